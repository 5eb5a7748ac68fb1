"""The kvd wire protocol, sans-IO: messages to ZeroMQ frames and back, with limits (spec: docs/protocol.md).

Theory of operation. A message is a list of frames: frame 0 is a msgpack map (the header), the rest are raw
binary frames (tensors or encoded pages) whose meaning the header gives. Every message type is a frozen,
slotted dataclass that validates itself when built, so a message that exists is a valid message. Each class
lists its header fields as ``(name, check)`` pairs; one generic codec turns the fields into a header map and
back, and three classes with binary frames (:class:`AppendRequest`, :class:`GetReply`, :class:`GetPagesReply`)
add their own frame handling. Decoding checks, in order: frame count and header size (cheap, before msgpack
runs), msgpack with every container limit and no extension types, the header is a flat map with known keys,
the protocol version, then every field's type (:class:`ProtocolError`) and range (:class:`InvalidArgument`),
and finally each binary frame against the dtype and shape the header declares. Tensor frames become read-only
numpy views of the received buffers; outgoing tensors are sent as memoryviews of the caller's arrays, so no
payload byte is copied on either side. No zmq import here: the server and client own the sockets. The messages
small requests are made of (a get, an append, and their replies) are read first by flat functions that make the
same checks inline and hand anything unusual to the generic decoder, and written by a typed twin of them (see
"the fast path", at the end).

Layout: this module is the codec (opening frames, encoding, decoding) and the public module: it re-exports
the message classes (:mod:`kvd.wire.messages`), the constants, field checks and :class:`Limits`
(:mod:`kvd.wire.schema`), the routing functions (:mod:`kvd.wire.routing`) and what is read of a header
without decoding it (:mod:`kvd.wire.peek`). Import from here.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

import msgpack
import numpy as np
from msgpack.exceptions import StackError

from kvd._native import pure_requested
from kvd.errors import InvalidArgument, KvdError, MessageTooLarge, ProtocolError, UnsupportedVersion
from kvd.wire.messages import (  # noqa: F401 - messages re-exported: kvd.protocol is the public module
    _ALL,
    _DEFAULTS,
    _FIELD_NAMES,
    _GET_REPLIES,
    _REPLIES,
    REQUESTS,
    STATE_OPS,
    AppendReply,
    AppendRequest,
    AttendReply,
    AttendRequest,
    CalibrateReply,
    CalibrateRequest,
    DropReply,
    DropRequest,
    ErrorReply,
    ExplainReply,
    ExplainRequest,
    GetPagesReply,
    GetReply,
    GetRequest,
    HelloReply,
    HelloRequest,
    LengthReply,
    LengthRequest,
    LengthsReply,
    LengthsRequest,
    PingReply,
    PingRequest,
    RegisterReply,
    RegisterRequest,
    Reply,
    Request,
    StatsReply,
    StatsRequest,
    TopologyReply,
    TopologyRequest,
    _Message,
)
from kvd.wire.peek import changes_state, salvage_request_id  # noqa: F401 - re-exported
from kvd.wire.routing import owner, rendezvous_score  # noqa: F401 - kept importable as kvd.protocol.owner
from kvd.wire.schema import (  # noqa: F401 - constants re-exported: kvd.protocol is the public module
    _MIN_ARRAY_LEN,
    _MIN_HEADER_BYTES,
    CALIBRATION_STATES,
    DEFAULT_LIMITS,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_PAGES,
    DTYPES,
    GET_FORMATS,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_INDEX,
    MAX_LOOKUP,
    MAX_NAMESPACE_BYTES,
    MAX_POSITION,
    MAX_QUERIES,
    MAX_REQUEST_ID,
    MAX_SEQ_ID_BYTES,
    MAX_SHARDS,
    MAX_STATS_KEYS,
    MAX_TEXT_BYTES,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    SERVER_ROLES,
    Check,
    Frame,
    Limits,
    PageEntry,
    SeqId,
    as_array,
    byte_view,
    check_request_id,
    check_short_text,
    frame_tensor,
    int_in,
    is_int,
    packed_tensors,
    plain_int,
    show,
    tensor_frame,
    tensors_from_wire,
    text_in,
    wire_array,
    wire_dtype_name,
)

_PAYLOAD_NAMES = {
    c: tuple(f.name for f in fields(c) if f.name != "request_id" and f.name not in dict(c.FIELDS)) for c in _ALL
}  # the fields _from_payload fills (or their defaults)
_ENVELOPES: tuple[tuple[str, ...], ...] = (("v", "id", "op"), ("v", "id", "op", "ok"), ("v", "id", "ok"))
_KNOWN: dict[tuple[type[_Message], tuple[str, ...]], frozenset[str]] = {  # header keys each message may have
    (c, env): frozenset((*env, *(name for name, _ in (*c.FIELDS, *c.SET_ONLY)), *c.EXTRA_KEYS))
    for c in _ALL for env in _ENVELOPES
}


def error_reply(request_id: Any, exc: BaseException) -> ErrorReply:
    """The error reply for ``exc``; a non-kvd exception becomes code 1 (KvdError), naming its type."""
    if isinstance(exc, KvdError):
        code, name, message = exc.code, type(exc).__name__, str(exc)
    else:
        code, name, message = KvdError.code, "KvdError", f"internal error: {type(exc).__name__}: {exc}"
    raw = message.encode("utf-8", "replace")
    if len(raw) > MAX_ERROR_MESSAGE_BYTES:
        message = raw[: MAX_ERROR_MESSAGE_BYTES - 3].decode("utf-8", "ignore") + "..."
    else:
        message = raw.decode("utf-8")
    valid_id = is_int(request_id) and 0 <= int(request_id) <= MAX_REQUEST_ID
    return ErrorReply(request_id=int(request_id) if valid_id else None, code=code, error=name, message=message)


# ---- frames and msgpack: the checks before any field is looked at ---------------------------------------------


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed in a header")


def _pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("header has a map with a duplicate key")
    return out


def _declared_map_len(head: memoryview) -> int:
    """The entry count msgpack declares for a header that starts with a map (-1 if it does not)."""
    first = head[0] if len(head) else 0
    if 0x80 <= first <= 0x8F:
        return first & 0x0F
    if first == 0xDE and len(head) >= 3:
        return int.from_bytes(head[1:3], "big")
    if first == 0xDF and len(head) >= 5:
        return int.from_bytes(head[1:5], "big")
    return -1


def _has_nested_map(header: dict[Any, Any]) -> bool:
    for v in header.values():
        if type(v) is dict:
            return True
        if type(v) is list:
            for item in v:
                if type(item) is dict:
                    return True
    return False


@functools.lru_cache(maxsize=16)
def _unpack_options(max_bytes: int, max_array_len: int) -> dict[str, Any]:
    return dict(
        raw=False,
        strict_map_key=True,
        use_list=True,
        ext_hook=_refuse_ext,
        max_str_len=max_bytes,
        max_bin_len=max_bytes,
        max_ext_len=0,
        max_array_len=max_array_len,
        max_map_len=MAX_STATS_KEYS,
    )


def unpack_header(head: memoryview, *, max_bytes: int, max_array_len: int) -> Any:
    """The msgpack object in ``head`` with every container limit, no extension types and no duplicate map key.

    Raises :class:`ProtocolError` naming what msgpack refused (never anything else).
    """
    options = _unpack_options(max_bytes, max_array_len)
    try:
        header = msgpack.unpackb(head, **options)
        # duplicate keys: the top-level map is checked by its declared size; a header with nested maps (info
        # maps, topology shards: replies only) is decoded again with a hook that checks every map
        if type(header) is dict and (len(header) != _declared_map_len(head) or _has_nested_map(header)):
            header = msgpack.unpackb(head, object_pairs_hook=_pairs, **options)
    except KvdError:
        raise
    except Exception as exc:  # msgpack raises ValueError, TypeError, UnicodeDecodeError, StackError, ...
        why = str(exc)[:200] or ("nested too deeply" if isinstance(exc, StackError) else "")
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {why}") from None
    return header


# ---- opening a message -------------------------------------------------------------------------------------


def check_limits(sizes: Sequence[int], limits: Limits) -> None:
    """Frame count and sizes (``sizes[0]`` is the header) against ``limits``: :class:`MessageTooLarge` naming
    the limit."""
    if len(sizes) > limits.max_frames:
        raise MessageTooLarge(f"message has {len(sizes)} frames, more than max_frames {limits.max_frames}")
    if sizes[0] > limits.max_header_bytes:
        raise MessageTooLarge(f"header is {sizes[0]} bytes, more than max_header_bytes {limits.max_header_bytes}")
    total = sizes[0]
    max_frame = limits.max_frame_bytes
    for i in range(1, len(sizes)):
        size = sizes[i]
        total += size
        if size > max_frame:
            raise MessageTooLarge(f"frame {i} is {size} bytes, more than max_frame_bytes {max_frame}")
    if total > limits.max_message_bytes:
        raise MessageTooLarge(f"message is {total} bytes, more than max_message_bytes {limits.max_message_bytes}")


class DecodeContext:
    """What a failed decode could still read: the request id, for the error reply."""

    __slots__ = ("request_id",)

    def __init__(self) -> None:
        self.request_id: int | None = None


def open_message(frames: Any, limits: Limits, ctx: DecodeContext) -> tuple[dict[Any, Any], list[Frame]]:
    """Frame count and sizes, then msgpack: the checks shared by requests and replies."""
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError("a message is a non-empty list of frames (the header first)")
    head = byte_view(frames[0], "header frame")
    if head.nbytes > limits.max_header_bytes:
        ctx.request_id = salvage_request_id(head)
        raise MessageTooLarge(
            f"header is {head.nbytes} bytes, more than max_header_bytes {limits.max_header_bytes}"
        )
    try:
        header = unpack_header(
            head, max_bytes=limits.max_header_bytes, max_array_len=max(limits.max_pages, _MIN_ARRAY_LEN)
        )
    except ProtocolError:
        ctx.request_id = salvage_request_id(head)
        raise
    if type(header) is not dict:
        raise ProtocolError(f"header must be a msgpack map, got {show(header)}")
    rid = header.get("id")
    if type(rid) is int and 0 <= rid <= MAX_REQUEST_ID:
        ctx.request_id = rid  # from here on an error reply can name the request
    for key in header:
        if type(key) is not str:
            raise ProtocolError(f"header keys must be strings, got {show(key)}")
    if len(frames) > limits.max_frames:
        raise MessageTooLarge(f"message has {len(frames)} frames, more than max_frames {limits.max_frames}")
    views: list[Frame] = []
    sizes = [head.nbytes]
    for i in range(1, len(frames)):  # a pages reply has thousands: keep this loop lean
        frame = frames[i]
        # bytes are immutable and already ours, a 1-D byte memoryview is already a view: kept as they are
        if type(frame) is not bytes and not (
            type(frame) is memoryview and frame.format == "B" and frame.ndim == 1 and frame.c_contiguous
        ):
            frame = byte_view(frame, f"frame {i}")
        views.append(frame)
        sizes.append(len(frame))
    check_limits(sizes, limits)
    if type(header.get("v")) is not int and not is_int(header.get("v")):
        raise ProtocolError(f"header field v (protocol version) must be an integer, got {show(header.get('v'))}")
    return header, views


_packers = threading.local()  # a msgpack Packer per thread: packb builds one a call; a Packer is not thread-safe


def _packb(obj: Any) -> bytes:
    packer = getattr(_packers, "packer", None)
    if packer is None:  # this thread's first message
        packer = _packers.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    return packer.pack(obj)  # resets itself when it raises, too


# ---- encoding ------------------------------------------------------------------------------------------------


def _encode(msg: _Message, envelope: dict[str, Any], limits: Limits | None) -> list[Frame]:
    header = envelope
    for name, _check in msg.FIELDS:
        header[name] = getattr(msg, name)
    if msg.FRAMES == 0 and not msg.EXTRA_KEYS and not msg.SET_ONLY:
        out: list[Frame] = [_packb(header)]
    else:
        extra, frames = msg._payload()
        header.update(extra)
        out = [_packb(header), *frames]
    if limits is not None:
        check_limits([len(f) for f in out], limits)  # every frame is bytes or a 1-D byte memoryview
    return out


def encode_request(request: Request, limits: Limits | None = None) -> list[Frame]:
    """Frames for ``request`` (a DEALER sends them as one multipart message); tensors are not copied.

    With ``limits``, raises :class:`MessageTooLarge` if the message would not fit them.
    """
    if _TYPED is not None:  # a get or an append: the typed twin writes the same bytes (see "the fast path")
        frames = _TYPED.encode_request(request, limits)
        if frames is not None:
            return frames
    if type(request) not in REQUESTS.values():
        raise InvalidArgument(f"not a request message: {type(request).__name__}")
    return _encode(request, {"v": PROTOCOL_VERSION, "id": request.request_id, "op": request.OP}, limits)


def encode_reply(reply: Reply, limits: Limits | None = None) -> list[Frame]:
    """Frames for ``reply`` (pages and tensors are not copied). With ``limits``, raises
    :class:`MessageTooLarge` if the reply would not fit them (the server then sends that error instead)."""
    if _TYPED is not None:  # an fp16 get reply or an append reply: the same bytes, written by the typed twin
        frames = _TYPED.encode_reply(reply, limits)
        if frames is not None:
            return frames
    if isinstance(reply, ErrorReply):
        return _encode(reply, {"v": PROTOCOL_VERSION, "id": reply.request_id, "ok": False}, limits)
    if type(reply) not in (*_REPLIES.values(), GetReply, GetPagesReply):
        raise InvalidArgument(f"not a reply message: {type(reply).__name__}")
    return _encode(reply, {"v": PROTOCOL_VERSION, "id": reply.request_id, "op": reply.OP, "ok": True}, limits)


# ---- decoding ------------------------------------------------------------------------------------------------


def _check_version(header: Mapping[Any, Any]) -> None:
    if header["v"] != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"protocol version {header['v']} is not supported; this side speaks {PROTOCOL_VERSION}"
        )


def _build(
    cls: type[_Message], header: dict[Any, Any], frames: list[Frame], limits: Limits, envelope: tuple[str, ...]
) -> Any:
    """The message of class ``cls`` from a header already past :func:`_open`; validates every field once."""
    known = _KNOWN[cls, envelope]
    if not known.issuperset(header):  # one pass in C over the header's keys
        unknown = [str(k)[:80] for k in header if k not in known][:8]
        raise ProtocolError(f"{cls.OP or 'error reply'}: unknown header keys {unknown}")
    if cls.FRAMES is not None and len(frames) != cls.FRAMES:
        raise ProtocolError(
            f"{cls.OP or 'error reply'}: expected {cls.FRAMES} frames after the header, got {len(frames)}"
        )
    if "id" not in header:
        raise ProtocolError(f"{cls.OP or 'error reply'}: missing header field 'id'")
    rid = header["id"]
    msg = object.__new__(cls)
    setattr_ = object.__setattr__
    setattr_(
        msg,
        "request_id",
        None if rid is None and cls is ErrorReply else check_request_id("id", rid, ProtocolError),
    )
    defaults = _DEFAULTS[cls]
    optional = cls.OPTIONAL
    for name, check in cls.FIELDS:
        value = header.get(name)
        if value is None and name in optional:
            setattr_(msg, name, check(name, defaults[name], ProtocolError))  # normalises, e.g. details -> {}
        elif value is not None or name in header:
            setattr_(msg, name, check(name, value, ProtocolError))
        else:
            raise ProtocolError(f"{cls.OP or 'error reply'}: missing header field {name!r}")
    payload = cls._from_payload(header, frames, limits)
    for name in _PAYLOAD_NAMES[cls]:
        setattr_(msg, name, payload[name] if name in payload else defaults[name])
    msg._cross_check(wire=True)
    return msg


def _decode_request(frames: Any, limits: Limits, ctx: DecodeContext) -> Request:
    header, rest = open_message(frames, limits, ctx)
    _check_version(header)
    op = header.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise ProtocolError(f"op must be one of {', '.join(REQUESTS)}, got {show(op)}")
    return _build(REQUESTS[op], header, rest, limits, ("v", "id", "op"))


def decode_request(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Request:
    """The request in ``frames``, a list of bytes-like frames (header first, the ROUTER identity removed).

    Tensors and pages are zero-copy views of the frames (which they keep alive; read-only if the frames are).

    Raises :class:`ProtocolError` (malformed), :class:`MessageTooLarge`, :class:`UnsupportedVersion` or
    :class:`InvalidArgument` (a value out of range), each naming the field and value; never anything else.
    """
    request = _fast_request(frames, limits)
    return request if request is not None else _decode_request(frames, limits, DecodeContext())


def parse_request(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Request | ErrorReply:
    """Like :func:`decode_request`, but a bad request becomes the :class:`ErrorReply` to send back (carrying
    the request id whenever the header had a readable one). For the server loop: it never raises."""
    request = _fast_request(frames, limits)
    return request if request is not None else _parse_request(frames, limits)


def _parse_request(frames: Sequence[Any], limits: Limits) -> Request | ErrorReply:
    """:func:`parse_request` by the generic decoder alone."""
    ctx = DecodeContext()
    try:
        return _decode_request(frames, limits, ctx)
    except KvdError as exc:
        return error_reply(ctx.request_id, exc)


def decode_reply(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Reply:
    """The reply in ``frames`` (an :class:`ErrorReply` for a failed request: call ``.exception()``).

    Raises the same errors as :func:`decode_request` when the reply itself is malformed.
    """
    reply = _fast_reply(frames, limits)
    return reply if reply is not None else _decode_reply(frames, limits)


def _decode_reply(frames: Sequence[Any], limits: Limits) -> Reply:
    """The generic reply decoder: every reply, every check, every error."""
    header, rest = open_message(frames, limits, DecodeContext())
    ok = header.get("ok")
    if ok is False:  # the error reply is the same in every protocol version, so it is read whatever v says
        return _build(ErrorReply, header, rest, limits, ("v", "id", "ok"))
    if ok is not True:
        raise ProtocolError(f"reply field ok must be a boolean, got {show(ok)}")
    _check_version(header)
    op = header.get("op")
    if op == "get":
        fmt = header.get("format")
        if not isinstance(fmt, str) or fmt not in _GET_REPLIES:
            raise ProtocolError(f"get reply format must be one of {', '.join(GET_FORMATS)}, got {show(fmt)}")
        cls = _GET_REPLIES[fmt]
    elif isinstance(op, str) and op in _REPLIES:
        cls = _REPLIES[op]
    else:
        raise ProtocolError(f"reply op must be one of {', '.join(REQUESTS)}, got {show(op)}")
    return _build(cls, header, rest, limits, ("v", "id", "op", "ok"))


# ---- the fast path of the messages small requests are made of -------------------------------------------------
# Each side waits for the other, and wakes up to a message with cold caches: there every call and branch of the
# generic decoder costs several times its warm price (a 64 KiB get reply: ~7 us in a tight loop, ~30 us of the
# client's CPU per request in a real round trip; BENCHMARKS.md, "Wire"). So the messages of small requests, a
# get and an append and their replies, are read by one flat function each when their header has exactly the keys
# kvd's own client and server send. It checks everything the generic decoder checks, in the same terms, and
# returns None for anything else (another key set, a wrong type, a value out of range, a non-ASCII string, a
# frame over a limit), which the generic decoder then decodes or refuses with its own error. So the result is
# always the generic decoder's (tests/unit/test_protocol_fast.py compares the two on valid and broken messages).
# These Python functions have a typed twin, kvd.wire._flatwire (cython_ext/_flatwire.pyx), which is the fast path
# wherever it is built (always, with the kernels) unless KVD_PURE_PYTHON is set: the same checks compiled to C,
# reading the header's bytes without msgpack, two to four times cheaper with cold caches. It also writes these
# four messages (encode_request / encode_reply), byte for byte as the generic encoder does. The tests run every
# case against both twins.

_GET_REPLY_KEYS = frozenset(("v", "id", "op", "ok", "start", "end", "layers", "format", "dtype", "shape"))
_PACKED_GET_REPLY_KEYS = _GET_REPLY_KEYS | {"packed"}  # protocol 1.4: keys and values in one frame
_APPEND_REPLY_KEYS = frozenset(("v", "id", "op", "ok", "length"))
_FIXMAP = 0x80  # msgpack's first byte of a map of up to 15 entries is 0x80 + the count
_F16 = DTYPES["float16"]
_new, _set = object.__new__, object.__setattr__


def _byte_frame(frame: Any) -> bool:
    return type(frame) is bytes or (type(frame) is memoryview and frame.ndim == 1 and frame.format == "B"
                                    and frame.c_contiguous)


def _flat_header(frames: Any, limits: Limits, entries: tuple[int, ...]) -> tuple[dict[str, Any], int] | None:
    """For a flat path: the header map of ``frames`` and its size, if ``frames`` is a list or tuple whose header
    is a byte frame within ``max_header_bytes`` declaring a map of one of ``entries`` entries (one byte says so,
    before msgpack runs), and holding that many distinct keys (fewer: a duplicate key); else None."""
    head = frames[0]
    if not _byte_frame(head):
        return None
    size = len(head)
    if not 0 < size <= limits.max_header_bytes or head[0] - _FIXMAP not in entries:
        return None
    try:
        header = msgpack.unpackb(head, **_unpack_options(limits.max_header_bytes,
                                                         max(limits.max_pages, _MIN_ARRAY_LEN)))
    except Exception:  # noqa: BLE001 - the generic decoder says what is wrong
        return None
    if type(header) is not dict or len(header) != head[0] - _FIXMAP:
        return None
    return header, size


def _fast_reply_py(frames: Any, limits: Limits) -> AppendReply | GetReply | None:
    """An fp16 get reply or an append reply in kvd's own header shape, else None (see above)."""
    if type(frames) is not list and type(frames) is not tuple:
        return None
    n = len(frames)
    if n == 3:
        keys = _GET_REPLY_KEYS
    elif n == 2:
        keys = _PACKED_GET_REPLY_KEYS
    elif n == 1:
        keys = _APPEND_REPLY_KEYS
    else:
        return None
    # with the exact key set, no value of the accepted types below is a map (and max_frames is >= 3)
    opened = _flat_header(frames, limits, (len(keys),))
    if opened is None or opened[0].keys() != keys or (n == 2 and opened[0]["packed"] is not True):
        return None
    header, size = opened
    v, rid = header["v"], header["id"]
    if (header["ok"] is not True or type(v) is not int or v != PROTOCOL_VERSION
            or type(rid) is not int or not 0 <= rid <= MAX_REQUEST_ID):
        return None
    if n == 1:
        length = header["length"]
        if header["op"] != "append" or type(length) is not int or not 0 <= length <= MAX_POSITION:
            return None
        reply = _new(AppendReply)
        _set(reply, "request_id", rid)
        _set(reply, "length", length)
        _set(reply, "notice", None)  # (a reply with a notice takes the generic decoder)
        return reply
    start, end, layers, shape = header["start"], header["end"], header["layers"], header["shape"]
    if (header["op"] != "get" or header["format"] != "fp16" or header["dtype"] != "float16"
            or type(start) is not int or type(end) is not int or not 0 <= start <= end <= MAX_POSITION
            or type(layers) is not list or not layers or type(shape) is not list or len(shape) != 4):
        return None
    for layer in layers:
        if type(layer) is not int or not 0 <= layer <= MAX_INDEX:
            return None
    n_layers = len(layers)
    if len(set(layers)) != n_layers:
        return None
    shape_layers, tokens, heads, dim = shape
    if (type(shape_layers) is not int or type(tokens) is not int or type(heads) is not int or type(dim) is not int
            or shape_layers != n_layers or tokens != end - start or tokens > MAX_INDEX
            or not 1 <= heads <= MAX_INDEX or not 1 <= dim <= MAX_INDEX):
        return None
    tensors = _flat_tensors(frames, size, limits, (n_layers, tokens, heads, dim), _F16)
    if tensors is None:
        return None
    got = _new(GetReply)  # every field set below (GetReply.trusted, without its loop and keyword dict)
    _set(got, "request_id", rid)
    _set(got, "start", start)
    _set(got, "end", end)
    _set(got, "layers", tuple(layers))
    _set(got, "keys", tensors[0])
    _set(got, "values", tensors[1])
    _set(got, "dtype", "float16")
    _set(got, "packed", frames[1] if n == 2 else None)
    return got


def _flat_tensors(frames: Any, size: int, limits: Limits, dims: tuple[int, int, int, int],
                  kind: np.dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """The keys and values of a flat path's message: its two byte frames (or its one packed frame, keys then
    values, when the message has 2 frames) as arrays of ``dims`` and ``kind``, if each is exactly that size and
    the frame and message limits hold (``size``: the header's); else None."""
    need = dims[0] * dims[1] * dims[2] * dims[3] * kind.itemsize
    if len(frames) == 2:
        frame = frames[1]
        if (not _byte_frame(frame) or len(frame) != 2 * need or 2 * need > limits.max_frame_bytes
                or size + 2 * need > limits.max_message_bytes):
            return None
        return np.ndarray(dims, kind, frame), np.ndarray(dims, kind, frame, need)
    key_frame, value_frame = frames[1], frames[2]
    if (not _byte_frame(key_frame) or not _byte_frame(value_frame) or len(key_frame) != need
            or len(value_frame) != need or need > limits.max_frame_bytes
            or size + 2 * need > limits.max_message_bytes):
        return None
    return np.ndarray(dims, kind, key_frame), np.ndarray(dims, kind, value_frame)


_GET_REQUEST_KEYS = frozenset(("v", "id", "op", "namespace", "seq_id", "start", "end", "layers", "format"))
_PACKED_GET_REQUEST_KEYS = _GET_REQUEST_KEYS | {"packed"}  # on the wire only when true (protocol 1.1 / 1.4)
_APPEND_REQUEST_KEYS = frozenset(("v", "id", "op", "namespace", "seq_id", "offset", "dtype", "shape"))
# on the wire only when set: position and incarnation (protocol 1.3), notices (1.8, only when true)
_APPEND_REQUEST_MORE = frozenset(("position", "incarnation", "notices"))
_PACKED_APPEND_REQUEST_KEYS = _APPEND_REQUEST_KEYS | {"packed"}  # one frame of keys then values (protocol 1.4)
_PACKED_APPEND_REQUEST_ANY = _PACKED_APPEND_REQUEST_KEYS | _APPEND_REQUEST_MORE


def _fast_request_py(frames: Any, limits: Limits) -> AppendRequest | GetRequest | None:
    """A get or an append request in kvd's own client's header shape, else None (see above)."""
    if type(frames) is not list and type(frames) is not tuple:
        return None
    n = len(frames)
    if n == 1:
        opened = _flat_header(frames, limits, (9, 10))  # packed is sent only when true
    elif n == 3:
        opened = _flat_header(frames, limits, (8, 9, 10, 11))  # position, incarnation, notices only when set
    elif n == 2:
        opened = _flat_header(frames, limits, (9, 10, 11, 12))  # packed, and the three others when set
    else:
        return None
    if opened is None:
        return None
    header, size = opened
    if n == 1:
        if (header.keys() != _GET_REQUEST_KEYS and header.keys() != _PACKED_GET_REQUEST_KEYS) or (
                header["op"] != "get" or header.get("packed", True) is not True):
            return None
    elif n == 3:
        if not _APPEND_REQUEST_KEYS <= header.keys() <= _APPEND_REQUEST_KEYS | _APPEND_REQUEST_MORE or (
                header["op"] != "append"):
            return None
    elif not _PACKED_APPEND_REQUEST_KEYS <= header.keys() <= _PACKED_APPEND_REQUEST_ANY or (
            header["op"] != "append" or header["packed"] is not True):
        return None
    if n != 1 and header.get("notices", True) is not True:  # sent only when true
        return None
    v, rid, namespace, seq_id = header["v"], header["id"], header["namespace"], header["seq_id"]
    if (type(v) is not int or v != PROTOCOL_VERSION or type(rid) is not int or not 0 <= rid <= MAX_REQUEST_ID
            or type(namespace) is not str or not namespace.isascii()
            or not 0 < len(namespace) <= MAX_NAMESPACE_BYTES):
        return None
    if type(seq_id) is int:
        if not 0 <= seq_id <= MAX_POSITION:
            return None
    elif type(seq_id) is not str or not seq_id.isascii() or len(seq_id) > MAX_SEQ_ID_BYTES:
        return None
    if n == 1:
        return _fast_get_request(header, rid, namespace, seq_id)
    return _fast_append_request(header, frames, size, limits, rid, namespace, seq_id)


def _fast_get_request(header: dict[str, Any], rid: int, namespace: str, seq_id: SeqId) -> GetRequest | None:
    start, end, layers, fmt = header["start"], header["end"], header["layers"], header["format"]
    if type(start) is not int or not 0 <= start <= MAX_POSITION or (fmt != "fp16" and fmt != "pages"):
        return None
    if end is not None and (type(end) is not int or not start <= end <= MAX_POSITION):
        return None
    if layers is not None:
        if type(layers) is not list or not layers:
            return None
        for layer in layers:
            if type(layer) is not int or not 0 <= layer <= MAX_INDEX:
                return None
        if len(set(layers)) != len(layers):
            return None
        layers = tuple(layers)
    req = _new(GetRequest)
    _set(req, "request_id", rid)
    _set(req, "namespace", namespace)
    _set(req, "seq_id", seq_id)
    _set(req, "start", start)
    _set(req, "end", end)
    _set(req, "layers", layers)
    _set(req, "format", fmt)
    _set(req, "packed", "packed" in header)  # (True: the caller saw to it)
    return req


def _fast_append_request(header: dict[str, Any], frames: Any, size: int, limits: Limits, rid: int,
                         namespace: str, seq_id: SeqId) -> AppendRequest | None:
    offset, dtype, shape = header["offset"], header["dtype"], header["shape"]
    position, incarnation = header.get("position"), header.get("incarnation")
    if offset is not None and (type(offset) is not int or not 0 <= offset <= MAX_POSITION):
        return None
    if position is not None and (type(position) is not int or not 0 <= position <= MAX_POSITION):
        return None
    if incarnation is not None and (type(incarnation) is not str or not incarnation.isascii()
                                    or not 0 < len(incarnation) <= MAX_TEXT_BYTES):
        return None
    if type(dtype) is not str or dtype not in DTYPES or type(shape) is not list or len(shape) != 4:
        return None
    n_layers, tokens, heads, dim = shape
    if (type(n_layers) is not int or type(tokens) is not int or type(heads) is not int or type(dim) is not int
            or not 1 <= n_layers <= MAX_INDEX or not 1 <= tokens <= MAX_INDEX or not 1 <= heads <= MAX_INDEX
            or not 1 <= dim <= MAX_INDEX):
        return None
    tensors = _flat_tensors(frames, size, limits, (n_layers, tokens, heads, dim), DTYPES[dtype])
    if tensors is None:
        return None
    req = _new(AppendRequest)
    _set(req, "request_id", rid)
    _set(req, "namespace", namespace)
    _set(req, "seq_id", seq_id)
    _set(req, "keys", tensors[0])
    _set(req, "values", tensors[1])
    _set(req, "offset", offset)
    _set(req, "dtype", dtype)
    _set(req, "position", position)
    _set(req, "incarnation", incarnation)
    _set(req, "packed", len(frames) == 2)
    _set(req, "parent", None)  # (a request with a parent takes the generic decoder)
    _set(req, "notices", "notices" in header)  # (True: the caller saw to it)
    return req


def _load_typed() -> Any:
    """:mod:`kvd.wire._flatwire` (the fast path above compiled to C, typed) bound to this module's classes, or
    None where it is not built."""
    try:
        _flatwire = importlib.import_module("kvd.wire._flatwire")  # an extension: no stub for type checkers
    except ImportError:
        return None
    _flatwire.bind(GetReply, AppendReply, GetRequest, AppendRequest, DTYPES, PROTOCOL_VERSION, tensor_frame,
                   packed_tensors, MAX_INDEX, MAX_POSITION, MAX_NAMESPACE_BYTES, MAX_SEQ_ID_BYTES, MAX_TEXT_BYTES)
    return _flatwire


_TYPED = None if pure_requested(os.environ) else _load_typed()  # KVD_PURE_PYTHON: the Python twin
FAST_PATH = "python" if _TYPED is None else "typed"  # which twin reads the messages of small requests
_fast_reply = _fast_reply_py if _TYPED is None else _TYPED.fast_reply
_fast_request = _fast_request_py if _TYPED is None else _TYPED.fast_request
