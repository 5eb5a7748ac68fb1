"""Warm result buffers: the arrays :meth:`kvd.store.Store.get` returns, on memory that is reused.

Why: a get of many MiB returns new arrays. glibc maps every block over 32 MiB fresh from the OS and unmaps it
when freed (that threshold cannot be raised), so each such get pays a page fault and the kernel's zeroing per
4 KiB before a byte is decoded: measured here, that halves a large get (bench/store.py, "get" against
"get_into"). :func:`empty_f16` puts arrays of at least :data:`MIN_BYTES` on a
``kvd.codec._kernels.WarmBlock``: when the last array or view using a block is gone, its memory is kept (up to
:func:`cache_bytes`, oldest dropped first) for the next block of about that size, already faulted in.

Safety: a block is only reused after it died, which is after every array and view on it died (numpy keeps
the block alive as their base), so no caller ever sees its memory change. Bounded: at most
:func:`cache_bytes` bytes (default :data:`DEFAULT_CACHE_BYTES`) are kept per process, outside any store's
capacity. Without the compiled extension this is plain ``numpy.empty``.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import numpy as np

_ext: Any
try:
    _ext = importlib.import_module("kvd.codec._kernels")
except ImportError:  # not built
    _ext = None

MIN_BYTES = 1 << 20  # below this, malloc's own reuse is as good
DEFAULT_CACHE_BYTES = 256 << 20


def cache_bytes(limit: int | None = None) -> int:
    """Set (if ``limit`` is given) and return how many bytes of freed blocks the process keeps for reuse."""
    if _ext is None:
        return 0
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"the warm cache limit must be a non-negative int, got {limit!r}")
    return int(_ext.warm_cache_limit(-1 if limit is None else limit))


def cached() -> tuple[int, int]:
    """(blocks, bytes) kept for reuse now."""
    if _ext is None:
        return (0, 0)
    blocks, nbytes = _ext.warm_cache_info()
    return int(blocks), int(nbytes)


def empty_f16(shape: tuple[int, ...]) -> np.ndarray:
    """A new float16 array of ``shape`` (contents undefined), on a warm block when it is large."""
    n = 2 * math.prod(shape)
    if _ext is None or n < MIN_BYTES:
        return np.empty(shape, np.float16)
    return np.frombuffer(_ext.WarmBlock(n), np.float16).reshape(shape)


cache_bytes(DEFAULT_CACHE_BYTES)
