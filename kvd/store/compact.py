"""Re-compression of a store's cold pages: after a level rise (:meth:`Compaction.compact`), and when an append
does not fit (:meth:`Compaction._squeeze`).

Theory of operation: rows enter the store's compaction log in the order they become eligible (sealed, out of the
window, not protected), which is their age order; a sink row only to the 8-bit rung, at q4. After a level
rise, :meth:`Compaction.compact` walks the log from its cursor and re-encodes (decode, then encode at the format
in force) every page on a lower rung, within a byte budget per call, so no request waits for a whole pass. A
page moves only up a rung and only if that makes it smaller; the old buffer is freed, not pooled, because
compaction runs to free memory. Re-encoding an 8-bit page to q4 quantizes a second time: its error is q4's plus
the 8-bit error it already had.

*Compress before forgetting.* An append that does not fit first *squeezes* the store: it compacts, oldest first,
toward the level in force, and when nothing is left to compact there it raises the store's own level one rung
(never past ``max_level``, the most compact level the policy allows) and goes on, until the append fits or
nothing more can be compressed. Only then may it evict (LRU) or be refused. The shard then runs *ahead* of the
cluster's level: it reports so, the coordinator's pressure (the fullest shard counts) catches the cluster up,
and the lead ends when an order reaches its level or steps the cluster down (the coordinator steps down only
when the data, re-counted at the lower level's density, fits: kvd.policy). Pages sealed or re-encoded ahead are
flagged in their trailer, so ``explain`` says why. The work an append pays is proportional to the bytes it
needs: each page re-encoded frees 40-70% of itself (8-bit -> q4, fp16 -> 8-bit, fp16 -> q4).

This is a mixin of :class:`kvd.store.Store`, split out because it is a job of its own; it relies on the store's
lock, ledger, log, namespaces, level format and epoch. Pure core: no Ray, no ZeroMQ.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvd.policy import Level
from kvd.store import pool as sp
from kvd.store.sequences import Namespace, Seq, int_arg

if TYPE_CHECKING:
    import numpy as np

    from kvd.store import sequences as store_seq

__all__ = ["Compaction"]


class Compaction:
    capacity_bytes: int
    _lock: threading.RLock
    _ledger: sp.Ledger
    _log: store_seq.CompactionLog
    _ns: dict[str, Namespace]
    _holding: dict[str, Namespace]
    _fmt: str
    _level: Level
    _ordered: Level
    _ahead: Level | None
    _ahead_reason: str
    _level_reason: str
    _max_rung: int
    _epoch: int
    _recompressed_pages: int
    _recompressed_bytes: int
    _squeezes: int
    _squeezed_bytes: int
    _aheads: int

    if TYPE_CHECKING:  # provided by Store

        def _seal(
            self, ns: Namespace, fmt: str, kp: np.ndarray, vp: np.ndarray, layer: int, row: int, taken: sp.Taken,
            flags: int,
        ) -> bytearray: ...  # fmt: skip

        def _set_level_in_force(self, level: Level) -> None: ...

        def _rung_level(self, rung: int) -> Level: ...

        def _sink_fmt(self, ns: Namespace, fmt: str) -> str: ...

    def compact(self, budget_bytes: int) -> int:
        """Re-encode, oldest first, sealed unprotected pages on a lower rung than the level in force, until the
        stored bytes of the pages re-encoded in this call would exceed ``budget_bytes`` (a budget smaller than
        one page does nothing). A page is only re-encoded if that makes it smaller (always so for real page
        sizes; a page of a few tokens can grow at q4 through section alignment). Returns the bytes freed (the
        fall of ``used_bytes``)."""
        budget = int_arg("budget_bytes", budget_bytes, 0)
        with self._lock:
            if not self._backlog_bytes():
                return 0
            before, spent = self._ledger.used, [0]

            def over_budget(rec: bytearray) -> bool:
                if spent[0] + len(rec) > budget:
                    return True
                spent[0] += len(rec)
                return False

            self._compact_pages(over_budget)
            return before - self._ledger.used

    def _compact_pages(self, stop: Callable[[bytearray], bool]) -> None:
        """Walk the log from its cursor, re-encoding every page that shrinks at the level in force, until
        ``stop(record)`` (asked before each page) says so or the log ends."""
        log = self._log
        while log.cursor < len(log.entries):
            seq, r = log.entries[log.cursor]
            sink = r < seq.sink_rows
            for i in seq.ns.quant_layers if seq.alive else ():
                rec = seq.pages[i][r]
                if not self._shrinks(seq.ns, sp.current_fmt(rec), sink):
                    continue
                if stop(rec):
                    return
                if self._ledger.used + seq.ns.rec_bytes[self._fmt] > self.capacity_bytes:
                    # The new page exists for an instant next to the old one. A full store still compacts
                    # (that is how it stops being full): one page of transient overshoot, which
                    # used_bytes never shows, and only after the pool is emptied.
                    self._ledger.pool.clear()
                self._recompress(seq, i, r, rec, sink)
            log.cursor += 1

    def _can_squeeze(self) -> bool:
        """Whether compression could still free memory: a page awaits re-encoding, or the level may rise."""
        return sp.RUNG[self._fmt] < self._max_rung or self._backlog_bytes() > 0

    def _squeeze(self, need: int) -> bool:
        """Compress until ``need`` more bytes fit or nothing more can be compressed (module docstring). Returns
        whether the level in force changed (the caller re-plans what it seals). The caller holds the lock and
        has checked its data: a refused append must not change the level."""
        cap, led = self.capacity_bytes, self._ledger
        before, level = led.used, self._level
        led.pool.clear()
        while led.used + need > cap:
            if self._backlog_bytes():
                self._compact_pages(lambda _rec: led.used + need <= cap)
                if led.used + need <= cap:
                    break
            rung = sp.RUNG[self._fmt]
            if rung >= self._max_rung:
                break
            ahead = self._rung_level(rung + 1)
            self._ahead = ahead
            self._aheads += 1
            self._ahead_reason = self._level_reason = (
                f"an append needed {need} bytes with {led.used} of {cap} used at {self._fmt}: running ahead of "
                f"the cluster's {self._ordered.tag} (epoch {self._epoch}) at {ahead.tag}"
            )
            self._set_level_in_force(ahead)
        self._squeezes += 1
        self._squeezed_bytes += before - led.used
        return self._level is not level

    def _target(self, ns: Namespace, sink: bool) -> str:
        """The format the level in force re-encodes a page of ``ns`` to (a sink row's: ``_sink_fmt``)."""
        return self._sink_fmt(ns, self._fmt) if sink else ns.seal_fmt(self._fmt)

    def _shrinks(self, ns: Namespace, fmt: str, sink: bool) -> bool:
        """Whether a page of ``fmt`` (of a sink row if ``sink``) awaits re-encoding at the level in force (a
        higher rung, fewer bytes)."""
        target = self._target(ns, sink)
        return sp.RUNG[fmt] < sp.RUNG[target] and ns.rec_bytes[target] < ns.rec_bytes[fmt]

    def _backlog_bytes(self) -> int:
        return sum(b for ns in self._holding.values()
                   for backlog, sink in ((ns.backlog, False), (ns.sink_backlog, True))
                   for fmt, b in backlog.items() if b and self._shrinks(ns, fmt, sink))

    def _recompress(self, seq: Seq, layer: int, row: int, old: bytearray, sink: bool) -> None:
        ns = seq.ns
        fmt = self._target(ns, sink)
        kp, vp = sp.decode_record(old, ns.record_sizes(old))
        taken = sp.Taken()
        try:
            rec = self._seal(ns, fmt, kp, vp, layer, row, taken, 0)
        except BaseException:
            self._ledger.give_back(taken)
            raise
        self._ledger.adopt(taken)
        sp.copy_trailer_recompressed(old, rec, epoch=self._epoch, fmt=fmt, ahead=self._ahead is not None)
        seq.pages[layer][row] = rec
        backlog = ns.sink_backlog if sink else ns.backlog
        backlog[sp.current_fmt(old)] -= len(old)
        backlog[fmt] += len(rec)
        # the old buffer is freed, not pooled: compaction runs to free memory
        seq.nbytes += self._ledger.add_page(rec) - self._ledger.remove_page(old, pool=False)
        self._recompressed_pages += 1
        self._recompressed_bytes += len(old)
