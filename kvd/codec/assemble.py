"""Assembling a token range from pages: what a reader of ``get(format="pages")`` does with the entries.

``assemble`` / ``assemble_into`` are re-exported by :mod:`kvd.pages` (their public home). Every page's header
is checked first (shape, coverage of the range); whole pages are then checked and decoded by the C codec in
one call (:mod:`kvd.codec.batch`), the rest (pages cut by the range, pages with raw heads, a damaged page, which
raises) page by page; with enough output, on two threads (the kernels release the GIL).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvd.codec import batch as page_batch
from kvd.codec.pages import _batch_spec, _bytes_view, _decode_layout, _Layout, decode, decode_into, header
from kvd.errors import InvalidArgument


def assemble(
    entries: Sequence[tuple[int, int, object, object]], start: int, end: int, layers: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rebuild ``(keys, values)`` float16 ``[L', end-start, H, D]`` from ``(layer, token0, key_page, value_page)``
    entries (as ``Store.get_pages`` returns them). ``layers`` gives the output order (default: the entries' layers
    in order of first appearance). Raises InvalidArgument if the pages do not cover ``[start, end)`` of a layer.
    """
    if end < start:
        raise InvalidArgument(f"end {end} < start {start}")
    order = list(dict.fromkeys(e[0] for e in entries)) if layers is None else list(layers)
    first = header(entries[0][2]) if entries else None
    h, d = (first.heads, first.head_dim) if first else (1, 1)
    keys = np.empty((len(order), end - start, h, d), np.float16)
    values = np.empty_like(keys)
    assemble_into(entries, start, end, keys, values, order)
    return keys, values


PARALLEL_MIN_BYTES = page_batch.PARALLEL_MIN_BYTES


def assemble_into(
    entries: Sequence[tuple[int, int, object, object]],
    start: int,
    end: int,
    keys_out: np.ndarray,
    values_out: np.ndarray,
    layers: Sequence[int] | None = None,
    *,
    parallel: bool | None = None,
) -> None:
    """Like :func:`assemble`, decoding straight into ``keys_out`` and ``values_out`` (float16, C-contiguous,
    ``[L', end-start, H, D]``). Pages are checked and decoded on two threads when there is enough work
    (``parallel=None``: at least PARALLEL_MIN_BYTES of output; the kernels release the GIL)."""
    if end < start:
        raise InvalidArgument(f"end {end} < start {start}")
    order = list(dict.fromkeys(e[0] for e in entries)) if layers is None else list(layers)
    slot = {layer: i for i, layer in enumerate(order)}
    want = (len(order), end - start)
    for name, out in (("keys_out", keys_out), ("values_out", values_out)):
        if not isinstance(out, np.ndarray) or out.dtype != np.float16 or out.shape[:2] != want or out.ndim != 4:
            raise InvalidArgument(
                f"{name} must be a float16 array [{want[0]}, {want[1]}, H, D], got {getattr(out, 'shape', out)}"
            )
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgument(f"{name} must be writable and C-contiguous")
    h, d = keys_out.shape[2:]
    covered = np.zeros(want, bool)
    jobs: list[_Job] = []
    for layer, token0, kp, vp in entries:
        if layer not in slot:
            continue
        i = slot[layer]
        for page, dst in ((kp, keys_out), (vp, values_out)):
            lay = _decode_layout(_bytes_view(page))
            if lay.shape[1:] != (h, d):
                raise InvalidArgument(
                    f"page of layer {layer} at token {token0} has shape {lay.shape}, expected [*, {h}, {d}]"
                )
            lo, hi = max(start, token0), min(end, token0 + lay.shape[0])
            if lo >= hi:
                continue
            jobs.append((page, dst[i, lo - start : hi - start], lo - token0, hi - token0, lay))
            covered[i, lo - start : hi - start] = True
    if not covered.all():
        i, t = (int(v) for v in np.argwhere(~covered)[0])
        raise InvalidArgument(f"pages do not cover token {start + t} of layer {order[i]}")
    if parallel is None:
        parallel = keys_out.nbytes + values_out.nbytes >= PARALLEL_MIN_BYTES
    page_batch.split_run(_decode_jobs, jobs, parallel=parallel)


_Job = tuple[object, np.ndarray, int, int, _Layout]  # page, destination, first and end token in it, layout


def _decode_jobs(jobs: Sequence[_Job]) -> None:
    """Whole pages go to the C codec in one call (kvd.codec.batch); partial pages, pages it has no spec for and
    any page it stops at (damaged: decode_into raises the error) go through decode_into here."""
    whole: list[_Job] = []
    rest: list[_Job] = []
    for job in jobs:
        _, _, lo, hi, lay = job
        (whole if lo == 0 and hi == lay.shape[0] and _batch_spec(lay) is not None else rest).append(job)
    while whole:
        stop = page_batch.decode_pages(
            [_batch_spec(j[4]) for j in whole], [j[0] for j in whole], [j[1] for j in whole]
        )
        if stop < 0:
            break
        rest.append(whole[stop])
        whole = whole[stop + 1 :]
    for page, dst, lo, hi, lay in rest:
        if lo == 0 and hi == lay.shape[0]:
            decode_into(page, dst)
        else:
            dst[...] = decode(page)[lo:hi]
