"""Constants, field checks, tensor framing and size limits of the kvd wire protocol (docs/protocol.md), shared
by the messages in :mod:`kvd.wire.messages`, the codec in :mod:`kvd.protocol` and the routing in
:mod:`kvd.wire.routing`. Pure: no zmq.

A *check* is a function ``(field name, value, exception class for a wrong type) -> normalised value``. A value
of the wrong type raises the given class (:class:`~kvd.errors.ProtocolError` for bytes off the wire,
:class:`~kvd.errors.InvalidArgument` for a message a caller builds); a value of the right type outside its
domain is always :class:`~kvd.errors.InvalidArgument`. Every message names the field and the bad value.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvd.errors import ConfigError, InvalidArgument, KvdError, ProtocolError

try:  # bfloat16 arrays need ml_dtypes; without it bfloat16 frames decode to their uint16 bit patterns
    from ml_dtypes import bfloat16 as _BF16_TYPE

    _BF16: np.dtype = np.dtype(_BF16_TYPE)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16 = np.dtype("<u2")

PROTOCOL_VERSION = 1  # the major version: a peer speaking another one is refused with UnsupportedVersion
PROTOCOL_MINOR = 8  # additions a client can discover through hello; never changes the meaning of old fields
# 1.1: get's ``packed`` field (pages in few frames, docs/protocol.md §6.5)
# 1.2: the ``lengths`` operation (many sequences' lengths in one request, docs/protocol.md §6.11)
# 1.3: append's ``position``, hello's and append's ``incarnation``, error WrongShard (docs/protocol.md §3)
# 1.4: ``packed`` fp16 tensors: keys and values in one frame, in an append and an fp16 get reply (§6.4, §6.5)
# 1.5: the ``attend`` operation (attention computed by the shard over its pages, docs/protocol.md §6.12)
# 1.6: append's ``parent`` (the sequence a new one follows in a chain, for prefix-aware eviction; §6.4)
# 1.7: the ``calibrate`` operation (a namespace's calibration, docs/protocol.md §6.13)
# 1.8: append's ``notices`` and its reply's ``notice`` ("needs calibration", §6.4); calibrate's ``require`` with
#      the calibration optional, and its reply's ``required`` (§6.13)
MAX_LOOKUP = 4096  # seq_ids in one ``lengths`` request

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
PageEntry = tuple[int, int, Any, Any]  # (layer, token0, key page, value page)


# ---- field checks: (field name, value, exception for a wrong type) -> normalised value ------------------------
# A wrong type is a ProtocolError when it came off the wire and InvalidArgument when a caller built the message;
# a value of the right type out of its range is always InvalidArgument.

Check = Callable[[str, Any, type[KvdError]], Any]


def show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def is_int(value: Any) -> bool:
    if type(value) is int:  # the common case, first: this runs for every integer field
        return True
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def int_in(low: int, high: int, *, optional: bool = False) -> Check:
    def check(name: str, value: Any, exc: type[KvdError]) -> int | None:
        if type(value) is int and low <= value <= high:  # the common case, first
            return value
        if value is None and optional:
            return None
        if not is_int(value):
            raise exc(f"{name} must be an integer{' or nil' if optional else ''}, got {show(value)}")
        value = int(value)
        if not low <= value <= high:
            if high == MAX_POSITION:  # "[0, 9223372036854775807]" reads as noise: say which side is wrong
                raise InvalidArgument(f"{name} must be >= {low}, got {value}" if value < low
                                      else f"{name} must be below 2**63, got {value}")
            raise InvalidArgument(f"{name} must be in [{low}, {high}], got {value}")
        return value

    return check


def text_in(max_bytes: int, *, nonempty: bool = True) -> Check:
    def check(name: str, value: Any, exc: type[KvdError]) -> str:
        if type(value) is str and value.isascii() and (0 if nonempty else -1) < len(value) <= max_bytes:
            return value  # the common case, first: ASCII has one byte per character
        if not isinstance(value, str):
            raise exc(f"{name} must be a string, got {show(value)}")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise InvalidArgument(f"{name} is not encodable as UTF-8: {value[:80]!r}") from None
        if size > max_bytes or (nonempty and size == 0):
            raise InvalidArgument(
                f"{name} must be {'1' if nonempty else '0'} to {max_bytes} bytes of UTF-8, "
                f"got {size} bytes: {value[:80]!r}"
            )
        return value

    return check


def check_bool(name: str, value: Any, exc: type[KvdError]) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise exc(f"{name} must be a boolean, got {show(value)}")
    return bool(value)


check_namespace = text_in(MAX_NAMESPACE_BYTES)
check_position = int_in(0, MAX_POSITION)
check_opt_position = int_in(0, MAX_POSITION, optional=True)
check_index = int_in(0, MAX_INDEX)
check_dim = int_in(1, MAX_INDEX)
check_size = int_in(0, MAX_INDEX)
check_short_text = text_in(MAX_TEXT_BYTES)


def check_request_id(name: str, value: Any, exc: type[KvdError]) -> int:
    if type(value) is int and 0 <= value <= MAX_REQUEST_ID:
        return value
    if not is_int(value) or not 0 <= value <= MAX_REQUEST_ID:  # part of the envelope: always exc's class
        raise exc(f"{name} (request id) must be an integer in [0, 2**64), got {show(value)}")
    return int(value)


_seq_text = text_in(MAX_SEQ_ID_BYTES, nonempty=False)
_stat_text = text_in(MAX_TEXT_BYTES, nonempty=False)
_stat_int = int_in(-(2**63), MAX_REQUEST_ID)


def check_seq_id(name: str, value: Any, exc: type[KvdError]) -> SeqId:
    if type(value) is int and 0 <= value <= MAX_POSITION:
        return value
    if isinstance(value, str):
        return _seq_text(name, value, exc)
    if is_int(value):
        return check_position(name, value, exc)
    raise exc(f"{name} must be a string or a non-negative integer, got {show(value)}")


def check_array(name: str, value: Any, exc: type[KvdError]) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise exc(f"{name} must be an array, got {show(value)}")
    return value


def plain_int(value: Any, high: int) -> bool:
    """A Python int (not bool) in [0, high]: the fast path of the checks for long arrays."""
    return type(value) is int and 0 <= value <= high


def check_layers(name: str, value: Any, exc: type[KvdError], *, optional: bool = True) -> tuple[int, ...] | None:
    if value is None and optional:
        return None
    items = tuple(check_array(name, value, exc))
    for v in items:  # the common case, plain ints in range, without a call per item
        if type(v) is not int or not 0 <= v <= MAX_INDEX:
            items = tuple(check_index(f"{name}[{i}]", v, exc) for i, v in enumerate(items))
            break
    if not items:
        raise InvalidArgument(f"{name} must be nil or a non-empty array of layer indices, got []")
    if len(set(items)) != len(items):
        raise InvalidArgument(f"{name} lists a layer twice: {list(items)[:32]}")
    return items


def check_required_layers(name: str, value: Any, exc: type[KvdError]) -> tuple[int, ...]:
    return check_layers(name, value, exc, optional=False)  # type: ignore[return-value]


def one_of(choices: Sequence[str]) -> Check:
    """A check of a string that must be one of ``choices``."""
    def check(name: str, value: Any, exc: type[KvdError]) -> str:
        if not isinstance(value, str):
            raise exc(f"{name} must be a string, got {show(value)}")
        if value not in choices:
            raise InvalidArgument(f"{name} must be one of {', '.join(choices)}, got {value[:80]!r}")
        return value

    return check


check_get_format = one_of(GET_FORMATS)


def check_seq_ids(name: str, value: Any, exc: type[KvdError]) -> tuple[SeqId, ...]:
    items = check_array(name, value, exc)
    if not 1 <= len(items) <= MAX_LOOKUP:
        raise exc(f"{name} must hold 1 to {MAX_LOOKUP} sequence ids, got {len(items)}")
    for v in items:  # the common case without a call and a formatted name per id (a lookup of 4,096 ids: 10x)
        kind = type(v)
        if kind is str:
            if len(v) <= MAX_SEQ_ID_BYTES and v.isascii():
                continue
        elif kind is int and 0 <= v <= MAX_POSITION:
            continue
        return tuple(check_seq_id(f"{name}[{i}]", v, exc) for i, v in enumerate(items))
    return tuple(items)


def check_opt_positions(name: str, value: Any, exc: type[KvdError]) -> tuple[int | None, ...]:
    items = check_array(name, value, exc)
    if len(items) > MAX_LOOKUP:
        raise exc(f"{name} must hold at most {MAX_LOOKUP} items, got {len(items)}")
    for v in items:  # the common case, nil or plain ints in range, without a call per item
        if v is not None and (type(v) is not int or not 0 <= v <= MAX_POSITION):
            return tuple(None if v is None else check_position(f"{name}[{i}]", v, exc)
                         for i, v in enumerate(items))
    return tuple(items)


MAX_QUERIES = 4096  # queries (T_q) in one ``attend``: their positions travel in the header, one array


def check_opt_scale(name: str, value: Any, exc: type[KvdError]) -> float | None:
    """An ``attend`` scale: nil, or a finite number > 0 (an int is taken as a float)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise exc(f"{name} must be a number or nil, got {show(value)}")
    out = float(value)
    if not math.isfinite(out) or out <= 0:
        raise InvalidArgument(f"{name} must be a finite number > 0, got {value!r}")
    return out


def check_opt_query_positions(name: str, value: Any, exc: type[KvdError]) -> tuple[int, ...] | None:
    """An ``attend``'s causal positions: nil, or 1 to MAX_QUERIES positions."""
    if value is None:
        return None
    items = check_array(name, value, exc)
    if not 1 <= len(items) <= MAX_QUERIES:
        raise exc(f"{name} must hold 1 to {MAX_QUERIES} positions, got {len(items)}")
    for v in items:  # the common case, plain ints in range, without a call per item
        if type(v) is not int or not 0 <= v <= MAX_POSITION:
            return tuple(check_position(f"{name}[{i}]", v, exc) for i, v in enumerate(items))
    return tuple(items)


CALIBRATION_STATES = ("none", "active", "quarantined", "missing", "needed", "pending")
MAX_CALIBRATION_KEYS = 64  # top-level keys of a calibration record (kvd.calibration.Calibration.to_dict: 12)


def check_calibration(name: str, value: Any, exc: type[KvdError]) -> dict[str, Any]:
    """A ``calibrate`` record: a map with string keys (its contents are checked by the server with
    :func:`kvd.calibration.from_dict`; the header's msgpack limits bound its size)."""
    if not isinstance(value, Mapping):
        raise exc(f"{name} must be a map (kvd.calibration.Calibration.to_dict()), got {show(value)}")
    if len(value) > MAX_CALIBRATION_KEYS:
        raise InvalidArgument(f"{name} has {len(value)} keys, more than {MAX_CALIBRATION_KEYS}")
    for key in value:
        if not isinstance(key, str):
            raise exc(f"{name} keys must be strings, got {show(key)}")
    return value if type(value) is dict else dict(value)


def check_opt_calibration(name: str, value: Any, exc: type[KvdError]) -> dict[str, Any] | None:
    """:func:`check_calibration`, or nil (protocol 1.8: a ``calibrate`` that sets ``require`` only)."""
    return None if value is None else check_calibration(name, value, exc)


check_calibration_state = one_of(CALIBRATION_STATES)


def check_calibration_levels(name: str, value: Any, exc: type[KvdError]) -> dict[str, dict[str, Any]]:
    """A calibration state's ``levels``: nil (none) or at most 8 maps of scalars by level name."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise exc(f"{name} must be a map, got {show(value)}")
    if len(value) > 8:
        raise InvalidArgument(f"{name} has {len(value)} levels, more than 8")
    out: dict[str, dict[str, Any]] = {}
    for key, item in value.items():
        where = f"{name}[{check_short_text(f'{name} key', key, exc)[:80]!r}]"
        info = check_info(where, item, exc)
        if any(isinstance(v, (dict, list)) for v in info.values()):
            raise exc(f"{where} must be a map of scalars")
        out[key] = info
    return out


def check_text_list(name: str, value: Any, exc: type[KvdError]) -> tuple[str, ...]:
    return tuple(check_short_text(f"{name}[{i}]", v, exc) for i, v in enumerate(check_array(name, value, exc)))


def _stat_scalar(name: str, value: Any, exc: type[KvdError]) -> Any:
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    if is_int(value):
        return _stat_int(name, value, exc)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return _stat_text(name, value, exc)
    raise exc(f"{name} must be nil, a boolean, a number or a string, got {show(value)}")


def _stat_array(name: str, value: Any, exc: type[KvdError], *, nested: bool) -> list[Any]:
    return [
        _stat_array(f"{name}[{i}]", v, exc, nested=False)
        if nested and isinstance(v, (list, tuple))
        else _stat_scalar(f"{name}[{i}]", v, exc)
        for i, v in enumerate(value)
    ]


def check_info(name: str, value: Any, exc: type[KvdError]) -> dict[str, Any]:
    """An open map (stats, explain details): each value a scalar, a map of scalars, or an array of scalars and
    arrays of scalars. At most 2 levels of containers under the map, so decoding work stays flat."""
    if not isinstance(value, Mapping):
        raise exc(f"{name} must be a map, got {show(value)}")
    if len(value) > MAX_STATS_KEYS:
        raise InvalidArgument(f"{name} has {len(value)} keys, more than {MAX_STATS_KEYS}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        check_short_text(f"{name} key", key, exc)
        where = f"{name}[{key[:80]!r}]"
        if isinstance(item, Mapping):
            out[key] = {
                check_short_text(f"{where} key", k, exc): _stat_scalar(f"{where}[{k[:80]!r}]", v, exc)
                for k, v in item.items()
            }
        elif isinstance(item, (list, tuple)):
            out[key] = _stat_array(where, item, exc, nested=True)
        else:
            out[key] = _stat_scalar(where, item, exc)
    return out


def check_opt_info(name: str, value: Any, exc: type[KvdError]) -> dict[str, Any]:
    return {} if value is None else check_info(name, value, exc)


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
            raise InvalidArgument(
                f"{name}: cannot view {type(obj).__name__} through DLPack ({exc}); pass a "
                "bfloat16 tensor as its int16/uint16 bits with dtype='bfloat16'"
            ) from None
    try:
        return np.asarray(memoryview(obj))
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"{name} must be a numpy array or expose the buffer protocol or DLPack, got {type(obj).__name__}"
        ) from None


def wire_dtype_name(arr: np.ndarray, name: str, declared: str | None) -> str:
    dt = arr.dtype
    if declared is not None:
        if declared not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {', '.join(DTYPES)}, got {declared!r}")
        bits_ok = dt.kind in "ui" and dt.itemsize == DTYPES[declared].itemsize  # raw bit patterns
        if not bits_ok and wire_dtype_name(arr, name, None) != declared:
            raise InvalidArgument(f"{name} has dtype {dt}, which cannot be sent as {declared}")
        return declared
    if dt.kind == "f" and dt.itemsize in (2, 4):
        return "float16" if dt.itemsize == 2 else "float32"
    if dt.name == "bfloat16":
        return "bfloat16"
    raise InvalidArgument(f"{name} dtype must be one of {', '.join(DTYPES)}, got {dt}")


def wire_array(arr: np.ndarray) -> np.ndarray:
    """C-contiguous and little-endian: the caller's array itself when it already is (the usual case)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


def tensor_frame(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a 1-D byte memoryview (no copy)."""
    try:  # float16 / float32: a third of the cost of the view below
        return memoryview(arr).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no buffer format (bfloat16), zero-size or not contiguous
        return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def byte_view(frame: Any, what: str) -> memoryview:
    try:
        view = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"{what} is not a bytes-like object: {type(frame).__name__}") from None
    if not view.c_contiguous:  # numpy, msgpack and the kernels read a frame as one run of bytes
        raise ProtocolError(f"{what} is not a contiguous buffer")
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def check_shape(name: str, value: Any, exc: type[KvdError], *, min_dims: tuple[int, ...]) -> tuple[int, ...]:
    if type(value) in (list, tuple) and len(value) == len(min_dims):  # the common case: plain ints in range
        for v, low in zip(value, min_dims, strict=True):
            if type(v) is not int or not low <= v <= MAX_INDEX:
                break
        else:
            return tuple(value)
    items = check_array(name, value, exc)
    if len(items) != len(min_dims):
        raise exc(f"{name} must have {len(min_dims)} dimensions, got {len(items)}: {show(value)}")
    pairs = enumerate(zip(items, min_dims, strict=True))
    return tuple((check_dim if low else check_size)(f"{name}[{i}]", v, exc) for i, (v, low) in pairs)


def frame_tensor(view: Frame, what: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    # Python integers do not overflow; implementations in other languages must check (docs/protocol.md).
    need = math.prod(shape) * DTYPES[dtype].itemsize
    if len(view) != need:
        raise ProtocolError(f"{what} frame has {len(view)} bytes but shape {list(shape)} of {dtype} needs {need}")
    return np.ndarray(shape, DTYPES[dtype], view)


MAX_SHARDS = 4096  # shards in one topology reply
SERVER_ROLES = ("shard", "coordinator")


check_role = one_of(SERVER_ROLES)


def check_shards(name: str, value: Any, exc: type[KvdError]) -> tuple[dict[str, str], ...]:
    """A topology's shard list: maps with exactly the keys ``id`` and ``endpoint`` (text), ids distinct."""
    items = check_array(name, value, exc)
    if len(items) > MAX_SHARDS:
        raise InvalidArgument(f"{name} lists {len(items)} shards, more than {MAX_SHARDS}")
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise exc(f"{name}[{i}] must be a map with the keys id and endpoint, got {show(item)}")
        if len(item) != 2 or "id" not in item or "endpoint" not in item:
            keys = [str(k)[:40] for k in item][:8]
            raise exc(f"{name}[{i}] must have exactly the keys id and endpoint, got {keys}")
        sid = check_short_text(f"{name}[{i}].id", item["id"], exc)
        if sid in seen:
            raise InvalidArgument(f"{name} lists the shard id {sid[:80]!r} twice")
        seen.add(sid)
        out.append({"id": sid, "endpoint": check_short_text(f"{name}[{i}].endpoint", item["endpoint"], exc)})
    return tuple(out)


# ---- messages' tensors and pages -----------------------------------------------------------------------------


def check_tensors(msg: Any, *, min_dims: tuple[int, ...], declared: str | None) -> None:
    keys = wire_array(as_array(msg.keys, "keys"))
    values = wire_array(as_array(msg.values, "values"))
    dtype = wire_dtype_name(keys, "keys", declared)
    if wire_dtype_name(values, "values", declared) != dtype or keys.dtype != values.dtype:
        raise InvalidArgument(f"keys and values must have the same dtype, got {keys.dtype} and {values.dtype}")
    if keys.shape != values.shape:
        raise InvalidArgument(f"keys and values must have the same shape, got {keys.shape} and {values.shape}")
    check_shape("shape", list(keys.shape), InvalidArgument, min_dims=min_dims)
    object.__setattr__(msg, "keys", keys)
    object.__setattr__(msg, "values", values)
    object.__setattr__(msg, "dtype", dtype)


def tensors_from_wire(
    header: Mapping[str, Any], frames: list[Frame], *, min_dims: tuple[int, ...], dtypes: Sequence[str], op: str
) -> dict[str, Any]:
    """``keys``, ``values`` and ``dtype`` from a header's ``dtype`` and ``shape`` and its two frames, or, when the
    header says ``packed`` (protocol 1.4), from its one frame holding keys then values (then also ``packed``: that
    frame). Views of the frames, not copies."""
    dtype = header.get("dtype")
    if not isinstance(dtype, str):
        raise ProtocolError(f"dtype must be a string, got {show(dtype)}")
    if dtype not in dtypes:
        raise ProtocolError(f"dtype must be one of {', '.join(dtypes)}, got {dtype[:80]!r}")
    shape = check_shape("shape", header.get("shape"), ProtocolError, min_dims=min_dims)
    packed = header.get("packed")
    if packed is not None and check_bool("packed", packed, ProtocolError):  # protocol 1.4: one frame
        if len(frames) != 1:
            raise ProtocolError(f"{op}: packed keys and values travel in 1 frame after the header, got "
                                f"{len(frames)}")
        need = math.prod(shape) * DTYPES[dtype].itemsize
        frame = frames[0]
        if len(frame) != 2 * need:
            raise ProtocolError(f"packed keys and values frame has {len(frame)} bytes but shape {list(shape)} of "
                                f"{dtype} needs 2 x {need}")
        return {"keys": np.ndarray(shape, DTYPES[dtype], frame), "dtype": dtype, "packed": frame,
                "values": np.ndarray(shape, DTYPES[dtype], frame, need)}
    if len(frames) != 2:
        raise ProtocolError(f"{op}: expected 2 frames after the header, got {len(frames)}")
    keys = frame_tensor(frames[0], "keys", dtype, shape)
    return {"keys": keys, "values": frame_tensor(frames[1], "values", dtype, shape), "dtype": dtype}


def packed_tensors(keys: np.ndarray, values: np.ndarray) -> bytes:
    """``keys`` then ``values`` as the one frame of packed tensors (protocol 1.4): a copy of both."""
    return b"".join((tensor_frame(keys), tensor_frame(values)))


def check_page_entry(i: int, entry: Any) -> PageEntry:
    if (
        type(entry) is tuple
        and len(entry) == 4
        and plain_int(entry[0], MAX_INDEX)
        and plain_int(entry[1], MAX_POSITION)
        and type(entry[2]) is bytes
        and type(entry[3]) is bytes
    ):
        return entry  # the store's usual entry: bytes pages, sent as they are
    if not isinstance(entry, (list, tuple)) or len(entry) != 4:
        raise InvalidArgument(f"entries[{i}] must be (layer, token0, key_page, value_page), got {show(entry)}")
    return (
        check_index(f"entries[{i}].layer", entry[0], InvalidArgument),
        check_position(f"entries[{i}].token0", entry[1], InvalidArgument),
        byte_view(entry[2], f"entries[{i}] key page"),
        byte_view(entry[3], f"entries[{i}] value page"),
    )


# What a packed pages reply's reader needs of a page header (docs/formats.md): magic, version, raw-head count and
# payload length, and in a version 2 page the held-head count after the raw-head list, from which the page's total
# length follows. Framing only: the pages themselves are checked on decode.
_PAGE_SPAN = struct.Struct("<4sB5xH8xI")
_PAGE_MAGIC = b"KVDP"
_HELD_VERSION = 2
_HELD_BLOCK = 8  # n_held, level, axis, group, zero


def split_packed(frames: Sequence[Frame], n_pages: int) -> list[memoryview]:
    """The pages in ``frames`` of a packed pages reply: each frame holds one or more whole pages back to back,
    and a page's length is ``32 + align8(2 * n_raw) + payload_bytes`` from its own header, plus ``8 +
    align8(2 * n_held)`` in a version 2 page (held heads). Views, not copies. Raises :class:`ProtocolError`
    unless the frames split into exactly ``n_pages`` pages."""
    out: list[memoryview] = []
    unpack = _PAGE_SPAN.unpack_from
    for i, frame in enumerate(frames):
        view = frame if type(frame) is memoryview else memoryview(frame)
        n = len(view)
        if not n:
            raise ProtocolError(f"packed frame {i} is empty")
        off = 0
        while off < n:
            if n - off < _PAGE_SPAN.size:
                raise ProtocolError(f"packed frame {i} ends inside a page header at byte {off}")
            magic, version, n_raw, payload = unpack(view, off)
            size = 32 + (2 * n_raw + 7) // 8 * 8
            if version == _HELD_VERSION and magic == _PAGE_MAGIC:
                if n - off < size + 2:
                    raise ProtocolError(f"packed frame {i} ends inside a page header at byte {off}")
                n_held = view[off + size] | view[off + size + 1] << 8
                size += _HELD_BLOCK + (2 * n_held + 7) // 8 * 8
            size += payload
            if magic != _PAGE_MAGIC or size > n - off:
                raise ProtocolError(f"packed frame {i} has no whole kvd page at byte {off} "
                                    f"(magic {bytes(magic)!r}, {size} bytes claimed, {n - off} left)")
            out.append(view[off : off + size])
            off += size
        if len(out) > n_pages:
            break
    if len(out) != n_pages:
        raise ProtocolError(f"packed frames hold {len(out)}{'+' if len(out) > n_pages else ''} pages, "
                            f"entries need {n_pages}")
    return out


def pages_from_wire(header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
    """A pages reply's ``entries`` (and ``packed``, its frames, when the header says so) from the header and the
    frames after it: two frames per entry, or the pages split out of packed frames (:func:`split_packed`)."""
    listed = check_array("entries", header.get("entries"), ProtocolError)
    packed = header.get("packed")
    if packed is not None and check_bool("packed", packed, ProtocolError):
        if len(listed) > limits.max_pages:
            raise ProtocolError(f"entries lists {len(listed)} pages, more than max_pages {limits.max_pages}")
        return {"entries": _page_entries(listed, split_packed(frames, 2 * len(listed))), "packed": tuple(frames)}
    if len(listed) > limits.max_pages or len(frames) != 2 * len(listed):
        raise ProtocolError(
            f"entries lists {len(listed)} pages but {len(frames)} page frames follow "
            f"(2 per entry, at most {limits.max_pages} entries)"
        )
    return {"entries": _page_entries(listed, frames)}


def _page_entries(listed: Sequence[Any], pages: Sequence[Frame]) -> tuple[PageEntry, ...]:
    """``(layer, token0, key page, value page)`` from the header's pairs and the pages in order."""
    entries = []
    for i, pair in enumerate(listed):
        if (
            type(pair) is list
            and len(pair) == 2
            and plain_int(pair[0], MAX_INDEX)
            and plain_int(pair[1], MAX_POSITION)
        ):  # fast path; the checks below name what is wrong
            entries.append((pair[0], pair[1], pages[2 * i], pages[2 * i + 1]))
            continue
        if not isinstance(pair, list) or len(pair) != 2:
            raise ProtocolError(f"entries[{i}] must be [layer, token0], got {show(pair)}")
        layer = check_index(f"entries[{i}].layer", pair[0], ProtocolError)
        entries.append(
            (layer, check_position(f"entries[{i}].token0", pair[1], ProtocolError), pages[2 * i], pages[2 * i + 1])
        )
    return tuple(entries)


# ---- size limits ---------------------------------------------------------------------------------------------


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
