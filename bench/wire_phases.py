"""Where one request's time goes: per-phase medians of kvd requests made one at a time, server in another process.

Both sides stamp time.perf_counter() (CLOCK_MONOTONIC, one clock for every process of the machine) at the
edges of each phase, by wrapping the client's and the server's own steps (a diagnostic: it hooks private
methods of kvd.client.Client and kvd.wire.server.ShardServer, so it moves with them):

    call -> encode      client API call until the request is encoded (routing, plan)
    encode + send       encode_request and the ZeroMQ send
    transit c->s        until the server's loop has the message (ZeroMQ I/O threads, TCP, wake-ups)
    admission           admission into the queue until the request runs
    server run          parse, store operation, reply encoding (for a request of 1 MiB or more: on the bulk lane)
    server send         the reply's ZeroMQ send (from the bulk lane: also the hand-back to the loop)
    transit s->c        until the client has the whole reply
    client decode       decode_reply (header, field checks, tensor views)
    decode -> return    the rest of the call (for format="pages": the page decode, assemble)

    python bench/wire_phases.py                         # 4 KiB get (1 token of 8 heads x 128, 1 layer)
    python bench/wire_phases.py --op append
    python bench/wire_phases.py --tokens 2048 --level q4 --format pages --requests 300
    KVD_PURE_PYTHON=1 python bench/wire_phases.py       # the same with every module from source
"""

from __future__ import annotations

import argparse
import itertools
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("get", "append"), default="get")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per request (4 KiB of keys + values each)")
    ap.add_argument("--level", default="fp16", help="the store's level (pages are compacted to it first)")
    ap.add_argument("--format", choices=("fp16", "pages"), default="fp16", help="get's reply format")
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
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
