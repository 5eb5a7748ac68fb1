"""A namespace's calibration in a cluster (issue 33): given once through the client, kept by the coordinator with
the namespace, handed to every shard (one that restarts too), kept across a coordinator restart; likewise a
namespace's own require_calibration (protocol 1.8), whose appends then say the namespace needs a calibration;
`kvd calibrate` and `kvd status` as a user runs them. Real processes: one local Ray (2 CPUs) per module, shards
and the coordinator killed with SIGKILL, the command line in subprocesses."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from kvd.calibration import calibrate, check_sample
from kvd.client import AsyncClient, Client
from kvd.cluster.coordinator import RayKV
from kvd.cluster.deploy import Deployment, deploy, teardown, wait_until
from kvd.cluster.naming import state_key
from kvd.errors import KvdWarning

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray"), pytest.mark.backend_independent]

LAYERS, HEADS, DIM, PAGE = 2, 2, 64, 16  # PAGE: the small clusters' page (conftest.PAGE)
NS = "model"
REPO = Path(__file__).resolve().parents[2]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("KVD_") or k in ("KVD_KERNELS",)},
       "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def sample_arrays(layers: int = LAYERS, heads: int = HEADS, tokens: int = 256, seed: int = 0) -> dict[str, Any]:
    """q/k/v per layer as an .npz holds them; keys with outlier channels on head 1, so q4 hurts there most."""
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"meta": np.array("synthetic-model, test")}
    for i in range(layers):
        k = rng.standard_normal((tokens, heads, DIM)).astype(np.float32)
        k[:, -1, :4] *= 12.0
        out[f"L{i}_q"] = rng.standard_normal((tokens, 2 * heads, DIM)).astype(np.float16)
        out[f"L{i}_k"] = k.astype(np.float16)
        out[f"L{i}_v"] = rng.standard_normal((tokens, heads, DIM)).astype(np.float16)
    return out


def a_calibration(layers: int = LAYERS) -> Any:
    arrays = sample_arrays(layers=layers)
    sample = check_sample([(arrays[f"L{i}_q"], arrays[f"L{i}_k"], arrays[f"L{i}_v"]) for i in range(layers)],
                          model="synthetic-model")
    return calibrate(sample, page_tokens=PAGE, sink_tokens=0)


@pytest.fixture
def make_cluster(small_config: Any) -> Iterator[Any]:
    started: list[str] = []

    def make(shards: int = 2, **extra: Any) -> Deployment:
        config = small_config("kvd-cal", shards, **extra)
        started.append(config.cluster.namespace)
        return deploy(config, ready_timeout_s=60)

    yield make
    for namespace in started:
        teardown(namespace, timeout_s=10)


def shard_state(cluster: Deployment, shard_id: str) -> tuple[str | None, int]:
    """The namespace's calibration state on a shard (through Ray) and the shard's pid."""
    stats = ray.get(cluster.shards[shard_id].stats.remote(), timeout=10)
    return (stats.get("calibration_states") or {}).get(NS), int(stats["pid"])


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def restart_shard(cluster: Deployment, shard_id: str, state: str = "active") -> None:
    """SIGKILL the shard's process; return once Ray restarted it (empty) and the namespace is in ``state`` there
    again (it got its calibration, or its own require_calibration, back)."""
    _, pid = shard_state(cluster, shard_id)
    kill(pid)
    wait_until(lambda: shard_state(cluster, shard_id)[1] != pid, timeout_s=60, what=f"{shard_id} restart")
    wait_until(lambda: shard_state(cluster, shard_id)[0] == state, timeout_s=30,
               what=f"the calibration state {state} on the restarted {shard_id}")


@pytest.mark.timeout(240)
def test_a_calibration_reaches_every_shard_a_restarted_one_and_survives_a_coordinator_restart(
    make_cluster: Any,
) -> None:
    cluster = make_cluster(2)
    cal = a_calibration()
    with Client(cluster.endpoint, timeout_s=10) as client:
        client.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        state = client.calibrate(NS, cal)
        assert state["state"] == "active" and state["digest"] == cal.digest
        for sid in cluster.shards:
            assert shard_state(cluster, sid)[0] == "active", sid
        assert ray.get(cluster.coordinator.calibrations.remote(), timeout=10)[NS]["digest"] == cal.digest

        # a shard killed for real comes back empty, and gets the calibration from the coordinator
        restart_shard(cluster, "shard-1")

        # the coordinator killed for real comes back with it (persisted), and hands it to a shard restarted later
        saved = RayKV(state_key(cluster.namespace)).calibrations()[NS]  # in Ray's internal KV
        assert saved == {"calibration": cal.to_dict(), "require": None}
        coordinator_pid = int(ray.get(cluster.coordinator.pid.remote(), timeout=10))
        kill(coordinator_pid)
        wait_until(lambda: int(ray.get(cluster.coordinator.pid.remote(), timeout=5)) != coordinator_pid,
                   timeout_s=60, what="coordinator restart")
        assert ray.get(cluster.coordinator.calibrations.remote(), timeout=10)[NS]["digest"] == cal.digest
        restart_shard(cluster, "shard-0")
        stats = ray.get(cluster.shards["shard-0"].stats.remote(), timeout=10)
        assert "8bit" in stats["calibration_budgets"][NS] and "q4" in stats["calibration_budgets"][NS]

        # a new calibration replaces it everywhere
        other = a_calibration(layers=LAYERS + 1)  # of another layout: quarantined, and reported as such
        assert client.calibrate(NS, other)["state"] == "quarantined"
        for sid in cluster.shards:
            wait_until(lambda sid=sid: shard_state(cluster, sid)[0] == "quarantined", timeout_s=10,
                       what=f"{sid} quarantined")


NEEDS = "needs calibration: pages compressed with the default protection"
_SEQS = itertools.count()


def appends_say(endpoint: str, namespace: str, count: int = 8) -> dict[str, str]:
    """A fresh client's ``notices`` after ``count`` appends of new sequences to ``namespace`` (spread over the
    shards by their ids); the client's warning is caught."""
    k = np.ones((LAYERS, 2 * PAGE, HEADS, DIM), np.float16)
    with Client(endpoint, timeout_s=10) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore", KvdWarning)
        for _ in range(count):
            seq = f"seq-{next(_SEQS)}"
            assert client.append(namespace, seq, k, k) == 2 * PAGE
            client.drop(namespace, seq)  # (the shards hold 1 MiB each)
        return dict(client.notices)


@pytest.mark.timeout(300)
def test_a_namespaces_own_require_calibration_reaches_every_shard_survives_restarts_and_appends_say_so(
    make_cluster: Any,
) -> None:
    cluster = make_cluster(2, **{"store.allow_raw_fallback": False})
    ep = cluster.endpoint
    with Client(ep, timeout_s=10) as client:
        client.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        client.register("other", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        assert appends_say(ep, NS) == {}  # the shards do not require calibrations
        state = client.calibrate(NS, require=True)
        assert (state["state"], state["required"]) == ("needed", True)
        for sid in cluster.shards:
            assert shard_state(cluster, sid)[0] == "needed", sid
        assert ray.get(cluster.coordinator.required.remote(), timeout=10) == {NS: True}
        k = np.ones((LAYERS, PAGE + 1, HEADS, DIM), np.float16)
        with pytest.warns(KvdWarning, match=f"kvd namespace '{NS}': {NEEDS}"):
            assert client.append(NS, "first", k, k) == PAGE + 1
        assert client.notices == {NS: NEEDS}
    assert appends_say(ep, NS) == {NS: NEEDS} and appends_say(ep, "other") == {}

    async def async_notices() -> dict[str, str]:
        async with AsyncClient(ep, timeout_s=10) as c:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", KvdWarning)
                await c.append_many([(NS, f"a-{i}", k, k) for i in range(6)])
            return dict(c.notices)

    assert asyncio.run(async_notices()) == {NS: NEEDS}

    # a shard killed for real comes back empty and gets the setting from the coordinator
    restart_shard(cluster, "shard-1", "needed")
    # the coordinator keeps it persisted, and a restarted one hands it to a shard restarted after it
    assert RayKV(state_key(cluster.namespace)).calibrations()[NS] == {"calibration": None, "require": True}
    coordinator_pid = int(ray.get(cluster.coordinator.pid.remote(), timeout=10))
    kill(coordinator_pid)
    wait_until(lambda: int(ray.get(cluster.coordinator.pid.remote(), timeout=5)) != coordinator_pid,
               timeout_s=60, what="coordinator restart")
    assert ray.get(cluster.coordinator.required.remote(), timeout=10) == {NS: True}
    restart_shard(cluster, "shard-0", "needed")
    assert appends_say(ep, NS) == {NS: NEEDS}  # on every shard, the restarted ones too

    # kvd calibrate --no-require undoes it, kvd status shows it
    done = kvd("calibrate", NS, "--no-require", "--address", ep)
    assert done.returncode == 0, done.stderr
    assert f"namespace {NS!r}: calibration none; requires a calibration: no" in done.stdout, done.stdout
    for sid in cluster.shards:
        wait_until(lambda sid=sid: shard_state(cluster, sid)[0] == "none", timeout_s=10, what=f"{sid} none")
    assert appends_say(ep, NS) == {}
    status = kvd("status", "--address", ep)
    assert status.returncode == 0, status.stderr
    rows = {line.split()[0]: line.split() for line in status.stdout.splitlines()
            if line.split()[:1] in ([NS], ["other"])}
    assert rows[NS][1:3] == ["none", "no"] and rows["other"][1:3] == ["none", "(no)"], status.stdout
    usage = kvd("calibrate", NS, "--address", ep)
    assert usage.returncode == 2 and "give --sample FILE, --require / --no-require, or both" in usage.stderr


def kvd(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=timeout_s)


@pytest.mark.timeout(300)
def test_kvd_calibrate_and_kvd_status_end_to_end(make_cluster: Any, tmp_path: Path) -> None:
    cluster = make_cluster(2)
    ep = cluster.endpoint
    good = tmp_path / "sample.npz"
    np.savez(good, **sample_arrays())
    with Client(ep, timeout_s=10) as client:
        client.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        client.register("other", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)

    status = kvd("status", "--address", ep)
    assert status.returncode == 0, status.stderr
    assert "namespaces and their calibration" in status.stdout
    assert any(line.split()[:2] == [NS, "none"] for line in status.stdout.splitlines()), status.stdout

    done = kvd("calibrate", NS, "--sample", str(good), "--address", ep, "--budget-q4", "0.05")
    assert done.returncode == 0, done.stderr
    assert "calibration " in done.stdout and "of synthetic-model: layout (2, 2, 64), 256 tokens, pages of 16" \
        in done.stdout
    assert "q4: budget 5.00%" in done.stdout and f"namespace {NS!r}: calibration active" in done.stdout

    status = kvd("status", "--address", ep)
    assert status.returncode == 0, status.stderr
    rows = {line.split()[0]: line for line in status.stdout.splitlines() if line.split()[:1] in ([NS], ["other"])}
    assert rows[NS].split()[1] == "active" and "q4" in rows[NS] and "<= 5.00%" in rows[NS], status.stdout
    assert rows["other"].split()[1] == "none"
    assert "pages held back by calibrations" in status.stdout

    # clear errors, and exit codes: a bad sample file (2), an unknown namespace (1), a sample of another layout
    # (quarantined: 1), no kvd (1)
    bad = tmp_path / "bad.npz"
    arrays = sample_arrays()
    arrays["L1_k"] = arrays["L1_k"].astype(np.float32)
    arrays["L1_k"][3, 0, 0] = np.nan
    np.savez(bad, **arrays)
    result = kvd("calibrate", NS, "--sample", str(bad), "--address", ep)
    assert result.returncode == 2 and "bad sample: layer 1 keys[3, 0, 0] is nan" in result.stderr, result.stderr
    result = kvd("calibrate", NS, "--sample", str(tmp_path / "missing.npz"), "--address", ep)
    assert result.returncode == 2 and "cannot read the sample" in result.stderr, result.stderr
    result = kvd("calibrate", "nope", "--sample", str(good), "--address", ep)
    assert result.returncode == 1 and "UnknownNamespace" in result.stderr and "'nope'" in result.stderr
    wide = tmp_path / "wide.npz"
    np.savez(wide, **sample_arrays(layers=LAYERS + 1))
    result = kvd("calibrate", "other", "--sample", str(wide), "--address", ep)
    assert result.returncode == 1 and "calibration quarantined" in result.stdout, result.stdout + result.stderr
    result = kvd("calibrate", NS, "--sample", str(good), "--address", "tcp://127.0.0.1:1", "--timeout", "1")
    assert result.returncode == 1 and "kvd calibrate:" in result.stderr
