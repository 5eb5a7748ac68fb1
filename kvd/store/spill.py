"""The store's side of its disk tier: spilling a sequence out of RAM, reading a spilled one, taking one back
into RAM to append to it, recovering the namespaces a disk holds, and persisting RAM at a clean stop.

Theory of operation: the disk is the rung after q4. When an append does not fit and the store can compress
no further, :meth:`Eviction._make_room` spills least-recently-used whole sequences (:meth:`Spilling._spill`)
instead of forgetting them; a sequence is then either in RAM or on disk, never both. Its sealed records go to
disk as they are, at the level they were stored, with their history trailers; its hot tail as fp16 pages. A
read of a spilled sequence is served from the file (:meth:`Spilling._disk_view`) and does **not** bring it
back into RAM: a prefix read once per request would otherwise push out the sequences the next decode steps
need, and the OS page cache already keeps a hot file in memory outside the store's budget. An append to a
spilled sequence takes it back first (:meth:`Spilling._promote`: its records return as they are, bit-exact),
because a hot tail is written in place.

Reads and promotions that must read a file raise :class:`OnDisk` when the caller says it may not do disk I/O
(a shard's serving loop): the server then runs the request on its bulk lane. Reading happens without the
store's lock.

This is a mixin of :class:`kvd.store.Store`; it relies on the store's lock, ledger, log and tables. Pure core:
no Ray, no ZeroMQ (the tier's file I/O is in :mod:`kvd.store.disk.files`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd.errors import CorruptPage, LayoutMismatch, UnknownSequence
from kvd.store import pool as sp
from kvd.store import sequences as store_seq
from kvd.store.chains import Chains
from kvd.store.disk import DiskTier
from kvd.store.disk.format import SeqHeader, trailers_digest
from kvd.store.disk.index import Entry
from kvd.store.sequences import Namespace, Seq, SeqId

__all__ = ["OnDisk", "Spilling"]

log = logging.getLogger("kvd.store.disk")

CLOSE_WAIT_S = 10.0  # at a stop, how long one sequence waits for room in the write buffer (a failing disk)


class OnDisk(Exception):
    """(For a server) the operation must read a spilled sequence from disk and the caller said it may not do
    disk I/O on this thread: nothing was done. Run it where disk I/O is allowed."""


class Spilling:
    page_tokens: int
    raw_layers: tuple[int, ...]
    raw_heads: tuple[int, ...]
    _lock: threading.RLock
    _ledger: sp.Ledger
    _log: store_seq.CompactionLog
    _ns: dict[str, Namespace]
    _seqs: OrderedDict[tuple[str, SeqId], Seq]
    _holding: dict[str, Namespace]
    _chains: Chains
    _disk: DiskTier | None
    _tokens: int
    _promotions: int
    _disk_hits: int
    _disk_misses: int
    capacity_bytes: int
    _pinned: set[tuple[str, SeqId]]
    _unpinned: threading.Condition
    _admit: Callable[..., bool]
    _can_squeeze: Callable[[], bool]
    _squeeze: Callable[[int], bool]
    _make_room: Callable[..., None]
    _remove: Callable[..., None]
    _sink_top: Callable[[Namespace], int]
    register: Callable[..., None]

    # ------------------------------------------------------------------------------------------ recovery

    def layouts(self) -> dict[str, tuple[int, int, int]]:
        """Every registered namespace's ``(layers, kv heads, head_dim)`` (those a disk brought back included)."""
        with self._lock:
            return {name: (ns.layers, ns.heads, ns.head_dim) for name, ns in self._ns.items()}

    def _accept_spilled(self, h: SeqHeader) -> str | None:
        """Whether this store can serve a sequence a disk holds (recovery): the same page geometry, and its
        namespace registered here with the same layout (registered from the file if new)."""
        if h.page_tokens != self.page_tokens:
            return f"stored with page_tokens {h.page_tokens}, this store has {self.page_tokens}"
        if h.raw_heads != self.raw_heads or h.raw_layers != self.raw_layers:
            return (f"stored with raw_layers {list(h.raw_layers)} and raw_heads {list(h.raw_heads)}, this store "
                    f"has {list(self.raw_layers)} and {list(self.raw_heads)}")
        layers, heads, dim = h.layout
        try:
            self.register(h.namespace, num_layers=layers, num_kv_heads=heads, head_dim=dim)
        except LayoutMismatch as exc:
            return str(exc)
        if h.sizes is not None:  # records sized by a calibration: read them by their page headers
            self._ns[h.namespace].mixed = True
        return None

    # ------------------------------------------------------------------------------------------ spill

    def _spill(self, seq: Seq, *, wait_s: float = 0.0) -> str | None:
        """(Under the lock) hand ``seq`` to the disk tier and take it out of RAM. Returns None when spilled,
        else why not (then nothing changed)."""
        assert self._disk is not None
        ns = seq.ns
        off = sp.CUR_FMT_FROM_END
        records = [list(recs) for recs in seq.pages]
        rows = len(records[0])
        fill = seq.length - rows * self.page_tokens
        tail = seq.tail[:, :, :fill].copy() if fill and seq.tail is not None else None
        header = SeqHeader(
            namespace=ns.name, layout=(ns.layers, ns.heads, ns.head_dim), page_tokens=self.page_tokens,
            raw_layers=self.raw_layers, raw_heads=self.raw_heads, seq_id=seq.key[1], position=seq.position,
            sink_rows=seq.sink_rows, window_done=seq.window_done, length=seq.length, rows=rows,
            fmts=bytes(rec[-off] for recs in records for rec in recs), tail_fill=fill,
            trailers=trailers_digest(rec for recs in records for rec in recs), serial=0,
            sizes=tuple(len(rec) for recs in records for rec in recs) if ns.mixed else None,
        )  # fmt: skip
        why = self._disk.spill(header, records, tail, wait_s=wait_s)
        if why is None:
            self._remove(seq.key, pool=False, to_disk=True)  # the records now belong to the tier
        return why

    def close(self, *, persist: bool = True) -> None:
        """Stop the disk tier, if any (a shard stopping). ``persist``: first spill every sequence held in RAM,
        least recently used first, so that a restart on the same disk serves them too (as far as the disk
        budget allows: the oldest give way). Nothing else changes; the store should not be used after."""
        if self._disk is None:
            return
        with self._lock:
            if persist:
                lost = 0
                for key in list(self._seqs):
                    if self._spill(self._seqs[key], wait_s=CLOSE_WAIT_S) is not None:
                        lost += 1
                if lost:
                    log.warning("disk tier: %d sequences held in memory could not be written out at the stop "
                                "(%s)", lost, self._disk.stats()["disk_last_error"] or "the disk is full")
            self._disk.close(flush=True)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every spill and removal so far has reached the disk (or failed: ``stats()`` says). True if
        none is left (or there is no disk tier), False on timeout."""
        return self._disk.flush(timeout_s) if self._disk is not None else True

    # ------------------------------------------------------------------------------------------ reads

    def _disk_entry(self, ns: Namespace, key: tuple[str, SeqId]) -> Entry:
        """(Under the lock) the disk entry of a sequence not in RAM; UnknownSequence if there is none."""
        entry = self._disk.get(key) if self._disk is not None else None
        if entry is None:
            self._disk_misses += 1
            raise UnknownSequence(f"no sequence {key[1]!r} in namespace {ns.name!r}")
        return entry

    def _disk_stub(self, entry: Entry, view: store_seq.SeqView, disk_io: bool) -> None:
        """(Under the lock) a read of a spilled sequence begins: a pending one's pages go into ``view`` now (no
        disk read); OnDisk when its file must be read and ``disk_io`` is False; it counts as a use."""
        loaded = self._disk.pending(entry)  # type: ignore[union-attr]
        if loaded is not None:
            view.pages, view.tail = loaded
        elif not disk_io:
            raise OnDisk
        self._disk_hits += 1
        self._disk.touch(entry.key)  # type: ignore[union-attr]

    def _disk_view(self, entry: Entry, view: store_seq.SeqView, *, decoded: bool) -> store_seq.SeqView:
        """(Without the lock) fill ``view`` with ``entry``'s pages, read from disk and verified, unless
        :meth:`_disk_stub` found them in memory. ``decoded``: the caller decodes every page it reads, which
        checks each page's checksum (then a CorruptPage it raises goes to :meth:`_disk_damaged`), so the load
        does not check them twice; pages sent as they are (``get_pages``) are checked here."""
        if view.pages:
            return view
        try:
            view.pages, view.tail = self._disk.load(entry, verify_pages=not decoded)  # type: ignore[union-attr]
        except FileNotFoundError:  # dropped or evicted from disk since the lookup
            raise UnknownSequence(f"no sequence {entry.key[1]!r} in namespace {entry.key[0]!r}") from None
        return view

    def _disk_damaged(self, entry: Entry, exc: CorruptPage) -> CorruptPage:
        """A page of ``entry`` failed its check as it was decoded: the file is dropped; the error to raise."""
        self._disk.discard(entry)  # type: ignore[union-attr]
        return CorruptPage(f"sequence {entry.key[1]!r} of {entry.key[0]!r} on disk is damaged ({exc}); it was "
                           "dropped")

    # ------------------------------------------------------------------------------------------ promotion

    def _promote(self, ns: Namespace, key: tuple[str, SeqId], disk_io: bool) -> None:
        """(Under the lock) if ``key`` is on disk, bring it back into RAM as it is stored, making room as an
        append does (compress, spill others, evict or refuse). Releases the lock while it reads the file."""
        while key not in self._seqs and self._disk is not None:
            entry = self._disk.get(key)
            if entry is None:
                return
            loaded = self._disk.pending(entry)
            if loaded is None:
                if not disk_io:
                    raise OnDisk
                self._lock.release()
                try:
                    loaded = self._disk.load(entry)
                except FileNotFoundError:
                    continue  # gone meanwhile: look again
                finally:
                    self._lock.acquire()
                if key in self._seqs or self._disk.get(key) is not entry:
                    continue  # something changed while the lock was released
            self._adopt(ns, key, entry, *loaded)

    def _adopt(self, ns: Namespace, key: tuple[str, SeqId], entry: Entry, recs: list[list[bytearray]],
               tail: np.ndarray | None) -> None:
        while self._pinned:  # making room runs with no append in flight (kvd.store.core, "Threads")
            self._unpinned.wait()
        if key in self._seqs or self._disk.get(key) is not entry:  # type: ignore[union-attr]
            return
        h = entry.header
        record_bytes = sum(len(r) for layer in recs for r in layer)
        pages_n = sum(len(layer) for layer in recs)
        sink_top = self._sink_top(ns)
        rows = list(range(0 if sink_top else h.sink_rows, h.window_done))  # in a backlog (Seq.sink_top)
        need = record_bytes + sp.PAGE_META_BYTES * pages_n + ns.seq_meta + sp.ROW_META_BYTES * len(rows)
        tail_shape = ns.tail_shape(tail.shape[2]) if tail is not None else None  # a tail of its size, as appends
        need += ns.token_bytes * tail_shape[2] + sp.TAIL_META_BYTES if tail_shape is not None else 0
        if self._ledger.used + need > self.capacity_bytes and self._can_squeeze():
            while self._squeeze(need):  # compress before spilling or forgetting others
                if self._ledger.used + need <= self.capacity_bytes or not self._can_squeeze():
                    break
        disk = self._disk
        assert disk is not None
        disk.touch(key)  # spilling others to make room evicts this one from a full disk last
        if self._admit(need, None, key, h.length, lambda: None):
            self._make_room(need, key)
        disk.remove(key)  # (if the full disk forgot it meanwhile, the records read are still here)
        self._promotions += 1
        seq = Seq(ns, key, h.position, h.sink_rows, sink_top)
        seq.pages = [list(layer) for layer in recs]
        seq.length, seq.window_done = h.length, h.window_done
        led = self._ledger
        led.record_bytes += record_bytes
        for layer in seq.pages:
            for rec in layer:
                seq.nbytes += led.add_page(rec)
        if tail is not None and tail_shape is not None:
            arr, _ = led.pool.take_tail(tail_shape)
            arr[:, :, : tail.shape[2]] = tail
            led.tail_bytes += arr.nbytes
            seq.tail = arr
            seq.nbytes += led.add_tail(arr)
        q = ns.quant_layers
        for r in rows:  # as Store._append counts rows leaving the window (kvd.store.core)
            backlog, top = (ns.backlog, 2) if r >= h.sink_rows else (ns.sink_backlog, sink_top)
            for i in q:
                rec = seq.pages[i][r]
                backlog[sp.current_fmt(rec)] += len(rec)
            if q and sp.RUNG[sp.current_fmt(seq.pages[q[0]][r])] < top:
                self._log.add(seq, r)
                seq.nbytes += sp.ROW_META_BYTES
                led.meta_bytes += sp.ROW_META_BYTES
        led.meta_bytes += ns.seq_meta
        ns.sequences += 1
        self._holding[ns.name] = ns
        self._tokens += h.length
        self._seqs[key] = seq
        self._chains.add(key, depth=h.position)  # (its link to its parent is not on disk; its children's are)

    # ------------------------------------------------------------------------------------------ introspection

    def _disk_explain(self, entry: Entry, layer: int, token: int) -> dict[str, Any]:
        """``explain`` of a spilled sequence, from its header (no disk read)."""
        h = entry.header
        p = self.page_tokens
        i = store_seq.int_arg("layer", layer, 0, h.layout[0] - 1)
        tok = store_seq.int_arg("token", token, 0, h.length - 1)
        r = tok // p
        reasons = ["on disk: spilled when the shard's memory was full at its most compact level"]
        level = "fp16"
        if r < h.rows:
            level = sp.FMT_NAME[h.fmts[i * h.rows + r]]
        else:
            reasons.append("hot tail (kept fp16)")
        if i in h.raw_layers:
            reasons.append("raw layer")
        if r < h.sink_rows:
            reasons.append("sink")
        return {"level": level, "page": r, "reasons": reasons, "sealed_level": None, "sealed_epoch": None,
                "recompressed": [], "tier": "disk"}
