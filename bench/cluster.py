"""Cluster benchmark: several client processes against a kvd of Ray shards, and level-change latency.

Run: ``.venv/bin/python bench/cluster.py`` (a few minutes) or ``--quick`` (smoke, ~1 minute).

Part 1, throughput. An embedded Ray runs a coordinator and ``--shards`` shards. Client processes (kvd.cli.loadgen)
append a 512-token prefill chunk and then decode steps (one token, all layers) of the 7B-class layout
(32 layers, 8 KV heads, head_dim 128), read each sequence back and drop it. Reported: aggregate GB/s of fp16
payload, requests/s, p50/p99 latency per op, for 1 client process (the single-process baseline of this run)
and for ``--clients`` processes; then bench/wire.py (the single-process wire bench, issue 4) if present.

Part 2, control latency. A second kvd with a small memory, a short report interval and a hysteresis wide
enough that re-compression does not immediately undo a rise is filled until cluster pressure crosses 0.80 and
then 0.95. The time from the bench first seeing raw pressure at the threshold (polling shard stats) to the
coordinator's decision, to every shard confirming the new epoch, and to used bytes falling back below the
threshold (re-compression), from the coordinator's level history (CLOCK_MONOTONIC, shared by all processes of
the machine). A negative "decision" can happen: the coordinator may see a report before the bench's next poll.
Medians over ``--repeats`` runs.

Part 3, decode-step latency under mixed load (issue 19; ``--decode-only`` runs just this part). A 2-shard kvd
(``--shards``); one client appends decode steps (one token, all layers, 7B-class layout: 128 KiB) to 8 sequences
in rotation, one at a time, while ``--clients`` other client processes each loop: append a 512-token prefill
chunk (64 MiB) to a sequence of their own, read it back whole, drop it. Rounds of ``--decode-seconds`` alternate
quiet (the decode client alone) and loaded; reported per round and as the median over rounds of each kind:
decode-step append latency p50 / p99 / p999, and the prefill clients' chunks per second. ``--socket-buffer 0``
runs the shards with the system's autotuned TCP buffers instead of the loopback default, 256 KiB
(``cluster.shard_socket_buffer_bytes``; docs/design.md, "Small requests never wait ...").
``--prefill-rate N`` paces the prefill clients at N chunks per second in all instead of back to back: back to
back, they and the shards keep both CPUs of this machine busy, and the decode steps wait for a CPU.

``--namespaces N`` runs only what a namespace registration costs as N accumulate (bench/namespaces.py).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from decode_steps import SEQS, Pace, decode_steps  # noqa: E402  (bench/decode_steps.py)

from kvd.cli.loadgen import LAYOUTS, Layout, run_load  # noqa: E402
from kvd.cluster.deploy import deploy, teardown, wait_until  # noqa: E402
from kvd.config import load_config  # noqa: E402


def _throughput(args: argparse.Namespace) -> None:
    ns = "bench-throughput"
    config = load_config(env={}, overrides={
        "cluster.namespace": ns, "cluster.port": 0, "cluster.shards": args.shards,
        "cluster.memory_bytes": args.memory, "cluster.shard_cpus": 0, "store.eviction": "lru",
    })
    deployment = deploy(config)
    print(f"\n## Throughput: {args.shards} shards x {config.shard_capacity_bytes >> 20} MiB, "
          f"7B-class layout, prefill {args.prefill} tokens + {args.decode} decode steps per sequence\n")
    rows = []
    try:
        for clients in sorted({1, args.clients}):
            result = run_load(deployment.endpoint, clients=clients, seconds=args.seconds, layout=LAYOUTS["7b"],
                              prefill_tokens=args.prefill, decode_steps=args.decode, progress=False,
                              namespace=f"bench-{clients}")
            rows.append((clients, result))
    finally:
        teardown(ns)
    print("| client processes | op | requests | GB/s | req/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for clients, result in rows:
        for op, r in [*result["ops"].items(), ("total", result["total"])]:
            if op == "drop":
                continue
            print(f"| {clients} | {op} | {r['count']} | {r['gbps']:.3f} | {r['rps']:.0f} | {r['p50_ms']:.2f} | "
                  f"{r['p99_ms']:.2f} |")
        if result["errors"]:
            print(f"| {clients} | errors | {result['errors']} | {result['error_samples'][:2]} | | | |")


def _fill_until(client: object, *, ns: str, layout: Layout, threshold: float, target: float, seq_prefix: str,
                timeout_s: float) -> float:
    """Append one-page chunks until the cluster's raw pressure (from shard stats, polled every 8 appends)
    reaches ``target``; returns the ``time.monotonic()`` at which a poll first saw it at or above
    ``threshold``. (CLOCK_MONOTONIC is one clock for every process of a Linux machine, so it compares with the
    coordinator's timestamps.)"""
    shape = (layout.num_layers, 16, layout.num_kv_heads, layout.head_dim)
    chunk = np.random.default_rng(0).standard_normal(shape, dtype=np.float32).astype(np.float16)
    deadline = time.monotonic() + timeout_s
    crossed_at = None
    i = 0
    while time.monotonic() < deadline:
        for _ in range(8):
            try:
                client.append(ns, f"{seq_prefix}-{i}", chunk, chunk)  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - a full shard refuses; others keep filling
                pass
            i += 1
        stats = [s for s in client.shard_stats() if "used_bytes" in s]  # type: ignore[attr-defined]
        pressure = sum(s["used_bytes"] for s in stats) / sum(s["capacity_bytes"] for s in stats)
        if crossed_at is None and pressure >= threshold:
            crossed_at = time.monotonic()
        if pressure >= target:
            assert crossed_at is not None
            return crossed_at
    raise TimeoutError(f"pressure did not reach {target}")


def _control_latency(args: argparse.Namespace) -> None:
    from kvd.client import Client

    layout = Layout(4, 2, 64)
    print(f"\n## Level changes: {args.shards} shards, report interval {args.interval} s, policy alpha 1.0\n")
    print("| run | threshold | level | seen by client -> decision ms | -> all shards applied ms | "
          "-> used below threshold ms | (seen by coordinator -> decision ms) |")
    print("|---|---|---|---|---|---|---|")
    measured: dict[str, list[tuple[float, ...]]] = {"q8": [], "q4": []}
    for run in range(args.repeats):
        ns = f"bench-control-{run}"
        config = load_config(env={}, overrides={
            "cluster.namespace": ns, "cluster.port": 0, "cluster.shards": args.shards,
            "cluster.memory_bytes": f"{2 * args.shards}MiB", "cluster.shard_cpus": 0,
            "cluster.report_interval_s": args.interval, "store.eviction": "none", "store.page_tokens": 16,
            "store.sink_tokens": 0, "store.window_tokens": 0, "policy.ewma_alpha": 1.0, "policy.hysteresis": 0.5,
        })
        deployment = deploy(config)
        try:
            with Client(deployment.endpoint, timeout_s=10.0) as client:
                client.register(ns, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                head_dim=layout.head_dim)
                for level, threshold, target in (("q8", 0.80, 0.85), ("q4", 0.95, 0.97)):
                    seen = _fill_until(client, ns=ns, layout=layout, threshold=threshold, target=target,
                                       seq_prefix=level, timeout_s=120)
                    wait_until(lambda d=deployment, lv=level: _settled(d, lv), timeout_s=60,
                               what=f"{level} applied and relieved")
                    change = [c for c in deployment.status()["history"] if c["level"] == level][-1]
                    row = tuple(1e3 * (change[k] - seen) for k in ("decided_at", "applied_at", "relieved_at"))
                    row += (1e3 * (change["decided_at"] - change["crossed_at"]),)
                    measured[level].append(row)
                    print(f"| {run} | {threshold:.2f} | {level} | {row[0]:.0f} | {row[1]:.0f} | {row[2]:.0f} | "
                          f"{row[3]:.0f} |")
        finally:
            teardown(ns)
    for level, rows in measured.items():
        if rows:
            med = [statistics.median(r[i] for r in rows) for i in range(4)]
            print(f"| median | | {level} | {med[0]:.0f} | {med[1]:.0f} | {med[2]:.0f} | {med[3]:.0f} |")


def _settled(deployment: object, level: str) -> bool:
    history = deployment.status()["history"]  # type: ignore[attr-defined]
    changes = [c for c in history if c["level"] == level]
    return bool(changes) and changes[-1]["applied_at"] is not None and changes[-1]["relieved_at"] is not None


DECODE_MAX_TOKENS = 256  # a decode sequence is dropped and started again at this length (32 MiB)


def _prefill_worker(endpoint: str, ns: str, index: int, chunk_tokens: int, go: Any, stop: Any, done: Any,
                    failed: Any, nice: int, rate: float, clients: int) -> None:
    """A client process: while ``go`` is set, append a ``chunk_tokens`` prefill chunk, read it back, drop it
    (errors are counted in ``failed`` and the loop goes on). ``nice``: added to its priority (every thread).
    ``rate``: chunks per second of all ``clients`` together (:class:`Pace`; 0: back to back)."""
    from kvd.client import Client

    if nice:
        os.nice(nice)

    layout = LAYOUTS["7b"]
    shape = (layout.num_layers, chunk_tokens, layout.num_kv_heads, layout.head_dim)
    k = np.random.default_rng(index).standard_normal(shape, dtype=np.float32).astype(np.float16)
    with Client(endpoint, timeout_s=120.0) as client:
        i = 0
        pace = Pace(rate, clients, index, stop)
        while not stop.is_set():
            if not go.wait(0.1) or not pace.wait():
                continue
            seq = f"prefill-{index}-{i}"
            i += 1
            try:
                client.append(ns, seq, k, k)
                client.get(ns, seq)
                client.drop(ns, seq)
            except Exception:  # noqa: BLE001 - counted and reported by the bench
                with failed.get_lock():
                    failed.value += 1
                continue
            with done.get_lock():
                done.value += 1


def _decode_latency(args: argparse.Namespace) -> None:
    from kvd.client import Client

    ns = "bench-decode"
    layout = LAYOUTS["7b"]
    config = load_config(env={}, overrides={
        "cluster.namespace": ns, "cluster.port": 0, "cluster.shards": args.shards,
        "cluster.memory_bytes": args.memory, "cluster.shard_cpus": 0, "store.eviction": "lru",
        **({} if args.socket_buffer is None else {"cluster.shard_socket_buffer_bytes": args.socket_buffer}),
    })
    deployment = deploy(config)
    ctx = mp.get_context("spawn")
    go, stop, done, failed = ctx.Event(), ctx.Event(), ctx.Value("l", 0), ctx.Value("l", 0)
    workers = [ctx.Process(target=_prefill_worker, args=(deployment.endpoint, ns, i, args.prefill, go, stop, done,
                                                         failed, args.prefill_nice, args.prefill_rate,
                                                         args.clients), daemon=True)
               for i in range(args.clients)]
    rows: list[tuple[int, str, dict[str, float]]] = []
    try:
        with Client(deployment.endpoint, timeout_s=60.0) as client:
            client.register(ns, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                            head_dim=layout.head_dim)
            for w in workers:
                w.start()
            shape = (layout.num_layers, 1, layout.num_kv_heads, layout.head_dim)
            step = np.random.default_rng(99).standard_normal(shape, dtype=np.float32).astype(np.float16)
            lengths = dict.fromkeys(range(SEQS), 0)
            for s in lengths:
                client.append(ns, f"decode-{s}", step, step)
                lengths[s] = 1
            print(f"\n## Decode-step latency under mixed load: {args.shards} shards, 7B-class layout, one token "
                  f"all layers ({step.nbytes * 2 >> 10} KiB) per append; loaded = {args.clients} other clients "
                  f"each appending {args.prefill}-token chunks ({step.nbytes * 2 * args.prefill >> 20} MiB), "
                  f"reading them back and dropping them ("
                  + (f"{args.prefill_rate:g} chunks/s in all, " if args.prefill_rate else "back to back, ")
                  + f"prefill clients at nice {args.prefill_nice}; shard "
                  f"socket buffers {args.socket_buffer or 'of the loopback default'})\n")
            print("| round | load | decode appends | p50 ms | p99 ms | p999 ms | max ms | prefill chunks/s |")
            print("|---|---|---|---|---|---|---|---|")
            for rnd in range(2 * args.decode_rounds):
                loaded = rnd % 2 == 1
                if loaded:
                    go.set()
                    time.sleep(1.0)  # the prefill clients are under way
                before = done.value
                t_round = time.perf_counter()
                lat = decode_steps(client, ns, step, lengths, args.decode_seconds, DECODE_MAX_TOKENS)
                chunks_per_s = (done.value - before) / (time.perf_counter() - t_round)
                go.clear()
                a = np.array(lat)
                r = {"n": len(a), "p50": np.percentile(a, 50) * 1e3, "p99": np.percentile(a, 99) * 1e3,
                     "p999": np.percentile(a, 99.9) * 1e3, "max": a.max() * 1e3, "chunks": chunks_per_s}
                kind = "loaded" if loaded else "quiet"
                rows.append((rnd, kind, r))
                print(f"| {rnd} | {kind} | {r['n']} | {r['p50']:.2f} | {r['p99']:.2f} | {r['p999']:.2f} | "
                      f"{r['max']:.1f} | {r['chunks']:.1f} |", flush=True)
                if loaded:
                    time.sleep(2.0)  # the prefill clients finish their chunk in progress
            for kind in ("quiet", "loaded"):
                sel = [r for _, k, r in rows if k == kind]
                med = {key: statistics.median(r[key] for r in sel) for key in ("n", "p50", "p99", "p999", "max",
                                                                                "chunks")}
                print(f"| median | {kind} | {med['n']:.0f} | {med['p50']:.2f} | {med['p99']:.2f} | "
                      f"{med['p999']:.2f} | {med['max']:.1f} | {med['chunks']:.1f} |")
            shards = [st for st in client.shard_stats() if "server_requests" in st]
            counters = {key: sum(int(st.get(f"server_{key}", 0)) for st in shards)
                        for key in ("busy", "replies_dropped", "peers_cut")}
            print(f"\nfailed prefill chunks: {failed.value}; the shards' busy replies {counters['busy']}, "
                  f"replies dropped {counters['replies_dropped']}, peers cut {counters['peers_cut']}")
    finally:
        stop.set()
        go.set()
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
        teardown(ns)


def _wire_bench(args: argparse.Namespace) -> None:
    wire = REPO / "bench" / "wire.py"
    if not wire.exists():
        print("\n(bench/wire.py not present: single-process wire bench skipped)")
        return
    print("\n## Single-process wire bench (bench/wire.py" + (" --quick" if args.quick else "") + ")\n", flush=True)
    cmd = [sys.executable, str(wire)] + (["--quick"] if args.quick else [])
    subprocess.run(cmd, check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: short, small")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--memory", default="2GiB")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--interval", type=float, default=0.1, help="report interval of the control part")
    parser.add_argument("--no-wire", action="store_true", help="skip bench/wire.py")
    parser.add_argument("--decode-only", action="store_true",
                        help="only part 3: decode-step latency while other clients prefill and read")
    parser.add_argument("--decode-seconds", type=float, default=None, help="length of one round of part 3")
    parser.add_argument("--decode-rounds", type=int, default=None, help="rounds of each kind (quiet, loaded)")
    parser.add_argument("--prefill-nice", type=int, default=0,
                        help="run part 3's prefill clients at this nice value: on one machine their CPU competes "
                             "with the shards' and the decode client's, as it would not from other machines")
    parser.add_argument("--prefill-rate", type=float, default=0.0, metavar="CHUNKS_PER_S",
                        help="part 3's prefill chunks per second, all clients together (default 0: back to back, "
                             "which keeps every CPU of this machine busy)")
    parser.add_argument("--socket-buffer", default=None, metavar="SIZE",
                        help="part 3's cluster.shard_socket_buffer_bytes, e.g. 256KiB, or 0 for the system's "
                             "autotuned buffers (default: unset, 256 KiB for these loopback shards)")
    parser.add_argument("--namespaces", type=int, default=0, metavar="N",
                        help="only: register N namespaces one at a time and report the cost as they accumulate")
    args = parser.parse_args()
    if args.prefill_rate < 0:
        parser.error(f"--prefill-rate must be 0 (back to back) or more, got {args.prefill_rate:g}")
    args.seconds = args.seconds or (3.0 if args.quick else 15.0)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.prefill, args.decode = 512, 32
    args.decode_seconds = args.decode_seconds or (3.0 if args.quick else 10.0)
    args.decode_rounds = args.decode_rounds or (1 if args.quick else 3)
    if args.quick:
        args.clients = min(args.clients, 2)
    import ray

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, object_store_memory=128 << 20,
             logging_level=logging.WARNING, log_to_driver=False)
    try:
        print(f"# kvd cluster bench ({'quick' if args.quick else 'full'}), {os.cpu_count()} CPUs")
        if args.namespaces:
            from namespaces import namespaces_only  # bench/namespaces.py

            namespaces_only(args.namespaces, args.shards)
            return
        if not args.decode_only:
            _throughput(args)
            _control_latency(args)
        _decode_latency(args)
    finally:
        ray.shutdown()
    if not args.no_wire and not args.decode_only and not args.namespaces:
        _wire_bench(args)


if __name__ == "__main__":
    main()
