"""Batched page codec: many whole pages per call into C, for the store's append and read paths.

Theory of operation
-------------------
:mod:`kvd.pages` encodes one page per Python call: it checks the array, looks up the layout, builds section
views, calls a kernel and hashes the payload. On a 24 KiB page that Python work costs three times the
kernel. Here a page layout (without raw heads) is flattened once into a :class:`PageSpec`, and the compiled
extension then encodes a whole row of records (every layer's key and value page plus the trailer) or checks
and decodes a run of records in one call with the GIL released, in C, page after page (``kvd_pagecodec.h``).
The bytes are the same as :func:`kvd.pages.encode`'s; a page that the C path cannot take (non-finite input,
bytes that do not match their layout, a layout with raw heads) is left to :mod:`kvd.pages`, which raises the
documented error or takes the slow road.

The checksum is xxh3-64. Rather than carry a copy of xxHash, the C code calls ``XXH3_64bits_withSeed`` of the
``xxhash`` module Python has already loaded (the function :mod:`kvd.pages` uses), found with ctypes and
checked against ``xxhash.xxh3_64_intdigest`` at import. When that symbol is not exported, or the kernels in
use are the numpy reference, :data:`ENABLED` is False and callers use the per-page path: slower, same bytes.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import xxhash

from kvd.codec import kernels

_ext: Any
try:
    _ext = importlib.import_module("kvd.codec._kernels")
except ImportError:  # not built: the per-page path is all there is
    _ext = None


def _hash_address() -> int:
    """The address of the xxhash module's XXH3_64bits_withSeed, or 0 when it cannot be found or disagrees."""
    if _ext is None:
        return 0
    try:
        lib = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
        for name in ("XXH3_64bits_withSeed_dispatch", "XXH3_64bits_withSeed"):  # the dispatching one picks SIMD
            fn = getattr(lib, name, None)
            if fn is not None:
                break
        else:
            return 0
        address = ctypes.cast(fn, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0
    _ext.set_page_hash(address)
    probe = bytes(range(256)) * 40
    for n in (0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, len(probe)):  # every size class of xxh3
        for seed in (0, 0x9E3779B97F4A7C15):
            if _ext.page_hash(probe[:n], seed) != xxhash.xxh3_64_intdigest(probe[:n], seed):
                _ext.set_page_hash(0)
                return 0
    return address


# A record buffer of the given size, not zeroed when the extension is there: every byte of a record is
# written by the codec (sections, padding, header, trailer), so zeroing first would be a wasted pass.
new_record = _ext.new_record if _ext is not None else bytearray

HASH_OK: bool = _hash_address() != 0  # the C codec has its checksum (tests drive it with any compiled set)
_BACKEND = kernels.compiled()
ENABLED: bool = _BACKEND is not None and HASH_OK  # the store's paths use it


@functools.lru_cache(maxsize=1024)
def spec(flat: tuple[Any, ...]) -> Any:
    """The C codec's ``PageSpec`` of a layout flattened by :func:`kvd.pages.flat_layout` (None when the batch
    path is off). Cached: the store and the page readers ask for the same few layouts over and over."""
    if not ENABLED:
        return None
    return _ext.PageSpec(*flat)


def encode_row(
    layers: tuple[tuple[Any, Any, bytes], ...], recs: list[bytearray], src_k: Any, src_v: Any, t0: int
) -> int:
    """Fill ``recs[i]`` with the pages of ``src_k[i, t0:t0+P]`` / ``src_v[i, t0:t0+P]`` and trailer ``layers[i]
    = (key spec, value spec, trailer)``. Returns -1, or the first layer left undone (non-finite input)."""
    return _ext.encode_row(_BACKEND, layers, recs, src_k, src_v, t0)


def decode_run(recs: list[bytearray], r0: int, r1: int, specs_by_code: tuple[Any, ...], code_from_end: int,
               kout: Any, vout: Any, *, stream: bool = False) -> int:  # fmt: skip
    """Decode records ``recs[r0:r1]`` into ``kout`` / ``vout`` ``[(r1 - r0) * P, H, D]``; a record's format code
    is its byte at ``-code_from_end``, ``specs_by_code[code]`` its ``(key spec, value spec)`` or None.
    ``stream``: fp16 pages go past the cache (:data:`STREAM_MIN_BYTES`). Returns -1, or the first record left
    undone (decode it through :mod:`kvd.pages`)."""
    return _ext.decode_run(_BACKEND, recs, r0, r1, specs_by_code, code_from_end, kout, vout, stream)


def decode_pages(specs: list[Any], srcs: list[Any], outs: list[Any]) -> int:
    """Check and decode page ``srcs[i]`` into ``outs[i]`` (float16 ``[T, H, D]``, C-contiguous) by ``specs[i]``.
    Returns -1, or the first page left undone (decode it through :mod:`kvd.pages`)."""
    return _ext.decode_pages(_BACKEND, specs, srcs, outs)


def any_nonfinite(a: Any) -> bool | None:
    """Whether float16 ``a`` ``[L, T, H, D]`` (each ``a[i]`` contiguous) holds NaN/Inf, in one C pass; None when
    the extension is missing or the array is not of that form."""
    if _ext is None:
        return None
    r = _ext.any_nonfinite(a)
    return None if r < 0 else bool(r)


# ------------------------------------------------------------------------------------------------------------
# two threads for big batches: the C calls release the GIL, so a second thread doubles the kernel work done

# Below this a hand-off to the second thread costs more than it saves: waking it and waiting for it takes ~50 us
# here, as long as a whole 1 MiB fp16 get. Measured in one process (docs/design.md): at 1 MiB the split made
# gets 61 -> 112 us and one-layer appends 55 -> 116 us; from 4 MiB it pays (8-layer q4 get 450 -> 301 us).
PARALLEL_MIN_BYTES = 4 << 20
# A read at least this large decodes fp16 pages with streaming stores: it cannot stay in cache anyway, and
# skipping the read for ownership helps; a smaller one (a reply about to be sent) is sent faster from cache
# (measured through a shard: 8 MiB gets 1.31 -> 1.14 ms without streaming).
STREAM_MIN_BYTES = 32 << 20
_POOL: list[ThreadPoolExecutor] = []
_T = TypeVar("_T")
_R = TypeVar("_R")


def split_run(fn: Callable[[Sequence[_T]], _R], items: Sequence[_T], *, parallel: bool) -> tuple[_R, ...]:
    """``fn(items)`` here, or (``parallel`` and at least two items) ``fn`` of the first half here and of the second
    half on kvd's helper thread, at once. Returns the results in order; an exception of either half is raised
    (the first half's first) after both are done."""
    if not parallel or len(items) < 2:
        return (fn(items),)
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvd-codec"))
    half = len(items) // 2
    other = _POOL[0].submit(fn, items[half:])
    try:
        first = fn(items[:half])
    except BaseException:
        other.exception()  # waits: no work on the caller's data outlives the call
        raise
    return first, other.result()
