"""Attention where the pages live (issue 34): correctness, speed and bytes on the wire of ``attend``.

1. Correctness, on the real SmolLM2-135M sample (every layer, its last 8 queries): the relative error of
   Store.attend against float64 attention over the pages as decoded, per level (it must add nothing to the
   level's own error: <= 1e-3), and at fp16 against float32 attention over the raw tokens.
2. Scan speed, in one process: one decode query (T_q = 1, 32 query heads) over N tokens of one layer of the
   7B-class layout (8 KV heads x 128 dims) at fp16 / q8 / q4: stored K+V bytes scanned per second, against one
   numpy.copyto of the same number of bytes into a reused buffer, timed in the same rounds (the ratio is the
   goal: >= 0.5x); and the same query with the fused q8 / q4 tiles off (every page decoded into an fp16
   scratch first), the baseline they replace.
3. Through a shard (a ShardServer in another process, loopback): time per query of ``Client.attend`` against
   ``get(format="pages")`` + client decode + float32 attention over the result, and the bytes each moves on the
   wire (the pages reply's frames; the attend request's query frame and reply's out and lse frames, headers
   included).

Medians of --repeats rounds. One layer per namespace: attend works per layer, and 128k tokens of all 32 layers
(16 GiB at fp16) do not fit this machine; a layer is what one attend scans.

    .venv/bin/python bench/attend.py [--tokens 4096,32768,131072] [--shard-tokens 4096,32768] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvd import attention
from kvd.codec import attend as kernel
from kvd.codec import kernels
from kvd.store import Store

H, D, HQ = 8, 128, 32
NS = "b7"


def medians(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def make_store(level: str, tokens: int, seed: int = 0) -> Store:
    store = Store(8 << 30)
    store.register(NS, num_layers=1, num_kv_heads=H, head_dim=D)
    if level != "fp16":
        store.set_level(level, 1)
    rng = np.random.default_rng(seed)
    step = 8192
    for t in range(0, tokens, step):
        n = min(step, tokens - t)
        k = rng.standard_normal((1, n, H, D), dtype=np.float32).astype(np.float16)
        v = rng.standard_normal((1, n, H, D), dtype=np.float32).astype(np.float16)
        store.append(NS, "s", k, v)
    return store


def stored_bytes(store: Store) -> int:
    return sum(len(k) + len(v) for _, _, k, v in store.get_pages(NS, "s"))


def correctness() -> None:
    from kvd.evaluate import load_sample

    layers, meta = load_sample()
    print(f"## correctness: {meta}")
    print("| level | rel. error vs float64 over decoded pages (max over layers) | vs float32 over raw tokens |")
    print("|---|---|---|")
    for level in ("fp16", "q8", "fp8_e4m3", "q4"):
        worst = worst_raw = 0.0
        for q, k, v in layers:
            t, h, d = k.shape
            store = Store(1 << 28, eight_bit="fp8_e4m3" if level == "fp8_e4m3" else "q8")
            store.register(NS, num_layers=1, num_kv_heads=h, head_dim=d)
            if level != "fp16":
                store.set_level("q8" if level == "fp8_e4m3" else level, 1)
            store.append(NS, "s", k[None], v[None])
            qq = q[-8:]
            out, _ = store.attend(NS, "s", 0, qq)
            kd, vd = store.get(NS, "s")
            want = attention.attend(qq, kd[0], vd[0])[0]
            worst = max(worst, float(np.linalg.norm(out - want) / np.linalg.norm(want)))
            raw = attention.attend(qq.astype(np.float32), k.astype(np.float32), v.astype(np.float32))[0]
            worst_raw = max(worst_raw, float(np.linalg.norm(out - raw) / np.linalg.norm(raw)))
        print(f"| {level} | {worst:.2e} | {worst_raw:.2e} |")


def decoded_first(store: Store, q: np.ndarray) -> None:
    """The attend of the scan with the fused tiles off: every page decoded into an fp16 scratch, then read."""
    kernel.FUSED = False
    try:
        store.attend(NS, "s", 0, q)
    finally:
        kernel.FUSED = True


def scan_speed(token_counts: list[int], repeats: int) -> None:
    print(f"\n## scan speed, in process: T_q=1, {HQ} query heads, one layer of {H} KV heads x {D}; tile kernel "
          f"{kernel.TILE_KERNEL}, codec kernels {kernels.BACKEND}")
    print("| tokens | level | stored K+V MiB | attend ms | GB/s scanned | copyto GB/s | ratio "
          "| decode-then-tile ms |")
    print("|---|---|---|---|---|---|---|---|")
    q = np.random.default_rng(9).standard_normal((1, HQ, D)).astype(np.float32)
    for tokens in token_counts:
        for level in ("fp16", "q8", "q4"):
            store = make_store(level, tokens)
            nbytes = stored_bytes(store)
            src = np.ones(nbytes, np.uint8)
            dst = np.empty_like(src)
            t_att, t_copy, t_dec = medians([lambda st=store: st.attend(NS, "s", 0, q),
                                            lambda d=dst, s=src: np.copyto(d, s),
                                            lambda st=store: decoded_first(st, q)], repeats)
            print(f"| {tokens} | {level} | {nbytes / 2**20:.1f} | {t_att * 1e3:.2f} | "
                  f"{nbytes / t_att / 1e9:.2f} | {nbytes / t_copy / 1e9:.2f} | {t_copy / t_att:.2f}x | "
                  f"{t_dec * 1e3:.2f} |")
            del store, src, dst


def _serve(conn: Any, level: str, tokens: int) -> None:
    from kvd.wire.server import ShardServer

    store = make_store(level, tokens)
    server = ShardServer(store, shard_id="bench")
    conn.send(server.start())
    conn.recv()
    server.stop()


def through_shard(token_counts: list[int], repeats: int) -> None:
    from kvd.client import Client

    print("\n## through a shard (loopback, server in another process): T_q=1, one layer")
    print("| tokens | level | attend ms | get pages + decode + attention ms | speed-up | wire bytes/query attend "
          "| wire bytes/query get | bytes ratio |")
    print("|---|---|---|---|---|---|---|---|")
    q = np.random.default_rng(9).standard_normal((1, HQ, D)).astype(np.float32)
    ctx = mp.get_context("spawn")
    for tokens in token_counts:
        for level in ("fp16", "q8", "q4"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, level, tokens), daemon=True)
            proc.start()
            endpoint = parent.recv()
            with Client(endpoint, timeout_s=120) as c:
                def via_get() -> None:
                    k, v = c.get(NS, "s", format="pages")
                    attention_f32(q, k[0], v[0])

                t_att, t_get = medians([lambda: c.attend(NS, "s", 0, q), via_get], repeats)
                stats0 = c.shard_stats()[0]
                c.attend(NS, "s", 0, q)
                stats1 = c.shard_stats()[0]
                c.get(NS, "s", format="pages")
                stats2 = c.shard_stats()[0]
            parent.send("stop")
            proc.join(30)
            wire_att = (stats1["server_bytes_in"] - stats0["server_bytes_in"]) + (
                stats1["server_bytes_out"] - stats0["server_bytes_out"])
            wire_get = (stats2["server_bytes_in"] - stats1["server_bytes_in"]) + (
                stats2["server_bytes_out"] - stats1["server_bytes_out"])
            print(f"| {tokens} | {level} | {t_att * 1e3:.2f} | {t_get * 1e3:.2f} | {t_get / t_att:.1f}x | "
                  f"{wire_att} | {wire_get} | {wire_get / wire_att:.0f}x |")


def attention_f32(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The client's own attention over decoded K/V: float32 numpy, one query, grouped heads."""
    g = q.shape[1] // k.shape[1]
    kk = k.astype(np.float32).transpose(1, 2, 0)  # [H, D, T]
    s = np.einsum("hgd,hdt->hgt", q[0].reshape(k.shape[1], g, -1), kk) / np.float32(np.sqrt(q.shape[2]))
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hgt,thd->hgd", p, v.astype(np.float32)).reshape(q.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4096,32768,131072")
    ap.add_argument("--shard-tokens", default="4096,32768")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: correctness,scan,shard")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"# bench/attend.py on {platform.machine()} {platform.processor() or ''}, "
          f"python {platform.python_version()}")
    if "correctness" not in skip:
        correctness()
    if "scan" not in skip:
        scan_speed([int(t) for t in args.tokens.split(",")], args.repeats)
    if "shard" not in skip:
        through_shard([int(t) for t in args.shard_tokens.split(",")], args.repeats)


if __name__ == "__main__":
    main()
