"""The hot tail sized to what it holds (kvd.store.sequences.tail_tokens): a sequence's tail is charged for the
tokens it can hold now, not a whole page; it grows in steps as tokens arrive, a growth makes room as any append
does (compress, spill, evict or refuse), and every reader sees the same tokens as with a whole-page tail."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import NonFiniteError, OutOfMemory
from kvd.store import Store
from kvd.store import pool as sp
from kvd.store.sequences import tail_tokens

NS = "m"
MiB = 1 << 20
L, H, D, P = 2, 3, 64, 64
TOKEN_BYTES = 2 * L * H * D * 2  # keys + values of one token of every layer, float16


def kv(t: int, seed: int = 0, layers: int = L, heads: int = H, dim: int = D) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (layers, t, heads, dim)
    return rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(np.float16)


def store(capacity: int = 256 * MiB, **opts) -> Store:
    s = Store(capacity, **opts)
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    return s


def tail_charge(fill: int) -> int:
    """What a tail holding ``fill`` tokens (0: no tail) is charged: its buffer and its object."""
    return tail_tokens(fill, P) * TOKEN_BYTES + sp.TAIL_META_BYTES if fill else 0


def parts(st: dict) -> int:
    return st["page_bytes"] + st["tail_bytes"] + st["pool_bytes"] + st["metadata_bytes"] + st["reserved_bytes"]


def test_the_step_schedule_holds_the_fill_wastes_under_three_quarters_and_ends_at_a_page() -> None:
    for p in (1, 16, 48, 64, 100):
        caps = [tail_tokens(f, p) for f in range(1, p + 1)]
        assert caps == sorted(caps) and caps[-1] == p
        steps = sorted(set(caps))
        # few steps: each one is a copy
        assert all(b == 4 * a or b == p for a, b in zip(steps, steps[1:], strict=False))
        for f, cap in enumerate(caps, 1):
            assert f <= cap <= p and (cap < 4 * f or cap == 1)


def test_16_tokens_of_the_readme_layout_take_2_mib_not_a_page() -> None:
    """The README's example (32 layers, 8 KV heads, head_dim 128, 16 tokens: 2 MiB of keys and values) fits in a
    store of 2 MiB plus the metadata charges; with a whole-page tail it needed 8 MiB."""
    s = Store(2 * MiB + 8 * 1024, eviction="none")
    s.register("llama-7b", num_layers=32, num_kv_heads=8, head_dim=128)
    k, v = kv(16, 1, 32, 8, 128)
    assert s.append("llama-7b", "request-42", k, v) == 16
    st = s.stats()
    assert st["tail_bytes"] == 2 * MiB and st["used_bytes"] <= st["capacity_bytes"]
    gk, gv = s.get("llama-7b", "request-42")
    np.testing.assert_array_equal(gk, k)
    np.testing.assert_array_equal(gv, v)


@pytest.mark.parametrize("n", [1, 16, 63, 64, 65, 200])
def test_used_bytes_of_a_short_sequence_is_its_tail_size(n: int) -> None:
    s = store()
    s.append(NS, 1, *kv(n))
    st = s.stats()
    assert st["tail_bytes"] + (sp.TAIL_META_BYTES if n % P else 0) == tail_charge(n % P)
    assert st["used_bytes"] == parts(st)
    if n < P:
        seq_meta = sp.SEQ_META_BYTES + L * sp.LAYER_META_BYTES
        assert st["used_bytes"] == sp.namespace_meta_bytes(L) + seq_meta + tail_charge(n)


@pytest.mark.parametrize("level", ["fp16", "q8", "q4"])
def test_growing_across_steps_then_sealing_is_bit_exact_against_one_append(level: str) -> None:
    k, v = kv(3 * P + 21, 2)
    chunks = [1, 1, 2, 3, 5, 8, 13, 21, 10, 1, 1, 30, 40, 3, 1, 1, 20, 50, 2]
    assert sum(chunks) == k.shape[1]
    s, ref = store(), store()
    s.set_level(level, 1)
    ref.set_level(level, 1)
    ref.append(NS, 1, k, v)
    n = 0
    for c in chunks:
        assert s.append(NS, 1, k[:, n : n + c], v[:, n : n + c]) == n + c
        n += c
        st = s.stats()
        assert st["tail_bytes"] == tail_tokens(n % P, P) * TOKEN_BYTES * (n % P > 0), n
        assert st["used_bytes"] == parts(st)
        gk, gv = s.get(NS, 1, n - n % P)  # the hot tail: fp16 at every level
        np.testing.assert_array_equal(gk.view(np.uint16), k[:, n - n % P : n].view(np.uint16))
        np.testing.assert_array_equal(gv.view(np.uint16), v[:, n - n % P : n].view(np.uint16))
    for a, b in zip(s.get(NS, 1), ref.get(NS, 1), strict=True):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    got, want = s.get_pages(NS, 1), ref.get_pages(NS, 1)
    assert [(i, t0, bytes(kp), bytes(vp)) for i, t0, kp, vp in got] == [
        (i, t0, bytes(kp), bytes(vp)) for i, t0, kp, vp in want]
    a, b = s.stats(), ref.stats()
    for key in ("pages_by_level", "bytes_by_level", "tail_bytes", "tokens", "compaction_backlog_bytes"):
        assert a[key] == b[key], key
    assert a["used_bytes"] - a["pool_bytes"] == b["used_bytes"] - b["pool_bytes"]
    assert s.explain(NS, 1, 1, n - 1)["reasons"] == ["hot tail"]


def test_a_growth_that_does_not_fit_is_refused_and_changes_nothing() -> None:
    s = store(eviction="none", max_level="fp16")
    s.append(NS, "a", *kv(2, 3))  # 2 tokens in a tail of 4
    cap = s.stats()["used_bytes"] + TOKEN_BYTES  # room for one token more, not for a tail of 16
    s2 = store(cap, eviction="none", max_level="fp16")
    k, v = kv(5, 3)
    s2.append(NS, "a", k[:, :2], v[:, :2])
    before = s2.stats()
    with pytest.raises(OutOfMemory, match="nothing was written"):
        s2.append(NS, "a", k[:, 2:], v[:, 2:])  # 5 tokens: the tail must grow to 16
    after = s2.stats()
    for key in ("used_bytes", "tokens", "tail_bytes", "pool_bytes"):
        assert after[key] == before[key], key
    np.testing.assert_array_equal(s2.get(NS, "a")[0], k[:, :2])


def test_a_growth_that_does_not_fit_evicts_the_least_recently_used() -> None:
    probe = store()
    probe.append(NS, "a", *kv(2, 4))
    probe.append(NS, "b", *kv(10, 5))
    # the growth's peak (a tail of 16 tokens beside the old one of 4) fits only once "b" is gone
    s = store(probe.stats()["used_bytes"] + tail_charge(16) - 1, eviction="lru", max_level="fp16")
    ka, va = kv(5, 4)
    s.append(NS, "a", ka[:, :2], va[:, :2])
    s.append(NS, "b", *kv(10, 5))
    assert s.append(NS, "a", ka[:, 2:], va[:, 2:]) == 5  # its tail grows to 16 tokens: "b" makes way
    st = s.stats()
    assert st["evictions"] == 1 and s.lengths(NS, ["a", "b"]) == [5, None]
    assert st["used_bytes"] == parts(st) <= st["capacity_bytes"]
    np.testing.assert_array_equal(s.get(NS, "a")[1], va)


def test_a_growth_with_non_finite_values_keeps_the_old_tail() -> None:
    s = store()
    k, v = kv(10, 6)
    s.append(NS, 1, k[:, :3], v[:, :3])  # a tail of 4 tokens
    before = s.stats()
    bad = k[:, 3:10].copy()
    bad[1, 5, 0, 2] = np.inf
    with pytest.raises(NonFiniteError, match=r"keys\[1, 5, 0, 2\]"):
        s.append(NS, 1, bad, v[:, 3:10])
    after = s.stats()
    for key in ("used_bytes", "tokens", "tail_bytes", "pool_bytes"):
        assert after[key] == before[key], key
    np.testing.assert_array_equal(s.get(NS, 1)[0], k[:, :3])
    assert s.append(NS, 1, k[:, 3:10], v[:, 3:10]) == 10
    np.testing.assert_array_equal(s.get(NS, 1)[0], k)


def test_a_sequence_taken_back_from_disk_gets_a_tail_of_its_size(tmp_path) -> None:
    s = store(64 * MiB, disk_path=str(tmp_path), disk_bytes=64 * MiB)
    k, v = kv(P + 5, 7)
    s.append(NS, 1, k[:, :P + 3], v[:, :P + 3])
    s.close()  # spills it
    s2 = Store(64 * MiB, disk_path=str(tmp_path), disk_bytes=64 * MiB)
    assert s2.append(NS, 1, k[:, P + 3 :], v[:, P + 3 :]) == P + 5
    st = s2.stats()
    assert st["promotions"] == 1 and st["tail_bytes"] == tail_tokens(5, P) * TOKEN_BYTES
    assert st["used_bytes"] == parts(st)
    gk, gv = s2.get(NS, 1)
    np.testing.assert_array_equal(gk, k)
    np.testing.assert_array_equal(gv, v)
    s2.close(persist=False)
