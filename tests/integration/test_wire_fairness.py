"""One client does not starve the others (issue 32, section 4): a shard in another process, a client that
floods it with pipelined requests and a polite one that sends one request at a time, over real sockets.

What the polite client relies on: its request runs after at most one request of each other connection, not
after everything a flooder queued; it is not refused because another connection filled the queue; and the
flooder, not the polite client, is answered ``Busy`` past its share. Orders are observed through the store
itself (a flood of ``lengths`` that name the polite client's sequence tells, request by request, whether it ran
before or after the polite append), never through wall-clock times.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import zmq

from kvd.errors import Busy
from kvd.store import Store
from kvd.wire import protocol as p
from kvd.wire.server import ShardServer
from kvd.wire.server.loop import RouterServer
from kvd.wire.server.shard import LOOKUP_SLICE

from test_wire import LAYOUT, NS, ServerProcess, kv, raw_dealer, request  # isort: skip

pytestmark = pytest.mark.integration

IDS = 4096  # ids per flood `lengths` request (the hostile client)


def _lengths(i: int) -> list[bytes]:
    return p.encode_request(p.LengthsRequest(request_id=i, namespace=NS,
                                             seq_ids=("polite", *(f"x{j}" for j in range(IDS - 1)))))


def _flood(ctx: zmq.Context[Any], endpoint: str, n: int) -> zmq.Socket[Any]:
    sock = raw_dealer(ctx, endpoint, SNDHWM=0, RCVHWM=0)  # the client queues what the server does not take yet
    frames = _lengths(7)  # one request, sent n times (encoding 4,096 ids n times costs the test minutes)
    for _ in range(n):
        sock.send_multipart(frames)
    return sock


def _replies(server: ServerProcess, sock: zmq.Socket[Any], n: int) -> tuple[list[Any], int]:
    """The flood's replies and how many the server dropped: every request is answered (executed or Busy) or
    its reply is counted as dropped, because the flooder's pipe held ``SNDHWM`` unread replies when it was
    sent (the bound on what a peer that does not read can pin); never silence."""
    out: list[Any] = []
    deadline = time.monotonic() + 60
    while True:
        while sock.poll(200):
            reply = p.decode_reply(sock.recv_multipart())
            assert reply.request_id == 7
            out.append(reply)
        dropped = int(server.metrics()["replies_dropped"])
        if len(out) + dropped >= n:
            return out, dropped
        assert time.monotonic() < deadline, f"only {len(out)} of {n} replies, {dropped} dropped"


def _queued_at_least(server: ServerProcess, depth: int) -> dict[str, Any]:
    while True:  # readiness: the flood is received and queued (it only grows until the server has it all)
        metrics = server.metrics()
        if metrics["queue_depth"] >= depth:
            return metrics
        assert server.alive()


@pytest.mark.timeout(180)
def test_a_polite_request_runs_ahead_of_a_flooders_queue_and_the_flooder_gets_busy_past_its_share() -> None:
    server = ServerProcess("fair", server={"max_peer_requests": 128})
    ctx = zmq.Context()
    try:
        polite = raw_dealer(ctx, server.endpoint)
        assert isinstance(request(polite, p.RegisterRequest(request_id=1, namespace=NS, **LAYOUT)),
                          p.RegisterReply)
        n = 1500
        flood = _flood(ctx, server.endpoint, n)
        queued = _queued_at_least(server, 100)["queue_depth"]
        k, v = kv(tokens=1, seed=1)
        reply = request(polite, p.AppendRequest(request_id=2, namespace=NS, seq_id="polite", keys=k, values=v),
                        timeout_s=60)
        assert isinstance(reply, p.AppendReply), reply  # never Busy: the polite client is within its share
        replies, dropped = _replies(server, flood, n)
        ran = [r for r in replies if isinstance(r, p.LengthsReply)]
        busy = [r for r in replies if isinstance(r, p.ErrorReply) and r.code == Busy.code]
        assert len(ran) + len(busy) + dropped == n
        after = sum(r.lengths[0] == 1 for r in ran)  # flood requests that ran after the polite append
        # one shared FIFO ran every flood request queued before the append first (after == 0); in turns, the
        # append waits for one flood request, so nearly all of the queue runs after it
        assert after >= queued // 2, f"{after} flood requests ran after the polite append; {queued} were queued"
        metrics = server.metrics()
        # refused for its share, not for a full queue (a refusal's reply may be one of the dropped)
        assert busy and len(busy) <= metrics["busy_share"] <= len(busy) + dropped
        assert "its share" in busy[0].message and "not executed" in busy[0].message
        assert metrics["queue_peak"] <= 128 + 1 + 1  # the flooder's share, the polite append, one in progress
    finally:
        ctx.destroy(linger=0)
        server.stop()


@pytest.mark.timeout(180)
def test_a_full_queue_refuses_the_heaviest_connection_not_the_newcomer() -> None:
    """The shared queue's bytes are kept full by one flooder (it sends a request again for every reply): a
    polite client's requests, each larger than a flood request (so larger than the room one flood request
    leaves as it runs), all get in, in place of the flooder's newest queued requests, answered Busy instead."""
    flood_bytes = sum(len(f) for f in _lengths(0))
    server = ServerProcess("full", server={"max_queued_bytes": 40 * flood_bytes})
    ctx = zmq.Context()
    stop = threading.Event()
    flood_replies: list[Any] = []

    sent = [200]
    again = _lengths(7)

    def keep_flooding(sock: zmq.Socket[Any]) -> None:
        while not stop.is_set():
            if sock.poll(50):
                flood_replies.append(p.decode_reply(sock.recv_multipart()))
                sock.send_multipart(again)
                sent[0] += 1

    try:
        polite = raw_dealer(ctx, server.endpoint)
        assert isinstance(request(polite, p.RegisterRequest(request_id=1, namespace=NS, **LAYOUT)),
                          p.RegisterReply)
        flood = _flood(ctx, server.endpoint, 200)
        flooder = threading.Thread(target=keep_flooding, args=(flood,), daemon=True)
        flooder.start()
        _queued_at_least(server, 36)
        k, v = kv(tokens=2 * flood_bytes // 256 + 8, seed=2)  # 256 bytes a token: over twice a flood request
        assert k.nbytes + v.nbytes > 2 * flood_bytes
        for i in range(20):
            reply = request(polite, p.AppendRequest(request_id=10 + i, namespace=NS, seq_id=f"polite{i}", keys=k,
                                                    values=v), timeout_s=60)
            assert isinstance(reply, p.AppendReply), reply  # never Busy, though the queue is full
        stop.set()
        flooder.join(10)
        # every flood request is answered, but replies past the server's SNDHWM to a reader as slow as this
        # thread are dropped (replies_dropped): read what came
        while len(flood_replies) + server.metrics()["replies_dropped"] < sent[0]:
            assert flood.poll(60_000), f"{len(flood_replies)} of {sent[0]} flood replies"
            flood_replies.append(p.decode_reply(flood.recv_multipart()))
        while flood.poll(0):
            flood_replies.append(p.decode_reply(flood.recv_multipart()))
        made_room = [r for r in flood_replies if isinstance(r, p.ErrorReply) and "made room" in r.message]
        assert made_room, "no flood request was refused to make room for a polite one"
        for r in made_room:  # a request refused to make room did not run: the flooder may resend it
            assert r.code == Busy.code and "not executed" in r.message
    finally:
        stop.set()
        ctx.destroy(linger=0)
        server.stop()


@pytest.mark.timeout(180)
def test_the_requests_of_a_connection_that_left_are_not_run() -> None:
    """1 MiB gets pipelined by a peer that then leaves: once its departure is known, its other queued requests
    are dropped unexecuted, and a polite client is served throughout."""
    server = ServerProcess("gone", server={"hwm": 1024})
    ctx = zmq.Context()
    ghost_ctx = zmq.Context()
    try:
        polite = raw_dealer(ctx, server.endpoint)
        assert isinstance(request(polite, p.RegisterRequest(request_id=1, namespace=NS, **LAYOUT)),
                          p.RegisterReply)
        k, v = kv(tokens=8192, seed=3)  # 1 MiB of keys + values per get reply
        assert isinstance(request(polite, p.AppendRequest(request_id=2, namespace=NS, seq_id="big", keys=k,
                                                          values=v)), p.AppendReply)
        ghost = raw_dealer(ghost_ctx, server.endpoint, SNDHWM=0)
        n = 200
        before = server.metrics()["requests"]
        for i in range(n):
            ghost.send_multipart(p.encode_request(p.GetRequest(request_id=i, namespace=NS, seq_id="big")))
        ghost.close(linger=20_000)  # the requests are written out first, then the connection is closed
        ghost_ctx.term()
        while server.metrics()["requests"] < before + n:  # readiness: the server has every request
            assert server.alive()
        reply = request(polite, p.GetRequest(request_id=3, namespace=NS, seq_id="big", start=0, end=5))
        assert isinstance(reply, p.GetReply) and np.array_equal(reply.keys, k[:, :5])
        while server.metrics()["queue_depth"]:  # readiness: the ghost's requests ran or were dropped
            assert server.alive()
        metrics = server.metrics()
        assert metrics["requests_abandoned"] > 0
        assert metrics["requests_abandoned"] + metrics["replies_dropped"] <= n + 1
    finally:
        ghost_ctx.destroy(linger=0)
        ctx.destroy(linger=0)
        server.stop()


class _HeldServer(RouterServer):
    """A server whose requests only say hello, in this process; request id 0 holds its loop until :attr:`go` is
    set (and id 2 until :attr:`go_first` is), so the test decides what happens while the loop is busy.
    :attr:`ran` lists the ids it executed."""

    def __init__(self) -> None:
        super().__init__(host="127.0.0.1", port=0, limits=None, curve=None, max_queued_requests=1024,
                         max_queued_bytes=1 << 28, hwm=64, heartbeat_ivl_s=1.0, heartbeat_timeout_s=30.0,
                         linger_s=0.1)
        self.go = threading.Event()
        self.go_first = threading.Event()
        self.ran: list[int] = []

    def _execute(self, req: Any) -> Any:
        self.ran.append(req.request_id)
        if req.request_id in (0, 2):
            assert (self.go if req.request_id == 0 else self.go_first).wait(60)
        return self._hello(req, role="coordinator", name="held", page_tokens=None)


@pytest.mark.timeout(120)
def test_of_what_a_connection_sent_before_it_left_only_the_writes_run() -> None:
    """Two peers pipeline reads, then a write, and leave while the loop is busy: one the loop had served before,
    one it never saw. None of their reads runs (ZeroMQ still delivers them; nobody would read the replies); each
    one's write does (a client that sends and closes keeps its writes); a polite client is answered."""
    server = _HeldServer()
    server.start()
    ctx = zmq.Context()
    ghost_ctx = zmq.Context()
    n = 300
    try:
        polite = raw_dealer(ctx, server.endpoint)
        known = raw_dealer(ghost_ctx, server.endpoint, SNDHWM=0)
        assert isinstance(request(known, p.HelloRequest(request_id=1)), p.HelloReply)
        holder = raw_dealer(ctx, server.endpoint)
        holder.send_multipart(p.encode_request(p.HelloRequest(request_id=0)))
        while server.ran != [1, 0]:  # readiness: the loop is held
            time.sleep(0.01)
        unseen = raw_dealer(ghost_ctx, server.endpoint, SNDHWM=0)
        guard = server._guard
        assert guard is not None
        while len(guard._conns) < 4:  # readiness: the guard holds every connection, so it sees each one end
            time.sleep(0.01)
        for i in range(n):
            known.send_multipart(p.encode_request(p.HelloRequest(request_id=1000 + i)))
            unseen.send_multipart(p.encode_request(p.HelloRequest(request_id=2000 + i)))
        for sock, rid in ((known, 1500), (unseen, 2500)):
            sock.send_multipart(p.encode_request(p.DropRequest(request_id=rid, namespace="m", seq_id="s")))
        known.close(linger=20_000)  # the requests are written out, then the connections are closed
        unseen.close(linger=20_000)
        ghost_ctx.term()
        while server.metrics()["peers_left"] < 2:  # readiness: both departures are known
            time.sleep(0.01)
        polite.send_multipart(p.encode_request(p.HelloRequest(request_id=5)))
        server.go.set()
        assert holder.poll(10_000) and p.decode_reply(holder.recv_multipart()).request_id == 0
        assert polite.poll(10_000) and p.decode_reply(polite.recv_multipart()).request_id == 5
        while server.metrics()["requests"] < 2 + 2 * (n + 1) + 1 or server.metrics()["queue_depth"]:
            time.sleep(0.01)  # readiness: every message was taken and nothing is left queued
        assert sorted(i for i in server.ran if 1000 <= i < 3000) == [1500, 2500]
        assert server.metrics()["requests_abandoned"] == 2 * n
        assert isinstance(request(polite, p.HelloRequest(request_id=6)), p.HelloReply)
    finally:
        server.go.set()
        ghost_ctx.destroy(linger=0)
        ctx.destroy(linger=0)
        server.stop()


def test_a_connection_whose_departure_came_before_its_first_message_is_known_to_have_left() -> None:
    """ZeroMQ reports a disconnect before it closes the connection's descriptor, so the loop may read the first
    message of a connection that has already left while the descriptor is still its socket: its inode came with
    the departure, before the loop knew it; the connection must be taken as gone, not as a new live one."""
    import collections
    import os
    import socket

    server = _HeldServer()
    a, b = socket.socketpair()
    try:
        guard = type("Guard", (), {})()
        guard.departed = collections.deque([os.fstat(a.fileno()).st_ino])  # the departure, first
        assert server._left(guard, b"\0gone", a.fileno())  # then its first message, the descriptor still open
        guard.departed.append(os.fstat(b.fileno()).st_ino + 10**9)  # another connection's, never seen
        assert not server._left(guard, b"\0live", b.fileno())
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_connection_with_nothing_queued_goes_ahead_of_one_that_keeps_a_queue() -> None:
    """A client that keeps requests queued is served in turn; one that sends a request now and then (a decode
    step) waits for the request running when it arrives, not also for the flooder's next one."""
    server = _HeldServer()
    server.start()
    ctx = zmq.Context()
    try:
        flooder = raw_dealer(ctx, server.endpoint, SNDHWM=0)
        polite = raw_dealer(ctx, server.endpoint)
        assert isinstance(request(polite, p.HelloRequest(request_id=1)), p.HelloReply)
        # The flooder's first request (2) holds the loop while the rest reach ZeroMQ's pipe, so from then on
        # every turn reads more of them than it runs and the flooder keeps a queue: its request 0, the ninth
        # after the first, is taken in turn, not as a newcomer's (a newcomer is never taken twice in a row).
        ids = [2] + [100 + i for i in range(60)]
        ids[9] = 0  # the loop holds in it, with the flooder's later requests queued
        for rid in ids:
            flooder.send_multipart(p.encode_request(p.HelloRequest(request_id=rid)))
        while 2 not in server.ran:
            time.sleep(0.01)
        time.sleep(0.5)  # ZeroMQ's I/O thread moves the flooder's requests into the pipe within milliseconds
        server.go_first.set()
        while 0 not in server.ran:  # readiness: the loop is held, the flooder's later requests waiting
            time.sleep(0.01)
        polite.send_multipart(p.encode_request(p.HelloRequest(request_id=5)))
        time.sleep(0.5)  # ZeroMQ's I/O thread moves it into the pipe within milliseconds; the loop is held
        server.go.set()
        assert polite.poll(10_000) and p.decode_reply(polite.recv_multipart()).request_id == 5
        held = server.ran.index(0)
        assert server.ran[held + 1] == 5, server.ran[held:held + 4]
    finally:
        server.go.set()
        server.go_first.set()
        ctx.destroy(linger=0)
        server.stop()


def test_a_peer_that_reads_its_replies_never_finds_its_pipe_full() -> None:
    """ZeroMQ's pipe learns what its reader took only every (SNDHWM + 1) // 2 messages, so with SNDHWM replies
    a peer that reads everything can find the pipe full at SNDHWM // 2 + 1 outstanding, and the reply is dropped
    (the client then waits out its timeout): at SNDHWM 64 a client pipelining its window of 64 appends lost
    one reply in tens of thousands. What a peer may have outstanding (the client's window; its share of the queue,
    past which it gets Busy) must stay under that."""
    from kvd.client.core import DEFAULT_WINDOW
    from kvd.wire.server.loop import DEFAULT_HWM, DEFAULT_MAX_PEER_REQUESTS

    never_full_below = DEFAULT_HWM - (DEFAULT_HWM + 1) // 2 + 1
    assert never_full_below > max(DEFAULT_WINDOW, DEFAULT_MAX_PEER_REQUESTS)


class _HeldLookups(ShardServer):
    """A shard in this process whose first store lookup of a ``lengths`` of more than one slice holds the loop
    until :attr:`go` is set (:attr:`held` says it is held); :attr:`lookups` counts the ids of each lookup."""

    def __init__(self, **options: Any) -> None:
        super().__init__(Store(64 << 20), shard_id="sliced", recycle_memory=False, **options)
        self.go = threading.Event()
        self.held = threading.Event()
        self.lookups: list[int] = []

    def _lookup(self, namespace: str, seq_ids: Any) -> list[int | None]:
        self.lookups.append(len(seq_ids))
        if len(self.lookups) == 1 and len(seq_ids) > 1:
            self.held.set()
            assert self.go.wait(60)
        return super()._lookup(namespace, seq_ids)


def _polite(server: _HeldLookups, ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
    polite = raw_dealer(ctx, server.endpoint)
    assert isinstance(request(polite, p.RegisterRequest(request_id=1, namespace=NS, **LAYOUT)), p.RegisterReply)
    return polite


def _hold_long_lookup(server: _HeldLookups, ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
    """A connection that sent a ``lengths`` of IDS ids (request 3; the last id the polite client's sequence),
    once the loop is held in the lookup's first slice."""
    server.lookups.clear()
    long = raw_dealer(ctx, server.endpoint)
    long.send_multipart(p.encode_request(p.LengthsRequest(
        request_id=3, namespace=NS, seq_ids=(*(f"x{j}" for j in range(IDS - 1)), "polite"))))
    assert server.held.wait(30)  # readiness: the loop runs the lookup's first slice
    return long


@pytest.mark.timeout(120)
def test_a_long_lookup_runs_in_slices_with_other_connections_requests_between_them() -> None:
    """A ``lengths`` of 4,096 ids holds the loop for a slice at a time, not the whole lookup: an append that
    arrives while its first slice runs is served before the lookup ends (which its last slice sees), and the
    reply is the whole lookup's, in order."""
    assert IDS > 2 * LOOKUP_SLICE
    server = _HeldLookups()
    server.start()
    ctx = zmq.Context()
    try:
        polite = _polite(server, ctx)
        held = {5: 3, LOOKUP_SLICE + 1: 7, IDS - 2: 11}  # ids in the first, second and last slices: tokens
        for j, tokens in held.items():
            k, v = kv(tokens=tokens, seed=j)
            assert isinstance(request(polite, p.AppendRequest(request_id=2, namespace=NS, seq_id=f"x{j}", keys=k,
                                                              values=v)), p.AppendReply)
        long = _hold_long_lookup(server, ctx)
        k, v = kv(tokens=1, seed=1)
        polite.send_multipart(p.encode_request(p.AppendRequest(request_id=4, namespace=NS, seq_id="polite",
                                                               keys=k, values=v)))
        time.sleep(0.5)  # ZeroMQ's I/O thread moves it into the pipe within milliseconds; the loop is held
        server.go.set()
        assert polite.poll(10_000) and isinstance(p.decode_reply(polite.recv_multipart()), p.AppendReply)
        assert long.poll(10_000)
        reply = p.decode_reply(long.recv_multipart())
        assert isinstance(reply, p.LengthsReply) and reply.request_id == 3
        expected = [held.get(j) for j in range(IDS - 1)] + [1]  # the append ran before the last slice
        assert list(reply.lengths) == expected
        assert server.lookups == [LOOKUP_SLICE] * (IDS // LOOKUP_SLICE)
    finally:
        server.go.set()
        ctx.destroy(linger=0)
        server.stop()


@pytest.mark.timeout(120)
def test_a_long_lookup_of_a_connection_that_left_stops_and_the_loop_forgets_it() -> None:
    """The connection that sent a long lookup leaves during its first slice: the rest does not run, the loop
    keeps nothing of it (it would read one message a turn while it held a lookup in slices), and serves on."""
    server = _HeldLookups()
    server.start()
    ctx, gone_ctx = zmq.Context(), zmq.Context()
    try:
        polite = _polite(server, ctx)
        _hold_long_lookup(server, gone_ctx)
        gone_ctx.destroy(linger=0)
        deadline = time.monotonic() + 30
        while not server.metrics()["peers_left"]:  # readiness: the guard heard of the departure
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.go.set()
        assert isinstance(request(polite, p.PingRequest(request_id=5)), p.PingReply)
        assert server.metrics()["requests_abandoned"] == 1
        assert server.lookups == [LOOKUP_SLICE]
        assert not server._admission.slicing
    finally:
        server.go.set()
        ctx.destroy(linger=0)
        server.stop()


def _socket_inodes() -> set[str]:
    """The sockets this process has open (both ends of a connection to itself among them)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add(link)
    return found


@pytest.mark.timeout(120)
def test_a_connection_that_leaves_before_the_guard_hears_of_it_is_still_learned_gone() -> None:
    """A peer sends a long lookup and leaves before the connection guard's thread has read a single event (a busy
    machine): ZeroMQ has closed the connection by the time the guard reads its ACCEPTED, so the guard alone cannot
    know it; the loop, which met it, says so, and its lookup stops."""
    server = _HeldLookups()
    server.start()
    guard = server._guard
    assert guard is not None
    gate = threading.Event()
    read_events = guard._events

    def events_late() -> None:
        assert gate.wait(60)
        read_events()

    guard._events = events_late  # type: ignore[method-assign]
    ctx, gone_ctx = zmq.Context(), zmq.Context()
    try:
        polite = _polite(server, ctx)
        before = _socket_inodes()
        _hold_long_lookup(server, gone_ctx)
        gone_ctx.destroy(linger=0)
        deadline = time.monotonic() + 30
        while _socket_inodes() - before:  # readiness: ZeroMQ closed both ends of the connection that left
            assert time.monotonic() < deadline
            time.sleep(0.01)
        gate.set()
        while not server.metrics()["peers_left"]:
            assert time.monotonic() < deadline, "the departure of a connection the loop met was never learned"
            time.sleep(0.01)
        server.go.set()
        assert isinstance(request(polite, p.PingRequest(request_id=5)), p.PingReply)
        assert server.metrics()["peers_left"] == 1
        assert server.metrics()["requests_abandoned"] == 1
        assert server.lookups == [LOOKUP_SLICE]
    finally:
        gate.set()
        server.go.set()
        ctx.destroy(linger=0)
        server.stop()


@pytest.mark.timeout(120)
def test_a_long_lookup_refused_to_make_room_leaves_nothing_behind() -> None:
    """A full queue refuses the newest request of its heaviest connection: when that is a lookup between two of
    its slices, it is answered Busy, and the connection's next request is its own, not the lookup's rest."""
    server = _HeldLookups(max_queued_bytes=32 << 10)  # the long lookup (~23 KiB) and a 16 KiB append do not fit
    server.start()
    ctx = zmq.Context()
    try:
        polite = _polite(server, ctx)
        long = _hold_long_lookup(server, ctx)
        k, v = kv(tokens=64, seed=1)
        polite.send_multipart(p.encode_request(p.AppendRequest(request_id=4, namespace=NS, seq_id="polite",
                                                               keys=k, values=v)))
        time.sleep(0.5)  # in the pipe; the loop is held
        server.go.set()
        assert polite.poll(10_000) and isinstance(p.decode_reply(polite.recv_multipart()), p.AppendReply)
        assert long.poll(10_000)
        refused = p.decode_reply(long.recv_multipart())
        assert isinstance(refused, p.ErrorReply) and refused.code == Busy.code and refused.request_id == 3
        reply = request(long, p.LengthsRequest(request_id=5, namespace=NS, seq_ids=("polite", "x1")))
        assert isinstance(reply, p.LengthsReply) and reply.request_id == 5 and reply.lengths == (64, None)
        assert not server._admission.slicing
    finally:
        server.go.set()
        ctx.destroy(linger=0)
        server.stop()
