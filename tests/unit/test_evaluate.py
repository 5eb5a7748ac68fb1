"""kvd.evaluate.attention, the yardstick of every precision decision, is causal grouped-query attention exactly as
its definition says, checked against a per-head, per-query loop over the definition."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.evaluate import attention, eps_o


def by_definition(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_queries: int) -> np.ndarray:
    t, hq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros((n_queries, hq, d))
    for i, pos in enumerate(range(t - n_queries, t)):
        for head in range(hq):
            kk = k[: pos + 1, head // g].astype(np.float64)
            s = kk @ q[pos, head].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ v[: pos + 1, head // g].astype(np.float64)
    return out


@pytest.mark.parametrize(("t", "hq", "h", "n_queries"), [(40, 6, 2, 40), (33, 4, 4, 7), (17, 3, 1, 1)])
def test_attention_is_causal_grouped_query_attention(t: int, hq: int, h: int, n_queries: int) -> None:
    rng = np.random.default_rng(t)
    q = rng.standard_normal((t, hq, 16)).astype(np.float16)
    k = (3 * rng.standard_normal((t, h, 16))).astype(np.float16)
    v = rng.standard_normal((t, h, 16)).astype(np.float16)
    got = attention(q, k, v, n_queries)
    assert got.shape == (n_queries, hq, 16) and got.dtype == np.float64
    np.testing.assert_allclose(got, by_definition(q, k, v, n_queries), rtol=1e-12, atol=1e-14)


def test_eps_o_is_zero_for_the_same_kv_and_grows_with_the_damage() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((64, 4, 16)).astype(np.float16) for _ in range(3))
    assert eps_o(q, k, v, k, v) == 0.0
    noisy = [(v + s * rng.standard_normal(v.shape)).astype(np.float16) for s in (0.01, 0.1)]
    small, large = (eps_o(q, k, v, k, v_hat) for v_hat in noisy)
    assert 0 < small < large
