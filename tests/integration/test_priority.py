"""Shard and coordinator actors run every thread at normal priority (issue 18, item 11). Ray starts its worker
processes at nice 15; a shard as started served 64 KiB puts ~10x slower on two busy cores than at nice 0, and
``renice -p PID`` moves only the main thread. A shard's process also starts with one malloc arena (kvd's own
setting comes after Ray's threads made theirs: BENCHMARKS.md, "Soak"). A real local Ray, a real deployment, /proc
of the actors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from kvd.client import Client
from kvd.cluster.deploy import Deployment, deploy, teardown
from kvd.config import load_config
from kvd.wire.server import BULK_NICE, BULK_THREAD_NAME

# The control plane under Ray is what runs here (tests/unit/test_suite_marks.py, DRIVERS_ONLY): the second pass
# leaves it out.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray"), pytest.mark.backend_independent]



@pytest.fixture(scope="module")
def deployed() -> Iterator[Deployment]:
    config = load_config(env={}, overrides={
        "cluster.namespace": f"kvd-nice-{os.getpid()}", "cluster.port": 0, "cluster.shards": 1,
        "cluster.memory_bytes": "4MiB", "cluster.shard_cpus": 0, "cluster.report_interval_s": 0.1,
        "cluster.ray_timeout_s": 10.0,
    })
    deployment = deploy(config, ready_timeout_s=60)
    yield deployment
    teardown(config.cluster.namespace, timeout_s=10)


def thread_nices(pid: int) -> dict[str, int]:
    """``{"tid name": nice}`` of every thread of ``pid`` (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (task / "stat").read_bytes()
        except OSError:
            continue
        name = raw[raw.index(b"(") + 1: raw.rindex(b")")].decode(errors="replace")
        out[f"{task.name} {name}"] = int(raw.rsplit(b")", 1)[1].split()[16])
    return out


@ray.remote(num_cpus=0)
class Plain:
    def pid(self) -> int:
        return os.getpid()


def test_ray_itself_starts_workers_at_a_low_priority() -> None:
    """The premise: without kvd's help an actor's main thread, and every thread it starts, runs at Ray's worker
    niceness (15 by default; a few threads Ray starts before it renices stay at 0)."""
    plain = Plain.remote()
    try:
        nices = thread_nices(ray.get(plain.pid.remote(), timeout=60))
    finally:
        ray.kill(plain)
    own = os.getpriority(os.PRIO_PROCESS, 0)  # Ray adds its 15 to the nice value it started with
    assert nices[min(nices, key=lambda k: int(k.split()[0]))] == min(own + 15, 19), nices  # the main thread


def test_every_thread_of_a_shard_and_the_coordinator_runs_at_nice_0(deployed: Deployment) -> None:
    """Every thread at nice 0 but a shard's bulk lane (and the codec thread it starts), which yields to the
    threads serving small requests by BULK_NICE (kvd.wire.server, "Two lanes")."""
    (shard,) = deployed.shards.values()
    shard_pid = ray.get(shard.info.remote(), timeout=30)["pid"]
    coordinator_pid = ray.get(deployed.coordinator.pid.remote(), timeout=30)
    with Client(deployed.endpoint, timeout_s=10) as client:  # the serving threads have done their work
        client.register("nice", num_layers=1, num_kv_heads=1, head_dim=16)  # (register runs on the bulk lane)
    for who, pid in (("shard", shard_pid), ("coordinator", coordinator_pid)):
        nices = thread_nices(pid)
        assert len(nices) >= 4, nices  # main, Ray's threads, the server, ZeroMQ's I/O thread at least
        assert any("ZMQbg" in name for name in nices), nices  # ZeroMQ's I/O threads, created after __init__ began
        bulk = {name: nice for name, nice in nices.items() if name.endswith(f" {BULK_THREAD_NAME}")}
        not_normal = {name: nice for name, nice in nices.items() if nice != 0 and name not in bulk}
        assert not not_normal, f"{who} threads not at nice 0: {not_normal}"
        if who == "shard":
            assert bulk and set(bulk.values()) == {BULK_NICE}, nices
        else:
            assert not bulk, nices


def test_a_shards_process_starts_with_one_malloc_arena(deployed: Deployment) -> None:
    (shard,) = deployed.shards.values()
    pid = ray.get(shard.info.remote(), timeout=30)["pid"]
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"MALLOC_ARENA_MAX=1" in env
