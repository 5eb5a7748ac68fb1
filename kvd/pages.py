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
The numerics of each kernel are specified in :mod:`kvd.kernels_ref`; the byte layout in ``docs/formats.md``.

Raw heads (``raw_heads``) are stored as float16 inside an otherwise quantized page. Non-finite input is refused
(:class:`~kvd.errors.NonFiniteError`) at every level, fp16 included; a page whose header, length or checksum does
not hold is refused on decode (:class:`~kvd.errors.CorruptPage`), never decoded as garbage.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvd import kernels
from kvd.errors import CorruptPage, InvalidArgument, NonFiniteError, UnsupportedVersion

FORMAT_VERSION = 1
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

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.tokens, self.heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        return _prefix_bytes(len(self.raw_heads)) + self.payload_bytes


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _prefix_bytes(n_raw: int) -> int:
    return HEADER_BYTES + _align(2 * n_raw)


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


def _sections(
    level: str, axis: int, group: int, t: int, hq: int, d: int, n_raw: int
) -> list[tuple[str, type, tuple[int, ...]]]:
    """The payload's arrays in order: (name, dtype, shape). Each starts aligned to ALIGN_BYTES."""
    out: list[tuple[str, type, tuple[int, ...]]] = []
    if level == "fp16":
        return [("raw", np.float16, (t * (hq + n_raw), d))]
    if hq:
        if axis == AXIS_TOKEN:
            n, width = t * hq, d
            meta_shape = (n, _ng(d, group))
        else:
            n, width = t, hq * d
            meta_shape = (_ng(t, group), width)
        if level == "q4":
            out.append(("packed", np.uint8, (n, (width + 1) // 2)))
            out.append(("scales", np.float16, meta_shape))
            out.append(("mins", np.float16, meta_shape))
        else:
            out.append(("codes", np.int8 if level == "q8" else np.uint8, (n, width)))
            out.append(("scales", np.float16, meta_shape))
    if n_raw:
        out.append(("rawheads", np.float16, (t, n_raw * d)))
    return out


def _payload_bytes(sections: Iterable[tuple[str, type, tuple[int, ...]]]) -> int:
    total = 0
    for _, dt, shape in sections:
        total += _align(int(np.prod(shape)) * np.dtype(dt).itemsize)
    return total


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


def nbytes(level: str, T: int, H: int, D: int, *, role: str, raw_heads: Sequence[int] = ()) -> int:  # noqa: N803
    """The exact size in bytes of a page of ``T`` tokens, ``H`` heads, ``D`` head_dim encoded at ``level``."""
    _check_dims(T, H, D)
    rh = _check_raw_heads(raw_heads, H)
    axis, _ = scheme(level, role, D)
    n_raw = 0 if level == "fp16" else len(rh)
    return _prefix_bytes(n_raw) + _payload_bytes(_sections(level, axis, GROUPS[level], T, H - n_raw, D, n_raw))


# ---------------------------------------------------------------------------------------------------------
# input normalisation


def as_f16(x: object, name: str = "x") -> np.ndarray:
    """``x`` as a float16 numpy array: float16 as is, float32 and bfloat16 converted (float32 values beyond the
    float16 range are refused). Accepts numpy arrays and anything ``numpy.asarray`` takes (a CPU torch tensor)."""
    a = np.asarray(x)
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


# ---------------------------------------------------------------------------------------------------------
# encode


def encode(x: object, level: str, *, role: str, raw_heads: Sequence[int] = ()) -> bytes:
    """Encode ``x`` ``[T, H, D]`` at ``level`` (``"fp16"``, ``"q8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"q4"``).

    ``role`` is ``"key"`` or ``"value"`` (it selects the quantization axis). ``raw_heads`` are kept float16.
    Raises InvalidArgument for a bad shape, dtype, level or role, NonFiniteError for NaN/Inf.
    """
    a = _page_input(x)
    buf = bytearray(nbytes(level, *a.shape, role=role, raw_heads=raw_heads))
    encode_into(a, level, buf, role=role, raw_heads=raw_heads)
    return bytes(buf)


def _page_input(x: object) -> np.ndarray:
    a = as_f16(x)
    if a.ndim != 3:
        raise InvalidArgument(f"a page must be [T, H, D], got shape {a.shape}")
    _check_dims(*a.shape)
    return np.ascontiguousarray(a)


def encode_into(x: object, level: str, out: object, *, role: str, raw_heads: Sequence[int] = ()) -> int:
    """Encode like :func:`encode` into the writable buffer ``out`` (at least :func:`nbytes` long).

    Returns the number of bytes written. Nothing useful is left in ``out`` if it raises.
    """
    a = _page_input(x)
    t, h, d = a.shape
    rh = _check_raw_heads(raw_heads, h)
    axis, rotated = scheme(level, role, d)
    if level == "fp16":
        rh = ()
    n_raw = len(rh)
    hq = h - n_raw
    group = GROUPS[level]
    sections = _sections(level, axis, group, t, hq, d, n_raw)
    size = _prefix_bytes(n_raw) + _payload_bytes(sections)
    mv = memoryview(out).cast("B")
    if mv.readonly:
        raise InvalidArgument("out must be a writable buffer")
    if len(mv) < size:
        raise InvalidArgument(f"out holds {len(mv)} bytes, the page needs {size}")
    raw = np.frombuffer(mv, dtype=np.uint8, count=size)
    views = _views(raw, _prefix_bytes(n_raw), sections)

    if level == "fp16":
        kernels.f16_copy_rows(a.reshape(t * h, d), views["raw"])
    else:
        q = a if not n_raw else np.ascontiguousarray(np.delete(a, rh, axis=1))
        if n_raw:
            kernels.f16_copy_rows(a[:, list(rh), :].reshape(t, n_raw * d), views["rawheads"])
        if hq:
            _encode_quantized(q, level, axis, group, rotated, views)
    _write_header(raw, level, axis, group, rotated, t, h, d, rh, size - _prefix_bytes(n_raw))
    return size


def _encode_quantized(
    q: np.ndarray, level: str, axis: int, group: int, rotated: bool, v: dict[str, np.ndarray]
) -> None:
    t, hq, d = q.shape
    m = q.reshape(t * hq, d) if axis == AXIS_TOKEN else q.reshape(t, hq * d)
    if level == "q8":
        if axis == AXIS_TOKEN:
            kernels.q8_encode_rows(m, v["codes"], v["scales"], group)
        else:
            kernels.q8_encode_cols(m, v["codes"], v["scales"], group)
    elif level.startswith("fp8"):
        kernels.fp8_encode_rows(m, v["codes"], v["scales"], group, 0 if level == "fp8_e4m3" else 1)
    elif axis == AXIS_TOKEN:
        kernels.q4_encode_rows(m, v["packed"], v["scales"], v["mins"], group, rotated)
    else:
        kernels.q4_encode_cols(m, v["packed"], v["scales"], v["mins"], group)


def _views(
    raw: np.ndarray, offset: int, sections: list[tuple[str, type, tuple[int, ...]]]
) -> dict[str, np.ndarray]:
    views = {}
    for name, dt, shape in sections:
        n = int(np.prod(shape)) * np.dtype(dt).itemsize
        views[name] = raw[offset : offset + n].view(dt).reshape(shape)
        offset += _align(n)
    return views


def _write_header(
    raw: np.ndarray,
    level: str,
    axis: int,
    group: int,
    rotated: bool,
    t: int,
    h: int,
    d: int,
    rh: tuple[int, ...],
    payload: int,
) -> None:
    flags = FLAG_ROTATED if rotated else 0
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, _LEVEL_CODE[level], axis, flags, group, len(rh), t, h, d, payload)
    raw[: _HEAD.size] = np.frombuffer(head, np.uint8)
    pre = _prefix_bytes(len(rh))
    raw[HEADER_BYTES:pre] = 0
    if rh:
        raw[HEADER_BYTES : HEADER_BYTES + 2 * len(rh)] = np.frombuffer(struct.pack(f"<{len(rh)}H", *rh), np.uint8)
    raw[_HEAD.size : HEADER_BYTES] = np.frombuffer(_SUM.pack(_checksum(raw, pre)), np.uint8)


def _checksum(raw: np.ndarray, prefix: int) -> int:
    """xxh3-64 of the payload, seeded with the xxh3-64 of every header byte but the checksum itself."""
    seed = xxhash.xxh3_64_intdigest(
        memoryview(raw[: _HEAD.size]).tobytes() + memoryview(raw[HEADER_BYTES:prefix]).tobytes()
    )
    return xxhash.xxh3_64_intdigest(memoryview(raw[prefix:]), seed=seed)


# ---------------------------------------------------------------------------------------------------------
# decode


def header(buf: object) -> PageHeader:
    """Parse and check a page's header (not its checksum). Raises CorruptPage or UnsupportedVersion."""
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_BYTES:
        raise CorruptPage(f"page of {len(mv)} bytes is shorter than its {HEADER_BYTES}-byte header")
    magic, ver, lcode, axis, flags, group, n_raw, t, h, d, payload = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptPage(f"not a kvd page (magic {bytes(magic)!r})")
    if ver != FORMAT_VERSION:
        raise UnsupportedVersion(f"page format version {ver} is not supported (this kvd reads {FORMAT_VERSION})")
    if lcode >= len(LEVELS):
        raise CorruptPage(f"unknown level code {lcode}")
    level = LEVELS[lcode]
    if not (1 <= t and 1 <= h and 1 <= d and (group >= 1 or level == "fp16") and flags & ~FLAG_ROTATED == 0):
        raise CorruptPage(f"inconsistent page header (T={t}, H={h}, D={d}, group={group}, flags={flags})")
    expect_axis = (
        {AXIS_NONE}
        if level == "fp16"
        else ({AXIS_TOKEN} if level.startswith("fp8") else {AXIS_TOKEN, AXIS_CHANNEL})
    )
    rotated = bool(flags & FLAG_ROTATED)
    if axis not in expect_axis or (rotated and (level != "q4" or axis != AXIS_TOKEN or d & (d - 1))):
        raise CorruptPage(f"inconsistent page header (level {level}, axis {axis}, flags {flags})")
    if n_raw > h or (level == "fp16" and n_raw):
        raise CorruptPage(f"inconsistent page header ({n_raw} raw heads of {h})")
    pre = _prefix_bytes(n_raw)
    if len(mv) < pre:
        raise CorruptPage("page truncated inside its raw-head list")
    rh = struct.unpack_from(f"<{n_raw}H", mv, HEADER_BYTES)
    if list(rh) != sorted(set(rh)) or (rh and rh[-1] >= h):
        raise CorruptPage(f"inconsistent raw-head list {rh} for {h} heads")
    expect = _payload_bytes(_sections(level, axis, group, t, h - n_raw, d, n_raw))
    if payload != expect:
        raise CorruptPage(f"payload length {payload} does not match the header's shape (expected {expect})")
    (checksum,) = _SUM.unpack_from(mv, _HEAD.size)
    return PageHeader(FORMAT_VERSION, level, axis, rotated, group, t, h, d, tuple(rh), payload, checksum)


def _verified(buf: object) -> tuple[PageHeader, np.ndarray]:
    hd = header(buf)
    mv = memoryview(buf).cast("B")
    if len(mv) != hd.nbytes:
        raise CorruptPage(f"page is {len(mv)} bytes, its header says {hd.nbytes}")
    raw = np.frombuffer(mv, dtype=np.uint8)
    if _checksum(raw, _prefix_bytes(len(hd.raw_heads))) != hd.checksum:
        raise CorruptPage("page checksum mismatch: the page was damaged")
    return hd, raw


def decode(buf: object) -> np.ndarray:
    """Decode a page to a new float16 array ``[T, H, D]``. Raises CorruptPage, UnsupportedVersion."""
    hd, raw = _verified(buf)
    out = np.empty(hd.shape, np.float16)
    _decode_checked(hd, raw, out)
    return out


def decode_into(buf: object, out: np.ndarray) -> None:
    """Decode a page into ``out``, a writable C-contiguous float16 array of the page's shape ``[T, H, D]``."""
    hd, raw = _verified(buf)
    if not isinstance(out, np.ndarray) or out.dtype != np.float16 or out.shape != hd.shape:
        raise InvalidArgument(
            f"out must be a float16 array of shape {hd.shape}, "
            f"got {getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgument("out must be writable and C-contiguous")
    _decode_checked(hd, raw, out)


def _decode_checked(hd: PageHeader, raw: np.ndarray, out: np.ndarray) -> None:
    t, h, d = hd.shape
    n_raw = len(hd.raw_heads)
    hq = h - n_raw
    v = _views(raw, _prefix_bytes(n_raw), _sections(hd.level, hd.axis, hd.group, t, hq, d, n_raw))
    if hd.level == "fp16":
        np.copyto(out.reshape(t * h, d), v["raw"])
        return
    if not n_raw:
        _decode_quantized(hd, v, out)
        return
    if hq:
        q = np.empty((t, hq, d), np.float16)
        _decode_quantized(hd, v, q)
        keep = [i for i in range(h) if i not in set(hd.raw_heads)]
        out[:, keep, :] = q
    out[:, list(hd.raw_heads), :] = v["rawheads"].reshape(t, n_raw, d)


def _decode_quantized(hd: PageHeader, v: dict[str, np.ndarray], out: np.ndarray) -> None:
    t, hq, d = out.shape
    m = out.reshape(t * hq, d) if hd.axis == AXIS_TOKEN else out.reshape(t, hq * d)
    if hd.level == "q8":
        if hd.axis == AXIS_TOKEN:
            kernels.q8_decode_rows(v["codes"], v["scales"], m, hd.group)
        else:
            kernels.q8_decode_cols(v["codes"], v["scales"], m, hd.group)
    elif hd.level.startswith("fp8"):
        kernels.fp8_decode_rows(v["codes"], v["scales"], m, hd.group, 0 if hd.level == "fp8_e4m3" else 1)
    elif hd.axis == AXIS_TOKEN:
        kernels.q4_decode_rows(v["packed"], v["scales"], v["mins"], m, hd.group, hd.rotated)
    else:
        kernels.q4_decode_cols(v["packed"], v["scales"], v["mins"], m, hd.group)


# ---------------------------------------------------------------------------------------------------------
# assembling a range from pages (used by get(format="pages") readers)


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
    slot = {layer: i for i, layer in enumerate(order)}
    first = header(entries[0][2]) if entries else None
    h, d = (first.heads, first.head_dim) if first else (1, 1)
    keys = np.empty((len(order), end - start, h, d), np.float16)
    values = np.empty_like(keys)
    covered = np.zeros((len(order), end - start), bool)
    for layer, token0, kp, vp in entries:
        if layer not in slot:
            continue
        i = slot[layer]
        for page, dst in ((kp, keys), (vp, values)):
            hd = header(page)
            if (hd.heads, hd.head_dim) != (h, d):
                raise InvalidArgument(
                    f"page of layer {layer} at token {token0} has shape {hd.shape}, expected [*, {h}, {d}]"
                )
            lo, hi = max(start, token0), min(end, token0 + hd.tokens)
            if lo >= hi:
                continue
            if lo == token0 and hi == token0 + hd.tokens:
                decode_into(page, dst[i, lo - start : hi - start])
            else:
                dst[i, lo - start : hi - start] = decode(page)[lo - token0 : hi - token0]
            covered[i, lo - start : hi - start] = True
    if not covered.all():
        i, t = (int(v) for v in np.argwhere(~covered)[0])
        raise InvalidArgument(f"pages do not cover token {start + t} of layer {order[i]}")
    return keys, values
