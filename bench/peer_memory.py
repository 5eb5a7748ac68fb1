"""What hostile peers make a shard server hold (issue 18, item 5): the server's peak and remaining RSS.

    python bench/peer_memory.py                       # default limits: 1 and 4 peers sending 5 frames of 128 MiB,
                                                      # 16 peers not reading 64 replies of 2 MiB
    python bench/peer_memory.py --frames 10           # 10 frames of 128 MiB per oversize peer

The server is a ShardServer with default settings in another process on tcp://127.0.0.1; the peers are pyzmq
DEALERs in this one (an oversize peer sends one buffer many times, zero-copy, so this process stays small).
Each scenario reports the server's RSS rise at its peak (VmHWM, reset before) and once the peers are gone
(after 2 s), and whether the oversize peers were cut or answered.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack  # noqa: E402
import zmq  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.wire import protocol as p  # noqa: E402

MIB = 1 << 20
NS = "m"


def serve(conn: Any) -> None:
    from kvd.store import Store
    from kvd.wire.server import ShardServer

    server = ShardServer(Store(1 << 30), shard_id="peer-memory")
    conn.send(server.start())
    conn.recv()
    conn.send(server.metrics())
    conn.recv()
    server.stop()


def status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def oversize(ctx: zmq.Context[Any], endpoint: str, peers: int, frames: int) -> tuple[int, int]:
    payload = np.zeros(128 * MIB, np.uint8)
    header = msgpack.packb({"v": 1, "id": 9, "op": "ping"})
    socks, mons = [], []
    for _ in range(peers):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, -1)
        s.setsockopt(zmq.SNDHWM, 0)
        mons.append(s.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        s.connect(endpoint)
        socks.append(s)
    for s in socks:
        s.send_multipart([header, *([payload] * frames)], copy=False)
    cut = answered = 0
    for s, m in zip(socks, mons, strict=True):
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        poller.register(m, zmq.POLLIN)
        if not poller.poll(120_000):
            raise RuntimeError("an oversize peer was neither cut nor answered")
        if m.poll(0):
            cut += 1
        else:
            answered += 1
    for s in socks:
        s.close(0)
    for m in mons:
        m.close(0)
    return cut, answered


def slow(ctx: zmq.Context[Any], endpoint: str, peers: int, gets: int) -> list[Any]:
    req = p.encode_request(p.GetRequest(request_id=1, namespace=NS, seq_id="big"))
    socks = []
    for _ in range(peers):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 16 * 1024)
        s.connect(endpoint)
        socks.append(s)
    for s in socks:
        for _ in range(gets):
            s.send_multipart(req)
    return socks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=5, help="frames of 128 MiB per oversize message")
    ap.add_argument("--slow-peers", type=int, default=16, help="peers asking for 64 replies of 2 MiB, never read")
    args = ap.parse_args()
    mpc = mp.get_context("spawn")
    parent, child = mpc.Pipe()
    proc = mpc.Process(target=serve, args=(child,), daemon=True)
    proc.start()
    endpoint = parent.recv()
    pid = proc.pid
    assert pid is not None
    ctx = zmq.Context()
    with Client(endpoint, timeout_s=60) as c:
        c.register(NS, num_layers=2, num_kv_heads=2, head_dim=16)
        k = np.zeros((2, 8192, 2, 16), np.float16)  # 1 MiB of keys, as much of values: 2 MiB per get
        c.append(NS, "big", k, k)
        for _ in range(20):
            c.get(NS, "big")

    def measure(name: str, run: Any) -> None:
        base = status(pid, "VmRSS")
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        detail = run()
        peak = status(pid, "VmHWM") - base
        time.sleep(2.0)
        left = status(pid, "VmRSS") - base
        print(f"| {name} | {peak / MIB:.0f} | {left / MIB:.0f} | {detail} |", flush=True)

    print("| scenario | peak RSS rise, MiB | RSS rise 2 s after the peers left, MiB | outcome |")
    print("|---|---|---|---|")
    for peers in (1, 4):
        def run_oversize(peers: int = peers) -> str:
            cut, answered = oversize(ctx, endpoint, peers, args.frames)
            return f"{cut} cut, {answered} answered"
        measure(f"{peers} peer(s) x {args.frames} frames of 128 MiB", run_oversize)

    def run_slow() -> str:
        with Client(endpoint, timeout_s=60) as c:
            before = c.shard_stats()[0]["server_requests"] + 1
        socks = slow(ctx, endpoint, args.slow_peers, 64)
        with Client(endpoint, timeout_s=60) as c:
            while True:  # readiness: all the gets ran
                st = c.shard_stats()[0]
                if st["server_requests"] >= before + 64 * args.slow_peers and st["server_queue_depth"] == 0:
                    break
                time.sleep(0.05)
        for s in socks:
            s.close(0)
        return f"{args.slow_peers} slow readers"
    measure(f"{args.slow_peers} peers x 64 gets of 2 MiB, never read", run_slow)
    parent.send("metrics")
    print("server metrics:", parent.recv())
    parent.send("stop")
    proc.join(10)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
