"""The coordinator: a named, detached Ray actor around :class:`kvd.cluster.membership.Membership`.

Theory of operation
-------------------
One coordinator per kvd (per Ray namespace). Shards find it by name, register, and report ``used`` /
``capacity`` every report interval (kvd.cluster.shard). Each report goes into the pure :class:`Membership`, which
decides levels; a level change is first persisted (Ray's internal key-value store, key
``kvd/<namespace>/coordinator``) and then broadcast: ``set_level(level, epoch)`` on every shard actor, sent by a
broadcaster thread so a slow shard never blocks reports. Report replies carry the current level and epoch too,
so a shard that missed a broadcast (or restarted) converges within one report interval.

Clients never talk to the coordinator through Ray: it serves the topology (shard ids and endpoints, topology
epoch, level, level epoch) on its own ZeroMQ endpoint (:class:`kvd.wire.server.TopologyServer`), the only address a
client is given. The coordinator is pinned to the Ray head node and rebinds the same port after a restart.

Namespaces and routing: ``register`` is cluster-wide. A shard that serves a ``register`` asks the coordinator
first (:meth:`Coordinator.add_namespace`), which keeps the layout and pushes it to every shard before answering
(``sync``); a shard that registers (started, restarted, or found the coordinator restarted) is handed every
namespace and the routing (topology epoch and shard ids, which it enforces: docs/protocol.md §10) in the reply,
and report replies carry whatever a shard lacks, so every shard converges within one report interval even if a
push was lost. A registration costs the same however many namespaces exist: the push carries the new namespace
only (with the version it applies on), and namespaces are persisted in parts of ``NAMESPACE_PART`` under keys
of their own (``.../namespaces/<i>``), of which an addition rewrites only the last. ``cluster.max_namespaces``
bounds how many there are.

Calibrations live with their namespaces: a shard serving ``calibrate`` hands the record (and the namespace's
own ``require_calibration``, protocol 1.8) to the coordinator first (:meth:`Coordinator.add_calibration`), which
keeps them (the latest per namespace), persists them under a key of the namespace's own
(``.../calibrations/<namespace in hex>``: a calibration is a few KB, and setting one rewrites only its own key)
and pushes them to every shard before answering; shards get every calibration with their registration and what
they lack with their reports (``calibrations_version``), as namespaces.

Clients get the topology only once it is complete and persisted: a fresh cluster answers ``Busy`` (retry)
until every expected shard registered; every published topology was saved first, so a restarted coordinator
serves it again at once under the same epoch, and never names a different shard list with an epoch that was
served before.

Restart: Ray restarts the actor (``max_restarts=-1``); the new process reads the persisted level, epochs,
topology (shard ids, endpoints, incarnations), namespaces and endpoint, rebinds the endpoint, serves the
persisted topology, and confirms membership as shards register again (their reports are refused as unknown
only when the persisted state is lost, or they changed meanwhile). It never issues an epoch at or below one
already persisted or reported.

A failed save (the GCS did not answer) publishes nothing: clients keep the last saved topology (or ``Busy``) and
housekeeping saves again every half second. A level order is broadcast even if its save failed: the level must
move under pressure, and the shards report its epoch back, so a restarted coordinator still goes past it.

The plain class :class:`Coordinator` is wrapped with ``ray.remote`` in one place
(:func:`kvd.cluster.deploy.actor_class`); :mod:`kvd.cluster.deploy` starts, locates and stops a whole kvd on a
connected Ray. Every wait for a shard (``ray.wait``, ``ray.get``) is bounded by ``ray_timeout_s`` or less, and
calls on actors are sent without waiting; ``ray.get_actor`` (a shard's handle, looked up once and kept) and the
internal KV calls of :class:`RayKV` take no timeout, as Ray offers none: they wait as long as the GCS does.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvd.cluster.membership import LevelOrder, Membership, ShardReport
from kvd.cluster.naming import curve_server_config, resolve_host, shard_ids, shard_name, state_key
from kvd.config.settings import Config
from kvd.errors import Busy, ConfigError, KvdError
from kvd.policy import Policy

__all__ = ["Coordinator", "RayKV"]

log = logging.getLogger("kvd.cluster.coordinator")

_KV_NAMESPACE = "kvd"
_HOUSEKEEPING_S = 0.5
_REBIND_S = 2.0
_REBIND_PAUSE_S = 0.1
_PUSH_TIMEOUT_S = 2.0  # a namespace push waits this long for the shards (a dead one converges by its reports)
NAMESPACE_PART = 256  # namespaces per persisted part (a registration rewrites one part of at most this many)


class RayKV:
    """Persisted coordinator state in Ray's internal KV (GCS). Failures are logged, never fatal: :meth:`load`
    returns ``{}`` and :meth:`save` False.

    Why a private Ray API (``ray.experimental.internal_kv``): the state must outlive the coordinator's process
    (Ray restarts the actor) and last exactly as long as the Ray cluster, with nothing else to run or mount.
    Ray's public API has no key-value store; its GCS has this one, which Ray's own libraries persist to (Serve's
    controller, the job manager). The price is an API without a stability promise: kvd pins one Ray version
    (pyproject.toml), and tests/integration/test_lifecycle.py kills a coordinator that must then serve its saved
    topology again, so an upgrade that breaks this class fails the suite rather than a restart in production.
    """

    def __init__(self, key: str) -> None:
        self._key = key

    def part(self, index: int) -> RayKV:
        """The store of part ``index`` of the state kept apart (the namespaces), under a key of its own."""
        return RayKV(f"{self._key}/namespaces/{index}")

    def calibration(self, namespace: str) -> RayKV:
        """The store of ``namespace``'s calibration, under a key of its own."""
        return RayKV(f"{self._key}/calibrations/{namespace.encode().hex()}")

    def calibrations(self) -> dict[str, dict[str, Any]]:
        """Every namespace's calibration entry saved: ``{namespace: {"calibration": record or None, "require":
        bool or None}}`` ({} when none, or the GCS did not answer)."""
        from ray.experimental import internal_kv

        prefix = f"{self._key}/calibrations/"
        try:
            keys = internal_kv._internal_kv_list(prefix, namespace=_KV_NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - as load(): start without them; shards hand theirs over
            log.warning("cannot list calibrations under %s: %s", prefix, exc)
            return {}
        out: dict[str, dict[str, Any]] = {}
        for key in keys:
            item = RayKV(key.decode() if isinstance(key, bytes) else str(key)).load()
            record, require = item.get("calibration"), item.get("require")
            if isinstance(item.get("namespace"), str) and (isinstance(record, dict) or isinstance(require, bool)):
                out[item["namespace"]] = {"calibration": record if isinstance(record, dict) else None,
                                          "require": require if isinstance(require, bool) else None}
        return out

    def load(self) -> dict[str, Any]:
        from ray.experimental import internal_kv

        try:
            raw = internal_kv._internal_kv_get(self._key, namespace=_KV_NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - GCS unreachable or client mode: start fresh, shards correct us
            log.warning("cannot read coordinator state %s: %s", self._key, exc)
            return {}
        if not raw:
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            log.warning("ignoring unreadable coordinator state %r", raw[:200])
            return {}
        return data if isinstance(data, dict) else {}

    def save(self, data: dict[str, Any]) -> bool:
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_put(self._key, json.dumps(data), overwrite=True, namespace=_KV_NAMESPACE)
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot persist coordinator state %s: %s", self._key, exc)
            return False

    def delete(self) -> None:
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_del(self._key, namespace=_KV_NAMESPACE)
            internal_kv._internal_kv_del(f"{self._key}/namespaces/", del_by_prefix=True, namespace=_KV_NAMESPACE)
            internal_kv._internal_kv_del(f"{self._key}/calibrations/", del_by_prefix=True,
                                         namespace=_KV_NAMESPACE)
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot delete coordinator state %s: %s", self._key, exc)



def _list_of_maps(value: Any) -> list[dict[str, Any]]:
    """The persisted shard list, or [] when it is missing or not what this version writes."""
    if not isinstance(value, list):
        return []
    if not all(isinstance(x, dict) and "id" in x and "endpoint" in x for x in value):
        return []
    return value


class Coordinator:
    """Membership, the level controller and the topology endpoint. Wrapped as a Ray actor by :func:`actor_class`.

    ``host``: the address to bind the topology endpoint (``"node"`` = this node's IP). Methods called by shards:
    :meth:`register`, :meth:`report`; by tools: :meth:`endpoint`, :meth:`topology`, :meth:`status`,
    :meth:`stop`.
    """

    def __init__(self, config: Config, *, host: str, kv: Any = None, clock: Callable[[], float] = time.monotonic):
        from kvd.cluster.priority import normal_priority  # Ray runs workers at nice 15; a server must not
        normal_priority()
        self._config = config
        self._cluster = config.cluster
        self._clock = clock
        self._kv = kv if kv is not None else RayKV(state_key(config.cluster.namespace))
        state = self._kv.load()
        recovered_epoch = int(state.get("epoch", 0) or 0)
        recovered_level = state.get("level")
        recovered_calibrations, recovered_required = self._load_calibrations() if state else ({}, {})
        self._restarted = bool(state)
        self._membership = Membership(
            Policy(config.policy_config()),
            now=clock(),
            report_interval_s=self._cluster.report_interval_s,
            pressure_mode=self._cluster.pressure_mode,
            expected=shard_ids(self._cluster.shards),
            recovered_epoch=recovered_epoch,
            recovered_level=recovered_level if recovered_epoch and recovered_level else None,
            recovered_topology_epoch=int(state.get("topology_epoch", 0) or 0),
            recovered_shards=_list_of_maps(state.get("shards")),
            recovered_namespaces=self._load_namespaces(state),
            recovered_namespaces_version=int(state.get("namespaces_version", 0) or 0),
            recovered_calibrations=recovered_calibrations,
            recovered_calibrations_version=int(state.get("calibrations_version", 0) or 0),
            recovered_required=recovered_required,
            max_namespaces=self._cluster.max_namespaces,
            ready_grace_s=self._cluster.ready_grace_s,
        )
        self._namespaces_saved = self._membership.namespace_count  # persisted: every part up to this many
        # (the digest of its calibration, its own require_calibration) of each namespace as persisted
        self._calibrations_saved = self._calibration_entries()
        self._handles: dict[str, Any] = {}
        self._handles_lock = threading.Lock()
        self._persist_lock = threading.Lock()
        self._orders: queue.Queue[LevelOrder | None] = queue.Queue()
        self._stopped = threading.Event()
        self._resync = threading.Event()  # the routing or the namespaces changed: push them to every shard
        self._saved: dict[str, Any] | None = None
        self._served: dict[str, Any] | None = None  # the topology clients get: complete, and persisted first
        self._bind_host = resolve_host(host)
        self._server = self._start_topology_server(state.get("endpoint"))
        self._persist(force=True)
        self._threads = [
            threading.Thread(target=self._broadcast_loop, name="kvd-broadcast", daemon=True),
            threading.Thread(target=self._housekeeping_loop, name="kvd-housekeeping", daemon=True),
            threading.Thread(target=self._sync_loop, name="kvd-sync", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        log.info("coordinator serving topology on %s (restarted=%s)", self._server.endpoint, self._restarted)

    # ------------------------------------------------------------------------------------------ startup

    def _start_topology_server(self, previous: str | None) -> Any:
        from kvd.wire.server import TopologyServer

        curve = curve_server_config(self._config)
        ports: list[int] = []
        if isinstance(previous, str) and previous.rsplit(":", 1)[-1].isdigit():
            ports.append(int(previous.rsplit(":", 1)[-1]))  # clients only know this address: keep it
        if self._cluster.port not in ports:
            ports.append(self._cluster.port)
        last_exc: Exception | None = None
        for port in ports:
            # The previous process's socket may take a moment to go away after a crash: retry that port for a
            # bounded time (bind failures are immediate, so this loop does not wait for anything else).
            deadline = time.monotonic() + (_REBIND_S if port else 0.0)
            while True:
                server = TopologyServer(self._client_topology, host=self._bind_host, port=port, curve=curve)
                try:
                    server.start()
                    return server
                except Exception as exc:  # noqa: BLE001 - zmq reports address in use as ZMQError
                    last_exc = exc
                    server.stop(timeout_s=0.1)
                if time.monotonic() >= deadline:
                    break
                time.sleep(_REBIND_PAUSE_S)  # a bounded retry of a failed bind, not a wait for readiness
        raise ConfigError(
            f"coordinator cannot bind {self._bind_host} port(s) {ports}: {last_exc} "
            "(is another kvd running? use `kvd down`, another --port or another --namespace)"
        )

    # ----------------------------------------------------------------------------------- shard-facing

    def register(self, shard_id: str, endpoint: str, incarnation: str, node: str = "", topology_epoch: int = 0,
                 namespaces: dict[str, Any] | None = None,
                 calibrations: dict[str, Any] | None = None,
                 required: dict[str, bool] | None = None) -> dict[str, Any]:
        """A shard (re)started: returns ``{"level": tag, "epoch": int, "topology_epoch": int}`` to apply, plus
        every namespace (``namespaces``, ``namespaces_version``), every calibration and namespace's own
        ``require_calibration`` (``calibrations``, ``required``, ``calibrations_version``) and, once published,
        the ``routing``. ``topology_epoch`` / ``namespaces`` / ``calibrations`` / ``required``: what the shard
        had (kept from before a coordinator restart, or on its disk)."""
        before = self._membership.topology_epoch
        calibrations_before = self._membership.calibrations_version
        reg = self._membership.register(shard_id, endpoint, incarnation=incarnation, node=node, now=self._clock(),
                                        topology_epoch=topology_epoch, namespaces=namespaces,
                                        calibrations=calibrations, required=required)
        self._persist()
        if (self._membership.topology_epoch != before or namespaces
                or self._membership.calibrations_version != calibrations_before):
            self._resync.set()
        log.info("shard %s registered at %s (incarnation %s)", shard_id, endpoint, incarnation)
        sync = self._membership.shard_sync(topology_epoch=-1, namespaces_version=-1, now=self._clock())
        return {"level": reg.level.tag, "epoch": reg.epoch, "topology_epoch": reg.topology_epoch, **sync}

    def add_namespace(self, namespace: str, layout: list[int]) -> dict[str, Any]:
        """A shard serves ``register``: make it cluster-wide. ``{"ok": True}`` once it is persisted and pushed
        to every shard (or the push timed out: a shard that missed it gets it with its next report);
        ``{"ok": False, "code", "error", "message"}`` for a layout the cluster knows otherwise."""
        before = self._membership.namespaces_version
        return self._cluster_wide(lambda: self._membership.add_namespace(namespace, layout),
                                  f"namespace {namespace} registered with layout {list(layout)}",
                                  namespaces_from=before,  # what was added since `before` only
                                  calibrations_from=self._membership.calibrations_version)

    def add_calibration(self, namespace: str, record: dict[str, Any] | None = None,
                        require: bool | None = None) -> dict[str, Any]:
        """A shard serves ``calibrate`` (``record``: a checked ``Calibration.to_dict()``; ``require``: the
        namespace's own ``require_calibration``; None: unchanged): keep them with the namespace. ``{"ok": True}``
        once they are persisted and pushed to every shard (or the push timed out: a shard that missed them gets
        them with its next report); ``{"ok": False, "code", "error", "message"}`` for a namespace the cluster
        does not know."""
        before = self._membership.calibrations_version
        done = f"namespace {namespace}" + (f" calibrated ({str(record.get('digest'))[:16]})" if record else "") \
            + (f" require_calibration {require}" if require is not None else "")
        return self._cluster_wide(lambda: self._membership.set_calibration(namespace, record, require), done,
                                  namespaces_from=self._membership.namespaces_version, calibrations_from=before)

    def _cluster_wide(self, change: Callable[[], bool], done: str, **since: int) -> dict[str, Any]:
        """Apply ``change`` to membership; if it changed anything, persist it (a failed save is retried by
        housekeeping) and push what changed ``since`` to every shard. The reply of add_namespace and
        add_calibration."""
        try:
            changed = change()
        except KvdError as exc:
            return {"ok": False, "code": exc.code, "error": type(exc).__name__, "message": str(exc)}
        if changed:
            self._persist()
            log.info(done)
            self._push(wait_s=_PUSH_TIMEOUT_S, **since)
        return {"ok": True}

    def calibrations(self) -> dict[str, dict[str, Any]]:
        """Every namespace's calibration record, as the coordinator keeps it."""
        return self._membership.calibrations()

    def required(self) -> dict[str, bool]:
        """Every namespace's own ``require_calibration``, where it has one, as the coordinator keeps it."""
        return self._membership.required()

    def report(self, report: dict[str, Any]) -> dict[str, Any]:
        """One shard report (the fields of :class:`ShardReport`). Returns ``{"known": bool, "level", "epoch"}``;
        ``known`` False asks the shard to register again (this coordinator does not know that process)."""
        topology_epoch = self._membership.topology_epoch
        outcome = self._membership.report(ShardReport(**report), now=self._clock())
        if outcome.order is not None or self._membership.topology_epoch != topology_epoch:
            self._persist()  # before the broadcast; should it fail, the shards carry the epoch (module docstring)
        if outcome.order is not None:
            self._orders.put(outcome.order)
        if not outcome.known:
            return {"known": False}
        assert outcome.level is not None
        sync = self._membership.shard_sync(topology_epoch=int(report.get("topology_epoch", 0)),
                                           namespaces_version=int(report.get("namespaces_version", 0)),
                                           calibrations_version=int(report.get("calibrations_version", 0)),
                                           now=self._clock())
        return {"known": True, "level": outcome.level.tag, "epoch": outcome.epoch, "reason": outcome.reason,
                **sync}

    # ------------------------------------------------------------------------------------ tool-facing

    def endpoint(self) -> str:
        """The client endpoint: ``tcp://host:port``."""
        return str(self._server.endpoint)

    def topology(self) -> dict[str, Any]:
        """The topology as membership has it now (complete or not; tools). Clients get :meth:`_client_topology`."""
        return self._membership.topology()

    def namespaces(self) -> dict[str, list[int]]:
        """Every namespace registered in the cluster: ``{name: [layers, kv_heads, head_dim]}``."""
        return {k: list(v) for k, v in self._membership.namespaces()[1].items()}

    def status(self) -> dict[str, Any]:
        """Control-plane figures: level, epochs, cluster pressure, per-shard view, level-change history."""
        snap = self._membership.snapshot(self._clock())
        snap["endpoint"] = self.endpoint()
        snap["namespace"] = self._cluster.namespace
        snap["pid"] = os.getpid()
        snap["restarted"] = self._restarted
        snap["topology_published"] = self._served is not None
        snap["namespaces"] = self._membership.namespace_count
        snap["calibrations"] = len(self._membership.calibrations())
        snap["clock"] = self._clock()
        return snap

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> bool:
        return True

    def stop(self) -> None:
        """Stop serving the topology and the background threads (before the actor is killed)."""
        self._stopped.set()
        self._orders.put(None)
        self._server.stop(timeout_s=2.0)

    # -------------------------------------------------------------------------------------- internals

    def _persist(self, *, force: bool = False) -> bool:
        """Save the state if it changed, then publish its topology to clients once complete: a topology is
        served only after it was saved, so a restarted coordinator never serves an epoch it cannot recall.
        False if the save failed (``kv.save`` returned False: the GCS did not answer): nothing is marked saved
        or published, and the next call (housekeeping makes one every ``_HOUSEKEEPING_S``) tries again."""
        # One writer at a time, so a slower save of an older state never lands after a newer one.
        with self._persist_lock:
            if not self._save_namespaces() or not self._save_calibrations():
                return False  # the state must never count namespaces or calibrations that were not saved
            state = self._membership.state()
            state["endpoint"] = self._server.endpoint
            state["namespace_count"] = self._namespaces_saved
            if force or state != self._saved:
                if not self._kv.save(state):
                    return False  # clients keep the last saved topology; housekeeping retries
                self._saved = state
            if self._membership.published_topology(self._clock()) is not None:
                self._served = {"epoch": state["topology_epoch"],
                                "shards": [{"id": s["id"], "endpoint": s["endpoint"]} for s in state["shards"]]}
            return True

    def _load_namespaces(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """The persisted namespaces, in the order added: ``namespace_count`` of them from their parts."""
        count = state.get("namespace_count")
        if not isinstance(count, int) or count <= 0:
            return None
        out: dict[str, Any] = {}
        for index in range((count + NAMESPACE_PART - 1) // NAMESPACE_PART):
            part = self._kv.part(index).load()
            out.update(part)
            if len(part) < min(NAMESPACE_PART, count - index * NAMESPACE_PART):
                log.warning("coordinator state: namespaces part %d has %d of its namespaces; the shards hand "
                            "over the rest as they register", index, len(part))
        return dict(list(out.items())[:count])

    def _save_namespaces(self) -> bool:
        """(Under the persist lock) save the parts that hold namespaces added since the last save: one part per
        registration, whatever the number of namespaces. False if a save failed (retried with the next)."""
        count = self._membership.namespace_count
        saved = self._namespaces_saved
        if count <= saved:
            return True
        for index in range(saved // NAMESPACE_PART, (count - 1) // NAMESPACE_PART + 1):
            if not self._kv.part(index).save(self._membership.namespace_part(index, NAMESPACE_PART)):
                return False
        self._namespaces_saved = count
        return True

    def _load_calibrations(self) -> tuple[dict[str, Any], dict[str, bool]]:
        """The persisted calibrations whose record still reads as one (a damaged one is left out, logged), and
        the namespaces' own ``require_calibration``."""
        from kvd.calibration import from_dict

        records, required = {}, {}
        for name, item in self._kv.calibrations().items():
            if item["require"] is not None:
                required[name] = item["require"]
            record = item["calibration"]
            if record is None:
                continue
            try:
                from_dict(record)
            except KvdError as exc:
                log.warning("coordinator state: calibration of namespace %s is unreadable (%s); left out", name,
                            exc)
                continue
            records[name] = record
        return records, required

    def _calibration_entries(self, records: dict[str, Any] | None = None,
                             required: dict[str, bool] | None = None) -> dict[str, tuple[Any, bool | None]]:
        """``{namespace: (its calibration's digest or None, its own require_calibration or None)}`` of
        ``records`` and ``required`` (None: membership's)."""
        records = self._membership.calibrations() if records is None else records
        required = self._membership.required() if required is None else required
        return {name: (records[name].get("digest") if name in records else None, required.get(name))
                for name in {*records, *required}}

    def _save_calibrations(self) -> bool:
        """(Under the persist lock) save each namespace's calibration entry (its record and its own
        ``require_calibration``) changed since the last save, under its own key. False if a save failed
        (retried with the next)."""
        records, required = self._membership.calibrations(), self._membership.required()
        for name, entry in self._calibration_entries(records, required).items():
            if self._calibrations_saved.get(name) == entry:
                continue
            if not self._kv.calibration(name).save({"namespace": name, "calibration": records.get(name),
                                                    "require": required.get(name)}):
                return False
            self._calibrations_saved[name] = entry
        return True

    def _client_topology(self) -> dict[str, Any]:
        """What the topology endpoint serves: the last published topology, with the level in force; ``Busy``
        (retry) until membership is complete."""
        served = self._served
        if served is None:
            missing = self._membership.expected_missing()
            raise Busy(f"the coordinator is still building its membership ({len(missing)} shard(s) not "
                       f"registered yet: {', '.join(missing[:8])}); retry after a short backoff")
        return {**served, "level": self._membership.level.tag, "level_epoch": self._membership.epoch}

    def _push(self, *, wait_s: float, namespaces_from: int = -1, calibrations_from: int = -1) -> None:
        """Send every shard the routing, the namespaces added after version ``namespaces_from`` and the
        calibrations set after ``calibrations_from`` (-1: all) (``Shard.sync``); wait up to ``wait_s`` for
        them."""
        import ray

        payload = self._membership.shard_sync(topology_epoch=-1, namespaces_version=namespaces_from,
                                              calibrations_version=calibrations_from, now=self._clock())
        refs: dict[Any, str] = {}
        for state in self._membership.shards():
            try:
                refs[self._handle(state.shard_id).sync.remote(payload)] = state.shard_id
            except Exception as exc:  # noqa: BLE001 - a dead shard converges through its next report
                with self._handles_lock:
                    self._handles.pop(state.shard_id, None)
                log.warning("sync to %s failed: %s", state.shard_id, exc)
        if refs and wait_s > 0:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
            for ref in ready:
                try:
                    ray.get(ref, timeout=0)
                except Exception as exc:  # noqa: BLE001
                    with self._handles_lock:
                        self._handles.pop(refs[ref], None)  # look it up again: it may have restarted
                    log.warning("sync to %s failed: %s", refs[ref], exc)

    def _sync_loop(self) -> None:
        while not self._stopped.is_set():
            if not self._resync.wait(_HOUSEKEEPING_S):
                continue
            self._resync.clear()
            try:
                self._push(wait_s=self._cluster.ray_timeout_s)
            except Exception:  # noqa: BLE001 - keep the loop alive; reports converge the shards anyway
                log.exception("coordinator sync failed")

    def _handle(self, shard_id: str) -> Any:
        with self._handles_lock:
            handle = self._handles.get(shard_id)
        if handle is None:
            import ray

            handle = ray.get_actor(shard_name(shard_id), namespace=self._cluster.namespace)
            with self._handles_lock:
                self._handles[shard_id] = handle
        return handle

    def _broadcast_loop(self) -> None:
        import ray

        while not self._stopped.is_set():
            order = self._orders.get()
            if order is None:
                return
            pending: dict[Any, str] = {}
            for shard_id in order.targets:
                try:
                    ref = self._handle(shard_id).set_level.remote(order.level.tag, order.epoch, order.reason)
                    pending[ref] = shard_id
                except Exception as exc:  # noqa: BLE001 - a dead shard converges through its next report
                    log.warning("set_level(%s, %d) to %s failed: %s", order.level.tag, order.epoch, shard_id, exc)
            deadline = self._clock() + self._cluster.ray_timeout_s
            while pending and self._clock() < deadline:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - self._clock()))
                for ref in ready:
                    shard_id = pending.pop(ref)
                    try:
                        applied = ray.get(ref, timeout=self._cluster.ray_timeout_s)
                        self._membership.acknowledge(shard_id, int(applied), now=self._clock())
                    except Exception as exc:  # noqa: BLE001
                        with self._handles_lock:
                            self._handles.pop(shard_id, None)  # look it up again: it may have restarted
                        log.warning("set_level to %s failed: %s", shard_id, exc)
            for shard_id in pending.values():
                log.warning("set_level(%s, %d) to %s timed out", order.level.tag, order.epoch, shard_id)

    def _housekeeping_loop(self) -> None:
        published = self._served is not None
        while not self._stopped.wait(_HOUSEKEEPING_S):
            try:
                for shard_id in self._membership.expire(self._clock()):
                    log.warning("shard %s stopped reporting; marked down", shard_id)
                self._persist()
                if not published and self._served is not None:
                    published = True
                    self._resync.set()  # the routing is complete now: hand it to the shards at once
            except Exception:  # noqa: BLE001 - keep the loop alive whatever happens
                log.exception("coordinator housekeeping failed")
