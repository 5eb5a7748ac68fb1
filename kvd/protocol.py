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

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from functools import partial
from typing import Any, ClassVar

import msgpack

from kvd.errors import (
    ConfigError,
    InvalidArgument,
    KvdError,
    ProtocolError,
    UnsupportedVersion,
    error_for_code,
)
from kvd.protocol_schema import (  # noqa: F401 - constants re-exported: kvd.protocol is the public module
    _MIN_ARRAY_LEN,
    _MIN_HEADER_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_PAGES,
    DTYPES,
    GET_FORMATS,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_INDEX,
    MAX_NAMESPACE_BYTES,
    MAX_POSITION,
    MAX_REQUEST_ID,
    MAX_SEQ_ID_BYTES,
    MAX_SHARDS,
    MAX_STATS_KEYS,
    MAX_TEXT_BYTES,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    SERVER_ROLES,
    Check,
    DecodeContext,
    Frame,
    PageEntry,
    SeqId,
    as_array,
    byte_view,
    check_array,
    check_bool,
    check_dim,
    check_get_format,
    check_index,
    check_info,
    check_layers,
    check_limits,
    check_namespace,
    check_opt_info,
    check_opt_position,
    check_page_entry,
    check_position,
    check_request_id,
    check_required_layers,
    check_role,
    check_seq_id,
    check_shape,
    check_shards,
    check_short_text,
    check_tensors,
    check_text_list,
    frame_tensor,
    int_in,
    is_int,
    open_message,
    plain_int,
    show,
    tensor_frame,
    tensors_from_wire,
    text_in,
    unpack_header,
    wire_array,
    wire_dtype_name,
)
from kvd.routing import owner, rendezvous_score  # noqa: F401 - kept importable as kvd.protocol.owner


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



# ---- messages ------------------------------------------------------------------------------------------------

_FieldSpec = tuple[tuple[str, Check], ...]
_NS_SEQ: _FieldSpec = (("namespace", check_namespace), ("seq_id", check_seq_id))


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
        object.__setattr__(msg, "request_id", check_request_id("id", msg.request_id, exc))
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
    FIELDS = (("namespace", check_namespace), ("num_layers", check_dim), ("num_kv_heads", check_dim),
              ("head_dim", check_dim))
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
    FIELDS = (*_NS_SEQ, ("offset", check_opt_position))
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
            check_tensors(self, min_dims=(1, 1, 1, 1), declared=self.dtype)

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        return ({"dtype": self.dtype, "shape": list(self.keys.shape)},
                [tensor_frame(self.keys), tensor_frame(self.values)])

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        return tensors_from_wire(header, frames, min_dims=(1, 1, 1, 1), dtypes=tuple(DTYPES))


@dataclass(frozen=True, slots=True, kw_only=True)
class GetRequest(_Message):
    """Store.get (``format="fp16"``, reply :class:`GetReply`) or get_pages (``"pages"``, :class:`GetPagesReply`).

    Tokens ``[start, end)`` (``end=None``: to the end) of ``layers`` (None: all, in order).
    """

    OP = "get"
    FIELDS = (*_NS_SEQ, ("start", check_position), ("end", check_opt_position), ("layers", check_layers),
              ("format", check_get_format))
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
    """

    OP = "hello"
    FIELDS = (("protocol_version", check_position), ("protocol_minor", check_position),
              ("kvd_version", check_short_text), ("page_format_version", check_position), ("role", check_role),
              ("shard_id", check_short_text), ("page_tokens", _opt_dim),
              *((name, check_position) for name in _LIMIT_FIELDS))
    OPTIONAL = ("page_tokens",)
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

    def _cross_check(self, wire: bool = False) -> None:
        if (self.page_tokens is None) != (self.role == "coordinator"):
            raise InvalidArgument(f"page_tokens must be set for a shard and nil for a coordinator, got role "
                                  f"{self.role!r} with page_tokens {self.page_tokens!r}")
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
    FIELDS = (("length", check_position),)
    length: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GetReply(_Message):
    """Decoded float16 ``keys`` and ``values`` ``[len(layers), end - start, H, D]`` of tokens [start, end)."""

    OP = "get"
    FIELDS = (("start", check_position), ("end", check_position), ("layers", check_required_layers))
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
            check_tensors(self, min_dims=(1, 0, 1, 1), declared="float16")
        want = (len(self.layers), self.end - self.start)
        if self.end < self.start or self.keys.shape[:2] != want:
            raise InvalidArgument(f"tensor shape {list(self.keys.shape)} does not match {len(self.layers)} layers "
                                  f"and tokens [{self.start}, {self.end})")

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        return ({"format": "fp16", "dtype": self.dtype, "shape": list(self.keys.shape)},
                [tensor_frame(self.keys), tensor_frame(self.values)])

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        return tensors_from_wire(header, frames, min_dims=(1, 0, 1, 1), dtypes=("float16",))


@dataclass(frozen=True, slots=True, kw_only=True)
class GetPagesReply(_Message):
    """Stored pages covering tokens [start, end) of ``layers``: entries ``(layer, token0, key_page, value_page)``.

    Exactly Store.get_pages' entries. Pages are bytes-like: decoded replies hold the received frames themselves
    (bytes) or memoryviews of them, never copies.
    ``kvd.pages.assemble(entries, start, end, layers)`` rebuilds the float16 arrays (docs/formats.md).
    """

    OP = "get"
    FIELDS = (("start", check_position), ("end", check_position), ("layers", check_required_layers))
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

    def _payload(self) -> tuple[dict[str, Any], list[Frame]]:
        frames: list[Frame] = []
        for entry in self.entries:
            frames += (entry[2], entry[3])
        return {"format": "pages", "entries": [[e[0], e[1]] for e in self.entries]}, frames

    @classmethod
    def _from_payload(cls, header: Mapping[str, Any], frames: list[Frame], limits: Limits) -> dict[str, Any]:
        listed = check_array("entries", header.get("entries"), ProtocolError)
        if len(listed) > limits.max_pages or len(frames) != 2 * len(listed):
            raise ProtocolError(f"entries lists {len(listed)} pages but {len(frames)} page frames follow "
                                f"(2 per entry, at most {limits.max_pages} entries)")
        entries = []
        for i, pair in enumerate(listed):
            if type(pair) is list and len(pair) == 2 and plain_int(pair[0], MAX_INDEX) \
                    and plain_int(pair[1], MAX_POSITION):  # fast path; the checks below name what is wrong
                entries.append((pair[0], pair[1], frames[2 * i], frames[2 * i + 1]))
                continue
            if not isinstance(pair, list) or len(pair) != 2:
                raise ProtocolError(f"entries[{i}] must be [layer, token0], got {show(pair)}")
            layer = check_index(f"entries[{i}].layer", pair[0], ProtocolError)
            entries.append((layer, check_position(f"entries[{i}].token0", pair[1], ProtocolError),
                            frames[2 * i], frames[2 * i + 1]))
        return {"entries": tuple(entries)}


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
    FIELDS = (("epoch", check_position), ("shards", check_shards), ("level", check_short_text),
              ("level_epoch", check_position))
    epoch: int
    shards: tuple[dict[str, str], ...]
    level: str
    level_epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply(_Message):
    """A failed request: ``code`` (kvd.errors), ``error`` (class name), ``message``. ``request_id`` is None
    when the request was too malformed to read one. :meth:`exception` gives the matching kvd error."""

    FIELDS = (("code", int_in(1, MAX_INDEX)), ("error", check_short_text),
              ("message", text_in(MAX_ERROR_MESSAGE_BYTES, nonempty=False)))
    request_id: int | None  # type: ignore[assignment]
    code: int
    error: str
    message: str

    def exception(self) -> KvdError:
        return error_for_code(self.code, self.message)


Request = (HelloRequest | PingRequest | RegisterRequest | AppendRequest | GetRequest | DropRequest | LengthRequest
           | StatsRequest | ExplainRequest | TopologyRequest)
Reply = (HelloReply | PingReply | RegisterReply | AppendReply | GetReply | GetPagesReply | DropReply | LengthReply
         | StatsReply | ExplainReply | TopologyReply | ErrorReply)
REQUESTS: dict[str, type[_Message]] = {c.OP: c for c in (HelloRequest, PingRequest, RegisterRequest, AppendRequest,
                                                       GetRequest, DropRequest, LengthRequest, StatsRequest,
                                                       ExplainRequest, TopologyRequest)}
_REPLIES: dict[str, type[_Message]] = {c.OP: c for c in (HelloReply, PingReply, RegisterReply, AppendReply,
                                                       DropReply, LengthReply, StatsReply, ExplainReply,
                                                       TopologyReply)}
_GET_REPLIES: dict[str, type[_Message]] = {"fp16": GetReply, "pages": GetPagesReply}
_ALL: tuple[type[_Message], ...] = (*REQUESTS.values(), *_REPLIES.values(), *_GET_REPLIES.values(), ErrorReply)
_DEFAULTS = {c: {f.name: f.default for f in fields(c) if f.default is not MISSING} for c in _ALL}
_FIELD_NAMES = {c: tuple(f.name for f in fields(c)) for c in _ALL}
_PAYLOAD_NAMES = {c: tuple(f.name for f in fields(c) if f.name != "request_id" and f.name not in dict(c.FIELDS))
                  for c in _ALL}  # the fields _from_payload fills (or their defaults)
_ENVELOPES: tuple[tuple[str, ...], ...] = (("v", "id", "op"), ("v", "id", "op", "ok"), ("v", "id", "ok"))
_KNOWN: dict[tuple[type[_Message], tuple[str, ...]], frozenset[str]] = {  # header keys each message may have
    (c, env): frozenset((*env, *(name for name, _ in c.FIELDS), *c.EXTRA_KEYS))
    for c in _ALL for env in _ENVELOPES}


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


_packb = partial(msgpack.packb, use_bin_type=True)


# ---- encoding ------------------------------------------------------------------------------------------------


def _encode(msg: _Message, envelope: dict[str, Any], limits: Limits | None) -> list[Frame]:
    header = envelope
    for name, _check in msg.FIELDS:
        header[name] = getattr(msg, name)
    if msg.FRAMES == 0 and not msg.EXTRA_KEYS:
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


def _check_version(header: Mapping[Any, Any]) -> None:
    if header["v"] != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {header['v']} is not supported; this side speaks "
                                 f"{PROTOCOL_VERSION}")


def _build(cls: type[_Message], header: dict[Any, Any], frames: list[Frame], limits: Limits,
           envelope: tuple[str, ...]) -> Any:
    """The message of class ``cls`` from a header already past :func:`_open`; validates every field once."""
    known = _KNOWN[cls, envelope]
    for key in header:
        if key not in known:
            unknown = [str(k)[:80] for k in header if k not in known][:8]
            raise ProtocolError(f"{cls.OP or 'error reply'}: unknown header keys {unknown}")
    if cls.FRAMES is not None and len(frames) != cls.FRAMES:
        raise ProtocolError(f"{cls.OP or 'error reply'}: expected {cls.FRAMES} frames after the header, got "
                            f"{len(frames)}")
    if "id" not in header:
        raise ProtocolError(f"{cls.OP or 'error reply'}: missing header field 'id'")
    rid = header["id"]
    msg = object.__new__(cls)
    setattr_ = object.__setattr__
    setattr_(msg, "request_id", None if rid is None and cls is ErrorReply
             else check_request_id("id", rid, ProtocolError))
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
    return _decode_request(frames, limits, DecodeContext())


def parse_request(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Request | ErrorReply:
    """Like :func:`decode_request`, but a bad request becomes the :class:`ErrorReply` to send back (carrying
    the request id whenever the header had a readable one). For the server loop: it never raises."""
    ctx = DecodeContext()
    try:
        return _decode_request(frames, limits, ctx)
    except KvdError as exc:
        return error_reply(ctx.request_id, exc)


def decode_reply(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Reply:
    """The reply in ``frames`` (an :class:`ErrorReply` for a failed request: call ``.exception()``).

    Raises the same errors as :func:`decode_request` when the reply itself is malformed.
    """
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
