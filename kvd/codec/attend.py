"""Attention over pages as they are stored: one online-softmax pass, q8 / q4 pages read as stored and any other
page decoded on the fly into a one-page scratch that stays in cache, never an fp16 copy of the range.

Theory of operation
-------------------
:class:`State` holds, for queries ``[T_q, H_q, D]`` (float32, the scale already applied) and their causal
positions, the running maximum ``m`` and denominator ``l`` ``[T_q, H_q]`` and the unnormalised output ``acc``
``[T_q, H_q, D]`` of flash-decoding's online softmax. :func:`tile` folds one run of tokens (keys and values
``[n, H, D]`` float16, the first at position ``token0``) into it: scores, a causal mask, a new maximum, the
rescale of what was summed so far, and the weighted values. :func:`run` does the same for consecutive full pages
of one layer straight from the store's records: in C, with the GIL released, each page checked, then a q8 / q4
page pair (keys by channel, values by token) read as stored by a fused tile that computes from the codes
(``cython_ext/kvd_attend_q.h``), any other page decoded by the page codec of :mod:`kvd.codec.batch` (every level's
SIMD decoder) into a scratch page and folded in by the float16 tile (``cython_ext/kvd_attend.h``); both tiles
AVX2+FMA+F16C, else portable C. :meth:`State.finish` gives ``(out,
lse)`` (:mod:`kvd.attention`).

The numpy :func:`tile_reference` is the twin and the fallback (``KVD_KERNELS=reference``, or the extension not
built). Unlike the codec's kernels the compiled tile is not bit-identical to it: its sums run in another order
and its ``exp`` is a polynomial (relative error under 2e-7), so results agree to float32 rounding, which the tests
bound. Decoding is exact either way: the pages are decoded by the codec's bit-identical kernels. The fused tiles
keep code * scale in float32 where a decoded page rounds it to float16, so over q8 / q4 pages the result agrees
with attention over the decoded pages to float16 rounding (the tests bound it by 1e-3).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from kvd.codec import batch, kernels

_ext: Any
try:
    _ext = importlib.import_module("kvd.codec._kernels")
except ImportError:
    _ext = None

_BACKEND = kernels.compiled()
# the compiled tile runs wherever a compiled kernel set is in use (KVD_KERNELS=reference: the numpy twin)
COMPILED: bool = _BACKEND is not None and hasattr(_ext, "attend_tile")
# the run over records needs the page codec in C too (its checksum function: kvd.codec.batch)
RUN: bool = COMPILED and batch.ENABLED
TILE_KERNEL: str = _ext.attend_kernel(_BACKEND) if COMPILED else "reference"  # "avx2", "scalar" or "reference"
# q8 / q4 page pairs read as stored by the fused tiles; False decodes every page first (bench/attend.py's baseline)
FUSED: bool = True


class State:
    """The online softmax of queries ``q`` (float32 ``[T_q, H_q, D]``, C-contiguous, scaled) at causal positions
    ``pos`` (int64 ``[T_q]``) over a layer of ``kv_heads`` KV heads; fold tokens in with :func:`tile` /
    :func:`run`, then :meth:`finish`."""

    __slots__ = ("q", "pos", "m", "l", "acc", "kv_heads", "last")

    def __init__(self, q: np.ndarray, pos: np.ndarray, kv_heads: int) -> None:
        t_q, h_q, d = q.shape
        self.q = q
        self.pos = pos
        self.kv_heads = kv_heads
        self.m = np.full((t_q, h_q), -np.inf, np.float32)
        self.l = np.zeros((t_q, h_q), np.float32)  # noqa: E741 - the softmax denominator's usual name
        self.acc = np.zeros((t_q, h_q, d), np.float32)
        self.last = int(pos.max())  # no token after this position is seen by any query

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """``(out [T_q, H_q, D], lse [T_q, H_q])`` float32; a query that saw no token has 0 and -inf."""
        seen = self.l > 0
        denom = np.where(seen, self.l, 1.0).astype(np.float32)
        out = self.acc / denom[..., None]
        lse = np.where(seen, self.m + np.log(denom), -np.inf).astype(np.float32)
        return out, lse


def tile_reference(state: State, k: np.ndarray, v: np.ndarray, token0: int) -> None:
    """Fold keys ``k`` and values ``v`` (float16 ``[n, H, D]``, positions ``token0 ..``) into ``state``: numpy,
    float32."""
    q, pos = state.q, state.pos
    t_q, h_q, d = q.shape
    n, h = k.shape[0], k.shape[1]
    if n == 0:
        return
    g = h_q // h
    s = np.einsum("qhgd,thd->qhgt", q.reshape(t_q, h, g, d), k.astype(np.float32))
    masked = (token0 + np.arange(n))[None, :] > pos[:, None]
    s[np.broadcast_to(masked[:, None, None, :], s.shape)] = -np.inf
    m = state.m.reshape(t_q, h, g)
    top = np.maximum(m, s.max(axis=-1))
    live = np.isfinite(top)
    base = np.where(live, top, np.float32(0))
    alpha = np.exp(m - base)  # 0 where nothing was seen before; 1 where nothing is seen yet (then acc is 0)
    p = np.exp(s - base[..., None])
    l_ = state.l.reshape(t_q, h, g)
    acc = state.acc.reshape(t_q, h, g, d)
    l_ *= alpha
    l_ += p.sum(axis=-1)
    acc *= alpha[..., None]
    acc += np.einsum("qhgt,thd->qhgd", p, v.astype(np.float32))
    m[...] = top


def tile(state: State, k: np.ndarray, v: np.ndarray, token0: int) -> None:
    """:func:`tile_reference`, by the compiled kernel when there is one (``k``, ``v`` C-contiguous float16)."""
    if COMPILED and k.flags.c_contiguous and v.flags.c_contiguous:
        _ext.attend_tile(_BACKEND, state.q, state.pos, state.m, state.l, state.acc, k, v, token0)
    else:
        tile_reference(state, k, v, token0)


def run(state: State, recs: list[Any], r0: int, r1: int, specs_by_code: tuple[Any, ...], code_from_end: int,
        kscratch: np.ndarray, vscratch: np.ndarray) -> int:
    """Fold the full pages of records ``recs[r0:r1]`` (one layer; row ``r`` holds positions ``r * P ..``, P the
    scratch pages' token count) into ``state``, in C. Returns -1, or the first row it left undone (no spec for
    its format, or bytes that do not match it: fold that one in through :mod:`kvd.codec.pages` and go on).
    Only when :data:`RUN`."""
    return int(_ext.attend_run(_BACKEND, recs, r0, r1, specs_by_code, code_from_end, state.q, state.pos,
                               state.m, state.l, state.acc, kscratch, vscratch, FUSED))
