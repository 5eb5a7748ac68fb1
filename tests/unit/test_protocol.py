"""The wire protocol (issue 4): round trips, golden bytes, every schema rule, a hostile-input fuzz, routing.

Golden fixtures live in tests/unit/fixtures/protocol/*.frames (each frame: 4-byte little-endian length, then
the bytes). They were written once from the encoder; a wire change must be deliberate: re-run
``python tests/unit/test_protocol.py --write-fixtures``, bump the protocol version if old peers break, and
update docs/protocol.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import random
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd import errors, pages
from kvd.errors import (
    ConfigError,
    InvalidArgument,
    KvdError,
    MessageTooLarge,
    ProtocolError,
    UnsupportedVersion,
)
from kvd.wire import protocol as p

FIXTURES = Path(__file__).parent / "fixtures" / "protocol"
BF16 = np.dtype(ml_dtypes.bfloat16)
WIRE_DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4"), "bfloat16": BF16}
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def as_bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


def same(a: Any, b: Any) -> bool:
    """Field-by-field equality, comparing arrays and pages by their bytes (NaN-safe, dtype- and shape-exact)."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
                return False
        elif f.name == "packed" and isinstance(x, tuple) and isinstance(y, tuple):
            if [bytes(f) for f in x] != [bytes(f) for f in y]:
                return False
        elif f.name == "packed" and isinstance(x, (bytes, memoryview)) and isinstance(y, (bytes, memoryview)):
            if bytes(x) != bytes(y):  # a packed get reply's frame: the bytes, whatever holds them
                return False
        elif f.name == "entries":
            if [(e[0], e[1], bytes(e[2]), bytes(e[3])) for e in x] != [
                (e[0], e[1], bytes(e[2]), bytes(e[3])) for e in y
            ]:
                return False
        elif x != y or type(x) is not type(y):
            return False
    return True


def encode(msg: Any) -> list[Any]:
    return p.encode_reply(msg) if type(msg).__name__.endswith("Reply") else p.encode_request(msg)


def decode(frames: list[Any]) -> Any:
    header = msgpack.unpackb(bytes(frames[0]))
    return p.decode_reply(frames) if "ok" in header else p.decode_request(frames)


# ---- deterministic example messages (also the golden fixtures) -----------------------------------------------


def tensor(shape: tuple[int, ...], dtype: str, offset: float = 0.0) -> np.ndarray:
    return (np.arange(math.prod(shape), dtype=np.float32).reshape(shape) / 4 + offset).astype(WIRE_DTYPES[dtype])


def real_page(tokens: int, offset: float, level: str = "fp16") -> bytes:
    """A small real kvd page (deterministic bytes)."""
    return pages.encode(tensor((tokens, 1, 4), "float16", offset), level, role="key")


def examples() -> dict[str, Any]:
    k16, v16 = tensor((2, 3, 1, 4), "float16"), tensor((2, 3, 1, 4), "float16", -1.5)
    packed = [real_page(2, 0.0), real_page(2, 1.0, "q8"), real_page(1, 2.0), real_page(1, 3.0, "q8")]
    return {
        "hello_request": p.HelloRequest(request_id=1),
        "hello_reply": p.HelloReply.for_limits(p.Limits(), request_id=1, kvd_version="0.1.0",
                                               page_format_version=2, shard_id="shard-0", page_tokens=64),
        "hello_reply_coordinator": p.HelloReply.for_limits(p.Limits(), request_id=1, kvd_version="0.1.0",
                                                           page_format_version=2, role="coordinator",
                                                           shard_id="coordinator"),
        "ping_request": p.PingRequest(request_id=7),
        "ping_reply": p.PingReply(request_id=7),
        "register_request": p.RegisterRequest(request_id=2, namespace="smollm2", num_layers=30, num_kv_heads=3,
                                              head_dim=64),
        "register_reply": p.RegisterReply(request_id=2),
        "append_request_float16": p.AppendRequest(request_id=3, namespace="smollm2", seq_id="req-42", keys=k16,
                                                  values=v16),
        "append_request_float32_offset": p.AppendRequest(
            request_id=4, namespace="m", seq_id=2**40 + 5, offset=3, keys=tensor((1, 2, 2, 2), "float32"),
            values=tensor((1, 2, 2, 2), "float32", 100.0)),
        "append_request_bfloat16": p.AppendRequest(request_id=5, namespace="m", seq_id=0,
                                                   keys=tensor((1, 1, 2, 2), "bfloat16"),
                                                   values=tensor((1, 1, 2, 2), "bfloat16", -2.0)),
        "append_request_position": p.AppendRequest(request_id=19, namespace="m", seq_id="block-1", offset=0,
                                                   position=128, keys=tensor((1, 1, 1, 2), "float16"),
                                                   values=tensor((1, 1, 1, 2), "float16", 1.0)),
        "append_request_parent": p.AppendRequest(request_id=20, namespace="m", seq_id="block-1", offset=0,
                                                 position=128, parent="block-0",
                                                 keys=tensor((1, 1, 1, 2), "float16"),
                                                 values=tensor((1, 1, 1, 2), "float16", 1.0)),
        "append_reply": p.AppendReply(request_id=3, length=3),
        "get_request_default": p.GetRequest(request_id=6, namespace="smollm2", seq_id="req-42"),
        "get_request_pages": p.GetRequest(request_id=8, namespace="smollm2", seq_id=17, start=64, end=200,
                                          layers=(0, 5), format="pages"),
        "get_reply_fp16": p.GetReply(request_id=6, start=0, end=3, layers=(0, 1), keys=k16, values=v16),
        "get_reply_fp16_empty": p.GetReply(request_id=9, start=5, end=5, layers=(2,),
                                           keys=np.zeros((1, 0, 1, 4), np.float16),
                                           values=np.zeros((1, 0, 1, 4), np.float16)),
        "get_reply_pages": p.GetPagesReply(request_id=8, start=64, end=200, layers=(0, 5), entries=(
            (0, 64, b"KVDP-key-0-64", b"KVDP-value-0-64"),
            (0, 128, b"KVDP-key-0-128", b"KVDP-value-0-128"),
            (5, 64, b"KVDP-key-5-64", b"KVDP-value-5-64"),
        )),
        "get_request_packed": p.GetRequest(request_id=18, namespace="smollm2", seq_id=17, start=1, end=3,
                                           layers=(0,), format="pages", packed=True),
        "get_reply_pages_packed": p.GetPagesReply(  # three pages in the first frame, one in the second
            request_id=18, start=1, end=3, layers=(0,), entries=((0, 0, *packed[:2]), (0, 2, *packed[2:])),
            packed=(b"".join(packed[:3]), packed[3])),
        "drop_request": p.DropRequest(request_id=10, namespace="smollm2", seq_id="req-42"),
        "drop_reply": p.DropReply(request_id=10, dropped=True),
        "length_request": p.LengthRequest(request_id=11, namespace="smollm2", seq_id=17),
        "length_reply": p.LengthReply(request_id=11, length=4096),
        "lengths_request": p.LengthsRequest(request_id=19, namespace="smollm2", seq_ids=("blk-0", 17, "blk-2")),
        "lengths_reply": p.LengthsReply(request_id=19, lengths=(128, None, 128)),
        "stats_request": p.StatsRequest(request_id=12),
        "stats_reply": p.StatsReply(request_id=12, stats={
            "used_bytes": 1 << 30, "capacity_bytes": 1 << 32, "pressure": 0.25, "level": "fp16", "epoch": 0,
            "pages_by_level": {"fp16": 10, "q8": 0}, "raw_layers": [0, 1], "eight_bit": None, "lru": True}),
        "explain_request": p.ExplainRequest(request_id=13, namespace="smollm2", seq_id="req-42", layer=3,
                                            token=100),
        "explain_reply": p.ExplainReply(request_id=13, level="q8", reasons=("sealed at level q8",),
                                        details={"page": 1, "sealed_epoch": 2, "recompressed": [["q8", 2]]}),
        "error_reply": p.ErrorReply(request_id=14, code=6, error="UnknownSequence",
                                    message="no sequence 'req-9' in namespace 'smollm2'"),
        "topology_request": p.TopologyRequest(request_id=15),
        "topology_reply": p.TopologyReply(request_id=15, epoch=3, shards=(
            {"id": "shard-0", "endpoint": "tcp://10.0.0.7:5555"}, {"id": "shard-1", "endpoint": "tcp://10.0.0.8:5555"}),
            level="q8", level_epoch=2),
        "topology_reply_empty": p.TopologyReply(request_id=16, epoch=0, shards=(), level="fp16", level_epoch=0),
        "error_reply_no_id": p.ErrorReply(request_id=None, code=10, error="ProtocolError",
                                          message="header is not valid msgpack"),
        # protocol 1.3: a shard's incarnation, asked for in hello and named by an append; routing refusals
        "hello_request_incarnation": p.HelloRequest(request_id=20, incarnation=True),
        "hello_reply_incarnation": p.HelloReply.for_limits(p.Limits(), request_id=20, kvd_version="0.1.0",
                                                           page_format_version=2, shard_id="shard-0",
                                                           page_tokens=64, incarnation="9f1c2ab04e"),
        "append_request_incarnation": p.AppendRequest(request_id=21, namespace="m", seq_id=7, offset=0,
                                                      incarnation="9f1c2ab04e",
                                                      keys=tensor((1, 1, 1, 2), "float16"),
                                                      values=tensor((1, 1, 1, 2), "float16", 3.0)),
        "error_reply_wrong_shard": p.ErrorReply(
            request_id=21, code=19, error="WrongShard",
            message="shard 'shard-0' does not own sequence 7 of namespace 'm': shard 'shard-1' does "
                    "(topology epoch 4); refresh the topology and resend"),
        # protocol 1.4: keys and values packed in one frame, in an append and in an fp16 get reply
        "append_request_packed": p.AppendRequest(request_id=22, namespace="smollm2", seq_id="req-42", keys=k16,
                                                 values=v16, packed=True),
        "get_request_fp16_packed": p.GetRequest(request_id=23, namespace="smollm2", seq_id="req-42", packed=True),
        "get_reply_fp16_packed": p.GetReply(request_id=23, start=0, end=3, layers=(0, 1), keys=k16, values=v16,
                                            packed=np.concatenate([k16, v16]).tobytes()),
        # protocol 1.5: attention computed by the shard, its output and log-sum-exp
        "attend_request": p.AttendRequest(request_id=24, namespace="smollm2", seq_id="req-42", layer=1,
                                          queries=tensor((1, 2, 4), "float16"), start=0, end=3, scale=0.5,
                                          positions=(2,)),
        "attend_request_default": p.AttendRequest(request_id=25, namespace="smollm2", seq_id=17, layer=0,
                                                  queries=tensor((2, 1, 4), "float32")),
        "attend_reply": p.AttendReply(request_id=24, start=0, end=3, out=tensor((1, 2, 4), "float32"),
                                      lse=np.array([[1.5, -np.inf]], np.float32)),
        # protocol 1.7: a namespace's calibration record (kvd.calibration.Calibration.to_dict) and its state
        "calibrate_request": p.CalibrateRequest(request_id=26, namespace="smollm2", calibration=CALIBRATION),
        "calibrate_reply": p.CalibrateReply(
            request_id=26, state="active", reason="calibration 5d2c0e9e1a7f3b64 active",
            digest="5d2c0e9e1a7f3b64c1d0a9e8f7b6a5c4", model="smollm2-135m",
            levels={"q4": {"budget": 0.06, "mean": 0.055, "worst": 0.059, "bits": 5.2, "met": True, "off": "",
                           "protected": 2}}),
        "calibrate_reply_quarantined": p.CalibrateReply(
            request_id=27, state="quarantined", reason="quarantined: calibration 5d2c0e9e1a7f3b64 was measured on "
            "layout (layers, kv_heads, head_dim) (3, 1, 4), the namespace is (2, 1, 4)"),
        # protocol 1.8: an append that asks for its reply's notice, and that reply; a namespace's own
        # require_calibration, alone or with a calibration, and the reply that says whether it requires one
        "append_request_notices": p.AppendRequest(request_id=28, namespace="smollm2", seq_id="req-42", keys=k16,
                                                  values=v16, offset=3, incarnation="9f1c2ab04e", notices=True,
                                                  packed=True),
        "append_reply_notice": p.AppendReply(request_id=28, length=6, notice=NOTICE),
        "calibrate_request_require": p.CalibrateRequest(request_id=29, namespace="smollm2", require=True),
        "calibrate_request_both": p.CalibrateRequest(request_id=30, namespace="smollm2", calibration=CALIBRATION,
                                                     require=False),
        "calibrate_reply_required": p.CalibrateReply(request_id=29, state="needed", reason=NOTICE, required=True),
    }


NOTICE = "needs calibration: pages compressed with the default protection"  # Protection's reason, state "needed"


# A calibration record of one layer and one KV head (a real one is what kvd.calibration.calibrate returns)
CALIBRATION = {
    "version": 1, "model": "smollm2-135m", "layout": [1, 1, 4], "dtype": "float16", "tokens": 256,
    "page_tokens": 64, "sink_tokens": 4, "eight_bit": "q8", "kvd_version": "0.1.0",
    "errors": [[[[0.0, 0.008, 0.06], [0.0, 0.007, 0.05]]]],
    "plans": {"q4": {"budget": 0.06, "heads": [[["q8"], ["q4"]]], "mean": 0.04, "worst": 0.04, "bits": 6.1,
                     "off": ""}},
    "digest": "5d2c0e9e1a7f3b64c1d0a9e8f7b6a5c4",
}


def write_frames(path: Path, frames: list[Any]) -> None:
    path.write_bytes(b"".join(len(bytes(f)).to_bytes(4, "little") + bytes(f) for f in frames))


def read_frames(path: Path) -> list[bytes]:
    data, frames, pos = path.read_bytes(), [], 0
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "little")
        frames.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return frames


def write_fixtures() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, msg in examples().items():
        write_frames(FIXTURES / f"{name}.frames", encode(msg))


# ---- golden bytes --------------------------------------------------------------------------------------------


def test_fixture_set_matches_examples() -> None:
    on_disk = {path.stem for path in FIXTURES.glob("*.frames")}
    assert on_disk == set(examples()), "fixtures and examples() disagree: regenerate deliberately"


@pytest.mark.parametrize("name", sorted(examples()))
def test_golden_bytes(name: str) -> None:
    msg = examples()[name]
    golden = read_frames(FIXTURES / f"{name}.frames")
    assert as_bytes(encode(msg)) == golden, f"the encoding of {name} changed"
    assert same(decode(golden), msg)


def test_golden_ping_bytes_match_the_spec_example() -> None:
    # docs/protocol.md shows these exact bytes for {"v": 1, "id": 7, "op": "ping"}
    assert read_frames(FIXTURES / "ping_request.frames") == [
        bytes.fromhex("83a17601a2696407a26f70a470696e67")
    ]


# ---- hypothesis round trips ----------------------------------------------------------------------------------

request_ids = st.integers(0, p.MAX_REQUEST_ID)
utf8_text = st.text(max_size=40)
namespaces = st.text(min_size=1, max_size=40).filter(lambda s: len(s.encode()) <= p.MAX_NAMESPACE_BYTES)
seq_ids = st.one_of(st.text(max_size=60), st.integers(0, p.MAX_POSITION))
positions = st.integers(0, p.MAX_POSITION)
indices = st.integers(0, p.MAX_INDEX)
dims = st.integers(1, p.MAX_INDEX)
layer_lists = st.lists(st.integers(0, 200), min_size=1, max_size=8, unique=True).map(tuple)


@st.composite
def tensor_pair(draw: Any, dtypes: tuple[str, ...] = ("float16", "float32", "bfloat16"), min_t: int = 1) -> Any:
    dtype = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.integers(low, high)) for low, high in ((1, 3), (min_t, 4), (1, 3), (1, 5)))
    n = math.prod(shape) * WIRE_DTYPES[dtype].itemsize
    k, v = draw(st.binary(min_size=n, max_size=n)), draw(st.binary(min_size=n, max_size=n))
    return tuple(np.frombuffer(b, WIRE_DTYPES[dtype]).reshape(shape) for b in (k, v))


@st.composite
def get_requests(draw: Any) -> p.GetRequest:
    start = draw(positions)
    end = draw(st.one_of(st.none(), st.integers(start, p.MAX_POSITION)))
    fmt = draw(st.sampled_from(p.GET_FORMATS))
    return p.GetRequest(request_id=draw(request_ids), namespace=draw(namespaces), seq_id=draw(seq_ids),
                        start=start, end=end, layers=draw(st.one_of(st.none(), layer_lists)), format=fmt,
                        packed=fmt == "pages" and draw(st.booleans()))


@st.composite
def get_replies(draw: Any) -> p.GetReply:
    keys, values = draw(tensor_pair(dtypes=("float16",), min_t=0))
    start = draw(st.integers(0, 10**12))
    n_layers = keys.shape[0]
    layers = tuple(draw(st.lists(st.integers(0, 100), min_size=n_layers, max_size=n_layers, unique=True)))
    return p.GetReply(request_id=draw(request_ids), start=start, end=start + keys.shape[1], layers=layers,
                      keys=keys, values=values)


@st.composite
def get_pages_replies(draw: Any) -> p.GetPagesReply:
    layers = draw(layer_lists)
    keys = draw(st.lists(st.tuples(st.sampled_from(layers), st.integers(0, 2**40)), max_size=12, unique=True))
    pages = st.binary(min_size=1, max_size=64)
    start = draw(positions)
    return p.GetPagesReply(request_id=draw(request_ids), start=start, end=draw(st.integers(start, p.MAX_POSITION)),
                           layers=layers, entries=tuple((lay, t0, draw(pages), draw(pages)) for lay, t0 in keys))


@st.composite
def span_pages(draw: Any) -> bytes:
    """Bytes that frame as a kvd page (magic, version, raw-head count, payload length, and in a version 2 page
    the held-head count); the rest is random: the protocol only frames pages, the page decoder checks them."""
    version, n_raw, payload = draw(st.sampled_from((1, 2))), draw(st.integers(0, 5)), draw(st.integers(0, 40))

    def noise(n: int) -> bytes:
        return bytes(draw(st.binary(min_size=n, max_size=n)))

    page = b"KVDP" + bytes([version]) + noise(5) + n_raw.to_bytes(2, "little") + noise(8)
    page += payload.to_bytes(4, "little") + noise(8) + noise((2 * n_raw + 7) // 8 * 8)
    if version == 2:  # the held heads' block: its count, then its own 6 bytes, then the heads
        n_held = draw(st.integers(0, 5))
        page += n_held.to_bytes(2, "little") + noise(6) + noise((2 * n_held + 7) // 8 * 8)
    return page + noise(payload)


@st.composite
def packed_pages_replies(draw: Any) -> p.GetPagesReply:
    """A packed pages reply with its pages cut into frames at random page boundaries."""
    layers = draw(layer_lists)
    keys = draw(st.lists(st.tuples(st.sampled_from(layers), st.integers(0, 2**40)), max_size=12, unique=True))
    entries = tuple((lay, t0, draw(span_pages()), draw(span_pages())) for lay, t0 in keys)
    flat = [page for e in entries for page in e[2:]]
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(flat) - 1)), max_size=4))) if len(flat) > 1 else []
    bounds = [0, *[c for c in cuts if c < len(flat)], len(flat)]
    frames = tuple(b"".join(flat[a:b]) for a, b in itertools.pairwise(bounds) if b > a)
    start = draw(positions)
    return p.GetPagesReply(request_id=draw(request_ids), start=start, end=draw(st.integers(start, p.MAX_POSITION)),
                           layers=layers, entries=entries, packed=frames)


stat_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                         st.floats(allow_nan=False), utf8_text)
stat_arrays = st.lists(st.one_of(stat_scalars, st.lists(stat_scalars, max_size=3)), max_size=4)
stat_maps = st.dictionaries(utf8_text.filter(bool), stat_scalars, max_size=4)
stat_values = st.one_of(stat_scalars, stat_arrays, stat_maps)
error_classes = st.sampled_from(sorted(errors.ERRORS_BY_CODE.values(), key=lambda c: c.code))

MESSAGES: dict[str, Any] = {
    "hello_request": st.builds(p.HelloRequest, request_id=request_ids),
    "ping_request": st.builds(p.PingRequest, request_id=request_ids),
    "register_request": st.builds(p.RegisterRequest, request_id=request_ids, namespace=namespaces,
                                  num_layers=dims, num_kv_heads=dims, head_dim=dims),
    "append_request": st.builds(lambda rid, ns, seq, off, pos, kv, notices: p.AppendRequest(
        request_id=rid, namespace=ns, seq_id=seq, offset=off, position=pos, keys=kv[0], values=kv[1],
        notices=notices), request_ids, namespaces, seq_ids, st.one_of(st.none(), positions),
        st.one_of(st.none(), positions), tensor_pair(), st.booleans()),
    "get_request": get_requests(),
    "drop_request": st.builds(p.DropRequest, request_id=request_ids, namespace=namespaces, seq_id=seq_ids),
    "length_request": st.builds(p.LengthRequest, request_id=request_ids, namespace=namespaces, seq_id=seq_ids),
    "stats_request": st.builds(p.StatsRequest, request_id=request_ids),
    "explain_request": st.builds(p.ExplainRequest, request_id=request_ids, namespace=namespaces,
                                 seq_id=seq_ids, layer=indices, token=positions),
    "hello_reply": st.builds(lambda rid, text, n, shard: p.HelloReply(
        request_id=rid, kvd_version=text, page_format_version=n[0], role="shard" if shard else "coordinator",
        shard_id=text, page_tokens=n[1] + 1 if shard else None, max_header_bytes=4096 + n[2], max_frames=3 + n[3]),
        request_ids, st.text(min_size=1, max_size=20), st.tuples(*[st.integers(0, 10**6)] * 4), st.booleans()),
    "topology_request": st.builds(p.TopologyRequest, request_id=request_ids),
    "topology_reply": st.builds(lambda rid, epoch, ids, level, level_epoch: p.TopologyReply(
        request_id=rid, epoch=epoch, shards=tuple({"id": i, "endpoint": f"tcp://{i}:1"} for i in ids), level=level,
        level_epoch=level_epoch), request_ids, positions, st.lists(st.text(min_size=1, max_size=12), unique=True,
                                                                 max_size=6), st.text(min_size=1, max_size=8),
        positions),
    "ping_reply": st.builds(p.PingReply, request_id=request_ids),
    "register_reply": st.builds(p.RegisterReply, request_id=request_ids),
    "append_reply": st.builds(p.AppendReply, request_id=request_ids, length=positions,
                              notice=st.one_of(st.none(), st.text(min_size=1, max_size=100))),
    "get_reply": get_replies(),
    "get_pages_reply": get_pages_replies(),
    "get_pages_reply_packed": packed_pages_replies(),
    "drop_reply": st.builds(p.DropReply, request_id=request_ids, dropped=st.booleans()),
    "length_reply": st.builds(p.LengthReply, request_id=request_ids, length=positions),
    "stats_reply": st.builds(p.StatsReply, request_id=request_ids,
                             stats=st.dictionaries(utf8_text.filter(bool), stat_values, max_size=8)),
    "calibrate_request": st.builds(lambda rid, ns, cal, req: p.CalibrateRequest(
        request_id=rid, namespace=ns, calibration=cal, require=True if cal is None and req is None else req),
        request_ids, namespaces, st.one_of(st.none(), st.dictionaries(utf8_text.filter(bool), stat_values,
                                                                      max_size=8)),
        st.one_of(st.none(), st.booleans())),
    "calibrate_reply": st.builds(p.CalibrateReply, request_id=request_ids, state=st.sampled_from(
        p.CALIBRATION_STATES), reason=st.text(max_size=200), digest=st.text(max_size=32),
        levels=st.dictionaries(st.sampled_from(["8bit", "q4"]), st.dictionaries(
            utf8_text.filter(bool), stat_scalars, max_size=7)), required=st.one_of(st.none(), st.booleans())),
    "explain_reply": st.builds(p.ExplainReply, request_id=request_ids, level=st.text(min_size=1, max_size=8),
                               reasons=st.lists(st.text(min_size=1, max_size=30), max_size=5).map(tuple),
                               details=st.dictionaries(utf8_text.filter(bool), stat_values, max_size=4)),
    "error_reply": st.builds(lambda rid, cls, text: p.error_reply(rid, cls(text)),
                             st.one_of(st.none(), request_ids), error_classes, st.text(max_size=3000)),
}


@pytest.mark.parametrize("kind", sorted(MESSAGES))
@HYP
@given(data=st.data())
def test_round_trip(kind: str, data: Any) -> None:
    msg = data.draw(MESSAGES[kind])
    frames = encode(msg)
    assert all(isinstance(f, (bytes, memoryview)) for f in frames)
    back = decode(as_bytes(frames))
    assert same(back, msg)
    assert as_bytes(encode(back)) == as_bytes(frames)  # canonical: decoding and re-encoding changes no byte


@HYP
@given(cls=error_classes, text=st.text(max_size=100), rid=request_ids)
def test_server_errors_come_back_as_the_same_class(cls: type[KvdError], text: str, rid: int) -> None:
    reply = p.decode_reply(as_bytes(p.encode_reply(p.error_reply(rid, cls(text)))))
    assert isinstance(reply, p.ErrorReply) and reply.request_id == rid and reply.error == cls.__name__
    exc = reply.exception()
    assert type(exc) is cls and str(exc) == str(cls(text))


def test_error_reply_from_a_foreign_exception_and_truncation() -> None:
    reply = p.error_reply(5, RuntimeError("boom"))
    assert (reply.code, reply.error) == (1, "KvdError") and "RuntimeError: boom" in reply.message
    long = p.error_reply(5, InvalidArgument("é" * 5000))
    assert len(long.message.encode()) <= p.MAX_ERROR_MESSAGE_BYTES and long.message.endswith("...")
    assert p.error_reply(-3, InvalidArgument("x")).request_id is None
    assert type(p.ErrorReply(request_id=1, code=999, error="Future", message="m").exception()) is KvdError


def test_an_append_without_position_is_the_same_bytes_as_in_1_2_and_a_bad_position_is_refused() -> None:
    k = tensor((1, 1, 1, 2), "float16")
    plain = as_bytes(encode(p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k, values=k)))
    assert b"position" not in plain[0]  # a 1.2 server (unknown keys are errors) is sent what it knows
    with_pos = as_bytes(encode(p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k, values=k,
                                               position=64)))
    assert msgpack.unpackb(with_pos[0])["position"] == 64
    assert decode(with_pos).position == 64 and decode(plain).position is None
    with pytest.raises(InvalidArgument, match="position must be >= 0"):
        p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k, values=k, position=-1)
    header = msgpack.unpackb(with_pos[0])
    for bad, err in ((-3, InvalidArgument), ("64", ProtocolError), (1.5, ProtocolError)):
        header["position"] = bad
        with pytest.raises(err, match="position"):
            p.decode_request([packb(header), *with_pos[1:]])


def test_1_8_fields_are_on_the_wire_only_when_set_so_a_1_7_peer_gets_its_own_bytes() -> None:
    # an append without notices, its reply without a notice and a calibrate with a record only: 1.7's bytes
    ex = examples()
    old = ex["append_request_float16"]
    plain = p.AppendRequest(request_id=3, namespace="smollm2", seq_id="req-42", keys=old.keys, values=old.values,
                            notices=False)
    assert as_bytes(encode(plain)) == read_frames(FIXTURES / "append_request_float16.frames")
    assert b"notice" not in as_bytes(encode(p.AppendReply(request_id=3, length=3)))[0]
    assert as_bytes(encode(p.AppendReply(request_id=3, length=3))) == read_frames(FIXTURES / "append_reply.frames")
    assert b"require" not in as_bytes(encode(ex["calibrate_request"]))[0]
    assert b"required" not in as_bytes(encode(ex["calibrate_reply"]))[0]
    # with them: the keys, and their values back
    asked = msgpack.unpackb(as_bytes(encode(ex["append_request_notices"]))[0])
    assert asked["notices"] is True
    assert decode(as_bytes(encode(ex["append_reply_notice"]))).notice == NOTICE
    alone = msgpack.unpackb(as_bytes(encode(ex["calibrate_request_require"]))[0])
    assert alone["require"] is True and alone["calibration"] is None
    back = decode(as_bytes(encode(ex["calibrate_request_require"])))
    assert back.calibration is None and back.require is True
    assert decode(as_bytes(encode(ex["calibrate_reply_required"]))).required is True


# ---- zero copy -----------------------------------------------------------------------------------------------


def test_append_frames_are_views_of_the_callers_arrays() -> None:
    keys, values = tensor((2, 8, 2, 16), "float16"), tensor((2, 8, 2, 16), "float16", 1.0)
    frames = p.encode_request(p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=keys, values=values))
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), keys)
    assert np.shares_memory(np.frombuffer(frames[2], np.uint8), values)
    received = [bytearray(bytes(f)) for f in frames]
    req = p.decode_request(received)
    assert isinstance(req, p.AppendRequest)
    assert np.shares_memory(req.keys, np.frombuffer(received[1], np.uint8))
    assert np.array_equal(req.keys, keys) and np.array_equal(req.values, values)


def test_pages_are_views_of_the_received_frames() -> None:
    frames = [bytearray(bytes(f)) for f in encode(examples()["get_reply_pages"])]
    reply = p.decode_reply(frames)
    assert isinstance(reply, p.GetPagesReply)
    assert np.shares_memory(np.frombuffer(reply.entries[1][2], np.uint8), np.frombuffer(frames[3], np.uint8))


def test_packed_pages_are_views_of_the_received_frames_and_match_the_unpacked_form() -> None:
    msg = examples()["get_reply_pages_packed"]
    frames = [bytearray(bytes(f)) for f in encode(msg)]
    assert len(frames) == 3  # the header and two packed frames for four pages
    reply = p.decode_reply(frames)
    assert isinstance(reply, p.GetPagesReply) and reply.packed is not None
    assert np.shares_memory(np.frombuffer(reply.entries[1][2], np.uint8), np.frombuffer(frames[1], np.uint8))
    assert np.shares_memory(np.frombuffer(reply.entries[1][3], np.uint8), np.frombuffer(frames[2], np.uint8))
    unpacked = dataclasses.replace(msg, packed=None)
    plain = p.decode_reply(as_bytes(encode(unpacked)))
    assert [(e[0], e[1], bytes(e[2]), bytes(e[3])) for e in plain.entries] == [
        (e[0], e[1], bytes(e[2]), bytes(e[3])) for e in reply.entries]
    got = pages.assemble(reply.entries, reply.start, reply.end, reply.layers)
    want = pages.assemble(plain.entries, plain.start, plain.end, plain.layers)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_packed_frames_must_be_the_entries_pages() -> None:
    msg = examples()["get_reply_pages_packed"]
    frames = [bytes(f) for f in msg.packed]
    with pytest.raises(InvalidArgument, match="not the entries' pages in order"):
        dataclasses.replace(msg, packed=(frames[0], PAGES[1]))  # same framing, other bytes
    with pytest.raises(InvalidArgument, match="hold 3 pages, entries need 4"):
        dataclasses.replace(msg, packed=(frames[0],))
    with pytest.raises(InvalidArgument, match="packed must be an array"):
        dataclasses.replace(msg, packed=frames[0])
    with pytest.raises(InvalidArgument, match="packed must be a boolean"):
        p.GetRequest(request_id=1, namespace="m", seq_id=1, format="pages", packed=1)
    # since protocol 1.4 an fp16 get may ask for packed keys and values too
    assert p.GetRequest(request_id=1, namespace="m", seq_id=1, packed=True).packed is True


def test_packed_tensors_travel_as_one_frame_of_keys_then_values() -> None:
    examples_ = examples()
    k16, v16 = examples_["append_request_float16"].keys, examples_["append_request_float16"].values
    joined = k16.tobytes() + v16.tobytes()
    for name in ("append_request_packed", "get_reply_fp16_packed"):
        frames = as_bytes(encode(examples_[name]))
        assert len(frames) == 2 and frames[1] == joined, name
        assert msgpack.unpackb(frames[0])["packed"] is True
        for twin in (p.decode_request, p.decode_reply):
            if (twin is p.decode_request) != name.startswith("append"):
                continue
            got = twin([frames[0], bytearray(frames[1])])  # a writable frame: the arrays are views of it
            assert got.keys.tobytes() == k16.tobytes() and got.values.tobytes() == v16.tobytes()
            assert got.keys.base is not None and got.values.base is not None
            assert np.shares_memory(got.keys, got.values) is False
            assert (got.packed is True) if name.startswith("append") else bytes(got.packed) == joined
    # unpacked and packed messages carry the same tensors
    plain = p.decode_request(encode(examples_["append_request_float16"]))
    packed = p.decode_request(encode(examples_["append_request_packed"]))
    assert plain.keys.tobytes() == packed.keys.tobytes() and plain.values.tobytes() == packed.values.tobytes()
    assert (plain.packed, packed.packed) == (False, True)


@pytest.mark.parametrize("name", ["append_request_packed", "get_reply_fp16_packed"])
def test_a_packed_message_with_a_wrong_frame_is_refused_by_name(name: str) -> None:
    frames = as_bytes(encode(examples()[name]))
    decode_ = p.decode_request if name.startswith("append") else p.decode_reply
    with pytest.raises(ProtocolError, match="packed keys and values frame has 95 bytes but shape .* needs 2 x 48"):
        decode_([frames[0], frames[1][:-1]])
    with pytest.raises(ProtocolError, match="packed keys and values travel in 1 frame after the header, got 2"):
        decode_([frames[0], frames[1][:48], frames[1][48:]])
    header = msgpack.unpackb(frames[0])
    header["packed"] = 1
    with pytest.raises(ProtocolError, match="packed must be a boolean"):
        decode_([msgpack.packb(header), frames[1]])
    header["packed"] = False  # false is the unpacked form: two frames
    with pytest.raises(ProtocolError, match="expected 2 frames after the header, got 1"):
        decode_([msgpack.packb(header), frames[1]])


def test_a_packed_get_reply_must_hold_its_keys_and_values() -> None:
    msg = examples()["get_reply_fp16_packed"]
    with pytest.raises(InvalidArgument, match="packed is not the bytes of keys then values"):
        dataclasses.replace(msg, packed=msg.values.tobytes() + msg.keys.tobytes())
    with pytest.raises(InvalidArgument, match="packed is not the bytes of keys then values"):
        dataclasses.replace(msg, packed=msg.keys.tobytes())


def test_a_request_without_packed_keeps_its_1_0_bytes() -> None:
    # packed is on the wire only when true, so a 1.0 server never sees a key it does not know
    req = p.GetRequest(request_id=8, namespace="smollm2", seq_id=17, start=64, end=200, layers=(0, 5),
                       format="pages")
    assert "packed" not in msgpack.unpackb(bytes(p.encode_request(req)[0]))
    assert as_bytes(p.encode_request(req)) == read_frames(FIXTURES / "get_request_pages.frames")


class DLPackOnly:
    """A tensor that only speaks DLPack, like a CPU torch tensor."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._arr.__dlpack_device__()


def test_buffer_protocol_dlpack_and_bfloat16_bits_are_accepted() -> None:
    keys = tensor((1, 2, 1, 4), "float32")
    req = p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=memoryview(keys),  # type: ignore[arg-type]
                          values=DLPackOnly(keys))
    assert req.dtype == "float32" and req.keys.shape == (1, 2, 1, 4)
    assert np.shares_memory(req.keys, keys) and np.shares_memory(req.values, keys)
    bits = tensor((1, 2, 1, 4), "bfloat16").view(np.uint16)
    req = p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=bits, values=bits, dtype="bfloat16")
    back = p.decode_request(as_bytes(p.encode_request(req)))
    assert isinstance(back, p.AppendRequest)
    assert back.dtype == "bfloat16" and back.keys.dtype == BF16
    assert back.keys.view(np.uint16).tobytes() == bits.tobytes()


def test_non_contiguous_and_big_endian_arrays_are_sent_correctly() -> None:
    base = tensor((2, 4, 2, 4), "float32")
    strided = base[:, ::2]
    big = base.astype(">f4")
    for arr in (strided, big):
        req = p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=arr, values=arr)
        back = p.decode_request(as_bytes(p.encode_request(req)))
        assert isinstance(back, p.AppendRequest)
        assert np.array_equal(back.keys, arr) and back.keys.dtype == np.dtype("<f4")


# ---- limits --------------------------------------------------------------------------------------------------


def test_default_limits_hold_the_largest_legal_messages() -> None:
    lim = p.Limits()
    assert (lim.max_header_bytes, lim.max_frame_bytes) == (128 * 1024, 256 * 1024 * 1024)
    assert lim.max_pages == 4096 and lim.max_frames == 1 + 2 * lim.max_pages
    assert lim.max_message_bytes == lim.max_header_bytes + 2 * lim.max_frame_bytes
    # the largest pages reply: max_pages entries with the widest layer / token0 values and long seq ids
    entries = tuple((p.MAX_INDEX - i, p.MAX_POSITION, b"k", b"v") for i in range(lim.max_pages))
    big = p.GetPagesReply(request_id=p.MAX_REQUEST_ID, start=p.MAX_POSITION, end=p.MAX_POSITION,
                          layers=tuple(p.MAX_INDEX - i for i in range(lim.max_pages)), entries=entries)
    frames = p.encode_reply(big, lim)
    assert len(frames[0]) <= lim.max_header_bytes and len(frames) == lim.max_frames
    assert same(p.decode_reply(as_bytes(frames), lim), big)
    # every fixed-size header with maximal strings fits the smallest allowed header limit
    widest = p.ExplainRequest(request_id=p.MAX_REQUEST_ID, namespace="ns" * 128, seq_id="s" * 1024,
                              layer=p.MAX_INDEX, token=p.MAX_POSITION)
    assert len(p.encode_request(widest)[0]) < 4096
    err = p.error_reply(p.MAX_REQUEST_ID, InvalidArgument("x" * 10000))
    assert len(p.encode_reply(err)[0]) < 4096


@pytest.mark.parametrize("bad", [dict(max_header_bytes=100), dict(max_frames=2), dict(max_frame_bytes=0),
                                 dict(max_header_bytes=True), dict(max_message_bytes=1000), dict(max_frames=1.5)])
def test_limits_refuse_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        p.Limits(**bad)


def test_encoder_enforces_limits_when_given() -> None:
    small = p.Limits(max_header_bytes=4096, max_frame_bytes=64, max_message_bytes=4096 + 100)
    keys = tensor((1, 1, 1, 64), "float16")  # 128 bytes per frame
    req = p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=keys, values=keys)
    with pytest.raises(MessageTooLarge, match="max_frame_bytes"):
        p.encode_request(req, small)
    with pytest.raises(MessageTooLarge, match="max_frames"):
        p.encode_reply(examples()["get_reply_pages"], p.Limits(max_frames=5))
    assert len(p.encode_request(req, p.Limits())) == 3


# ---- rejection: one test per schema rule ---------------------------------------------------------------------

BASE: dict[str, dict[str, Any]] = {
    "register": {"v": 1, "id": 1, "op": "register", "namespace": "m", "num_layers": 2, "num_kv_heads": 1,
                 "head_dim": 4},
    "append": {"v": 1, "id": 1, "op": "append", "namespace": "m", "seq_id": "s", "offset": None,
               "dtype": "float16", "shape": [1, 1, 1, 2]},
    "get": {"v": 1, "id": 1, "op": "get", "namespace": "m", "seq_id": 3, "start": 0, "end": None, "layers": None,
            "format": "fp16"},
    "explain": {"v": 1, "id": 1, "op": "explain", "namespace": "m", "seq_id": 3, "layer": 0, "token": 0},
    "ping": {"v": 1, "id": 1, "op": "ping"},
    "calibrate": {"v": 1, "id": 1, "op": "calibrate", "namespace": "m", "calibration": {"version": 1}},
}
DELETE = object()
FOUR = b"\x00" * 4  # an append payload frame for shape [1, 1, 1, 2] float16


def request(kind: str, frames: list[bytes] | None = None, /, **changes: Any) -> list[bytes]:
    header = dict(BASE[kind])
    for key, value in changes.items():
        if value is DELETE:
            del header[key]
        else:
            header[key] = value
    return [packb(header), *(frames if frames is not None else ([FOUR, FOUR] if kind == "append" else []))]


REJECTED: list[tuple[str, list[bytes], type[KvdError], str]] = [
    # envelope
    ("no version", request("ping", v=DELETE), ProtocolError, "v (protocol version)"),
    ("version is a string", request("ping", v="1"), ProtocolError, "v (protocol version)"),
    ("unknown major version", request("ping", v=2), UnsupportedVersion, "protocol version 2"),
    ("version 0", request("ping", v=0), UnsupportedVersion, "protocol version 0"),
    ("no id", request("ping", id=DELETE), ProtocolError, "'id'"),
    ("negative id", request("ping", id=-1), ProtocolError, "request id"),
    ("bool id", request("ping", id=True), ProtocolError, "bool True"),
    ("float id", request("ping", id=1.0), ProtocolError, "float 1.0"),
    ("no op", request("ping", op=DELETE), ProtocolError, "op must be one of"),
    ("unknown op", request("ping", op="put"), ProtocolError, "'put'"),
    ("op is bytes", request("ping", op=b"ping"), ProtocolError, "op must be one of"),
    ("typo in a key", request("get", namspace="m"), ProtocolError, "namspace"),
    ("reply key in a request", request("ping", ok=True), ProtocolError, "'ok'"),
    ("frames after ping", request("ping", [b"x"]), ProtocolError, "expected 0 frames"),
    # namespace and seq_id
    ("missing namespace", request("get", namespace=DELETE), ProtocolError, "'namespace'"),
    ("nil namespace", request("get", namespace=None), ProtocolError, "namespace must be a string"),
    ("empty namespace", request("get", namespace=""), InvalidArgument, "namespace must be 1 to 256 bytes"),
    ("long namespace", request("get", namespace="é" * 129), InvalidArgument, "got 258 bytes"),
    ("namespace is int", request("get", namespace=5), ProtocolError, "namespace must be a string, got int 5"),
    ("namespace is bin", request("get", namespace=b"m"), ProtocolError, "namespace must be a string"),
    ("seq_id too long", request("get", seq_id="x" * 1025), InvalidArgument, "seq_id must be 0 to 1024 bytes"),
    ("negative seq_id", request("get", seq_id=-1), InvalidArgument, "seq_id must be >= 0, got -1"),
    ("seq_id 2**63", request("get", seq_id=2**63), InvalidArgument, "got 9223372036854775808"),
    ("seq_id 2**64-1", request("get", seq_id=2**64 - 1), InvalidArgument, "seq_id must be below 2**63"),
    ("bool seq_id", request("get", seq_id=False), ProtocolError, "seq_id must be a string or"),
    ("float seq_id", request("get", seq_id=1.5), ProtocolError, "float 1.5"),
    ("list seq_id", request("get", seq_id=[1]), ProtocolError, "seq_id must be a string or"),
    ("map seq_id", request("get", seq_id={"a": 1}), ProtocolError, "seq_id must be a string or"),
    # register
    ("bool is not int", request("register", num_layers=True), ProtocolError, "num_layers must be an integer"),
    ("zero layers", request("register", num_layers=0), InvalidArgument, "num_layers must be in [1,"),
    ("negative heads", request("register", num_kv_heads=-4), InvalidArgument, "num_kv_heads must be in"),
    ("head_dim 2**31", request("register", head_dim=2**31), InvalidArgument, "head_dim must be in"),
    ("missing head_dim", request("register", head_dim=DELETE), ProtocolError, "'head_dim'"),
    ("nil head_dim", request("register", head_dim=None), ProtocolError, "head_dim must be an integer"),
    ("float head_dim", request("register", head_dim=64.0), ProtocolError, "head_dim must be an integer"),
    # get
    ("start after end", request("get", start=5, end=4), InvalidArgument, "start must be <= end"),
    ("negative start", request("get", start=-1), InvalidArgument, "start must be >= 0, got -1"),
    ("string end", request("get", end="9"), ProtocolError, "end must be an integer or nil"),
    ("empty layers", request("get", layers=[]), InvalidArgument, "layers must be nil or a non-empty"),
    ("repeated layer", request("get", layers=[1, 1]), InvalidArgument, "layers lists a layer twice"),
    ("negative layer", request("get", layers=[0, -1]), InvalidArgument, "layers[1] must be in"),
    ("layer 2**31", request("get", layers=[2**31]), InvalidArgument, "layers[0] must be in"),
    ("bool layer", request("get", layers=[True]), ProtocolError, "layers[0] must be an integer"),
    ("nested layers", request("get", layers=[[0]]), ProtocolError, "layers[0] must be an integer"),
    ("layers is a map", request("get", layers={"0": 0}), ProtocolError, "layers must be an array"),
    ("unknown format", request("get", format="fp32"), InvalidArgument, "format must be one of fp16, pages"),
    ("format is int", request("get", format=1), ProtocolError, "format must be a string"),
    ("packed is 1", request("get", format="pages", packed=1), ProtocolError, "packed must be a boolean"),
    # explain
    ("negative layer", request("explain", layer=-1), InvalidArgument, "layer must be in"),
    ("missing token", request("explain", token=DELETE), ProtocolError, "'token'"),
    # append
    ("unknown dtype", request("append", dtype="int8"), ProtocolError, "dtype must be one of"),
    ("missing dtype", request("append", dtype=DELETE), ProtocolError, "dtype must be a string"),
    ("three dims", request("append", shape=[1, 1, 2]), ProtocolError, "shape must have 4 dimensions"),
    ("zero dim", request("append", shape=[1, 0, 1, 2]), InvalidArgument, "shape[1] must be in [1,"),
    ("string dim", request("append", shape=[1, 1, 1, "2"]), ProtocolError, "shape[3] must be an integer"),
    ("shape is an int", request("append", shape=4), ProtocolError, "shape must be an array"),
    ("short values frame", request("append", [FOUR, b"\x00" * 3]), ProtocolError,
     "values frame has 3 bytes but shape [1, 1, 1, 2] of float16 needs 4"),
    ("float32 needs more", request("append", dtype="float32"), ProtocolError, "needs 8"),
    ("overflowing shape", request("append", shape=[2**31 - 1] * 4), ProtocolError, "keys frame has 4 bytes"),
    ("one frame", request("append", [FOUR]), ProtocolError, "expected 2 frames after the header, got 1"),
    ("three frames", request("append", [FOUR, FOUR, FOUR]), ProtocolError, "expected 2 frames"),
    ("negative offset", request("append", offset=-1), InvalidArgument, "offset must be >= 0, got -1"),
    ("string offset", request("append", offset="0"), ProtocolError, "offset must be an integer or nil"),
    ("notices is 1", request("append", notices=1), ProtocolError, "notices must be a boolean, got int 1"),
    ("notices is a string", request("append", notices="yes"), ProtocolError, "notices must be a boolean"),
    # calibrate (protocol 1.8: require, the calibration optional)
    ("calibrate with neither", request("calibrate", calibration=DELETE), InvalidArgument,
     "calibrate needs a calibration, require, or both"),
    ("calibrate with nil only", request("calibrate", calibration=None, require=None), InvalidArgument,
     "calibrate needs a calibration, require, or both"),
    ("require is a string", request("calibrate", require="yes"), ProtocolError, "require must be a boolean"),
    ("require is 1", request("calibrate", calibration=None, require=1), ProtocolError,
     "require must be a boolean, got int 1"),
    ("calibration a list beside require", request("calibrate", calibration=[1], require=True), ProtocolError,
     "calibration must be a map"),
    ("calibrate reply key in a request", request("calibrate", required=True), ProtocolError, "'required'"),
    # msgpack level
    ("header not a map", [packb([1, "ping"])], ProtocolError, "header must be a msgpack map, got list"),
    ("header is nil", [packb(None)], ProtocolError, "header must be a msgpack map"),
    ("trailing bytes", [packb(BASE["ping"]) + b"\xc0"], ProtocolError, "not valid msgpack: ExtraData"),
    ("truncated", [packb(BASE["get"])[:-3]], ProtocolError, "not valid msgpack"),
    ("not msgpack", [b"\xc1"], ProtocolError, "not valid msgpack"),
    ("empty header", [b""], ProtocolError, "not valid msgpack"),
    ("bad utf-8", [b"\x81\xa2op\xa2\xff\xfe"], ProtocolError, "UnicodeDecodeError"),
    ("ext type", [packb({**BASE["ping"], "x": msgpack.ExtType(1, b"abc")})], ProtocolError, "max_ext_len"),
    ("empty ext type", [b"\x84\xa1v\x01\xa2id\x01\xa2op\xa4ping\xa1x\xc7\x00\x05"], ProtocolError,
     "extension type 5 is not allowed"),
    ("timestamp", [b"\x84\xa1v\x01\xa2id\x01\xa2op\xa4ping\xa1t\xd6\xff\x00\x00\x00\x00"], ProtocolError,
     "not valid msgpack"),
    ("duplicate key", [b"\x84\xa1v\x01\xa2id\x01\xa2op\xa4ping\xa2id\x02"], ProtocolError, "duplicate key"),
    ("bin key", [packb({b"v": 1, "id": 1, "op": "ping"})], ProtocolError, "header keys must be strings"),
    ("int key", [b"\x81\x01\x01"], ProtocolError, "not valid msgpack"),
    ("4G array", [b"\xdd\xff\xff\xff\xff"], ProtocolError, "exceeds max_array_len"),
    ("4G map", [b"\xdf\xff\xff\xff\xff"], ProtocolError, "exceeds max_map_len"),
    ("4G string", [b"\xdb\xff\xff\xff\xff"], ProtocolError, "not valid msgpack"),
    ("4G bin", [b"\xc6\xff\xff\xff\xff"], ProtocolError, "not valid msgpack"),
    ("deep arrays", [b"\x91" * 60000], ProtocolError, "nested too deeply"),
    ("deep maps", [b"\x81\xa1a" * 20000 + b"\xc0"], ProtocolError, "nested too deeply"),
    ("no frames", [], ProtocolError, "non-empty list of frames"),
    ("frame not bytes", [packb(BASE["ping"]), 5], ProtocolError, "frame 1 is not a bytes-like object"),  # type: ignore[list-item]
    # sizes
    ("header too big", [packb({**BASE["ping"], "pad": "x" * (128 * 1024)})], MessageTooLarge, "max_header_bytes"),
    ("too many frames", [packb(BASE["ping"])] + [b""] * p.DEFAULT_MAX_FRAMES, MessageTooLarge, "max_frames"),
]


@pytest.mark.parametrize(("frames", "cls", "needle"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_rejected(frames: list[bytes], cls: type[KvdError], needle: str) -> None:
    with pytest.raises(KvdError) as info:
        p.decode_request(frames)
    assert type(info.value) is cls, info.value
    assert needle in str(info.value)
    reply = p.parse_request(frames)  # what the server sends back: the same error, with the id when readable
    assert isinstance(reply, p.ErrorReply) and reply.code == cls.code and needle in reply.message


def test_error_reply_carries_the_id_whenever_the_header_had_one() -> None:
    reply = p.parse_request(request("get", id=99, start=5, end=1))
    assert isinstance(reply, p.ErrorReply) and reply.request_id == 99
    too_many = p.parse_request([packb({**BASE["ping"], "id": 42})] + [b""] * 4, p.Limits(max_frames=3))
    assert isinstance(too_many, p.ErrorReply) and too_many.request_id == 42 and too_many.error == "MessageTooLarge"
    assert p.parse_request([b"\xc1"]).request_id is None
    assert p.parse_request(request("ping", v=3, id=8)).request_id == 8


def test_size_limits_on_decode() -> None:
    small = p.Limits(max_header_bytes=4096, max_frame_bytes=3, max_message_bytes=4096 + 5)
    with pytest.raises(MessageTooLarge, match="frame 1 is 4 bytes, more than max_frame_bytes 3"):
        p.decode_request(request("append"), small)
    small = p.Limits(max_header_bytes=4096, max_message_bytes=4096)
    with pytest.raises(MessageTooLarge, match="more than max_message_bytes 4096"):
        p.decode_request(request("append", [FOUR, b"\x00" * 4096]), small)


def test_nil_means_default_for_optional_fields_only() -> None:
    req = p.decode_request(request("get", start=None, format=DELETE, layers=DELETE))
    assert isinstance(req, p.GetRequest)
    assert (req.start, req.end, req.layers, req.format) == (0, None, None, "fp16")
    req = p.decode_request(request("append", offset=DELETE))
    assert isinstance(req, p.AppendRequest) and req.offset is None


def test_local_construction_errors_are_invalid_argument() -> None:
    k = tensor((1, 1, 1, 2), "float16")
    cases: list[Any] = [
        lambda: p.GetRequest(request_id=1, namespace="m", seq_id=1, start=-1),
        lambda: p.GetRequest(request_id=1, namespace="m", seq_id=True),
        lambda: p.GetRequest(request_id=1, namespace="m", seq_id=1, start=3, end=2),
        lambda: p.PingRequest(request_id=2**64),
        lambda: p.RegisterRequest(request_id=1, namespace="\ud800", num_layers=1, num_kv_heads=1, head_dim=1),
        lambda: p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k, values=k[:, :, :, :1]),
        lambda: p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k, values=k.astype(np.float32)),
        lambda: p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k[0], values=k[0]),
        lambda: p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k.astype(np.int64),
                                values=k.astype(np.int64)),
        lambda: p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=[[[[1.0]]]], values=[[[[1.0]]]]),
        lambda: p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k, values=k, dtype="bfloat16"),
        lambda: p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k[:, :0], values=k[:, :0]),
        lambda: p.GetReply(request_id=1, start=0, end=2, layers=(0,), keys=k, values=k),
        lambda: p.GetReply(request_id=1, start=0, end=1, layers=(0,), keys=k.astype(np.float32),
                           values=k.astype(np.float32)),
        lambda: p.GetPagesReply(request_id=1, start=0, end=1, layers=(0,), entries=((1, 0, b"k", b"v"),)),
        lambda: p.GetPagesReply(request_id=1, start=0, end=1, layers=(0,),
                                entries=((0, 0, b"k", b"v"), (0, 0, b"k", b"v"))),
        lambda: p.GetPagesReply(request_id=1, start=0, end=1, layers=(0,), entries=((0, 0, b"", b"v"),)),
        lambda: p.StatsReply(request_id=1, stats={"x": {"y": {"z": 1}}}),
        lambda: p.StatsReply(request_id=1, stats={"x": [[[1]]]}),
        lambda: p.StatsReply(request_id=1, stats={"x": object()}),
        lambda: p.HelloReply(request_id=1, kvd_version="v", page_format_version=1, shard_id="s", page_tokens=64,
                             max_frames=2),
        lambda: p.ErrorReply(request_id=1, code=0, error="X", message=""),
        lambda: p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=k, values=k, notices="yes"),
        lambda: p.AppendReply(request_id=1, length=1, notice=""),
        lambda: p.AppendReply(request_id=1, length=1, notice="x" * 2049),
        lambda: p.CalibrateRequest(request_id=1, namespace="m"),
        lambda: p.CalibrateRequest(request_id=1, namespace="m", require=1),
        lambda: p.CalibrateReply(request_id=1, state="none", reason="", required="yes"),
    ]
    for make in cases:
        with pytest.raises(InvalidArgument):
            make()
    with pytest.raises(InvalidArgument, match="not a request"):
        p.encode_request(p.PingReply(request_id=1))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not a reply"):
        p.encode_reply(p.PingRequest(request_id=1))  # type: ignore[arg-type]


def test_numpy_scalars_from_the_store_are_accepted() -> None:
    reply = p.StatsReply(request_id=np.uint64(3), stats={"tokens": np.int64(5), "pressure": np.float32(0.5),
                                                         "on": np.bool_(True)})
    back = p.decode_reply(as_bytes(p.encode_reply(reply)))
    assert back.request_id == 3 and back.stats == {"tokens": 5, "pressure": 0.5, "on": True}  # type: ignore[union-attr]
    assert p.AppendReply(request_id=1, length=np.int64(7)).length == 7


def hdr(**fields: Any) -> bytes:
    return packb(fields)


PAGES = [real_page(3, 0.0), real_page(3, 1.0, "q8")]  # the key and value page of one entry


def packed_reply(frames: list[bytes], **changes: Any) -> list[bytes]:
    header = {"v": 1, "id": 1, "op": "get", "ok": True, "format": "pages", "start": 0, "end": 3, "layers": [0],
              "packed": True, "entries": [[0, 0]], **changes}
    return [hdr(**header), *frames]


REPLIES_REJECTED: list[tuple[str, list[bytes], type[KvdError], str]] = [
    ("no ok", [hdr(v=1, id=1, op="ping")], ProtocolError, "ok must be a boolean"),
    ("ok is 1", [hdr(v=1, id=1, op="ping", ok=1)], ProtocolError, "ok must be a boolean"),
    ("future version", [hdr(v=2, id=1, op="ping", ok=True)], UnsupportedVersion, "protocol version 2"),
    ("unknown op", [hdr(v=1, id=1, op="put", ok=True)], ProtocolError, "reply op must be one of"),
    ("get without format", [hdr(v=1, id=1, op="get", ok=True)], ProtocolError, "get reply format"),
    ("error without code", [hdr(v=1, id=1, ok=False, error="X", message="m")], ProtocolError, "'code'"),
    ("error with op", [hdr(v=1, id=1, ok=False, op="get", code=2, error="X", message="m")], ProtocolError,
     "unknown header keys ['op']"),
    ("bool length", [hdr(v=1, id=1, op="length", ok=True, length=False)], ProtocolError, "length must be an"),
    ("dropped is 1", [hdr(v=1, id=1, op="drop", ok=True, dropped=1)], ProtocolError, "dropped must be a boolean"),
    ("deep stats", [hdr(v=1, id=1, op="stats", ok=True, stats={"a": {"b": [1]}})], ProtocolError,
     "must be nil, a boolean, a number or a string"),
    ("deeper arrays", [hdr(v=1, id=1, op="stats", ok=True, stats={"a": [[[1]]]})], ProtocolError,
     "stats['a'][0][0] must be nil"),
    ("details not a map", [hdr(v=1, id=1, op="explain", ok=True, level="q8", reasons=[], details=[1])],
     ProtocolError, "details must be a map"),
    ("reasons not strings", [hdr(v=1, id=1, op="explain", ok=True, level="q8", reasons=[1])], ProtocolError,
     "reasons[0] must be a string"),
    ("pages count mismatch", [hdr(v=1, id=1, op="get", ok=True, format="pages", start=0, end=1, layers=[0],
                                  entries=[[0, 0]]), b"k"], ProtocolError, "2 per entry"),
    ("pages entry shape", [hdr(v=1, id=1, op="get", ok=True, format="pages", start=0, end=1, layers=[0],
                               entries=[[0, 0, 0]]), b"k", b"v"], ProtocolError, "must be [layer, token0]"),
    ("pages layer not listed", [hdr(v=1, id=1, op="get", ok=True, format="pages", start=0, end=1, layers=[0],
                                    entries=[[3, 0]]), b"k", b"v"], InvalidArgument, "not in layers"),
    ("packed is a string", packed_reply([b"".join(PAGES)], packed="yes"), ProtocolError,
     "packed must be a boolean"),
    ("packed empty frame", packed_reply([b"".join(PAGES), b""]), ProtocolError, "packed frame 1 is empty"),
    ("packed page cut", packed_reply([PAGES[0][:-8]]), ProtocolError, "no whole kvd page at byte 0"),
    ("packed frame ends in a header", packed_reply([PAGES[0] + PAGES[1][:20]]), ProtocolError,
     "ends inside a page header"),
    ("packed wrong magic", packed_reply([b"XVDP" + PAGES[0][4:] + PAGES[1]]), ProtocolError, "magic b'XVDP'"),
    ("packed page split over frames", packed_reply([PAGES[0] + PAGES[1][:40], PAGES[1][40:]]), ProtocolError,
     "no whole kvd page"),
    ("packed too few pages", packed_reply([PAGES[0]]), ProtocolError, "hold 1 pages, entries need 2"),
    ("packed too many pages", packed_reply([PAGES[0] + PAGES[1], PAGES[0]]), ProtocolError, "hold 3+ pages"),
    ("packed huge claimed payload", packed_reply([PAGES[0][:20] + b"\xff\xff\xff\xff" + PAGES[0][24:] + PAGES[1]]),
     ProtocolError, "4294967327 bytes claimed"),
    ("fp16 reply in float32", [hdr(v=1, id=1, op="get", ok=True, format="fp16", start=0, end=1, layers=[0],
                                   dtype="float32", shape=[1, 1, 1, 1]), b"1234", b"1234"], ProtocolError,
     "dtype must be one of float16"),
    ("fp16 reply wrong token count", [hdr(v=1, id=1, op="get", ok=True, format="fp16", start=0, end=2,
                                          layers=[0], dtype="float16", shape=[1, 1, 1, 1]), b"12", b"12"],
     InvalidArgument, "does not match"),
    ("hello reply bad limits", [hdr(v=1, id=1, op="hello", ok=True, protocol_version=1, protocol_minor=0,
                                    kvd_version="x", page_format_version=1, role="shard", shard_id="s",
                                    page_tokens=1, max_header_bytes=10, max_frame_bytes=1, max_frames=3,
                                    max_message_bytes=10)], InvalidArgument, "max_header_bytes"),
    ("hello reply without role", [hdr(v=1, id=1, op="hello", ok=True, protocol_version=1, protocol_minor=0,
                                      kvd_version="x", page_format_version=1, shard_id="s", page_tokens=1,
                                      max_header_bytes=4096, max_frame_bytes=1, max_frames=3,
                                      max_message_bytes=4096)], ProtocolError, "missing header field 'role'"),
    ("hello reply unknown role", [hdr(v=1, id=1, op="hello", ok=True, protocol_version=1, protocol_minor=0,
                                      kvd_version="x", page_format_version=1, role="proxy", shard_id="s",
                                      page_tokens=1, max_header_bytes=4096, max_frame_bytes=1, max_frames=3,
                                      max_message_bytes=4096)], InvalidArgument, "role must be one of"),
    ("coordinator with page_tokens", [hdr(v=1, id=1, op="hello", ok=True, protocol_version=1, protocol_minor=0,
                                          kvd_version="x", page_format_version=1, role="coordinator",
                                          shard_id="c", page_tokens=64, max_header_bytes=4096, max_frame_bytes=1,
                                          max_frames=3, max_message_bytes=4096)], InvalidArgument,
     "nil for a coordinator"),
    ("shards not an array", [hdr(v=1, id=1, op="topology", ok=True, epoch=1, shards={"id": "a"}, level="q8",
                                 level_epoch=0)], ProtocolError, "shards must be an array"),
    ("shard not a map", [hdr(v=1, id=1, op="topology", ok=True, epoch=1, shards=["a"], level="q8",
                             level_epoch=0)], ProtocolError, "shards[0] must be a map"),
    ("shard with an extra key", [hdr(v=1, id=1, op="topology", ok=True, epoch=1, level="q8", level_epoch=0,
                                     shards=[{"id": "a", "endpoint": "e", "x": 1}])], ProtocolError,
     "exactly the keys id and endpoint"),
    ("shard id twice", [hdr(v=1, id=1, op="topology", ok=True, epoch=1, level="q8", level_epoch=0,
                            shards=[{"id": "a", "endpoint": "e"}, {"id": "a", "endpoint": "f"}])], InvalidArgument,
     "lists the shard id 'a' twice"),
    ("shard endpoint is an int", [hdr(v=1, id=1, op="topology", ok=True, epoch=1, level="q8", level_epoch=0,
                                      shards=[{"id": "a", "endpoint": 5}])], ProtocolError,
     "shards[0].endpoint must be a string"),
    ("negative epoch", [hdr(v=1, id=1, op="topology", ok=True, epoch=-1, shards=[], level="q8", level_epoch=0)],
     InvalidArgument, "epoch must be >= 0, got -1"),
    ("empty notice", [hdr(v=1, id=1, op="append", ok=True, length=3, notice="")], InvalidArgument,
     "notice must be 1 to 2048 bytes"),
    ("notice too long", [hdr(v=1, id=1, op="append", ok=True, length=3, notice="x" * 2049)], InvalidArgument,
     "notice must be 1 to 2048 bytes"),
    ("notice is an int", [hdr(v=1, id=1, op="append", ok=True, length=3, notice=5)], ProtocolError,
     "notice must be a string"),
    ("required is a string", [hdr(v=1, id=1, op="calibrate", ok=True, state="none", reason="", required="yes")],
     ProtocolError, "required must be a boolean"),
    # a repeated key inside a nested map (hand-written: {"v":1,"id":1,"op":"topology","ok":true,"epoch":1,
    # "level":"q8","level_epoch":0,"shards":[{"id":"a","id":"b"}]})
    ("duplicate key in a nested map", [b"\x88\xa1v\x01\xa2id\x01\xa2op\xa8topology\xa2ok\xc3\xa5epoch\x01"
                                       b"\xa5level\xa2q8\xablevel_epoch\x00\xa6shards\x91\x82\xa2id\xa1a"
                                       b"\xa2id\xa1b"], ProtocolError, "duplicate key"),
]


@pytest.mark.parametrize(("frames", "cls", "needle"), [r[1:] for r in REPLIES_REJECTED],
                         ids=[r[0] for r in REPLIES_REJECTED])
def test_rejected_replies(frames: list[bytes], cls: type[KvdError], needle: str) -> None:
    with pytest.raises(KvdError) as info:
        p.decode_reply(frames)
    assert type(info.value) is cls, info.value
    assert needle in str(info.value)


def test_error_replies_are_read_whatever_their_version() -> None:
    reply = p.decode_reply([hdr(v=7, id=3, ok=False, code=12, error="UnsupportedVersion", message="speak 7")])
    assert isinstance(reply, p.ErrorReply) and isinstance(reply.exception(), UnsupportedVersion)


# ---- fuzz: random, truncated, bit-flipped and hostile frames -------------------------------------------------


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), rng.randrange(-(2**63), 2**64)])
    if kind == 3:
        return rng.choice([0.0, -1.5, float("nan"), float("inf"), 1e300])
    if kind == 4:
        return rng.choice(["", "m", "float16", "fp16", "pages", "é" * rng.randrange(300), "x" * 1025])
    if kind == 5:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(8)))
    if kind == 6:
        return msgpack.ExtType(rng.randrange(128), b"x" * rng.randrange(4))
    if kind == 7:
        return rng.randrange(0, 4)
    if kind == 8:
        return rng.choice(["get", "append", "ping", "hello", "stats", "nope"])
    if kind == 9:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 10:
        return [rng.randrange(0, 3) for _ in range(rng.choice([2, 4, 4, 5]))]
    return {rng.choice(["a", "b", "fp16"]): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


KEYS = ["v", "id", "op", "ok", "namespace", "seq_id", "start", "end", "layers", "format", "dtype", "shape",
        "offset", "layer", "token", "num_layers", "num_kv_heads", "head_dim", "entries", "length", "code",
        "error", "message", "stats", "dropped", "level", "reasons", "packed", "nope"]


def hostile() -> list[list[Any]]:
    deep_a, deep_m = b"\x91" * 200_000, b"\x81\xa1a" * 50_000 + b"\xc0"
    ping = BASE["ping"]
    out: list[list[Any]] = [
        [b"\xdd\xff\xff\xff\xff"], [b"\xdf\xff\xff\xff\xff"], [b"\xdb\xff\xff\xff\xff"], [b"\xc6\xff\xff\xff\xff"],
        [b"\xc9\xff\xff\xff\xff\x01"], [b"\x84\xa1v\x01\xa2id\x01\xa2op\xa4ping\xa1x\xdd\xff\xff\xff\xff"],
        [b"\x84\xa1v\x01\xa2id\x01\xa2op\xa4ping\xa1x\xc9\xff\xff\xff\xf0\x05"],
        [deep_a], [deep_m], [b"\x81\xa1a" + deep_a],
        [packb(1)], [packb("ping")], [packb([ping])], [packb(None)], [packb(2**64 - 1)], [b""], [],
        [packb({**ping, "id": 2**64 - 1, "v": 2**64 - 1})], [packb({**ping, "v": -(2**63)})],
        [packb({**BASE["append"], "shape": [2**31 - 1] * 4}), FOUR, FOUR],
        [packb({**BASE["append"], "shape": [2**64 - 1] * 4}), FOUR, FOUR],
        [packb({**BASE["append"], "shape": [65536, 65536, 65536, 65536]}), b"", b""],
        [packb({**BASE["get"], "layers": list(range(5000))})],
        [packb({f"k{i}": i for i in range(2000)})],
        [packb({**ping, "x": "y" * 140_000})],
        [packb(ping)] + [b""] * 10_000,
        [packb(ping), None], [None], [packb(ping), "text"], ["not a list"], [memoryview(packb(ping))],
    ]
    for code in (-1, 0, 1, 127, -128):  # every ext encoding, including timestamps (-1)
        for size in (1, 2, 4, 8, 16, 0, 3, 300, 70_000):
            out.append([PING_WITH_X + ext_bytes(code, b"z" * size)])
    return out


PING_WITH_X = b"\x84\xa1v\x01\xa2id\x01\xa2op\xa4ping\xa1x"  # {"v": 1, "id": 1, "op": "ping", "x": <value>}


def ext_bytes(code: int, data: bytes) -> bytes:
    """A msgpack extension value in its shortest encoding (msgpack.ExtType refuses negative codes)."""
    t = code.to_bytes(1, "big", signed=True)
    fixed = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
    if len(data) in fixed:
        return bytes([fixed[len(data)]]) + t + data
    if len(data) < 256:
        return b"\xc7" + len(data).to_bytes(1, "big") + t + data
    if len(data) < 65536:
        return b"\xc8" + len(data).to_bytes(2, "big") + t + data
    return b"\xc9" + len(data).to_bytes(4, "big") + t + data


def fuzz_cases(n: int, seed: int = 1234) -> Any:
    rng = random.Random(seed)
    corpus = [as_bytes(encode(m)) for m in examples().values()]
    hostile_cases = hostile()
    for i in range(n):
        mode = i % 5
        if mode == 0:  # random bytes
            yield [bytes(rng.randrange(256) for _ in range(rng.randrange(40))) for _ in range(rng.randrange(1, 4))]
        elif mode == 1:  # truncated: the header, a frame, or frames missing
            msg = list(rng.choice(corpus))
            j = rng.randrange(len(msg))
            msg[j] = msg[j][: rng.randrange(len(msg[j]) + 1)]
            yield msg[: rng.randrange(1, len(msg) + 1)] if rng.random() < 0.3 else msg
        elif mode == 2:  # bit flips
            flipped = [bytearray(f) for f in rng.choice(corpus)]
            for _ in range(rng.randrange(1, 9)):
                j = rng.randrange(len(flipped)) if rng.random() < 0.3 else 0
                if flipped[j]:
                    flipped[j][rng.randrange(len(flipped[j]))] ^= 1 << rng.randrange(8)
            yield [bytes(f) for f in flipped]
        elif mode == 3:  # well-formed msgpack, hostile content: wrong types, ranges, shapes, extras
            header = dict(rng.choice([BASE[op] for op in BASE]))
            for _ in range(rng.randrange(1, 4)):
                header[rng.choice(KEYS)] = random_value(rng)
            try:
                raw = packb(header)
            except (OverflowError, TypeError, ValueError):
                raw = packb({"v": 1})
            yield [raw] + [bytes(rng.randrange(4) * 2) for _ in range(rng.randrange(4))]
        else:
            yield hostile_cases[(i // 5) % len(hostile_cases)]


@pytest.mark.timeout(60)
def test_fuzz_every_input_is_decoded_or_refused_with_a_kvd_error() -> None:
    outcomes: Counter[str] = Counter()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for frames in fuzz_cases(10_000):
            for decoder in (p.decode_request, p.decode_reply):
                try:
                    msg = decoder(frames)
                except KvdError as exc:
                    outcomes[type(exc).__name__] += 1
                else:
                    outcomes[type(msg).__name__] += 1
                    assert same(decode(as_bytes(encode(msg))), msg)  # anything accepted is a valid message
            assert isinstance(p.parse_request(frames), (p.ErrorReply, *p.REQUESTS.values()))
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    # the largest input is ~200 KB (deep nesting) or 10,000 empty frames; claims of 4 G items allocate nothing
    assert peak < 8 * 1024 * 1024, f"decoding peaked at {peak} bytes"
    assert outcomes["ProtocolError"] > 1000 and outcomes["MessageTooLarge"] > 0
    assert outcomes["UnsupportedVersion"] > 0 and outcomes["InvalidArgument"] > 0
    assert sum(n for k, n in outcomes.items() if "Request" in k or "Reply" in k) > 100  # some survive intact


# ---- routing -------------------------------------------------------------------------------------------------


def spec_owner(shards: list[str], namespace: str, seq_id: str | int) -> int:
    """docs/protocol.md "Routing", written again from the text."""

    def u32(n: int) -> bytes:
        return n.to_bytes(4, "little")

    ns = namespace.encode()
    if isinstance(seq_id, int):
        seq = b"\x00" + seq_id.to_bytes(8, "little")
    else:
        seq = b"\x01" + u32(len(seq_id.encode())) + seq_id.encode()
    best, best_score = 0, -1
    for i, shard in enumerate(shards):
        data = u32(len(ns)) + ns + seq + u32(len(shard.encode())) + shard.encode()
        score = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
        if score > best_score or (score == best_score and shard.encode() < shards[best].encode()):
            best, best_score = i, score
    return best


SHARDS = [f"shard-{i}" for i in range(8)]


def test_routing_follows_the_spec_formula() -> None:
    rng = random.Random(7)
    for i in range(2000):
        seq: str | int = rng.randrange(2**63) if i % 2 else f"req-{rng.randrange(10**9)}"
        shards = SHARDS[: rng.randrange(1, 9)]
        assert p.owner(shards, "smollm2", seq) == spec_owner(shards, "smollm2", seq)


# Test vectors published in docs/protocol.md (the hex is the full 8-byte score, big-endian).
VECTORS: list[tuple[str, str | int, str, str]] = [
    ("smollm2", "req-42", "shard-0", "bca65a9c155c12f2"),
    ("smollm2", 42, "shard-0", "75d2cd674c77af71"),
    ("llama", "", "tcp://10.0.0.7:5555", "4b599c60614e334b"),
]
OWNER_VECTORS: list[tuple[tuple[str, str | int], int]] = [
    (("smollm2", "req-42"), 0), (("smollm2", 42), 1), (("llama", "é"), 3)]


def test_routing_vectors() -> None:
    for ns, seq, shard, score in VECTORS:
        assert f"{p.rendezvous_score(shard, ns, seq):016x}" == score
    for (ns, seq), index in OWNER_VECTORS:
        assert p.owner(SHARDS, ns, seq) == index


def test_routing_is_balanced_and_moves_only_the_removed_shards_keys() -> None:
    keys = [("m", f"seq-{i}") if i % 2 else ("m", i) for i in range(10_000)]
    before = [SHARDS[p.owner(SHARDS, ns, s)] for ns, s in keys]
    counts = Counter(before)
    expected = len(keys) / len(SHARDS)
    assert all(abs(counts[s] - expected) < 0.15 * expected for s in SHARDS), counts  # ~5.6 sigma
    survivors = [s for s in SHARDS if s != "shard-3"]
    after = [survivors[p.owner(survivors, ns, s)] for ns, s in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved and all(b == "shard-3" for b, _ in moved)
    assert len(moved) == counts["shard-3"]
    shuffled = SHARDS[::-1]
    assert all(shuffled[p.owner(shuffled, ns, s)] == o for (ns, s), o in zip(keys[:500], before, strict=False))


def test_router_matches_owner_and_is_reexported() -> None:
    from kvd.wire import routing

    assert p.owner is routing.owner and p.rendezvous_score is routing.rendezvous_score
    router = routing.Router(SHARDS)
    rng = random.Random(3)
    for _ in range(500):
        seq: str | int = rng.randrange(2**63) if rng.random() < 0.5 else f"r{rng.randrange(10**6)}"
        assert router.owner("ns", seq) == spec_owner(SHARDS, "ns", seq)
    assert router.shard_ids == tuple(SHARDS)


def test_topology_messages() -> None:
    reply = examples()["topology_reply"]
    back = p.decode_reply(as_bytes(p.encode_reply(reply)))
    assert isinstance(back, p.TopologyReply) and back.shards == reply.shards and back.epoch == 3
    with pytest.raises(InvalidArgument, match="twice"):
        p.TopologyReply(request_id=1, epoch=1, shards=({"id": "a", "endpoint": "x"}, {"id": "a", "endpoint": "y"}),
                        level="q8", level_epoch=0)
    assert isinstance(p.decode_request([packb({"v": 1, "id": 4, "op": "topology"})]), p.TopologyRequest)
    with pytest.raises(ProtocolError, match="expected 0 frames"):
        p.decode_request([packb({"v": 1, "id": 4, "op": "topology"}), b"x"])


def test_routing_refuses_bad_input() -> None:
    for args in [([], "m", 1), (["a", "a"], "m", 1), (["a"], "", 1), (["a"], "m", -1), (["a"], "m", 1.5),
                 ("ab", "m", 1), ([""], "m", 1), ([3], "m", 1)]:
        with pytest.raises(InvalidArgument):
            p.owner(*args)  # type: ignore[arg-type]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-fixtures"]:
        write_fixtures()
        print(f"wrote {len(examples())} fixtures to {FIXTURES}")
    else:
        print("usage: python tests/unit/test_protocol.py --write-fixtures")


def test_lengths_requests_and_replies_are_bounded_and_checked() -> None:
    ok = p.LengthsRequest(request_id=1, namespace="n", seq_ids=["a", 2])
    assert ok.seq_ids == ("a", 2)
    for bad, match in (([], "1 to 4096"), (["x"] * (p.MAX_LOOKUP + 1), "1 to 4096"), (["a", -1], r"seq_ids\[1\]"),
                       ("abc", "must be an array")):
        with pytest.raises(InvalidArgument, match=match):
            p.LengthsRequest(request_id=1, namespace="n", seq_ids=bad)
    # every id the per-id check refuses is refused, and named, wherever it sits in a long list (a fast path checks
    # the usual ASCII strings and plain ints without a call per id)
    longest = "x" * p.MAX_SEQ_ID_BYTES
    assert p.LengthsRequest(request_id=1, namespace="n", seq_ids=["", longest, 0, 2**63 - 1]).seq_ids[1] == longest
    assert p.LengthsRequest(request_id=1, namespace="n", seq_ids=["é" * 512]).seq_ids == ("é" * 512,)
    for bad in (True, -1, 2**63, 1.0, None, b"a", ["a"], longest + "x", "é" * 513):
        with pytest.raises((InvalidArgument, ProtocolError), match=r"seq_ids\[4000\]"):
            p.LengthsRequest(request_id=1, namespace="n", seq_ids=[f"s{i}" for i in range(4000)] + [bad, 1])
    assert p.LengthsReply(request_id=1, lengths=[None, 3]).lengths == (None, 3)
    with pytest.raises(InvalidArgument, match=r"lengths\[0\]"):
        p.LengthsReply(request_id=1, lengths=[-2])
    for bad in (True, -1, 2**63, 1.0, "3"):
        with pytest.raises((InvalidArgument, ProtocolError), match=r"lengths\[2\]"):
            p.LengthsReply(request_id=1, lengths=[None, 5, bad])
    # on the wire: a header naming too many seq_ids is refused as a protocol error, with its id
    frames = p.encode_request(ok)
    header = msgpack.unpackb(bytes(frames[0]))
    header["seq_ids"] = []
    reply = p.parse_request([msgpack.packb(header)])
    assert isinstance(reply, p.ErrorReply) and reply.request_id == 1


def test_messages_encoded_from_many_threads_at_once_are_each_exact() -> None:
    import threading

    # the encoder keeps one msgpack packer per thread: concurrent encodes must never mix their bytes
    keys = np.arange(2 * 3 * 2 * 4, dtype=np.float16).reshape(2, 3, 2, 4)
    msgs = [p.AppendRequest(request_id=i, namespace=f"ns{i}", seq_id=f"s{i}" * (i % 7 + 1), keys=keys, values=keys)
            for i in range(8)] + [p.LengthReply(request_id=i, length=i * 1000) for i in range(8)]
    expected = [[bytes(f) for f in (p.encode_request(m) if type(m) is p.AppendRequest else p.encode_reply(m))]
                for m in msgs]
    bad: list[int] = []

    def run(offset: int) -> None:
        for n in range(400):
            i = (n + offset) % len(msgs)
            m = msgs[i]
            got = p.encode_request(m) if type(m) is p.AppendRequest else p.encode_reply(m)
            if [bytes(f) for f in got] != expected[i]:
                bad.append(i)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
