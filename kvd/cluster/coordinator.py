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

Restart: Ray restarts the actor (``max_restarts=-1``); the new process reads the persisted level, epoch,
topology epoch and endpoint, rebinds the endpoint, and rebuilds membership as shards, whose reports are
refused as unknown, register again. It never issues an epoch at or below one already persisted or reported.

The plain class :class:`Coordinator` is wrapped with ``ray.remote`` in one place
(:func:`kvd.cluster.deploy.actor_class`); :mod:`kvd.cluster.deploy` starts, locates and stops a whole kvd on a
connected Ray. Every Ray call here has a timeout.
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
from kvd.errors import ConfigError
from kvd.policy import Policy

__all__ = ["Coordinator", "RayKV"]

log = logging.getLogger("kvd.cluster.coordinator")

_KV_NAMESPACE = "kvd"
_HOUSEKEEPING_S = 0.5
_REBIND_S = 2.0
_REBIND_PAUSE_S = 0.1


class RayKV:
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
        return {"known": True, "level": outcome.level.tag, "epoch": outcome.epoch, "reason": outcome.reason}

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
        while not self._stopped.wait(_HOUSEKEEPING_S):
            try:
                for shard_id in self._membership.expire(self._clock()):
                    log.warning("shard %s stopped reporting; marked down", shard_id)
                self._persist()
            except Exception:  # noqa: BLE001 - keep the loop alive whatever happens
                log.exception("coordinator housekeeping failed")
