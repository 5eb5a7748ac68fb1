"""Client-side pieces that need no network: CURVE key files, the topology a client routes over, how appends are
split to fit the limits, what a server's protocol minor lets the client send, and cluster stats."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvd.client import core as client_core
from kvd.client.core import PACK_BELOW_BYTES, First, _check_hello, _Conn, _Core, _on_wire
from kvd.client.sync import _append_chunks, aggregate_stats
from kvd.errors import Busy, ConfigError, InvalidArgument, KvdWarning, ShardUnavailable, Timeout
from kvd.wire import protocol as p
from kvd.wire.routing import Topology, owner
from kvd.wire.server import CurveConfig, keygen


def test_keygen_writes_a_private_secret_and_configs_load_it(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path / "keys", "server")
    assert Path(public).name == "server.key" and Path(secret).name == "server.key_secret"
    assert (os.stat(secret).st_mode & 0o777) == 0o600
    assert (os.stat(tmp_path / "keys").st_mode & 0o777) == 0o700
    c_public, c_secret = keygen(tmp_path / "keys", "client")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "client.key").write_bytes(Path(c_public).read_bytes())
    server = CurveConfig.for_server(secret_key_file=secret, authorized_keys_dir=allowed)
    client = CurveConfig.for_client(server_public_key_file=public, secret_key_file=c_secret)
    assert client.server_public_key == server.public_key
    assert server.authorized_keys == frozenset({client.public_key})
    assert server.secret_key.decode() not in repr(server) and client.secret_key.decode() not in repr(client)
    ephemeral = CurveConfig.for_client(server_public_key_file=public)  # a fresh pair: for allow-any servers
    assert ephemeral.public_key != client.public_key and len(ephemeral.secret_key) == 40
    anyone = CurveConfig.for_server(secret_key_file=secret)
    assert anyone.authorized_keys is None


def test_curve_config_refuses_what_cannot_work(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path, "server")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no client could connect"):
        CurveConfig.for_server(secret_key_file=secret, authorized_keys_dir=empty)
    with pytest.raises(ConfigError, match="holds no secret key"):
        CurveConfig.for_server(secret_key_file=public)
    with pytest.raises(ConfigError, match="cannot read the CURVE key file"):
        CurveConfig.for_client(server_public_key_file=tmp_path / "missing.key")
    with pytest.raises(ConfigError, match="not a directory"):
        CurveConfig.for_server(secret_key_file=secret, authorized_keys_dir=tmp_path / "nope")
    with pytest.raises(ConfigError, match="40-character Z85"):
        CurveConfig(public_key=b"short", secret_key=b"x" * 40)
    with pytest.raises(ConfigError, match="plain file name"):
        keygen(tmp_path, "../evil")


def test_topology_routes_by_id_and_caches_per_topology() -> None:
    shards = [{"id": f"shard-{i}", "endpoint": f"tcp://h{i}:1"} for i in range(4)]
    topo = Topology(epoch=5, shards=shards, level="q8", level_epoch=2)
    ids = [s["id"] for s in shards]
    seqs: list[str | int] = ["a", "b", 1, 2, "1"]
    for seq in seqs:
        assert topo.owner("ns", seq) == shards[owner(ids, "ns", seq)]
    assert topo.owner("ns", 1) is topo.owner("ns", 1)
    assert topo.as_dict() == {"epoch": 5, "shards": shards, "level": "q8", "level_epoch": 2}
    with pytest.raises(ShardUnavailable, match="no shards"):
        Topology(epoch=1, shards=[]).owner("ns", 1)
    with pytest.raises(InvalidArgument, match="twice"):
        Topology(epoch=1, shards=[shards[0], {**shards[1], "id": "shard-0"}])
    with pytest.raises(InvalidArgument):
        topo.owner("", 1)


def test_appends_over_the_frame_limit_are_split_along_tokens() -> None:
    keys = np.zeros((2, 100, 2, 16), np.float16)  # 128 bytes per token per tensor
    values = np.ones_like(keys)
    limits = p.Limits(max_frame_bytes=1000, max_header_bytes=4096, max_message_bytes=4096 + 2000)
    chunks = _append_chunks(keys, values, limits)
    assert [c[0].shape[1] for c in chunks] == [7] * 14 + [2]  # 7 tokens = 896 bytes <= 1000
    assert np.array_equal(np.concatenate([c[1] for c in chunks], axis=1), values)
    assert all(np.shares_memory(c[0], keys) for c in chunks)  # views, not copies
    assert _append_chunks(keys, values, p.Limits())[0][0] is keys


@pytest.mark.parametrize("minor", [0, 1, 3, 4, 7])
def test_gets_ask_for_packed_replies_only_from_a_server_that_speaks_them(minor: int) -> None:
    """Packed pages from protocol 1.1, packed fp16 keys and values from 1.4; an older server never sees the key."""
    conn = _Conn("tcp://127.0.0.1:1", None, None)
    hello = p.HelloReply.for_limits(p.Limits(), request_id=1, kvd_version="x", page_format_version=1,
                                    shard_id="s", page_tokens=64, protocol_minor=minor)
    _check_hello(conn, hello, "s")
    pages = p.GetRequest(request_id=2, namespace="m", seq_id=1, format="pages")
    sent = _on_wire(conn, pages)
    assert sent.packed is (minor >= 1) and not pages.packed  # the caller's request is not changed
    assert (sent.request_id, sent.namespace, sent.seq_id, sent.format) == (2, "m", 1, "pages")
    wire = p.encode_request(sent)
    assert (b"packed" in bytes(wire[0])) is (minor >= 1)  # a 1.0 server never sees the key
    for asked in (False, True):  # the client's own gets ask for packed fp16 from the start
        fp16 = p.GetRequest(request_id=3, namespace="m", seq_id=1, packed=asked)
        sent = _on_wire(conn, fp16)
        assert sent.packed is (minor >= 4) and fp16.packed is asked
        assert (sent is fp16) is (asked is (minor >= 4))  # unchanged when nothing is to change
        assert (b"packed" in bytes(p.encode_request(sent)[0])) is (minor >= 4)


@pytest.mark.parametrize("minor", [3, 4])
def test_small_appends_go_packed_to_a_server_of_protocol_1_4(minor: int) -> None:
    conn = _Conn("tcp://127.0.0.1:1", None, None)
    _check_hello(conn, p.HelloReply.for_limits(p.Limits(), request_id=1, kvd_version="x", page_format_version=1,
                                               shard_id="s", page_tokens=64, protocol_minor=minor), "s")
    for tokens, packs in ((1, True), (PACK_BELOW_BYTES // 4096 - 1, True), (PACK_BELOW_BYTES // 4096, False)):
        keys = np.arange(tokens * 8 * 128, dtype=np.float16).reshape(1, tokens, 8, 128)  # 2 KiB a token
        append = p.AppendRequest(request_id=2, namespace="m", seq_id=1, keys=keys, values=keys + 1)
        sent = _on_wire(conn, append)
        assert sent.packed is (packs and minor >= 4) and append.packed is False, tokens
        frames = p.encode_request(sent)
        assert len(frames) == (2 if sent.packed else 3)
        got = p.decode_request([bytes(f) for f in frames])
        assert got.keys.tobytes() == keys.tobytes() and got.values.tobytes() == (keys + 1).tobytes()
        assert _on_wire(conn, sent) is sent  # once is enough: the send path may look again


@pytest.mark.parametrize("minor", [7, 8])
def test_appends_ask_for_their_replys_notice_only_from_a_server_of_protocol_1_8(minor: int) -> None:
    conn = _Conn("tcp://127.0.0.1:1", None, None)
    _check_hello(conn, p.HelloReply.for_limits(p.Limits(), request_id=1, kvd_version="x", page_format_version=1,
                                               shard_id="s", page_tokens=64, protocol_minor=minor), "s")
    keys = np.zeros((1, 1, 1, 2), np.float16)
    append = p.AppendRequest(request_id=2, namespace="m", seq_id=1, keys=keys, values=keys)
    sent = _on_wire(conn, append)
    assert sent.notices is (minor >= 8) and append.notices is False  # the caller's request is not changed
    assert (b"notices" in bytes(p.encode_request(sent)[0])) is (minor >= 8)  # a 1.7 server never sees the key
    assert _on_wire(conn, sent) is sent
    # a request shaped for a 1.8 shard and resent to this one (WrongShard, a new owner) is this one's
    asked = p.AppendRequest(request_id=3, namespace="m", seq_id=1, keys=keys, values=keys, notices=True)
    assert _on_wire(conn, asked).notices is (minor >= 8)


def test_a_namespaces_notice_is_kept_until_a_reply_without_one_and_warned_once() -> None:
    core = _Core("tcp://127.0.0.1:1", timeout_s=1.0, curve=None, limits=None)
    keys = np.zeros((1, 1, 1, 2), np.float16)
    asked = p.AppendRequest(request_id=1, namespace="m", seq_id=1, keys=keys, values=keys, notices=True)
    with pytest.warns(KvdWarning, match="kvd namespace 'm': needs calibration: x"):
        core._note(asked, p.AppendReply(request_id=1, length=1, notice="needs calibration: x"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KvdWarning)  # once per namespace
        core._note(asked, p.AppendReply(request_id=2, length=2, notice="needs calibration: y"))
    assert core.notices == {"m": "needs calibration: y"}  # the latest
    not_asked = p.AppendRequest(request_id=3, namespace="m", seq_id=2, keys=keys, values=keys)
    core._note(not_asked, p.AppendReply(request_id=3, length=1))  # an older shard's reply tells nothing
    assert core.notices == {"m": "needs calibration: y"}
    core._note(asked, p.AppendReply(request_id=4, length=3))  # a 1.8 shard's without one: it got its calibration
    assert core.notices == {}
    other = p.AppendRequest(request_id=5, namespace="n", seq_id=1, keys=keys, values=keys, notices=True)
    with pytest.warns(KvdWarning, match="'n'"):  # another namespace warns on its own
        core._note(other, p.AppendReply(request_id=5, length=1, notice="needs calibration: z"))


def test_aggregate_stats_of_no_shards() -> None:
    assert aggregate_stats([]) == {"shards": 0, "errors": 0}


def test_aggregate_stats_leave_a_shards_own_eviction_bound_out() -> None:
    """Each store learns its own staleness bound: a sum (or a None against a number) is no cluster figure."""
    out = aggregate_stats([{"evictions": 2, "eviction_stale_after": None, "eviction_reuses_known": 10},
                           {"evictions": 3, "eviction_stale_after": 168, "eviction_reuses_known": 200}])
    assert out["evictions"] == 5
    assert "eviction_stale_after" not in out and "eviction_reuses_known" not in out


def test_appends_name_the_shard_incarnation_the_hello_found_and_nothing_else_does() -> None:
    conn = _Conn("tcp://127.0.0.1:1", None, None)
    hello = p.HelloReply.for_limits(p.Limits(), request_id=1, kvd_version="x", page_format_version=1,
                                    shard_id="s", page_tokens=64, protocol_minor=3)  # (no packed appends)
    _check_hello(conn, hello, "s")  # a shard that did not say (older than 1.3, or not asked)
    keys = np.zeros((1, 1, 1, 2), np.float16)
    append = p.AppendRequest(request_id=2, namespace="m", seq_id=1, keys=keys, values=keys)
    assert _on_wire(conn, append) is append and b"incarnation" not in bytes(p.encode_request(append)[0])
    _check_hello(conn, p.HelloReply.for_limits(p.Limits(), request_id=3, kvd_version="x", page_format_version=1,
                                               shard_id="s", page_tokens=64, incarnation="inc-1",
                                               protocol_minor=3), "s")
    sent = _on_wire(conn, append)
    assert sent.incarnation == "inc-1" and append.incarnation is None
    assert p.decode_request(p.encode_request(sent)).incarnation == "inc-1"
    named = p.AppendRequest(request_id=4, namespace="m", seq_id=1, keys=keys, values=keys, incarnation="inc-0")
    assert _on_wire(conn, named) is named  # the incarnation a sequence was written on is kept
    length = p.LengthRequest(request_id=5, namespace="m", seq_id=1)
    assert _on_wire(conn, length) is length


def test_a_client_remembers_the_incarnation_of_the_sequences_it_appended_to_last(monkeypatch) -> None:
    """An append names the shard incarnation its sequence was written on, so a restarted shard refuses to continue
    it in the middle. The client's memory of them is bounded: the WRITTEN_ENTRIES sequences appended to most
    recently, the least recently appended forgotten first; a drop forgets at once."""
    monkeypatch.setattr(client_core, "WRITTEN_ENTRIES", 3)
    core = _Core("tcp://127.0.0.1:1", timeout_s=1.0, curve=None, limits=None)
    conn = _Conn("tcp://127.0.0.1:1", None, None)
    _check_hello(conn, p.HelloReply.for_limits(p.Limits(), request_id=1, kvd_version="x", page_format_version=1,
                                               shard_id="s", page_tokens=64, incarnation="inc-1"), "s")
    keys = np.zeros((1, 1, 1, 2), np.float16)

    def append(sid: str) -> p.AppendRequest:
        return p.AppendRequest(request_id=2, namespace="m", seq_id=sid, keys=keys, values=keys)

    for sid in "abcad":  # a again: now the most recent; d: b, the least recent, is forgotten
        core._remember(append(sid), conn)
    assert {sid: core._bind(append(sid)).incarnation for sid in "abcd"} == {
        "a": "inc-1", "b": None, "c": "inc-1", "d": "inc-1"}
    core._remember(append("b"), conn)  # back: c is now the least recent, and goes
    assert [sid for sid in "abcd" if core._bind(append(sid)).incarnation] == ["a", "b", "d"]
    core._remember(p.DropRequest(request_id=3, namespace="m", seq_id="a"), conn)
    assert [sid for sid in "abcd" if core._bind(append(sid)).incarnation] == ["b", "d"]


def _drive(plan: Any, respond: Any) -> Any:
    """Run a client plan without a network: ``respond(action)`` answers each I/O action (or raises)."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            action = plan.throw(error) if error is not None else plan.send(value)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            value = respond(action)
        except BaseException as exc:  # noqa: BLE001 - thrown into the plan, as the clients do
            error = exc


class _FakeCluster:
    """Three shards and a coordinator answering a client plan: shards refuse what they do not own."""

    def __init__(self, client_ids: list[str], incarnations: dict[str, str] | None = None) -> None:
        self.ids = ["shard-0", "shard-1", "shard-2"]
        self.incarnations = incarnations or {sid: f"inc-{sid}" for sid in self.ids}
        self.core = _Core("tcp://127.0.0.1:1", timeout_s=5.0, curve=None, limits=None)
        self.core._coordinator = _Conn("tcp://coordinator:1", None, None)
        self.core._set_topology({"epoch": 1, "shards": [self.shard(s) for s in client_ids], "level": "fp16",
                                 "level_epoch": 1})
        self.sent: list[tuple[str, Any]] = []

    @staticmethod
    def shard(sid: str) -> dict[str, str]:
        return {"id": sid, "endpoint": f"tcp://{sid}:1"}

    def respond(self, action: tuple[Any, ...]) -> Any:
        kind = action[0]
        if kind == "open":
            return _Conn(action[1], None, None)
        if kind in ("send", "sleep"):
            if kind == "send":
                self.sent.append((action[1].endpoint, action[2]))
            return None
        conn, req = action[1], action[2]
        sid = conn.endpoint[len("tcp://"):-len(":1")]
        if isinstance(req, p.TopologyRequest):
            return p.TopologyReply(request_id=req.request_id, epoch=2, shards=tuple(map(self.shard, self.ids)),
                                   level="fp16", level_epoch=1)
        if isinstance(req, p.HelloRequest):
            return p.HelloReply.for_limits(p.Limits(), request_id=req.request_id, kvd_version="x",
                                           page_format_version=1, shard_id=sid, page_tokens=16,
                                           incarnation=self.incarnations[sid] if req.incarnation else None)
        if req.incarnation is not None and req.incarnation != self.incarnations[sid]:
            return p.ErrorReply(request_id=req.request_id, code=19, error="WrongShard", message="restarted")
        if self.ids[owner(self.ids, req.namespace, req.seq_id)] != sid:
            return p.ErrorReply(request_id=req.request_id, code=19, error="WrongShard", message="not mine")
        return p.AppendReply(request_id=req.request_id, length=2)


def test_a_refused_append_goes_to_the_owner_the_refreshed_topology_names_with_that_shards_incarnation() -> None:
    fake = _FakeCluster(["shard-0", "shard-1"])  # a stale topology: shard-2 is missing
    seq = next(f"s{i}" for i in range(1000) if owner(fake.ids, "m", f"s{i}") == 2)
    keys = np.zeros((1, 2, 1, 4), np.float16)
    assert _drive(fake.core._plan_append("m", seq, keys, keys, None, None, None), fake.respond) == 2
    appends = [(endpoint, req) for endpoint, req in fake.sent if isinstance(req, p.AppendRequest)]
    assert [e for e, _ in appends][-1] == "tcp://shard-2:1" and len(appends) == 2
    assert appends[0][1].incarnation != "inc-shard-2" and appends[1][1].incarnation == "inc-shard-2"
    assert sum(isinstance(r, p.TopologyRequest) for _, r in fake.sent) == 1
    assert fake.core.topology()["epoch"] == 2
    # the shard restarts (a new incarnation at the same endpoint): the sequence is not continued in the middle
    fake.incarnations["shard-2"] = "inc-shard-2-b"
    with pytest.raises(ShardUnavailable, match="inc-shard-2-b"):
        _drive(fake.core._plan_append("m", seq, keys, keys, None, None, None), fake.respond)
    # ... it is forgotten, so appending again starts it over (the caller's choice); an offset append is resent
    assert _drive(fake.core._plan_append("m", seq, keys, keys, None, None, None), fake.respond) == 2
    fake.incarnations["shard-2"] = "inc-shard-2-c"
    assert _drive(fake.core._plan_append("m", seq, keys, keys, 2, None, None), fake.respond) == 2


def _first_attempt(fake: _FakeCluster, shard_id: str, seq: str, keys: Any, outcome: Any = None) -> First:
    """What Client's fast path hands the plan: the append as sent on the greeted connection, and its outcome
    (the fake shard's reply unless given)."""
    deadline = fake.core._deadline(None)
    conn = _drive(fake.core._g_conn(fake.shard(shard_id), deadline), fake.respond)
    req = _on_wire(conn, p.AppendRequest(request_id=next(fake.core._ids), namespace="m", seq_id=seq, keys=keys,
                                         values=keys))
    if outcome is None:
        outcome = fake.respond(("wait", conn, req, deadline, 5.0))
    fake.sent.clear()
    return First(conn, req, deadline, outcome)


def test_a_first_attempt_refused_with_wrong_shard_goes_on_as_the_plan_would() -> None:
    fake = _FakeCluster(["shard-0", "shard-1"])  # a stale topology: shard-2 is missing
    seq = next(f"s{i}" for i in range(1000) if owner(fake.ids, "m", f"s{i}") == 2)
    stale = fake.core._topo.owner("m", seq)["id"]
    keys = np.zeros((1, 2, 1, 4), np.float16)
    first = _first_attempt(fake, stale, seq, keys)
    assert isinstance(first.outcome, p.ErrorReply) and first.outcome.code == 19
    assert _drive(fake.core._plan_append("m", seq, keys, keys, None, None, None, first=first), fake.respond) == 2
    appends = [(endpoint, req) for endpoint, req in fake.sent if isinstance(req, p.AppendRequest)]
    assert appends == [("tcp://shard-2:1", appends[0][1])] and appends[0][1].incarnation == "inc-shard-2"
    assert appends[0][1].request_id != first.req.request_id  # resent under a new id, once, to the owner
    assert sum(isinstance(r, p.TopologyRequest) for _, r in fake.sent) == 1


def test_a_first_attempt_answered_busy_is_retried_after_a_pause() -> None:
    fake = _FakeCluster(["shard-0", "shard-1", "shard-2"])
    keys = np.zeros((1, 2, 1, 4), np.float16)
    sid = fake.core._topo.owner("m", "s").get("id")
    first = _first_attempt(fake, sid, "s", keys, p.ErrorReply(request_id=0, code=Busy.code, error="Busy",
                                                               message="queue full"))
    actions: list[str] = []

    def respond(action: tuple[Any, ...]) -> Any:
        actions.append(action[0])
        return fake.respond(action)

    assert _drive(fake.core._plan_append("m", "s", keys, keys, None, None, None, first=first), respond) == 2
    assert actions == ["sleep", "send", "wait"]


def test_a_first_attempt_that_timed_out_is_not_resent_for_an_append_but_the_topology_is_read_again() -> None:
    fake = _FakeCluster(["shard-0", "shard-1", "shard-2"])
    keys = np.zeros((1, 2, 1, 4), np.float16)
    sid = fake.core._topo.owner("m", "s")["id"]
    first = _first_attempt(fake, sid, "s", keys, Timeout("no reply"))
    with pytest.raises(Timeout, match="no reply"):
        _drive(fake.core._plan_append("m", "s", keys, keys, None, None, None, first=first), fake.respond)
    assert [type(r) for _, r in fake.sent] == [p.TopologyRequest]


_REUSE_PROBE = r"""
import ctypes, ctypes.util, resource, sys
import kvd.client
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "opt-in":
    assert kvd.client.recycle_buffers(512 << 20)
n, size = 16, 16 << 20  # 16 replies of 16 MiB in flight: 256 MiB, as 8 pipelined 32 MiB gets

def burst() -> int:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [libc.malloc(size) for _ in range(n)]
    for b in bufs:
        ctypes.memset(b, 1, size)
    for b in bufs:
        libc.free(b)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

burst()
print(burst())
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="glibc malloc on Linux")
@pytest.mark.parametrize("mode", ["default", "opt-in"])
def test_recycle_buffers_keeps_large_reply_buffers_warm_and_only_when_asked(mode: str) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _REUSE_PROBE, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pages = 16 * (16 << 20) // 4096
    faults = int(out.stdout.split()[-1])
    if mode == "opt-in":
        assert faults < pages // 20  # the second burst reuses the first one's pages
    else:
        assert faults > pages // 2  # importing kvd.client changes nothing: fresh pages every burst


def test_recycle_buffers_refuses_a_size_below_a_reply_frame() -> None:
    from kvd.client import recycle_buffers

    with pytest.raises(InvalidArgument, match="keep_bytes"):
        recycle_buffers(1 << 20)


def test_request_frames_under_the_copy_bound_are_copied_and_larger_ones_sent_from_the_callers_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import zmq

    from kvd.client.conn import COPY_BELOW_BYTES, _open_socket
    from kvd.wire import sockets

    sent: list[tuple[int, int, bool]] = []  # (bytes, flags, copied) of each part
    monkeypatch.setattr(sockets, "_send", lambda _s, data, flags, copy, _t: sent.append((len(data), flags, copy)))
    frames = [b"h" * 40, bytes(COPY_BELOW_BYTES - 1), memoryview(bytes(COPY_BELOW_BYTES))]
    sockets.send_frames(None, frames, zmq.NOBLOCK)  # the clients' and the servers' sends
    more, noblock = int(zmq.SNDMORE), int(zmq.NOBLOCK)
    assert sent == [(40, noblock | more, True), (COPY_BELOW_BYTES - 1, more, True), (COPY_BELOW_BYTES, 0, False)]
    ctx = zmq.Context()
    try:
        conn = _open_socket(ctx, "tcp://127.0.0.1:1", None, p.DEFAULT_LIMITS)
        assert conn.sock.copy_threshold == COPY_BELOW_BYTES  # AsyncClient's send_multipart(copy=False) too
        conn.close()
    finally:
        ctx.term()
