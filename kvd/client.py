"""Clients of a kvd cluster: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio, same methods as
coroutines). Wire format: docs/protocol.md.

Theory of operation
-------------------
*Addressing.* ``address`` is the coordinator's endpoint (one string): the client asks it for the topology (op
``topology``) and routes each ``(namespace, seq_id)`` by rendezvous hashing over the shard ids
(:class:`kvd.routing.Router`). If the string is a shard's endpoint instead (its ``hello`` says role ``shard``),
the client uses that one shard. A list of shard endpoints is asked ``hello`` each for its shard id, so routing
agrees with clients that read the topology from the coordinator.

*Connections.* One DEALER per shard, opened on first use; the shard's ``hello`` is checked (protocol version,
shard id against the topology, limits). ``ZMQ_IMMEDIATE`` queues requests only to a live connection, so a shard
that is down shows at once as "cannot send" rather than as a silent queue; heartbeats detect dead peers.

*Pipelining.* Every request carries an id from one counter; replies are matched by id in any order and
replies to abandoned requests (timed out) are discarded. :meth:`Client.append_nowait` /
:meth:`Client.get_nowait` return a :class:`Pending`; :meth:`Client.append_many` / :meth:`Client.get_many` keep
a window of requests in flight. On :class:`AsyncClient`, concurrent coroutines pipeline by themselves.

*Failures.* Every call has a timeout (:class:`~kvd.errors.Timeout`). Server errors are raised as the same kvd
error class. ``Busy`` is retried with a short backoff within the call's timeout (a Busy request was not
executed). On ShardUnavailable or Timeout, a client that knows a coordinator re-reads the topology once and
retries the call on the new owner if it is idempotent (get, length, stats, explain, register); an append is
never retried silently (set ``offset`` to make a resend safe).

*Zero copy.* Arrays (numpy, buffer protocol, DLPack such as CPU torch tensors) are sent from their own memory
(frames of 64 KiB and more are not copied: do not modify an array until its call returned or its Pending
completed). fp16 ``get`` results are read-only numpy views of the received frames; ``format="pages"`` results
are decoded on the client (:func:`kvd.pages.assemble`) into new arrays.

Neither client is thread-safe: use one per thread (or per event loop).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Generator, Iterable, Sequence
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
import zmq.backend
from zmq.utils.monitor import recv_monitor_message

from kvd import pages
from kvd import protocol as p
from kvd.errors import (
    Busy,
    InvalidArgument,
    KvdError,
    MessageTooLarge,
    ProtocolError,
    ShardUnavailable,
    Timeout,
    UnsupportedVersion,
)
from kvd.routing import Topology
from kvd.server import (
    DEFAULT_HEARTBEAT_IVL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    CurveConfig,
    recv_frames,
    send_frames,
)

log = logging.getLogger(__name__)

__all__ = ["AsyncClient", "Client", "Pending", "aggregate_stats"]

DEFAULT_TIMEOUT_S = 10.0
CONNECT_GRACE_S = 2.0  # a shard we cannot send to for this long (within a call's timeout) is unavailable
DEFAULT_WINDOW = 64  # requests in flight per *_many call; well under a shard's admission queue
_BUSY_BACKOFF_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
_IDEMPOTENT = frozenset({"get", "length", "stats", "explain", "register"})
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_MONITOR_IDS = itertools.count()
_RCVTIMEO, _NOBLOCK, _POLLIN, _EVENTS = int(zmq.RCVTIMEO), int(zmq.NOBLOCK), int(zmq.POLLIN), int(zmq.EVENTS)
_get = zmq.backend.Socket.get  # the backend's getsockopt: no enum wrapping on the hot path
_NOT_ADDITIVE = frozenset({"epoch", "page_tokens", "sink_tokens", "window_tokens", "server_uptime_s",
                           "server_queue_peak"})


def aggregate_stats(per_shard: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Cluster totals from per-shard stats: numbers summed (``epoch`` and settings: the maximum), maps of numbers
    summed per key, ``pressure`` recomputed as used/capacity, a string kept when all shards agree (else
    ``"mixed"``); ``shards`` counts the shards, ``errors`` those that did not answer."""
    good = [s for s in per_shard if "error" not in s]
    out: dict[str, Any] = {"shards": len(per_shard), "errors": len(per_shard) - len(good)}
    for stats in good:
        for key, value in stats.items():
            if key in ("shard_id", "endpoint"):
                continue
            have = out.get(key)
            if isinstance(value, bool) or value is None:
                out[key] = value if have is None or have == value else "mixed"
            elif isinstance(value, (int, float)):
                if key in _NOT_ADDITIVE:
                    out[key] = value if have is None else max(have, value)
                else:
                    out[key] = (have or 0) + value
            elif isinstance(value, dict):
                merged = dict(have) if isinstance(have, dict) else {}
                for k, v in value.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        merged[k] = merged.get(k, 0) + v
                out[key] = merged
            else:
                out[key] = value if key not in out or have == value else "mixed"
    if out.get("capacity_bytes"):
        out["pressure"] = out.get("used_bytes", 0) / out["capacity_bytes"]
    return out


class _Conn:
    """One DEALER to one server, with the replies received for requests still waited for."""

    __slots__ = ("endpoint", "shard_id", "sock", "monitor", "hello", "limits", "waiting", "replies", "reader",
                 "rcvtimeo", "closed")

    def __init__(self, endpoint: str, sock: Any, monitor: Any) -> None:
        self.endpoint, self.sock, self.monitor = endpoint, sock, monitor
        self.shard_id: str | None = None
        self.hello: p.HelloReply | None = None
        self.limits = p.DEFAULT_LIMITS
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
    monitor.connect(address)
    sock.connect(endpoint)
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


def _value(req: Any, reply: Any) -> Any:
    """The caller's result for ``reply`` to ``req``; an error reply is raised as its kvd error."""
    if isinstance(reply, p.ErrorReply):
        raise reply.exception()
    if reply.OP != req.OP or (isinstance(req, p.GetRequest)
                              and isinstance(reply, p.GetPagesReply) != (req.format == "pages")):
        raise ProtocolError(f"reply {type(reply).__name__} does not answer {type(req).__name__}")
    if isinstance(reply, (p.AppendReply, p.LengthReply)):
        return reply.length
    if isinstance(reply, p.GetReply):
        return reply.keys, reply.values
    if isinstance(reply, p.GetPagesReply):
        return pages.assemble(reply.entries, reply.start, reply.end, reply.layers)
    if isinstance(reply, p.DropReply):
        return reply.dropped
    if isinstance(reply, p.StatsReply):
        return reply.stats
    if isinstance(reply, p.ExplainReply):
        return {"level": reply.level, "reasons": list(reply.reasons), **(reply.details or {})}
    if isinstance(reply, p.TopologyReply):
        return {"epoch": reply.epoch, "shards": [dict(s) for s in reply.shards], "level": reply.level,
                "level_epoch": reply.level_epoch}
    return None


def _append_chunks(keys: Any, values: Any, limits: p.Limits) -> list[tuple[Any, Any]]:
    """Split an append along T so that each message fits ``limits`` (docs/protocol.md §6.4)."""
    room = min(limits.max_frame_bytes, (limits.max_message_bytes - limits.max_header_bytes) // 2)
    if isinstance(keys, np.ndarray) and keys.nbytes <= room:
        return [(keys, values)]  # the common case, without a second look at the arrays
    k, v = p.as_array(keys, "keys"), p.as_array(values, "values")
    if k.ndim != 4 or k.shape[1] < 2:
        return [(keys, values)]
    per_token = k.nbytes // k.shape[1]
    step = max(1, room // max(per_token, 1))
    if k.shape[1] <= step:
        return [(keys, values)]
    return [(k[:, t:t + step], v[:, t:t + step]) for t in range(0, k.shape[1], step)]


def _renumber(req: Any, rid: int) -> Any:
    """``req`` under a new request id (messages are frozen and their fields were validated already)."""
    clone = object.__new__(type(req))
    for cls in type(req).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name != "__weakref__":
                object.__setattr__(clone, name, getattr(req, name))
    object.__setattr__(clone, "request_id", rid)
    return clone


def _is_busy(reply: Any) -> bool:
    return isinstance(reply, p.ErrorReply) and reply.code == Busy.code


# A plan is a generator that yields I/O actions and gets their results back (or has their exceptions thrown in
# at the yield); Client runs plans with blocking calls, AsyncClient with awaits. Actions:
#   ("open", endpoint) -> _Conn      ("send", conn, req, deadline) -> None
#   ("wait", conn, req, deadline, timeout_s) -> reply      ("sleep", seconds) -> None
Plan = Generator[tuple[Any, ...], Any, Any]


class _Core:
    """What both clients share: addressing, topology, routing, request ids and every call's plan."""

    def __init__(self, address: str | Sequence[str], *, timeout_s: float, curve: CurveConfig | None,
                 limits: p.Limits | None) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if curve is not None and not isinstance(curve, CurveConfig):
            raise InvalidArgument(f"curve must be a CurveConfig, got {type(curve).__name__}")
        if isinstance(address, str):
            self._seeds: tuple[str, ...] = (p.check_short_text("address", address, InvalidArgument),)
        else:
            self._seeds = tuple(p.check_short_text(f"address[{i}]", a, InvalidArgument)
                                for i, a in enumerate(address))
            if not self._seeds or len(set(self._seeds)) != len(self._seeds):
                raise InvalidArgument(f"address must be an endpoint or a non-empty list of distinct shard "
                                      f"endpoints, got {address!r}")
        self._single = isinstance(address, str)
        self.timeout_s = float(timeout_s)
        self._curve = curve
        self._limits = limits or p.DEFAULT_LIMITS
        self._ids = itertools.count(1)
        self._coordinator: _Conn | None = None
        self._conns: dict[str, _Conn] = {}  # endpoint -> connection (hello done)
        self._opened: list[_Conn] = []  # every connection ever opened: close() closes what is left
        self._topo = Topology(epoch=None, shards=())
        self._closed = False

    # -------------------------------------------------------------------------------------------- helpers

    def _deadline(self, timeout_s: float | None) -> float:
        if self._closed:
            raise InvalidArgument("the client is closed")
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _tmo(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    def _set_topology(self, topo: dict[str, Any]) -> None:
        self._topo = Topology(**topo)
        live = {(s["endpoint"], s["id"]) for s in self._topo.shards}
        for endpoint, conn in list(self._conns.items()):
            if (endpoint, conn.shard_id) not in live:
                del self._conns[endpoint]
                conn.close()

    @property
    def _shards(self) -> tuple[dict[str, str], ...]:
        return self._topo.shards

    def topology(self) -> dict[str, Any]:
        """The topology in use: ``{"epoch", "shards": [{"id", "endpoint"}], "level", "level_epoch"}`` (for shard
        endpoints given directly: epoch 0, level None)."""
        return self._topo.as_dict()

    def _timeout(self, conn: _Conn, what: str, timeout_s: float) -> Timeout:
        why = conn.auth_failure()
        name = f"shard {conn.shard_id!r} at {conn.endpoint}" if conn.shard_id else conn.endpoint
        return Timeout(f"no reply from {name} to {what} within {timeout_s:g} s" + (f": {why}" if why else ""))

    def _unavailable(self, conn: _Conn, what: str, deadline: float, timeout_s: float) -> KvdError:
        why = conn.auth_failure()
        if why or time.monotonic() >= deadline:
            return Timeout(f"cannot send {what} to {conn.endpoint} within {timeout_s:g} s"
                           + (f": {why}" if why else ": not connected"))
        return ShardUnavailable(f"cannot send {what} to {conn.endpoint}: no connection within "
                                f"{CONNECT_GRACE_S:g} s (is the server running?)")

    # -------------------------------------------------------------------------------------------- plans

    def _g_roundtrip(self, conn: _Conn, req: Any, deadline: float, timeout_s: float) -> Plan:
        """Send and wait; ``Busy`` is retried with backoff until the deadline (a Busy request was not run)."""
        backoffs = iter(_BUSY_BACKOFF_S)
        while True:
            yield ("send", conn, req, deadline)
            reply = yield ("wait", conn, req, deadline, timeout_s)
            if not _is_busy(reply):
                return reply
            backoff = next(backoffs, _BUSY_BACKOFF_S[-1])
            if time.monotonic() + backoff >= deadline:
                return reply
            yield ("sleep", backoff)
            req = _renumber(req, next(self._ids))

    def _g_hello(self, conn: _Conn, expect_id: str | None, deadline: float) -> Plan:
        req = p.HelloRequest(request_id=next(self._ids))
        _check_hello(conn, (yield from self._g_roundtrip(conn, req, deadline, self.timeout_s)), expect_id)

    def _g_conn(self, shard: dict[str, str], deadline: float) -> Plan:
        """The connection to ``shard``, opened and greeted (hello) on first use."""
        endpoint = shard["endpoint"]
        conn = self._conns.get(endpoint)
        if conn is not None and conn.shard_id == shard["id"]:
            return conn
        conn = yield ("open", endpoint)
        try:
            yield from self._g_hello(conn, shard["id"], deadline)
        except BaseException:
            conn.close()
            raise
        other = self._conns.get(endpoint)  # opened meanwhile by a concurrent call (AsyncClient)
        if other is not None and other.shard_id == shard["id"]:
            conn.close()
            return other
        if other is not None:
            other.close()
        self._conns[endpoint] = conn
        return conn

    def _g_bootstrap(self, deadline: float) -> Plan:
        conns: list[_Conn] = []
        try:
            for address in self._seeds:
                conns.append((yield ("open", address)))
            reqs = [p.HelloRequest(request_id=next(self._ids)) for _ in conns]
            for conn, req in zip(conns, reqs, strict=True):
                yield ("send", conn, req, deadline)
            for conn, req in zip(conns, reqs, strict=True):
                _check_hello(conn, (yield ("wait", conn, req, deadline, self.timeout_s)), None)
            roles = [c.hello.role for c in conns if c.hello is not None]
            if self._single and roles[0] == "coordinator":
                self._coordinator = conns[0]
                yield from self._g_refresh(deadline)
                return
            if "coordinator" in roles:
                raise InvalidArgument("a list address must name shards; one of them is a coordinator")
        except BaseException:
            for conn in conns:
                conn.close()
            self._coordinator = None
            raise
        for conn in conns:
            self._conns[conn.endpoint] = conn
        self._set_topology({"epoch": 0, "shards": [{"id": c.shard_id, "endpoint": c.endpoint} for c in conns],
                            "level": None, "level_epoch": None})

    def _g_refresh(self, deadline: float) -> Plan:
        if self._coordinator is not None:
            req = p.TopologyRequest(request_id=next(self._ids))
            self._set_topology(_value(req, (yield from self._g_roundtrip(self._coordinator, req, deadline,
                                                                        self.timeout_s))))
        return self.topology()

    def _g_routed(self, make: Any, namespace: str, seq_id: p.SeqId, timeout_s: float | None) -> Plan:
        deadline, tmo = self._deadline(timeout_s), self._tmo(timeout_s)
        req = make(next(self._ids))
        try:
            conn = yield from self._g_conn(self._topo.owner(namespace, seq_id), deadline)
            return _value(req, (yield from self._g_roundtrip(conn, req, deadline, tmo)))
        except (ShardUnavailable, Timeout):
            if self._coordinator is None:
                raise
            deadline = self._deadline(timeout_s)  # the retry has a timeout of its own
            yield from self._g_refresh(deadline)
            if req.OP not in _IDEMPOTENT:
                raise
        req = _renumber(req, next(self._ids))
        conn = yield from self._g_conn(self._topo.owner(namespace, seq_id), deadline)
        return _value(req, (yield from self._g_roundtrip(conn, req, deadline, tmo)))

    def _g_everywhere(self, make: Any, timeout_s: float | None) -> Plan:
        """One request to every shard, in flight together: values (or kvd errors) in topology order."""
        deadline, tmo = self._deadline(timeout_s), self._tmo(timeout_s)
        sent: list[Any] = []
        for shard in self._shards:
            try:
                conn = yield from self._g_conn(shard, deadline)
                req = make(next(self._ids))
                yield ("send", conn, req, deadline)
                sent.append((conn, req))
            except KvdError as exc:
                sent.append(exc)
        out: list[Any] = []
        for item in sent:
            try:
                if isinstance(item, KvdError):
                    raise item
                conn, req = item
                reply = yield ("wait", conn, req, deadline, tmo)
                if _is_busy(reply):
                    reply = yield from self._g_roundtrip(conn, _renumber(req, next(self._ids)), deadline, tmo)
                out.append(_value(req, reply))
            except KvdError as exc:
                out.append(exc)
        return out

    def _plan_register(self, namespace: str, layout: tuple[int, int, int], timeout_s: float | None) -> Plan:
        def make(rid: int) -> p.RegisterRequest:
            return p.RegisterRequest(request_id=rid, namespace=namespace, num_layers=layout[0],
                                     num_kv_heads=layout[1], head_dim=layout[2])

        make(0)  # argument errors before any I/O
        errors = [r for r in (yield from self._g_everywhere(make, timeout_s)) if isinstance(r, KvdError)]
        if errors and self._coordinator is not None and all(isinstance(e, (ShardUnavailable, Timeout))
                                                            for e in errors):
            yield from self._g_refresh(self._deadline(timeout_s))
            errors = [r for r in (yield from self._g_everywhere(make, timeout_s)) if isinstance(r, KvdError)]
        if errors:
            raise errors[0]

    def _plan_append(self, namespace: str, seq_id: p.SeqId, keys: Any, values: Any, offset: int | None,
                     dtype: str | None, timeout_s: float | None) -> Plan:
        first = self._topo.owner(namespace, seq_id)
        conn = yield from self._g_conn(first, self._deadline(timeout_s))
        chunks = _append_chunks(keys, values, conn.limits)
        length = offset
        for i, (k, v) in enumerate(chunks):
            def make(rid: int, k: Any = k, v: Any = v, off: int | None = length) -> p.AppendRequest:
                return p.AppendRequest(request_id=rid, namespace=namespace, seq_id=seq_id, keys=k, values=v,
                                       offset=off, dtype=dtype)
            try:
                length = yield from self._g_routed(make, namespace, seq_id, timeout_s)
            except KvdError as exc:
                if i:
                    raise type(exc)(f"{exc} (after {i} of {len(chunks)} parts of this append were stored, up "
                                    f"to length {length})") from exc
                raise
        return length

    def _plan_get(self, namespace: str, seq_id: p.SeqId, start: int, end: int | None,
                  layers: Sequence[int] | None, fmt: str, timeout_s: float | None) -> Plan:
        def make(rid: int) -> p.GetRequest:
            return p.GetRequest(request_id=rid, namespace=namespace, seq_id=seq_id, start=start, end=end,
                                layers=None if layers is None else tuple(layers), format=fmt)
        try:
            return (yield from self._g_routed(make, namespace, seq_id, timeout_s))
        except MessageTooLarge:
            stop = end
            if stop is None:
                stop = yield from self._g_routed(
                    lambda rid: p.LengthRequest(request_id=rid, namespace=namespace, seq_id=seq_id),
                    namespace, seq_id, timeout_s)
            if stop - start < 2:
                raise
            mid = (start + stop) // 2
            a = yield from self._plan_get(namespace, seq_id, start, mid, layers, fmt, timeout_s)
            b = yield from self._plan_get(namespace, seq_id, mid, stop, layers, fmt, timeout_s)
            return np.concatenate([a[0], b[0]], axis=1), np.concatenate([a[1], b[1]], axis=1)

    def _plan_shard_stats(self, timeout_s: float | None) -> Plan:
        def make(rid: int) -> p.StatsRequest:
            return p.StatsRequest(request_id=rid)

        results = yield from self._g_everywhere(make, timeout_s)
        if self._coordinator is not None and any(isinstance(r, (ShardUnavailable, Timeout)) for r in results):
            yield from self._g_refresh(self._deadline(timeout_s))
            results = yield from self._g_everywhere(make, timeout_s)
        return [({"shard_id": s["id"], "endpoint": s["endpoint"], "error": f"{type(r).__name__}: {r}"}
                 if isinstance(r, KvdError) else {**r, "shard_id": s["id"], "endpoint": s["endpoint"]})
                for s, r in zip(self._shards, results, strict=True)]

    def _plan_ping(self, timeout_s: float | None) -> Plan:
        out: dict[str, float] = {}
        for shard in self._shards:
            deadline = self._deadline(timeout_s)
            t0 = time.perf_counter()
            conn = yield from self._g_conn(shard, deadline)
            req = p.PingRequest(request_id=next(self._ids))
            _value(req, (yield from self._g_roundtrip(conn, req, deadline, self._tmo(timeout_s))))
            out[shard["id"]] = time.perf_counter() - t0
        return out

    def _plan_simple(self, make: Any, namespace: str, seq_id: p.SeqId, timeout_s: float | None) -> Plan:
        return (yield from self._g_routed(make, namespace, seq_id, timeout_s))

    def _all_conns(self) -> list[_Conn]:
        return [c for c in self._opened if not c.closed]

    def _track(self, conn: _Conn) -> _Conn:
        self._opened = [c for c in self._opened if not c.closed]
        self._opened.append(conn)
        return conn


# ------------------------------------------------------------------------------------------------ sync


class Pending:
    """A request in flight on a :class:`Client`. :meth:`result` waits for its reply (replies to other
    requests that arrive meanwhile are kept for them) and returns what the blocking method would."""

    __slots__ = ("_client", "_conn", "_req", "_deadline", "_timeout_s", "_outcome")

    def __init__(self, client: Client, conn: _Conn, req: Any, deadline: float, timeout_s: float) -> None:
        self._client, self._conn, self._req = client, conn, req
        self._deadline, self._timeout_s = deadline, timeout_s
        self._outcome: tuple[bool, Any] | None = None

    @property
    def request_id(self) -> int:
        return int(self._req.request_id)

    def __del__(self) -> None:
        if self._outcome is None:  # abandoned: its reply, when it comes, is discarded
            self._conn.waiting.pop(self._req.request_id, None)
            self._conn.replies.pop(self._req.request_id, None)

    def done(self) -> bool:
        """Whether the reply is in (does not block)."""
        if self._outcome is None:
            self._client._pump(self._conn, 0.0)
            return self._req.request_id in self._conn.replies
        return True

    def result(self) -> Any:
        """The call's value; raises its error (:class:`~kvd.errors.Timeout` at the call's deadline)."""
        if self._outcome is None:
            try:
                reply = self._client._wait(self._conn, self._req, self._deadline, self._timeout_s)
                self._outcome = (True, _value(self._req, reply))
            except KvdError as exc:
                self._outcome = (False, exc)
        ok, value = self._outcome
        if not ok:
            raise value
        return value


class Client(_Core):
    """A blocking client. ``address``: the coordinator's endpoint, one shard's endpoint, or a list of shard
    endpoints. ``timeout_s`` bounds every call (each method also takes ``timeout_s=``); ``curve``: a client
    :class:`~kvd.server.CurveConfig`; ``limits``: what this client accepts in a reply. Connects and reads the
    topology at construction: raises :class:`~kvd.errors.Timeout` or :class:`~kvd.errors.ShardUnavailable` if it
    cannot. Not thread-safe; a context manager (:meth:`close`)."""

    def __init__(self, address: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 curve: CurveConfig | None = None, limits: p.Limits | None = None) -> None:
        super().__init__(address, timeout_s=timeout_s, curve=curve, limits=limits)
        self._ctx: zmq.Context[Any] = zmq.Context()
        try:
            self._drive(self._g_bootstrap(self._deadline(None)))
        except BaseException:
            self.close()
            raise

    # -------------------------------------------------------------------------------------------- transport

    def _drive(self, plan: Plan) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                action = plan.throw(error) if error is not None else plan.send(value)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                kind = action[0]
                if kind == "wait":
                    value = self._wait(*action[1:])
                elif kind == "send":
                    self._send(*action[1:])
                elif kind == "open":
                    value = self._track(_open_socket(self._ctx, action[1], self._curve, self._limits))
                else:
                    time.sleep(action[1])  # a backoff the server asked for (Busy), not a wait for a condition
            except BaseException as exc:  # noqa: BLE001 - thrown into the plan at its yield
                error = exc

    def _send(self, conn: _Conn, req: Any, deadline: float) -> None:
        frames = p.encode_request(req, conn.limits)
        sock = conn.sock
        try:
            send_frames(sock, frames, _NOBLOCK)
        except zmq.Again:  # not connected (ZMQ_IMMEDIATE) or SNDHWM: wait a little for the pipe
            grace = min(deadline, time.monotonic() + CONNECT_GRACE_S) - time.monotonic()
            if grace <= 0 or not sock.poll(grace * 1000, zmq.POLLOUT):
                raise self._unavailable(conn, req.OP, deadline, self.timeout_s) from None
            send_frames(sock, frames, _NOBLOCK)
        conn.waiting[req.request_id] = None

    def _pump(self, conn: _Conn, wait_s: float) -> None:
        """Receive what is there (waiting up to ``wait_s`` for the first message) and file replies by id."""
        sock = conn.sock
        if not int(_get(sock, _EVENTS)) & _POLLIN:
            if wait_s <= 0:
                return
            ms = -(-int(wait_s * 1000) // 50) * 50 or 1  # on a 50 ms grid: RCVTIMEO is not reset every call
            if conn.rcvtimeo != ms:
                sock.setsockopt(_RCVTIMEO, ms)
                conn.rcvtimeo = ms
            try:
                self._file(conn, recv_frames(sock))
            except zmq.Again:
                return
        while int(_get(sock, _EVENTS)) & _POLLIN:
            self._file(conn, recv_frames(sock))

    def _file(self, conn: _Conn, msg: list[zmq.Frame]) -> None:
        try:
            reply = p.decode_reply([f.buffer for f in msg], self._limits)
        except KvdError as exc:
            log.warning("discarding a malformed reply from %s: %s", conn.endpoint, exc)
            return
        rid = reply.request_id
        if rid in conn.waiting:
            del conn.waiting[rid]
            conn.replies[rid] = reply

    def _wait(self, conn: _Conn, req: Any, deadline: float, timeout_s: float) -> Any:
        rid = req.request_id
        replies = conn.replies
        while rid not in replies:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                conn.waiting.pop(rid, None)
                raise self._timeout(conn, req.OP, timeout_s)
            self._pump(conn, remaining)
        return replies.pop(rid)

    # -------------------------------------------------------------------------------------------- the API

    def refresh(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Re-read the topology from the coordinator (nothing to do for shard endpoints); returns it."""
        return self._drive(self._g_refresh(self._deadline(timeout_s)))

    def register(self, namespace: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 timeout_s: float | None = None) -> None:
        """Register a layout on every shard (Store.register). Raises LayoutMismatch, ShardUnavailable, ..."""
        self._drive(self._plan_register(namespace, (num_layers, num_kv_heads, head_dim), timeout_s))

    def append(self, namespace: str, seq_id: p.SeqId, keys: Any, values: Any, *, offset: int | None = None,
               dtype: str | None = None, timeout_s: float | None = None) -> int:
        """Append ``keys``/``values`` ``[L, T, H, D]`` (float16, float32 or bfloat16; ``dtype="bfloat16"`` for
        16-bit integer arrays holding bfloat16 bits); returns the new length. ``offset``: store only if the
        sequence's length equals it (else :class:`~kvd.errors.Conflict`). Never retried after a failure. An
        append larger than the shard's frame limit goes as several appends along T; if one of them fails, the
        tokens before it stay stored (the error says how many)."""
        return self._drive(
            self._plan_append(namespace, seq_id, keys, values, offset, dtype, timeout_s))

    def get(self, namespace: str, seq_id: p.SeqId, start: int = 0, end: int | None = None,
            layers: Sequence[int] | None = None, *, format: str = "fp16",  # noqa: A002 - the protocol's name
            timeout_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, end)`` of ``layers`` as float16 ``(keys, values)`` ``[L', T', H, D]`` (Store.get).
        ``format="pages"`` fetches the stored pages and decodes them here (fewer bytes on the wire). A range
        too large for one reply is fetched in parts."""
        return self._drive(
            self._plan_get(namespace, seq_id, start, end, layers, format, timeout_s))

    def drop(self, namespace: str, seq_id: p.SeqId, *, timeout_s: float | None = None) -> bool:
        """Forget a sequence; False if there was none (Store.drop). Not retried."""
        return self._drive(self._plan_simple(
            lambda rid: p.DropRequest(request_id=rid, namespace=namespace, seq_id=seq_id), namespace, seq_id,
            timeout_s))

    def length(self, namespace: str, seq_id: p.SeqId, *, timeout_s: float | None = None) -> int:
        """Tokens stored for the sequence (Store.length)."""
        return self._drive(self._plan_simple(
            lambda rid: p.LengthRequest(request_id=rid, namespace=namespace, seq_id=seq_id), namespace, seq_id,
            timeout_s))

    def explain(self, namespace: str, seq_id: p.SeqId, layer: int, token: int, *,
                timeout_s: float | None = None) -> dict[str, Any]:
        """Why a token is stored as it is: ``{"level", "reasons", ...}`` (Store.explain)."""
        return self._drive(self._plan_simple(
            lambda rid: p.ExplainRequest(request_id=rid, namespace=namespace, seq_id=seq_id, layer=layer,
                                         token=token), namespace, seq_id, timeout_s))

    def shard_stats(self, *, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Each shard's stats (store stats, ``server_*`` metrics, ``shard_id``, ``endpoint``) in topology order;
        a shard that did not answer gives ``{"shard_id", "endpoint", "error"}``."""
        return self._drive(self._plan_shard_stats(timeout_s))

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Cluster totals over :meth:`shard_stats` (see :func:`aggregate_stats`)."""
        return aggregate_stats(self.shard_stats(timeout_s=timeout_s))

    def ping(self, *, timeout_s: float | None = None) -> dict[str, float]:
        """Round-trip seconds of a ping to every shard, by shard id; raises the first failure."""
        return self._drive(self._plan_ping(timeout_s))

    # -------------------------------------------------------------------------------------------- pipelining

    def _submit(self, req: Any, namespace: str, seq_id: p.SeqId, timeout_s: float | None) -> Pending:
        deadline = self._deadline(timeout_s)
        conn = self._drive(self._g_conn(self._topo.owner(namespace, seq_id), deadline))
        self._send(conn, req, deadline)
        return Pending(self, conn, req, deadline, self._tmo(timeout_s))

    def append_nowait(self, namespace: str, seq_id: p.SeqId, keys: Any, values: Any, *,
                      offset: int | None = None, dtype: str | None = None,
                      timeout_s: float | None = None) -> Pending:
        """Send an append and return at once; :meth:`Pending.result` gives the new length. No retries: a Busy
        reply raises :class:`~kvd.errors.Busy`; set ``offset`` when pipelining appends to one sequence. Do not
        modify the arrays before the Pending completed (they are sent from their own memory)."""
        req = p.AppendRequest(request_id=next(self._ids), namespace=namespace, seq_id=seq_id, keys=keys,
                              values=values, offset=offset, dtype=dtype)
        return self._submit(req, namespace, seq_id, timeout_s)

    def get_nowait(self, namespace: str, seq_id: p.SeqId, start: int = 0, end: int | None = None,
                   layers: Sequence[int] | None = None, *, format: str = "fp16",  # noqa: A002
                   timeout_s: float | None = None) -> Pending:
        """Send a get and return at once; :meth:`Pending.result` gives ``(keys, values)``."""
        req = p.GetRequest(request_id=next(self._ids), namespace=namespace, seq_id=seq_id, start=start, end=end,
                           layers=None if layers is None else tuple(layers), format=format)
        return self._submit(req, namespace, seq_id, timeout_s)

    def _many(self, submit: Any, items: Iterable[Sequence[Any]], window: int,
              return_exceptions: bool) -> list[Any]:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidArgument(f"window must be a positive integer, got {window!r}")
        pending: list[Pending | KvdError] = []
        out: list[Any] = []
        for item in items:
            if len(pending) - len(out) >= window:
                out.append(_outcome(pending[len(out)]))
            try:
                pending.append(submit(item))
            except KvdError as exc:
                pending.append(exc)
        out.extend(_outcome(x) for x in pending[len(out):])
        if not return_exceptions:
            for value in out:
                if isinstance(value, KvdError):
                    raise value
        return out

    def append_many(self, items: Iterable[Sequence[Any]], *, window: int = DEFAULT_WINDOW,
                    return_exceptions: bool = False, timeout_s: float | None = None) -> list[Any]:
        """Pipelined appends: ``items`` of ``(namespace, seq_id, keys, values[, offset])``, at most ``window``
        in flight. Returns the new lengths in order; with ``return_exceptions`` failures are returned in place,
        else the first one is raised once all completed."""
        return self._many(lambda it: self.append_nowait(*it[:4], offset=it[4] if len(it) > 4 else None,
                                                        timeout_s=timeout_s), items, window, return_exceptions)

    def get_many(self, items: Iterable[Sequence[Any]], *, format: str = "fp16",  # noqa: A002
                 window: int = DEFAULT_WINDOW, return_exceptions: bool = False,
                 timeout_s: float | None = None) -> list[Any]:
        """Pipelined gets: ``items`` of ``(namespace, seq_id[, start[, end[, layers]]])``; returns
        ``(keys, values)`` pairs in order (failures as in :meth:`append_many`)."""
        return self._many(lambda it: self.get_nowait(*it, format=format, timeout_s=timeout_s), items, window,
                          return_exceptions)

    # -------------------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close every connection (requests in flight are abandoned). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self._all_conns():
            conn.close()
        self._conns.clear()
        self._coordinator = None
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _outcome(pending: Pending | KvdError) -> Any:
    if isinstance(pending, KvdError):
        return pending
    try:
        return pending.result()
    except KvdError as exc:
        return exc


# ------------------------------------------------------------------------------------------------ asyncio


class AsyncClient(_Core):
    """The asyncio client: :class:`Client`'s methods as coroutines (``topology()`` stays a plain method).
    Concurrent calls are pipelined on the shards' connections (one reader task per connection matches replies
    by id). Connects on first use or in ``async with``; ``await close()``. Use it from one event loop."""

    def __init__(self, address: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 curve: CurveConfig | None = None, limits: p.Limits | None = None) -> None:
        super().__init__(address, timeout_s=timeout_s, curve=curve, limits=limits)
        self._ctx: zmq.asyncio.Context = zmq.asyncio.Context()
        self._connected = False
        self._connecting: asyncio.Lock | None = None

    async def connect(self, *, timeout_s: float | None = None) -> AsyncClient:
        """Greet the servers and read the topology (done by the first call if not called). Idempotent."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if not self._connected:
                await self._drive(self._g_bootstrap(self._deadline(timeout_s)), connected=False)
                self._connected = True
        return self

    async def _drive(self, plan: Plan, *, connected: bool = True) -> Any:
        if connected and not self._connected:
            await self.connect()
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                action = plan.throw(error) if error is not None else plan.send(value)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                kind = action[0]
                if kind == "wait":
                    value = await self._wait(*action[1:])
                elif kind == "send":
                    await self._send(*action[1:])
                elif kind == "open":
                    value = self._open(action[1])
                else:
                    await asyncio.sleep(action[1])
            except (Exception, asyncio.CancelledError) as exc:  # thrown into the plan at its yield
                error = exc

    def _open(self, endpoint: str) -> _Conn:
        conn = self._track(_open_socket(self._ctx, endpoint, self._curve, self._limits))
        conn.reader = asyncio.ensure_future(self._reader(conn))
        return conn

    async def _reader(self, conn: _Conn) -> None:
        while True:
            try:
                msg = await conn.sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                reply = p.decode_reply([f.buffer for f in msg], self._limits)
            except KvdError as exc:
                log.warning("discarding a malformed reply from %s: %s", conn.endpoint, exc)
                continue
            fut = conn.waiting.pop(reply.request_id, None) if reply.request_id is not None else None
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def _send(self, conn: _Conn, req: Any, deadline: float) -> None:
        frames = p.encode_request(req, conn.limits)
        fut = asyncio.get_running_loop().create_future()
        conn.waiting[req.request_id] = fut  # the reader resolves it
        conn.replies[req.request_id] = fut  # _wait takes it from here (it may be resolved before _wait runs)
        sent = conn.sock.send_multipart(frames, copy=False)  # pyzmq copies frames under its threshold
        if not sent.done():  # not connected (ZMQ_IMMEDIATE) or SNDHWM: wait a little for the pipe
            grace = min(deadline, time.monotonic() + CONNECT_GRACE_S) - time.monotonic()
            try:
                await asyncio.wait_for(sent, max(grace, 0.0))
            except asyncio.TimeoutError:
                conn.waiting.pop(req.request_id, None)
                conn.replies.pop(req.request_id, None)
                raise self._unavailable(conn, req.OP, deadline, self.timeout_s) from None
        else:
            sent.result()

    async def _wait(self, conn: _Conn, req: Any, deadline: float, timeout_s: float) -> Any:
        fut = conn.replies.pop(req.request_id, None)
        if fut is None:
            raise self._timeout(conn, req.OP, timeout_s)
        try:
            return await asyncio.wait_for(fut, max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            conn.waiting.pop(req.request_id, None)
            raise self._timeout(conn, req.OP, timeout_s) from None
        except asyncio.CancelledError:
            conn.waiting.pop(req.request_id, None)  # a late reply is discarded
            raise

    # -------------------------------------------------------------------------------------------- the API

    async def refresh(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """See :meth:`Client.refresh`."""
        return await self._drive(self._g_refresh(self._deadline(timeout_s)))

    async def register(self, namespace: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
                       timeout_s: float | None = None) -> None:
        """See :meth:`Client.register`."""
        await self._drive(self._plan_register(namespace, (num_layers, num_kv_heads, head_dim), timeout_s))

    async def append(self, namespace: str, seq_id: p.SeqId, keys: Any, values: Any, *,
                     offset: int | None = None, dtype: str | None = None, timeout_s: float | None = None) -> int:
        """See :meth:`Client.append`."""
        return await self._drive(
            self._plan_append(namespace, seq_id, keys, values, offset, dtype, timeout_s))

    async def get(self, namespace: str, seq_id: p.SeqId, start: int = 0, end: int | None = None,
                  layers: Sequence[int] | None = None, *, format: str = "fp16",  # noqa: A002
                  timeout_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Client.get`."""
        return await self._drive(
            self._plan_get(namespace, seq_id, start, end, layers, format, timeout_s))

    async def drop(self, namespace: str, seq_id: p.SeqId, *, timeout_s: float | None = None) -> bool:
        """See :meth:`Client.drop`."""
        return await self._drive(self._plan_simple(
            lambda rid: p.DropRequest(request_id=rid, namespace=namespace, seq_id=seq_id), namespace, seq_id,
            timeout_s))

    async def length(self, namespace: str, seq_id: p.SeqId, *, timeout_s: float | None = None) -> int:
        """See :meth:`Client.length`."""
        return await self._drive(self._plan_simple(
            lambda rid: p.LengthRequest(request_id=rid, namespace=namespace, seq_id=seq_id), namespace, seq_id,
            timeout_s))

    async def explain(self, namespace: str, seq_id: p.SeqId, layer: int, token: int, *,
                      timeout_s: float | None = None) -> dict[str, Any]:
        """See :meth:`Client.explain`."""
        return await self._drive(self._plan_simple(
            lambda rid: p.ExplainRequest(request_id=rid, namespace=namespace, seq_id=seq_id, layer=layer,
                                         token=token), namespace, seq_id, timeout_s))

    async def shard_stats(self, *, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """See :meth:`Client.shard_stats`."""
        return await self._drive(self._plan_shard_stats(timeout_s))

    async def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """See :meth:`Client.stats`."""
        return aggregate_stats(await self.shard_stats(timeout_s=timeout_s))

    async def ping(self, *, timeout_s: float | None = None) -> dict[str, float]:
        """See :meth:`Client.ping`."""
        return await self._drive(self._plan_ping(timeout_s))

    async def _gather(self, calls: list[Any], window: int, return_exceptions: bool) -> list[Any]:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidArgument(f"window must be a positive integer, got {window!r}")
        gate = asyncio.Semaphore(window)

        async def one(call: Any) -> Any:
            async with gate:
                try:
                    return await call()
                except KvdError as exc:
                    if not return_exceptions:
                        raise
                    return exc

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def append_many(self, items: Iterable[Sequence[Any]], *, window: int = DEFAULT_WINDOW,
                          return_exceptions: bool = False, timeout_s: float | None = None) -> list[Any]:
        """Concurrent appends, at most ``window`` in flight (see :meth:`Client.append_many`)."""
        calls = [lambda it=it: self.append(*it[:4], offset=it[4] if len(it) > 4 else None, timeout_s=timeout_s)
                 for it in items]
        return await self._gather(calls, window, return_exceptions)

    async def get_many(self, items: Iterable[Sequence[Any]], *, format: str = "fp16",  # noqa: A002
                       window: int = DEFAULT_WINDOW, return_exceptions: bool = False,
                       timeout_s: float | None = None) -> list[Any]:
        """Concurrent gets, at most ``window`` in flight (see :meth:`Client.get_many`)."""
        calls = [lambda it=it: self.get(*it, format=format, timeout_s=timeout_s) for it in items]
        return await self._gather(calls, window, return_exceptions)

    async def close(self) -> None:
        """Close every connection and cancel the reader tasks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        conns = self._all_conns()
        for conn in conns:
            conn.close()
        readers = [c.reader for c in conns if c.reader is not None]
        if readers:
            await asyncio.gather(*readers, return_exceptions=True)
        self._conns.clear()
        self._coordinator = None
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
