"""Load generator behind ``kvd bench`` and bench/cluster.py: client processes driving a running kvd.

Each client process registers a namespace, then loops until the deadline over fresh sequences: one prefill
append of ``prefill_tokens`` tokens, ``decode_steps`` one-token appends (all layers each), one read of the whole
sequence (fp16), and a drop. Latencies are measured per request on the client; throughput counts fp16 bytes
(keys + values) of the payload. Client processes start with ``spawn`` and begin together after all have
connected (readiness by message, no sleeps).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Layout", "LAYOUTS", "run_load", "print_report", "percentile_ms"]

_READY_TIMEOUT_S = 60.0
_OPS = ("prefill", "decode", "get", "drop")


@dataclass(frozen=True, slots=True)
class Layout:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def token_bytes(self) -> int:
        """fp16 bytes of one token over all layers, keys and values."""
        return 2 * 2 * self.num_layers * self.num_kv_heads * self.head_dim


LAYOUTS = {"7b": Layout(32, 8, 128), "small": Layout(4, 2, 64)}


def percentile_ms(samples: np.ndarray, q: float) -> float:
    return float(np.percentile(samples, q) * 1e3) if len(samples) else float("nan")


def _worker(wid: int, endpoint: str, layout: Layout, prefill_tokens: int, decode_steps: int, namespace: str,
            curve: Any, timeout_s: float, start: Any, stop_at: Any, counter: Any, out: Any) -> None:
    from kvd.client.sync import Client

    lat: dict[str, list[float]] = {op: [] for op in _OPS}
    errors: list[str] = []
    n_errors = 0
    try:
        client = Client(endpoint, timeout_s=timeout_s, curve=curve)
        client.register(namespace, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                        head_dim=layout.head_dim)
        rng = np.random.default_rng(wid)
        shape = (layout.num_layers, prefill_tokens, layout.num_kv_heads, layout.head_dim)
        pk = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
        pv = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
        dk, dv = np.ascontiguousarray(pk[:, :1]), np.ascontiguousarray(pv[:, :1])
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(("failed", wid, f"{type(exc).__name__}: {exc}"))
        return
    out.put(("ready", wid, None))
    start.wait()
    n = 0
    clock = time.perf_counter
    while time.time() < stop_at.value:
        seq = f"w{wid}-{n}"
        n += 1
        steps: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
            ("prefill", client.append, (namespace, seq, pk, pv)),
            *[("decode", client.append, (namespace, seq, dk, dv))] * decode_steps,
            ("get", client.get, (namespace, seq)),
            ("drop", client.drop, (namespace, seq)),
        ]
        for op, call, args in steps:
            if op == "decode" and time.time() >= stop_at.value:
                continue  # time is up: skip the remaining decode steps, still read back and drop
            t0 = clock()
            try:
                call(*args)
            except Exception as exc:  # noqa: BLE001 - counted, a few kept for the report
                n_errors += 1
                if len(errors) < 5:
                    errors.append(f"{op}: {type(exc).__name__}: {exc}")
                break
            lat[op].append(clock() - t0)
            with counter.get_lock():
                counter.value += 1
    client.close()
    out.put(("done", wid, {"lat": {op: np.asarray(v) for op, v in lat.items()}, "errors": n_errors,
                           "error_samples": errors}))


def run_load(endpoint: str, *, clients: int = 4, seconds: float = 10.0, layout: Layout = LAYOUTS["7b"],
             prefill_tokens: int = 512, decode_steps: int = 32, curve: Any = None, progress: bool = True,
             namespace: str = "kvd-bench", timeout_s: float = 30.0) -> dict[str, Any]:
    """Drive ``clients`` processes against ``endpoint`` for ``seconds``; returns per-op and total figures:
    ``{"ops": {op: {count, bytes, gbps, rps, p50_ms, p99_ms}}, "total": {...}, "errors", "error_samples",
    "seconds", "clients", "layout"}``. ``gbps`` is 1e9 fp16 payload bytes per second."""
    ctx = mp.get_context("spawn")
    start, counter, out = ctx.Event(), ctx.Value("q", 0), ctx.Queue()
    stop_at = ctx.Value("d", float("inf"))
    procs = [
        ctx.Process(target=_worker, args=(i, endpoint, layout, prefill_tokens, decode_steps, namespace, curve,
                                          timeout_s, start, stop_at, counter, out), daemon=True)
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    ready, failed = 0, list[str]()
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while ready + len(failed) < clients:
        try:
            kind, wid, info = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if kind == "ready":
            ready += 1
        else:
            failed.append(f"client {wid}: {info}")
    if ready < clients:
        stop_at.value = 0.0
        start.set()
        for p in procs:
            p.join(timeout=10)
        raise RuntimeError("bench clients did not start: " + ("; ".join(failed) or "timeout"))
    t_start = time.time()
    stop_at.value = t_start + seconds
    start.set()
    results: list[dict[str, Any]] = []
    while len(results) < clients:
        if progress:
            _progress(time.time() - t_start, seconds, counter.value)
        try:
            kind, _wid, info = out.get(timeout=0.2)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and out.empty():
                break
            continue
        if kind == "done":
            results.append(info)
    wall = time.time() - t_start
    if progress:
        _progress(min(wall, seconds), seconds, counter.value)
        print(file=sys.stderr)
    for p in procs:
        p.join(timeout=10)
    return _summarize(results, wall, clients, layout, prefill_tokens)


def _summarize(results: list[dict[str, Any]], wall: float, clients: int, layout: Layout,
               prefill_tokens: int) -> dict[str, Any]:
    tb = layout.token_bytes()
    per_op_bytes = {"prefill": tb * prefill_tokens, "decode": tb, "get": None, "drop": 0}
    ops: dict[str, Any] = {}
    all_lat = []
    total_bytes = 0
    get_bytes = 0
    n_prefill = sum(len(r["lat"]["prefill"]) for r in results)
    n_decode = sum(len(r["lat"]["decode"]) for r in results)
    n_get = sum(len(r["lat"]["get"]) for r in results)
    if n_get:  # a read returns the whole sequence: its tokens per read on average
        get_bytes = int(tb * (prefill_tokens * n_prefill + n_decode) / max(n_prefill, 1))
    per_op_bytes["get"] = get_bytes
    for op in _OPS:
        lat = np.concatenate([r["lat"][op] for r in results]) if results else np.zeros(0)
        all_lat.append(lat)
        nbytes = int(per_op_bytes[op] or 0) * len(lat)
        total_bytes += nbytes
        ops[op] = {"count": len(lat), "bytes": nbytes, "gbps": nbytes / wall / 1e9, "rps": len(lat) / wall,
                   "p50_ms": percentile_ms(lat, 50), "p99_ms": percentile_ms(lat, 99)}
    lat = np.concatenate(all_lat) if all_lat else np.zeros(0)
    return {
        "ops": ops,
        "total": {"count": len(lat), "bytes": total_bytes, "gbps": total_bytes / wall / 1e9,
                  "rps": len(lat) / wall, "p50_ms": percentile_ms(lat, 50), "p99_ms": percentile_ms(lat, 99)},
        "errors": sum(r["errors"] for r in results) + (clients - len(results)),
        "error_samples": [e for r in results for e in r["error_samples"]][:5],
        "seconds": wall,
        "clients": clients,
        "layout": layout,
    }


def _progress(elapsed: float, total: float, ops: int) -> None:
    width = 30
    done = min(1.0, elapsed / total) if total > 0 else 1.0
    bar = "#" * int(done * width) + "." * (width - int(done * width))
    print(f"\r[{bar}] {elapsed:5.1f}/{total:.0f} s  {ops:,} requests", end="", file=sys.stderr, flush=True)


def print_report(result: dict[str, Any]) -> None:
    """The table of ``kvd bench``."""
    layout = result["layout"]
    print(f"{result['clients']} clients, {result['seconds']:.1f} s, layout {layout.num_layers} layers x "
          f"{layout.num_kv_heads} KV heads x {layout.head_dim}")
    print(f"{'op':<8} {'requests':>9} {'GB/s':>8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name, row in [*result["ops"].items(), ("total", result["total"])]:
        print(f"{name:<8} {row['count']:>9} {row['gbps']:>8.3f} {row['rps']:>9.1f} {row['p50_ms']:>8.3f} "
              f"{row['p99_ms']:>8.3f}")
    if result["errors"]:
        print(f"errors: {result['errors']}")
        for line in result["error_samples"]:
            print(f"  {line}")
