"""Every kernel backend against the numpy reference (kvd.codec.reference), bit for bit.

Outputs are compared as bit patterns (codes, scales, mins, decoded float16 via .view(uint16)), with no
exception: the reference reduces q4 minimums and maximums on order-preserving integer keys, so even a group
holding both +0.0 and -0.0 has one answer (-0.0 below +0.0), which the compiled backends give too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (  # tests/unit is on sys.path (pytest's default import mode)
    BACKENDS,
    COMPILED,
    GROUPS,
    IMPLS,
    KINDS,
    LEVELS,
    SETTINGS,
    assert_same_encoding,
    bits,
    cases,
    decode,
    encode,
    garbage,
    make_x,
    ng,
)

from kvd.codec import kernels
from kvd.codec import reference as ref
from kvd.errors import BackendUnavailable, InvalidArgument, NonFiniteError

# ---------------------------------------------------------------------------------------------------------
# bit-identity


@pytest.mark.parametrize("level", LEVELS)
@SETTINGS
@given(data=st.data())
def test_encode_decode_match_reference(level, data):
    x, group = data.draw(cases(level))
    want = encode(ref, level, x, group)
    want_out = decode(ref, level, want, x.shape, group)
    for name in COMPILED:
        got = encode(IMPLS[name], level, x, group)
        assert_same_encoding(level, x, group, want, got, name)
        got_out = decode(IMPLS[name], level, want, x.shape, group)  # decode the reference's encoding
        assert np.array_equal(bits(want_out), bits(got_out)), f"{name}: {level} decoded values differ"


@pytest.mark.parametrize("level", LEVELS)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), d=st.integers(1, 140), group=GROUPS)
def test_decode_arbitrary_codes_match_reference(level, seed, n, d, group):
    """Decoders on any codes and any finite scales/mins (incl. codes no encoder makes, e.g. fp8 exponent 31)."""
    rng = np.random.default_rng(seed)
    if level == "q4_rot":
        d = 1 << (d % 9)
    rows = level not in ("q8_cols", "q4_cols")
    sshape = (n, ng(d, group)) if rows else (ng(n, group), d)

    def f16s(shape):
        b = rng.integers(0, 0x7C00, shape, dtype=np.uint16) | (rng.integers(0, 2, shape, dtype=np.uint16) << 15)
        return b.view(np.float16)

    enc = {"scales": f16s(sshape)}
    if level.startswith("q4"):
        enc["packed"] = rng.integers(0, 256, (n, (d + 1) // 2), dtype=np.uint8)
        enc["mins"] = f16s(sshape)
    else:
        enc["codes"] = rng.integers(0, 256, (n, d), dtype=np.uint8).view(
            np.int8 if level.startswith("q8") else np.uint8
        )
    want = decode(ref, level, enc, (n, d), group)
    for name in COMPILED:
        got = decode(IMPLS[name], level, enc, (n, d), group)
        assert np.array_equal(bits(want), bits(got)), f"{name}: {level} decoded values differ"


@SETTINGS
@given(data=st.data())
def test_f16_copy_rows_matches_reference(data):
    x, _ = data.draw(cases("q8_rows"))
    for name in BACKENDS:
        out = garbage(x.shape, np.float16)
        IMPLS[name].f16_copy_rows(x, out)
        assert np.array_equal(bits(out), bits(np.ascontiguousarray(x))), name


@pytest.mark.parametrize("name", COMPILED)
@pytest.mark.parametrize("level", LEVELS)
def test_page_shapes_match_reference(name, level):
    """The shapes kvd pages use (T=64, H=8, D=128; rows [512, 128], columns [64, 1024]) at their group sizes."""
    rng = np.random.default_rng(7)
    page = (rng.standard_normal((64, 8, 128)) * rng.choice([0.01, 1, 30], (64, 8, 1))).astype(np.float16)
    page[3, 2, 5] = 900.0  # an outlier
    x = page.reshape(64, 1024) if level.endswith("cols") else page.reshape(512, 128)
    for group in (16, 32, 64, 128):
        want = encode(ref, level, x, group)
        got = encode(IMPLS[name], level, x, group)
        assert_same_encoding(level, x, group, want, got, name)
        assert np.array_equal(
            bits(decode(ref, level, want, x.shape, group)), bits(decode(IMPLS[name], level, want, x.shape, group))
        )


# ---------------------------------------------------------------------------------------------------------
# round-trip error bounds


def ulp16(v: np.ndarray) -> np.ndarray:
    """The float16 spacing at |v| (65504: its spacing below, 32)."""
    a = np.minimum(np.abs(v.astype(np.float16)), np.float16(65472))
    return np.spacing(a).astype(np.float64)


def expand(s: np.ndarray, shape: tuple[int, int], group: int, rows: bool) -> np.ndarray:
    s = s.astype(np.float64)
    if rows:
        return np.repeat(s, group, axis=1)[:, : shape[1]]
    return np.repeat(s, group, axis=0)[: shape[0]]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(KINDS), n=st.integers(1, 40), group=GROUPS)
def test_round_trip_error_bounds(name, level, seed, kind, n, group):
    rng = np.random.default_rng(seed)
    d = 64 if level == "q4_rot" else int(rng.integers(1, 100))
    x = make_x(rng, kind, n, d)
    impl = IMPLS[name]
    enc = encode(impl, level, x, group)
    xr = decode(impl, level, enc, x.shape, group).astype(np.float64)
    xf = x.astype(np.float64)
    err = np.abs(xr - xf)
    rows = not level.endswith("cols")
    s = expand(enc["scales"], x.shape, group, rows)
    if level in ("q8_rows", "q8_cols", "q4_rows", "q4_cols"):
        # rint puts every value within half a step of its code; the float16 rounding of the output adds half
        # an ulp (and the clip at 65504 only moves values that were already within that)
        assert np.all(err <= s * 0.5 * (1 + 1e-5) + ulp16(xr)), f"{name} {level}"
    elif level == "q4_rot":
        # in the rotated domain each value is within s/2; FWHT scales the L2 norm by sqrt(D)
        step = np.sqrt(np.sum((s * 0.5) ** 2, axis=1))
        bound = np.sqrt(d) * step * (1 + 1e-4) + np.sqrt(np.sum(ulp16(xr) ** 2, axis=1))
        assert np.all(np.sqrt(np.sum(err**2, axis=1)) <= bound), f"{name} {level}"
    else:
        fmt = 0 if level == "fp8_e4m3" else 1
        mbits, bias = ref._FP8_BITS[fmt]
        rel = 2.0 ** -(mbits + 1)  # half an fp8 ulp, relative
        sub_step = 2.0 ** (1 - bias - mbits)  # the fp8 subnormal step (in units of the scale)
        bound = np.abs(xf) * rel * (1 + 1e-4) + s * sub_step * 0.5 + ulp16(xr) + s * 1e-6
        assert np.all(err <= bound), f"{name} {level}"
    assert np.all(np.isfinite(xr)), "finite input never decodes to NaN/Inf"


# ---------------------------------------------------------------------------------------------------------
# non-finite input


def call_encoder(impl, level: str, x: np.ndarray, group: int) -> None:
    if level == "f16":
        impl.f16_copy_rows(x, np.empty(x.shape, np.float16))
    else:
        encode(impl, level, x, group)


@pytest.mark.parametrize("level", (*LEVELS, "f16"))
@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 70),
    d=st.integers(1, 140),
    group=GROUPS,
    bad=st.sampled_from([np.nan, np.inf, -np.inf, -np.nan]),
    count=st.integers(1, 3),
)
def test_non_finite_input_is_refused(level, seed, n, d, group, bad, count):
    rng = np.random.default_rng(seed)
    if level == "q4_rot":
        d = 1 << (d % 8)
    x = make_x(rng, "normal", n, d)
    for _ in range(count):
        x[rng.integers(0, n), rng.integers(0, d)] = bad
    for name in BACKENDS:
        with pytest.raises(NonFiniteError) as info:
            call_encoder(IMPLS[name], level, x, group)
        m = re.search(r"row (\d+), column (\d+)", str(info.value))
        assert m, str(info.value)
        assert not np.isfinite(x[int(m.group(1)), int(m.group(2))]), f"{name}: {info.value}"


@pytest.mark.parametrize("name", BACKENDS)
def test_f16_copy_rows_writes_nothing_on_non_finite(name):
    x = np.ones((300, 100), np.float16)
    x[299, 99] = np.nan
    out = np.zeros((300, 100), np.float16)
    with pytest.raises(NonFiniteError):
        IMPLS[name].f16_copy_rows(x, out)
    assert not out.any()


# ---------------------------------------------------------------------------------------------------------
# bad arguments: the same error class and message as the reference


def _outcome(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - comparing whatever the reference raises
        return type(exc), str(exc)
    return None, None


def _bad_calls():
    x = np.zeros((4, 8), np.float16)
    c8, u8, s = np.zeros((4, 8), np.int8), np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.float16)
    p, sm = np.zeros((4, 4), np.uint8), np.zeros((4, 1), np.float16)
    ro = np.zeros((4, 8), np.int8)
    ro.flags.writeable = False
    fortran = np.zeros((4, 8), np.int8, order="F")
    return [
        ("q8_encode_rows", (x.astype(np.float32), c8, s, 8)),
        ("q8_encode_rows", (x.ravel(), c8, s, 8)),
        ("q8_encode_rows", (x[None], c8, s, 8)),
        ("q8_encode_rows", (np.zeros((0, 8), np.float16), c8, s, 8)),
        ("q8_encode_rows", (np.zeros((4, 16), np.float16)[:, ::2], c8, s, 8)),
        ("q8_encode_rows", (x.astype(">f2"), c8, s, 8)),
        ("q8_encode_rows", ([[0.0] * 8] * 4, c8, s, 8)),
        ("q8_encode_rows", (x, u8, s, 8)),
        ("q8_encode_rows", (x, c8[:, :7], s, 8)),
        ("q8_encode_rows", (x, fortran, s, 8)),
        ("q8_encode_rows", (x, ro, s, 8)),
        ("q8_encode_rows", (x, c8, np.zeros((4, 2), np.float16), 8)),
        ("q8_encode_rows", (x, c8, s.astype(np.float32), 8)),
        ("q8_encode_rows", (x, c8, s, 0)),
        ("q8_encode_rows", (x, c8, s, 65536)),
        ("q8_encode_rows", (x, c8, s, 8.0)),
        ("q8_encode_rows", (x, c8, s, True)),
        ("q8_decode_rows", (c8, s, x.astype(np.float32), 8)),
        ("q8_decode_rows", (u8, s, x, 8)),
        ("q8_decode_rows", (c8, np.zeros((4, 3), np.float16), x, 8)),
        ("q8_decode_rows", (c8, s, x, -1)),
        ("q8_encode_cols", (x, c8, np.zeros((2, 8), np.float16), 8)),
        ("q8_decode_cols", (c8, np.zeros((2, 8), np.float16), x, 8)),
        ("fp8_encode_rows", (x, u8, s, 8, 2)),
        ("fp8_encode_rows", (x, c8, s, 8, 0)),
        ("fp8_decode_rows", (u8, s, x, 8, -1)),
        ("q4_encode_rows", (np.zeros((4, 6), np.float16), np.zeros((4, 3), np.uint8), sm, sm, 8, True)),
        ("q4_encode_rows", (x, np.zeros((4, 5), np.uint8), sm, sm, 8, False)),
        ("q4_encode_rows", (x, p, sm, np.zeros((4, 1), np.float32), 8, False)),
        ("q4_decode_rows", (p, sm, sm, np.zeros((4, 6), np.float16), 8, True)),
        ("q4_decode_rows", (p, sm, sm, x, 0, False)),
        ("q4_encode_cols", (x, p, np.zeros((1, 8), np.float16), np.zeros((2, 8), np.float16), 4)),
        ("q4_decode_cols", (p, np.zeros((1, 8), np.float16), np.zeros((1, 8), np.float16), x, 2)),
        ("f16_copy_rows", (x, np.zeros((4, 8), np.float32))),
        ("f16_copy_rows", (x, np.zeros((8, 4), np.float16))),
    ]


@pytest.mark.parametrize("name", COMPILED)
def test_bad_arguments_raise_like_the_reference(name):
    for fn, args in _bad_calls():
        want = _outcome(getattr(ref, fn), *args)
        assert want[0] is not None and issubclass(want[0], InvalidArgument), (fn, want)
        assert _outcome(getattr(IMPLS[name], fn), *args) == want, fn


@pytest.mark.parametrize("name", COMPILED)
def test_valid_arguments_of_other_types_match_the_reference(name):
    """numpy integer group / fmt, numpy bool rotate, a misaligned array: handled, with the reference's result."""
    rng = np.random.default_rng(3)
    x = make_x(rng, "normal", 8, 32)
    buf = np.zeros(8 * 32 * 2 + 1, np.uint8)
    xm = np.frombuffer(buf.data, np.float16, count=8 * 32, offset=1).reshape(8, 32)  # misaligned, read-only
    buf[1:] = x.view(np.uint8).ravel()
    for impl in (ref, IMPLS[name]):
        c, s = np.zeros((8, 32), np.uint8), np.zeros((8, 1), np.float16)
        impl.fp8_encode_rows(xm, c, s, np.int64(32), np.int32(1))
        p, s2, m2 = np.zeros((8, 16), np.uint8), np.zeros((8, 1), np.float16), np.zeros((8, 1), np.float16)
        impl.q4_encode_rows(x, p, s2, m2, np.int16(32), np.bool_(True))
        if impl is ref:
            want = (c, s, p, s2, m2)
        else:
            for a, b in zip(want, (c, s, p, s2, m2), strict=True):
                assert np.array_equal(bits(a), bits(b))


# ---------------------------------------------------------------------------------------------------------
# fp8 rounding against ml_dtypes


@pytest.mark.parametrize("fmt", [0, 1])
def test_f32_to_fp8_matches_ml_dtypes(fmt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dt = ml_dtypes.float8_e4m3fn if fmt == 0 else ml_dtypes.float8_e5m2
    top = ref.FP8_MAX[fmt]
    lut = ref._FP8_LUT[fmt]
    valid = np.isfinite(np.arange(256).astype(np.uint8).view(dt).astype(np.float32))
    codes = np.arange(256, dtype=np.uint8)[valid]
    vals = codes.view(dt).astype(np.float32)
    # every representable value maps to its own code (and the reference table agrees with ml_dtypes)
    assert np.array_equal(lut[codes].view(np.uint32), vals.view(np.uint32))
    assert np.array_equal(ref.f32_to_fp8(vals, fmt), codes)
    # midpoints (ties to even), neighbours of every value, and random values within range
    v = np.sort(np.unique(np.abs(vals)))
    mids = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(v, np.float32(0)), np.nextafter(v, np.float32(np.inf)), mids])
    rng = np.random.default_rng(fmt)
    rand = (rng.standard_normal(20000) * 10.0 ** rng.integers(-8, 5, 20000)).astype(np.float32)
    ys = np.concatenate([near, -near, rand])
    ys = ys[np.abs(ys) <= top]
    assert np.array_equal(ref.f32_to_fp8(ys, fmt), ys.astype(dt).view(np.uint8))
    # beyond the range the reference saturates (ml_dtypes would give NaN/Inf)
    big = np.array([top * 1.01, 1e30, -1e30], np.float32)
    assert np.array_equal(lut[ref.f32_to_fp8(big, fmt)], np.array([top, top, -top], np.float32))
    if COMPILED:  # the C helper every compiled backend builds on
        from kvd.codec import _kernels

        assert np.array_equal(_kernels.f32_to_fp8(ys, fmt), ref.f32_to_fp8(ys, fmt))
        assert np.array_equal(_kernels.fp8_lut(fmt).view(np.uint32), lut.view(np.uint32))


@pytest.mark.skipif(not COMPILED, reason="the compiled extension is not built")
def test_c_float16_helpers_match_numpy():
    from kvd.codec import _kernels

    allbits = np.arange(0x7C00, dtype=np.uint16)
    vals = np.concatenate([allbits, allbits | 0x8000]).view(np.float16)
    assert all(_kernels.h2f(int(b)) == float(v) for b, v in zip(vals.view(np.uint16)[::7], vals[::7], strict=True))
    rng = np.random.default_rng(11)
    f = (rng.standard_normal(3000) * 10.0 ** rng.integers(-9, 5, 3000)).astype(np.float32)
    f = np.concatenate([f, vals.astype(np.float32)[::13], np.float32([65519.99, 65520.0, 2.0**-25, 3 * 2.0**-26])])
    with np.errstate(over="ignore"):
        assert [_kernels.f2h(float(v)) for v in f] == list(f.astype(np.float16).view(np.uint16))
    f = np.abs(f[np.abs(f) < 65504])
    assert [_kernels.f16_up(float(v)) for v in f] == list(ref.f16_up(f).view(np.uint16))
    assert [_kernels.f16_down(float(-v)) for v in f] == list(ref.f16_down(-f).view(np.uint16))


# ---------------------------------------------------------------------------------------------------------
# backend selection


def _python(code: str, env_value: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("KVD_KERNELS", None)
    if env_value is not None:
        env["KVD_KERNELS"] = env_value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_backend_is_the_best_available_or_the_forced_one():
    wanted = kernels.requested_backend()
    if wanted is None:
        assert kernels.BACKEND == kernels.available()[0]
    elif wanted == "simd":
        assert kernels.BACKEND in kernels.SIMD_BACKENDS
    else:
        assert kernels.BACKEND == wanted
    assert kernels.available()[-1] == "reference"
    assert kernels.q8_encode_rows.__name__ == "q8_encode_rows"


@pytest.mark.timeout(120)
def test_kvd_kernels_forces_a_backend():
    code = (
        "from kvd import kernels; f = kernels.q8_encode_rows\n"
        "print(kernels.BACKEND, f.__self__.name if hasattr(f, '__self__') else 'reference')"
    )
    simd = [b for b in BACKENDS if b in kernels.SIMD_BACKENDS]
    for value, expect in [
        ("reference", "reference"),
        ("scalar", "scalar"),
        *[(b, b) for b in simd],
        *([("simd", simd[0])] if simd else []),
    ]:
        if expect not in BACKENDS:
            continue
        run = _python(code, value.upper() if value == "scalar" else value)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [expect, expect], run.stdout
    impossible = "neon" if "neon" not in BACKENDS else "avx512"
    for value in (impossible, "bogus"):
        run = _python("import kvd.kernels", value)
        assert run.returncode != 0
        assert "BackendUnavailable" in run.stderr and "reference" in run.stderr, run.stderr


@pytest.mark.timeout(60)
def test_missing_extension_falls_back_to_reference_with_a_warning():
    code = (
        "import sys, warnings; sys.modules['kvd.codec._kernels'] = None\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    from kvd import kernels\n"
        "print(kernels.BACKEND, kernels.available(), any('not built' in str(m.message) for m in w))\n"
    )
    run = _python(code, None)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["reference", "['reference']", "True"]
    run = _python("import sys; sys.modules['kvd.codec._kernels'] = None\nimport kvd.kernels", "scalar")
    assert run.returncode != 0 and "BackendUnavailable" in run.stderr


def test_load_unknown_backend_raises():
    with pytest.raises(BackendUnavailable, match="available"):
        kernels.load("bogus")


