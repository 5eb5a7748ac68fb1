"""kvd.wire.protocol's fast path for the messages small requests are made of (an fp16 get's reply, an append's,
a get request, an append request): it must give exactly what the generic decoder gives, value or error, on valid
messages and on every broken variant of them, and it must really be taken for the messages kvd sends. It has two
twins, the Python functions of kvd.wire.protocol and their typed build (kvd.wire._flatwire); every test runs with
each."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from kvd._native import pure_requested
from kvd.errors import KvdError, MessageTooLarge
from kvd.wire import protocol as p
from kvd.wire import schema

RNG = np.random.default_rng(19)
TYPED = p._load_typed()
TWINS = {"python": (p._fast_reply_py, p._fast_request_py),
         "typed": (None, None) if TYPED is None else (TYPED.fast_reply, TYPED.fast_request)}


@pytest.fixture(autouse=True, params=sorted(TWINS))
def twin(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once with each twin as the fast path of decode_reply, decode_request and parse_request."""
    reply, req = TWINS[request.param]
    assert reply is not None, "kvd.wire._flatwire is not built: setup.py builds it with the kernels"
    monkeypatch.setattr(p, "_fast_reply", reply)
    monkeypatch.setattr(p, "_fast_request", req)
    monkeypatch.setattr(p, "_TYPED", TYPED if request.param == "typed" else None)  # the encoders' twin
    return str(request.param)


def test_the_typed_twin_is_the_fast_path_unless_pure_python_is_asked_for() -> None:
    assert TYPED is not None
    assert p.FAST_PATH == ("python" if pure_requested() else "typed")


def get_frames(layers: tuple[int, ...] = (0, 3), start: int = 5, tokens: int = 4, heads: int = 2,
               dim: int = 8, request_id: int = 41, packed: bool = False) -> list[Any]:
    shape = (len(layers), tokens, heads, dim)
    keys = RNG.standard_normal(shape).astype(np.float16)
    values = RNG.standard_normal(shape).astype(np.float16)
    reply = p.GetReply(request_id=request_id, start=start, end=start + tokens, layers=layers, keys=keys,
                       values=values, packed=keys.tobytes() + values.tobytes() if packed else None)
    return [bytes(f) for f in p.encode_reply(reply)]


def append_frames(length: int = 77, request_id: int = 9) -> list[Any]:
    return [bytes(f) for f in p.encode_reply(p.AppendReply(request_id=request_id, length=length))]


def outcome(decode: Any, frames: Any, limits: p.Limits = p.DEFAULT_LIMITS) -> tuple[Any, ...]:
    """What a decoder makes of ``frames``: the reply's every field (arrays by shape, dtype, flags and bytes), or
    the error's class and message."""
    try:
        reply = decode(frames, limits)
    except KvdError as exc:
        return ("error", type(exc), str(exc))
    out: list[Any] = [type(reply)]
    for name in p._FIELD_NAMES[type(reply)]:
        value = getattr(reply, name)
        if isinstance(value, np.ndarray):
            value = (value.shape, value.dtype.str, value.flags.writeable, value.tobytes())
        out.append((name, value))
    return tuple(out)


def with_header(frames: list[Any], **changes: Any) -> list[Any]:
    """``frames`` with the header's fields changed (a value of ``DROP`` removes the key)."""
    header = msgpack.unpackb(frames[0])
    for key, value in changes.items():
        if value is DROP:
            header.pop(key)
        else:
            header[key] = value
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


DROP = object()


def strided(data: bytes) -> memoryview:
    """A 1-D byte view of ``data`` that is not contiguous (every other byte of a buffer twice its size)."""
    return memoryview(bytes(b for c in data for b in (c, 0)))[::2]

VALID = [
    pytest.param(get_frames(), id="get"),
    pytest.param(get_frames(layers=(7,), start=0, tokens=1, heads=8, dim=128, request_id=2**64 - 1), id="get 1x1"),
    pytest.param(get_frames(layers=(2, 1, 0), start=2**40, tokens=0), id="get no tokens"),
    pytest.param(get_frames(packed=True), id="get packed"),
    pytest.param(get_frames(layers=(2, 1, 0), start=7, tokens=0, packed=True), id="get packed no tokens"),
    pytest.param(append_frames(), id="append"),
    pytest.param(append_frames(length=0, request_id=0), id="append 0"),
    pytest.param(append_frames(length=2**63 - 1), id="append max"),
]


@pytest.mark.parametrize("frames", VALID)
def test_the_fast_path_is_taken_for_kvds_own_replies_and_agrees_with_the_generic_one(frames: list[Any]) -> None:
    assert p._fast_reply(frames, p.DEFAULT_LIMITS) is not None
    as_views = [memoryview(f) for f in frames]  # what a client hands over: views of the received frames
    assert p._fast_reply(as_views, p.DEFAULT_LIMITS) is not None
    for given in (frames, as_views, tuple(frames)):
        assert outcome(p.decode_reply, given) == outcome(p._decode_reply, given)
    assert outcome(p.decode_reply, frames)[0] in (p.GetReply, p.AppendReply)


def _get_variants() -> list[Any]:
    base = get_frames()
    header = msgpack.unpackb(base[0])
    out: list[Any] = []
    for key in header:
        out.append(pytest.param(with_header(base, **{key: DROP}), id=f"no {key}"))
    bad_values: dict[str, list[Any]] = {
        "v": [2, 0, True, "1", 1.0, None],
        "id": [-1, -2**63, True, "41", None, 1.5],
        "ok": [1, None, False, "true"],
        "op": ["append", 5, None, "GET"],
        "format": ["pages", None, b"fp16", "FP16"],
        "dtype": ["float32", "bfloat16", None, 16],
        "start": [-1, True, 2**63, None, 1.5, 6],
        "end": [4, 2**63, True, None, 10],
        "layers": [[], [0, 0], [-1, 3], [True, 3], [2**31, 3], "03", None, [0, 3.0], [[0], 3], [{"a": 1}, 3]],
        "shape": [[2, 4, 2], [2, 4, 2, 0], [2, 5, 2, 8], [3, 4, 2, 8], [True, 4, 2, 8], [2, 4, 2, 2**31],
                  "x", None, [2, 4, 2, 8, 1], [2.0, 4, 2, 8], [2, 4, {"h": 2}, 8]],
    }
    for key, values in bad_values.items():
        for value in values:
            out.append(pytest.param(with_header(base, **{key: value}), id=f"{key}={value!r}"))
    out.append(pytest.param(with_header(base, extra=1), id="extra key"))
    out.append(pytest.param(with_header(base, info={"a": 1}), id="extra nested map"))
    out.append(pytest.param(with_header(base, format=DROP, formats="fp16"), id="renamed key"))
    # a duplicate key: the map declares 10 entries, one of them a second "op"
    raw = base[0]
    header_items = list(msgpack.unpackb(raw).items())
    header_items[-1] = ("op", "get")
    dup = b"\x8a" + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in header_items)
    out.append(pytest.param([dup, *base[1:]], id="duplicate key"))
    out.append(pytest.param([raw + b"\x00", *base[1:]], id="trailing byte"))
    out.append(pytest.param([b"", *base[1:]], id="empty header"))
    out.append(pytest.param([raw, base[1][:-2], base[2]], id="short keys frame"))
    out.append(pytest.param([raw, base[1], base[2] + b"\x00\x00"], id="long values frame"))
    out.append(pytest.param([raw, bytearray(base[1]), base[2]], id="bytearray frame"))
    out.append(pytest.param([raw, memoryview(base[1]).cast("H"), base[2]], id="uint16 view frame"))
    # as many uint16 items as the frame needs bytes: the length in items matches, the bytes do not
    out.append(pytest.param([raw, memoryview(base[1] * 2).cast("H"), base[2]], id="uint16 view, items match"))
    out.append(pytest.param([with_header(base, shape=[2, 4, 2, 0])[0], b"", b""], id="no dims, empty frames"))
    out.append(pytest.param([with_header(base, shape=[2, 4, 0, 8])[0], b"", b""], id="no heads, empty frames"))
    out.append(pytest.param([raw, base[1]], id="two frames"))
    out.append(pytest.param([raw, base[1], base[2], b""], id="four frames"))
    out.append(pytest.param([bytearray(raw), *base[1:]], id="bytearray header"))
    out.append(pytest.param([strided(raw), *base[1:]], id="strided header view"))
    out.append(pytest.param([raw, strided(base[1]), base[2]], id="strided keys view"))
    return out


def _append_variants() -> list[Any]:
    base = append_frames()
    out: list[Any] = []
    for key in msgpack.unpackb(base[0]):
        out.append(pytest.param(with_header(base, **{key: DROP}), id=f"no {key}"))
    for value in [-1, True, 2**63, "3", None, 2.0]:
        out.append(pytest.param(with_header(base, length=value), id=f"length={value!r}"))
    out.append(pytest.param(with_header(base, op="get"), id="op=get"))
    out.append(pytest.param(with_header(base, ok=False), id="ok=false"))
    out.append(pytest.param(with_header(base, v=2), id="v=2"))
    out.append(pytest.param(with_header(base, extra="x"), id="extra key"))
    out.append(pytest.param(with_header(base, length=DROP, lenght=77), id="renamed key"))
    out.append(pytest.param([*base, b"x"], id="a frame too many"))
    # protocol 1.8: a reply with a notice is valid, and read by the generic decoder alone
    for value in ["needs calibration: pages compressed with the default protection", "", 5, None, True]:
        out.append(pytest.param(with_header(base, notice=value), id=f"notice={value!r}"[:40]))
    err = p.encode_reply(p.error_reply(9, KvdError("boom")))
    out.append(pytest.param([bytes(f) for f in err], id="an error reply"))
    return out


@pytest.mark.parametrize("frames", _get_variants() + _append_variants())
def test_a_broken_reply_gets_the_generic_decoders_answer(frames: Any) -> None:
    assert outcome(p.decode_reply, frames) == outcome(p._decode_reply, frames)


# (limits, whether they refuse a message of two 16 KiB frames)
LIMIT_CASES = [
    pytest.param(p.Limits(max_frame_bytes=16383), True, id="frame limit"),
    pytest.param(p.Limits(max_header_bytes=4096, max_message_bytes=32767), True, id="message limit"),
    pytest.param(p.Limits(max_frame_bytes=16384, max_header_bytes=4096, max_message_bytes=32768 + 4096), False,
                 id="just within"),
    pytest.param(p.Limits(max_frames=3), False, id="the fewest frames"),
]


@pytest.mark.parametrize(("limits", "refused"), LIMIT_CASES)
def test_the_fast_path_keeps_the_limits(limits: p.Limits, refused: bool) -> None:
    frames = get_frames(heads=8, dim=128)  # 2 layers x 4 tokens x 8 heads x 128 dims x 2 bytes = 16 KiB a frame
    assert outcome(p.decode_reply, frames, limits) == outcome(p._decode_reply, frames, limits)
    assert (outcome(p.decode_reply, frames, limits)[0] == "error") is refused


def test_the_fast_path_keeps_the_header_limit() -> None:
    frames = get_frames(layers=tuple(range(2000)), tokens=1, heads=1, dim=1)  # a header of about 6 KB
    assert 4096 < len(frames[0]) <= p.DEFAULT_MAX_HEADER_BYTES
    limits = p.Limits(max_header_bytes=4096)
    assert outcome(p.decode_reply, frames, limits) == outcome(p._decode_reply, frames, limits)
    assert outcome(p.decode_reply, frames, limits)[0] == "error"
    assert outcome(p.decode_reply, frames) == outcome(p._decode_reply, frames)


# ---- requests: a get and an append as kvd's client sends them --------------------------------------------------


def generic_decode(frames: Any, limits: p.Limits = p.DEFAULT_LIMITS) -> Any:
    return p._decode_request(frames, limits, p.DecodeContext())


def get_request(**fields: Any) -> list[Any]:
    base: dict[str, Any] = {"request_id": 12, "namespace": "ns", "seq_id": "seq-1"}
    return [bytes(f) for f in p.encode_request(p.GetRequest(**{**base, **fields}))]


def append_request(dtype: str = "float16", shape: tuple[int, ...] = (2, 3, 2, 8), **fields: Any) -> list[Any]:
    base: dict[str, Any] = {"request_id": 13, "namespace": "ns", "seq_id": "seq-1"}
    if dtype == "bfloat16":
        keys = RNG.integers(0, 2**16, shape, dtype=np.uint16)
        values = RNG.integers(0, 2**16, shape, dtype=np.uint16)
        fields["dtype"] = "bfloat16"
    else:
        keys = RNG.standard_normal(shape).astype(dtype)
        values = RNG.standard_normal(shape).astype(dtype)
    return [bytes(f) for f in p.encode_request(p.AppendRequest(keys=keys, values=values, **{**base, **fields}))]


VALID_REQUESTS = [
    pytest.param(get_request(), id="get"),
    pytest.param(get_request(seq_id=7, start=3, end=9, layers=(4, 0)), id="get int seq, range, layers"),
    pytest.param(get_request(seq_id="", format="pages", end=3), id="get pages, empty seq id"),
    pytest.param(get_request(namespace="n" * 256, seq_id="s" * 1024, start=2**63 - 1), id="get longest texts"),
    pytest.param(append_request(), id="append"),
    pytest.param(append_request("float32", offset=5, position=64), id="append f32, offset, position"),
    pytest.param(append_request("bfloat16", shape=(1, 1, 1, 1), incarnation="inc-1"), id="append bf16"),
    pytest.param(append_request(seq_id=2**63 - 1, offset=0, position=0, incarnation="i" * 1024), id="append most"),
    pytest.param(get_request(packed=True), id="get packed (1.4)"),
    pytest.param(get_request(format="pages", packed=True, layers=(1,)), id="get pages packed (1.1)"),
    pytest.param(append_request(packed=True), id="append packed (1.4)"),
    pytest.param(append_request("bfloat16", shape=(1, 1, 1, 1), packed=True, offset=2, position=1,
                                incarnation="inc"), id="append packed, every optional field"),
    pytest.param(append_request(notices=True), id="append notices (1.8)"),
    pytest.param(append_request(offset=2, position=1, incarnation="inc", notices=True),
                 id="append, every optional field"),
    pytest.param(append_request("float32", packed=True, offset=2, position=1, incarnation="inc", notices=True),
                 id="append packed, every optional field (1.8)"),
]


@pytest.mark.parametrize("frames", VALID_REQUESTS)
def test_the_fast_path_is_taken_for_kvds_own_requests_and_agrees_with_the_generic_one(frames: list[Any]) -> None:
    assert p._fast_request(frames, p.DEFAULT_LIMITS) is not None
    as_views = [memoryview(f) for f in frames]  # what the server hands over: views of the received frames
    assert p._fast_request(as_views, p.DEFAULT_LIMITS) is not None
    for given in (frames, as_views, tuple(frames)):
        assert outcome(p.decode_request, given) == outcome(generic_decode, given)
        assert outcome(p.parse_request, given) == outcome(p._parse_request, given)


def _variants(base: list[Any], bad_values: dict[str, list[Any]]) -> list[Any]:
    out: list[Any] = []
    for key in msgpack.unpackb(base[0]):
        out.append(pytest.param(with_header(base, **{key: DROP}), id=f"no {key}"))
    for key, values in bad_values.items():
        for value in values:
            out.append(pytest.param(with_header(base, **{key: value}), id=f"{key}={value!r}"[:60]))
    out.append(pytest.param(with_header(base, extra=1), id="extra key"))
    last = list(msgpack.unpackb(base[0]))[-1]
    out.append(pytest.param(with_header(base, **{last: DROP, "renamed": 1}), id="renamed key"))
    raw = base[0]
    items = list(msgpack.unpackb(raw).items())
    items[-1] = ("op", items[2][1])  # the map declares as many entries as before, one of them a second "op"
    dup = bytes([raw[0]]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in items)
    out.append(pytest.param([dup, *base[1:]], id="duplicate key"))
    out.append(pytest.param([raw + b"\x00", *base[1:]], id="trailing byte"))
    out.append(pytest.param([b"", *base[1:]], id="empty header"))
    out.append(pytest.param([bytearray(raw), *base[1:]], id="bytearray header"))
    out.append(pytest.param([strided(raw), *base[1:]], id="strided header view"))
    out.append(pytest.param([*base, b""], id="a frame too many"))
    return out


def _packed_get_variants() -> list[Any]:
    """A packed get reply (protocol 1.4) changed: its header as a request's is, its one frame of keys, values."""
    base = get_frames(packed=True)
    raw = base[0]
    return [*_variants(base, {"packed": [False, None, 1, "true"], "shape": [[2, 4, 2, 4], [2, 2, 2, 8]]}),
            pytest.param([raw, base[1][:-2]], id="short packed frame"),
            pytest.param([raw, base[1] + b"\x00\x00"], id="long packed frame"),
            pytest.param([raw, base[1][:256], base[1][256:]], id="packed in two frames"),
            pytest.param([raw, bytearray(base[1])], id="bytearray packed frame"),
            pytest.param([raw, memoryview(base[1]).cast("H")], id="uint16 view packed frame"),
            pytest.param([raw, strided(base[1])], id="strided packed view"),
            pytest.param([with_header(base, packed=DROP)[0], base[1]], id="two frames, not packed")]


@pytest.mark.parametrize("frames", _packed_get_variants())
def test_a_broken_packed_reply_gets_the_generic_decoders_answer(frames: Any) -> None:
    assert outcome(p.decode_reply, frames) == outcome(p._decode_reply, frames)


_TEXT_AND_IDS: dict[str, list[Any]] = {
    "v": [2, True, "1", None],
    "id": [-1, True, "12", None, 1.5],
    "namespace": ["", "n" * 257, "é", "é" * 200, 5, None, b"ns"],  # 200 characters, 400 bytes of UTF-8
    "seq_id": ["", "é", "é" * 600, "s" * 1025, -1, True, 2**63, None, 1.5, b"s", ["s"]],
}

GET_VARIANTS = _variants(get_request(end=8, layers=(0, 2)), {
    **_TEXT_AND_IDS,
    "op": ["append", "GET", None],
    "start": [-1, True, 2**63, None, 1.5, 9],
    "end": [-1, True, 2**63, 1.5, 7],
    "layers": [[], [0, 0], [-1], [True], [2**31], "0", [0, 1.0], [[0]], [None], [0, None]],
    "format": ["FP16", None, b"fp16", 1],
    "packed": [True, False, None, 1],
}) + _variants(get_request(), {"start": [5, 2**63], "end": [0, 4], "layers": [[3]], "format": ["pages"]})

APPEND_VARIANTS = _variants(append_request(position=4, incarnation="abc"), {
    **_TEXT_AND_IDS,
    "op": ["get", "APPEND", None],
    "offset": [-1, True, 2**63, 1.5, "5"],
    "position": [-1, True, 2**63, None, 1.5],
    "incarnation": ["", "é", "é" * 600, "i" * 1025, None, 5, b"abc"],
    "dtype": ["float64", "bfloat16", "float32", None, 16],
    "shape": [[2, 3, 2], [2, 3, 2, 0], [0, 3, 2, 8], [2, 0, 2, 8], [2, 3, 2, 9], [True, 3, 2, 8], [2, 3, 2, 2**31],
              "x", None, [2.0, 3, 2, 8]],
}) + _variants(append_request(), {"position": [0], "incarnation": ["x"], "notices": [True, False, None, 1]}) \
    + _variants(append_request(packed=True, offset=1), {"packed": [False, None, 1, "true"], "dtype": ["float32"],
                                                        "shape": [[2, 3, 2, 16], [2, 3, 4, 8], [2, 3, 2, 4]]}) \
    + _variants(append_request(notices=True, position=3), {"notices": [False, None, 1, "true", 0],
                                                           "position": [None]}) \
    + _variants(append_request(packed=True, notices=True, incarnation="x"), {"notices": [False, None, "yes"],
                                                                             "packed": [False]})


@pytest.mark.parametrize("frames", GET_VARIANTS + APPEND_VARIANTS)
def test_a_changed_or_broken_request_gets_the_generic_decoders_answer(frames: Any) -> None:
    assert outcome(p.decode_request, frames) == outcome(generic_decode, frames)
    assert outcome(p.parse_request, frames) == outcome(p._parse_request, frames)


@pytest.mark.parametrize("frames", [
    pytest.param(lambda b: [b[0], b[1][:-2], b[2]], id="short keys frame"),
    pytest.param(lambda b: [b[0], b[1], b[2] + b"\x00\x00"], id="long values frame"),
    pytest.param(lambda b: [b[0], bytearray(b[1]), b[2]], id="bytearray frame"),
    pytest.param(lambda b: [b[0], memoryview(b[1]).cast("H"), b[2]], id="uint16 view frame"),
    pytest.param(lambda b: [b[0], memoryview(b[1] * 2).cast("H"), b[2]], id="uint16 view, items match"),
    pytest.param(lambda b: [b[0], b[1], strided(b[2])], id="strided values view"),
    pytest.param(lambda b: b[:2], id="two frames"),
    pytest.param(lambda b: [with_header(b, shape=[2, 0, 2, 8])[0], b"", b""], id="no tokens, empty frames"),
    pytest.param(lambda b: [with_header(b, shape=[2, 3, 0, 8])[0], b"", b""], id="no heads, empty frames"),
])
def test_an_append_with_odd_frames_gets_the_generic_decoders_answer(frames: Any) -> None:
    given = frames(append_request())
    assert outcome(p.decode_request, given) == outcome(generic_decode, given)
    assert outcome(p.parse_request, given) == outcome(p._parse_request, given)


@pytest.mark.parametrize("frames", [
    pytest.param(lambda b: [b[0], b[1][:-2]], id="short packed frame"),
    pytest.param(lambda b: [b[0], b[1] + b"\x00\x00"], id="long packed frame"),
    pytest.param(lambda b: [b[0], b[1][:192], b[1][192:]], id="packed in two frames"),
    pytest.param(lambda b: [b[0], bytearray(b[1])], id="bytearray packed frame"),
    pytest.param(lambda b: [b[0], memoryview(b[1]).cast("H")], id="uint16 view packed frame"),
    pytest.param(lambda b: [b[0], strided(b[1])], id="strided packed view"),
    pytest.param(lambda b: b[:1], id="no frame"),
    pytest.param(lambda b: [with_header(b, shape=[2, 0, 2, 8])[0], b""], id="no tokens, empty frame"),
])
def test_a_packed_append_with_odd_frames_gets_the_generic_decoders_answer(frames: Any) -> None:
    given = frames(append_request(packed=True))
    assert outcome(p.decode_request, given) == outcome(generic_decode, given)
    assert outcome(p.parse_request, given) == outcome(p._parse_request, given)


@pytest.mark.parametrize(("limits", "refused"), LIMIT_CASES)
def test_the_request_fast_path_keeps_the_limits(limits: p.Limits, refused: bool) -> None:
    frames = append_request(shape=(2, 4, 8, 128))  # 16 KiB a frame
    assert outcome(p.decode_request, frames, limits) == outcome(generic_decode, frames, limits)
    assert outcome(p.parse_request, frames, limits) == outcome(p._parse_request, frames, limits)
    assert (outcome(p.decode_request, frames, limits)[0] == "error") is refused


# ---- random damage: every twin agrees with the generic decoder on headers changed byte by byte ------------------


def _damaged(header: bytes, rng: np.random.Generator) -> bytes:
    out = bytearray(header)
    kind = rng.integers(4)
    if kind == 0:  # one to three bytes replaced
        for _ in range(rng.integers(1, 4)):
            out[rng.integers(len(out))] = rng.integers(256)
    elif kind == 1:  # a byte replaced by a nearby value: a length, a count or an int one off
        i = rng.integers(len(out))
        out[i] = (out[i] + int(rng.choice([-1, 1]))) % 256
    elif kind == 2:
        del out[rng.integers(len(out)):]
    else:
        out.insert(rng.integers(len(out) + 1), rng.integers(256))
    return bytes(out)


@pytest.mark.parametrize("base", [
    pytest.param((get_frames(), p.decode_reply, p._decode_reply), id="get reply"),
    pytest.param((append_frames(), p.decode_reply, p._decode_reply), id="append reply"),
    pytest.param((get_request(end=8, layers=(0, 2)), p.decode_request, generic_decode), id="get request"),
    pytest.param((append_request(offset=3, position=4, incarnation="abc"), p.decode_request, generic_decode),
                 id="append request"),
    pytest.param((get_frames(packed=True), p.decode_reply, p._decode_reply), id="packed get reply"),
    pytest.param((get_request(end=8, packed=True), p.decode_request, generic_decode), id="packed get request"),
    pytest.param((append_request(offset=3, packed=True), p.decode_request, generic_decode),
                 id="packed append request"),
    pytest.param((append_request(offset=3, incarnation="abc", notices=True), p.decode_request, generic_decode),
                 id="append request with notices"),
])
def test_a_randomly_damaged_header_gets_the_generic_decoders_answer(base: Any) -> None:
    frames, decode, generic = base
    rng = np.random.default_rng(1234)
    fast = p._fast_reply if decode is p.decode_reply else p._fast_request
    taken = 0
    for _ in range(1500):
        given = [_damaged(frames[0], rng), *frames[1:]]
        assert outcome(decode, given) == outcome(generic, given), given[0]
        taken += fast(given, p.DEFAULT_LIMITS) is not None
    assert taken > 0  # some damage leaves a valid message of the same shape (an id, a count one off)


# ---- encoding: the typed twin writes the generic encoder's bytes ----------------------------------------------

INTS = (0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1)
TEXTS = ("n", "x" * 31, "x" * 32, "x" * 255, "x" * 256)


def _messages() -> list[Any]:
    """Get and append requests and replies with every field at the edges of msgpack's encodings."""
    out: list[Any] = []
    f16 = np.arange(2 * 3 * 2 * 4, dtype=np.float16).reshape(2, 3, 2, 4)
    for i, n in enumerate(INTS):
        text = TEXTS[i % len(TEXTS)]
        out.append(p.GetRequest(request_id=n, namespace=text, seq_id=n, start=n, end=None))
        out.append(p.GetRequest(request_id=2**64 - 1 - n, namespace="ns", seq_id=text + "s" * (i * 60),
                                start=0, end=n, layers=tuple(range(i * 6 + 1)), format=("fp16", "pages")[i % 2]))
        out.append(p.AppendRequest(request_id=n, namespace=text, seq_id=n if i % 2 else text, keys=f16, values=f16,
                                   offset=None if i % 3 else n, position=None if i % 4 else n,
                                   incarnation=None if i % 5 else "i" * (i * 90 + 1)))
        out.append(p.AppendReply(request_id=n, length=n))
        layers = tuple(range(i + 1))
        kv = np.zeros((len(layers), 2, 1, 8), np.float16)
        out.append(p.GetReply(request_id=n, start=n - min(n, 2) + 2 if n < 2**63 - 2 else n - 2,
                              end=(n - min(n, 2) + 2 if n < 2**63 - 2 else n - 2) + 2, layers=layers, keys=kv,
                              values=kv))
    for dtype in ("float32", "bfloat16"):
        arr = np.ones((1, 2, 3, 4), np.float32 if dtype == "float32" else np.uint16)
        out.append(p.AppendRequest(request_id=5, namespace="ns", seq_id=3, keys=arr, values=arr, dtype=dtype))
    for n in (15, 16, 64):  # a fixarray's most items, an array16's fewest, the typed twin's most layers
        out.append(p.GetRequest(request_id=1, namespace="ns", seq_id="s", layers=tuple(range(n))))
    empty = np.zeros((1, 0, 2, 4), np.float16)
    out.append(p.GetReply(request_id=1, start=7, end=7, layers=(3,), keys=empty, values=empty))
    # protocol 1.4: packed keys and values (and 1.1's packed pages asked for)
    for i, n in enumerate(INTS[::3]):
        out.append(p.GetRequest(request_id=n, namespace="ns", seq_id=n, end=n or None,
                                format=("fp16", "pages")[i % 2], packed=True))
        out.append(p.AppendRequest(request_id=n, namespace="ns", seq_id="s", keys=f16, values=f16 + 1,
                                   offset=None if i % 2 else n, position=None if i % 3 else n,
                                   incarnation=None if i % 2 else "inc", packed=True))
        # protocol 1.8: notices, packed or not, beside the other optional fields
        out.append(p.AppendRequest(request_id=n, namespace="ns", seq_id=n, keys=f16, values=f16,
                                   offset=None if i % 2 else n, position=None if i % 3 else n,
                                   incarnation=None if i % 2 else "inc", packed=bool(i % 2), notices=True))
        kv = np.arange(2 * (i + 1) * 2 * 8, dtype=np.float16).reshape(2, i + 1, 2, 8)
        out.append(p.GetReply(request_id=n, start=n - min(n, i + 1), end=n - min(n, i + 1) + i + 1 if n else i + 1,
                              layers=(0, 1), keys=kv[:, :, :1], values=kv[:, :, 1:],
                              packed=kv[:, :, :1].tobytes() + kv[:, :, 1:].tobytes()))
    out.append(p.GetReply(request_id=1, start=7, end=7, layers=(3,), keys=empty, values=empty, packed=b""))
    return out


def _generic(msg: Any, limits: p.Limits | None = None) -> Any:
    encode = p.encode_request if type(msg) in p.REQUESTS.values() else p.encode_reply
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(p, "_TYPED", None)
            return [bytes(f) for f in encode(msg, limits)]
    except KvdError as exc:
        return (type(exc), str(exc))


def _typed_encode(msg: Any, limits: p.Limits | None = None) -> Any:
    assert TYPED is not None
    encode = TYPED.encode_request if type(msg) in p.REQUESTS.values() else TYPED.encode_reply
    return encode(msg, limits)


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: type(m).__name__)
def test_the_typed_encoders_write_the_generic_encoders_bytes(msg: Any, twin: str) -> None:
    for limits in (None, p.DEFAULT_LIMITS):
        frames = _typed_encode(msg, limits)
        assert frames is not None
        assert [bytes(f) for f in frames] == _generic(msg, limits)
    decode = p.decode_request if type(msg) in p.REQUESTS.values() else p.decode_reply
    assert outcome(decode, [bytes(f) for f in frames])[0] is type(msg)  # and it reads back as what it was


def _declined() -> list[Any]:
    f16 = np.zeros((1, 1, 1, 8), np.float16)
    return [
        pytest.param(p.GetRequest(request_id=1, namespace="é", seq_id="s"), id="non-ASCII namespace"),
        pytest.param(p.GetRequest(request_id=1, namespace="ns", seq_id="é"), id="non-ASCII seq id"),
        pytest.param(p.GetRequest(request_id=1, namespace="ns", seq_id="s", layers=tuple(range(65))),
                     id="65 layers"),
        pytest.param(p.AppendRequest(request_id=1, namespace="ns", seq_id="s", keys=f16, values=f16,
                                     incarnation="é"), id="non-ASCII incarnation"),
        pytest.param(p.LengthRequest(request_id=1, namespace="ns", seq_id="s"), id="another request"),
        pytest.param(p.error_reply(3, KvdError("boom")), id="an error reply"),
        pytest.param(p.LengthReply(request_id=1, length=3), id="another reply"),
        pytest.param(p.AppendReply(request_id=1, length=3, notice="needs calibration"), id="a notice (1.8)"),
        # a server's own replies are built unchecked (trusted): values no check let through are the generic's
        pytest.param(p.AppendReply.trusted(request_id=1, length=-1), id="negative int"),
        pytest.param(p.AppendReply.trusted(request_id=1, length=True), id="bool for an int"),
    ]


@pytest.mark.parametrize("msg", _declined())
def test_what_the_typed_encoders_do_not_take_goes_to_the_generic_encoder(msg: Any, twin: str) -> None:
    assert _typed_encode(msg) is None
    encode = p.encode_request if type(msg) in p.REQUESTS.values() else p.encode_reply
    assert [bytes(f) for f in encode(msg)] == _generic(msg)


ENCODE_LIMITS = [  # each refuses a message of two 16 KiB tensor frames whose header is ``head`` bytes
    pytest.param(lambda head: p.Limits(max_frame_bytes=16383), id="frame limit"),
    pytest.param(lambda head: p.Limits(max_header_bytes=4096, max_message_bytes=32767), id="message limit"),
    pytest.param(lambda head: p.Limits(max_header_bytes=4096, max_message_bytes=head + 32768 - 1),
                 id="message limit by one byte"),
]


@pytest.mark.parametrize("limits", ENCODE_LIMITS)
def test_the_typed_encoders_keep_the_limits(limits: Any, twin: str) -> None:
    kv = np.zeros((2, 4, 8, 128), np.float16)  # 16 KiB a frame
    for msg in (p.AppendRequest(request_id=1, namespace="ns", seq_id="s", keys=kv, values=kv),
                p.GetReply(request_id=1, start=0, end=4, layers=(0, 1), keys=kv, values=kv)):
        refusing = limits(len(_generic(msg)[0]))
        assert _typed_encode(msg, refusing) is None
        assert _typed_encode(msg, p.Limits(max_header_bytes=4096, max_message_bytes=len(_generic(msg)[0]) + 32768,
                                           max_frame_bytes=16384)) is not None  # just within: taken
        encode = p.encode_request if type(msg) in p.REQUESTS.values() else p.encode_reply
        with pytest.raises(MessageTooLarge) as caught:
            encode(msg, refusing)
        assert _generic(msg, refusing) == (MessageTooLarge, str(caught.value))


def test_the_longest_header_the_typed_encoders_write_fits_every_header_limit(twin: str) -> None:
    assert TYPED is not None and TYPED.ROOM <= schema._MIN_HEADER_BYTES  # the smallest max_header_bytes allowed
    f16 = np.zeros((1, 1, 1, 8), np.float16)
    longest = [p.GetRequest(request_id=2**64 - 1, namespace="n" * 256, seq_id="s" * 1024, start=2**63 - 1,
                            end=2**63 - 1, layers=tuple(range(2**31 - 64, 2**31)), format="pages"),
               p.AppendRequest(request_id=2**64 - 1, namespace="n" * 256, seq_id="s" * 1024, keys=f16, values=f16,
                               offset=2**63 - 1, position=2**63 - 1, incarnation="i" * 1024, notices=True,
                               packed=True)]
    for msg in longest:
        frames = _typed_encode(msg)
        assert frames is not None and len(frames[0]) < TYPED.ROOM
        assert [bytes(f) for f in frames] == _generic(msg)
