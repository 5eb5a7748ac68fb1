"""The paged KV store of one shard: hot tails, sealed pages, protection, compaction, eviction, accounting.

Theory of operation
-------------------
A namespace fixes a layout (``num_layers`` L, ``num_kv_heads`` H, ``head_dim`` D). A sequence is, per layer, a
list of sealed pages of ``page_tokens`` (P) tokens plus at most one *hot tail*. All layers receive the same
tokens, so they share the page boundaries: page *row* ``r`` holds tokens ``[r*P, (r+1)*P)`` of every layer.

* **Hot tail.** One float16 array ``[2, L, C, H, D]`` (keys, values) per sequence, allocated lazily when a token
  lands in a partial page and written in place. Its capacity C is what it holds rounded up to a power of four, at
  most P (:func:`~kvd.store.sequences.tail_tokens`): a tail that must hold more grows to the next step (a new
  array, the tokens it held copied over), an append that seals the row seals it from a whole page (the tail grown
  to P first if it is smaller), and the tokens left after a seal go to a tail of their own size; a sequence whose
  length is a multiple of P holds no tail.
* **Sealing.** A full page is encoded with :func:`kvd.pages.encode_into` into a *record* (one ``bytearray``:
  key page, value page, 32-byte history trailer; :mod:`kvd.store.pool`) at the format of the level in force,
  unless protected: a page of a ``raw_layers`` layer, or a page still inside the last ``window_tokens``
  tokens, stays fp16; ``raw_heads`` stay fp16 inside quantized pages. A page holding any of the prompt's first
  ``sink_tokens`` tokens (a sequence's token 0 is at prompt position ``position``, given when it is created,
  default 0) is kept one rung less compact than the level: fp16, and ``eight_bit`` at q4 (``sink_raw``, or a
  namespace's calibration, keeps it fp16 at q4 too). A window page is encoded at the level in force when its
  last token leaves the window.
* **Levels.** ``Level.FP16`` seals fp16 pages, ``Level.Q8`` and ``Level.FP8`` both mean the 8-bit rung and seal
  at the store's ``eight_bit`` format (``Level.FP8`` while ``eight_bit == "q8"`` seals ``fp8_e4m3``: the order
  asked for a float format), ``Level.Q4`` seals q4. Orders carry epochs; an older epoch is ignored.
* **Compaction.** Rows become compaction candidates, in a log, in the order they become eligible (sealed out of
  the window and not protected; a sink row only toward the 8-bit rung, at q4): the log order is the age order.
  After a level rise, :meth:`Store.compact` walks the log from the oldest row and re-encodes (decode, then
  encode at the new format) every page on a lower rung, within a byte budget per call. Re-encoding an 8-bit page
  to q4 quantizes a second time, so its error is that of q4 plus the 8-bit error it already had. Level drops
  only change new pages.
* **Accounting.** ``used_bytes`` = every record's length + every hot tail's size + the pool's free buffers
  + stated metadata charges (:mod:`kvd.store.pool`: per page, per logged row, per sequence and layer, per
  namespace; a forgotten sequence's log entries stop counting at once and are freed at a later prune, never
  more than the live ones: :class:`~kvd.store.sequences.CompactionLog`). An append computes the bytes it will
  allocate before touching anything. If they do not fit, it first compresses: the oldest pages are re-encoded
  toward the level in force, and the store's own level rises one rung at a time up to ``max_level`` (it runs
  *ahead* of the ordered level; :mod:`kvd.store.compact`).
  Only if that is not enough it refuses with :class:`~kvd.errors.OutOfMemory` when no room can be made
  (``eviction="none"`` and the pool emptied is not enough, or the sequence alone cannot fit); otherwise it
  builds its pages first, then empties the pool and evicts whole sequences (never the sequence being appended
  to) until they fit, those no lookup can reach first, then chain tails (those unused for longer than the
  store's reuse has shown worth waiting for, then the deepest in their prompt), each least recently used first
  (:mod:`kvd.store.chains`: plain LRU for sequences outside chains), then
  commits (:mod:`kvd.store.evict`). The check counts the peak (new buffers are allocated before the ones they
  replace are freed), so ``used_bytes`` never exceeds ``capacity_bytes``; while an evicting append runs, the
  process holds that append's new pages beyond the capacity (as a Redis command may exceed ``maxmemory`` by its
  own size), the price of not reading the tokens
  once more to refuse NaN/Inf first.
* **All or nothing.** An append validates shapes and dtypes, then builds every new buffer (pages it seals, pages
  leaving the window, a new or grown tail) off to the side: NaN/Inf is refused by the kernels while encoding, and
  the tokens that will sit in the hot tail are checked before they are copied; either way the error names the
  value as ``keys[layer, token, head, dim]``. Only then does it make room and commit, with operations that
  cannot fail. On any error the new buffers go back where they came from and nothing was evicted (a valid
  append refused for want of room may have re-compressed pages first: that changes no token's presence).

Defaults, measured (bench/store.py; module docstring of kvd.pages for the codec):
``page_tokens=64`` matches the q8 key group of 64 tokens (8.25 bits per value; with 32 the format costs 8.5
bits and caps the gain at 1.88x); ``sink_tokens=4`` keeps the first page one rung less compact, which on the real
sample takes the q8 attention error from 1.07% to 0.90% (the page fp16) and q4 from 8.78% to 7.98% (the page
8-bit; 7.95% fp16, ``sink_raw``, for 3.3x its extra bytes), for one less compact page per (sequence, layer);
``window_tokens=0`` because the hot tail already is a full-precision window of the last 0..P-1 tokens, and a real
window costs too much memory for its gain: 128 tokens take the q8 error to 0.68% (with the sink) but add two fp16
pages per (sequence, layer), which caps q8 at 1.85x for 4,096-token sequences, under the 1.9x target.
With the defaults, a 4,096-token sequence of the sample layout takes 1.905x fewer bytes at q8 than at fp16 and
3.07x fewer at q4 (7B-class layout: 1.91x, 3.09x), page headers and metadata included.

Threads. Every public method holds one lock, so a reporting thread may call :meth:`Store.stats` at any time,
and the store may be served by more than one thread (kvd.wire.server runs large requests on a lane of their
own). The heavy part of a large operation runs *without* the lock, so that a decode step's small append is
not held for the whole encoding of a 64 MiB prefill:

* An append of ``UNLOCKED_MIN_BYTES`` or more (keys and values, float16) that fits without evicting plans,
  takes its buffers and *reserves* its peak need (``reserved_bytes``, counted in ``used_bytes``) under the
  lock, encodes its pages without it, and commits under it. Meanwhile its sequence is *pinned*: another append
  to it or a drop of it waits, and an append that must make room (compress or evict) waits for every append in
  flight before it plans, so compression and eviction always run alone, as before. An append is still all or
  nothing (a NaN found while encoding without the lock gives everything back) and appends to one sequence
  still apply in the order they took the lock.
* A read of ``UNLOCKED_MIN_BYTES`` or more takes a snapshot under the lock (the page tables and a copy of the
  hot tail's filled tokens it needs) and decodes without it. Committed records are never written again; while
  such a read runs, records that leave a page table are freed rather than pooled, so none is reused under it.
  The read returns the sequence as it was when it took the lock.

Pure core: no Ray, no ZeroMQ.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvd.errors import (
    ConfigError,
    CorruptPage,
    InvalidArgument,
    LayoutMismatch,
    UnknownNamespace,
    UnknownSequence,
)
from kvd.policy import Level
from kvd.store import buffers
from kvd.store import pool as sp
from kvd.store import sequences as store_seq
from kvd.store.append import UNLOCKED_MIN_BYTES, Appending, InFlight
from kvd.store.attend import Attending
from kvd.store.calibrated import Calibrating
from kvd.store.chains import Chains
from kvd.store.compact import Compaction
from kvd.store.disk import DEFAULT_WRITE_BUFFER_BYTES, DiskTier
from kvd.store.evict import Eviction
from kvd.store.sequences import (
    PACK_FRAME_BYTES,
    RAW,
    Namespace,
    ReadTooLarge,
    Seq,
    SeqId,
    int_arg,
    int_tuple,
    seq_id_arg,
)
from kvd.store.spill import OnDisk, Spilling

__all__ = ["Store", "EIGHT_BIT_FORMATS", "PACK_FRAME_BYTES", "DEFAULT_PAGE_TOKENS", "DEFAULT_SINK_TOKENS",
           "DEFAULT_WINDOW_TOKENS", "OnDisk", "ReadTooLarge", "UNLOCKED_MIN_BYTES"]

DEFAULT_PAGE_TOKENS = 64
DEFAULT_SINK_TOKENS = 4
DEFAULT_WINDOW_TOKENS = 0
EIGHT_BIT_FORMATS = ("q8", "fp8_e4m3", "fp8_e5m2")
MAX_EPOCH = 2**63 - 1


_fp16_bytes = store_seq.fp16_bytes


class Store(Appending, Compaction, Eviction, Spilling, Attending, Calibrating):
    """One shard's paged, adaptively quantized KV memory. See the module docstring for the model.

    ``capacity_bytes`` bounds ``used_bytes`` (payload and metadata). Options (keyword-only):
    ``page_tokens`` (P, default 64), ``window_tokens`` (default 0), ``sink_tokens`` (default 4), ``sink_raw``
    (the sink pages stay fp16 at every level; default: fp16, and 8-bit at q4),
    ``raw_layers`` / ``raw_heads`` (indices kept fp16 in every namespace; registering a layout they do not
    fit is refused), ``eviction`` (``"lru"`` or ``"none"``), ``eviction_order`` (``"prefix"``: what no lookup
    can reach first, then chain tails (stale ones, then the deepest in their prompt), then least recently
    used, by the ``parent`` and ``position`` appends give, :mod:`kvd.store.chains`; ``"recency"``: least
    recently used alone),
    ``eight_bit`` (the 8-bit rung's page format:
    ``"q8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``), ``max_level`` (the most compact level an append that does not
    fit may compress to before it evicts or is refused: the policy's ``max_level``, default q4; fp16 turns
    compression under pressure off), ``disk_path`` and ``disk_bytes`` (a disk tier in that directory, at most
    that many bytes of files: full sequences spill there instead of being forgotten, and a store created on the
    same directory serves what it holds; :mod:`kvd.store.spill`), ``disk_fresh`` (remove what the directory
    holds instead), ``disk_write_buffer_bytes`` (spilled bytes waiting to be written, at most; outside
    ``capacity_bytes``), ``require_calibration`` (a namespace without a calibration is not compressed:
    its pages stay fp16 while ``allow_raw_fallback``, else they are compressed as usual and the namespace
    reports that it needs one; :mod:`kvd.store.calibrated`). Bad options raise
    :class:`~kvd.errors.ConfigError`. A store with a disk tier should be
    ended with :meth:`close`.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
        window_tokens: int = DEFAULT_WINDOW_TOKENS,
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        sink_raw: bool = False,
        raw_layers: Iterable[int] = (),
        raw_heads: Iterable[int] = (),
        eviction: str = "lru",
        eviction_order: str = "prefix",
        eight_bit: str = "q8",
        max_level: Level | str = Level.Q4,
        disk_path: str | None = None,
        disk_bytes: int = 0,
        disk_fresh: bool = False,
        disk_write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_BYTES,
        require_calibration: bool = False,
        allow_raw_fallback: bool = True,
    ) -> None:
        self.capacity_bytes = int_arg("capacity_bytes", capacity_bytes, 1, None, ConfigError)
        self.page_tokens = int_arg("page_tokens", page_tokens, 1, 65535, ConfigError)
        self.window_tokens = int_arg("window_tokens", window_tokens, 0, None, ConfigError)
        self.sink_tokens = int_arg("sink_tokens", sink_tokens, 0, None, ConfigError)
        if not isinstance(sink_raw, bool):
            raise ConfigError(f"sink_raw must be a bool, got {sink_raw!r}")
        self.sink_raw = sink_raw
        self.raw_layers = int_tuple("raw_layers", raw_layers)
        self.raw_heads = int_tuple("raw_heads", raw_heads)
        if eviction not in ("lru", "none"):
            raise ConfigError(f"eviction must be 'lru' or 'none', got {eviction!r}")
        if eviction_order not in ("prefix", "recency"):
            raise ConfigError(f"eviction_order must be 'prefix' or 'recency', got {eviction_order!r}")
        if eight_bit not in EIGHT_BIT_FORMATS:
            raise ConfigError(f"eight_bit must be one of {EIGHT_BIT_FORMATS}, got {eight_bit!r}")
        self.eviction = eviction
        self.eight_bit = eight_bit
        try:
            self.max_level = Level.parse(max_level)
        except InvalidArgument as exc:
            raise ConfigError(f"max_level: {exc}") from None
        self._max_rung = self.max_level.rung
        self._lock = threading.RLock()
        self._unpinned = threading.Condition(self._lock)  # notified when an append in flight commits
        self._pinned: set[tuple[str, SeqId]] = set()  # sequences an append is building without the lock
        self._readers = 0  # reads decoding without the lock: removed records are not pooled meanwhile
        self._ns: dict[str, Namespace] = {}
        # the namespaces with sequences in memory (or compaction backlog): the only ones with pages, so what
        # the work repeated every report and every idle pass of a shard reads, however many are registered
        self._holding: dict[str, Namespace] = {}
        self._seqs: OrderedDict[tuple[str, SeqId], Seq] = OrderedDict()  # least recently used first
        self._chains = Chains(by_prefix=eviction_order == "prefix")  # the eviction order (kvd.store.chains)
        self.eviction_order = eviction_order
        self._ledger = sp.Ledger(min(sp.POOL_MAX_BYTES, self.capacity_bytes // sp.POOL_CAPACITY_DIVISOR))
        self._log = store_seq.CompactionLog()
        self._level = Level.FP16  # in force: the order's level, or the shard's own lead (`_ahead`) above it
        self._ordered = Level.FP16  # the level of the newest order (what `_epoch` means)
        self._ahead: Level | None = None
        self._ahead_reason = ""
        self._level_reason = ""  # why the level in force is what it is: the last order's reason, or the lead's
        self._fmt = RAW
        self._epoch = 0
        self._ns_meta = 0
        self._tokens = 0
        self._appends = self._gets = self._evictions = self._evicted_tokens = self._refusals = 0
        self._recompressed_pages = self._recompressed_bytes = self._window_encodes = 0
        self._squeezes = self._squeezed_bytes = self._aheads = 0
        self._spill_overflows = self._promotions = self._disk_hits = self._disk_misses = 0
        self._init_calibrating(require_calibration, allow_raw_fallback)
        disk_bytes = int_arg("disk_bytes", disk_bytes, 0, None, ConfigError)
        self._disk: DiskTier | None = None
        if disk_bytes:
            if not disk_path:
                raise ConfigError("disk_bytes is set but disk_path is not: name the disk tier's directory")
            self._disk = DiskTier(disk_path, disk_bytes, fresh=disk_fresh, allow_evict=eviction == "lru",
                                  write_buffer_bytes=int_arg("disk_write_buffer_bytes", disk_write_buffer_bytes, 1,
                                                             None, ConfigError))
            self._load_calibrations(self._disk.directory, disk_fresh)
            self._disk.recover(self._accept_spilled)

    # ------------------------------------------------------------------------------------------ levels

    def format_for(self, level: Level | str) -> str:
        """The page format sealed under ``level`` (see the module docstring)."""
        lv = Level.parse(level)
        if lv is Level.FP16:
            return RAW
        if lv is Level.Q4:
            return "q4"
        if lv is Level.Q8 or self.eight_bit.startswith("fp8"):
            return self.eight_bit
        return "fp8_e4m3"

    def set_level(self, level: Level | str, epoch: int, reason: str = "") -> bool:
        """Apply a level order. Returns True if applied; False if ``epoch`` is older than the newest applied or
        it repeats the current (epoch, level). The same epoch with another level is applied (last one wins).
        A rise makes older pages compaction backlog (see :meth:`compact`); a drop changes only new pages.
        ``reason``: why the order was given (the coordinator's words), kept for ``stats()["level_reason"]``.

        A store running ahead under its own pressure (kvd.store.compact) keeps its lead through an order below
        it, unless the order steps the cluster down (demand fell); an order at or above the lead ends it."""
        lv = Level.parse(level)
        ep = int_arg("epoch", epoch, 0, MAX_EPOCH)
        with self._lock:
            if ep < self._epoch or (ep == self._epoch and lv is self._ordered):
                return False
            step_down = lv.rung < self._ordered.rung
            self._epoch, self._ordered = ep, lv
            if self._ahead is not None and (step_down or lv.rung >= self._ahead.rung):
                self._ahead, self._ahead_reason = None, ""
            self._set_level_in_force(lv if self._ahead is None else self._ahead)
            if self._ahead is None:
                self._level_reason = f"order of epoch {ep}: {reason}" if reason else f"order of epoch {ep}"
            return True

    def _set_level_in_force(self, level: Level) -> None:
        if level is not self._level:
            self._level = level
            self._fmt = self.format_for(level)
            self._log.cursor = 0

    def _rung_level(self, rung: int) -> Level:
        """The level of ``rung`` (0 fp16, 1 the 8-bit rung of ``eight_bit``, 2 q4)."""
        return (Level.FP16, Level.Q8 if self.eight_bit == "q8" else Level.FP8, Level.Q4)[rung]

    def used_by_rung(self) -> tuple[int, int, int]:
        """``used_bytes`` if every unprotected sealed page more compact than each rung (fp16, 8-bit, q4) were
        stored at that rung: what the data would take at a less compact level. The policy steps down only
        when this fits (kvd.policy), so the memory compression freed does not pass for a drop in demand."""
        with self._lock:
            used = self._ledger.used
            out = []
            for rung in range(3):
                target = self.format_for(self._rung_level(rung))
                extra = 0
                for ns in self._holding.values():
                    sink_target = self._sink_fmt(ns, target)  # (a sink page is one rung less compact)
                    for backlog, to in ((ns.backlog, target), (ns.sink_backlog, sink_target)):
                        for fmt, b in backlog.items():
                            if b and sp.RUNG[fmt] > sp.RUNG[to]:
                                extra += b // ns.rec_bytes[fmt] * ns.rec_bytes[to] - b
                out.append(used + extra)
            return out[0], out[1], out[2]

    # ------------------------------------------------------------------------------------------ namespaces

    def register(self, namespace: str, *, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Register a layout. Registering the same layout again is a no-op; another layout raises
        :class:`~kvd.errors.LayoutMismatch`, as does a layout that ``raw_layers``/``raw_heads`` do not fit."""
        if not isinstance(namespace, str) or not namespace:
            raise InvalidArgument(f"namespace must be a non-empty str, got {namespace!r}")
        layers = int_arg("num_layers", num_layers, 1, 65535)
        heads = int_arg("num_kv_heads", num_kv_heads, 1, 65535)
        dim = int_arg("head_dim", head_dim, 1, 65535)
        with self._lock:
            old = self._ns.get(namespace)
            if old is not None:
                if (old.layers, old.heads, old.head_dim) != (layers, heads, dim):
                    raise LayoutMismatch(
                        f"namespace {namespace!r} is registered as (layers={old.layers}, kv_heads={old.heads}, "
                        f"head_dim={old.head_dim}), not (layers={layers}, kv_heads={heads}, head_dim={dim})"
                    )
                return
            if self.raw_layers and self.raw_layers[-1] >= layers:
                raise LayoutMismatch(f"raw_layers {self.raw_layers} out of range for {layers} layers")
            if self.raw_heads and self.raw_heads[-1] >= heads:
                raise LayoutMismatch(f"raw_heads {self.raw_heads} out of range for {heads} kv heads")
            ns = self._ns[namespace] = Namespace(
                namespace, layers, heads, dim,
                raw_layers=self.raw_layers, raw_heads=self.raw_heads, page_tokens=self.page_tokens,
            )  # fmt: skip
            self._note_namespace(ns)
            charge = sp.namespace_meta_bytes(layers)
            self._ledger.meta_bytes += charge
            self._ns_meta += charge

    def _namespace(self, namespace: object) -> Namespace:
        ns = self._ns.get(namespace) if isinstance(namespace, str) else None
        if ns is None:
            raise UnknownNamespace(f"namespace {namespace!r} is not registered")
        return ns

    def _sequence(self, namespace: object, seq_id: object) -> Seq:
        ns = self._namespace(namespace)
        key = (ns.name, seq_id_arg(seq_id))
        seq = self._seqs.get(key)
        if seq is None:
            raise UnknownSequence(f"no sequence {key[1]!r} in namespace {ns.name!r}")
        return seq

    # ------------------------------------------------------------------------------------------ append

    def append(
        self, namespace: str, seq_id: SeqId, keys: object, values: object, *, position: int | None = None,
        parent: SeqId | None = None, disk_io: bool = True,
    ) -> int:
        """Append T tokens: ``keys`` and ``values`` ``[L, T, H, D]`` (all layers; float16, float32 or bfloat16).
        Returns the new length. All or nothing: on any error (shape, dtype, NaN/Inf, out of memory) nothing is
        stored. T = 0 is a no-op on an existing sequence and refused for a new one.

        ``position``: where the sequence's token 0 sits in the prompt it belongs to (default 0). Only the prompt's
        first ``sink_tokens`` are sinks, so a sequence that starts later (a prompt stored block by block, one
        sequence per block) gets no sink page. Fixed when the sequence is created; an append that states another
        position is refused (InvalidArgument).

        ``parent``: the sequence (same namespace) this one follows in a chain that lookups walk in order, such as
        a prompt stored one block per sequence: while this one is reachable only through it, a full store gives
        up this one first once the parent is gone, and keeps a parent while its children are held
        (:mod:`kvd.store.chains`). Read when the append creates the sequence.

        An append to a sequence on disk takes it back into RAM first (:mod:`kvd.store.spill`); with ``disk_io``
        False it raises :class:`OnDisk` instead when that means reading a file (nothing is done)."""
        with self._lock:
            ns = self._namespace(namespace)
            key = (ns.name, seq_id_arg(seq_id))
            pos = None if position is None else int_arg("position", position, 0, None)
            up = None if parent is None else (ns.name, seq_id_arg(parent, "parent"))
            k16, v16 = store_seq.check_kv(ns, keys, values)
            entered = False  # whether this append brought the sequence into memory (created, or from disk)
            if self._disk is not None and key not in self._seqs:
                self._promote(ns, key, disk_io)
                entered = key in self._seqs
            while True:
                while key in self._pinned:  # another thread's append to this sequence is in flight
                    self._unpinned.wait()
                seq = self._seqs.get(key)
                if seq is not None and pos is not None and pos != seq.position:
                    raise InvalidArgument(f"sequence {key[1]!r} starts at prompt position {seq.position}, not "
                                          f"{pos}; nothing was written")
                if k16.shape[1] == 0:
                    if seq is None:
                        raise InvalidArgument(f"a new sequence needs at least one token; {key[1]!r} got 0")
                    break
                try:
                    created = seq is None
                    seq = self._append(ns, key, seq, k16, v16, pos or 0)
                    if created:
                        self._chains.add(key, up, depth=seq.position)
                        entered = True
                    break
                except InFlight:  # it must make room: that waits for the appends in flight, then plans again
                    while self._pinned:
                        self._unpinned.wait()
            if entered:  # entering made it the most recently used; a touch would count a reuse that is none
                self._seqs.move_to_end(key)
            else:
                self._touch(key)
            self._appends += 1
            return seq.length

    def _touch(self, key: tuple[str, SeqId]) -> None:
        """(Under the lock) a use of ``key`` (in RAM): the most recently used, for eviction."""
        self._seqs.move_to_end(key)
        self._chains.touch(key)

    # ------------------------------------------------------------------------------------------ memory

    @property
    def used_bytes(self) -> int:
        """Bytes accounted: records + hot tails + pooled free buffers + metadata charges."""
        with self._lock:
            return self._ledger.used

    # ------------------------------------------------------------------------------------------ read

    def get(
        self,
        namespace: str,
        seq_id: SeqId,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, end)`` (``end`` None = the length) of ``layers`` (None = all, in order) as float16
        ``(keys, values)`` ``[L', end - start, H, D]``: the two halves of :meth:`get_packed`'s array (either keeps
        the whole array alive). Raises UnknownNamespace, UnknownSequence, InvalidArgument (range, layers),
        CorruptPage (a damaged page; not expected)."""
        both = self.get_packed(namespace, seq_id, start, end, layers)
        return both[0], both[1]

    def get_packed(
        self, namespace: str, seq_id: SeqId, start: int = 0, end: int | None = None,
        layers: Sequence[int] | None = None, *, max_bytes: int | None = None, disk_io: bool = True,
    ) -> np.ndarray:  # fmt: skip
        """Like :meth:`get`, with keys and values in one new C-contiguous float16 array ``[2, L', end - start, H,
        D]``: keys ``[0]``, values ``[1]``, so that a server sends both as one frame (docs/protocol.md §6.5).
        ``max_bytes``: raise :class:`ReadTooLarge` instead of reading more than that. ``disk_io`` False: raise
        :class:`OnDisk` instead of reading a spilled sequence's file."""
        with self._lock:
            seq, entry = self._lookup(namespace, seq_id)
            s, e, lay = store_seq.check_range(seq, start, end, layers)
            ns = seq.ns
            fp16 = _fp16_bytes(ns, len(lay), e - s)
            if max_bytes is not None and fp16 > max_bytes:
                raise ReadTooLarge(fp16, max_bytes)  # (before it counts as a use)
            view = self._use(seq, entry, e, fp16, disk_io)
            both = buffers.empty_f16((2, len(lay), e - s, ns.heads, ns.head_dim))
            if view is None:
                store_seq.read_into(seq, s, e, lay, self.page_tokens, both[0], both[1])
                return both
        self._unlocked_read(store_seq.read_into, view, s, e, lay, self.page_tokens, both[0], both[1], entry=entry)
        return both

    def _lookup(self, namespace: object, seq_id: object) -> tuple[Any, Any]:
        """(Under the lock) ``(seq, None)`` for a sequence in RAM, ``(view, entry)`` for one on disk (a view
        whose pages :meth:`_unlocked_read` loads); UnknownNamespace / UnknownSequence."""
        ns = self._namespace(namespace)
        key = (ns.name, seq_id_arg(seq_id))
        seq = self._seqs.get(key)
        if seq is not None:
            return seq, None
        entry = self._disk_entry(ns, key)
        return store_seq.SeqView.of(ns, entry.length), entry

    def _use(self, seq: Any, entry: Any, end: int, fp16: int, disk_io: bool) -> store_seq.SeqView | None:
        """(Under the lock) count a read of ``seq`` as a use; the view to read without the lock, or None to read
        now (small, in RAM)."""
        if entry is not None:
            self._disk_stub(entry, seq, disk_io)
            self._gets += 1
            self._readers += 1
            return seq  # type: ignore[no-any-return]
        self._gets += 1
        self._touch(seq.key)
        return None if fp16 < UNLOCKED_MIN_BYTES else self._view(seq, end)

    def get_into(
        self,
        namespace: str,
        seq_id: SeqId,
        keys_out: np.ndarray,
        values_out: np.ndarray,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> int:
        """Like :meth:`get`, but decode into caller buffers (no allocation, no page faults when they are reused):
        ``keys_out`` / ``values_out`` are writable float16 ndarrays ``[L', T, H, D]`` with ``T >= end - start``,
        each layer C-contiguous (a C-contiguous array is); tokens ``[start, end)`` land in ``[:, :end - start]``
        and the rest is left as it was. Returns ``end - start``, the tokens written. Raises what :meth:`get`
        raises, and InvalidArgument (naming the buffer) for a wrong type, dtype, shape, layout, a read-only
        buffer, or the two buffers overlapping; nothing is written then."""
        with self._lock:
            seq, entry = self._lookup(namespace, seq_id)
            s, e, lay = store_seq.check_range(seq, start, end, layers)
            ns = seq.ns
            k = store_seq.check_out(keys_out, "keys_out", len(lay), e - s, ns.heads, ns.head_dim)
            v = store_seq.check_out(values_out, "values_out", len(lay), e - s, ns.heads, ns.head_dim)
            if np.may_share_memory(k, v):
                raise InvalidArgument("keys_out and values_out overlap")
            view = self._use(seq, entry, e, _fp16_bytes(ns, len(lay), e - s), True)
            if view is None:
                store_seq.read_into(seq, s, e, lay, self.page_tokens, k, v)
                return e - s
        self._unlocked_read(store_seq.read_into, view, s, e, lay, self.page_tokens, k, v, entry=entry)
        return e - s

    def get_pages(
        self,
        namespace: str,
        seq_id: SeqId,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> list[tuple[int, int, memoryview, memoryview]]:
        """The stored pages covering ``[start, end)`` of ``layers``: ``(layer, token0, key_page, value_page)``
        in the order of ``layers`` (None = ascending), then by token0. Pages may extend past the range; the hot
        tail comes as an fp16 page of its filled tokens. An empty range gives the one page holding ``start``,
        so :func:`kvd.pages.assemble` ``(entries, start, end, layers)`` always equals :meth:`get`. The pages
        are read-only copies (memoryviews), unaffected by anything the store does later."""
        return self.get_pages_packed(namespace, seq_id, start, end, layers)[0]

    def get_pages_packed(
        self,
        namespace: str,
        seq_id: SeqId,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        *,
        frame_bytes: int = PACK_FRAME_BYTES,
        max_bytes: int | None = None,
        disk_io: bool = True,
    ) -> tuple[list[tuple[int, int, memoryview, memoryview]], list[memoryview]]:
        """:meth:`get_pages`' entries and the buffers their pages are views of: whole pages back to back, in
        entry order (key page, value page), at most ``frame_bytes`` per buffer unless one page alone is larger.
        The buffers are a packed pages reply's frames (docs/protocol.md §6.5). ``max_bytes``: raise
        :class:`ReadTooLarge` instead of reading a range whose float16 keys and values are more than that."""
        frame_bytes = int_arg("frame_bytes", frame_bytes, 1)
        with self._lock:
            seq, entry = self._lookup(namespace, seq_id)
            s, e, lay = store_seq.check_range(seq, start, end, layers)
            fp16 = _fp16_bytes(seq.ns, len(lay), e - s)
            if max_bytes is not None and fp16 > max_bytes:
                raise ReadTooLarge(fp16, max_bytes)
            view = self._use(seq, entry, e, fp16, disk_io)
            if view is None:
                return store_seq.page_entries(seq, s, e, lay, self.page_tokens, frame_bytes)
        return self._unlocked_read(store_seq.page_entries, view, s, e, lay, self.page_tokens, frame_bytes,
                                   entry=entry)

    def _view(self, seq: Seq, end: int) -> store_seq.SeqView:
        """(Under the lock) a read's snapshot of ``seq``; counts the read until :meth:`_unlocked_read` ends."""
        view = seq.view(end)
        self._readers += 1
        return view

    def _unlocked_read(self, read: Any, view: store_seq.SeqView, *args: Any, entry: Any = None) -> Any:
        """Run ``read(view, *args)`` without the lock (the caller has released it), then end the read. ``entry``:
        the view is of a spilled sequence, whose pages are loaded first."""
        try:
            if entry is None:
                return read(view, *args)
            decoded = read is store_seq.read_into
            self._disk_view(entry, view, decoded=decoded)
            try:
                return read(view, *args)
            except CorruptPage as exc:
                if not decoded:
                    raise
                raise self._disk_damaged(entry, exc) from None
        finally:
            with self._lock:
                self._readers -= 1

    def length(self, namespace: str, seq_id: SeqId) -> int:
        """Tokens stored for the sequence (in RAM or on disk). Raises UnknownNamespace / UnknownSequence."""
        with self._lock:
            return int(self._lookup(namespace, seq_id)[0].length)

    def lengths(self, namespace: str, seq_ids: Iterable[SeqId]) -> list[int | None]:
        """Tokens stored for each sequence (a Python int), None where there is no such sequence (one lock, one
        namespace check: a prefix lookup). A lookup is not a use: LRU order does not change. Raises
        UnknownNamespace."""
        with self._lock:
            name = self._namespace(namespace).name
            seqs, disk = self._seqs, self._disk
            out: list[int | None] = []
            for sid in seq_ids:
                key = (name, sid if type(sid) is str else seq_id_arg(sid))
                seq = seqs.get(key)
                if seq is not None:
                    out.append(seq.length)
                else:
                    entry = disk.get(key) if disk is not None else None
                    out.append(None if entry is None else entry.length)
            return out

    def drop(self, namespace: str, seq_id: SeqId) -> bool:
        """Forget a sequence and free its memory. Returns False if there was no such sequence."""
        with self._lock:
            ns = self._namespace(namespace)
            key = (ns.name, seq_id_arg(seq_id))
            while key in self._pinned:  # an append to it is in flight: it goes first
                self._unpinned.wait()
            if key not in self._seqs:  # on disk: its file goes by the disk's writer thread
                gone = self._disk is not None and self._disk.remove(key) is not None
                if gone:
                    self._chains.remove(key)  # its children in memory are unreachable from now on
                return gone
            self._remove(key, pool=not self._readers)
            return True

    # ------------------------------------------------------------------------------------------ introspection

    def explain(self, namespace: str, seq_id: SeqId, layer: int, token: int) -> dict[str, Any]:
        """Why ``token`` of ``layer`` is stored as it is: ``{"level": page format tag, "page": row index,
        "reasons": [str, ...], "sealed_level", "sealed_epoch", "recompressed": [[format, epoch], ...]}``.
        Reasons: "hot tail", "raw layer", "sink", "a sink page is kept one rung less compact than the level: fp16,
        8 bits at q4", "window", "kept fp16 in the window until it aged out",
        "sealed at level q8 (epoch 3)", "re-compressed to q4 at epoch 5", "raw heads [0] kept fp16"."""
        with self._lock:
            seq, entry = self._lookup(namespace, seq_id)
            if entry is not None:
                return self._disk_explain(entry, layer, token)
            return store_seq.explain(seq, layer, token, self.page_tokens)

    def stats(self) -> dict[str, Any]:
        """A consistent snapshot. Bytes: ``used_bytes`` (= ``page_bytes`` + ``tail_bytes`` + ``pool_bytes`` +
        ``metadata_bytes`` + ``reserved_bytes``, the last the peak need of large appends encoding at that moment:
        the module docstring, "Threads"), ``capacity_bytes``, ``pressure`` (used / capacity),
        ``compaction_backlog_bytes``, ``pages_by_level`` / ``bytes_by_level`` (sealed pages by format tag); the
        level in force (tag), its page ``format`` and ``epoch``; ``ordered_level`` (the newest order's level),
        ``ahead`` (the level this store runs at under its own pressure, or None) with ``ahead_reason`` and
        ``ahead_count`` (times it ran ahead), ``level_reason`` (why the level in force is what it is),
        ``max_level``, ``squeezes`` / ``squeezed_bytes`` (appends that compressed to make room, bytes freed);
        ``tokens``, ``sequences``, ``namespaces``; counters (``gets`` counts get and get_pages calls, ``refusals``
        out-of-memory refusals, ``evictions`` evicted sequences); the eviction order's ``eviction_stale_after``
        (uses of the store after which an unused chain tail goes first; None until ``eviction_reuses_known``
        reuse distances are enough: kvd.store.chains)."""
        with self._lock:
            led = self._ledger
            used = led.used
            return {
                "used_bytes": used,
                "capacity_bytes": self.capacity_bytes,
                "pressure": used / self.capacity_bytes,
                "level": self._level.tag,
                "format": self._fmt,
                "epoch": self._epoch,
                "ordered_level": self._ordered.tag,
                "ahead": self._ahead.tag if self._ahead is not None else None,
                "ahead_reason": self._ahead_reason,
                "level_reason": self._level_reason,
                "ahead_count": self._aheads,
                "max_level": self.max_level.tag,
                "squeezes": self._squeezes,
                "squeezed_bytes": self._squeezed_bytes,
                "tokens": self._tokens,
                "sequences": len(self._seqs),
                "namespaces": len(self._ns),
                "evictions": self._evictions,
                "evicted_tokens": self._evicted_tokens,
                "eviction_stale_after": self._chains.stale_after,
                "eviction_reuses_known": self._chains.reuses_known,
                "refusals": self._refusals,
                "compaction_backlog_bytes": self._backlog_bytes(),
                "recompressed_pages": self._recompressed_pages,
                "recompressed_bytes": self._recompressed_bytes,
                "window_encodes": self._window_encodes,
                "pages_by_level": {k: v for k, v in led.pages_by_fmt.items() if v},
                "bytes_by_level": {k: v for k, v in led.bytes_by_fmt.items() if v},
                "tail_pages": led.tails,
                "tail_bytes": led.tail_bytes,
                "page_bytes": led.record_bytes,
                "pool_bytes": led.pool.bytes,
                "metadata_bytes": led.meta_bytes,
                "reserved_bytes": led.reserved,
                "appends": self._appends,
                "gets": self._gets,
                "page_tokens": self.page_tokens,
                "sink_tokens": self.sink_tokens,
                "sink_raw": self.sink_raw,
                "window_tokens": self.window_tokens,
                "eight_bit": self.eight_bit,
                "eviction": self.eviction,
                "spill_overflows": self._spill_overflows,
                "promotions": self._promotions,
                "disk_hits": self._disk_hits,
                "disk_misses": self._disk_misses,
                **self._calibration_stats(),
                **(self._disk.stats() if self._disk is not None else {"disk_capacity_bytes": 0}),
            }
