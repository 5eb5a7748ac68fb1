"""The data path over tcp://127.0.0.1, server in another process: raw pyzmq vs kvd vs Redis, LMCache's server
and Mooncake Store (issues 4 and 19).

    python bench/wire.py            # full run (a few minutes; the first one also installs the peers)
    python bench/wire.py --quick    # smoke run
    python bench/wire.py --no-redis --no-lmcache --no-mooncake   # kvd and raw pyzmq only
    python bench/wire.py --frames   # only what the number of frames costs (raw pyzmq, same bytes)
    python bench/wire.py --codec    # only the sans-IO codec's calls for small gets and appends, tight loops
    python bench/wire.py --copy     # only what one frame costs sent copied vs zero-copy (raw pyzmq)
    python bench/wire.py --packed   # pages of a 32-layer 7B-class sequence: packed (1.1) vs a frame per page (1.0)
    python bench/wire.py --socket-buffer 0   # also kvd with the system's autotuned socket buffers, same run
    python bench/wire.py --fairness # a polite client's latency, alone and while another floods the shard
    python bench/wire.py --fairness --loop-variants 4,4-while4,4-slice4096  # a lengths flood, by the loop's rules

For payloads of 4 KiB, 64 KiB, 1 MiB and 8 MiB, one request at a time and 8 in flight, median GB/s of payload:

* **raw zmq**: a minimal ROUTER server in another process that keeps each put's frame and sends it back on get
  (zero-copy both ways): the transport limit.
* **kvd**: a ShardServer around a Store (fp16 level) in another process; ``append`` of keys + values (the
  payload is both tensors together) to one of 32 sequences in rotation, and ``get`` (format fp16) of a
  stored sequence of exactly the payload's size. The append server is filled until it evicts, so appends
  recycle memory as in a full cache; its ``max_level`` is fp16, so it evicts instead of compressing its pages
  to q4 (what a full kvd does by default, and work the peers do not do): the bench checks it stored fp16 only.
* **redis**: redis-server (installed with apt-get if missing, run on a free loopback port with persistence
  off, stopped after) through redis-py with hiredis (pip-installed into this venv if missing): SET and GET of
  the same bytes; 8 in flight is a pipeline of 8.
* **kvd ... buffers** (``--socket-buffer BYTES``): the same append and get servers with ``socket_buffer_bytes`` at
  BYTES (0: the system's autotuning). On loopback a shard's default is 256 KiB, which keeps decode steps from
  waiting behind a prefill's turn of an I/O thread (docs/design.md) and costs large transfers some throughput:
  these columns measure that price beside the peers.
* **pages q4**: ``get(format="pages")`` from a second kvd server whose store is at level q4, decoded on the
  client with kvd.pages.assemble, in fp16-equivalent GB/s (the bytes of the fp16 result), against raw get.
* **lmcache**: LMCache's standalone server (``lmcache_server HOST PORT cpu``, PyPI ``lmcache``; it installs and
  serves without CUDA) over its own TCP protocol, from a client in this process that speaks it as LMCache's
  remote connector does (a 186-byte header, then the bytes; get reads the reply into a buffer allocated once).
  Its put has no reply, so a put is timed up to the reply of a HEALTH request sent after it (the server handles
  a connection's requests in order); 8 in flight is 8 requests sent before the replies are read.
* **mooncake**: Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``, Debian ``libibverbs1``):
  ``mooncake_master`` and a ``mooncake_client`` storage node holding the pool (standalone-store mode, the
  deployment comparable to a kvd server), ``P2PHANDSHAKE`` metadata, TCP transport; the client is
  ``MooncakeDistributedStore`` in a worker process (it needs the peers' venv) that times each batch itself:
  ``upsert_from`` / ``get_into`` from and into registered buffers (its zero-copy calls); 8 in flight is one
  ``batch_upsert_from`` / ``batch_get_into`` of 8 keys.

LMCache and Mooncake need torch (the CPU build) and their own dependencies, so they live in a venv of their own,
``.venv-peers`` next to ``.venv`` (``$KVD_PEERS_VENV``), which the bench creates and fills on first use (pip,
plus ``apt-get install libibverbs1`` for Mooncake; a few minutes, once). A peer that cannot be installed or
started is reported and left out; the others still run. Every peer is started by the bench and stopped after.

Every process (servers and this one, which runs all the clients) recycles large buffers
(kvd.wire.server.tune_malloc, what a ShardServer does by default): without it, fresh buffers cost a page
fault per 4 KiB. This process opts in with kvd.client.recycle_buffers, keeping 1 GiB of freed heap: the 8
pipelined 32 MiB replies (256 MiB) would otherwise reach the servers' 256 MiB trim threshold when they are freed
and be mapped fresh again for the next batch (``--client-malloc server`` measures that, the setting of the
servers).

The layout is one layer of a 7B-class model (8 KV heads x 128 dims, 4 KiB of keys + values per token), so every
payload is a whole number of tokens and pages have their real size (64 tokens: 128 KiB at fp16).
Targets (issue 4): kvd >= 0.8x raw at every size; kvd >= 2x Redis at 1 MiB; pages q4 >= 1.5x raw fp16-eq.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
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

from kvd.client import Client, recycle_buffers  # noqa: E402
from kvd.wire.server import tune_malloc  # noqa: E402

SIZES = {"4 KiB": 4 << 10, "64 KiB": 64 << 10, "1 MiB": 1 << 20, "8 MiB": 8 << 20, "32 MiB": 32 << 20}
REPO = Path(__file__).resolve().parents[1]
PEERS_VENV = Path(os.environ.get("KVD_PEERS_VENV", str(REPO / ".venv-peers")))
PEERS_PACKAGES = ("torch==2.13.0", "lmcache", "mooncake-transfer-engine-non-cuda")  # torch: the CPU build on disk
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
# --socket-buffer: the columns of the kvd servers with other socket buffers
BUFFERS_APPEND, BUFFERS_GET = "kvd append buffers", "kvd get buffers"


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


def kvd_server(conn: Any, level: str, capacity_bytes: int, incarnation: str | None = None,
               socket_buffer: int | None = None) -> None:
    """A ShardServer storing at ``level``; ``incarnation``: as a cluster's shards have one (clients then remember
    it per sequence they append to); ``socket_buffer``: its ``socket_buffer_bytes`` (None: the default)."""
    from kvd.store import Store
    from kvd.wire.server import ShardServer

    # max_level: a full store evicts instead of running ahead to a more compact level (kvd.store.compact), so
    # the "fp16" append server stores raw pages in its steady state, as the peers store raw bytes
    store = Store(capacity_bytes, eviction="lru", max_level=level)
    if level != "fp16":
        store.set_level(level, 1)
    options = {} if socket_buffer is None else {"socket_buffer_bytes": socket_buffer}
    server = ShardServer(store, shard_id=f"bench-{level}", incarnation=incarnation, **options)
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
        import hiredis  # noqa: F401  (redis-py parses replies with it when it is installed)
        import redis  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "redis", "hiredis"], check=False)
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


def measure(batches: dict[str, Callable[[], Any]], n: int, budget_s: float) -> dict[str, float]:
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
                own = batch()  # a batch run in another process returns its own time
                times[name].append((own if own is not None else time.perf_counter() - t0) / n)
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


Batch = Callable[[], Any]  # None, or its own time in seconds (a batch run in another process)


def kvd_get_batch(getter: Client, size: int, n: int) -> Batch:
    """Gets (fp16) of a sequence of exactly ``size`` bytes of keys and values, stored afresh first; n in flight."""
    tokens = size // TOKEN_BYTES
    seq = f"g{size}"
    getter.drop(NS, seq)
    getter.append(NS, seq, *kv(tokens))
    if getter.length(NS, seq) != tokens:  # every batch reads the payload it is labelled with
        raise RuntimeError(f"the sequence {seq} holds {getter.length(NS, seq)} tokens, not {tokens}")

    def get() -> None:
        if n == 1:
            getter.get(NS, seq)
        else:
            ps = [getter.get_nowait(NS, seq) for _ in range(n)]
            for x in ps:
                x.result()

    return get


def kvd_batches(client: Client, getter: Client, size: int, n: int) -> tuple[Batch, Batch]:
    """Appends through ``client`` into a store filled until it evicts, and :func:`kvd_get_batch` through
    ``getter`` (another server: the appends would evict the sequence it reads)."""
    get = kvd_get_batch(getter, size, n)
    k, v = kv(size // TOKEN_BYTES)
    counter = iter(range(1 << 62))

    # steady state: fill the store until it evicts (or for WARMUP_S), so appends recycle memory as a full cache
    # does instead of paying first-touch page faults on fresh memory
    t_end = time.perf_counter() + WARMUP_S
    while time.perf_counter() < t_end and not client.stats()["evictions"]:
        for _ in range(16):
            client.append(NS, f"a{size}-{next(counter) % ROTATION}", k, v)
    stats = client.stats()
    if (stats["level"], stats["pages_by_level"].keys() - {"fp16"}) != ("fp16", set()):  # no other work measured
        raise RuntimeError(f"the append server is not storing fp16 pages: level {stats['level']}, pages "
                           f"{stats['pages_by_level']}")

    def append() -> None:
        if n == 1:
            client.append(NS, f"a{size}-{next(counter) % ROTATION}", k, v)
        else:
            ps = [client.append_nowait(NS, f"a{size}-{next(counter) % ROTATION}", k, v) for _ in range(n)]
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


# ------------------------------------------------------------------------------------------------ peers


def peers_python() -> Path | None:
    """The python of the peers' venv, created and filled if needed (None, with the reason printed, if not)."""
    py = PEERS_VENV / "bin" / "python"
    check = "import lmcache.v1.server.__main__, mooncake.store"
    if py.exists() and subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0:
        return py
    print(f"installing LMCache and Mooncake Store into {PEERS_VENV} (once; a few minutes) ...", file=sys.stderr,
          flush=True)
    if not py.exists():
        base = getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable
        subprocess.run([base, "-m", "venv", str(PEERS_VENV)], check=False)
    if not Path("/usr/lib/x86_64-linux-gnu/libibverbs.so.1").exists():
        subprocess.run(["apt-get", "install", "-y", "-qq", "libibverbs1"], check=False, capture_output=True)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", *PEERS_PACKAGES], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"could not install the peers ({r.stderr.strip()[-400:]}): LMCache and Mooncake skipped")
        return None
    r = subprocess.run([str(py), "-c", check], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"the peers do not import ({r.stderr.strip()[-400:]}): LMCache and Mooncake skipped")
        return None
    return py


def wait_port(port: int, proc: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class LMCache:
    """LMCache's standalone server (its own process, from the peers' venv) and a client of its protocol
    (lmcache.v1.protocol: ClientMetaMessage "9 int32 + 150-byte key", ServerMetaMessage "9 int32")."""

    KEY_BYTES = 150
    PUT, GET, HEALTH = 1, 2, 5  # ClientCommand
    BINARY_FMT, UINT8 = 4, 6  # a bytes object: MemoryFormat.BINARY and dtype uint8, shape [n, 0, 0, 0]

    def __init__(self, py: Path) -> None:
        import struct

        self.struct = struct
        self.port = free_port()
        exe = py.with_name("lmcache_server")
        self.proc = subprocess.Popen([str(exe), "127.0.0.1", str(self.port), "cpu"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        if not wait_port(self.port, self.proc, 120):
            self.stop()
            raise RuntimeError("lmcache_server did not start")
        self.bufs: dict[int, bytearray] = {}
        self.fmt = self.BINARY_FMT  # MemoryFormat.BINARY (4): raw bytes of shape [n, 0, 0, 0]
        try:
            self.sock = socket.create_connection(("127.0.0.1", self.port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._put(self.key(64), b"x" * 64)
            if not self._get(self.key(64), 64):
                raise RuntimeError("lmcache_server did not return what was put")
        except BaseException:
            self.stop()  # the server process must not outlive a failed start
            raise

    def _header(self, cmd: int, key: bytes, length: int) -> bytes:
        shape = (length, 0, 0, 0)
        return self.struct.pack(f"iiiiiiiii{self.KEY_BYTES}s", cmd, length, self.fmt, self.UINT8, 0, *shape,
                                key.ljust(self.KEY_BYTES))

    @staticmethod
    def key(size: int) -> bytes:
        return f"bench@1@0@{size:x}@half".encode()

    def _put(self, key: bytes, data: bytes) -> None:
        self.sock.sendall(self._header(self.PUT, key, len(data)))
        self.sock.sendall(data)

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("lmcache_server closed the connection")
            got += k

    def _reply(self) -> int:
        head = bytearray(36)
        self._recv_into(memoryview(head))
        code, length = self.struct.unpack_from("ii", head)
        return length if code == 200 else -1

    def _health(self) -> None:
        self.sock.sendall(self._header(self.HEALTH, b"bench@1@0@0@half", 0))
        self._reply()

    def _get(self, key: bytes, size: int) -> bool:
        self.sock.sendall(self._header(self.GET, key, 0))
        length = self._reply()
        if length < 0:
            return False
        buf = self.bufs.setdefault(size, bytearray(max(size, length)))
        self._recv_into(memoryview(buf)[:length])
        return True

    def batches(self, size: int, n: int) -> tuple[Batch, Batch]:
        data = os.urandom(size)
        key = self.key(size)
        self._put(key, data)
        self._health()
        get_head = self._header(self.GET, key, 0)

        def put() -> None:
            for _ in range(n):
                self._put(key, data)
            self._health()  # the puts are stored once this is answered

        def get() -> None:
            self.sock.sendall(get_head * n)
            buf = memoryview(self.bufs.setdefault(size, bytearray(size)))
            for _ in range(n):
                length = self._reply()
                assert length == size, length
                self._recv_into(buf[:length])

        return put, get

    def stop(self) -> None:
        if hasattr(self, "sock"):
            self.sock.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


MOONCAKE_WORKER = r"""
import ctypes, json, sys, time
import numpy as np
from mooncake.store import MooncakeDistributedStore
cfg = json.loads(sys.argv[1])
store = MooncakeDistributedStore()
rc = store.setup(cfg["host"], "P2PHANDSHAKE", 0, cfg["buffer"], "tcp", "", cfg["master"])
print(json.dumps({"setup": rc}), flush=True)
bufs = {}
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "prepare":
        size, n = cmd["size"], cmd["n"]
        if (size, n) not in bufs:
            src = np.frombuffer(np.random.default_rng(size).bytes(size), np.uint8).copy()
            dst = np.empty(size * n, np.uint8)
            for a in (src, dst):
                store.register_buffer(a.ctypes.data, a.nbytes)
            keys = [f"k{size}-{i}" for i in range(n)]
            bufs[(size, n)] = (src, dst, keys)
            for k in keys:
                store.upsert_from(k, src.ctypes.data, size)
        print(json.dumps({"ok": True}), flush=True)
    elif cmd["op"] == "run":
        size, n, what = cmd["size"], cmd["n"], cmd["what"]
        src, dst, keys = bufs[(size, n)]
        t0 = time.perf_counter()
        if what == "put":
            if n == 1:
                rc = store.upsert_from(keys[0], src.ctypes.data, size)
            else:
                rc = min(store.batch_upsert_from(keys, [src.ctypes.data] * n, [size] * n) or [0])
        else:
            if n == 1:
                rc = store.get_into(keys[0], dst.ctypes.data, size)
                rc = 0 if rc == size else rc
            else:
                got = store.batch_get_into(keys, [dst.ctypes.data + i * size for i in range(n)], [size] * n)
                rc = 0 if all(g == size for g in got) else min(got)
        dt = time.perf_counter() - t0
        print(json.dumps({"t": dt, "rc": rc}), flush=True)
    elif cmd["op"] == "stop":
        break
"""


class Mooncake:
    """mooncake_master + a mooncake_client storage node on 127.0.0.1, and a MooncakeDistributedStore client in
    a worker process of the peers' venv (bench/engines.py starts Mooncake the same way)."""

    def __init__(self, py: Path, pool: str = "4 GB") -> None:
        import json
        import tempfile

        self.json = json
        bindir = py.parent
        self.dir = Path(tempfile.mkdtemp(prefix="kvd-bench-mooncake-"))
        self.log = open(self.dir / "mooncake.log", "w")  # noqa: SIM115 - closed in stop()
        port = free_port()
        master = [str(bindir / "mooncake_master"), "-rpc_address", "127.0.0.1", "-rpc_port", str(port),
                  "-metrics_port", str(free_port())]
        self.procs: list[subprocess.Popen[Any]] = [subprocess.Popen(master, stdout=self.log, stderr=self.log)]
        if not wait_port(port, self.procs[0], 60):
            self.stop()
            raise RuntimeError(f"mooncake_master did not start (log: {self.dir / 'mooncake.log'})")
        try:
            node_port = free_port()
            node = [str(bindir / "mooncake_client"), "-host", "127.0.0.1", "-port", str(node_port),
                    "-master_server_address", f"127.0.0.1:{port}", "-metadata_server", "P2PHANDSHAKE",
                    "-protocol", "tcp", "-global_segment_size", pool]
            self.procs.append(subprocess.Popen(node, stdout=self.log, stderr=self.log))
            time.sleep(3.0)  # the storage node mounts its segment with the master (no readiness signal)
            cfg = {"host": "127.0.0.1", "master": f"127.0.0.1:{port}", "buffer": 1 << 30}
            self.worker = subprocess.Popen([str(py), "-c", MOONCAKE_WORKER, json.dumps(cfg)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                           text=True, bufsize=1)
            self.procs.append(self.worker)
            reply = self._read()
            if reply.get("setup") != 0:
                raise RuntimeError(f"MooncakeDistributedStore.setup returned {reply} (log: {self.dir})")
        except BaseException:
            self.stop()  # no process of a failed start may outlive it
            raise

    def _read(self) -> dict[str, Any]:
        assert self.worker.stdout is not None
        line = self.worker.stdout.readline()
        if not line:
            raise RuntimeError(f"the Mooncake worker ended (log: {self.dir / 'mooncake.log'})")
        return dict(self.json.loads(line))

    def _ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.worker.stdin is not None
        self.worker.stdin.write(self.json.dumps(cmd) + "\n")
        self.worker.stdin.flush()
        return self._read()

    def batches(self, size: int, n: int) -> tuple[Batch, Batch]:
        self._ask(op="prepare", size=size, n=n)

        def run(what: str) -> float:
            reply = self._ask(op="run", size=size, n=n, what=what)
            if reply["rc"] != 0:
                raise RuntimeError(f"Mooncake {what} of {size} bytes x{n} failed: {reply['rc']}")
            return float(reply["t"])

        return (lambda: run("put")), (lambda: run("get"))

    def stop(self) -> None:
        if getattr(self, "worker", None) is not None and self.worker.poll() is None:
            with contextlib.suppress(Exception):
                self._ask(op="stop")
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.log.close()


# ------------------------------------------------------------------------------------------------ main


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # so that every finally runs: the peers started are stopped


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a timeout or a closed terminal must not leave peers running
        signal.signal(sig, _exit_on_signal)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short smoke run")
    ap.add_argument("--no-redis", action="store_true", help="skip Redis")
    ap.add_argument("--no-lmcache", action="store_true", help="skip LMCache's server")
    ap.add_argument("--no-mooncake", action="store_true", help="skip Mooncake Store")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"payloads to measure, of {', '.join(SIZES)}")
    ap.add_argument("--frames", action="store_true",
                    help="only the cost of frames: raw pyzmq get of the same bytes in 1, 8, 64 and 640 frames")
    ap.add_argument("--packed", action="store_true",
                    help="only pages of a 32-layer sequence at q4: packed (protocol 1.1) vs one frame per page")
    ap.add_argument("--codec", action="store_true", help="only the sans-IO codec's calls, in tight loops")
    ap.add_argument("--fairness", action="store_true",
                    help="only a polite client's latency, alone and while another client floods the shard")
    ap.add_argument("--loop-variants", metavar="V,V",
                    help="with --fairness: only the lengths flood, against servers reading N messages a turn "
                         "(N), and with rules added: newcomers at the back of the rotation (-rotation), lookups "
                         "in slices of K ids (-sliceK; 4096: whole), K reads a turn while a lookup runs in slices "
                         "(-whileK); alternating (e.g. 4,4-while4,4-slice4096,256-slice4096)")
    ap.add_argument("--copy", action="store_true",
                    help="only what sending one frame costs copied vs zero-copy (raw pyzmq, 64 KiB to 8 MiB)")
    ap.add_argument("--socket-buffer", type=int, metavar="BYTES",
                    help="also measure kvd with its shards' socket_buffer_bytes at BYTES (0: the system's "
                         "autotuning; the loopback default is 256 KiB, chosen for decode steps' tail), same run")
    ap.add_argument("--client-malloc", choices=("recycle", "server"), default="recycle",
                    help="this process's malloc: kvd.client.recycle_buffers (1 GiB kept, the default) or the "
                         "servers' tune_malloc (256 MiB)")
    args = ap.parse_args()
    # the clients (raw, kvd, redis) run in this process: one allocator setting for all
    if args.client_malloc == "recycle":
        recycle_buffers(1 << 30)
    else:
        tune_malloc()
    if args.codec:
        return codec_only(3 if args.quick else 7)
    if args.copy:
        return copy_only(3 if args.quick else 7, 100 if args.quick else 300)
    if args.frames:
        return frames_only(0.4 if args.quick else 2.5)
    if args.packed:
        return packed_only(0.4 if args.quick else 2.5)
    if args.fairness:
        from fairness import fairness_only, loop_variants  # bench/fairness.py

        if args.loop_variants:
            return loop_variants(args.loop_variants.split(","), 3.0 if args.quick else 4.0, 1 if args.quick else 3)
        return fairness_only(3.0 if args.quick else 10.0, 1 if args.quick else 3)
    budget = 0.4 if args.quick else 2.5
    raw_proc, raw_ep, raw_pipe = start(raw_server)
    servers = {name: start(kvd_server, level, capacity) for name, level, capacity in (
        ("append", "fp16", APPEND_CAPACITY_BYTES), ("get", "fp16", GET_CAPACITY_BYTES),
        ("q4", "q4", GET_CAPACITY_BYTES))}
    if args.socket_buffer is not None:  # the same append and get servers with other socket buffers
        for name, capacity in (("append", APPEND_CAPACITY_BYTES), ("get", GET_CAPACITY_BYTES)):
            servers[f"{name} buffers"] = start(kvd_server, "fp16", capacity, None, args.socket_buffer)
    redis_info = None if args.no_redis else start_redis()
    peers: dict[str, Any] = {}
    if not (args.no_lmcache and args.no_mooncake):
        py = peers_python()
        for name, skip, cls in (("lmcache", args.no_lmcache, LMCache), ("mooncake", args.no_mooncake, Mooncake)):
            if py is None or skip:
                continue
            try:
                peers[name] = cls(py)
            except Exception as exc:  # noqa: BLE001 - a peer that does not start is reported and left out
                print(f"{name} could not be started ({exc}): its columns are skipped")
    labels = [x.strip() for x in args.sizes.split(",") if x.strip()]
    unknown = [label for label in labels if label not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {', '.join(map(repr, unknown))}; use a comma-separated list of "
                 f"{', '.join(map(repr, SIZES))}")
    sizes = {label: SIZES[label] for label in labels}
    rows: list[tuple[str, int, dict[str, float]]] = []
    try:
        raw = Raw(raw_ep)
        clients = {name: Client(endpoint, timeout_s=60) for name, (_, endpoint, _) in servers.items()}
        for c in clients.values():
            c.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        for label, size in sizes.items():
            data = os.urandom(size)
            raw.batch(b"P", size, data, 1)()
            for n in (1, INFLIGHT):
                append, get = kvd_batches(clients["append"], clients["get"], size, n)
                batches = {"raw put": raw.batch(b"P", size, data, n), "raw get": raw.batch(b"G", size, None, n),
                           "kvd append": append, "kvd get": get,
                           "kvd pages q4": pages_batch(clients["q4"], size, n)}
                if args.socket_buffer is not None:
                    batches[BUFFERS_APPEND], batches[BUFFERS_GET] = kvd_batches(
                        clients["append buffers"], clients["get buffers"], size, n)
                if redis_info is not None:
                    batches["redis put"], batches["redis get"] = redis_batches(redis_info[1], size, n)
                for name, peer in peers.items():
                    batches[f"{name} put"], batches[f"{name} get"] = peer.batches(size, n)
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
        for peer in peers.values():
            peer.stop()
    names = (["redis"] if redis_info is not None else []) + list(peers)
    if args.socket_buffer is not None:
        print(f"\n'kvd append/get buffers': the same servers with socket_buffer_bytes={args.socket_buffer} "
              f"({'autotuned' if args.socket_buffer == 0 else f'{args.socket_buffer >> 10} KiB'})")
    report(rows, names)
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


def codec_only(rounds: int = 7, calls: int = 2000) -> int:
    """The sans-IO codec alone, in tight loops (no sockets): what building, encoding and decoding the small
    messages of a 16-token get and append cost (the client's calls and the server's), median us per call."""
    from kvd.wire import protocol as p

    k, v = kv(16)
    greq = p.GetRequest(request_id=5, namespace=NS, seq_id="read")
    areq = p.AppendRequest(request_id=6, namespace=NS, seq_id="write3", keys=k, values=v, incarnation="0123abcd")
    gframes = [bytes(f) for f in p.encode_request(greq)]
    aframes = [bytes(f) for f in p.encode_request(areq)]
    grep = p.GetReply(request_id=5, start=0, end=16, layers=(0,), keys=k, values=v)
    grep_frames = [bytes(f) for f in p.encode_reply(grep)]
    arep_frames = [bytes(f) for f in p.encode_reply(p.AppendReply(request_id=6, length=32))]
    cases: dict[str, Callable[[], Any]] = {
        "GetRequest(...)": lambda: p.GetRequest(request_id=5, namespace=NS, seq_id="read"),
        "AppendRequest(...)": lambda: p.AppendRequest(request_id=6, namespace=NS, seq_id="w", keys=k, values=v),
        "encode_request(get)": lambda: p.encode_request(greq, p.DEFAULT_LIMITS),
        "encode_request(append)": lambda: p.encode_request(areq, p.DEFAULT_LIMITS),
        "parse_request(get) (server)": lambda: p.parse_request(gframes),
        "parse_request(append) (server)": lambda: p.parse_request(aframes),
        "encode_reply(get) (server)": lambda: p.encode_reply(grep, p.DEFAULT_LIMITS),
        "decode_reply(get)": lambda: p.decode_reply(grep_frames),
        "decode_reply(append)": lambda: p.decode_reply(arep_frames),
    }
    print("\nthe codec alone, 16 tokens of 8 x 128 fp16 (median us per call)")
    print("| call | us |")
    print("|---|---|")
    for name, fn in cases.items():
        runs = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            runs.append((time.perf_counter() - t0) / calls * 1e6)
        print(f"| {name} | {statistics.median(runs):.2f} |")
    return 0


COPY_SIZES_KIB = (64, 128, 256, 512, 1024, 2048, 8192)


def copy_only(rounds: int = 7, n: int = 300) -> int:
    """One frame sent to the raw server (a put: it keeps the frame and acks), copied into ZeroMQ's message or
    sent zero-copy; this process's CPU per message (every thread: Python, ZeroMQ's I/O, pyzmq's garbage
    collector, which hands zero-copy buffers back) and the median wall per put, alternating rounds."""
    import zmq.backend

    send = zmq.backend.Socket.send
    proc, endpoint, pipe = start(raw_server)
    try:
        raw = Raw(endpoint)
        sock = raw.sock
        bufs = {kib: memoryview(np.ones(kib << 10, np.uint8)) for kib in COPY_SIZES_KIB}
        more = int(zmq.SNDMORE)

        def put(kib: int, copy: bool) -> None:
            send(sock, b"P", more, True, False)
            send(sock, b"c", more, True, False)
            send(sock, bufs[kib], 0, copy, False)
            sock.recv()

        res: dict[tuple[int, bool], tuple[list[float], list[float]]] = {
            (kib, copy): ([], []) for kib in COPY_SIZES_KIB for copy in (True, False)}
        for (kib, copy) in res:
            for _ in range(50):
                put(kib, copy)
        for _ in range(rounds):
            for (kib, copy), (cpu, wall) in res.items():
                c0, ts = time.process_time(), []
                for _ in range(n):
                    t0 = time.perf_counter()
                    put(kib, copy)
                    ts.append(time.perf_counter() - t0)
                cpu.append((time.process_time() - c0) / n * 1e6)
                wall.append(statistics.median(ts) * 1e6)
    finally:
        pipe.send("stop")
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    print("\none frame put to the raw server: copied vs zero-copy (medians; CPU: this process, every thread)")
    print("| frame | copy, CPU us | zero-copy, CPU us | copy, wall us | zero-copy, wall us |")
    print("|---|---|---|---|---|")
    for kib in COPY_SIZES_KIB:
        (cc, cw), (zc, zw) = ((statistics.median(res[kib, c][0]), statistics.median(res[kib, c][1]))
                              for c in (True, False))
        print(f"| {kib} KiB | {cc:.0f} | {zc:.0f} | {cw:.0f} | {zw:.0f} |")
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


def report(rows: list[tuple[str, int, dict[str, float]]], peers: list[str]) -> None:
    cols = ["raw put", "kvd append", "raw get", "kvd get", "kvd pages q4"]
    buffers = bool(rows) and BUFFERS_GET in rows[0][2]
    if buffers:
        cols += [BUFFERS_APPEND, BUFFERS_GET]
    for name in peers:
        cols += [f"{name} put", f"{name} get"]
    print("\nGB/s of payload (median), tcp://127.0.0.1, server in another process; pages q4 in fp16-equivalent "
          "GB/s")
    print("| payload | in flight | " + " | ".join(cols) + " |")
    print("|---" * (2 + len(cols)) + "|")
    for label, n, res in rows:
        size = SIZES[label]
        print(f"| {label} | {n} | " + " | ".join(f"{size / res[c] / 1e9:.2f}" for c in cols) + " |")
    ratio_cols = ["append/raw put", "get/raw get", "pages/raw get"]
    for name in peers:
        ratio_cols += [f"append/{name} put", f"get/{name} get"]
    if buffers:
        ratio_cols += ["buffers append/raw put", "buffers get/raw get"]
        for name in peers:
            ratio_cols += [f"buffers append/{name} put", f"buffers get/{name} get"]
    print("\nratios of kvd to the others (GB/s over GB/s, same run; above 1: kvd is faster)")
    print("| payload | in flight | " + " | ".join(ratio_cols) + " |")
    print("|---" * (2 + len(ratio_cols)) + "|")
    for label, n, res in rows:
        ratios = [res["raw put"] / res["kvd append"], res["raw get"] / res["kvd get"],
                  res["raw get"] / res["kvd pages q4"]]
        for name in peers:
            ratios += [res[f"{name} put"] / res["kvd append"], res[f"{name} get"] / res["kvd get"]]
        if buffers:
            ratios += [res["raw put"] / res[BUFFERS_APPEND], res["raw get"] / res[BUFFERS_GET]]
            for name in peers:
                ratios += [res[f"{name} put"] / res[BUFFERS_APPEND], res[f"{name} get"] / res[BUFFERS_GET]]
        print(f"| {label} | {n} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    print("\nmedian latency per request (us)")
    print("| payload | in flight | " + " | ".join(cols) + " |")
    print("|---" * (2 + len(cols)) + "|")
    for label, n, res in rows:
        print(f"| {label} | {n} | " + " | ".join(f"{res[c] * 1e6:.0f}" for c in cols) + " |")


if __name__ == "__main__":
    sys.exit(main())
