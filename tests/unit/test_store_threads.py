"""The store served by more than one thread (kvd.store.core, "Threads"): a large append encodes and a large read
decodes without the store's lock, so small operations on other sequences go on meanwhile; everything the
store promises a single caller still holds (all or nothing, order per sequence, capacity, reads unchanged by
later writes).

Each test holds a large operation inside its unlocked part (a wrapped seal_rows / read_into that waits on an
event) and checks what other threads can and cannot do until it is let go."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvd.errors import NonFiniteError, OutOfMemory
from kvd.store import Store
from kvd.store import pool as sp
from kvd.store import sequences as store_seq
from kvd.store.core import UNLOCKED_MIN_BYTES

NS = "m"
MiB = 1 << 20
LAYERS, HEADS, DIM = 4, 8, 128
TOKEN_BYTES = 2 * LAYERS * HEADS * DIM * 2  # keys + values of one token, float16
BIG = -(-UNLOCKED_MIN_BYTES // TOKEN_BYTES) + 64  # tokens of an append that encodes without the lock
WAIT_S = 10.0


def kv(t: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (LAYERS, t, HEADS, DIM)
    return rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(np.float16)


def make(capacity: int = 256 * MiB, **opts: Any) -> Store:
    s = Store(capacity, **opts)
    s.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    return s


class Held:
    """Wraps a module function so that its first call from a thread of this test signals ``entered`` and waits
    for ``go``; ``thread`` runs the held operation."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        self.result: Any = None
        real = getattr(module, name)
        armed = [True]

        def held(*args: Any, **kwargs: Any) -> Any:
            if armed[0] and threading.current_thread() is self.thread:
                armed[0] = False
                self.entered.set()
                assert self.go.wait(WAIT_S), "the held operation was never let go"
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, held)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self._op: Callable[[], Any] = lambda: None

    def start(self, op: Callable[[], Any]) -> Held:
        self._op = op
        self.thread.start()
        assert self.entered.wait(WAIT_S), "the operation did not reach its unlocked part"
        return self

    def _run(self) -> None:
        try:
            self.result = self._op()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.errors.append(exc)

    def finish(self) -> Any:
        self.go.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        if self.errors:
            raise self.errors[0]
        return self.result


def in_thread(op: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(op()), daemon=True)
    t.start()
    return t, out


@pytest.fixture
def held_seal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    h = Held(monkeypatch, sp, "seal_rows")
    yield h
    h.go.set()


@pytest.fixture
def held_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    h = Held(monkeypatch, store_seq, "read_into")
    yield h
    h.go.set()


# ------------------------------------------------------------------------------------------ appends


def test_small_operations_on_other_sequences_run_while_a_large_append_encodes(held_seal: Held) -> None:
    s = make()
    k, v = kv(BIG, 1)
    dk, dv = kv(1, 2)
    s.append(NS, "decode", dk, dv)
    held_seal.start(lambda: s.append(NS, "prefill", k, v))
    # the prefill is encoding: a decode step, a read, a lookup and stats all go through now
    assert s.append(NS, "decode", dk, dv) == 2
    got_k, _ = s.get(NS, "decode")
    np.testing.assert_array_equal(got_k[:, 1:], dk)
    assert s.lengths(NS, ["decode", "prefill"]) == [2, None]  # the prefill is not visible until it commits
    st = s.stats()
    assert st["reserved_bytes"] > 0
    assert st["used_bytes"] == (st["page_bytes"] + st["tail_bytes"] + st["pool_bytes"] + st["metadata_bytes"]
                                + st["reserved_bytes"])
    assert held_seal.finish() == BIG
    got_k, got_v = s.get(NS, "prefill")
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    assert s.stats()["reserved_bytes"] == 0


def test_an_append_to_the_sequence_in_flight_waits_and_lands_after_it(held_seal: Held) -> None:
    s = make()
    k, v = kv(BIG, 3)
    k2, v2 = kv(5, 4)
    held_seal.start(lambda: s.append(NS, "seq", k, v))
    second, out = in_thread(lambda: s.append(NS, "seq", k2, v2))
    second.join(0.3)
    assert second.is_alive(), "an append to a sequence in flight must wait for it"
    held_seal.finish()
    second.join(WAIT_S)
    assert out == [BIG + 5]
    got_k, _ = s.get(NS, "seq")
    np.testing.assert_array_equal(got_k, np.concatenate([k, k2], axis=1))


def test_a_drop_of_the_sequence_in_flight_waits_for_its_append(held_seal: Held) -> None:
    s = make()
    k, v = kv(BIG, 5)
    s.append(NS, "seq", *kv(3, 6))
    held_seal.start(lambda: s.append(NS, "seq", k, v))
    dropper, out = in_thread(lambda: s.drop(NS, "seq"))
    dropper.join(0.3)
    assert dropper.is_alive()
    held_seal.finish()
    dropper.join(WAIT_S)
    assert out == [True]
    assert s.lengths(NS, ["seq"]) == [None]
    st = s.stats()
    assert st["tokens"] == 0 and st["page_bytes"] == 0 and st["reserved_bytes"] == 0


def test_a_large_append_with_nan_found_without_the_lock_stores_nothing(held_seal: Held) -> None:
    s = make()
    s.append(NS, "seq", *kv(10, 7))
    before = s.stats()
    k, v = kv(BIG, 8)
    v[2, BIG // 2, 1, 3] = np.nan
    held_seal.start(lambda: s.append(NS, "seq", k, v))
    with pytest.raises(NonFiniteError, match=r"values\[2, "):
        held_seal.finish()
    after = s.stats()
    assert s.length(NS, "seq") == 10
    for key in ("tokens", "page_bytes", "tail_bytes", "metadata_bytes", "reserved_bytes", "sequences"):
        assert after[key] == before[key], key
    assert s.append(NS, "seq", *kv(1, 9)) == 11  # the sequence is not left pinned


def test_an_append_that_must_evict_waits_for_the_appends_in_flight(held_seal: Held) -> None:
    chunk = BIG * TOKEN_BYTES
    s = make(capacity=int(2.5 * chunk), eviction="lru", max_level="fp16")
    s.append(NS, "old", *kv(BIG, 10))
    k, v = kv(BIG, 11)
    held_seal.start(lambda: s.append(NS, "new", k, v))
    # a third chunk does not fit: it must evict, which waits until "new" has committed
    third, out = in_thread(lambda: s.append(NS, "third", *kv(BIG, 12)))
    third.join(0.3)
    assert third.is_alive(), "eviction must not run while an append is in flight"
    assert s.stats()["used_bytes"] <= s.capacity_bytes
    held_seal.finish()
    third.join(WAIT_S)
    assert out == [BIG]
    st = s.stats()
    assert st["used_bytes"] <= s.capacity_bytes and st["evictions"] == 1
    assert s.lengths(NS, ["old", "new", "third"]) == [None, BIG, BIG]  # least recently used went
    np.testing.assert_array_equal(s.get(NS, "new")[0], k)


def test_the_room_of_an_append_in_flight_is_reserved(held_seal: Held) -> None:
    chunk = BIG * TOKEN_BYTES
    s = make(capacity=chunk + 3 * 64 * TOKEN_BYTES, eviction="none", max_level="fp16")
    held_seal.start(lambda: s.append(NS, "big", *kv(BIG, 13)))
    assert s.append(NS, "small-0", *kv(64, 14)) == 64  # what is left besides the reservation is usable
    # one that does not fit besides the reservation waits for the append in flight, then is refused as it would
    # have been after it: room is never promised twice, and nothing passes the capacity
    refused, out = in_thread(lambda: pytest.raises(OutOfMemory, s.append, NS, "small-1", *kv(3 * 64, 15)))
    refused.join(0.3)
    assert refused.is_alive()
    assert s.stats()["used_bytes"] <= s.capacity_bytes
    held_seal.finish()
    refused.join(WAIT_S)
    assert len(out) == 1 and "nothing was written" in str(out[0].value)
    assert s.lengths(NS, ["big", "small-0", "small-1"]) == [BIG, 64, None]
    assert s.stats()["used_bytes"] <= s.capacity_bytes


# ------------------------------------------------------------------------------------------ reads


def test_a_large_read_returns_the_sequence_as_it_was_when_it_started(held_read: Held) -> None:
    s = make()
    k, v = kv(BIG + 10, 20)  # sealed pages and a hot tail
    s.append(NS, "seq", k, v)
    held_read.start(lambda: s.get(NS, "seq"))
    # while it decodes without the lock: the tail is rewritten, the sequence dropped, and its records' sizes
    # taken by another sequence (they would be reused if they were pooled)
    s.append(NS, "seq", *kv(60, 21))
    s.drop(NS, "seq")
    s.append(NS, "other", *kv(BIG + 10, 22))
    got_k, got_v = held_read.finish()
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    assert s.stats()["reserved_bytes"] == 0


def test_small_operations_run_while_a_large_read_decodes(held_read: Held) -> None:
    s = make()
    k, v = kv(BIG, 23)
    s.append(NS, "big", k, v)
    s.append(NS, "decode", *kv(1, 24))
    held_read.start(lambda: s.get_pages(NS, "big") and s.get(NS, "big"))
    assert s.append(NS, "decode", *kv(1, 25)) == 2
    assert s.drop(NS, "big")
    got_k, _ = held_read.finish()
    np.testing.assert_array_equal(got_k, k)


def test_get_into_and_pages_of_a_large_range_match_the_locked_read() -> None:
    s = make()
    k, v = kv(BIG + 33, 26)
    s.append(NS, "seq", k, v)
    s.set_level("q8", 1)
    s.compact(1 << 30)
    ko, vo = s.get(NS, "seq", 7, BIG + 20)
    kb = np.zeros((LAYERS, BIG + 13, HEADS, DIM), np.float16)
    vb = np.zeros_like(kb)
    assert s.get_into(NS, "seq", kb, vb, 7, BIG + 20) == BIG + 13
    np.testing.assert_array_equal(kb, ko)
    np.testing.assert_array_equal(vb, vo)
    from kvd import pages

    entries = s.get_pages(NS, "seq", 7, BIG + 20)
    ka, va = pages.assemble(entries, 7, BIG + 20, list(range(LAYERS)))
    np.testing.assert_array_equal(ka, ko)
    np.testing.assert_array_equal(va, vo)


# ------------------------------------------------------------------------------------------ levels and compaction


def same_store(a: Store, b: Store, seq_ids: list[str]) -> None:
    """``a`` and ``b`` hold the same pages, bit for bit, and account for them alike."""
    sa, sb = a.stats(), b.stats()
    for key in ("used_bytes", "page_bytes", "tail_bytes", "metadata_bytes", "pages_by_level", "bytes_by_level",
                "compaction_backlog_bytes", "tokens", "reserved_bytes"):
        assert sa[key] == sb[key], key
    assert sa["used_bytes"] == (sa["page_bytes"] + sa["tail_bytes"] + sa["pool_bytes"] + sa["metadata_bytes"]
                                + sa["reserved_bytes"])
    for sid in seq_ids:
        pa, pb = a.get_pages(NS, sid), b.get_pages(NS, sid)
        assert [(i, t0, bytes(kp), bytes(vp)) for i, t0, kp, vp in pa] == [
            (i, t0, bytes(kp), bytes(vp)) for i, t0, kp, vp in pb]


@pytest.mark.parametrize("window", [0, 128])
@pytest.mark.parametrize(("planned", "ordered"), [("q8", "q4"), ("q4", "fp16"), ("fp16", "q8")])
def test_a_level_order_while_a_large_append_encodes_applies_to_what_its_plan_sealed(
    held_seal: Held, window: int, planned: str, ordered: str
) -> None:
    """The append commits the rows its plan sealed at the plan's format (they are logged for compaction as such,
    charged as planned), whatever level is in force when it commits: it ends as the same appends and order one
    after the other would."""
    first, big = kv(130, 30), kv(BIG, 31)
    s, ref = make(window_tokens=window), make(window_tokens=window)
    for store in (s, ref):
        store.set_level(planned, 1)
        store.append(NS, "seq", *first)
    held_seal.start(lambda: s.append(NS, "seq", *big))
    assert s.set_level(ordered, 2)  # the order lands while the append encodes without the lock
    assert held_seal.finish() == 130 + BIG
    ref.append(NS, "seq", *big)
    ref.set_level(ordered, 2)
    for store in (s, ref):
        store.compact(1 << 40)
    same_store(s, ref, ["seq"])
    assert s.stats()["compaction_backlog_bytes"] == 0


def test_compaction_while_a_large_append_encodes(held_seal: Held) -> None:
    old, big = kv(BIG, 32), kv(BIG, 33)
    s, ref = make(), make()
    for store in (s, ref):
        store.append(NS, "old", *old)
        store.set_level("q4", 1)
    held_seal.start(lambda: s.append(NS, "new", *big))
    assert s.compact(1 << 40) > 0  # "old" is re-encoded while "new" encodes
    assert held_seal.finish() == BIG
    ref.compact(1 << 40)
    ref.append(NS, "new", *big)
    same_store(s, ref, ["old", "new"])
    np.testing.assert_array_equal(s.get(NS, "new")[0], ref.get(NS, "new")[0])
