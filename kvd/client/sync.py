"""Clients of a kvd cluster: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio, same methods as
coroutines). Wire format: docs/protocol.md.

Theory of operation
-------------------
*Addressing.* ``address`` is the coordinator's endpoint (one string): the client asks it for the topology (op
``topology``) and routes each ``(namespace, seq_id)`` by rendezvous hashing over the shard ids
(:class:`kvd.wire.routing.Router`). If the string is a shard's endpoint instead (its ``hello`` says role
``shard``), the client uses that one shard. A list of shard endpoints is asked ``hello`` each for its shard id,
so routing agrees with clients that read the topology from the coordinator.

*Connections.* One DEALER per shard, opened on first use; the shard's ``hello`` is checked (protocol version,
shard id against the topology, limits). ``ZMQ_IMMEDIATE`` queues requests only to a live connection, so a shard
that is down shows at once as "cannot send" rather than as a silent queue; heartbeats detect dead peers.

*Pipelining.* Every request carries an id from one counter; replies are matched by id in any order and
replies to abandoned requests (timed out) are discarded. :meth:`Client.append_nowait` /
:meth:`Client.get_nowait` return a :class:`Pending`; :meth:`Client.append_many` / :meth:`Client.get_many` keep
a window of requests in flight. On :class:`AsyncClient`, concurrent coroutines pipeline by themselves.

*Failures.* Every call has a timeout (:class:`~kvd.errors.Timeout`). Server errors are raised as the same kvd
error class. ``Busy`` is retried with a short backoff within the call's timeout (a Busy request was not
executed); no retry starts that could not be answered before the timeout, so a call refused until then raises
``Busy`` (not run) rather than ``Timeout`` (an append: maybe run). On ShardUnavailable or Timeout, a client
that knows a coordinator re-reads the topology once and retries the call on the new owner if it is idempotent
(get, length, stats, explain, register); an append is
never retried silently (set ``offset`` to make a resend safe). A shard that answers WrongShard (protocol
1.3: it does not own the sequence by its topology) executed nothing: the client reads the topology again and
resends to the owner, pausing while that shard's topology lags, within the call's timeout.

*Notices.* An append to a shard of protocol 1.8 asks for its reply's ``notice``: the namespace needs a
calibration (it requires one, has none or only a quarantined one, and raw fallback is off). ``append`` still
returns the length; the client keeps each namespace's latest notice in :attr:`Client.notices` (a reply without
one clears it) and warns (:class:`~kvd.errors.KvdWarning`) the first time a namespace has one.

*Incarnations.* A shard's ``hello`` tells its incarnation (protocol 1.3), and every append names the
incarnation the sequence was last appended on by this client (the most recent 65,536 sequences) or else the
connection's. A shard that restarted, even on its old port, refuses it; an append without ``offset`` then
raises ShardUnavailable instead of continuing the sequence in the middle on the empty successor.

*Zero copy.* Arrays (numpy, buffer protocol, DLPack such as CPU torch tensors) are sent from their own memory
(frames of 1 MiB and more are not copied: do not modify an array until its call returned or its Pending
completed; smaller frames are copied, which costs less than a zero-copy send there). fp16 ``get`` results are
read-only numpy views of the received frames; ``format="pages"`` results are decoded on the client
(:func:`kvd.pages.assemble`) into new arrays. Pages travel packed, a few frames per reply, from every shard
whose ``hello`` reports protocol 1.1 or later, and one frame per page otherwise. From protocol 1.4, keys and
values travel in one frame (packed tensors): fp16 ``get`` replies of up to 1 MiB (the two results are then views
of one frame), and appends under ``PACK_BELOW_BYTES`` (copied into that frame).

Neither client is thread-safe: use one per thread (or per event loop).
"""


from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import zmq
import zmq.backend

from kvd.client.aio import AsyncClient  # re-exported: kvd.client is where callers import it from
from kvd.client.conn import _open_socket
from kvd.client.core import (
    CONNECT_GRACE_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WINDOW,
    First,
    Plan,
    _append_chunks,  # noqa: F401 - re-exported for the tests
    _Conn,
    _Core,
    _on_wire,
    _value,
    aggregate_stats,
)
from kvd.client.messages import _decode_reply
from kvd.errors import InvalidArgument, KvdError, WrongShard
from kvd.wire import protocol as p
from kvd.wire.curve import CurveConfig
from kvd.wire.sockets import recv_frames, send_frames

log = logging.getLogger(__name__)

__all__ = ["AsyncClient", "Client", "Pending", "aggregate_stats"]

_RCVTIMEO, _NOBLOCK, _POLLIN, _EVENTS = int(zmq.RCVTIMEO), int(zmq.NOBLOCK), int(zmq.POLLIN), int(zmq.EVENTS)
_get = zmq.backend.Socket.get  # the backend's getsockopt: no enum wrapping on the hot path


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
                if type(self._req) is p.AppendRequest:
                    self._client._remember(self._req, self._conn)
                    self._client._note(self._req, reply)
            except KvdError as exc:
                self._outcome = (False, exc)
        ok, value = self._outcome
        if not ok:
            raise value
        return value


class Client(_Core):
    """A blocking client. ``address``: the coordinator's endpoint, one shard's endpoint, or a list of shard
    endpoints. ``timeout_s`` bounds every call (each method also takes ``timeout_s=``); ``curve``: a client
    :class:`~kvd.wire.server.CurveConfig`; ``limits``: what this client accepts in a reply. Connects and reads the
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
        frames = p.encode_request(_on_wire(conn, req), conn.limits)
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
        """File replies by id: with ``wait_s`` > 0 one message (waiting up to ``wait_s``), else all there is."""
        sock = conn.sock
        if wait_s > 0:
            # one blocking receive, no getsockopt(EVENTS) before or after (~2 us each): the caller loops until
            # its reply is in, and replies to other requests are filed on the way
            ms = -(-int(wait_s * 1000) // 50) * 50 or 1  # on a 50 ms grid: RCVTIMEO is not reset every call
            if conn.rcvtimeo != ms:
                sock.setsockopt(_RCVTIMEO, ms)
                conn.rcvtimeo = ms
            try:
                self._file(conn, recv_frames(sock))
            except zmq.Again:
                pass
            return
        while int(_get(sock, _EVENTS)) & _POLLIN:
            self._file(conn, recv_frames(sock))

    def _file(self, conn: _Conn, msg: list[zmq.Frame]) -> None:
        reply = _decode_reply([f.buffer for f in msg], self._limits, conn.endpoint)
        if reply is None:
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

    def _first(self, req: Any, namespace: str, seq_id: p.SeqId, timeout_s: float | None,
               tensor_bytes: int = 0) -> First | None:
        """The fast path of a routed call: its first attempt made directly (no plan, no generators) when the
        owner's connection is open and greeted, else None (nothing was sent: the plan makes every attempt).
        The outcome (a reply, or the kvd error of the send or the wait) goes back to the plan unless it is the
        plain success the caller reads itself; the plan then does exactly what it would have done."""
        shard = self._topo.owner(namespace, seq_id)
        conn = self._conns.get(shard["endpoint"])
        if conn is None or conn.shard_id != shard["id"]:
            return None
        if tensor_bytes:  # an append: only one that fits one message (else the plan splits it along T)
            lim = conn.limits
            if tensor_bytes > min(lim.max_frame_bytes, (lim.max_message_bytes - lim.max_header_bytes) // 2):
                return None
        deadline = self._deadline(timeout_s)
        if type(req) is p.AppendRequest:
            req = _on_wire(conn, self._bind(req))  # the incarnation it is meant for is fixed before it is sent
        try:
            self._send(conn, req, deadline)
            outcome = self._wait(conn, req, deadline, self.timeout_s if timeout_s is None else timeout_s)
        except KvdError as exc:
            outcome = exc
        return First(conn, req, deadline, outcome)

    # -------------------------------------------------------------------------------------------- the API

    def refresh(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Re-read the topology from the coordinator (nothing to do for shard endpoints); returns it."""
        return self._drive(self._g_refresh(self._deadline(timeout_s)))

    def register(self, namespace: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 timeout_s: float | None = None) -> None:
        """Register a layout on every shard (Store.register). Raises LayoutMismatch, ShardUnavailable, ..."""
        self._drive(self._plan_register(namespace, (num_layers, num_kv_heads, head_dim), timeout_s))

    def calibrate(self, namespace: str, calibration: Any = None, *, require: bool | None = None,
                  timeout_s: float | None = None) -> dict[str, Any]:
        """Give ``namespace`` (registered) a calibration (a :class:`kvd.calibration.Calibration` or its
        ``to_dict()``) on every shard (protocol 1.7, docs/protocol.md §6.13); in a cluster the coordinator keeps
        it with the namespace and hands it to every shard, a restarted or later one too. Pages sealed from then
        on follow it. ``require`` (protocol 1.8; None: unchanged): the namespace's own
        ``require_calibration``, kept by the coordinator with the calibration; with ``calibration`` None only
        that is set and the namespace keeps its calibration. Returns the state: ``{"state": "active" |
        "quarantined" | "missing" | "needed" | ..., "reason", "digest", "model", "levels": {level: {"budget",
        "mean", "worst", "bits", "met", "off", "protected"}}}``, with ``"required"`` when ``require`` was
        given; a calibration measured on another layout is quarantined (kept, never applied). Raises
        InvalidArgument for a malformed record or neither argument, UnknownNamespace, and ProtocolError when a
        shard is older than 1.7 (1.8 with ``require``; nothing is sent then)."""
        return self._drive(self._plan_calibrate(namespace, calibration, require, timeout_s))

    def append(self, namespace: str, seq_id: p.SeqId, keys: Any, values: Any, *, offset: int | None = None,
               dtype: str | None = None, position: int | None = None, parent: p.SeqId | None = None,
               timeout_s: float | None = None) -> int:
        """Append ``keys``/``values`` ``[L, T, H, D]`` (float16, float32 or bfloat16; ``dtype="bfloat16"`` for
        16-bit integer arrays holding bfloat16 bits); returns the new length. ``offset``: store only if the
        sequence's length equals it (else :class:`~kvd.errors.Conflict`). Never retried after a failure. An
        append larger than the shard's frame limit goes as several appends along T; if one of them fails, the
        tokens before it stay stored (the error says how many). ``position``: where the sequence's token 0 sits
        in its prompt (default 0; see :meth:`kvd.store.Store.append`): a prompt stored as one sequence per block
        passes each block's first token index, so only the prompt's first block keeps the sink page.
        ``parent``: the sequence a new one follows in a chain that lookups walk in order (the previous block of
        such a prompt): a full shard then gives up what no lookup can reach first, then chain tails
        (:mod:`kvd.store.chains`). Sent only when both live on the same shard, and to a server of protocol 1.6
        or later."""
        parent = self._parent_here(namespace, seq_id, parent)
        first = None
        if type(keys) is np.ndarray:  # other array types: the plan views them (and splits them) once
            first = self._first(p.AppendRequest(request_id=next(self._ids), namespace=namespace, seq_id=seq_id,
                                                keys=keys, values=values, offset=offset, dtype=dtype,
                                                position=position, parent=parent), namespace, seq_id, timeout_s,
                                keys.nbytes or 1)
            if first is not None and type(first.outcome) is p.AppendReply:
                self._remember(first.req, first.conn)
                self._note(first.req, first.outcome)
                return first.outcome.length
        return self._drive(
            self._plan_append(namespace, seq_id, keys, values, offset, dtype, timeout_s, position, first, parent))

    def get(self, namespace: str, seq_id: p.SeqId, start: int = 0, end: int | None = None,
            layers: Sequence[int] | None = None, *, format: str = "fp16",  # noqa: A002 - the protocol's name
            timeout_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, end)`` of ``layers`` as float16 ``(keys, values)`` ``[L', T', H, D]`` (Store.get).
        ``format="pages"`` fetches the stored pages and decodes them here (fewer bytes on the wire). A range
        too large for one reply is fetched in parts."""
        first = self._first(p.GetRequest(request_id=next(self._ids), namespace=namespace, seq_id=seq_id,
                                         start=start, end=end, layers=None if layers is None else tuple(layers),
                                         format=format, packed=True), namespace, seq_id, timeout_s)
        if first is not None and type(first.outcome) is p.GetReply and format == "fp16":  # else the plan says
            return first.outcome.keys, first.outcome.values  # what is wrong (or assembles the pages)
        return self._drive(
            self._plan_get(namespace, seq_id, start, end, layers, format, timeout_s, first))

    def drop(self, namespace: str, seq_id: p.SeqId, *, timeout_s: float | None = None) -> bool:
        """Forget a sequence; False if there was none (Store.drop). Not retried."""
        return self._drive(self._plan_simple(
            lambda rid: p.DropRequest(request_id=rid, namespace=namespace, seq_id=seq_id), namespace, seq_id,
            timeout_s))

    def length(self, namespace: str, seq_id: p.SeqId, *, timeout_s: float | None = None) -> int:
        """Tokens stored for the sequence (Store.length)."""
        first = self._first(p.LengthRequest(request_id=next(self._ids), namespace=namespace, seq_id=seq_id),
                            namespace, seq_id, timeout_s)
        if first is not None and type(first.outcome) is p.LengthReply:
            return first.outcome.length
        return self._drive(self._plan_simple(
            lambda rid: p.LengthRequest(request_id=rid, namespace=namespace, seq_id=seq_id), namespace, seq_id,
            timeout_s, first))

    def lengths(self, namespace: str, seq_ids: Sequence[p.SeqId], *,
                timeout_s: float | None = None) -> list[int | None]:
        """Tokens stored for each sequence, None where there is none (never appended, dropped, evicted), in
        order: one request per shard, all in flight at once (a prefix lookup of any length costs one round
        trip). Does not count as a use for LRU. Raises UnknownNamespace if a shard does not know the namespace."""
        return self._drive(self._plan_lengths(namespace, seq_ids, timeout_s))

    def attend(self, namespace: str, seq_id: p.SeqId, layer: int, queries: Any, *, start: int = 0,
               end: int | None = None, scale: float | None = None, positions: Any = None,
               timeout_s: float | None = None) -> tuple[Any, Any]:
        """Attention of ``queries`` (float16/float32 ``[T_q, H_q, D]``, ``H_q`` a multiple of the namespace's KV
        heads) over tokens ``[start, end)`` (``end`` None: the length) of ``layer``, computed by the shard over
        its pages as stored (protocol 1.5, docs/protocol.md §6.12): ``(out [T_q, H_q, D], lse [T_q, H_q])``
        float32, to merge with other parts by :func:`kvd.attention.merge`. ``scale`` defaults to
        ``1/sqrt(head_dim)``; query ``i`` sees the positions ``<= positions[i]`` (default: the last ``T_q``
        positions of the range). At most 4096 queries. Raises what the store's ``attend`` raises, and
        ProtocolError for a shard older than 1.5."""
        return self._drive(self._plan_attend(namespace, seq_id, layer, queries, start, end, scale, positions,
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
        shard = self._topo.owner(namespace, seq_id)
        conn = self._conns.get(shard["endpoint"])
        if conn is None or conn.shard_id != shard["id"]:  # not open, or not greeted as this shard yet
            conn = self._drive(self._g_conn(shard, deadline))
        req = _on_wire(conn, self._bind(req))  # an append names the incarnation it is meant for
        self._send(conn, req, deadline)
        return Pending(self, conn, req, deadline, self._tmo(timeout_s))

    def append_nowait(self, namespace: str, seq_id: p.SeqId, keys: Any, values: Any, *,
                      offset: int | None = None, dtype: str | None = None, position: int | None = None,
                      parent: p.SeqId | None = None, timeout_s: float | None = None) -> Pending:
        """Send an append and return at once; :meth:`Pending.result` gives the new length. No retries: a Busy
        reply raises :class:`~kvd.errors.Busy`; set ``offset`` when pipelining appends to one sequence. Do not
        modify the arrays before the Pending completed (they are sent from their own memory)."""
        req = p.AppendRequest(request_id=next(self._ids), namespace=namespace, seq_id=seq_id, keys=keys,
                              values=values, offset=offset, dtype=dtype, position=position,
                              parent=self._parent_here(namespace, seq_id, parent))
        return self._submit(req, namespace, seq_id, timeout_s)

    def get_nowait(self, namespace: str, seq_id: p.SeqId, start: int = 0, end: int | None = None,
                   layers: Sequence[int] | None = None, *, format: str = "fp16",  # noqa: A002
                   timeout_s: float | None = None) -> Pending:
        """Send a get and return at once; :meth:`Pending.result` gives ``(keys, values)``."""
        req = p.GetRequest(request_id=next(self._ids), namespace=namespace, seq_id=seq_id, start=start, end=end,
                           layers=None if layers is None else tuple(layers), format=format, packed=True)
        return self._submit(req, namespace, seq_id, timeout_s)

    def _many(self, submit: Any, items: Iterable[Sequence[Any]], window: int,
              return_exceptions: bool, redo: Any) -> list[Any]:
        """``submit`` each item with at most ``window`` in flight; an item refused with WrongShard (not
        executed: a stale topology, or a shard that restarted) is done again with ``redo``, the blocking call,
        which reads the topology again and resends where it may (in order, after the window)."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidArgument(f"window must be a positive integer, got {window!r}")
        pending: list[Pending | KvdError] = []
        out: list[Any] = []
        done: list[Sequence[Any]] = []
        for item in items:
            done.append(item)
            if len(pending) - len(out) >= window:
                out.append(_outcome(pending[len(out)]))
            try:
                pending.append(submit(item))
            except KvdError as exc:
                pending.append(exc)
        out.extend(_outcome(x) for x in pending[len(out):])
        for i, value in enumerate(out):
            if isinstance(value, WrongShard):
                try:
                    out[i] = redo(done[i])
                except KvdError as exc:
                    out[i] = exc
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
        def offset(it: Sequence[Any]) -> int | None:
            return it[4] if len(it) > 4 else None

        return self._many(lambda it: self.append_nowait(*it[:4], offset=offset(it), timeout_s=timeout_s), items,
                          window, return_exceptions,
                          lambda it: self.append(*it[:4], offset=offset(it), timeout_s=timeout_s))

    def get_many(self, items: Iterable[Sequence[Any]], *, format: str = "fp16",  # noqa: A002
                 window: int = DEFAULT_WINDOW, return_exceptions: bool = False,
                 timeout_s: float | None = None) -> list[Any]:
        """Pipelined gets: ``items`` of ``(namespace, seq_id[, start[, end[, layers]]])``; returns
        ``(keys, values)`` pairs in order (failures as in :meth:`append_many`)."""
        return self._many(lambda it: self.get_nowait(*it, format=format, timeout_s=timeout_s), items, window,
                          return_exceptions, lambda it: self.get(*it, format=format, timeout_s=timeout_s))

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
