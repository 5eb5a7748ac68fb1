"""The ROUTER loop every kvd server runs (:class:`RouterServer`): binding, socket options, CURVE, admission (the
queues and turns: :mod:`kvd.wire.server.admission`), replies, metrics (counted by :mod:`kvd.wire.server.metrics`).
:class:`~kvd.wire.server.shard.ShardServer` and :class:`~kvd.wire.server.topology.TopologyServer` say what a
request does. Wire format: docs/protocol.md; codec: :mod:`kvd.protocol`.

Theory of operation
-------------------
*One thread per server* owns its ROUTER socket: it receives, admits, executes and replies. A hand-off between
a receiving thread and a store thread costs about as much as a whole loopback round trip (two GIL hand-overs,
~40 us measured), so a small request that arrives at an idle server runs at once on the thread that received
it. The store's kernels release the GIL, so other threads of the process (the Ray actor, metrics readers) run
while a page is encoded.

*Admission (the busy policy).* Each turn of the loop first takes the messages ZeroMQ has ready, a few
(``DRAIN_BATCH``: ZeroMQ's ROUTER reads its connections in turn, the rest wait in their pipes), into each one's
peer's queue (one FIFO per connection), bounded for all peers together (``max_queued_requests`` requests,
``max_queued_bytes`` bytes; one request is always admitted when nothing is queued, whatever its size) and for
each peer (``max_peer_requests``, counting its requests on the bulk lane). A message over its peer's bound is
answered ``Busy`` (code 13) at once: only its request id is read (within the header's first 4 KiB, so a
refusal costs the same whatever the request's size), it is not executed, and its buffers are
freed. When the shared bound is full, a request of a peer that holds fewer than the heaviest peer takes that
peer's newest queued request's place, which is answered ``Busy`` instead: a peer that floods is refused, not
the peers it would crowd out. Then one request runs and is answered, taken from the peers *in turn*
(round-robin over the peers with requests queued; a peer that had nothing queued goes ahead of the rotation,
but never twice in a row while the rotation waits), and the loop drains again. So a request waits for at most
one request of every other peer with requests queued, however many one of them pipelines, and a client that
sends one request at a time waits for the request running when it arrives and at most one more (a client pipelining
1,500 ``lengths`` of 4,096 ids took another's p99 from 17 ms to 439 ms behind one shared FIFO; BENCHMARKS.md,
"Wire", "Fairness"); under overload a request gets ``Busy`` once it is read, never silence; requests of one
connection start in the order received; and the memory held by received requests is bounded by
``max_queued_bytes``. A long request that only reads may run *in slices* (a server's :meth:`_slices`: a shard's
``lengths`` of more than ``LOOKUP_SLICE`` ids), one slice a turn with its connection going to the back of the
rotation after each, so others wait for a slice of it, not the whole (each slice sees the store as it is then);
while one runs, the loop reads one message a turn (``DRAIN_WHILE_SLICING``), not a few.

*A peer that left* is learned as it leaves: the connection guard passes on ZeroMQ's disconnect events, each
naming the connection's socket inode, and the loop knows the inode of every connection it took a message from
(read once, at its first message, while the descriptor is still that connection's; a descriptor already closed
at the first message, or whose inode a departure named before, is a connection that left before the loop saw
it). The loop tells the guard of each connection it meets (:meth:`~kvd.wire.sockets.ConnectionGuard.met`): the
guard may read a connection's accept only after it closed, and would then never announce it. Of what such a
peer sent, queued or still delivered by ZeroMQ, the requests that only read are dropped unexecuted
(``requests_abandoned``): nobody would read their replies. Its writes (:data:`~kvd.wire.messages.STATE_OPS`:
append, drop, register, calibrate, told from the header's op without decoding the request) still run, so a
client that sends appends and closes keeps them. Learned only from a failed reply (EHOSTUNREACH, which
ZeroMQ gives once the departed peer's pipe is read to its end; until then a reply gets EAGAIN, like one to a
slow reader), a client that pipelines 1 MiB gets and leaves, again and again, kept every such connection in the
rotation with a get built for nobody, and the shard stalled for everyone well after the flood
(BENCHMARKS.md, "Fairness"). This applies to the identities the ROUTER makes (one per connection, never reused);
a peer that sets its own identity may come back under it, so its departure is learned as before.

*What peers make ZeroMQ hold* is bounded per server by :class:`~kvd.wire.sockets.ConnectionGuard`: ZeroMQ
assembles a whole multipart message before the loop sees it (``MAXMSGSIZE`` bounds a frame, not a message),
and keeps unread replies in each peer's pipe. The guard measures both per connection from the kernel's TCP
counters and cuts a peer that is sending one message over ``max_message_bytes``, and the largest holders while
all peers together hold more than ``max_inbound_bytes`` received-and-not-taken or ``max_reply_bytes`` of
unread replies (both default to twice ``max_message_bytes``). The loop itself drops a reply that would exceed
the reply budget unless its peer has read everything before (and the reply is small). Freed memory goes back
to the system once a heavy peer is cut or gone, and every ``trim_every_s`` (:func:`~kvd.wire.sockets.trim_malloc`).

*Replies* are sent without blocking. ``ROUTER_MANDATORY`` turns a reply to a vanished peer (EHOSTUNREACH) or to
a peer whose pipe is full (a slow reader at ``SNDHWM`` replies: EAGAIN) into an error instead of a silent drop:
the reply is discarded and counted (``replies_dropped``), and the loop goes on serving everyone else. A slow
reader therefore pins at most ``SNDHWM`` replies, and all slow readers together at most ``max_reply_bytes``.
Heartbeats (``ZMQ_HEARTBEAT_*``) close connections to dead peers, which frees their pipes.

*Bad input* never reaches the store: :func:`kvd.protocol.parse_request` checks every field and frame first and
the error reply names the problem. A frame over ``MAXMSGSIZE`` (the protocol's ``max_frame_bytes``) makes
ZeroMQ cut that peer; everyone else is unaffected.

*Memory.* Requests and replies of MiBs allocate buffers of that size on every call; :meth:`ShardServer.start`
makes glibc recycle them (:func:`tune_malloc`) instead of paying a page fault per 4 KiB of fresh memory.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.auth
import zmq.backend
from zmq.auth.thread import ThreadAuthenticator

from kvd import __version__
from kvd.codec import pages
from kvd.errors import Busy, ConfigError, KvdError
from kvd.wire import protocol as p
from kvd.wire.curve import ZAP_DOMAIN, AllowList, CurveConfig
from kvd.wire.server.admission import FULL, OVER_SHARE, Admission
from kvd.wire.server.departures import Departures
from kvd.wire.server.lane import BulkLane
from kvd.wire.server.metrics import Metrics
from kvd.wire.sockets import (
    HANDSHAKE_TIMEOUT_S,
    TRIM_EVERY_S,
    ConnectionGuard,
    recv_frames,
    send_frames,
    socket_buffer_cap,
)

__all__ = ["DEFAULT_HWM", "DEFAULT_LINGER_S", "DEFAULT_MAX_PEER_REQUESTS", "DEFAULT_MAX_QUEUED_BYTES",
           "DEFAULT_MAX_QUEUED_REQUESTS", "IDLE_TICK_S", "MIN_SOCKET_BUFFER_BYTES", "RouterServer", "ToBulkLane"]

log = logging.getLogger("kvd.wire.server")

DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_MAX_QUEUED_BYTES = 256 * 1024 * 1024
# One peer's requests queued or on the bulk lane: four times a client's pipelining window (kvd.client's
# DEFAULT_WINDOW, 64), a quarter of the shared queue, so no one peer can take the whole queue.
DEFAULT_MAX_PEER_REQUESTS = 256
# Replies per peer (SNDHWM); replies to a slow reader beyond it are dropped (their bytes are bounded by the reply
# budget). ZeroMQ's pipe learns what its reader took only every (hwm + 1) // 2 messages, so a peer that reads
# everything as it comes can still find the pipe "full" with hwm // 2 + 1 replies outstanding: at 64, a client
# pipelining its window of 64 appends lost a reply now and then (and waited out its timeout). So the bound is
# four times a peer's share of the queue (max_peer_requests): over twice what a peer that reads may have
# outstanding, with room for the Busy replies of one past its share.
DEFAULT_HWM = 4 * DEFAULT_MAX_PEER_REQUESTS
DEFAULT_LINGER_S = 0.1  # at stop, replies already queued get this long to leave
IDLE_TICK_S = 0.05  # the longest a blocked receive waits before compaction and the stop flag are looked at
# Most messages admitted (or refused) per turn before the next request runs. ZeroMQ's ROUTER reads its connections
# in turn, so a few reads reach every connection with a message waiting; each read past a connection's share is a
# Busy that a client retrying at once answers with another message, so more reads per turn would only spend the
# loop on refusals (under a flood of 4,096-id lengths, a polite client's p99 was 59.6 ms at 256 a turn against
# 6.7 ms at 4, lookups run whole: bench/wire.py --fairness --loop-variants; BENCHMARKS.md, "Fairness").
DRAIN_BATCH = 4
# Most messages read a turn while a request runs in slices (a long lookup: ShardServer's LOOKUP_SLICE): its
# turns are short, and four reads a turn made the loop read (and refuse) a flooder's retries about twice as
# often (under a 4,096-id lengths flood, a polite client's p99 6.46 ms and p50 1.40 ms at four reads, 5.35 and
# 1.36 ms at one, 6.71 and 2.22 ms with the lookup run whole: same command).
DRAIN_WHILE_SLICING = 1
MIN_SOCKET_BUFFER_BYTES = 4096  # the smallest socket_buffer_bytes taken (Linux doubles it and floors it too)
GUARD_INTERVAL_S = 0.01  # how often the connection guard looks at every connection (see ConnectionGuard)
# Plain ints and pyzmq's backend methods on the hot path: the sugar layer's enum flags and option wrappers cost
# microseconds per call, a measurable share of a small request.
_SNDMORE, _NOBLOCK, _POLLIN = int(zmq.SNDMORE), int(zmq.NOBLOCK), int(zmq.POLLIN)
_EVENTS, _RCVMORE, _SRCFD = int(zmq.EVENTS), int(zmq.RCVMORE), int(zmq.SRCFD)
_DONTWAIT = int(zmq.DONTWAIT)
_EHOSTUNREACH = int(zmq.EHOSTUNREACH)
_SNDMORE_NOBLOCK = _SNDMORE | _NOBLOCK
_get = zmq.backend.Socket.get
_send = zmq.backend.Socket.send


class ToBulkLane(Exception):
    """Raised by a server's ``_execute`` on the loop thread for a request to run on the bulk lane instead; nothing
    was done for it yet. The loop hands the request to the lane as if ``_is_bulk`` had said so."""


class RouterServer:
    """The ROUTER loop shared by both servers: binding, socket options, CURVE, admission, replies, metrics.
    Subclasses implement :meth:`_execute` (a request -> a reply message) and may override :meth:`_idle`."""

    _NAME = "server"
    _IO_THREADS = 1  # ZeroMQ I/O threads of the server's context

    def __init__(self, *, host: str, port: int, limits: p.Limits | None, curve: CurveConfig | None,
                 max_queued_requests: int, max_queued_bytes: int, hwm: int,
                 heartbeat_ivl_s: float, heartbeat_timeout_s: float, linger_s: float,
                 max_inbound_bytes: int | None = None, max_reply_bytes: int | None = None,
                 guard_interval_s: float = GUARD_INTERVAL_S, socket_buffer_bytes: int = 0,
                 max_peer_requests: int = DEFAULT_MAX_PEER_REQUESTS, trim_every_s: float = TRIM_EVERY_S) -> None:
        if curve is not None and not isinstance(curve, CurveConfig):
            raise ConfigError(f"curve must be a CurveConfig, got {type(curve).__name__}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"port must be an integer in [0, 65535], got {port!r}")
        self._host, self._port = host, port
        self._limits = limits or p.DEFAULT_LIMITS
        # what all peers together may make ZeroMQ hold: by default two of the largest legal messages each way
        if max_inbound_bytes is None:
            max_inbound_bytes = 2 * self._limits.max_message_bytes
        if max_reply_bytes is None:
            max_reply_bytes = 2 * self._limits.max_message_bytes
        for name, value in (("max_queued_requests", max_queued_requests), ("max_queued_bytes", max_queued_bytes),
                            ("max_peer_requests", max_peer_requests), ("hwm", hwm),
                            ("max_inbound_bytes", max_inbound_bytes),
                            ("max_reply_bytes", max_reply_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(socket_buffer_bytes, bool) or not isinstance(socket_buffer_bytes, int) \
                or socket_buffer_bytes < 0 or 0 < socket_buffer_bytes < MIN_SOCKET_BUFFER_BYTES:
            raise ConfigError(f"socket_buffer_bytes must be 0 (the system's, autotuned) or at least "
                              f"{MIN_SOCKET_BUFFER_BYTES}, got {socket_buffer_bytes!r}")
        self._socket_buffer = socket_buffer_bytes
        if max_inbound_bytes < self._limits.max_message_bytes:
            raise ConfigError(f"max_inbound_bytes {max_inbound_bytes} is less than max_message_bytes "
                              f"{self._limits.max_message_bytes}: the largest legal request would be cut")
        if isinstance(guard_interval_s, bool) or not isinstance(guard_interval_s, (int, float)) \
                or not 0 < guard_interval_s <= 1:
            raise ConfigError(f"guard_interval_s must be in (0, 1], got {guard_interval_s!r}")
        if isinstance(trim_every_s, bool) or not isinstance(trim_every_s, (int, float)) or not trim_every_s > 0:
            raise ConfigError(f"trim_every_s must be a positive number of seconds, got {trim_every_s!r}")
        self._trim_every = float(trim_every_s)
        self._max_inbound, self._max_reply, self._guard_interval = max_inbound_bytes, max_reply_bytes, \
            float(guard_interval_s)
        self._guard: ConnectionGuard | None = None
        self._curve = curve
        self._hwm = hwm
        self._heartbeat = (heartbeat_ivl_s, heartbeat_timeout_s)
        self._linger_ms = int(linger_s * 1000)
        self._metrics = Metrics()
        # the requests received and not yet answered, per connection, and their turns (loop thread only)
        self._admission = Admission(max_queued_requests, max_queued_bytes, max_peer_requests)
        self._departed = Departures(self._abandon, self._met)  # which connections have left (loop thread only)
        self._endpoint: str | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._compact_every = 0  # requests between idle-work calls under load (0: only when idle)
        self._since_idle = 0
        self._ctx: zmq.Context[Any] | None = None
        self._lane: BulkLane | None = None  # a shard's bulk lane (started by _main when _wants_lane)
        self._loop_thread = -1  # the serving thread's id (threading.get_ident()), once it runs

    # -------------------------------------------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 10.0) -> str:
        """Bind, start the serving thread and return once it serves: ``"tcp://host:port"``. Raises the bind
        error (e.g. the port is taken) or :class:`ConfigError`."""
        if self._thread is not None:
            raise ConfigError(f"{self._NAME} already started")
        self._thread = threading.Thread(target=self._main, name=f"kvd-{self._NAME}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self._stopping.set()
            raise ConfigError(f"{self._NAME} did not start within {timeout_s} s")
        if self._start_error is not None:
            self._thread.join(timeout_s)
            raise self._start_error
        assert self._endpoint is not None
        return self._endpoint

    @property
    def endpoint(self) -> str:
        """``"tcp://host:port"`` once started."""
        if self._endpoint is None:
            raise ConfigError(f"{self._NAME} is not started")
        return self._endpoint

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the socket (replies already queued get ``linger_s`` to leave). Idempotent."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("%s at %s did not stop within %s s", self._NAME, self._endpoint, timeout_s)

    def metrics(self) -> dict[str, Any]:
        """Counters: requests (messages received), errors (error replies, Busy excluded), busy (of those:
        busy_share, refused because their peer was over its share), requests_abandoned (reads queued for, or sent
        by, a peer that left: not executed), peers_queued (connections with requests queued now),
        requests_per_s (over the last 10 s), bulk_requests (run on a shard's bulk lane), bulk_depth (waiting or
        running on it now; counted in queue_depth),
        bytes_in / bytes_out (frames after the identity),
        replies_dropped (peer gone or not reading, or over the reply budget), replies_over_budget (of those: over
        ``max_reply_bytes``), peers_cut (by the connection guard), peers_left (connections that ended, as the
        guard saw them), replies_held_bytes (replies not yet in the
        kernel, last look), queue_depth, queued_bytes, queue_peak, compactions, compacted_bytes, uptime_s,
        socket_buffer_bytes (each connection's TCP buffers as asked of the kernel; 0: the system's, autotuned),
        max_reply_bytes (the reply budget in force)."""
        guard, adm = self._guard, self._admission
        out = self._metrics.snapshot(adm.queued + adm.bulk_pending, adm.queued_bytes,
                                     guard.cuts if guard else 0, guard.held_total if guard else 0,
                                     adm.bulk_pending, len(adm.peers))
        out["peers_left"] = guard.departures if guard else 0
        out["socket_buffer_bytes"] = self._socket_buffer
        out["max_reply_bytes"] = self._max_reply
        return out

    def __enter__(self) -> RouterServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------------------------------------- socket

    def _open(self, ctx: zmq.Context[Any]) -> zmq.Socket[Any]:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable / full -> error, never a silent drop
        # the transport cut for one frame: a peer cannot make us buffer more than the largest legal frame
        sock.setsockopt(zmq.MAXMSGSIZE, max(self._limits.max_frame_bytes, self._limits.max_header_bytes))
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        # No inbound limit in ZeroMQ: libzmq 4.3.5 aborts the process (`!_io_error`, stream_engine_base.cpp) when a
        # peer whose input it stopped at RCVHWM closes while replies to it are pending (libzmq issue 4841), which
        # any client that pipelines gets and leaves can make happen. What peers make ZeroMQ hold inbound is
        # bounded by the guard instead (max_inbound_bytes), and each peer's share by admission (Busy).
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        ivl, timeout = self._heartbeat
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(ivl * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout * 1000))  # peers drop us when we stop heartbeating
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_TIMEOUT_S * 1000))  # garbage peers are cut
        sock.setsockopt(zmq.RCVTIMEO, int(IDLE_TICK_S * 1000))
        if self._socket_buffer:  # every accepted connection's SO_SNDBUF / SO_RCVBUF (see ShardServer)
            sock.setsockopt(zmq.SNDBUF, self._socket_buffer)
            sock.setsockopt(zmq.RCVBUF, self._socket_buffer)
            cap = socket_buffer_cap()
            if cap is not None and cap < self._socket_buffer:
                log.warning("%s: socket buffers of %d bytes asked, but Linux cuts them to %d "
                            "(net.core.rmem_max / wmem_max); raise those with sysctl to get the size asked",
                            self._NAME, self._socket_buffer, cap)
        # A ZAP domain makes ZeroMQ refuse ZMTP 1.0 peers, i.e. anything whose first byte is not 0xFF: without
        # it a peer sending random bytes is taken for a 1.0 peer and held open for good (the handshake timeout
        # ends with the greeting). With NULL security and no ZAP handler every ZMTP 3 peer is still admitted.
        sock.zap_domain = ZAP_DOMAIN.encode()
        if self._curve is not None:
            sock.curve_secretkey = self._curve.secret_key
            sock.curve_publickey = self._curve.public_key
            sock.curve_server = True
        # before bind: the guard must know every connection (accepted / disconnected, with its descriptor)
        self._guard = ConnectionGuard(
            sock.get_monitor_socket(int(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)),
            curve=self._curve is not None, max_message_bytes=self._limits.max_message_bytes,
            max_inbound_bytes=self._max_inbound, max_reply_bytes=self._max_reply, interval_s=self._guard_interval,
            name=f"kvd-{self._NAME}", trim_every_s=self._trim_every)
        host = self._host
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        try:
            sock.bind(f"tcp://{host}:{self._port if self._port else '*'}")
        except BaseException:
            self._close_guard(sock)
            sock.close(0)  # an open socket would make ctx.term() wait forever
            raise
        if not self._guard.start():
            self._close_guard(sock)
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        self._endpoint = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        return sock

    def _main(self) -> None:
        self._loop_thread = threading.get_ident()
        ctx: zmq.Context[Any] = zmq.Context(io_threads=self._IO_THREADS)
        self._ctx = ctx
        auth: ThreadAuthenticator | None = None
        sock = None
        try:
            if self._curve is not None:
                auth = ThreadAuthenticator(ctx, log=log.getChild("auth"))
                auth.start()  # before bind: without a ZAP handler CURVE would admit every key
                if self._curve.authorized_keys is None:
                    auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
                else:
                    auth.configure_curve_callback(domain=ZAP_DOMAIN,
                                                  credentials_provider=AllowList(self._curve.authorized_keys))
            sock = self._open(ctx)
            if self._wants_lane:
                self._lane = BulkLane(ctx, self._reply, self._idle, compact_every=self._compact_every,
                                      tick_s=IDLE_TICK_S, name=f"kvd-{self._NAME}-bulk")
        except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
            self._start_error = exc if isinstance(exc, Exception) else RuntimeError(str(exc))
            self._ready.set()
            if sock is not None:
                sock.close(0)
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)
            return
        self._ready.set()
        try:
            self._loop(sock)
        except Exception:  # pragma: no cover - the loop catches everything per request; this is a last resort
            log.exception("%s at %s crashed", self._NAME, self._endpoint)
        finally:
            lane, self._lane = self._lane, None
            if lane is not None:
                lane.stop()
            self._close_guard(sock)
            sock.close(self._linger_ms)
            if auth is not None:
                auth.stop()
            ctx.term()

    def _close_guard(self, sock: zmq.Socket[Any]) -> None:
        guard, self._guard = self._guard, None
        if guard is None:
            return
        # the monitor goes first: libzmq's I/O thread sends its events blocking, so the guard reads until then
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        guard.stop()

    # -------------------------------------------------------------------------------------------- serving

    def _loop(self, sock: zmq.Socket[Any]) -> None:
        stopping = self._stopping
        idle_work = True
        while not stopping.is_set():
            try:
                idle_work = self._turn(sock, idle_work)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM or stopping.is_set():
                    return
                log.exception("%s at %s: socket error, serving on", self._NAME, self._endpoint)
            except Exception:  # noqa: BLE001 - one bad turn must not stop the server
                log.exception("%s at %s: unexpected error, serving on", self._NAME, self._endpoint)

    def _turn(self, sock: zmq.Socket[Any], idle_work: bool) -> bool:
        """One turn: receive (blocking only when idle), admit everything ready, run the oldest request (or hand
        it to the bulk lane). Returns whether idle work (compaction) remains."""
        guard = self._guard
        lane = self._lane
        adm = self._admission
        if lane is not None and adm.bulk_pending:
            self._deliver(sock, lane)
        if not adm.queued:
            if lane is not None and adm.bulk_pending:  # wait for a message or for the bulk lane's next reply
                lane.wait(sock)
                self._deliver(sock, lane)
                if not int(_get(sock, _EVENTS)) & _POLLIN:
                    return False
                self._admit(sock, recv_frames(sock))
            elif idle_work and lane is None:  # a backlog remains: a message if one is waiting, else the backlog
                if not sock.poll(0, zmq.POLLIN):
                    if guard is not None:
                        guard.drains += 1  # (a drain: no complete message was waiting; see ConnectionGuard)
                    return self._idle()
                self._admit(sock, recv_frames(sock))
            elif not self._receive(sock):  # nothing for IDLE_TICK_S: idle work (a shard's lane does its own)
                return False if lane is not None else self._idle()
        n = 0
        batch = DRAIN_WHILE_SLICING if adm.slicing else DRAIN_BATCH
        while n < batch:
            if not int(_get(sock, _EVENTS)) & _POLLIN:
                if guard is not None:
                    guard.drains += 1
                break
            self._admit(sock, recv_frames(sock))
            n += 1
        if guard is not None and guard.departed:  # before a request runs: none for a peer that left
            self._departed.take(guard.departed)
        if not adm.queued:
            return idle_work
        ident, frames, size, fd = adm.take()
        reply = self._run(frames, ident, size, fd)
        del frames  # the request's buffers go before the reply is sent
        if reply is None:  # on the bulk lane: its bytes stay queued until it is answered
            return idle_work
        adm.ran(size)
        self._send(sock, ident, reply, fd)
        if lane is not None:
            return False
        self._since_idle += 1
        if self._since_idle >= self._compact_every > 0:
            return self._idle()
        return idle_work

    def _receive(self, sock: zmq.Socket[Any]) -> bool:
        """Admit one message, waiting up to IDLE_TICK_S (RCVTIMEO) for it; False if none came."""
        try:
            self._admit(sock, recv_frames(sock))
            return True
        except zmq.Again:
            if self._guard is not None:
                self._guard.drains += 1
            return False

    def _deliver(self, sock: zmq.Socket[Any], lane: BulkLane) -> None:
        """Send the replies the bulk lane has finished (on the loop thread, which owns the socket)."""
        done = lane.done
        metrics = self._metrics
        adm = self._admission
        while done:
            ident, reply, size, fd, error = done.popleft()
            adm.from_lane(ident, size)
            if error:
                metrics.errors += 1
            self._send(sock, ident, reply, fd)

    def _admit(self, sock: zmq.Socket[Any], msg: list[zmq.Frame]) -> None:
        metrics = self._metrics
        metrics.requests += 1
        metrics.tick(time.monotonic())
        ident = msg[0].bytes
        frames = msg[1:]
        del msg  # (a refused request's buffers are freed as soon as it is answered)
        lens = [len(f) for f in frames]
        size = sum(lens)
        metrics.bytes_in += size
        fd = -1
        guard = self._guard
        if guard is not None:  # what the loop took from this connection (ZeroMQ no longer holds it)
            fd = frames[0].get(_SRCFD)
            guard.took(fd, lens)
            if ident[:1] == b"\0" and fd >= 0 and self._left(guard, ident, fd) \
                    and not _writes(frames):  # (a ROUTER-made identity; a write still runs)
                metrics.requests_abandoned += 1
                return
        adm = self._admission
        depth = adm.admit(ident, frames, size, fd)
        if depth == OVER_SHARE:
            metrics.busy_share += 1
            self._refuse(sock, ident, frames, fd,
                         f"this connection has {adm.held(ident)} requests queued, its share of the server's queue "
                         f"(max_peer_requests {adm.max_peer})")
            return
        if depth == FULL:
            depth = adm.queued + adm.bulk_pending
            if not self._make_room(sock, ident, size):
                self._refuse(sock, ident, frames, fd,
                             f"server queue full ({depth} request{'s' if depth != 1 else ''}, "
                             f"{adm.queued_bytes} bytes queued)")
                return
            depth = adm.push(ident, frames, size, fd)
        if depth > metrics.queue_peak:
            metrics.queue_peak = depth

    def _refuse(self, sock: zmq.Socket[Any], ident: bytes, frames: list[zmq.Frame], fd: int, why: str) -> None:
        """Answer a request ``Busy`` without running it (its buffers go first)."""
        self._metrics.busy += 1
        rid = _peek_id(frames)
        del frames[:]
        self._send(sock, ident, p.encode_reply(p.ErrorReply(
            request_id=rid, code=Busy.code, error="Busy",
            message=f"{why}; the request was not executed: retry after a short backoff")), fd)

    def _make_room(self, sock: zmq.Socket[Any], ident: bytes, size: int) -> bool:
        """The shared queue is full: refuse (``Busy``) the newest queued requests of the peers that hold more than
        the arriving request's peer, heaviest first, until the request fits. False if it cannot (its peer is
        among the heaviest: it is the one over its share)."""
        adm = self._admission
        metrics = self._metrics
        while adm.full(size):
            taken = adm.displace(ident, size)
            if taken is None:
                return False
            victim, frames, fd = taken
            metrics.busy_share += 1
            self._refuse(sock, victim, frames, fd,
                         "this connection holds more of the server's full queue than others; its newest request "
                         "made room for another connection's")
        return True

    def _abandon(self, ident: bytes) -> None:
        """The peer is gone: its queued requests that only read are dropped unexecuted (nobody would read their
        replies); its writes stay queued and run."""
        self._metrics.requests_abandoned += self._admission.abandon(ident, _writes)

    def _met(self, fd: int, ino: int) -> None:
        """A connection's first message came on ``fd`` (socket inode ``ino``): the guard learns of it."""
        if self._guard is not None:
            self._guard.met(fd, ino)

    def _left(self, guard: ConnectionGuard, ident: bytes, fd: int) -> bool:
        """Whether the connection ``ident`` (a ROUTER-made identity) that sent a message on ``fd`` has left."""
        return self._departed.left(guard.departed, ident, fd)

    def _run(self, frames: list[zmq.Frame], ident: bytes, size: int, fd: int) -> list[p.Frame] | None:
        """Parse, execute and encode: the reply frames; or None when the request went to the bulk lane (its
        reply comes back through :meth:`_deliver`) or has slices left (it is queued again). Never raises."""
        adm = self._admission
        going = adm.slicing.pop(ident, None)
        if going is not None:  # the front of this connection's queue is its request in slices: the next one
            return self._slice(going[0], going[1], frames, ident, size, fd)
        views = [f.buffer for f in frames]
        req = p.parse_request(views, self._limits)
        if isinstance(req, p.ErrorReply):
            self._metrics.errors += 1
            return p.encode_reply(req)
        lane = self._lane
        if lane is not None and (ident in adm.bulk_owed or self._is_bulk(req, size)):
            self._to_lane(lane, ident, req, frames, size, fd)
            return None
        slices = self._slices(req)
        if slices is not None:
            return self._slice(req, slices, frames, ident, size, fd)
        try:
            reply, error = self._reply(req)
        except ToBulkLane:  # found large only as it ran, before anything was done (_reply: only with a lane)
            assert lane is not None
            self._to_lane(lane, ident, req, frames, size, fd)
            return None
        if error:
            self._metrics.errors += 1
        return reply

    def _slice(self, req: Any, slices: Iterator[None], frames: list[zmq.Frame], ident: bytes, size: int,
               fd: int) -> list[p.Frame] | None:
        """Run the next slice of ``req``: its reply frames after the last one; else None, and the request goes
        back to the front of its connection's queue, the connection to the back of the rotation."""
        reply, error = self._reply_slice(req, slices)
        if error:
            self._metrics.errors += 1
        if reply is not None:
            return reply
        self._admission.requeue(ident, frames, size, fd, (req, slices))
        return None

    def _slices(self, req: Any) -> Iterator[None] | None:
        """The slices of a long request that only reads, run one a turn with other connections' requests in
        between (a generator: it yields between slices and returns the reply); None to run it whole (the
        default). Each slice sees the store as it is when it runs. Only on the loop thread, so a request runs
        whole on the bulk lane."""
        return None

    def _to_lane(self, lane: BulkLane, ident: bytes, req: Any, frames: list[zmq.Frame], size: int,
                 fd: int) -> None:
        self._admission.to_lane(ident)
        self._metrics.bulk_requests += 1
        lane.submit((ident, req, frames, size, fd))

    def _reply(self, req: Any) -> tuple[list[p.Frame], bool]:
        """Execute a parsed request and encode its reply: ``(frames, whether it is an error reply)``. Runs on
        either lane; raises only :class:`ToBulkLane`, on the loop thread of a server with a bulk lane (anywhere
        else it is a bug, and the request's reply says so)."""
        try:
            return p.encode_reply(self._execute(req), self._limits), False
        except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the server
            if isinstance(exc, ToBulkLane) and self._lane is not None and self._on_loop():
                raise
            return self._failed(req, exc)

    def _reply_slice(self, req: Any, slices: Iterator[None]) -> tuple[list[p.Frame] | None, bool]:
        """Run the next of a request's ``slices``: like :meth:`_reply`, with frames None while slices remain."""
        try:
            next(slices)
        except StopIteration as done:
            return p.encode_reply(done.value, self._limits), False
        except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the server
            return self._failed(req, exc)
        return None, False

    def _failed(self, req: Any, exc: Exception) -> tuple[list[p.Frame], bool]:
        """The error reply to ``req``, which raised ``exc`` (in an ``except`` block: a bug is logged with it)."""
        if not isinstance(exc, KvdError):
            log.exception("%s: internal error on %s", self._NAME, type(req).__name__)  # (on the lane too)
        return p.encode_reply(p.error_reply(req.request_id, exc)), True

    _wants_lane = False  # a bulk lane for this server (ShardServer)

    def _is_bulk(self, req: Any, size: int) -> bool:
        """Whether a request runs on the bulk lane, known before it runs (see the module docstring). One found
        large only as it runs (a read: the store knows its size) makes :meth:`_execute` raise :class:`ToBulkLane`
        on the loop thread instead."""
        return False

    def _on_loop(self) -> bool:
        """Whether the calling thread is the serving loop's (not the bulk lane's)."""
        return threading.get_ident() == self._loop_thread

    def _send(self, sock: zmq.Socket[Any], ident: bytes, frames: list[p.Frame], fd: int) -> None:
        guard = self._guard
        lens = None
        if guard is not None and fd >= 0:
            lens = [len(f) for f in frames]
            if not guard.reply_allowed(fd, sum(lens)):  # replies not read by peers are at max_reply_bytes
                self._metrics.replies_dropped += 1
                self._metrics.replies_over_budget += 1
                return
        try:
            # only the identity part can fail (ROUTER checks the peer's pipe on the first part)
            _send(sock, ident, _SNDMORE_NOBLOCK, True, False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer left; EAGAIN: it is not reading (SNDHWM)
            self._metrics.replies_dropped += 1
            log.debug("%s: reply dropped (%s)", self._NAME, exc)
            if exc.errno == _EHOSTUNREACH:
                self._abandon(ident)
            return
        self._metrics.bytes_out += send_frames(sock, frames)
        if lens is not None and guard is not None:
            guard.gave(fd, lens)

    def _execute(self, req: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _idle(self) -> bool:
        """Work to do between requests; returns True while more remains (the loop then does not block)."""
        self._since_idle = 0
        return False

    def _hello(self, req: p.HelloRequest, *, role: str, name: str, page_tokens: int | None) -> p.HelloReply:
        # the newest page format this server writes: a calibrated namespace's pages with held heads are
        # version 2 (docs/formats.md), so a reader of version 1 only is told before it asks for pages
        return p.HelloReply.for_limits(self._limits, request_id=req.request_id, kvd_version=__version__,
                                       page_format_version=pages.HELD_VERSION, role=role, shard_id=name,
                                       page_tokens=page_tokens)


def _writes(frames: list[zmq.Frame]) -> bool:
    """Whether a request (its frames) changes state, told from its header's op without decoding it."""
    return p.changes_state(frames[0].buffer)


def _peek_id(frames: list[zmq.Frame]) -> int | None:
    """The request id of a message to refuse, if its header has a readable one: read within the header's first
    4 KiB (:func:`kvd.wire.protocol.salvage_request_id`), so refusing a flood of 4,096-id ``lengths`` does not
    decode 4,096 ids each."""
    try:
        return p.salvage_request_id(frames[0].buffer)
    except Exception:  # noqa: BLE001 - anything unreadable has no id
        return None
