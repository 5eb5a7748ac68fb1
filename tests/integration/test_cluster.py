"""The Ray cluster end to end: real Ray actors, real shard processes, real ZeroMQ sockets on 127.0.0.1.

One local Ray (2 CPUs) per module; each test deploys its own kvd in its own Ray namespace (coordinator plus
shards, port 0) and tears it down. Levels are driven by real memory pressure: small stores (1 MiB per shard),
a small layout (pages of 16 tokens, 16 KiB at fp16) and a 0.1 s report interval keep it fast. The policy runs
with ``ewma_alpha = 1`` (each report round decides on its own) and a hysteresis of 0.5, wide enough that the
memory re-compression frees after a rise does not by itself step the level back down.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray

from kvd.client import Client
from kvd.cluster.deploy import Deployment, deploy, teardown, wait_until
from kvd.errors import Conflict, InvalidArgument, KvdError, OutOfMemory, UnknownSequence
from kvd.wire.protocol import owner

from tcp_buffers import tcp_buffers  # isort: skip  (tests/integration/tcp_buffers.py)

# The control plane under Ray is what runs here (tests/unit/test_suite_marks.py, DRIVERS_ONLY): the second pass
# leaves it out.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray"), pytest.mark.backend_independent]

LAYERS, HEADS, DIM, PAGE = 2, 2, 64, 16
NS = "model"



@pytest.fixture
def cluster(request: pytest.FixtureRequest, small_config: Any) -> Iterator[Deployment]:
    shards = getattr(request, "param", 3)
    # a hysteresis of 0.5 keeps these tests' levels where they put them, whatever re-compression frees
    config = small_config("kvd-test", shards, **{"store.eviction": "none", "policy.ewma_alpha": 1.0,
                                                 "policy.hysteresis": 0.5, "store.warm_cache_bytes": "3MiB",
                                                 "cluster.shard_socket_buffer_bytes": "64KiB"})
    deployment = deploy(config, ready_timeout_s=60)
    yield deployment
    teardown(config.cluster.namespace, timeout_s=10)


def chunk(tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((LAYERS, tokens, HEADS, DIM), dtype=np.float32).astype(np.float16)


def connect(deployment: Deployment, timeout_s: float = 5.0) -> Client:
    client = Client(deployment.endpoint, timeout_s=timeout_s)
    client.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    return client


def shard_ids(deployment: Deployment) -> list[str]:
    return sorted(deployment.status()["shards"][i]["id"] for i in range(len(deployment.shards)))


def all_stats(client: Client) -> list[dict[str, Any]]:
    return [s for s in client.shard_stats() if isinstance(s, dict)]


def pressure(client: Client, stats: list[dict[str, Any]] | None = None) -> float:
    """The cluster's raw pressure, from ``stats`` if given (else read now)."""
    stats = all_stats(client) if stats is None else stats
    return sum(s["used_bytes"] for s in stats) / sum(s["capacity_bytes"] for s in stats)


def accounts(client: Client) -> list[dict[str, Any]]:
    """Where each shard's used bytes are, for a failure message."""
    keys = ("shard_id", "level", "epoch", "used_bytes", "page_bytes", "tail_bytes", "pool_bytes",
            "reserved_bytes", "compaction_backlog_bytes", "bytes_by_level", "recompressed_pages", "sequences",
            "server_bulk_requests")
    return [{key: s.get(key) for key in keys} for s in all_stats(client)]


def fill(client: Client, prefix: str, target: float, *, until_ordered: str | None = None,
         timeout_s: float = 60.0) -> list[str]:
    """Append one-page sequences until raw cluster pressure reaches ``target`` or, with ``until_ordered``, a
    shard has been ordered to that level; returns the stored seq ids. (A fill slower than the coordinator's
    reports goes past the threshold before the target: without the stop it would fill on while the shards
    re-compress, and end with compressed pages, at the target again. That made the q8 test flaky.)"""
    data = chunk(PAGE, 1)
    stored: list[str] = []
    deadline = time.monotonic() + timeout_s
    for i in itertools.count():
        if i % 4 == 0:
            stats = all_stats(client)
            if pressure(client, stats) >= target or any(s["ordered_level"] == until_ordered for s in stats):
                return stored
        assert time.monotonic() < deadline, f"pressure stuck at {pressure(client):.3f} below {target}"
        try:
            client.append(NS, f"{prefix}-{i}", data, data)
            stored.append(f"{prefix}-{i}")
        except OutOfMemory:
            pass  # that shard is full; sequences hashed to the others keep filling them
    raise AssertionError("unreachable")


def levels_converged(client: Client, level: str) -> tuple[bool, set[int]]:
    """Every shard runs at ``level`` because the coordinator ordered it, under one epoch. The order counts, not
    only the level in force: a full shard runs ahead to q4 on its own (kvd.store.compact) under the epoch of the
    order before, so three shards ahead at q4 look converged at the old epoch before the coordinator decides."""
    stats = all_stats(client)
    epochs = {s["epoch"] for s in stats}
    return all(s["level"] == s["ordered_level"] == level for s in stats) and len(epochs) == 1, epochs


# -------------------------------------------------------------------------------------------------- levels


@pytest.mark.timeout(120)
def test_sequences_spread_and_pressure_moves_every_shard_to_q8_then_q4_and_back(cluster: Deployment) -> None:
    with connect(cluster) as client:
        ids = shard_ids(cluster)
        assert len(ids) == 3
        # each shard process applied the configured bound on its warm result buffers (3 MiB)
        assert {ray.get(h.stats.remote())["warm_cache_bytes"] for h in cluster.shards.values()} == {3 << 20}

        # Fill to just past 0.80 at fp16: every shard moves to q8 under one epoch.
        stored = fill(client, "a", 0.82, until_ordered="q8")
        owners = {ids[owner(ids, NS, s)] for s in stored}
        assert owners == set(ids)  # the client spread sequences over every shard
        # each shard applied the configured TCP buffers to the client's connection (Linux doubles them)
        for shard in all_stats(client):
            assert set(tcp_buffers(int(shard["endpoint"].rsplit(":", 1)[1]))) == {(128 << 10, 128 << 10)}
        assert {s["sequences"] for s in all_stats(client)} != {0}
        wait_until(lambda: levels_converged(client, "q8")[0], timeout_s=30, what="every shard at q8")
        (q8_epoch,) = levels_converged(client, "q8")[1]
        assert cluster.status()["level_epoch"] == q8_epoch

        # Re-compression frees memory: every cold fp16 page is re-encoded at 8 bits.
        wait_until(lambda: all(s["compaction_backlog_bytes"] == 0 for s in all_stats(client)), timeout_s=30,
                   what="q8 re-compression")
        after_q8 = pressure(client)
        assert after_q8 < 0.6, (after_q8, accounts(client))
        assert all(set(s["bytes_by_level"]) == {"q8"} for s in all_stats(client))

        # Fill again past 0.95: q4 everywhere under a newer epoch, every page re-encoded. A shard that filled up
        # before the order came compressed itself to q4 already (kvd.store.compact), so used bytes may stay high.
        fill(client, "b", 0.96)
        wait_until(lambda: levels_converged(client, "q4")[0], timeout_s=30, what="every shard at q4")
        (q4_epoch,) = levels_converged(client, "q4")[1]
        assert q4_epoch > q8_epoch
        wait_until(lambda: all(s["compaction_backlog_bytes"] == 0 for s in all_stats(client)), timeout_s=30,
                   what="q4 re-compression")
        assert all(set(s["bytes_by_level"]) == {"q4"} for s in all_stats(client))

        # Pressure now sits inside q4's hysteresis band or above it (above 0.45): the level holds.
        assert pressure(client) > 0.45
        samples = cluster.status()["samples"]
        wait_until(lambda: cluster.status()["samples"] >= samples + 5, timeout_s=30, what="five more samples")
        assert levels_converged(client, "q4") == (True, {q4_epoch})

        # Drop everything: pressure falls below the band and the level steps down (through the 8-bit rung if
        # a report round catches pressure inside its margin on the way), each step with a newer epoch.
        for seq in [*stored, *[f"b-{i}" for i in range(5000)]]:
            client.drop(NS, seq)
        assert pressure(client) < 0.30
        wait_until(lambda: levels_converged(client, "fp16")[0], timeout_s=30, what="every shard back at fp16")
        (fp16_epoch,) = levels_converged(client, "fp16")[1]
        assert fp16_epoch > q4_epoch
        changes = cluster.status()["history"]
        assert [(c["level"], c["epoch"]) for c in changes[:2]] == [("q8", q8_epoch), ("q4", q4_epoch)], changes
        down = changes[2:]
        assert [c["epoch"] for c in down] == list(range(q4_epoch + 1, fp16_epoch + 1)), changes
        assert down[-1]["level"] == "fp16" and all(c["level"] in ("q8", "fp16") for c in down), changes
        assert all(c["pressure"] < 0.45 for c in down), changes  # never a step down inside q4's band


# ------------------------------------------------------------------------------------------------ failures


def _shard_pid(deployment: Deployment, shard_id: str) -> int:
    return int(ray.get(deployment.shards[shard_id].info.remote(), timeout=10)["pid"])


@pytest.mark.timeout(120)
def test_sigkill_of_a_shard_during_appends(cluster: Deployment) -> None:
    ids = shard_ids(cluster)
    victim = ids[1]
    seqs = [f"s{i}" for i in range(24)]
    home = {s: ids[owner(ids, NS, s)] for s in seqs}
    assert victim in home.values() and len(set(home.values())) == 3
    step = chunk(1, 2)
    with connect(cluster, timeout_s=2.0) as client:
        lengths = dict.fromkeys(seqs, 0)
        # A token is 1 KiB: 24 sequences of at most 3 pages stay near a third of the 3 MiB however long the
        # restart below takes, so what is read back is still fp16 (a full shard compresses, then refuses).
        cap = 3 * PAGE
        for s in seqs:
            lengths[s] = client.append(NS, s, chunk(PAGE, 3), chunk(PAGE, 3))
        errors: dict[str, list[BaseException]] = {s: [] for s in seqs}
        stop = threading.Event()

        def appender() -> None:
            while not stop.is_set():
                for s in seqs:
                    if errors[s]:
                        continue  # a sequence that failed once stays failed: its data is gone
                    try:
                        if lengths[s] < cap:
                            lengths[s] = client.append(NS, s, step, step)
                        else:  # keep every shard far below q8's pressure, however long the restart takes
                            assert client.length(NS, s) == lengths[s]
                    except BaseException as exc:  # noqa: BLE001 - recorded and checked below
                        errors[s].append(exc)

        thread = threading.Thread(target=appender, daemon=True)
        thread.start()
        try:
            wait_until(lambda: min(lengths.values()) >= PAGE + 3, timeout_s=20, what="appends under way")
            pid = _shard_pid(cluster, victim)
            os.kill(pid, signal.SIGKILL)
            # Ray restarts the shard: new process, registered again under the same id.
            wait_until(lambda: _shard_pid(cluster, victim) != pid, timeout_s=60, what="shard restart")
            wait_until(lambda: ray.get(cluster.shards[victim].info.remote(), timeout=10)["registered"],
                       timeout_s=30, what="restarted shard registered")
            wait_until(lambda: all(errors[s] for s in seqs if home[s] == victim), timeout_s=30,
                       what="every sequence of the dead shard to fail")
        finally:  # the appender stops before the client closes, also on a failure (a ZeroMQ socket is not shared)
            stop.set()
            thread.join(timeout=30)

        for s in seqs:
            if home[s] == victim:
                # A clear kvd error, not a hang or a stray exception.
                assert errors[s] and all(isinstance(e, KvdError) for e in errors[s]), (s, errors[s])
            else:
                assert errors[s] == [], (s, errors[s])  # other shards never noticed
        # The others' data is intact. The victim came back empty but knows the namespace (registrations are kept
        # by the coordinator): its old sequences are missing, and an append that states where it expects the
        # sequence to be (offset) is refused instead of silently starting a new sequence.
        for s in seqs:
            if home[s] != victim:
                assert client.length(NS, s) == lengths[s]
                keys, values = client.get(NS, s)
                assert keys.shape == (LAYERS, lengths[s], HEADS, DIM)
                np.testing.assert_array_equal(keys[:, PAGE:], np.repeat(step, lengths[s] - PAGE, axis=1))
        lost = [s for s in seqs if home[s] == victim]
        for s in lost:
            with pytest.raises(UnknownSequence):
                client.length(NS, s)
            with pytest.raises(UnknownSequence):
                client.get(NS, s)
            with pytest.raises(Conflict):
                client.append(NS, s, step, step, offset=lengths[s])
        # The restarted shard serves new sequences.
        fresh = next(f"new{i}" for i in itertools.count() if ids[owner(ids, NS, f"new{i}")] == victim)
        assert client.append(NS, fresh, chunk(PAGE, 4), chunk(PAGE, 5)) == PAGE
        keys, values = client.get(NS, fresh)
        np.testing.assert_array_equal(keys, chunk(PAGE, 4))
        np.testing.assert_array_equal(values, chunk(PAGE, 5))
        victim_stats = next(s for s in all_stats(client) if s["shard_id"] == victim)
        assert victim_stats["sequences"] == 1  # only the new one: it came back empty
        assert (victim_stats["level"], victim_stats["epoch"]) == (cluster.status()["level"],
                                                                  cluster.status()["level_epoch"])


@pytest.mark.timeout(120)
def test_coordinator_killed_data_keeps_flowing_and_levels_resume_with_a_newer_epoch(
    cluster: Deployment,
) -> None:
    with connect(cluster) as client:
        fill(client, "a", 0.82)
        wait_until(lambda: levels_converged(client, "q8")[0], timeout_s=30, what="every shard at q8")
        (q8_epoch,) = levels_converged(client, "q8")[1]
        wait_until(lambda: all(s["compaction_backlog_bytes"] == 0 for s in all_stats(client)), timeout_s=30,
                   what="q8 re-compression")
        endpoint = cluster.endpoint
        pid = int(ray.get(cluster.coordinator.pid.remote(), timeout=10))
        os.kill(pid, signal.SIGKILL)

        # Data keeps flowing while the coordinator is down or restarting: the client talks to shards.
        data = chunk(PAGE, 6)
        for i in range(30):
            assert client.append(NS, f"during-{i}", data, data) == PAGE
            np.testing.assert_array_equal(client.get(NS, f"during-{i}")[0].shape, data.shape)

        wait_until(lambda: int(ray.get(cluster.coordinator.pid.remote(), timeout=5)) != pid, timeout_s=60,
                   what="coordinator restart")
        status = cluster.status()
        assert status["restarted"] and status["endpoint"] == endpoint  # same address for clients
        assert status["level_epoch"] >= q8_epoch and status["level"] == "q8"
        wait_until(lambda: sum(s["up"] for s in cluster.status()["shards"]) == 3, timeout_s=30,
                   what="shards re-registered")
        with Client(endpoint, timeout_s=5.0) as fresh_client:  # a new client finds the topology there
            assert len(all_stats(fresh_client)) == 3

        # Level control resumes: crossing 0.95 moves every shard to q4 with an epoch newer than before.
        fill(client, "b", 0.96)
        wait_until(lambda: levels_converged(client, "q4")[0], timeout_s=30, what="every shard at q4")
        (q4_epoch,) = levels_converged(client, "q4")[1]
        assert q4_epoch > q8_epoch


# ------------------------------------------------------------------------------------------------ namespaces


@pytest.mark.timeout(180)
def test_namespaces_reach_every_shard_up_to_the_limit_and_a_small_shard_holds_a_small_reply_budget(
        small_config: Any) -> None:
    """A namespace registered through one shard is served by every shard (the coordinator pushes what was added,
    not everything); past cluster.max_namespaces a register is refused with an error naming the setting; and a
    1 MiB shard's reply budget is the floor, 64 MiB, not 1 GiB."""
    config = small_config("kvd-ns", 2, **{"cluster.max_namespaces": 3})
    deployment = deploy(config, ready_timeout_s=60)
    try:
        with Client(deployment.endpoint, timeout_s=10.0) as client:
            ids = [s["shard_id"] for s in all_stats(client)]
            for i in range(3):
                client.register(f"ns{i}", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
            with pytest.raises(InvalidArgument, match=r"cluster.max_namespaces = 3"):
                client.register("ns3", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
            assert deployment.status()["namespaces"] == 3
            data = chunk(PAGE, 2)
            for i in range(3):  # a sequence on each shard, in every namespace: each shard knows all three
                seqs = {ids[owner(ids, f"ns{i}", f"s{j}")]: f"s{j}" for j in range(64)}
                assert len(seqs) == 2
                for seq in seqs.values():
                    assert client.append(f"ns{i}", seq, data, data) == PAGE
            assert {s["server_max_reply_bytes"] for s in all_stats(client)} == {64 << 20}
    finally:
        teardown(config.cluster.namespace, timeout_s=10)
