"""``Store.attend``: attention computed where the pages live, over one layer's stored range (a mixin of
:class:`kvd.store.Store`).

A read like :meth:`Store.get_packed`, with the same snapshot rules (kvd.store.core, "Threads"): under the lock it
checks the arguments, resolves the range against the sequence's length at that moment and counts a use; a small
range in RAM is then attended under the lock, a large one (or one of a spilled sequence) over a snapshot
without it, so ``attend`` on a sequence being appended to sees one consistent prefix. The pages are walked once
by :mod:`kvd.codec.attend`: full pages in C from the records, partial pages at the range's ends, pages with raw
(protected) heads and the hot tail through a one-page scratch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvd.codec import attend as kernel
from kvd.codec import pages
from kvd.errors import InvalidArgument, LayoutMismatch, NonFiniteError
from kvd.store import pool as sp
from kvd.store import sequences as store_seq

__all__ = ["Attending", "check_queries"]


def check_queries(ns: store_seq.Namespace, queries: Any, positions: Any, scale: Any,
                  end: int) -> tuple[np.ndarray, np.ndarray]:
    """The queries as a C-contiguous float32 ``[T_q, H_q, D]`` with ``scale`` applied (None: ``1/sqrt(D)``) and
    their positions as int64 ``[T_q]`` (None: the last ``T_q`` positions before ``end``). InvalidArgument /
    LayoutMismatch / NonFiniteError naming the bad value."""
    q = np.asarray(queries) if not isinstance(queries, np.ndarray) else queries
    if q.dtype not in (np.float16, np.float32):
        raise InvalidArgument(f"queries must be float16 or float32, got {q.dtype}")
    if q.ndim != 3 or not q.shape[0]:
        raise InvalidArgument(f"queries must be [T_q, H_q, D] with T_q >= 1, got shape {list(q.shape)}")
    t_q, h_q, d = q.shape
    if d != ns.head_dim or h_q < 1 or h_q % ns.heads:
        raise LayoutMismatch(f"queries [T_q, H_q, D] = {list(q.shape)} do not fit namespace {ns.name!r}: D must "
                             f"be head_dim {ns.head_dim} and H_q a multiple of its {ns.heads} KV heads")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not math.isfinite(scale) or scale <= 0:
        raise InvalidArgument(f"scale must be a finite number > 0, got {scale!r}")
    q32 = np.ascontiguousarray(q, dtype=np.float32) * np.float32(scale)
    if not np.isfinite(q32).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(q32))[0])
        raise NonFiniteError(f"queries{list(bad)} is not finite after scaling: {q[bad]!r} (scale {scale})")
    if positions is None:
        pos = np.arange(end - t_q, end, dtype=np.int64)
    else:
        pos = np.asarray(positions)
        if pos.shape != (t_q,) or (pos.size and pos.dtype.kind not in "iu"):
            raise InvalidArgument(f"positions must be {t_q} integers (one per query), got {pos.dtype} shape "
                                  f"{list(pos.shape)}")
        pos = pos.astype(np.int64)
        if (pos < 0).any():
            raise InvalidArgument(f"positions must be >= 0, got {int(pos.min())}")
    return q32, pos


def attend_view(seq: Any, s: int, e: int, layer: int, p: int, q: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray,
                                                                                                        np.ndarray]:
    """Attention of ``q`` at ``pos`` over tokens ``[s, e)`` of ``layer`` of ``seq`` (a Seq or a SeqView): the
    pages in order, then the hot tail. Reads only."""
    ns = seq.ns
    state = kernel.State(q, pos, ns.heads)
    e = min(e, state.last + 1)  # tokens after every query's position change nothing
    if e <= s:
        return state.finish()
    recs = seq.pages[layer]
    n_sealed = len(recs)
    sealed_end = n_sealed * p
    r_lo, r_hi = s // p, min(-(-e // p), n_sealed)
    full_lo, full_hi = -(-s // p), min(e // p, n_sealed)  # rows lying fully inside [s, e)
    sizes, off = ns.sizes_by_code, sp.CUR_FMT_FROM_END
    kscr = np.empty((p, ns.heads, ns.head_dim), np.float16)
    vscr = np.empty_like(kscr)
    use_run = kernel.RUN and full_hi > full_lo and any(ns.specs_by_code)
    r = r_lo
    while r < r_hi:
        if use_run and full_lo <= r < full_hi:
            stop = kernel.run(state, recs, r, full_hi, ns.specs_by_code, off, kscr, vscr)
            if stop < 0:
                r = full_hi
                continue
            r = stop  # this row goes the slow way below
        rec = recs[r]
        kb, vb = sizes[rec[-off]] if not ns.mixed else ns.record_sizes(rec)
        mv = memoryview(rec)
        pages.decode_into(mv[:kb], kscr)
        pages.decode_into(mv[kb : kb + vb], vscr)
        a = r * p
        lo, hi = max(a, s), min(a + p, e)
        kernel.tile(state, kscr[lo - a : hi - a], vscr[lo - a : hi - a], lo)
        r += 1
    if e > sealed_end:
        assert seq.tail is not None
        lo = max(s, sealed_end)
        kernel.tile(state, np.ascontiguousarray(seq.tail[0, layer, lo - sealed_end : e - sealed_end]),
                    np.ascontiguousarray(seq.tail[1, layer, lo - sealed_end : e - sealed_end]), lo)
    return state.finish()


class Attending:
    """The mixin: :meth:`attend` over the store's own state (see the module docstring)."""

    def attend(self, namespace: str, seq_id: Any, layer: int, queries: Any, *, start: int = 0,
               end: int | None = None, scale: float | None = None, positions: Any = None,
               max_bytes: int | None = None, disk_io: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Attention of ``queries`` (float16/float32 ``[T_q, H_q, D]``, ``H_q`` a multiple of the KV heads:
        grouped-query, query head ``h`` reads KV head ``h // (H_q // H)``) over tokens ``[start, end)`` (``end``
        None: the length when the call runs) of ``layer``, computed over the pages as stored: ``(out [T_q, H_q,
        D], lse [T_q, H_q])`` float32 (:mod:`kvd.attention`). ``scale`` (default ``1/sqrt(D)``) multiplies the
        scores; query ``i`` sees the tokens at positions ``<= positions[i]`` (default: the last ``T_q``
        positions of the range, so a single query sees all of it). ``max_bytes``: raise ReadTooLarge instead of
        attending over a range whose float16 keys and values are more than that; ``disk_io`` False: raise
        OnDisk instead of reading a spilled sequence's file (a server's loop). Raises UnknownNamespace,
        UnknownSequence, InvalidArgument (range, layer, positions, scale), LayoutMismatch (head count or head
        dim), NonFiniteError (NaN/Inf queries)."""
        out, lse, _, _ = self.attend_range(namespace, seq_id, layer, queries, start=start, end=end, scale=scale,
                                           positions=positions, max_bytes=max_bytes, disk_io=disk_io)
        return out, lse

    def attend_range(self, namespace: str, seq_id: Any, layer: int, queries: Any, *, start: int = 0,
                     end: int | None = None, scale: float | None = None, positions: Any = None,
                     max_bytes: int | None = None,
                     disk_io: bool = True) -> tuple[np.ndarray, np.ndarray, int, int]:
        """:meth:`attend`, and the range it covered: ``(out, lse, start, end)`` with ``end`` resolved."""
        store: Any = self
        with store._lock:
            seq, entry = store._lookup(namespace, seq_id)
            s, e, lay = store_seq.check_range(seq, start, end, [layer])
            q, pos = check_queries(seq.ns, queries, positions, scale, e)
            fp16 = store_seq.fp16_bytes(seq.ns, 1, e - s)
            if max_bytes is not None and fp16 > max_bytes:
                raise store_seq.ReadTooLarge(fp16, max_bytes)
            view = store._use(seq, entry, e, fp16, disk_io)
            if view is None:
                return (*attend_view(seq, s, e, lay[0], store.page_tokens, q, pos), s, e)
        return (*store._unlocked_read(attend_view, view, s, e, lay[0], store.page_tokens, q, pos, entry=entry),
                s, e)
