"""The page codec (kvd.pages): sizes, schemes, headers, damage, inputs, and the golden v1 bytes."""

from __future__ import annotations

import os
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd import kernels, pages
from kvd.codec import reference as ref
from kvd.errors import CorruptPage, InvalidArgument, KvdError, NonFiniteError, UnsupportedVersion

GOLDEN = Path(__file__).parent / "data" / "pages_v1"
QUANTIZED = [lv for lv in pages.LEVELS if lv != "fp16"]


def kv(t: int, h: int, d: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h, d)) * scale
    x[:, :, rng.integers(0, d)] *= 8  # an outlier channel, as real keys have
    return x.astype(np.float16)


def reference_roundtrip(x: np.ndarray, level: str, role: str) -> np.ndarray:
    """What the documented scheme (axis, group, rotation) gives, straight from the reference kernels."""
    t, h, d = x.shape
    axis, rotated = pages.scheme(level, role, d)
    g = pages.GROUPS[level]
    if level == "fp16":
        return x.copy()
    m = x.reshape(t * h, d) if axis == pages.AXIS_TOKEN else x.reshape(t, h * d)
    n, w = m.shape
    out = np.empty_like(m)
    meta = (n, -(-w // g)) if axis == pages.AXIS_TOKEN else (-(-n // g), w)
    s, mn = np.empty(meta, np.float16), np.empty(meta, np.float16)
    if level == "q8":
        c = np.empty(m.shape, np.int8)
        enc, dec = (
            (ref.q8_encode_rows, ref.q8_decode_rows)
            if axis == pages.AXIS_TOKEN
            else (ref.q8_encode_cols, ref.q8_decode_cols)
        )
        enc(m, c, s, g)
        dec(c, s, out, g)
    elif level.startswith("fp8"):
        fmt = 0 if level == "fp8_e4m3" else 1
        c = np.empty(m.shape, np.uint8)
        ref.fp8_encode_rows(m, c, s, g, fmt)
        ref.fp8_decode_rows(c, s, out, g, fmt)
    else:
        p = np.empty((n, (w + 1) // 2), np.uint8)
        if axis == pages.AXIS_TOKEN:
            ref.q4_encode_rows(m, p, s, mn, g, rotated)
            ref.q4_decode_rows(p, s, mn, out, g, rotated)
        else:
            ref.q4_encode_cols(m, p, s, mn, g)
            ref.q4_decode_cols(p, s, mn, out, g)
    return out.reshape(x.shape)


# ------------------------------------------------------------------------------------------ schemes and sizes


@pytest.mark.parametrize("level", pages.LEVELS)
@pytest.mark.parametrize("role", pages.ROLES)
def test_page_decodes_to_the_documented_scheme(level: str, role: str) -> None:
    x = kv(64, 3, 64, seed=1)
    got = pages.decode(pages.encode(x, level, role=role))
    assert got.dtype == np.float16 and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint16), reference_roundtrip(x, level, role).view(np.uint16))


def test_schemes_are_the_measured_ones() -> None:
    assert pages.scheme("q8", "key", 128) == (pages.AXIS_CHANNEL, False)
    assert pages.scheme("q8", "value", 128) == (pages.AXIS_TOKEN, False)
    assert pages.scheme("q4", "key", 128) == (pages.AXIS_CHANNEL, False)
    assert pages.scheme("q4", "value", 128) == (pages.AXIS_TOKEN, True)
    assert pages.scheme("q4", "value", 96) == (pages.AXIS_TOKEN, False)  # rotation needs a power of two
    assert pages.scheme("fp8_e4m3", "key", 128) == (pages.AXIS_TOKEN, False)
    assert pages.scheme("fp16", "value", 128) == (pages.AXIS_NONE, False)


@pytest.mark.parametrize(
    ("level", "max_bits"), [("fp16", 16.0), ("q8", 8.25), ("fp8_e4m3", 8.5), ("fp8_e5m2", 8.5), ("q4", 5.0)]
)
@pytest.mark.parametrize("role", pages.ROLES)
def test_bits_per_value_of_a_7b_page(level: str, max_bits: float, role: str) -> None:
    t, h, d = 64, 8, 128
    header_bits = 8 * pages.HEADER_BYTES / (t * h * d)
    assert 8 * pages.nbytes(level, t, h, d, role=role) / (t * h * d) <= max_bits + header_bits + 1e-9


@settings(max_examples=150, deadline=None)
@given(
    t=st.integers(1, 70),
    h=st.integers(1, 5),
    d=st.integers(1, 70),
    level=st.sampled_from(pages.LEVELS),
    role=st.sampled_from(pages.ROLES),
    data=st.data(),
)
def test_nbytes_is_exact_and_roundtrip_holds(t: int, h: int, d: int, level: str, role: str, data) -> None:
    raw_heads = data.draw(st.lists(st.integers(0, h - 1), unique=True, max_size=h))
    x = kv(t, h, d, seed=t * 1000 + h * 10 + d)
    buf = pages.encode(x, level, role=role, raw_heads=raw_heads)
    assert len(buf) == pages.nbytes(level, t, h, d, role=role, raw_heads=raw_heads)
    hd = pages.header(buf)
    assert (hd.level, hd.shape) == (level, (t, h, d))
    assert hd.raw_heads == (tuple(sorted(raw_heads)) if level != "fp16" else ())
    y = pages.decode(buf)
    if raw_heads:
        np.testing.assert_array_equal(y[:, raw_heads].view(np.uint16), x[:, raw_heads].view(np.uint16))
    keep = [i for i in range(h) if i not in raw_heads]
    if keep and level != "fp16":
        expect = reference_roundtrip(np.ascontiguousarray(x[:, keep]), level, role)
        np.testing.assert_array_equal(y[:, keep].view(np.uint16), expect.view(np.uint16))
    if level == "fp16":
        np.testing.assert_array_equal(y.view(np.uint16), x.view(np.uint16))


@pytest.mark.parametrize(("level", "tol"), [("q8", 0.02), ("fp8_e4m3", 0.04), ("fp8_e5m2", 0.08), ("q4", 0.12)])
def test_roundtrip_error_is_small(level: str, tol: float) -> None:
    x = kv(64, 8, 128, seed=3)
    for role in pages.ROLES:
        y = pages.decode(pages.encode(x, level, role=role)).astype(np.float64)
        assert np.linalg.norm(y - x) / np.linalg.norm(x.astype(np.float64)) < tol


@pytest.mark.parametrize("level", pages.LEVELS)
def test_adversarial_content(level: str) -> None:
    cases = {
        "zeros": np.zeros((8, 2, 64), np.float16),
        "negative zero": np.full((8, 2, 64), -0.0, np.float16),
        "constant": np.full((8, 2, 64), 3.5, np.float16),
        "extremes": np.tile(np.array([65504, -65504], np.float16), (8, 2, 32)),
        "denormals": np.full((8, 2, 64), 6e-8, np.float16),
        "one outlier": np.pad(np.array([[[60000.0]]], np.float16), ((0, 7), (0, 1), (0, 63))),
    }
    for name, x in cases.items():
        for role in pages.ROLES:
            y = pages.decode(pages.encode(x, level, role=role))
            assert np.isfinite(y).all(), name
            # zeros are exact everywhere; a constant is exact where a zero point can hold it (q4: scale 0)
            if name in ("zeros", "negative zero") or (name == "constant" and level in ("fp16", "q4")):
                np.testing.assert_array_equal(y.astype(np.float32), x.astype(np.float32), err_msg=name)
            scale = float(np.abs(x.astype(np.float32)).max()) or 1.0
            assert np.abs(y.astype(np.float64) - x).max() <= 0.15 * scale, (name, role)


# ------------------------------------------------------------------------------------------ inputs


def test_float32_and_bfloat16_inputs_are_converted() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = kv(16, 2, 32, seed=4)
    want = pages.encode(x, "q8", role="key")
    assert pages.encode(x.astype(np.float32), "q8", role="key") == want
    xb = x.astype(np.float32).astype(ml_dtypes.bfloat16)
    got = pages.decode(pages.encode(xb, "fp16", role="key"))
    np.testing.assert_array_equal(got, xb.astype(np.float32).astype(np.float16))


def test_float32_beyond_float16_range_is_refused() -> None:
    x = np.ones((4, 1, 8), np.float32)
    x[2, 0, 5] = 1e6
    with pytest.raises(NonFiniteError, match=r"\[2, 0, 5\].*1000000"):
        pages.encode(x, "q8", role="value")


@pytest.mark.parametrize("level", pages.LEVELS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused_at_every_level(level: str, bad: float) -> None:
    x = kv(8, 2, 16)
    x[5, 1, 7] = bad
    with pytest.raises(NonFiniteError):
        pages.encode(x, level, role="key")


def test_bad_arguments_name_the_value() -> None:
    x = kv(4, 2, 8)
    with pytest.raises(InvalidArgument, match="'q3'"):
        pages.encode(x, "q3", role="key")
    with pytest.raises(InvalidArgument, match="'query'"):
        pages.encode(x, "q8", role="query")
    with pytest.raises(InvalidArgument, match=r"\(4, 16\)"):
        pages.encode(x.reshape(4, 16), "q8", role="key")
    with pytest.raises(InvalidArgument, match="int32"):
        pages.encode(x.astype(np.int32), "q8", role="key")
    with pytest.raises(InvalidArgument, match="raw_heads"):
        pages.encode(x, "q8", role="key", raw_heads=[2])
    with pytest.raises(InvalidArgument, match="T must"):
        pages.encode(np.zeros((0, 2, 8), np.float16), "q8", role="key")
    with pytest.raises(InvalidArgument, match="needs"):
        pages.encode_into(x, "q8", bytearray(10), role="key")
    with pytest.raises(InvalidArgument, match="writable"):
        pages.encode_into(x, "q8", bytes(pages.nbytes("q8", 4, 2, 8, role="key")), role="key")


def test_non_contiguous_input_gives_the_same_page() -> None:
    big = kv(64, 4, 64, seed=5)
    view = big[::2, 1:3, :]  # strided tokens and heads
    assert not view.flags.c_contiguous
    for level in pages.LEVELS:
        assert pages.encode(view, level, role="value") == pages.encode(
            np.ascontiguousarray(view), level, role="value"
        )
    transposed = np.ascontiguousarray(big.transpose(2, 1, 0)).transpose(2, 1, 0)
    assert pages.encode(transposed, "q4", role="key") == pages.encode(big, "q4", role="key")


# ------------------------------------------------------------------------------------------ decode_into


def test_decode_into_writes_the_callers_buffer_without_allocating() -> None:
    x = kv(64, 8, 128, seed=6)
    for level in pages.LEVELS:
        buf = pages.encode(x, level, role="value")
        out = np.empty_like(x)
        pages.decode_into(buf, out)  # warm caches and lazy imports
        tracemalloc.start()
        pages.decode_into(buf, out)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        if kernels.BACKEND != "reference":  # the numpy reference makes temporaries; compiled kernels must not
            assert peak < 16 << 10, (level, peak)
        np.testing.assert_array_equal(out, pages.decode(buf))


def test_decode_into_refuses_a_wrong_buffer() -> None:
    buf = pages.encode(kv(8, 2, 16), "q8", role="key")
    with pytest.raises(InvalidArgument, match=r"\(8, 2, 16\)"):
        pages.decode_into(buf, np.empty((8, 2, 15), np.float16))
    with pytest.raises(InvalidArgument):
        pages.decode_into(buf, np.empty((8, 2, 16), np.float32))
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        pages.decode_into(buf, np.empty((8, 2, 32), np.float16)[:, :, ::2])


# ------------------------------------------------------------------------------------------ damage


@pytest.mark.parametrize("level", pages.LEVELS)
def test_every_header_bit_flip_is_refused(level: str) -> None:
    buf = pages.encode(kv(8, 3, 16), level, role="value", raw_heads=[1])
    prefix = pages.HEADER_BYTES + 8
    for byte in range(prefix):
        for bit in range(8):
            bad = bytearray(buf)
            bad[byte] ^= 1 << bit
            with pytest.raises((CorruptPage, UnsupportedVersion)):
                pages.decode(bytes(bad))


@settings(max_examples=200, deadline=None)
@given(level=st.sampled_from(pages.LEVELS), pos=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_payload_bit_flips_are_refused(level: str, pos: float, bit: int) -> None:
    buf = bytearray(pages.encode(kv(16, 2, 32, seed=7), level, role="key"))
    buf[pages.HEADER_BYTES + int(pos * (len(buf) - pages.HEADER_BYTES))] ^= 1 << bit
    with pytest.raises(CorruptPage, match="checksum"):
        pages.decode(bytes(buf))


def test_truncated_extended_and_foreign_buffers_are_refused() -> None:
    buf = pages.encode(kv(8, 2, 16), "q4", role="key")
    for bad in (buf[:-1], buf + b"\0", buf[:10], b"", b"JUNK" + buf[4:]):
        with pytest.raises(CorruptPage):
            pages.decode(bad)
    future = bytearray(buf)
    future[4] = pages.HELD_VERSION + 1
    with pytest.raises(UnsupportedVersion, match=str(pages.HELD_VERSION + 1)):
        pages.decode(bytes(future))


def test_a_consistent_but_lying_header_is_refused_even_with_a_fixed_checksum() -> None:
    # A writer bug that changes the shape and recomputes the checksum must still not decode as garbage.
    buf = bytearray(pages.encode(kv(8, 2, 16), "q8", role="key"))
    struct.pack_into("<H", buf, 16, 3)  # H: 2 -> 3 heads, payload length no longer matches
    with pytest.raises(CorruptPage, match="payload length"):
        pages.header(bytes(buf))


# ------------------------------------------------------------------------------------------ assemble


def test_assemble_rebuilds_a_range_across_pages() -> None:
    t, h, d = 150, 2, 16
    ks = [kv(t, h, d, seed=10 + i) for i in range(3)]
    vs = [kv(t, h, d, seed=20 + i) for i in range(3)]
    entries = []
    for layer in range(3):
        for t0 in range(0, t, 64):
            entries.append(
                (
                    layer,
                    t0,
                    pages.encode(ks[layer][t0 : t0 + 64], "fp16", role="key"),
                    pages.encode(vs[layer][t0 : t0 + 64], "fp16", role="value"),
                )
            )
    keys, values = pages.assemble(entries, 30, 140, layers=[2, 0])
    np.testing.assert_array_equal(keys, np.stack([ks[2][30:140], ks[0][30:140]]))
    np.testing.assert_array_equal(values, np.stack([vs[2][30:140], vs[0][30:140]]))
    with pytest.raises(InvalidArgument, match="cover token 128 of layer 1"):
        pages.assemble([e for e in entries if not (e[0] == 1 and e[1] == 128)], 0, 150)


@pytest.mark.parametrize("parallel", [False, True])
def test_assemble_into_decodes_into_the_callers_buffers(parallel: bool) -> None:
    t, h, d = 200, 4, 64
    ks = [kv(t, h, d, seed=30 + i) for i in range(4)]
    entries = [
        (
            layer,
            t0,
            pages.encode(ks[layer][t0 : t0 + 64], "q4", role="key"),
            pages.encode(ks[layer][t0 : t0 + 64], "q8", role="value"),
        )
        for layer in range(4)
        for t0 in range(0, t, 64)
    ]
    want_k, want_v = pages.assemble(entries, 10, 190)
    out_k, out_v = np.empty_like(want_k), np.empty_like(want_v)
    pages.assemble_into(entries, 10, 190, out_k, out_v, parallel=parallel)
    np.testing.assert_array_equal(out_k.view(np.uint16), want_k.view(np.uint16))
    np.testing.assert_array_equal(out_v.view(np.uint16), want_v.view(np.uint16))
    with pytest.raises(InvalidArgument, match="keys_out"):
        pages.assemble_into(entries, 10, 190, out_k[:, :-1], out_v)
    with pytest.raises(InvalidArgument, match="values_out"):
        pages.assemble_into(entries, 10, 190, out_k, out_v.astype(np.float32))


def test_assemble_into_reports_a_damaged_page_from_either_thread() -> None:
    x = kv(64, 8, 128, seed=8)
    entries = [
        (layer, 0, pages.encode(x, "q8", role="key"), pages.encode(x, "q8", role="value")) for layer in range(8)
    ]
    bad = bytearray(entries[-1][3])
    bad[-5] ^= 0x10
    entries[-1] = (7, 0, entries[-1][2], bytes(bad))
    out = np.empty((8, 64, 8, 128), np.float16)
    with pytest.raises(CorruptPage, match="checksum"):
        pages.assemble_into(entries, 0, 64, out, out.copy(), parallel=True)


# ------------------------------------------------------------------------------------------ golden bytes


def golden_input() -> np.ndarray:
    return kv(64, 2, 64, seed=42)


@pytest.mark.parametrize("level", pages.LEVELS)
@pytest.mark.parametrize("role", pages.ROLES)
def test_golden_v1_pages(level: str, role: str) -> None:
    """Format v1 cannot change by accident: today's encoder writes the committed bytes, and they decode."""
    path = GOLDEN / f"{level}_{role}.page"
    buf = pages.encode(golden_input(), level, role=role, raw_heads=[1] if level == "q4" else [])
    if os.environ.get("KVD_REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf)
    stored = path.read_bytes()
    assert buf == stored, f"{path.name}: the v1 page format changed; bump FORMAT_VERSION instead"
    assert pages.header(stored).level == level
    np.testing.assert_array_equal(pages.decode(stored), pages.decode(buf))


def test_every_kvd_error_on_decode_is_a_kvd_error() -> None:
    rng = np.random.default_rng(0)
    good = pages.encode(kv(8, 2, 16), "q4", role="value")
    for _ in range(2000):
        bad = bytearray(good)
        for _ in range(rng.integers(1, 4)):
            bad[rng.integers(0, len(bad))] = rng.integers(0, 256)
        cut = rng.integers(0, len(bad) + 1)
        try:
            pages.decode(bytes(bad[:cut]))
        except KvdError:
            pass
