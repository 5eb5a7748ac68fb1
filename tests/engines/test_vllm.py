"""KvdConnector under a real vLLM (CPU) engine, SmolLM2-135M in fp32, against a real kvd shard server.

Every engine runs in a process of its own (vllm_engine.py) with vLLM's own prefix cache off, so a cached-token
count above zero can only come from kvd. The prompt shares a 3-block prefix (block size 128).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_helpers import KvdServer, missing_engines  # isort: skip  (tests/engines/engine_helpers.py)
import vllm_engine  # isort: skip  (tests/engines/vllm_engine.py)
from kvd.errors import KvdError

_reason = missing_engines("torch", "vllm", "transformers")
if _reason:
    pytest.skip(_reason, allow_module_level=True)

pytestmark = [pytest.mark.engines, pytest.mark.timeout(600)]

PREFIX = ("The history of the city begins with a small fishing village on the banks of a wide river. "
          "Merchants came by boat, built warehouses of stone, and the village grew into a market town. ") * 12
PROMPT = PREFIX + "Summarize the story in one sentence."
OTHER = PREFIX + "Which trade made the town rich?"
BLOCK = 128


class Engine:
    """One vLLM engine process (vllm_engine.run, from a forkserver with vLLM imported); :meth:`ask` sends a
    command and returns its reply."""

    def __init__(self, model: Path, endpoint: str | None, **options: Any) -> None:
        ctx = vllm_engine.context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=vllm_engine.run, args=({"model": str(model), "endpoint": endpoint,
                                                                **options}, child), daemon=True)
        self.proc.start()
        child.close()
        assert self.ask(None, timeout_s=300).get("ready"), "the engine did not start"

    def ask(self, cmd: dict[str, Any] | None, timeout_s: float = 300) -> dict[str, Any]:
        try:
            if cmd is not None:
                self.conn.send(cmd)
            if self.conn.poll(timeout_s):
                return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass
        self.proc.join(5)
        raise AssertionError(f"the engine ended ({self.proc.exitcode}) or did not answer {cmd} in {timeout_s} s")

    def generate(self, *texts: str, max_tokens: int = 24, logprobs: int | None = None) -> list[dict[str, Any]]:
        return self.ask({"generate": list(texts), "max_tokens": max_tokens, "logprobs": logprobs})["outputs"]

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.ask({"quit": True}, timeout_s=60)
            except AssertionError:
                pass
            self.proc.join(60)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
        self.conn.close()


@pytest.fixture(scope="module")
def server() -> Iterator[KvdServer]:
    srv = KvdServer(level="fp16")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def first(model_folder: Path, server: KvdServer) -> Iterator[dict[str, Any]]:
    """A first fp32 engine: PROMPT computed (a miss), its blocks stored, then PROMPT again and OTHER. It prefills
    in chunks (max_num_batched_tokens=128: a block per step, the prompt's blocks completed over several steps,
    scheduled_cached_reqs), so every test of it also checks that each step saves the blocks it completed; the
    other engines prefill a prompt in one step."""
    eng = Engine(model_folder, server.endpoint, llm={"max_num_batched_tokens": 128, "max_num_seqs": 4})
    try:
        miss = eng.generate(PROMPT)[0]
        assert eng.ask({"flush": 30})["flushed"]
        hit, other = eng.generate(PROMPT, OTHER)
        yield {"miss": miss, "hit": hit, "other": other, "namespace": eng.ask({"namespace": 1})["namespace"],
               "counters": eng.ask({"counters": 1})}
    finally:
        eng.close()


def test_second_request_loads_the_prefix_from_kvd_and_matches_recomputation(first: dict[str, Any]) -> None:
    full_blocks = (len(first["miss"]["prompt_ids"]) - 1) // BLOCK
    assert full_blocks >= 3
    assert first["miss"]["cached"] == 0
    assert first["hit"]["cached"] == full_blocks * BLOCK  # vLLM's own prefix cache is off: these came from kvd
    assert first["hit"]["token_ids"] == first["miss"]["token_ids"]  # level fp16, fp32 engine
    a, b = first["miss"]["prompt_ids"], first["other"]["prompt_ids"]
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared >= 3 * BLOCK
    assert first["other"]["cached"] == shared // BLOCK * BLOCK  # another question, the same prefix blocks
    c = first["counters"]
    assert c["saved_blocks"] >= full_blocks and c["loaded_blocks"] >= full_blocks + shared // BLOCK
    assert c["load_failed_blocks"] == 0 and c["save_failed_blocks"] == 0


def test_stored_blocks_are_the_models_own_keys_and_values(first: dict[str, Any], server: KvdServer,
                                                          model_folder: Path) -> None:
    """What kvd holds for block 0 is transformers' K/V for the same tokens (keys read the right way round)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvd.client import Client
    from kvd.integrations import prefix

    ids = first["miss"]["prompt_ids"]
    keys = prefix.block_keys(ids, BLOCK)
    key = keys[0]
    with Client(server.endpoint) as kv:
        k, v = kv.get(first["namespace"], key)  # [L, 128, H, D] float16
        # each block was stored at its position in the prompt: only the prompt's first block has a sink page
        assert "sink" in kv.explain(first["namespace"], keys[0], 0, 0)["reasons"]
        assert all("sink" not in kv.explain(first["namespace"], kb, 0, 0)["reasons"] for kb in keys[1:3])
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([ids[:BLOCK]]), use_cache=True).past_key_values
    for layer in (0, 15, 29):
        want_k = cache.layers[layer].keys[0].permute(1, 0, 2).numpy()  # [T, H, D]
        want_v = cache.layers[layer].values[0].permute(1, 0, 2).numpy()
        scale = max(1.0, float(abs(want_k).max()))
        assert abs(k[layer].astype("float32") - want_k).max() < 2e-2 * scale
        assert abs(v[layer].astype("float32") - want_v).max() < 2e-2 * max(1.0, float(abs(want_v).max()))


def test_a_fresh_engine_hits_what_the_first_stored_and_with_vllms_own_prefix_cache_kvd_supplies_what_it_lacks(
        first: dict[str, Any], model_folder: Path, server: KvdServer) -> None:
    """A new engine process (prompts prefilled in one step) loads what the first one stored, and with vLLM's own
    prefix cache on, kvd is asked only for what that cache lacks."""
    eng = Engine(model_folder, server.endpoint, prefix_caching=True)
    try:
        a = eng.generate(PROMPT)[0]  # a fresh process, vLLM's cache empty: the blocks come from kvd
        b = eng.generate(OTHER)[0]  # the shared blocks are now in vLLM's own cache
        c = eng.generate(PROMPT)[0]  # all of it in vLLM's own cache
        assert eng.ask({"flush": 30})["flushed"]
        counters = eng.ask({"counters": 1})
    finally:
        eng.close()
    assert a["cached"] == first["hit"]["cached"] and a["token_ids"] == first["miss"]["token_ids"]
    assert b["cached"] == first["other"]["cached"] and b["token_ids"] == first["other"]["token_ids"]
    assert c["token_ids"] == first["miss"]["token_ids"]
    assert counters["loaded_blocks"] == a["cached"] // BLOCK  # only the first request needed kvd
    # Blocks the engine had (from kvd or from its own cache) are not sent to kvd again: the first engine stored
    # PROMPT's and OTHER's shared blocks, so only OTHER's own full blocks (if any) were new.
    assert counters["save_existing_blocks"] == 0, counters


@pytest.mark.parametrize("options", [{"dtype": "bfloat16"}, {"extra": {"kvd_model_id": "another-model"}}],
                         ids=["other-dtype", "other-model"])
def test_another_dtype_or_model_gets_no_hit(first: dict[str, Any], model_folder: Path, server: KvdServer,
                                            options: dict[str, Any]) -> None:
    eng = Engine(model_folder, server.endpoint, **options)
    try:
        out = eng.generate(PROMPT)[0]
        namespace = eng.ask({"namespace": 1})["namespace"]
    finally:
        eng.close()
    assert namespace != first["namespace"]
    assert out["cached"] == 0


def test_blocks_spilled_to_disk_are_hit_and_a_kvd_stopped_mid_run_costs_only_recomputation(
        model_folder: Path, tmp_path: Path) -> None:
    """A store whose memory holds about one block of this model at fp16 spills the prompt's earlier blocks to its
    disk tier as it saves the later ones; the next request loads every block, those from disk included, with no
    change in the engine. Then kvd stops: the engine recomputes, answers the same, and gives its saves up."""
    srv = KvdServer(level="fp16", capacity_bytes=4 << 20, max_level="fp16", disk_path=str(tmp_path),
                    disk_bytes=256 << 20)
    eng = Engine(model_folder, srv.endpoint)
    try:
        miss = eng.generate(PROMPT)[0]
        assert eng.ask({"flush": 30})["flushed"]
        spilled = srv.stats()
        hit = eng.generate(PROMPT)[0]
        read = srv.stats()
        srv.stop()
        after = eng.generate(PROMPT, OTHER)
        assert eng.ask({"flush": 30})["flushed"]  # the saves it tried are given up, not stuck
        counters = eng.ask({"counters": 1})
    finally:
        eng.close()
        srv.stop()
    assert spilled["spills"] >= 2 and spilled["evictions"] == 0, spilled
    full_blocks = (len(miss["prompt_ids"]) - 1) // BLOCK
    assert hit["cached"] == full_blocks * BLOCK  # vLLM's own prefix cache is off: every block came from kvd
    assert hit["token_ids"] == miss["token_ids"]  # fp16 blocks, read back from disk bit-exact
    assert read["disk_hits"] >= 2 and read["disk_reads"] >= 2, read
    assert after[0]["cached"] == 0 and after[0]["token_ids"] == miss["token_ids"]
    assert after[1]["cached"] == 0 and len(after[1]["token_ids"]) == 24
    # A dead kvd costs one timeout, then the link is down and the other saves fail at once: fewer calls waited
    # for the timeout than saves were given up (a link that waited on every save would make them equal).
    given_up = counters["save_failed_blocks"] + counters["save_dropped_blocks"]
    assert given_up >= 2 and 1 <= counters["link_failures"] < given_up, counters


@pytest.fixture(scope="module")
def sync_engine(model_folder: Path) -> Iterator[tuple[KvdServer, Engine]]:
    """An engine whose saves are synchronous (kvd_async_saves=false), and its own kvd server."""
    srv = KvdServer(level="fp16")
    eng = Engine(model_folder, srv.endpoint, extra={"kvd_async_saves": False})
    try:
        yield srv, eng
    finally:
        eng.close()
        srv.stop()


def forget_prompt(srv: KvdServer, eng: Engine) -> list[str]:
    """Drop PROMPT's blocks from kvd (a test on a shared engine starts from a miss); returns their keys."""
    from kvd.client import Client
    from kvd.integrations import prefix

    ids = eng.ask({"tokenize": PROMPT})["ids"]
    keys = prefix.block_keys(ids, BLOCK)
    with Client(srv.endpoint) as kv:
        namespace = eng.ask({"namespace": 1})["namespace"]
        for key in keys:
            try:
                kv.drop(namespace, key)
            except KvdError:  # nothing stored yet: not even the namespace
                pass
    return keys


def test_synchronous_saves_are_in_kvd_when_the_step_ends(sync_engine: tuple[KvdServer, Engine]) -> None:
    """kvd_async_saves=false: no flush needed, the very next request hits."""
    srv, eng = sync_engine
    srv.set_level("fp16")
    forget_prompt(srv, eng)
    miss = eng.generate(PROMPT)[0]
    hit = eng.generate(PROMPT)[0]
    assert miss["cached"] == 0 and hit["cached"] == (len(hit["prompt_ids"]) - 1) // BLOCK * BLOCK
    assert hit["token_ids"] == miss["token_ids"]


# The level's measured error (BENCHMARKS.md, "Quality a user sees": the largest next-token KL over 1,280 scored
# positions of 5 real texts). A load that mixed up layers, heads or tokens would be orders of magnitude off.
LEVEL_KL = {"q8": 5e-3, "q4": 1e-1}


@pytest.mark.parametrize("level", sorted(LEVEL_KL))
def test_blocks_stored_compressed_load_within_the_levels_error(sync_engine: tuple[KvdServer, Engine],
                                                               level: str) -> None:
    """kvd at q8 or q4: the engine loads the blocks it stored at that level, and its next-token distribution
    stays within the level's error of the one it computed (vLLM's top 20 tokens, KL over those both list)."""
    from kvd.client import Client
    from kvd.integrations import prefix

    srv, eng = sync_engine
    srv.set_level(level)
    keys = forget_prompt(srv, eng)
    computed = eng.generate(PROMPT, max_tokens=1, logprobs=20)[0]  # a miss: computed, stored at the level
    loaded = eng.generate(PROMPT, max_tokens=1, logprobs=20)[0]
    assert keys == prefix.block_keys(computed["prompt_ids"], BLOCK)
    assert computed["cached"] == 0 and loaded["cached"] == (len(loaded["prompt_ids"]) - 1) // BLOCK * BLOCK
    with Client(srv.endpoint) as kv:
        assert kv.explain(eng.ask({"namespace": 1})["namespace"], keys[1], 0, 0)["level"] == level
    want, got = computed["first_logprobs"], loaded["first_logprobs"]
    both = [t for t in want if t in got]
    assert len(both) >= 10, (want, got)
    lw = np.array([want[t] for t in both])
    lg = np.array([got[t] for t in both])
    lw, lg = lw - np.logaddexp.reduce(lw), lg - np.logaddexp.reduce(lg)  # both renormalised over those tokens
    kl = float(np.sum(np.exp(lw) * (lw - lg)))
    assert 0 <= kl <= LEVEL_KL[level], kl
