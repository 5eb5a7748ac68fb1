"""kvd.cluster.membership (pure): topology epochs, cluster pressure, one sample per round, level epochs,
recovery."""

from __future__ import annotations

import pytest

from kvd.cluster.membership import Membership, ShardReport
from kvd.errors import InvalidArgument, LayoutMismatch, UnknownNamespace
from kvd.policy import Level, Policy, PolicyConfig

pytestmark = pytest.mark.backend_independent  # the control plane's pure core: no kernel, no compiled module

INTERVAL_S = 0.5
CAP = 1000
# alpha = 1: the EWMA is the last sample, so each round's level follows from its pressure alone.
SHARP = PolicyConfig(ewma_alpha=1.0)


class Cluster:
    """A Membership plus a fake clock and fake shards that report exact figures."""

    def __init__(self, n: int = 3, *, config: PolicyConfig = SHARP, mode: str = "sum", **kwargs: object) -> None:
        self.now = 100.0
        self.ids = [f"shard-{i}" for i in range(n)]
        self.m = Membership(
            Policy(config),
            now=self.now,
            report_interval_s=INTERVAL_S,
            pressure_mode=mode,
            expected=self.ids,
            **kwargs,  # type: ignore[arg-type]
        )
        self.incarnation = {sid: f"{sid}-a" for sid in self.ids}
        self.endpoint = {sid: f"tcp://127.0.0.1:{6000 + i}" for i, sid in enumerate(self.ids)}
        self.epoch = {sid: 0 for sid in self.ids}
        self.level = {sid: "fp16" for sid in self.ids}
        self.orders: list = []

    def register(self, sid: str) -> None:
        reg = self.m.register(sid, self.endpoint[sid], incarnation=self.incarnation[sid], now=self.now)
        self.apply(sid, reg.level, reg.epoch)

    def apply(self, sid: str, level: Level, epoch: int) -> None:
        if epoch > self.epoch[sid]:  # what Store.set_level does
            self.epoch[sid], self.level[sid] = epoch, level.tag

    def report(self, sid: str, used: int, cap: int = CAP, used_by_rung: tuple[int, int, int] | None = None,
               ahead: str | None = None):
        outcome = self.m.report(
            ShardReport(
                shard_id=sid,
                incarnation=self.incarnation[sid],
                endpoint=self.endpoint[sid],
                used_bytes=used,
                capacity_bytes=cap,
                level=self.level[sid],
                epoch=self.epoch[sid],
                used_by_rung=used_by_rung,
                ahead=ahead,
            ),
            now=self.now,
        )
        for order in (outcome.order, outcome.resend):
            if order is not None:
                self.orders.append(order)
                for target in order.targets:
                    self.apply(target, order.level, order.epoch)
        return outcome

    def round(self, used: int | dict[str, int], ids: list[str] | None = None,
              by_rung: dict[str, tuple[int, int, int]] | None = None) -> None:
        """Advance one report interval; every listed shard reports."""
        self.now += INTERVAL_S
        for sid in ids if ids is not None else self.ids:
            self.report(sid, used[sid] if isinstance(used, dict) else used,
                        used_by_rung=(by_rung or {}).get(sid))

    def start(self) -> Cluster:
        for sid in self.ids:
            self.register(sid)
        return self


# -------------------------------------------------------------------------------------------- topology


def test_registration_builds_the_topology_with_increasing_epochs() -> None:
    c = Cluster(3)
    c.register("shard-0")
    t1 = c.m.topology()
    assert t1["shards"] == [{"id": "shard-0", "endpoint": c.endpoint["shard-0"]}]
    c.register("shard-1")
    c.register("shard-2")
    t2 = c.m.topology()
    assert t2["epoch"] > t1["epoch"]
    assert [s["id"] for s in t2["shards"]] == c.ids
    c.register("shard-1")  # the same process again: nothing changes
    assert c.m.topology() == t2


def test_fresh_cluster_starts_at_epoch_one_with_the_minimum_level() -> None:
    c = Cluster(2).start()
    assert (c.m.level, c.m.epoch) == (Level.FP16, 1)
    assert c.epoch == {"shard-0": 1, "shard-1": 1}  # a new store (epoch 0) applies it
    aggressive = Cluster(2, config=PolicyConfig.aggressive()).start()
    assert aggressive.level == {"shard-0": "q8", "shard-1": "q8"}
    assert aggressive.m.topology()["level"] == "q8" and aggressive.m.topology()["level_epoch"] == 1


def test_restarted_shard_gets_a_new_endpoint_a_new_topology_epoch_and_the_current_level() -> None:
    c = Cluster(2).start()
    c.round(900)  # 0.90 -> q8 at epoch 2
    assert c.m.level is Level.Q8
    before = c.m.topology()["epoch"]
    c.incarnation["shard-1"] = "shard-1-b"
    c.endpoint["shard-1"] = "tcp://127.0.0.1:7001"
    c.epoch["shard-1"], c.level["shard-1"] = 0, "fp16"  # the process came back with an empty store
    c.register("shard-1")
    topo = c.m.topology()
    assert topo["epoch"] == before + 1
    assert {"id": "shard-1", "endpoint": "tcp://127.0.0.1:7001"} in topo["shards"]
    assert (c.level["shard-1"], c.epoch["shard-1"]) == ("q8", c.m.epoch)
    assert [s.restarts for s in c.m.shards()] == [0, 1]


def test_report_from_an_unknown_shard_asks_it_to_register() -> None:
    c = Cluster(1)
    assert c.report("shard-0", 10).known is False
    c.register("shard-0")
    assert c.report("shard-0", 10).known is True
    c.incarnation["shard-0"] = "other"  # a process the coordinator has not seen register
    assert c.report("shard-0", 10).known is False


def test_silent_shard_is_marked_down_but_stays_in_the_topology() -> None:
    c = Cluster(3).start()
    c.round(100)
    for _ in range(10):
        c.round(100, ids=["shard-0", "shard-1"])
    snap = c.m.snapshot(c.now)
    up = {s["id"]: s["up"] for s in snap["shards"]}
    assert up == {"shard-0": True, "shard-1": True, "shard-2": False}
    assert [s["id"] for s in c.m.topology()["shards"]] == c.ids  # routing must not move its sequences
    c.round(100)  # it reports again: up
    assert all(s.up for s in c.m.shards())


def test_remove_forgets_a_shard_and_bumps_the_topology_epoch() -> None:
    c = Cluster(2).start()
    epoch = c.m.topology_epoch
    assert c.m.remove("shard-1") is True
    assert c.m.remove("shard-1") is False
    assert c.m.topology_epoch == epoch + 1
    assert [s["id"] for s in c.m.topology()["shards"]] == ["shard-0"]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="pressure_mode"):
        Membership(Policy(), now=0.0, report_interval_s=1.0, pressure_mode="mean")
    with pytest.raises(InvalidArgument, match="report_interval_s"):
        Membership(Policy(), now=0.0, report_interval_s=0.0)
    c = Cluster(1)
    with pytest.raises(InvalidArgument, match="endpoint"):
        c.m.register("shard-0", "", incarnation="x", now=0.0)
    ids = dict(shard_id="s", incarnation="i", endpoint="e")
    with pytest.raises(InvalidArgument, match="used_bytes"):
        ShardReport(**ids, used_bytes=-1, capacity_bytes=1, level="q8", epoch=0)
    with pytest.raises(InvalidArgument, match="q3"):
        ShardReport(**ids, used_bytes=1, capacity_bytes=1, level="q3", epoch=0)


# -------------------------------------------------------------------------------------------- pressure


def test_sum_mode_weights_by_capacity_and_max_mode_takes_the_fullest_shard() -> None:
    for mode, expected in (("sum", (900 + 100) / (1000 + 3000)), ("max", 0.9)):
        c = Cluster(2, mode=mode).start()
        c.now += INTERVAL_S
        c.report("shard-0", 900, cap=1000)
        c.report("shard-1", 100, cap=3000)
        assert c.m.cluster_pressure() == pytest.approx(expected)
    # The same figures move the cluster to q8 in max mode only.
    assert c.m.level is Level.Q8


def test_one_policy_sample_per_round_whatever_the_number_of_shards() -> None:
    for n in (1, 2, 4, 8):
        c = Cluster(n).start()
        for _ in range(5):
            c.round(100)
        assert c.m.snapshot(c.now)["samples"] == 5, n


def test_a_silent_shard_delays_a_round_by_at_most_two_intervals() -> None:
    c = Cluster(2).start()
    c.round(100)
    samples = c.m.snapshot(c.now)["samples"]
    c.now += INTERVAL_S
    c.report("shard-0", 100)
    assert c.m.snapshot(c.now)["samples"] == samples  # waiting for shard-1
    c.now += INTERVAL_S
    c.report("shard-0", 100)
    assert c.m.snapshot(c.now)["samples"] == samples + 1  # the round closed without it


def test_no_level_decision_before_every_expected_shard_has_reported() -> None:
    c = Cluster(3)
    c.register("shard-0")
    c.round(990, ids=["shard-0"])
    assert c.m.level is Level.FP16 and c.orders == []
    c.register("shard-1")
    c.register("shard-2")
    c.round(990)
    assert c.m.level is Level.Q4


def test_warm_up_ends_after_stale_after_even_if_a_shard_never_reports() -> None:
    c = Cluster(2)
    c.register("shard-0")
    for _ in range(int(c.m.stale_after_s / INTERVAL_S) + 1):
        c.round(990, ids=["shard-0"])
    assert c.m.level is Level.Q4


# ----------------------------------------------------------------------------------------------- levels


def test_rising_pressure_moves_every_shard_to_q8_then_q4_with_one_epoch_each() -> None:
    c = Cluster(3).start()
    c.round(500)
    assert c.orders == [] and c.m.level is Level.FP16
    c.round(850)
    q8 = c.orders[-1]
    assert (q8.level, q8.epoch, q8.targets) == (Level.Q8, 2, tuple(c.ids))
    assert set(c.epoch.values()) == {2} and set(c.level.values()) == {"q8"}
    c.round(960)
    q4 = c.orders[-1]
    assert (q4.level, q4.epoch) == (Level.Q4, 3)
    assert set(c.epoch.values()) == {3} and set(c.level.values()) == {"q4"}
    assert c.m.epoch == 3 and c.m.topology()["level"] == "q4"


def test_falling_pressure_steps_down_only_past_the_hysteresis_margin() -> None:
    c = Cluster(2).start()
    c.round(960)
    assert c.m.level is Level.Q4
    c.round(910)  # below 0.95 but inside the 0.05 margin
    assert c.m.level is Level.Q4
    c.round(890)  # below 0.90: back to the 8-bit rung
    assert c.m.level is Level.Q8
    c.round(760)  # inside the margin of 0.80
    assert c.m.level is Level.Q8
    c.round(100)
    assert c.m.level is Level.FP16
    epochs = [o.epoch for o in c.orders]
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs)
    assert c.m.snapshot(c.now)["downgrades"] == 2


def test_shard_reporting_an_old_epoch_is_sent_the_current_order() -> None:
    c = Cluster(2).start()
    c.round(900)
    c.epoch["shard-1"], c.level["shard-1"] = 1, "fp16"  # pretend the broadcast to shard-1 was lost
    c.now += INTERVAL_S
    outcome = c.report("shard-1", 900)
    assert outcome.resend is not None
    assert (outcome.resend.level, outcome.resend.epoch, outcome.resend.targets) == (Level.Q8, 2, ("shard-1",))
    assert c.report("shard-1", 900).resend is None  # applied: nothing more to send


def test_history_records_crossing_decision_application_and_relief() -> None:
    c = Cluster(2).start()
    c.round(500)
    crossed_at = c.now + INTERVAL_S
    c.round(850)
    change = c.m.history()[-1]
    assert change.level == "q8" and change.threshold == pytest.approx(0.80)
    assert change.crossed_at == crossed_at and change.decided_at == crossed_at
    # The reports of this round carried the old epoch; the acknowledgements of the broadcast complete it.
    assert change.applied_at is None and set(change.pending) == set(c.ids)
    c.now += 0.01
    for sid in c.ids:
        c.m.acknowledge(sid, change.epoch, now=c.now)
    change = c.m.history()[-1]
    assert change.pending == () and change.applied_at == c.now
    c.round(780)  # re-compression freed memory: below the threshold, inside the hysteresis band
    assert c.m.level is Level.Q8
    assert c.m.history()[-1].relieved_at == c.now


# --------------------------------------------------------------------------------------------- recovery


def test_recovered_coordinator_continues_the_epoch_and_keeps_the_level_inside_its_band() -> None:
    c = Cluster(2, recovered_epoch=7, recovered_level="q4", recovered_topology_epoch=5)
    c.epoch = {sid: 7 for sid in c.ids}
    c.level = {sid: "q4" for sid in c.ids}
    c.start()
    assert c.m.epoch == 7 and c.m.topology_epoch > 5
    c.round(920)  # a fresh policy would say q8 for 0.92; inside q4's hysteresis band the level holds
    assert c.m.level is Level.Q4 and c.orders == []
    fresh = Policy(SHARP)
    assert fresh.observe(0.92) is Level.Q8
    c.round(500)
    assert c.orders[-1].epoch == 8 and c.orders[-1].level is Level.FP16


def test_a_shard_with_a_newer_epoch_raises_the_floor() -> None:
    c = Cluster(2)  # persisted state lost: the coordinator thinks the cluster is new (epoch 1)
    c.start()
    c.epoch = {sid: 12 for sid in c.ids}
    c.level = {sid: "q8" for sid in c.ids}
    c.round(850)
    assert c.m.epoch == 12 and c.m.level is Level.Q8 and c.orders == []
    c.round(990)
    assert c.orders[-1].epoch == 13 and c.orders[-1].level is Level.Q4


def test_report_outcome_carries_the_level_and_epoch_in_force_together() -> None:
    c = Cluster(2).start()
    c.now += INTERVAL_S
    c.report("shard-0", 900)
    outcome = c.report("shard-1", 900)  # completes the round: the decision happens inside this report
    assert outcome.order is not None
    assert (outcome.level, outcome.epoch) == (Level.Q8, 2) == (outcome.order.level, outcome.order.epoch)
    c.incarnation["shard-0"] = "gone"
    unknown = c.report("shard-0", 900)
    assert unknown.known is False and unknown.level is None and unknown.epoch is None


# ------------------------------------------------------------------------------ every shard counts, step downs


def test_the_default_mode_sees_a_single_full_shard() -> None:
    """The scenario of the issue: three shards at 0.84, one of them taken to 0.98 by one more sequence. The
    sum (0.89) never reaches q4; the default mode (the fullest shard) does."""
    fill = {"shard-0": 980, "shard-1": 840, "shard-2": 840}
    default = Membership(Policy(SHARP), now=0.0, report_interval_s=INTERVAL_S)
    assert default.snapshot(0.0)["pressure_mode"] == "max"
    for mode, want in (("max", Level.Q4), ("sum", Level.Q8)):
        c = Cluster(mode=mode).start()
        c.round(fill)
        assert c.m.level is want, mode
        snap = c.m.snapshot(c.now)
        assert snap["pressure_sum"] == pytest.approx(2660 / 3000) and snap["pressure_max"] == 0.98
        assert snap["imbalance"] == pytest.approx(0.98 / (2660 / 3000))


def test_compression_does_not_pass_for_a_drop_in_demand() -> None:
    """After a rise the shards re-compress and report less used; the data re-counted at fp16 is still more
    than the memory, so the level holds: one change, no flapping, whatever the number of rounds."""
    c = Cluster(mode="max").start()
    c.round(900)
    assert c.m.level is Level.Q8
    for _ in range(40):
        c.round(520, by_rung={sid: (1000, 520, 330) for sid in c.ids})
    assert c.m.level is Level.Q8 and c.m.epoch == 2
    snap = c.m.snapshot(c.now)
    assert snap["policy_reason"].startswith("held at q8") and snap["reason"].startswith("up to q8")
    for _ in range(5):  # sequences dropped: the data would fit at fp16 now
        c.round(300, by_rung={sid: (580, 300, 190) for sid in c.ids})
    assert c.m.level is Level.FP16 and c.m.epoch == 3
    history = c.m.snapshot(c.now)["history"]
    assert [h["level"] for h in history] == ["q8", "fp16"]
    assert history[-1]["reason"].startswith("down to fp16") and history[0]["reason"].startswith("up to q8")
    assert c.orders[-1].reason == history[-1]["reason"]


def test_reports_refuse_malformed_recounts() -> None:
    base = dict(shard_id="s", incarnation="i", endpoint="e", used_bytes=1, capacity_bytes=2, level="fp16",
                epoch=0)
    for bad in ((1, 2), (1, 2, -3), (1, 2, True), ("1", 2, 3)):
        with pytest.raises(InvalidArgument, match="used_by_rung"):
            ShardReport(**base, used_by_rung=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        ShardReport(**base, ahead="q5")
    assert ShardReport(**base, used_by_rung=[3, 2, 1]).used_by_rung == (3, 2, 1)  # type: ignore[arg-type]


def test_shards_running_ahead_pull_the_cluster_up_to_their_level() -> None:
    """Shards that compressed themselves to q4 to make room hover below the q4 threshold once they evicted or
    freed memory; their lead counts as that rung's threshold, so the cluster's level catches up with them."""
    c = Cluster(mode="max").start()
    for _ in range(3):
        for sid in c.ids:
            c.report(sid, 900, ahead="q4")  # measured 0.90: below 0.95, but they ran ahead to q4
        c.now += INTERVAL_S
    assert c.m.level is Level.Q4
    c2 = Cluster(mode="max").start()
    c2.round(500)
    assert c2.m.level is Level.FP16
    c2.now += INTERVAL_S
    for sid in c2.ids:
        c2.report(sid, 500, ahead="q8" if sid == "shard-1" else None)  # one shard filled up at fp16
    assert c2.m.level is Level.Q8


# ------------------------------------------------------------------------- lifecycle (issue 18, items 1-2)


def test_namespaces_are_registered_once_for_the_cluster_and_handed_to_every_shard() -> None:
    c = Cluster(2).start()
    version, names = c.m.namespaces()
    assert names == {}
    assert c.m.add_namespace("smollm2", (30, 3, 64)) is True
    assert c.m.add_namespace("smollm2", (30, 3, 64)) is False  # the same layout again: nothing changes
    with pytest.raises(LayoutMismatch, match="smollm2"):
        c.m.add_namespace("smollm2", (30, 3, 128))
    v2, names = c.m.namespaces()
    assert names == {"smollm2": (30, 3, 64)} and v2 > version
    # a shard that joins (or comes back empty) learns them from its registration, with the routing
    c.incarnation["shard-1"] = "shard-1-b"
    c.register("shard-1")
    assert c.m.shard_sync(topology_epoch=0, namespaces_version=0)["namespaces"] == {"smollm2": [30, 3, 64]}
    # a shard's own namespaces (registered while the coordinator was away) join the cluster's
    c.m.register("shard-0", c.endpoint["shard-0"], incarnation="shard-0-a", now=c.now,
                 namespaces={"llama": (2, 2, 8), "smollm2": (30, 3, 128)})
    assert c.m.namespaces()[1] == {"smollm2": (30, 3, 64), "llama": (2, 2, 8)}  # the first layout stays


def test_a_shard_in_sync_is_sent_nothing() -> None:
    c = Cluster(2).start()
    c.m.add_namespace("m", (1, 1, 4))
    sync = c.m.shard_sync(topology_epoch=0, namespaces_version=0)
    assert sync["routing"] == {"epoch": c.m.topology_epoch, "shards": c.ids}
    again = c.m.shard_sync(topology_epoch=sync["routing"]["epoch"], namespaces_version=sync["namespaces_version"])
    assert "routing" not in again and "namespaces" not in again


def test_a_shard_behind_is_sent_only_the_namespaces_it_lacks() -> None:
    """What a registration costs does not grow with the namespaces that exist: a shard one behind gets one."""
    c = Cluster(2).start()
    for i in range(300):
        c.m.add_namespace(f"n{i}", (1, 1, 4))
    version = c.m.namespaces_version
    c.m.add_namespace("new", (2, 2, 8))
    sync = c.m.shard_sync(topology_epoch=0, namespaces_version=version)
    assert sync["namespaces"] == {"new": [2, 2, 8]} and sync["namespaces_from"] == version
    assert sync["namespaces_version"] == version + 1
    assert list(c.m.shard_sync(topology_epoch=0, namespaces_version=version - 2)["namespaces"]) == \
        ["n298", "n299", "new"]
    # a version this coordinator cannot place (newer than its own: it lost its state) gets them all
    full = c.m.shard_sync(topology_epoch=0, namespaces_version=version + 50)
    assert len(full["namespaces"]) == 301 and "namespaces_from" not in full


def test_a_recovered_coordinator_sends_deltas_after_its_own_additions_and_all_before_them() -> None:
    c = Cluster(2).start()
    for i in range(5):
        c.m.add_namespace(f"n{i}", (1, 1, 4))
    state = c.m.state()
    assert "namespaces" not in state  # persisted apart, in parts (namespace_part)
    assert c.m.namespace_part(1, 2) == {"n2": [1, 1, 4], "n3": [1, 1, 4]}
    r = Cluster(2, recovered_namespaces={**c.m.namespace_part(0, 2), **c.m.namespace_part(1, 2),
                                         **c.m.namespace_part(2, 2)},
                recovered_namespaces_version=state["namespaces_version"]).start()
    r.m.add_namespace("later", (1, 1, 8))
    assert r.m.shard_sync(topology_epoch=0, namespaces_version=5)["namespaces"] == {"later": [1, 1, 8]}
    everything = r.m.shard_sync(topology_epoch=0, namespaces_version=3)  # from before the restart
    assert len(everything["namespaces"]) == 6 and "namespaces_from" not in everything


def test_namespaces_past_the_limit_are_refused_with_an_error_naming_it() -> None:
    c = Cluster(2, max_namespaces=3).start()
    for i in range(3):
        assert c.m.add_namespace(f"n{i}", (1, 1, 4)) is True
    with pytest.raises(InvalidArgument, match=r"cluster.max_namespaces = 3"):
        c.m.add_namespace("n3", (1, 1, 4))
    assert c.m.add_namespace("n0", (1, 1, 4)) is False  # a known one is still fine
    assert c.m.namespace_count == 3


def test_no_topology_is_published_before_every_expected_shard_has_registered() -> None:
    c = Cluster(3)
    c.register("shard-0")
    c.register("shard-1")
    assert c.m.published_topology(c.now) is None  # 2 of 3: clients would route shard-2's sequences elsewhere
    assert "routing" not in c.m.shard_sync(topology_epoch=0, namespaces_version=0)  # nor do shards enforce it
    c.register("shard-2")
    topo = c.m.published_topology(c.now)
    assert topo is not None and [s["id"] for s in topo["shards"]] == c.ids


def test_a_shard_that_never_comes_leaves_the_others_published_after_a_grace() -> None:
    c = Cluster(3)
    c.register("shard-0")
    c.register("shard-1")
    c.now += c.m.ready_grace_s - 0.1
    assert c.m.published_topology(c.now) is None
    c.now += 0.2
    assert [s["id"] for s in c.m.published_topology(c.now)["shards"]] == ["shard-0", "shard-1"]


def test_a_recovered_coordinator_serves_the_persisted_topology_at_once_under_its_epoch() -> None:
    c = Cluster(3).start()
    c.m.add_namespace("m", (1, 1, 4))
    before = c.m.published_topology(c.now)
    state = c.m.state()
    # what the coordinator persisted is enough to serve the same topology, under the same epoch, at once
    r = Cluster(3, recovered_epoch=state["epoch"], recovered_level=state["level"],
                recovered_topology_epoch=state["topology_epoch"], recovered_shards=state["shards"],
                recovered_namespaces=c.m.namespace_part(0, 256),
                recovered_namespaces_version=state["namespaces_version"])
    assert r.m.published_topology(r.now) == before
    assert r.m.namespaces() == c.m.namespaces()
    r.start()  # the same processes register again: nothing moved, the epoch stays
    assert r.m.published_topology(r.now) == before
    r.incarnation["shard-2"] = "shard-2-b"  # one restarted meanwhile, even on the same port: a newer epoch
    r.register("shard-2")
    assert r.m.published_topology(r.now)["epoch"] > before["epoch"]


def test_a_coordinator_that_lost_its_state_never_reuses_a_topology_epoch_the_shards_know() -> None:
    c = Cluster(3)
    for sid in c.ids:
        c.m.register(sid, c.endpoint[sid], incarnation=c.incarnation[sid], now=c.now, topology_epoch=9)
    assert c.m.published_topology(c.now)["epoch"] > 9
    c2 = Cluster(2).start()
    epoch = c2.m.topology_epoch
    c2.now += INTERVAL_S
    c2.m.report(ShardReport(shard_id="shard-0", incarnation="shard-0-a", endpoint=c2.endpoint["shard-0"],
                            used_bytes=0, capacity_bytes=CAP, level="fp16", epoch=1, topology_epoch=epoch + 5),
                now=c2.now)
    assert c2.m.topology_epoch > epoch + 5


def record(digest: str) -> dict[str, object]:
    """A calibration record as the coordinator keeps it (checked by the shard that served it)."""
    return {"version": 1, "model": "m", "digest": digest}


def test_a_calibration_lives_with_its_namespace_and_reaches_every_shard() -> None:
    c = Cluster(2).start()
    c.m.add_namespace("m", (2, 2, 8))
    with pytest.raises(UnknownNamespace, match="'nope' is not registered"):
        c.m.set_calibration("nope", record("a"))
    before = c.m.calibrations_version
    assert c.m.set_calibration("m", record("a")) is True
    assert c.m.set_calibration("m", record("a")) is False  # the same digest again: nothing changes
    assert c.m.state()["calibrations_version"] == before + 1
    # a shard that registers (fresh, or restarted empty) is sent every calibration
    assert c.m.shard_sync(topology_epoch=0, namespaces_version=0)["calibrations"] == {"m": record("a")}
    # one in sync is sent none; one behind only those set after its version, with that version
    assert "calibrations" not in c.m.shard_sync(topology_epoch=0, namespaces_version=0,
                                                calibrations_version=before + 1)
    c.m.add_namespace("n", (1, 1, 4))
    c.m.set_calibration("n", record("b"))
    c.m.set_calibration("m", record("c"))  # a new calibration replaces the namespace's
    sync = c.m.shard_sync(topology_epoch=0, namespaces_version=0, calibrations_version=before + 2)
    assert sync["calibrations"] == {"m": record("c")} and sync["calibrations_from"] == before + 2
    assert sync["calibrations_version"] == before + 3
    # a shard's own (from its disk tier) join where the cluster has none, and only for known namespaces
    c.m.add_namespace("o", (1, 1, 4))
    c.m.register("shard-0", c.endpoint["shard-0"], incarnation="shard-0-a", now=c.now,
                 calibrations={"m": record("old"), "o": record("d"), "unknown": record("e")})
    assert c.m.calibrations() == {"m": record("c"), "n": record("b"), "o": record("d")}


def test_a_recovered_coordinator_keeps_calibrations_and_sends_all_to_a_shard_it_cannot_place() -> None:
    c = Cluster(2).start()
    c.m.add_namespace("m", (2, 2, 8))
    c.m.set_calibration("m", record("a"))
    version = c.m.state()["calibrations_version"]
    r = Cluster(2, recovered_namespaces={"m": (2, 2, 8)}, recovered_calibrations=c.m.calibrations(),
                recovered_calibrations_version=version).start()
    assert r.m.calibrations() == {"m": record("a")}
    assert "calibrations" not in r.m.shard_sync(topology_epoch=0, namespaces_version=0,
                                                calibrations_version=version)
    assert r.m.shard_sync(topology_epoch=0, namespaces_version=0,
                          calibrations_version=version - 1)["calibrations"] == {"m": record("a")}
    r.m.set_calibration("m", record("b"))
    assert r.m.shard_sync(topology_epoch=0, namespaces_version=0,
                          calibrations_version=version)["calibrations"] == {"m": record("b")}


def test_a_namespaces_own_require_calibration_lives_with_its_calibration_and_reaches_every_shard() -> None:
    c = Cluster(2).start()
    c.m.add_namespace("m", (2, 2, 8))
    c.m.add_namespace("n", (1, 1, 4))
    with pytest.raises(InvalidArgument, match="needs a record, require, or both"):
        c.m.set_calibration("m", None)
    with pytest.raises(InvalidArgument, match="require must be a bool"):
        c.m.set_calibration("m", None, 1)  # type: ignore[arg-type]
    with pytest.raises(UnknownNamespace, match="'nope' is not registered"):
        c.m.set_calibration("nope", None, True)
    before = c.m.calibrations_version
    assert c.m.set_calibration("m", None, True) is True  # the setting alone
    assert c.m.set_calibration("m", None, True) is False  # the same again: nothing changes
    assert c.m.required() == {"m": True} and c.m.calibrations() == {}
    assert c.m.state()["calibrations_version"] == before + 1
    # a registering shard is sent it, beside the calibrations
    sync = c.m.shard_sync(topology_epoch=0, namespaces_version=0)
    assert sync["required"] == {"m": True} and sync["calibrations"] == {}
    # a calibration with the same setting changes the record only, and keeps the setting
    assert c.m.set_calibration("m", record("a"), True) is True
    assert c.m.required() == {"m": True} and c.m.calibrations() == {"m": record("a")}
    # a shard behind gets what changed after its version: here n's setting only
    assert c.m.set_calibration("n", None, False) is True
    sync = c.m.shard_sync(topology_epoch=0, namespaces_version=0, calibrations_version=before + 2)
    assert (sync["required"], sync["calibrations"], sync["calibrations_from"]) == ({"n": False}, {}, before + 2)
    # a shard's own settings (from its disk tier) join where the cluster has none, for known namespaces only
    c.m.add_namespace("o", (1, 1, 4))
    c.m.register("shard-0", c.endpoint["shard-0"], incarnation="shard-0-a", now=c.now,
                 required={"m": False, "o": True, "unknown": True})
    assert c.m.required() == {"m": True, "n": False, "o": True}
    # a recovered coordinator keeps them, and sends them all to a shard it cannot place
    version = c.m.state()["calibrations_version"]
    r = Cluster(2, recovered_namespaces={"m": (2, 2, 8), "n": (1, 1, 4), "o": (1, 1, 4)},
                recovered_calibrations=c.m.calibrations(), recovered_required=c.m.required(),
                recovered_calibrations_version=version).start()
    assert r.m.required() == {"m": True, "n": False, "o": True}
    assert "required" not in r.m.shard_sync(topology_epoch=0, namespaces_version=0, calibrations_version=version)
    assert r.m.shard_sync(topology_epoch=0, namespaces_version=0,
                          calibrations_version=version - 1)["required"] == {"m": True, "n": False, "o": True}
