"""Attention results with their log-sum-exp, and their exact merge: what ``attend`` returns and how to combine it.

A shard's ``attend`` (docs/protocol.md §6.12) returns, for queries ``[T_q, H_q, D]`` over a token range, the
attention output ``out`` ``[T_q, H_q, D]`` (float32) and ``lse`` ``[T_q, H_q]``, the natural log of the softmax
denominator ``log(sum_j exp(s_j))`` over the range's scores ``s_j = scale * q . k_j``. Two results over disjoint
token sets merge exactly (as split-K / flash-decoding merges its splits): with ``w_i = exp(lse_i - max_i lse_i)``,
``out = sum_i w_i out_i / sum_i w_i`` and ``lse = max lse + log(sum_i w_i)``. A query that sees no token of a
part (causally masked) has ``lse = -inf`` and ``out = 0`` there, and weighs nothing in the merge.

Pure numpy: no torch, no ray, no zmq. :func:`attend` is the float64 oracle the tests and the bench hold the shard
to, and the local part an engine computes over the tokens it holds itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvd.errors import InvalidArgument

__all__ = ["attend", "default_positions", "merge"]


def default_positions(t_q: int, end: int) -> np.ndarray:
    """The causal positions ``attend`` gives queries when none are stated: the last ``t_q`` positions of a range
    ending at ``end`` (``end - t_q .. end - 1``; negative ones see no token)."""
    return np.arange(end - t_q, end, dtype=np.int64)


def merge(parts: Iterable[tuple[Any, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """The exact merge of attention results ``(out [T_q, H_q, D], lse [T_q, H_q])`` over disjoint token sets:
    ``(out, lse)`` as if attention had run over their union, float32 (computed in float64). Raises
    InvalidArgument for no parts or parts of different shapes."""
    outs, lses = [], []
    for i, (out, lse) in enumerate(parts):
        o, s = np.asarray(out, np.float64), np.asarray(lse, np.float64)
        if o.ndim != 3 or s.shape != o.shape[:2]:
            raise InvalidArgument(f"part {i}: out must be [T_q, H_q, D] and lse [T_q, H_q], got {o.shape} and "
                                  f"{s.shape}")
        if outs and o.shape != outs[0].shape:
            raise InvalidArgument(f"part {i} has shape {o.shape}, part 0 {outs[0].shape}")
        outs.append(o)
        lses.append(s)
    if not outs:
        raise InvalidArgument("merge needs at least one part")
    lse = np.stack(lses)  # [n, T_q, H_q]
    top = lse.max(axis=0)
    seen = np.isfinite(top)
    w = np.exp(lse - np.where(seen, top, 0.0)[None])  # exp(-inf) = 0 for a part that saw nothing
    total = w.sum(axis=0)
    safe = np.where(seen, total, 1.0)
    out = np.einsum("nth,nthd->thd", w, np.stack(outs)) / safe[..., None]
    out[~seen] = 0.0
    merged = np.where(seen, top + np.log(safe), -np.inf)
    return out.astype(np.float32), merged.astype(np.float32)


def attend(queries: Any, keys: Any, values: Any, *, scale: float | None = None,
           positions: Sequence[int] | np.ndarray | None = None, token0: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Causal grouped-query attention in float64: ``(out [T_q, H_q, D], lse [T_q, H_q])`` as float64.

    ``queries`` ``[T_q, H_q, D]``; ``keys``, ``values`` ``[T, H, D]`` holding tokens at positions ``token0 ..
    token0 + T - 1``; ``H_q`` a multiple of ``H`` (query head ``h`` reads KV head ``h // (H_q // H)``).
    ``scale`` defaults to ``1 / sqrt(D)``; query ``i`` sees the tokens at positions ``<= positions[i]``
    (default: :func:`default_positions` of the range's end)."""
    q = np.asarray(queries, np.float64)
    k = np.asarray(keys, np.float64)
    v = np.asarray(values, np.float64)
    t_q, h_q, d = q.shape
    t, h = k.shape[0], k.shape[1]
    if h_q % h or v.shape != k.shape or k.shape[2] != d:
        raise InvalidArgument(f"queries {q.shape} do not fit keys {k.shape} / values {v.shape}")
    g = h_q // h
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    pos = default_positions(t_q, token0 + t) if positions is None else np.asarray(positions, np.int64)
    s = np.einsum("qhgd,thd->qhgt", q.reshape(t_q, h, g, d), k) * scale  # [T_q, H, G, T]
    masked = (token0 + np.arange(t))[None, :] > pos[:, None]  # [T_q, T]
    s[np.broadcast_to(masked[:, None, None, :], s.shape)] = -np.inf
    top = s.max(axis=-1, initial=-np.inf)
    seen = np.isfinite(top)
    p = np.exp(s - np.where(seen, top, 0.0)[..., None])
    total = p.sum(axis=-1)
    out = np.einsum("qhgt,thd->qhgd", p, v) / np.where(seen, total, 1.0)[..., None]
    lse = np.where(seen, top + np.log(np.where(seen, total, 1.0)), -np.inf)
    return out.reshape(t_q, h_q, d), lse.reshape(t_q, h_q)
