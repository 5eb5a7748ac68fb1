"""Held heads in the page format (version 2 pages): a q4 page with some heads at 8 bits, read back exactly as
those heads would be from a page of their own; every page without held heads stays version 1, byte for byte."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd import pages
from kvd.errors import CorruptPage, InvalidArgument


def kv(t: int, h: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h, d))
    x[:, :, rng.integers(0, d)] *= 8
    return x.astype(np.float16)


def alone(x: np.ndarray, heads: list[int], level: str, role: str) -> np.ndarray:
    return pages.decode(pages.encode(np.ascontiguousarray(x[:, heads]), level, role=role))


@settings(max_examples=80, deadline=None)
@given(t=st.integers(1, 70), h=st.integers(2, 6), d=st.integers(1, 40), role=st.sampled_from(pages.ROLES),
       held_level=st.sampled_from(["q8", "fp8_e4m3", "fp8_e5m2"]), data=st.data())
def test_held_heads_round_trip_as_pages_of_their_own(t: int, h: int, d: int, role: str, held_level: str,
                                                    data: st.DataObject) -> None:
    held = sorted(data.draw(st.sets(st.integers(0, h - 1), min_size=1, max_size=h)))
    raw = sorted(data.draw(st.sets(st.sampled_from([i for i in range(h) if i not in held]) if len(held) < h
                                   else st.nothing(), max_size=h - len(held))))
    x = kv(t, h, d, seed=t * 100 + h * 10 + d)
    buf = pages.encode(x, "q4", role=role, raw_heads=raw, held_heads=held, held_level=held_level)
    size = pages.nbytes("q4", t, h, d, role=role, raw_heads=raw, held_heads=held, held_level=held_level)
    assert len(buf) == size
    hd = pages.verify(buf)
    assert (hd.version, hd.level, hd.raw_heads, hd.held_heads, hd.held_level) == (
        pages.HELD_VERSION, "q4", tuple(raw), tuple(held), held_level)
    assert hd.nbytes == len(buf)
    y = pages.decode(buf)
    np.testing.assert_array_equal(y[:, held].view(np.uint16), alone(x, held, held_level, role).view(np.uint16))
    if raw:
        np.testing.assert_array_equal(y[:, raw].view(np.uint16), x[:, raw].view(np.uint16))
    rest = [i for i in range(h) if i not in held and i not in raw]
    if rest:
        np.testing.assert_array_equal(y[:, rest].view(np.uint16), alone(x, rest, "q4", role).view(np.uint16))


def test_a_page_without_held_heads_is_version_1_and_unchanged() -> None:
    x = kv(64, 3, 64)
    for role in pages.ROLES:
        assert pages.encode(x, "q4", role=role, held_heads=(), held_level="q8") == pages.encode(x, "q4", role=role)
        assert pages.header(pages.encode(x, "q4", role=role)).version == 1


def test_held_heads_cost_what_their_level_costs() -> None:
    """One of 3 heads at q8 in a 64 x 3 x 64 q4 page: its bytes are those of a q8 page of that head, less the
    header the held block replaces with 16 bytes."""
    x = kv(64, 3, 64)
    for role in pages.ROLES:
        got = len(pages.encode(x, "q4", role=role, held_heads=[1], held_level="q8"))
        parts = (pages.nbytes("q4", 64, 2, 64, role=role) + pages.nbytes("q8", 64, 1, 64, role=role)
                 - pages.HEADER_BYTES + 16)
        assert got == parts


@pytest.mark.parametrize("bad", [
    {"held_heads": [1], "held_level": None},
    {"held_heads": [1], "held_level": "q4"},
    {"held_heads": [1], "held_level": "fp16"},
    {"held_heads": [1], "held_level": "q8", "raw_heads": [1]},
    {"held_heads": [3], "held_level": "q8"},
])
def test_bad_held_heads_are_refused(bad: dict) -> None:
    with pytest.raises(InvalidArgument):
        pages.encode(kv(8, 3, 16), "q4", role="key", **bad)


def test_an_eight_bit_page_holds_no_heads_at_its_own_rung() -> None:
    with pytest.raises(InvalidArgument, match="less compact"):
        pages.encode(kv(8, 3, 16), "q8", role="key", held_heads=[0], held_level="fp8_e4m3")


def test_damaged_held_blocks_are_corrupt_pages() -> None:
    x = kv(16, 4, 16)
    buf = bytearray(pages.encode(x, "q4", role="value", raw_heads=[0], held_heads=[2], held_level="q8"))
    at = 32 + 8  # after the header and the padded raw-head list
    for off, value in ((at, 9), (at + 2, 0), (at + 2, 4), (at + 3, 7), (at + 6, 1), (at + 8, 0), (at + 8, 5)):
        bad = bytearray(buf)
        struct.pack_into("<B" if off in (at + 2, at + 3) else "<H", bad, off, value)
        with pytest.raises(CorruptPage):
            pages.decode(bytes(bad))
    with pytest.raises(CorruptPage):
        pages.decode(bytes(buf[: at + 4]))
    bad = bytearray(buf)
    bad[-1] ^= 1
    with pytest.raises(CorruptPage, match="checksum"):
        pages.decode(bytes(bad))
