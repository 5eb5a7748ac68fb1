"""Appends of :class:`kvd.store.Store`: the store's all-or-nothing core, in four named steps.

Theory of operation
-------------------
An append of T tokens to a sequence of n tokens (P a page) seals the rows it completes, re-encodes the sealed rows
that leave the recent window, and leaves its last ``(n + T) % P`` tokens in the hot tail (:mod:`kvd.store.core`,
"Hot tail", "All or nothing", "Threads"). A decode step whose token fits in the tail as it is takes a short cut
(:meth:`Appending._append_in_tail`); every other append runs four steps:

1. **Plan** (:class:`AppendPlan`): from the lengths, the protection and the level in force, the rows it seals and
   their format, the rows leaving the window, what happens to the hot tail (kept, grown, replaced, released), the
   rows the compaction log takes, and the peak bytes all of it allocates. Nothing is touched.
2. **Make room** (:meth:`Appending._make_room_for`): if the peak does not fit, compress (a level the squeeze raised
   re-plans at that level), then admit: it fits, or evicting or spilling others will make it fit once it is
   built, or OutOfMemory.
3. **Build** (:meth:`Appending._build`): check the tokens that go to the tail, take every buffer off to the side
   and encode the rows (without the store's lock for a large append that fits); only then make room by
   evicting, if admitted so. On any error every buffer goes back and nothing changed.
4. **Commit** (:meth:`Appending._commit`): under the lock, with operations that cannot fail. It follows the plan,
   never the level in force at commit: a large append's level may have changed while it encoded unlocked, and
   its rows are what the plan sealed.

This is a mixin of :class:`kvd.store.Store`; it relies on the store's lock, ledger, log, level and counters.
Pure core: no Ray, no ZeroMQ.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.codec import batch as page_batch
from kvd.policy import Level
from kvd.store import pool as sp
from kvd.store import sequences as store_seq
from kvd.store.sequences import RAW, Namespace, Seq, SeqId, tail_tokens

__all__ = ["UNLOCKED_MIN_BYTES", "AppendPlan", "Appending", "InFlight"]

# Appends and reads of at least this many bytes (keys + values, float16) encode or decode without the lock.
UNLOCKED_MIN_BYTES = 1 << 20


class InFlight(Exception):
    """(Internal) an append must make room while other appends are in flight: wait for them, plan again."""


class AppendPlan:
    """Step 1: what an append of ``tokens`` tokens to ``seq`` (None: a new sequence) does, decided before anything
    is touched. Positions: the sequence goes from ``length`` to ``new_length`` tokens; ``fill`` tokens of row
    ``row`` are in the tail before, ``new_fill`` of row ``new_rows`` after; rows ``[row, new_rows)`` are sealed;
    rows ``[window_done, out_rows)`` leave the window, of which the already sealed ones (``exits``; sink rows
    only if they may be compressed) are re-encoded at their format (:meth:`row_fmt`: ``fmt``, a sink row's
    ``sink_fmt``). :meth:`at_level` decides the formats and ``need``, the peak in bytes."""

    __slots__ = (
        "ns", "key", "seq", "tokens", "position", "sink_rows", "length", "new_length", "fill", "row", "new_fill",
        "new_rows", "out_rows", "window_done", "exits", "tail", "seal_tail", "grow_to", "reuse_tail", "new_tail",
        "sink_top", "fmt", "sink_fmt", "exit_flags", "row_plans", "logged", "need",
    )  # fmt: skip

    def __init__(self, store: Appending, ns: Namespace, key: tuple[str, SeqId], seq: Seq | None, tokens: int,
                 position: int) -> None:
        p = store.page_tokens
        self.ns, self.key, self.seq, self.tokens, self.position = ns, key, seq, tokens, position
        self.sink_rows = seq.sink_rows if seq is not None else store._sink_rows_at(position)
        self.length = seq.length if seq is not None else 0
        self.new_length = self.length + tokens
        self.row, self.fill = divmod(self.length, p)
        self.new_rows, self.new_fill = divmod(self.new_length, p)
        self.out_rows = max(0, self.new_length - store.window_tokens) // p  # rows wholly older than the window
        self.window_done = seq.window_done if seq is not None else 0
        self.sink_top = seq.sink_top if seq is not None else store._sink_top(ns)  # (Seq.sink_top)
        self.exits = [r for r in range(self.window_done, min(self.row, self.out_rows))
                      if r >= self.sink_rows or self.sink_top]
        # The hot tail's buffers. Row `row` is sealed from the tail when this append completes it; that needs a
        # whole page, so a smaller tail is first copied into one (`grow_to` P). A tail that keeps its row but must
        # hold more than its capacity grows to the next step. The tail after the append is then that buffer (the
        # old tail or the grown one) if it keeps its row or, after a seal, if the tokens left need a page
        # (`reuse_tail`); else a new buffer of their size (`new_tail`), and no tail when none are left.
        self.tail = seq.tail if seq is not None else None
        cap = self.tail.shape[2] if self.tail is not None else 0
        f, f2 = self.fill, self.new_fill
        self.seal_tail = bool(f) and self.new_rows > self.row
        if self.seal_tail:
            self.grow_to = p if cap < p else 0
        else:
            self.grow_to = tail_tokens(f2, p) if f and f2 > cap else 0
        self.reuse_tail = bool(f and f2) and (not self.seal_tail or tail_tokens(f2, p) == p)
        self.new_tail = bool(f2) and not self.reuse_tail
        self.at_level(store)

    def at_level(self, store: Appending) -> None:
        """Decide the formats and the peak need at the store's level in force (again after a squeeze raised it)."""
        ns = self.ns
        self.fmt = ns.seal_fmt(store._fmt)
        self.sink_fmt = store._sink_fmt(ns, store._fmt) if self.sink_top else RAW
        self.exit_flags = sp.FLAG_WINDOW | store._ahead_flag()
        self.row_plans = [store._row_plan(self, r) for r in range(self.row, self.new_rows)]
        # Rows at their top rung (q4; a sink row's: the 8-bit rung, or fp16 when it stays so) never need
        # compaction. Decided here, at the format the rows are sealed at, not at the commit (the level may change
        # in between).
        q = ns.quant_layers
        self.logged = [r for r in range(self.window_done, self.out_rows)
                       if q and sp.RUNG[self.row_fmt(r)] < (self.sink_top if r < self.sink_rows else 2)]
        need = sum(plan.need for plan in self.row_plans) + sp.ROW_META_BYTES * len(self.logged)
        # a row leaving the window is re-encoded: a new record, and the old one may go to the pool, which charges
        # PAGE_META_BYTES on top of its bytes (the page's own metadata moves with the new record)
        for r in self.exits if q else ():
            f = self.row_fmt(r)
            if f != RAW:
                need += ns.seal_bytes(f, q) + len(q) * sp.PAGE_META_BYTES
        if self.grow_to:
            need += ns.token_bytes * self.grow_to + sp.TAIL_META_BYTES
        if self.new_tail:
            need += ns.token_bytes * tail_tokens(self.new_fill, store.page_tokens) + sp.TAIL_META_BYTES
        self.need = need + (ns.seq_meta if self.seq is None else 0)

    def row_fmt(self, r: int) -> str:
        """The format row ``r`` is sealed at once out of the window."""
        return self.sink_fmt if r < self.sink_rows else self.fmt


class Built:
    """Step 3's result, off to the side until the commit: the buffers ``taken``, the ``sealed`` rows (records and
    their plan), the re-encoded window exits (``swaps``: layer, row, record), the buffer row ``row`` was written
    to (``page``: the tail or a grown copy) and a ``new_tail``."""

    __slots__ = ("taken", "sealed", "swaps", "page", "new_tail")

    def __init__(self, page: np.ndarray | None) -> None:
        self.taken = sp.Taken()
        self.sealed: list[tuple[list[bytearray], store_seq.RowPlan]] = []
        self.swaps: list[tuple[int, int, bytearray]] = []
        self.page = page
        self.new_tail: np.ndarray | None = None


class Appending:
    page_tokens: int
    window_tokens: int
    sink_tokens: int
    sink_raw: bool
    eight_bit: str
    capacity_bytes: int
    _lock: threading.RLock
    _unpinned: threading.Condition
    _pinned: set[tuple[str, SeqId]]
    _readers: int
    _ledger: sp.Ledger
    _log: store_seq.CompactionLog
    _seqs: OrderedDict[tuple[str, SeqId], Seq]
    _holding: dict[str, Namespace]
    _fmt: str
    _epoch: int
    _ahead: Level | None
    _tokens: int
    _window_encodes: int
    _cal_held_pages: int
    _cal_raw_pages: int
    _admit: Callable[..., bool]
    _can_squeeze: Callable[[], bool]
    _squeeze: Callable[[int], bool]
    _make_room: Callable[..., None]

    def _append(self, ns: Namespace, key: tuple[str, SeqId], seq: Seq | None, k16: np.ndarray, v16: np.ndarray,
                position: int) -> Seq:
        """(Under the lock) append ``k16`` / ``v16`` ``[L, T, H, D]`` (checked, T > 0) to ``seq`` (None: create
        it). Raises InFlight when it must make room while other appends are in flight (nothing was touched)."""
        if seq is not None and self._append_in_tail(seq, k16, v16):
            return seq
        plan = AppendPlan(self, ns, key, seq, k16.shape[1], position)
        evict = self._make_room_for(plan, k16, v16)
        built = self._build(plan, k16, v16, evict)
        return self._commit(plan, built, k16, v16)

    def _append_in_tail(self, seq: Seq, k16: np.ndarray, v16: np.ndarray) -> bool:
        """The decode step's case: the tokens fit in the hot tail as it is, so nothing is sealed, allocated or
        leaves the window; what the four steps do then, without their planning. False (nothing done) otherwise."""
        tail, p, n = seq.tail, self.page_tokens, seq.length
        end = n + k16.shape[1]
        f, f2 = n % p, end % p
        if tail is None or end - f2 != n - f or f2 > tail.shape[2] or self._ledger.used > self.capacity_bytes \
                or max(0, end - self.window_tokens) // p > seq.window_done:
            return False
        sp.refuse_nonfinite(k16, "keys", n)
        sp.refuse_nonfinite(v16, "values", n)
        np.copyto(tail[0, :, f:f2], k16)
        np.copyto(tail[1, :, f:f2], v16)
        seq.length = end
        self._tokens += k16.shape[1]
        return True

    def _make_room_for(self, plan: AppendPlan, k16: np.ndarray, v16: np.ndarray) -> bool:
        """Step 2: compress until the plan fits (re-planning at a level the squeeze raised), then admit it. Returns
        whether the build must end by evicting (kvd.store.evict); raises OutOfMemory, or InFlight."""
        cap, led = self.capacity_bytes, self._ledger

        def validate() -> None:  # a full pass, only paid when the append does not fit
            sp.refuse_nonfinite(k16, "keys", plan.length)
            sp.refuse_nonfinite(v16, "values", plan.length)

        if self._pinned and led.used + plan.need > cap:
            raise InFlight  # nothing is touched yet; compressing and evicting run with no append in flight
        if led.used + plan.need > cap and self._can_squeeze():
            validate()  # bad data changes nothing, not even the level
            # compress before forgetting (kvd.store.compact). A level the squeeze raised can make this append
            # need more (rows leaving the window are then re-encoded): squeeze again for the new need.
            while self._squeeze(plan.need):
                plan.at_level(self)
                if led.used + plan.need <= cap or not self._can_squeeze():
                    break
        return self._admit(plan.need, plan.seq, plan.key, plan.tokens, validate)

    def _build(self, plan: AppendPlan, k16: np.ndarray, v16: np.ndarray, evict: bool) -> Built:
        """Step 3: every new buffer, filled and checked, off to the side; then room made by evicting if ``evict``.
        On any error the buffers go back and nothing changed."""
        p, t, ns, led = self.page_tokens, plan.tokens, plan.ns, self._ledger
        f, f2, n = plan.fill, plan.new_fill, plan.length
        built = Built(plan.tail)
        taken = built.taken
        keep = min(t, f2)  # the last `keep` input tokens end in the hot tail: checked here, copied below
        try:
            if keep:
                sp.refuse_nonfinite(k16[:, t - keep :], "keys", plan.new_length - keep, first=n)
                sp.refuse_nonfinite(v16[:, t - keep :], "values", plan.new_length - keep, first=n)
            if f:
                assert plan.tail is not None
                if plan.grow_to:
                    built.page = led.take_tail((2, ns.layers, plan.grow_to, ns.heads, ns.head_dim), taken)
                    np.copyto(built.page[:, :, :f], plan.tail[:, :, :f])
                page = built.page
                assert page is not None
                m = min(t, p - f)  # rows [f, f+m) of the tail are not visible until the length moves
                np.copyto(page[0, :, f : f + m], k16[:, :m])
                np.copyto(page[1, :, f : f + m], v16[:, :m])
            jobs: list[sp.SealJob] = []
            for r, row_plan in zip(range(plan.row, plan.new_rows), plan.row_plans, strict=True):
                if r == plan.row and f:
                    assert built.page is not None
                    src_k, src_v, a = built.page[0], built.page[1], 0
                else:
                    src_k, src_v, a = k16, v16, r * p - n
                recs = sp.take_row(led.pool, row_plan.layers, taken)
                jobs.append((recs, row_plan.layers, row_plan.batch, src_k, src_v, a, r))
                built.sealed.append((recs, row_plan))
            parallel = len(jobs) * ns.row_bytes >= page_batch.PARALLEL_MIN_BYTES
            if evict or 2 * k16.nbytes < UNLOCKED_MIN_BYTES:
                sp.seal_rows(jobs, p, parallel=parallel, first=n)
            else:
                self._seal_unlocked(plan, jobs, parallel)
            self._encode_exits(plan, built)
            if plan.new_tail:
                built.new_tail = led.take_tail(ns.tail_shape(f2), taken)
                np.copyto(built.new_tail[0, :, :f2], k16[:, t - f2 :])
                np.copyto(built.new_tail[1, :, :f2], v16[:, t - f2 :])
            if evict:  # built and checked: only now may other sequences make way for it
                self._make_room(plan.need, plan.key)
        except BaseException:
            led.give_back(taken)
            raise
        led.adopt(taken)
        return built

    def _seal_unlocked(self, plan: AppendPlan, jobs: list[sp.SealJob], parallel: bool) -> None:
        """A large append that fits encodes without the lock (kvd.store.core, "Threads"): its sequence pinned and
        its peak reserved meanwhile. Other threads may change the level or compact: the commit follows the plan."""
        self._pinned.add(plan.key)
        self._ledger.reserved += plan.need
        self._lock.release()
        try:
            sp.seal_rows(jobs, self.page_tokens, parallel=parallel, first=plan.length)
        finally:
            self._lock.acquire()
            self._ledger.reserved -= plan.need
            self._pinned.discard(plan.key)
            self._unpinned.notify_all()  # waiters run once this append has committed (they need the lock)

    def _encode_exits(self, plan: AppendPlan, built: Built) -> None:
        """The sealed rows leaving the window, re-encoded at their format (kept as they are at fp16)."""
        seq, ns = plan.seq, plan.ns
        for r in plan.exits if ns.quant_layers else ():
            fmt = plan.row_fmt(r)
            if fmt == RAW:
                continue
            assert seq is not None
            for i in ns.quant_layers:
                old = seq.pages[i][r]
                kp, vp = sp.decode_record(old, ns.record_sizes(old))
                rec = self._seal(ns, fmt, kp, vp, i, r, built.taken, plan.exit_flags)
                built.swaps.append((i, r, rec))

    def _commit(self, plan: AppendPlan, built: Built, k16: np.ndarray, v16: np.ndarray) -> Seq:
        """Step 4 (nothing here can fail): the new pages, window exits, log entries and tail go into the page
        table and the ledger, as the plan decided."""
        ns, led, seq = plan.ns, self._ledger, plan.seq
        if seq is None:
            seq = Seq(ns, plan.key, plan.position, plan.sink_rows, plan.sink_top)
            self._seqs[plan.key] = seq
            ns.sequences += 1
            self._holding[ns.name] = ns
            led.meta_bytes += ns.seq_meta
        for i, r, rec in built.swaps:
            old = seq.pages[i][r]
            seq.pages[i][r] = rec
            seq.nbytes += led.add_page(rec) - led.remove_page(old, pool=not self._readers)
            self._window_encodes += 1
        for recs, row_plan in built.sealed:
            for page_list, rec in zip(seq.pages, recs, strict=True):
                page_list.append(rec)
            led.add_pages(row_plan.counts, ns.layers)
            seq.nbytes += row_plan.need
            self._cal_held_pages += row_plan.held
        q = ns.quant_layers
        if plan.fmt == RAW and self._fmt != RAW and q:  # the namespace's calibration keeps these rows fp16
            rows = [r for r in plan.exits if r >= plan.sink_rows]
            rows += [r for r in range(plan.row, plan.new_rows) if plan.sink_rows <= r < plan.out_rows]
            self._cal_raw_pages += len(rows) * len(q)
        for r in range(plan.window_done, plan.out_rows) if q else ():  # rows now out of the window, oldest first
            if r >= plan.sink_rows or plan.sink_top:
                # rows out of the window are not yet compacted, so every quantized layer of one holds the same
                # format (and, unless a calibration protects some layers' heads, the same record size)
                rec = seq.pages[q[0]][r]
                backlog = ns.backlog if r >= plan.sink_rows else ns.sink_backlog
                if ns.mixed:
                    backlog[sp.current_fmt(rec)] += sum(len(seq.pages[i][r]) for i in q)
                else:
                    backlog[sp.current_fmt(rec)] += len(rec) * len(q)
        for r in plan.logged:  # compaction candidates, oldest first
            self._log.add(seq, r)
        seq.nbytes += sp.ROW_META_BYTES * len(plan.logged)
        led.meta_bytes += sp.ROW_META_BYTES * len(plan.logged)
        seq.window_done = max(plan.window_done, plan.out_rows)
        self._commit_tail(plan, built, seq, k16, v16)
        seq.length = plan.new_length
        self._tokens += plan.tokens
        return seq

    def _commit_tail(self, plan: AppendPlan, built: Built, seq: Seq, k16: np.ndarray, v16: np.ndarray) -> None:
        """The sequence's tail after the append: the old one, a grown one, a new one or none (AppendPlan)."""
        led, old, page, f2 = self._ledger, plan.tail, built.page, plan.new_fill
        if plan.reuse_tail and plan.seal_tail:  # sealed from `page`: the tokens left take its first rows
            assert page is not None
            np.copyto(page[0, :, :f2], k16[:, plan.tokens - f2 :])
            np.copyto(page[1, :, :f2], v16[:, plan.tokens - f2 :])
        after = page if plan.reuse_tail else built.new_tail
        if after is old:
            return
        if old is not None:
            seq.nbytes -= led.remove_tail(old, pool=True)
        if page is not old and page is not after:  # a page the row was sealed from, and nothing more
            assert page is not None
            led.free_tail(page)
        if after is not None:
            seq.nbytes += led.add_tail(after)
        seq.tail = after

    # ------------------------------------------------------------------------------------------ rows

    def _sink_rows_at(self, position: int) -> int:
        """Rows of a sequence starting at prompt ``position`` that hold any of the prompt's sink tokens."""
        return -(-(self.sink_tokens - position) // self.page_tokens) if position < self.sink_tokens else 0

    def _row_plan(self, plan: AppendPlan, row: int) -> store_seq.RowPlan:
        """How a row is sealed: raw if protected (a sink row that stays fp16; in the window, flagged as held
        there), else at its format at the level in force (:meth:`AppendPlan.row_fmt`) with raw layers raw."""
        ns = plan.ns
        if row < plan.sink_rows and not plan.sink_top:
            return ns.plan(RAW, 0, self._epoch)
        if row >= plan.out_rows:
            return ns.plan(RAW, sp.FLAG_WINDOW, self._epoch)
        return ns.plan(plan.row_fmt(row), self._ahead_flag(), self._epoch)

    def _sink_top(self, ns: Namespace) -> int:
        """The most compact rung of ``ns``'s sink rows: 0 (fp16) with ``sink_raw`` or a calibration in force
        (whose errors were measured with the sink at fp16), else 1 (the 8-bit rung, at q4: :meth:`_sink_fmt`)."""
        return 0 if self.sink_raw or (ns.prot is not None and ns.prot.applies) else 1

    def _sink_fmt(self, ns: Namespace, fmt: str) -> str:
        """The format of ``ns``'s sink rows that may be compressed, out of the window, when the level in force
        seals at ``fmt``: one rung less compact, fp16 up to the 8-bit rung and the 8-bit rung at q4."""
        return ns.seal_fmt(self.eight_bit) if sp.RUNG[fmt] > 1 else RAW

    def _ahead_flag(self) -> int:
        return sp.FLAG_AHEAD_SEALED if self._ahead is not None and self._fmt != RAW else 0

    def _seal(
        self, ns: Namespace, fmt: str, kp: np.ndarray, vp: np.ndarray, layer: int, row: int, taken: sp.Taken,
        flags: int,
    ) -> bytearray:  # fmt: skip
        """A record of ``fmt`` (taken into ``taken``) holding pages ``kp`` / ``vp`` of ``layer``, row ``row``."""
        prot = ns.prot if ns.prot is not None and ns.prot.applies and fmt != RAW else None
        if prot is None:
            size, sizes = ns.rec_bytes[fmt], ns.page_bytes[fmt]
            rh = () if fmt == RAW else ns.raw_heads
            kw: tuple[dict[str, Any], dict[str, Any]] = ({"raw_heads": rh}, {"raw_heads": rh})
        else:
            kb, vb, size, kk, vk, held = prot.layer(layer, fmt)
            sizes, kw = (kb, vb), (kk, vk)
            self._cal_held_pages += held
        rec = self._ledger.take_record(size, taken)
        p = self.page_tokens
        sp.encode_record(
            rec, fmt, sizes, kp, vp, protect=kw, epoch=self._epoch, flags=flags,
            where=f"layer {layer}, tokens [{row * p}, {row * p + p})",
        )  # fmt: skip
        return rec

