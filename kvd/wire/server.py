"""ZeroMQ servers: :class:`ShardServer` (the data path around one Store) and :class:`TopologyServer` (the
coordinator's topology endpoint). Wire format: docs/protocol.md; codec: :mod:`kvd.protocol`.

Theory of operation
-------------------
*One thread per server* owns its ROUTER socket: it receives, admits, executes and replies. A hand-off between
a receiving thread and a store thread costs about as much as a whole loopback round trip (two GIL hand-overs,
~40 us measured), so a small request that arrives at an idle server runs at once on the thread that received
it. The store's kernels release the GIL, so other threads of the process (the Ray actor, metrics readers) run
while a page is encoded.

*Two lanes (a shard).* A request that moves ``BULK_MIN_BYTES`` or more (an append of that size, a get whose
range decodes to that size) or may wait on another process (``register``, which asks the coordinator) runs on
the shard's *bulk lane*, a second thread, and its reply comes back to the loop to be sent. Small requests keep
running on the loop meanwhile, and the store encodes and decodes large requests without its lock (kvd.store,
"Threads"), so a decode step's append is never queued behind a 64 MiB prefill. Requests of one connection
still start in the order received: while one of its requests is on the bulk lane, the connection's next
requests follow it there. The bulk lane also compacts the store when it has nothing else to do. The shard's
ZeroMQ context has two I/O threads, so a connection's bytes do not wait behind every other connection's MiBs
either.

*Admission (the busy policy).* Each turn of the loop first drains every message ZeroMQ has ready into a bounded
FIFO (``max_queued_requests`` requests, ``max_queued_bytes`` bytes; one request is always admitted into an empty
queue whatever its size). A message that does not fit is answered ``Busy`` (code 13) at once: only its
request id is read, it is not executed, and its buffers are freed. Then the oldest queued request runs and is
answered, and the loop drains again. So under overload a request gets ``Busy`` within the time of the
operation in progress, never silence; requests of one connection start in the order received; and the
memory held by received requests is bounded by ``max_queued_bytes``.

*What peers make ZeroMQ hold* is bounded per server by :class:`~kvd.wire.sockets.ConnectionGuard`: ZeroMQ
assembles a whole multipart message before the loop sees it (``MAXMSGSIZE`` bounds a frame, not a message),
and keeps unread replies in each peer's pipe. The guard measures both per connection from the kernel's TCP
counters and cuts a peer that is sending one message over ``max_message_bytes``, and the largest holders while
all peers together hold more than ``max_inbound_bytes`` received-and-not-taken or ``max_reply_bytes`` of
unread replies (both default to twice ``max_message_bytes``). The loop itself drops a reply that would exceed
the reply budget unless its peer has read everything before (and the reply is small). Freed memory goes back
to the system once a heavy peer is cut or gone (:func:`~kvd.wire.sockets.trim_malloc`).

*Replies* are sent without blocking. ``ROUTER_MANDATORY`` turns a reply to a vanished peer (EHOSTUNREACH) or to
a peer whose pipe is full (a slow reader at ``SNDHWM`` replies: EAGAIN) into an error instead of a silent drop:
the reply is discarded and counted (``replies_dropped``), and the loop goes on serving everyone else. A slow
reader therefore pins at most ``SNDHWM`` replies, and all slow readers together at most ``max_reply_bytes``.
Heartbeats (``ZMQ_HEARTBEAT_*``) close connections to dead peers, which frees their pipes.

*Bad input* never reaches the store: :func:`kvd.protocol.parse_request` checks every field and frame first and
the error reply names the problem. A frame over ``MAXMSGSIZE`` (the protocol's ``max_frame_bytes``) makes
ZeroMQ cut that peer; everyone else is unaffected.

*Compaction* (:meth:`Store.compact`) runs between requests, with ``compact_budget_bytes`` per call: on the bulk
lane when it has no request (again at once while a backlog remains, else every ``IDLE_TICK_S``), and after every
``compact_every`` bulk requests.

*Memory.* Requests and replies of MiBs allocate buffers of that size on every call; :meth:`ShardServer.start`
makes glibc recycle them (:func:`tune_malloc`) instead of paying a page fault per 4 KiB of fresh memory.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.auth
import zmq.backend
from zmq.auth.thread import ThreadAuthenticator

from kvd import __version__
from kvd.codec import pages
from kvd.errors import (
    Busy,
    ConfigError,
    Conflict,
    KvdError,
    MessageTooLarge,
    ProtocolError,
    UnknownSequence,
    WrongShard,
)
from kvd.store.core import PACK_FRAME_BYTES, Store
from kvd.wire import protocol as p
from kvd.wire.curve import ZAP_DOMAIN, AllowList, CurveConfig, keygen
from kvd.wire.routing import Router
from kvd.wire.sockets import (
    COPY_THRESHOLD_BYTES,
    DEFAULT_HEARTBEAT_IVL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    HANDSHAKE_TIMEOUT_S,
    ConnectionGuard,
    recv_frames,
    send_frames,
    tune_malloc,
)

log = logging.getLogger(__name__)

# CurveConfig, keygen, tune_malloc and the frame helpers live in kvd.wire.curve and kvd.wire.sockets (re-exported)
__all__ = ["COPY_THRESHOLD_BYTES", "DEFAULT_HEARTBEAT_IVL_S", "DEFAULT_HEARTBEAT_TIMEOUT_S", "CurveConfig",
           "ShardServer", "TopologyServer", "keygen", "recv_frames", "send_frames", "tune_malloc"]

DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_MAX_QUEUED_BYTES = 256 * 1024 * 1024
DEFAULT_HWM = 64  # messages per peer and direction; replies to a slow reader beyond it are dropped
DEFAULT_LINGER_S = 0.1  # at stop, replies already queued get this long to leave
IDLE_TICK_S = 0.05  # the longest a blocked receive waits before compaction and the stop flag are looked at
DRAIN_BATCH = 256  # most messages admitted (or refused) per turn before the next request runs
BULK_MIN_BYTES = 4 << 20  # a shard's requests moving this much run on its bulk lane (see the module docstring)
COMPACT_STEP_BYTES = 1 << 20  # compaction takes the store's lock for at most about this much re-encoding
BULK_NICE = 10  # the bulk lane's thread (and the codec thread it starts) yield the CPU to the loop's requests
GUARD_INTERVAL_S = 0.01  # how often the connection guard looks at every connection (see ConnectionGuard)
RATE_WINDOW_S = 10
_OWNER_CACHE = 65536  # sequences whose owner a shard remembers (per routing)
_START_UP_OPS = (p.HelloRequest, p.PingRequest, p.StatsRequest)  # served while a shard is starting
# Plain ints and pyzmq's backend methods on the hot path: the sugar layer's enum flags and option wrappers cost
# microseconds per call, a measurable share of a small request.
_SNDMORE, _NOBLOCK, _POLLIN = int(zmq.SNDMORE), int(zmq.NOBLOCK), int(zmq.POLLIN)
_EVENTS, _RCVMORE, _SRCFD = int(zmq.EVENTS), int(zmq.RCVMORE), int(zmq.SRCFD)
_DONTWAIT = int(zmq.DONTWAIT)
_SNDMORE_NOBLOCK = _SNDMORE | _NOBLOCK
_get = zmq.backend.Socket.get
_send = zmq.backend.Socket.send


# ------------------------------------------------------------------------------------------------ the loop


class _Metrics:
    """Counters written by the server thread only; :meth:`snapshot` may run on any thread (ints are read
    atomically; the rate is approximate by design)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests = self.errors = self.busy = self.bytes_in = self.bytes_out = 0
        self.replies_dropped = self.queue_peak = self.compactions = self.compacted_bytes = 0
        self.replies_over_budget = self.bulk_requests = 0
        self._stamp = [0] * RATE_WINDOW_S
        self._count = [0] * RATE_WINDOW_S

    def tick(self, now: float) -> None:
        sec = int(now)
        i = sec % RATE_WINDOW_S
        if self._stamp[i] != sec:
            self._stamp[i], self._count[i] = sec, 0
        self._count[i] += 1

    def rate(self) -> float:
        now = time.monotonic()
        sec = int(now)
        total = sum(c for s, c in zip(self._stamp, self._count, strict=True) if sec - RATE_WINDOW_S < s <= sec)
        span = min(float(RATE_WINDOW_S), max(now - self.started, 1e-3))
        return total / span

    def snapshot(self, queue_depth: int, queued_bytes: int, peers_cut: int, replies_held: int,
                 bulk_depth: int) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "busy": self.busy,
                "bulk_requests": self.bulk_requests, "bulk_depth": bulk_depth,
                "requests_per_s": round(self.rate(), 3), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "replies_dropped": self.replies_dropped, "replies_over_budget": self.replies_over_budget,
                "peers_cut": peers_cut, "replies_held_bytes": replies_held,
                "queue_depth": queue_depth, "queued_bytes": queued_bytes,
                "queue_peak": self.queue_peak, "compactions": self.compactions,
                "compacted_bytes": self.compacted_bytes, "uptime_s": round(time.monotonic() - self.started, 3)}


class _RouterServer:
    """The ROUTER loop shared by both servers: binding, socket options, CURVE, admission, replies, metrics.
    Subclasses implement :meth:`_execute` (a request -> a reply message) and may override :meth:`_idle`."""

    _NAME = "server"
    _IO_THREADS = 1  # ZeroMQ I/O threads of the server's context

    def __init__(self, *, host: str, port: int, limits: p.Limits | None, curve: CurveConfig | None,
                 max_queued_requests: int, max_queued_bytes: int, hwm: int,
                 heartbeat_ivl_s: float, heartbeat_timeout_s: float, linger_s: float,
                 max_inbound_bytes: int | None = None, max_reply_bytes: int | None = None,
                 guard_interval_s: float = GUARD_INTERVAL_S) -> None:
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
                            ("hwm", hwm), ("max_inbound_bytes", max_inbound_bytes),
                            ("max_reply_bytes", max_reply_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if max_inbound_bytes < self._limits.max_message_bytes:
            raise ConfigError(f"max_inbound_bytes {max_inbound_bytes} is less than max_message_bytes "
                              f"{self._limits.max_message_bytes}: the largest legal request would be cut")
        if isinstance(guard_interval_s, bool) or not isinstance(guard_interval_s, (int, float)) \
                or not 0 < guard_interval_s <= 1:
            raise ConfigError(f"guard_interval_s must be in (0, 1], got {guard_interval_s!r}")
        self._max_inbound, self._max_reply, self._guard_interval = max_inbound_bytes, max_reply_bytes, \
            float(guard_interval_s)
        self._guard: ConnectionGuard | None = None
        self._curve = curve
        self._max_queued, self._max_queued_bytes, self._hwm = max_queued_requests, max_queued_bytes, hwm
        self._heartbeat = (heartbeat_ivl_s, heartbeat_timeout_s)
        self._linger_ms = int(linger_s * 1000)
        self._metrics = _Metrics()
        self._queue: collections.deque[tuple[bytes, list[Any], int, int]] = collections.deque()
        self._queued_bytes = 0
        self._endpoint: str | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._compact_every = 0  # requests between idle-work calls under load (0: only when idle)
        self._since_idle = 0
        self._ctx: zmq.Context[Any] | None = None
        self._lane: _BulkLane | None = None  # a shard's bulk lane (started by _main when _wants_lane)
        self._bulk_owed: dict[bytes, int] = {}  # connection -> its requests on the bulk lane (loop thread only)
        self._bulk_pending = 0

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
        """Counters: requests (messages received), errors (error replies, Busy excluded), busy,
        requests_per_s (over the last 10 s), bulk_requests (run on a shard's bulk lane), bulk_depth (waiting or
        running on it now; counted in queue_depth),
        bytes_in / bytes_out (frames after the identity),
        replies_dropped (peer gone or not reading, or over the reply budget), replies_over_budget (of those: over
        ``max_reply_bytes``), peers_cut (by the connection guard), replies_held_bytes (replies not yet in the
        kernel, last look), queue_depth, queued_bytes, queue_peak, compactions, compacted_bytes, uptime_s."""
        guard = self._guard
        return self._metrics.snapshot(len(self._queue) + self._bulk_pending, self._queued_bytes,
                                      guard.cuts if guard else 0, guard.held_total if guard else 0,
                                      self._bulk_pending)

    def __enter__(self) -> _RouterServer:
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
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        ivl, timeout = self._heartbeat
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(ivl * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout * 1000))  # peers drop us when we stop heartbeating
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_TIMEOUT_S * 1000))  # garbage peers are cut
        sock.setsockopt(zmq.RCVTIMEO, int(IDLE_TICK_S * 1000))
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
            name=f"kvd-{self._NAME}")
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
                self._lane = _BulkLane(ctx, self._reply, self._idle, compact_every=self._compact_every,
                                       name=f"kvd-{self._NAME}-bulk")
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
        queue = self._queue
        guard = self._guard
        lane = self._lane
        if lane is not None and self._bulk_pending:
            self._deliver(sock, lane)
        if not queue:
            if lane is not None and self._bulk_pending:  # wait for a message or for the bulk lane's next reply
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
        while n < DRAIN_BATCH:
            if not int(_get(sock, _EVENTS)) & _POLLIN:
                if guard is not None:
                    guard.drains += 1
                break
            self._admit(sock, recv_frames(sock))
            n += 1
        if not queue:
            return idle_work
        ident, frames, size, fd = queue.popleft()
        reply = self._run(frames, ident, size, fd)
        del frames  # the request's buffers go before the reply is sent
        if reply is None:  # on the bulk lane: its bytes stay queued until it is answered
            return idle_work
        self._queued_bytes -= size
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

    def _deliver(self, sock: zmq.Socket[Any], lane: _BulkLane) -> None:
        """Send the replies the bulk lane has finished (on the loop thread, which owns the socket)."""
        done = lane.done
        metrics = self._metrics
        owed = self._bulk_owed
        while done:
            ident, reply, size, fd, error = done.popleft()
            self._bulk_pending -= 1
            self._queued_bytes -= size
            n = owed[ident] - 1
            if n:
                owed[ident] = n
            else:
                del owed[ident]
            if error:
                metrics.errors += 1
            self._send(sock, ident, reply, fd)

    def _admit(self, sock: zmq.Socket[Any], msg: list[zmq.Frame]) -> None:
        metrics = self._metrics
        metrics.requests += 1
        metrics.tick(time.monotonic())
        ident = msg[0].bytes
        frames = msg[1:]
        lens = [len(f) for f in frames]
        size = sum(lens)
        metrics.bytes_in += size
        fd = -1
        guard = self._guard
        if guard is not None:  # what the loop took from this connection (ZeroMQ no longer holds it)
            fd = frames[0].get(_SRCFD)
            guard.took(fd, lens)
        queue = self._queue
        depth = len(queue) + self._bulk_pending
        if depth and (depth >= self._max_queued or self._queued_bytes + size > self._max_queued_bytes):
            metrics.busy += 1
            rid = _peek_id(frames)
            del msg, frames
            self._send(sock, ident, p.encode_reply(p.ErrorReply(
                request_id=rid, code=Busy.code, error="Busy",
                message=f"server queue full ({len(queue)} requests, {self._queued_bytes} bytes queued); "
                        "the request was not executed: retry after a short backoff")), fd)
            return
        queue.append((ident, frames, size, fd))
        self._queued_bytes += size
        if depth + 1 > metrics.queue_peak:
            metrics.queue_peak = depth + 1

    def _run(self, frames: list[zmq.Frame], ident: bytes, size: int, fd: int) -> list[p.Frame] | None:
        """Parse, execute and encode: the reply frames; or None when the request went to the bulk lane (its
        reply comes back through :meth:`_deliver`). Never raises."""
        views = [f.buffer for f in frames]
        req = p.parse_request(views, self._limits)
        if isinstance(req, p.ErrorReply):
            self._metrics.errors += 1
            return p.encode_reply(req)
        lane = self._lane
        if lane is not None and (ident in self._bulk_owed or self._is_bulk(req, size)):
            self._bulk_owed[ident] = self._bulk_owed.get(ident, 0) + 1
            self._bulk_pending += 1
            self._metrics.bulk_requests += 1
            lane.submit((ident, req, frames, size, fd))
            return None
        reply, error = self._reply(req)
        if error:
            self._metrics.errors += 1
        return reply

    def _reply(self, req: Any) -> tuple[list[p.Frame], bool]:
        """Execute a parsed request and encode its reply: ``(frames, whether it is an error reply)``. Never
        raises; runs on either lane."""
        try:
            return p.encode_reply(self._execute(req), self._limits), False
        except KvdError as exc:
            return p.encode_reply(p.error_reply(req.request_id, exc)), True
        except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the server
            log.exception("%s: internal error on %s", self._NAME, type(req).__name__)
            return p.encode_reply(p.error_reply(req.request_id, exc)), True

    _wants_lane = False  # a bulk lane for this server (ShardServer)

    def _is_bulk(self, req: Any, size: int) -> bool:
        """Whether a request runs on the bulk lane (see the module docstring)."""
        return False

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
        return p.HelloReply.for_limits(self._limits, request_id=req.request_id, kvd_version=__version__,
                                       page_format_version=pages.FORMAT_VERSION, role=role, shard_id=name,
                                       page_tokens=page_tokens)


class _BulkLane:
    """A shard's second serving thread: runs the requests :meth:`_RouterServer._is_bulk` picks, in the order
    submitted, and the store's compaction when it has none. The loop submits ``(ident, request, frames, size,
    fd)``; the lane appends ``(ident, reply frames, size, fd, is_error)`` to :attr:`done` and wakes the loop
    through an inproc PAIR socket (ZeroMQ sockets stay with the threads that use them)."""

    def __init__(self, ctx: zmq.Context[Any], reply: Callable[[Any], tuple[list[p.Frame], bool]],
                 idle: Callable[[], bool], *, compact_every: int, name: str) -> None:
        self.done: collections.deque[tuple[bytes, list[p.Frame], int, int, bool]] = collections.deque()
        self._jobs: collections.deque[tuple[bytes, Any, list[zmq.Frame], int, int]] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._reply, self._idle = reply, idle
        self._compact_every = compact_every  # jobs between idle-work calls while jobs keep coming (0: never)
        self._stopping = False
        self._endpoint = f"inproc://{name}-{id(self):x}"
        self._rx = ctx.socket(zmq.PAIR)  # the loop's end
        self._rx.setsockopt(zmq.LINGER, 0)
        self._rx.bind(self._endpoint)
        self._ctx = ctx
        self._poll = [(None, _POLLIN), (self._rx, _POLLIN)]
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait(5.0)

    def submit(self, job: tuple[bytes, Any, list[zmq.Frame], int, int]) -> None:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()

    def wait(self, sock: zmq.Socket[Any]) -> None:
        """(Loop thread) block until ``sock`` has a message or the lane a reply, at most ``IDLE_TICK_S``."""
        if self.done:
            return
        self._poll[0] = (sock, _POLLIN)
        zmq.zmq_poll(self._poll, int(IDLE_TICK_S * 1000))
        rx = self._rx
        with contextlib.suppress(zmq.Again):
            while True:
                rx.recv(_DONTWAIT, copy=False)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(10.0)
        self._rx.close(0)

    def _main(self, ready: threading.Event) -> None:
        lower_thread_priority(BULK_NICE, BULK_THREAD_NAME)
        tx = self._ctx.socket(zmq.PAIR)
        tx.setsockopt(zmq.LINGER, 0)
        tx.connect(self._endpoint)
        ready.set()
        idle_work = True
        since_idle = 0
        try:
            while True:
                with self._cv:
                    while not self._jobs and not self._stopping and not idle_work:
                        idle_work = not self._cv.wait(IDLE_TICK_S)  # a tick without work: compact again
                    if self._stopping:
                        return
                    job = self._jobs.popleft() if self._jobs else None
                if job is None:
                    since_idle = 0
                    idle_work = self._run_idle()
                    continue
                ident, req, frames, size, fd = job
                reply, error = self._reply(req)
                del req, frames, job  # the request's buffers go before the reply is sent
                self.done.append((ident, reply, size, fd, error))
                with contextlib.suppress(zmq.Again):  # (the loop also looks at `done` every turn)
                    tx.send(b"", _DONTWAIT)
                idle_work = True
                since_idle += 1
                if since_idle >= self._compact_every > 0:
                    since_idle = 0
                    self._run_idle()
        finally:
            tx.close(0)

    def _run_idle(self) -> bool:
        try:
            return self._idle()
        except Exception:  # noqa: BLE001 - idle work must not stop the lane
            log.exception("bulk lane: idle work failed")
            return False


BULK_THREAD_NAME = "kvd-bulk"  # the lane's name in the kernel (top -H, /proc/PID/task/*/comm)


def lower_thread_priority(steps: int, name: str) -> None:
    """Raise the calling thread's nice value by ``steps`` and give it ``name`` in the kernel (Linux: nice and
    the name are per thread, and threads it creates inherit both). Elsewhere, or when refused, nothing
    changes."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError) as exc:
        log.debug("thread name unchanged: %s", exc)
    if steps <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    except OSError as exc:
        log.debug("thread priority unchanged: %s", exc)


def _peek_id(frames: list[zmq.Frame]) -> int | None:
    """The request id of a message to refuse, if its header has a readable one (a bounded, cheap decode)."""
    try:
        head = frames[0].buffer
        if len(head) > p.DEFAULT_MAX_HEADER_BYTES:
            return None
        header = msgpack.unpackb(head, raw=False, strict_map_key=True, max_ext_len=0, max_bin_len=0,
                                 max_array_len=p.DEFAULT_MAX_PAGES, max_map_len=p.MAX_STATS_KEYS)
        rid = header.get("id") if isinstance(header, dict) else None
    except Exception:  # noqa: BLE001 - anything unreadable has no id
        return None
    return rid if type(rid) is int and 0 <= rid <= p.MAX_REQUEST_ID else None


# ------------------------------------------------------------------------------------------------ servers


class ShardServer(_RouterServer):
    """Serves one :class:`~kvd.store.Store` over ZeroMQ (docs/protocol.md) on ``tcp://host:port`` (port 0: any
    free port; :meth:`start` returns the endpoint). The serving thread is the only caller of the store's data
    operations; ``set_level``/``stats`` may be called on the store from other threads (it has a lock).

    Options (keyword-only): ``limits`` (the protocol limits enforced and announced), ``curve`` (a server
    :class:`CurveConfig`: encryption and the client allow-list), ``compact_budget_bytes`` (per compaction step),
    ``compact_every`` (requests between compaction steps under load), ``max_queued_requests`` /
    ``max_queued_bytes`` (admission; beyond them requests get ``Busy``), ``hwm`` (ZeroMQ SNDHWM/RCVHWM per peer),
    ``heartbeat_ivl_s`` / ``heartbeat_timeout_s``, ``linger_s``, ``recycle_memory`` (:meth:`start` calls
    :func:`tune_malloc`, process-wide: meant for a process that hosts shards).

    In a cluster (kvd.cluster.shard): ``incarnation`` (this process's id, told to a ``hello`` that asks and
    checked against an ``append`` that names one), ``on_register`` (called with ``(namespace, (layers,
    kv_heads, head_dim))`` before a ``register`` is applied: makes it cluster-wide; raises to refuse it), and
    :meth:`set_routing` (the topology whose ownership the shard enforces: WrongShard for another's sequence),
    ``starting`` (data operations are answered Busy until :meth:`open_for_data`: a restarted shard first learns
    the cluster's namespaces, so its lost sequences are UnknownSequence, never UnknownNamespace).
    """

    _NAME = "shard server"

    def __init__(self, store: Store, *, shard_id: str, host: str = "127.0.0.1", port: int = 0,
                 limits: p.Limits | None = None, curve: CurveConfig | None = None,
                 compact_budget_bytes: int = 8 << 20, compact_every: int = 64,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
                 max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES, hwm: int = DEFAULT_HWM,
                 heartbeat_ivl_s: float = DEFAULT_HEARTBEAT_IVL_S,
                 heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 linger_s: float = DEFAULT_LINGER_S, recycle_memory: bool = True, incarnation: str | None = None,
                 on_register: Callable[[str, tuple[int, int, int]], None] | None = None,
                 starting: bool = False) -> None:
        super().__init__(host=host, port=port, limits=limits, curve=curve, max_queued_requests=max_queued_requests,
                         max_queued_bytes=max_queued_bytes, hwm=hwm, heartbeat_ivl_s=heartbeat_ivl_s,
                         heartbeat_timeout_s=heartbeat_timeout_s, linger_s=linger_s)
        self._store = store
        self._pack_frame_bytes = min(PACK_FRAME_BYTES, self._limits.max_frame_bytes)  # packed pages replies
        self._shard_id = p.check_short_text("shard_id", shard_id, ConfigError)
        if isinstance(compact_budget_bytes, bool) or not isinstance(compact_budget_bytes, int) \
                or compact_budget_bytes < 0:
            raise ConfigError(f"compact_budget_bytes must be a non-negative integer, got {compact_budget_bytes!r}")
        self._compact_budget = compact_budget_bytes
        self._compact_every = compact_every
        self._recycle_memory = recycle_memory
        self._incarnation = None if incarnation is None else p.check_short_text("incarnation", incarnation,
                                                                                 ConfigError)
        self._on_register_hook = on_register
        self._starting = bool(starting)  # data operations get Busy until open_for_data() (cluster start-up)
        # (topology epoch, router, this shard's index in it, owner cache): None until a cluster hands one
        self._routing: tuple[int, Router, int, dict[tuple[str, type, Any], int]] | None = None
        self._handlers: dict[type, Callable[[Any], Any]] = {
            p.HelloRequest: self._on_hello, p.PingRequest: lambda r: p.PingReply.trusted(request_id=r.request_id),
            p.RegisterRequest: self._on_register, p.AppendRequest: self._on_append, p.GetRequest: self._on_get,
            p.DropRequest: self._on_drop, p.LengthRequest: self._on_length,
            p.LengthsRequest: self._on_lengths, p.StatsRequest: self._on_stats,
            p.ExplainRequest: self._on_explain}

    @property
    def shard_id(self) -> str:
        return self._shard_id

    @property
    def incarnation(self) -> str | None:
        return self._incarnation

    @property
    def topology_epoch(self) -> int:
        """The epoch of the routing enforced (0: none)."""
        routing = self._routing
        return 0 if routing is None else routing[0]

    def set_routing(self, epoch: int, shard_ids: list[str]) -> bool:
        """Enforce ownership by rendezvous hashing over ``shard_ids`` (docs/protocol.md §10) from now on, if
        ``epoch`` is newer than the routing in force. Any thread may call it. Returns whether it applied."""
        current = self._routing
        if current is not None and epoch <= current[0]:
            return False
        if self._shard_id not in shard_ids:
            log.warning("shard %s: topology epoch %d does not list this shard; routing not enforced",
                        self._shard_id, epoch)
            self._routing = None
            return False
        router = Router(list(shard_ids))
        self._routing = (int(epoch), router, router.shard_ids.index(self._shard_id), {})
        return True

    def _check_owner(self, namespace: str, seq_id: Any) -> None:
        """WrongShard unless this shard owns ``(namespace, seq_id)`` by the routing in force (if any)."""
        routing = self._routing
        if routing is None:
            return
        epoch, router, mine, cache = routing
        key = (namespace, type(seq_id), seq_id)
        index = cache.get(key)
        if index is None:
            index = router.owner(namespace, seq_id)
            if len(cache) >= _OWNER_CACHE:
                cache.clear()
            cache[key] = index
        if index != mine:
            raise WrongShard(f"shard {self._shard_id!r} does not own sequence {seq_id!r} of namespace "
                             f"{namespace!r}: shard {router.shard_ids[index]!r} does (topology epoch {epoch}); "
                             "refresh the topology and resend. Nothing was done")

    _wants_lane = True
    # Two I/O threads: ZeroMQ gives each connection to one I/O thread, which moves its bytes in turns of up to a
    # socket buffer's worth; with one thread a decode step's few bytes waited behind MiBs of other clients'
    # prefills on every turn (bench/decode_tail.py: p50 3.4 -> 0.8 ms, p99 32 -> 19 ms with 4 prefilling).
    _IO_THREADS = 2

    def _is_bulk(self, req: Any, size: int) -> bool:
        kind = type(req)
        if kind is p.AppendRequest:
            return size >= BULK_MIN_BYTES
        if kind is p.GetRequest:
            return self._store.read_bytes(req.namespace, req.seq_id, req.start, req.end,
                                          req.layers) >= BULK_MIN_BYTES
        return kind is p.RegisterRequest  # may wait for the coordinator (on_register)

    def start(self, timeout_s: float = 10.0) -> str:
        if self._recycle_memory:
            tune_malloc()  # a shard's process serves large buffers all day: recycle them (see tune_malloc)
        return super().start(timeout_s)

    def open_for_data(self) -> None:
        """Serve data operations (after ``starting=True``); any thread."""
        self._starting = False

    def _execute(self, req: Any) -> Any:
        if self._starting and type(req) not in _START_UP_OPS:
            raise Busy(f"shard {self._shard_id!r} is starting (registering with the coordinator); the request "
                       "was not executed: retry after a short backoff")
        handler = self._handlers.get(type(req))
        if handler is None:
            raise ProtocolError(f"op {req.OP!r} is served by the coordinator, not by shard {self._shard_id!r}")
        return handler(req)

    def _idle(self) -> bool:
        self._since_idle = 0
        if not self._compact_budget:
            return False
        # In steps of COMPACT_STEP_BYTES, letting go of the store's lock (and the GIL) between them: a small
        # request on the loop waits for one step, not for the whole budget. A step that does nothing (no
        # backlog: it returns at once; or pages larger than the step) doubles it.
        metrics = self._metrics
        left, step, freed = self._compact_budget, COMPACT_STEP_BYTES, 0
        try:
            while left > 0:
                take = min(step, left)
                got = self._store.compact(take)
                if not got:
                    if take == left:
                        break
                    step *= 2
                    continue
                freed += got
                metrics.compactions += 1
                metrics.compacted_bytes += got
                left -= take
                time.sleep(0)
        except Exception:  # noqa: BLE001 - compaction must not stop serving
            log.exception("shard %s: compaction failed", self._shard_id)
            return False
        return freed > 0

    def _on_hello(self, req: p.HelloRequest) -> p.HelloReply:
        reply = self._hello(req, role="shard", name=self._shard_id, page_tokens=self._store.page_tokens)
        if req.incarnation and self._incarnation is not None:  # protocol 1.3, only to a hello that asks
            reply = dataclasses.replace(reply, incarnation=self._incarnation)
        return reply

    def _on_register(self, req: p.RegisterRequest) -> p.RegisterReply:
        if self._on_register_hook is not None:  # cluster-wide first: the cluster may know another layout
            self._on_register_hook(req.namespace, (req.num_layers, req.num_kv_heads, req.head_dim))
        self._store.register(req.namespace, num_layers=req.num_layers, num_kv_heads=req.num_kv_heads,
                             head_dim=req.head_dim)
        return p.RegisterReply.trusted(request_id=req.request_id)

    def _on_append(self, req: p.AppendRequest) -> p.AppendReply:
        if req.incarnation is not None and req.incarnation != self._incarnation:
            raise WrongShard(f"shard {self._shard_id!r} is incarnation {self._incarnation}, not {req.incarnation} "
                             "that the append names (the shard restarted, or the sequence was written to another "
                             "shard): the sequence's earlier tokens are not here. Nothing was written: say hello "
                             "again, then resend with offset (or start the sequence over)")
        if self._routing is not None:
            self._check_owner(req.namespace, req.seq_id)
        store = self._store
        if req.offset is not None:
            try:
                current = store.length(req.namespace, req.seq_id)
            except UnknownSequence:
                current = 0
            if current != req.offset:
                raise Conflict(f"append offset {req.offset} does not match the length {current} of sequence "
                               f"{req.seq_id!r} in namespace {req.namespace!r}; nothing was written")
        keys, values = req.keys, req.values
        if req.dtype == "bfloat16":  # the wire carries bit patterns; the store takes float16
            keys = pages.bf16_bits_to_f16(keys.view(np.uint16), "keys")
            values = pages.bf16_bits_to_f16(values.view(np.uint16), "values")
        length = store.append(req.namespace, req.seq_id, keys, values, position=req.position)
        # the server's own replies from the store's results are valid by construction: no second check
        return p.AppendReply.trusted(request_id=req.request_id, length=int(length))

    def _on_get(self, req: p.GetRequest) -> p.GetReply | p.GetPagesReply:
        if self._routing is not None:
            self._check_owner(req.namespace, req.seq_id)
        store = self._store
        if req.format == "fp16":
            keys, values = store.get(req.namespace, req.seq_id, req.start, req.end, req.layers)
            keys, values = np.ascontiguousarray(keys, np.float16), np.ascontiguousarray(values, np.float16)
            layers = req.layers if req.layers is not None else tuple(range(keys.shape[0]))
            return p.GetReply.trusted(request_id=req.request_id, start=req.start, end=req.start + keys.shape[1],
                                      layers=layers, keys=keys, values=values)
        entries, frames = store.get_pages_packed(req.namespace, req.seq_id, req.start, req.end, req.layers,
                                                 frame_bytes=self._pack_frame_bytes)
        if len(entries) > self._limits.max_pages:
            raise MessageTooLarge(f"the range needs {len(entries)} pages, more than max_pages "
                                    f"{self._limits.max_pages}: ask for fewer tokens or layers")
        end = req.end if req.end is not None else store.length(req.namespace, req.seq_id)
        layers = req.layers if req.layers is not None else tuple(dict.fromkeys(e[0] for e in entries))
        return p.GetPagesReply.trusted(request_id=req.request_id, start=req.start, end=int(end), layers=layers,
                                       entries=tuple(entries), packed=tuple(frames) if req.packed else None)

    def _on_drop(self, req: p.DropRequest) -> p.DropReply:
        if self._routing is not None:
            self._check_owner(req.namespace, req.seq_id)
        dropped = bool(self._store.drop(req.namespace, req.seq_id))
        return p.DropReply.trusted(request_id=req.request_id, dropped=dropped)

    def _on_length(self, req: p.LengthRequest) -> p.LengthReply:
        if self._routing is not None:
            self._check_owner(req.namespace, req.seq_id)
        return p.LengthReply.trusted(request_id=req.request_id,
                                     length=int(self._store.length(req.namespace, req.seq_id)))

    def _on_lengths(self, req: p.LengthsRequest) -> p.LengthsReply:
        if self._routing is not None:
            for seq_id in req.seq_ids:
                self._check_owner(req.namespace, seq_id)
        found = self._store.lengths(req.namespace, req.seq_ids)
        return p.LengthsReply.trusted(request_id=req.request_id,
                                      lengths=tuple(None if n is None else int(n) for n in found))

    def _on_stats(self, req: p.StatsRequest) -> p.StatsReply:
        stats = dict(self._store.stats())
        for key, value in self.metrics().items():
            stats[f"server_{key}"] = value
        stats["shard_id"] = self._shard_id
        stats["endpoint"] = self._endpoint
        stats["topology_epoch"] = self.topology_epoch
        if self._incarnation is not None:
            stats["incarnation"] = self._incarnation
        return p.StatsReply(request_id=req.request_id, stats=stats)

    def _on_explain(self, req: p.ExplainRequest) -> p.ExplainReply:
        if self._routing is not None:
            self._check_owner(req.namespace, req.seq_id)
        info = dict(self._store.explain(req.namespace, req.seq_id, req.layer, req.token))
        level, reasons = info.pop("level"), info.pop("reasons")
        return p.ExplainReply(request_id=req.request_id, level=level, reasons=tuple(reasons), details=info)


class TopologyServer(_RouterServer):
    """Serves ``hello`` / ``ping`` / ``topology`` for the coordinator. ``get_topology()`` is called on the
    serving thread for each request and returns ``{"epoch": int, "shards": [{"id", "endpoint"}, ...],
    "level": tag, "level_epoch": int}``. Data operations are refused with ProtocolError (they go to shards)."""

    _NAME = "topology server"

    def __init__(self, get_topology: Callable[[], dict[str, Any]], *, host: str = "127.0.0.1", port: int = 0,
                 curve: CurveConfig | None = None, name: str = "coordinator", limits: p.Limits | None = None,
                 hwm: int = DEFAULT_HWM, heartbeat_ivl_s: float = DEFAULT_HEARTBEAT_IVL_S,
                 heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 linger_s: float = DEFAULT_LINGER_S) -> None:
        super().__init__(host=host, port=port, limits=limits, curve=curve, max_queued_requests=256,
                         max_queued_bytes=16 << 20, hwm=hwm, heartbeat_ivl_s=heartbeat_ivl_s,
                         heartbeat_timeout_s=heartbeat_timeout_s, linger_s=linger_s)
        if not callable(get_topology):
            raise ConfigError(f"get_topology must be callable, got {type(get_topology).__name__}")
        self._get_topology = get_topology
        self._name = p.check_short_text("name", name, ConfigError)

    def _execute(self, req: Any) -> Any:
        if isinstance(req, p.HelloRequest):
            return self._hello(req, role="coordinator", name=self._name, page_tokens=None)
        if isinstance(req, p.PingRequest):
            return p.PingReply(request_id=req.request_id)
        if isinstance(req, p.TopologyRequest):
            topo = self._get_topology()
            return p.TopologyReply(request_id=req.request_id, epoch=topo["epoch"], shards=tuple(topo["shards"]),
                                   level=topo["level"], level_epoch=topo["level_epoch"])
        raise ProtocolError(f"op {req.OP!r} is served by the shards; this is the coordinator's topology endpoint "
                            "(ops: hello, ping, topology)")
