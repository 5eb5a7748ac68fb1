"""Soak: does a shard's memory stay flat under a long mixed load over a full store? (issue 32, section 6)

    python bench/soak.py                                  # 10 minutes, 20 clients, a 256 MiB store
    python bench/soak.py --minutes 5 --clients 20 --memory 256
    python bench/soak.py --minutes 3 --tracemalloc        # also the shard's top Python allocation growth
    python bench/soak.py --cluster                        # the shard of a one-shard kvd on a local Ray (kvd up)
    python bench/soak.py --cluster --arena-max 0          # ... with glibc's default arenas instead of kvd's one

The shard is a ShardServer with default settings (LRU eviction, prefix-aware order; ownership enforced, as in a
cluster) in a process of its own on tcp://127.0.0.1, or with ``--cluster`` the Ray actor shard of a one-shard kvd
deployed on a local Ray (what ``kvd up`` runs: its reporter thread and Ray's core worker in the same process;
glibc's figures and tracemalloc are then not available); the clients are threads, spread over a few processes,
each with its own kvd Client. Each client loops over a mix that keeps the store full and evicting: prompts stored
as chains of 64-token blocks (a shared prefix from a pool, then a block of its own, each with its parent, looked
up first with ``lengths`` and read back where found, as the vLLM connector does), decode sessions (a prefill of
128-1,024 tokens, one-token appends, a read of the whole sequence, then a drop half of the time, else left to
eviction), and reads of recent sequences that may have been evicted.

Every ``--every`` seconds the shard's RSS is read from /proc and the shard process reports what it accounts: the
store's used bytes and pool, sequences, the eviction heap's entries (kvd.store.chains), the server's queued and
held reply bytes, the warm result cache (kvd.store.buffers), glibc's heap (mallinfo2: in use, free) and, with
``--tracemalloc``, the bytes Python objects hold. The table gives RSS at the end of the warm-up (``--warmup``
seconds) and at the end, the growth after warm-up, and the accounts at both points.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
NS = "soak"
LAYOUT = (8, 2, 64)  # layers, kv heads, head dim: 4 KiB of fp16 keys and values per token
BLOCK = 64  # tokens per chained block (one kvd sequence each)
PREFIXES = 64  # shared prefixes prompts draw from (Zipf-like): the prefix working set is larger than the store


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> dict[str, int]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    mi = fn()
    return {"heap_used": mi.uordblks, "heap_free": mi.fordblks, "mmapped": mi.hblkhd}


def serve(conn: Any, memory: int, trace: bool) -> None:
    """The shard's process: a ShardServer over a Store, answering the bench's samples on ``conn``."""
    import tracemalloc

    if trace:
        tracemalloc.start(8)
    from kvd.store import Store, buffers
    from kvd.wire.server import ShardServer
    from kvd.wire.sockets import trim_malloc

    store = Store(memory)
    server = ShardServer(store, shard_id="soak")
    server.set_routing(1, ["soak"])  # ownership enforced, as a cluster's shard does (it owns every sequence here)
    conn.send(server.start())
    base = None
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            break
        if cmd == "mark" and trace:
            base = tracemalloc.take_snapshot()
            conn.send(None)
            continue
        if cmd == "trim":  # how much of the RSS is free heap glibc keeps: give it back, and time that
            t0 = time.perf_counter()
            trim_malloc()
            conn.send(time.perf_counter() - t0)
            continue
        if cmd == "diff":
            lines: list[str] = []
            if trace and base is not None:
                snap = tracemalloc.take_snapshot()
                for d in snap.compare_to(base, "lineno")[:12]:
                    lines.append(f"{d.size_diff / 1024:+.0f} KiB ({d.count_diff:+d}) {d.traceback}")
            conn.send(lines)
            continue
        st = store.stats()
        m = server.metrics()
        blocks, warm = buffers.cached()
        conn.send({
            "used": st["used_bytes"], "pool": st["pool_bytes"], "sequences": st["sequences"],
            "evictions": st["evictions"], "level": st["level"],
            "heap_entries": len(store._chains._heap),  # noqa: SLF001 - the bench looks inside on purpose
            "queued": m["queued_bytes"], "replies_held": m["replies_held_bytes"], "requests": m["requests"],
            "errors": m["errors"], "busy": m["busy"], "warm": warm, "warm_blocks": blocks,
            "traced": tracemalloc.get_traced_memory()[0] if trace else 0, **_mallinfo(),
        })
    server.stop()


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS")


class LocalShard:
    """A ShardServer in a process of its own (:func:`serve`), sampled over a pipe."""

    def __init__(self, mpc: Any, memory: int, trace: bool) -> None:
        self._conn, child = mpc.Pipe()
        self._proc = mpc.Process(target=serve, args=(child, memory, trace), daemon=True)
        self._proc.start()
        self.endpoint: str = self._conn.recv()
        self.pid: int = self._proc.pid
        self._trace = trace

    def _ask(self, cmd: str) -> Any:
        self._conn.send(cmd)
        return self._conn.recv()

    def sample(self) -> dict[str, Any]:
        return dict(self._ask("sample"))

    def mark(self) -> None:
        if self._trace:
            self._ask("mark")

    def diff(self) -> list[str]:
        return list(self._ask("diff")) if self._trace else []

    def trim(self) -> float | None:
        return float(self._ask("trim"))

    def stop(self) -> None:
        self._conn.send("stop")
        self._proc.join(15)


class ClusterShard:
    """The one shard of a kvd deployed on a local Ray (kvd.cluster.deploy, as ``kvd up`` does), sampled through
    its actor's stats."""

    RAY_NS = "bench-soak"

    def __init__(self, memory: int, arena_max: int | None) -> None:
        import ray

        from kvd.cluster.deploy import deploy
        from kvd.config import load_config

        if arena_max is not None:  # what deploy hands the shard's process (kvd's default: 1)
            os.environ["MALLOC_ARENA_MAX"] = str(arena_max)
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        config = load_config(env={}, overrides={
            "cluster.namespace": self.RAY_NS, "cluster.port": 0, "cluster.shards": 1,
            "cluster.memory_bytes": memory, "cluster.shard_cpus": 0, "store.eviction": "lru"})
        self._dep = deploy(config)
        self.endpoint = self._dep.endpoint
        self.pid = int(self._stats()["pid"])

    def _stats(self) -> dict[str, Any]:
        st = next(iter(self._dep.shard_stats().values()))
        if isinstance(st, Exception):
            raise st
        return st

    def sample(self) -> dict[str, Any]:
        st = self._stats()
        return {"used": st["used_bytes"], "pool": st["pool_bytes"], "sequences": st["sequences"],
                "evictions": st["evictions"], "level": st["level"], "heap_entries": -1,
                "queued": st["server_queued_bytes"], "replies_held": st["server_replies_held_bytes"],
                "requests": st["server_requests"], "errors": st["server_errors"], "busy": st["server_busy"],
                "warm": st["warm_cached_bytes"], "warm_blocks": -1, "traced": 0, "heap_used": 0, "heap_free": 0,
                "mmapped": 0}

    def mark(self) -> None:
        pass

    def diff(self) -> list[str]:
        return []

    def trim(self) -> float | None:
        return None

    def stop(self) -> None:
        import ray

        from kvd.cluster.deploy import teardown

        teardown(self.RAY_NS)
        ray.shutdown()


def rss_by_kind(pid: int) -> dict[str, int]:
    """The process's resident bytes by kind of mapping (/proc/PID/smaps): ``brk`` (glibc's main heap),
    ``anon`` (anonymous mappings: other malloc arenas, large blocks, thread stacks, Ray's and ZeroMQ's own) and
    ``files`` (code and mapped files)."""
    out = {"brk": 0, "anon": 0, "files": 0}
    kind = "anon"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 6)
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                path = head[5].strip() if len(head) > 5 else ""
                kind = "brk" if path == "[heap]" else "anon" if not path or path.startswith("[") else "files"
            elif line.startswith("Rss:"):
                out[kind] += int(line.split()[1]) * 1024
    return out


def _client(endpoint: str, wid: int, stop_at: float, counts: dict[str, int], lock: threading.Lock) -> None:
    from kvd.client import Client
    from kvd.errors import Busy, UnknownSequence

    rng = np.random.default_rng(wid)
    layers, heads, dim = LAYOUT
    block = rng.standard_normal((layers, BLOCK, heads, dim), dtype=np.float32).astype(np.float16)
    prefill = rng.standard_normal((layers, 1024, heads, dim), dtype=np.float32).astype(np.float16)
    step = np.ascontiguousarray(prefill[:, :1])
    zipf = 1.0 / np.arange(1, PREFIXES + 1)
    zipf /= zipf.sum()
    mine: list[str] = []
    local = dict.fromkeys(("ops", "hits", "misses", "busy", "errors"), 0)
    n = 0
    with Client(endpoint, timeout_s=120) as c:
        while time.time() < stop_at:
            n += 1
            try:
                kind = rng.random()
                if kind < 0.45:  # a prompt: shared prefix blocks, then one of its own, chained by parent
                    pre = int(rng.choice(PREFIXES, p=zipf))
                    ids = [f"p{pre}-{b}" for b in range(1 + pre % 6)] + [f"u{wid}-{n}"]
                    found = c.lengths(NS, ids)
                    hit = 0
                    while hit < len(ids) and found[hit] is not None:
                        hit += 1
                    for sid in ids[:hit]:
                        c.get(NS, sid)
                    for b in range(hit, len(ids)):
                        c.append(NS, ids[b], block, block, position=b * BLOCK,
                                 parent=ids[b - 1] if b else None)
                    local["hits"] += hit
                    local["misses"] += len(ids) - hit
                    local["ops"] += 2 + len(ids)
                elif kind < 0.85:  # a decode session
                    sid = f"d{wid}-{n}"
                    t = int(rng.integers(2, 17)) * 64
                    c.append(NS, sid, prefill[:, :t], prefill[:, :t])
                    for _ in range(int(rng.integers(1, 17))):
                        c.append(NS, sid, step, step)
                    c.get(NS, sid)
                    if rng.random() < 0.5:
                        c.drop(NS, sid)
                    else:
                        mine.append(sid)
                        del mine[:-64]
                    local["ops"] += 20
                elif mine:  # a read of a recent sequence (evicted or not)
                    try:
                        c.get(NS, mine[int(rng.integers(len(mine)))])
                        local["hits"] += 1
                    except UnknownSequence:
                        local["misses"] += 1
                    local["ops"] += 1
            except Busy:
                local["busy"] += 1
            except UnknownSequence:  # evicted between the lookup and the read
                local["misses"] += 1
            except Exception as exc:  # noqa: BLE001 - counted and shown; the soak goes on
                local["errors"] += 1
                if local["errors"] <= 3:
                    print(f"client {wid}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    with lock:
        for k, v in local.items():
            counts[k] = counts.get(k, 0) + v


def clients_proc(endpoint: str, wids: list[int], stop_at: float, out: Any) -> None:
    counts: dict[str, int] = {}
    lock = threading.Lock()
    threads = [threading.Thread(target=_client, args=(endpoint, w, stop_at, counts, lock)) for w in wids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the soak after start (default 10)")
    ap.add_argument("--clients", type=int, default=20, help="client threads (default 20)")
    ap.add_argument("--procs", type=int, default=4, help="processes the client threads are spread over")
    ap.add_argument("--memory", type=int, default=256, help="the store's capacity, MiB (default 256)")
    ap.add_argument("--warmup", type=float, default=120.0, help="seconds before the baseline sample (default 120)")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples (default 5)")
    ap.add_argument("--tracemalloc", action="store_true", help="trace the shard's Python allocations")
    ap.add_argument("--cluster", action="store_true", help="soak the shard of a one-shard kvd on a local Ray")
    ap.add_argument("--arena-max", type=int, default=None,
                    help="with --cluster: MALLOC_ARENA_MAX of the shard's process (deploy's default 1; 0: "
                         "glibc's default, an arena per thread up to 8 per core)")
    args = ap.parse_args()
    mpc = mp.get_context("spawn")
    memory = args.memory * MIB
    shard = ClusterShard(memory, args.arena_max) if args.cluster else LocalShard(mpc, memory, args.tracemalloc)
    endpoint, pid = shard.endpoint, shard.pid
    from kvd.client import Client

    with Client(endpoint, timeout_s=60) as c:
        c.register(NS, num_layers=LAYOUT[0], num_kv_heads=LAYOUT[1], head_dim=LAYOUT[2])
    start = time.time()
    stop_at = start + args.minutes * 60
    out = mpc.Queue()
    procs = []
    for i in range(args.procs):
        wids = list(range(i, args.clients, args.procs))
        if wids:
            procs.append(mpc.Process(target=clients_proc, args=(endpoint, wids, stop_at, out), daemon=True))
    for pr in procs:
        pr.start()

    def sample() -> dict[str, Any]:
        s = shard.sample()
        s["rss"] = rss(pid)
        s.update(rss_by_kind(pid))
        s["t"] = time.time() - start
        return s

    mib = ("rss", "brk", "anon", "files", "used", "pool", "warm", "heap_used", "heap_free", "mmapped", "traced",
           "queued", "replies_held")
    cols = ("t", *mib, "sequences", "heap_entries", "evictions")

    def row(s: dict[str, Any]) -> str:
        cells = [f"{s[k] / MIB:.1f}" if k in mib else f"{s[k]:.0f}" if k == "t" else str(s[k]) for k in cols]
        return "| " + " | ".join(cells) + " |"

    print(f"shard pid {pid}, {args.clients} clients in {len(procs)} processes, store {args.memory} MiB, "
          f"{args.minutes} min, warm-up {args.warmup:.0f} s; MiB columns: " + ", ".join(mib), flush=True)
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols), flush=True)
    samples: list[dict[str, Any]] = []
    marked = False
    while time.time() < stop_at:
        time.sleep(min(args.every, max(0.0, stop_at - time.time())))
        s = sample()
        samples.append(s)
        print(row(s), flush=True)
        if not marked and s["t"] >= args.warmup:
            marked = True
            shard.mark()
    counts: dict[str, int] = {}
    for _ in procs:
        for k, v in out.get(timeout=300).items():
            counts[k] = counts.get(k, 0) + v
    for pr in procs:
        pr.join(30)
    end = sample()
    warm = next((s for s in samples if s["t"] >= args.warmup), samples[0])
    after = [s for s in samples if s["t"] >= args.warmup]
    slope = 0.0
    if len(after) > 2:
        slope = float(np.polyfit([s["t"] for s in after], [s["rss"] for s in after], 1)[0]) * 60 / MIB
    print()
    print("| point | t, s | RSS, MiB | store used | pool | warm cache | malloc in use | malloc free | mmapped | "
          "queued | replies held | sequences | eviction heap | evictions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    peak = max(after or samples, key=lambda s: s["rss"])
    for name, s in (("warm-up end", warm), ("end", end), ("peak RSS", peak)):
        print(f"| {name} | {s['t']:.0f} | {s['rss'] / MIB:.1f} | {s['used'] / MIB:.1f} | {s['pool'] / MIB:.1f} | "
              f"{s['warm'] / MIB:.1f} | {s['heap_used'] / MIB:.1f} | {s['heap_free'] / MIB:.1f} | "
              f"{s['mmapped'] / MIB:.1f} | {s['queued'] / MIB:.1f} | {s['replies_held'] / MIB:.1f} | "
              f"{s['sequences']} | {s['heap_entries']} | {s['evictions']} |")
    growth = (end["rss"] - warm["rss"]) / warm["rss"] * 100
    # RSS saw-tooths between heap trims (every 30 s, kvd.wire.sockets.TRIM_EVERY_S), so beside the two samples:
    # the means of the first and the last minute after warm-up, and the peaks of the first and the last two minutes
    def window(lo: float, hi: float) -> list[float]:
        return [s["rss"] / MIB for s in after if lo <= s["t"] < hi] or [end["rss"] / MIB]

    t_end = end["t"] + 1
    mean_first = float(np.mean(window(args.warmup, args.warmup + 60)))
    mean_last = float(np.mean(window(t_end - 60, t_end)))
    peak_first, peak_last = max(window(args.warmup, args.warmup + 120)), max(window(t_end - 120, t_end))
    grown = (end["rss"] - warm["rss"]) / MIB
    print(f"\nRSS growth after warm-up: {growth:+.2f}% between the two samples ({grown:+.1f} MiB); "
          f"{(mean_last / mean_first - 1) * 100:+.2f}% between the means of the first and the last minute "
          f"({mean_first:.1f} -> {mean_last:.1f} MiB); {(peak_last / peak_first - 1) * 100:+.2f}% between the "
          f"peaks of the first and the last two minutes ({peak_first:.1f} -> {peak_last:.1f} MiB); linear fit "
          f"{slope:+.2f} MiB/min; level {end['level']}; requests {end['requests']}, error replies {end['errors']} "
          f"(UnknownSequence: evicted), busy {end['busy']}; "
          f"clients: {counts}")
    took = shard.trim()
    if took is not None:
        after_trim = rss(pid)
        print(f"malloc_trim(0) at the end took {took * 1e3:.1f} ms: RSS {end['rss'] / MIB:.1f} -> "
              f"{after_trim / MIB:.1f} MiB (free heap glibc kept: {(end['rss'] - after_trim) / MIB:.1f} MiB)")
    lines = shard.diff()
    if lines:
        print("\nshard's Python allocation growth after warm-up (tracemalloc, top lines):")
        for line in lines:
            print("  " + line)
    shard.stop()


if __name__ == "__main__":
    main()
