"""Page records, the bounded buffer pool, the ledger and the metadata charges of :mod:`kvd.store`.

A *record* is one sealed page of one (sequence, layer): the encoded key page, the encoded value page and a
32-byte trailer, back to back in one ``bytearray`` (one Python object per page keeps the per-page overhead
small, which is what the memory target of the store is most sensitive to)::

    | key page (pages.nbytes(fmt, role="key")) | value page (role="value") | trailer (TRAILER_BYTES) |

The trailer holds the page's history, read by ``explain``, compaction and the accounting::

    sealed_epoch i64 | recompress_epoch_1 i64 | recompress_epoch_2 i64 |
    sealed_fmt u8 | recompress_fmt_1 u8 | recompress_fmt_2 u8 | current_fmt u8 | flags u8 | 3 bytes zero

Formats are coded by their index in :data:`kvd.pages.LEVELS` (``NO_FMT`` = none). A page is re-encoded at most
twice (fp16 -> 8-bit rung -> q4: compaction only moves a page up a rung), so two history slots suffice.

:class:`BufferPool` keeps freed buffers for reuse (records by byte size, hot tails by shape) up to a small
bound in bytes; whatever it keeps is counted in the store's ``used_bytes`` and dropped first when an append
needs room. The ``*_META_BYTES`` constants are the stated charge for the Python objects around the buffers;
they were measured with tracemalloc on CPython 3.11 (see tests/unit/test_store_memory.py). The
:class:`Ledger` adds it all up: ``used = records + hot tails + pool + metadata``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvd.codec import batch as page_batch
from kvd.codec import pages
from kvd.errors import NonFiniteError

# The trailer (see the module docstring). Offsets are from the end of the record, for cheap byte reads.
TRAILER = struct.Struct("<qqqBBBBB3x")
TRAILER_BYTES = TRAILER.size
assert TRAILER_BYTES == 32
CUR_FMT_FROM_END = TRAILER_BYTES - 27  # rec[-CUR_FMT_FROM_END] is the current format code
NO_FMT = 255
NO_EPOCH = -1
FLAG_WINDOW = 1  # the page was held raw in the recent window and encoded when it aged out
# The shard ran ahead of the cluster's level under its own memory pressure (kvd.store.compact, "squeeze") when it
# sealed the page / re-encoded it the first / the second time.
FLAG_AHEAD_SEALED = 2
FLAG_AHEAD_R1 = 4
FLAG_AHEAD_R2 = 8

FMT_CODE = {name: i for i, name in enumerate(pages.LEVELS)}
FMT_NAME = dict(enumerate(pages.LEVELS))
# Rung of each page format: q8 and both fp8 formats are the same 8-bit rung (same memory), so compaction never
# re-encodes between them; it only moves a page to a higher rung.
RUNG = {"fp16": 0, "q8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "q4": 2}
RUNG_BY_CODE = {FMT_CODE[name]: r for name, r in RUNG.items()}

# Metadata charges (bytes), fitted to tracemalloc measurements on CPython 3.11 (64-bit): a record's bytearray
# object and its list slot ~68, a compaction-log entry (tuple + list slot) ~62, a hot tail's ndarray object
# ~160, a sequence's object, key and index entries ~450 plus ~64 per layer (its page list), a namespace ~1.5 KiB
# plus ~24 per layer. tests/unit/test_store_memory.py holds the store to them within 3%.
PAGE_META_BYTES = 72  # per sealed page record (one layer, keys and values)
ROW_META_BYTES = 64  # per sealed page row in the compaction log (one entry for all layers of the row)
TAIL_META_BYTES = 160  # per hot tail (the ndarray object around the buffer)
SEQ_META_BYTES = 456  # per sequence, plus LAYER_META_BYTES per layer
LAYER_META_BYTES = 64  # per (sequence, layer): its page list
NAMESPACE_META_BYTES = 1536  # per registered namespace, plus NAMESPACE_LAYER_META_BYTES per layer
NAMESPACE_LAYER_META_BYTES = 24


def namespace_meta_bytes(layers: int) -> int:
    """The metadata charge of a namespace of ``layers`` layers."""
    return NAMESPACE_META_BYTES + NAMESPACE_LAYER_META_BYTES * layers


POOL_MAX_BYTES = 64 << 20  # the pool keeps at most this many bytes ...
POOL_CAPACITY_DIVISOR = 64  # ... and at most capacity_bytes / 64
# and at most this many buffers of one size or shape: high enough that the byte bound decides (a steady-state
# store that drops a sequence and appends the next then reuses its records instead of allocating and zeroing
# new ones: +10-15% append throughput on the 7B-class layout, whose 256 KiB records are fresh mmaps)
POOL_MAX_PER_SIZE = 4096


def write_trailer(
    rec: bytearray,
    *,
    sealed_epoch: int,
    sealed_fmt: str,
    flags: int = 0,
) -> None:
    """Initialise the trailer of a freshly sealed record (no re-encoding yet)."""
    code = FMT_CODE[sealed_fmt]
    TRAILER.pack_into(
        rec, len(rec) - TRAILER_BYTES, sealed_epoch, NO_EPOCH, NO_EPOCH, code, NO_FMT, NO_FMT, code, flags
    )


def trailer_bytes(*, sealed_epoch: int, sealed_fmt: str, flags: int = 0) -> bytes:
    """The trailer :func:`write_trailer` writes, as bytes (rows of pages share it: copy instead of packing)."""
    code = FMT_CODE[sealed_fmt]
    return TRAILER.pack(sealed_epoch, NO_EPOCH, NO_EPOCH, code, NO_FMT, NO_FMT, code, flags)


def read_trailer(rec: bytearray) -> tuple[int, int, int, int, int, int, int, int]:
    """(sealed_epoch, r1_epoch, r2_epoch, sealed_fmt, r1_fmt, r2_fmt, cur_fmt, flags) of a record."""
    return TRAILER.unpack_from(rec, len(rec) - TRAILER_BYTES)


def copy_trailer_recompressed(
    old: bytearray, new: bytearray, *, epoch: int, fmt: str, ahead: bool = False
) -> None:
    """Give ``new`` the history of ``old`` plus one re-encoding to ``fmt`` at ``epoch`` (``ahead``: done under
    the shard's own pressure, ahead of the cluster's level)."""
    se, e1, _e2, sf, f1, _f2, _cur, flags = read_trailer(old)
    code = FMT_CODE[fmt]
    if f1 == NO_FMT:
        e1, f1, e2, f2 = epoch, code, NO_EPOCH, NO_FMT
        flags |= FLAG_AHEAD_R1 if ahead else 0
    else:
        e2, f2 = epoch, code
        flags |= FLAG_AHEAD_R2 if ahead else 0
    TRAILER.pack_into(new, len(new) - TRAILER_BYTES, se, e1, e2, sf, f1, f2, code, flags)


def current_fmt(rec: bytearray) -> str:
    """The format the record's pages are encoded in now."""
    return FMT_NAME[rec[len(rec) - CUR_FMT_FROM_END]]


class BufferPool:
    """Free lists of page records (by size) and hot-tail arrays (by shape), bounded in bytes.

    ``bytes`` is what the pool holds, the buffers plus the charge for their objects (``PAGE_META_BYTES`` per
    record, ``TAIL_META_BYTES`` per tail, as when they were live); the store counts it in ``used_bytes``.
    Not thread-safe on its own (the store's lock covers it).
    """

    __slots__ = ("max_bytes", "bytes", "_records", "_tails")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.bytes = 0
        self._records: dict[int, list[bytearray]] = {}
        self._tails: dict[tuple[int, ...], list[np.ndarray]] = {}

    def buffers(self) -> int:
        """How many buffers the pool holds."""
        return sum(len(v) for v in self._records.values()) + sum(len(v) for v in self._tails.values())

    def take_record(self, size: int) -> tuple[bytearray, bool]:
        """A record buffer of exactly ``size`` bytes and whether it came from the pool (else it is new)."""
        free = self._records.get(size)
        if free:
            self.bytes -= size + PAGE_META_BYTES
            return free.pop(), True
        return page_batch.new_record(size), False

    def give_record(self, rec: bytearray, *, force: bool = False) -> bool:
        """Keep ``rec`` for reuse if the bound allows (``force``: always, to undo a :meth:`take_record`).
        Returns whether it was kept (else the caller just drops it and its memory is freed)."""
        size = len(rec)
        free = self._records.setdefault(size, [])
        cost = size + PAGE_META_BYTES
        if not force and (self.bytes + cost > self.max_bytes or len(free) >= POOL_MAX_PER_SIZE):
            return False
        free.append(rec)
        self.bytes += cost
        return True

    def take_tail(self, shape: tuple[int, ...]) -> tuple[np.ndarray, bool]:
        """A float16 array of ``shape`` (contents undefined) and whether it came from the pool."""
        free = self._tails.get(shape)
        if free:
            arr = free.pop()
            self.bytes -= arr.nbytes + TAIL_META_BYTES
            return arr, True
        return np.empty(shape, np.float16), False

    def give_tail(self, arr: np.ndarray, *, force: bool = False) -> bool:
        """Keep a hot-tail array for reuse if the bound allows; see :meth:`give_record`."""
        free = self._tails.setdefault(arr.shape, [])
        cost = arr.nbytes + TAIL_META_BYTES
        if not force and (self.bytes + cost > self.max_bytes or len(free) >= POOL_MAX_PER_SIZE):
            return False
        free.append(arr)
        self.bytes += cost
        return True

    def clear(self) -> int:
        """Drop everything the pool holds; returns the bytes released."""
        released = self.bytes
        self._records.clear()
        self._tails.clear()
        self.bytes = 0
        return released


def refuse_nonfinite(a: np.ndarray, name: str, t0: int, layer0: int = 0, first: int | None = None) -> None:
    """Raise NonFiniteError naming the first NaN/Inf of float16 ``a`` ``[L, T, H, D]`` as the caller's
    ``name[layer, token, head, dim]``: layers offset by ``layer0``; ``a``'s token 0 is token ``t0`` of the
    sequence and the caller's array starts at token ``first`` of it (``t0`` if None)."""
    if page_batch.any_nonfinite(a) is False:  # the usual answer, in one C pass instead of four numpy ones
        return
    bad = (a.view(np.uint16) & 0x7FFF) >= 0x7C00
    if bad.any():
        i, t, h, d = (int(x) for x in np.argwhere(bad)[0])
        at = t0 + t - (t0 if first is None else first)
        raise NonFiniteError(
            f"{name}[{layer0 + i}, {at}, {h}, {d}] = {float(a[i, t, h, d])} is not finite (token {t0 + t} of the "
            "sequence); nothing was stored"
        )


def encode_record(
    rec: bytearray,
    fmt: str,
    sizes: tuple[int, int],
    keys: np.ndarray,
    values: np.ndarray,
    *,
    protect: tuple[dict[str, Any], dict[str, Any]],
    epoch: int,
    flags: int,
    where: str,
) -> None:
    """Encode one page of ``keys`` and ``values`` ``[P, H, D]`` at ``fmt`` into ``rec`` (``sizes`` = the two
    pages' byte sizes; ``protect`` = the key and value pages' arguments to :func:`kvd.pages.encode_into`: raw
    and held heads) and start its history. NonFiniteError names ``where`` (the layer and tokens)."""
    kb, vb = sizes
    mv = memoryview(rec)
    parts = (("keys", keys, mv[:kb], protect[0]), ("values", values, mv[kb : kb + vb], protect[1]))
    for name, x, out, kw in parts:
        try:
            pages.encode_into(x, fmt, out, role=name[:-1], **(kw if fmt != "fp16" else {}))
        except NonFiniteError as exc:
            raise NonFiniteError(f"{name} of {where}: {exc}") from None
    write_trailer(rec, sealed_epoch=epoch, sealed_fmt=fmt, flags=flags)


RowLayers = tuple[tuple[str, int, int, int, tuple[dict[str, Any], dict[str, Any]], bytes], ...]
# one row to seal: its records, per layer (format, record bytes, key page bytes, value page bytes, the key and
# value pages' encoder arguments (raw and held heads), trailer) (kvd.store.sequences.RowPlan.layers),
# RowPlan.batch, the source arrays, the first source token, the row
SealJob = tuple[list[bytearray], RowLayers, Any, np.ndarray, np.ndarray, int, int]


def take_row(pool: BufferPool, layers: RowLayers, taken: Taken) -> list[bytearray]:
    """Records for one row of pages (one per layer), taken from ``pool`` and recorded in ``taken``."""
    take, bufs = pool.take_record, taken.bufs
    recs = []
    for layer in layers:
        size = layer[1]
        rec, from_pool = take(size)
        bufs.append((rec, from_pool))
        taken.record_bytes += size
        recs.append(rec)
    return recs


def seal_rows(jobs: list[SealJob], p: int, *, parallel: bool, first: int = 0) -> None:
    """Encode rows of pages into their records: every layer's tokens ``[a, a + p)`` of the job's ``src_k`` /
    ``src_v`` ``[L, T, H, D]``. The hot path of an append: rows with a C spec go to the batched codec (split
    over two threads when ``parallel``), the rest and any row it stops at page by page, in row order, so a
    NonFiniteError names the first bad value (``values[layer, token, head, dim]`` of the caller's arrays, whose
    token 0 is token ``first`` of the sequence). Records are left to the caller."""
    left: dict[int, int] = {}  # job index -> first layer the C path did not encode

    def encode(part: Sequence[tuple[int, SealJob]]) -> list[tuple[int, int]]:
        undone = []
        for n, (recs, _, batch, src_k, src_v, a, _) in part:
            first = page_batch.encode_row(batch, recs, src_k, src_v, a) if batch is not None else 0
            if first >= 0:
                undone.append((n, first))
        return undone

    for undone in page_batch.split_run(encode, list(enumerate(jobs)), parallel=parallel):
        left.update(undone)
    enc = pages.encode_into
    for n in sorted(left):
        recs, layers, _, src_k, src_v, a, row = jobs[n]
        b = a + p
        for i in range(left[n], len(layers)):
            fmt, size, kb, vb, kw, trailer = layers[i]
            mv = memoryview(recs[i])
            name = "keys"
            try:
                enc(src_k[i, a:b], fmt, mv[:kb], role="key", **kw[0])
                name = "values"
                enc(src_v[i, a:b], fmt, mv[kb : kb + vb], role="value", **kw[1])
            except NonFiniteError as exc:  # name the value as the checks of unencoded tokens do
                refuse_nonfinite((src_k if name == "keys" else src_v)[i : i + 1, a:b], name, row * p, i, first)
                raise NonFiniteError(f"{name} of layer {i}, tokens [{row * p}, {row * p + p}): {exc}") from None
            mv[size - TRAILER_BYTES :] = trailer


def decode_record(rec: bytearray, sizes: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The decoded key and value pages of a record (``sizes`` = their byte sizes in its current format)."""
    kb, vb = sizes
    mv = memoryview(rec)
    return pages.decode(mv[:kb]), pages.decode(mv[kb : kb + vb])


class Taken:
    """Buffers taken for an operation in progress: ``bufs`` holds ``(buffer, came from the pool)``;
    ``record_bytes`` / ``tail_bytes`` what they add up to (a caller appending to ``bufs`` directly adds the
    sizes itself)."""

    __slots__ = ("bufs", "record_bytes", "tail_bytes")

    def __init__(self) -> None:
        self.bufs: list[tuple[Any, bool]] = []
        self.record_bytes = 0
        self.tail_bytes = 0


class Ledger:
    """Every byte a store accounts for, and its pool. ``used = record_bytes + tail_bytes + pool.bytes +
    meta_bytes + reserved``. A buffer is *taken* (from the pool or newly allocated) while an operation builds,
    *adopted* (counted live) when it commits or given back when it fails; :meth:`add_page` / :meth:`add_tail`
    then count it in a page table, :meth:`remove_page` / :meth:`remove_tail` take it out and free or pool it. The
    add and remove methods return the bytes the owning sequence accounts for, so the store can keep
    ``Seq.nbytes``. ``reserved`` holds the peak need of appends building while the store's lock is released."""

    __slots__ = ("pool", "record_bytes", "tail_bytes", "meta_bytes", "reserved", "tails", "pages_by_fmt",
                 "bytes_by_fmt")

    def __init__(self, pool_max_bytes: int) -> None:
        self.pool = BufferPool(pool_max_bytes)
        self.record_bytes = 0
        self.tail_bytes = 0
        self.meta_bytes = 0
        self.reserved = 0  # the peak need of appends building without the store's lock (Store.append)
        self.tails = 0
        self.pages_by_fmt = dict.fromkeys(pages.LEVELS, 0)
        self.bytes_by_fmt = dict.fromkeys(pages.LEVELS, 0)

    @property
    def used(self) -> int:
        return self.record_bytes + self.tail_bytes + self.pool.bytes + self.meta_bytes + self.reserved

    def take_record(self, size: int, taken: Taken) -> bytearray:
        rec, from_pool = self.pool.take_record(size)
        taken.bufs.append((rec, from_pool))
        taken.record_bytes += size
        return rec

    def take_tail(self, shape: tuple[int, ...], taken: Taken) -> np.ndarray:
        arr, from_pool = self.pool.take_tail(shape)
        taken.bufs.append((arr, from_pool))
        taken.tail_bytes += arr.nbytes
        return arr

    def give_back(self, taken: Taken) -> None:
        """Undo the takes of a failed operation: pooled buffers go back to the pool, new ones are dropped."""
        for buf, from_pool in taken.bufs:
            if from_pool and isinstance(buf, np.ndarray):
                self.pool.give_tail(buf, force=True)
            elif from_pool:
                self.pool.give_record(buf, force=True)

    def adopt(self, taken: Taken) -> None:
        """The taken buffers are now live (counted in record_bytes / tail_bytes)."""
        self.record_bytes += taken.record_bytes
        self.tail_bytes += taken.tail_bytes

    def add_page(self, rec: bytearray) -> int:
        fmt = current_fmt(rec)
        self.pages_by_fmt[fmt] += 1
        self.bytes_by_fmt[fmt] += len(rec)
        self.meta_bytes += PAGE_META_BYTES
        return len(rec) + PAGE_META_BYTES

    def add_pages(self, counts: tuple[tuple[str, int, int], ...], pages_n: int) -> None:
        """Count ``pages_n`` new pages given as ``(format, pages, bytes)`` totals (a sealed row)."""
        pbf, bbf = self.pages_by_fmt, self.bytes_by_fmt
        for fmt, n, nb in counts:
            pbf[fmt] += n
            bbf[fmt] += nb
        self.meta_bytes += PAGE_META_BYTES * pages_n

    def remove_pages(self, counts: dict[str, tuple[int, int]]) -> None:
        """Uncount dropped pages given as ``{format: (pages, bytes)}`` (the caller frees or pools them)."""
        for fmt, (n, nb) in counts.items():
            self.pages_by_fmt[fmt] -= n
            self.bytes_by_fmt[fmt] -= nb
            self.meta_bytes -= PAGE_META_BYTES * n
            self.record_bytes -= nb

    def remove_page(self, rec: bytearray, *, pool: bool) -> int:
        fmt = current_fmt(rec)
        self.pages_by_fmt[fmt] -= 1
        self.bytes_by_fmt[fmt] -= len(rec)
        self.meta_bytes -= PAGE_META_BYTES
        self.record_bytes -= len(rec)
        if pool:
            self.pool.give_record(rec)
        return len(rec) + PAGE_META_BYTES

    def add_tail(self, arr: np.ndarray) -> int:
        self.tails += 1
        self.meta_bytes += TAIL_META_BYTES
        return arr.nbytes + TAIL_META_BYTES

    def free_tail(self, arr: np.ndarray) -> None:
        """A taken tail buffer that was adopted but never counted in a page table (the whole page an append
        sealed a row from, when the sequence's tail was smaller): uncount it and pool it if the bound allows."""
        self.tail_bytes -= arr.nbytes
        self.pool.give_tail(arr)

    def remove_tail(self, arr: np.ndarray, *, pool: bool) -> int:
        self.tails -= 1
        self.meta_bytes -= TAIL_META_BYTES
        self.tail_bytes -= arr.nbytes
        if pool:
            self.pool.give_tail(arr)
        return arr.nbytes + TAIL_META_BYTES
