"""``KvdCache``: a transformers ``Cache`` whose sequences can be stored in kvd and loaded back into a later
``generate()`` call, instead of recomputing them.

The working KV stays local, exactly as in ``DynamicCache`` (it *is* a DynamicCache: generation, masks and
cropping are transformers' own), so a KvdCache that loaded nothing generates what a DynamicCache does. kvd
comes in only at the edges of a call:

- :meth:`KvdCache.save` appends the cached tokens to a kvd sequence of your naming (only the tokens not yet
  saved), and :meth:`KvdCache.resume` loads one back: continue a conversation in another process or later.
- :meth:`KvdCache.save_prefix` stores the cached prompt as full blocks under chained hashes of its token ids
  (:mod:`kvd.integrations.prefix`), and :meth:`KvdCache.for_prompt` loads the longest stored block prefix of
  a new prompt: a shared system prompt is computed once, by anyone.

::

    cache = KvdCache(client, model.config)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    cache.save("chat-7")                                   # prompt + generated tokens (all but the last)
    ...
    cache = KvdCache.resume(client, model.config, "chat-7")
    more = model.generate(torch.cat([out, next_ids], -1), past_key_values=cache, max_new_tokens=32)

**Attending in kvd** (``attend=True`` on :meth:`KvdCache.resume`): the stored sequence is not loaded. The cache
holds only the tokens that come after it, and reports the stored ones in its length (positions and RoPE are
the model's own). A model loaded with ``attn_implementation=ATTENTION`` (``"kvd"``, registered in transformers'
``AttentionInterface`` when this module is imported) sends each layer's queries (post-RoPE, as the stored keys
are) to kvd with :meth:`kvd.client.Client.attend` over the stored tokens, attends over the local tokens itself
(causal), and merges the two parts by their log-sum-exp: exact, as if all tokens were local. The context never
leaves kvd; each generated token costs one ``attend`` round trip per layer (the queries out, the output back)::

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=ATTENTION)
    cache = KvdCache.resume(client, model.config, "chat-7", attend=True)
    more = model.generate(torch.cat([out, next_ids], -1), past_key_values=cache, max_new_tokens=32)

**Calibration**: :func:`capture_sample` (from :mod:`kvd.integrations.capture`) records a model's queries, keys
and values on a few texts, the sample :func:`kvd.calibration.calibrate` measures (``kvd calibrate``).

With any other cache, ``"kvd"`` attention is plain causal attention over the local tokens. Batch size 1 (no
padding masks); no soft-capping.

kvd keeps KV at float16 or coarser (its precision level); loads are decoded into the cache's dtype (the
model's). The namespace covers the model, dtype, shape and block size, so caches of different models never
mix. Batch size 1 only for saving and loading (one sequence per cache); sliding-window models are refused.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache

from kvd.client import Client
from kvd.errors import Conflict, InvalidArgument, UnknownNamespace, UnknownSequence
from kvd.integrations import prefix
from kvd.integrations.capture import capture_sample

DEFAULT_BLOCK_TOKENS = 64  # one kvd page at the default page size
ATTENTION = "kvd"  # the attn_implementation that attends over a cache's stored tokens in kvd

# The cache and layer whose update() ran last on this thread, with the keys it returned: the attention call that
# follows in the same layer (transformers does not pass the cache to attention functions) finds its cache here.
_last_update = threading.local()


def _layout(config: Any) -> tuple[int, int, int]:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = int(cfg.num_hidden_layers)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return layers, heads, dim


def _dtype(config: Any, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, d) if isinstance(d, str) else d


class KvdCache(DynamicCache):
    """A DynamicCache that can store its sequence in kvd and be filled from kvd. ``client``: a
    :class:`kvd.client.Client`; ``config``: the model's config (layout and dtype); ``model_id``: what names
    the model in kvd (default ``config.name_or_path``); ``dtype``: the model's dtype if the config does not say;
    ``block_tokens``: block size of the prefix keys; ``format``: how loads travel (``"pages"`` or ``"fp16"``)."""

    def __init__(self, client: Client, config: Any, *, model_id: str | None = None,
                 dtype: torch.dtype | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 format: str = "pages") -> None:  # noqa: A002 - kvd's name for it
        super().__init__(config=config)
        if any(getattr(layer, "is_sliding", False) for layer in self.layers):
            raise InvalidArgument("KvdCache does not support sliding-window layers (their KV is not the prefix's)")
        self.client, self.config = client, config
        self.layout = _layout(config)
        self.dtype = _dtype(config, dtype)
        self.block_tokens = int(block_tokens)
        self.format = format
        named = getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
        self.model_id = model_id or str(named)
        if not self.model_id:
            raise InvalidArgument("model_id is required when the config does not name the model")
        self.namespace = prefix.namespace_for("transformers", self.model_id, dtype=str(self.dtype),
                                              shape=list(self.layout), block_tokens=self.block_tokens)
        layers, heads, dim = self.layout
        client.register(self.namespace, num_layers=layers, num_kv_heads=heads, head_dim=dim)
        self.loaded_tokens = 0  # how many tokens the last resume/for_prompt brought in
        self.stored_seq: str | int | None = None  # attend=True: the kvd sequence the model attends over there
        self.stored_tokens = 0  # ... and its tokens, positions 0 .. stored_tokens - 1 (not held here)
        self._saved: dict[str, int] = {}  # seq_id -> tokens of this cache already in it

    # -------------------------------------------------------------------------------- the stored tokens' length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx) + self.stored_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
        return kv_length + self.stored_tokens, kv_offset

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.stored_tokens:
            impl = getattr(self.config, "_attn_implementation", None)
            if impl != ATTENTION:
                raise InvalidArgument(f"this cache attends over {self.stored_tokens} tokens in kvd: load the "
                                      f"model with attn_implementation={ATTENTION!r} (it has {impl!r})")
            _last_update.cache, _last_update.layer, _last_update.keys = self, layer_idx, keys
        return keys, values

    # ------------------------------------------------------------------------------------------ local <-> kvd

    def _arrays(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Cached tokens [start, end) as float16 ``[L, T, H, D]`` (what kvd appends)."""
        if super().get_seq_length() and self.layers[0].keys.shape[0] != 1:
            raise InvalidArgument(f"KvdCache saves one sequence: batch size is {self.layers[0].keys.shape[0]}")
        if start < self.stored_tokens:
            raise InvalidArgument(f"tokens before {self.stored_tokens} are in kvd only (sequence "
                                  f"{self.stored_seq!r}), not in this cache")
        start, end = start - self.stored_tokens, end - self.stored_tokens
        keys = torch.stack([layer.keys[0, :, start:end] for layer in self.layers])  # [L, H, T, D]
        values = torch.stack([layer.values[0, :, start:end] for layer in self.layers])
        return (keys.transpose(1, 2).to(torch.float16).contiguous().numpy(),
                values.transpose(1, 2).to(torch.float16).contiguous().numpy())

    def _fill(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Append ``[L, T, H, D]`` arrays (any float dtype) to the local cache, in the cache's dtype."""
        if keys.shape[0] != len(self.layers):
            raise InvalidArgument(f"{keys.shape[0]} layers from kvd for a {len(self.layers)}-layer model")
        for i in range(keys.shape[0]):
            k = torch.from_numpy(np.ascontiguousarray(keys[i])).transpose(0, 1).unsqueeze(0).to(self.dtype)
            v = torch.from_numpy(np.ascontiguousarray(values[i])).transpose(0, 1).unsqueeze(0).to(self.dtype)
            self.update(k, v, i)
        self.loaded_tokens += keys.shape[1]

    def save(self, seq_id: str | int) -> int:
        """Append the cached tokens not yet saved under ``seq_id`` (all of them the first time); returns the
        sequence's length in kvd. The append is conditional on kvd holding exactly what this cache saved
        before (``offset``), so two writers never interleave silently (:class:`~kvd.errors.Conflict`)."""
        done, n = self._saved.get(seq_id, 0), self.get_seq_length()
        if n <= done:
            return done
        k, v = self._arrays(done, n)
        length = self.client.append(self.namespace, seq_id, k, v, offset=done)
        self._saved[seq_id] = length
        return length

    def save_prefix(self, token_ids: Sequence[int] | torch.Tensor) -> int:
        """Store the cached tokens as full blocks under the chained keys of ``token_ids`` (the ids the cache
        holds KV for, e.g. the prompt); blocks already in kvd are skipped. Returns the number of blocks that
        are in kvd afterwards."""
        ids = _ids(token_ids)[: self.get_seq_length()]
        keys = prefix.block_keys(ids, self.block_tokens)
        have = prefix.stored_prefix(lambda ks: self.client.lengths(self.namespace, ks), keys, self.block_tokens)
        for i in range(have, len(keys)):
            k, v = self._arrays(i * self.block_tokens, (i + 1) * self.block_tokens)
            try:
                # position: only the prompt's first block holds the sinks kvd keeps at fp16 (protocol 1.3)
                self.client.append(self.namespace, keys[i], k, v, offset=0, position=i * self.block_tokens)
            except Conflict:
                pass  # stored meanwhile by someone else: the same KV
        return len(keys)

    @classmethod
    def resume(cls, client: Client, config: Any, seq_id: str | int, *, attend: bool = False,
               **options: Any) -> KvdCache:
        """A new cache holding the kvd sequence ``seq_id`` (raises :class:`~kvd.errors.UnknownSequence` if
        kvd does not have it). Generate from the ids it was saved with, plus anything new. ``attend``: do not
        load it; the model (``attn_implementation=ATTENTION``) attends over it in kvd, and :meth:`save` under
        ``seq_id`` appends the tokens generated after it."""
        cache = cls(client, config, **options)
        if attend:
            (n,) = client.lengths(cache.namespace, [seq_id])
            if not n:
                raise UnknownSequence(f"kvd holds no sequence {seq_id!r} in namespace {cache.namespace!r}")
            cache.stored_seq, cache.stored_tokens = seq_id, n
            cache._saved[seq_id] = n
            return cache
        keys, values = client.get(cache.namespace, seq_id, format=cache.format)
        cache._fill(keys, values)
        cache._saved[seq_id] = keys.shape[1]
        return cache

    @classmethod
    def for_prompt(cls, client: Client, config: Any, token_ids: Sequence[int] | torch.Tensor,
                   **options: Any) -> KvdCache:
        """A new cache holding the longest prefix of ``token_ids`` stored by :meth:`save_prefix` (whole
        blocks, leaving at least one token for the model to compute); empty if there is none."""
        cache = cls(client, config, **options)
        ids = _ids(token_ids)
        keys = prefix.block_keys(ids, cache.block_tokens, max_blocks=(len(ids) - 1) // cache.block_tokens)
        ns = cache.namespace
        hits = prefix.stored_prefix(lambda ks: client.lengths(ns, ks), keys, cache.block_tokens)
        if hits:
            try:
                got = client.get_many([(ns, key) for key in keys[:hits]], format=cache.format)
            except (UnknownSequence, UnknownNamespace):  # evicted between the lookup and the get
                return cls(client, config, **options)
            cache._fill(np.concatenate([k for k, _ in got], axis=1), np.concatenate([v for _, v in got], axis=1))
        return cache


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function ``ATTENTION``: causal attention of ``query`` ``[B, H_q, T, D]`` over the
    local ``key``/``value`` ``[B, H, L, D]`` (the last ``T`` of the ``L`` are the queries' own tokens), merged
    with kvd's attention over the cache's stored tokens when the cache attends in kvd. Returns ``([B, T, H_q,
    D], None)`` as transformers expects."""
    if kwargs.get("softcap") is not None:
        raise InvalidArgument(f"{ATTENTION!r} attention does not soft-cap scores")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    cache = getattr(_last_update, "cache", None)
    if cache is None or _last_update.keys is not key or _last_update.layer != getattr(module, "layer_idx", None):
        return _local(query, key, value, scale, need_lse=False)[0].transpose(1, 2), None
    if query.shape[0] != 1:
        raise InvalidArgument(f"attending in kvd takes one sequence, got a batch of {query.shape[0]}")
    _last_update.cache = _last_update.keys = None  # consumed: one attention call per update
    n = cache.stored_tokens
    t, local = query.shape[2], key.shape[2]
    q = query[0].transpose(0, 1).to(torch.float32).contiguous().numpy()  # [T, H_q, D]
    positions = np.arange(n + local - t, n + local, dtype=np.int64)  # every query sees every stored token
    r_out, r_lse = cache.client.attend(cache.namespace, cache.stored_seq, module.layer_idx, q, start=0, end=n,
                                       scale=scale, positions=positions)
    out, lse = _local(query, key, value, scale, need_lse=True)  # [1, H_q, T, D], [1, H_q, T]
    r_out = torch.from_numpy(r_out).transpose(0, 1).unsqueeze(0)  # [1, H_q, T, D]
    r_lse = torch.from_numpy(r_lse).transpose(0, 1).unsqueeze(0)  # [1, H_q, T]
    top = torch.maximum(lse, r_lse)
    w_local, w_kvd = torch.exp(lse - top), torch.exp(r_lse - top)
    merged = (w_local[..., None] * out + w_kvd[..., None] * r_out) / (w_local + w_kvd)[..., None]
    return merged.to(query.dtype).transpose(1, 2).contiguous(), None


def _local(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
           need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal grouped-query attention of the last ``T`` tokens over all ``L`` local ones: ``(out [B, H_q, T,
    D], lse [B, H_q, T] float32 or None)``."""
    t, length = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    if not need_lse:
        mask = None
        if 1 < t < length:
            mask = torch.ones(t, length, dtype=torch.bool, device=query.device).tril(length - t)
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=(t > 1 and t == length), scale=scale,
            enable_gqa=groups > 1), None
    k = key.repeat_interleave(groups, dim=1).to(torch.float32)
    v = value.repeat_interleave(groups, dim=1).to(torch.float32)
    s = torch.matmul(query.to(torch.float32), k.transpose(2, 3)) * scale  # [B, H_q, T, L]
    if t > 1:
        hidden = torch.ones(t, length, dtype=torch.bool, device=query.device).triu(length - t + 1)
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


AttentionInterface.register(ATTENTION, attention)


def _ids(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2:
            if token_ids.shape[0] != 1:
                raise InvalidArgument(f"one sequence expected, got a batch of {token_ids.shape[0]}")
            token_ids = token_ids[0]
        return [int(t) for t in token_ids.tolist()]
    return [int(t) for t in token_ids]


__all__ = ["ATTENTION", "KvdCache", "attention", "capture_sample"]
