"""The ``calibrate`` operation (protocol 1.7) over real sockets: a ShardServer in another process applies a
namespace's calibration to the pages it seals from then on, quarantines one measured on another layout, refuses
bad records with clear errors and keeps serving, and a client never sends it to a server older than 1.7.
Protocol 1.8: a namespace's own ``require_calibration`` (``calibrate``'s ``require``), and the "needs
calibration" notice on append replies, which Client and AsyncClient surface without changing what append
returns, and which a request without ``notices`` never gets."""

from __future__ import annotations

import asyncio
import threading
import warnings
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvd.calibration import Calibration, LevelPlan
from kvd.client import AsyncClient, Client
from kvd.codec import pages
from kvd.errors import InvalidArgument, KvdWarning, ProtocolError, UnknownNamespace
from kvd.wire import protocol as p

from test_wire import LAYOUT, NS, ServerProcess, kv, raw_dealer, request  # isort: skip

pytestmark = pytest.mark.integration

L, H, D = LAYOUT["num_layers"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"]
PAGE = 64  # the store's default page


def calibration(layout: tuple[int, int, int] = (L, H, D), model: str = "test-model") -> Calibration:
    """Layer 0's keys of head 1 held at q8 and its values of head 0 kept fp16 under q4; the 8-bit rung as is."""
    q4 = (((("q4", "q8"), ("fp16", "q4"))),) + tuple((("q4",) * layout[1], ("q4",) * layout[1])
                                                     for _ in range(layout[0] - 1))
    q4 = tuple((tuple(k), tuple(v)) for k, v in q4)
    eight = tuple((("q8",) * layout[1], ("q8",) * layout[1]) for _ in range(layout[0]))
    if layout[1] != 2:
        q4 = tuple((("q4",) * layout[1], ("q4",) * layout[1]) for _ in range(layout[0]))
    head = ((0.0, 0.008, 0.07), (0.0, 0.006, 0.05))
    errors = tuple(tuple(head for _ in range(layout[1])) for _ in range(layout[0]))
    plans = {"q4": LevelPlan("q4", 0.06, q4, 0.055, 0.058, 5.2),
             "8bit": LevelPlan("8bit", 0.01, eight, 0.009, 0.0095, 8.3)}
    return Calibration(model, layout, "float16", 256, PAGE, 4, "q8", "0", errors, plans).sealed()


@pytest.fixture
def server() -> Any:
    srv = ServerProcess("shard-cal", level="q4")
    yield srv
    srv.stop()


@pytest.mark.timeout(60)
def test_the_op_round_trips_and_pages_sealed_after_it_follow_the_calibration(server: ServerProcess) -> None:
    cal = calibration()
    k, v = kv(tokens=3 * PAGE, seed=1)
    with Client(server.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        c.append(NS, "before", k, v)
        state = c.calibrate(NS, cal)
        assert state["state"] == "active" and state["digest"] == cal.digest and state["model"] == "test-model"
        assert state["levels"]["q4"]["met"] and state["levels"]["q4"]["budget"] == pytest.approx(0.06)
        assert state["levels"]["q4"]["protected"] == 2
        c.append(NS, "after", k, v)
        why = c.explain(NS, "after", 0, PAGE + 3)  # page 1 (past the sink page), sealed at q4
        assert why["level"] == "q4"
        assert "key heads [1] held at q8 by the calibration" in why["reasons"]
        assert "value heads [0] kept fp16 by the calibration" in why["reasons"]
        assert f"calibration {cal.digest[:16]} active" in why["reasons"]
        assert not any("calibration" in r and "held" in r for r in c.explain(NS, "after", 1, PAGE + 3)["reasons"])
        # the pages themselves: layer 0's key page holds head 1 at q8 (page format 2), its value page head 0 raw
        ctx = zmq.Context()
        sock = raw_dealer(ctx, server.endpoint)
        try:
            reply = request(sock, p.GetRequest(request_id=1, namespace=NS, seq_id="after", start=PAGE,
                                               end=2 * PAGE, layers=(0,), format="pages"))
        finally:
            sock.close(0)
            ctx.term()
        key_page, value_page = bytes(reply.entries[0][2]), bytes(reply.entries[0][3])
        assert pages.header(key_page).version == pages.HELD_VERSION
        assert pages.header(value_page).raw_heads == (0,)
        np.testing.assert_array_equal(pages.decode(key_page)[:, 1], pages.decode(
            pages.encode(k[0, PAGE:2 * PAGE, 1:2], "q8", role="key"))[:, 0])
        # pages sealed before keep their format; the store counts what the calibration held back
        assert not any("calibration" in r and "held" in r for r in c.explain(NS, "before", 0, PAGE + 3)["reasons"])
        stats = c.stats()
        assert stats["calibrated_namespaces"] == 1 and stats["calibration_held_pages"] >= 2


@pytest.mark.timeout(60)
def test_pages_with_held_heads_come_back_through_every_get(server: ServerProcess) -> None:
    """A calibrated namespace's pages (format 2: held heads, raw heads) read back through the client's gets: fp16
    from the server, and pages packed several to a frame, which the client splits by their own headers and
    decodes. Both give the same tokens, and within q4's error of what was appended."""
    k, v = kv(tokens=4 * PAGE, seed=3)
    with Client(server.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        c.calibrate(NS, calibration())
        c.append(NS, "held", k, v)
        k16, v16 = c.get(NS, "held")
        kp, vp = c.get(NS, "held", format="pages")
        many = c.get_many([(NS, "held")], format="pages")
    np.testing.assert_array_equal(kp, k16)
    np.testing.assert_array_equal(vp, v16)
    np.testing.assert_array_equal(many[0][0], k16)
    for got, want in ((k16, k), (v16, v)):
        err = np.linalg.norm(got.astype(np.float32) - want) / np.linalg.norm(want)
        assert err < 0.2, err


@pytest.mark.timeout(60)
def test_a_calibration_of_another_layout_is_quarantined_and_reported(server: ServerProcess) -> None:
    wrong = calibration(layout=(L + 1, H, D))
    k, v = kv(tokens=3 * PAGE, seed=2)
    with Client(server.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        state = c.calibrate(NS, wrong)
        assert state["state"] == "quarantined" and state["digest"] == wrong.digest
        assert f"layout (layers, kv_heads, head_dim) {(L + 1, H, D)}, the namespace is {(L, H, D)}" \
            in state["reason"]
        c.append(NS, "s", k, v)
        why = c.explain(NS, "s", 0, PAGE + 3)
        assert why["level"] == "q4" and state["reason"] in why["reasons"]
        assert not any("by the calibration" in r for r in why["reasons"])  # kept, never applied
        assert c.stats()["calibrated_namespaces"] == 0
        # a matching one replaces it
        assert c.calibrate(NS, calibration())["state"] == "active"


@pytest.mark.timeout(60)
def test_async_client_calibrates_too(server: ServerProcess) -> None:
    import asyncio

    async def run() -> dict[str, Any]:
        async with AsyncClient(server.endpoint, timeout_s=10) as c:
            await c.register(NS, **LAYOUT)
            return await c.calibrate(NS, calibration().to_dict())

    assert asyncio.run(run())["state"] == "active"


def _tampered(**change: Any) -> dict[str, Any]:
    record = calibration().to_dict()
    record.update(change)
    return record


@pytest.mark.timeout(60)
@pytest.mark.parametrize("record,error,needle", [
    (_tampered(model="another"), "InvalidArgument", "does not match its contents"),
    (_tampered(version=9), "InvalidArgument", "calibration format version 9 is not 1"),
    ({k: v for k, v in calibration().to_dict().items() if k != "errors"}, "InvalidArgument",
     "malformed calibration: KeyError: 'errors'"),
    (_tampered(layout=[2, 0, 16]), "InvalidArgument", "layout must be 3 positive integers"),
    (_tampered(eight_bit="q3"), "InvalidArgument", "eight_bit must be q8, fp8_e4m3 or fp8_e5m2"),
    ([1, 2, 3], "ProtocolError", "calibration must be a map"),
])
def test_bad_records_get_clear_errors_and_the_shard_keeps_serving(server: ServerProcess, record: Any,
                                                                  error: str, needle: str) -> None:
    with Client(server.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        if isinstance(record, dict):  # the client refuses it before any I/O, with the same message
            with pytest.raises(InvalidArgument, match=needle.replace("(", r"\(").replace(")", r"\)")):
                c.calibrate(NS, record)
    ctx = zmq.Context()
    sock = raw_dealer(ctx, server.endpoint)
    try:  # a peer that does not check: the server does
        header = msgpack.packb({"v": 1, "id": 7, "op": "calibrate", "namespace": NS, "calibration": record})
        sock.send_multipart([header])
        assert sock.poll(10_000)
        reply = p.decode_reply(sock.recv_multipart())
        assert isinstance(reply, p.ErrorReply) and reply.request_id == 7 and reply.error == error
        assert needle in reply.message
    finally:
        sock.close(0)
        ctx.term()
    with Client(server.endpoint, timeout_s=10) as c:  # nothing was applied, and the shard serves
        assert c.ping()
        k, v = kv(tokens=2 * PAGE, seed=3)
        c.append(NS, "s", k, v)
        assert c.stats()["calibrated_namespaces"] == 0
        assert c.calibrate(NS, calibration())["state"] == "active"


@pytest.mark.timeout(60)
def test_an_unknown_namespace_is_refused(server: ServerProcess) -> None:
    with Client(server.endpoint, timeout_s=10) as c:
        with pytest.raises(UnknownNamespace, match="register it"):
            c.calibrate("nope", calibration())
        assert c.stats()["calibrated_namespaces"] == 0


@pytest.mark.timeout(60)
def test_hello_says_the_server_may_write_page_format_2(server: ServerProcess) -> None:
    ctx = zmq.Context()
    sock = raw_dealer(ctx, server.endpoint)
    try:
        hello = request(sock, p.HelloRequest(request_id=1))
        assert hello.protocol_minor == 8 and hello.page_format_version == pages.HELD_VERSION == 2
    finally:
        sock.close(0)
        ctx.term()


def _old_shard(router: zmq.Socket[Any], seen: list[str], stop: threading.Event, minor: int = 6,
               headers: list[dict[str, Any]] | None = None) -> None:
    """A shard of protocol 1.``minor`` (6: it knows no calibrate operation): it answers hello, register and
    append, and refuses what it does not know (an unknown op, or a key newer than it) as such a server does."""
    known = {"append": {"v", "id", "op", "namespace", "seq_id", "offset", "dtype", "shape", "position",
                        "incarnation", "packed", "parent"},
             "calibrate": {"v", "id", "op", "namespace", "calibration"}}
    while not stop.is_set():
        if not router.poll(50):
            continue
        ident, *frames = router.recv_multipart()
        header = msgpack.unpackb(frames[0])
        seen.append(header.get("op", "?"))
        if headers is not None:
            headers.append(header)
        op = header.get("op")
        if set(header) - known.get(op, set(header)):
            reply: Any = p.error_reply(header.get("id"), ProtocolError(f"{op}: unknown header keys"))
        elif op == "hello":
            reply = p.HelloReply.for_limits(p.Limits(), request_id=header["id"], kvd_version="0.1.0",
                                            page_format_version=1, shard_id="old", page_tokens=64,
                                            protocol_minor=minor)
        elif op == "register":
            reply = p.RegisterReply(request_id=header["id"])
        elif op == "append":
            reply = p.AppendReply(request_id=header["id"], length=header["shape"][1])
        elif op == "calibrate" and minor >= 7:
            reply = p.CalibrateReply(request_id=header["id"], state="active", reason="")
        else:
            reply = p.error_reply(header.get("id"), ProtocolError("unknown op"))
        router.send_multipart([ident, *p.encode_reply(reply)])


@pytest.mark.timeout(60)
def test_a_server_before_protocol_1_7_is_never_sent_the_op() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=_old_shard, args=(router, seen, stop), daemon=True)
    thread.start()
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=5) as c:
            c.register(NS, **LAYOUT)
            with pytest.raises(ProtocolError, match=r"speaks protocol 1\.6: calibrate needs 1\.7"):
                c.calibrate(NS, calibration())
        assert "calibrate" not in seen and "register" in seen
    finally:
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.term()


# ---- protocol 1.8: "needs calibration" on append replies, and a namespace's own require_calibration -----------

NEEDS = "needs calibration: pages compressed with the default protection"


@pytest.fixture
def strict() -> Any:
    """A shard that requires calibrations and may not keep pages raw without one."""
    srv = ServerProcess("shard-strict", level="q4", store={"require_calibration": True,
                                                         "allow_raw_fallback": False})
    yield srv
    srv.stop()


@pytest.mark.timeout(60)
def test_a_namespace_that_needs_a_calibration_says_so_on_every_append_through_client(
        strict: ServerProcess) -> None:
    k, v = kv(tokens=PAGE + 3, seed=4)
    with Client(strict.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        with pytest.warns(KvdWarning, match=f"kvd namespace '{NS}': {NEEDS}"):
            assert c.append(NS, "a", k, v) == PAGE + 3  # append still returns the length
        assert c.notices == {NS: NEEDS}
        with warnings.catch_warnings():
            warnings.simplefilter("error", KvdWarning)  # once per namespace per client: no second warning
            assert c.append(NS, "a", k[:, :1], v[:, :1]) == PAGE + 4  # the fast path
            assert c.append_nowait(NS, "b", k, v).result() == PAGE + 3  # pipelined
            assert c.append_many([(NS, "c", k, v), (NS, "d", k, v)]) == [PAGE + 3] * 2
            big = kv(tokens=2 * PAGE, seed=5)
            assert c.append(NS, "e", memoryview(big[0]), memoryview(big[1])) == 2 * PAGE  # the plan's path
        c.notices.clear()
        c.append_nowait(NS, "b", k[:, :1], v[:, :1]).result()
        assert c.notices == {NS: NEEDS}  # every append says so, pipelined ones too
        c.notices.clear()
        c.append_many([(NS, "c", k[:, :1], v[:, :1])])
        assert c.notices == {NS: NEEDS}
        c.notices.clear()
        c.append(NS, "e", memoryview(np.ascontiguousarray(k[:, :1])),
                 memoryview(np.ascontiguousarray(v[:, :1])))  # through the plan
        assert c.notices == {NS: NEEDS}
        # a matching calibration: no notice any more, and the namespace's entry goes
        assert c.calibrate(NS, calibration())["state"] == "active"
        with warnings.catch_warnings():
            warnings.simplefilter("error", KvdWarning)
            c.append(NS, "f", k, v)
        assert c.notices == {}
        # another client warns on its own
        c.register("other", **LAYOUT)
    with Client(strict.endpoint, timeout_s=10) as c2, pytest.warns(KvdWarning, match="'other'"):
        c2.append("other", "x", k, v)


@pytest.mark.timeout(60)
def test_async_client_surfaces_the_notice_too(strict: ServerProcess) -> None:
    k, v = kv(tokens=PAGE + 3, seed=6)

    async def run() -> tuple[list[Any], dict[str, str], dict[str, str]]:
        async with AsyncClient(strict.endpoint, timeout_s=10) as c:
            await c.register(NS, **LAYOUT)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                lengths = [await c.append(NS, "a", k, v), *await c.append_many([(NS, "b", k, v),
                                                                                (NS, "c", k, v)])]
            seen = dict(c.notices)
            await c.calibrate(NS, calibration())
            await c.append(NS, "d", k, v)
            return [lengths, [w for w in caught if issubclass(w.category, KvdWarning)]], seen, dict(c.notices)

    (lengths, warned), seen, after = asyncio.run(run())
    assert lengths == [PAGE + 3] * 3
    assert len(warned) == 1 and NEEDS in str(warned[0].message)
    assert seen == {NS: NEEDS} and after == {}


@pytest.mark.timeout(60)
def test_a_request_without_notices_gets_the_17_reply_bytes_and_one_with_it_the_notice(
        strict: ServerProcess) -> None:
    k, v = kv(tokens=3, seed=7)
    with Client(strict.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
    ctx = zmq.Context()
    sock = raw_dealer(ctx, strict.endpoint)
    try:
        sock.send_multipart(p.encode_request(p.AppendRequest(request_id=5, namespace=NS, seq_id="old", keys=k,
                                                             values=v)))
        assert sock.poll(10_000)
        got = [bytes(f) for f in sock.recv_multipart()]
        assert got == [bytes(f) for f in p.encode_reply(p.AppendReply(request_id=5, length=3))]  # 1.7's bytes
        reply = request(sock, p.AppendRequest(request_id=6, namespace=NS, seq_id="new", keys=k, values=v,
                                              notices=True))
        assert isinstance(reply, p.AppendReply) and (reply.length, reply.notice) == (3, NEEDS)
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_a_namespaces_own_require_calibration_over_the_wire(server: ServerProcess) -> None:
    """On a shard that does not require calibrations: one namespace does, on its own (fallback on: kept raw, no
    notice); then with fallback off on another shard, its appends say it needs one; --no-require undoes it."""
    k, v = kv(tokens=2 * PAGE, seed=8)
    with Client(server.endpoint, timeout_s=10) as c:
        c.register(NS, **LAYOUT)
        state = c.calibrate(NS, require=True)
        assert (state["state"], state["required"]) == ("missing", True)
        c.append(NS, "raw", k, v)
        assert c.explain(NS, "raw", 0, PAGE + 3)["level"] == "fp16"  # kept raw for want of one
        stats = c.shard_stats()[0]
        assert stats["calibration_required"] == {NS: True} and stats["require_calibration"] is False
        state = c.calibrate(NS, calibration(), require=False)  # both at once
        assert (state["state"], state["required"]) == ("active", False)
        assert "required" not in c.calibrate(NS, calibration())  # a 1.7-style request: a 1.7-style reply
        assert c.calibrate(NS, require=False)["digest"] == calibration().digest  # the calibration stays
        with pytest.raises(InvalidArgument, match="neither"):
            c.calibrate(NS)
    strict = ServerProcess("shard-strict-2", level="q4", store={"allow_raw_fallback": False})
    try:
        with Client(strict.endpoint, timeout_s=10) as c, warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            c.register(NS, **LAYOUT)
            c.append(NS, "a", k, v)
            assert c.notices == {}
            assert c.calibrate(NS, require=True)["state"] == "needed"
            c.append(NS, "b", k, v)
            assert c.notices == {NS: NEEDS}
            c.calibrate(NS, require=False)
            c.append(NS, "c", k, v)
            assert c.notices == {}
    finally:
        strict.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("minor", [6, 7])
def test_a_server_before_protocol_1_8_is_never_sent_notices_or_require(minor: int) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[str] = []
    headers: list[dict[str, Any]] = []
    stop = threading.Event()
    thread = threading.Thread(target=_old_shard, args=(router, seen, stop, minor, headers), daemon=True)
    thread.start()
    k, v = kv(tokens=3)
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=5) as c, warnings.catch_warnings():
            warnings.simplefilter("error", KvdWarning)
            c.register(NS, **LAYOUT)
            assert c.append(NS, "s", k, v) == 3
            assert c.append_nowait(NS, "t", k, v).result() == 3
            with pytest.raises(ProtocolError, match=rf"speaks protocol 1\.{minor}: calibrate"):
                c.calibrate(NS, require=True)
            if minor == 7:
                assert c.calibrate(NS, calibration())["state"] == "active"  # 1.7's calibrate still goes
            assert c.notices == {}
        appends = [h for h in headers if h.get("op") == "append"]
        assert len(appends) == 2 and not any("notices" in h for h in appends)
        assert not any("require" in h for h in headers)
        assert seen.count("calibrate") == (1 if minor == 7 else 0)
    finally:
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.term()
