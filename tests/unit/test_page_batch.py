"""The batched C page codec (kvd.codec.batch, cython_ext/_pagecodec.pxi): the same bytes as kvd.pages, every
compiled kernel set, and what it leaves to kvd.pages (non-finite input, damaged pages, arrays it cannot take)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd import kernels, pages
from kvd.codec import batch as page_batch
from kvd.errors import CorruptPage, KvdError, NonFiniteError, UnknownSequence
from kvd.store import Store
from kvd.store import pool as sp

ext = pytest.importorskip("kvd.codec._kernels", reason="the compiled extension is what this module tests")
COMPILED = [b for b in kernels.available() if b != "reference"]
TRAILER = bytes(range(sp.TRAILER_BYTES))  # any 32 bytes: the codec copies them verbatim
SHAPES = [(64, 3, 64), (64, 8, 128), (5, 1, 7), (33, 2, 96), (1, 4, 16)]


@pytest.fixture(autouse=True, scope="module")
def _hash() -> None:
    assert page_batch.HASH_OK, "the xxhash module's XXH3_64bits_withSeed must be usable from C"


def rand(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * rng.uniform(0.1, 8, shape[-1])).astype(np.float16)


def specs(level: str, t: int, h: int, d: int) -> tuple[object, object]:
    return (
        ext.PageSpec(*pages.flat_layout(level, "key", t, h, d)),
        ext.PageSpec(*pages.flat_layout(level, "value", t, h, d)),
    )


def expected_record(k: np.ndarray, v: np.ndarray, level: str) -> bytes:
    return pages.encode(k, level, role="key") + pages.encode(v, level, role="value") + TRAILER


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("level", pages.LEVELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_row_writes_the_bytes_of_pages_encode(backend: str, level: str, shape: tuple[int, ...]) -> None:
    t, h, d = shape
    layers = 3
    src_k, src_v = rand((layers, t + 7, h, d), 1), rand((layers, t + 7, h, d), 2)
    ks, vs = specs(level, t, h, d)
    recs = [bytearray(ks.size + vs.size + len(TRAILER)) for _ in range(layers)]
    assert ext.encode_row(kernels.load(backend), ((ks, vs, TRAILER),) * layers, recs, src_k, src_v, 5) == -1
    for i in range(layers):
        assert bytes(recs[i]) == expected_record(src_k[i, 5 : 5 + t], src_v[i, 5 : 5 + t], level)


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("level", pages.LEVELS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stream", [False, True])
def test_decode_run_matches_pages_decode(backend: str, level: str, shape: tuple[int, int, int], stream) -> None:
    t, h, d = shape
    rows = 4
    k, v = rand((rows, t, h, d), 3), rand((rows, t, h, d), 4)
    code = sp.FMT_CODE[level]
    trailer = bytearray(sp.TRAILER_BYTES)
    trailer[-sp.CUR_FMT_FROM_END] = code
    recs = [bytearray(expected_record(k[r], v[r], level)[: -sp.TRAILER_BYTES] + trailer) for r in range(rows)]
    by_code = tuple(specs(level, t, h, d) if c == code else None for c in range(len(pages.LEVELS)))
    kout = np.full((rows * t + 3, h, d), np.float16(7))
    vout = np.full((rows * t + 3, h, d), np.float16(7))
    be = kernels.load(backend)
    assert ext.decode_run(be, recs, 1, rows, by_code, sp.CUR_FMT_FROM_END, kout, vout, stream) == -1
    for r in range(1, rows):
        lo = (r - 1) * t
        for out, x, role in ((kout, k, "key"), (vout, v, "value")):
            want = pages.decode(pages.encode(x[r], level, role=role))
            np.testing.assert_array_equal(out[lo : lo + t].view(np.uint16), want.view(np.uint16))
    assert (kout[(rows - 1) * t :] == 7).all() and (vout[(rows - 1) * t :] == 7).all()  # nothing past the run


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("level", ["fp16", "q8", "fp8_e5m2", "q4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("role", ["key", "value"])
def test_encode_row_stops_at_the_layer_with_a_non_finite_value(backend, level, bad, role) -> None:
    t, h, d = 64, 3, 64
    src_k, src_v = rand((4, t, h, d), 5), rand((4, t, h, d), 6)
    (src_k if role == "key" else src_v)[2, 17, 1, 9] = bad
    ks, vs = specs(level, t, h, d)
    recs = [bytearray(ks.size + vs.size + len(TRAILER)) for _ in range(4)]
    assert ext.encode_row(kernels.load(backend), ((ks, vs, TRAILER),) * 4, recs, src_k, src_v, 0) == 2
    for i in range(2):  # the layers before it are done
        assert bytes(recs[i]) == expected_record(src_k[i], src_v[i], level)


@pytest.mark.parametrize("backend", COMPILED)
def test_arrays_the_c_path_cannot_take_are_left_to_pages(backend: str) -> None:
    t, h, d = 8, 2, 16
    ks, vs = specs("q8", t, h, d)
    be = kernels.load(backend)
    good = rand((2, t, h, d))
    recs = [bytearray(ks.size + vs.size + len(TRAILER)) for _ in range(2)]
    swapped = good.byteswap().view(good.dtype.newbyteorder())
    for bad in (rand((2, t, h, 2 * d))[..., ::2], good.astype(np.float32), good[:, :, :, :-1], swapped):
        assert ext.encode_row(be, ((ks, vs, TRAILER),) * 2, recs, bad, good, 0) == 0
    raw = np.zeros(good.nbytes + 1, np.uint8)[1:].view(np.float16)  # misaligned float16
    assert ext.encode_row(be, ((ks, vs, TRAILER),) * 2, recs, raw.reshape(good.shape), good, 0) == 0
    by_code = (None, (ks, vs), None, None, None)
    out = np.empty((2 * t, h, d), np.float16)
    assert ext.decode_run(be, recs, 0, 2, by_code, sp.CUR_FMT_FROM_END, out[:, :, ::-1], out) == 0  # reversed
    ro = out.copy()
    ro.flags.writeable = False
    assert ext.decode_run(be, recs, 0, 2, by_code, sp.CUR_FMT_FROM_END, ro, out) == 0


@pytest.mark.parametrize("backend", COMPILED)
def test_a_damaged_or_foreign_record_stops_the_run_there(backend: str) -> None:
    t, h, d = 16, 2, 32
    ks, vs = specs("q4", t, h, d)
    be = kernels.load(backend)
    k, v = rand((3, t, h, d), 7), rand((3, t, h, d), 8)
    trailer = bytearray(sp.TRAILER_BYTES)
    trailer[-sp.CUR_FMT_FROM_END] = sp.FMT_CODE["q4"]
    good = [bytearray(expected_record(k[r], v[r], "q4")[: -sp.TRAILER_BYTES] + trailer) for r in range(3)]
    by_code = tuple((ks, vs) if c == sp.FMT_CODE["q4"] else None for c in range(5))
    out_k, out_v = np.empty((3 * t, h, d), np.float16), np.empty((3 * t, h, d), np.float16)
    for where in (3, 24, 40, ks.size - 1, ks.size + 30, ks.size + vs.size - 1):  # header, checksum, payloads
        recs = [bytearray(r) for r in good]
        recs[1][where] ^= 0x10
        assert ext.decode_run(be, recs, 0, 3, by_code, sp.CUR_FMT_FROM_END, out_k, out_v) == 1
    recs = [bytearray(r) for r in good]
    recs[2][-sp.CUR_FMT_FROM_END] = sp.FMT_CODE["q8"]  # a format with no spec
    assert ext.decode_run(be, recs, 0, 3, by_code, sp.CUR_FMT_FROM_END, out_k, out_v) == 2


@pytest.mark.parametrize("level", ["q8", "q4"])
def test_the_store_refuses_a_damaged_page_and_keeps_serving_the_rest(level: str) -> None:
    s = Store(1 << 26, page_tokens=16, sink_tokens=0)
    s.register("m", num_layers=2, num_kv_heads=2, head_dim=32)
    s.set_level(level, 1)
    k, v = rand((2, 80, 2, 32), 9), rand((2, 80, 2, 32), 10)
    s.append("m", 1, k, v)
    clean = s.get("m", 1)
    rec = s._seqs[("m", 1)].pages[1][2]  # layer 1, tokens [32, 48)
    rec[100] ^= 1
    with pytest.raises(CorruptPage, match="checksum"):
        s.get("m", 1)
    got = s.get("m", 1, 0, 32)  # rows before the damaged one still read
    np.testing.assert_array_equal(got[0].view(np.uint16), clean[0][:, :32].view(np.uint16))
    got = s.get("m", 1, 48, 80)
    np.testing.assert_array_equal(got[1].view(np.uint16), clean[1][:, 48:].view(np.uint16))


def test_a_non_finite_append_names_the_value_and_stores_nothing() -> None:
    s = Store(1 << 26, page_tokens=16, sink_tokens=0)
    s.register("m", num_layers=3, num_kv_heads=2, head_dim=32)
    s.set_level("q8", 1)
    k, v = rand((3, 64, 2, 32), 11), rand((3, 64, 2, 32), 12)
    v[2, 37, 1, 5] = np.nan
    with pytest.raises(NonFiniteError, match=r"values\[2, 37, 1, 5\] = nan is not finite"):
        s.append("m", 1, k, v)
    st = s.stats()
    assert st["tokens"] == 0 and st["sequences"] == 0 and sum(st["pages_by_level"].values()) == 0
    with pytest.raises(UnknownSequence):
        s.length("m", 1)


def test_the_store_takes_the_batched_path_exactly_when_it_is_on() -> None:
    assert page_batch.ENABLED == (kernels.BACKEND != "reference")
    s = Store(1 << 26, page_tokens=16)
    s.register("m", num_layers=2, num_kv_heads=2, head_dim=32)
    ns = s._ns["m"]
    assert set(ns.specs) == (set(pages.LEVELS) if page_batch.ENABLED else set())
    assert (ns.plan("q8", 0, 1).batch is not None) == page_batch.ENABLED
    s2 = Store(1 << 26, page_tokens=16, raw_heads=(1,))
    s2.register("m", num_layers=2, num_kv_heads=2, head_dim=32)
    # pages with raw heads take the per-page path: only raw (fp16) pages, which never carry them, have specs
    assert set(s2._ns["m"].specs) == ({"fp16"} if page_batch.ENABLED else set())


@pytest.mark.parametrize("level", pages.LEVELS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_reused_buffer_gives_the_same_bytes(level: str, shape: tuple[int, int, int]) -> None:
    # padding between sections is written as zeros by both paths, so old bytes never reach a page
    x = rand(shape, 13)
    for role in pages.ROLES:
        want = pages.encode(x, level, role=role)
        dirty = bytearray(b"\xa5" * len(want))
        pages.encode_into(x, level, dirty, role=role)
        assert bytes(dirty) == want
    for backend in COMPILED:
        ks, vs = specs(level, *shape)
        rec = bytearray(b"\x5a" * (ks.size + vs.size + len(TRAILER)))
        src = x[None]
        assert ext.encode_row(kernels.load(backend), ((ks, vs, TRAILER),), [rec], src, src, 0) == -1
        assert bytes(rec) == expected_record(x, x, level)
    assert len(page_batch.new_record(100)) == 100 and type(page_batch.new_record(1)) is bytearray


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("where", [0, 31, 32, 35])
def test_fp16_pages_refuse_non_finite_values_in_the_streamed_part_and_the_rest(backend: str, where: int) -> None:
    # 3 x 1 x 12 = 36 values: 32 go through the streaming loop, 4 through the plain one
    t, h, d = 3, 1, 12
    ks, vs = specs("fp16", t, h, d)
    be = kernels.load(backend)
    src = rand((1, t, h, d), 14)
    recs = [bytearray(ks.size + vs.size + len(TRAILER))]
    assert ext.encode_row(be, ((ks, vs, TRAILER),), recs, src, src, 0) == -1
    assert bytes(recs[0]) == expected_record(src[0], src[0], "fp16")
    bad = src.copy()
    bad.reshape(-1)[where] = np.inf
    assert ext.encode_row(be, ((ks, vs, TRAILER),), recs, bad, src, 0) == 0
    assert ext.encode_row(be, ((ks, vs, TRAILER),), recs, src, bad, 0) == 0


@pytest.mark.parametrize("level", ["fp16", "q8", "q4"])
def test_two_threads_give_the_same_store_as_one(monkeypatch, level: str) -> None:
    k, v = rand((4, 200, 2, 32), 15), rand((4, 200, 2, 32), 16)

    def filled() -> Store:
        s = Store(1 << 26, page_tokens=16, sink_tokens=0)
        s.register("m", num_layers=4, num_kv_heads=2, head_dim=32)
        s.set_level(level, 1)
        s.append("m", 1, k[:, :7], v[:, :7])
        s.append("m", 1, k[:, 7:], v[:, 7:])
        return s

    one = filled()
    monkeypatch.setattr(page_batch, "PARALLEL_MIN_BYTES", 0)
    two = filled()
    for a, b in zip(one.get_pages("m", 1), two.get_pages("m", 1), strict=True):
        assert a == b
    for lo, hi, layers in ((0, 200, None), (5, 190, [3, 0, 2]), (16, 48, [1])):
        for a, b in zip(one.get("m", 1, lo, hi, layers), two.get("m", 1, lo, hi, layers), strict=True):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_on_two_threads_the_error_names_the_first_bad_row(monkeypatch) -> None:
    monkeypatch.setattr(page_batch, "PARALLEL_MIN_BYTES", 0)
    s = Store(1 << 26, page_tokens=16, sink_tokens=0)
    s.register("m", num_layers=2, num_kv_heads=2, head_dim=32)
    s.set_level("q8", 1)
    k, v = rand((2, 128, 2, 32), 17), rand((2, 128, 2, 32), 18)
    k[1, 20, 0, 0] = np.inf  # row 1, handled by the first thread
    k[0, 100, 1, 3] = np.nan  # row 6, handled by the second
    with pytest.raises(NonFiniteError, match=r"keys\[1, 20, 0, 0\] = inf is not finite"):
        s.append("m", 1, k, v)
    assert s.stats()["tokens"] == 0


def test_any_nonfinite_finds_every_nan_and_inf_and_declines_other_forms() -> None:
    base = rand((3, 70, 2, 32), 19)
    for x in (base, base[:, 5:9], base[::2, :1]):  # contiguous, a token slice, a layer-strided one
        assert page_batch.any_nonfinite(x) is False
        for where in ((0, 0, 0, 0), (x.shape[0] - 1, x.shape[1] - 1, 1, 31), (1 % x.shape[0], 0, 1, 7)):
            for bad in (np.nan, np.inf, -np.inf, np.float16(np.nan) * -1):
                y = x.copy() if x.base is None else x
                old = y[where]
                y[where] = bad
                assert page_batch.any_nonfinite(y) is True
                y[where] = old
    assert page_batch.any_nonfinite(np.float16(65504) * np.ones((1, 3, 2, 2), np.float16)) is False
    assert page_batch.any_nonfinite(base[:, :, :, ::2]) is None  # not contiguous within a layer
    assert page_batch.any_nonfinite(base.astype(np.float32)) is None
    assert page_batch.any_nonfinite(base[0]) is None  # not [L, T, H, D]


@pytest.mark.parametrize("level", pages.LEVELS)
def test_assemble_refuses_every_header_bit_flip_and_payload_flips_through_the_c_path(level: str) -> None:
    # assemble_into decodes whole pages in C: a damaged page must be refused there exactly as kvd.pages does
    t, h, d = 16, 2, 32
    k, v = rand((1, t, h, d), 20), rand((1, t, h, d), 21)
    kp, vp = pages.encode(k[0], level, role="key"), pages.encode(v[0], level, role="value")
    out_k, out_v = np.empty((1, t, h, d), np.float16), np.empty((1, t, h, d), np.float16)
    pages.assemble_into([(0, 0, kp, vp)], 0, t, out_k, out_v, parallel=False)
    np.testing.assert_array_equal(out_k.view(np.uint16), pages.decode(kp)[None].view(np.uint16))
    rng = np.random.default_rng(22)
    flips = [(byte, bit) for byte in range(pages.HEADER_BYTES) for bit in range(8)]
    flips += [(int(rng.integers(pages.HEADER_BYTES, len(vp))), int(rng.integers(8))) for _ in range(64)]
    for byte, bit in flips:
        bad = bytearray(vp)
        bad[byte] ^= 1 << bit
        with pytest.raises(KvdError):
            pages.assemble_into([(0, 0, kp, bytes(bad))], 0, t, out_k, out_v, parallel=False)


@pytest.mark.parametrize("level", ["q8", "fp8_e4m3", "q4"])
def test_raw_heads_with_a_head_dim_of_one_encode(level: str) -> None:
    # found by hypothesis: np.delete of the raw heads gave a [T, H', 1] array with strides the kernels refuse
    x = rand((2, 4, 1), 23)
    for role in pages.ROLES:
        page = pages.encode(x, level, role=role, raw_heads=[0, 1])
        got = pages.decode(page)
        np.testing.assert_array_equal(got[:, :2].view(np.uint16), x[:, :2].view(np.uint16))  # raw heads exact
        assert np.isfinite(got).all() and got.shape == x.shape
