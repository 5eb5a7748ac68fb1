"""The coordinator: a named, detached Ray actor around :class:`kvd.membership.Membership`.

Theory of operation
-------------------
One coordinator per kvd (per Ray namespace). Shards find it by name, register, and report ``used`` /
``capacity`` every report interval (kvd.shard). Each report goes into the pure :class:`Membership`, which
decides levels; a level change is first persisted (Ray's internal key-value store, key
``kvd/<namespace>/coordinator``) and then broadcast: ``set_level(level, epoch)`` on every shard actor, sent by a
broadcaster thread so a slow shard never blocks reports. Report replies carry the current level and epoch too,
so a shard that missed a broadcast (or restarted) converges within one report interval.

Clients never talk to the coordinator through Ray: it serves the topology (shard ids and endpoints, topology
epoch, level, level epoch) on its own ZeroMQ endpoint (:class:`kvd.server.TopologyServer`), the only address a
client is given. The coordinator is pinned to the Ray head node and rebinds the same port after a restart.

Restart: Ray restarts the actor (``max_restarts=-1``); the new process reads the persisted level, epoch,
topology epoch and endpoint, rebinds the endpoint, and rebuilds membership as shards, whose reports are
refused as unknown, register again. It never issues an epoch at or below one already persisted or reported.

The plain class :class:`Coordinator` is wrapped with ``ray.remote`` in one place (:func:`actor_class`);
:func:`deploy`, :func:`find` and :func:`teardown` start, locate and stop a whole kvd on a connected Ray.
Every Ray call here has a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd.config import Config
from kvd.errors import ConfigError, Timeout
from kvd.membership import LevelOrder, Membership, ShardReport
from kvd.policy import Policy

__all__ = [
    "Coordinator",
    "Deployment",
    "actor_class",
    "coordinator_name",
    "shard_name",
    "shard_ids",
    "deploy",
    "find",
    "teardown",
    "resolve_host",
    "wait_until",
    "state_key",
    "curve_server_config",
]

log = logging.getLogger("kvd.coordinator")

_KV_NAMESPACE = "kvd"
_HOUSEKEEPING_S = 0.5
_REBIND_S = 2.0
_REBIND_PAUSE_S = 0.1
# A shard process holds its store (capacity, exact) plus Python, Ray worker and numpy: reserve both.
_SHARD_MEMORY_OVERHEAD = 1.05
_SHARD_PROCESS_BYTES = 256 << 20


def coordinator_name() -> str:
    return "kvd-coordinator"


def shard_name(shard_id: str) -> str:
    return f"kvd-{shard_id}"


def shard_ids(n: int) -> list[str]:
    """The stable ids of a cluster of ``n`` shards: ``shard-0`` ... (routing hashes over these ids)."""
    return [f"shard-{i}" for i in range(n)]


def state_key(namespace: str) -> str:
    return f"kvd/{namespace}/coordinator"


def resolve_host(host: str) -> str:
    """The address to bind: ``"node"`` means this Ray node's IP (for actors on a real cluster)."""
    if host == "node":
        import ray

        return str(ray.util.get_node_ip_address())
    return host


class _RayKV:
    """Persisted coordinator state in Ray's internal KV (GCS). Failures are logged, never fatal."""

    def __init__(self, key: str) -> None:
        self._key = key

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
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot delete coordinator state %s: %s", self._key, exc)


def curve_server_config(config: Config) -> Any:
    """The server-side CurveConfig of kvd.server for ``config.curve``, or None when CURVE is off."""
    if config.curve.server_secret_key is None:
        return None
    from kvd.server import CurveConfig

    return CurveConfig.for_server(
        secret_key_file=config.curve.server_secret_key, authorized_keys_dir=config.curve.authorized_keys
    )


class Coordinator:
    """Membership, the level controller and the topology endpoint. Wrapped as a Ray actor by :func:`actor_class`.

    ``host``: the address to bind the topology endpoint (``"node"`` = this node's IP). Methods called by shards:
    :meth:`register`, :meth:`report`; by tools: :meth:`endpoint`, :meth:`topology`, :meth:`status`,
    :meth:`stop`.
    """

    def __init__(self, config: Config, *, host: str, kv: Any = None, clock: Callable[[], float] = time.monotonic):
        self._config = config
        self._cluster = config.cluster
        self._clock = clock
        self._kv = kv if kv is not None else _RayKV(state_key(config.cluster.namespace))
        state = self._kv.load()
        recovered_epoch = int(state.get("epoch", 0) or 0)
        recovered_level = state.get("level")
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
        )
        self._handles: dict[str, Any] = {}
        self._handles_lock = threading.Lock()
        self._persist_lock = threading.Lock()
        self._orders: queue.Queue[LevelOrder | None] = queue.Queue()
        self._stopped = threading.Event()
        self._bind_host = resolve_host(host)
        self._server = self._start_topology_server(state.get("endpoint"))
        self._persist(force=True)
        self._threads = [
            threading.Thread(target=self._broadcast_loop, name="kvd-broadcast", daemon=True),
            threading.Thread(target=self._housekeeping_loop, name="kvd-housekeeping", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        log.info("coordinator serving topology on %s (restarted=%s)", self._server.endpoint, self._restarted)

    # ------------------------------------------------------------------------------------------ startup

    def _start_topology_server(self, previous: str | None) -> Any:
        from kvd.server import TopologyServer

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
                server = TopologyServer(self._membership.topology, host=self._bind_host, port=port, curve=curve)
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

    def register(self, shard_id: str, endpoint: str, incarnation: str, node: str = "") -> dict[str, Any]:
        """A shard (re)started: returns ``{"level": tag, "epoch": int, "topology_epoch": int}`` to apply."""
        reg = self._membership.register(shard_id, endpoint, incarnation=incarnation, node=node, now=self._clock())
        self._persist()
        log.info("shard %s registered at %s (incarnation %s)", shard_id, endpoint, incarnation)
        return {"level": reg.level.tag, "epoch": reg.epoch, "topology_epoch": reg.topology_epoch}

    def report(self, report: dict[str, Any]) -> dict[str, Any]:
        """One shard report (the fields of :class:`ShardReport`). Returns ``{"known": bool, "level", "epoch"}``;
        ``known`` False asks the shard to register again (this coordinator does not know that process)."""
        outcome = self._membership.report(ShardReport(**report), now=self._clock())
        if outcome.order is not None:
            self._persist()  # before the broadcast: an epoch is durable before any shard applies it
            self._orders.put(outcome.order)
        if not outcome.known:
            return {"known": False}
        assert outcome.level is not None
        return {"known": True, "level": outcome.level.tag, "epoch": outcome.epoch}

    # ------------------------------------------------------------------------------------ tool-facing

    def endpoint(self) -> str:
        """The client endpoint: ``tcp://host:port``."""
        return str(self._server.endpoint)

    def topology(self) -> dict[str, Any]:
        return self._membership.topology()

    def status(self) -> dict[str, Any]:
        """Control-plane figures: level, epochs, cluster pressure, per-shard view, level-change history."""
        snap = self._membership.snapshot(self._clock())
        snap["endpoint"] = self.endpoint()
        snap["namespace"] = self._cluster.namespace
        snap["pid"] = os.getpid()
        snap["restarted"] = self._restarted
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

    def _persist(self, *, force: bool = False) -> None:
        # One writer at a time, so a slower save of an older state never lands after a newer one.
        with self._persist_lock:
            dirty = self._membership.take_dirty()
            if dirty is None and not force:
                return
            level, epoch, topology_epoch = dirty or (
                self._membership.level,
                self._membership.epoch,
                self._membership.topology_epoch,
            )
            self._kv.save(
                {
                    "level": level.tag,
                    "epoch": epoch,
                    "topology_epoch": topology_epoch,
                    "endpoint": self._server.endpoint,
                }
            )

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
                    ref = self._handle(shard_id).set_level.remote(order.level.tag, order.epoch)
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
        while not self._stopped.wait(_HOUSEKEEPING_S):
            try:
                for shard_id in self._membership.expire(self._clock()):
                    log.warning("shard %s stopped reporting; marked down", shard_id)
                self._persist()
            except Exception:  # noqa: BLE001 - keep the loop alive whatever happens
                log.exception("coordinator housekeeping failed")


def actor_class(kind: str) -> Any:
    """The Ray actor class for ``"coordinator"`` or ``"shard"``: the one place plain classes meet ray.remote."""
    import ray

    options: dict[str, Any]
    if kind == "coordinator":
        # Threaded: reports and status calls run while the broadcaster waits on shards.
        options = {"num_cpus": 0, "max_restarts": -1, "max_concurrency": 32}
        return ray.remote(**options)(Coordinator)
    if kind == "shard":
        from kvd.shard import Shard

        options = {"max_restarts": -1, "max_concurrency": 8}
        return ray.remote(**options)(Shard)
    raise ValueError(f"unknown actor kind {kind!r}")


# ------------------------------------------------------------------------------------------- deployment


@dataclass
class Deployment:
    """A running kvd: actor handles, the client endpoint, the Ray namespace."""

    namespace: str
    endpoint: str
    coordinator: Any
    shards: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0

    def status(self) -> dict[str, Any]:
        import ray

        status: dict[str, Any] = ray.get(self.coordinator.status.remote(), timeout=self.timeout_s)
        return status

    def shard_stats(self) -> dict[str, dict[str, Any] | Exception]:
        """``{shard_id: stats dict}`` through Ray (an exception in place of a shard that did not answer)."""
        import ray

        refs = {sid: h.stats.remote() for sid, h in self.shards.items()}
        out: dict[str, dict[str, Any] | Exception] = {}
        for sid, ref in refs.items():
            try:
                out[sid] = ray.get(ref, timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001
                out[sid] = exc
        return out


def _get_actor(name: str, namespace: str) -> Any | None:
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def deploy(config: Config, *, host: str = "127.0.0.1", ready_timeout_s: float = 120.0) -> Deployment:
    """Start a coordinator and ``config.cluster.shards`` shards (SPREAD over the nodes) on the connected Ray.

    ``host``: bind address of every actor, or ``"node"`` for each node's IP. Returns once every shard has
    registered. Raises ConfigError if a kvd already runs in the namespace, Timeout if it does not come up.
    """
    import ray

    cluster = config.cluster
    ns = cluster.namespace
    timeout_s = cluster.ray_timeout_s
    if _get_actor(coordinator_name(), ns) is not None:
        raise ConfigError(
            f"a kvd is already running in Ray namespace {ns!r}: `kvd down` it or pick another namespace"
        )
    _RayKV(state_key(ns)).delete()  # a new cluster starts a new epoch history
    coordinator = (
        actor_class("coordinator")
        .options(
            name=coordinator_name(),
            namespace=ns,
            lifetime="detached",
            # Pinned to the head: a restarted coordinator comes back at the same address.
            resources={"node:__internal_head__": 0.001},
        )
        .remote(config, host=host)
    )
    try:
        endpoint = ray.get(coordinator.endpoint.remote(), timeout=ready_timeout_s)
    except ray.exceptions.RayActorError as exc:
        _kill(coordinator)
        raise ConfigError(f"the coordinator did not start: {_root_cause(exc)}") from None
    except Exception:
        _kill(coordinator)
        raise
    deployment = Deployment(namespace=ns, endpoint=endpoint, coordinator=coordinator, timeout_s=timeout_s)
    shard_cls = actor_class("shard")
    for sid in shard_ids(cluster.shards):
        deployment.shards[sid] = shard_cls.options(
            name=shard_name(sid),
            namespace=ns,
            lifetime="detached",
            num_cpus=cluster.shard_cpus,
            # Ray's memory resource keeps the scheduler from packing more shards on a node than fit.
            memory=int(config.shard_capacity_bytes * _SHARD_MEMORY_OVERHEAD) + _SHARD_PROCESS_BYTES,
            scheduling_strategy="SPREAD",
        ).remote(sid, config, host=host)
    try:
        # Constructors first: a shard that cannot start (bad settings, no free port) fails here at once.
        for sid, handle in deployment.shards.items():
            try:
                ray.get(handle.endpoint.remote(), timeout=ready_timeout_s)
            except ray.exceptions.RayActorError as exc:
                raise ConfigError(f"shard {sid} did not start: {_root_cause(exc)}") from None
            except ray.exceptions.GetTimeoutError:
                raise Timeout(
                    f"shard {sid} did not start within {ready_timeout_s:.0f} s: not enough CPU or memory "
                    f"resources in the Ray cluster? (each shard asks for {cluster.shard_cpus} CPU and "
                    f"{(config.shard_capacity_bytes * _SHARD_MEMORY_OVERHEAD + _SHARD_PROCESS_BYTES) / 2**30:.2f} "
                    "GiB of Ray memory)"
                ) from None
        wait_until(
            lambda: _all_registered(deployment, cluster.shards),
            timeout_s=ready_timeout_s,
            what=f"{cluster.shards} shards to register",
        )
    except BaseException:
        teardown(ns, timeout_s=timeout_s)
        raise
    return deployment


def _root_cause(exc: BaseException) -> str:
    """The last ``SomeError: message`` line of a Ray actor error (the exception raised in the actor)."""
    lines = [line.strip() for line in str(exc).splitlines() if "Error: " in line or "Exception: " in line]
    return lines[-1] if lines else str(exc).splitlines()[0]


def _all_registered(deployment: Deployment, n: int) -> bool:
    import ray

    topology = ray.get(deployment.coordinator.topology.remote(), timeout=deployment.timeout_s)
    return len(topology["shards"]) >= n


def find(namespace: str = "kvd", *, timeout_s: float = 10.0) -> Deployment | None:
    """The kvd running in ``namespace`` on the connected Ray, or None."""
    import ray

    coordinator = _get_actor(coordinator_name(), namespace)
    if coordinator is None:
        return None
    endpoint = ray.get(coordinator.endpoint.remote(), timeout=timeout_s)
    topology = ray.get(coordinator.topology.remote(), timeout=timeout_s)
    deployment = Deployment(namespace=namespace, endpoint=endpoint, coordinator=coordinator, timeout_s=timeout_s)
    names = {s["id"] for s in topology["shards"]}
    i = 0
    while True:  # shards that never registered are found by name too
        sid = f"shard-{i}"
        handle = _get_actor(shard_name(sid), namespace)
        if handle is None and sid not in names:
            break
        if handle is not None:
            deployment.shards[sid] = handle
        i += 1
    return deployment


def _kill(handle: Any) -> None:
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # noqa: BLE001
        log.warning("ray.kill failed: %s", exc)


def teardown(namespace: str = "kvd", *, timeout_s: float = 10.0) -> int:
    """Stop the kvd in ``namespace``: shards first (stop serving, then kill), then the coordinator; forget the
    persisted state. Returns the number of actors stopped (0 if nothing ran)."""
    import ray

    deployment = find(namespace, timeout_s=timeout_s) if _get_actor(coordinator_name(), namespace) else None
    handles: list[Any] = []
    if deployment is not None:
        handles = [*deployment.shards.values(), deployment.coordinator]
    else:
        i = 0
        while (h := _get_actor(shard_name(f"shard-{i}"), namespace)) is not None:
            handles.append(h)
            i += 1
    stops = []
    for h in handles:
        try:
            stops.append(h.stop.remote())
        except Exception:  # noqa: BLE001
            pass
    if stops:
        ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
    for h in handles:
        _kill(h)
    _RayKV(state_key(namespace)).delete()
    return len(handles)


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Poll ``predicate`` until it is true; raise :class:`~kvd.errors.Timeout` naming ``what`` after
    ``timeout_s``. Exceptions from the predicate count as "not yet" (the last one is chained)."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        try:
            if predicate():
                return
        except Exception as exc:  # noqa: BLE001 - kvd, socket or Ray errors while an actor starts
            last = exc
        if time.monotonic() >= deadline:
            raise Timeout(f"timed out after {timeout_s:.1f} s waiting for {what}") from last
        time.sleep(poll_s)

