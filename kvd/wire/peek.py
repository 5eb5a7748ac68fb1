"""What is read of a request header without decoding it, for a server that must act on a message before (or
instead of) parsing it: the request id, to answer a header the strict decoder refused (or a refusal, ``Busy``,
without decoding 4,096 ids), and whether the request changes state, to drop the reads of a client that has left
and run its writes. Tolerant where the decoder is strict, bounded to the header's first ``_SALVAGE_BYTES``, and
never raises. Pure: no zmq.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvd.wire.messages import STATE_OPS
from kvd.wire.schema import MAX_REQUEST_ID

__all__ = ["changes_state", "salvage_request_id"]

_SALVAGE_BYTES = 4096  # where a refused header's id is looked for: kvd and sane clients put it near the start


def _salvage(head: memoryview, key: str) -> list[Any]:
    """The values of the top-level map's ``key`` entries, read tolerantly (strings as bytes, extension values
    skipped, nothing after the map looked at) within the first ``_SALVAGE_BYTES`` bytes. Never raises."""
    found: list[Any] = []
    wanted = (key.encode(), key)
    try:
        unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, ext_hook=lambda code, data: None,
                                    max_buffer_size=_SALVAGE_BYTES, max_ext_len=_SALVAGE_BYTES)
        unpacker.feed(bytes(head[:_SALVAGE_BYTES]))
        n = unpacker.read_map_header()
        for _ in range(n):
            if unpacker.unpack() in wanted:
                found.append(unpacker.unpack())
            else:
                unpacker.skip()
    except Exception:  # noqa: BLE001 - out of data, not a map, too deep: use what was read so far
        pass
    return found


def salvage_request_id(head: memoryview) -> int | None:
    """The request id of a header the strict decoder refused (a duplicate key, a trailing byte, invalid UTF-8,
    an extension type, a header over ``max_header_bytes``), so that its error reply can still name the request.
    None unless exactly one ``id`` key was seen within the first ``_SALVAGE_BYTES`` bytes and its value is a
    valid request id. Never raises."""
    found = _salvage(head, "id")
    if len(found) != 1:
        return None
    rid = found[0]
    return rid if type(rid) is int and 0 <= rid <= MAX_REQUEST_ID else None


def changes_state(head: memoryview) -> bool:
    """Whether a request header (not yet decoded) asks for more than a reply: its op is one of
    :data:`~kvd.wire.messages.STATE_OPS`, or cannot be told (then it is parsed as any request). Read within the
    header's first ``_SALVAGE_BYTES`` bytes. Never raises."""
    op = _leading_op(head)
    if op is None:
        found = _salvage(head, "op")
        if len(found) != 1 or not isinstance(found[0], bytes):
            return True
        op = found[0]
    try:
        return op.decode() in STATE_OPS
    except UnicodeDecodeError:
        return True


def _leading_op(head: memoryview) -> bytes | None:
    """The op of a header whose map starts with small integer entries and then ``op`` (kvd's encoder writes
    ``v``, ``id``, ``op`` first): a microsecond against a tolerant decode's six, for a server that reads a
    departed flooder's every message. None for any other start. (A second ``op`` later in the map makes the
    strict decoder refuse the request, so the first one decides what it can be.)"""
    b = bytes(head[:48])
    n = len(b)
    if not n:
        return None
    i = 1 if 0x80 <= b[0] <= 0x8F else 3 if b[0] == 0xDE else 0
    if not i:
        return None
    for _ in range(3):
        if i >= n or not 0xA0 <= b[i] <= 0xBF:
            return None
        end = i + 1 + (b[i] & 0x1F)
        if end >= n:
            return None
        key = b[i + 1:end]
        tag = b[end]
        if key == b"op":
            if not 0xA0 <= tag <= 0xBF or end + 1 + (tag & 0x1F) > n:
                return None
            return b[end + 1:end + 1 + (tag & 0x1F)]
        if tag <= 0x7F or tag == 0xC0:
            i = end + 1
        elif tag in _UINT_SIZES:
            i = end + 1 + _UINT_SIZES[tag]
        else:
            return None
    return None


_UINT_SIZES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
