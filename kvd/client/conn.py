"""A client's connections: one ZeroMQ DEALER per server (:class:`_Conn`), opened with the client's options and
a handshake monitor that explains a refused key, the hello each server answers (what it speaks), the endpoint
check, and the process-wide receive buffers (:func:`recycle_buffers`). Shared by :class:`kvd.client.Client` and
:class:`kvd.client.aio.AsyncClient` through :mod:`kvd.client.core`."""

from __future__ import annotations

import asyncio
import itertools
import re
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvd.errors import InvalidArgument, ProtocolError, ShardUnavailable, UnsupportedVersion
from kvd.wire import protocol as p
from kvd.wire.curve import CurveConfig
from kvd.wire.sockets import (  # COPY_BELOW_BYTES: frames under it are copied when sent (kvd.wire.sockets)
    COPY_BELOW_BYTES,
    DEFAULT_HEARTBEAT_IVL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    tune_malloc,
)

__all__ = ["RECYCLE_BYTES", "check_endpoint", "recycle_buffers"]

_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_MONITOR_IDS = itertools.count()

RECYCLE_BYTES = 1 << 30  # recycle_buffers' default: the free heap a client process keeps for its next replies


def recycle_buffers(keep_bytes: int = RECYCLE_BYTES) -> bool:
    """Opt in, for the whole process, to receive buffers that are reused warm instead of mapped fresh.

    ZeroMQ receives every reply frame into a buffer it mallocs (an fp16 get's arrays are views of those
    buffers). By default glibc maps a large buffer fresh and unmaps it when freed, and trims its heap once
    enough is free at the top, so large gets pay a page fault per 4 KiB of every reply: 8 pipelined 32 MiB
    gets spent about two thirds of the client's CPU there (BENCHMARKS.md, "Wire"). After this call, frames up
    to 32 MiB come from the heap and up to ``keep_bytes`` of freed heap stay mapped for the next replies: set it
    above the reply bytes this process has in flight at once (8 x 32 MiB gets: more than 256 MiB), at the cost
    of that much memory kept by the process after a burst. It also puts every thread on one malloc arena (the
    thread that receives and the one that frees must share it). kvd never calls it for you: malloc is the
    process's, and an inference engine may tune it differently. Returns False (and changes nothing) where
    malloc is not glibc's; raises InvalidArgument for a size below 32 MiB."""
    if isinstance(keep_bytes, bool) or not isinstance(keep_bytes, int) or keep_bytes < 32 << 20:
        raise InvalidArgument(f"keep_bytes must be an integer of at least 32 MiB, got {keep_bytes!r}")
    return tune_malloc(trim_threshold_bytes=keep_bytes)


# tcp://host:port (host: a name, an IPv4 address or a [bracketed] IPv6 one), ipc://path, inproc://name
_TCP_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.%]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")


def check_endpoint(name: str, value: Any) -> str:
    """``value`` if it is an endpoint a DEALER can connect to (``tcp://host:port``, ``ipc://...``,
    ``inproc://...``), else :class:`~kvd.errors.InvalidArgument` at once: ZeroMQ would otherwise refuse the
    ``connect`` only after the socket exists, and a socket left open makes ``Context.term()`` wait forever."""
    text = p.check_short_text(name, value, InvalidArgument)
    m = _TCP_ENDPOINT.fullmatch(text)
    if m is not None and 1 <= int(m.group(1)) <= 65535:
        return text
    if text.startswith(("ipc://", "inproc://")) and "://" in text and text.split("://", 1)[1]:
        return text
    raise InvalidArgument(f"{name} must be an endpoint like tcp://127.0.0.1:7070 (tcp://HOST:PORT, port "
                          f"1-65535), got {text!r}")


class _Conn:
    """One DEALER to one server, with the replies received for requests still waited for."""

    __slots__ = ("endpoint", "shard_id", "sock", "monitor", "hello", "limits", "packs", "lookups", "positions",
                 "parents",
                 "packs_tensors", "waiting", "replies", "reader", "rcvtimeo", "closed", "incarnation", "attends",
                 "calibrates", "notices", "requires")

    def __init__(self, endpoint: str, sock: Any, monitor: Any) -> None:
        self.endpoint, self.sock, self.monitor = endpoint, sock, monitor
        self.shard_id: str | None = None
        self.hello: p.HelloReply | None = None
        self.limits = p.DEFAULT_LIMITS
        self.packs = False  # the server takes get's packed field (protocol 1.1)
        self.lookups = False  # the server answers lengths (protocol 1.2)
        self.attends = False  # the server answers attend (protocol 1.5)
        self.calibrates = False  # the server answers calibrate (protocol 1.7)
        self.requires = False  # the server takes calibrate's require, the calibration optional (protocol 1.8)
        self.notices = False  # the server takes append's notices and may answer with a notice (protocol 1.8)
        self.positions = False  # the server takes append's position field (protocol 1.3)
        self.parents = False  # the server takes append's parent field (protocol 1.6)
        self.packs_tensors = False  # the server takes and sends keys and values in one frame (protocol 1.4)
        self.incarnation: str | None = None  # the shard process this connection talks to (protocol 1.3)
        self.waiting: dict[int, Any] = {}  # id -> None (sync: reply not yet in) or a Future (async)
        self.replies: dict[int, Any] = {}
        self.reader: asyncio.Task[None] | None = None
        self.rcvtimeo = -2
        self.closed = False

    def auth_failure(self) -> str | None:
        """Why the handshake failed, if the monitor saw it (CURVE key refused, or a CURVE / plain mismatch)."""
        found = None
        try:
            while self.monitor.poll(0):
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
                if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    found = "the server refused this client's CURVE key (not on its allow-list)"
                elif found is None:
                    found = "the security handshake failed (CURVE on one side only, or a wrong server key)"
        except (zmq.ZMQError, ValueError):
            pass
        return found

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.reader is not None:
            self.reader.cancel()
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(0)


def _open_socket(ctx: Any, endpoint: str, curve: CurveConfig | None, limits: p.Limits) -> _Conn:
    sock = ctx.socket(zmq.DEALER)
    sock.copy_threshold = COPY_BELOW_BYTES  # AsyncClient's send_multipart(copy=False) copies frames under it
    sock.setsockopt(zmq.LINGER, 0)  # close() must not wait for requests to a dead shard
    sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to live connections: a down shard fails fast
    sock.setsockopt(zmq.MAXMSGSIZE, max(limits.max_frame_bytes, limits.max_header_bytes))
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(DEFAULT_HEARTBEAT_IVL_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(DEFAULT_HEARTBEAT_TIMEOUT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(DEFAULT_HEARTBEAT_TIMEOUT_S * 1000))
    if curve is not None:
        curve.apply_client(sock)
    # the handshake monitor is read only to explain a failure, with a plain socket also for AsyncClient
    address = f"inproc://kvd-client-monitor-{next(_MONITOR_IDS)}"
    sock.monitor(address, _MONITOR_EVENTS)
    monitor: zmq.Socket[Any] = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
    try:
        monitor.connect(address)
        sock.connect(endpoint)
    except BaseException:
        monitor.close(0)  # an open socket would make Context.term() wait forever
        sock.close(0)
        raise
    return _Conn(endpoint, sock, monitor)


def _check_hello(conn: _Conn, reply: Any, expect_id: str | None) -> None:
    if isinstance(reply, p.ErrorReply):
        raise reply.exception()
    if not isinstance(reply, p.HelloReply):
        raise ProtocolError(f"{conn.endpoint}: expected a hello reply, got {type(reply).__name__}")
    if reply.protocol_version != p.PROTOCOL_VERSION:
        raise UnsupportedVersion(f"{conn.endpoint} speaks protocol {reply.protocol_version}, this client "
                                 f"{p.PROTOCOL_VERSION}")
    if expect_id is not None and (reply.role != "shard" or reply.shard_id != expect_id):
        raise ShardUnavailable(f"{conn.endpoint} is now {reply.role} {reply.shard_id!r}, not shard {expect_id!r} "
                               "as the topology said")
    conn.hello, conn.limits, conn.shard_id = reply, reply.limits, reply.shard_id
    conn.packs = reply.protocol_minor >= 1
    conn.lookups = reply.protocol_minor >= 2  # the lengths operation
    conn.attends = reply.protocol_minor >= 5  # the attend operation
    conn.calibrates = reply.protocol_minor >= 7  # the calibrate operation
    conn.requires = reply.protocol_minor >= 8  # calibrate's require
    conn.notices = reply.protocol_minor >= 8  # append's notices (the reply's notice)
    conn.positions = reply.protocol_minor >= 3  # append's position
    conn.parents = reply.protocol_minor >= 6  # append's parent
    conn.packs_tensors = reply.protocol_minor >= 4  # packed fp16 tensors (append, fp16 get reply)
    conn.incarnation = reply.incarnation  # protocol 1.3: appends on this connection name this process
