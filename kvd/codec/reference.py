"""Pure-numpy reference kernels: the numerical contract of kvd's page codecs.

Theory of operation
-------------------
Every kernel works on a 2-D float16 matrix and writes into outputs the caller allocated. A page ``[T, H, D]``
is seen either as rows ``[T*H, D]`` (per-token quantization: groups run along head_dim) or as columns
``[T, H*D]`` (per-channel quantization, as in KIVI: groups run along the tokens). ``group`` is the group size;
the last group of a row (column) may be partial.

The compiled backends (``kvd.codec._kernels``: AVX-512, AVX2, NEON, scalar C) produce *bit-identical* integer
codes, scales and decoded values to these functions. That is possible because every step below is a single IEEE-754
float32 operation in round-to-nearest-even (no fused multiply-add anywhere; the extension is built with
``-ffp-contract=off``), and the few directed roundings are explicit:

* scales are rounded **up** to float16 (``f16_up``), so ``|x| / scale`` never exceeds the code range and no
  clamping error appears; a zero scale means "all zero" (symmetric) or "constant group" (asymmetric) and
  ``inv = 0``.
* asymmetric minimums are rounded **down** to float16 (``f16_down``), so ``x - min >= 0``.
* decoded values are clamped to +-65504 before the float32 -> float16 conversion (the rounded-up scale can
  push ``127 * scale`` just past the float16 range; clamping gives what round-to-nearest would give there).

Non-finite input (NaN or Inf; float16 bits with an all-ones exponent) is refused with
:class:`kvd.errors.NonFiniteError` naming the first bad position; compiled kernels detect it in the same pass
that finds the absmax / min / max.

Formats (codes):
* ``q8``: int8 in [-127, 127], ``x ~ q * s``, ``s = f16_up(absmax / 127)``.
* ``fp8`` (``fmt`` 0 = E4M3, max 448, no infinities; 1 = E5M2, max 57344): ``y = x * (1/s)`` rounded to the
  8-bit float with round-to-nearest-even and saturation to +-max (finite input never yields NaN),
  ``s = f16_up(absmax / max)``.
* ``q4``: 4-bit unsigned in [0, 15], ``x ~ q * s + m``, ``m = f16_down(min)``,
  ``s = f16_up((max - m) / 15)``; two codes per byte, the even element in the low nibble, along the row
  (rows) or along the token's channels (columns); an odd length leaves the last high nibble zero.
  Rows may be *rotated*: ``y = FWHT(x) * (1/D)`` (the unnormalized fast Walsh-Hadamard transform, butterflies
  in order h = 1, 2, 4, ..., each pair ``(a, b) -> (a + b, a - b)``); decode applies ``FWHT`` again, which
  undoes it exactly in real arithmetic. The rotation spreads outliers across the row, which takes the
  attention error of q4 on real KV from 9.24% to 8.78% (BENCHMARKS.md, "Kernels and codec").
"""

from __future__ import annotations

import numpy as np

from kvd.errors import InvalidArgument, NonFiniteError

F16_MAX = 65504.0
Q8_MAX = 127
Q4_MAX = 15
FP8_E4M3 = 0
FP8_E5M2 = 1
FP8_MAX = {FP8_E4M3: 448.0, FP8_E5M2: 57344.0}
# (mantissa bits, exponent bias) of each 8-bit float
_FP8_BITS = {FP8_E4M3: (3, 7), FP8_E5M2: (2, 15)}

_F32 = np.float32


# ---------------------------------------------------------------------------------------------------------
# argument checks (the compiled backends raise the same errors with the same messages)


def _check_input(x: np.ndarray, name: str = "x") -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float16:
        raise InvalidArgument(f"{name} must be a float16 numpy array, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != 2:
        raise InvalidArgument(f"{name} must be 2-D, got shape {x.shape}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise InvalidArgument(f"{name} must not be empty, got shape {x.shape}")
    if x.shape[1] > 1 and x.strides[1] != x.itemsize:
        raise InvalidArgument(f"{name} rows must be contiguous (last-axis stride {x.strides[1]} bytes)")


def _check_out(a: np.ndarray, name: str, dtype: type, shape: tuple[int, ...], *, writable: bool = True) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.dtype(dtype):
        raise InvalidArgument(f"{name} must be a {np.dtype(dtype).name} numpy array, got {getattr(a, 'dtype', a)}")
    if a.shape != shape:
        raise InvalidArgument(f"{name} must have shape {shape}, got {a.shape}")
    if not a.flags.c_contiguous:
        raise InvalidArgument(f"{name} must be C-contiguous")
    if writable and not a.flags.writeable:
        raise InvalidArgument(f"{name} must be writable")


def _check_out_matrix(out: np.ndarray) -> None:
    if not isinstance(out, np.ndarray) or out.ndim != 2:
        raise InvalidArgument(f"out must be a 2-D numpy array, got {getattr(out, 'shape', type(out).__name__)}")


def _check_group(group: int) -> int:
    if not isinstance(group, (int, np.integer)) or isinstance(group, bool) or not 1 <= int(group) <= 65535:
        raise InvalidArgument(f"group must be an integer in [1, 65535], got {group!r}")
    return int(group)  # a numpy unsigned group would otherwise overflow in -(-n // group)


def _check_fmt(fmt: int) -> None:
    if fmt not in (FP8_E4M3, FP8_E5M2):
        raise InvalidArgument(f"fp8 fmt must be 0 (E4M3) or 1 (E5M2), got {fmt!r}")


def _ngroups(n: int, group: int) -> int:
    return -(-n // group)


def _check_finite(x: np.ndarray) -> None:
    bad = (x.view(np.uint16) & 0x7FFF) >= 0x7C00
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        raise NonFiniteError(f"non-finite value ({float(x[r, c])}) at row {r}, column {c}; nothing was stored")


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


# ---------------------------------------------------------------------------------------------------------
# float helpers


def f16_up(v: np.ndarray) -> np.ndarray:
    """The smallest float16 >= each float32 value (v is finite and within float16 range)."""
    v = np.asarray(v, dtype=_F32)
    h = v.astype(np.float16)
    low = h.astype(_F32) < v
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def f16_down(v: np.ndarray) -> np.ndarray:
    """The largest float16 <= each float32 value (v is finite and within float16 range)."""
    v = np.asarray(v, dtype=_F32)
    h = v.astype(np.float16)
    high = h.astype(_F32) > v
    h[high] = np.nextafter(h[high], np.float16(-np.inf))
    return h


def _to_f16(v: np.ndarray) -> np.ndarray:
    return np.clip(v, _F32(-F16_MAX), _F32(F16_MAX)).astype(np.float16)


def _inv(s32: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        inv = _F32(1.0) / s32
    return np.where(s32 > 0, inv, _F32(0.0)).astype(_F32)


def fwht_rows(y: np.ndarray) -> np.ndarray:
    """Unnormalized fast Walsh-Hadamard transform of each float32 row (length a power of two)."""
    n, d = y.shape
    y = np.ascontiguousarray(y, dtype=_F32)
    h = 1
    while h < d:
        v = y.reshape(n, d // (2 * h), 2, h)
        a = v[:, :, 0, :]
        b = v[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2).reshape(n, d)
        h *= 2
    return y


def _fp8_lut(fmt: int) -> np.ndarray:
    mbits, bias = _FP8_BITS[fmt]
    codes = np.arange(256)
    mag = codes & 0x7F
    e = mag >> mbits
    m = mag & ((1 << mbits) - 1)
    val = np.where(
        e == 0,
        m * 2.0 ** (1 - bias - mbits),
        (1.0 + m / (1 << mbits)) * 2.0 ** (e.astype(np.float64) - bias),
    )
    val = np.where(codes & 0x80, -val, val)
    return val.astype(_F32)


_FP8_LUT = {f: _fp8_lut(f) for f in (FP8_E4M3, FP8_E5M2)}


def f32_to_fp8(y: np.ndarray, fmt: int) -> np.ndarray:
    """Round float32 values to 8-bit float codes: nearest-even, saturating at +-max, sign kept (also of -0)."""
    mbits, bias = _FP8_BITS[fmt]
    y = np.asarray(y, dtype=_F32)
    bits = y.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    a = np.minimum(np.abs(y), _F32(FP8_MAX[fmt]))
    abits = a.view(np.uint32).astype(np.int64)
    shift = 23 - mbits
    rounded = abits + ((1 << (shift - 1)) - 1) + ((abits >> shift) & 1)
    normal = (rounded >> shift) - ((127 - bias) << mbits)
    sub = np.rint(a * _F32(2.0 ** (bias + mbits - 1)))  # exact power-of-two scaling, then nearest-even
    min_normal = _F32(2.0 ** (1 - bias))
    code = np.where(a < min_normal, sub.astype(np.int64), normal)
    return (code.astype(np.uint8) | sign).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------------
# group reductions: rows -> groups along axis 1; columns are handled by transposing views


def _ordered_key(v: np.ndarray) -> np.ndarray:
    """int32 keys of finite float32 values that order like the floats with -0.0 < +0.0 (an involution)."""
    k = v.view(np.int32)
    return k ^ ((k >> 31) & np.int32(0x7FFFFFFF))


def _group_reduce(xf: np.ndarray, group: int, fn: np.ufunc) -> np.ndarray:
    """fn.reduce over groups along axis 1 of a float32 [N, D] matrix -> [N, ceil(D/group)].

    Reduced on integer keys, so a group holding both zeros has min -0.0 and max +0.0 (numpy's float min/max
    return either zero, depending on their SIMD order; the compiled kernels order -0.0 below +0.0)."""
    starts = np.arange(0, xf.shape[1], group)
    keys = fn.reduceat(_ordered_key(np.ascontiguousarray(xf, dtype=_F32)), starts, axis=1)
    return _ordered_key(keys).view(_F32)


def _expand(g: np.ndarray, d: int, group: int) -> np.ndarray:
    return np.repeat(g, group, axis=1)[:, :d]


# ---------------------------------------------------------------------------------------------------------
# fp16 (raw): a checked copy, so raw pages and the hot tail refuse NaN/Inf exactly like the quantizers


def f16_copy_rows(x: np.ndarray, out: np.ndarray) -> None:
    """Copy float16 x [N, D] into out [N, D], refusing NaN/Inf (NonFiniteError) before anything is written."""
    _check_input(x)
    _check_out(out, "out", np.float16, x.shape)
    _check_finite(x)
    out[...] = x


# ---------------------------------------------------------------------------------------------------------
# q8


def _q8_encode(xf: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    d = xf.shape[1]
    am = _group_reduce(np.abs(xf), group, np.maximum)
    s16 = f16_up(am / _F32(Q8_MAX))
    inv = _expand(_inv(s16.astype(_F32)), d, group)
    q = np.clip(np.rint(xf * inv), -Q8_MAX, Q8_MAX).astype(np.int8)
    return q, s16


def q8_encode_rows(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, group: int) -> None:
    """int8 codes [N, D] and float16 scales [N, ceil(D/group)] of x [N, D] (groups along each row)."""
    _check_input(x)
    group = _check_group(group)
    n, d = x.shape
    _check_out(codes, "codes", np.int8, (n, d))
    _check_out(scales, "scales", np.float16, (n, _ngroups(d, group)))
    _check_finite(x)
    q, s = _q8_encode(x.astype(_F32), group)
    codes[...] = q
    scales[...] = s


def q8_decode_rows(codes: np.ndarray, scales: np.ndarray, out: np.ndarray, group: int) -> None:
    """out [N, D] float16 = codes * scales (inverse of q8_encode_rows)."""
    _check_out_matrix(out)
    group = _check_group(group)
    n, d = out.shape
    _check_out(codes, "codes", np.int8, (n, d), writable=False)
    _check_out(scales, "scales", np.float16, (n, _ngroups(d, group)), writable=False)
    _check_out(out, "out", np.float16, (n, d))
    out[...] = _to_f16(codes.astype(_F32) * _expand(scales.astype(_F32), d, group))


def q8_encode_cols(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, group: int) -> None:
    """int8 codes [T, C] and float16 scales [ceil(T/group), C] of x [T, C] (groups along each column)."""
    _check_input(x)
    group = _check_group(group)
    t, c = x.shape
    _check_out(codes, "codes", np.int8, (t, c))
    _check_out(scales, "scales", np.float16, (_ngroups(t, group), c))
    _check_finite(x)
    q, s = _q8_encode(np.ascontiguousarray(x.astype(_F32).T), group)
    codes[...] = q.T
    scales[...] = s.T


def q8_decode_cols(codes: np.ndarray, scales: np.ndarray, out: np.ndarray, group: int) -> None:
    """out [T, C] float16 = codes * scales (inverse of q8_encode_cols)."""
    _check_out_matrix(out)
    group = _check_group(group)
    t, c = out.shape
    _check_out(codes, "codes", np.int8, (t, c), writable=False)
    _check_out(scales, "scales", np.float16, (_ngroups(t, group), c), writable=False)
    _check_out(out, "out", np.float16, (t, c))
    s = np.repeat(scales.astype(_F32), group, axis=0)[:t]
    out[...] = _to_f16(codes.astype(_F32) * s)


# ---------------------------------------------------------------------------------------------------------
# fp8


def fp8_encode_rows(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, group: int, fmt: int) -> None:
    """8-bit float codes [N, D] (uint8 bit patterns) and float16 scales [N, ceil(D/group)] of x [N, D]."""
    _check_input(x)
    group = _check_group(group)
    _check_fmt(fmt)
    n, d = x.shape
    _check_out(codes, "codes", np.uint8, (n, d))
    _check_out(scales, "scales", np.float16, (n, _ngroups(d, group)))
    _check_finite(x)
    xf = x.astype(_F32)
    am = _group_reduce(np.abs(xf), group, np.maximum)
    s16 = f16_up(am / _F32(FP8_MAX[fmt]))
    inv = _expand(_inv(s16.astype(_F32)), d, group)
    codes[...] = f32_to_fp8(xf * inv, fmt)
    scales[...] = s16


def fp8_decode_rows(codes: np.ndarray, scales: np.ndarray, out: np.ndarray, group: int, fmt: int) -> None:
    """out [N, D] float16 = fp8(codes) * scales (inverse of fp8_encode_rows)."""
    _check_out_matrix(out)
    group = _check_group(group)
    _check_fmt(fmt)
    n, d = out.shape
    _check_out(codes, "codes", np.uint8, (n, d), writable=False)
    _check_out(scales, "scales", np.float16, (n, _ngroups(d, group)), writable=False)
    _check_out(out, "out", np.float16, (n, d))
    out[...] = _to_f16(_FP8_LUT[fmt][codes] * _expand(scales.astype(_F32), d, group))


# ---------------------------------------------------------------------------------------------------------
# q4


def _q4_encode(y: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = y.shape[1]
    mn16 = f16_down(_group_reduce(y, group, np.minimum))
    mnf = mn16.astype(_F32)
    rng = _group_reduce(y, group, np.maximum) - mnf
    s16 = f16_up(rng / _F32(Q4_MAX))
    inv = _expand(_inv(s16.astype(_F32)), d, group)
    q = np.clip(np.rint((y - _expand(mnf, d, group)) * inv), 0, Q4_MAX).astype(np.uint8)
    return q, s16, mn16


def _pack4(q: np.ndarray) -> np.ndarray:
    n, d = q.shape
    if d % 2:
        q = np.concatenate([q, np.zeros((n, 1), np.uint8)], axis=1)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def _unpack4(p: np.ndarray, d: int) -> np.ndarray:
    n = p.shape[0]
    q = np.empty((n, 2 * p.shape[1]), np.uint8)
    q[:, 0::2] = p & 0x0F
    q[:, 1::2] = p >> 4
    return q[:, :d]


def _check_rotate(rotate: bool, d: int) -> None:
    if rotate and not is_pow2(d):
        raise InvalidArgument(f"rotation needs a power-of-two row length, got {d}")


def q4_encode_rows(
    x: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray,
    group: int,
    rotate: bool,
    prefetch: np.ndarray | None = None,
) -> None:
    """Packed 4-bit codes [N, ceil(D/2)], float16 scales and mins [N, ceil(D/group)] of x [N, D].

    With ``rotate`` (D a power of two) the row is first Hadamard-rotated: ``y = FWHT(x) * (1/D)``.
    ``prefetch``: a C-contiguous array the compiled kernel reads into cache meanwhile (the next input, e.g. the
    keys of the same page); it never changes the result, and the reference only checks it.
    """
    if prefetch is not None and not (isinstance(prefetch, np.ndarray) and prefetch.flags.c_contiguous):
        raise TypeError(f"prefetch must be a C-contiguous numpy array or None, got {type(prefetch).__name__}")
    _check_input(x)
    group = _check_group(group)
    n, d = x.shape
    _check_rotate(rotate, d)
    ng = _ngroups(d, group)
    _check_out(packed, "packed", np.uint8, (n, (d + 1) // 2))
    _check_out(scales, "scales", np.float16, (n, ng))
    _check_out(mins, "mins", np.float16, (n, ng))
    _check_finite(x)
    y = x.astype(_F32)
    if rotate:
        y = fwht_rows(y) * _F32(1.0 / d)
    q, s, m = _q4_encode(y, group)
    packed[...] = _pack4(q)
    scales[...] = s
    mins[...] = m


def q4_decode_rows(
    packed: np.ndarray, scales: np.ndarray, mins: np.ndarray, out: np.ndarray, group: int, rotate: bool
) -> None:
    """out [N, D] float16 = q * s + m, then FWHT if the rows were rotated (inverse of q4_encode_rows)."""
    _check_out_matrix(out)
    group = _check_group(group)
    n, d = out.shape
    _check_rotate(rotate, d)
    ng = _ngroups(d, group)
    _check_out(packed, "packed", np.uint8, (n, (d + 1) // 2), writable=False)
    _check_out(scales, "scales", np.float16, (n, ng), writable=False)
    _check_out(mins, "mins", np.float16, (n, ng), writable=False)
    _check_out(out, "out", np.float16, (n, d))
    q = _unpack4(packed, d).astype(_F32)
    v = q * _expand(scales.astype(_F32), d, group) + _expand(mins.astype(_F32), d, group)
    if rotate:
        v = fwht_rows(v)
    out[...] = _to_f16(v)


def q4_encode_cols(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, mins: np.ndarray, group: int) -> None:
    """Packed 4-bit codes [T, ceil(C/2)], float16 scales and mins [ceil(T/group), C] of x [T, C]."""
    _check_input(x)
    group = _check_group(group)
    t, c = x.shape
    ng = _ngroups(t, group)
    _check_out(packed, "packed", np.uint8, (t, (c + 1) // 2))
    _check_out(scales, "scales", np.float16, (ng, c))
    _check_out(mins, "mins", np.float16, (ng, c))
    _check_finite(x)
    q, s, m = _q4_encode(np.ascontiguousarray(x.astype(_F32).T), group)
    packed[...] = _pack4(np.ascontiguousarray(q.T))
    scales[...] = s.T
    mins[...] = m.T


def q4_decode_cols(packed: np.ndarray, scales: np.ndarray, mins: np.ndarray, out: np.ndarray, group: int) -> None:
    """out [T, C] float16 = q * s + m (inverse of q4_encode_cols)."""
    _check_out_matrix(out)
    group = _check_group(group)
    t, c = out.shape
    ng = _ngroups(t, group)
    _check_out(packed, "packed", np.uint8, (t, (c + 1) // 2), writable=False)
    _check_out(scales, "scales", np.float16, (ng, c), writable=False)
    _check_out(mins, "mins", np.float16, (ng, c), writable=False)
    _check_out(out, "out", np.float16, (t, c))
    q = _unpack4(packed, c).astype(_F32)
    s = np.repeat(scales.astype(_F32), group, axis=0)[:t]
    m = np.repeat(mins.astype(_F32), group, axis=0)[:t]
    out[...] = _to_f16(q * s + m)


KERNELS = (
    "f16_copy_rows",
    "q8_encode_rows",
    "q8_decode_rows",
    "q8_encode_cols",
    "q8_decode_cols",
    "fp8_encode_rows",
    "fp8_decode_rows",
    "q4_encode_rows",
    "q4_decode_rows",
    "q4_encode_cols",
    "q4_decode_cols",
)
