"""What a client's own bookkeeping costs as it writes to ever more sequences.

A client remembers, for the sequences it appended to most recently (``kvd.client.core.WRITTEN_ENTRIES``), the
shard incarnation each was written on, so that a restarted shard refuses to continue one in the middle. This
bench appends one token to a new sequence each time (as a connector storing one block per sequence does) and
reports the calling thread's CPU and the wall time per append, medians over windows of appends, by how many
sequences the client has written so far: below and past that bound the cost must be the same. The server is a
ShardServer in another process with an incarnation, as a cluster's shards have (bench/wire.py's, 256 MiB,
evicting; its own tables run it without one, so their clients remember nothing); the layout is small (1 layer,
1 KV head x 64), so that the client's bookkeeping is what grows, not the bytes.

    python bench/client_state.py                  # up to 140,000 sequences (about a minute)
    python bench/client_state.py --sequences 20000 --window 1000   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import wire  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.client import core as client_core  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=140_000, help="sequences written in all")
    ap.add_argument("--window", type=int, default=4000, help="appends per reported window")
    args = ap.parse_args()
    bound = client_core.WRITTEN_ENTRIES
    proc, endpoint, pipe = wire.start(wire.kvd_server, "fp16", wire.APPEND_CAPACITY_BYTES, "inc-1")
    rows = []
    try:
        client = Client(endpoint, timeout_s=60)
        client.register(wire.NS, num_layers=1, num_kv_heads=1, head_dim=64)
        k = np.ones((1, 1, 1, 64), np.float16)
        cpu: list[float] = []
        wall: list[float] = []
        for i in range(args.sequences):
            c0, t0 = time.thread_time(), time.perf_counter()
            client.append(wire.NS, i, k, k)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
            if len(cpu) == args.window:
                rows.append((i + 1, statistics.median(cpu) * 1e6, statistics.median(wall) * 1e6))
                cpu, wall = [], []
        evictions = client.stats()["evictions"]
        client.close()
    finally:
        pipe.send("stop")
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    print(f"one-token appends, each to a new sequence; the client remembers the last {bound} "
          f"(server evictions: {evictions}); medians per window of {args.window} appends, us")
    print("| sequences written | past the bound | client thread CPU | wall |")
    print("|---|---|---|---|")
    for n, c, w in rows:
        print(f"| {n} | {'yes' if n - args.window >= bound else 'no'} | {c:.1f} | {w:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
