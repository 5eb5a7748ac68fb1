"""What :class:`kvd.client.Client` and :class:`kvd.client.aio.AsyncClient` share: :class:`_Core`, which holds
addressing, topology, routing, request ids and every call's *plan* (a generator of I/O actions that each client
runs with its own I/O: blocking calls or awaits). Connections are :mod:`kvd.client.conn`'s, requests and replies
:mod:`kvd.client.messages`'s (their public names stay importable from here). Theory of operation: the docstring
of :mod:`kvd.client`."""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from kvd.client.conn import RECYCLE_BYTES, _check_hello, _Conn, check_endpoint, recycle_buffers
from kvd.client.messages import (
    PACK_BELOW_BYTES,
    _append_chunks,
    _is_busy,
    _on_wire,
    _renumber,
    _replace,
    _value,
    aggregate_stats,
)
from kvd.errors import (
    InvalidArgument,
    KvdError,
    KvdWarning,
    MessageTooLarge,
    ProtocolError,
    ShardUnavailable,
    Timeout,
    UnknownSequence,
    WrongShard,
)
from kvd.wire import protocol as p
from kvd.wire.curve import CurveConfig
from kvd.wire.routing import Topology

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_WINDOW", "PACK_BELOW_BYTES", "RECYCLE_BYTES", "aggregate_stats",
           "check_endpoint", "recycle_buffers"]

DEFAULT_TIMEOUT_S = 10.0
CONNECT_GRACE_S = 2.0  # a shard we cannot send to for this long (within a call's timeout) is unavailable
DEFAULT_WINDOW = 64  # requests in flight per *_many call; well under a shard's admission queue
_BUSY_BACKOFF_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
# WrongShard from the owner the coordinator names too: that shard has not got the topology yet (it gets it
# within one report interval); retry it after these pauses, within the call's timeout.
_ROUTE_BACKOFF_S = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
# Sequences whose shard incarnation a client remembers (the most recently appended): an append to one of them
# names that incarnation, so a restarted shard (empty, on any port) refuses to continue it in the middle.
WRITTEN_ENTRIES = 65536
_IDEMPOTENT = frozenset({"get", "length", "lengths", "stats", "explain", "register", "attend",
                         "calibrate"})


class First:
    """The first attempt of a routed request, made by a client's fast path without the plan machinery (the
    connection was open and greeted): the request as sent, its connection and deadline, and its ``outcome``,
    the reply or the kvd error that sending or waiting raised. :meth:`_Core._g_routed` goes on from it."""

    __slots__ = ("conn", "req", "deadline", "outcome")

    def __init__(self, conn: _Conn, req: Any, deadline: float, outcome: Any) -> None:
        self.conn, self.req, self.deadline, self.outcome = conn, req, deadline, outcome


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
            self._seeds: tuple[str, ...] = (check_endpoint("address", address),)
        else:
            self._seeds = tuple(check_endpoint(f"address[{i}]", a) for i, a in enumerate(address))
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
        # sequence -> incarnation it was appended on, least recently appended first. An OrderedDict: a dict's
        # oldest entry, taken with next(iter()) after many deletions, costs a scan over the deleted slots
        # before it (up to 50 us more per append past WRITTEN_ENTRIES sequences; bench/client_state.py)
        self._written: OrderedDict[tuple[str, type, p.SeqId], str] = OrderedDict()
        # namespace -> the latest notice its append replies carried (protocol 1.8; see _note), and the
        # namespaces this client warned about
        self.notices: dict[str, str] = {}
        self._warned: set[str] = set()
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

    def _bind(self, req: Any) -> Any:
        """An append to a sequence this client appended to before names the shard incarnation it went to."""
        if type(req) is p.AppendRequest and req.incarnation is None:
            incarnation = self._written.get((req.namespace, type(req.seq_id), req.seq_id))
            if incarnation is not None:
                return _replace(req, incarnation=incarnation)
        return req

    def _remember(self, req: Any, conn: _Conn) -> None:
        """After a successful append (or drop) of ``req`` on ``conn``: remember (forget) its incarnation."""
        key = (req.namespace, type(req.seq_id), req.seq_id)
        if type(req) is p.AppendRequest and conn.incarnation is not None:
            written = self._written
            if key in written:
                written.move_to_end(key)  # the oldest entry goes first
            elif len(written) >= WRITTEN_ENTRIES:
                written.popitem(last=False)
            written[key] = conn.incarnation
        elif type(req) is p.DropRequest:
            self._written.pop(key, None)

    def _note(self, req: Any, reply: Any) -> None:
        """After a successful append ``req`` (sent with ``notices``, to a 1.8 server): keep its reply's notice
        as the namespace's latest in :attr:`notices` (a reply without one clears it: the namespace got what it
        lacked), and warn (:class:`~kvd.errors.KvdWarning`) the first time a namespace has one."""
        notice = reply.notice
        if notice is None:
            if self.notices and req.notices:
                self.notices.pop(req.namespace, None)
            return
        namespace = req.namespace
        self.notices[namespace] = notice
        if namespace not in self._warned:
            self._warned.add(namespace)
            warnings.warn(f"kvd namespace {namespace!r}: {notice} (this client warns once per namespace; "
                          "client.notices holds the latest)", KvdWarning, stacklevel=3)

    # -------------------------------------------------------------------------------------------- plans

    def _g_roundtrip(self, conn: _Conn, req: Any, deadline: float, timeout_s: float, reply: Any = None) -> Plan:
        """Send and wait; ``Busy`` is retried with backoff until the deadline (a Busy request was not run).
        ``reply``: the reply to ``req``, already sent and received (a client's first attempt, :class:`First`).

        No retry starts that could not be answered before the deadline (the backoff plus twice the last round
        trip): a retry cut off by the deadline would end in Timeout, which tells the caller less (an append may
        or may not have run) than the Busy it had (not run)."""
        backoffs = iter(_BUSY_BACKOFF_S)
        rtt = 0.0
        while True:
            if reply is None:
                sent = time.monotonic()
                yield ("send", conn, req, deadline)
                reply = yield ("wait", conn, req, deadline, timeout_s)
                rtt = time.monotonic() - sent
            if not _is_busy(reply):
                return reply
            backoff = next(backoffs, _BUSY_BACKOFF_S[-1])
            if time.monotonic() + backoff + 2 * rtt >= deadline:
                return reply
            yield ("sleep", backoff)
            req = _renumber(req, next(self._ids))
            reply = None

    def _g_hello_reply(self, conn: _Conn, deadline: float) -> Plan:
        """The hello reply of ``conn``'s server, asking for its incarnation (protocol 1.3); a server older
        than 1.3 refuses that field (ProtocolError) and is asked again the 1.0 way."""
        req = p.HelloRequest(request_id=next(self._ids), incarnation=True)
        reply = yield from self._g_roundtrip(conn, req, deadline, self.timeout_s)
        if isinstance(reply, p.ErrorReply) and reply.code == ProtocolError.code:
            req = p.HelloRequest(request_id=next(self._ids))
            reply = yield from self._g_roundtrip(conn, req, deadline, self.timeout_s)
        return reply

    def _g_hello(self, conn: _Conn, expect_id: str | None, deadline: float) -> Plan:
        _check_hello(conn, (yield from self._g_hello_reply(conn, deadline)), expect_id)

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
            reqs = [p.HelloRequest(request_id=next(self._ids), incarnation=True) for _ in conns]
            for conn, req in zip(conns, reqs, strict=True):
                yield ("send", conn, req, deadline)
            for conn, req in zip(conns, reqs, strict=True):
                reply = yield ("wait", conn, req, deadline, self.timeout_s)
                if isinstance(reply, p.ErrorReply) and reply.code == ProtocolError.code:
                    reply = yield from self._g_hello_reply(conn, deadline)  # an older server: retried plainly
                _check_hello(conn, reply, None)
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

    def _g_routed(self, make: Any, namespace: str, seq_id: p.SeqId, timeout_s: float | None,
                  first: First | None = None) -> Plan:
        """One request to the owner of ``(namespace, seq_id)``. On ShardUnavailable or Timeout, the topology is
        read again once and an idempotent request retried. On WrongShard (protocol 1.3) the request was not
        executed: see :meth:`_g_moved`, then it is resent, within the call's timeout. ``first``: the first
        attempt, already made by the client's fast path (:class:`First`); the plan goes on from its outcome
        exactly as if it had made that attempt itself."""
        tmo = self._tmo(timeout_s)
        if first is None:
            deadline = self._deadline(timeout_s)
            req = self._bind(make(next(self._ids)))
        else:
            deadline, req = first.deadline, first.req
        refreshed = False
        backoffs = iter(_ROUTE_BACKOFF_S)
        while True:
            conn: _Conn | None = None
            try:
                if first is not None:
                    conn, outcome, first = first.conn, first.outcome, None
                    if isinstance(outcome, BaseException):
                        raise outcome
                    reply = yield from self._g_roundtrip(conn, req, deadline, tmo, outcome)
                else:
                    conn = yield from self._g_conn(self._topo.owner(namespace, seq_id), deadline)
                    if type(req) is p.AttendRequest and not conn.attends:
                        raise ProtocolError(f"shard {conn.shard_id!r} speaks protocol 1."
                                            f"{conn.hello.protocol_minor if conn.hello else 0}: attend needs 1.5")
                    if type(req) is p.AppendRequest:
                        req = _on_wire(conn, req)  # the incarnation it is meant for is fixed before it is sent
                    reply = yield from self._g_roundtrip(conn, req, deadline, tmo)
                value = _value(req, reply)
                if type(req) in (p.AppendRequest, p.DropRequest):
                    self._remember(req, conn)
                    if type(req) is p.AppendRequest:
                        self._note(req, reply)
                return value
            except WrongShard as exc:
                assert conn is not None  # hello never answers WrongShard
                req = yield from self._g_moved(conn, req, exc, namespace, seq_id, deadline, backoffs)
            except (ShardUnavailable, Timeout):
                if self._coordinator is None or refreshed:
                    raise
                refreshed = True
                deadline = self._deadline(timeout_s)  # the retry has a timeout of its own
                yield from self._g_refresh(deadline)
                if req.OP not in _IDEMPOTENT:
                    raise
            req = _renumber(req, next(self._ids))

    def _g_moved(self, conn: _Conn, req: Any, exc: WrongShard, namespace: str, seq_id: p.SeqId, deadline: float,
                 backoffs: Any) -> Plan:
        """After WrongShard: returns the request to resend, or raises when it must not be resent.

        The shard is greeted again. If the request named an incarnation the shard no longer is, the shard
        restarted (on this endpoint or another) and lost its sequences: an append without ``offset`` is not
        resent (ShardUnavailable; the client forgets the sequence, so an append after that starts it over), an
        append with ``offset`` is, to the new process. Otherwise the shard does not own the sequence by its
        topology: the topology is read again (a client without a coordinator raises), and if the owner is
        still this shard, that shard's topology lags the coordinator's: resent after a pause."""
        meant = req.incarnation if type(req) is p.AppendRequest else None
        yield from self._g_hello(conn, conn.shard_id, deadline)
        if meant is not None and conn.incarnation != meant:
            self._written.pop((namespace, type(seq_id), seq_id), None)
            if req.offset is None:
                raise ShardUnavailable(
                    f"sequence {seq_id!r} was appended on shard incarnation {meant}, and shard {conn.shard_id!r} "
                    f"at {conn.endpoint} is now incarnation {conn.incarnation}: the shard restarted (or the "
                    "sequence's owner changed) and the earlier tokens are not there. This append was not "
                    "stored. Resend it with offset to continue the sequence only where it still is, or append "
                    "again to start it over"
                ) from exc
            return _replace(req, incarnation=None)
        if self._coordinator is None:
            raise exc
        shard = self._topo.owner(namespace, seq_id)
        yield from self._g_refresh(deadline)
        if self._topo.owner(namespace, seq_id)["id"] == shard["id"]:
            backoff = next(backoffs, _ROUTE_BACKOFF_S[-1])
            if time.monotonic() + backoff >= deadline:
                raise exc
            yield ("sleep", backoff)
        if type(req) is p.AppendRequest:  # it named the incarnation of the shard it went to: bind it anew
            return self._bind(_replace(req, incarnation=None))
        return req

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

    def _plan_calibrate(self, namespace: str, calibration: Any, require: bool | None,
                        timeout_s: float | None) -> Plan:
        """``calibrate`` on every shard, as ``register``: each shard applies it (in a cluster it is made
        cluster-wide first: the coordinator keeps it with the namespace and hands it to every shard, also one
        that starts later). Every shard must speak protocol 1.7 (1.8 with ``require``): nothing is sent
        otherwise. Returns the first shard's calibration state."""
        from kvd.calibration import Calibration, from_dict

        record = calibration.to_dict() if isinstance(calibration, Calibration) else calibration
        if record is not None:
            from_dict(record)  # argument errors (a malformed record, a digest that does not match) before any I/O

        def make(rid: int) -> p.CalibrateRequest:
            return p.CalibrateRequest(request_id=rid, namespace=namespace, calibration=record, require=require)

        make(0)
        deadline = self._deadline(timeout_s)
        for shard in self._shards:
            conn = yield from self._g_conn(shard, deadline)
            if not conn.calibrates or (require is not None and not conn.requires):
                minor = conn.hello.protocol_minor if conn.hello else 0
                what = "calibrate needs 1.7" if not conn.calibrates else "calibrate's require needs 1.8"
                raise ProtocolError(f"shard {conn.shard_id!r} speaks protocol 1.{minor}: {what} on every shard "
                                    "(nothing was sent); upgrade the cluster's kvd")
        results = yield from self._g_everywhere(make, timeout_s)
        if self._coordinator is not None and any(isinstance(r, (ShardUnavailable, Timeout)) for r in results):
            yield from self._g_refresh(self._deadline(timeout_s))
            results = yield from self._g_everywhere(make, timeout_s)
        for r in results:
            if isinstance(r, KvdError):
                raise r
        return results[0]

    def _parent_here(self, namespace: str, seq_id: p.SeqId, parent: p.SeqId | None) -> p.SeqId | None:
        """``parent`` if it lives on ``seq_id``'s shard, else None: a shard knows only the chains it holds
        whole (kvd.store.chains)."""
        if parent is None:
            return None
        same = self._topo.owner(namespace, parent)["id"] == self._topo.owner(namespace, seq_id)["id"]
        return parent if same else None

    def _plan_append(self, namespace: str, seq_id: p.SeqId, keys: Any, values: Any, offset: int | None,
                     dtype: str | None, timeout_s: float | None, position: int | None = None,
                     first: First | None = None, parent: p.SeqId | None = None) -> Plan:
        if first is not None:  # a fast path's attempt: a whole append in one message
            return (yield from self._g_routed(None, namespace, seq_id, timeout_s, first))
        owner = self._topo.owner(namespace, seq_id)
        conn = yield from self._g_conn(owner, self._deadline(timeout_s))
        chunks = _append_chunks(keys, values, conn.limits)
        length = offset
        for i, (k, v) in enumerate(chunks):
            def make(rid: int, k: Any = k, v: Any = v, off: int | None = length) -> p.AppendRequest:
                return p.AppendRequest(request_id=rid, namespace=namespace, seq_id=seq_id, keys=k, values=v,
                                       offset=off, dtype=dtype, position=position, parent=parent)
            try:
                length = yield from self._g_routed(make, namespace, seq_id, timeout_s)
            except KvdError as exc:
                if i:
                    raise type(exc)(f"{exc} (after {i} of {len(chunks)} parts of this append were stored, up "
                                    f"to length {length})") from exc
                raise
        return length

    def _plan_get(self, namespace: str, seq_id: p.SeqId, start: int, end: int | None,
                  layers: Sequence[int] | None, fmt: str, timeout_s: float | None, first: First | None = None
                  ) -> Plan:
        def make(rid: int) -> p.GetRequest:
            return p.GetRequest(request_id=rid, namespace=namespace, seq_id=seq_id, start=start, end=end,
                                layers=None if layers is None else tuple(layers), format=fmt, packed=True)
        try:
            return (yield from self._g_routed(make, namespace, seq_id, timeout_s, first))
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

    def _plan_attend(self, namespace: str, seq_id: p.SeqId, layer: int, queries: Any, start: int,
                     end: int | None, scale: float | None, positions: Any, timeout_s: float | None) -> Plan:
        listed = None if positions is None else tuple(int(i) for i in np.asarray(positions).reshape(-1))

        def make(rid: int) -> p.AttendRequest:
            return p.AttendRequest(request_id=rid, namespace=namespace, seq_id=seq_id, layer=layer,
                                   queries=queries, start=start, end=end, scale=scale, positions=listed)
        return (yield from self._g_routed(make, namespace, seq_id, timeout_s))

    def _plan_lengths(self, namespace: str, seq_ids: Sequence[p.SeqId], timeout_s: float | None) -> Plan:
        """Lengths of many sequences (None: no such sequence), one ``lengths`` request per shard, all in flight
        at once; a shard older than protocol 1.2 gets pipelined ``length`` requests instead. WrongShard (a stale
        topology): the topology is read again and the lookup repeated, within the call's timeout."""
        deadline = self._deadline(timeout_s)
        backoffs = iter(_ROUTE_BACKOFF_S)
        while True:
            try:
                return (yield from self._g_lengths(namespace, seq_ids, timeout_s))
            except WrongShard:
                backoff = next(backoffs, _ROUTE_BACKOFF_S[-1])
                if self._coordinator is None or time.monotonic() + backoff >= deadline:
                    raise
                before = self._topo.epoch
                yield from self._g_refresh(deadline)
                if self._topo.epoch == before:
                    yield ("sleep", backoff)  # a shard's topology lags the coordinator's

    def _g_lengths(self, namespace: str, seq_ids: Sequence[p.SeqId], timeout_s: float | None) -> Plan:
        ids = list(seq_ids)
        deadline, tmo = self._deadline(timeout_s), self._tmo(timeout_s)
        groups: dict[str, tuple[dict[str, str], list[int]]] = {}
        for i, sid in enumerate(ids):
            shard = self._topo.owner(namespace, sid)
            groups.setdefault(shard["id"], (shard, []))[1].append(i)
        sent: list[tuple[_Conn, Any, list[int]]] = []
        for shard, idxs in groups.values():
            conn = yield from self._g_conn(shard, deadline)
            batches = ([idxs[a : a + p.MAX_LOOKUP] for a in range(0, len(idxs), p.MAX_LOOKUP)] if conn.lookups
                       else [[i] for i in idxs])
            for batch in batches:
                rid = next(self._ids)
                req: Any = (p.LengthsRequest(request_id=rid, namespace=namespace, seq_ids=[ids[i] for i in batch])
                            if conn.lookups else p.LengthRequest(request_id=rid, namespace=namespace,
                                                                 seq_id=ids[batch[0]]))
                yield ("send", conn, req, deadline)
                sent.append((conn, req, batch))
        out: list[int | None] = [None] * len(ids)
        for conn, req, batch in sent:
            reply = yield ("wait", conn, req, deadline, tmo)
            if _is_busy(reply):
                reply = yield from self._g_roundtrip(conn, _renumber(req, next(self._ids)), deadline, tmo)
            try:
                found = _value(req, reply)
            except UnknownSequence:
                found = None
            for i, n in zip(batch, found if isinstance(req, p.LengthsRequest) else [found], strict=True):
                out[i] = n
        return out

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

    def _plan_simple(self, make: Any, namespace: str, seq_id: p.SeqId, timeout_s: float | None,
                     first: First | None = None) -> Plan:
        return (yield from self._g_routed(make, namespace, seq_id, timeout_s, first))

    def _all_conns(self) -> list[_Conn]:
        return [c for c in self._opened if not c.closed]

    def _track(self, conn: _Conn) -> _Conn:
        self._opened = [c for c in self._opened if not c.closed]
        self._opened.append(conn)
        return conn
