"""Bad peers against a live shard server in another process (issue 4): 10,000 fuzzed and hostile messages, an
oversize frame, CURVE with an unlisted key, a client that vanishes mid-flight, a slow reader, overload."""

from __future__ import annotations

import importlib.util
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvd.client import Client
from kvd.errors import Busy, Timeout, UnknownSequence
from kvd.wire import protocol as p
from kvd.wire.server import CurveConfig, keygen

# a sibling test module (pytest puts this directory on sys.path): the server-process helpers
from scripted_shard import Scripted  # isort: skip  (tests/integration/scripted_shard.py)
from test_wire import LAYOUT, NS, ServerProcess, kv, raw_dealer, request  # isort: skip

pytestmark = pytest.mark.integration

MIB = 1 << 20


def _unit_fuzz() -> Any:
    """The protocol unit tests' fuzz corpus (random, truncated, bit-flipped and hostile frames)."""
    path = Path(__file__).resolve().parents[1] / "unit" / "test_protocol.py"
    spec = importlib.util.spec_from_file_location("_kvd_protocol_fuzz_corpus", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sendable(frames: Any) -> list[bytes] | None:
    if not isinstance(frames, list) or not frames:
        return None
    if not all(isinstance(f, (bytes, bytearray, memoryview)) for f in frames):
        return None
    return [bytes(f) for f in frames]


# ---- fuzz ----------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_fuzz_every_message_is_answered_and_nothing_leaks() -> None:
    small = {"max_frame_bytes": MIB, "max_message_bytes": (128 << 10) + 2 * MIB}
    server = ServerProcess("fuzz", server={"limits": small})
    ctx = zmq.Context()
    try:
        with Client(server.endpoint, timeout_s=10) as c:
            c.register(NS, **LAYOUT)
            k, v = kv(tokens=130, seed=9)
            c.append(NS, "precious", k, v)
        sock = raw_dealer(ctx, server.endpoint)
        corpus = _unit_fuzz()
        sendable = (f for f in (_sendable(x) for x in corpus.fuzz_cases(10_500)) if f is not None)
        cases = [next(sendable) for _ in range(10_000)]  # (a few generated cases are not frames at all)
        # hostile extras: claims of 4 G items, deep nesting, wrong types, shape and length mismatches
        base = {"v": 1, "id": 77, "op": "append", "namespace": NS, "seq_id": "precious", "offset": None,
                "dtype": "float16", "shape": [2, 1, 2, 16]}
        extras = [
            [msgpack.packb({**base, "shape": [2**32, 2**32, 2, 16]}), b"\0" * 128, b"\0" * 128],
            [msgpack.packb({**base, "shape": [2, 1, 2, 16]}), b"\0" * 128, b"\0" * 127],
            [msgpack.packb({**base, "shape": "2x1"}), b"", b""],
            [msgpack.packb({**base, "dtype": 16}), b"\0" * 128, b"\0" * 128],
            [msgpack.packb({**base, "seq_id": [["precious"]]}), b"\0" * 128, b"\0" * 128],
            [b"\x91" * 100_000], [b"\xdd\xff\xff\xff\xff"], [b"\xdf\xff\xff\xff\xff" + b"\xa1a" * 1000],
            [msgpack.packb({"v": 1, "id": 78, "op": "get", "namespace": NS, "seq_id": "precious",
                            "layers": list(range(4097))})],
        ]
        cases += extras

        def blast(batch: list[list[bytes]]) -> int:
            errors = 0
            for frames in batch:
                sock.send_multipart(frames)
                assert sock.poll(10_000), f"no reply to {[f[:40] for f in frames[:3]]}"
                reply = p.decode_reply(sock.recv_multipart())
                errors += isinstance(reply, p.ErrorReply)
            return errors

        blast(cases[:500])  # warm up the allocator before the baseline
        rss_before = server.rss_bytes()
        errors = blast(cases[500:])
        rss_after = server.rss_bytes()
        assert errors > 0.9 * (len(cases) - 500)
        assert rss_after - rss_before < 10 * MIB, f"server RSS grew by {(rss_after - rss_before) / MIB:.1f} MiB"
        # an oversize frame cuts only that peer: no reply, its connection is closed, everyone else is served
        cut = raw_dealer(ctx, server.endpoint)
        monitor = cut.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        cut.send_multipart([msgpack.packb({**base, "shape": [2, 2048, 2, 16]}), b"\0" * 2 * MIB, b"\0" * 256])
        assert monitor.poll(10_000), "the peer that sent an oversize frame was not disconnected"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        cut.disable_monitor()
        assert isinstance(request(sock, p.PingRequest(request_id=1)), p.PingReply)
        with Client(server.endpoint, timeout_s=10) as c:
            keys, values = c.get(NS, "precious")
            assert np.array_equal(keys, k) and np.array_equal(values, v) and c.length(NS, "precious") == 130
        assert server.alive()
    finally:
        ctx.destroy(linger=0)
        server.stop()


# ---- CURVE ---------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_curve_serves_allowed_keys_only(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    server_pub, server_sec = keygen(keys, "server")
    client_pub, client_sec = keygen(keys, "client")
    _, intruder_sec = keygen(keys, "intruder")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(client_pub, allowed)
    assert (Path(server_sec).stat().st_mode & 0o777) == 0o600
    server = ServerProcess("secure", curve_files={"secret_key_file": server_sec,
                                                   "authorized_keys_dir": str(allowed)})
    try:
        good = CurveConfig.for_client(server_public_key_file=server_pub, secret_key_file=client_sec)
        assert good.secret_key.decode() not in repr(good)  # no secret in logs
        with Client(server.endpoint, timeout_s=10, curve=good) as c:
            c.register(NS, **LAYOUT)
            k, v = kv(tokens=5)
            assert c.append(NS, "s", k, v) == 5
            assert np.array_equal(c.get(NS, "s")[0], k)
        bad = CurveConfig.for_client(server_public_key_file=server_pub, secret_key_file=intruder_sec)
        with pytest.raises(Timeout, match="refused this client's CURVE key"):
            Client(server.endpoint, timeout_s=1.5, curve=bad)
        with pytest.raises(Timeout):  # no CURVE at all: no service either
            Client(server.endpoint, timeout_s=1.5)
        assert server.metrics()["requests"] == 4  # hello, register, append, get: nothing from the others
    finally:
        server.stop()


# ---- vanished clients, slow readers, overload ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_vanished_client_does_not_disturb_the_server() -> None:
    """A client that sends a request and vanishes before its reply: the reply is dropped and counted, the request
    was executed, and everyone else is served. The client goes as soon as its request has left (its socket closes
    after the last byte is written, so the server reads the whole request and then the end of the connection)
    and the append takes milliseconds, so the reply always meets a closed peer, however fast the append is."""
    server = ServerProcess("vanish", level="q4")
    ghost_ctx = zmq.Context()
    try:
        with Client(server.endpoint, timeout_s=30) as c:
            c.register(NS, **LAYOUT)
            big_k, big_v = kv(tokens=60_000, seed=2)  # 7.7 MiB of keys + values
            ghost = raw_dealer(ghost_ctx, server.endpoint)
            before = server.metrics()["requests"]
            ghost.send_multipart(p.encode_request(p.AppendRequest(request_id=1, namespace=NS, seq_id="ghost",
                                                                  keys=big_k, values=big_v)), copy=False)
            ghost.close(linger=20_000)  # the request is written out first, then the connection is closed
            ghost_ctx.term()  # returns once that is done
            while server.metrics()["requests"] == before:  # readiness: the server has the ghost's request
                assert server.alive()
            assert set(c.ping()) == {"vanish"}  # served while the append runs on the bulk lane
            deadline = time.monotonic() + 30
            while server.metrics()["replies_dropped"] < 1:  # the append's reply met the closed peer
                assert time.monotonic() < deadline, server.metrics()
                time.sleep(0.01)
            assert c.length(NS, "ghost") == 60_000  # the request itself was executed
    finally:
        ghost_ctx.destroy(linger=0)
        server.stop()


@pytest.mark.timeout(90)
def test_clients_that_pipeline_gets_and_leave_do_not_bring_the_shard_down() -> None:
    """A client pipelines many gets and closes its connection without reading, again and again. With an inbound
    high-water mark, libzmq 4.3.5 stopped reading such a peer and then, seeing it close while replies to it were
    pending, aborted the whole shard (an assertion in its I/O thread) within seconds."""
    server = ServerProcess("leavers")
    try:
        with Client(server.endpoint, timeout_s=30) as c:
            c.register(NS, **LAYOUT)
            k, v = kv(tokens=2048, seed=3)  # a 512 KiB reply per get
            c.append(NS, "big", k, v)
            frames = p.encode_request(p.GetRequest(request_id=1, namespace=NS, seq_id="big"))
            deadline = time.monotonic() + 8
            rounds = 0
            while time.monotonic() < deadline:
                ctx = zmq.Context()
                leaver = raw_dealer(ctx, server.endpoint, SNDHWM=0)
                for _ in range(500):
                    leaver.send_multipart(frames)
                leaver.close(linger=5000)
                ctx.term()  # returns once the requests have left; then the connection is gone
                rounds += 1
                assert server.alive(), f"the shard died after {rounds} clients that left"
            assert set(c.ping()) == {"leavers"} and c.length(NS, "big") == 2048
        assert server.alive()
    finally:
        server.stop()


@pytest.mark.timeout(90)
def test_a_slow_reader_is_bounded_by_its_high_water_mark() -> None:
    server = ServerProcess("slow", server={"hwm": 4})
    ctx = zmq.Context()
    try:
        with Client(server.endpoint, timeout_s=30) as c:
            c.register(NS, **LAYOUT)
            k, v = kv(tokens=8192, seed=4)  # 1 MiB of keys + values per get reply
            c.append(NS, "big", k, v)
            slow = raw_dealer(ctx, server.endpoint, RCVHWM=1, RCVBUF=16 * 1024)
            rss_before = server.rss_bytes()
            n = 120  # 120 MiB of replies that are never read
            before = server.metrics()["requests"]
            for i in range(n):
                slow.send_multipart(p.encode_request(p.GetRequest(request_id=i, namespace=NS, seq_id="big")))
            while server.metrics()["requests"] < before + n:  # readiness: every request was received
                assert server.alive()
            assert set(c.ping()) == {"slow"}  # others are served meanwhile
            assert np.array_equal(c.get(NS, "big", 0, 5)[0], k[:, :5])
            with Client(server.endpoint, timeout_s=30) as other:
                while other.shard_stats()[0]["server_queue_depth"] > 0:  # readiness: all of them ran
                    pass
            grown = server.rss_bytes() - rss_before
            metrics = server.metrics()
            assert metrics["replies_dropped"] > 0
            assert grown < 48 * MIB, f"server RSS grew by {grown / MIB:.0f} MiB for {n} MiB of unread replies"
    finally:
        ctx.destroy(linger=0)
        server.stop()


@pytest.mark.timeout(60)
def test_overload_gets_busy_replies_and_busy_requests_do_not_run() -> None:
    server = ServerProcess("busy", level="q4", server={"max_queued_requests": 4})
    ctx = zmq.Context()
    try:
        with Client(server.endpoint, timeout_s=30) as c:
            c.register(NS, **LAYOUT)
        sock = raw_dealer(ctx, server.endpoint)
        big_k, big_v = kv(tokens=60_000, seed=5)
        small_k, small_v = kv(tokens=1, seed=6)
        sock.send_multipart(p.encode_request(p.AppendRequest(request_id=1000, namespace=NS, seq_id="slow",
                                                             keys=big_k, values=big_v)))
        n = 60
        for i in range(n):
            sock.send_multipart(p.encode_request(p.AppendRequest(request_id=i, namespace=NS, seq_id=f"b{i}",
                                                                 keys=small_k, values=small_v)))
        replies: dict[int, Any] = {}
        while len(replies) < n + 1:  # every request is answered: executed or Busy, never silence
            assert sock.poll(20_000), f"only {len(replies)} of {n + 1} replies"
            reply = p.decode_reply(sock.recv_multipart())
            assert reply.request_id is not None
            replies[reply.request_id] = reply
        busy = [i for i in range(n) if isinstance(replies[i], p.ErrorReply) and replies[i].code == Busy.code]
        done = [i for i in range(n) if isinstance(replies[i], p.AppendReply)]
        assert busy and len(busy) + len(done) == n
        assert "not executed" in replies[busy[0]].message
        with Client(server.endpoint, timeout_s=30) as c:
            for i in busy:
                with pytest.raises(UnknownSequence):
                    c.length(NS, f"b{i}")
            assert all(c.length(NS, f"b{i}") == 1 for i in done)
        assert server.metrics()["busy"] == len(busy)
    finally:
        ctx.destroy(linger=0)
        server.stop()


def busy_twice() -> Callable[[Any], Any]:
    """An answer for :class:`Scripted`: Busy to the first two attempts of each request, then the real reply."""
    attempts = 0

    def answer(req: Any) -> Any:
        nonlocal attempts
        attempts += 1
        if attempts % 3:
            return p.error_reply(req.request_id, Busy("queue full"))
        return p.LengthReply(request_id=req.request_id, length=42)

    return answer


@pytest.mark.timeout(30)
def test_a_call_refused_busy_until_its_timeout_raises_busy_not_timeout() -> None:
    """Busy says the request did not run; a retry cut off by the deadline would say Timeout (an append: maybe
    run). With replies 0.3 s apart and a 1 s timeout, the retry sent at ~0.6 s could only be answered after the
    deadline: the client stops at the Busy it has (CI saw the Timeout 2 times in 40 with a real shard). That it
    raised Busy, not Timeout, is what shows it gave up before the deadline; no third attempt was sent."""
    def slow_busy(req: Any) -> Any:
        time.sleep(0.3)
        return p.ErrorReply(request_id=req.request_id, code=Busy.code, error="Busy", message="queue full")

    server = Scripted(slow_busy, shard_id="sb")
    try:
        with Client(server.endpoint, timeout_s=1.0) as c:
            for call in (lambda: c.append(NS, 1, *kv(tokens=1)), lambda: c.length(NS, 1)):
                before = len(server.requests)
                with pytest.raises(Busy, match="queue full"):
                    call()  # with the answer it had, not a Timeout after waiting for one past the deadline
                assert len(server.requests) - before == 2  # one retry fitted, a third attempt would not
    finally:
        server.close()


def test_the_client_retries_busy_with_backoff() -> None:
    server = Scripted(busy_twice(), shard_id="bt")
    try:
        with Client(server.endpoint, timeout_s=5) as c:
            t0 = time.monotonic()
            assert c.length(NS, 1) == 42 and len(server.requests) == 3
            assert time.monotonic() - t0 < 2
            with pytest.raises(Busy):  # pipelined calls are not retried
                c.append_nowait(NS, 1, *kv(tokens=1)).result()
    finally:
        server.close()
