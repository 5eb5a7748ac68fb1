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
    """Causal grouped-query attention of the last ``n_queries`` queries, float64 ``[n_queries, Hq, D]``.

    ``q`` is ``[T, Hq, D]``; ``k`` and ``v`` are ``[T, H, D]`` with ``Hq`` a multiple of ``H``."""
    t, hq, d = q.shape
    g = hq // k.shape[1]
    qq = q[-n_queries:].astype(np.float64).transpose(1, 0, 2)  # [Hq, nq, D]
    kk = np.repeat(k.astype(np.float64), g, axis=1).transpose(1, 0, 2)  # [Hq, T, D]
    vv = np.repeat(v.astype(np.float64), g, axis=1).transpose(1, 0, 2)
    s = qq @ kk.transpose(0, 2, 1) / np.sqrt(d)  # [Hq, nq, T]
    s[:, np.arange(t)[None, :] > np.arange(t - n_queries, t)[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return ((p / p.sum(axis=-1, keepdims=True)) @ vv).transpose(1, 0, 2)


def eps_o(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_hat: np.ndarray, v_hat: np.ndarray) -> float:
    """Relative attention-output error of decoded ``k_hat``, ``v_hat`` against the originals ``k``, ``v``."""
    o = attention(q, k, v)
    return float(np.linalg.norm(attention(q, k_hat, v_hat) - o) / np.linalg.norm(o))
