"""The store against a dictionary model (hypothesis stateful): register, append, get, get_pages, drop,
set_level, compact, eviction.

The model keeps every appended token exactly, the LRU order, the level/epoch timeline and, per page row, the
format in force when the row was sealed (or left the window). A stored page must decode to exactly the codec's
round trip of the model's data through the formats the store reports for it (sealed format, then each
re-compression), the reported sealed format must be the model's, each re-compression must climb a rung to a
format that was in force, and protected tokens (sink page, window, hot tail, raw layers, raw heads) must come
back bit-exact. Evictions must take exactly the least recently used sequences, and only once the store has
compressed everything it may (its level at ``max_level``, no page left to re-encode); a store that runs ahead of
the ordered level under its own pressure keeps to the lead rules of ``Store.set_level``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvd import pages
from kvd.errors import NonFiniteError, OutOfMemory, UnknownSequence
from kvd.policy import Level
from kvd.store import Store
from kvd.store import pool as sp

NS = "m"
L, H, D = 2, 2, 8
SEQ_IDS = [0, 1, 2, "a"]
RUNG = sp.RUNG
# A loose relative-L2 bound per format, on top of the exact round-trip check (random normal data, tiny pages).
REL_TOL = {"fp16": 0.0, "q8": 0.02, "fp8_e4m3": 0.08, "fp8_e5m2": 0.16, "q4": 0.25}


def roundtrip(x: np.ndarray, chain: list[str], role: str, raw_heads: tuple[int, ...]) -> np.ndarray:
    for fmt in chain:
        rh = () if fmt == "fp16" else raw_heads
        x = pages.decode(pages.encode(x, fmt, role=role, raw_heads=rh))
    return x


class StoreModel(RuleBasedStateMachine):
    @initialize(
        page_tokens=st.sampled_from([2, 4, 8]),
        sink=st.sampled_from([0, 1, 5]),
        sink_raw=st.booleans(),
        window=st.sampled_from([0, 3, 8]),
        raw_layers=st.sampled_from([(), (1,)]),
        raw_heads=st.sampled_from([(), (1,)]),
        eight_bit=st.sampled_from(["q8", "fp8_e4m3", "fp8_e5m2"]),
        capacity=st.sampled_from([6_000, 12_000, 64_000]),
        max_level=st.sampled_from(["fp16", "q8", "q4"]),
    )
    def setup(self, page_tokens, sink, sink_raw, window, raw_layers, raw_heads, eight_bit, capacity,
              max_level) -> None:
        self.p, self.sink, self.sink_raw, self.window = page_tokens, sink, sink_raw, window
        self.raw_layers, self.raw_heads = raw_layers, raw_heads
        self.store = Store(
            capacity,
            page_tokens=page_tokens,
            sink_tokens=sink,
            sink_raw=sink_raw,
            window_tokens=window,
            raw_layers=raw_layers,
            raw_heads=raw_heads,
            eight_bit=eight_bit,
            max_level=max_level,
        )
        self.max_rung = Level.parse(max_level).rung
        self.store.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
        self.data: dict[object, tuple[np.ndarray, np.ndarray]] = {}
        self.row_fmt: dict[object, list[str]] = {}  # per sequence: the format each out-of-window row got
        self.lru: list[object] = []
        self.epoch, self.level = 0, Level.FP16  # the ordered level
        self.ahead: Level | None = None  # the store's own lead, read after each append
        self.fmt_epochs: dict[str, set[int]] = {"fp16": {0}}
        self.rng = np.random.default_rng(0)

    # ------------------------------------------------------------------------------------------ helpers

    def touch(self, sid: object) -> None:
        if sid in self.lru:
            self.lru.remove(sid)
        self.lru.append(sid)

    def out_rows(self, n: int) -> int:
        return max(0, n - self.window) // self.p

    def in_force(self) -> Level:
        return self.ahead if self.ahead is not None else self.level

    def check_squeeze(self, before: dict, forgot: bool) -> None:
        """An append may run the store ahead (never past max_level, only upward); it may evict or be refused
        only with everything compressed that could be."""
        after = self.store.stats()
        ahead = None if after["ahead"] is None else Level.from_tag(after["ahead"])
        if ahead is not None:
            assert self.level.rung < ahead.rung <= self.max_rung, (after, self.level)
            if self.ahead is not None:
                assert ahead.rung >= self.ahead.rung
            # a squeeze climbs one rung at a time, re-encoding pages at every rung it passes (oldest first):
            # a page may stay at an intermediate rung once the append fit
            for rung in range(self.in_force().rung + 1, ahead.rung + 1):
                self.fmt_epochs.setdefault(self.store.format_for(self.store._rung_level(rung)), set()).add(
                    self.epoch)
        else:
            assert self.ahead is None
        self.ahead = ahead
        assert after["level"] == self.in_force().tag and after["ordered_level"] == self.level.tag
        if forgot:
            assert sp.RUNG[after["format"]] >= self.max_rung and after["compaction_backlog_bytes"] == 0, after

    def tokens(self, t: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        k = (rng.standard_normal((L, t, H, D)) * rng.choice([0.01, 1.0, 30.0])).astype(np.float16)
        v = rng.standard_normal((L, t, H, D)).astype(np.float16)
        return k, v

    # ------------------------------------------------------------------------------------------ rules

    @rule(sid=st.sampled_from(SEQ_IDS), t=st.integers(0, 20), seed=st.integers(0, 2**16))
    def append(self, sid, t, seed) -> None:
        k, v = self.tokens(t, seed)
        before = self.store.stats()
        if t == 0 and sid not in self.data:
            with pytest.raises(ValueError):
                self.store.append(NS, sid, k, v)
            return
        try:
            n2 = self.store.append(NS, sid, k, v)
        except OutOfMemory:
            self.check_squeeze(before, forgot=True)
            after = self.store.stats()
            assert after["refusals"] == before["refusals"] + 1
            assert after["evictions"] == before["evictions"]
            assert after["tokens"] == before["tokens"]
            if sid in self.data:
                assert self.store.length(NS, sid) == self.data[sid][0].shape[1]
            return
        after = self.store.stats()
        evicted = after["evictions"] - before["evictions"]
        self.check_squeeze(before, forgot=evicted > 0)
        victims = [s for s in self.lru if s != sid][:evicted]
        for s in victims:
            with pytest.raises(UnknownSequence):
                self.store.length(NS, s)
            del self.data[s], self.row_fmt[s]
            self.lru.remove(s)
        for s in self.data:
            if s != sid:
                assert self.store.length(NS, s) == self.data[s][0].shape[1]
        old_k, old_v = self.data.get(sid, (k[:, :0], v[:, :0]))
        self.data[sid] = (np.concatenate([old_k, k], axis=1), np.concatenate([old_v, v], axis=1))
        n = self.data[sid][0].shape[1]
        assert n2 == n
        fmts = self.row_fmt.setdefault(sid, [])
        while len(fmts) < self.out_rows(n):
            fmt = self.store.format_for(self.in_force())
            if len(fmts) * self.p < self.sink:  # a sink row: one rung less compact
                fmt = self.store.eight_bit if RUNG[fmt] > 1 else "fp16"
            fmts.append(fmt)
        self.touch(sid)

    @precondition(lambda self: self.data)
    @rule(data=st.data(), nan=st.sampled_from([np.nan, np.inf, -np.inf]))
    def append_non_finite(self, data, nan) -> None:
        sid = data.draw(st.sampled_from(sorted(self.data, key=str)))
        t = data.draw(st.integers(1, 3 * self.p))
        k, v = self.tokens(t, 7)
        bad = k if data.draw(st.booleans()) else v
        bad[data.draw(st.integers(0, L - 1)), data.draw(st.integers(0, t - 1)), 0, 0] = nan
        before = self.store.stats()
        with pytest.raises(NonFiniteError):
            self.store.append(NS, sid, k, v)
        after = self.store.stats()
        for key in ("used_bytes", "tokens", "pages_by_level", "bytes_by_level", "tail_bytes", "sequences",
                    "level", "ahead", "recompressed_pages"):
            assert after[key] == before[key], key

    @precondition(lambda self: self.data)
    @rule(data=st.data())
    def get(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.data, key=str)))
        n = self.data[sid][0].shape[1]
        start = data.draw(st.integers(0, n))
        end = data.draw(st.integers(start, n))
        layers = data.draw(st.sampled_from([None, [1], [1, 0]]))
        keys, values = self.store.get(NS, sid, start, end, layers)
        self.touch(sid)
        lay = [0, 1] if layers is None else layers
        assert keys.shape == values.shape == (len(lay), end - start, H, D)
        assert keys.dtype == np.float16
        full_k, full_v = self.expected(sid)
        np.testing.assert_array_equal(keys.view(np.uint16), full_k[lay, start:end].view(np.uint16))
        np.testing.assert_array_equal(values.view(np.uint16), full_v[lay, start:end].view(np.uint16))
        entries = self.store.get_pages(NS, sid, start, end, layers)
        ak, av = pages.assemble(entries, start, end, layers)
        np.testing.assert_array_equal(ak.view(np.uint16), keys.view(np.uint16))
        np.testing.assert_array_equal(av.view(np.uint16), values.view(np.uint16))

    def expected(self, sid) -> tuple[np.ndarray, np.ndarray]:
        """What get() must return for the whole sequence, built from explain() and the codec, with checks."""
        mk, mv = self.data[sid]
        n, p = mk.shape[1], self.p
        ek, ev = mk.copy(), mv.copy()
        sealed = n // p
        out = self.out_rows(n)
        for layer in range(L):
            for r in range(-(-n // p)):
                info = self.store.explain(NS, sid, layer, r * p)
                reasons = info["reasons"]
                sink = r * p < self.sink
                assert ("sink" in reasons) == sink
                protected = r >= sealed or layer in self.raw_layers or (sink and self.sink_raw) or r >= out
                if protected:
                    assert info["level"] == "fp16", info
                    assert ("hot tail" in reasons) == (r >= sealed)
                    assert ("raw layer" in reasons) == (layer in self.raw_layers)
                    assert ("window" in reasons) == (sealed > r >= out)
                    continue  # bit-exact: ek/ev already hold the model's data
                sealed_fmt = info["sealed_level"]
                assert sealed_fmt == self.row_fmt[sid][r], (info, self.row_fmt[sid])
                chain = [sealed_fmt]
                for fmt, ep in info["recompressed"]:
                    assert RUNG[fmt] > RUNG[chain[-1]], info
                    in_force = set(self.fmt_epochs.get(fmt, set()))
                    if sink and fmt == self.store.eight_bit:  # re-encoded toward q4, capped
                        in_force |= self.fmt_epochs.get("q4", set())
                    assert ep in in_force, (info, self.fmt_epochs)
                    chain.append(fmt)
                assert info["level"] == chain[-1]
                assert not sink or RUNG[chain[-1]] <= 1, info  # a sink page goes no further than 8 bits
                for role, src, dst in (("key", mk, ek), ("value", mv, ev)):
                    x = src[layer, r * p : (r + 1) * p]
                    y = roundtrip(x, chain, role, self.raw_heads)
                    for h in self.raw_heads:  # raw heads are bit-exact inside quantized pages
                        np.testing.assert_array_equal(y[:, h].view(np.uint16), x[:, h].view(np.uint16))
                    xf = x.astype(np.float64)
                    err = np.linalg.norm(y.astype(np.float64) - xf)
                    assert err <= sum(REL_TOL[f] for f in chain) * np.linalg.norm(xf) + 1e-3, (chain, err)
                    dst[layer, r * p : (r + 1) * p] = y
        return ek, ev

    @precondition(lambda self: self.data)
    @rule(data=st.data())
    def drop(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.data, key=str) + ["missing"]))
        before = self.store.stats()["used_bytes"]
        assert self.store.drop(NS, sid) == (sid in self.data)
        if sid in self.data:
            del self.data[sid], self.row_fmt[sid]
            self.lru.remove(sid)
            assert self.store.stats()["used_bytes"] < before

    @rule(level=st.sampled_from(list(Level) + ["fp16", "q8", "fp8", "q4"]), step=st.integers(-1, 2))
    def set_level(self, level, step) -> None:
        epoch = max(0, self.epoch + step)
        lv = Level.parse(level)
        applied = self.store.set_level(level, epoch)
        expect = epoch > self.epoch or (epoch == self.epoch and lv is not self.level)
        assert applied == expect
        if applied:
            # a lead survives an order below it, unless the order steps the cluster down
            if self.ahead is not None and (lv.rung < self.level.rung or lv.rung >= self.ahead.rung):
                self.ahead = None
            self.epoch, self.level = epoch, lv
            self.fmt_epochs.setdefault(self.store.format_for(self.in_force()), set()).add(epoch)
        st_ = self.store.stats()
        assert (st_["level"], st_["ordered_level"], st_["epoch"]) == (self.in_force().tag, lv.tag if applied
                                                                     else self.level.tag, self.epoch)

    @rule(budget=st.sampled_from([0, 300, 2_000, 10**9]))
    def compact(self, budget) -> None:
        before = self.store.stats()
        freed = self.store.compact(budget)
        after = self.store.stats()
        assert freed == before["used_bytes"] - after["used_bytes"]
        assert freed >= 0
        assert after["recompressed_bytes"] - before["recompressed_bytes"] <= budget
        assert after["compaction_backlog_bytes"] <= before["compaction_backlog_bytes"]
        if budget == 10**9:
            assert after["compaction_backlog_bytes"] == 0

    # ------------------------------------------------------------------------------------------ invariants

    @invariant()
    def accounting_holds(self) -> None:
        if not hasattr(self, "store"):
            return
        s = self.store.stats()
        assert s["used_bytes"] <= s["capacity_bytes"]
        assert s["used_bytes"] == s["page_bytes"] + s["tail_bytes"] + s["pool_bytes"] + s["metadata_bytes"]
        assert sum(s["bytes_by_level"].values()) == s["page_bytes"]
        assert s["tokens"] == sum(k.shape[1] for k, _ in self.data.values())
        assert s["sequences"] == len(self.data)
        assert s["pressure"] == s["used_bytes"] / s["capacity_bytes"]


StoreModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVD_STORE_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestStoreModel = StoreModel.TestCase
