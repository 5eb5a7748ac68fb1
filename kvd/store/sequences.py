"""Page tables of :mod:`kvd.store`: namespaces, sequences, argument checks and the read side.

A :class:`Namespace` fixes a layout and precomputes the byte size of every page format. A :class:`Seq` is one
sequence's page table: per layer a list of sealed records (:mod:`kvd.store.pool`), one hot tail shared by all
layers (``[2, L, C, H, D]`` float16: keys, values; its capacity C is :func:`tail_tokens` of what it holds, so a
short sequence is charged for its tokens, not a page), and ``window_done``, the number of rows that have left the
recent window. The functions here only read a sequence (decode pages, list them, explain one); everything that
changes state, and the lock, stays in :class:`kvd.store.Store`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvd.codec import batch as page_batch
from kvd.codec import pages
from kvd.errors import ConfigError, InvalidArgument, KvdError, LayoutMismatch
from kvd.store import pool as sp
from kvd.store.calibrated import Protection, record_sizes

RAW = "fp16"

SeqId = str | int


def int_arg(
    name: str, value: object, lo: int, hi: int | None = None, err: type[KvdError] = InvalidArgument
) -> int:
    """``value`` as an int in ``[lo, hi]`` (bools refused), else ``err`` naming ``name`` and the value."""
    if type(value) is int and value >= lo and (hi is None or value <= hi):  # the usual case, without the ABC check
        return value
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise err(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise err(f"{name} must be {rng}, got {v}")
    return v


def int_tuple(name: str, values: Iterable[object]) -> tuple[int, ...]:
    """A sorted tuple of distinct non-negative ints (a store option), else ConfigError."""
    try:
        items = tuple(values)
    except TypeError:
        raise ConfigError(f"{name} must be a sequence of integers, got {values!r}") from None
    out = tuple(int_arg(f"{name} entry", v, 0, None, ConfigError) for v in items)
    if len(set(out)) != len(out):
        raise ConfigError(f"{name} has duplicates: {out}")
    return tuple(sorted(out))


def seq_id_arg(seq_id: object, name: str = "seq_id") -> SeqId:
    """A sequence id: a str or a non-negative int (numpy ints become int; bools are refused)."""
    if isinstance(seq_id, str):
        return seq_id
    if type(seq_id) is int and seq_id >= 0:  # the usual int, without the ABC check below
        return seq_id
    if isinstance(seq_id, numbers.Integral) and not isinstance(seq_id, bool) and int(seq_id) >= 0:
        return int(seq_id)
    raise InvalidArgument(f"{name} must be a str or a non-negative int, got {type(seq_id).__name__} {seq_id!r}")


def tail_tokens(fill: int, page_tokens: int) -> int:
    """The capacity (tokens) of a hot tail that holds ``fill`` tokens (``1 <= fill <= page_tokens``): the next
    power of four, at most a page (1, 4, 16, 64). A growth copies the tokens the tail holds: 21 copies over a
    64-token page, against 63 for doubling, whose growths made a decode step's mean 1.6x a whole-page tail's
    (steps of four: 1.14x); a tail never holds more than four times its tokens (docs/design.md, "A hot tail of its
    size")."""
    cap = 1
    while cap < fill:
        cap <<= 2
    return min(page_tokens, cap)


def rows_contiguous(a: np.ndarray) -> np.ndarray:
    """``a`` ``[L, T, H, D]`` as is if every ``a[i, t0:t1]`` is C-contiguous (what a page encoder takes; true for
    a token slice of a C-contiguous array, the usual chunked-append input), else a C-contiguous copy."""
    item = a.itemsize
    _, _, h, d = a.shape
    if a.strides[1:] == (h * d * item, d * item, item):
        return a
    return np.ascontiguousarray(a)


def check_kv(ns: Namespace, keys: object, values: object) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` and ``values`` of an append as float16 ``[L, T, H, D]`` arrays whose every ``[i, t0:t1]`` is
    C-contiguous; LayoutMismatch / InvalidArgument / NonFiniteError (float32 beyond the float16 range) naming
    the bad value."""
    arrays = []
    for name, x in (("keys", keys), ("values", values)):
        a = np.asarray(x)
        if a.ndim != 4 or a.shape[0] != ns.layers or a.shape[2:] != (ns.heads, ns.head_dim):
            raise LayoutMismatch(
                f"{name} must be [L={ns.layers}, T, H={ns.heads}, D={ns.head_dim}] for namespace "
                f"{ns.name!r}, got shape {a.shape}"
            )
        arrays.append(a)
    if arrays[0].shape != arrays[1].shape:
        raise LayoutMismatch(f"keys {arrays[0].shape} and values {arrays[1].shape} differ in shape")
    return rows_contiguous(pages.as_f16(arrays[0], "keys")), rows_contiguous(pages.as_f16(arrays[1], "values"))


class RowPlan:
    """How one row of pages (every layer) is sealed: per layer ``(format, record bytes, key page bytes, value
    page bytes, raw heads, trailer)``; ``rec_bytes`` the records' total, ``need`` that plus their metadata
    charge, ``counts`` the ``(format, pages, bytes)`` totals for the ledger."""

    __slots__ = ("layers", "rec_bytes", "need", "counts", "batch", "held")

    def __init__(self, ns: Namespace, fmt: str, flags: int, epoch: int) -> None:
        layers = []
        counts: dict[str, list[int]] = {}
        prot = ns.prot if ns.prot is not None and ns.prot.applies else None
        self.held = 0  # pages whose heads the namespace's calibration protects
        for i in range(ns.layers):
            f = RAW if ns.raw_layer[i] else fmt
            fl = flags if not ns.raw_layer[i] else 0
            if prot is None or f == RAW:
                kb, vb = ns.page_bytes[f]
                size = ns.rec_bytes[f]
                rh = () if f == RAW else ns.raw_heads
                kw: tuple[dict[str, Any], dict[str, Any]] = ({"raw_heads": rh}, {"raw_heads": rh})
            else:
                kb, vb, size, kk, vk, held = prot.layer(i, f)
                kw = (kk, vk)
                self.held += held
            layers.append((f, size, kb, vb, kw, sp.trailer_bytes(sealed_epoch=epoch, sealed_fmt=f, flags=fl)))
            c = counts.setdefault(f, [0, 0])
            c[0] += 1
            c[1] += size
        self.layers = tuple(layers)
        self.rec_bytes = sum(x[1] for x in layers)
        self.need = self.rec_bytes + sp.PAGE_META_BYTES * ns.layers
        self.counts = tuple((f, n, nb) for f, (n, nb) in counts.items())
        # per layer (key spec, value spec, trailer) for kvd.codec.batch, or None when a layer has no C spec
        specs = [ns.specs.get(f) if prot is None or f == RAW else None for f, *_ in layers]
        ok = all(x is not None for x in specs)
        self.batch = tuple((*x, lay[5]) for x, lay in zip(specs, layers, strict=True)) if ok else None  # type: ignore[misc]


_MAX_PLANS = 64  # plans are cached per (format, flags, epoch): a bound against ever-new epochs


class Namespace:
    """A registered layout with its byte sizes: ``page_bytes[fmt] = (key page, value page)``, ``rec_bytes[fmt]``
    (both pages + trailer), ``token_bytes`` (float16 keys and values of one token of every layer: a hot tail's
    bytes per token of capacity), ``row_bytes`` (the same for a row of pages), and the compaction backlog of its
    sequences (``backlog``; ``sink_backlog`` for sink rows, which go no further than the 8-bit rung)."""

    __slots__ = (
        "name", "layers", "heads", "head_dim", "page_tokens", "quant_layers", "raw_layer", "raw_heads",
        "page_bytes", "rec_bytes", "token_bytes", "row_bytes", "seq_meta", "sequences", "backlog", "sink_backlog",
        "_plans", "sizes_by_code", "specs", "specs_by_code", "prot", "mixed",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        layers: int,
        heads: int,
        head_dim: int,
        *,
        raw_layers: tuple[int, ...],
        raw_heads: tuple[int, ...],
        page_tokens: int,
    ) -> None:
        self.name, self.layers, self.heads, self.head_dim = name, layers, heads, head_dim
        self.page_tokens = page_tokens
        self.raw_layer = [i in raw_layers for i in range(layers)]
        self.quant_layers = [i for i in range(layers) if not self.raw_layer[i]]
        self.raw_heads = raw_heads
        self.page_bytes: dict[str, tuple[int, int]] = {}
        self.rec_bytes: dict[str, int] = {}
        for fmt in pages.LEVELS:
            rh = () if fmt == RAW else raw_heads
            kb = pages.nbytes(fmt, page_tokens, heads, head_dim, role="key", raw_heads=rh)
            vb = pages.nbytes(fmt, page_tokens, heads, head_dim, role="value", raw_heads=rh)
            self.page_bytes[fmt] = (kb, vb)
            self.rec_bytes[fmt] = kb + vb + sp.TRAILER_BYTES
        # page_bytes by the format code a record's trailer holds (sp.FMT_CODE order), for the read loop
        self.sizes_by_code = tuple(self.page_bytes[fmt] for fmt in pages.LEVELS)
        # (key spec, value spec) of the C page codec per format (kvd.codec.batch); absent when it is off or
        # the format's pages carry raw heads
        self.specs: dict[str, tuple[Any, Any]] = {}
        for fmt in pages.LEVELS:
            if fmt == RAW or not raw_heads:
                ks = page_batch.spec(pages.flat_layout(fmt, "key", page_tokens, heads, head_dim))
                vs = page_batch.spec(pages.flat_layout(fmt, "value", page_tokens, heads, head_dim))
                if ks is not None and vs is not None:
                    self.specs[fmt] = (ks, vs)
        self.specs_by_code = tuple(self.specs.get(fmt) for fmt in pages.LEVELS)
        self.token_bytes = 2 * layers * heads * head_dim * 2
        self.row_bytes = self.token_bytes * page_tokens
        self.seq_meta = sp.SEQ_META_BYTES + sp.LAYER_META_BYTES * layers
        self.sequences = 0
        # bytes of compaction-eligible records (unprotected, out of the window) by their current format
        self.backlog = dict.fromkeys(pages.LEVELS, 0)
        self.sink_backlog = dict.fromkeys(pages.LEVELS, 0)  # the same for sink rows that may be compressed
        self._plans: dict[tuple[str, int, int], RowPlan] = {}
        self.prot: Protection | None = None  # the calibration's effect (kvd.store.calibrated)
        self.mixed = False  # records may differ in size within a format: sizes come from their page headers

    def protect(self, prot: Protection | None) -> None:
        """Attach a calibration state; once one has changed how pages are sealed, records are sized by their
        headers for the namespace's life (pages sealed under an older protection stay readable)."""
        self.prot = prot
        self.mixed |= prot is not None and prot.applies
        self._plans.clear()

    def seal_fmt(self, fmt: str) -> str:
        """The format a page is sealed at when the level in force asks for ``fmt``."""
        return fmt if self.prot is None else self.prot.seal_fmt(fmt)

    def record_sizes(self, rec: Any) -> tuple[int, int]:
        """A record's key and value page sizes."""
        if self.mixed:
            return record_sizes(rec)
        return self.page_bytes[sp.current_fmt(rec)]

    def seal_bytes(self, fmt: str, layers: Sequence[int]) -> int:
        """Record bytes of ``layers`` sealed at ``fmt`` (not raw layers)."""
        if self.prot is None or not self.prot.applies or fmt == RAW:
            return self.rec_bytes[fmt] * len(layers)
        return sum(self.prot.layer(i, fmt)[2] for i in layers)

    def tail_shape(self, fill: int) -> tuple[int, int, int, int, int]:
        """The shape of a hot tail that holds ``fill`` tokens (its capacity: :func:`tail_tokens`)."""
        return (2, self.layers, tail_tokens(fill, self.page_tokens), self.heads, self.head_dim)

    def plan(self, fmt: str, flags: int, epoch: int) -> RowPlan:
        """The :class:`RowPlan` of a row sealed at ``fmt`` (raw layers stay fp16) with trailer ``flags`` (not
        given to raw layers) under ``epoch``."""
        key = (fmt, flags, epoch)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = RowPlan(self, fmt, flags, epoch)
        return plan


class Seq:
    """One sequence's page table (see the module docstring). ``nbytes`` is everything it accounts for."""

    __slots__ = ("ns", "key", "position", "sink_rows", "sink_top", "length", "pages", "tail", "window_done",
                 "nbytes", "alive", "logged")

    def __init__(self, ns: Namespace, key: tuple[str, SeqId], position: int = 0, sink_rows: int = 0,
                 sink_top: int = 0) -> None:
        self.ns = ns
        self.key = key
        self.position = position  # where token 0 sits in its prompt (Store.append's ``position``)
        self.sink_rows = sink_rows  # rows [0, sink_rows) hold some of the prompt's sink tokens (Store.sink_raw)
        self.sink_top = sink_top  # their most compact rung (0: fp16), fixed when the sequence enters memory
        self.length = 0
        self.pages: list[list[bytearray]] = [[] for _ in range(ns.layers)]
        self.tail: np.ndarray | None = None
        self.window_done = 0  # rows [0, window_done) are out of the recent window (encoded, or protected)
        self.nbytes = ns.seq_meta
        self.alive = True
        self.logged = 0  # rows of this sequence in the compaction log

    def record_pages(self, layer: int, row: int) -> tuple[memoryview, memoryview]:
        """The encoded key and value pages of a sealed record (views into it)."""
        rec = self.pages[layer][row]
        kb, vb = self.ns.record_sizes(rec)
        mv = memoryview(rec)
        return mv[:kb], mv[kb : kb + vb]

    def view(self, end: int) -> SeqView:
        """What a read of tokens before ``end`` needs, taken under the store's lock so that the read can run
        without it: the page tables (lists of the records, which are never written once committed) and a copy
        of the hot tail's filled tokens if the read reaches them (appends write the tail in place)."""
        return SeqView(self, end)


class SeqView:
    """A read's snapshot of a :class:`Seq` (:meth:`Seq.view`): the attributes reads use, frozen. Its records
    must not be reused while the read runs: the store does not pool removed records while a view is out."""

    __slots__ = ("ns", "length", "pages", "tail")

    def __init__(self, seq: Seq, end: int) -> None:
        self.ns = seq.ns
        self.length = seq.length
        self.pages = [list(recs) for recs in seq.pages]
        sealed_end = len(seq.pages[0]) * seq.ns.page_tokens
        fill = seq.length - sealed_end
        self.tail = seq.tail[:, :, :fill].copy() if seq.tail is not None and end > sealed_end else None

    record_pages = Seq.record_pages

    @classmethod
    def of(cls, ns: Namespace, length: int) -> SeqView:
        """A view of ``length`` tokens of ``ns`` whose pages and tail the caller fills in (a spilled sequence:
        kvd.store.spill)."""
        view = cls.__new__(cls)
        view.ns, view.length, view.pages, view.tail = ns, length, [], None
        return view


def fp16_bytes(ns: Namespace, layers: int, tokens: int) -> int:
    """The bytes of float16 keys and values of ``tokens`` tokens of ``layers`` layers of ``ns``."""
    return 4 * layers * tokens * ns.heads * ns.head_dim


class ReadTooLarge(Exception):
    """A read given ``max_bytes`` would return more (float16 keys and values): nothing was read, and the read did
    not count as a use. A server's loop reads this way, and hands a large read to its bulk lane instead."""

    def __init__(self, nbytes: int, max_bytes: int) -> None:
        super().__init__(f"the read returns {nbytes} bytes, over {max_bytes}")
        self.nbytes = nbytes


def check_range(seq: Seq, start: object, end: object, layers: object) -> tuple[int, int, list[int]]:
    """``(start, end, layers)`` checked against the sequence; InvalidArgument naming the bad value."""
    n = seq.length
    s = int_arg("start", start, 0, n)
    e = n if end is None else int_arg("end", end, 0, n)
    if s > e:
        raise InvalidArgument(f"start {s} > end {e}")
    if layers is None:
        return s, e, list(range(seq.ns.layers))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise InvalidArgument(f"layers must be a sequence of layer indices, got {layers!r}")
    out = [int_arg("layer", i, 0, seq.ns.layers - 1) for i in layers]
    if not out or len(set(out)) != len(out):
        raise InvalidArgument(f"layers must be distinct and not empty, got {out}")
    return s, e, out


def check_out(out: object, name: str, layers: int, tokens: int, h: int, d: int) -> np.ndarray:
    """A caller's output buffer for :meth:`kvd.store.Store.get_into`: a writable float16 ndarray
    ``[layers, T >= tokens, h, d]`` whose every layer is C-contiguous (a C-contiguous array is); else
    InvalidArgument naming what is wrong."""
    if not isinstance(out, np.ndarray):
        raise InvalidArgument(f"{name} must be a numpy float16 array, got {type(out).__name__}")
    if out.dtype != np.float16:
        raise InvalidArgument(f"{name} must be float16, got {out.dtype}")
    if out.ndim != 4 or out.shape[0] != layers or out.shape[1] < tokens or out.shape[2:] != (h, d):
        raise InvalidArgument(f"{name} must have shape [{layers}, T >= {tokens}, {h}, {d}], got {out.shape}")
    if not out.flags.writeable:
        raise InvalidArgument(f"{name} is read-only")
    if out.size and out.strides[1:] != (h * d * 2, d * 2, 2):
        raise InvalidArgument(f"{name} must be C-contiguous within each layer, got strides {out.strides}")
    return out


def read_into(seq: Seq, s: int, e: int, lay: Sequence[int], p: int, keys: np.ndarray, values: np.ndarray) -> None:
    """Decode tokens ``[s, e)`` of layers ``lay`` into ``keys[j, :e - s]`` / ``values[j, :e - s]`` (buffers
    checked by :func:`check_out`): pages lying fully inside the range straight into the output, partial ones
    through a scratch page; the layers split over two threads when the output is large."""
    nbytes = 2 * len(lay) * (e - s) * seq.ns.heads * seq.ns.head_dim * 2
    stream = nbytes >= page_batch.STREAM_MIN_BYTES

    def read(part: Sequence[tuple[int, int]]) -> None:
        _read_layers(seq, s, e, part, p, keys, values, stream)

    page_batch.split_run(read, list(enumerate(lay)), parallel=nbytes >= page_batch.PARALLEL_MIN_BYTES)


def _read_layers(
    seq: Seq, s: int, e: int, part: Sequence[tuple[int, int]], p: int, keys: np.ndarray, values: np.ndarray,
    stream: bool,
) -> None:
    """:func:`read_into` for the ``(output index, layer)`` pairs of ``part`` (reads only: safe on two threads)."""
    ns = seq.ns
    sizes, off = ns.sizes_by_code, sp.CUR_FMT_FROM_END
    sized = ns.record_sizes if ns.mixed else None
    decode_into = pages.decode_into
    n_sealed = len(seq.pages[0])
    sealed_end = n_sealed * p
    r_lo, r_hi = s // p, min(-(-e // p), n_sealed)
    full_lo = -(-s // p)  # rows [full_lo, full_hi) lie fully inside [s, e)
    full_hi = min(e // p, n_sealed)
    scratch: np.ndarray | None = None
    batch = ns.specs_by_code if full_hi > full_lo and any(ns.specs_by_code) else None
    for j, i in part:
        recs = seq.pages[i]
        kj, vj = keys[j], values[j]
        done = (-1, -1)  # rows the C codec decoded; the ones it leaves (raw heads, damage) go through pages
        if batch is not None:
            lo, hi = full_lo * p - s, full_hi * p - s
            stop = page_batch.decode_run(recs, full_lo, full_hi, batch, off, kj[lo:hi], vj[lo:hi], stream=stream)
            done = (full_lo, full_hi if stop < 0 else stop)
        for r in range(r_lo, r_hi):
            if done[0] <= r < done[1]:
                continue
            rec = recs[r]
            kb, vb = sizes[rec[-off]] if sized is None else sized(rec)
            mv = memoryview(rec)
            a = r * p
            if full_lo <= r < full_hi:
                decode_into(mv[:kb], kj[a - s : a - s + p])
                decode_into(mv[kb : kb + vb], vj[a - s : a - s + p])
                continue
            lo, hi = max(a, s), min(a + p, e)
            if scratch is None:
                scratch = np.empty((p, ns.heads, ns.head_dim), np.float16)
            for buf, dst in ((mv[:kb], kj), (mv[kb : kb + vb], vj)):
                decode_into(buf, scratch)
                dst[lo - s : hi - s] = scratch[lo - a : hi - a]
        if e > sealed_end:
            assert seq.tail is not None
            lo = max(s, sealed_end)
            kj[lo - s : e - s] = seq.tail[0, i, lo - sealed_end : e - sealed_end]
            vj[lo - s : e - s] = seq.tail[1, i, lo - sealed_end : e - sealed_end]


# A packed pages reply's frames hold whole pages up to this size: ZeroMQ then overlaps the copy of one frame with
# the transfer of the one before. Raw pyzmq moved 2.6 MB fastest as 4-8 frames of 330-660 KB, 1.8-2.2x faster
# than as 64 frames and 1.3-1.6x faster than as one (bench/wire.py --frames, BENCHMARKS.md "Wire").
PACK_FRAME_BYTES = 512 << 10

PageEntry = tuple[int, int, memoryview, memoryview]


def page_entries(
    seq: Seq, s: int, e: int, lay: list[int], p: int, frame_bytes: int = PACK_FRAME_BYTES
) -> tuple[list[PageEntry], list[memoryview]]:
    """``(layer, token0, key_page, value_page)`` covering ``[s, e)`` (the page holding ``s`` if empty), in the
    order of ``lay`` then token0, the hot tail encoded as an fp16 page of its filled tokens; and the buffers the
    pages were copied into: every page in entry order (key, value), whole pages, at most ``frame_bytes`` per
    buffer unless one page alone is larger. The pages are read-only views of those buffers: one copy, made under
    the store's lock, serves both forms of a pages reply."""
    r_lo = min(s, seq.length - 1) // p
    r_hi = max(-(-e // p), r_lo + 1)
    n_sealed = len(seq.pages[0])
    ns = seq.ns
    fill = seq.length - n_sealed * p
    tail_bytes = pages.nbytes(RAW, fill, ns.heads, ns.head_dim, role="key") if r_hi > n_sealed else 0
    # (layer, token0, key source, value source): a source is a page view, or (0 keys | 1 values, layer) of the tail
    plan: list[tuple[int, int, Any, Any]] = []
    sizes: list[int] = []  # of every page, in order
    for i in lay:
        for r in range(r_lo, min(r_hi, n_sealed)):
            kp, vp = seq.record_pages(i, r)
            plan.append((i, r * p, kp, vp))
            sizes += (len(kp), len(vp))
        if tail_bytes:
            plan.append((i, n_sealed * p, (0, i), (1, i)))
            sizes += (tail_bytes, tail_bytes)
    buf_sizes: list[int] = []
    for n in sizes:
        if buf_sizes and buf_sizes[-1] + n <= frame_bytes:
            buf_sizes[-1] += n
        else:
            buf_sizes.append(n)
    bufs = [memoryview(np.empty(n, np.uint8)) for n in buf_sizes]  # every byte is written below
    frames = [b.toreadonly() for b in bufs]
    out: list[PageEntry] = []
    k = off = 0
    for layer, token0, *sources in plan:
        views = []
        for role, src in zip(("key", "value"), sources, strict=True):
            if off == len(bufs[k]):
                k, off = k + 1, 0
            buf = bufs[k]
            if type(src) is tuple:
                assert seq.tail is not None
                n = pages.encode_into(seq.tail[src[0], src[1], :fill], RAW, buf[off : off + tail_bytes], role=role)
            else:
                n = len(src)
                buf[off : off + n] = src
            views.append(frames[k][off : off + n])
            off += n
        out.append((layer, token0, views[0], views[1]))
    return out, frames


def explain(seq: Seq, layer: object, token: object, p: int) -> dict[str, Any]:
    """See :meth:`kvd.store.Store.explain`."""
    ns, sink_rows = seq.ns, seq.sink_rows
    i = int_arg("layer", layer, 0, ns.layers - 1)
    tok = int_arg("token", token, 0, seq.length - 1)
    r = tok // p
    reasons: list[str] = []
    recompressed: list[list[Any]] = []
    info: dict[str, Any] = {
        "level": RAW, "page": r, "reasons": reasons, "sealed_level": None, "sealed_epoch": None,
        "recompressed": recompressed,
    }  # fmt: skip
    sealed = r < len(seq.pages[i])
    if not sealed:
        reasons.append("hot tail")
    if ns.raw_layer[i]:
        reasons.append("raw layer")
    if r < sink_rows:
        reasons.append("sink")
        if seq.sink_top:
            reasons.append("a sink page is kept one rung less compact than the level: fp16, 8 bits at q4")
    if not sealed:
        if ns.prot is not None:
            reasons += ns.prot.reasons(None, RAW)
        return info
    if r >= seq.window_done:
        reasons.append("window")
    se, e1, e2, sf, f1, f2, cur, flags = sp.read_trailer(seq.pages[i][r])
    info.update(level=sp.FMT_NAME[cur], sealed_level=sp.FMT_NAME[sf], sealed_epoch=se)
    if r < seq.window_done and (r >= sink_rows or seq.sink_top) and not ns.raw_layer[i]:
        if flags & sp.FLAG_WINDOW:
            reasons.append("kept fp16 in the window until it aged out")
        reasons.append(f"sealed at level {sp.FMT_NAME[sf]} (epoch {se}){_ahead(flags & sp.FLAG_AHEAD_SEALED)}")
        for f_, e_, bit in ((f1, e1, sp.FLAG_AHEAD_R1), (f2, e2, sp.FLAG_AHEAD_R2)):
            if f_ != sp.NO_FMT:
                reasons.append(f"re-compressed to {sp.FMT_NAME[f_]} at epoch {e_}{_ahead(flags & bit)}")
                recompressed.append([sp.FMT_NAME[f_], e_])
    if ns.raw_heads and sp.FMT_NAME[cur] != RAW:
        reasons.append(f"raw heads {list(ns.raw_heads)} kept fp16")
    if ns.prot is not None:
        reasons += ns.prot.reasons(seq.pages[i][r], sp.FMT_NAME[cur])
    return info


def _ahead(flag: int) -> str:
    return ", ahead of the cluster: this shard was full" if flag else ""


class CompactionLog:
    """Rows that may need re-compression, ``(seq, row)`` in the order they became eligible (sealed out of the
    window, unprotected): the order of their age. ``cursor`` is where compaction resumes; a level change
    restarts it. Entries of dropped sequences stay until :meth:`prune` removes them, once they are half the
    log: so forgetting a sequence costs, amortized, what it logged, never a pass over every row kept (which in a
    full store, evicting on every append, made an append's cost grow with the store). The store stops charging
    a sequence's entries when it forgets it; the dead awaiting a prune are never more than the live."""

    __slots__ = ("entries", "dead", "cursor")

    def __init__(self) -> None:
        self.entries: list[tuple[Seq, int]] = []
        self.dead = 0
        self.cursor = 0

    def add(self, seq: Seq, row: int) -> None:
        self.entries.append((seq, row))
        seq.logged += 1

    def forget(self, seq: Seq) -> None:
        """``seq`` was dropped: its entries are dead from now on."""
        self.dead += seq.logged

    def prune(self) -> int:
        """Remove the dead entries if they are half the log; returns how many went."""
        dead = self.dead
        if not dead or 2 * dead < len(self.entries):
            return 0
        self.cursor = sum(1 for s, _ in self.entries[: self.cursor] if s.alive)
        self.entries = [e for e in self.entries if e[0].alive]
        self.dead = 0
        return dead
