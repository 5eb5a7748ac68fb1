"""Attention-output error of each page level on real KV (SmolLM2-135M, 30 layers, 512 tokens).

    python bench/quality.py              # the levels as kvd encodes them (kvd.pages)
    python bench/quality.py --ablation   # the scheme choices behind them (axis, group, rotation)

eps_O = ||softmax(q K^T / sqrt(d)) V - O|| / ||O||, causal, grouped-query (9 query heads share 3 KV heads), over
the last 256 queries, where O uses the original K and V and the first term K, V decoded from pages of
``--page-tokens`` tokens. Keys are the post-RoPE keys (what an inference engine caches). On real KV,
end-to-end model damage tracks it: KL ~ 2.9 * eps_O^2. The sample is found through $KVD_SAMPLE or at
<repo>/../shared/data/smollm2_kv_sample.npz.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.codec import kernels, pages  # noqa: E402
from kvd.codec import reference as ref  # noqa: E402
from kvd.evaluate import N_QUERIES, eps_o, load_sample  # noqa: E402

TARGETS = {"q8": 0.013, "fp8_e4m3": 0.05, "q4": 0.09}


def paged(x: np.ndarray, page_tokens: int, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Apply a page round trip ``fn`` to each ``page_tokens`` slice of x [T, H, D]."""
    out = np.empty_like(x)
    for t0 in range(0, x.shape[0], page_tokens):
        out[t0 : t0 + page_tokens] = fn(x[t0 : t0 + page_tokens])
    return out


def level_table(layers: list, page_tokens: int) -> list[tuple[str, float, float, float]]:
    """(level, bits per value, mean eps_O, worst eps_O) for every level as kvd.pages encodes it."""
    rows = []
    for level in pages.LEVELS:
        errs, nbytes, nvals = [], 0, 0
        for q, k, v in layers:
            dec = {}
            for role, x in (("key", k), ("value", v)):

                def trip(p: np.ndarray, role: str = role, level: str = level) -> np.ndarray:
                    return pages.decode(pages.encode(p, level, role=role))

                dec[role] = paged(x, page_tokens, trip)
                for t0 in range(0, x.shape[0], page_tokens):
                    nbytes += pages.nbytes(level, min(page_tokens, x.shape[0] - t0), *x.shape[1:], role=role)
                nvals += x.size
            errs.append(eps_o(q, k, v, dec["key"], dec["value"]))
        rows.append((level, 8 * nbytes / nvals, float(np.mean(errs)), float(np.max(errs))))
    return rows


# ---------------------------------------------------------------------------------------------------------
# ablation: scheme variants built straight from the reference kernels


def _rows_q8(x: np.ndarray, group: int) -> np.ndarray:
    m = x.reshape(-1, x.shape[-1])
    c, s, o = (
        np.empty(m.shape, np.int8),
        np.empty((m.shape[0], -(-m.shape[1] // group)), np.float16),
        np.empty_like(m),
    )
    ref.q8_encode_rows(m, c, s, group)
    ref.q8_decode_rows(c, s, o, group)
    return o.reshape(x.shape)


def _cols_q8(x: np.ndarray, group: int) -> np.ndarray:
    m = x.reshape(x.shape[0], -1)
    c, s, o = (
        np.empty(m.shape, np.int8),
        np.empty((-(-m.shape[0] // group), m.shape[1]), np.float16),
        np.empty_like(m),
    )
    ref.q8_encode_cols(m, c, s, group)
    ref.q8_decode_cols(c, s, o, group)
    return o.reshape(x.shape)


def _rows_q4(x: np.ndarray, group: int, rotate: bool) -> np.ndarray:
    m = x.reshape(-1, x.shape[-1])
    n, d = m.shape
    p, s, mn, o = (
        np.empty((n, (d + 1) // 2), np.uint8),
        np.empty((n, -(-d // group)), np.float16),
        np.empty((n, -(-d // group)), np.float16),
        np.empty_like(m),
    )
    ref.q4_encode_rows(m, p, s, mn, group, rotate)
    ref.q4_decode_rows(p, s, mn, o, group, rotate)
    return o.reshape(x.shape)


def _cols_q4(x: np.ndarray, group: int) -> np.ndarray:
    m = x.reshape(x.shape[0], -1)
    t, c = m.shape
    ng = -(-t // group)
    p, s, mn, o = (
        np.empty((t, (c + 1) // 2), np.uint8),
        np.empty((ng, c), np.float16),
        np.empty((ng, c), np.float16),
        np.empty_like(m),
    )
    ref.q4_encode_cols(m, p, s, mn, group)
    ref.q4_decode_cols(p, s, mn, o, group)
    return o.reshape(x.shape)


def _rows_fp8(x: np.ndarray, group: int, fmt: int) -> np.ndarray:
    m = x.reshape(-1, x.shape[-1])
    c, s, o = (
        np.empty(m.shape, np.uint8),
        np.empty((m.shape[0], -(-m.shape[1] // group)), np.float16),
        np.empty_like(m),
    )
    ref.fp8_encode_rows(m, c, s, group, fmt)
    ref.fp8_decode_rows(c, s, o, group, fmt)
    return o.reshape(x.shape)


ABLATION: list[tuple[str, float, Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]] = [
    ("q8  K tok g32,  V tok g32", 8.5, lambda k: _rows_q8(k, 32), lambda v: _rows_q8(v, 32)),
    ("q8  K tok g64,  V tok g64", 8.25, lambda k: _rows_q8(k, 64), lambda v: _rows_q8(v, 64)),
    ("q8  K chan g32, V tok g32", 8.5, lambda k: _cols_q8(k, 32), lambda v: _rows_q8(v, 32)),
    ("q8  K chan g64, V tok g64  [kvd]", 8.25, lambda k: _cols_q8(k, 64), lambda v: _rows_q8(v, 64)),
    ("fp8 E4M3 tok g32  [kvd]", 8.5, lambda k: _rows_fp8(k, 32, 0), lambda v: _rows_fp8(v, 32, 0)),
    ("fp8 E4M3 tok g64", 8.25, lambda k: _rows_fp8(k, 64, 0), lambda v: _rows_fp8(v, 64, 0)),
    ("fp8 E5M2 tok g32  [kvd]", 8.5, lambda k: _rows_fp8(k, 32, 1), lambda v: _rows_fp8(v, 32, 1)),
    ("q4  K tok g32,  V tok g32", 5.0, lambda k: _rows_q4(k, 32, False), lambda v: _rows_q4(v, 32, False)),
    ("q4  K chan g32, V tok g32", 5.0, lambda k: _cols_q4(k, 32), lambda v: _rows_q4(v, 32, False)),
    ("q4  K chan g64, V rot g32", 4.75, lambda k: _cols_q4(k, 64), lambda v: _rows_q4(v, 32, True)),
    ("q4  K chan g32, V rot g32  [kvd]", 5.0, lambda k: _cols_q4(k, 32), lambda v: _rows_q4(v, 32, True)),
]


def ablation_table(layers: list, page_tokens: int) -> list[tuple[str, float, float, float]]:
    rows = []
    for name, bits, fk, fv in ABLATION:
        errs = [eps_o(q, k, v, paged(k, page_tokens, fk), paged(v, page_tokens, fv)) for q, k, v in layers]
        rows.append((name, bits, float(np.mean(errs)), float(np.max(errs))))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-tokens", type=int, default=64, help="tokens per page (default 64, the store default)")
    ap.add_argument("--ablation", action="store_true", help="also print the scheme variants behind the choice")
    ap.add_argument("--sample", type=Path, default=None, help="the .npz sample (default: $KVD_SAMPLE or shared/)")
    args = ap.parse_args(argv)
    layers, meta = load_sample(args.sample)
    q0, k0, _ = layers[0]
    print(f"sample: {meta.split(',')[0]}, {len(layers)} layers, keys {k0.shape}, queries {q0.shape}")
    print(f"pages of {args.page_tokens} tokens, last {N_QUERIES} queries, kernels backend: {kernels.BACKEND}\n")
    print(
        f"{'level':<12}{'bits/value':>11}{'eps_O mean':>12}{'eps_O worst':>13}{'KL~2.9e^2':>11}{'target':>9}  ok"
    )
    failed = False
    for level, bits, mean, worst in level_table(layers, args.page_tokens):
        target = TARGETS.get(level)
        ok = "" if target is None else ("yes" if mean <= target else "NO")
        failed |= ok == "NO"
        tgt = f"{100 * target:.1f}%" if target else "-"
        kl = 2.9 * mean**2
        print(f"{level:<12}{bits:>11.3f}{100 * mean:>11.2f}%{100 * worst:>12.2f}%{kl:>11.5f}{tgt:>9}  {ok}")
    if args.ablation:
        print(f"\n{'scheme (reference kernels)':<34}{'bits/value':>11}{'eps_O mean':>12}{'eps_O worst':>13}")
        for name, bits, mean, worst in ablation_table(layers, args.page_tokens):
            print(f"{name:<34}{bits:>11.3f}{100 * mean:>11.2f}%{100 * worst:>12.2f}%")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
