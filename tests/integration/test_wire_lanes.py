"""A shard's two lanes (kvd.wire.server, "Two lanes"): a large request runs on the bulk lane while small ones
from other connections are answered; requests of one connection still run in the order sent; the bulk lane
compacts when idle. A real ShardServer on 127.0.0.1, real clients; the large request is held inside its
unlocked encode (a wrapped seal_rows) so the test decides when it ends."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from kvd.client import Client
from kvd.errors import Busy, ConfigError, KvdError
from kvd.store import Store
from kvd.store import pool as sp
from kvd.store import sequences as store_seq
from kvd.wire import protocol as p
from kvd.wire.server import BULK_MIN_BYTES, LOOPBACK_SOCKET_BUFFER_BYTES, ShardServer, loop
from kvd.wire.sockets import is_loopback, socket_buffer_cap

from tcp_buffers import tcp_buffers  # isort: skip  (tests/integration/tcp_buffers.py)

NS = "lanes"
LAYOUT = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 128}
TOKEN_BYTES = 2 * 4 * 8 * 128 * 2
BIG = BULK_MIN_BYTES // TOKEN_BYTES * 2  # tokens of an append that runs on the bulk lane
WAIT_S = 20.0


def kv(tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (4, tokens, 8, 128)
    return rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(np.float16)


class Gate:
    """Holds the first call of ``module.name`` made on the bulk lane's thread until :meth:`open`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        real = getattr(module, name)
        armed = [True]

        def held(*args: Any, **kwargs: Any) -> Any:
            if armed[0] and threading.current_thread().name.endswith("-bulk"):
                armed[0] = False
                self.entered.set()
                self.go.wait(WAIT_S)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, held)

    def open(self) -> None:
        self.go.set()


@pytest.fixture
def server() -> Iterator[ShardServer]:
    srv = ShardServer(Store(1 << 30), shard_id="lanes", recycle_memory=False)
    srv.start()
    with Client(srv.endpoint, timeout_s=WAIT_S) as c:
        c.register(NS, **LAYOUT)
    yield srv
    srv.stop()


@contextlib.contextmanager
def held(gate: Gate, fn: Any) -> Iterator[tuple[threading.Thread, list[Any]]]:
    """Run ``fn`` (a call that reaches ``gate``) in a thread; ``out`` gets its result or exception. Leaving the
    block opens the gate and waits for the thread, also when an assertion failed inside: the test's clients are
    closed after that, never under a call still using them (ZeroMQ aborts the process on a socket used from two
    threads: one such failure took the whole suite down)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield t, out
    finally:
        gate.open()
        t.join(WAIT_S)
        assert not t.is_alive(), "the held call did not finish after its gate opened"


def test_small_requests_of_other_connections_are_served_while_a_large_append_runs(
        server: ShardServer, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch, sp, "seal_rows")
    k, v = kv(BIG, 1)
    dk, dv = kv(1, 2)
    with Client(server.endpoint, timeout_s=WAIT_S) as prefill, Client(server.endpoint, timeout_s=5) as decode:
        decode.append(NS, "decode", dk, dv)
        with held(gate, lambda: prefill.append(NS, "prefill", k, v)) as (big, out):
            assert gate.entered.wait(WAIT_S), "the large append did not reach the bulk lane's encode"
            # the prefill is held mid-encode: a decode step, a read and a lookup of another client go through
            for n in range(2, 12):
                assert decode.append(NS, "decode", dk, dv) == n
            assert decode.length(NS, "decode") == 11
            np.testing.assert_array_equal(decode.get(NS, "decode")[0][:, -1:], dk)
            assert big.is_alive() and not out
            assert server.metrics()["bulk_depth"] == 1
        assert out == [BIG]
        np.testing.assert_array_equal(decode.get(NS, "prefill")[0], k)
    metrics = server.metrics()
    assert metrics["bulk_requests"] >= 2 and metrics["bulk_depth"] == 0  # the prefill and its large read


def test_a_busy_reply_counts_the_requests_on_the_bulk_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client told Busy learns how much is ahead of it, the bulk lane's requests included (it said 0 requests
    while a large append held the queue's bytes)."""
    k, v = kv(BIG, 1)
    srv = ShardServer(Store(1 << 30), shard_id="busy", recycle_memory=False, max_queued_bytes=k.nbytes * 2 + 4096)
    with srv, Client(srv.endpoint, timeout_s=WAIT_S) as prefill, Client(srv.endpoint, timeout_s=5) as other:
        prefill.register(NS, **LAYOUT)
        gate = Gate(monkeypatch, sp, "seal_rows")
        with held(gate, lambda: prefill.append(NS, "prefill", k, v)) as (_, out):
            assert gate.entered.wait(WAIT_S), "the large append did not reach the bulk lane's encode"
            # one attempt: append() would retry Busy for its whole timeout before raising it
            with pytest.raises(Busy, match=r"\(1 request, \d+ bytes queued\)"):
                other.append_nowait(NS, "second", k, v).result()  # does not fit beside the first: not run
        assert out == [BIG]
        assert other.lengths(NS, ["second"]) == [None]


def test_a_large_read_does_not_hold_small_requests(server: ShardServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(server.endpoint, timeout_s=WAIT_S) as c:
        k, v = kv(BIG, 3)
        c.append(NS, "big", k, v)
        c.append(NS, "small", *kv(1, 4))
    gate = Gate(monkeypatch, store_seq, "read_into")
    with Client(server.endpoint, timeout_s=WAIT_S) as reader, Client(server.endpoint, timeout_s=5) as other:
        with held(gate, lambda: reader.get(NS, "big")) as (_, out):
            assert gate.entered.wait(WAIT_S)
            assert other.append(NS, "small", *kv(1, 5)) == 2
            assert other.drop(NS, "big")  # the read in flight keeps what it started with
        np.testing.assert_array_equal(out[0][0], k)
        np.testing.assert_array_equal(out[0][1], v)


@pytest.mark.parametrize("fmt", ["fp16", "pages"])
def test_a_read_goes_to_the_bulk_lane_from_its_size_only(server: ShardServer, fmt: str) -> None:
    """The loop sends a get to the bulk lane when its range decodes to BULK_MIN_BYTES or more, in either format,
    and runs a smaller one itself: the store tells as it looks the range up, before reading."""
    tokens = BULK_MIN_BYTES // TOKEN_BYTES  # the fewest tokens whose keys and values are BULK_MIN_BYTES
    k, v = kv(tokens + 1, 8)
    with Client(server.endpoint, timeout_s=WAIT_S) as c:
        c.append(NS, "edge", k, v)
        for end, bulk in ((tokens - 1, False), (tokens, True), (None, True), (1, False)):
            before = server.metrics()["bulk_requests"]
            got = c.get(NS, "edge", 0, end, format=fmt)
            if fmt == "fp16":
                np.testing.assert_array_equal(got[0], k[:, :end])
            assert server.metrics()["bulk_requests"] - before == bulk, (end, bulk)


def test_a_request_the_bulk_lane_is_told_to_hand_on_gets_an_error_reply(server: ShardServer,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """ToBulkLane raised on the bulk lane itself (a bug: only the loop may hand a request on) costs that request
    an internal error reply, never the lane: the next large request is served."""
    k, v = kv(BIG, 9)
    with Client(server.endpoint, timeout_s=WAIT_S) as c:
        c.append(NS, "big", k, v)
        execute = server._execute

        def always_on(req: Any) -> Any:
            if isinstance(req, p.GetRequest) and req.seq_id == "big":
                raise loop.ToBulkLane
            return execute(req)

        monkeypatch.setattr(server, "_execute", always_on)
        with pytest.raises(KvdError, match="ToBulkLane|internal"):
            c.get(NS, "big")
        monkeypatch.setattr(server, "_execute", execute)
        np.testing.assert_array_equal(c.get(NS, "big")[0], k)


def test_requests_of_one_connection_run_in_the_order_sent(server: ShardServer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection pipelines a large append, then small requests on the same sequence: they wait for it (they
    follow it onto the bulk lane), and the replies come back in the order sent."""
    gate = Gate(monkeypatch, sp, "seal_rows")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.endpoint)
        k, v = kv(BIG, 6)
        sk, sv = kv(1, 7)
        requests = [p.AppendRequest(request_id=1, namespace=NS, seq_id="s", keys=k, values=v),
                    p.LengthRequest(request_id=2, namespace=NS, seq_id="s"),
                    p.AppendRequest(request_id=3, namespace=NS, seq_id="s", keys=sk, values=sv),
                    p.LengthRequest(request_id=4, namespace=NS, seq_id="s")]
        for req in requests:
            sock.send_multipart(p.encode_request(req))
        assert gate.entered.wait(WAIT_S)
        time.sleep(0.2)
        assert not sock.poll(0), "a small request of the connection overtook its large append"
        gate.open()
        replies = []
        while len(replies) < 4:
            assert sock.poll(int(WAIT_S * 1000))
            replies.append(p.decode_reply(sock.recv_multipart()))
        assert [r.request_id for r in replies] == [1, 2, 3, 4]
        assert [r.length for r in replies] == [BIG, BIG, BIG + 1, BIG + 1]
    finally:
        ctx.destroy(linger=0)


def test_the_bulk_lane_compacts_while_small_requests_are_served(server: ShardServer) -> None:
    with Client(server.endpoint, timeout_s=WAIT_S) as c:
        for i in range(4):
            c.append(NS, f"s{i}", *kv(BIG, 10 + i))
        server._store.set_level("q4", 1)  # a backlog of fp16 pages to re-encode
        deadline = time.monotonic() + WAIT_S
        n = 0
        while c.stats()["compaction_backlog_bytes"]:
            n += 1
            assert c.append(NS, "decode", *kv(1, 20)) == n  # served throughout
            assert time.monotonic() < deadline, c.stats()
    assert server.metrics()["compactions"] >= 1


@pytest.mark.skipif(not hasattr(threading, "get_native_id") or not __import__("sys").platform.startswith("linux"),
                    reason="per-thread nice values are Linux's")
def test_the_bulk_lane_yields_the_cpu_to_the_loop(server: ShardServer) -> None:
    from kvd.cluster.priority import thread_nice_values
    from kvd.wire.server import BULK_NICE

    lane = server._lane
    loop = server._thread
    assert lane is not None and loop is not None
    nice = thread_nice_values()
    mine, loops = nice[lane._thread.native_id], nice[loop.native_id]
    assert mine == min(19, loops + BULK_NICE)
    assert mine > loops or loops == 19  # the lane yields to the loop


def test_compaction_takes_the_store_lock_one_step_at_a_time(server: ShardServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane compacts its budget (8 MiB by default) in steps of COMPACT_STEP_BYTES, each a store call of its
    own, so a small request waits for one step at most, not for the whole budget."""
    from kvd.wire.server import COMPACT_STEP_BYTES

    store = server._store
    budgets: list[int] = []  # of the calls that re-encoded something
    real = store.compact

    def compact(budget: int) -> int:
        freed = real(budget)
        if freed:
            budgets.append(budget)
        return freed

    with Client(server.endpoint, timeout_s=WAIT_S) as c:
        for i in range(4):
            c.append(NS, f"s{i}", *kv(BIG, 30 + i))
        monkeypatch.setattr(store, "compact", compact)
        store.set_level("q8", 1)
        deadline = time.monotonic() + WAIT_S
        while c.stats()["compaction_backlog_bytes"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert len(budgets) > 4 and max(budgets) <= COMPACT_STEP_BYTES


def test_a_shard_moves_bytes_on_two_io_threads(server: ShardServer) -> None:
    """ZeroMQ gives each connection to one I/O thread: a shard has two, so a decode step's connection shares
    its I/O thread with at most about half of the prefilling ones."""
    assert server._ctx is not None and server._ctx.get(zmq.IO_THREADS) == 2


def test_socket_buffer_bytes_sets_every_connections_tcp_buffers(caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment can bound what ZeroMQ's I/O threads move per turn for one connection (the decode tail under
    prefills, docs/design.md): a size it names, 256 KiB by default on loopback, the system's autotuned buffers
    with 0 (and by default on other addresses)."""
    store = Store(1 << 28)
    store.register(NS, **LAYOUT)
    k, v = kv(300, 1)  # ~4.8 MB each way: autotuned buffers grow past their initial size
    cap = socket_buffer_cap()
    assert cap is not None  # Linux
    loopback = 2 * min(LOOPBACK_SOCKET_BUFFER_BYTES, cap)  # Linux doubles what it is asked, after the cap
    expected = {48 << 10: 2 * (48 << 10), None: loopback, 0: None}
    for size, want in expected.items():
        with ShardServer(store, shard_id=f"buffers-{size}", recycle_memory=False, socket_buffer_bytes=size) as srv:
            with Client(srv.endpoint) as client:
                client.append(NS, srv.shard_id, k, v)
                assert np.array_equal(client.get(NS, srv.shard_id)[0], k)
                buffers = tcp_buffers(int(srv.endpoint.rsplit(":", 1)[1]))
                asked = LOOPBACK_SOCKET_BUFFER_BYTES if size is None else size
                assert client.shard_stats()[0]["server_socket_buffer_bytes"] == asked  # what operators see
        assert buffers, f"no connection found for socket_buffer_bytes={size}"
        if want is None:  # autotuned: neither fixed size
            assert all(rb not in (2 * (48 << 10), loopback) for rb, _ in buffers), buffers
        else:
            assert buffers == [(want, want)], (size, buffers)
    # a size the kernel would cut is said in the log, with the sysctl that allows it
    monkeypatch.setattr(loop, "socket_buffer_cap", lambda: 64 << 10)
    with caplog.at_level("WARNING", logger="kvd.wire.server"):
        with ShardServer(store, shard_id="capped", recycle_memory=False, socket_buffer_bytes=128 << 10):
            pass
    assert "net.core.rmem_max" in caplog.text and str(64 << 10) in caplog.text
    for bad in (-1, 1, 4095, True, 1.5):
        with pytest.raises(ConfigError, match="socket_buffer_bytes"):
            ShardServer(store, shard_id="bad", recycle_memory=False, socket_buffer_bytes=bad)  # type: ignore[arg-type]


def test_loopback_hosts_are_told_apart_from_the_others() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.7", "::", "node-a", "", None))  # type: ignore[arg-type]
