"""Page codec: one sealed page of keys or values, encoded at a level, as self-describing bytes.

Theory of operation
-------------------
A page holds ``T`` tokens x ``H`` KV heads x ``D`` head_dim of one tensor (the keys or the values of one layer of
one sequence). :func:`encode` turns it into ``header | raw-head list | payload``; everything a reader needs is
in the header (format version, level, quantization axis, group size, rotation, shape, raw heads, payload length,
checksum), so a page written under one level or setting is read correctly after any later change: readers
trust the header, never a global setting.

Schemes, chosen by measurement on real KV (BENCHMARKS.md, ``bench/quality.py``):

=========  =====================================================  ===========================================
level      keys (role="key")                                      values (role="value")
=========  =====================================================  ===========================================
fp16       raw float16                                            raw float16
q8         int8 per channel, groups of 64 tokens (KIVI)           int8 per token, groups of 64 along head_dim
fp8_e4m3   E4M3 per token, groups of 32 along head_dim            same as keys
fp8_e5m2   E5M2 per token, groups of 32 along head_dim            same as keys
q4         4-bit asymmetric per channel, groups of 32 tokens      4-bit asymmetric per token, groups of 32
                                                                  along head_dim, Hadamard-rotated rows when
                                                                  head_dim is a power of two
=========  =====================================================  ===========================================

Every scale and zero point is float16: q8 (groups of 64) costs 8.25 bits per value, fp8 (groups of 32) 8.5 and
q4 (groups of 32, scale + zero point) 5.
The numerics of each kernel are specified in :mod:`kvd.codec.reference`; the byte layout in ``docs/formats.md``.

Raw heads (``raw_heads``) are stored as float16 inside an otherwise quantized page. Non-finite input is refused
(:class:`~kvd.errors.NonFiniteError`) at every level, fp16 included; a page whose header, length or checksum does
not hold is refused on decode (:class:`~kvd.errors.CorruptPage`), never decoded as garbage.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvd.codec import batch as page_batch
from kvd.codec import kernels
from kvd.errors import CorruptPage, InvalidArgument, NonFiniteError, UnsupportedVersion

FORMAT_VERSION = 1
HELD_VERSION = 2  # a page with held heads (docs/formats.md); every other page is written as version 1
MAGIC = b"KVDP"
HEADER_BYTES = 32
# Group size per level, chosen on real KV (BENCHMARKS.md): q8 at 64 costs 8.25 bits per value, which is what lets
# a store hold >= 1.9x the tokens of fp16 (8.5 bits caps it at 1.88x) for 1.07% attention error; fp8 keeps 32
# because its error grows faster with the group (4.5% -> 4.9%); q4 keeps 32 (64 costs 9.7% vs 8.8%).
GROUPS = {"fp16": 0, "q8": 64, "fp8_e4m3": 32, "fp8_e5m2": 32, "q4": 32}
ALIGN_BYTES = 8  # every section starts on an 8-byte boundary, so decoders can read scales aligned

LEVELS = ("fp16", "q8", "fp8_e4m3", "fp8_e5m2", "q4")
ROLES = ("key", "value")
_LEVEL_CODE = {name: i for i, name in enumerate(LEVELS)}

AXIS_NONE = 0  # raw
AXIS_TOKEN = 1  # groups along head_dim, one group set per (token, head) row
AXIS_CHANNEL = 2  # groups along the tokens, one group set per channel (head, dim)
FLAG_ROTATED = 1

# magic, version, level, axis, flags, group, n_raw_heads, T, H, D, payload_len | checksum
_HEAD = struct.Struct("<4sBBBBHHIHHI")
_SUM = struct.Struct("<Q")
_ZEROS = bytes(8)
# held-head block of a version 2 page, after the raw-head list: n_held, level code, axis, group, zero
_HELD = struct.Struct("<HBBHH")
_RUNG = {"fp16": 0, "q8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "q4": 2}
assert _HEAD.size + _SUM.size == HEADER_BYTES


@dataclass(frozen=True, slots=True)
class PageHeader:
    """The decoded header of a page. ``nbytes`` is the whole page's length."""

    version: int
    level: str
    axis: int
    rotated: bool
    group: int
    tokens: int
    heads: int
    head_dim: int
    raw_heads: tuple[int, ...]
    payload_bytes: int
    checksum: int
    held_heads: tuple[int, ...] = ()
    held_level: str | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.tokens, self.heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        return _prefix_bytes(len(self.raw_heads), len(self.held_heads)) + self.payload_bytes


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _prefix_bytes(n_raw: int, n_held: int = 0) -> int:
    return HEADER_BYTES + _align(2 * n_raw) + (_HELD.size + _align(2 * n_held) if n_held else 0)


def _ng(n: int, group: int) -> int:
    return -(-n // group)


def _check_level(level: str) -> str:
    if level not in _LEVEL_CODE:
        raise InvalidArgument(f"unknown level {level!r}; expected one of {', '.join(LEVELS)}")
    return level


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise InvalidArgument(f"role must be 'key' or 'value', got {role!r}")
    return role


def scheme(level: str, role: str, head_dim: int) -> tuple[int, bool]:
    """(axis, rotated) used for a page of this level, role and head_dim."""
    _check_level(level)
    _check_role(role)
    if level == "fp16":
        return AXIS_NONE, False
    if level in ("q8", "q4") and role == "key":
        return AXIS_CHANNEL, False
    if level == "q4":
        return AXIS_TOKEN, head_dim >= 2 and (head_dim & (head_dim - 1)) == 0
    return AXIS_TOKEN, False


def _check_dims(t: int, h: int, d: int) -> None:
    for name, v, hi in (("T", t, 2**32 - 1), ("H", h, 65535), ("D", d, 65535)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 1 <= v <= hi:
            raise InvalidArgument(f"page {name} must be an integer in [1, {hi}], got {v!r}")


def _check_raw_heads(raw_heads: Sequence[int], h: int) -> tuple[int, ...]:
    rh = tuple(sorted(set(int(i) for i in raw_heads)))
    if len(rh) != len(tuple(raw_heads)):
        raise InvalidArgument(f"raw_heads has duplicates: {tuple(raw_heads)}")
    if rh and not (0 <= rh[0] and rh[-1] < h):
        raise InvalidArgument(f"raw_heads {rh} out of range for {h} heads")
    return rh


def _check_held(held_heads: Sequence[int], held_level: str | None, level: str, h: int,
                rh: tuple[int, ...]) -> tuple[tuple[int, ...], str | None]:
    hh = _check_raw_heads(held_heads, h)
    if not hh:
        return (), None
    if held_level is None or _check_level(held_level) == "fp16" or _RUNG[held_level] >= _RUNG[level]:
        raise InvalidArgument(
            f"held heads need a held_level quantized and less compact than {level!r}, got {held_level!r}"
        )
    if set(hh) & set(rh):
        raise InvalidArgument(f"heads {sorted(set(hh) & set(rh))} are both raw and held")
    return hh, held_level


# ---------------------------------------------------------------------------------------------------------
# layouts: everything about a page that its header determines, computed and checked once per header


@dataclass(frozen=True, slots=True)
class _Section:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the page
    nbytes: int


@dataclass(frozen=True, slots=True)
class _Layout:
    level: str
    axis: int
    rotated: bool
    group: int
    shape: tuple[int, int, int]
    raw_heads: tuple[int, ...]
    held: _Layout | None  # the held heads' matrix, as a page of their own whose sections are part of this one
    held_heads: tuple[int, ...]
    prefix: int  # header + raw-head list (+ held-head block), padded
    size: int  # the whole page
    matrix: tuple[int, int]  # the quantized heads as the kernel's 2-D matrix
    sections: tuple[_Section, ...]
    head: bytes  # the page's first `prefix` bytes with a zero checksum: constant for the layout
    seed: int  # xxh3-64 of the header bytes the checksum covers: constant for the layout
    gaps: tuple[tuple[int, int], ...]  # alignment padding [start, end) after sections: written as zeros

    def views(self, buf: memoryview) -> dict[str, np.ndarray]:
        return {s.name: np.ndarray(s.shape, s.dtype, buffer=buf, offset=s.offset) for s in self.sections}

    def header(self, checksum: int) -> PageHeader:
        t, h, d = self.shape
        return PageHeader(
            HELD_VERSION if self.held_heads else FORMAT_VERSION, self.level, self.axis, self.rotated, self.group,
            t, h, d, self.raw_heads, self.size - self.prefix, checksum, self.held_heads,
            self.held.level if self.held is not None else None,
        )  # fmt: skip


def _build_layout(
    level: str, axis: int, rotated: bool, group: int, t: int, h: int, d: int, rh: tuple[int, ...],
    held: tuple[tuple[int, ...], str, int, int] | None = None,
) -> _Layout:
    """``held``: (held heads, their level, axis, group) of a version 2 page, or None."""
    n_raw = len(rh)
    hh = held[0] if held else ()
    hq = h - n_raw - len(hh)
    prefix = _prefix_bytes(n_raw, len(hh))
    specs: list[tuple[str, type, tuple[int, ...]]] = []
    if axis == AXIS_TOKEN:
        matrix, meta = (t * hq, d), (t * hq, _ng(d, group))
    elif axis == AXIS_CHANNEL:
        matrix, meta = (t, hq * d), (_ng(t, group), hq * d)
    else:
        matrix, meta = (t * h, d), (0, 0)
    if level == "fp16":
        specs.append(("raw", np.float16, matrix))
    elif hq:
        if level == "q4":
            specs += [("packed", np.uint8, (matrix[0], (matrix[1] + 1) // 2)), ("scales", np.float16, meta)]
            specs.append(("mins", np.float16, meta))
        else:
            specs += [("codes", np.int8 if level == "q8" else np.uint8, matrix), ("scales", np.float16, meta)]
    if n_raw:
        specs.append(("rawheads", np.float16, (t, n_raw * d)))
    sections, off = [], prefix
    for name, dt, shape in specs:
        n = math.prod(shape) * np.dtype(dt).itemsize
        sections.append(_Section(name, np.dtype(dt), shape, off, n))
        off += _align(n)
    sub = None
    if held:
        hl, ha, hg = held[1:]
        sub = _build_layout(hl, ha, False, hg, t, len(hh), d, ())
        for x in sub.sections:  # the held matrix's sections follow, as in a page of their own
            sections.append(_Section("held_" + x.name, x.dtype, x.shape, off + x.offset - sub.prefix, x.nbytes))
        off += sub.size - sub.prefix
    if off - prefix > 0xFFFFFFFF:
        raise InvalidArgument(f"a page of {off - prefix} payload bytes exceeds the format's 4 GiB limit")
    flags = FLAG_ROTATED if rotated else 0
    head = bytearray(prefix)
    version = HELD_VERSION if held else FORMAT_VERSION
    _HEAD.pack_into(head, 0, MAGIC, version, _LEVEL_CODE[level], axis, flags, group, n_raw, t, h, d, off - prefix)
    struct.pack_into(f"<{n_raw}H", head, HEADER_BYTES, *rh)
    if held:
        at = _prefix_bytes(n_raw)
        _HELD.pack_into(head, at, len(hh), _LEVEL_CODE[held[1]], held[2], held[3], 0)
        struct.pack_into(f"<{len(hh)}H", head, at + _HELD.size, *hh)
    seed = xxhash.xxh3_64_intdigest(bytes(head[: _HEAD.size]) + bytes(head[HEADER_BYTES:]))
    gaps = tuple((x.offset + x.nbytes, x.offset + _align(x.nbytes)) for x in sections if x.nbytes % ALIGN_BYTES)
    return _Layout(
        level, axis, rotated, group, (t, h, d), rh, sub, hh, prefix, off, matrix, tuple(sections), bytes(head),
        seed, gaps,
    )  # fmt: skip


_MAX_CACHED_LAYOUTS = 4096  # bounds memory against a peer sending pages of ever-new shapes
_ENCODE_LAYOUTS: dict[tuple[object, ...], _Layout] = {}
_DECODE_LAYOUTS: dict[bytes, _Layout] = {}


def _remember(cache: dict, key: object, layout: _Layout) -> _Layout:
    if len(cache) >= _MAX_CACHED_LAYOUTS:
        cache.clear()
    cache[key] = layout
    return layout


_BATCH_SPECS: dict[bytes, object] = {}


def _batch_spec(lay: _Layout) -> object:
    """The C codec's spec of a layout (kvd.codec.batch), or None (raw heads, or the batch path is off)."""
    spec = _BATCH_SPECS.get(lay.head)
    if spec is None and lay.head not in _BATCH_SPECS:
        spec = page_batch.spec(_flat(lay)) if not lay.raw_heads and lay.held is None else None
        _remember(_BATCH_SPECS, lay.head, spec)  # type: ignore[arg-type]
    return spec


def _encode_layout(level: str, role: str, t: int, h: int, d: int, raw_heads: Sequence[int],
                   held_heads: Sequence[int] = (), held_level: str | None = None) -> _Layout:
    key = (level, role, t, h, d, tuple(raw_heads), tuple(held_heads), held_level)
    lay = _ENCODE_LAYOUTS.get(key)
    if lay is not None:
        return lay
    _check_dims(t, h, d)
    rh = _check_raw_heads(raw_heads, h)
    axis, rotated = scheme(level, role, d)
    held = None
    if level == "fp16":
        rh = ()
    else:
        hh, hl = _check_held(held_heads, held_level, level, h, rh)
        if hl is not None:
            held = (hh, hl, scheme(hl, role, d)[0], GROUPS[hl])
    return _remember(_ENCODE_LAYOUTS, key, _build_layout(level, axis, rotated, GROUPS[level], t, h, d, rh, held))


def nbytes(level: str, T: int, H: int, D: int, *, role: str, raw_heads: Sequence[int] = (),  # noqa: N803
           held_heads: Sequence[int] = (), held_level: str | None = None) -> int:
    """The exact size in bytes of a page of ``T`` tokens, ``H`` heads, ``D`` head_dim encoded at ``level``."""
    return _encode_layout(level, role, T, H, D, raw_heads, held_heads, held_level).size


def flat_layout(level: str, role: str, t: int, h: int, d: int) -> tuple[object, ...]:
    """A page layout without raw heads as the C page codec takes it (kvd.codec.batch): level code, axis,
    rotated, group, kernel matrix rows and cols, offsets of the data / scales / mins sections (0 if absent),
    page size, checksum seed, the constant prefix bytes (checksum zero), the page shape and the padding
    ranges to zero."""
    return _flat(_encode_layout(level, role, t, h, d, ()))


def _flat(lay: _Layout) -> tuple[object, ...]:
    off = {s.name: s.offset for s in lay.sections}
    data = off.get("raw", off.get("codes", off.get("packed", 0)))
    return (
        _LEVEL_CODE[lay.level], lay.axis, lay.rotated, lay.group, *lay.matrix, data, off.get("scales", 0),
        off.get("mins", 0), lay.size, lay.seed, lay.head, lay.shape, lay.gaps,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# input normalisation


def as_f16(x: object, name: str = "x") -> np.ndarray:
    """``x`` as a float16 numpy array: float16 as is, float32 and bfloat16 converted (float32 values beyond the
    float16 range are refused). Accepts numpy arrays and anything ``numpy.asarray`` takes (a CPU torch tensor)."""
    a = x if type(x) is np.ndarray else np.asarray(x)
    if a.dtype == np.float16:
        return a
    if a.dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            h = a.astype(np.float16)
        bad = np.isinf(h) & np.isfinite(a)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise NonFiniteError(f"{name}{list(idx)} = {float(a[idx])} is beyond the float16 range (+-65504)")
        return h
    if a.dtype.name == "bfloat16" and a.dtype.itemsize == 2:
        return bf16_bits_to_f16(a.view(np.uint16), name)
    raise InvalidArgument(f"{name} must be float16, float32 or bfloat16, got {a.dtype}")


def bf16_bits_to_f16(bits: np.ndarray, name: str = "x") -> np.ndarray:
    """float16 from bfloat16 bit patterns held in a uint16 array (how bfloat16 travels without ml_dtypes)."""
    b = np.asarray(bits)
    if b.dtype != np.uint16 and b.dtype != np.int16:
        raise InvalidArgument(f"{name}: bfloat16 bits must be a 16-bit integer array, got {b.dtype}")
    return as_f16((b.view(np.uint16).astype(np.uint32) << 16).view(np.float32), name)


def _page_input(x: object) -> np.ndarray:
    a = as_f16(x)
    if a.ndim != 3:
        raise InvalidArgument(f"a page must be [T, H, D], got shape {a.shape}")
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _bytes_view(buf: object) -> memoryview:
    mv = memoryview(buf)  # type: ignore[arg-type]
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


# ---------------------------------------------------------------------------------------------------------
# encode


def encode(x: object, level: str, *, role: str, raw_heads: Sequence[int] = (), held_heads: Sequence[int] = (),
           held_level: str | None = None) -> bytes:
    """Encode ``x`` ``[T, H, D]`` at ``level`` (``"fp16"``, ``"q8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"q4"``).

    ``role`` is ``"key"`` or ``"value"`` (it selects the quantization axis). ``raw_heads`` are kept float16;
    ``held_heads`` are encoded at ``held_level``, a quantized level less compact than ``level`` (a q4 page with
    a few heads at q8: a version 2 page). Raises InvalidArgument for a bad shape, dtype, level, role or head
    list, NonFiniteError for NaN/Inf.
    """
    a = _page_input(x)
    t, h, d = a.shape
    buf = bytearray(_encode_layout(level, role, t, h, d, raw_heads, held_heads, held_level).size)
    encode_into(a, level, buf, role=role, raw_heads=raw_heads, held_heads=held_heads, held_level=held_level)
    return bytes(buf)


def encode_into(x: object, level: str, out: object, *, role: str, raw_heads: Sequence[int] = (),
                held_heads: Sequence[int] = (), held_level: str | None = None) -> int:
    """Encode like :func:`encode` into the writable buffer ``out`` (at least :func:`nbytes` long).

    Returns the number of bytes written. Nothing useful is left in ``out`` if it raises.
    """
    a = _page_input(x)
    t, h, d = a.shape
    lay = _encode_layout(level, role, t, h, d, raw_heads, held_heads, held_level)
    mv = _bytes_view(out)
    if mv.readonly:
        raise InvalidArgument("out must be a writable buffer")
    if len(mv) < lay.size:
        raise InvalidArgument(f"out holds {len(mv)} bytes, the page needs {lay.size}")
    v = lay.views(mv)
    rh = lay.raw_heads
    if level == "fp16":
        kernels.f16_copy_rows(a.reshape(lay.matrix), v["raw"])
    else:
        if rh:
            kernels.f16_copy_rows(np.ascontiguousarray(a[:, list(rh), :]).reshape(t, len(rh) * d), v["rawheads"])
        if lay.held is not None:
            sub = lay.held
            hv = {k[5:]: x for k, x in v.items() if k.startswith("held_")}
            _encode_matrix(sub, np.ascontiguousarray(a[:, list(lay.held_heads), :]).reshape(sub.matrix), hv)
        skip = rh + lay.held_heads
        if len(skip) < h:
            # np.delete can return odd strides for a size-1 head_dim (not C-contiguous): the kernel needs rows
            q = np.ascontiguousarray(np.delete(a, skip, axis=1)) if skip else a
            _encode_matrix(lay, q.reshape(lay.matrix), v)
    for lo, hi in lay.gaps:  # a reused buffer must not carry old bytes into the page (or out to a client)
        mv[lo:hi] = _ZEROS[: hi - lo]
    mv[: lay.prefix] = lay.head
    _SUM.pack_into(mv, _HEAD.size, xxhash.xxh3_64_intdigest(mv[lay.prefix : lay.size], lay.seed))
    return lay.size


def _encode_matrix(lay: _Layout, m: np.ndarray, v: dict[str, np.ndarray]) -> None:
    g = lay.group
    if lay.level == "q8":
        enc = kernels.q8_encode_rows if lay.axis == AXIS_TOKEN else kernels.q8_encode_cols
        enc(m, v["codes"], v["scales"], g)
    elif lay.level == "q4":
        if lay.axis == AXIS_TOKEN:
            kernels.q4_encode_rows(m, v["packed"], v["scales"], v["mins"], g, lay.rotated)
        else:
            kernels.q4_encode_cols(m, v["packed"], v["scales"], v["mins"], g)
    else:
        kernels.fp8_encode_rows(m, v["codes"], v["scales"], g, 0 if lay.level == "fp8_e4m3" else 1)


# ---------------------------------------------------------------------------------------------------------
# decode


def _decode_layout(mv: memoryview) -> _Layout:
    """The layout a page's header describes, fully checked (cached by the header's bytes)."""
    if len(mv) < HEADER_BYTES:
        raise CorruptPage(f"page of {len(mv)} bytes is shorter than its {HEADER_BYTES}-byte header")
    n_raw = mv[10] | (mv[11] << 8)
    prefix = _prefix_bytes(n_raw)
    n_held = 0
    if mv[4] == HELD_VERSION and len(mv) >= prefix + _HELD.size:
        n_held = mv[prefix] | (mv[prefix + 1] << 8)
        prefix = _prefix_bytes(n_raw, n_held)
    key = bytes(mv[: _HEAD.size])
    if prefix > HEADER_BYTES:
        key += bytes(mv[HEADER_BYTES:prefix])
    lay = _DECODE_LAYOUTS.get(key)
    if lay is not None:
        return lay
    magic, ver, lcode, axis, flags, group, n_raw, t, h, d, payload = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptPage(f"not a kvd page (magic {bytes(magic)!r})")
    if ver not in (FORMAT_VERSION, HELD_VERSION):
        raise UnsupportedVersion(
            f"page format version {ver} is not supported (this kvd reads {FORMAT_VERSION} and {HELD_VERSION})"
        )
    if lcode >= len(LEVELS):
        raise CorruptPage(f"unknown level code {lcode}")
    level = LEVELS[lcode]
    if not (1 <= t and 1 <= h and 1 <= d and (group >= 1 or level == "fp16") and flags & ~FLAG_ROTATED == 0):
        raise CorruptPage(f"inconsistent page header (T={t}, H={h}, D={d}, group={group}, flags={flags})")
    if level == "fp16":
        expect_axis = {AXIS_NONE}
    else:
        expect_axis = {AXIS_TOKEN} if level.startswith("fp8") else {AXIS_TOKEN, AXIS_CHANNEL}
    rotated = bool(flags & FLAG_ROTATED)
    if axis not in expect_axis or (rotated and (level != "q4" or axis != AXIS_TOKEN or d & (d - 1))):
        raise CorruptPage(f"inconsistent page header (level {level}, axis {axis}, flags {flags})")
    if n_raw > h or (level == "fp16" and n_raw):
        raise CorruptPage(f"inconsistent page header ({n_raw} raw heads of {h})")
    if len(mv) < prefix:
        raise CorruptPage("page truncated inside its raw-head list")
    rh = struct.unpack_from(f"<{n_raw}H", mv, HEADER_BYTES)
    if list(rh) != sorted(set(rh)) or (rh and rh[-1] >= h):
        raise CorruptPage(f"inconsistent raw-head list {rh} for {h} heads")
    at = _prefix_bytes(n_raw)
    if any(mv[HEADER_BYTES + 2 * n_raw : at]):
        raise CorruptPage("non-zero padding after the raw-head list")
    held = None
    if ver == HELD_VERSION:
        held = _held_block(mv, at, level, h, tuple(rh))
    try:
        lay = _build_layout(level, axis, rotated, group, t, h, d, tuple(rh), held)
    except InvalidArgument as e:
        raise CorruptPage(f"inconsistent page header: {e}") from None
    if payload != lay.size - prefix:
        raise CorruptPage(
            f"payload length {payload} does not match the header's shape (expected {lay.size - prefix})"
        )
    return _remember(_DECODE_LAYOUTS, key, lay)


def _held_block(mv: memoryview, at: int, level: str, h: int,
                rh: tuple[int, ...]) -> tuple[tuple[int, ...], str, int, int]:
    """The held-head block of a version 2 page at ``at``, checked."""
    if len(mv) < at + _HELD.size:
        raise CorruptPage("page truncated inside its held-head block")
    n_held, lcode, axis, group, zero = _HELD.unpack_from(mv, at)
    if len(mv) < _prefix_bytes(len(rh), n_held):
        raise CorruptPage("page truncated inside its held-head list")
    hh = struct.unpack_from(f"<{n_held}H", mv, at + _HELD.size)
    hl = LEVELS[lcode] if lcode < len(LEVELS) else "?"
    if (not n_held or zero or hl in ("?", "fp16") or _RUNG[hl] >= _RUNG.get(level, 0) or group < 1
            or axis not in ({AXIS_TOKEN} if hl.startswith("fp8") else {AXIS_TOKEN, AXIS_CHANNEL})):
        raise CorruptPage(f"inconsistent held-head block ({n_held} heads, level code {lcode}, axis {axis}, "
                          f"group {group}) in a {level} page")
    if list(hh) != sorted(set(hh)) or hh[-1] >= h or set(hh) & set(rh) or len(hh) + len(rh) > h:
        raise CorruptPage(f"inconsistent held-head list {hh} (raw heads {rh}) for {h} heads")
    if any(mv[at + _HELD.size + 2 * n_held : _prefix_bytes(len(rh), n_held)]):
        raise CorruptPage("non-zero padding after the held-head list")
    return tuple(hh), hl, axis, group


def header(buf: object) -> PageHeader:
    """Parse and check a page's header (not its checksum). Raises CorruptPage or UnsupportedVersion."""
    mv = _bytes_view(buf)
    lay = _decode_layout(mv)
    return lay.header(_SUM.unpack_from(mv, _HEAD.size)[0])


def _verified(buf: object) -> tuple[_Layout, memoryview]:
    mv = _bytes_view(buf)
    lay = _decode_layout(mv)
    if len(mv) != lay.size:
        raise CorruptPage(f"page is {len(mv)} bytes, its header says {lay.size}")
    if xxhash.xxh3_64_intdigest(mv[lay.prefix :], lay.seed) != _SUM.unpack_from(mv, _HEAD.size)[0]:
        raise CorruptPage("page checksum mismatch: the page was damaged")
    return lay, mv


def verify(buf: object) -> PageHeader:
    """Check a page's header, length and checksum without decoding it; its header. Raises CorruptPage or
    UnsupportedVersion (a page read back from disk is checked this way before it is served)."""
    lay, mv = _verified(buf)
    return lay.header(_SUM.unpack_from(mv, _HEAD.size)[0])


def decode(buf: object) -> np.ndarray:
    """Decode a page to a new float16 array ``[T, H, D]``. Raises CorruptPage, UnsupportedVersion."""
    lay, mv = _verified(buf)
    out = np.empty(lay.shape, np.float16)
    _decode_checked(lay, mv, out)
    return out


def decode_into(buf: object, out: np.ndarray) -> None:
    """Decode a page into ``out``, a writable C-contiguous float16 array of the page's shape ``[T, H, D]``."""
    lay, mv = _verified(buf)
    if not isinstance(out, np.ndarray) or out.dtype != np.float16 or out.shape != lay.shape:
        raise InvalidArgument(
            f"out must be a float16 array of shape {lay.shape}, "
            f"got {getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgument("out must be writable and C-contiguous")
    _decode_checked(lay, mv, out)


def _decode_checked(lay: _Layout, mv: memoryview, out: np.ndarray) -> None:
    t, h, d = lay.shape
    rh = lay.raw_heads
    v = lay.views(mv)
    if lay.level == "fp16":
        np.copyto(out.reshape(lay.matrix), v["raw"])
        return
    skip = rh + lay.held_heads
    if not skip:
        _decode_matrix(lay, v, out.reshape(lay.matrix))
        return
    if len(skip) < h:
        q = np.empty((t, h - len(skip), d), np.float16)
        _decode_matrix(lay, v, q.reshape(lay.matrix))
        out[:, [i for i in range(h) if i not in set(skip)], :] = q
    if rh:
        out[:, list(rh), :] = v["rawheads"].reshape(t, len(rh), d)
    if lay.held is not None:
        sub = lay.held
        q = np.empty(sub.shape, np.float16)
        _decode_matrix(sub, {k[5:]: x for k, x in v.items() if k.startswith("held_")}, q.reshape(sub.matrix))
        out[:, list(lay.held_heads), :] = q


def _decode_matrix(lay: _Layout, v: dict[str, np.ndarray], m: np.ndarray) -> None:
    g = lay.group
    if lay.level == "q8":
        dec = kernels.q8_decode_rows if lay.axis == AXIS_TOKEN else kernels.q8_decode_cols
        dec(v["codes"], v["scales"], m, g)
    elif lay.level == "q4":
        if lay.axis == AXIS_TOKEN:
            kernels.q4_decode_rows(v["packed"], v["scales"], v["mins"], m, g, lay.rotated)
        else:
            kernels.q4_decode_cols(v["packed"], v["scales"], v["mins"], m, g)
    else:
        kernels.fp8_decode_rows(v["codes"], v["scales"], m, g, 0 if lay.level == "fp8_e4m3" else 1)


__all__ = [
    "AXIS_CHANNEL", "AXIS_NONE", "AXIS_TOKEN", "FORMAT_VERSION", "GROUPS", "HEADER_BYTES", "HELD_VERSION",
    "LEVELS", "ROLES",
    "PageHeader", "as_f16", "bf16_bits_to_f16", "decode", "decode_into", "encode", "encode_into", "flat_layout",
    "header", "nbytes", "scheme", "verify",
]  # fmt: skip
