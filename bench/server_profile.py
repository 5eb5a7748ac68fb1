"""Where a shard's serving loop (or the client) spends each request, by function: Linux perf, DWARF call graphs.

A ShardServer (fp16, bench/wire.py's server) in another process answers a kvd client's gets or appends, one at a
time or N in flight. While they run, ``perf record --call-graph dwarf`` samples the server process; the table then
gives, for each of kvd's functions on the loop thread (and the ZeroMQ and memory calls under them), its inclusive
share of that thread's samples and what that share is in microseconds of CPU per request (the thread's CPU over
the window, from /proc, divided by the requests done). Functions run on the bulk lane (requests of 4 MiB and
more) are not on the loop thread; the ZeroMQ I/O threads' CPU is given as a total. ``--side client`` samples the
client instead (this process): the thread that makes the calls.

Needs ``perf`` and the right to use it on another process (root, or kernel.perf_event_paranoid <= 1). Compiled
modules show as their Cython functions; under KVD_PURE_PYTHON=1 the loop shows as the interpreter only.

    python bench/server_profile.py                            # 64 KiB gets, 8 in flight
    python bench/server_profile.py --op append --tokens 256    # 1 MiB appends into a full store
    python bench/server_profile.py --depth 1 --seconds 8
    python bench/server_profile.py --side client              # the client's calling thread instead (this process)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import wire  # noqa: E402
import wire_phases  # noqa: E402

from kvd.client import Client, recycle_buffers  # noqa: E402

# Cython names a module's function __pyx_pw_<len><part>...<len><Class>_<n>_<name>; libzmq, libc and kvd's C kernels
# keep their own names
_PYX = re.compile(r"__pyx_pw_(.+)$")
_NATIVE = ("zmq_msg_send", "zmq_msg_recv", "__memmove_avx512_unaligned_erms", "__memmove_avx_unaligned_erms",
           "kvd_page_encode", "kvd_page_decode", "XXH3_64bits_withSeed", "XXHL64_seed_avx512", "__poll")


def python_name(symbol: str) -> str | None:
    """``kvd.wire.server.loop.RouterServer._run`` for ``__pyx_pw_3kvd_4wire_6server_4loop_12RouterServer_31_run``
    (each dotted part is its length and itself, then "_"; last comes a counter and the function's name); None for
    a symbol that is not a Cython-compiled function."""
    m = _PYX.match(symbol)
    if m is None:
        return None
    rest, parts = m.group(1), []
    while True:
        d = re.match(r"(\d+)(.*)", rest)
        if d is None:
            return None
        n, tail = int(d.group(1)), d.group(2)
        if len(tail) > n + 1 and tail[n] == "_" and tail[n + 1].isdigit():
            parts.append(tail[:n])
            rest = tail[n + 1:]
        else:
            return ".".join([*parts, tail])


def _drive(client: Client, op: str, tokens: int, depth: int) -> Any:
    size = tokens * wire.TOKEN_BYTES
    client.register(wire.NS, num_layers=wire.LAYERS, num_kv_heads=wire.HEADS, head_dim=wire.DIM)
    if op == "get":  # (not kvd_batches: its appends fill the store until it evicts the sequence read)
        return wire.kvd_get_batch(client, size, depth)
    return wire.kvd_batches(client, client, size, depth)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("get", "append"), default="get")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request (4 KiB of keys + values each)")
    ap.add_argument("--depth", type=int, default=8, help="requests in flight")
    ap.add_argument("--seconds", type=float, default=6.0, help="length of the sampled window")
    ap.add_argument("--frequency", type=int, default=999, help="perf samples per second")
    ap.add_argument("--top", type=int, default=30, help="rows of the table")
    ap.add_argument("--side", choices=("server", "client"), default="server",
                    help="the shard's loop thread, or the client's calling thread (this process)")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        print("perf is not installed (Debian: linux-perf)", file=sys.stderr)
        return 2
    data = Path(tempfile.mkdtemp(prefix="kvd-profile-")) / "perf.data"  # DWARF stacks: tens of MB
    try:
        return _profile(args, data)
    finally:
        shutil.rmtree(data.parent, ignore_errors=True)


def _profile(args: argparse.Namespace, data: Path) -> int:
    recycle_buffers()
    capacity = wire.APPEND_CAPACITY_BYTES if args.op == "append" else wire.GET_CAPACITY_BYTES
    proc, endpoint, pipe = wire.start(wire.kvd_server, "fp16", capacity)
    try:
        client = Client(endpoint, timeout_s=60)
        batch = _drive(client, args.op, args.tokens, args.depth)
        for _ in range(200):
            batch()
        pid = proc.pid if args.side == "server" else os.getpid()
        before, done, t0 = wire_phases._thread_cpu(pid), 0, time.perf_counter()
        perf = subprocess.Popen(["perf", "record", "-q", "-F", str(args.frequency), "--call-graph", "dwarf,16384",
                                 "-p", str(pid), "-o", str(data), "--", "sleep", str(args.seconds)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stop = threading.Event()
        threading.Thread(target=lambda: (perf.wait(), stop.set()), daemon=True).start()
        while not stop.is_set():
            batch()
            done += args.depth
        wall = time.perf_counter() - t0
        after = wire_phases._thread_cpu(pid)
        if perf.returncode:
            print(f"perf record failed: {perf.stderr.read().decode() if perf.stderr else ''}", file=sys.stderr)
            return 2
    finally:
        proc.kill()
    used = {tid: cpu - before.get(tid, (name, 0.0))[1] for tid, (name, cpu) in after.items()}
    io = sum(u for tid, u in used.items() if after[tid][0].startswith("ZMQbg/IO"))
    # the serving loop: the shard's busiest thread that is not ZeroMQ's; the client's: this process's main thread
    tid = pid if args.side == "client" else \
        max((t for t in used if not after[t][0].startswith("ZMQbg/")), key=lambda t: used[t])
    per_request = used[tid] / done * 1e6
    # inclusive shares (--children) of that thread's own samples (--percentage relative)
    report = subprocess.run(["perf", "report", "-i", str(data), "--children", "--percentage", "relative", "--tid",
                             str(tid), "--sort", "sym", "-g", "none", "--stdio"],
                            capture_output=True, text=True, check=True).stdout
    rows: dict[str, float] = {}
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+[\d.]+%\s+\[[.k]\]\s+(\S+)", line)
        if m is None:
            continue
        share, symbol = float(m.group(1)), m.group(2)
        name = python_name(symbol) or (symbol if symbol in _NATIVE else None)
        if name is not None and name not in rows:  # (a function inlined into its wrapper is listed twice)
            rows[name] = share
    thread = "loop thread" if args.side == "server" else "calling thread"
    print(f"{args.op}s of {args.tokens} token(s) ({args.tokens * wire.TOKEN_BYTES >> 10} KiB), {args.depth} in "
          f"flight: {done} requests in {wall:.1f} s, {wall / done * 1e6:.0f} us each; {args.side} CPU per "
          f"request: {thread} {per_request:.0f} us, ZeroMQ I/O threads {io / done * 1e6:.0f} us")
    print(f"| function ({thread}, inclusive) | share of the thread | us per request |")
    print("|---|---|---|")
    for name, share in sorted(rows.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| {name} | {share:.1f}% | {share / 100 * per_request:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
