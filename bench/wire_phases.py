"""Where one request's time goes: per-phase medians of kvd requests made one at a time, server in another process.

Both sides stamp time.perf_counter() (CLOCK_MONOTONIC, one clock for every process of the machine) at the
edges of each phase, by wrapping the client's and the server's own steps (a diagnostic: it hooks private
methods of kvd.client.Client and kvd.wire.server.ShardServer, so it moves with them):

    call -> encode      client API call until the request is encoded (routing, plan)
    encode + send       encode_request and the ZeroMQ send
    transit c->s        until the server's loop has the message (ZeroMQ I/O threads, TCP, wake-ups)
    admission           admission into the queue until the request runs
    server run          parse, store operation, reply encoding (for a request of 4 MiB or more: on the bulk lane)
    server send         the reply's ZeroMQ send (from the bulk lane: also the hand-back to the loop)
    transit s->c        until the client has the whole reply
    client decode       decode_reply (header, field checks, tensor views)
    decode -> return    the rest of the call (for format="pages": the page decode, assemble)

    python bench/wire_phases.py                         # 4 KiB get (1 token of 8 heads x 128, 1 layer)
    python bench/wire_phases.py --op append
    python bench/wire_phases.py --tokens 2048 --level q4 --format pages --requests 300
    KVD_PURE_PYTHON=1 python bench/wire_phases.py       # the same with every module from source

``--threads`` measures instead the CPU each thread of both processes spends per request, for gets answered by
three servers in alternating rounds, one request at a time and 8 in flight (with ``--op append``: raw puts
against kvd appends into a full store, the first two servers):

    raw zmq      bench/wire.py's ROUTER that sends a stored frame back (the transport limit), raw DEALER client
    kvd          a ShardServer (fp16), kvd.client.Client
    kvd shape    a bare ROUTER loop that answers each get with the encoded frames of a kvd get reply made once,
                 only the request id re-packed (kvd's message shape and client, with almost no server work)
    kvd 1.3      the same ShardServer, with a client that speaks protocol 1.3: keys and values in two frames, not
                 packed in one (protocol 1.4), so the difference is what the packed frame saves
    kvd ping     the ShardServer answering pings, one at a time: no data and no store, so the fixed cost of any
                 request in kvd's client and serving loop
    kvd buffers  with ``--socket-buffer BYTES``: the ShardServer with socket_buffer_bytes=BYTES (0: the system's
                 autotuned buffers; on loopback the default is 256 KiB, for the decode tail)

    python bench/wire_phases.py --threads --tokens 16    # 64 KiB gets
    python bench/wire_phases.py --threads --op append --tokens 256    # 1 MiB appends
    python bench/wire_phases.py --threads --op append --tokens 128 --pack-below 1048577    # 512 KiB, packed

``--frames`` measures what frames cost ZeroMQ's I/O threads, with no kvd code: a raw ROUTER answers each request
with the same 64 KiB in several shapes (a small header frame, then the bytes as one frame, two or four), and the
same CPU per thread is read, one request at a time and 8 in flight. What protocol 1.4's packed tensors rest on:

    python bench/wire_phases.py --frames
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import wire  # noqa: E402

from kvd.client import Client  # noqa: E402

PHASES = ("call -> encode", "encode + send", "transit c->s", "admission", "server run", "server send",
          "transit s->c", "client decode", "decode -> return", "total")


def server(conn: Any, level: str, n: int, capacity_bytes: int) -> None:
    """A ShardServer whose loop stamps receive, run start, run end and reply sent; sends the last n x 4 stamps."""
    from kvd.store import Store
    from kvd.wire.server import ShardServer, tune_malloc

    tune_malloc()
    store = Store(capacity_bytes, eviction="lru", window_tokens=0)
    if level != "fp16":
        store.set_level(level, 1)
    srv = ShardServer(store, shard_id="phases")
    stamps: list[float] = []
    admit, run, reply, send = srv._admit, srv._run, srv._reply, srv._send

    def admit_(sock: Any, msg: Any) -> None:
        stamps.append(time.perf_counter())
        admit(sock, msg)

    def run_(frames: Any, *rest: Any) -> Any:  # parse, then run here or hand to the bulk lane
        stamps.append(time.perf_counter())
        return run(frames, *rest)

    def reply_(req: Any) -> Any:  # execute and encode, on either lane
        out = reply(req)
        stamps.append(time.perf_counter())
        return out

    def send_(sock: Any, ident: bytes, frames: Any, *rest: Any) -> None:
        send(sock, ident, frames, *rest)
        stamps.append(time.perf_counter())

    srv._admit, srv._run, srv._reply, srv._send = admit_, run_, reply_, send_  # type: ignore[method-assign]
    conn.send(srv.start())
    while conn.recv() == "cpu":  # this process's CPU seconds so far (every thread: the loop and ZeroMQ's I/O)
        conn.send(time.process_time())
    conn.send(stamps[-4 * n:])
    srv.stop()


def shape_server(conn: Any) -> None:
    """kvd's reply shape with almost no server work: a ROUTER loop serving kvd's requests through a (never
    started) ShardServer's own parse and execute, except gets after the first, which are answered with the first
    get's encoded reply frames, only the header's request id re-packed."""
    import msgpack
    import zmq

    from kvd.store import Store
    from kvd.wire import protocol as p
    from kvd.wire.server import ShardServer, tune_malloc

    tune_malloc()
    shard = ShardServer(Store(wire.GET_CAPACITY_BYTES, eviction="lru"), shard_id="shape")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    header: dict[str, Any] | None = None
    body: list[bytes] = []
    while True:
        msg = sock.recv_multipart(copy=False)
        if header is not None:
            head = msgpack.unpackb(msg[1].buffer)
            if head.get("op") == "get":
                header["id"] = head["id"]
                sock.send_multipart([msg[0], msgpack.packb(header), *body], copy=False)
                continue
        req = p.parse_request([f.buffer for f in msg[1:]])
        frames = p.encode_reply(req if isinstance(req, p.ErrorReply) else shard._execute(req))
        if isinstance(req, p.GetRequest):
            header, body = msgpack.unpackb(frames[0]), [bytes(f) for f in frames[1:]]
        sock.send_multipart([msg[0], *frames], copy=False)


FRAME_SHAPES = {  # --frames: 64 KiB of reply as raw pyzmq sends it, after the ROUTER's identity
    "1 frame (raw get)": [b"ok", bytes(65536)],
    "header + 1 frame (packed)": [b"h" * 90, bytes(65536)],
    "header + 2 frames (keys, values)": [b"h" * 90, bytes(32768), bytes(32768)],
    "header + 4 frames": [b"h" * 90, *[bytes(16384)] * 4],
}


def frame_server(conn: Any, shape: str) -> None:
    """A raw ROUTER that answers every message with FRAME_SHAPES[shape] (copied into ZeroMQ, as kvd sends frames
    under 1 MiB)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    body = FRAME_SHAPES[shape]
    while True:
        msg = sock.recv_multipart(copy=False)
        sock.send_multipart([msg[0], *body])


Threads = dict[int, tuple[str, float]]  # tid -> (thread name, CPU seconds so far)


def _thread_cpu(pid: int) -> Threads:
    """CPU seconds (user + system) of every thread of ``pid`` so far: tid -> (name, seconds)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                st = fh.read()
        except FileNotFoundError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        out[int(tid)] = (st[st.index("(") + 1: st.rindex(")")], (int(fields[11]) + int(fields[12])) / tick)
    return out


def _split(before: Threads, after: Threads) -> tuple[float, float, float]:
    """(app, ZeroMQ I/O, other) CPU seconds between two :func:`_thread_cpu` looks. The app thread is the busiest
    thread that is not ZeroMQ's (the serving loop, or the client's calling thread)."""
    io, rest = 0.0, []
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        if name.startswith("ZMQbg/IO"):
            io += used
        else:
            rest.append(used)
    rest.sort()
    return (rest[-1] if rest else 0.0), io, sum(rest[:-1])


def _rounds(batches: dict[tuple[str, int], Any], pids: dict[str, int], seconds: float,
            rounds: int) -> dict[tuple[str, int], list[tuple[float, ...]]]:
    """Each batch (``(name, requests in it)`` -> a call) run for ``seconds / rounds`` per round, in alternating
    rounds: per round, wall time and the CPU of each thread of both processes per request, in us (wall, server
    app, server ZeroMQ I/O, server other, client app, client ZeroMQ I/O, client other); ``pids``: name -> the
    server's process."""
    per: dict[tuple[str, int], list[tuple[float, ...]]] = {key: [] for key in batches}
    me = os.getpid()
    for _ in range(rounds):
        for (name, n), batch in batches.items():
            for _ in range(50):
                batch()
            pid = pids[name]
            s0, c0, t0, done = _thread_cpu(pid), _thread_cpu(me), time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds / rounds:
                batch()
                done += n
            wall = time.perf_counter() - t0
            s_app, s_io, s_other = _split(s0, _thread_cpu(pid))
            c_app, c_io, c_other = _split(c0, _thread_cpu(me))
            per[name, n].append(tuple(x / done * 1e6 for x in (wall, s_app, s_io, s_other, c_app, c_io, c_other)))
    return per


def _table(title: str, first: str, per: dict[tuple[str, int], list[tuple[float, ...]]]) -> None:
    rounds = len(next(iter(per.values())))
    print(f"{title}, CPU per request by thread (us; medians of {rounds} rounds; the clock ticks at 10 ms, so "
          "small shares are approximate)")
    print(f"| {first} | in flight | wall | server app | server ZeroMQ I/O | server other | client app | "
          "client ZeroMQ I/O | client other | CPU total |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, n), rows in per.items():
        med = [statistics.median(r[j] for r in rows) for j in range(7)]
        print(f"| {name} | {n} | " + " | ".join(f"{x:.0f}" for x in med) + f" | {sum(med[1:]):.0f} |")


def frames_only(seconds: float, rounds: int = 3) -> int:
    import zmq

    servers = {shape: wire.start(frame_server, shape) for shape in FRAME_SHAPES}
    ctx = zmq.Context()
    batches: dict[tuple[str, int], Any] = {}
    for shape, (_, endpoint, _) in servers.items():
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        for n in (1, 8):
            def batch(sock: Any = sock, n: int = n) -> None:
                for _ in range(n):
                    sock.send(b"G")
                for _ in range(n):
                    sock.recv_multipart(copy=False)
            batches[shape, n] = batch
    try:
        per = _rounds(batches, {shape: proc.pid for shape, (proc, _, _) in servers.items()}, seconds, rounds)
    finally:
        for proc, _, _ in servers.values():
            proc.kill()
    _table("raw pyzmq: 64 KiB of reply in several shapes", "reply after the identity", per)
    return 0


def threads_only(op: str, tokens: int, seconds: float, rounds: int = 3, socket_buffer: int | None = None) -> int:
    from kvd.client import recycle_buffers

    recycle_buffers()  # as bench/wire.py's client process: pipelined MiB replies reuse warm buffers
    size = tokens * wire.TOKEN_BYTES
    servers = {"raw zmq": wire.start(wire.raw_server)}
    if op == "get":
        servers["kvd"] = wire.start(wire.kvd_server, "fp16", wire.GET_CAPACITY_BYTES)
        servers["kvd shape"] = wire.start(shape_server)
    else:  # appends into bench/wire.py's append server: a full store, LRU eviction recycling memory
        servers["kvd"] = wire.start(wire.kvd_server, "fp16", wire.APPEND_CAPACITY_BYTES)
    if socket_buffer is not None:  # the same server with other socket buffers (0: the system's autotuning)
        capacity = wire.GET_CAPACITY_BYTES if op == "get" else wire.APPEND_CAPACITY_BYTES
        servers["kvd buffers"] = wire.start(wire.kvd_server, "fp16", capacity, None, socket_buffer)
    batches: dict[tuple[str, int], Any] = {}
    try:
        for name, (_, endpoint, _) in [*servers.items(), ("kvd 1.3", servers["kvd"])]:
            if name == "raw zmq":
                raw = wire.Raw(endpoint)
                raw.batch(b"P", size, bytes(size), 1)()
                for n in (1, 8):
                    batches[name, n] = raw.batch(b"G", size, None, n) if op == "get" else \
                        raw.batch(b"P", size, os.urandom(size), n)
                continue
            client = Client(endpoint, timeout_s=60)
            client.register(wire.NS, num_layers=wire.LAYERS, num_kv_heads=wire.HEADS, head_dim=wire.DIM)
            if name == "kvd 1.3":  # as a client of protocol 1.3 (this client's one connection was greeted)
                for conn in client._conns.values():
                    conn.packs_tensors = False
            if op == "append":
                for n in (1, 8):
                    batches[name, n] = wire.kvd_batches(client, client, size, n)[0]
                continue
            for n in (1, 8):  # (kvd 1.3 shares the kvd row's server: the sequence is stored afresh, same size)
                batches[name, n] = wire.kvd_get_batch(client, size, n)
            if name == "kvd":  # no data and no store: what any request costs both processes
                batches["kvd ping", 1] = client.ping
        pids = {name: proc.pid for name, (proc, _, _) in servers.items()}
        pids["kvd ping"] = pids["kvd 1.3"] = pids["kvd"]
        per = _rounds(batches, pids, seconds, rounds)
    finally:
        for proc, _, _ in servers.values():
            proc.kill()
    _table(f"{op}s of {tokens} token(s) ({size >> 10} KiB)", "server", per)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("get", "append"), default="get")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per request (4 KiB of keys + values each)")
    ap.add_argument("--level", default="fp16", help="the store's level (pages are compacted to it first)")
    ap.add_argument("--format", choices=("fp16", "pages"), default="fp16", help="get's reply format")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--threads", action="store_true",
                    help="CPU per request of each thread of both processes: raw zmq vs kvd (and, for gets, kvd's "
                         "shape)")
    ap.add_argument("--frames", action="store_true",
                    help="CPU per thread of raw pyzmq replies of 64 KiB in 1, 2 and 4 frames (no kvd code)")
    ap.add_argument("--seconds", type=float, default=15.0,
                    help="with --threads or --frames: seconds per server and depth")
    ap.add_argument("--socket-buffer", type=int, default=None, metavar="BYTES",
                    help="with --threads: also a 'kvd buffers' row, the kvd server with socket_buffer_bytes=BYTES "
                         "(0: the system's autotuning; the loopback default is 256 KiB)")
    ap.add_argument("--pack-below", type=int, default=None, metavar="BYTES",
                    help="the client packs appends of keys and values together under this many bytes (default: "
                         "kvd.client.core.PACK_BELOW_BYTES): where packing stops paying")
    args = ap.parse_args()
    if args.pack_below is not None:
        from kvd.client import core

        core.PACK_BELOW_BYTES = args.pack_below
    if args.frames:
        return frames_only(args.seconds)
    if args.threads:
        return threads_only(args.op, args.tokens, args.seconds, socket_buffer=args.socket_buffer)
    n = args.requests
    # appends run against bench/wire.py's smaller store, so that the warm-up fills it and the measured ones are
    # the steady state (LRU eviction recycling memory), not a store still growing into fresh pages
    capacity = wire.APPEND_CAPACITY_BYTES if args.op == "append" else wire.GET_CAPACITY_BYTES
    proc, endpoint, pipe = wire.start(server, args.level, n, capacity)
    try:
        client = Client(endpoint, timeout_s=60)
        client.register(wire.NS, num_layers=wire.LAYERS, num_kv_heads=wire.HEADS, head_dim=wire.DIM)
        k, v = wire.kv(args.tokens)
        client.append(wire.NS, "read", k, v)
        time.sleep(1.0)  # the idle server compacts the read sequence to the level in force

        writes = itertools.count()

        def call() -> None:
            if args.op == "get":
                client.get(wire.NS, "read", format=args.format)
            else:  # over 32 sequences, so that LRU eviction keeps a long run of large appends within the store
                client.append(wire.NS, f"write{next(writes) % 32}", k, v)

        warmup = 500 if args.op == "get" else wire.APPEND_CAPACITY_BYTES // (args.tokens * wire.TOKEN_BYTES) + 500
        for _ in range(warmup):
            call()
        stamps: list[float] = []
        send, file_ = client._send, client._file

        def send_(conn: Any, req: Any, deadline: float) -> None:
            stamps.append(time.perf_counter())
            send(conn, req, deadline)
            stamps.append(time.perf_counter())

        def file__(conn: Any, msg: Any) -> None:
            stamps.append(time.perf_counter())
            file_(conn, msg)
            stamps.append(time.perf_counter())

        client._send, client._file = send_, file__  # type: ignore[method-assign]
        calls = []
        pipe.send("cpu")
        server_cpu0 = pipe.recv()
        client_cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            calls.append((t0, time.perf_counter()))
        client_cpu, wall = time.process_time() - client_cpu0, time.perf_counter() - wall0
        pipe.send("cpu")
        server_cpu = pipe.recv() - server_cpu0
        client.close()
        pipe.send("stop")
        server_stamps = pipe.recv()
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    rows = []
    for i, (t0, t1) in enumerate(calls):
        c_enc, c_sent, c_recv, c_dec = stamps[4 * i: 4 * i + 4]
        s_recv, s_run0, s_run1, s_sent = server_stamps[4 * i: 4 * i + 4]
        rows.append((c_enc - t0, c_sent - c_enc, s_recv - c_sent, s_run0 - s_recv, s_run1 - s_run0,
                     s_sent - s_run1, c_recv - s_sent, c_dec - c_recv, t1 - c_dec, t1 - t0))
    print(f"kvd {args.op} of {args.tokens} token(s) x 4 KiB, level {args.level}"
          + (f", format {args.format}" if args.op == "get" else "") + f", {n} requests one at a time (us)")
    print("| phase | p25 | median | p75 | p90 |")
    print("|---|---|---|---|---|")
    for j, name in enumerate(PHASES):
        xs = sorted(r[j] for r in rows)
        q = [xs[int(f * (len(xs) - 1))] * 1e6 for f in (0.25, 0.5, 0.75, 0.9)]
        print(f"| {name} | " + " | ".join(f"{x:.1f}" for x in q) + " |")
    total = statistics.median(r[-1] for r in rows) * 1e6
    print(f"\n(median of the total: {total:.1f} us; per request on average: "
          f"wall {wall / n * 1e6:.0f} us, client process CPU {client_cpu / n * 1e6:.0f} us, server process CPU "
          f"{server_cpu / n * 1e6:.0f} us, every thread of each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
