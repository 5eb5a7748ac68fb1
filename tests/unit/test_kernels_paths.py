"""The SIMD backends' fast paths against the numpy reference, bit for bit, adversarially: the codec's row shapes
(rows of 64 or 128 values in groups of 32, batches of 8 groups), column blocks and their tails, every float16
through fp8, NaN/Inf in any row or column of a batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_cases import COMPILED, IMPLS, assert_same_encoding, bits, decode, encode, layout, make_x

from kvd.codec import reference as ref
from kvd.errors import NonFiniteError


def assert_backends_match_reference(level: str, x: np.ndarray, group: int) -> None:
    """Every compiled backend encodes ``x`` to the reference's bits and decodes the reference's encoding to its
    bits."""
    want = encode(ref, level, x, group)
    want_out = decode(ref, level, want, x.shape, group)
    for name in COMPILED:
        got = encode(IMPLS[name], level, x, group)
        assert_same_encoding(level, x, group, want, got, name)
        got_out = decode(IMPLS[name], level, want, x.shape, group)
        assert np.array_equal(bits(want_out), bits(got_out)), f"{name}: {level} decoded values differ"


# ---------------------------------------------------------------------------------------------------------
# the fast paths of the codec's shapes (rows of 64 or 128 values in groups of 32), adversarially


def _every_f16_in_groups(absmax: float, d: int) -> np.ndarray:
    """Every finite float16 bit pattern (both signs, +-0 and subnormals), 31 per group of 32, the group's
    32nd value fixing its absmax (so the scale), as rows of d values."""
    vals = np.arange(0x10000, dtype=np.uint32)
    vals = vals[(vals & 0x7C00) != 0x7C00].astype(np.uint16).view(np.float16)
    vals = vals[np.abs(vals.astype(np.float32)) <= absmax]
    groups = -(-vals.size // 31)
    body = np.zeros(groups * 31, np.float16)
    body[: vals.size] = vals
    x = np.concatenate([body.reshape(groups, 31), np.full((groups, 1), absmax, np.float16)], axis=1)
    rows = -(-x.size // d)
    flat = np.zeros(rows * d, np.float16)
    flat[: x.size] = x.ravel()
    return flat.reshape(rows, d)


@pytest.mark.parametrize("fmt", (0, 1))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("absmax", (1.0, 448.0, 65504.0, 2.0**-14, 6e-8))
def test_fp8_rows_of_32_every_float16_value(fmt, d, absmax):
    """The fp8 rows fast path rounds by an fma trick (kvd_avx512_util.h): every finite float16 value, at
    scales from subnormal to the largest, gives the reference's code."""
    x = _every_f16_in_groups(absmax, d)
    want = encode(ref, "fp8_e4m3" if fmt == 0 else "fp8_e5m2", x, 32)
    for name in COMPILED:
        got = encode(IMPLS[name], "fp8_e4m3" if fmt == 0 else "fp8_e5m2", x, 32)
        assert_same_encoding("fp8", x, 32, want, got, name)


@pytest.mark.parametrize("level", ("fp8_e4m3", "fp8_e5m2", "q8_rows", "q4_rot"))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("n", (1, 3, 4, 5, 7, 8, 9, 17, 33))
@pytest.mark.parametrize("how", ("contiguous", "every_other_row", "padded"))
def test_rows_of_32_batches_and_tails(level, d, n, how):
    """Row counts that are not a multiple of a batch (16 groups: 4 rows of 128, 8 of 64), row strides, and
    a mix of +-0, subnormals, huge and constant rows, encoded and decoded like the reference."""
    rng = np.random.default_rng(n * 1000 + d)
    x = make_x(rng, "mixed", n, d)
    x[0, :32] = np.float16(-0.0)  # a group of -0 only
    x[n // 2, 32:64] = np.float16(65504.0)  # a constant group at the top of the range
    x[-1, :16] = np.uint16(1).view(np.float16)  # the smallest subnormal
    x = layout(x, how)
    want = encode(ref, level, x, 32)
    want_out = decode(ref, level, want, x.shape, 32)
    for name in COMPILED:
        got = encode(IMPLS[name], level, x, 32)
        assert_same_encoding(level, x, 32, want, got, name)
        got_out = decode(IMPLS[name], level, want, x.shape, 32)
        assert np.array_equal(bits(want_out), bits(got_out)), f"{name}: {level} decoded values differ"


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("n", (1, 4, 6, 8, 11))
@pytest.mark.parametrize("pos", ("first", "middle", "last"))
@pytest.mark.parametrize("bad", (np.nan, np.inf, -np.inf))
def test_rows_of_32_non_finite_is_refused(d, n, pos, bad):
    """NaN/Inf anywhere in a batch (also in the rows after the last whole batch) is refused by every level."""
    x = make_x(np.random.default_rng(3), "normal", n, d)
    r = {"first": 0, "middle": n // 2, "last": n - 1}[pos]
    x[r, (7 * r + 5) % d] = bad
    for name in COMPILED:
        for level in ("fp8_e4m3", "fp8_e5m2", "q8_rows", "q4_rot"):
            with pytest.raises(NonFiniteError):
                encode(IMPLS[name], level, x, 32)


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("n", (1, 3, 4, 5, 8, 9, 13))
@pytest.mark.parametrize("scale", ("small", "large", "mixed"))
def test_q4_rot_decode_tables_and_clamp(d, n, scale):
    """The q4 rotated decoder (a 16-entry table per group; the clamp to +-65504 skipped for batches whose
    parameters cannot reach it) on any codes, with parameters on both sides of that bound and negative ones."""
    rng = np.random.default_rng(d + 17 * n)
    packed = rng.integers(0, 256, (n, d // 2), dtype=np.uint8)
    sc = {"small": 1.0, "large": 4000.0, "mixed": 1.0}[scale]
    scales = (rng.random((n, d // 32)) * sc).astype(np.float16)
    mins = (rng.standard_normal((n, d // 32)) * sc).astype(np.float16)
    if scale == "mixed":  # one group of the batch past the bound, one negative scale, +-0 parameters
        scales[n // 2, 0] = 600.0
        scales[0, -1] = -3.0
        mins[-1, 0] = np.float16(-0.0)
        scales[-1, -1] = np.float16(0.0)
    enc = {"packed": packed, "scales": scales, "mins": mins}
    want = decode(ref, "q4_rot", enc, (n, d), 32)
    for name in COMPILED:
        got = decode(IMPLS[name], "q4_rot", enc, (n, d), 32)
        assert np.array_equal(bits(want), bits(got)), f"{name}: q4_rot decoded values differ"


# ---------------------------------------------------------------------------------------------------------
# the AVX2 fast paths: rows in batches of 8 groups (q8 / fp8 with groups of 32 or 64, q4 rotated with groups
# of 16 to 128), columns in blocks of 128 (q8) or 64 (q4) with narrower tails


_ROW_SHAPES = ((64, 64), (128, 64), (128, 128), (64, 16), (128, 16), (96, 32), (64, 8))


@pytest.mark.parametrize(
    ("level", "d", "group"),
    [  # the rotation needs a power-of-two row
        (level, d, group)
        for level in ("q8_rows", "fp8_e4m3", "fp8_e5m2", "q4_rot")
        for d, group in _ROW_SHAPES
        if level != "q4_rot" or d & (d - 1) == 0
    ],
)
@pytest.mark.parametrize("n", (1, 2, 3, 5, 9, 17))
@pytest.mark.parametrize("how", ("contiguous", "every_other_row"))
def test_rows_batches_of_8_groups(level, d, group, n, how):
    """Group counts that are not a multiple of a batch of 8, with -0 only, constant, subnormal and huge groups."""
    rng = np.random.default_rng(n * 7919 + d * 31 + group)
    x = make_x(rng, "mixed", n, d)
    x[0, :group] = np.float16(-0.0)
    x[n // 2, -group:] = np.float16(65504.0)
    x[-1, : min(group, 8)] = np.uint16(1).view(np.float16)
    x = layout(x, how)
    assert_backends_match_reference(level, x, group)


@pytest.mark.parametrize("level", ("q8_rows", "fp8_e4m3", "q4_rot"))
@pytest.mark.parametrize("group", (16, 64))
@pytest.mark.parametrize("row", (0, 3, 4, 6))
@pytest.mark.parametrize("bad", (np.nan, -np.inf))
def test_rows_batches_of_8_groups_non_finite(level, group, row, bad):
    """NaN/Inf in any row of a batch of 8 groups, and in the rows after the last whole batch, is refused."""
    x = make_x(np.random.default_rng(row), "normal", 7, 128)
    x[row, (37 * row + 11) % 128] = bad
    for name in COMPILED:
        with pytest.raises(NonFiniteError):
            encode(IMPLS[name], level, x, group)


@pytest.mark.parametrize("level", ("q8_cols", "q4_cols"))
@pytest.mark.parametrize("c", (64, 128, 130, 192, 256 + 16 + 3, 1024))
@pytest.mark.parametrize(("t", "group"), ((64, 64), (64, 32), (45, 32), (3, 64)))
@pytest.mark.parametrize("how", ("contiguous", "padded"))
def test_cols_blocks_and_tails(level, c, t, group, how):
    """Column blocks of 128 / 64 followed by tails of 16 and single columns, with +-0, constant and
    subnormal columns, and a row stride."""
    rng = np.random.default_rng(c * 131 + t + group)
    x = make_x(rng, "mixed", t, c)
    x[:, 1] = np.float16(-0.0)
    x[:, c // 2] = np.float16(-3.5)
    x[:, -1] = np.uint16(0x8001).view(np.float16)
    x = layout(x, how)
    assert_backends_match_reference(level, x, group)


@pytest.mark.parametrize("level", ("q8_cols", "q4_cols"))
@pytest.mark.parametrize("col", (0, 77, 127, 128, 200))
@pytest.mark.parametrize("bad", (np.nan, np.inf, -np.inf))
def test_cols_blocks_non_finite(level, col, bad):
    """NaN/Inf in any column of a block (or of the tail) and any token of the group is refused."""
    x = make_x(np.random.default_rng(col), "normal", 40, 208)
    x[(col * 13) % 40, col] = bad
    for name in COMPILED:
        with pytest.raises(NonFiniteError):
            encode(IMPLS[name], level, x, 32)


HINTS = {
    "a key page": lambda: np.ones((64, 1024), np.float16),
    "one byte": lambda: np.ones(1, np.uint8),
    "empty": lambda: np.empty(0, np.float16),
    "larger than the rows": lambda: np.ones(4 << 20, np.uint8),
}


@pytest.mark.parametrize("rotate", (True, False))
@pytest.mark.parametrize("n", (1, 5, 512))
@pytest.mark.parametrize("hint", tuple(HINTS))
def test_q4_rows_prefetch_hint_changes_no_byte(rotate, n, hint):
    """The page codec hands a page's keys to its value rows as a prefetch hint: whatever its size, the codes,
    scales and mins are those of the call without it, on every backend."""
    x = make_x(np.random.default_rng(n), "mixed", n, 128)
    level = "q4_rot" if rotate else "q4_rows"
    for name, impl in IMPLS.items():
        want = encode(impl, level, x, 32)
        got = {k: np.empty_like(v) for k, v in want.items()}
        impl.q4_encode_rows(x, got["packed"], got["scales"], got["mins"], 32, rotate, prefetch=HINTS[hint]())
        assert_same_encoding(level, x, 32, want, got, f"{name} with a hint of {hint}")


def test_q4_rows_prefetch_hint_is_checked_and_nan_still_refused():
    x = make_x(np.random.default_rng(3), "normal", 16, 128)
    packed = np.empty((16, 64), np.uint8)
    scales, mins = np.empty((16, 4), np.float16), np.empty((16, 4), np.float16)
    keys = np.ones((64, 1024), np.float16)
    for impl in IMPLS.values():
        for bad in (keys[:, ::2], b"bytes", [1, 2]):
            with pytest.raises(TypeError, match="prefetch must be a C-contiguous numpy array"):
                impl.q4_encode_rows(x, packed, scales, mins, 32, True, prefetch=bad)
        y = x.copy()
        y[9, 100] = np.nan
        with pytest.raises(NonFiniteError):
            impl.q4_encode_rows(y, packed, scales, mins, 32, True, prefetch=keys)
