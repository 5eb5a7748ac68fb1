"""The byte-exact examples in docs/protocol.md (§11.1) are kvd's own encoder output and cannot rot: this module
generates them (a header of each request kind, an error reply with an echoed id, one page per level with its
checksum) and the test compares them with the document. After a deliberate change of the encoder or of the
page format, regenerate them with ``python tests/unit/test_protocol_doc.py --write`` (and bump the version)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import numpy as np
import xxhash

from kvd.calibration import Calibration, LevelPlan
from kvd.codec import pages
from kvd.wire import protocol as p

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
BEGIN = "<!-- generated: begin (python tests/unit/test_protocol_doc.py --write; do not edit by hand) -->"
END = "<!-- generated: end -->"

NS, SEQ = "smollm2", "req-42"
KEYS = (np.arange(8, dtype=np.float32).reshape(2, 1, 1, 4) / 4).astype(np.float16)  # [L=2, T=1, H=1, D=4]
PAGE_INPUT = (np.arange(16, dtype=np.float32).reshape(2, 1, 8) / 4 - 1.5).astype(np.float16)  # [T=2, H=1, D=8]


def requests() -> list[p.Request]:
    return [
        p.HelloRequest(request_id=1),
        p.PingRequest(request_id=2),
        p.RegisterRequest(request_id=3, namespace=NS, num_layers=2, num_kv_heads=1, head_dim=4),
        p.AppendRequest(request_id=4, namespace=NS, seq_id=SEQ, keys=KEYS, values=KEYS, offset=0),
        p.GetRequest(request_id=5, namespace=NS, seq_id=SEQ, start=0, end=1),
        p.GetRequest(request_id=6, namespace=NS, seq_id=SEQ, start=0, layers=[1], format="pages", packed=True),
        p.DropRequest(request_id=7, namespace=NS, seq_id=SEQ),
        p.LengthRequest(request_id=8, namespace=NS, seq_id=SEQ),
        p.StatsRequest(request_id=9),
        p.ExplainRequest(request_id=10, namespace=NS, seq_id=SEQ, layer=1, token=0),
        p.TopologyRequest(request_id=11),
        p.LengthsRequest(request_id=12, namespace=NS, seq_ids=(SEQ, "req-43")),
        # protocol 1.3: a block stored at its prompt position, on the shard incarnation it was first written to
        p.AppendRequest(request_id=13, namespace=NS, seq_id="block-1", keys=KEYS, values=KEYS, offset=0,
                        position=128, incarnation="7f3a9c2e"),
        # protocol 1.5: attention over tokens [0, 1) of layer 1 for one query of one head
        p.AttendRequest(request_id=14, namespace=NS, seq_id=SEQ, layer=1, queries=KEYS[0, :, :, :], end=1),
        # protocol 1.7: a calibration of one layer and one KV head (the 8-bit rung only) for the namespace
        p.CalibrateRequest(request_id=15, namespace=NS, calibration=CALIBRATION),
        # protocol 1.8: an append whose reply may carry a notice; a namespace's own require_calibration alone
        p.AppendRequest(request_id=16, namespace=NS, seq_id=SEQ, keys=KEYS, values=KEYS, offset=1, notices=True),
        p.CalibrateRequest(request_id=17, namespace=NS, require=True),
    ]


CALIBRATION = Calibration(
    "smollm2-135m", (1, 1, 4), "float16", 128, 64, 4, "q8", "0.1.0", (((((0.0, 0.0078125, 0.0625),) * 2),),),
    {"8bit": LevelPlan("8bit", 0.01, ((("q8",), ("q8",)),), 0.0078125, 0.0078125, 8.25)},
).sealed().to_dict()


def show(header: bytes) -> str:
    return json.dumps(msgpack.unpackb(header), ensure_ascii=False).replace("null", "nil")


def hexdump(data: bytes, indent: str = "") -> list[str]:
    return [f"{indent}{i:04x}  {data[i:i + 16].hex(' ')}" for i in range(0, len(data), 16)]


def render() -> str:
    out = [BEGIN, "", "**Request headers** (frame 0 of each request kind; offsets in hex):", ""]
    for req in requests():
        frames = p.encode_request(req)
        header = bytes(frames[0])
        extra = f", then {len(frames) - 1} frames of {', '.join(str(len(f)) for f in frames[1:])} bytes" \
            if len(frames) > 1 else ""
        label = " (pages, packed)" if getattr(req, "packed", False) else ""
        label = " (1.3: position, incarnation)" if getattr(req, "position", None) is not None else label
        label = " (1.8: notices)" if getattr(req, "notices", False) else label
        label = " (1.8: require only)" if getattr(req, "require", None) is not None else label
        out += [f"`{req.OP}`{label}: {len(header)} bytes"
                f"{extra}", "", "```", show(header), *hexdump(header), "```", ""]
    trailing = msgpack.packb({"v": 1, "id": 12, "op": "ping"}) + b"\x00"
    reply = bytes(p.encode_reply(p.parse_request([trailing]))[0])  # type: ignore[arg-type]
    out += ["**Error reply** to the `ping` header `{\"v\": 1, \"id\": 12, \"op\": \"ping\"}` followed by one "
            "stray byte `00`: the id is echoed (§7).", "", "```", show(reply), *hexdump(reply), "```", ""]
    out += ["**One page per level** (docs/formats.md), role `key`, of the float16 tensor `[T=2, H=1, D=8]` with "
            "values `(i / 4) - 1.5` for i = 0..15 in C order. `checksum` is the u64 at bytes 24..31, "
            "`xxh3_64(bytes[prefix:], seed = xxh3_64(bytes[0:24] ++ bytes[32:prefix]))`:", ""]
    for level in ("fp16", "q8", "fp8_e4m3", "fp8_e5m2", "q4"):
        page = bytes(pages.encode(PAGE_INPUT, level, role="key"))
        head = pages.header(page)
        prefix = 32 + (2 * len(head.raw_heads) + 7) // 8 * 8
        seed = xxhash.xxh3_64_intdigest(page[:24] + page[32:prefix])
        checksum = xxhash.xxh3_64_intdigest(page[prefix:], seed=seed)
        assert checksum == int.from_bytes(page[24:32], "little")
        out += [f"`{level}`: {len(page)} bytes, checksum `{checksum:#018x}`", "", "```", *hexdump(page), "```", ""]
    out.append(END)
    return "\n".join(out)


def current() -> str:
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def test_the_documented_examples_are_what_kvd_encodes() -> None:
    stale = "docs/protocol.md §11.1 is stale: run python tests/unit/test_protocol_doc.py --write"
    assert current() == render(), stale


def test_the_documented_request_headers_decode_back_to_the_requests() -> None:
    for req in requests():
        frames = p.encode_request(req)
        assert type(p.decode_request(frames)) is type(req)


def main(argv: list[str]) -> int:
    if argv != ["--write"]:
        print(render())
        return 0
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    DOC.write_text(text[:start] + render() + text[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
