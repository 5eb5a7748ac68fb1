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


def test_a_request_that_changes_state_is_told_from_its_header_without_decoding_it() -> None:
    """A server runs these for a client that has left (its writes are kept) and drops the rest unread."""
    from test_protocol import examples  # isort: skip  (tests/unit/test_protocol.py: one example per message)

    requests = {type(m).OP: m for m in examples().values() if type(m) in p.REQUESTS.values()}
    assert set(requests) == set(p.REQUESTS)  # an example of every request
    assert p.STATE_OPS == {"register", "append", "drop", "calibrate"}
    for op, message in requests.items():
        head = memoryview(bytes(p.encode_request(message)[0]))
        assert p.changes_state(head) is (op in p.STATE_OPS), op
    # in any key order (kvd's encoder writes v, id, op first; other clients need not)
    for fields in ({"op": "get", "v": 1, "id": 7}, {"v": 1, "namespace": "n", "op": "append", "id": 2**40},
                   {"v": 1, "id": 2**40, "seq_id": 5, "op": "drop"}, {"v": 1, "id": 300, "op": "lengths"}):
        assert p.changes_state(memoryview(packb(fields))) is (fields["op"] in p.STATE_OPS), fields
    # whatever cannot be told is taken as a write (then parsed, and answered, as any request)
    for head in (b"", b"\xc1", packb([1, 2]), packb({"v": 1, "id": 7}), packb({"op": 5}), packb({"op": b"\xff"}),
                 packb({"v": 1, "pad": "x" * 8192, "op": "ping"}),
                 packb({"v": 1, "op": "ping"})[:-2]):
        assert p.changes_state(memoryview(head)) is True, head[:40]
    assert p.changes_state(memoryview(packb({"v": 1, "id": 7, "op": "get", "x": msgpack.ExtType(5, b"ab")})))\
        is False
    # a second op makes the strict decoder refuse the request (a duplicate key): it never runs as a write
    twice = b"\x82" + fixstr(b"op") + fixstr(b"get") + fixstr(b"op") + fixstr(b"append")
    assert p.changes_state(memoryview(twice)) is False
    assert isinstance(p.parse_request([twice]), p.ErrorReply)
