"""The data path over tcp://127.0.0.1, server in another process: raw pyzmq vs kvd vs Redis (issue 4).

    python bench/wire.py            # full run (about a minute)
    python bench/wire.py --quick    # smoke run
    python bench/wire.py --frames   # only what the number of frames costs (raw pyzmq, same bytes)
    python bench/wire.py --packed   # pages of a 32-layer 7B-class sequence: packed (1.1) vs a frame per page (1.0)

For payloads of 4 KiB, 64 KiB, 1 MiB and 8 MiB, one request at a time and 8 in flight, median GB/s of payload:

* **raw zmq**: a minimal ROUTER server in another process that keeps each put's frame and sends it back on get
  (zero-copy both ways): the transport limit.
* **kvd**: a ShardServer around a Store (fp16 level) in another process; ``append`` of keys + values (the
  payload is both tensors together) to one of 32 sequences in rotation, and ``get`` (format fp16) of a
  stored sequence of exactly the payload's size.
* **redis**: redis-server (installed with apt-get if missing, run on a free loopback port with persistence
  off, stopped after) through redis-py: SET and GET of the same bytes; 8 in flight is a pipeline of 8.
* **pages q4**: ``get(format="pages")`` from a second kvd server whose store is at level q4, decoded on the
  client with kvd.pages.assemble, in fp16-equivalent GB/s (the bytes of the fp16 result), against raw get.

Every process (servers and this one, which runs all the clients) recycles large buffers
(kvd.wire.server.tune_malloc, what a ShardServer does by default): without it, fresh buffers cost a page
fault per 4 KiB.

The layout is one layer of a 7B-class model (8 KV heads x 128 dims, 4 KiB of keys + values per token), so every
payload is a whole number of tokens and pages have their real size (64 tokens: 128 KiB at fp16).
Targets (issue 4): kvd >= 0.8x raw at every size; kvd >= 2x Redis at 1 MiB; pages q4 >= 1.5x raw fp16-eq.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.wire.server import tune_malloc  # noqa: E402

SIZES = {"4 KiB": 4 << 10, "64 KiB": 64 << 10, "1 MiB": 1 << 20, "8 MiB": 8 << 20}
LAYERS, HEADS, DIM = 1, 8, 128
TOKEN_BYTES = 2 * LAYERS * HEADS * DIM * 2  # keys + values, fp16
NS = "bench"
INFLIGHT = 8
ROTATION = 32
APPEND_CAPACITY_BYTES = 256 << 20  # small enough that appends reach steady state (LRU eviction recycles memory)
GET_CAPACITY_BYTES = 1 << 30  # the get sequences live in their own server, where appends cannot evict them
WARMUP_S = 1.5
ROUNDS = 5
# --frames: the bytes of an 8 MiB (fp16-equivalent) get at q4 as pages (64 pages of 40,992 bytes), in n frames
FRAMES_TOTAL = 64 * 40992
FRAME_COUNTS = (1, 8, 64, 640)
# --packed: a 32-layer 7B-class sequence read whole as pages at q4
PACKED_LAYERS = 32
PACKED_TOKENS = (256, 1024)


# ------------------------------------------------------------------------------------------------ servers


def raw_server(conn: Any) -> None:
    """ROUTER: [b"P", key, data] keeps data (the frame itself); [b"G", key] sends it back."""
    tune_malloc()  # as the kvd servers do (ShardServer.start): the same allocator for every server
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.setsockopt(zmq.RCVHWM, 64)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    store: dict[bytes, Any] = {}
    frame_parts: dict[bytes, list[bytes]] = {}
    while True:
        msg = sock.recv_multipart(copy=False)
        ident, op, key = msg[0].bytes, msg[1].bytes, msg[2].bytes
        if op == b"P":
            store[key] = msg[3]
            sock.send_multipart([ident, b"ok"])
        elif op == b"G":
            sock.send_multipart([ident, b"ok", store[key]], copy=False)
        elif op == b"F":  # FRAMES_TOTAL bytes split into int(key) frames, sent as pyzmq sends them
            parts = frame_parts.setdefault(key, [bytes(FRAMES_TOTAL // int(key))] * int(key))
            sock.send_multipart([ident, b"ok", *parts], copy=len(parts[0]) >= 65536)
        else:
            break


def kvd_server(conn: Any, level: str, capacity_bytes: int) -> None:
    from kvd.store import Store
    from kvd.wire.server import ShardServer

    store = Store(capacity_bytes, eviction="lru")
    if level != "fp16":
        store.set_level(level, 1)
    server = ShardServer(store, shard_id=f"bench-{level}")
    conn.send(server.start())
    conn.recv()  # until told to stop
    server.stop()


def start(target: Callable[..., None], *args: Any) -> tuple[Any, str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    if not parent.poll(60):
        raise RuntimeError(f"{target.__name__} did not start")
    return proc, parent.recv(), parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis() -> tuple[Any, int] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        print("installing redis-server (apt-get) ...", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=False, capture_output=True)
        exe = shutil.which("redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "redis"], check=False)
    if exe is None:
        print("redis-server unavailable: Redis columns skipped")
        return None
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--protected-mode", "no", "--proto-max-bulk-len", "1gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    r = redis.Redis(port=port)
    for _ in range(500):  # readiness: the server answers PING
        try:
            if r.ping():
                return proc, port
        except redis.exceptions.ConnectionError:
            time.sleep(0.01)
    proc.kill()
    print("redis-server did not start: Redis columns skipped")
    return None


# ------------------------------------------------------------------------------------------------ timing


def measure(batches: dict[str, Callable[[], None]], n: int, budget_s: float) -> dict[str, float]:
    """Median seconds per request of each batch of ``n`` requests. The variants run in interleaved rounds, so
    a change in the machine's load (it is shared) hits all of them alike."""
    for batch in batches.values():
        batch()  # warm up
    times: dict[str, list[float]] = {name: [] for name in batches}
    slice_s = budget_s / ROUNDS
    for _ in range(ROUNDS):
        for name, batch in batches.items():
            t_end = time.perf_counter() + slice_s
            done = 0
            while done < 2 or (time.perf_counter() < t_end and done < 400):
                t0 = time.perf_counter()
                batch()
                times[name].append((time.perf_counter() - t0) / n)
                done += 1
    return {name: statistics.median(t) for name, t in times.items()}


class Raw:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)

    def batch(self, op: bytes, size: int, data: bytes | None, n: int) -> Callable[[], None]:
        key = str(size).encode()
        parts = [op, key] + ([data] if data is not None else [])

        def run() -> None:
            for _ in range(n):
                self.sock.send_multipart(parts, copy=False)
            for _ in range(n):
                self.sock.recv_multipart(copy=False)

        return run


def kv(tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((LAYERS, tokens, HEADS, DIM), dtype=np.float32).astype(np.float16)
    return k, (k * -0.5).astype(np.float16)


Batch = Callable[[], None]


def kvd_batches(client: Client, getter: Client, size: int, n: int) -> tuple[Batch, Batch]:
    tokens = size // TOKEN_BYTES
    k, v = kv(tokens)
    counter = iter(range(1 << 62))
    seq = f"g{size}"
    getter.drop(NS, seq)
    getter.append(NS, seq, k, v)

    # steady state: fill the store until it evicts (or for WARMUP_S), so appends recycle memory as a full cache
    # does instead of paying first-touch page faults on fresh memory
    t_end = time.perf_counter() + WARMUP_S
    while time.perf_counter() < t_end and not client.stats()["evictions"]:
        for _ in range(16):
            client.append(NS, f"a{size}-{next(counter) % ROTATION}", k, v)

    def append() -> None:
        if n == 1:
            client.append(NS, f"a{size}-{next(counter) % ROTATION}", k, v)
        else:
            ps = [client.append_nowait(NS, f"a{size}-{next(counter) % ROTATION}", k, v) for _ in range(n)]
            for x in ps:
                x.result()

    def get() -> None:
        if n == 1:
            getter.get(NS, seq)
        else:
            ps = [getter.get_nowait(NS, seq) for _ in range(n)]
            for x in ps:
                x.result()

    return append, get


def pages_batch(client: Client, size: int, n: int) -> Callable[[], None]:
    tokens = size // TOKEN_BYTES
    k, v = kv(tokens, seed=1)
    seq = f"p{size}"
    client.drop(NS, seq)
    client.append(NS, seq, k, v)
    keys, values = client.get(NS, seq, format="pages")
    fp16 = client.get(NS, seq)
    assert np.array_equal(keys, fp16[0]) and np.array_equal(values, fp16[1])

    def run() -> None:
        if n == 1:
            client.get(NS, seq, format="pages")
        else:
            ps = [client.get_nowait(NS, seq, format="pages") for _ in range(n)]
            for x in ps:
                x.result()

    return run


def redis_batches(port: int, size: int, n: int) -> tuple[Callable[[], None], Callable[[], None]]:
    import redis

    r = redis.Redis(port=port)
    data = os.urandom(size)
    key = f"k{size}"
    r.set(key, data)

    def put() -> None:
        if n == 1:
            r.set(key, data)
        else:
            pipe = r.pipeline(transaction=False)
            for _ in range(n):
                pipe.set(key, data)
            pipe.execute()

    def get() -> None:
        if n == 1:
            r.get(key)
        else:
            pipe = r.pipeline(transaction=False)
            for _ in range(n):
                pipe.get(key)
            pipe.execute()

    return put, get


# ------------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--no-redis", action="store_true", help="skip Redis")
    ap.add_argument("--frames", action="store_true",
                    help="only the cost of frames: raw pyzmq get of the same bytes in 1, 8, 64 and 640 frames")
    ap.add_argument("--packed", action="store_true",
                    help="only pages of a 32-layer sequence at q4: packed (protocol 1.1) vs one frame per page")
    args = ap.parse_args()
    tune_malloc()  # the clients (raw, kvd, redis) run in this process: one allocator setting for all
    if args.frames:
        return frames_only(0.4 if args.quick else 2.5)
    if args.packed:
        return packed_only(0.4 if args.quick else 2.5)
    budget = 0.4 if args.quick else 2.5
    raw_proc, raw_ep, raw_pipe = start(raw_server)
    servers = {name: start(kvd_server, level, capacity) for name, level, capacity in (
        ("append", "fp16", APPEND_CAPACITY_BYTES), ("get", "fp16", GET_CAPACITY_BYTES),
        ("q4", "q4", GET_CAPACITY_BYTES))}
    redis_info = None if args.no_redis else start_redis()
    rows: list[tuple[str, int, dict[str, float]]] = []
    try:
        raw = Raw(raw_ep)
        clients = {name: Client(endpoint, timeout_s=60) for name, (_, endpoint, _) in servers.items()}
        for c in clients.values():
            c.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        for label, size in SIZES.items():
            data = os.urandom(size)
            raw.batch(b"P", size, data, 1)()
            for n in (1, INFLIGHT):
                append, get = kvd_batches(clients["append"], clients["get"], size, n)
                batches = {"raw put": raw.batch(b"P", size, data, n), "raw get": raw.batch(b"G", size, None, n),
                           "kvd append": append, "kvd get": get,
                           "kvd pages q4": pages_batch(clients["q4"], size, n)}
                if redis_info is not None:
                    batches["redis set"], batches["redis get"] = redis_batches(redis_info[1], size, n)
                rows.append((label, n, measure(batches, n, budget)))
                print(f"  measured {label} x{n}", file=sys.stderr, flush=True)
        for c in clients.values():
            c.close()
    finally:
        for _, _, pipe in servers.values():
            pipe.send("stop")
        for proc in [raw_proc, *(proc for proc, _, _ in servers.values())]:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        if redis_info is not None:
            redis_info[0].terminate()
            redis_info[0].wait(5)
    report(rows, redis_info is not None)
    return 0


def frames_only(budget: float) -> int:
    """Raw pyzmq, one request at a time: the same FRAMES_TOTAL bytes as 1, 8, 64 and 640 frames. A pages reply
    has two frames per page, so this is what the frame count alone costs."""
    proc, endpoint, pipe = start(raw_server)
    try:
        raw = Raw(endpoint)
        batches = {}
        for n in FRAME_COUNTS:
            parts = [b"F", str(n).encode()]

            def run(parts: list[bytes] = parts) -> None:
                raw.sock.send_multipart(parts)
                raw.sock.recv_multipart(copy=False)

            batches[n] = run
        res = measure(batches, 1, budget)  # type: ignore[arg-type]
    finally:
        pipe.send("stop")
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    print(f"\nraw pyzmq get of {FRAMES_TOTAL} bytes in n frames, one at a time (median us per request)")
    print("| frames | bytes per frame | us | GB/s |")
    print("|---|---|---|---|")
    for n in FRAME_COUNTS:
        print(f"| {n} | {FRAMES_TOTAL // n} | {res[n] * 1e6:.0f} | {FRAMES_TOTAL / res[n] / 1e9:.2f} |")
    return 0


def packed_only(budget: float) -> int:
    """One request at a time, a q4 server: ``get(format="pages")`` of a whole 32-layer 7B-class sequence, as a
    1.1 client asks for it (packed) and as a 1.0 client does (two frames per entry: this client with packing
    switched off), with raw pyzmq's get of the fp16 bytes (keys + values in one frame) for scale."""
    proc, endpoint, pipe = start(kvd_server, "q4", 2 << 30)
    raw_proc, raw_ep, raw_pipe = start(raw_server)
    rows = []
    try:
        client = Client(endpoint, timeout_s=60)
        client.register("packed", num_layers=PACKED_LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        raw = Raw(raw_ep)
        (conn,) = client._conns.values()  # a diagnostic: the per-connection switch _on_wire reads
        assert conn.packs, "the server does not speak protocol 1.1"
        for tokens in PACKED_TOKENS:
            rng = np.random.default_rng(tokens)
            k = rng.standard_normal((PACKED_LAYERS, tokens, HEADS, DIM), dtype=np.float32).astype(np.float16)
            v = (k * -0.5).astype(np.float16)
            client.append("packed", tokens, k, v)
            fp16 = client.get("packed", tokens)
            key = f"fp16-{tokens}".encode()
            raw.sock.send_multipart([b"P", key, k.tobytes() + v.tobytes()])  # keys + values: one frame
            raw.sock.recv_multipart()

            def pages_get(packs: bool, tokens: int = tokens) -> None:
                conn.packs = packs
                client.get("packed", tokens, format="pages")

            def raw_get(key: bytes = key) -> None:
                raw.sock.send_multipart([b"G", key])
                raw.sock.recv_multipart(copy=False)

            for packs in (True, False):
                got = (pages_get(packs), client.get("packed", tokens, format="pages"))[1]
                assert np.array_equal(got[0], fp16[0]) and np.array_equal(got[1], fp16[1])
            res = measure({"packed": lambda: pages_get(True), "per page": lambda: pages_get(False),
                           "kvd fp16": lambda tokens=tokens: client.get("packed", tokens), "raw fp16": raw_get},
                          1, budget)
            entries = PACKED_LAYERS * -(-tokens // 64)
            rows.append((tokens, entries, k.nbytes * 2, res))
        client.close()
    finally:
        for pp, pr in ((pipe, proc), (raw_pipe, raw_proc)):
            pp.send("stop")
            pr.join(5)
            if pr.is_alive():
                pr.kill()
    print(f"\nget(format='pages') of a whole {PACKED_LAYERS}-layer sequence (8 KV heads x 128) at q4, one at a "
          "time (median ms; GB/s of fp16-equivalent)")
    cols = ("packed", "per page", "kvd fp16", "raw fp16")
    print("| tokens | entries | fp16 MiB | " + " | ".join(f"{c} ms" for c in cols) + " | "
          + " | ".join(f"{c} GB/s" for c in cols) + " | packed / per page | packed / kvd fp16 | packed / raw |")
    print("|---" * (3 + 2 * len(cols) + 3) + "|")
    for tokens, entries, nbytes, res in rows:
        gb = {name: nbytes / t / 1e9 for name, t in res.items()}
        ms = " | ".join(f"{res[c] * 1e3:.1f}" for c in cols)
        print(f"| {tokens} | {entries} | {nbytes >> 20} | {ms} | "
              + " | ".join(f"{gb[c]:.2f}" for c in cols) + f" | {gb['packed'] / gb['per page']:.2f}x "
              f"| {gb['packed'] / gb['kvd fp16']:.2f}x | {gb['packed'] / gb['raw fp16']:.2f}x |")
    return 0


def report(rows: list[tuple[str, int, dict[str, float]]], with_redis: bool) -> None:
    cols = ["raw put", "kvd append", "raw get", "kvd get", "kvd pages q4"] + (
        ["redis set", "redis get"] if with_redis else [])
    print("\nGB/s of payload (median), tcp://127.0.0.1, server in another process; pages q4 in fp16-equivalent "
          "GB/s")
    print("| payload | in flight | " + " | ".join(cols) + " | append/raw | get/raw | pages/raw get |"
          + (" kvd/redis set | kvd/redis get |" if with_redis else ""))
    print("|---" * (2 + len(cols) + 3 + (2 if with_redis else 0)) + "|")
    size_of = dict(SIZES)
    for label, n, res in rows:
        size = size_of[label]
        gbps = {c: size / res[c] / 1e9 for c in cols}
        line = f"| {label} | {n} | " + " | ".join(f"{gbps[c]:.2f}" for c in cols)
        line += f" | {gbps['kvd append'] / gbps['raw put']:.2f}x | {gbps['kvd get'] / gbps['raw get']:.2f}x"
        line += f" | {gbps['kvd pages q4'] / gbps['raw get']:.2f}x |"
        if with_redis:
            line += f" {gbps['kvd append'] / gbps['redis set']:.2f}x"
            line += f" | {gbps['kvd get'] / gbps['redis get']:.2f}x |"
        print(line)
    print("\nmedian latency per request (us)")
    print("| payload | in flight | " + " | ".join(cols) + " |")
    print("|---" * (2 + len(cols)) + "|")
    for label, n, res in rows:
        print(f"| {label} | {n} | " + " | ".join(f"{res[c] * 1e6:.0f}" for c in cols) + " |")


if __name__ == "__main__":
    sys.exit(main())
