"""The data path over real sockets (issue 4): a ShardServer in another process, the clients in this one.

Servers run in ``spawn`` processes that report their endpoint through a pipe (port 0, no sleeps) and answer
commands on it (metrics, stop); their RSS is read from /proc. Every test is bounded by a timeout. The hostile
cases (fuzz, CURVE, slow readers, overload) are in test_wire_hostile.py, which imports the helpers below.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvd.client import AsyncClient, Client, aggregate_stats
from kvd.codec import pages
from kvd.errors import (
    Conflict,
    InvalidArgument,
    LayoutMismatch,
    NonFiniteError,
    ProtocolError,
    ShardUnavailable,
    Timeout,
    UnknownNamespace,
    UnknownSequence,
)
from kvd.store import Store
from kvd.wire import protocol as p
from kvd.wire.routing import owner
from kvd.wire.server import PACK_REPLY_MAX_BYTES, ShardServer, TopologyServer

from scripted_shard import Scripted  # isort: skip  (tests/integration/scripted_shard.py)

pytestmark = pytest.mark.integration

NS = "m"
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}


# ---- a shard server in another process ----------------------------------------------------------------------


def _serve(conn: Any, shard_id: str, store_kwargs: dict[str, Any], server_kwargs: dict[str, Any],
           level: str | None, curve_files: dict[str, str] | None) -> None:
    from kvd.wire.server import CurveConfig

    store = Store(store_kwargs.pop("capacity_bytes", 256 << 20), **store_kwargs)
    if level is not None:
        store.set_level(level, 1)
    if "limits" in server_kwargs:
        server_kwargs["limits"] = p.Limits(**server_kwargs["limits"])
    curve = CurveConfig.for_server(**curve_files) if curve_files else None
    server = ShardServer(store, shard_id=shard_id, curve=curve, **server_kwargs)
    conn.send(server.start())
    while True:
        cmd = conn.recv()
        if cmd == "metrics":
            conn.send(server.metrics())
        elif isinstance(cmd, tuple) and cmd[0] == "level":  # what the coordinator's broadcast does
            conn.send(store.set_level(cmd[1], cmd[2]))
        elif cmd == "stop":
            server.stop()
            conn.send("stopped")
            return


class ServerProcess:
    """A ShardServer in a spawn process; :attr:`endpoint` once it serves."""

    def __init__(self, shard_id: str = "shard-0", *, level: str | None = None,
                 store: dict[str, Any] | None = None, server: dict[str, Any] | None = None,
                 curve_files: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, shard_id, dict(store or {}), dict(server or {}), level,
                                                     curve_files), daemon=True)
        self.proc.start()
        if not self._conn.poll(60):  # readiness: the child reports its endpoint once it serves
            self.proc.kill()
            raise RuntimeError("the server process did not report an endpoint")
        self.endpoint: str = self._conn.recv()
        self.shard_id = shard_id

    def metrics(self) -> dict[str, Any]:
        self._conn.send("metrics")
        assert self._conn.poll(10), "the server process did not answer"
        return self._conn.recv()

    def set_level(self, level: str, epoch: int) -> bool:
        self._conn.send(("level", level, epoch))
        assert self._conn.poll(10), "the server process did not answer"
        return self._conn.recv()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def alive(self) -> bool:
        return self.proc.is_alive()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send("stop")
                self._conn.poll(10)
            except (BrokenPipeError, OSError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def kv(layers: int = 2, tokens: int = 100, heads: int = 2, dim: int = 16, seed: int = 0,
       dtype: Any = np.float16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((layers, tokens, heads, dim), dtype=np.float32).astype(dtype)
    return k, (rng.standard_normal(k.shape, dtype=np.float32) * 0.5).astype(dtype)


def raw_dealer(ctx: zmq.Context[Any], endpoint: str, **options: int) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


def request(sock: zmq.Socket[Any], req: Any, timeout_s: float = 10.0) -> Any:
    sock.send_multipart(p.encode_request(req))
    assert sock.poll(int(timeout_s * 1000)), f"no reply to {type(req).__name__}"
    return p.decode_reply(sock.recv_multipart())


@pytest.fixture(scope="module")
def shard() -> Iterator[ServerProcess]:
    server = ServerProcess()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def q4_shard() -> Iterator[ServerProcess]:
    server = ServerProcess("shard-q4", level="q4")
    yield server
    server.stop()


# ---- every operation, client and server in separate processes ----------------------------------------------


class DLPackOnly:
    """A tensor that only speaks DLPack, as a CPU torch tensor does."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._arr.__dlpack_device__()


@pytest.mark.timeout(60)
def test_every_operation_round_trips(shard: ServerProcess) -> None:
    with Client(shard.endpoint, timeout_s=10) as c:
        assert c.topology()["shards"] == [{"id": "shard-0", "endpoint": shard.endpoint}]
        c.register(NS, **LAYOUT)
        c.register(NS, **LAYOUT)  # same layout again: fine
        with pytest.raises(LayoutMismatch):
            c.register(NS, num_layers=3, num_kv_heads=2, head_dim=16)
        k, v = kv(tokens=150)
        assert c.append(NS, "rt", k[:, :100], v[:, :100]) == 100
        assert c.append(NS, "rt", DLPackOnly(k[:, 100:].copy()), memoryview(v[:, 100:].copy())) == 150
        keys, values = c.get(NS, "rt")
        assert keys.dtype == np.float16 and np.array_equal(keys, k) and np.array_equal(values, v)
        part = c.get(NS, "rt", 10, 140, layers=[1])
        assert np.array_equal(part[0], k[1:2, 10:140]) and np.array_equal(part[1], v[1:2, 10:140])
        for start, end, layers in ((0, None, None), (10, 140, [1]), (64, 64, [1, 0]), (149, 150, None)):
            fp16 = c.get(NS, "rt", start, end, layers)
            paged = c.get(NS, "rt", start, end, layers, format="pages")
            assert np.array_equal(paged[0], fp16[0]) and np.array_equal(paged[1], fp16[1])
        assert c.length(NS, "rt") == 150
        info = c.explain(NS, "rt", 0, 3)
        assert info["level"] == "fp16" and "sink" in info["reasons"] and info["page"] == 0
        stats = c.stats()
        assert stats["tokens"] >= 150 and stats["shards"] == 1 and stats["errors"] == 0
        (one,) = c.shard_stats()
        assert one["shard_id"] == "shard-0" and one["server_requests"] > 0 and "used_bytes" in one
        assert set(c.ping()) == {"shard-0"}
        assert c.drop(NS, "rt") is True and c.drop(NS, "rt") is False
        with pytest.raises(UnknownSequence):
            c.length(NS, "rt")


@pytest.mark.timeout(60)
def test_dtypes_and_refusals_come_back_as_kvd_errors(shard: ServerProcess) -> None:
    with Client([shard.endpoint], timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        k32, v32 = kv(tokens=5, dtype=np.float32)
        assert c.append(NS, "f32", k32, v32) == 5
        assert np.array_equal(c.get(NS, "f32")[0], k32.astype(np.float16))
        bits = (k32.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 by truncation, as raw 16-bit patterns
        assert c.append(NS, "bf16", bits, bits, dtype="bfloat16") == 5
        want = pages.bf16_bits_to_f16(bits)
        assert np.array_equal(c.get(NS, "bf16")[0], want)
        nan = k32.copy()
        nan[0, 2, 1, 3] = np.nan
        with pytest.raises(NonFiniteError):
            c.append(NS, "f32", nan, v32)
        assert c.length(NS, "f32") == 5  # all or nothing
        with pytest.raises(LayoutMismatch):
            c.append(NS, "f32", k32[:, :, :1], v32[:, :, :1])
        with pytest.raises(UnknownNamespace):
            c.append("nope", 1, k32, v32)
        with pytest.raises(InvalidArgument):
            c.get(NS, "f32", layers=[7])
        with pytest.raises(UnknownSequence):
            c.get(NS, "never")
        with pytest.raises(InvalidArgument):  # checked by the client before anything is sent
            c.get(NS, "f32", 3, 1)


@pytest.mark.timeout(60)
def test_q4_pages_decode_to_the_fp16_reply(q4_shard: ServerProcess) -> None:
    with Client(q4_shard.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        k, v = kv(tokens=300, seed=3)
        c.append(NS, 7, k, v)
        fp16 = c.get(NS, 7)
        paged = c.get(NS, 7, format="pages")
        assert np.array_equal(paged[0], fp16[0]) and np.array_equal(paged[1], fp16[1])
        assert c.explain(NS, 7, 0, 200)["level"] == "q4"
        assert not np.array_equal(fp16[0], k)  # it really is quantized ...
        assert np.abs(fp16[0].astype(np.float32) - k).mean() < 0.2  # ... and close


@pytest.mark.timeout(60)
def test_pages_travel_packed_from_a_1_1_server_and_one_per_frame_otherwise(q4_shard: ServerProcess) -> None:
    k, v = kv(tokens=1000, seed=5)
    with Client(q4_shard.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        c.append(NS, "pk", k, v)
        fp16 = c.get(NS, "pk", 10, 990)
        (conn,) = c._conns.values()
        assert conn.packs and conn.hello is not None and conn.hello.protocol_minor == p.PROTOCOL_MINOR >= 1
        for packs in (True, False):  # False: how this client talks to a 1.0 server, which never sees packed
            conn.packs = packs
            paged = c.get(NS, "pk", 10, 990, format="pages")
            assert np.array_equal(paged[0], fp16[0]) and np.array_equal(paged[1], fp16[1]), packs
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(q4_shard.endpoint)
    try:
        replies = {}
        for packed in (False, True):
            req = p.GetRequest(request_id=1, namespace=NS, seq_id="pk", format="pages", packed=packed)
            sock.send_multipart(p.encode_request(req))
            assert sock.poll(10_000)
            frames = sock.recv_multipart()
            reply = replies[packed] = p.decode_reply(frames)
            assert isinstance(reply, p.GetPagesReply) and len(reply.entries) == 2 * 16  # 2 layers x 16 pages
            # packed: 64 small pages fit in one frame; else two frames per entry
            assert len(frames) - 1 == (1 if packed else 2 * len(reply.entries))
            assert (reply.packed is not None) == packed
        assert [(e[0], e[1], bytes(e[2]), bytes(e[3])) for e in replies[True].entries] == [
            (e[0], e[1], bytes(e[2]), bytes(e[3])) for e in replies[False].entries]
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_keys_and_values_travel_packed_in_one_frame_with_a_1_4_server_and_as_two_otherwise(
        shard: ServerProcess) -> None:
    k, v = kv(tokens=40, seed=6)
    with Client(shard.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        (conn,) = c._conns.values()
        assert conn.packs_tensors and conn.hello is not None and conn.hello.protocol_minor >= 4
        for packs in (True, False):  # False: how this client talks to a 1.3 server, which never sees packed
            conn.packs_tensors = packs
            seq = f"pt-{packs}"
            assert c.append(NS, seq, k[:, :25], v[:, :25]) == 25
            assert c.append_nowait(NS, seq, k[:, 25:], v[:, 25:], offset=25).result() == 40
            for keys, values in (c.get(NS, seq), c.get_nowait(NS, seq, 5, 30, layers=[1]).result()):
                want = slice(None) if keys.shape[0] == 2 else slice(1, 2), slice(None) if keys.shape[1] == 40 \
                    else slice(5, 30)
                assert np.array_equal(keys, k[want]) and np.array_equal(values, v[want]), packs
                assert not np.shares_memory(keys, values)
    ctx = zmq.Context()
    sock = raw_dealer(ctx, shard.endpoint)
    try:  # on the wire: what a client in another language sees
        for packed in (False, True):
            req = p.AppendRequest(request_id=1, namespace=NS, seq_id=f"raw-{packed}", keys=k, values=v,
                                  packed=packed)
            out = p.encode_request(req)
            assert len(out) == (2 if packed else 3)
            sock.send_multipart(out)
            assert sock.poll(10_000)
            assert p.decode_reply(sock.recv_multipart()).length == 40
            sock.send_multipart(p.encode_request(p.GetRequest(request_id=2, namespace=NS, seq_id="raw-False",
                                                              start=3, end=33, packed=packed)))
            assert sock.poll(10_000)
            frames = sock.recv_multipart()
            assert len(frames) == (2 if packed else 3)
            assert (b"packed" in frames[0]) is packed
            assert b"".join(frames[1:]) == k[:, 3:33].tobytes() + v[:, 3:33].tobytes()
        # the server stored the packed append's tensors, not the frame's halves in some other order
        sock.send_multipart(p.encode_request(p.GetRequest(request_id=3, namespace=NS, seq_id="raw-True")))
        assert sock.poll(10_000)
        got = p.decode_reply(sock.recv_multipart())
        assert np.array_equal(got.keys, k) and np.array_equal(got.values, v) and got.packed is None
        # a reply over PACK_REPLY_MAX_BYTES goes as two frames, though asked: a large frame moves slower
        big_k, big_v = kv(tokens=PACK_REPLY_MAX_BYTES // 256 + 1, seed=7)  # 256 bytes a token, both tensors
        big = p.encode_request(p.AppendRequest(request_id=6, namespace=NS, seq_id="raw-big", keys=big_k,
                                              values=big_v))
        sock.send_multipart(big)
        assert sock.poll(10_000) and p.decode_reply(sock.recv_multipart()).length == big_k.shape[1]
        for end, packs in ((big_k.shape[1] - 1, True), (None, False)):
            sock.send_multipart(p.encode_request(p.GetRequest(request_id=7, namespace=NS, seq_id="raw-big",
                                                              end=end, packed=True)))
            assert sock.poll(10_000)
            frames = sock.recv_multipart()
            assert len(frames) == (2 if packs else 3) and (b"packed" in frames[0]) is packs
        # a packed append whose frame does not split into its keys and values is refused by name; nothing stored
        bad = p.encode_request(p.AppendRequest(request_id=4, namespace=NS, seq_id="raw-bad", keys=k, values=v,
                                               packed=True))
        sock.send_multipart([bad[0], bytes(bad[1])[:-2]])
        assert sock.poll(10_000)
        err = p.decode_reply(sock.recv_multipart())
        assert isinstance(err, p.ErrorReply) and err.error == "ProtocolError" and "2 x 5120" in err.message
        sock.send_multipart(p.encode_request(p.LengthRequest(request_id=5, namespace=NS, seq_id="raw-bad")))
        assert sock.poll(10_000)
        assert p.decode_reply(sock.recv_multipart()).error == "UnknownSequence"
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_offsets_make_appends_conditional(shard: ServerProcess) -> None:
    with Client(shard.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        k, v = kv(tokens=4)
        with pytest.raises(Conflict, match="offset 3 does not match the length 0"):
            c.append(NS, "off", k, v, offset=3)
        with pytest.raises(UnknownSequence):
            c.length(NS, "off")  # nothing was written
        assert c.append(NS, "off", k, v, offset=0) == 4
        assert c.append(NS, "off", k, v, offset=4) == 8
        with pytest.raises(Conflict):
            c.append(NS, "off", k, v, offset=4)  # a resend of the same append is refused, not duplicated
        assert c.length(NS, "off") == 8
        # pipelined appends with offsets: a gap makes the later ones fail instead of landing at a wrong position
        out = c.append_many([(NS, "off", k, v, 8), (NS, "off", k, v, 99), (NS, "off", k, v, 12)],
                            return_exceptions=True)
        assert out[0] == 12 and isinstance(out[1], Conflict) and out[2] == 16


@pytest.mark.timeout(60)
def test_malformed_requests_get_error_replies_naming_the_problem(shard: ServerProcess) -> None:
    ctx = zmq.Context()
    try:
        sock = raw_dealer(ctx, shard.endpoint)
        cases = [
            ([msgpack.packb({"v": 1, "id": 5, "op": "put"})], 5, "ProtocolError", "'put'"),
            ([msgpack.packb({"v": 1, "id": 6, "op": "get", "namespace": NS, "seq_id": 1, "start": -1})], 6,
             "InvalidArgument", "start must be >= 0, got -1"),
            ([msgpack.packb({"v": 1, "id": 7, "op": "append", "namespace": NS, "seq_id": 1, "dtype": "float16",
                             "shape": [2, 1, 2, 16]}), b"\0" * 128, b"\0" * 3], 7, "ProtocolError",
             "values frame has 3 bytes"),
            ([msgpack.packb({"v": 9, "id": 8, "op": "ping"})], 8, "UnsupportedVersion", "protocol version 9"),
            ([b"\xc1"], None, "ProtocolError", "not valid msgpack"),
            ([msgpack.packb({"v": 1, "id": 9, "op": "topology"})], 9, "ProtocolError",
             "served by the coordinator"),
        ]
        for frames, rid, error, needle in cases:
            sock.send_multipart(frames)
            assert sock.poll(10_000)
            reply = p.decode_reply(sock.recv_multipart())
            assert isinstance(reply, p.ErrorReply)
            assert (reply.request_id, reply.error) == (rid, error) and needle in reply.message, reply
        assert isinstance(request(sock, p.PingRequest(request_id=10)), p.PingReply)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_idle_compaction_reencodes_old_pages_after_a_level_rise() -> None:
    server = ServerProcess("compact", store={"capacity_bytes": 64 << 20},
                           server={"compact_budget_bytes": 64 << 10})
    try:
        with Client(server.endpoint, timeout_s=10) as c:
            c.register(NS, **LAYOUT)
            k, v = kv(tokens=640, seed=5)
            c.append(NS, "old", k, v)
            before = c.stats()
            assert before["pages_by_level"] == {"fp16": 20}
            assert server.set_level("q4", 1)
            while server.metrics()["compactions"] == 0 or c.stats()["compaction_backlog_bytes"]:
                assert server.alive()  # readiness: the server compacts while idle, in small steps
            after = c.stats()
            assert after["pages_by_level"]["q4"] == 18 and after["used_bytes"] < before["used_bytes"]
            assert c.explain(NS, "old", 1, 300)["level"] == "q4"
            assert server.metrics()["compactions"] > 1  # more than one budget-bounded step
            assert np.abs(c.get(NS, "old")[0].astype(np.float32) - k).mean() < 0.2
    finally:
        server.stop()


# ---- pipelining --------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_pipelined_requests_complete_in_any_order(shard: ServerProcess) -> None:
    with Client(shard.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        data = {i: kv(tokens=1 + i % 7, seed=i) for i in range(40)}
        lengths = c.append_many([(NS, f"pipe{i}", k, v) for i, (k, v) in data.items()], window=16)
        assert lengths == [1 + i % 7 for i in range(40)]
        pending = [c.get_nowait(NS, f"pipe{i}") for i in data]
        for i in reversed(range(40)):  # collected in reverse: earlier replies wait in the client for their turn
            keys, values = pending[i].result()
            assert np.array_equal(keys, data[i][0]) and np.array_equal(values, data[i][1])
        gets = c.get_many([(NS, f"pipe{i}") for i in data], format="pages")
        assert all(np.array_equal(g[0], data[i][0]) for i, g in enumerate(gets))
        mixed = c.get_many([(NS, "pipe1"), (NS, "missing"), (NS, "pipe2")], return_exceptions=True)
        assert isinstance(mixed[1], UnknownSequence) and np.array_equal(mixed[2][0], data[2][0])


class ReversingServer(Scripted):
    """A ROUTER that answers hello at once and then every 8 pings in reverse order: replies out of order."""

    def __init__(self) -> None:
        self.held: list[tuple[bytes, int]] = []
        super().__init__(lambda req: None, shard_id="rev")

    def serve(self, ident: bytes, req: Any) -> None:
        self.held.append((ident, req.request_id))
        if len(self.held) == 8:
            for who, rid in reversed(self.held):
                self.send(who, p.PingReply(request_id=rid))
            self.held.clear()


@pytest.mark.timeout(30)
def test_replies_are_matched_by_id_not_by_order() -> None:
    server = ReversingServer()
    try:
        with Client(server.endpoint, timeout_s=5) as c:
            conn = c._conns[server.endpoint]
            reqs = [p.PingRequest(request_id=next(c._ids)) for _ in range(8)]
            for req in reqs:
                c._send(conn, req, float("inf"))
            import time
            deadline = time.monotonic() + 5
            got = [c._wait(conn, req, deadline, 5) for req in reqs]  # the first one arrives last
            assert [r.request_id for r in got] == [r.request_id for r in reqs]

            async def concurrent() -> list[Any]:
                async with AsyncClient(server.endpoint, timeout_s=5) as ac:
                    aconn = ac._conns[server.endpoint]
                    areqs = [p.PingRequest(request_id=next(ac._ids)) for _ in range(8)]

                    async def one(req: Any) -> Any:
                        await ac._send(aconn, req, float("inf"))
                        return await ac._wait(aconn, req, time.monotonic() + 5, 5)

                    return list(await asyncio.gather(*(one(r) for r in areqs)))

            replies = asyncio.run(concurrent())
            assert all(isinstance(r, p.PingReply) for r in replies)
            assert len({r.request_id for r in replies}) == 8
    finally:
        server.stop.set()
        server.thread.join(5)


# ---- routing, topology, refresh ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_shards() -> Iterator[list[ServerProcess]]:
    servers = [ServerProcess(f"shard-{i}") for i in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.mark.timeout(60)
def test_routing_by_shard_id_through_the_coordinator(two_shards: list[ServerProcess]) -> None:
    ids = [s.shard_id for s in two_shards]
    topo = {"epoch": 3, "shards": [{"id": s.shard_id, "endpoint": s.endpoint} for s in two_shards],
            "level": "q8", "level_epoch": 2}
    coordinator = TopologyServer(lambda: topo)
    try:
        endpoint = coordinator.start()
        with Client(endpoint, timeout_s=10) as c:
            assert c.topology() == topo
            c.register("route", **LAYOUT)  # to every shard
            k, v = kv(tokens=3)
            seqs: list[str | int] = [f"seq-{i}" for i in range(20)] + list(range(20))
            for s in seqs:
                c.append("route", s, k, v)
            per_shard = [Client([srv.endpoint], timeout_s=10) for srv in two_shards]
            try:
                for s in seqs:
                    home = owner(ids, "route", s)
                    assert per_shard[home].length("route", s) == 3
                    with pytest.raises(UnknownSequence):
                        per_shard[1 - home].length("route", s)
            finally:
                for x in per_shard:
                    x.close()
            assert {owner(ids, "route", s) for s in seqs} == {0, 1}  # both shards got some
            assert [x["shard_id"] for x in c.shard_stats()] == ids
            assert c.stats()["sequences"] >= len(seqs)
        # a list of shard endpoints routes the same way: ids come from each shard's hello
        with Client([s.endpoint for s in reversed(two_shards)], timeout_s=10) as listed:
            assert sorted(x["id"] for x in listed.topology()["shards"]) == ids
            assert all(listed.length("route", s) == 3 for s in seqs)
    finally:
        coordinator.stop()


@pytest.mark.timeout(60)
def test_lengths_of_many_sequences_cost_one_request_per_shard(two_shards: list[ServerProcess]) -> None:
    """A prefix lookup of any length: one lengths request to each shard, in flight together, answers in the
    caller's order with None for what is not there; sync and asyncio alike."""
    endpoints = [s.endpoint for s in two_shards]
    with Client(endpoints, timeout_s=10) as c:
        c.register("lookup", **LAYOUT)
        k, v = kv(tokens=5)
        stored = [f"blk-{i}" for i in range(0, 300, 2)]
        for s in stored:
            c.append("lookup", s, k[:, : 1 + len(s) % 5], v[:, : 1 + len(s) % 5])
        asked = [f"blk-{i}" for i in range(300)]
        before = [srv.metrics()["requests"] for srv in two_shards]
        got = c.lengths("lookup", asked)
        after = [srv.metrics()["requests"] for srv in two_shards]
        assert got == [1 + len(s) % 5 if s in stored else None for s in asked]
        assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1]
        assert c.lengths("lookup", []) == []
        with pytest.raises(UnknownNamespace):
            c.lengths("never-registered", ["x"])

        async def lookup() -> list[int | None]:
            async with AsyncClient(endpoints, timeout_s=10) as ac:
                return await ac.lengths("lookup", asked[:10])

        assert asyncio.run(lookup()) == got[:10]


def test_an_append_states_its_prompt_position_so_a_block_gets_no_sink_page(q4_shard: ServerProcess) -> None:
    k, v = kv(tokens=130)
    with Client(q4_shard.endpoint, timeout_s=10) as c:
        c.register("blocks", **LAYOUT)
        c.append("blocks", "first", k[:, :128], v[:, :128])  # a prompt's first block: its sinks stay at 8 bits
        c.append("blocks", "second", k[:, :128], v[:, :128], position=128, offset=0)
        first, second = c.explain("blocks", "first", 0, 0), c.explain("blocks", "second", 0, 0)
        assert first["level"] == "q8" and "sink" in first["reasons"]
        assert second["level"] == "q4" and "sink" not in second["reasons"]
        with pytest.raises(InvalidArgument, match="starts at prompt position 128, not 0"):
            c.append("blocks", "second", k[:, 128:], v[:, 128:], position=0)
        assert c.length("blocks", "second") == 128


def test_an_appends_parent_reaches_the_shard_which_evicts_the_chains_tail_first() -> None:
    """A chain a0 <- a1 <- a2 stored first (the least recently used), then two blocks outside it: the full shard
    gives up the chain's tail, never its head, and the parent travels on the wire (the typed encoder hands such
    an append to the generic one)."""
    k, v = kv(tokens=64)
    probe = Store(64 << 20, max_level="fp16")
    probe.register("chain", **LAYOUT)
    base = probe.used_bytes
    probe.append("chain", "p", k, v)
    one = probe.used_bytes - base
    server = ServerProcess("shard-chain", store={"capacity_bytes": base + 4 * one + one // 2, "max_level": "fp16"})
    try:
        with Client(server.endpoint, timeout_s=10) as c:
            c.register("chain", **LAYOUT)
            for i in range(3):
                c.append("chain", f"a{i}", k, v, position=64 * i, parent=f"a{i - 1}" if i else None)
            c.append("chain", "x", k, v)
            c.append("chain", "y", k, v)
            assert c.lengths("chain", ["a0", "a1", "a2", "x", "y"]) == [64, 64, None, 64, 64]
    finally:
        server.stop()


def _old_shard(router: zmq.Socket[Any], store: Store, seen: list[str], stop: threading.Event) -> None:
    """A shard of protocol 1.1: it knows no lengths operation and no append position."""
    while not stop.is_set():
        if not router.poll(50):
            continue
        ident, *frames = router.recv_multipart()
        req = p.parse_request(frames)
        seen.append(getattr(req, "OP", "?"))
        if isinstance(req, p.HelloRequest):
            reply: Any = p.HelloReply.for_limits(p.Limits(), request_id=req.request_id, kvd_version="0.1.0",
                                                 page_format_version=1, shard_id="old", page_tokens=64,
                                                 protocol_minor=1)
        elif isinstance(req, p.LengthRequest):
            try:
                reply = p.LengthReply(request_id=req.request_id, length=store.length(req.namespace, req.seq_id))
            except UnknownSequence as exc:
                reply = p.error_reply(req.request_id, exc)
        elif isinstance(req, p.AppendRequest):
            unknown = sorted({"position", "parent"} & msgpack.unpackb(frames[0]).keys())
            if unknown:  # unknown keys are errors before 1.3 (position) and 1.6 (parent)
                reply = p.error_reply(req.request_id, ProtocolError(f"append: unknown header keys {unknown}"))
            else:
                reply = p.AppendReply(request_id=req.request_id,
                                      length=store.append(req.namespace, req.seq_id, req.keys, req.values))
        else:
            reply = p.error_reply(getattr(req, "request_id", None), ProtocolError("unknown op"))
        router.send_multipart([ident, *p.encode_reply(reply)])


@pytest.mark.timeout(60)
def test_lengths_from_a_server_before_protocol_1_2_come_from_pipelined_length_requests() -> None:
    store = Store(16 << 20)
    store.register(NS, **LAYOUT)
    k, v = kv(tokens=3)
    store.append(NS, "a", k, v)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=_old_shard, args=(router, store, seen, stop), daemon=True)
    thread.start()
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=5) as c:
            assert c.lengths(NS, ["a", "b", "a"]) == [3, None, 3]
            assert c.append(NS, "blk", k, v, position=64) == 3  # left out for a server before 1.3
            assert c.append(NS, "blk2", k, v, position=64, parent="blk") == 3  # and the parent before 1.6
        assert "lengths" not in seen and seen.count("length") == 3 and seen.count("append") == 2
    finally:
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_topology_refresh_after_a_shard_moves() -> None:
    stores = [Store(64 << 20) for _ in range(3)]
    # s1 restarts at another endpoint (servers[2]) under its own id, empty
    servers = [ShardServer(stores[i], shard_id=("s0", "s1", "s1")[i]) for i in range(3)]
    eps = [s.start() for s in servers]
    topo: dict[str, Any] = {"epoch": 1, "level": "fp16", "level_epoch": 0,
                            "shards": [{"id": "s0", "endpoint": eps[0]}, {"id": "s1", "endpoint": eps[1]}]}
    coordinator = TopologyServer(lambda: topo)
    try:
        with Client(coordinator.start(), timeout_s=3) as c:
            c.register(NS, **LAYOUT)
            k, v = kv(tokens=2)
            victim = next(s for s in (f"x{i}" for i in range(100)) if owner(["s0", "s1"], NS, s) == 1)
            c.append(NS, victim, k, v)
            # shard s1 dies; the coordinator now lists s2 in its place (it came back empty elsewhere)
            servers[1].stop()
            stores[2].register(NS, **LAYOUT)
            topo = {**topo, "epoch": 2, "shards": [topo["shards"][0], {"id": "s1", "endpoint": eps[2]}]}
            with pytest.raises(UnknownSequence):  # idempotent: refreshed once and retried on the new endpoint
                c.length(NS, victim)
            assert c.topology()["epoch"] == 2
            assert c.append(NS, victim, k, v) == 2  # the next append goes to the new endpoint
            # an append that meets a dead shard is not retried: the error surfaces, the topology is refreshed
            servers[2].stop()
            topo = {**topo, "epoch": 3, "shards": [topo["shards"][0], {"id": "s1", "endpoint": eps[1]}]}
            with pytest.raises((ShardUnavailable, Timeout)):
                c.append(NS, victim, k, v)
            assert c.topology()["epoch"] == 3
    finally:
        coordinator.stop()
        for s in servers:
            s.stop()


@pytest.mark.timeout(60)
def test_a_get_too_large_for_one_reply_is_fetched_in_parts() -> None:
    # max_frames 5: a pages reply holds at most 2 pages; max_frame_bytes 4096: an fp16 frame at most 64 tokens of
    # this layout. Both gets come back MessageTooLarge first and are then fetched as halves by the client.
    small = ServerProcess("shard-small", store={"page_tokens": 16},
                          server={"limits": {"max_frames": 5, "max_frame_bytes": 4096}})
    try:
        with Client(small.endpoint, timeout_s=10) as c:
            c.register(NS, **LAYOUT)
            k, v = kv(tokens=50)  # 2 layers x 50 tokens x 2 heads x 16 dims: 6400 bytes per tensor
            c.append(NS, "big", k[:, :25], v[:, :25])
            c.append(NS, "big", k[:, 25:], v[:, 25:])
            for fmt in ("fp16", "pages"):
                keys, values = c.get(NS, "big", format=fmt)
                assert np.array_equal(keys, k) and np.array_equal(values, v), fmt
                keys, values = c.get(NS, "big", 3, 47, layers=[1], format=fmt)
                assert np.array_equal(keys, k[1:, 3:47]) and np.array_equal(values, v[1:, 3:47]), fmt
            assert small.metrics()["errors"] >= 4  # the first attempts were refused, not served partially
            # 30 tokens: each tensor fits a frame (3840 bytes), both together do not: the server does not pack
            # them, though asked, and says so; the client reads either form
            keys, values = c.get(NS, "big", 0, 30)
            assert np.array_equal(keys, k[:, :30]) and np.array_equal(values, v[:, :30])
            ctx = zmq.Context()
            sock = raw_dealer(ctx, small.endpoint)
            try:
                sock.send_multipart(p.encode_request(p.GetRequest(request_id=1, namespace=NS, seq_id="big",
                                                                  end=30, packed=True)))
                assert sock.poll(10_000)
                frames = sock.recv_multipart()
                assert len(frames) == 3 and b"packed" not in frames[0]
                sock.send_multipart(p.encode_request(p.GetRequest(request_id=2, namespace=NS, seq_id="big",
                                                                  end=16, packed=True)))
                assert sock.poll(10_000)
                frames = sock.recv_multipart()
                assert len(frames) == 2 and len(frames[1]) == 4096
            finally:
                sock.close(0)
                ctx.term()
    finally:
        small.stop()


@pytest.mark.timeout(30)
def test_every_call_has_a_timeout() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)  # answers hello, then never anything
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def mute() -> None:
        while not stop.is_set():
            if sock.poll(50):
                ident, *frames = sock.recv_multipart()
                req = p.decode_request(frames)
                if isinstance(req, p.HelloRequest):
                    sock.send_multipart([ident, *p.encode_reply(p.HelloReply(
                        request_id=req.request_id, kvd_version="t", page_format_version=1, shard_id="mute",
                        page_tokens=64))])

    thread = threading.Thread(target=mute, daemon=True)
    thread.start()
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=0.3) as c:
            with pytest.raises(Timeout, match="no reply from shard 'mute'.*length"):
                c.length(NS, 1)
            with pytest.raises(Timeout):
                c.get_nowait(NS, 1).result()

            async def run() -> None:
                async with AsyncClient(f"tcp://127.0.0.1:{port}", timeout_s=0.3) as ac:
                    with pytest.raises(Timeout):
                        await ac.length(NS, 1)

            asyncio.run(run())
        with pytest.raises((Timeout, ShardUnavailable)):  # nothing listens there any more
            stop.set()
            thread.join(5)
            sock.close()
            Client(f"tcp://127.0.0.1:{port}", timeout_s=0.3)
    finally:
        stop.set()
        ctx.destroy(linger=0)


# ---- asyncio -----------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_async_client(two_shards: list[ServerProcess]) -> None:
    async def run() -> None:
        async with AsyncClient([s.endpoint for s in two_shards], timeout_s=10) as c:
            await c.register("async", **LAYOUT)
            data = {i: kv(tokens=10 + i, seed=i) for i in range(24)}
            lengths = await asyncio.gather(*(c.append("async", i, k, v, offset=0) for i, (k, v) in data.items()))
            assert lengths == [10 + i for i in range(24)]
            got = await asyncio.gather(*(c.get("async", i, format="pages" if i % 2 else "fp16") for i in data))
            for i, (keys, values) in enumerate(got):
                assert np.array_equal(keys, data[i][0]) and np.array_equal(values, data[i][1])
            assert await c.append_many([("async", 0, *data[0], 10)]) == [20]
            with pytest.raises(Conflict):
                await c.append("async", 0, *data[0], offset=0)
            with pytest.raises(UnknownSequence):
                await c.length("async", "missing")
            assert (await c.explain("async", 1, 0, 0))["level"] == "fp16"
            assert (await c.stats())["shards"] == 2
            assert await c.drop("async", 3) is True

    asyncio.run(run())


def test_aggregate_stats_sums_counters_and_merges_levels() -> None:
    a = {"used_bytes": 10, "capacity_bytes": 100, "pressure": 0.1, "level": "q8", "epoch": 3,
         "pages_by_level": {"q8": 2}, "page_tokens": 64, "shard_id": "a"}
    b = {"used_bytes": 30, "capacity_bytes": 100, "pressure": 0.3, "level": "q4", "epoch": 4,
         "pages_by_level": {"q8": 1, "q4": 5}, "page_tokens": 64, "shard_id": "b"}
    out = aggregate_stats([a, b, {"shard_id": "c", "error": "Timeout: x"}])
    assert out["used_bytes"] == 40 and out["pressure"] == 0.2 and out["level"] == "mixed"
    assert out["epoch"] == 4 and out["page_tokens"] == 64 and out["pages_by_level"] == {"q8": 3, "q4": 5}
    assert (out["shards"], out["errors"]) == (3, 1)


def test_aggregate_stats_keeps_maps_of_flags_and_states_per_key() -> None:
    # per-namespace flags and states (calibration_required, calibration_states): kept where the shards agree,
    # "mixed" where they do not, numbers still summed
    a = {"calibration_required": {"m": True, "n": False}, "calibration_states": {"m": "calibrated", "n": "needed"},
         "tokens_by_namespace": {"m": 5}}
    b = {"calibration_required": {"m": True, "n": True}, "calibration_states": {"m": "calibrated"},
         "tokens_by_namespace": {"m": 2, "n": 1}}
    out = aggregate_stats([a, b])
    assert out["calibration_required"] == {"m": True, "n": "mixed"}
    assert out["calibration_states"] == {"m": "calibrated", "n": "needed"}
    assert out["tokens_by_namespace"] == {"m": 7, "n": 1}


@pytest.mark.timeout(20)
def test_a_taken_port_fails_start_at_once_and_leaves_no_thread() -> None:
    first = ShardServer(Store(1 << 20), shard_id="first")
    endpoint = first.start()
    try:
        port = int(endpoint.rsplit(":", 1)[1])
        before = threading.active_count()
        with pytest.raises(zmq.ZMQError, match="in use"):
            ShardServer(Store(1 << 20), shard_id="second", port=port).start()
        # start() used to wait out its 10 s readiness timeout while ctx.term() hung on the unbound socket
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threading.active_count() <= before
    finally:
        first.stop()
