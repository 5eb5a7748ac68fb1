"""The coordinator's brain, pure: membership, topology, level epochs and cluster pressure (no Ray, no ZeroMQ).

Theory of operation
-------------------
Shards are known by stable ids (``shard-0`` ...). A shard *registers* when its process starts (with a fresh
``incarnation``) and then *reports* ``used`` / ``capacity`` and the level and epoch its store has applied,
every report interval. The coordinator (kvd.cluster.coordinator) owns one :class:`Membership` and passes each
event in with the current time; everything here is deterministic, so the unit tests drive it with a fake clock.

Topology. The topology lists every known shard and its endpoint under a *topology epoch* that increases
whenever a shard joins, changes endpoint (a restarted shard) or is removed. A shard that stops reporting is
marked *down* after ``stale_after_s`` but stays in the topology: clients route by rendezvous hashing over the
shard ids, so removing it would silently move its sequences to another shard; keeping it gives their owners a
clear error until it comes back (empty) under the same id.

Pressure and levels. Cluster pressure is the fullest up shard's ``used / capacity`` (mode ``"max"``, the
default) or ``sum(used) / sum(capacity)`` over the shards that are up (mode ``"sum"``). Every shard counts: a
shard evicts when *it* is full, whatever the others hold, and routing by rendezvous hashing fills shards
unevenly by chance (3 shards of 7 sequences each plus one more: that shard at 0.98, the sum at 0.89 and never
at the q4 threshold; the issue that made "max" the default). ``max(sum, fullest)`` is the fullest, so "max" is
that blend; "sum" stays for clusters whose shards are meant to fill unevenly. A shard that ran ahead to a rung
under its own pressure (kvd.store.compact) counts as at least that rung's threshold full, so the next epoch
catches the cluster up with it. Reports also carry
``used_by_rung`` (the bytes re-counted at each rung's density), aggregated the same way and handed to the
policy, which steps down only when the data would fit there (kvd.policy). The policy gets one sample per report
*round*: when every up shard has reported since the last sample (or, if one is late, two report intervals
after the last sample), so the EWMA's time constant does not depend on the number of shards. When the policy's
level changes, the *level epoch* increases by one and a :class:`LevelOrder` for every up shard is returned;
the caller persists the epoch and broadcasts ``set_level(level, epoch)``. A shard that reports an older epoch
is sent the current order again (a lost broadcast or a restarted, empty shard converges within one report).

Publishing. Clients and shards get the topology only once it is complete (:meth:`Membership.published_topology`,
:meth:`Membership.shard_sync`): a fresh cluster when every expected shard has registered (or ``ready_grace_s``
has passed), a restarted coordinator at once with the topology it persisted (:meth:`Membership.state`). A
partial list would route the missing shards' sequences to others. The topology epoch is bumped for a new id, a
new endpoint or a new incarnation (a shard restarted, even on its old port), and it is never reused: a
registration or report carrying a newer topology epoch than this coordinator knows (its persisted state was
lost) puts its own past it.

Namespaces. ``register`` is cluster-wide: the coordinator keeps every namespace's layout
(:meth:`Membership.add_namespace`, the first layout wins), persists it, and hands it to every shard with its
registration and whenever a report shows the shard is behind (``namespaces_version``), so a restarted or new
shard knows every namespace before it serves. The version counts additions, so what a shard lacks is the
namespaces added after its version (:meth:`Membership.shard_sync` sends only those, with the version they
apply on, ``namespaces_from``); only a shard whose version this coordinator cannot place (from before a restart
that lost the state, or from a lost predecessor) is sent them all. A registration therefore costs the same
however many namespaces exist, and ``max_namespaces`` bounds how many there are (:class:`InvalidArgument` past
it: every namespace costs memory in the coordinator, in every shard and in Ray's state).

Calibrations. A namespace's calibration (kvd.calibration) lives with the namespace: the coordinator keeps the
latest record of each and the namespace's own ``require_calibration``, if set (:meth:`Membership.set_calibration`;
a record whose digest it already has, or the setting it has, changes nothing) and hands them to every shard the
way it hands namespaces, counted by ``calibrations_version``: a shard behind is sent the calibrations set after
its version (``calibrations_from``), or all of them when this coordinator cannot tell. A shard that registers
hands over the calibrations and settings it holds (from its disk tier) where the cluster has none for that
namespace.

Restarts. A coordinator restarted with ``recovered_epoch`` / ``recovered_level`` (from persistent storage)
continues from there; a report carrying a newer epoch than the coordinator knows raises the floor, so no epoch
is ever issued twice or backwards. Until every expected shard has reported (or ``stale_after_s`` has passed)
no level decision is made. The first sample after a recovery is seeded into the band of the recovered level,
so a restart inside a hysteresis band does not move the level by itself.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from kvd.cluster.registry import NamespaceRegistry
from kvd.errors import InvalidArgument
from kvd.policy import Level, Policy

__all__ = ["Membership", "ShardReport", "ShardState", "LevelOrder", "Registration", "ReportOutcome", "LevelChange"]

PRESSURE_MODES = ("sum", "max")
_HISTORY_LEN = 64
# A round with a silent shard closes after this many report intervals, so one slow shard cannot stall control.
_ROUND_TIMEOUT_INTERVALS = 2.0


READY_GRACE_STALES = 3.0  # a fresh cluster's ready grace, in stale times


def default_stale_after_s(report_interval_s: float) -> float:
    """After how long without a report a shard is marked down: three report intervals, at least 1 s."""
    return max(3.0 * report_interval_s, 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardReport:
    """What a shard tells the coordinator every report interval. Bytes are exact store accounting."""

    shard_id: str
    incarnation: str
    endpoint: str
    used_bytes: int
    capacity_bytes: int
    level: str  # tag of the level the shard's store has applied
    epoch: int  # level epoch the shard's store has applied
    node: str = ""
    # used_bytes re-counted at fp16, the 8-bit rung and q4 (Store.used_by_rung); None: as used_bytes
    used_by_rung: tuple[int, int, int] | None = None
    ahead: str | None = None  # the level the shard runs at under its own pressure, above `level`
    topology_epoch: int = 0  # of the routing the shard enforces (0: none yet)
    namespaces_version: int = 0  # of the namespaces the shard was last handed
    calibrations_version: int = 0  # of the calibrations the shard was last handed

    def __post_init__(self) -> None:
        if not self.shard_id or not isinstance(self.shard_id, str):
            raise InvalidArgument(f"shard_id must be a non-empty str, got {self.shard_id!r}")
        for name in ("used_bytes", "capacity_bytes", "epoch", "topology_epoch", "namespaces_version",
                     "calibrations_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"{name} must be a non-negative int, got {value!r}")
        Level.from_tag(self.level)
        if self.ahead is not None:
            Level.from_tag(self.ahead)
        if self.used_by_rung is not None:
            rungs = tuple(self.used_by_rung)
            if len(rungs) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in rungs):
                raise InvalidArgument(f"used_by_rung must be 3 non-negative ints, got {self.used_by_rung!r}")
            object.__setattr__(self, "used_by_rung", rungs)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardState:
    """The coordinator's view of one shard. Times are the caller's clock (seconds)."""

    shard_id: str
    endpoint: str
    incarnation: str
    node: str
    registered_at: float
    last_report_at: float | None = None
    used_bytes: int = 0
    capacity_bytes: int = 0
    level: str = Level.FP16.tag
    epoch: int = 0
    up: bool = True
    restarts: int = 0
    used_by_rung: tuple[int, int, int] | None = None
    ahead: str | None = None

    @property
    def pressure(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    def pressure_at(self, rung: int) -> float:
        """Pressure with the data re-counted at ``rung`` (0 fp16, 1 8-bit, 2 q4); as measured if unknown."""
        used = self.used_by_rung[rung] if self.used_by_rung is not None else self.used_bytes
        return used / self.capacity_bytes if self.capacity_bytes else 0.0


@dataclass(frozen=True, slots=True)
class LevelOrder:
    """``set_level(level, epoch)`` to send to each shard in ``targets``."""

    level: Level
    epoch: int
    targets: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Registration:
    """The answer to a registration: the level and epoch the shard must apply now, the topology epoch."""

    level: Level
    epoch: int
    topology_epoch: int


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    """``known``: False when the shard must register first (e.g. the coordinator restarted).
    ``order``: a cluster-wide level change to persist and broadcast. ``resend``: the current order for this
    shard alone (it reported an older epoch). ``level`` / ``epoch``: the level in force and its epoch, read
    together (None when not ``known``)."""

    known: bool
    order: LevelOrder | None = None
    resend: LevelOrder | None = None
    level: Level | None = None
    epoch: int | None = None
    reason: str = ""  # of the level change behind ``level``


@dataclass(frozen=True, slots=True, kw_only=True)
class LevelChange:
    """One level change, for status and the bench. Times are the caller's clock (seconds).

    ``crossed_at``: when raw cluster pressure last crossed the threshold behind this change (None when it
    is a step down). ``applied_at``: when the last up shard confirmed the epoch. ``relieved_at``: when raw
    pressure fell back below the threshold after a step up (re-compression freed the memory)."""

    epoch: int
    level: str
    previous: str
    pressure: float
    smoothed: float
    decided_at: float
    crossed_at: float | None = None
    threshold: float | None = None
    applied_at: float | None = None
    relieved_at: float | None = None
    pending: tuple[str, ...] = ()
    reason: str = ""


class Membership:
    """Membership, topology and the level controller of one coordinator. Thread-safe; pure (no I/O).

    ``policy``: the :class:`~kvd.policy.Policy` to feed. ``expected``: shard ids the cluster is configured
    with (no level decision until each has reported or ``stale_after_s`` passed since ``now``).
    ``recovered_epoch`` / ``recovered_level``: state persisted by a previous coordinator; a fresh cluster
    (``recovered_epoch=0``) starts at epoch 1 with the policy's minimum level, so a new store (epoch 0)
    always applies it.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        now: float,
        report_interval_s: float,
        stale_after_s: float | None = None,
        pressure_mode: str = "max",
        expected: Iterable[str] = (),
        recovered_epoch: int = 0,
        recovered_level: Level | str | None = None,
        recovered_topology_epoch: int = 0,
        recovered_shards: Iterable[dict[str, Any]] = (),
        recovered_namespaces: dict[str, Any] | None = None,
        recovered_namespaces_version: int = 0,
        recovered_calibrations: dict[str, Any] | None = None,
        recovered_calibrations_version: int = 0,
        recovered_required: dict[str, bool] | None = None,
        ready_grace_s: float | None = None,
        max_namespaces: int | None = None,
    ) -> None:
        if pressure_mode not in PRESSURE_MODES:
            raise InvalidArgument(f"pressure_mode must be one of {PRESSURE_MODES}, got {pressure_mode!r}")
        if not report_interval_s > 0:
            raise InvalidArgument(f"report_interval_s must be > 0, got {report_interval_s!r}")
        self._policy = policy
        self._mode = pressure_mode
        self._interval_s = float(report_interval_s)
        self._stale_after_s = float(stale_after_s) if stale_after_s else default_stale_after_s(self._interval_s)
        self._expected = tuple(expected)
        self._started_at = now
        self._lock = threading.Lock()
        self._shards: dict[str, ShardState] = {}
        self._fresh: set[str] = set()
        self._last_sample_at: float | None = None
        self._samples = 0
        self._history: deque[LevelChange] = deque(maxlen=_HISTORY_LEN)
        self._raw_pressure: float | None = None
        # When raw pressure last rose through each threshold (cleared when it falls back below).
        self._crossed_at: dict[float, float] = {}
        self._topology_epoch = int(recovered_topology_epoch)
        # A fresh cluster publishes once every expected shard registered, or after this grace.
        self.ready_grace_s = float(ready_grace_s) if ready_grace_s else READY_GRACE_STALES * self._stale_after_s
        for item in recovered_shards:
            # The persisted topology: served at once, under its own epoch, until the shards register again.
            sid, endpoint = str(item["id"]), str(item["endpoint"])
            self._shards[sid] = ShardState(shard_id=sid, endpoint=endpoint,
                                           incarnation=str(item.get("incarnation", "")),
                                           node=str(item.get("node", "")), registered_at=now)
        self._ready = bool(self._shards) and self._topology_epoch > 0
        self._registry = NamespaceRegistry(
            namespaces=recovered_namespaces, namespaces_version=recovered_namespaces_version,
            calibrations=recovered_calibrations, calibrations_version=recovered_calibrations_version,
            required=recovered_required, max_namespaces=max_namespaces)
        if recovered_epoch > 0 and recovered_level is not None:
            self._level = Level.parse(recovered_level)
            self._epoch = int(recovered_epoch)
            self._seed: Level | None = self._level
        else:
            # A fresh cluster: epoch 1 carries the policy's starting level (min_level) to every new store.
            self._level = policy.level
            self._epoch = int(recovered_epoch) + 1
            self._seed = None

    # ----------------------------------------------------------------------------------------- properties

    @property
    def level(self) -> Level:
        with self._lock:
            return self._level

    @property
    def epoch(self) -> int:
        """The level epoch: increases by one at every level change; never decreases."""
        with self._lock:
            return self._epoch

    @property
    def topology_epoch(self) -> int:
        with self._lock:
            return self._topology_epoch

    @property
    def stale_after_s(self) -> float:
        return self._stale_after_s

    def state(self) -> dict[str, Any]:
        """What a restarted coordinator needs (to persist): level, epochs, shards, the namespaces' version. The
        namespaces themselves are persisted apart, in parts that do not change once full
        (:meth:`namespace_part`), so saving costs the same however many there are."""
        with self._lock:
            return {
                "level": self._level.tag,
                "epoch": self._epoch,
                "topology_epoch": self._topology_epoch,
                "shards": [{"id": s.shard_id, "endpoint": s.endpoint, "incarnation": s.incarnation, "node": s.node}
                           for _, s in sorted(self._shards.items())],
                "namespaces_version": self._registry.version,
                "calibrations_version": self._registry.calibrations_version,
            }

    # ------------------------------------------------------------------------------------------- events

    def register(
        self,
        shard_id: str,
        endpoint: str,
        *,
        incarnation: str,
        now: float,
        node: str = "",
        topology_epoch: int = 0,
        namespaces: dict[str, Any] | None = None,
        calibrations: dict[str, Any] | None = None,
        required: dict[str, bool] | None = None,
    ) -> Registration:
        """A shard (re)started and serves ``endpoint``. Returns the level and epoch it must apply now.

        A new id, a new endpoint or a new ``incarnation`` bumps the topology epoch; a new incarnation of a
        known id counts a restart and forgets the old process's figures (it came back empty).
        ``topology_epoch``: the newest the shard was handed (this epoch goes past it); ``namespaces``: the
        shard's own (``{name: (layers, kv_heads, head_dim)}``), added where the cluster has none of that name;
        ``calibrations``: the shard's own (``{name: record}``), likewise; ``required``: the shard's namespaces'
        own ``require_calibration`` (``{name: bool}``), likewise.
        """
        if not shard_id or not isinstance(shard_id, str):
            raise InvalidArgument(f"shard_id must be a non-empty str, got {shard_id!r}")
        if not endpoint or not isinstance(endpoint, str):
            raise InvalidArgument(f"endpoint must be a non-empty str, got {endpoint!r}")
        with self._lock:
            self._raise_topology_floor(topology_epoch)
            self._registry.adopt(namespaces or {}, calibrations or {}, required)
            old = self._shards.get(shard_id)
            if old is None:
                self._shards[shard_id] = ShardState(
                    shard_id=shard_id, endpoint=endpoint, incarnation=incarnation, node=node, registered_at=now
                )
                self._bump_topology()
            elif old.incarnation != incarnation or old.endpoint != endpoint:
                self._shards[shard_id] = ShardState(
                    shard_id=shard_id,
                    endpoint=endpoint,
                    incarnation=incarnation,
                    node=node,
                    registered_at=now,
                    restarts=old.restarts + (old.incarnation != incarnation),
                )
                self._bump_topology()
            elif not old.up:
                self._shards[shard_id] = replace(old, up=True)
            return Registration(self._level, self._epoch, self._topology_epoch)

    def report(self, report: ShardReport, *, now: float) -> ReportOutcome:
        """Record a shard's figures; maybe take a policy sample. See :class:`ReportOutcome`."""
        with self._lock:
            state = self._shards.get(report.shard_id)
            if state is None or state.incarnation != report.incarnation or state.endpoint != report.endpoint:
                return ReportOutcome(known=False)
            self._shards[report.shard_id] = replace(
                state,
                last_report_at=now,
                used_bytes=report.used_bytes,
                capacity_bytes=report.capacity_bytes,
                level=report.level,
                epoch=report.epoch,
                up=True,
                used_by_rung=report.used_by_rung,
                ahead=report.ahead,
            )
            self._raise_topology_floor(report.topology_epoch)
            if report.epoch > self._epoch:
                # A shard applied an epoch this coordinator never issued: its predecessor did, and its state
                # was lost. Adopt it so the next order is newer than anything any shard has applied.
                self._epoch = report.epoch
                self._level = Level.from_tag(report.level)
                self._seed = self._level
            self._note_applied(report.shard_id, report.epoch, now)
            self._fresh.add(report.shard_id)
            self._expire(now)
            order = self._maybe_sample(now)
            resend = None
            if order is None and report.epoch < self._epoch:
                resend = LevelOrder(self._level, self._epoch, (report.shard_id,), self._reason())
            return ReportOutcome(
                known=True, order=order, resend=resend, level=self._level, epoch=self._epoch, reason=self._reason()
            )

    def acknowledge(self, shard_id: str, epoch: int, *, now: float) -> None:
        """A shard confirmed applying ``epoch`` (the reply of a set_level broadcast)."""
        with self._lock:
            state = self._shards.get(shard_id)
            if state is None:
                return
            if epoch > state.epoch:
                self._shards[shard_id] = replace(state, epoch=epoch, level=self._level_of_epoch(epoch, state))
            self._note_applied(shard_id, epoch, now)

    def expire(self, now: float) -> list[str]:
        """Mark shards that have not reported for ``stale_after_s`` as down; returns the ids newly down."""
        with self._lock:
            return self._expire(now)

    def remove(self, shard_id: str) -> bool:
        """Forget a shard (it was stopped on purpose). Bumps the topology epoch; False if unknown."""
        with self._lock:
            if self._shards.pop(shard_id, None) is None:
                return False
            self._fresh.discard(shard_id)
            self._bump_topology()
            return True

    def add_namespace(self, namespace: str, layout: Any) -> bool:
        """Register ``namespace`` with ``layout`` (layers, kv_heads, head_dim) for the whole cluster
        (:meth:`NamespaceRegistry.add`): True if it is new, False if known with this layout."""
        with self._lock:
            return self._registry.add(namespace, layout)

    def set_calibration(self, namespace: str, record: dict[str, Any] | None, require: bool | None = None) -> bool:
        """Keep ``record`` as ``namespace``'s calibration and ``require`` as its own ``require_calibration``
        (:meth:`NamespaceRegistry.set_calibration`; None: unchanged): True if either changed."""
        with self._lock:
            return self._registry.set_calibration(namespace, record, require)

    @property
    def calibrations_version(self) -> int:
        with self._lock:
            return self._registry.calibrations_version

    def calibrations(self) -> dict[str, dict[str, Any]]:
        """``{namespace: calibration record}`` of every calibrated namespace."""
        with self._lock:
            return self._registry.calibrations()

    def required(self) -> dict[str, bool]:
        """``{namespace: require_calibration}`` of every namespace with a setting of its own."""
        with self._lock:
            return self._registry.required()

    # ------------------------------------------------------------------------------------------ queries

    @property
    def namespace_count(self) -> int:
        with self._lock:
            return len(self._registry)

    @property
    def namespaces_version(self) -> int:
        with self._lock:
            return self._registry.version

    def namespace_part(self, index: int, size: int) -> dict[str, list[int]]:
        """Namespaces ``index * size`` to ``(index + 1) * size - 1`` in the order added: ``{name: [L, H, D]}``
        (a part of the persisted state; parts before the last never change)."""
        with self._lock:
            return self._registry.part(index, size)

    def namespaces(self) -> tuple[int, dict[str, tuple[int, int, int]]]:
        """``(version, {namespace: (layers, kv_heads, head_dim)})``; the version grows with every addition."""
        with self._lock:
            return self._registry.version, self._registry.layouts()

    def published_topology(self, now: float) -> dict[str, Any] | None:
        """The topology to serve clients (as :meth:`topology`), or None while it is incomplete: a fresh
        cluster before every expected shard registered (or ``ready_grace_s`` passed). Once complete, always."""
        with self._lock:
            if not self._is_ready(now):
                return None
            return self._topology()

    def shard_sync(
        self, *, topology_epoch: int, namespaces_version: int, now: float | None = None,
        calibrations_version: int = -1,
    ) -> dict[str, Any]:
        """What a shard that has ``topology_epoch`` / ``namespaces_version`` lacks: ``routing`` (``{"epoch",
        "shards": [ids]}``, only once the topology is published) and ``namespaces`` (``{name: [L, H, D]}``),
        each only when it differs; ``namespaces_version`` always. ``namespaces`` holds the ones added after the
        shard's version, with ``namespaces_from`` (that version) when this coordinator added all of them; every
        namespace, without ``namespaces_from``, when it cannot tell which the shard lacks. ``calibrations``
        (``{name: record}``) and ``required`` (``{name: bool}``) likewise for a shard at ``calibrations_version``,
        with ``calibrations_from``."""
        with self._lock:
            out: dict[str, Any] = {"namespaces_version": self._registry.version,
                                   "calibrations_version": self._registry.calibrations_version}
            if self._is_ready(self._started_at if now is None else now) and topology_epoch != self._topology_epoch:
                out["routing"] = {"epoch": self._topology_epoch, "shards": sorted(self._shards)}
            out.update(self._registry.sync(namespaces_version, calibrations_version))
            return out

    def expected_missing(self) -> list[str]:
        """Expected shard ids that have not registered."""
        with self._lock:
            return [sid for sid in self._expected if sid not in self._shards]

    def shards(self) -> list[ShardState]:
        with self._lock:
            return [self._shards[k] for k in sorted(self._shards)]

    def cluster_pressure(self) -> float | None:
        """Raw cluster pressure over the up shards (by ``pressure_mode``); None before any report."""
        with self._lock:
            return self._pressure()

    def topology(self) -> dict[str, Any]:
        """``{"epoch", "shards": [{"id", "endpoint"}], "level", "level_epoch"}``, ids sorted, as it is now
        (complete or not: for tools; clients get :meth:`published_topology`)."""
        with self._lock:
            return self._topology()

    def _topology(self) -> dict[str, Any]:
        return {
            "epoch": self._topology_epoch,
            "shards": [{"id": s.shard_id, "endpoint": s.endpoint} for _, s in sorted(self._shards.items())],
            "level": self._level.tag,
            "level_epoch": self._epoch,
        }

    def _is_ready(self, now: float) -> bool:
        if not self._ready and self._shards and (
            set(self._expected) <= set(self._shards) or now - self._started_at >= self.ready_grace_s
        ):
            self._ready = True  # once complete, the topology is served from then on (a shard down stays listed)
        return self._ready

    def history(self) -> list[LevelChange]:
        with self._lock:
            return list(self._history)

    def snapshot(self, now: float) -> dict[str, Any]:
        """Everything `kvd status` shows about the control plane, as plain data."""
        with self._lock:
            self._expire(now)
            policy = self._policy.snapshot()
            return {
                "level": self._level.tag,
                "level_epoch": self._epoch,
                "topology_epoch": self._topology_epoch,
                "pressure": self._pressure(),
                "pressure_sum": self._pressure("sum"),
                "pressure_max": self._pressure("max"),
                "pressure_at_rungs": self._pressure_at_rungs(),
                "imbalance": self._imbalance(),
                "smoothed_pressure": policy["pressure"] if policy["samples"] else None,
                "pressure_mode": self._mode,
                "reason": self._reason(),  # of the last level change
                "policy_reason": policy["reason"],  # of the last change, or of the last step down held
                "samples": self._samples,
                "upgrades": policy["upgrades"],
                "downgrades": policy["downgrades"],
                "used_bytes": sum(s.used_bytes for s in self._shards.values() if s.up),
                "capacity_bytes": sum(s.capacity_bytes for s in self._shards.values() if s.up),
                "shards": [
                    {
                        "id": s.shard_id,
                        "endpoint": s.endpoint,
                        "node": s.node,
                        "up": s.up,
                        "level": s.level,
                        "epoch": s.epoch,
                        "used_bytes": s.used_bytes,
                        "capacity_bytes": s.capacity_bytes,
                        "pressure": s.pressure,
                        "ahead": s.ahead,
                        "used_by_rung": list(s.used_by_rung) if s.used_by_rung is not None else None,
                        "restarts": s.restarts,
                        "report_age_s": None if s.last_report_at is None else now - s.last_report_at,
                    }
                    for _, s in sorted(self._shards.items())
                ],
                "history": [_change_dict(c) for c in self._history],
            }

    # --------------------------------------------------------------------------------------- internals

    def _bump_topology(self) -> None:
        self._topology_epoch += 1

    def _raise_topology_floor(self, seen: int) -> None:
        """A shard was handed topology epoch ``seen`` by a predecessor whose state is lost: go past it, so
        no epoch names two different shard lists."""
        if seen > self._topology_epoch:
            self._topology_epoch = seen
            self._bump_topology()

    def _expire(self, now: float) -> list[str]:
        gone = []
        for shard_id, s in self._shards.items():
            seen = s.last_report_at if s.last_report_at is not None else s.registered_at
            if s.up and now - seen > self._stale_after_s:
                self._shards[shard_id] = replace(s, up=False)
                self._fresh.discard(shard_id)
                gone.append(shard_id)
        return gone

    def _up(self) -> list[ShardState]:
        return [s for s in self._shards.values() if s.up and s.last_report_at is not None and s.capacity_bytes > 0]

    def _pressure(self, mode: str | None = None, rung: int | None = None) -> float | None:
        """Pressure over the up shards by ``mode`` (the configured one by default), as measured or with the
        data re-counted at ``rung``."""
        up = self._up()
        if not up:
            return None
        if rung is None:
            used = self._used_with_leads
        else:
            used = lambda s: s.pressure_at(rung) * s.capacity_bytes  # noqa: E731
        if (mode or self._mode) == "max":
            return max(used(s) / s.capacity_bytes for s in up)
        return sum(used(s) for s in up) / sum(s.capacity_bytes for s in up)

    def _used_with_leads(self, s: ShardState) -> float:
        """A shard that ran ahead to a rung filled up below it: it counts as at least that rung's threshold
        full, so the cluster's next epoch catches up with the leads instead of watching them."""
        if s.ahead is None:
            return s.used_bytes
        cfg = self._policy.config
        floor = cfg.q4_threshold if Level.from_tag(s.ahead).rung == 2 else cfg.q8_threshold
        return max(s.used_bytes, floor * s.capacity_bytes)

    def _pressure_at_rungs(self) -> tuple[float, float, float] | None:
        at = [self._pressure(rung=r) for r in range(3)]
        return None if at[0] is None else (at[0], at[1], at[2])  # type: ignore[return-value]

    def _imbalance(self) -> float | None:
        """The fullest up shard's pressure over the mean: 1.0 when routing spreads the data evenly."""
        up = self._up()
        if not up:
            return None
        mean = sum(s.pressure for s in up) / len(up)
        return max(s.pressure for s in up) / mean if mean > 0 else 1.0

    def _reason(self) -> str:
        return self._history[-1].reason if self._history else ""

    def _warming_up(self, now: float) -> bool:
        if now - self._started_at >= self._stale_after_s:
            return False
        reported = {s.shard_id for s in self._shards.values() if s.last_report_at is not None}
        return not set(self._expected) <= reported

    def _round_complete(self, now: float) -> bool:
        up_ids = {s.shard_id for s in self._up()}
        if not up_ids:
            return False
        if up_ids <= self._fresh:
            return True
        last = self._last_sample_at if self._last_sample_at is not None else self._started_at
        return now - last >= _ROUND_TIMEOUT_INTERVALS * self._interval_s

    def _maybe_sample(self, now: float) -> LevelOrder | None:
        pressure = self._pressure()
        if pressure is None:
            return None
        self._track_crossings(pressure, now)
        self._raw_pressure = pressure
        if self._warming_up(now) or not self._round_complete(now):
            return None
        self._fresh.clear()
        self._last_sample_at = now
        self._samples += 1
        if self._seed is not None:
            level = self._policy.observe(self._seeded(pressure, self._seed))
            self._seed = None
        else:
            level = self._policy.observe(pressure, self._pressure_at_rungs())
        if level == self._level:
            return None
        previous, self._level = self._level, level
        self._epoch += 1
        cfg = self._policy.config
        threshold = None
        if level > previous:
            threshold = cfg.q4_threshold if level is Level.Q4 else cfg.q8_threshold
        targets = tuple(sorted(s.shard_id for s in self._shards.values() if s.up))
        self._history.append(
            LevelChange(
                epoch=self._epoch,
                level=level.tag,
                previous=previous.tag,
                pressure=pressure,
                smoothed=self._policy.pressure,
                decided_at=now,
                crossed_at=self._crossed_at.get(threshold) if threshold is not None else None,
                threshold=threshold,
                pending=targets,
                reason=self._policy.reason,
            )
        )
        return LevelOrder(level, self._epoch, targets, self._policy.reason)

    def _seeded(self, pressure: float, level: Level) -> float:
        """A first sample that lands the fresh policy on ``level`` (the recovered one), as close to the real
        pressure as the level's band allows."""
        cfg = self._policy.config
        rung = cfg.rungs.index(level) if level in cfg.rungs else 0
        below_q4 = cfg.q4_threshold - 1e-9
        below_q8 = cfg.q8_threshold - 1e-9
        if rung == 2:
            return max(pressure, cfg.q4_threshold)
        if rung == 1:
            return min(max(pressure, cfg.q8_threshold), max(below_q4, cfg.q8_threshold))
        return min(pressure, max(below_q8, 0.0))

    def _track_crossings(self, pressure: float, now: float) -> None:
        cfg = self._policy.config
        for threshold in (cfg.q8_threshold, cfg.q4_threshold):
            if pressure >= threshold:
                self._crossed_at.setdefault(threshold, now)
            else:
                self._crossed_at.pop(threshold, None)
        # Relief: after a step up, the first time raw pressure is back below the threshold behind it.
        for i, change in enumerate(self._history):
            if change.threshold is not None and change.relieved_at is None and pressure < change.threshold:
                self._history[i] = replace(change, relieved_at=now)

    def _note_applied(self, shard_id: str, epoch: int, now: float) -> None:
        for i, change in enumerate(self._history):
            if change.pending and shard_id in change.pending and epoch >= change.epoch:
                pending = tuple(s for s in change.pending if s != shard_id)
                self._history[i] = replace(change, pending=pending, applied_at=now if not pending else None)

    def _level_of_epoch(self, epoch: int, state: ShardState) -> str:
        if epoch == self._epoch:
            return self._level.tag
        for change in self._history:
            if change.epoch == epoch:
                return change.level
        return state.level


def _change_dict(change: LevelChange) -> dict[str, Any]:
    return {name: getattr(change, name) for name in LevelChange.__slots__}

