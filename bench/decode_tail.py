"""Decode-step latency on one shard while other clients prefill, this checkout against another (an A/B of the
serving path, without Ray).

One ShardServer process (4 GiB store, fp16, LRU) from each source tree in turn; one client appends decode steps
(one token, all 32 layers of the 7B-class layout: 128 KiB) to 8 sequences in rotation, one at a time, while
``--clients`` other processes loop: append a 512-token chunk (64 MiB), read it back, drop it. Rounds of
``--seconds`` alternate between the trees, so both see the same machine; the table gives each round and the
median over rounds of each tree: decode-step p50 / p99 / p999 and the prefill chunks per second.

    python bench/decode_tail.py                                  # this checkout only
    git worktree add /tmp/kvd-before <commit>; cp kvd/codec/_kernels*.so /tmp/kvd-before/kvd/codec/
    KVD_PURE_PYTHON=1 python bench/decode_tail.py --other /tmp/kvd-before   # A/B, both trees from source
    python bench/decode_tail.py --prefill-nice 19   # prefill clients yield the CPU, as clients on other machines
    python bench/decode_tail.py --socket-buffer 0   # also with the system's autotuned socket buffers (a variant)
    python bench/decode_tail.py --decode-nice -10   # the decode client first for the CPU (as root)
    python bench/decode_tail.py --separate          # also: decode steps on a shard process of their own
    python bench/decode_tail.py --prefill-rate 4    # prefills at 4 chunks/s in all (not as fast as they can)

``--separate`` gives the decode client a second ShardServer process (its own store, loop and ZeroMQ I/O
threads) while the prefills go to the first: no queue, lock or I/O thread is shared any more, only the CPUs.
That is the floor any separation of decode steps from prefills inside one shard (a second socket, more
threads) could reach on this machine.

``--other`` trees run from source (``KVD_PURE_PYTHON=1`` makes this checkout do the same, for a fair A/B); they
need the kernel extension built or copied in, as above (the kernels are unchanged between the trees compared).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from decode_steps import Pace, decode_steps

HERE = str(Path(__file__).resolve().parents[1])
LAYERS, HEADS, DIM = 32, 8, 128  # the 7B-class layout
NS = "decode-tail"
DECODE_MAX_TOKENS = 200


def _use(src: str) -> None:
    sys.path.insert(0, src)
    for name in [m for m in sys.modules if m == "kvd" or m.startswith("kvd.")]:
        del sys.modules[name]


def _server(conn: Any, src: str, socket_buffer: int | None) -> None:
    """A ShardServer whose loop stamps, for every decode step (the only requests of 64 KiB to 1 MiB here), when
    it was received and when its run started and ended; sends the (wait, run) pairs at the end.
    (A diagnostic: it wraps private methods of kvd.wire.server, in both trees.)"""
    _use(src)
    from kvd.store import Store
    from kvd.wire.server import ShardServer

    options = {} if socket_buffer is None else {"socket_buffer_bytes": socket_buffer}  # older trees: the default
    server = ShardServer(Store(4 << 30, eviction="lru"), shard_id="decode-tail", **options)
    arrived: dict[int, float] = {}
    spans: list[tuple[float, float]] = []
    admit, run = server._admit, server._run

    def admit_(sock: Any, msg: Any) -> None:
        if len(msg) > 1:
            arrived[id(msg[1])] = time.perf_counter()
        admit(sock, msg)

    def run_(frames: Any, *rest: Any) -> Any:
        t0 = time.perf_counter()
        t_in = arrived.pop(id(frames[0]), t0)
        reply = run(frames, *rest)
        if reply is not None and (64 << 10) <= sum(len(f) for f in frames) < (1 << 20):  # a decode step
            spans.append((t0 - t_in, time.perf_counter() - t0))
        return reply

    server._admit, server._run = admit_, run_  # type: ignore[method-assign]
    conn.send(server.start())
    conn.recv()
    server.stop()
    conn.send(spans)


def _prefill(endpoint: str, src: str, index: int, tokens: int, nice: int, rate: float, clients: int, stop: Any,
             done: Any) -> None:
    """One prefill client: append a chunk, read it back, drop it; as fast as it can (``rate`` 0), else at its
    share of ``rate`` chunks per second of all ``clients`` (:class:`Pace`)."""
    _use(src)
    if nice:
        os.nice(nice)
    from kvd.client import Client

    shape = (LAYERS, tokens, HEADS, DIM)
    k = np.random.default_rng(index).standard_normal(shape, dtype=np.float32).astype(np.float16)
    with Client(endpoint, timeout_s=120.0) as client:
        i = 0
        pace = Pace(rate, clients, index, stop)
        while pace.wait():
            seq = f"prefill-{index}-{i}"
            i += 1
            client.append(NS, seq, k, k)
            client.get(NS, seq)
            client.drop(NS, seq)
            with done.get_lock():
                done.value += 1


def _decoder(endpoint: str, src: str, seconds: float, nice: int, conn: Any) -> None:
    """The decode client: steps appended one at a time for ``seconds``; sends back the latencies (ms)."""
    _use(src)
    if nice:
        os.nice(nice)  # before the client's ZeroMQ context: its I/O thread inherits the priority
    from kvd.client import Client

    step = np.random.default_rng(99).standard_normal((LAYERS, 1, HEADS, DIM), dtype=np.float32).astype(np.float16)
    with Client(endpoint, timeout_s=60.0) as client:
        conn.send("ready")
        conn.recv()
        lat = decode_steps(client, NS, step, {}, seconds, DECODE_MAX_TOKENS)
    conn.send(lat)


def _round(src: str, socket_buffer: int | None, separate: bool, args: argparse.Namespace) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    servers = []
    for _ in range(2 if separate else 1):  # [prefill shard, decode shard] or one for both
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_server, args=(there, src, socket_buffer), daemon=True)
        proc.start()
        servers.append((proc, here, here.recv()))
    endpoint, decode_endpoint = servers[0][2], servers[-1][2]
    _use(src)
    from kvd.client import Client

    stop, done = ctx.Event(), ctx.Value("l", 0)
    workers = [ctx.Process(target=_prefill, args=(endpoint, src, i, args.prefill, args.prefill_nice,
                                                   args.prefill_rate, args.clients, stop, done),
                           daemon=True) for i in range(args.clients)]
    mine, theirs = ctx.Pipe()
    decoder = ctx.Process(target=_decoder, args=(decode_endpoint, src, args.seconds, args.decode_nice, theirs),
                          daemon=True)
    try:
        for _, _, ep in servers:
            with Client(ep, timeout_s=60.0) as client:
                client.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        decoder.start()
        mine.recv()
        for w in workers:
            w.start()
        time.sleep(2.0)  # the prefill clients are under way
        before, t0 = done.value, time.perf_counter()
        mine.send("go")
        lat = mine.recv()
        chunks = (done.value - before) / (time.perf_counter() - t0)
        decoder.join(10)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
            if w.is_alive():
                w.kill()
        if decoder.is_alive():
            decoder.kill()
        for _, here, _ in servers:
            here.send("stop")
            spans = np.array(here.recv() or [(0.0, 0.0)]) * 1e3  # the decode steps are the last server's
        for proc, _, _ in servers:
            proc.join(10)
    a = np.array(lat) * 1e3
    served = spans[:, 0] + spans[:, 1]
    return {"n": float(len(a)), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "p999": float(np.percentile(a, 99.9)), "chunks": chunks,
            "wait99": float(np.percentile(spans[:, 0], 99)), "run99": float(np.percentile(spans[:, 1], 99)),
            "served99": float(np.percentile(served, 99))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--other", help="another source tree to compare with (a git worktree of an older commit)")
    ap.add_argument("--clients", type=int, default=4, help="prefill clients (default 4)")
    ap.add_argument("--prefill", type=int, default=512, help="tokens per prefill chunk (default 512: 64 MiB)")
    ap.add_argument("--prefill-nice", type=int, default=0, help="nice value added to the prefill clients")
    ap.add_argument("--prefill-rate", type=float, default=0.0, metavar="CHUNKS_PER_S",
                    help="prefill chunks per second, all clients together, on a fixed schedule (default 0: each "
                         "client as fast as it can, which keeps both CPUs busy)")
    ap.add_argument("--seconds", type=float, default=15.0, help="length of a round (default 15)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per variant (default 3)")
    ap.add_argument("--socket-buffer", type=int, default=None, metavar="BYTES",
                    help="also run this checkout with the shard's socket_buffer_bytes at BYTES (0: the system's "
                         "autotuned buffers), a variant beside its default (256 KiB on loopback)")
    ap.add_argument("--decode-nice", type=int, default=0,
                    help="nice value added to the decode client (negative: needs root or CAP_SYS_NICE)")
    ap.add_argument("--separate", action="store_true",
                    help="also run this checkout with the decode client on a shard process of its own (a variant)")
    args = ap.parse_args()
    if args.prefill_rate < 0:
        ap.error(f"--prefill-rate must be 0 (back to back) or more, got {args.prefill_rate:g}")
    trees: list[tuple[str, str, int | None, bool]] = [("this", HERE, None, False)]
    if args.other:
        trees.append(("other", str(Path(args.other).resolve()), None, False))
    if args.socket_buffer is not None:
        label = f"{args.socket_buffer >> 10} KiB" if args.socket_buffer else "autotuned"
        trees.append((f"this, buffers {label}", HERE, args.socket_buffer, False))
    if args.separate:
        trees.append(("this, decode on its own shard", HERE, None, True))
    pace = f"{args.prefill_rate:g} chunks/s in all" if args.prefill_rate else "as fast as they can"
    print(f"decode steps (128 KiB) on one shard while {args.clients} clients prefill {args.prefill}-token chunks "
          f"({args.prefill * LAYERS * HEADS * DIM * 4 >> 20} MiB) at nice +{args.prefill_nice}, {pace}, "
          f"decode client at nice {args.decode_nice:+d}; "
          f"{os.cpu_count()} CPUs; this = {HERE}" + (f", other = {trees[1][1]}" if args.other else ""))
    print("\nclient: each decode step's round trip; server: the shard's loop, for each decode step: time queued "
          "before it ran (wait), its run (parse, store, reply), and the two together (served)\n")
    print("| round | tree | decode appends | p50 ms | p99 ms | p999 ms | server wait p99 | server run p99 | "
          "server served p99 | prefill chunks/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows: dict[str, list[dict[str, float]]] = {name: [] for name, _, _, _ in trees}
    for rnd in range(args.rounds):
        for name, src, buffer, separate in trees:
            r = _round(src, buffer, separate, args)
            rows[name].append(r)
            print(_row(str(rnd), name, r), flush=True)
    for name, _, _, _ in trees:
        print(_row("median", name, {k: statistics.median(r[k] for r in rows[name]) for k in rows[name][0]}))


def _row(rnd: str, name: str, r: dict[str, float]) -> str:
    return (f"| {rnd} | {name} | {r['n']:.0f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['p999']:.2f} | "
            f"{r['wait99']:.2f} | {r['run99']:.2f} | {r['served99']:.2f} | {r['chunks']:.1f} |")


if __name__ == "__main__":
    main()
