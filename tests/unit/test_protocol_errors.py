"""Error replies name the request whenever its id could be read (issue 18, the protocol document): a duplicate
key, a trailing byte, invalid UTF-8, an extension type and an oversize header used to answer with id nil; and
an unknown op has exactly one code, ProtocolError (10)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvd.errors import InvalidArgument, MessageTooLarge, ProtocolError
from kvd.wire import protocol as p


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def fixstr(raw: bytes) -> bytes:
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


PING = packb({"v": 1, "id": 7, "op": "ping"})
# {"v": 1, "id": 7, "op": "ping", "op": "ping"}: a map of 4 entries with a repeated key
DUPLICATE_KEY = b"\x84" + PING[1:] + fixstr(b"op") + fixstr(b"ping")
# {"v": 1, "id": 7, "op": <the bytes ff fe as a str>}
INVALID_UTF8 = b"\x83" + fixstr(b"v") + b"\x01" + fixstr(b"id") + b"\x07" + fixstr(b"op") + fixstr(b"\xff\xfe")
EXT_TYPE = packb({"v": 1, "id": 7, "op": "ping", "x": msgpack.ExtType(5, b"ab")})
TIMESTAMP = packb({"v": 1, "id": 7, "op": "ping", "at": msgpack.Timestamp(1, 0)})
OVERSIZE = packb({"v": 1, "id": 7, "op": "ping", "pad": "x" * (128 * 1024)})

ECHOED = [
    ("duplicate key", [DUPLICATE_KEY], ProtocolError),
    ("trailing byte", [PING + b"\x00"], ProtocolError),
    ("invalid utf-8", [INVALID_UTF8], ProtocolError),
    ("extension type", [EXT_TYPE], ProtocolError),
    ("timestamp extension", [TIMESTAMP], ProtocolError),
    ("oversize header", [OVERSIZE], MessageTooLarge),
    ("id after an ext value", [packb({"v": 1, "x": msgpack.ExtType(1, b""), "id": 7, "op": "ping"})],
     ProtocolError),
]


@pytest.mark.parametrize(("frames", "cls"), [c[1:] for c in ECHOED], ids=[c[0] for c in ECHOED])
def test_a_refused_header_with_a_readable_id_is_answered_with_that_id(frames: list[bytes], cls: type) -> None:
    with pytest.raises(cls):
        p.decode_request(frames)
    reply = p.parse_request(frames)
    assert isinstance(reply, p.ErrorReply)
    assert reply.code == cls.code and reply.request_id == 7, reply
    # and the reply itself is a legal message a client decodes back with the id
    assert p.decode_reply(p.encode_reply(reply)).request_id == 7


NOT_ECHOED = [
    ("not msgpack", [b"\xc1"]),
    ("not a map", [packb([1, 7, "ping"])]),
    ("id repeated", [b"\x84" + fixstr(b"v") + b"\x01" + fixstr(b"id") + b"\x07" + fixstr(b"id") + b"\x08"
                     + fixstr(b"op") + fixstr(b"ping")]),
    ("id negative", [packb({"v": 1, "id": -7, "op": "ping"}) + b"\x00"]),
    ("id a string", [packb({"v": 1, "id": "7", "op": "ping"}) + b"\x00"]),
    ("id beyond the first 4 KiB", [packb({"v": 1, "pad": "x" * 5000, "id": 7, "op": "ping"}) + b"\x00"]),
    ("truncated before the id", [PING[:5]]),
]


@pytest.mark.parametrize("frames", [c[1] for c in NOT_ECHOED], ids=[c[0] for c in NOT_ECHOED])
def test_an_unreadable_or_ambiguous_id_is_answered_with_nil(frames: list[bytes]) -> None:
    reply = p.parse_request(frames)
    assert isinstance(reply, p.ErrorReply) and reply.request_id is None, reply


@pytest.mark.parametrize("op", ["frobnicate", "", 5, None, True, ["ping"], "PING", "error"])
def test_an_unknown_op_is_protocol_error_10_with_the_id(op: Any) -> None:
    reply = p.parse_request([packb({"v": 1, "id": 9, "op": op})])
    assert isinstance(reply, p.ErrorReply)
    assert (reply.code, reply.error, reply.request_id) == (10, "ProtocolError", 9)
    assert "op must be one of" in reply.message


@pytest.mark.parametrize("field", ["start", "end"])
def test_a_negative_position_is_reported_as_such_not_as_a_range_up_to_2_63(field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        p.GetRequest(request_id=1, namespace="m", seq_id="s", **{field: -1})
    assert str(info.value) == f"{field} must be >= 0, got -1"
    with pytest.raises(InvalidArgument, match=rf"{field} must be below 2\*\*63, got {2**63}"):
        p.GetRequest(request_id=1, namespace="m", seq_id="s", **{field: 2**63})
