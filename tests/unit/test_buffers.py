"""Warm result buffers (kvd.store.buffers): a block's memory is reused only after every array and view on it is
gone, never more than the cache limit is kept, and small arrays are plain numpy arrays."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kvd.store import buffers

pytest.importorskip("kvd.codec._kernels", reason="warm blocks live in the compiled extension")
BIG = (4, 256, 8, 128)  # 2 MiB


@pytest.fixture(autouse=True)
def _limit():
    old = buffers.cache_bytes()
    buffers.cache_bytes(0)  # start empty
    buffers.cache_bytes(64 << 20)
    yield
    buffers.cache_bytes(old)


def test_small_arrays_are_plain_numpy() -> None:
    a = buffers.empty_f16((3, 5, 7))
    assert a.dtype == np.float16 and a.shape == (3, 5, 7) and a.flags.owndata


def test_large_arrays_are_writable_float16_of_the_shape() -> None:
    a = buffers.empty_f16(BIG)
    assert a.dtype == np.float16 and a.shape == BIG and a.flags.writeable and a.flags.c_contiguous
    a[...] = 3
    assert float(a.sum(dtype=np.float64)) == 3 * a.size


def test_a_block_is_reused_only_after_its_last_view_is_gone() -> None:
    a = buffers.empty_f16(BIG)
    a[...] = 1
    view = a[1:, 10:]
    del a
    gc.collect()
    assert buffers.cached() == (0, 0)  # the view keeps the block alive
    b = buffers.empty_f16(BIG)  # so this one is new memory
    assert not np.shares_memory(b, view)
    b[...] = 2
    assert (view == 1).all()
    del view
    gc.collect()
    blocks, nbytes = buffers.cached()
    assert blocks == 1 and nbytes == 2 * np.prod(BIG)
    c = buffers.empty_f16(BIG)  # reuses the kept block
    assert buffers.cached() == (0, 0) and not np.shares_memory(c, b)


def test_the_cache_never_keeps_more_than_its_limit() -> None:
    buffers.cache_bytes(5 << 20)  # room for two 2 MiB blocks
    arrays = [buffers.empty_f16(BIG) for _ in range(4)]
    del arrays
    gc.collect()
    blocks, nbytes = buffers.cached()
    assert blocks == 2 and nbytes <= 5 << 20
    buffers.cache_bytes(0)
    assert buffers.cached() == (0, 0)


def test_a_much_smaller_request_does_not_take_a_big_block() -> None:
    a = buffers.empty_f16((8, 256, 8, 128))  # 4 MiB
    del a
    gc.collect()
    assert buffers.cached()[0] == 1
    b = buffers.empty_f16(BIG)  # 2 MiB: would waste half of it
    assert buffers.cached()[0] == 1 and b.nbytes == 2 << 20


def test_bad_limits_are_refused() -> None:
    for bad in (-1, 1.5, "1"):
        with pytest.raises(ValueError, match="non-negative int"):
            buffers.cache_bytes(bad)  # type: ignore[arg-type]
