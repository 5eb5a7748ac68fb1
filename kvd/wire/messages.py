"""The kvd wire messages (docs/protocol.md): one frozen, slotted dataclass per request and reply. Pure: no zmq.

Theory of operation. Every message validates itself when built, so a message that exists is a valid message.
Each class lists its header fields as ``(name, check)`` pairs (checks from :mod:`kvd.wire.schema`); the
generic codec in :mod:`kvd.protocol` turns those fields into a header map and back. Fields on the wire only
when set are declared once, in ``SET_ONLY``; the classes with binary frames (:class:`AppendRequest`,
:class:`AttendRequest`, :class:`GetReply`, :class:`GetPagesReply`, :class:`AttendReply`) and :class:`GetRequest`'s
``packed`` add their own handling through ``_payload`` (encoding) and ``_from_payload`` (decoding). Import these
names from :mod:`kvd.protocol`, the public module, which re-exports them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from kvd.errors import ConfigError, InvalidArgument, KvdError, ProtocolError, error_for_code
from kvd.wire.schema import (
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DTYPES,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_INDEX,
    MAX_QUERIES,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    Check,
    Frame,
    Limits,
    PageEntry,
    SeqId,
    as_array,
    byte_view,
    check_array,
    check_bool,
    check_calibration_levels,
    check_calibration_state,
    check_dim,
    check_get_format,
    check_index,
    check_info,
    check_layers,
    check_namespace,
    check_opt_calibration,
    check_opt_info,
    check_opt_position,
    check_opt_positions,
    check_opt_query_positions,
    check_opt_scale,
    check_page_entry,
    check_position,
    check_request_id,
    check_required_layers,
    check_role,
    check_seq_id,
    check_seq_ids,
    check_shape,
    check_shards,
    check_short_text,
    check_tensors,
    check_text_list,
    frame_tensor,
    int_in,
    packed_tensors,
    pages_from_wire,
    split_packed,
    tensor_frame,
    tensors_from_wire,
    text_in,
    wire_array,
    wire_dtype_name,
)

_FieldSpec = tuple[tuple[str, Check], ...]
_NS_SEQ: _FieldSpec = (("namespace", check_namespace), ("seq_id", check_seq_id))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Message:
    OP: ClassVar[str] = ""
    FIELDS: ClassVar[_FieldSpec] = ()  # header fields beside v / id / op / ok, in wire order
    EXTRA_KEYS: ClassVar[tuple[str, ...]] = ()  # header keys handled by _payload / _from_payload
    FRAMES: ClassVar[int | None] = 0  # binary frames after the header; None: the class counts them
    OPTIONAL: ClassVar[tuple[str, ...]] = ()  # FIELDS that may be absent or nil on the wire (= the default)
    # header fields beside FIELDS on the wire only when not their default (a later minor version's, so that a
    # message without them keeps its bytes); absent or nil: the default. _payload / _from_payload handle them.
    SET_ONLY: ClassVar[tuple[tuple[str, Check], ...]] = ()

    request_id: int

    def __post_init__(self) -> None:
        _check_fields(self, InvalidArgument)

    @classmethod
    def trusted(cls, **values: Any) -> Any:
        """The message from values known to be valid and normalised (a server's own replies: ints, tuples,
        C-contiguous little-endian arrays), without the checks of the constructor. Missing fields take their
        defaults. Use the constructor for anything else."""
        msg = object.__new__(cls)
        defaults = _DEFAULTS[cls]
        for name in _FIELD_NAMES[cls]:
            object.__setattr__(msg, name, values[name] if name in values else defaults[name])
        return msg

    def _cross_check(self, wire: bool = False) -> None:
        """Rules spanning several fields (InvalidArgument). ``wire``: the frames were already checked."""

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        defaults = _DEFAULTS[type(self)]
        return {name: getattr(self, name) for name, _ in self.SET_ONLY
                if getattr(self, name) is not defaults[name]}, []

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        return {name: check(name, header[name], ProtocolError) for name, check in cls.SET_ONLY
                if header.get(name) is not None}


def _check_fields(msg: _Message, exc: type[KvdError]) -> None:
    for name, check in msg.FIELDS:
        value = getattr(msg, name)
        normal = check(name, value, exc)
        if normal is not value:
            object.__setattr__(msg, name, normal)
    if msg.SET_ONLY:
        defaults = _DEFAULTS[type(msg)]
        for name, check in msg.SET_ONLY:
            value = getattr(msg, name)
            if value is not defaults[name]:
                object.__setattr__(msg, name, check(name, value, exc))
    if not (isinstance(msg, ErrorReply) and msg.request_id is None):
        object.__setattr__(msg, "request_id", check_request_id("id", msg.request_id, exc))
    msg._cross_check(wire=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloRequest(_Message):
    """Ask for the server's protocol version, limits and identity. Reply: :class:`HelloReply`.

    ``incarnation`` (protocol 1.3) asks a shard for its incarnation id too; on the wire only when true, so a
    request without it is the same bytes as in 1.0 (a server older than 1.3 refuses it with ProtocolError).
    """

    OP = "hello"
    SET_ONLY = (("incarnation", check_bool),)
    incarnation: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PingRequest(_Message):
    """Liveness check; the reply has no fields. Reply: :class:`PingReply`."""

    OP = "ping"


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterRequest(_Message):
    """Store.register. Reply: :class:`RegisterReply`."""

    OP = "register"
    FIELDS = (
        ("namespace", check_namespace),
        ("num_layers", check_dim),
        ("num_kv_heads", check_dim),
        ("head_dim", check_dim),
    )
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
    ``position`` (protocol 1.3): where the sequence's token 0 sits in its prompt (Store.append); it is on the
    wire only when set, so a request without it is the same bytes as in 1.2. ``incarnation`` (protocol 1.3):
    if set, a shard of another incarnation (it restarted, empty) refuses the append with WrongShard; on the
    wire only when set. ``packed`` (protocol 1.4): keys and values travel in one frame, keys first (a copy of both
    is sent; on the wire only when true). A decoded packed request's arrays are views of that one frame.
    ``parent`` (protocol 1.6): the sequence (same namespace, same shard) a new sequence follows in a chain that
    lookups walk in order (Store.append); on the wire only when set. ``notices`` (protocol 1.8): the reply may
    carry a ``notice`` (:class:`AppendReply`); on the wire only when true, so a request without it is the same
    bytes as in 1.7 and gets the 1.7 reply.
    """

    OP = "append"
    FIELDS = (*_NS_SEQ, ("offset", check_opt_position))
    OPTIONAL = ("offset",)
    EXTRA_KEYS = ("dtype", "shape", "position", "incarnation", "packed", "parent", "notices")
    FRAMES = None  # 2, or 1 when packed (tensors_from_wire counts them)
    namespace: str
    seq_id: SeqId
    keys: Any
    values: Any
    offset: int | None = None
    dtype: str | None = None
    position: int | None = None
    incarnation: str | None = None
    packed: bool = False
    parent: SeqId | None = None
    notices: bool = False

    def _cross_check(self, wire: bool = False) -> None:
        if not wire:  # a decoded request's arrays were built from the frames with the declared dtype and shape
            check_tensors(self, min_dims=(1, 1, 1, 1), declared=self.dtype)
            object.__setattr__(self, "position", check_opt_position("position", self.position, InvalidArgument))
            if self.parent is not None:
                object.__setattr__(self, "parent", check_seq_id("parent", self.parent, InvalidArgument))
            if self.incarnation is not None:
                check_short_text("incarnation", self.incarnation, InvalidArgument)
            object.__setattr__(self, "packed", check_bool("packed", self.packed, InvalidArgument))
            object.__setattr__(self, "notices", check_bool("notices", self.notices, InvalidArgument))

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        extra: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.keys.shape)}
        if self.position is not None:
            extra["position"] = self.position
        if self.incarnation is not None:
            extra["incarnation"] = self.incarnation
        if self.parent is not None:
            extra["parent"] = self.parent
        if self.notices:
            extra["notices"] = True
        if self.packed:
            extra["packed"] = True
            return extra, [packed_tensors(self.keys, self.values)]
        return extra, [tensor_frame(self.keys), tensor_frame(self.values)]

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        out = tensors_from_wire(header, frames, min_dims=(1, 1, 1, 1), dtypes=tuple(DTYPES), op=cls.OP)
        out["packed"] = "packed" in out
        out["position"] = check_opt_position("position", header.get("position"), ProtocolError)
        value = header.get("incarnation")
        if value is not None:
            out["incarnation"] = check_short_text("incarnation", value, ProtocolError)
        value = header.get("parent")
        if value is not None:
            out["parent"] = check_seq_id("parent", value, ProtocolError)
        value = header.get("notices")
        out["notices"] = False if value is None else check_bool("notices", value, ProtocolError)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class GetRequest(_Message):
    """Store.get (``format="fp16"``, reply :class:`GetReply`) or get_pages (``"pages"``, :class:`GetPagesReply`).

    Tokens ``[start, end)`` (``end=None``: to the end) of ``layers`` (None: all, in order). ``packed`` asks for
    the reply's binary parts in few frames: the pages of ``format="pages"`` (protocol 1.1), the keys and values
    of ``"fp16"`` in one frame (protocol 1.4). It is on the wire only when true, so a request without it is the
    same bytes as in 1.0.
    """

    OP = "get"
    FIELDS = (
        *_NS_SEQ,
        ("start", check_position),
        ("end", check_opt_position),
        ("layers", check_layers),
        ("format", check_get_format),
    )
    OPTIONAL = ("start", "end", "layers", "format")
    EXTRA_KEYS = ("packed",)
    namespace: str
    seq_id: SeqId
    start: int = 0
    end: int | None = None
    layers: tuple[int, ...] | None = None
    format: str = "fp16"
    packed: bool = False

    def _cross_check(self, wire: bool = False) -> None:
        if self.end is not None and self.end < self.start:
            raise InvalidArgument(f"start must be <= end, got start={self.start} end={self.end}")
        if not wire:
            object.__setattr__(self, "packed", check_bool("packed", self.packed, InvalidArgument))

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        return ({"packed": True} if self.packed else {}), []

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        packed = header.get("packed")
        return {"packed": False if packed is None else check_bool("packed", packed, ProtocolError)}


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
class LengthsRequest(_Message):
    """Store.lengths: many sequences of one namespace in one request (protocol 1.2; a prefix lookup costs one
    round trip per shard). Reply: :class:`LengthsReply`."""

    OP = "lengths"
    FIELDS = (("namespace", check_namespace), ("seq_ids", check_seq_ids))
    namespace: str
    seq_ids: tuple[SeqId, ...]


_QUERY_DTYPES = ("float16", "float32")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class AttendRequest(_Message):
    """Store.attend (protocol 1.5): attention of ``queries`` (float16 or float32 ``[T_q, H_q, D]``, one frame)
    over tokens ``[start, end)`` (``end`` None: to the end) of ``layer``. ``scale`` None: ``1/sqrt(D)``;
    ``positions`` None: the last ``T_q`` positions of the range, else one causal position per query.
    Reply: :class:`AttendReply`. The queries array is kept as given when C-contiguous little-endian."""

    OP = "attend"
    FIELDS = (
        *_NS_SEQ,
        ("layer", check_index),
        ("start", check_position),
        ("end", check_opt_position),
        ("scale", check_opt_scale),
        ("positions", check_opt_query_positions),
    )
    OPTIONAL = ("start", "end", "scale", "positions")
    EXTRA_KEYS = ("dtype", "shape")
    FRAMES = 1
    namespace: str
    seq_id: SeqId
    layer: int
    queries: Any
    start: int = 0
    end: int | None = None
    scale: float | None = None
    positions: tuple[int, ...] | None = None
    dtype: str | None = None

    def _cross_check(self, wire: bool = False) -> None:
        if not wire:
            q = wire_array(as_array(self.queries, "queries"))
            dtype = wire_dtype_name(q, "queries", self.dtype)
            if dtype not in _QUERY_DTYPES:
                raise InvalidArgument(f"queries must be float16 or float32, got {dtype}")
            check_shape("queries shape", list(q.shape), InvalidArgument, min_dims=(1, 1, 1))
            object.__setattr__(self, "queries", q)
            object.__setattr__(self, "dtype", dtype)
        t_q = self.queries.shape[0]
        if t_q > MAX_QUERIES:
            raise InvalidArgument(f"attend takes at most {MAX_QUERIES} queries, got {t_q}: split them")
        if self.positions is not None and len(self.positions) != t_q:
            raise InvalidArgument(f"positions holds {len(self.positions)} items for {t_q} queries")
        if self.end is not None and self.end < self.start:
            raise InvalidArgument(f"start must be <= end, got start={self.start} end={self.end}")

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        return {"dtype": self.dtype, "shape": list(self.queries.shape)}, [tensor_frame(self.queries)]

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        dtype = header.get("dtype")
        if not isinstance(dtype, str) or dtype not in _QUERY_DTYPES:
            raise ProtocolError(f"attend dtype must be one of {', '.join(_QUERY_DTYPES)}, got {dtype!r:.80}")
        shape = check_shape("shape", header.get("shape"), ProtocolError, min_dims=(1, 1, 1))
        return {"queries": frame_tensor(frames[0], "queries", dtype, shape), "dtype": dtype}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CalibrateRequest(_Message):
    """Store.calibrate (protocol 1.7): give ``namespace`` the ``calibration`` record (the map of
    :meth:`kvd.calibration.Calibration.to_dict`; the server checks it with :func:`kvd.calibration.from_dict`).
    ``require`` (protocol 1.8): the namespace's own ``require_calibration`` (None: unchanged); on the wire only
    when set, so a request without it is the same bytes as in 1.7. From 1.8 ``calibration`` may be None (nil)
    when ``require`` is set: the namespace keeps its calibration, if any. In a cluster the shard makes both
    cluster-wide first. Reply: :class:`CalibrateReply`."""

    OP = "calibrate"
    FIELDS = (("namespace", check_namespace), ("calibration", check_opt_calibration))
    OPTIONAL = ("calibration",)
    SET_ONLY = (("require", check_bool),)
    namespace: str
    calibration: dict[str, Any] | None = None
    require: bool | None = None

    def _cross_check(self, wire: bool = False) -> None:
        if self.calibration is None and self.require is None:
            raise InvalidArgument("calibrate needs a calibration, require, or both: it has neither")


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsRequest(_Message):
    """Store.stats. Reply: :class:`StatsReply`."""

    OP = "stats"


@dataclass(frozen=True, slots=True, kw_only=True)
class ExplainRequest(_Message):
    """Store.explain of one token of one layer. Reply: :class:`ExplainReply`."""

    OP = "explain"
    FIELDS = (*_NS_SEQ, ("layer", check_index), ("token", check_position))
    namespace: str
    seq_id: SeqId
    layer: int
    token: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyRequest(_Message):
    """Ask a coordinator for the cluster topology. Reply: :class:`TopologyReply`. Shards refuse it."""

    OP = "topology"


_LIMIT_FIELDS = ("max_header_bytes", "max_frame_bytes", "max_frames", "max_message_bytes")
_opt_dim = int_in(1, MAX_INDEX, optional=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloReply(_Message):
    """The server's protocol version, role, identity, page geometry and :class:`Limits` (:attr:`limits`).

    ``role`` is ``"shard"`` (serves data; ``shard_id`` is the id routing uses; ``page_tokens`` is set) or
    ``"coordinator"`` (serves the topology; ``shard_id`` is its name; ``page_tokens`` is None).
    ``incarnation`` (protocol 1.3): a shard's incarnation id, sent only to a hello that asked for it.
    """

    OP = "hello"
    FIELDS = (
        ("protocol_version", check_position),
        ("protocol_minor", check_position),
        ("kvd_version", check_short_text),
        ("page_format_version", check_position),
        ("role", check_role),
        ("shard_id", check_short_text),
        ("page_tokens", _opt_dim),
        *((name, check_position) for name in _LIMIT_FIELDS),
    )
    OPTIONAL = ("page_tokens",)
    SET_ONLY = (("incarnation", check_short_text),)
    protocol_version: int = PROTOCOL_VERSION
    protocol_minor: int = PROTOCOL_MINOR
    kvd_version: str
    page_format_version: int
    role: str = "shard"
    shard_id: str
    page_tokens: int | None = None
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_frames: int = DEFAULT_MAX_FRAMES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    incarnation: str | None = None

    def _cross_check(self, wire: bool = False) -> None:
        if (self.page_tokens is None) != (self.role == "coordinator"):
            raise InvalidArgument(
                f"page_tokens must be set for a shard and nil for a coordinator, got role "
                f"{self.role!r} with page_tokens {self.page_tokens!r}"
            )
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


_NOTICE = text_in(MAX_ERROR_MESSAGE_BYTES)  # an append reply's notice: 1 to 2048 bytes of UTF-8


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendReply(_Message):
    """``length``: the sequence's length in tokens after the append. ``notice`` (protocol 1.8): why the
    namespace needs attention (the store's calibration state: "needs calibration ..."), only in a reply to a
    request with ``notices``; on the wire only when set."""

    OP = "append"
    FIELDS = (("length", check_position),)
    SET_ONLY = (("notice", _NOTICE),)
    length: int
    notice: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GetReply(_Message):
    """Decoded float16 ``keys`` and ``values`` ``[len(layers), end - start, H, D]`` of tokens [start, end).

    ``packed`` (protocol 1.4): None sends keys and values as two frames; otherwise the one frame to send instead,
    holding keys then values (:meth:`kvd.store.Store.get_packed` gives both without a copy). A decoded packed
    reply has the received frame here, and keys and values are views of it."""

    OP = "get"
    FIELDS = (("start", check_position), ("end", check_position), ("layers", check_required_layers))
    EXTRA_KEYS = ("format", "dtype", "shape", "packed")
    FRAMES = None  # 2, or 1 when packed (tensors_from_wire counts them)
    start: int
    end: int
    layers: tuple[int, ...]
    keys: Any
    values: Any
    dtype: str = "float16"
    packed: Frame | None = None

    def _cross_check(self, wire: bool = False) -> None:
        if not wire:
            if self.dtype != "float16":
                raise InvalidArgument(f"a get reply carries float16 tensors, got dtype {self.dtype!r}")
            check_tensors(self, min_dims=(1, 0, 1, 1), declared="float16")
            if self.packed is not None:
                packed = byte_view(self.packed, "packed")
                if bytes(packed) != bytes(tensor_frame(self.keys)) + bytes(tensor_frame(self.values)):
                    raise InvalidArgument("packed is not the bytes of keys then values")
                object.__setattr__(self, "packed", packed)
        want = (len(self.layers), self.end - self.start)
        if self.end < self.start or self.keys.shape[:2] != want:
            raise InvalidArgument(
                f"tensor shape {list(self.keys.shape)} does not match {len(self.layers)} layers "
                f"and tokens [{self.start}, {self.end})"
            )

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        extra: dict[str, Any] = {"format": "fp16", "dtype": self.dtype, "shape": list(self.keys.shape)}
        if self.packed is not None:
            extra["packed"] = True
            return extra, [self.packed]
        return extra, [tensor_frame(self.keys), tensor_frame(self.values)]

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        return tensors_from_wire(header, frames, min_dims=(1, 0, 1, 1), dtypes=("float16",), op=cls.OP)


@dataclass(frozen=True, slots=True, kw_only=True)
class GetPagesReply(_Message):
    """Stored pages covering tokens [start, end) of ``layers``: entries ``(layer, token0, key_page, value_page)``.

    Exactly Store.get_pages' entries. Pages are bytes-like: decoded replies hold the received frames themselves
    (bytes) or memoryviews of them, never copies.
    ``kvd.pages.assemble(entries, start, end, layers)`` rebuilds the float16 arrays (docs/formats.md).

    ``packed`` (protocol 1.1): None sends two frames per entry; otherwise the frames to send instead, whose
    concatenation is every entry's key and value page in order, each frame whole pages (Store.get_pages_packed
    gives both). A decoded packed reply has the received frames here and entries viewing into them.
    """

    OP = "get"
    FIELDS = (("start", check_position), ("end", check_position), ("layers", check_required_layers))
    EXTRA_KEYS = ("format", "entries", "packed")
    FRAMES = None
    start: int
    end: int
    layers: tuple[int, ...]
    entries: tuple[PageEntry, ...]
    packed: tuple[Frame, ...] | None = None

    def _cross_check(self, wire: bool = False) -> None:
        if self.end < self.start:
            raise InvalidArgument(f"start must be <= end, got start={self.start} end={self.end}")
        entries = self.entries
        if not wire:
            listed = check_array("entries", entries, InvalidArgument)
            entries = tuple(check_page_entry(i, e) for i, e in enumerate(listed))
            object.__setattr__(self, "entries", entries)
        seen: set[tuple[int, int]] = set()
        allowed = set(self.layers)
        for i, (layer, token0, kpage, vpage) in enumerate(entries):
            if layer not in allowed or (layer, token0) in seen:
                raise InvalidArgument(f"entries[{i}] ({layer}, {token0}) is a duplicate or not in layers")
            seen.add((layer, token0))
            if not len(kpage) or not len(vpage):
                raise InvalidArgument(f"entries[{i}] ({layer}, {token0}) has an empty page")
        if self.packed is not None and not wire:
            packed = tuple(byte_view(f, f"packed[{i}]") for i, f in enumerate(check_array("packed", self.packed,
                                                                                          InvalidArgument)))
            try:
                split = split_packed(packed, 2 * len(entries))
            except ProtocolError as exc:
                raise InvalidArgument(str(exc)) from None
            pages = [page for e in entries for page in (e[2], e[3])]
            if any(a != b for a, b in zip(split, pages, strict=True)):
                raise InvalidArgument("packed frames are not the entries' pages in order")
            object.__setattr__(self, "packed", packed)

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        listed = [[e[0], e[1]] for e in self.entries]
        if self.packed is not None:
            return {"format": "pages", "packed": True, "entries": listed}, list(self.packed)
        frames: list[Frame] = []
        for entry in self.entries:
            frames += (entry[2], entry[3])
        return {"format": "pages", "entries": listed}, frames

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        return pages_from_wire(header, frames, limits)


@dataclass(frozen=True, slots=True, kw_only=True)
class DropReply(_Message):
    """``dropped``: whether the sequence existed."""

    OP = "drop"
    FIELDS = (("dropped", check_bool),)
    dropped: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthReply(_Message):
    OP = "length"
    FIELDS = (("length", check_position),)
    length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthsReply(_Message):
    """``lengths``: one item per requested seq_id, in order: its length, or nil when no such sequence."""

    OP = "lengths"
    FIELDS = (("lengths", check_opt_positions),)
    lengths: tuple[int | None, ...]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class AttendReply(_Message):
    """``attend``'s result over tokens ``[start, end)`` (``end`` resolved): ``out`` float32 ``[T_q, H_q, D]`` and
    ``lse`` float32 ``[T_q, H_q]`` (natural log of the softmax denominator; -inf where a query saw no token), two
    frames. Merge results with :func:`kvd.attention.merge`."""

    OP = "attend"
    FIELDS = (("start", check_position), ("end", check_position))
    EXTRA_KEYS = ("shape",)
    FRAMES = 2
    start: int
    end: int
    out: Any
    lse: Any

    def _cross_check(self, wire: bool = False) -> None:
        if self.end < self.start:
            raise InvalidArgument(f"start must be <= end, got start={self.start} end={self.end}")
        if not wire:
            out = wire_array(as_array(self.out, "out"))
            lse = wire_array(as_array(self.lse, "lse"))
            if out.dtype != "<f4" or lse.dtype != "<f4" or out.ndim != 3 or lse.shape != out.shape[:2]:
                raise InvalidArgument(f"out must be float32 [T_q, H_q, D] and lse float32 [T_q, H_q], got "
                                      f"{out.dtype} {list(out.shape)} and {lse.dtype} {list(lse.shape)}")
            check_shape("out shape", list(out.shape), InvalidArgument, min_dims=(1, 1, 1))
            object.__setattr__(self, "out", out)
            object.__setattr__(self, "lse", lse)

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        return {"shape": list(self.out.shape)}, [tensor_frame(self.out), tensor_frame(self.lse)]

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        shape = check_shape("shape", header.get("shape"), ProtocolError, min_dims=(1, 1, 1))
        return {"out": frame_tensor(frames[0], "out", "float32", shape),
                "lse": frame_tensor(frames[1], "lse", "float32", shape[:2])}


_REASON = text_in(MAX_ERROR_MESSAGE_BYTES, nonempty=False)
_opt_text = text_in(MAX_ERROR_MESSAGE_BYTES, nonempty=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrateReply(_Message):
    """A namespace's calibration state after a ``calibrate`` (Store.calibration_state): ``state`` (``active``,
    ``quarantined``, ...), ``reason`` (why, e.g. the layout a quarantined calibration was measured on),
    ``digest`` and ``model`` of the calibration, and per level (``8bit``, ``q4``) its ``budget``, ``mean``,
    ``worst``, ``bits``, ``met``, ``off`` and ``protected``. ``required`` (protocol 1.8): whether the namespace
    requires a calibration (its own setting, else the shard's), only in a reply to a request with ``require``;
    on the wire only when set."""

    OP = "calibrate"
    FIELDS = (("state", check_calibration_state), ("reason", _REASON), ("digest", _opt_text), ("model", _opt_text),
              ("levels", check_calibration_levels))
    OPTIONAL = ("digest", "model", "levels")
    SET_ONLY = (("required", check_bool),)
    state: str
    reason: str
    digest: str = ""
    model: str = ""
    levels: dict[str, dict[str, Any]] | None = None  # normalised to a dict
    required: bool | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsReply(_Message):
    """Store.stats() plus server counters; numpy scalars are turned into Python numbers."""

    OP = "stats"
    FIELDS = (("stats", check_info),)
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExplainReply(_Message):
    """Store.explain: ``level`` (format tag), ``reasons``, and the store's other keys in ``details``."""

    OP = "explain"
    FIELDS = (("level", check_short_text), ("reasons", check_text_list), ("details", check_opt_info))
    OPTIONAL = ("details",)
    level: str
    reasons: tuple[str, ...]
    details: dict[str, Any] | None = None  # normalised to a dict


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyReply(_Message):
    """The cluster as the coordinator sees it: ``epoch`` (bumped whenever a shard joins or moves), ``shards``
    (maps ``{"id", "endpoint"}``; clients route over the ids, docs/protocol.md §10), the cluster's ``level``
    tag and its ``level_epoch``. ``shards`` may be empty while no shard has registered yet."""

    OP = "topology"
    FIELDS = (
        ("epoch", check_position),
        ("shards", check_shards),
        ("level", check_short_text),
        ("level_epoch", check_position),
    )
    epoch: int
    shards: tuple[dict[str, str], ...]
    level: str
    level_epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply(_Message):
    """A failed request: ``code`` (kvd.errors), ``error`` (class name), ``message``. ``request_id`` is None
    when the request was too malformed to read one. :meth:`exception` gives the matching kvd error."""

    FIELDS = (
        ("code", int_in(1, MAX_INDEX)),
        ("error", check_short_text),
        ("message", text_in(MAX_ERROR_MESSAGE_BYTES, nonempty=False)),
    )
    request_id: int | None  # type: ignore[assignment]
    code: int
    error: str
    message: str

    def exception(self) -> KvdError:
        return error_for_code(self.code, self.message)


Request = (
    HelloRequest
    | PingRequest
    | RegisterRequest
    | AppendRequest
    | GetRequest
    | DropRequest
    | LengthRequest
    | LengthsRequest
    | AttendRequest
    | CalibrateRequest
    | StatsRequest
    | ExplainRequest
    | TopologyRequest
)
Reply = (
    HelloReply
    | PingReply
    | RegisterReply
    | AppendReply
    | GetReply
    | GetPagesReply
    | DropReply
    | LengthReply
    | LengthsReply
    | AttendReply
    | CalibrateReply
    | StatsReply
    | ExplainReply
    | TopologyReply
    | ErrorReply
)
REQUESTS: dict[str, type[_Message]] = {
    c.OP: c
    for c in (
        HelloRequest,
        PingRequest,
        RegisterRequest,
        AppendRequest,
        GetRequest,
        DropRequest,
        LengthRequest,
        LengthsRequest,
        AttendRequest,
        CalibrateRequest,
        StatsRequest,
        ExplainRequest,
        TopologyRequest,
    )
}
# The requests whose effect is more than their reply: a server runs these for a client that has left since it
# sent them (fire-and-forget writes are kept); the others' only effect is a reply nobody would read.
STATE_OPS = frozenset({RegisterRequest.OP, AppendRequest.OP, DropRequest.OP, CalibrateRequest.OP})
_REPLIES: dict[str, type[_Message]] = {
    c.OP: c
    for c in (
        HelloReply,
        PingReply,
        RegisterReply,
        AppendReply,
        DropReply,
        LengthReply,
        LengthsReply,
        AttendReply,
        CalibrateReply,
        StatsReply,
        ExplainReply,
        TopologyReply,
    )
}
_GET_REPLIES: dict[str, type[_Message]] = {"fp16": GetReply, "pages": GetPagesReply}
_ALL: tuple[type[_Message], ...] = (*REQUESTS.values(), *_REPLIES.values(), *_GET_REPLIES.values(), ErrorReply)
_DEFAULTS = {c: {f.name: f.default for f in fields(c) if f.default is not MISSING} for c in _ALL}
_FIELD_NAMES = {c: tuple(f.name for f in fields(c)) for c in _ALL}
