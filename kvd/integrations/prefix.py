"""Content-addressed prefix keys, shared by the engine integrations: which kvd sequence holds which prompt block.

A prompt's KV is stored one full block of ``block_tokens`` tokens per kvd sequence. Block i's sequence id is a
*chained* hash: it covers the token ids of blocks 0..i (and a per-request salt), so a block is found only by a
prompt whose whole prefix up to and including it is the same. The KV of a token depends on every token before
it; a key over the block's own tokens alone would hand one prompt another prompt's KV.

Everything else that changes the KV bytes goes into the *namespace*: model, engine dtype, KV layout, block size,
layer/head shape. Two engines that differ in any of these never share a namespace, so they never get a false hit
(a bf16 engine's blocks are invisible to an fp32 engine, unlike a store whose keys ignore the dtype). What is
per request (cache salt, LoRA adapter) goes into the chain's seed instead, so it needs no namespace of its own.

No torch here: this module is plain Python and is also what the tests use to compute expected keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from kvd.errors import InvalidArgument, KvdError, UnknownNamespace

DIGEST_BYTES = 16  # 128-bit keys: a false hit by collision is out of reach at any realistic number of blocks
KEY_VERSION = 1  # bump when the key derivation changes, so old stored blocks are simply never found


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two part lists hash alike by concatenation
        h.update(part)
    return h.digest()


def namespace_for(engine: str, model: str, **facts: Any) -> str:
    """A kvd namespace for one engine configuration: ``kvd/<engine>/<model's last path part>/<digest>``, the
    digest over ``model`` (in full) and every fact (dtype, layout, block size, shape...). Readable in
    ``kvd status``, within the protocol's 256-byte namespace limit."""
    if not engine or not model:
        raise InvalidArgument("engine and model must be non-empty")
    blob = json.dumps({"v": KEY_VERSION, "engine": engine, "model": model, **facts}, sort_keys=True, default=str)
    short = model.rstrip("/").rsplit("/", 1)[-1][:80] or "model"
    return f"kvd/{engine}/{short}/{_digest(blob.encode()).hex()}"


def chain_seed(salt: str | None = None, lora: str | None = None) -> bytes:
    """The chain's starting value for a request: covers its cache salt and LoRA adapter (None for neither)."""
    return _digest(b"kvd-prefix", str(KEY_VERSION).encode(), (salt or "").encode(), (lora or "").encode())


def block_keys(token_ids: Sequence[int], block_tokens: int, seed: bytes | None = None,
               max_blocks: int | None = None) -> list[str]:
    """The sequence ids of the full blocks of ``token_ids`` (a partial last block has none), at most
    ``max_blocks``. Key i covers tokens ``[0, (i + 1) * block_tokens)`` and ``seed``."""
    if block_tokens < 1:
        raise InvalidArgument(f"block_tokens must be >= 1, got {block_tokens}")
    n = len(token_ids) // block_tokens
    if max_blocks is not None:
        n = min(n, max(0, max_blocks))
    prev = seed if seed is not None else chain_seed()
    keys = []
    for i in range(n):
        block = token_ids[i * block_tokens:(i + 1) * block_tokens]
        prev = _digest(prev, b"".join(int(t).to_bytes(4, "little", signed=False) for t in block))
        keys.append(prev.hex())
    return keys


def stored_prefix(lengths: Callable[[list[str]], list[int | None]], keys: Sequence[str], block_tokens: int) -> int:
    """How many leading blocks of ``keys`` are stored whole, from one ``lengths(keys)`` call (a kvd client's
    :meth:`~kvd.client.Client.lengths` with the namespace bound: one round trip per shard, whatever the prefix
    length). A block that is missing or shorter than ``block_tokens`` (a save cut short) ends the prefix. A
    namespace kvd does not know (nothing stored yet, or a restarted kvd) is no prefix; other kvd errors
    propagate: the caller decides whether a kvd that does not answer means "no hit"."""
    if not keys:
        return 0
    try:
        found = lengths(list(keys))
    except UnknownNamespace:
        return 0
    hits = 0
    for n in found:
        if n != block_tokens:
            break
        hits += 1
    return hits


__all__ = ["DIGEST_BYTES", "KvdError", "block_keys", "chain_seed", "namespace_for", "stored_prefix"]
