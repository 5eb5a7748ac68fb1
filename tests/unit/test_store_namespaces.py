"""A store with many namespaces registered: the work it repeats (a shard's idle compaction every 50 ms and after
every bulk request, ``stats`` and ``used_by_rung`` with every report) reads only the namespaces that hold
sequences, and the ones ``stats`` lists, so registering one costs the same however many are registered; the
compaction backlog stays right as a namespace empties and fills again (dropped, evicted, spilled and taken back
from the disk), and ``stats`` lists the namespaces in the same order."""

from __future__ import annotations

import numpy as np

from kvd.store import Store
from kvd.store.calibrated import STATS_NAMESPACES

MiB = 1 << 20
L, H, D, P = 2, 2, 64, 16


def kv(t: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((L, t, H, D)).astype(np.float16),
            rng.standard_normal((L, t, H, D)).astype(np.float16))


def make(capacity: int = 64 * MiB, **opts) -> Store:
    s = Store(capacity, page_tokens=P, sink_tokens=0, window_tokens=0, **opts)
    for name in ("a", "b"):
        s.register(name, num_layers=L, num_kv_heads=H, head_dim=D)
    return s


def back_to_fp16(s: Store) -> None:
    """End the lead a full store took (it compresses before it evicts or spills) with a step down: fp16 pages
    from here on."""
    s.set_level("q8", 1)
    s.set_level("fp16", 2)
    assert s.stats()["level"] == "fp16"


class ReadCounting(dict):
    """A namespace's backlog (bytes by format) that notes every read of the whole map in ``reads``."""

    def __init__(self, data: dict[str, int], name: str, reads: list[str]) -> None:
        super().__init__(data)
        self.name, self.reads = name, reads

    def items(self):  # type: ignore[override]
        self.reads.append(self.name)
        return super().items()

    def values(self):  # type: ignore[override]
        self.reads.append(self.name)
        return super().values()


def test_idle_compaction_stats_and_used_by_rung_read_only_the_namespaces_holding_sequences() -> None:
    s = make()
    for i in range(1000):
        s.register(f"idle-{i}", num_layers=L, num_kv_heads=H, head_dim=D)
    k, v = kv(4 * P, 0)
    s.append("a", 0, k, v)
    s.append("b", 0, k, v)
    s.set_level("q8", 1)
    reads: list[str] = []
    for name, ns in s._ns.items():  # the store's namespaces: one backlog map each
        ns.backlog = ReadCounting(ns.backlog, name, reads)
    before = s.stats()["compaction_backlog_bytes"]
    s.used_by_rung()
    for _ in range(4):  # a shard's idle pass: steps of doubling budgets, each asking for the backlog first
        s.compact(P)
    assert before > 0 and set(reads) == {"a", "b"}, sorted(set(reads))[:8]
    assert s.compact(1 << 30) > 0 and s.stats()["compaction_backlog_bytes"] == 0


def test_a_namespace_that_empties_and_fills_again_is_compacted_again() -> None:
    s = make()
    k, v = kv(4 * P, 1)
    s.append("a", 0, k, v)
    s.append("b", 0, k, v)
    assert s.drop("a", 0) and s.drop("b", 0)
    assert s.stats()["compaction_backlog_bytes"] == 0
    s.append("a", 1, k, v)  # "a" holds a sequence again; "b" none
    s.set_level("q8", 1)
    st = s.stats()
    assert st["compaction_backlog_bytes"] == st["bytes_by_level"]["fp16"] > 0  # every page of "a" awaits q8
    assert s.compact(1 << 30) > 0 and s.stats()["compaction_backlog_bytes"] == 0


def test_a_namespace_whose_only_sequence_was_evicted_is_compacted_again() -> None:
    k, v = kv(4 * P, 2)
    s = make(capacity=1 * MiB // 4, eviction="lru")
    s.append("a", 0, k, v)
    i = 0
    while s.lengths("a", [0]) != [None]:
        s.append("b", i, k, v)  # "b" pushes "a"'s only sequence, the least recently used, out
        i += 1
    assert s.stats()["evictions"] >= 1
    for j in range(i):
        s.drop("b", j)
    back_to_fp16(s)
    s.append("a", 1, k, v)
    s.set_level("q8", 3)
    assert s.stats()["compaction_backlog_bytes"] > 0
    assert s.compact(1 << 30) > 0 and s.stats()["compaction_backlog_bytes"] == 0


def test_a_namespace_whose_sequence_comes_back_from_the_disk_is_compacted_again(tmp_path) -> None:
    k, v = kv(4 * P, 3)
    s = make(capacity=1 * MiB // 4, disk_path=str(tmp_path), disk_bytes=64 * MiB)
    try:
        s.append("a", 0, k, v)
        i = 0
        while s.stats()["spills"] == 0:
            s.append("b", i, k, v)  # "a"'s only sequence, the least recently used, goes to the disk
            i += 1
        s.flush()
        assert "on disk" in s.explain("a", 0, 0, 1)["reasons"][0]
        for j in range(i):
            s.drop("b", j)
        back_to_fp16(s)
        k2, v2 = kv(P, 4)
        assert s.append("a", 0, k2, v2) == 5 * P  # taken back from the disk
        assert s.stats()["promotions"] == 1
        s.set_level("q8", 3)
        assert s.stats()["compaction_backlog_bytes"] > 0
        assert s.compact(1 << 30) > 0 and s.stats()["compaction_backlog_bytes"] == 0
    finally:
        s.close(persist=False)


class LookupCounting(dict):
    """The store's namespaces by name, counting the lookups of one."""

    lookups = 0

    def __getitem__(self, name: str):  # type: ignore[no-untyped-def]
        self.lookups += 1
        return super().__getitem__(name)

    def get(self, name: str, default=None):  # type: ignore[no-untyped-def, override]
        self.lookups += 1
        return super().get(name, default)


def test_stats_looks_up_only_the_namespaces_it_lists() -> None:
    s = make()
    for i in range(1000):
        s.register(f"idle-{i}", num_layers=L, num_kv_heads=H, head_dim=D)
    s.require_calibration_of("idle-7", True)
    s._ns = LookupCounting(s._ns)  # the store's namespaces, counting lookups
    st = s.stats()
    assert len(st["calibration_states"]) == STATS_NAMESPACES
    assert st["calibration_unlisted"] == 1002 - STATS_NAMESPACES
    assert s._ns.lookups <= STATS_NAMESPACES + 1, s._ns.lookups  # each listed one, and the one with a Protection


def test_stats_lists_the_namespaces_with_a_calibration_policy_first_then_the_others_by_name() -> None:
    s = make()
    names = [f"n{i:03d}" for i in range(400)]
    for name in reversed(names):
        s.register(name, num_layers=L, num_kv_heads=H, head_dim=D)
    s.require_calibration_of("n399", True)
    s.require_calibration_of("n200", True)
    s.require_calibration_of("n100", False)  # a setting of its own that attaches no calibration state
    st = s.stats()
    others = sorted({"a", "b", *names} - {"n200", "n399"})
    assert list(st["calibration_states"]) == ["n200", "n399", *others][:STATS_NAMESPACES]
    assert st["calibration_states"]["n399"] == "missing" and st["calibration_states"]["a"] == "none"
    assert st["calibration_required"] == {"n399": True, "n200": True, "n100": False}
    assert st["calibration_unlisted"] == 402 - STATS_NAMESPACES
    s.require_calibration_of("n399", None)  # back to the store's setting: no calibration state, listed by name
    assert list(s.stats()["calibration_states"])[:2] == ["n200", "a"]
