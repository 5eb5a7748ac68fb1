"""What the codec's fast path for small requests saves (kvd.wire.protocol, "the fast path"): the same kvd client
and ShardServer with its typed twin (kvd.wire._flatwire, as shipped), with its Python twin (the codec's pure
fallback), and with neither (the generic decoder only), in alternating rounds of one run,
server in another process over tcp://127.0.0.1.

    python bench/codec_paths.py                       # 1 and 16 tokens (4 and 64 KiB), 1 and 8 in flight
    python bench/codec_paths.py --tokens 16 --depth 1 --rounds 9
    python bench/codec_paths.py --cold 8              # each codec call in one process, warm and cold

Three servers run side by side, one per path, and the client reads the replies of each with the same path. Each
request: ``get`` (fp16) of a stored sequence of ``tokens``, or ``append`` of
``tokens`` (keys + values) to one of ``depth`` sequences, dropped every 100 appends. The layout is bench/wire.py's
(one layer of 8 KV heads x 128: 4 KiB of keys + values per token). Reported: medians over the rounds of the wall
time per request and of this client thread's CPU per request.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import wire  # noqa: E402

from kvd.client import Client, recycle_buffers  # noqa: E402
from kvd.wire import protocol as p  # noqa: E402

PATHS = ("typed", "python", "generic")


def _none(frames: Any, limits: Any) -> None:
    return None


def use(path: str) -> None:
    """Make ``path`` the fast path of this process's codec (each function looks it up on the module at every
    call): "typed" reads and writes the four messages with kvd.wire._flatwire; "python" reads them with the
    Python twin and writes them with the generic encoder; "generic": neither."""
    typed = p._load_typed()
    if typed is None:
        raise SystemExit("kvd.wire._flatwire is not built: pip install -e . builds it")
    p._fast_reply, p._fast_request = {"typed": (typed.fast_reply, typed.fast_request),
                                      "python": (p._fast_reply_py, p._fast_request_py),
                                      "generic": (_none, _none)}[path]
    p._TYPED = typed if path == "typed" else None  # encode_request / encode_reply: typed, else the generic


def server(conn: Any, path: str) -> None:
    """bench/wire.py's fp16 kvd server, reading requests with ``path``."""
    use(path)
    wire.kvd_server(conn, "fp16", wire.GET_CAPACITY_BYTES)


def workload(client: Client, op: str, tokens: int, depth: int) -> Any:
    k, v = wire.kv(tokens)
    count = [0]

    def get() -> None:
        if depth == 1:
            client.get(wire.NS, "read")
        else:
            for pending in [client.get_nowait(wire.NS, "read") for _ in range(depth)]:
                pending.result()

    def append() -> None:
        count[0] += 1
        if count[0] % 100 == 0:
            for j in range(depth):
                client.drop(wire.NS, f"append-{j}")
        if depth == 1:
            client.append(wire.NS, "append-0", k, v)
        else:
            for pending in [client.append_nowait(wire.NS, f"append-{j}", k, v) for j in range(depth)]:
                pending.result()

    return get if op == "get" else append


def cold(mib: int, tokens: int = 16, calls: int = 1500) -> int:
    """Each codec call of a ``tokens`` get and its reply, on each path, in this process: warm (back to back) and
    cold (after reading ``mib`` MiB, which evicts the caches as the other process's copies do in a round trip).
    Medians, us per call."""
    keys, values = wire.kv(tokens)
    shape = (wire.LAYERS, tokens, wire.HEADS, wire.DIM)
    keys, values = keys.reshape(shape), values.reshape(shape)
    reply = p.GetReply(request_id=7, start=0, end=tokens, layers=(0,), keys=keys, values=values)
    request = p.GetRequest(request_id=7, namespace=wire.NS, seq_id="read")
    reply_frames = [bytes(f) for f in p.encode_reply(reply)]
    request_frames = [bytes(f) for f in p.encode_request(request)]
    limits = p.DEFAULT_LIMITS
    calls_of = {
        "encode a get request": lambda: p.encode_request(request, limits),
        "parse a get request (server)": lambda: p.parse_request([memoryview(f) for f in request_frames], limits),
        "encode its reply (server)": lambda: p.encode_reply(reply, limits),
        "decode the reply (client)": lambda: p.decode_reply([memoryview(f) for f in reply_frames], limits),
    }
    junk = np.ones(mib << 20, np.uint8)
    print(f"codec calls for a get of {tokens} token(s) ({tokens * wire.TOKEN_BYTES >> 10} KiB), warm and after "
          f"reading {mib} MiB; medians of {calls} calls, us")
    print("| call | typed: warm | typed: cold | python: warm | python: cold | generic: warm | generic: cold |")
    print("|---|---|---|---|---|---|---|")
    for name, call in calls_of.items():
        row = []
        for path in PATHS:
            use(path)
            warm, chilled = [], []
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                call()
                warm.append(time.perf_counter_ns() - t0)
            for _ in range(calls):
                junk.sum()
                t0 = time.perf_counter_ns()
                call()
                chilled.append(time.perf_counter_ns() - t0)
            row += [statistics.median(warm[100:]) / 1e3, statistics.median(chilled[100:]) / 1e3]
        use(PATHS[0])
        print(f"| {name} | " + " | ".join(f"{x:.1f}" for x in row) + " |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16", help="tokens per request, comma-separated (4 KiB each)")
    ap.add_argument("--depth", default="1,8", help="requests in flight, comma-separated")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per case")
    ap.add_argument("--seconds", type=float, default=1.5, help="seconds per path per round")
    ap.add_argument("--cold", type=int, metavar="MIB", help="instead: each codec call warm and after reading MIB "
                    "MiB (no server)")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.tokens.split(",")]
        depths = [int(x) for x in args.depth.split(",")]
    except ValueError:
        ap.error("--tokens and --depth take comma-separated integers")
    if min(sizes) < 1 or min(depths) < 1 or args.rounds < 1 or not args.seconds > 0:
        ap.error("--tokens, --depth and --rounds must be >= 1, --seconds > 0")
    if args.cold is not None:
        if args.cold < 1:
            ap.error("--cold takes a size in MiB >= 1")
        for tokens in sizes:
            cold(args.cold, tokens)
        return 0
    recycle_buffers()  # as bench/wire.py's client process
    servers: dict[str, tuple[Any, Any, Client]] = {}
    try:
        for name in PATHS:
            proc, endpoint, conn = wire.start(server, name)
            client = Client(endpoint, timeout_s=60)
            servers[name] = (proc, conn, client)
            client.register(wire.NS, num_layers=wire.LAYERS, num_kv_heads=wire.HEADS, head_dim=wire.DIM)
        print(f"kvd client and ShardServer, the fast path's typed twin, its Python twin, and the generic decoder "
              f"only; medians of {args.rounds} alternating rounds of {args.seconds:g} s, us per request")
        print("| request | tokens | in flight | typed: wall | python: wall | generic: wall | typed / python | "
              "typed / generic | client CPU: typed / python / generic |")
        print("|---|---|---|---|---|---|---|---|---|")
        for tokens in sizes:
            k, v = wire.kv(tokens)
            for _, _, client in servers.values():
                client.drop(wire.NS, "read")
                client.append(wire.NS, "read", k, v)
            for op in ("get", "append"):
                for depth in depths:
                    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in PATHS}
                    for _ in range(args.rounds):
                        for name in PATHS:
                            client = servers[name][2]
                            use(name)
                            try:
                                fn = workload(client, op, tokens, depth)
                                for _ in range(50):
                                    fn()
                                t0, c0, n = time.perf_counter(), time.thread_time(), 0
                                while time.perf_counter() - t0 < args.seconds:
                                    fn()
                                    n += depth
                                runs[name].append(((time.perf_counter() - t0) / n * 1e6,
                                                   (time.thread_time() - c0) / n * 1e6))
                            finally:
                                use(PATHS[0])
                    wall = [statistics.median(r[0] for r in runs[name]) for name in PATHS]
                    cpu = [statistics.median(r[1] for r in runs[name]) for name in PATHS]
                    print(f"| {op} | {tokens} | {depth} | {wall[0]:.1f} | {wall[1]:.1f} | {wall[2]:.1f} | "
                          f"{wall[0] / wall[1]:.2f} | {wall[0] / wall[2]:.2f} | "
                          f"{cpu[0]:.1f} / {cpu[1]:.1f} / {cpu[2]:.1f} |", flush=True)
    finally:
        for proc, conn, client in servers.values():
            client.close()
            conn.send("stop")
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
