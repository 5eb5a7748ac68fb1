"""The engine glue without an engine: import hygiene, prefix keys, the KV-layout block copies, the link.

The first two groups need neither torch nor an engine and run in the main venv too; the layout tests need
torch only (no vLLM process, no model).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_helpers import KvdServer, missing_engines  # isort: skip  (tests/engines/engine_helpers.py)
from kvd.integrations import prefix

pytestmark = pytest.mark.engines


def test_import_kvd_never_imports_an_engine() -> None:
    code = ("import sys, kvd, kvd.integrations, kvd.integrations.prefix, kvd.integrations.link, "
            "kvd.integrations.model, kvd.client\n"
            "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_block_keys_chain_over_the_whole_prefix() -> None:
    a = list(range(300))
    b = a[:128] + [7] + a[129:]  # differs in block 1 only
    ka, kb = prefix.block_keys(a, 128), prefix.block_keys(b, 128)
    assert len(ka) == 2  # the partial third block has no key
    assert ka[0] == kb[0] and ka[1] != kb[1]
    assert prefix.block_keys(a, 128, max_blocks=1) == ka[:1]
    assert prefix.block_keys(a[:128] + a[200:], 128)[0] == ka[0]
    # a per-request salt or LoRA changes every key; the same ones give the same keys
    salted = prefix.block_keys(a, 128, prefix.chain_seed("salt"))
    assert salted[0] != ka[0] and salted == prefix.block_keys(a, 128, prefix.chain_seed("salt"))
    assert prefix.block_keys(a, 128, prefix.chain_seed(lora="x:1"))[0] not in (ka[0], salted[0])
    # a block's key depends on where it is: the same 128 tokens after another block are another key
    assert prefix.block_keys(a[128:256] + a[:128], 128)[1] != ka[0]


def test_namespace_covers_model_dtype_layout_and_block_size() -> None:
    base = {"dtype": "torch.float32", "layout": "CPU_ATTN/vec", "block_size": 128, "shape": [30, 3, 64]}
    ns = prefix.namespace_for("vllm", "/models/smollm2", **base)
    assert ns.startswith("kvd/vllm/smollm2/") and len(ns.encode()) <= 256
    assert ns == prefix.namespace_for("vllm", "/models/smollm2", **base)
    for change in ({"dtype": "torch.bfloat16"}, {"layout": "CPU_ATTN/amx"}, {"block_size": 64},
                   {"shape": [30, 3, 128]}):
        assert prefix.namespace_for("vllm", "/models/smollm2", **{**base, **change}) != ns
    assert prefix.namespace_for("vllm", "/other/smollm2", **base) != ns
    assert prefix.namespace_for("transformers", "/models/smollm2", **base) != ns


def test_stored_prefix_stops_at_the_first_missing_or_short_block_in_one_lookup() -> None:
    from kvd.errors import UnknownNamespace

    stored = {"a": 128, "b": 128, "c": 100, "d": 128}
    calls: list[list[str]] = []

    def lengths(keys: list[str]) -> list[int | None]:
        calls.append(keys)
        return [stored.get(k) for k in keys]

    assert prefix.stored_prefix(lengths, ["a", "b", "c", "d"], 128) == 2
    assert prefix.stored_prefix(lengths, ["a", "x", "d"], 128) == 1
    assert prefix.stored_prefix(lengths, [], 128) == 0
    assert calls == [["a", "b", "c", "d"], ["a", "x", "d"]]  # one lookup per prompt, none for no blocks

    def unknown(keys: list[str]) -> list[int | None]:
        raise UnknownNamespace("nothing stored yet")

    assert prefix.stored_prefix(unknown, ["a"], 128) == 0


def test_a_dead_kvd_costs_one_timeout_then_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call after kvd died waits for its timeout; while the link is down the next ones fail at once:
    they neither call kvd nor open a connection (what made them fast; their speed is bench's business)."""
    from kvd.errors import ShardUnavailable, Timeout
    from kvd.integrations import link as link_mod
    from kvd.integrations.link import KvdDown, KvdLink

    srv = KvdServer()
    endpoint = srv.endpoint
    link = KvdLink(endpoint, "ns", (2, 1, 8), timeout_s=0.5, retry_after_s=30)
    assert link.call(lambda c: c.ping())
    srv.stop()
    with pytest.raises(KvdDown) as first:
        link.call(lambda c: c.length("ns", "x"))
    # the call was made and ran into its bound: no reply (Timeout) or no connection (ShardUnavailable)
    assert isinstance(first.value.__cause__, (Timeout, ShardUnavailable)), first.value.__cause__
    assert link.failures == 1 and link.down

    calls: list[str] = []
    clients: list[str] = []
    monkeypatch.setattr(link_mod, "Client", lambda *a, **k: clients.append("connect"))
    for _ in range(100):
        with pytest.raises(KvdDown, match="marked down"):
            link.call(lambda c: calls.append("call"))
    assert calls == [] and clients == [] and link.failures == 1 and link.down


# ---- vLLM CPU layout: needs torch only -------------------------------------------------------------------


@pytest.fixture
def torch_mod():  # noqa: ANN201
    reason = missing_engines("torch")
    if reason:
        pytest.skip(reason)
    import torch

    return torch


def test_block_io_reads_keys_transposed_and_round_trips(torch_mod) -> None:  # noqa: ANN001
    torch = torch_mod
    from kvd.integrations.vllm_layout import BlockIO

    layers, nb, h, d, bs = 3, 5, 2, 4, 8
    caches = [torch.randn(nb, h, bs, 2 * d) for _ in range(layers)]
    io = BlockIO(caches, h, d, bs)
    k, v = io.read([3, 1])
    assert k.shape == (2, layers, bs, h, d) and str(k.dtype) == "float16"
    # the layout, spelled out: per (block, head) keys [D, bs] then values [bs, D]
    row = caches[2][1, 1].reshape(-1)
    assert torch.allclose(torch.from_numpy(k[1, 2, :, 1, :]).float(), row[: bs * d].reshape(d, bs).T, atol=1e-2)
    assert torch.allclose(torch.from_numpy(v[1, 2, :, 1, :]).float(), row[bs * d:].reshape(bs, d), atol=1e-2)
    fresh = [torch.zeros_like(c) for c in caches]
    BlockIO(fresh, h, d, bs).write([3, 1], torch.from_numpy(k), torch.from_numpy(v))
    for c, f in zip(caches, fresh, strict=True):
        assert torch.allclose(c[[3, 1]], f[[3, 1]], atol=1e-2) and not f[[0, 2, 4]].any()
    # a list of per-block arrays (what the connector passes: the client's replies, unstacked); same bytes
    k2, v2 = io.read([1, 2])
    direct = [torch.zeros_like(c) for c in caches]
    BlockIO(direct, h, d, bs).write([1, 2], list(k2), list(v2))
    for c, f in zip(caches, direct, strict=True):
        assert torch.allclose(c[[1, 2]], f[[1, 2]], atol=1e-2) and not f[[0, 3, 4]].any()


def test_unverified_layouts_are_refused_with_a_clear_error(torch_mod) -> None:  # noqa: ANN001
    torch = torch_mod
    from kvd.integrations.vllm_layout import BlockIO, UnverifiedLayout, check_layout

    assert "keys-transposed" in check_layout("CPU_ATTN", "vec", torch.float32, "auto")
    for backend, isa, dtype, kv_dtype in (("CPU_ATTN", "amx", torch.bfloat16, "auto"),
                                          ("CPU_ATTN", "vec16", torch.float32, "auto"),
                                          ("FLASH_ATTN", "vec", torch.float32, "auto"),
                                          ("CPU_ATTN", "vec", torch.float16, "auto"),
                                          ("CPU_ATTN", "vec", torch.float32, "fp8")):
        with pytest.raises(UnverifiedLayout, match="verified|quantized"):
            check_layout(backend, isa, dtype, kv_dtype)
    with pytest.raises(UnverifiedLayout, match="contiguous"):
        BlockIO([torch.zeros(4, 2, 8, 8).transpose(1, 2)], 2, 4, 8)


def test_connector_load_reports_failed_blocks_and_never_raises(torch_mod) -> None:  # noqa: ANN001
    """KvdConnector._load against a real kvd: blocks after the first missing one are reported for vLLM to
    recompute, and a dead kvd fails every block without raising. Needs vLLM importable (the module imports it);
    the connector is built without an engine, only with what _load uses."""
    reason = missing_engines("vllm")
    if reason:
        pytest.skip(reason)
    import numpy as np

    torch = torch_mod
    from kvd.integrations.link import KvdLink
    from kvd.integrations.vllm import KvdConnector, _Settings
    from kvd.integrations.vllm_layout import BlockIO

    layers, h, d, bs = 2, 2, 32, 32
    srv = KvdServer()
    link = KvdLink(srv.endpoint, "ns", (layers, h, d), timeout_s=0.5, retry_after_s=30)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((layers, bs, h, d), dtype=np.float32).astype(np.float16)
    link.call(lambda c: c.append("ns", "b0", k, -k))
    link.call(lambda c: c.append("ns", "short", k[:, :5], k[:, :5]))

    conn = object.__new__(KvdConnector)
    caches = [torch.zeros(10, h, bs, 2 * d) for _ in range(layers)]
    conn._io, conn._link, conn.namespace, conn._bs = BlockIO(caches, h, d, bs), link, "ns", bs
    conn._cfg = _Settings(endpoint=srv.endpoint, timeout_s=0.5, retry_after_s=30, fmt="pages", async_saves=False,
                          save_buffer_bytes=1 << 20, model_id="m", parents=True)
    conn.counters = {"loaded_blocks": 0, "load_failed_blocks": 0, "load_fetch_us": 0, "load_write_us": 0}
    conn._load_errors = set()
    try:
        conn._load([(5, "b0"), (7, "missing"), (9, "b0")])
        assert conn.get_block_ids_with_load_errors() == {7, 9}
        back_k, back_v = BlockIO(caches, h, d, bs).read([5])
        assert np.array_equal(back_k[0], k) and np.array_equal(back_v[0], -k)
        conn._load([(3, "short")])
        assert conn.get_block_ids_with_load_errors() == {3}
        srv.stop()
        conn._load([(1, "b0"), (2, "b0")])
        assert conn.get_block_ids_with_load_errors() == {1, 2}
        assert conn.counters["loaded_blocks"] == 1 and conn.counters["load_failed_blocks"] == 5
    finally:
        srv.stop()
        link.close()


def test_connector_keys_cover_salt_and_lora_and_skip_multimodal_prompts(torch_mod) -> None:  # noqa: ANN001
    """The scheduler side's keys for a request: salted and LoRA requests get other keys; a request whose KV
    depends on more than its token ids (multimodal features, prompt embeddings) gets none."""
    if missing_engines("vllm"):
        pytest.skip(missing_engines("vllm"))
    from types import SimpleNamespace

    from kvd.integrations.vllm import KvdConnector

    conn = object.__new__(KvdConnector)
    conn._bs, conn._reqs = 32, {}

    def keys(rid: str, **fields: object) -> list[str]:
        base = {"request_id": rid, "prompt_token_ids": list(range(100)), "cache_salt": None, "lora_request": None,
                "mm_features": None, "prompt_embeds": None}
        return conn._state(SimpleNamespace(**{**base, **fields})).keys

    plain = keys("a")
    assert len(plain) == 3 and plain == prefix.block_keys(list(range(100)), 32)
    assert keys("b", cache_salt="tenant-1")[0] != plain[0]
    assert keys("c", lora_request=SimpleNamespace(lora_name="x", lora_int_id=1))[0] != plain[0]
    assert keys("d", mm_features=[object()]) == [] and keys("e", prompt_embeds=torch_mod.zeros(1)) == []
