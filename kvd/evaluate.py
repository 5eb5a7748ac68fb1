"""Attention-output error of decoded KV: the yardstick every precision choice in kvd is measured with.

``eps_O = ||softmax(q K^T / sqrt(d)) V - O|| / ||O||`` with causal, grouped-query attention over the last
``n_queries`` queries, where ``O`` uses the original keys and values. On real KV, end-to-end model damage tracks
it (KL ~ 2.9 eps_O^2). :func:`sample_path` finds the real SmolLM2-135M sample the benchmarks and tests use:
``$KVD_SAMPLE``, else ``<repo>/../shared/data/smollm2_kv_sample.npz``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

N_QUERIES = 256


def sample_path() -> Path:
    env = os.environ.get("KVD_SAMPLE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1].parent / "shared" / "data" / "smollm2_kv_sample.npz"


def load_sample(path: Path | None = None) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray]], str]:
    """``[(q [T, Hq, D], k [T, H, D], v [T, H, D]) per layer]`` float16 (keys post-RoPE), and the meta string."""
    with np.load(path or sample_path(), allow_pickle=False) as data:
        n = sum(1 for k in data.files if k.endswith("_v"))
        return [(data[f"L{i}_q"], data[f"L{i}_k"], data[f"L{i}_v"]) for i in range(n)], str(data["meta"])


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_queries: int = N_QUERIES) -> np.ndarray:
    """Causal grouped-query attention of the last ``n_queries`` queries (all of them if fewer), float64
    ``[n_queries, Hq, D]``.

    ``q`` is ``[T, Hq, D]``; ``k`` and ``v`` are ``[T, H, D]`` with ``Hq`` a multiple of ``H``."""
    t, hq, d = q.shape
    h = k.shape[1]
    g = hq // h
    n_queries = min(n_queries, t)
    # Each KV head with its g query heads as one [g * n_queries, D] block: contiguous matmuls, no repeated K/V.
    qq = np.ascontiguousarray(q[-n_queries:].astype(np.float64).reshape(n_queries, h, g, d).transpose(1, 2, 0, 3))
    kk = np.ascontiguousarray(k.astype(np.float64).transpose(1, 2, 0))  # [H, D, T]
    vv = np.ascontiguousarray(v.astype(np.float64).transpose(1, 0, 2))  # [H, T, D]
    s = (qq.reshape(h, g * n_queries, d) @ kk).reshape(h, g, n_queries, t) / np.sqrt(d)
    s[..., np.arange(t)[None, :] > np.arange(t - n_queries, t)[:, None]] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = s.reshape(h, g * n_queries, t) @ vv  # [H, g * n_queries, D]
    return o.reshape(h, g, n_queries, d).transpose(2, 0, 1, 3).reshape(n_queries, hq, d)


def eps_o(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_hat: np.ndarray, v_hat: np.ndarray) -> float:
    """Relative attention-output error of decoded ``k_hat``, ``v_hat`` against the originals ``k``, ``v``."""
    o = attention(q, k, v)
    return float(np.linalg.norm(attention(q, k_hat, v_hat) - o) / np.linalg.norm(o))
