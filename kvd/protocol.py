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
payload byte is copied on either side. No zmq import here: the server and client own the sockets.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import msgpack
import numpy as np
from msgpack.exceptions import StackError

from kvd.errors import (
    ConfigError,
    InvalidArgument,
    KvdError,
    MessageTooLarge,
    ProtocolError,
    UnsupportedVersion,
    error_for_code,
)

try:  # bfloat16 arrays need ml_dtypes; without it bfloat16 frames decode to their uint16 bit patterns
    from ml_dtypes import bfloat16 as _BF16_TYPE

    _BF16: np.dtype = np.dtype(_BF16_TYPE)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16 = np.dtype("<u2")

PROTOCOL_VERSION = 1  # the major version: a peer speaking another one is refused with UnsupportedVersion
PROTOCOL_MINOR = 0  # additions a client can discover through hello; never changes the meaning of old fields

_KIB = 1024
_MIB = 1024 * _KIB
DEFAULT_MAX_HEADER_BYTES = 128 * _KIB
DEFAULT_MAX_FRAME_BYTES = 256 * _MIB
DEFAULT_MAX_PAGES = 4096
DEFAULT_MAX_FRAMES = 1 + 2 * DEFAULT_MAX_PAGES
DEFAULT_MAX_MESSAGE_BYTES = DEFAULT_MAX_HEADER_BYTES + 2 * DEFAULT_MAX_FRAME_BYTES
MAX_NAMESPACE_BYTES = 256
MAX_SEQ_ID_BYTES = 1024
MAX_TEXT_BYTES = 1024  # shard ids, versions, level tags, explain reasons, stats strings
MAX_ERROR_MESSAGE_BYTES = 2048
MAX_STATS_KEYS = 1024
MAX_INDEX = 2**31 - 1  # layer indices and tensor dimensions fit a signed 32-bit integer
MAX_POSITION = 2**63 - 1  # token positions, lengths and integer seq_ids fit a signed 64-bit integer
MAX_REQUEST_ID = 2**64 - 1
_MIN_HEADER_BYTES = 4 * _KIB  # room for any fixed-size header with maximal strings and an error message
_MAX_MAP_LEN = MAX_STATS_KEYS
_MIN_ARRAY_LEN = 1024

DTYPES: dict[str, np.dtype] = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4"), "bfloat16": _BF16}
GET_FORMATS = ("fp16", "pages")

SeqId = str | int
Frame = bytes | memoryview


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Size limits of one side, in bytes and frames. The server announces its own in the hello reply.

    ``max_frames`` counts every frame of a message, the header included; a get-pages reply carries at most
    :attr:`max_pages` entries. Raises :class:`ConfigError` for limits no message could live within.
    """

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_frames: int = DEFAULT_MAX_FRAMES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        for name, low in (("max_header_bytes", _MIN_HEADER_BYTES), ("max_frame_bytes", 1), ("max_frames", 3)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_POSITION:
                raise ConfigError(f"Limits.{name} must be an integer in [{low}, 2**63), got {value!r}")
        m = self.max_message_bytes
        if isinstance(m, bool) or not isinstance(m, int) or not self.max_header_bytes <= m <= MAX_POSITION:
            raise ConfigError(f"Limits.max_message_bytes must be an integer >= max_header_bytes, got {m!r}")

    @property
    def max_pages(self) -> int:
        """Most entries in one get-pages reply: two frames each after the header."""
        return (self.max_frames - 1) // 2


DEFAULT_LIMITS = Limits()


# ---- field checks: (field name, value, exception for a wrong type) -> normalised value ------------------------
# A wrong type is a ProtocolError when it came off the wire and InvalidArgument when a caller built the message;
# a value of the right type out of its range is always InvalidArgument.

Check = Callable[[str, Any, type[KvdError]], Any]


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _is_int(value: Any) -> bool:
    if type(value) is int:  # the common case, first: this runs for every integer field
        return True
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _int_in(low: int, high: int, *, optional: bool = False) -> Check:
    def check(name: str, value: Any, exc: type[KvdError]) -> int | None:
        if value is None and optional:
            return None
        if not _is_int(value):
            raise exc(f"{name} must be an integer{' or nil' if optional else ''}, got {_show(value)}")
        value = int(value)
        if not low <= value <= high:
            raise InvalidArgument(f"{name} must be in [{low}, {high}], got {value}")
        return value

    return check


def _text(max_bytes: int, *, nonempty: bool = True) -> Check:
    def check(name: str, value: Any, exc: type[KvdError]) -> str:
        if not isinstance(value, str):
            raise exc(f"{name} must be a string, got {_show(value)}")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidArgument(f"{name} is not encodable as UTF-8: {value[:80]!r}") from None
        if size > max_bytes or (nonempty and size == 0):
            raise InvalidArgument(f"{name} must be {'1' if nonempty else '0'} to {max_bytes} bytes of UTF-8, "
                                  f"got {size} bytes: {value[:80]!r}")
        return value

    return check


def _bool(name: str, value: Any, exc: type[KvdError]) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise exc(f"{name} must be a boolean, got {_show(value)}")
    return bool(value)


_namespace = _text(MAX_NAMESPACE_BYTES)
_position = _int_in(0, MAX_POSITION)
_opt_position = _int_in(0, MAX_POSITION, optional=True)
_index = _int_in(0, MAX_INDEX)
_dim = _int_in(1, MAX_INDEX)
_size = _int_in(0, MAX_INDEX)
_short_text = _text(MAX_TEXT_BYTES)


def _request_id(name: str, value: Any, exc: type[KvdError]) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_REQUEST_ID:  # part of the envelope: always exc's class
        raise exc(f"{name} (request id) must be an integer in [0, 2**64), got {_show(value)}")
    return int(value)


_seq_text = _text(MAX_SEQ_ID_BYTES, nonempty=False)
_stat_text = _text(MAX_TEXT_BYTES, nonempty=False)
_stat_int = _int_in(-(2**63), MAX_REQUEST_ID)


def _seq_id(name: str, value: Any, exc: type[KvdError]) -> SeqId:
    if isinstance(value, str):
        return _seq_text(name, value, exc)
    if _is_int(value):
        return _position(name, value, exc)
    raise exc(f"{name} must be a string or a non-negative integer, got {_show(value)}")


def _sequence(name: str, value: Any, exc: type[KvdError]) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise exc(f"{name} must be an array, got {_show(value)}")
    return value


def _plain_int(value: Any, high: int) -> bool:
    """A Python int (not bool) in [0, high]: the fast path of the checks for long arrays."""
    return type(value) is int and 0 <= value <= high


def _layers(name: str, value: Any, exc: type[KvdError], *, optional: bool = True) -> tuple[int, ...] | None:
    if value is None and optional:
        return None
    items = tuple(_sequence(name, value, exc))
    if not all(_plain_int(v, MAX_INDEX) for v in items):
        items = tuple(_index(f"{name}[{i}]", v, exc) for i, v in enumerate(items))
    if not items:
        raise InvalidArgument(f"{name} must be nil or a non-empty array of layer indices, got []")
    if len(set(items)) != len(items):
        raise InvalidArgument(f"{name} lists a layer twice: {list(items)[:32]}")
    return items


def _required_layers(name: str, value: Any, exc: type[KvdError]) -> tuple[int, ...]:
    return _layers(name, value, exc, optional=False)  # type: ignore[return-value]


def _get_format(name: str, value: Any, exc: type[KvdError]) -> str:
    if not isinstance(value, str):
        raise exc(f"{name} must be a string, got {_show(value)}")
    if value not in GET_FORMATS:
        raise InvalidArgument(f"{name} must be one of {', '.join(GET_FORMATS)}, got {value[:80]!r}")
    return value


def _text_list(name: str, value: Any, exc: type[KvdError]) -> tuple[str, ...]:
    return tuple(_short_text(f"{name}[{i}]", v, exc) for i, v in enumerate(_sequence(name, value, exc)))


def _stat_scalar(name: str, value: Any, exc: type[KvdError]) -> Any:
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    if _is_int(value):
        return _stat_int(name, value, exc)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return _stat_text(name, value, exc)
    raise exc(f"{name} must be nil, a boolean, a number or a string, got {_show(value)}")


def _stat_array(name: str, value: Any, exc: type[KvdError], *, nested: bool) -> list[Any]:
    return [_stat_array(f"{name}[{i}]", v, exc, nested=False) if nested and isinstance(v, (list, tuple))
            else _stat_scalar(f"{name}[{i}]", v, exc) for i, v in enumerate(value)]


def _info(name: str, value: Any, exc: type[KvdError]) -> dict[str, Any]:
    """An open map (stats, explain details): each value a scalar, a map of scalars, or an array of scalars and
    arrays of scalars. At most 2 levels of containers under the map, so decoding work stays flat."""
    if not isinstance(value, Mapping):
        raise exc(f"{name} must be a map, got {_show(value)}")
    if len(value) > MAX_STATS_KEYS:
        raise InvalidArgument(f"{name} has {len(value)} keys, more than {MAX_STATS_KEYS}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        _short_text(f"{name} key", key, exc)
        where = f"{name}[{key[:80]!r}]"
        if isinstance(item, Mapping):
            out[key] = {_short_text(f"{where} key", k, exc): _stat_scalar(f"{where}[{k[:80]!r}]", v, exc)
                        for k, v in item.items()}
        elif isinstance(item, (list, tuple)):
            out[key] = _stat_array(where, item, exc, nested=True)
        else:
            out[key] = _stat_scalar(where, item, exc)
    return out


def _opt_info(name: str, value: Any, exc: type[KvdError]) -> dict[str, Any]:
    return {} if value is None else _info(name, value, exc)


# ---- tensors and frames --------------------------------------------------------------------------------------


def as_array(obj: Any, name: str = "array") -> np.ndarray:
    """A numpy view of ``obj`` (ndarray, DLPack tensor such as a CPU torch tensor, or buffer-protocol object).

    No copy is made; raises :class:`InvalidArgument` for anything else (a list would need a copy and a dtype).
    """
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__"):
        try:
            return np.from_dlpack(obj)
        except (TypeError, BufferError, RuntimeError, ValueError) as exc:
            raise InvalidArgument(f"{name}: cannot view {type(obj).__name__} through DLPack ({exc}); pass a "
                                  "bfloat16 tensor as its int16/uint16 bits with dtype='bfloat16'") from None
    try:
        return np.asarray(memoryview(obj))
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name} must be a numpy array or expose the buffer protocol or DLPack, "
                              f"got {type(obj).__name__}") from None


def _wire_dtype_name(arr: np.ndarray, name: str, declared: str | None) -> str:
    dt = arr.dtype
    if declared is not None:
        if declared not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {', '.join(DTYPES)}, got {declared!r}")
        bits_ok = dt.kind in "ui" and dt.itemsize == DTYPES[declared].itemsize  # raw bit patterns
        if not bits_ok and _wire_dtype_name(arr, name, None) != declared:
            raise InvalidArgument(f"{name} has dtype {dt}, which cannot be sent as {declared}")
        return declared
    if dt.kind == "f" and dt.itemsize in (2, 4):
        return "float16" if dt.itemsize == 2 else "float32"
    if dt.name == "bfloat16":
        return "bfloat16"
    raise InvalidArgument(f"{name} dtype must be one of {', '.join(DTYPES)}, got {dt}")


def _wire_array(arr: np.ndarray) -> np.ndarray:
    """C-contiguous and little-endian: the caller's array itself when it already is (the usual case)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


def _tensor_frame(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _byte_view(frame: Any, what: str) -> memoryview:
    try:
        view = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"{what} is not a bytes-like object: {type(frame).__name__}") from None
    if view.ndim != 1 or view.itemsize != 1:
        try:
            view = view.cast("B")
        except TypeError:
            raise ProtocolError(f"{what} is not a contiguous buffer") from None
    return view


def _shape(name: str, value: Any, exc: type[KvdError], *, min_dims: tuple[int, ...]) -> tuple[int, ...]:
    items = _sequence(name, value, exc)
    if len(items) != len(min_dims):
        raise exc(f"{name} must have {len(min_dims)} dimensions, got {len(items)}: {_show(value)}")
    pairs = enumerate(zip(items, min_dims, strict=True))
    return tuple((_dim if low else _size)(f"{name}[{i}]", v, exc) for i, (v, low) in pairs)


def _frame_tensor(view: Frame, what: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    # Python integers do not overflow; implementations in other languages must check (docs/protocol.md).
    need = math.prod(shape) * DTYPES[dtype].itemsize
    if len(view) != need:
        raise ProtocolError(f"{what} frame has {len(view)} bytes but shape {list(shape)} of {dtype} "
                            f"needs {need}")
    return np.frombuffer(view, dtype=DTYPES[dtype]).reshape(shape)


def _check_tensors(msg: Any, *, min_dims: tuple[int, ...], declared: str | None) -> None:
    keys = _wire_array(as_array(msg.keys, "keys"))
    values = _wire_array(as_array(msg.values, "values"))
    dtype = _wire_dtype_name(keys, "keys", declared)
    if _wire_dtype_name(values, "values", declared) != dtype or keys.dtype != values.dtype:
        raise InvalidArgument(f"keys and values must have the same dtype, got {keys.dtype} and {values.dtype}")
    if keys.shape != values.shape:
        raise InvalidArgument(f"keys and values must have the same shape, got {keys.shape} and {values.shape}")
    _shape("shape", list(keys.shape), InvalidArgument, min_dims=min_dims)
    object.__setattr__(msg, "keys", keys)
    object.__setattr__(msg, "values", values)
    object.__setattr__(msg, "dtype", dtype)


# ---- messages ------------------------------------------------------------------------------------------------

_FieldSpec = tuple[tuple[str, Check], ...]
_NS_SEQ: _FieldSpec = (("namespace", _namespace), ("seq_id", _seq_id))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Message:
    OP: ClassVar[str] = ""
    FIELDS: ClassVar[_FieldSpec] = ()  # header fields beside v / id / op / ok, in wire order
    EXTRA_KEYS: ClassVar[tuple[str, ...]] = ()  # header keys handled by _payload / _from_payload
    FRAMES: ClassVar[int | None] = 0  # binary frames after the header; None: the class counts them
    OPTIONAL: ClassVar[tuple[str, ...]] = ()  # FIELDS that may be absent or nil on the wire (= the default)

    request_id: int

    def __post_init__(self) -> None:
        _check_fields(self, InvalidArgument)

    def _cross_check(self, wire: bool = False) -> None:
        """Rules spanning several fields (InvalidArgument). ``wire``: the frames were already checked."""

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        return {}, []

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        return {}


def _check_fields(msg: _Message, exc: type[KvdError]) -> None:
    for name, check in msg.FIELDS:
        value = getattr(msg, name)
        normal = check(name, value, exc)
        if normal is not value:
            object.__setattr__(msg, name, normal)
    if not (isinstance(msg, ErrorReply) and msg.request_id is None):
        object.__setattr__(msg, "request_id", _request_id("id", msg.request_id, exc))
    msg._cross_check(wire=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloRequest(_Message):
    """Ask for the server's protocol version, limits and identity. Reply: :class:`HelloReply`."""

    OP = "hello"


@dataclass(frozen=True, slots=True, kw_only=True)
class PingRequest(_Message):
    """Liveness check; the reply has no fields. Reply: :class:`PingReply`."""

    OP = "ping"


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterRequest(_Message):
    """Store.register. Reply: :class:`RegisterReply`."""

    OP = "register"
    FIELDS = (("namespace", _namespace), ("num_layers", _dim), ("num_kv_heads", _dim), ("head_dim", _dim))
    namespace: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class AppendRequest(_Message):
    """Store.append of ``keys`` and ``values`` ``[L, T, H, D]`` (float16, float32 or bfloat16, same dtype).

    Arrays are kept as given (a C-contiguous little-endian array is never copied). ``dtype`` is inferred;
    pass it only to send integer arrays holding bfloat16 bit patterns. ``offset``: if set, the server applies
    the append only when the sequence's current length equals it (safe pipelining); else InvalidArgument.
    """

    OP = "append"
    FIELDS = (*_NS_SEQ, ("offset", _opt_position))
    OPTIONAL = ("offset",)
    EXTRA_KEYS = ("dtype", "shape")
    FRAMES = 2
    namespace: str
    seq_id: SeqId
    keys: Any
    values: Any
    offset: int | None = None
    dtype: str | None = None

    def _cross_check(self, wire: bool = False) -> None:
        if not wire:  # a decoded request's arrays were built from the frames with the declared dtype and shape
            _check_tensors(self, min_dims=(1, 1, 1, 1), declared=self.dtype)

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        return ({"dtype": self.dtype, "shape": list(self.keys.shape)},
                [_tensor_frame(self.keys), _tensor_frame(self.values)])

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        return _tensors_from_wire(header, frames, min_dims=(1, 1, 1, 1), dtypes=tuple(DTYPES))


def _tensors_from_wire(header: Mapping[str, Any], frames: list[Frame], *, min_dims: tuple[int, ...],
                       dtypes: Sequence[str]) -> dict[str, Any]:
    dtype = header.get("dtype")
    if not isinstance(dtype, str):
        raise ProtocolError(f"dtype must be a string, got {_show(dtype)}")
    if dtype not in dtypes:
        raise ProtocolError(f"dtype must be one of {', '.join(dtypes)}, got {dtype[:80]!r}")
    shape = _shape("shape", header.get("shape"), ProtocolError, min_dims=min_dims)
    keys = _frame_tensor(frames[0], "keys", dtype, shape)
    return {"keys": keys, "values": _frame_tensor(frames[1], "values", dtype, shape), "dtype": dtype}


@dataclass(frozen=True, slots=True, kw_only=True)
class GetRequest(_Message):
    """Store.get (``format="fp16"``, reply :class:`GetReply`) or get_pages (``"pages"``, :class:`GetPagesReply`).

    Tokens ``[start, end)`` (``end=None``: to the end) of ``layers`` (None: all, in order).
    """

    OP = "get"
    FIELDS = (*_NS_SEQ, ("start", _position), ("end", _opt_position), ("layers", _layers),
              ("format", _get_format))
    OPTIONAL = ("start", "end", "layers", "format")
    namespace: str
    seq_id: SeqId
    start: int = 0
    end: int | None = None
    layers: tuple[int, ...] | None = None
    format: str = "fp16"

    def _cross_check(self, wire: bool = False) -> None:
        if self.end is not None and self.end < self.start:
            raise InvalidArgument(f"start must be <= end, got start={self.start} end={self.end}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DropRequest(_Message):
    """Store.drop. Reply: :class:`DropReply`."""

    OP = "drop"
    FIELDS = _NS_SEQ
    namespace: str
    seq_id: SeqId


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthRequest(_Message):
    """Store.length. Reply: :class:`LengthReply`."""

    OP = "length"
    FIELDS = _NS_SEQ
    namespace: str
    seq_id: SeqId


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsRequest(_Message):
    """Store.stats. Reply: :class:`StatsReply`."""

    OP = "stats"


@dataclass(frozen=True, slots=True, kw_only=True)
class ExplainRequest(_Message):
    """Store.explain of one token of one layer. Reply: :class:`ExplainReply`."""

    OP = "explain"
    FIELDS = (*_NS_SEQ, ("layer", _index), ("token", _position))
    namespace: str
    seq_id: SeqId
    layer: int
    token: int


_LIMIT_FIELDS = ("max_header_bytes", "max_frame_bytes", "max_frames", "max_message_bytes")


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloReply(_Message):
    """The server's protocol version, identity, page geometry and :class:`Limits` (:attr:`limits`)."""

    OP = "hello"
    FIELDS = (("protocol_version", _position), ("protocol_minor", _position), ("kvd_version", _short_text),
              ("page_format_version", _position), ("shard_id", _short_text), ("page_tokens", _dim),
              *((name, _position) for name in _LIMIT_FIELDS))
    protocol_version: int = PROTOCOL_VERSION
    protocol_minor: int = PROTOCOL_MINOR
    kvd_version: str
    page_format_version: int
    shard_id: str
    page_tokens: int
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_frames: int = DEFAULT_MAX_FRAMES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def _cross_check(self, wire: bool = False) -> None:
        try:
            self.limits  # noqa: B018 - validates
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None

    @property
    def limits(self) -> Limits:
        return Limits(**{name: getattr(self, name) for name in _LIMIT_FIELDS})

    @classmethod
    def for_limits(cls, limits: Limits, **fields: Any) -> HelloReply:
        return cls(**{name: getattr(limits, name) for name in _LIMIT_FIELDS}, **fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class PingReply(_Message):
    OP = "ping"


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterReply(_Message):
    OP = "register"


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendReply(_Message):
    """``length``: the sequence's length in tokens after the append."""

    OP = "append"
    FIELDS = (("length", _position),)
    length: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GetReply(_Message):
    """Decoded float16 ``keys`` and ``values`` ``[len(layers), end - start, H, D]`` of tokens [start, end)."""

    OP = "get"
    FIELDS = (("start", _position), ("end", _position), ("layers", _required_layers))
    EXTRA_KEYS = ("format", "dtype", "shape")
    FRAMES = 2
    start: int
    end: int
    layers: tuple[int, ...]
    keys: Any
    values: Any
    dtype: str = "float16"

    def _cross_check(self, wire: bool = False) -> None:
        if not wire:
            if self.dtype != "float16":
                raise InvalidArgument(f"a get reply carries float16 tensors, got dtype {self.dtype!r}")
            _check_tensors(self, min_dims=(1, 0, 1, 1), declared="float16")
        want = (len(self.layers), self.end - self.start)
        if self.end < self.start or self.keys.shape[:2] != want:
            raise InvalidArgument(f"tensor shape {list(self.keys.shape)} does not match {len(self.layers)} layers "
                                  f"and tokens [{self.start}, {self.end})")

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        return ({"format": "fp16", "dtype": self.dtype, "shape": list(self.keys.shape)},
                [_tensor_frame(self.keys), _tensor_frame(self.values)])

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        return _tensors_from_wire(header, frames, min_dims=(1, 0, 1, 1), dtypes=("float16",))


PageEntry = tuple[int, int, Any, Any]


def _page_entry(i: int, entry: Any) -> PageEntry:
    if type(entry) is tuple and len(entry) == 4 and _plain_int(entry[0], MAX_INDEX) \
            and _plain_int(entry[1], MAX_POSITION) and type(entry[2]) is bytes and type(entry[3]) is bytes:
        return entry  # the store's usual entry: bytes pages, sent as they are
    if not isinstance(entry, (list, tuple)) or len(entry) != 4:
        raise InvalidArgument(f"entries[{i}] must be (layer, token0, key_page, value_page), got {_show(entry)}")
    return (_index(f"entries[{i}].layer", entry[0], InvalidArgument),
            _position(f"entries[{i}].token0", entry[1], InvalidArgument),
            _byte_view(entry[2], f"entries[{i}] key page"), _byte_view(entry[3], f"entries[{i}] value page"))


@dataclass(frozen=True, slots=True, kw_only=True)
class GetPagesReply(_Message):
    """Stored pages covering tokens [start, end) of ``layers``: entries ``(layer, token0, key_page, value_page)``.

    Exactly Store.get_pages' entries. Pages are bytes-like: decoded replies hold the received frames themselves
    (bytes) or memoryviews of them, never copies.
    ``kvd.pages.assemble(entries, start, end, layers)`` rebuilds the float16 arrays (docs/formats.md).
    """

    OP = "get"
    FIELDS = (("start", _position), ("end", _position), ("layers", _required_layers))
    EXTRA_KEYS = ("format", "entries")
    FRAMES = None
    start: int
    end: int
    layers: tuple[int, ...]
    entries: tuple[PageEntry, ...]

    def _cross_check(self, wire: bool = False) -> None:
        if self.end < self.start:
            raise InvalidArgument(f"start must be <= end, got start={self.start} end={self.end}")
        entries = self.entries
        if not wire:
            listed = _sequence("entries", entries, InvalidArgument)
            entries = tuple(_page_entry(i, e) for i, e in enumerate(listed))
            object.__setattr__(self, "entries", entries)
        seen: set[tuple[int, int]] = set()
        allowed = set(self.layers)
        for i, (layer, token0, kpage, vpage) in enumerate(entries):
            if layer not in allowed or (layer, token0) in seen:
                raise InvalidArgument(f"entries[{i}] ({layer}, {token0}) is a duplicate or not in layers")
            seen.add((layer, token0))
            if not len(kpage) or not len(vpage):
                raise InvalidArgument(f"entries[{i}] ({layer}, {token0}) has an empty page")

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        frames: list[Frame] = []
        for entry in self.entries:
            frames += (entry[2], entry[3])
        return {"format": "pages", "entries": [[e[0], e[1]] for e in self.entries]}, frames

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        listed = _sequence("entries", header.get("entries"), ProtocolError)
        if len(listed) > limits.max_pages or len(frames) != 2 * len(listed):
            raise ProtocolError(f"entries lists {len(listed)} pages but {len(frames)} page frames follow "
                                f"(2 per entry, at most {limits.max_pages} entries)")
        entries = []
        for i, pair in enumerate(listed):
            if type(pair) is list and len(pair) == 2 and _plain_int(pair[0], MAX_INDEX) \
                    and _plain_int(pair[1], MAX_POSITION):  # fast path; the checks below name what is wrong
                entries.append((pair[0], pair[1], frames[2 * i], frames[2 * i + 1]))
                continue
            if not isinstance(pair, list) or len(pair) != 2:
                raise ProtocolError(f"entries[{i}] must be [layer, token0], got {_show(pair)}")
            layer = _index(f"entries[{i}].layer", pair[0], ProtocolError)
            entries.append((layer, _position(f"entries[{i}].token0", pair[1], ProtocolError),
                            frames[2 * i], frames[2 * i + 1]))
        return {"entries": tuple(entries)}


@dataclass(frozen=True, slots=True, kw_only=True)
class DropReply(_Message):
    """``dropped``: whether the sequence existed."""

    OP = "drop"
    FIELDS = (("dropped", _bool),)
    dropped: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthReply(_Message):
    OP = "length"
    FIELDS = (("length", _position),)
    length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsReply(_Message):
    """Store.stats() plus server counters; numpy scalars are turned into Python numbers."""

    OP = "stats"
    FIELDS = (("stats", _info),)
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExplainReply(_Message):
    """Store.explain: ``level`` (format tag), ``reasons``, and the store's other keys in ``details``."""

    OP = "explain"
    FIELDS = (("level", _short_text), ("reasons", _text_list), ("details", _opt_info))
    OPTIONAL = ("details",)
    level: str
    reasons: tuple[str, ...]
    details: dict[str, Any] | None = None  # normalised to a dict


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply(_Message):
    """A failed request: ``code`` (kvd.errors), ``error`` (class name), ``message``. ``request_id`` is None
    when the request was too malformed to read one. :meth:`exception` gives the matching kvd error."""

    FIELDS = (("code", _int_in(1, MAX_INDEX)), ("error", _short_text),
              ("message", _text(MAX_ERROR_MESSAGE_BYTES, nonempty=False)))
    request_id: int | None  # type: ignore[assignment]
    code: int
    error: str
    message: str

    def exception(self) -> KvdError:
        return error_for_code(self.code, self.message)


Request = (HelloRequest | PingRequest | RegisterRequest | AppendRequest | GetRequest | DropRequest | LengthRequest
           | StatsRequest | ExplainRequest)
Reply = (HelloReply | PingReply | RegisterReply | AppendReply | GetReply | GetPagesReply | DropReply | LengthReply
         | StatsReply | ExplainReply | ErrorReply)
REQUESTS: dict[str, type[_Message]] = {c.OP: c for c in (HelloRequest, PingRequest, RegisterRequest, AppendRequest,
                                                       GetRequest, DropRequest, LengthRequest, StatsRequest,
                                                       ExplainRequest)}
_REPLIES: dict[str, type[_Message]] = {c.OP: c for c in (HelloReply, PingReply, RegisterReply, AppendReply,
                                                       DropReply, LengthReply, StatsReply, ExplainReply)}
_GET_REPLIES: dict[str, type[_Message]] = {"fp16": GetReply, "pages": GetPagesReply}
_ALL = (*REQUESTS.values(), *_REPLIES.values(), *_GET_REPLIES.values(), ErrorReply)
_DEFAULTS = {c: {f.name: f.default for f in fields(c) if f.default is not MISSING} for c in _ALL}
_FIELD_NAMES = {c: tuple(f.name for f in fields(c)) for c in _ALL}


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
    valid_id = _is_int(request_id) and 0 <= int(request_id) <= MAX_REQUEST_ID
    return ErrorReply(request_id=int(request_id) if valid_id else None, code=code, error=name, message=message)


# ---- encoding ------------------------------------------------------------------------------------------------


def _encode(msg: _Message, envelope: dict[str, Any], limits: Limits | None) -> list[Frame]:
    header = envelope
    for name, _check in msg.FIELDS:
        header[name] = getattr(msg, name)
    extra, frames = msg._payload()
    header.update(extra)
    out: list[Frame] = [msgpack.packb(header, use_bin_type=True)]
    out += frames
    if limits is not None:
        _check_sizes([len(f) for f in out], limits)  # every frame is bytes or a 1-D byte memoryview
    return out


def encode_request(request: Request, limits: Limits | None = None) -> list[Frame]:
    """Frames for ``request`` (a DEALER sends them as one multipart message); tensors are not copied.

    With ``limits``, raises :class:`MessageTooLarge` if the message would not fit them.
    """
    if type(request) not in REQUESTS.values():
        raise InvalidArgument(f"not a request message: {type(request).__name__}")
    return _encode(request, {"v": PROTOCOL_VERSION, "id": request.request_id, "op": request.OP}, limits)


def encode_reply(reply: Reply, limits: Limits | None = None) -> list[Frame]:
    """Frames for ``reply`` (pages and tensors are not copied). With ``limits``, raises
    :class:`MessageTooLarge` if the reply would not fit them (the server then sends that error instead)."""
    if isinstance(reply, ErrorReply):
        return _encode(reply, {"v": PROTOCOL_VERSION, "id": reply.request_id, "ok": False}, limits)
    if type(reply) not in (*_REPLIES.values(), GetReply, GetPagesReply):
        raise InvalidArgument(f"not a reply message: {type(reply).__name__}")
    return _encode(reply, {"v": PROTOCOL_VERSION, "id": reply.request_id, "op": reply.OP, "ok": True}, limits)


# ---- decoding ------------------------------------------------------------------------------------------------


def _check_sizes(sizes: Sequence[int], limits: Limits) -> None:
    if len(sizes) > limits.max_frames:
        raise MessageTooLarge(f"message has {len(sizes)} frames, more than max_frames {limits.max_frames}")
    if sizes[0] > limits.max_header_bytes:
        raise MessageTooLarge(f"header is {sizes[0]} bytes, more than max_header_bytes {limits.max_header_bytes}")
    for i, size in enumerate(sizes[1:], 1):
        if size > limits.max_frame_bytes:
            raise MessageTooLarge(f"frame {i} is {size} bytes, more than max_frame_bytes {limits.max_frame_bytes}")
    if sum(sizes) > limits.max_message_bytes:
        raise MessageTooLarge(f"message is {sum(sizes)} bytes, more than max_message_bytes "
                              f"{limits.max_message_bytes}")


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed in a header")


def _pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("header has a map with a duplicate key")
    return out


class _Context:
    __slots__ = ("request_id",)

    def __init__(self) -> None:
        self.request_id: int | None = None


def _open(frames: Any, limits: Limits, ctx: _Context) -> tuple[dict[Any, Any], list[Frame]]:
    """Frame count and sizes, then msgpack: the checks shared by requests and replies."""
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError("a message is a non-empty list of frames (the header first)")
    head = _byte_view(frames[0], "header frame")
    if head.nbytes > limits.max_header_bytes:
        raise MessageTooLarge(f"header is {head.nbytes} bytes, more than max_header_bytes "
                              f"{limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(
            head, raw=False, strict_map_key=True, use_list=True, object_pairs_hook=_pairs, ext_hook=_refuse_ext,
            max_str_len=limits.max_header_bytes, max_bin_len=limits.max_header_bytes, max_ext_len=0,
            max_array_len=max(limits.max_pages, _MIN_ARRAY_LEN), max_map_len=_MAX_MAP_LEN)
    except KvdError:
        raise
    except Exception as exc:  # msgpack raises ValueError, TypeError, UnicodeDecodeError, StackError, ...
        why = str(exc)[:200] or ("nested too deeply" if isinstance(exc, StackError) else "")
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}: {why}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {_show(header)}")
    rid = header.get("id")
    if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_REQUEST_ID:
        ctx.request_id = rid  # from here on an error reply can name the request
    for key in header:
        if not isinstance(key, str):
            raise ProtocolError(f"header keys must be strings, got {_show(key)}")
    if len(frames) > limits.max_frames:
        raise MessageTooLarge(f"message has {len(frames)} frames, more than max_frames {limits.max_frames}")
    views: list[Frame] = [head]
    for i, frame in enumerate(frames[1:], 1):  # a pages reply has thousands: keep this loop lean
        # bytes are immutable and already ours: kept as they are (no view needed, no copy made)
        views.append(frame if type(frame) is bytes else _byte_view(frame, f"frame {i}"))
    _check_sizes([len(v) for v in views], limits)
    version = header.get("v")
    if not _is_int(version):
        raise ProtocolError(f"header field v (protocol version) must be an integer, got {_show(version)}")
    return header, views[1:]


def _check_version(header: Mapping[Any, Any]) -> None:
    if header["v"] != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {header['v']} is not supported; this side speaks "
                                 f"{PROTOCOL_VERSION}")


def _build(cls: type[_Message], header: dict[Any, Any], frames: list[Frame], limits: Limits,
           envelope: tuple[str, ...]) -> Any:
    """The message of class ``cls`` from a header already past :func:`_open`; validates every field once."""
    where = cls.OP or "error reply"
    known = {*envelope, *(name for name, _ in cls.FIELDS), *cls.EXTRA_KEYS}
    unknown = [key for key in header if key not in known]
    if unknown:
        raise ProtocolError(f"{where}: unknown header keys {[str(k)[:80] for k in unknown[:8]]}")
    if cls.FRAMES is not None and len(frames) != cls.FRAMES:
        raise ProtocolError(f"{where}: expected {cls.FRAMES} frames after the header, got {len(frames)}")
    if "id" not in header:
        raise ProtocolError(f"{where}: missing header field 'id'")
    rid = header["id"]
    values: dict[str, Any] = {"request_id": None if rid is None and cls is ErrorReply
                              else _request_id("id", rid, ProtocolError)}
    defaults = _DEFAULTS[cls]
    for name, check in cls.FIELDS:
        value = header.get(name)
        if value is None and name in cls.OPTIONAL:
            values[name] = check(name, defaults[name], ProtocolError)  # normalises, e.g. details -> {}
        elif name in header:
            values[name] = check(name, value, ProtocolError)
        else:
            raise ProtocolError(f"{where}: missing header field {name!r}")
    values.update(cls._from_payload(header, frames, limits))
    msg = object.__new__(cls)
    for name in _FIELD_NAMES[cls]:
        object.__setattr__(msg, name, values[name] if name in values else defaults[name])
    msg._cross_check(wire=True)
    return msg


def _decode_request(frames: Any, limits: Limits, ctx: _Context) -> Request:
    header, rest = _open(frames, limits, ctx)
    _check_version(header)
    op = header.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise ProtocolError(f"op must be one of {', '.join(REQUESTS)}, got {_show(op)}")
    return _build(REQUESTS[op], header, rest, limits, ("v", "id", "op"))


def decode_request(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Request:
    """The request in ``frames``, a list of bytes-like frames (header first, the ROUTER identity removed).

    Tensors and pages are zero-copy views of the frames (which they keep alive; read-only if the frames are).

    Raises :class:`ProtocolError` (malformed), :class:`MessageTooLarge`, :class:`UnsupportedVersion` or
    :class:`InvalidArgument` (a value out of range), each naming the field and value; never anything else.
    """
    return _decode_request(frames, limits, _Context())


def parse_request(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Request | ErrorReply:
    """Like :func:`decode_request`, but a bad request becomes the :class:`ErrorReply` to send back (carrying
    the request id whenever the header had a readable one). For the server loop: it never raises."""
    ctx = _Context()
    try:
        return _decode_request(frames, limits, ctx)
    except KvdError as exc:
        return error_reply(ctx.request_id, exc)


def decode_reply(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Reply:
    """The reply in ``frames`` (an :class:`ErrorReply` for a failed request: call ``.exception()``).

    Raises the same errors as :func:`decode_request` when the reply itself is malformed.
    """
    header, rest = _open(frames, limits, _Context())
    ok = header.get("ok")
    if ok is False:  # the error reply is the same in every protocol version, so it is read whatever v says
        return _build(ErrorReply, header, rest, limits, ("v", "id", "ok"))
    if ok is not True:
        raise ProtocolError(f"reply field ok must be a boolean, got {_show(ok)}")
    _check_version(header)
    op = header.get("op")
    if op == "get":
        fmt = header.get("format")
        if not isinstance(fmt, str) or fmt not in _GET_REPLIES:
            raise ProtocolError(f"get reply format must be one of {', '.join(GET_FORMATS)}, got {_show(fmt)}")
        cls = _GET_REPLIES[fmt]
    elif isinstance(op, str) and op in _REPLIES:
        cls = _REPLIES[op]
    else:
        raise ProtocolError(f"reply op must be one of {', '.join(REQUESTS)}, got {_show(op)}")
    return _build(cls, header, rest, limits, ("v", "id", "op", "ok"))


# ---- routing -------------------------------------------------------------------------------------------------


def _routing_key(namespace: str, seq_id: SeqId) -> bytes:
    ns = _namespace("namespace", namespace, InvalidArgument).encode("utf-8")
    seq = _seq_id("seq_id", seq_id, InvalidArgument)
    if isinstance(seq, int):
        seq_part = b"\x00" + seq.to_bytes(8, "little")
    else:
        raw = seq.encode("utf-8")
        seq_part = b"\x01" + len(raw).to_bytes(4, "little") + raw
    return len(ns).to_bytes(4, "little") + ns + seq_part


def rendezvous_score(shard_id: str, namespace: str, seq_id: SeqId) -> int:
    """The highest-random-weight score of ``shard_id`` for a sequence (docs/protocol.md, "Routing")."""
    raw = _short_text("shard id", shard_id, InvalidArgument).encode("utf-8")
    data = _routing_key(namespace, seq_id) + len(raw).to_bytes(4, "little") + raw
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def owner(shard_ids: Sequence[str], namespace: str, seq_id: SeqId) -> int:
    """Index in ``shard_ids`` of the shard that owns ``(namespace, seq_id)``: rendezvous (HRW) hashing.

    Stable across processes and languages; removing a shard moves only the sequences it owned. Ties (never
    seen in practice) go to the smaller shard id by UTF-8 bytes, so the answer does not depend on list order.
    Raises :class:`InvalidArgument` for an empty list, duplicate ids or a bad namespace / seq_id.
    """
    if isinstance(shard_ids, str) or not isinstance(shard_ids, Sequence) or not shard_ids:
        raise InvalidArgument(f"shard_ids must be a non-empty sequence of shard ids, got {_show(shard_ids)}")
    raws = [_short_text(f"shard_ids[{i}]", s, InvalidArgument).encode("utf-8") for i, s in enumerate(shard_ids)]
    if len(set(raws)) != len(raws):
        raise InvalidArgument(f"shard_ids has duplicates: {list(shard_ids)[:16]}")
    prefix = hashlib.blake2b(_routing_key(namespace, seq_id), digest_size=8)
    best, best_score, best_raw = 0, -1, b""
    for i, raw in enumerate(raws):
        h = prefix.copy()
        h.update(len(raw).to_bytes(4, "little") + raw)
        score = int.from_bytes(h.digest(), "big")
        if score > best_score or (score == best_score and raw < best_raw):
            best, best_score, best_raw = i, score, raw
    return best
