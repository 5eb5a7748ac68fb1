"""Starting, finding and stopping a whole kvd on a connected Ray: the one place the plain actor classes meet
``ray.remote`` (:func:`actor_class`), :func:`deploy`, :func:`find`, :func:`teardown`, and :func:`wait_until`;
:func:`deploy_metrics` serves the Prometheus metrics of a kvd from the cluster itself (a detached `kvd up` has no
process left to serve them). Every wait for an actor (``ray.get``, ``ray.wait``) is bounded by a timeout;
``ray.get_actor``, ``ray.kill`` and the state deletion (Ray's internal KV) take none, as Ray offers none: they
return as soon as the GCS answers, and would wait as long as a GCS that does not."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd.cluster.coordinator import Coordinator, RayKV
from kvd.cluster.naming import coordinator_name, metrics_name, shard_ids, shard_name, state_key
from kvd.config.settings import Config
from kvd.errors import ConfigError, Timeout

__all__ = ["Deployment", "MetricsExporter", "actor_class", "deploy", "deploy_metrics", "find",
           "shard_memory_request", "teardown", "wait_until"]

log = logging.getLogger("kvd.deploy")

# A shard process holds its store (capacity, exact), the warm buffers of large gets (store.warm_cache_bytes,
# outside the capacity) and Python, the Ray worker and numpy: reserve all of it.
_SHARD_MEMORY_OVERHEAD = 1.05
_SHARD_PROCESS_BYTES = 256 << 20
_METRICS_PERIOD_S = 1.0


def shard_memory_request(config: Config) -> int:
    """Bytes of Ray's ``memory`` resource each shard asks for: its store + 5%, its warm cache and 256 MiB for the
    process around them. A node must offer Ray this much per shard it is to hold (cluster/README.md)."""
    return (int(config.shard_capacity_bytes * _SHARD_MEMORY_OVERHEAD) + config.store.warm_cache_bytes
            + _SHARD_PROCESS_BYTES)


def actor_class(kind: str) -> Any:
    """The Ray actor class for ``"coordinator"`` or ``"shard"``: the one place plain classes meet ray.remote."""
    import ray

    options: dict[str, Any]
    if kind == "coordinator":
        # Threaded: reports and status calls run while the broadcaster waits on shards.
        options = {"num_cpus": 0, "max_restarts": -1, "max_concurrency": 32}
        return ray.remote(**options)(Coordinator)
    if kind == "shard":
        from kvd.cluster.shard import Shard

        options = {"max_restarts": -1, "max_concurrency": 8}
        return ray.remote(**options)(Shard)
    if kind == "metrics":
        options = {"num_cpus": 0, "max_restarts": -1, "max_concurrency": 4}
        return ray.remote(**options)(MetricsExporter)
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


def deploy(config: Config, *, host: str = "127.0.0.1", ready_timeout_s: float = 120.0,
           fresh: bool = False) -> Deployment:
    """Start a coordinator and ``config.cluster.shards`` shards (SPREAD over the nodes) on the connected Ray.

    ``host``: bind address of every actor, or ``"node"`` for each node's IP. With a disk tier
    (``cluster.disk_bytes``) each shard is pinned to one node instead (:func:`_disk_placement`): its files are
    on that node's disk, so a restart must come back there. ``fresh``: the shards' disk tiers start empty (once:
    a shard Ray restarts later keeps what its disk holds). Returns once every shard has registered. Raises
    ConfigError if a kvd already runs in the namespace, Timeout if it does not come up.
    """
    import ray

    cluster = config.cluster
    ns = cluster.namespace
    timeout_s = cluster.ray_timeout_s
    if _get_actor(coordinator_name(), ns) is not None:
        raise ConfigError(
            f"a kvd is already running in Ray namespace {ns!r}: `kvd down` it or pick another namespace"
        )
    RayKV(state_key(ns)).delete()  # a new cluster starts a new epoch history
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
    endpoint: str = _started(coordinator, coordinator.endpoint.remote(), ready_timeout_s, "the coordinator")
    deployment = Deployment(namespace=ns, endpoint=endpoint, coordinator=coordinator, timeout_s=timeout_s)
    shard_cls = actor_class("shard")
    placement = _disk_placement(shard_ids(cluster.shards)) if config.shard_disk_bytes else {}
    fresh_token = uuid.uuid4().hex if fresh else None
    for sid in shard_ids(cluster.shards):
        deployment.shards[sid] = shard_cls.options(
            name=shard_name(sid),
            namespace=ns,
            lifetime="detached",
            num_cpus=cluster.shard_cpus,
            # Ray's memory resource keeps the scheduler from packing more shards on a node than fit.
            memory=shard_memory_request(config),
            scheduling_strategy=placement.get(sid, "SPREAD"),
            # One malloc arena from the process's start (or the deploying process's MALLOC_ARENA_MAX; 0 is
            # glibc's default): Ray's own threads create theirs before the shard's mallopt runs (kvd.wire.sockets),
            # and the store's records then fragment in those arenas; a kvd up shard's RSS crept +2.5% over a
            # 10-minute soak with them, +0.2% with one (BENCHMARKS.md, "Soak").
            runtime_env={"env_vars": {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "1")}},
        ).remote(sid, config, host=host, fresh_token=fresh_token)
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
                    f"{shard_memory_request(config) / 2**30:.2f} "
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


def _disk_placement(sids: list[str]) -> dict[str, Any]:
    """Shards with a disk tier: shard i on the i-th alive node (round robin, nodes in the order of their
    address), never moved (a hard node affinity). The same nodes give the same placement at every `kvd up`, so
    each shard finds its files again; a shard whose node is gone is not started elsewhere (its files are not
    there): docs/design.md, "The disk tier"."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    nodes = sorted(alive, key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    return {sid: NodeAffinitySchedulingStrategy(nodes[i % len(nodes)]["NodeID"], soft=False)
            for i, sid in enumerate(sids)}


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


def teardown(namespace: str = "kvd", *, timeout_s: float = 10.0, stop_timeout_s: float = 300.0) -> int:
    """Stop the kvd in ``namespace``: shards first (stop serving, write what they hold in memory to their disk
    tier if they have one, then kill), then the coordinator; forget the persisted state. ``stop_timeout_s``: how
    long the shards get to stop (a shard writing out its memory takes about memory / disk bandwidth). Returns
    the number of actors stopped (0 if nothing ran)."""
    import ray

    deployment = find(namespace, timeout_s=timeout_s) if _get_actor(coordinator_name(), namespace) else None
    handles: list[Any] = []
    if (exporter := _get_actor(metrics_name(), namespace)) is not None:
        handles.append(exporter)  # first: it polls the others
    if deployment is not None:
        handles += [*deployment.shards.values(), deployment.coordinator]
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
        ray.wait(stops, num_returns=len(stops), timeout=max(timeout_s, stop_timeout_s))
    for h in handles:
        _kill(h)
    RayKV(state_key(namespace)).delete()
    return len(handles)


# ------------------------------------------------------------------------------------------------ metrics


class MetricsExporter:
    """Serves the Prometheus metrics of the kvd in ``namespace`` (those of `kvd up --metrics-port`) from a
    detached actor pinned to the Ray head, so they outlive a `kvd up --detach` and stay at ``<head>:port``.
    A thread polls the coordinator and the shards through Ray every second, as the foreground `kvd up` does.
    ``host``: the bind address of the kvd's actors (``"node"`` = the node IP); the exporter binds 127.0.0.1
    for a loopback kvd and all interfaces otherwise (as `kvd up` does), and reports the URL to scrape."""

    def __init__(self, namespace: str, port: int, host: str, timeout_s: float = 10.0) -> None:
        import threading

        from kvd.cluster.metrics import StatusMetrics
        from kvd.cluster.naming import metrics_bind_host, resolve_host

        self._namespace = namespace
        self._timeout_s = timeout_s
        advertised = resolve_host(host)
        self._metrics = StatusMetrics(port, metrics_bind_host(advertised))
        self._url = f"http://{advertised}:{port}/metrics"
        self._stopped = threading.Event()
        self._polls = 0
        self._last_error = ""
        self._thread = threading.Thread(target=self._poll_loop, name="kvd-metrics", daemon=True)
        self._thread.start()

    def url(self) -> str:
        return self._url

    def info(self) -> dict[str, Any]:
        return {"url": self._url, "polls": self._polls, "last_error": self._last_error}

    def stop(self) -> None:
        self._stopped.set()
        self._metrics.close()

    def _poll_loop(self) -> None:
        deployment: Deployment | None = None
        while not self._stopped.is_set():
            try:
                if deployment is None:
                    deployment = find(self._namespace, timeout_s=self._timeout_s)
                if deployment is not None:
                    cluster = deployment.status()
                    if len(deployment.shards) < len(cluster.get("shards") or ()):
                        deployment = find(self._namespace, timeout_s=self._timeout_s)  # shards joined since
                    if deployment is not None:
                        self._metrics.update(cluster, deployment.shard_stats())
                        self._polls += 1
            except Exception as exc:  # noqa: BLE001 - a restarting coordinator: keep serving the last figures
                self._last_error = f"{type(exc).__name__}: {exc}"
                deployment = None
            self._stopped.wait(_METRICS_PERIOD_S)  # the scrape data's refresh period, not a wait for a condition


def deploy_metrics(namespace: str, port: int, *, host: str, timeout_s: float = 30.0) -> str:
    """Start the :class:`MetricsExporter` of the kvd in ``namespace`` on the Ray head (detached, restarted by Ray
    if it dies); returns the URL to scrape. Raises ConfigError if it cannot serve (port taken)."""

    stale = _get_actor(metrics_name(), namespace)
    if stale is not None:
        _kill(stale)
    exporter = (
        actor_class("metrics")
        .options(name=metrics_name(), namespace=namespace, lifetime="detached",
                 resources={"node:__internal_head__": 0.001})
        .remote(namespace, port, host)
    )
    url: str = _started(exporter, exporter.url.remote(), timeout_s, "the metrics exporter", " on the Ray head")
    return url


def _started(actor: Any, ready: Any, timeout_s: float, what: str, where: str = "") -> Any:
    """The value of ``ready`` (an actor's first call), once the actor serves; the actor is killed on any
    failure, and one that died starting is a ConfigError naming its cause."""
    import ray

    try:
        return ray.get(ready, timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:
        _kill(actor)
        raise ConfigError(f"{what} did not start{where}: {_root_cause(exc)}") from None
    except Exception:
        _kill(actor)
        raise


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

