"""The data path around one store: :class:`ShardServer`, a :class:`~kvd.wire.server.loop.RouterServer` whose
requests are the store's operations, large ones on its bulk lane (:mod:`kvd.wire.server.lane`).

*Compaction* (:meth:`Store.compact`) runs between requests, with ``compact_budget_bytes`` per call: on the bulk
lane when it has no request (again at once while a backlog remains, else every ``loop.IDLE_TICK_S``), and after
every ``compact_every`` bulk requests, in steps of ``COMPACT_STEP_BYTES`` that let go of the store's lock.

*Long lookups* (a ``lengths`` of more than ``LOOKUP_SLICE`` ids) run on the loop in slices, other connections'
requests between them (:mod:`kvd.wire.server.loop`, admission).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import numpy as np

from kvd.codec import pages
from kvd.errors import (
    Busy,
    ConfigError,
    Conflict,
    MessageTooLarge,
    ProtocolError,
    UnknownNamespace,
    UnknownSequence,
    WrongShard,
)
from kvd.store.core import PACK_FRAME_BYTES, OnDisk, ReadTooLarge, Store
from kvd.wire import protocol as p
from kvd.wire.curve import CurveConfig
from kvd.wire.routing import Router
from kvd.wire.server.loop import (
    DEFAULT_HWM,
    DEFAULT_LINGER_S,
    DEFAULT_MAX_PEER_REQUESTS,
    DEFAULT_MAX_QUEUED_BYTES,
    DEFAULT_MAX_QUEUED_REQUESTS,
    RouterServer,
    ToBulkLane,
)
from kvd.wire.sockets import (
    DEFAULT_HEARTBEAT_IVL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    TRIM_EVERY_S,
    is_loopback,
    tune_malloc,
)

__all__ = ["BULK_MIN_BYTES", "COMPACT_STEP_BYTES", "LOOKUP_SLICE", "LOOPBACK_SOCKET_BUFFER_BYTES",
           "MIN_REPLY_BUDGET_BYTES", "PACK_REPLY_MAX_BYTES", "REPLY_BUDGET_PER_CAPACITY", "ShardServer",
           "default_reply_budget"]

log = logging.getLogger("kvd.wire.server")

# Socket buffers of a shard bound to loopback, where every client shares the machine and a round trip is tens of
# microseconds (no throughput cap to fear): decode p99 27 -> 8-10 ms under 4 prefilling clients, 32 MiB gets with
# 8 in flight 0.72-0.75 -> 0.87-0.89x raw ZeroMQ (docs/design.md, "Small requests never wait for large ones").
LOOPBACK_SOCKET_BUFFER_BYTES = 256 << 10
BULK_MIN_BYTES = 4 << 20  # a shard's requests moving this much run on its bulk lane (see the module docstring)
COMPACT_STEP_BYTES = 1 << 20  # compaction takes the store's lock for at most about this much re-encoding
# A ``lengths`` of more ids runs on the loop in slices of this many, other connections' requests in between (a
# 4,096-id lookup costs ~0.6 ms, ~0.3 ms of it parsing: docs/design.md, "One client does not starve the others")
LOOKUP_SLICE = 512
# An fp16 get reply asked to be packed (protocol 1.4) is sent as one frame up to this size, keys and values
# together: a frame's own cost matters for small replies only, and a large reply moves faster as two frames (ZeroMQ
# sends one while it takes the next; 32 MiB gets 8 in flight: 0.83x raw ZeroMQ as one frame, 0.92x as two).
PACK_REPLY_MAX_BYTES = 1 << 20
# The reply budget by default (max_reply_bytes: unread replies held for all peers together) is the largest reply
# the store can give: its whole capacity at q4 read back as fp16 (3.6x), so 4x capacity; at least 64 MiB, at most
# the loop's own default (2 x max_message_bytes, 1 GiB). A 64 MiB store's slow readers held 675-821 MiB of
# replies under a budget of 1 GiB.
REPLY_BUDGET_PER_CAPACITY = 4
MIN_REPLY_BUDGET_BYTES = 64 << 20
# Sequences whose owner a shard remembers (per routing; forgotten all at once when full): the requests of a
# sequence in use (decode steps, reads) skip the rendezvous hash, and the cache holds about 1.3 MiB when full
# (65,536 owners held about 10 MiB, filled by every new sequence id: a soak's steady RSS growth).
_OWNER_CACHE = 4096
_START_UP_OPS = (p.HelloRequest, p.PingRequest, p.StatsRequest)  # served while a shard is starting


def default_reply_budget(capacity_bytes: int, limits: p.Limits) -> int:
    """A shard's ``max_reply_bytes`` by default: ``REPLY_BUDGET_PER_CAPACITY`` x the store's capacity (its
    largest reply), at least ``MIN_REPLY_BUDGET_BYTES``, at most 2 x ``max_message_bytes``."""
    budget = max(MIN_REPLY_BUDGET_BYTES, REPLY_BUDGET_PER_CAPACITY * capacity_bytes)
    return min(2 * limits.max_message_bytes, budget)


class ShardServer(RouterServer):
    """Serves one :class:`~kvd.store.Store` over ZeroMQ (docs/protocol.md) on ``tcp://host:port`` (port 0: any
    free port; :meth:`start` returns the endpoint). The serving thread is the only caller of the store's data
    operations; ``set_level``/``stats`` may be called on the store from other threads (it has a lock).

    Options (keyword-only): ``limits`` (the protocol limits enforced and announced), ``curve`` (a server
    :class:`CurveConfig`: encryption and the client allow-list), ``compact_budget_bytes`` (per compaction step),
    ``compact_every`` (requests between compaction steps under load), ``max_queued_requests`` /
    ``max_queued_bytes`` / ``max_peer_requests`` (admission, shared and per connection; beyond them requests get
    ``Busy``: :mod:`kvd.wire.server.loop`), ``hwm`` (ZeroMQ SNDHWM per peer: replies a peer does not read),
    ``heartbeat_ivl_s`` / ``heartbeat_timeout_s``, ``linger_s``, ``recycle_memory`` (:meth:`start` calls
    :func:`tune_malloc`, process-wide: meant for a process that hosts shards), ``socket_buffer_bytes`` (each
    connection's TCP send and receive buffer; 0: the system's, autotuned; None, the default:
    ``LOOPBACK_SOCKET_BUFFER_BYTES`` when ``host`` is a loopback address, else 0. Smaller buffers make ZeroMQ's
    I/O threads move a prefill's MiBs in shorter turns, so a decode step waits less behind them, but cap one
    connection's throughput at about a buffer per network round trip: docs/design.md), ``max_reply_bytes``
    (replies held for peers that do not read, all together; None, the default: :func:`default_reply_budget` of
    the store's capacity), ``trim_every_s`` (how often the free heap glibc keeps is given back to the system:
    :data:`~kvd.wire.sockets.TRIM_EVERY_S`).

    In a cluster (kvd.cluster.shard): ``incarnation`` (this process's id, told to a ``hello`` that asks and
    checked against an ``append`` that names one), ``on_register`` (called with ``(namespace, (layers,
    kv_heads, head_dim))`` before a ``register`` is applied: makes it cluster-wide; raises to refuse it),
    ``on_calibrate`` (called with ``(namespace, calibration, require)``, a checked
    :class:`~kvd.calibration.Calibration` or None and the namespace's own ``require_calibration`` or None, before
    a ``calibrate`` is applied: makes it cluster-wide), and
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
                 on_calibrate: Callable[[str, Any, bool | None], None] | None = None,
                 starting: bool = False, socket_buffer_bytes: int | None = None,
                 max_peer_requests: int = DEFAULT_MAX_PEER_REQUESTS, max_reply_bytes: int | None = None,
                 trim_every_s: float = TRIM_EVERY_S) -> None:
        if socket_buffer_bytes is None:
            socket_buffer_bytes = LOOPBACK_SOCKET_BUFFER_BYTES if is_loopback(host) else 0
        if max_reply_bytes is None:
            max_reply_bytes = default_reply_budget(store.capacity_bytes, limits or p.DEFAULT_LIMITS)
        super().__init__(host=host, port=port, limits=limits, curve=curve, max_queued_requests=max_queued_requests,
                         max_queued_bytes=max_queued_bytes, hwm=hwm, heartbeat_ivl_s=heartbeat_ivl_s,
                         heartbeat_timeout_s=heartbeat_timeout_s, linger_s=linger_s,
                         socket_buffer_bytes=socket_buffer_bytes, max_peer_requests=max_peer_requests,
                         max_reply_bytes=max_reply_bytes, trim_every_s=trim_every_s)
        self._store = store
        self._pack_frame_bytes = min(PACK_FRAME_BYTES, self._limits.max_frame_bytes)  # packed pages replies
        self._pack_reply_bytes = min(PACK_REPLY_MAX_BYTES, self._limits.max_frame_bytes)  # packed fp16 replies
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
        self._on_calibrate_hook = on_calibrate
        self._starting = bool(starting)  # data operations get Busy until open_for_data() (cluster start-up)
        # (topology epoch, router, this shard's index in it, owner cache): None until a cluster hands one
        self._routing: tuple[int, Router, int, dict[tuple[str, type, Any], int]] | None = None
        self._handlers: dict[type, Callable[[Any], Any]] = {
            p.HelloRequest: self._on_hello, p.PingRequest: lambda r: p.PingReply.trusted(request_id=r.request_id),
            p.RegisterRequest: self._on_register, p.AppendRequest: self._on_append, p.GetRequest: self._on_get,
            p.DropRequest: self._on_drop, p.LengthRequest: self._on_length,
            p.LengthsRequest: self._on_lengths, p.StatsRequest: self._on_stats,
            p.ExplainRequest: self._on_explain, p.AttendRequest: self._on_attend,
            p.CalibrateRequest: self._on_calibrate}

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
        # register and calibrate may wait for the coordinator (the hooks) and write a file; large gets: _on_get
        return kind is p.RegisterRequest or kind is p.CalibrateRequest

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

    def _on_calibrate(self, req: p.CalibrateRequest) -> p.CalibrateReply:
        from kvd.calibration import from_dict

        # InvalidArgument naming what is wrong; nothing is changed
        cal = from_dict(req.calibration) if req.calibration is not None else None
        if req.namespace not in self._store.layouts():
            raise UnknownNamespace(f"namespace {req.namespace!r} is not registered on shard {self._shard_id!r}: "
                                   "register it (its layout) before giving it a calibration")
        if self._on_calibrate_hook is not None:  # cluster-wide first: the coordinator keeps it with the namespace
            self._on_calibrate_hook(req.namespace, cal, req.require)
        if cal is not None:
            state = self._store.calibrate(req.namespace, cal, require=req.require)
        else:  # protocol 1.8: the namespace's own require_calibration, its calibration kept
            state = self._store.require_calibration_of(req.namespace, req.require)
        return p.CalibrateReply(request_id=req.request_id, state=state["state"], reason=state["reason"],
                                digest=state.get("digest", ""), model=state.get("model", ""),
                                levels=state.get("levels"),
                                required=state["required"] if req.require is not None else None)

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
        try:  # a sequence on disk is read back into RAM first: never on the loop (the store says so)
            length = store.append(req.namespace, req.seq_id, keys, values, position=req.position,
                                  parent=req.parent, disk_io=not self._loop_only())
        except OnDisk:
            raise ToBulkLane from None
        # the server's own replies from the store's results are valid by construction: no second check
        if req.notices:  # protocol 1.8: a namespace that needs a calibration says so on every append reply
            return p.AppendReply.trusted(request_id=req.request_id, length=int(length),
                                         notice=store.calibration_notice(req.namespace))
        return p.AppendReply.trusted(request_id=req.request_id, length=int(length))

    def _on_get(self, req: p.GetRequest) -> p.GetReply | p.GetPagesReply:
        if self._routing is not None:
            self._check_owner(req.namespace, req.seq_id)
        # On the loop, a read of BULK_MIN_BYTES or more goes to the bulk lane: the store says so as it looks the
        # range up, before reading (one lookup per get, not a size query and then the read).
        # So does a read of a spilled sequence's file (a disk read never runs on the loop).
        loop = self._loop_only()
        limit = BULK_MIN_BYTES - 1 if loop else None
        try:
            return self._get_fp16(req, limit, loop) if req.format == "fp16" else self._get_pages(req, limit, loop)
        except (ReadTooLarge, OnDisk):
            raise ToBulkLane from None

    def _loop_only(self) -> bool:
        """Whether this request runs on the loop of a server with a bulk lane: no disk I/O, nothing large."""
        return self._lane is not None and self._on_loop()

    def _get_fp16(self, req: p.GetRequest, limit: int | None, loop: bool) -> p.GetReply:
        # keys then values in one buffer: one frame when asked, if small enough
        both = self._store.get_packed(req.namespace, req.seq_id, req.start, req.end, req.layers, max_bytes=limit,
                                      disk_io=not loop)
        keys = both[0]
        layers = req.layers if req.layers is not None else tuple(range(keys.shape[0]))
        packed = req.packed and both.nbytes <= self._pack_reply_bytes
        return p.GetReply.trusted(request_id=req.request_id, start=req.start, end=req.start + keys.shape[1],
                                  layers=layers, keys=keys, values=both[1],
                                  packed=p.tensor_frame(both) if packed else None)

    def _get_pages(self, req: p.GetRequest, limit: int | None, loop: bool) -> p.GetPagesReply:
        store = self._store
        entries, frames = store.get_pages_packed(req.namespace, req.seq_id, req.start, req.end, req.layers,
                                                 frame_bytes=self._pack_frame_bytes, max_bytes=limit,
                                                 disk_io=not loop)
        if len(entries) > self._limits.max_pages:
            raise MessageTooLarge(f"the range needs {len(entries)} pages, more than max_pages "
                                  f"{self._limits.max_pages}: ask for fewer tokens or layers")
        end = req.end if req.end is not None else store.length(req.namespace, req.seq_id)
        layers = req.layers if req.layers is not None else tuple(dict.fromkeys(e[0] for e in entries))
        return p.GetPagesReply.trusted(request_id=req.request_id, start=req.start, end=int(end), layers=layers,
                                       entries=tuple(entries), packed=tuple(frames) if req.packed else None)

    def _on_attend(self, req: p.AttendRequest) -> p.AttendReply:
        if self._routing is not None:
            self._check_owner(req.namespace, req.seq_id)
        loop = self._loop_only()  # as a get: a large range, or a spilled sequence's file, on the bulk lane
        try:
            out, lse, start, end = self._store.attend_range(
                req.namespace, req.seq_id, req.layer, req.queries, start=req.start, end=req.end, scale=req.scale,
                positions=req.positions, max_bytes=BULK_MIN_BYTES - 1 if loop else None, disk_io=not loop)
        except (ReadTooLarge, OnDisk):
            raise ToBulkLane from None
        return p.AttendReply.trusted(request_id=req.request_id, start=start, end=end, out=out, lse=lse)

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
        # (the store's lengths are Python ints or None: no conversion per id)
        return p.LengthsReply.trusted(request_id=req.request_id, lengths=tuple(self._lookup(req.namespace,
                                                                                          req.seq_ids)))

    def _lookup(self, namespace: str, seq_ids: Sequence[p.SeqId]) -> list[int | None]:
        if self._routing is not None:
            for seq_id in seq_ids:
                self._check_owner(namespace, seq_id)
        return self._store.lengths(namespace, seq_ids)

    def _slices(self, req: Any) -> Iterator[None] | None:
        if type(req) is not p.LengthsRequest or len(req.seq_ids) <= LOOKUP_SLICE:
            return None
        return self._lookup_in_slices(req)

    def _lookup_in_slices(self, req: p.LengthsRequest) -> Generator[None, None, p.LengthsReply]:
        ids = req.seq_ids
        out: list[int | None] = []
        for start in range(0, len(ids), LOOKUP_SLICE):
            if start:
                yield
            out += self._lookup(req.namespace, ids[start:start + LOOKUP_SLICE])
        return p.LengthsReply.trusted(request_id=req.request_id, lengths=tuple(out))

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
