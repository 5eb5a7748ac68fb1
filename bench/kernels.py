"""Kernel throughput: GB/s of float16 data encoded / decoded, every level x every available backend.

Pages of a 7B-class shape (T=64 tokens, H=8 kv heads, D=128 head_dim; 128 KiB of float16 per role) fill at
least 64 MiB. Per page, the key is the column kernel on [64, 1024] (groups along the tokens) and the value the
row kernel on [512, 128] (groups along head_dim); q4 values are Hadamard-rotated and, as in the page codec
(kvd_page_encode_kv), encoded before the keys with the keys as their prefetch hint (--no-prefetch: keys first,
no hint); fp8 uses rows for both roles;
fp16 is the checked copy f16_copy_rows. Every output buffer is allocated once and reused; GB/s counts the
float16 side (input of an encode, output of a decode). The baseline is one numpy.copyto of the same bytes into
a reused buffer, timed in the same rounds as each row's kernels (round = copyto, encode, decode), so the ratio
compares runs made under the same load. Prints medians of --repeats rounds and the ratios. Buffers start where
numpy puts them (16 bytes past a cache line), like a store's records and the arrays clients send; --align 64
starts every buffer (the baseline's too) on a cache line, to see what the placement costs the kernels.

    .venv/bin/python bench/kernels.py [--mib 64] [--repeats 7] [--backends avx512,scalar] [--levels q8,q4]
                                      [--align 64]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvd.codec import kernels
from kvd.codec.pages import GROUPS

T, H, D = 64, 8, 128
LEVELS = ("fp16", "q8", "fp8_e4m3", "fp8_e5m2", "q4")


def seconds(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_medians(fns: list[Callable[[], None]], repeats: int) -> list[float]:
    """Median seconds of each function, run in rounds (one call of each per round) after one warm-up round, so
    a machine shared with other work slows the baseline and the kernels alike."""
    for fn in fns:
        fn()  # warm up (page faults of fresh buffers, caches)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            times[i].append(seconds(fn))
    return [statistics.median(t) for t in times]


ALIGN = [0]  # set by --align: every buffer's start (0: where numpy puts it, 16 bytes past a cache line)


def empty(shape: tuple[int, ...], dtype: object) -> np.ndarray:
    """np.empty, starting on an ``ALIGN[0]``-byte boundary when that is set."""
    dt = np.dtype(dtype)  # type: ignore[call-overload]
    if not ALIGN[0]:
        return np.empty(shape, dt)
    n = math.prod(shape) * dt.itemsize
    raw = np.empty(n + ALIGN[0], np.uint8)
    skip = -raw.ctypes.data % ALIGN[0]
    return raw[skip : skip + n].view(dt).reshape(shape)


def empty_like(a: np.ndarray) -> np.ndarray:
    return empty(a.shape, a.dtype)


def per_page(a: np.ndarray) -> list[np.ndarray]:
    """One view per page, made once: a store holds its pages as separate arrays, so the timed loop should
    not pay numpy's view creation (~0.2 us per array) on top of the kernel."""
    return [a[i] for i in range(a.shape[0])]


def level_ops(impl, level: str, keys: np.ndarray, values: np.ndarray, args: argparse.Namespace):
    """(encode, decode) closures over all pages for one level, with their output buffers allocated here."""
    pages = keys.shape[0]
    kx = keys.reshape(pages, T, H * D)  # columns view of each key page
    vx = values.reshape(pages, T * H, D)  # rows view of each value page
    kout = empty_like(kx)
    vout = empty_like(vx)
    # the codec's groups for this level (kvd.pages.GROUPS) unless overridden on the command line
    gr = args.row_group or GROUPS.get(level, 32)
    gc = args.col_group or GROUPS.get(level, 32)

    if level == "fp16":
        kdst, vdst = empty_like(kx), empty_like(vx)

        kx, vx, kdst, vdst, kout, vout = map(per_page, (kx, vx, kdst, vdst, kout, vout))

        def enc():
            for i in range(pages):
                impl.f16_copy_rows(kx[i], kdst[i])
                impl.f16_copy_rows(vx[i], vdst[i])

        def dec():
            for i in range(pages):
                impl.f16_copy_rows(kdst[i], kout[i])
                impl.f16_copy_rows(vdst[i], vout[i])

        return enc, dec

    if level == "q8":
        kc, ks = empty(kx.shape, np.int8), empty((pages, -(-T // gc), H * D), np.float16)
        vc, vs = empty(vx.shape, np.int8), empty((pages, T * H, -(-D // gr)), np.float16)
        kx, vx, kc, ks, vc, vs, kout, vout = map(per_page, (kx, vx, kc, ks, vc, vs, kout, vout))

        def enc():
            for i in range(pages):
                impl.q8_encode_cols(kx[i], kc[i], ks[i], gc)
                impl.q8_encode_rows(vx[i], vc[i], vs[i], gr)

        def dec():
            for i in range(pages):
                impl.q8_decode_cols(kc[i], ks[i], kout[i], gc)
                impl.q8_decode_rows(vc[i], vs[i], vout[i], gr)

        return enc, dec

    if level.startswith("fp8"):
        fmt = 0 if level == "fp8_e4m3" else 1
        g = args.fp8_group or GROUPS[level]
        kx2 = keys.reshape(pages, T * H, D)
        kout2 = kout.reshape(pages, T * H, D)
        kc, ks = empty(kx2.shape, np.uint8), empty((pages, T * H, -(-D // g)), np.float16)
        vc, vs = empty(vx.shape, np.uint8), empty((pages, T * H, -(-D // g)), np.float16)
        kx2, vx, kc, ks, vc, vs, kout2, vout = map(per_page, (kx2, vx, kc, ks, vc, vs, kout2, vout))

        def enc():
            for i in range(pages):
                impl.fp8_encode_rows(kx2[i], kc[i], ks[i], g, fmt)
                impl.fp8_encode_rows(vx[i], vc[i], vs[i], g, fmt)

        def dec():
            for i in range(pages):
                impl.fp8_decode_rows(kc[i], ks[i], kout2[i], g, fmt)
                impl.fp8_decode_rows(vc[i], vs[i], vout[i], g, fmt)

        return enc, dec

    assert level == "q4"
    ngc, ngr = -(-T // gc), -(-D // gr)
    kp, ks, km = (
        empty((pages, T, H * D // 2), np.uint8),
        empty((pages, ngc, H * D), np.float16),
        empty((pages, ngc, H * D), np.float16),
    )
    vp, vs, vm = (
        empty((pages, T * H, D // 2), np.uint8),
        empty((pages, T * H, ngr), np.float16),
        empty((pages, T * H, ngr), np.float16),
    )
    kx, vx, kp, ks, km, vp, vs, vm, kout, vout = map(per_page, (kx, vx, kp, ks, km, vp, vs, vm, kout, vout))

    if args.no_prefetch:

        def enc():
            for i in range(pages):
                impl.q4_encode_cols(kx[i], kp[i], ks[i], km[i], gc)
                impl.q4_encode_rows(vx[i], vp[i], vs[i], vm[i], gr, True)

    else:

        def enc():
            for i in range(pages):
                impl.q4_encode_rows(vx[i], vp[i], vs[i], vm[i], gr, True, prefetch=kx[i])
                impl.q4_encode_cols(kx[i], kp[i], ks[i], km[i], gc)

    def dec():
        for i in range(pages):
            impl.q4_decode_cols(kp[i], ks[i], km[i], kout[i], gc)
            impl.q4_decode_rows(vp[i], vs[i], vm[i], vout[i], gr, True)

    return enc, dec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of float16 (keys + values)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backends", default=",".join(kernels.available()))
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument(
        "--row-group", type=int, default=0, help="q8/q4 value groups along head_dim (default: codec's)"
    )
    parser.add_argument(
        "--col-group", type=int, default=0, help="q8/q4 key groups along the tokens (default: codec's)"
    )
    parser.add_argument("--fp8-group", type=int, default=0, help="fp8 groups along head_dim (default: codec's)")
    parser.add_argument(
        "--no-prefetch", action="store_true", help="q4: keys first, values without the keys as prefetch hint"
    )
    parser.add_argument("--reference-mib", type=int, default=8, help="the numpy reference runs on fewer MiB")
    parser.add_argument(
        "--align", type=int, default=0, help="start every buffer on this byte boundary (default 0: numpy's)"
    )
    args = parser.parse_args()
    if args.align < 0 or args.align & (args.align - 1):
        parser.error(f"--align must be 0 or a power of two, got {args.align}")
    ALIGN[0] = args.align

    page_bytes = T * H * D * 2
    rng = np.random.default_rng(0)

    def make(mib: int) -> tuple[np.ndarray, np.ndarray]:
        pages = max(1, (mib << 20) // (2 * page_bytes))
        kv = empty((2, pages, T, H, D), np.float16)
        kv[...] = rng.standard_normal((2, pages, T, H, D), dtype=np.float32) * 2
        return kv[0], kv[1]

    keys, values = make(args.mib)
    nbytes = keys.nbytes + values.nbytes
    src = empty((keys.size + values.size,), np.float16)
    src[: keys.size], src[keys.size :] = keys.ravel(), values.ravel()
    dst = empty_like(src)

    def copy() -> None:
        np.copyto(dst, src)

    print(
        f"kvd kernel throughput: {keys.shape[0]} pages of T={T} H={H} D={D} (keys + values = {nbytes >> 20} MiB "
        f"float16), median of {args.repeats} rounds; {platform.machine()}, numpy {np.__version__}, "
        f"default backend {kernels.BACKEND}; buffers "
        + (f"start on {ALIGN[0]}-byte boundaries" if ALIGN[0] else "where numpy puts them")
    )
    print(
        f"groups: {args.row_group or 'codec'} / {args.col_group or 'codec'} / {args.fp8_group or 'codec'} "
        f"({', '.join(f'{k} {v}' for k, v in GROUPS.items() if v)}); copyto = numpy.copyto of "
        f"the same {nbytes >> 20} MiB, timed in the same rounds as the row"
    )
    print()
    header = (
        f"{'level':<10} {'backend':<10} {'copyto GB/s':>12} {'encode GB/s':>12} {'x copyto':>9} "
        f"{'decode GB/s':>12} {'x copyto':>9}"
    )
    print(header)
    print("-" * len(header))
    small = None
    for level in args.levels.split(","):
        for name in args.backends.split(","):
            impl = kernels.load(name)
            k, v = keys, values
            if name == "reference":
                small = small or make(args.reference_mib)
                k, v = small
            enc, dec = level_ops(impl, level, k, v, args)
            nb = k.nbytes + v.nbytes
            reps = args.repeats if name != "reference" else 3
            tc, te, td = interleaved_medians([copy, enc, dec], reps)
            c, e, d = nbytes / tc / 1e9, nb / te / 1e9, nb / td / 1e9
            print(f"{level:<10} {name:<10} {c:>12.2f} {e:>12.2f} {e / c:>9.2f} {d:>12.2f} {d / c:>9.2f}")


if __name__ == "__main__":
    main()
