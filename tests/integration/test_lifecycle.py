"""Cluster lifecycle with real processes (issue 18, items 1-4): registrations that survive a shard restart and
reach every shard, a restarted coordinator that serves only complete topologies under epochs never reused,
shards that refuse sequences they do not own, and a client bound to a shard incarnation rather than a port.

One local Ray (2 CPUs) per module; each test deploys its own small kvd and kills real shard or coordinator
processes with SIGKILL.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
import zmq

from kvd.client import Client
from kvd.cluster.coordinator import RayKV
from kvd.cluster.deploy import Deployment, deploy, teardown, wait_until
from kvd.cluster.naming import state_key
from kvd.errors import Conflict, ShardUnavailable, UnknownSequence, WrongShard
from kvd.wire import protocol as p
from kvd.wire.routing import Topology, owner

# The control plane under Ray is what runs here (tests/unit/test_suite_marks.py, DRIVERS_ONLY): the second pass
# leaves it out.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray"), pytest.mark.backend_independent]

LAYERS, HEADS, DIM, PAGE = 2, 2, 64, 16
NS = "model"


def chunk(tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((LAYERS, tokens, HEADS, DIM), dtype=np.float32).astype(np.float16)


@pytest.fixture
def make_cluster(small_config: Any) -> Iterator[Any]:
    started: list[str] = []

    def make(shards: int = 3, **extra: Any) -> Deployment:
        config = small_config("kvd-life", shards, **{"store.eviction": "none", **extra})
        started.append(config.cluster.namespace)
        return deploy(config, ready_timeout_s=60)

    yield make
    for namespace in started:
        teardown(namespace, timeout_s=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def topology(deployment: Deployment) -> dict[str, Any]:
    return ray.get(deployment.coordinator.topology.remote(), timeout=10)


def endpoints(deployment: Deployment) -> dict[str, str]:
    return {s["id"]: s["endpoint"] for s in topology(deployment)["shards"]}


def seq_owned_by(ids: list[str], shard_id: str, prefix: str = "s") -> str:
    return next(f"{prefix}{i}" for i in itertools.count() if ids[owner(ids, NS, f"{prefix}{i}")] == shard_id)


def info(deployment: Deployment, shard_id: str) -> dict[str, Any]:
    return ray.get(deployment.shards[shard_id].info.remote(), timeout=10)


def kill_shard(deployment: Deployment, shard_id: str) -> None:
    """SIGKILL the shard's process; return once Ray restarted it and it registered with the coordinator."""
    pid = int(info(deployment, shard_id)["pid"])
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: int(info(deployment, shard_id)["pid"]) != pid, timeout_s=60, what="shard restart")
    wait_until(lambda: info(deployment, shard_id)["registered"], timeout_s=30, what="restarted shard registered")


# --------------------------------------------------------------------------------- item 1: registrations


@pytest.mark.timeout(180)
def test_a_namespace_registered_through_one_shard_is_known_on_every_shard_and_after_a_restart(
    make_cluster: Any,
) -> None:
    cluster = make_cluster(3)
    eps = endpoints(cluster)
    ids = sorted(eps)
    data = chunk(PAGE, 1)
    # A client that talks to one shard only (as a client in another language may) registers there ...
    with Client(eps["shard-0"], timeout_s=5.0) as one:
        one.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    # ... and every shard knows the namespace: a cluster client that never registered appends everywhere.
    with Client(cluster.endpoint, timeout_s=5.0) as client:
        seqs = {sid: seq_owned_by(ids, sid) for sid in ids}
        for sid, seq in seqs.items():
            assert client.append(NS, seq, data, data) == PAGE, sid
        # A restarted shard comes back empty but knows the namespace: its lost sequences are UnknownSequence
        # (what cluster/README.md promises), and appends routed to it work without registering again.
        victim = "shard-1"
        kill_shard(cluster, victim)
        with pytest.raises(UnknownSequence):
            client.length(NS, seqs[victim])
        with pytest.raises(UnknownSequence):
            client.get(NS, seqs[victim])
        fresh = seq_owned_by(ids, victim, "new")
        assert client.append(NS, fresh, data, data) == PAGE
        np.testing.assert_array_equal(client.get(NS, fresh)[0], data)
        for sid in ids:
            if sid != victim:
                assert client.length(NS, seqs[sid]) == PAGE


# ------------------------------------------------------------------------- item 2: coordinator restarts


def _poll_topologies(endpoint: str, stop: threading.Event, seen: list[tuple[float, Any]]) -> None:
    """Ask the topology endpoint as fast as it answers: (time, (epoch, shards)) or (time, error name)."""
    ctx = zmq.Context()
    rid = itertools.count(1)
    try:
        while not stop.is_set():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            try:
                while not stop.is_set():
                    req = p.TopologyRequest(request_id=next(rid))
                    sock.send_multipart(p.encode_request(req))
                    if not sock.poll(500):
                        seen.append((time.monotonic(), "no reply"))
                        break  # a new socket: the old one may hold requests for the dead process
                    reply = p.decode_reply(sock.recv_multipart())
                    if isinstance(reply, p.ErrorReply):
                        seen.append((time.monotonic(), reply.error))
                    else:
                        shards = tuple(sorted((s["id"], s["endpoint"]) for s in reply.shards))
                        seen.append((time.monotonic(), (reply.epoch, shards)))
                    time.sleep(0.005)
            finally:
                sock.close(0)
    finally:
        ctx.term()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("state", ["kept", "lost"])
def test_a_restarted_coordinator_serves_only_complete_topologies_and_never_reuses_an_epoch(
    make_cluster: Any, state: str,
) -> None:
    # a fixed port: a coordinator that lost its state (and so the port it had picked) binds it again; a long
    # ready grace, so that a complete topology comes from every shard registering again, however loaded the host
    # (the grace itself: test_shard_lifecycle.py)
    cluster = make_cluster(3, **{"cluster.port": _free_port(), "cluster.ready_grace_s": 60})
    before = topology(cluster)
    assert len(before["shards"]) == 3
    seen: list[tuple[float, Any]] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll_topologies, args=(cluster.endpoint, stop, seen), daemon=True)
    poller.start()
    wait_until(lambda: len(seen) > 5, timeout_s=10, what="topology polls")
    if state == "lost":  # the persisted state is gone too (GCS wiped): membership is rebuilt from the shards
        RayKV(state_key(cluster.namespace)).delete()
    pid = int(ray.get(cluster.coordinator.pid.remote(), timeout=10))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: int(ray.get(cluster.coordinator.pid.remote(), timeout=5)) != pid, timeout_s=60,
               what="coordinator restart")
    wait_until(lambda: any(t > killed_at and isinstance(v, tuple) for t, v in seen), timeout_s=30,
               what="a topology from the restarted coordinator")
    time.sleep(4.0)  # the window in which a restarted coordinator used to serve partial lists
    stop.set()
    poller.join(timeout=10)

    topologies = [v for _, v in seen if isinstance(v, tuple)]
    after = [v for t, v in seen if t > killed_at and isinstance(v, tuple)]
    assert after, seen[-5:]
    partial = [(t, v) for t, v in seen if isinstance(v, tuple) and len(v[1]) != 3]
    span = partial[-1][0] - partial[0][0] if partial else 0.0
    assert partial == [], f"{len(partial)} incomplete topologies served over {span:.2f} s, e.g. {partial[:3]}"
    by_epoch: dict[int, set[Any]] = {}
    for epoch, shards in topologies:
        by_epoch.setdefault(epoch, set()).add(shards)
    assert all(len(lists) == 1 for lists in by_epoch.values()), f"an epoch named two shard lists: {by_epoch}"
    epochs = [epoch for epoch, _ in topologies]
    assert epochs == sorted(epochs), "the topology epoch went backwards"
    if state == "lost":
        assert after[-1][0] > before["epoch"]  # rebuilt without its state: a newer epoch, never a reused one
    else:
        assert after[0] == (before["epoch"], tuple(sorted((s["id"], s["endpoint"]) for s in before["shards"])))
    # Refusals while rebuilding are Busy (retry), never a wrong answer.
    assert {v for _, v in seen if isinstance(v, str)} <= {"Busy", "no reply"}


# ----------------------------------------------------------------------------------- item 3: routing


@pytest.mark.timeout(180)
def test_a_shard_refuses_sequences_it_does_not_own_and_the_client_refreshes_and_follows(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    eps = endpoints(cluster)
    ids = sorted(eps)
    data = chunk(PAGE, 2)
    epoch = topology(cluster)["epoch"]
    with Client(cluster.endpoint, timeout_s=5.0) as client:
        client.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        theirs = seq_owned_by(ids, "shard-1")
        # A client that sends shard-0 a sequence shard-1 owns is refused, told the owner and the epoch.
        with Client(eps["shard-0"], timeout_s=5.0) as direct:
            with pytest.raises(WrongShard, match=rf"shard-1.*topology epoch {epoch}"):
                direct.append(NS, theirs, data, data)
            with pytest.raises(WrongShard):
                direct.length(NS, theirs)
            mine = seq_owned_by(ids, "shard-0")
            assert direct.append(NS, mine, data, data) == PAGE  # its own sequences are served as before
        with pytest.raises(UnknownSequence):
            client.length(NS, theirs)  # nothing was stored anywhere

        # A client holding a stale topology (one shard missing, as a restarted coordinator used to serve)
        # is refused by the wrong owner, reads the topology again and retries: every sequence lands on its
        # owner, none is split.
        seqs = [f"q{i}" for i in range(30)]
        stale = Topology(epoch=epoch - 1, shards=[{"id": s, "endpoint": eps[s]} for s in ids[:2]])
        misrouted = [s for s in seqs if stale.owner(NS, s)["id"] != ids[owner(ids, NS, s)]]
        assert misrouted
        client._set_topology(stale.as_dict())
        for s in seqs:
            assert client.append(NS, s, data, data) == PAGE
        assert client.topology()["epoch"] == epoch
        with Client(cluster.endpoint, timeout_s=5.0) as fresh:
            assert fresh.lengths(NS, seqs) == [PAGE] * len(seqs)
            stats = {st["shard_id"]: st["sequences"] for st in fresh.shard_stats()}
        # and no shard holds a stray copy: each holds exactly the sequences it owns ("theirs" was never stored)
        assert stats == {sid: sum(ids[owner(ids, NS, s)] == sid for s in [*seqs, mine]) for sid in ids}
        # the pipelined and batched calls follow too: a refused item is done again after a refresh
        for call, expect in ((lambda: client.get_many([(NS, s) for s in seqs]), [(data, data)] * len(seqs)),
                             (lambda: client.lengths(NS, seqs), [PAGE] * len(seqs)),
                             (lambda: client.append_many([(NS, s, data, data, PAGE) for s in seqs]),
                              [2 * PAGE] * len(seqs))):
            client._set_topology(stale.as_dict())
            got = call()
            assert len(got) == len(expect)
            for g, e in zip(got, expect, strict=True):
                if isinstance(e, tuple):
                    np.testing.assert_array_equal(g[0], e[0])
                else:
                    assert g == e


# ------------------------------------------------------------------------------ item 4: incarnations


@pytest.mark.timeout(180)
def test_a_shard_restarted_on_its_predecessors_port_does_not_continue_a_sequence_in_the_middle(
    make_cluster: Any,
) -> None:
    port = _free_port()
    cluster = make_cluster(1, **{"cluster.shard_ports": f"{port}-{port}"})
    (endpoint,) = endpoints(cluster).values()
    assert endpoint.endswith(f":{port}")
    step = chunk(1, 3)
    with Client(cluster.endpoint, timeout_s=5.0) as client:
        client.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        assert client.append(NS, "a", chunk(PAGE, 4), chunk(PAGE, 4)) == PAGE
        old = info(cluster, "shard-0")["incarnation"]
        kill_shard(cluster, "shard-0")
        assert info(cluster, "shard-0")["endpoint"] == endpoint  # the same port: the socket reconnects by itself
        assert info(cluster, "shard-0")["incarnation"] != old
        # The next append without offset must not start sequence "a" over at length 1 on the empty successor.
        with pytest.raises(ShardUnavailable, match="restarted"):
            client.append(NS, "a", step, step)
        with pytest.raises(UnknownSequence):
            client.length(NS, "a")
        with pytest.raises(Conflict):
            client.append(NS, "a", step, step, offset=PAGE)
        # the client now talks to the new incarnation: new sequences are served
        assert client.append(NS, "b", step, step) == 1
