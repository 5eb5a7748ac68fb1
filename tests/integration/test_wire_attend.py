"""``attend`` over real sockets (issue 34): a ShardServer in another process computes attention over its pages
for the sync and asyncio clients; bad input gets clear errors and the shard keeps serving; a large range runs on
the bulk lane.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from kvd import attention
from kvd.client import AsyncClient, Client
from kvd.errors import InvalidArgument, LayoutMismatch, NonFiniteError, ProtocolError, UnknownSequence
from kvd.store import Store
from kvd.wire import protocol as p

from test_wire import ServerProcess, kv  # isort: skip  (tests/integration/test_wire.py)

pytestmark = pytest.mark.integration

NS = "att"
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}


@pytest.fixture(scope="module")
def q8_shard() -> Iterator[ServerProcess]:
    server = ServerProcess("shard-att", level="q8")
    yield server
    server.stop()


def local_twin(k: np.ndarray, v: np.ndarray) -> Store:
    """A store like the shard's (defaults, level q8) holding the same tokens: the same pages, the same result."""
    store = Store(256 << 20)
    store.set_level("q8", 1)
    store.register(NS, **LAYOUT)
    store.append(NS, "s", k, v)
    return store


@pytest.mark.timeout(60)
def test_attend_round_trips_and_merges(q8_shard: ServerProcess) -> None:
    k, v = kv(tokens=150)
    twin = local_twin(k, v)
    q = np.random.default_rng(1).standard_normal((2, 4, 16)).astype(np.float16)
    with Client(q8_shard.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        c.append(NS, "s", k, v)
        out, lse = c.attend(NS, "s", 1, q)
        want = twin.attend(NS, "s", 1, q)
        assert out.dtype == np.float32 and out.shape == (2, 4, 16) and lse.shape == (2, 4)
        assert np.array_equal(out, want[0]) and np.array_equal(lse, want[1])
        parts = [c.attend(NS, "s", 1, q, start=a, end=b, positions=[120, 149], scale=0.3)
                 for a, b in ((0, 64), (64, 100), (100, 150))]
        whole = c.attend(NS, "s", 1, q, positions=[120, 149], scale=0.3)
        merged = attention.merge(parts)
        # the part (64, 100) cuts a q8 page, which it reads decoded (float16 values); the whole range reads that
        # page with the fused tile (float32 code * scale): they differ by float16 rounding, within 1e-3
        assert np.linalg.norm(merged[0] - whole[0]) / np.linalg.norm(whole[0]) < 1e-3
        assert np.abs(merged[1] - whole[1]).max() < 1e-3
    async def run() -> tuple[np.ndarray, np.ndarray]:
        async with AsyncClient(q8_shard.endpoint, timeout_s=10) as ac:
            return await ac.attend(NS, "s", 1, q)

    got = asyncio.run(run())
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.timeout(60)
def test_bad_input_gets_clear_errors_and_the_shard_keeps_serving(q8_shard: ServerProcess) -> None:
    k, v = kv(tokens=40)
    q = np.zeros((1, 4, 16), np.float32)
    with Client(q8_shard.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        c.append(NS, "bad", k, v)
        with pytest.raises(LayoutMismatch, match="multiple of its 2 KV heads"):
            c.attend(NS, "bad", 0, np.zeros((1, 3, 16), np.float32))
        with pytest.raises(InvalidArgument, match="end must be in"):
            c.attend(NS, "bad", 0, q, end=41)
        nan = q.copy()
        nan[0, 1, 2] = np.nan
        with pytest.raises(NonFiniteError, match="not finite"):
            c.attend(NS, "bad", 0, nan)
        with pytest.raises(UnknownSequence):
            c.attend(NS, "missing", 0, q)
        with pytest.raises(InvalidArgument, match="positions"):
            c.attend(NS, "bad", 0, q, positions=[1, 2])
        with pytest.raises(InvalidArgument, match="at most 4096"):
            c.attend(NS, "bad", 0, np.zeros((4097, 2, 16), np.float32))
        out, lse = c.attend(NS, "bad", 0, q)  # still serving
        assert np.isfinite(lse).all()


@pytest.mark.timeout(60)
def test_a_malformed_attend_gets_a_protocol_error(q8_shard: ServerProcess) -> None:
    import zmq
    from test_wire import raw_dealer

    ctx = zmq.Context()
    try:
        sock = raw_dealer(ctx, q8_shard.endpoint)
        req = p.AttendRequest(request_id=5, namespace=NS, seq_id="x", layer=0, queries=np.zeros((1, 2, 16),
                                                                                              np.float32))
        frames = p.encode_request(req)
        sock.send_multipart([frames[0], b"\x00" * 7])  # the frame does not match the shape
        assert sock.poll(10_000)
        reply = p.decode_reply(sock.recv_multipart())
        assert isinstance(reply, p.ErrorReply) and reply.request_id == 5 and reply.code == ProtocolError.code
        sock.close(0)
    finally:
        ctx.term()


@pytest.mark.timeout(120)
def test_a_large_range_runs_on_the_bulk_lane(q8_shard: ServerProcess) -> None:
    layout = {"num_layers": 1, "num_kv_heads": 8, "head_dim": 128}  # 4 KiB of fp16 K and V per token
    rng = np.random.default_rng(2)
    k = rng.standard_normal((1, 1100, 8, 128)).astype(np.float16)
    v = rng.standard_normal((1, 1100, 8, 128)).astype(np.float16)
    q = rng.standard_normal((1, 32, 128)).astype(np.float32)
    with Client(q8_shard.endpoint, timeout_s=30) as c:
        c.register("big", **layout)
        c.append("big", "s", k, v)
        before = q8_shard.metrics()["bulk_requests"]
        out, lse = c.attend("big", "s", 0, q)
        assert q8_shard.metrics()["bulk_requests"] > before
        keys, values = c.get("big", "s")
        want = attention.attend(q, keys[0], values[0])
        # fused q8 tiles against float64 over the decoded (float16) pages: float16 rounding, the bound 1e-3
        assert np.linalg.norm(out - want[0]) / np.linalg.norm(want[0]) < 1e-3
        assert np.abs(lse - want[1]).max() < 1e-3
