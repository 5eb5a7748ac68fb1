"""A shard server's part of the cluster lifecycle (protocol 1.3), without Ray: a ShardServer in this process on
127.0.0.1, raw DEALER sockets and kvd's client. Incarnations in hello and append, routing refusals, the
start-up gate and the cluster-wide register hook; and that a 1.2 client is served as before."""

from __future__ import annotations

import itertools
import json
import tracemalloc
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvd.client import Client
from kvd.errors import Busy, InvalidArgument, LayoutMismatch, UnknownNamespace, UnknownSequence, WrongShard
from kvd.store.core import Store
from kvd.wire import protocol as p
from kvd.wire.routing import owner
from kvd.wire.server import ShardServer

pytestmark = pytest.mark.integration

NS = "m"
IDS = ["shard-0", "shard-1", "shard-2"]
DATA = np.ones((1, 2, 1, 4), np.float16)


def mine(shard_id: str, prefix: str = "s") -> str:
    return next(f"{prefix}{i}" for i in itertools.count() if IDS[owner(IDS, NS, f"{prefix}{i}")] == shard_id)


@pytest.fixture
def shard() -> Iterator[tuple[ShardServer, list[Any]]]:
    registered: list[Any] = []

    def hook(namespace: str, layout: tuple[int, int, int]) -> None:
        if namespace == "taken":
            raise LayoutMismatch("namespace 'taken' is registered in this cluster as (layers=9, ...)")
        registered.append((namespace, layout))

    server = ShardServer(Store(8 << 20, page_tokens=16), shard_id="shard-0", incarnation="inc-a",
                         on_register=hook, starting=True)
    server.start()
    yield server, registered
    server.stop()


class Raw:
    """A DEALER speaking the protocol by hand, as a client of protocol 1.2 would."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, req: Any) -> tuple[dict[str, Any], Any]:
        self.sock.send_multipart(p.encode_request(req))
        assert self.sock.poll(5000), "no reply"
        frames = self.sock.recv_multipart()
        return msgpack.unpackb(frames[0]), p.decode_reply(frames)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.timeout(60)
def test_incarnation_is_told_only_when_asked_and_a_1_2_client_is_served_as_before(shard: Any) -> None:
    server, _ = shard
    raw = Raw(server.endpoint)
    try:
        header, reply = raw.ask(p.HelloRequest(request_id=1))
        # a 1.2 decoder reads it
        assert "incarnation" not in header and reply.protocol_minor == p.PROTOCOL_MINOR >= 3
        header, reply = raw.ask(p.HelloRequest(request_id=2, incarnation=True))
        assert header["incarnation"] == reply.incarnation == "inc-a"
        # starting: data operations are Busy (not executed) until the cluster's namespaces are known
        _, reply = raw.ask(p.LengthRequest(request_id=3, namespace=NS, seq_id="x"))
        assert isinstance(reply, p.ErrorReply) and reply.code == Busy.code and "starting" in reply.message
        server.open_for_data()
        _, reply = raw.ask(p.LengthRequest(request_id=4, namespace=NS, seq_id="x"))
        assert reply.code == UnknownNamespace.code
        _, reply = raw.ask(p.RegisterRequest(request_id=5, namespace=NS, num_layers=1, num_kv_heads=1,
                                             head_dim=4))
        assert isinstance(reply, p.RegisterReply)
        # an append without incarnation (a 1.2 client) is served as before
        _, reply = raw.ask(p.AppendRequest(request_id=6, namespace=NS, seq_id="x", keys=DATA, values=DATA))
        assert isinstance(reply, p.AppendReply) and reply.length == 2
    finally:
        raw.close()


@pytest.mark.timeout(60)
def test_an_append_naming_another_incarnation_is_refused_and_nothing_is_written(shard: Any) -> None:
    server, _ = shard
    server.open_for_data()
    with Client(server.endpoint, timeout_s=5.0) as client:
        client.register(NS, num_layers=1, num_kv_heads=1, head_dim=4)
        assert client.append(NS, "a", DATA, DATA) == 2  # the client names "inc-a", found by its hello
        raw = Raw(server.endpoint)
        try:
            _, reply = raw.ask(p.AppendRequest(request_id=1, namespace=NS, seq_id="a", keys=DATA, values=DATA,
                                               incarnation="inc-before"))
            assert reply.code == WrongShard.code and "inc-a" in reply.message and "inc-before" in reply.message
        finally:
            raw.close()
        assert client.length(NS, "a") == 2


@pytest.mark.timeout(120)
def test_what_a_shard_keeps_to_check_ownership_stays_small_over_many_sequences(shard: Any) -> None:
    """A shard that enforces routing checks the owner of every sequence it is asked about and remembers some
    answers: over 60,000 distinct sequences (a long run of prompts, blocks and sessions) what it keeps stays
    under 2 MiB (a cache of 65,536 owners held about 10 MiB, a soak's steady RSS growth: BENCHMARKS.md, "Soak")."""
    server, _ = shard
    server.open_for_data()
    assert server.set_routing(1, ["shard-0"])  # it owns every sequence: lengths answers all of them
    raw = Raw(server.endpoint)  # by hand: a kvd Client would add its own cache of owners to this process
    try:
        _, reply = raw.ask(p.RegisterRequest(request_id=1, namespace=NS, num_layers=1, num_kv_heads=1, head_dim=4))
        assert isinstance(reply, p.RegisterReply)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for batch in range(15):
                ids = tuple(f"seq-{batch}-{i:06d}" for i in range(4000))
                _, reply = raw.ask(p.LengthsRequest(request_id=2 + batch, namespace=NS, seq_ids=ids))
                assert reply.lengths == (None,) * 4000
            del ids, reply
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    finally:
        raw.close()
    assert grown < 2 << 20, f"{grown / (1 << 20):.1f} MiB kept after 60,000 sequences"


@pytest.mark.timeout(60)
def test_routing_is_enforced_once_handed_and_names_the_owner_and_the_epoch(shard: Any) -> None:
    server, _ = shard
    server.open_for_data()
    with Client(server.endpoint, timeout_s=5.0) as client:
        client.register(NS, num_layers=1, num_kv_heads=1, head_dim=4)
        theirs, ours = mine("shard-2"), mine("shard-0")
        assert client.append(NS, theirs, DATA, DATA) == 2  # no routing handed yet: a shard alone serves all
        assert server.set_routing(7, IDS) and not server.set_routing(6, IDS)  # an older epoch is ignored
        for call in (lambda: client.append(NS, theirs, DATA, DATA), lambda: client.get(NS, theirs),
                     lambda: client.length(NS, theirs), lambda: client.drop(NS, theirs),
                     lambda: client.lengths(NS, [ours, theirs]),
                     lambda: client.explain(NS, theirs, 0, 0)):
            with pytest.raises(WrongShard, match=r"'shard-2' does \(topology epoch 7\)"):
                call()
        assert server.set_routing(8, ["shard-0", "shard-2"])
        assert client.append(NS, ours, DATA, DATA) == 2
        with pytest.raises(UnknownSequence):
            client.length(NS, mine("shard-0", "new"))
        assert client.stats()["topology_epoch"] == 8


@pytest.mark.timeout(60)
def test_register_goes_through_the_cluster_first_and_a_refusal_registers_nothing(shard: Any) -> None:
    server, registered = shard
    server.open_for_data()
    with Client(server.endpoint, timeout_s=5.0) as client:
        client.register(NS, num_layers=1, num_kv_heads=1, head_dim=4)
        assert registered == [(NS, (1, 1, 4))]
        with pytest.raises(LayoutMismatch, match="in this cluster"):
            client.register("taken", num_layers=1, num_kv_heads=1, head_dim=4)
        with pytest.raises(UnknownNamespace):
            client.append("taken", "a", DATA, DATA)


# ------------------------------------------------------------------------------ the coordinator, without Ray


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's pushes to shards find no shard actor, without asking Ray: ``ray.get_actor`` in a process
    where Ray is not initialized starts a whole local Ray (about 25 s, in a background thread of the test)."""
    from kvd.cluster.coordinator import Coordinator

    def no_handle(self: Any, shard_id: str) -> Any:
        raise LookupError(f"no Ray in this test: no actor for {shard_id}")

    monkeypatch.setattr(Coordinator, "_handle", no_handle)


class MemoryKV:
    """The coordinator's persisted state in memory (what RayKV keeps in Ray's internal KV), as JSON."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.parts: dict[int, MemoryKV] = {}
        self.cals: dict[str, MemoryKV] = {}
        self.saves = 0

    def part(self, index: int) -> MemoryKV:
        return self.parts.setdefault(index, MemoryKV())

    def calibration(self, namespace: str) -> MemoryKV:
        return self.cals.setdefault(namespace, MemoryKV())

    def calibrations(self) -> dict[str, Any]:
        return {k: v.load()["calibration"] for k, v in self.cals.items() if v.data}

    def load(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.data))

    def save(self, data: dict[str, Any]) -> bool:
        self.data = json.loads(json.dumps(data))
        self.saves += 1
        return True

    def delete(self) -> None:
        self.data, self.parts, self.cals = {}, {}, {}


class FailingKV(MemoryKV):
    """A :class:`MemoryKV` whose saves fail (return False, as RayKV does when the GCS does not answer) while
    :attr:`failing` is set; counts every attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False
        self.attempts = 0

    def save(self, data: dict[str, Any]) -> bool:
        self.attempts += 1
        return False if self.failing else super().save(data)


def _report(sid: str, inc: str, endpoint: str, topology_epoch: int) -> dict[str, Any]:
    return {"shard_id": sid, "incarnation": inc, "endpoint": endpoint, "used_bytes": 0,
            "capacity_bytes": 1 << 20, "level": "fp16", "epoch": 1, "topology_epoch": topology_epoch}


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_ray")
def test_a_coordinator_publishes_only_saved_complete_topologies_and_serves_them_again_after_a_restart() -> None:
    from kvd.cluster.coordinator import Coordinator
    from kvd.config import load_config

    config = load_config(env={}, overrides={"cluster.shards": 2, "cluster.port": 0,
                                            "cluster.report_interval_s": 0.1})
    kv = MemoryKV()
    first = Coordinator(config, host="127.0.0.1", kv=kv)
    try:
        with pytest.raises(Busy, match="shard-1"):
            first._client_topology()
        first.register("shard-0", "tcp://127.0.0.1:1", "a0")
        with pytest.raises(Busy):
            first._client_topology()  # one of two: clients would route shard-1's sequences to shard-0
        reply = first.register("shard-1", "tcp://127.0.0.1:2", "a1")
        served = first._client_topology()
        assert [s["id"] for s in served["shards"]] == ["shard-0", "shard-1"]
        assert reply["routing"] == {"epoch": served["epoch"], "shards": ["shard-0", "shard-1"]}
        assert kv.data["topology_epoch"] == served["epoch"]  # saved before it was served
        assert first.add_namespace("m", [2, 2, 8]) == {"ok": True}
        refused = first.add_namespace("m", [2, 2, 16])
        assert not refused["ok"] and refused["code"] == LayoutMismatch.code
    finally:
        first.stop()
    second = Coordinator(config, host="127.0.0.1", kv=kv)  # a restart that kept its state
    try:
        again = second._client_topology()
        assert (again["epoch"], again["shards"]) == (served["epoch"], served["shards"])
        assert second.namespaces() == {"m": [2, 2, 8]}
        assert second.report(_report("shard-0", "a0", "tcp://127.0.0.1:1", served["epoch"]))["known"]
    finally:
        second.stop()


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_ray")
def test_cluster_ready_grace_s_is_how_long_a_coordinator_without_state_waits_for_every_shard() -> None:
    """Without a persisted topology the coordinator publishes one only when every expected shard registered, or
    once ``cluster.ready_grace_s`` passed (default 3 x the stale time: 3 s here, with 0.1 s reports)."""
    from kvd.cluster.coordinator import Coordinator
    from kvd.config import load_config

    config = load_config(env={}, overrides={"cluster.shards": 2, "cluster.port": 0,
                                            "cluster.report_interval_s": 0.1, "cluster.ready_grace_s": 30})
    now = [1000.0]
    coordinator = Coordinator(config, host="127.0.0.1", kv=MemoryKV(), clock=lambda: now[0])
    try:
        coordinator.register("shard-0", "tcp://127.0.0.1:1", "a0")
        now[0] += 29.0  # ten times the default grace
        coordinator._persist()  # what housekeeping does every second
        with pytest.raises(Busy, match="shard-1"):
            coordinator._client_topology()
        now[0] += 2.0
        coordinator._persist()  # what housekeeping does every second
        assert [s["id"] for s in coordinator._client_topology()["shards"]] == ["shard-0"]
    finally:
        coordinator.stop()


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_ray")
def test_a_coordinator_that_lost_its_state_goes_past_the_shards_epochs_and_keeps_broadcasting() -> None:
    from kvd.cluster.coordinator import Coordinator
    from kvd.config import load_config

    config = load_config(env={}, overrides={"cluster.shards": 2, "cluster.port": 0,
                                            "cluster.report_interval_s": 0.1})
    coordinator = Coordinator(config, host="127.0.0.1", kv=MemoryKV())
    try:
        coordinator.register("shard-0", "tcp://127.0.0.1:1", "a0", topology_epoch=5, namespaces={"m": [1, 1, 4]})
        coordinator.register("shard-1", "tcp://127.0.0.1:2", "a1", topology_epoch=5)
        epoch = coordinator._client_topology()["epoch"]
        assert epoch > 5 and coordinator.namespaces() == {"m": [1, 1, 4]}
        # a shard that was handed a newer epoch by a lost predecessor raises the floor again ...
        reply = coordinator.report(_report("shard-1", "a1", "tcp://127.0.0.1:2", epoch + 3))
        assert reply["routing"]["epoch"] > epoch + 3
        assert coordinator._client_topology()["epoch"] == reply["routing"]["epoch"]
        # ... and the level broadcaster is still there for the next order (give a wrongly stopped one time to go)
        coordinator._threads[0].join(timeout=0.5)
        assert all(t.is_alive() for t in coordinator._threads)
    finally:
        coordinator.stop()


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("no_ray")
def test_a_topology_whose_save_failed_is_not_served_and_the_save_is_retried() -> None:
    """``RayKV.save`` returns False when the GCS does not answer: the coordinator must then keep serving the last
    topology it saved (``Busy`` if none), and save again later without waiting for another change."""
    from kvd.cluster.coordinator import Coordinator
    from kvd.cluster.deploy import wait_until
    from kvd.config import load_config

    config = load_config(env={}, overrides={"cluster.shards": 2, "cluster.port": 0,
                                            "cluster.report_interval_s": 0.1})
    kv = FailingKV()
    kv.failing = True
    coordinator = Coordinator(config, host="127.0.0.1", kv=kv)
    try:
        coordinator.register("shard-0", "tcp://127.0.0.1:1", "a0")
        coordinator.register("shard-1", "tcp://127.0.0.1:2", "a1")
        assert coordinator.topology()["epoch"] > 0 and kv.data == {}
        with pytest.raises(Busy):  # complete, but not saved: a restart could not serve it again
            coordinator._client_topology()
        assert not coordinator.status()["topology_published"]

        kv.failing = False
        attempts = kv.attempts
        wait_until(lambda: coordinator.status()["topology_published"], timeout_s=10, what="the retried save")
        assert kv.attempts > attempts  # housekeeping saved it again, with no new event
        served = coordinator._client_topology()
        assert kv.data["topology_epoch"] == served["epoch"]
        assert [s["id"] for s in served["shards"]] == ["shard-0", "shard-1"]

        kv.failing = True  # a shard restarts (new incarnation, new port) while the GCS is away
        coordinator.register("shard-1", "tcp://127.0.0.1:3", "a1-bis")
        assert coordinator.topology()["epoch"] > served["epoch"]
        still = coordinator._client_topology()
        assert (still["epoch"], still["shards"]) == (served["epoch"], served["shards"])  # the saved one

        kv.failing = False
        wait_until(lambda: coordinator._client_topology()["epoch"] > served["epoch"], timeout_s=10,
                   what="the new topology, once saved")
        assert kv.data["topology_epoch"] == coordinator._client_topology()["epoch"]
        assert kv.data["shards"][1]["endpoint"] == "tcp://127.0.0.1:3"
    finally:
        coordinator.stop()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_ray")
def test_a_registration_saves_one_part_of_the_namespaces_and_a_restart_recovers_them_all() -> None:
    """What one registration writes does not grow with the namespaces that exist (one part of at most
    NAMESPACE_PART), a restarted coordinator knows every namespace, and past cluster.max_namespaces a register is
    refused with an error naming the setting."""
    from kvd.cluster.coordinator import NAMESPACE_PART, Coordinator
    from kvd.config import load_config

    n = 2 * NAMESPACE_PART + 10
    config = load_config(env={}, overrides={"cluster.shards": 1, "cluster.port": 0, "cluster.max_namespaces": n})
    kv = MemoryKV()
    first = Coordinator(config, host="127.0.0.1", kv=kv)
    try:
        for i in range(n - 1):
            assert first.add_namespace(f"n{i}", [1, 1, 4 + i % 3]) == {"ok": True}
        writes = {i: part.saves for i, part in kv.parts.items()}
        assert first.add_namespace("last", [2, 2, 8]) == {"ok": True}
        rewritten = [i for i, part in kv.parts.items() if part.saves != writes.get(i, 0)]
        assert rewritten == [n // NAMESPACE_PART]  # the last part only, not the 2 full ones before it
        assert len(kv.parts[rewritten[0]].data) <= NAMESPACE_PART and "namespaces" not in kv.data
        refused = first.add_namespace("one-too-many", [1, 1, 4])
        assert not refused["ok"] and refused["code"] == InvalidArgument.code
        assert "cluster.max_namespaces" in refused["message"]
        assert "one-too-many" not in first.namespaces()
    finally:
        first.stop()
    second = Coordinator(config, host="127.0.0.1", kv=kv)
    try:
        names = second.namespaces()
        assert len(names) == n and names["last"] == [2, 2, 8] and names["n7"] == [1, 1, 5]
    finally:
        second.stop()


@pytest.mark.timeout(60)
def test_a_registration_pushes_the_new_namespace_only_not_the_calibrations(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The push after a registration carries what it added: not every calibration the cluster keeps (a few KB
    each, to every shard, with every registration)."""
    from kvd.cluster.coordinator import Coordinator
    from kvd.config import load_config

    pushed: list[dict[str, Any]] = []

    class Recorder:
        def remote(self, payload: dict[str, Any]) -> Any:
            pushed.append(payload)
            raise LookupError("no Ray in this test: the push is recorded, not sent")

    class Handle:
        sync = Recorder()

    monkeypatch.setattr(Coordinator, "_handle", lambda self, shard_id: Handle())
    config = load_config(env={}, overrides={"cluster.shards": 1, "cluster.port": 0})
    coordinator = Coordinator(config, host="127.0.0.1", kv=MemoryKV())
    try:
        coordinator.register("shard-0", "tcp://127.0.0.1:1", "a0")
        for name in ("m", "n"):
            assert coordinator.add_namespace(name, [2, 2, 8]) == {"ok": True}
            assert coordinator.add_calibration(name, {"digest": f"d-{name}"}, True) == {"ok": True}
        pushed.clear()
        assert coordinator.add_namespace("new", [1, 1, 4]) == {"ok": True}
        # (the sync thread's pushes, of everything to a shard that registered, carry no namespaces_from)
        assert [(p["namespaces"], p.get("calibrations"), p.get("required")) for p in pushed
                if "namespaces_from" in p] == [({"new": [1, 1, 4]}, None, None)]
    finally:
        coordinator.stop()
