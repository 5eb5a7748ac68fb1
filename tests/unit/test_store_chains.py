"""Prefix-aware eviction (kvd.store.chains): the order against a model, stale tails before deep ones, and a full
store giving up a chain's unreachable blocks first, then chain tails, then by recency."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvd.errors import ConfigError, InvalidArgument, UnknownSequence
from kvd.store import Store
from kvd.store.chains import (
    GHOSTS,
    INNER,
    STALE_FACTOR,
    STALE_QUANTILE,
    TAIL,
    UNREACHABLE,
    Chains,
    bucket_floor,
    reuse_bucket,
)

KEYS = list(range(7))


class ChainsModel(RuleBasedStateMachine):
    """Chains against the rule written out: a key is unreachable when its parent is unreachable, or when its
    parent left the store for good (evicted, dropped, or dropped from disk) while the key was held and has not
    come back; a parent the store did not hold when the key came leaves it reachable. The victim is the key of the
    lowest tier (unreachable, then tails, then keys some key in memory names as parent), then the deepest, then
    the least recently used; but when that is a tail, the least recently used tail unused for longer than the
    staleness bound goes first. The bound: STALE_FACTOR x the STALE_QUANTILE quantile of the reuse distances (a
    key used again, in memory or back after it left: uses since its last one), taken at the floor of its bucket
    (reuse_bucket), recomputed every REUSE_EVERY new distances once REUSE_MIN are known."""

    REUSE_MIN, REUSE_EVERY = 3, 2  # (small, so that the bound comes into play within a few steps)

    def __init__(self) -> None:
        super().__init__()
        self.chains = Chains(reuse_min=self.REUSE_MIN, reuse_every=self.REUSE_EVERY)
        self.reuse: list[int] = []
        self.fresh = 0  # distances since the bound was computed
        self.bound: int | None = None
        self.left_at: dict[int, int] = {}  # key that left memory -> its last use
        self.mem: dict[int, int | None] = {}  # key in memory -> the parent it named
        self.depth: dict[int, int] = {}
        self.orphan: set[int] = set()  # keys in memory whose parent left for good while they were held
        self.disk: set[int] = set()
        self.used: dict[int, int] = {}
        self.clock = 0

    def _use(self, key: int) -> None:
        self.clock += 1
        last = self.used[key] if key in self.mem and key in self.used else self.left_at.pop(key, None)
        if last is not None:
            self.reuse.append(self.clock - last)
            self.fresh += 1
            if self.fresh >= self.REUSE_EVERY and len(self.reuse) >= self.REUSE_MIN:
                self.fresh = 0
                ordered = sorted(self.reuse)
                at = ordered[min(len(ordered) - 1, int(STALE_QUANTILE * len(ordered)))]
                self.bound = int(STALE_FACTOR * bucket_floor(reuse_bucket(at)))
        self.used[key] = self.clock

    def _enter(self, key: int, parent: int | None, depth: int) -> None:
        self.orphan.discard(key)
        self.orphan -= {c for c, p in self.mem.items() if p == key}  # its children are found again
        self._use(key)
        self.mem[key], self.depth[key] = parent, depth

    @rule(key=st.sampled_from(KEYS), parent=st.none() | st.sampled_from(KEYS), depth=st.integers(0, 2))
    def add(self, key: int, parent: int | None, depth: int) -> None:
        """A sequence created in memory; its parent is an earlier key (a chain of hashes has no cycle: see
        test_parents_in_a_cycle_still_give_a_victim)."""
        if parent is not None and parent >= key:
            parent = None
        if key in self.disk:
            return  # (an append to a sequence on disk promotes it)
        if key in self.mem:
            with pytest.raises(ValueError):
                self.chains.add(key, parent, depth=depth)
            return
        self.chains.add(key, parent, depth=depth)
        self._enter(key, parent, depth)

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: int) -> None:
        self.chains.touch(key)
        if key in self.mem:
            self._use(key)

    @rule(key=st.sampled_from(KEYS), to_disk=st.booleans())
    def remove(self, key: int, to_disk: bool) -> None:
        """Evicted or dropped (gone), or spilled (on disk); a key on disk may also be dropped from there."""
        if key not in self.mem and key not in self.disk:
            return
        held = to_disk and key in self.mem
        self.chains.remove(key, held=held)
        children = {c for c, p in self.mem.items() if p == key}
        if held:
            self.disk.add(key)
            self.orphan -= children
        else:
            self.disk.discard(key)
            self.orphan |= children
        if key in self.mem:
            self.left_at[key] = self.used[key]
        self.mem.pop(key, None)
        self.orphan.discard(key)

    @rule(key=st.sampled_from(KEYS))
    def promote(self, key: int) -> None:
        """Back from disk: the link to its parent is not kept there."""
        if key in self.disk:
            self.chains.add(key, depth=self.depth[key])
            self.disk.discard(key)
            self._enter(key, None, self.depth[key])

    def reachable(self, key: int) -> bool:
        while True:
            if key in self.orphan:
                return False
            parent = self.mem[key]
            if parent not in self.mem:  # none, on disk, or not held when the key came
                return True
            key = parent

    def tier(self, key: int) -> int:
        if not self.reachable(key):
            return UNREACHABLE
        return INNER if any(p == key for p in self.mem.values()) else TAIL

    @invariant()
    def same_tiers_and_victims(self) -> None:
        assert len(self.chains) == len(self.mem)
        for key in self.mem:
            assert self.chains.tier(key) == self.tier(key), key
        assert self.chains.stale_after == self.bound
        for exclude in [None, *self.mem]:
            rest = [k for k in self.mem if k != exclude]
            want = min(rest, key=lambda k: (self.tier(k), -self.depth[k], self.used[k])) if rest else None
            if want is not None and self.tier(want) == TAIL and self.bound is not None:
                stale = [k for k in rest if self.tier(k) == TAIL and self.clock - self.used[k] > self.bound]
                if stale:
                    want = min(stale, key=lambda k: self.used[k])
            assert self.chains.victim(exclude) == want


TestChainsModel = ChainsModel.TestCase
TestChainsModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_parents_in_a_cycle_still_give_a_victim() -> None:
    chains = Chains()
    chains.add("a", "b")
    chains.add("b", "a")
    chains.add("c", "c")  # its own parent: no link
    assert chains.tier("c") == TAIL
    order = []
    while (v := chains.victim()) is not None:
        order.append(v)
        chains.remove(v)
    assert sorted(order) == ["a", "b", "c"]


def test_a_victim_costs_log_n_when_uses_leave_stale_entries() -> None:
    chains = Chains()
    for k in range(100):
        chains.add(k, k - 1 if k % 10 else None)
    for _ in range(50):
        for k in range(100):
            chains.touch(k)
    assert len(chains._heap) <= 2 * len(chains) + 64  # rebuilt: outdated entries never outnumber live ones
    assert len(chains._recent) <= 2 * len(chains) + 64
    assert chains.victim() == 9  # the oldest chain's tail


def test_a_reuse_distance_is_counted_in_a_bucket_a_quarter_of_its_power_of_two_wide() -> None:
    assert [reuse_bucket(d) for d in range(9)] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    for d in [*range(1, 5000), 2**40 + 12345, 2**64 - 1]:
        floor = bucket_floor(reuse_bucket(d))
        assert floor <= d < bucket_floor(reuse_bucket(d) + 1)
        assert d - floor <= max(0, d // 4), d
    assert reuse_bucket(2**64 - 1) < 4 * 64


def _cycle(chains: Chains, keys: list[str], times: int) -> None:
    for _ in range(times):
        for key in keys:
            chains.touch(key)


def test_a_chain_nobody_uses_any_more_goes_before_the_deep_blocks_of_chains_in_use() -> None:
    # Prompts that changed: an old prompt's two blocks, then 8 chains of 4 blocks, each a live prompt's, used in
    # turn (a reuse distance of 32 uses). Depth alone would give up a live chain's last block first and keep the
    # old prompt's blocks for ever.
    chains = Chains()
    chains.add("old-0", depth=0)
    chains.add("old-1", "old-0", depth=128)
    live = [f"p{i}-{d}" for i in range(8) for d in range(4)]
    for key in live:
        i, d = key[1:].split("-")
        chains.add(key, f"p{i}-{int(d) - 1}" if d != "0" else None, depth=int(d) * 128)
    assert chains.victim() == "p0-3", "the order learns nothing before enough reuse is known: depth first"
    _cycle(chains, live, 5)  # 160 reuse distances of 32
    assert chains.stale_after == int(STALE_FACTOR * 32)
    order = []
    while len(order) < 2:
        order.append(victim := chains.victim())
        chains.remove(victim)
    assert order == ["old-1", "old-0"], "the stale chain goes first, tail then head"
    assert chains.victim() == "p0-3", "then the deepest of the chains in use, as before"


def test_a_workload_whose_prompts_recur_keeps_the_depth_order() -> None:
    # Every chain used within the bound: nothing is stale, the deepest tail goes first.
    chains = Chains()
    keys = [f"p{i}-{d}" for i in range(8) for d in range(3)]
    for key in keys:
        i, d = key[1:].split("-")
        chains.add(key, f"p{i}-{int(d) - 1}" if d != "0" else None, depth=int(d) * 128)
    _cycle(chains, keys, 6)
    assert chains.stale_after is not None
    assert chains.victim() == "p0-2"


def test_a_sequence_stored_again_after_its_eviction_counts_its_reuse_and_the_memory_of_departures_is_bounded(
        ) -> None:
    chains = Chains(reuse_min=1, reuse_every=1)
    chains.add("a")
    for i in range(99):
        chains.add(f"x{i}")
    chains.remove("a")  # evicted, 99 uses after its last one ...
    chains.add("a")  # ... and stored again at the 100th: one reuse distance of 100 (counted as 96-111)
    assert chains.stale_after == int(STALE_FACTOR * 96)
    for i in range(3 * GHOSTS):
        chains.add(f"y{i}")
        chains.remove(f"y{i}")
    assert len(chains._left_at) <= GHOSTS


# ------------------------------------------------------------------------------------------ through the store

NS = "chains"
BLOCK = 16


def block(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, BLOCK, 2, 32)).astype(np.float16)
    return k, k


def chained_store(blocks: int, **options: object) -> tuple[Store, int]:
    """A store with room for about ``blocks`` blocks (fp16, no compression), and the bytes one block takes."""
    probe = Store(1 << 24, max_level="fp16")
    probe.register(NS, num_layers=2, num_kv_heads=2, head_dim=32)
    base = probe.used_bytes
    probe.append(NS, "probe", *block(0))
    one = probe.used_bytes - base
    s = Store(base + blocks * one + one // 2, max_level="fp16", **options)
    s.register(NS, num_layers=2, num_kv_heads=2, head_dim=32)
    return s, one


def stored(s: Store, *ids: str) -> list[str]:
    return [i for i in ids if s.lengths(NS, [i])[0] is not None]


def put_chain(s: Store, name: str, n: int) -> list[str]:
    ids = [f"{name}{i}" for i in range(n)]
    for i, sid in enumerate(ids):
        s.append(NS, sid, *block(hash(sid) % 1000), position=i * BLOCK, parent=ids[i - 1] if i else None)
    return ids


def test_storing_a_sequence_is_not_a_reuse_and_each_later_use_is_one() -> None:
    """The reuse distances the staleness bound is learned from are those of sequences used again: the append
    that creates a sequence counts none (a connector stores every block of every prompt once; counted, half the
    distances were 1 and the bound fell below the real reuse), a later append or read of it counts one."""
    s, _ = chained_store(8)
    ids = put_chain(s, "a", 3)
    assert s.stats()["eviction_reuses_known"] == 0
    s.get(NS, ids[0])
    s.append(NS, ids[2], *block(3))
    assert s.stats()["eviction_reuses_known"] == 2


def test_a_full_store_gives_up_a_chains_unreachable_blocks_first() -> None:
    s, _ = chained_store(8)
    a = put_chain(s, "a", 4)
    b = put_chain(s, "b", 3)
    s.drop(NS, a[1])  # a2, a3 can no longer be found by a lookup that walks the chain
    s.get(NS, a[3])  # ... however recently used
    s.append(NS, "x", *block(7))
    s.append(NS, "y", *block(8))
    s.append(NS, "z", *block(9))
    s.append(NS, "w", *block(10))  # 11 blocks offered to room for 8, one dropped: two evicted
    assert stored(s, *a, *b, "x", "y", "z", "w") == [a[0], *b, "x", "y", "z", "w"]


def test_chain_tails_go_before_chain_heads_then_by_recency() -> None:
    s, _ = chained_store(4)
    a = put_chain(s, "a", 3)  # the oldest: plain LRU would evict a0 first and strand a1, a2
    s.append(NS, "x", *block(5))
    s.append(NS, "y", *block(6))
    assert stored(s, *a, "x") == [a[0], a[1], "x"]  # a2, the chain's tail, went
    s.append(NS, "z", *block(7))
    assert stored(s, *a, "x", "y", "z") == [a[0], "x", "y", "z"]  # then a1, now the tail (older than x)


def test_a_chain_is_reachable_again_when_its_missing_block_comes_back() -> None:
    s, _ = chained_store(6)
    a = put_chain(s, "a", 4)
    s.drop(NS, a[1])
    s.append(NS, a[1], *block(1), position=BLOCK, parent=a[0])  # a later prompt recomputes and stores it
    s.append(NS, "x", *block(5))
    s.append(NS, "y", *block(6))
    s.append(NS, "z", *block(7))  # 7 blocks offered to room for 6: the least recent tail goes, a3
    assert stored(s, *a, "x", "y", "z") == [a[0], a[1], a[2], "x", "y", "z"]


def test_without_parents_the_order_is_lru() -> None:
    s, _ = chained_store(3)
    for sid in ("p", "q", "r"):
        s.append(NS, sid, *block(1))
    s.get(NS, "p")
    s.append(NS, "t", *block(2))
    assert stored(s, "p", "q", "r", "t") == ["p", "r", "t"]


def test_eviction_order_recency_ignores_chains() -> None:
    s, _ = chained_store(4, eviction_order="recency")
    a = put_chain(s, "a", 3)
    s.append(NS, "x", *block(5))
    s.append(NS, "y", *block(6))
    assert stored(s, *a, "x", "y") == [a[1], a[2], "x", "y"]  # a0, the least recently used, went first


def test_a_bad_eviction_order_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="eviction_order"):
        Store(1 << 20, eviction_order="lfu")


def test_a_bad_parent_is_refused_and_nothing_is_stored() -> None:
    s, _ = chained_store(3)
    for bad in (-1, 1.5, b"x"):
        with pytest.raises(InvalidArgument, match="parent"):
            s.append(NS, "c", *block(1), parent=bad)
    with pytest.raises(UnknownSequence):
        s.get(NS, "c")


def test_unreachable_blocks_are_evicted_not_spilled_to_disk(tmp_path) -> None:
    probe, one = chained_store(4)
    base = probe.capacity_bytes - 4 * one - one // 2
    s = Store(base + 4 * one + one // 2, max_level="fp16", disk_path=str(tmp_path), disk_bytes=1 << 30)
    try:
        s.register(NS, num_layers=2, num_kv_heads=2, head_dim=32)
        a = put_chain(s, "a", 3)
        s.append(NS, "x", *block(5))
        s.drop(NS, a[0])  # a1, a2 unreachable
        s.append(NS, "y", *block(6))
        s.append(NS, "z", *block(7))  # room for 4 blocks, 5 offered after the drop: one goes
        st_ = s.stats()
        assert stored(s, *a, "x", "y", "z") == [a[1], "x", "y", "z"]  # a2 (the deeper) forgotten, not on disk
        assert st_["evictions"] == 1
    finally:
        s.close(persist=False)
