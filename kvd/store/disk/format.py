"""The on-disk form of one spilled sequence (pure: bytes in, bytes out; no file I/O).

A spilled sequence is one file: a fixed prefix, a msgpack header, then the sequence's sealed records exactly as
they are in RAM (:mod:`kvd.store.pool`: key page, value page, 32-byte trailer), layer by layer and row by row,
then its hot tail as one fp16 key page and one fp16 value page per layer::

    | magic "KVDSEQ" 0x01 0x00 | header_len u32 | 0 u32 | header xxh3-64 u64 | header (msgpack) | records | tail |

Every byte is covered by a check: the header by its xxh3 in the prefix; each page by its own header and
checksum (docs/formats.md), so a page read back is verified exactly as a page received from the wire; each
record's 32-byte trailer (its history, not part of a page) by an xxh3 of all trailers in the header. A reader
trusts nothing else: the geometry (layout, page size, raw heads, record sizes) comes from the header and is
checked against the namespace the store has before any byte is used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from kvd.codec import pages
from kvd.errors import CorruptPage

__all__ = ["MAGIC", "PREFIX_BYTES", "MAX_HEADER_BYTES", "FORMAT", "SeqHeader", "encode_header", "parse_prefix",
           "parse_header", "record_sizes", "trailers_digest"]

MAGIC = b"KVDSEQ\x01\x00"
FORMAT = 1
_PREFIX = struct.Struct("<8sIIQ")  # magic, header length, zero, xxh3-64 of the header
PREFIX_BYTES = _PREFIX.size
MAX_HEADER_BYTES = 16 << 20  # a header lists one byte per record: 16 MiB covers any sequence a shard can hold
TRAILER_BYTES = 32


@dataclass(frozen=True, slots=True)
class SeqHeader:
    """What a spilled sequence's file says about it. ``fmts`` holds the current format code of every record,
    layer-major (``fmts[layer * rows + row]``); ``serial`` orders spills (higher: spilled later)."""

    namespace: str
    layout: tuple[int, int, int]  # (layers, kv heads, head_dim)
    page_tokens: int
    raw_layers: tuple[int, ...]
    raw_heads: tuple[int, ...]
    seq_id: str | int
    position: int
    sink_rows: int
    window_done: int
    length: int
    rows: int
    fmts: bytes
    tail_fill: int
    trailers: int  # xxh3-64 of every record's trailer, in file order
    serial: int
    sizes: tuple[int, ...] | None = None  # every record's bytes, when a calibration made them differ by layer

    def body_bytes(self) -> int:
        """Bytes after the header: records and tail pages."""
        return sum(record_sizes(self)) + self.tail_page_bytes() * 2 * self.layout[0]

    def tail_page_bytes(self) -> int:
        if not self.tail_fill:
            return 0
        return pages.nbytes("fp16", self.tail_fill, self.layout[1], self.layout[2], role="key")


def record_sizes(h: SeqHeader) -> list[int]:
    """The byte size of every record of ``h``, in file order: the header's ``sizes`` where it lists them, else
    from its geometry alone."""
    if h.sizes is not None:
        return list(h.sizes)
    layers, heads, dim = h.layout
    sizes: dict[int, int] = {}
    out = []
    for code in h.fmts:
        size = sizes.get(code)
        if size is None:
            if code >= len(pages.LEVELS):
                raise CorruptPage(f"spilled sequence {h.seq_id!r}: unknown page format code {code}")
            fmt = pages.LEVELS[code]
            rh = () if fmt == "fp16" else h.raw_heads
            size = sizes[code] = (pages.nbytes(fmt, h.page_tokens, heads, dim, role="key", raw_heads=rh)
                                  + pages.nbytes(fmt, h.page_tokens, heads, dim, role="value", raw_heads=rh)
                                  + TRAILER_BYTES)
        out.append(size)
    return out


def trailers_digest(records: Any) -> int:
    """xxh3-64 over the trailers of ``records`` (an iterable of buffers), in order."""
    h = xxhash.xxh3_64()
    for rec in records:
        h.update(memoryview(rec)[len(rec) - TRAILER_BYTES :])
    return h.intdigest()


def encode_header(h: SeqHeader) -> bytes:
    """The file's prefix and header."""
    body = msgpack.packb({
        "format": FORMAT, "namespace": h.namespace, "layout": list(h.layout), "page_tokens": h.page_tokens,
        "raw_layers": list(h.raw_layers), "raw_heads": list(h.raw_heads), "seq_id": h.seq_id,
        "position": h.position, "sink_rows": h.sink_rows, "window_done": h.window_done, "length": h.length,
        "rows": h.rows, "fmts": h.fmts, "tail_fill": h.tail_fill, "trailers": h.trailers, "serial": h.serial,
        **({"sizes": list(h.sizes)} if h.sizes is not None else {}),
    }, use_bin_type=True)  # fmt: skip
    return _PREFIX.pack(MAGIC, len(body), 0, xxhash.xxh3_64_intdigest(body)) + body


def parse_prefix(buf: bytes) -> tuple[int, int]:
    """``(header length, header digest)`` from a file's first :data:`PREFIX_BYTES`; CorruptPage if it is not
    a spilled sequence of this format."""
    if len(buf) < PREFIX_BYTES:
        raise CorruptPage(f"spill file is {len(buf)} bytes, shorter than its {PREFIX_BYTES}-byte prefix")
    magic, n, zero, digest = _PREFIX.unpack_from(buf)
    if magic != MAGIC or zero != 0:
        raise CorruptPage(f"not a kvd spill file of format {FORMAT} (magic {magic!r})")
    if not 0 < n <= MAX_HEADER_BYTES:
        raise CorruptPage(f"spill file header length {n} out of range")
    return n, digest


def _int(m: dict, key: str, lo: int = 0) -> int:
    v = m.get(key)
    if type(v) is not int or v < lo:
        raise CorruptPage(f"spill file header: {key} = {v!r}")
    return v


def _ints(m: dict, key: str) -> tuple[int, ...]:
    v = m.get(key)
    if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
        raise CorruptPage(f"spill file header: {key} = {v!r}")
    return tuple(v)


def parse_header(body: bytes, digest: int) -> SeqHeader:
    """Check ``body`` against ``digest`` and parse it; CorruptPage naming what does not hold."""
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise CorruptPage("spill file header checksum mismatch: the file was damaged")
    try:
        m = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=1 << 16,
                            max_bin_len=MAX_HEADER_BYTES, max_array_len=1 << 16, max_map_len=64, max_ext_len=0)
    except Exception as exc:  # noqa: BLE001 - any msgpack failure is a damaged header
        raise CorruptPage(f"spill file header does not decode: {exc}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else m
        raise CorruptPage(f"spill file header of an unknown format: {got!r}")
    layout = _ints(m, "layout")
    seq_id = m.get("seq_id")
    ns = m.get("namespace")
    fmts = m.get("fmts")
    if len(layout) != 3 or min(layout) < 1 or not isinstance(ns, str) or not ns \
            or not (isinstance(seq_id, str) or (type(seq_id) is int and seq_id >= 0)) \
            or not isinstance(fmts, bytes):
        raise CorruptPage("spill file header: bad namespace, layout, seq_id or fmts")
    h = SeqHeader(
        namespace=ns, layout=(layout[0], layout[1], layout[2]), page_tokens=_int(m, "page_tokens", 1),
        raw_layers=_ints(m, "raw_layers"), raw_heads=_ints(m, "raw_heads"), seq_id=seq_id,
        position=_int(m, "position"), sink_rows=_int(m, "sink_rows"), window_done=_int(m, "window_done"),
        length=_int(m, "length", 1), rows=_int(m, "rows"), fmts=fmts, tail_fill=_int(m, "tail_fill"),
        trailers=_int(m, "trailers"), serial=_int(m, "serial"),
        sizes=_ints(m, "sizes") if "sizes" in m else None,
    )  # fmt: skip
    if h.sizes is not None and (len(h.sizes) != len(fmts) or min(h.sizes, default=1 << 40) < 2 * pages.HEADER_BYTES
                                + TRAILER_BYTES):
        raise CorruptPage(f"spill file header of {h.seq_id!r}: record sizes do not fit its records")
    if len(fmts) != h.rows * h.layout[0] or h.length != h.rows * h.page_tokens + h.tail_fill \
            or h.tail_fill >= h.page_tokens:
        raise CorruptPage(f"spill file header of {h.seq_id!r}: rows, length and tail do not agree")
    return h
