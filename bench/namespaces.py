"""What a namespace registration costs as namespaces accumulate (``python bench/cluster.py --namespaces N``; issue
32, section 5).

A kvd of ``--shards`` Ray shards (1 MiB each, ``cluster.max_namespaces`` = N + 16) in an embedded Ray. One client
registers N namespaces, one at a time, through the shards (each ``register`` goes through the coordinator, which
persists the namespace and pushes it to every shard before the reply). Reported: the median and p90 latency of
``register`` over the registrations at ``WINDOW`` points (the 10th to 59th, and the last 50 before each further
point), the coordinator's and each shard's RSS growth per namespace, and the ratio of the last window's median
to the first's: the goal is a ratio near 1 (a registration's cost independent of how many exist).
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


def namespaces_only(total: int, shards: int) -> None:
    ns = "bench-namespaces"
    config = load_config(env={}, overrides={
        "cluster.namespace": ns, "cluster.port": 0, "cluster.shards": shards,
        "cluster.memory_bytes": f"{shards}MiB", "cluster.shard_cpus": 0, "cluster.max_namespaces": total + 16})
    deployment = deploy(config, ready_timeout_s=120)
    points = [p for p in (60, 500, 1000, 2000, 4000, 8000) if p <= total] or [total]
    rows: list[tuple[int, float, float]] = []
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
                    rows.append((i + 1, statistics.median(window) * 1e3, float(np.quantile(window, 0.9)) * 1e3))
            grown = {k: (_rss(v) - rss0[k]) / total for k, v in pids.items()}
    finally:
        teardown(ns, timeout_s=30)
    print(f"\n## Namespace registration ({shards} shards; median / p90 of {WINDOW} registrations up to each "
          "count)\n")
    print(f"{'namespaces':>11}{'median ms':>11}{'p90 ms':>9}")
    for count, median, p90 in rows:
        print(f"{count:>11}{median:>11.1f}{p90:>9.1f}")
    print(f"\nlast / first median: {rows[-1][1] / rows[0][1]:.2f}")
    print("RSS growth per namespace: " + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in grown.items()))
