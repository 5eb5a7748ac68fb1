"""Making room in a store: admitting an append against the capacity, LRU eviction, and removing a sequence.

Theory of operation: an append computes the bytes it will allocate (its peak) before touching anything, and asks
:meth:`Eviction._admit` whether they fit. If not, and room can be made (LRU eviction on, and evicting every
other sequence would be enough), the append is built first and :meth:`Eviction._make_room` then empties the
pool and evicts whole sequences, those no lookup can reach first, then chain tails, each least recently used
first (:mod:`kvd.store.chains`; without chains, plain LRU); building first means bad data (NaN/Inf, refused by the
encoding pass) evicts nothing, with no separate pass over the tokens. When no room can be made the append is
refused with OutOfMemory, after checking its data so that bad data is named as such. :meth:`Eviction._remove`
takes a sequence out (drop and eviction) in one pass over its pages.

This is a mixin of :class:`kvd.store.Store`, split out because it is a job of its own; it relies on the store's
lock (held by the caller), ledger, log and sequence table. Pure core: no Ray, no ZeroMQ.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvd.errors import OutOfMemory
from kvd.policy import Level
from kvd.store import pool as sp
from kvd.store import sequences as store_seq
from kvd.store.chains import UNREACHABLE, Chains
from kvd.store.sequences import Namespace, Seq, SeqId

if TYPE_CHECKING:
    from kvd.store.disk import DiskTier

__all__ = ["Eviction"]


class Eviction:
    capacity_bytes: int
    eviction: str
    _ledger: sp.Ledger
    _log: store_seq.CompactionLog
    _seqs: OrderedDict[tuple[str, SeqId], Seq]
    _holding: dict[str, Namespace]
    _chains: Chains
    _ns_meta: int
    _tokens: int
    _evictions: int
    _evicted_tokens: int
    _refusals: int
    _fmt: str
    max_level: Level
    _disk: DiskTier | None
    _spill_overflows: int
    _spill: Callable[..., str | None]

    def _admit(
        self, need: int, seq: Seq | None, key: tuple[str, SeqId], t: int, validate: Callable[[], None]
    ) -> bool:
        """Whether ``need`` more bytes can be had: False if they fit now, True if LRU eviction will make room
        (:meth:`_make_room`, called once the append is built: its encoding refuses NaN/Inf, so bad data evicts
        nothing, and nobody pays a separate pass over the tokens first). Raises OutOfMemory when no room can be
        made; ``validate`` runs before that, so bad data is named as such rather than as too big."""
        cap = self.capacity_bytes
        if self._ledger.used + need <= cap:
            return False
        floor = self._ns_meta + (seq.nbytes if seq is not None else 0)  # what evicting everyone else leaves
        if (self.eviction == "lru" or self._disk is not None) and floor + need <= cap:
            return True  # (under eviction="none", _make_room refuses if the disk cannot take what must go)
        validate()
        self._ledger.pool.clear()
        if self._ledger.used + need <= cap:
            return False
        self._refusals += 1
        why = "eviction is off" if self.eviction == "none" else "the sequence alone does not fit"
        raise OutOfMemory(
            f"append of {t} tokens to {key[1]!r} in {key[0]!r} needs {need} bytes; {self._ledger.used} of "
            f"{cap} bytes are used at {self._fmt}, compressed as far as max_level {self.max_level.tag} allows "
            f"({why}); nothing was written"
        )

    def _make_room(self, need: int, key: tuple[str, SeqId]) -> None:
        """Free room for ``need`` more bytes: the pool first, then whole sequences in the order of
        :mod:`kvd.store.chains` (unreachable, chain tails, then least recently used first), never ``key``'s
        (:meth:`_admit` has checked that evicting every other sequence is enough). With a disk tier they are
        spilled to disk (kvd.store.spill), except unreachable ones, which are evicted; one the disk cannot take
        is evicted, or under ``eviction="none"`` the append is refused with the disk's reason."""
        cap = self.capacity_bytes
        if self._ledger.used + need <= cap:
            return
        self._ledger.pool.clear()
        while self._ledger.used + need > cap:
            victim = self._chains.victim(exclude=key)
            assert victim is not None  # (_admit checked that evicting every other sequence is enough)
            lost = self.eviction == "lru" and self._chains.tier(victim) == UNREACHABLE  # not worth a disk write
            if self._disk is not None and not lost:
                why = self._spill(self._seqs[victim])
                if why is None:
                    continue
                if self.eviction == "none":
                    self._refusals += 1
                    raise OutOfMemory(
                        f"{need} more bytes are needed for {key[1]!r} in {key[0]!r}: {self._ledger.used} of {cap} "
                        f"bytes are used at {self._fmt}, compressed as far as max_level {self.max_level.tag} "
                        f"allows, and the disk cannot take {victim[1]!r}: {why} (eviction is off); nothing was "
                        "written"
                    )
                self._spill_overflows += 1
            self._evictions += 1
            self._evicted_tokens += self._seqs[victim].length
            self._remove(victim, pool=False)

    def _remove(self, key: tuple[str, SeqId], *, pool: bool, to_disk: bool = False) -> None:
        """Take ``key`` out of RAM: evicted or dropped, or (``to_disk``) spilled: its chain stays reachable."""
        seq = self._seqs.pop(key)
        self._chains.remove(key, held=to_disk)
        ns = seq.ns
        # one pass tallying (format code -> pages, bytes), then one ledger update: the per-page cost of a drop
        off, lo, hi = sp.CUR_FMT_FROM_END, seq.sink_rows, seq.window_done
        first = 0 if seq.sink_top else lo  # rows [first, hi) are in a backlog: [first, lo) in the sinks'
        tally: dict[int, list[int]] = {}
        backlog: dict[int, int] = {}
        sink_backlog: dict[int, int] = {}
        give = self._ledger.pool.give_record if pool else None
        for i, recs in enumerate(seq.pages):
            eligible = not ns.raw_layer[i]
            for r, rec in enumerate(recs):
                code, size = rec[-off], len(rec)
                t = tally.get(code)
                if t is None:
                    t = tally[code] = [0, 0]
                t[0] += 1
                t[1] += size
                if eligible and first <= r < hi:
                    b = backlog if r >= lo else sink_backlog
                    b[code] = b.get(code, 0) + size
                if give is not None:
                    give(rec)
        for code, size in backlog.items():
            ns.backlog[sp.FMT_NAME[code]] -= size
        for code, size in sink_backlog.items():
            ns.sink_backlog[sp.FMT_NAME[code]] -= size
        self._ledger.remove_pages({sp.FMT_NAME[c]: (n, b) for c, (n, b) in tally.items()})
        if seq.tail is not None:
            self._ledger.remove_tail(seq.tail, pool=pool)
        self._ledger.meta_bytes -= ns.seq_meta + seq.logged * sp.ROW_META_BYTES
        self._log.forget(seq)  # its log entries go at a later prune (CompactionLog), uncharged from now on
        self._tokens -= seq.length
        ns.sequences -= 1
        if not ns.sequences and not any(ns.backlog.values()) and not any(ns.sink_backlog.values()):
            del self._holding[ns.name]  # (a backlog left without pages would stay in sight)
        seq.pages, seq.tail, seq.alive = [], None, False
        self._log.prune()
