"""Shared pieces of the kernel tests: the backends, running a level on one, comparing bit patterns, inputs."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvd.codec import kernels

BACKENDS = kernels.available()
IMPLS = {name: kernels.load(name) for name in BACKENDS}
COMPILED = [name for name in BACKENDS if name != "reference"]
LEVELS = ("q8_rows", "q8_cols", "fp8_e4m3", "fp8_e5m2", "q4_rows", "q4_rot", "q4_cols")
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def ng(n: int, group: int) -> int:
    return -(-n // group)


# ---------------------------------------------------------------------------------------------------------
# running one level on one backend


def encode(impl, level: str, x: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """Encoded outputs (filled with garbage first, so an unwritten element shows)."""
    n, d = x.shape

    def out(shape, dtype):
        return garbage(shape, dtype)

    if level in ("q8_rows", "fp8_e4m3", "fp8_e5m2"):
        codes = out((n, d), np.int8 if level == "q8_rows" else np.uint8)
        scales = out((n, ng(d, group)), np.float16)
        if level == "q8_rows":
            impl.q8_encode_rows(x, codes, scales, group)
        else:
            impl.fp8_encode_rows(x, codes, scales, group, 0 if level == "fp8_e4m3" else 1)
        return {"codes": codes, "scales": scales}
    if level == "q8_cols":
        codes, scales = out((n, d), np.int8), out((ng(n, group), d), np.float16)
        impl.q8_encode_cols(x, codes, scales, group)
        return {"codes": codes, "scales": scales}
    if level in ("q4_rows", "q4_rot"):
        packed = out((n, (d + 1) // 2), np.uint8)
        scales, mins = out((n, ng(d, group)), np.float16), out((n, ng(d, group)), np.float16)
        impl.q4_encode_rows(x, packed, scales, mins, group, level == "q4_rot")
        return {"packed": packed, "scales": scales, "mins": mins}
    assert level == "q4_cols"
    packed = out((n, (d + 1) // 2), np.uint8)
    scales, mins = out((ng(n, group), d), np.float16), out((ng(n, group), d), np.float16)
    impl.q4_encode_cols(x, packed, scales, mins, group)
    return {"packed": packed, "scales": scales, "mins": mins}


def garbage(shape, dtype) -> np.ndarray:
    a = np.empty(shape, dtype)
    a.view(np.uint8)[...] = 0xA5
    return a


def decode(impl, level: str, enc: dict[str, np.ndarray], shape: tuple[int, int], group: int) -> np.ndarray:
    out = garbage(shape, np.float16)
    if level == "q8_rows":
        impl.q8_decode_rows(enc["codes"], enc["scales"], out, group)
    elif level == "q8_cols":
        impl.q8_decode_cols(enc["codes"], enc["scales"], out, group)
    elif level in ("fp8_e4m3", "fp8_e5m2"):
        impl.fp8_decode_rows(enc["codes"], enc["scales"], out, group, 0 if level == "fp8_e4m3" else 1)
    elif level in ("q4_rows", "q4_rot"):
        impl.q4_decode_rows(enc["packed"], enc["scales"], enc["mins"], out, group, level == "q4_rot")
    else:
        impl.q4_decode_cols(enc["packed"], enc["scales"], enc["mins"], out, group)
    return out


def assert_same_encoding(level: str, x: np.ndarray, group: int, want: dict, got: dict, who: str) -> None:
    for key in want:
        assert np.array_equal(bits(want[key]), bits(got[key])), f"{who}: {level} {key} differ"


# ---------------------------------------------------------------------------------------------------------
# inputs


KINDS = ("normal", "bits", "zeros", "constant", "extreme", "denormal", "tiny", "outlier", "mixed")


def make_x(rng: np.random.Generator, kind: str, n: int, d: int) -> np.ndarray:
    if kind == "normal":
        x = rng.standard_normal((n, d)) * 10.0 ** rng.integers(-3, 4)
    elif kind == "bits":  # any finite float16, subnormals and +-0 included
        b = rng.integers(0, 0x7C00, (n, d), dtype=np.uint16) | (rng.integers(0, 2, (n, d), dtype=np.uint16) << 15)
        return b.view(np.float16)
    elif kind == "zeros":  # +0.0 and -0.0
        return np.where(rng.random((n, d)) < 0.5, np.float16(0.0), np.float16(-0.0)).astype(np.float16)
    elif kind == "constant":
        x = np.repeat(rng.standard_normal((n, 1)) * 100, d, axis=1)
    elif kind == "extreme":
        x = rng.choice([65504.0, -65504.0, 0.0, 1.0, -60000.0], (n, d))
    elif kind == "denormal":
        b = rng.integers(0, 0x0400, (n, d), dtype=np.uint16) | (rng.integers(0, 2, (n, d), dtype=np.uint16) << 15)
        return b.view(np.float16)
    elif kind == "tiny":
        x = rng.standard_normal((n, d)) * 1e-6
    elif kind == "outlier":
        x = rng.standard_normal((n, d))
        x[rng.integers(0, n), rng.integers(0, d)] = rng.choice([1000.0, -30000.0, 65504.0])
    else:  # mixed: zeros, signs and magnitudes next to each other
        x = rng.standard_normal((n, d)) * rng.choice([0.0, 1e-7, 1.0, 300.0], (n, d))
        x = np.where(rng.random((n, d)) < 0.1, -0.0, x)
    return np.clip(x, -65504, 65504).astype(np.float16)


def layout(x: np.ndarray, how: str) -> np.ndarray:
    """The same values, stored with a row stride (a view into a bigger array)."""
    n, d = x.shape
    if how == "padded":
        big = np.full((n, d + 7), np.float16(np.nan))
        big[:, 3 : 3 + d] = x
        return big[:, 3 : 3 + d]
    if how == "every_other_row":
        big = np.full((2 * n, d), np.float16(np.inf))
        big[::2] = x
        return big[::2]
    if how == "reversed":
        return np.ascontiguousarray(x[::-1])[::-1]
    if how == "read_only":
        y = x.copy()
        y.flags.writeable = False
        return y
    return np.ascontiguousarray(x)


GROUPS = st.one_of(st.sampled_from([1, 3, 16, 32, 64, 128, 65535]), st.integers(1, 200))
LAYOUTS = st.sampled_from(["contiguous", "padded", "every_other_row", "reversed", "read_only"])


@st.composite
def cases(draw, level: str):
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.one_of(st.sampled_from([1, 2, 4, 16, 64]), st.integers(1, 70)))
    if level == "q4_rot":
        d = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]))
    else:
        d = draw(st.one_of(st.sampled_from([1, 31, 32, 33, 64, 96, 128, 130]), st.integers(1, 160)))
    group = draw(GROUPS)
    how = draw(LAYOUTS)
    x = make_x(np.random.default_rng(seed), kind, n, d)
    return layout(x, how), group
