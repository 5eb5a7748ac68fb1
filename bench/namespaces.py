"""What a namespace registration costs as namespaces accumulate (``python bench/cluster.py --namespaces N``; issue
32, section 5).

A kvd of ``--shards`` Ray shards (1 MiB each, ``cluster.max_namespaces`` = N + 16) in an embedded Ray. One client
registers N namespaces, one at a time, through the shards (each ``register`` goes through the coordinator, which
persists the namespace and pushes it to every shard before the reply). Reported: the median and p90 latency of
``register`` over the registrations at ``WINDOW`` points (the 10th to 59th, and the last 50 before each further
point), the coordinator's and each shard's RSS growth per namespace, and the ratio of the last window's median
to the first's: the goal is a ratio near 1 (a registration's cost independent of how many exist).

The baseline of the same run, at each point: what a registration's parts cost when they do no kvd work, median
of ``WINDOW`` each: a ``ping`` through a shard (the client's round trip over ZeroMQ), a Ray call of the
coordinator that does nothing (a registration makes three Ray calls: the shard's to the coordinator, the
coordinator's pushes to the shards), and a put into Ray's internal KV store of a full namespaces part's size
(a registration saves one).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from kvd.client import Client
from kvd.cluster.deploy import deploy, teardown
from kvd.config import load_config

WINDOW = 50


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _pids(deployment: Any) -> dict[str, int]:
    import ray

    pids = {"coordinator": int(ray.get(deployment.coordinator.pid.remote(), timeout=30))}
    for sid, handle in deployment.shards.items():
        pids[sid] = int(ray.get(handle.info.remote(), timeout=30)["pid"])
    return pids


def _baseline(client: Client, deployment: Any, ns: str) -> tuple[float, float, float]:
    """Medians (ms) of ``WINDOW`` pings through a shard, Ray calls of the coordinator that do nothing, and puts
    of 8 KiB (about a full namespaces part) into Ray's internal KV store beside the coordinator's (removed
    after)."""
    import ray
    from ray.experimental import internal_kv

    from kvd.cluster.coordinator import _KV_NAMESPACE

    def median_ms(call: Any) -> float:
        lat = []
        for _ in range(WINDOW):
            t0 = time.perf_counter()
            call()
            lat.append(time.perf_counter() - t0)
        return statistics.median(lat) * 1e3

    payload, key, coordinator = "x" * (8 << 10), f"{ns}/bench-baseline", deployment.coordinator
    try:
        return (median_ms(client.ping), median_ms(lambda: ray.get(coordinator.ping.remote(), timeout=30)),
                median_ms(lambda: internal_kv._internal_kv_put(key, payload, overwrite=True,
                                                               namespace=_KV_NAMESPACE)))
    finally:
        internal_kv._internal_kv_del(key, namespace=_KV_NAMESPACE)


def namespaces_only(total: int, shards: int) -> None:
    ns = "bench-namespaces"
    config = load_config(env={}, overrides={
        "cluster.namespace": ns, "cluster.port": 0, "cluster.shards": shards,
        "cluster.memory_bytes": f"{shards}MiB", "cluster.shard_cpus": 0, "cluster.max_namespaces": total + 16})
    deployment = deploy(config, ready_timeout_s=120)
    points = [p for p in (60, 500, 1000, 2000, 4000, 8000) if p <= total] or [total]
    rows: list[tuple[int, float, float, tuple[float, float, float]]] = []
    try:
        pids = _pids(deployment)
        with Client(deployment.endpoint, timeout_s=60) as client:
            rss0 = {k: _rss(v) for k, v in pids.items()}
            lat: list[float] = []
            for i in range(total):
                t0 = time.perf_counter()
                client.register(f"ns-{i}", num_layers=2, num_kv_heads=2, head_dim=64)
                lat.append(time.perf_counter() - t0)
                if i + 1 in points:
                    window = lat[max(9, i + 1 - WINDOW):i + 1]
                    rows.append((i + 1, statistics.median(window) * 1e3, float(np.quantile(window, 0.9)) * 1e3,
                                 _baseline(client, deployment, ns)))
            grown = {k: (_rss(v) - rss0[k]) / total for k, v in pids.items()}
    finally:
        teardown(ns, timeout_s=30)
    print(f"\n## Namespace registration ({shards} shards; median / p90 of {WINDOW} registrations up to each "
          "count)\n")
    print(f"{'namespaces':>11}{'median ms':>11}{'p90 ms':>9}{'ping ms':>9}{'ray call ms':>13}{'kv put ms':>11}")
    for count, median, p90, (ping, call, put) in rows:
        print(f"{count:>11}{median:>11.1f}{p90:>9.1f}{ping:>9.2f}{call:>13.2f}{put:>11.2f}")
    first, last = rows[0], rows[-1]
    print(f"\nlast / first median: {last[1] / first[1]:.2f} (ping {last[3][0] / first[3][0]:.2f}, ray call "
          f"{last[3][1] / first[3][1]:.2f}, kv put {last[3][2] / first[3][2]:.2f})")
    print("RSS growth per namespace: " + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in grown.items()))
