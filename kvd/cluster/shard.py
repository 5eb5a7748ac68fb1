"""A shard: a thin Ray actor around one :class:`~kvd.store.Store` and its ZeroMQ
:class:`~kvd.wire.server.ShardServer`.

Theory of operation
-------------------
On start the shard builds an empty Store of ``config.shard_capacity_bytes``, binds its ZeroMQ endpoint (on
127.0.0.1 for an embedded Ray, the node's IP on a cluster; always a fresh port, so requests a client queued for
a dead process are never delivered to its empty successor) and starts one *reporter* thread. The reporter finds
the coordinator by name (retrying with backoff), registers (shard id, endpoint, a fresh incarnation id) and
then reports ``used_bytes`` / ``capacity_bytes`` and the applied level and epoch every
``config.cluster.report_interval_s``. Every reply carries the current level and epoch, which the shard applies
(``Store.set_level`` ignores older epochs), so a shard converges even if it misses a broadcast; a reply saying
"unknown" (the coordinator restarted) makes it register again.

Ray restarts a dead shard (``max_restarts=-1``) with the same shard id: it comes back empty, on a new port,
registers again and takes the current level; the coordinator publishes the new endpoint in the topology.
``cluster.shard_ports`` confines the ports to a range (for firewalls); a port is then picked at random in it,
so a restarted shard may come back on its predecessor's port. Clients tell the two apart by the incarnation
id (``hello``, protocol 1.3): an append meant for the dead process is refused with WrongShard.

Namespaces and routing (docs/protocol.md §6.3, §10). The registration reply hands the shard every namespace
of the cluster and the routing (topology epoch and shard ids), so a restarted or new shard knows every
namespace before it is published, and refuses sequences another shard owns (WrongShard). ``register``
served by this shard is made cluster-wide first (``Coordinator.add_namespace``, which pushes it to every
shard); if the coordinator cannot be reached the namespace is registered here and handed over with the next
registration or report. Reports carry the epoch and namespaces version the shard has, and their replies
whatever it lacks; the coordinator also pushes changes (:meth:`Shard.sync`). Calibrations, and a namespace's
own ``require_calibration``, travel the same way: ``calibrate`` served here is handed to the coordinator first
(``Coordinator.add_calibration``), the registration reply hands over every calibration and setting of the
cluster, and reports carry ``calibrations_version``.

Data never passes through this actor's Ray methods: clients talk to the ShardServer directly.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from typing import Any

from kvd.config.settings import Config
from kvd.errors import ConfigError, InvalidArgument, KvdError, error_for_code
from kvd.store import buffers

__all__ = ["Shard"]

log = logging.getLogger("kvd.cluster.shard")

_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 2.0
_ADD_NAMESPACE_S = 2.0  # the longest a register waits for the coordinator (it holds the serving thread)


def _candidate_ports(port_range: tuple[int, int] | None) -> list[int]:
    """0 (any free port), or every port of the range in random order (so shards spread over it)."""
    if port_range is None:
        return [0]
    ports = list(range(port_range[0], port_range[1] + 1))
    random.shuffle(ports)
    return ports


def _open_store(shard_id: str, config: Config, fresh_token: str | None) -> Any:
    """The shard's store, with its disk tier if ``cluster.disk_bytes`` is set. ``fresh_token``: `kvd up --fresh`
    asked for an empty disk; the token is written beside the files, so a restart of this shard by Ray (same
    arguments) keeps what the disk holds by then."""
    from kvd.store.core import Store

    disk: dict[str, Any] = {}
    if config.shard_disk_bytes:
        path = config.shard_disk_path(shard_id)
        mark = os.path.join(path, "FRESH")
        fresh = False
        if fresh_token is not None:
            try:
                with open(mark) as f:
                    fresh = f.read().strip() != fresh_token
            except FileNotFoundError:
                fresh = True
        disk = {"disk_path": path, "disk_bytes": config.shard_disk_bytes, "disk_fresh": fresh}
    store = Store(config.shard_capacity_bytes, **config.store_kwargs(), **disk)
    if disk and fresh_token is not None:
        with open(os.path.join(disk["disk_path"], "FRESH"), "w") as f:
            f.write(fresh_token)
    return store


class Shard:
    """One shard. ``shard_id``: its stable id (``shard-0`` ...); ``host``: bind address or ``"node"``.

    Ray methods: :meth:`set_level` (from the coordinator's broadcast), :meth:`stats`, :meth:`info`,
    :meth:`ping`, :meth:`stop`.
    """

    def __init__(self, shard_id: str, config: Config, *, host: str, fresh_token: str | None = None) -> None:
        from kvd.cluster.priority import normal_priority  # Ray runs workers at nice 15; a server must not
        normal_priority()
        from kvd.cluster.naming import curve_server_config, resolve_host
        from kvd.wire.server import ShardServer

        self._shard_id = shard_id
        self._config = config
        self._incarnation = uuid.uuid4().hex
        self._started_at = time.time()
        self._store = _open_store(shard_id, config, fresh_token)
        buffers.cache_bytes(config.store.warm_cache_bytes)  # process-wide, like ShardServer's malloc tuning
        bind_host = resolve_host(host)
        curve = curve_server_config(config)
        last_exc: Exception | None = None
        for port in _candidate_ports(config.cluster.shard_port_range):
            server = ShardServer(
                self._store,
                shard_id=shard_id,
                host=bind_host,
                port=port,
                curve=curve,
                compact_budget_bytes=config.store.compact_budget_bytes,
                socket_buffer_bytes=config.cluster.shard_socket_buffer_bytes,
                max_reply_bytes=config.cluster.shard_reply_bytes,
                incarnation=self._incarnation,
                on_register=self._register_namespace,
                on_calibrate=self._calibrate_namespace,
                starting=True,  # no data before the cluster's namespaces are known (the first registration)
            )
            try:
                self._endpoint = server.start()
            except Exception as exc:  # noqa: BLE001 - port taken: try the next one of the range
                last_exc = exc
                continue
            self._server = server
            break
        else:
            raise ConfigError(
                f"shard {shard_id} found no free port in cluster.shard_ports={config.cluster.shard_ports!r} "
                f"on {bind_host}: {last_exc}"
            )
        self._node = socket.gethostname()
        self._namespaces_lock = threading.Lock()
        self._namespaces: dict[str, tuple[int, int, int]] = {}  # every namespace this shard knows
        # registered here, not yet known to the coordinator: at first, those of the sequences its disk holds
        self._pending: dict[str, tuple[int, int, int]] = self._store.layouts()
        self._namespaces_version = 0
        # calibrated here, not yet kept by the coordinator: (record or None, require or None) by namespace
        self._pending_cals: dict[str, tuple[dict[str, Any] | None, bool | None]] = {}
        self._calibrations_version = 0
        self._stopped = threading.Event()
        self._registered = threading.Event()
        self._coordinator: Any = None
        self._reports = 0
        self._report_errors = 0
        self._last_error = ""
        self._reporter = threading.Thread(target=self._report_loop, name=f"kvd-report-{shard_id}", daemon=True)
        self._reporter.start()
        log.info("shard %s serving on %s", shard_id, self._endpoint)

    # ------------------------------------------------------------------------------------------ Ray methods

    def set_level(self, level: str, epoch: int, reason: str = "") -> int:
        """Apply a level order (older epochs are ignored by the store). Returns the epoch now in force."""
        self._store.set_level(level, epoch, reason)
        return int(self._store.stats()["epoch"])

    def sync(self, state: dict[str, Any]) -> int:
        """Apply what the coordinator pushes: ``namespaces`` and ``routing`` (see :meth:`_sync`). Returns the
        topology epoch now enforced."""
        self._sync(state)
        return self._server.topology_epoch

    def stats(self) -> dict[str, Any]:
        """The store's stats plus the server's metrics (``server_*``), this shard's identity and its process's
        warm result buffers (``warm_cache_bytes`` kept at most, ``warm_cached_bytes`` kept now)."""
        out = dict(self._store.stats())
        try:
            for key, value in self._server.metrics().items():
                out[f"server_{key}"] = value
        except Exception as exc:  # noqa: BLE001 - status must not fail because of metrics
            out["server_error"] = str(exc)
        out.update(self.info())
        out["warm_cache_bytes"] = buffers.cache_bytes()
        out["warm_cached_bytes"] = buffers.cached()[1]
        return out

    def info(self) -> dict[str, Any]:
        return {
            "shard_id": self._shard_id,
            "endpoint": self._endpoint,
            "incarnation": self._incarnation,
            "pid": os.getpid(),
            "node": self._node,
            "registered": self._registered.is_set(),
            "topology_epoch": self._server.topology_epoch,
            "namespaces": len(self._namespaces),
            "reports": self._reports,
            "report_errors": self._report_errors,
            "last_report_error": self._last_error,
            "uptime_s": time.time() - self._started_at,
        }

    def endpoint(self) -> str:
        return self._endpoint

    def ping(self) -> bool:
        return True

    def stop(self) -> None:
        """Stop reporting and serving (before the actor is killed). Without a disk tier the store's data is
        dropped with it; with one, what it holds in memory is written to disk first, for the next start."""
        self._stopped.set()
        self._server.stop(timeout_s=2.0)
        self._store.close(persist=True)

    # ------------------------------------------------------------------------------------------ reporter

    def _apply(self, reply: dict[str, Any]) -> None:
        self._store.set_level(reply["level"], int(reply["epoch"]), str(reply.get("reason", "")))
        self._sync(reply)

    def _sync(self, state: dict[str, Any]) -> None:
        """Register every namespace of ``state["namespaces"]`` here and enforce ``state["routing"]`` if newer.
        Namespaces sent ``namespaces_from`` a version (those added after it) bring this shard to their version
        only if it had that one: else it still lacks some, and its next report asks for them."""
        namespaces = state.get("namespaces")
        if isinstance(namespaces, dict):
            for name, layout in namespaces.items():
                self._learn(name, tuple(layout))
        version = state.get("namespaces_version")
        if isinstance(version, int) and isinstance(namespaces, dict):
            base = state.get("namespaces_from")
            with self._namespaces_lock:
                if base is None:  # every namespace the cluster has
                    self._namespaces_version = version
                elif base <= self._namespaces_version < version:
                    self._namespaces_version = version
        calibrations = state.get("calibrations")
        if isinstance(calibrations, dict):
            for name, record in calibrations.items():
                self._learn_calibration(name, record)
            required = state.get("required")
            for name, require in (required if isinstance(required, dict) else {}).items():
                self._learn_required(name, require)
            version = state.get("calibrations_version")
            base = state.get("calibrations_from")
            with self._namespaces_lock:
                if isinstance(version, int) and (base is None or base <= self._calibrations_version < version):
                    self._calibrations_version = version
        routing = state.get("routing")
        if isinstance(routing, dict) and self._server.set_routing(int(routing["epoch"]), list(routing["shards"])):
            log.info("shard %s routes by topology epoch %d", self._shard_id, int(routing["epoch"]))

    def _learn(self, name: str, layout: tuple[int, int, int]) -> None:
        with self._namespaces_lock:
            if self._namespaces.get(name) == layout:
                return
        try:
            self._store.register(name, num_layers=layout[0], num_kv_heads=layout[1], head_dim=layout[2])
        except KvdError as exc:  # this shard has it otherwise (registered while the coordinator was away)
            log.error("shard %s cannot take namespace %s %s from the coordinator: %s", self._shard_id, name,
                      list(layout), exc)
            return
        with self._namespaces_lock:
            self._namespaces[name] = layout

    def _learn_calibration(self, name: str, record: dict[str, Any]) -> None:
        if self._store.calibration_state(name).get("digest") == record.get("digest"):
            return  # held already (the disk tier's copy, or an earlier push): its file is not rewritten
        try:
            self._store.calibrate(name, record)
        except KvdError as exc:
            log.error("shard %s cannot take the calibration of namespace %s from the coordinator: %s",
                      self._shard_id, name, exc)

    def _learn_required(self, name: str, require: Any) -> None:
        if not isinstance(require, bool) or self._store.calibration_required().get(name) is require:
            return  # held already: its file is not rewritten
        try:
            self._store.require_calibration_of(name, require)
        except KvdError as exc:
            log.error("shard %s cannot take require_calibration of namespace %s from the coordinator: %s",
                      self._shard_id, name, exc)

    def _calibrate_namespace(self, namespace: str, calibration: Any, require: bool | None = None) -> None:
        """The server's ``calibrate`` hook (serving thread): make the calibration (or None) and the namespace's
        own ``require_calibration`` (or None) cluster-wide before they are applied here. If the coordinator does
        not answer within ``_ADD_NAMESPACE_S``, applies them here only and hands them over later (the
        reporter)."""

        record = calibration.to_dict() if calibration is not None else None
        if not self._hand_to_coordinator("add_calibration", namespace, record, require, what="calibration"):
            with self._namespaces_lock:
                old_record, old_require = self._pending_cals.get(namespace, (None, None))
                self._pending_cals[namespace] = (record if record is not None else old_record,
                                                 require if require is not None else old_require)

    def _hand_to_coordinator(self, method: str, namespace: str, *args: Any, what: str) -> bool:
        """Call the coordinator's ``method(namespace, *args)`` (``add_namespace``, ``add_calibration``) within
        ``_ADD_NAMESPACE_S``: True once it took it, False when it is away (the caller keeps it for the reporter
        to hand over); raises the error it refused it with."""
        import ray

        coordinator = self._coordinator
        if coordinator is None or not self._registered.is_set():
            return False
        try:
            reply = ray.get(getattr(coordinator, method).remote(namespace, *args),
                            timeout=min(_ADD_NAMESPACE_S, self._config.cluster.ray_timeout_s))
        except Exception as exc:  # noqa: BLE001 - the coordinator is away: keep it for later
            log.warning("shard %s: %s of %s not handed to the coordinator yet: %s", self._shard_id, what,
                        namespace, exc)
            return False
        if not reply.get("ok"):
            raise error_for_code(int(reply.get("code", KvdError.code)), str(reply.get("message")))
        return True

    def _register_namespace(self, namespace: str, layout: tuple[int, int, int]) -> None:
        """The server's ``register`` hook (serving thread): make it cluster-wide before it is applied here.
        Raises LayoutMismatch if the cluster has another layout; if the coordinator does not answer within
        ``_ADD_NAMESPACE_S``, registers here only and hands it over later (the reporter)."""

        with self._namespaces_lock:
            if self._namespaces.get(namespace) == layout:
                return  # known cluster-wide already
            held, limit = len(self._namespaces) + len(self._pending), self._config.cluster.max_namespaces
        if held >= limit and namespace not in self._pending:  # (the coordinator refuses it too, cluster-wide)
            raise InvalidArgument(f"namespace {namespace!r} was not registered: shard {self._shard_id} holds "
                                  f"{held} namespaces, the limit (cluster.max_namespaces = {limit}); reuse one, "
                                  "or raise cluster.max_namespaces")
        if not self._hand_to_coordinator("add_namespace", namespace, list(layout), what="namespace"):
            with self._namespaces_lock:
                self._pending[namespace] = layout

    def _hand_over_pending(self, timeout_s: float) -> None:
        """Namespaces registered here while the coordinator was away: make them cluster-wide now."""
        import ray

        with self._namespaces_lock:
            pending = dict(self._pending)
        for name, layout in pending.items():
            reply = ray.get(self._coordinator.add_namespace.remote(name, list(layout)), timeout=timeout_s)
            if not reply.get("ok"):
                log.error("shard %s: namespace %s %s registered here conflicts with the cluster: %s",
                          self._shard_id, name, list(layout), reply.get("message"))
            with self._namespaces_lock:
                self._pending.pop(name, None)
        with self._namespaces_lock:
            cals = dict(self._pending_cals)
        for name, entry in cals.items():
            reply = ray.get(self._coordinator.add_calibration.remote(name, *entry), timeout=timeout_s)
            if not reply.get("ok"):
                log.error("shard %s: calibration of %s made here was refused by the coordinator: %s",
                          self._shard_id, name, reply.get("message"))
            with self._namespaces_lock:
                if self._pending_cals.get(name) is entry:
                    del self._pending_cals[name]

    def _report_loop(self) -> None:
        import ray

        from kvd.cluster.naming import coordinator_name

        cluster = self._config.cluster
        timeout_s = cluster.ray_timeout_s
        backoff_s = _BACKOFF_MIN_S
        wait_s = 0.0
        while not self._stopped.wait(wait_s):
            try:
                if self._coordinator is None:
                    self._coordinator = ray.get_actor(coordinator_name(), namespace=cluster.namespace)
                if not self._registered.is_set():
                    with self._namespaces_lock:
                        mine = {k: list(v) for k, v in {**self._namespaces, **self._pending}.items()}
                    cals = self._store.calibration_records()  # from its disk tier: where the cluster has none
                    required = self._store.calibration_required()  # likewise
                    reply = ray.get(
                        self._coordinator.register.remote(
                            self._shard_id, self._endpoint, self._incarnation, self._node,
                            self._server.topology_epoch, mine, cals, required,
                        ),
                        timeout=timeout_s,
                    )
                    self._apply(reply)
                    self._registered.set()
                    self._server.open_for_data()
                if self._pending or self._pending_cals:
                    self._hand_over_pending(timeout_s)
                stats = self._store.stats()
                reply = ray.get(
                    self._coordinator.report.remote(
                        {
                            "shard_id": self._shard_id,
                            "incarnation": self._incarnation,
                            "endpoint": self._endpoint,
                            "used_bytes": int(stats["used_bytes"]),
                            "capacity_bytes": int(stats["capacity_bytes"]),
                            "level": str(stats["ordered_level"]),  # what the epoch means
                            "epoch": int(stats["epoch"]),
                            "node": self._node,
                            "used_by_rung": list(self._store.used_by_rung()),
                            "ahead": stats["ahead"],
                            "topology_epoch": self._server.topology_epoch,
                            "namespaces_version": self._namespaces_version,
                            "calibrations_version": self._calibrations_version,
                        }
                    ),
                    timeout=timeout_s,
                )
                self._reports += 1
                if not reply["known"]:
                    self._registered.clear()  # the coordinator restarted: register at once
                    wait_s = 0.0
                    continue
                self._apply(reply)
                backoff_s = _BACKOFF_MIN_S
                wait_s = cluster.report_interval_s
            except Exception as exc:  # noqa: BLE001 - coordinator missing, restarting or slow: retry
                if time.time() - self._started_at > cluster.ray_timeout_s:
                    self._server.open_for_data()  # no coordinator for that long: serve what this shard knows
                self._report_errors += 1
                self._last_error = f"{type(exc).__name__}: {exc}"
                self._coordinator = None
                self._registered.clear()
                wait_s = backoff_s
                backoff_s = min(_BACKOFF_MAX_S, backoff_s * 2)
                if self._report_errors in (1, 10) or self._report_errors % 100 == 0:
                    log.warning("shard %s cannot reach the coordinator: %s", self._shard_id, self._last_error)
