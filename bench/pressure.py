"""Adaptive precision under real pressure: how much a kvd holds before it forgets, whether levels hold, and the
attention error of what comes back at each level reached.

Run: ``.venv/bin/python bench/pressure.py`` (about 3 minutes) or ``--quick``.

An embedded Ray runs a kvd of ``--shards`` shards sharing ``--memory`` (the issue's scenario: 512 MiB, 3 shards,
0.2 s reports). Clients write what an engine writes: 7B-class sequences (32 layers, 8 KV heads, head_dim 128;
128 KiB per token at fp16) of 256 tokens, the prompt as three 64-token appends and then 64 one-token decode
steps, one sequence after the other; and sequences of 1024 tokens in ``--long-memory`` (the first page of each
sequence holds the attention sinks and is kept 8-bit at q4, so short sequences cannot reach q4's 3x).

1. *Tokens held at the first forgetting*: the fill stops at the first eviction (``eviction = "lru"``) or refusal
   (``"none"``); the tokens the cluster holds then, over what the same fill holds under the ``fp16_only``
   policy profile, measured in the same run. ``steady``: a pause of one report interval after each sequence
   (the coordinator keeps up); ``fast``: no pause (faster than the report interval).
2. *Levels at a steady fill*: LRU, the steady pace, for ``--seconds`` after the first eviction; level changes
   and step downs per minute (from the coordinator's history), then every sequence dropped (a real drop in
   demand) and the step downs that follow.
3. *Attention error through the store*: the real SmolLM2-135M sample (``kvd.evaluate``) appended to a Store
   with the default protection, read back at each level the cluster reaches, including q4 reached by
   re-compressing q8 pages (what running ahead does); eps_O mean and worst over the layers.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvd.client import Client  # noqa: E402
from kvd.cluster.deploy import deploy, teardown  # noqa: E402
from kvd.config import load_config  # noqa: E402
from kvd.errors import OutOfMemory  # noqa: E402
from kvd.evaluate import eps_o, load_sample, sample_path  # noqa: E402
from kvd.store import Store  # noqa: E402

LAYERS, HEADS, DIM = 32, 8, 128
NS = "llama-7b"
CHUNK, DECODE = 64, 64


def _config(args: argparse.Namespace, ns: str, *, profile: str, eviction: str, memory: str = "") -> Any:
    return load_config(env={}, overrides={
        "cluster.namespace": ns, "cluster.port": 0, "cluster.shards": args.shards,
        "cluster.memory_bytes": memory or args.memory, "cluster.shard_cpus": 0,
        "cluster.report_interval_s": args.report_interval, "store.eviction": eviction,
        "policy.profile": profile, "store.warm_cache_bytes": "16MiB",
    })


class Writer:
    """Appends sequences as an engine does; remembers what it stored."""

    def __init__(self, client: Client, seq_tokens: int = 256, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.prompt_chunks = (seq_tokens - DECODE) // CHUNK
        self.client = client
        self.chunk = rng.standard_normal((LAYERS, CHUNK, HEADS, DIM), dtype=np.float32).astype(np.float16)
        self.step = self.chunk[:, :1].copy()
        self.stored: list[str] = []
        self.n = 0

    def sequence(self) -> None:
        seq = f"s-{self.n}"
        self.n += 1
        for _ in range(self.prompt_chunks):
            self.client.append(NS, seq, self.chunk, self.chunk)
        for _ in range(DECODE):
            self.client.append(NS, seq, self.step, self.step)
        self.stored.append(seq)


def _stats(client: Client) -> list[dict[str, Any]]:
    return [s for s in client.shard_stats() if isinstance(s, dict)]


def first_forgetting(args: argparse.Namespace, *, profile: str, eviction: str, pace_s: float, seq_tokens: int,
                     memory: str) -> dict[str, Any]:
    ns = f"bench-pressure-{profile}-{eviction}-{int(pace_s * 1000)}-{seq_tokens}"
    config = _config(args, ns, profile=profile, eviction=eviction, memory=memory)
    deployment = deploy(config)
    try:
        with Client(deployment.endpoint, timeout_s=30.0) as client:
            client.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
            writer = Writer(client, seq_tokens)
            refused = False
            while True:
                before = {s["shard_id"]: s["tokens"] for s in _stats(client)}
                try:
                    writer.sequence()
                except OutOfMemory:
                    refused = True
                stats = _stats(client)
                if refused or any(s["evictions"] for s in stats):
                    break
                time.sleep(pace_s)
            status = deployment.status()
            full = max(stats, key=lambda s: s["evictions"] + s["refusals"])
            return {  # what the cluster and the shard that forgot held before the sequence that made it forget
                "full_tokens": before[full["shard_id"]],
                "tokens": sum(before.values()),
                "sequences": writer.n - 1,
                "cluster_level": status["level"],
                "levels": ",".join(f"{s['level']}{'*' if s.get('ahead') else ''}" for s in stats),
                "bytes_by_level": _merge(s["bytes_by_level"] for s in stats),
            }
    finally:
        teardown(ns)


def _merge(dicts: Any) -> str:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return " ".join(f"{k}:{v / (1 << 20):.0f}MiB" for k, v in sorted(total.items()))


def steady(args: argparse.Namespace) -> dict[str, Any]:
    ns = "bench-pressure-steady"
    config = _config(args, ns, profile="default", eviction="lru")
    deployment = deploy(config)
    try:
        with Client(deployment.endpoint, timeout_s=30.0) as client:
            client.register(NS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
            writer = Writer(client)
            while not any(s["evictions"] for s in _stats(client)):
                writer.sequence()
                time.sleep(args.report_interval)
            start_epoch = deployment.status()["level_epoch"]
            t0 = time.monotonic()
            while time.monotonic() - t0 < args.seconds:
                writer.sequence()
                time.sleep(args.report_interval)
            minutes = (time.monotonic() - t0) / 60
            status = deployment.status()
            during = [h for h in status["history"] if h["epoch"] > start_epoch]
            stats = _stats(client)
            evictions = sum(s["evictions"] for s in stats)
            end_epoch = status["level_epoch"]
            for seq in writer.stored:  # demand falls: every sequence dropped
                client.drop(NS, seq)
            time.sleep(max(3.0, 15 * args.report_interval))
            after = [h for h in deployment.status()["history"] if h["epoch"] > end_epoch]
            return {
                "minutes": minutes,
                "changes_per_min": len(during) / minutes,
                "downs_per_min": sum(1 for h in during if _down(h)) / minutes,
                "level": status["level"], "levels": ",".join(s["level"] for s in stats),
                "evictions_per_min": evictions / minutes,
                "after_drop": " -> ".join(h["level"] for h in after) or "(none)",
                "reasons": [h["reason"] for h in status["history"]][-3:],
            }
    finally:
        teardown(ns)


_RANK = {"fp16": 0, "q8": 1, "fp8": 1, "q4": 2}


def _down(h: dict[str, Any]) -> bool:
    return _RANK[h["level"]] < _RANK[h["previous"]]


def quality() -> list[tuple[str, float, float]]:
    """eps_O of the real sample read back through a Store (default protection: a 4-token sink page)."""
    layers, _ = load_sample(sample_path())
    t, h, d = layers[0][1].shape
    k = np.stack([layer[1] for layer in layers])[:, :, :, :]
    v = np.stack([layer[2] for layer in layers])
    out = []
    for name, steps in (("fp16", ["fp16"]), ("q8", ["q8"]), ("q4", ["q4"]), ("q8 then q4 (re-compressed)",
                                                                           ["q8", "q4"])):
        store = Store(1 << 30)
        store.register("s", num_layers=len(layers), num_kv_heads=h, head_dim=d)
        store.set_level(steps[0], 1)
        store.append("s", 0, k, v)
        for epoch, level in enumerate(steps[1:], start=2):
            store.set_level(level, epoch)
            store.compact(1 << 40)
        kh, vh = store.get("s", 0)
        errs = [eps_o(q, k[i], v[i], kh[i], vh[i]) for i, (q, _, _) in enumerate(layers)]
        out.append((name, statistics.mean(errs), max(errs)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", default="512MiB", help="total memory for the 256-token sequences")
    parser.add_argument("--long-memory", default="2GiB", help="total memory for the 1024-token sequences")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--report-interval", type=float, default=0.2)
    parser.add_argument("--seconds", type=float, default=60.0, help="steady fill after the first eviction")
    parser.add_argument("--quick", action="store_true", help="shorter steady fill (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 10.0

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
             logging_level=logging.WARNING, log_to_driver=False)
    try:
        print(f"\n## Tokens held at the first eviction or refusal: {args.shards} shards, reports every "
              f"{args.report_interval} s, 7B-class sequences (64-token prompt appends, then 64 decode steps)\n")
        print("| sequence tokens | memory | eviction | fill | fp16 alone: tokens | default policy: tokens | "
              "x fp16 | the shard that forgot: x fp16 | cluster level | shard levels (* ahead) | pages by level |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        cases = [(256, args.memory, e, f, pace) for e in ("lru", "none")
                 for f, pace in (("steady", args.report_interval), ("fast", 0.0))]
        cases += [(1024, args.long_memory, e, "fast", 0.0) for e in ("lru", "none")]
        for tokens, memory, eviction, fill, pace in cases:
            kw = dict(eviction=eviction, pace_s=pace, seq_tokens=tokens, memory=memory)
            base = first_forgetting(args, profile="fp16_only", **kw)
            got = first_forgetting(args, profile="default", **kw)
            print(f"| {tokens} | {memory} | {eviction} | {fill} | {base['tokens']} | {got['tokens']} | "
                  f"{got['tokens'] / base['tokens']:.2f} | {got['full_tokens'] / base['full_tokens']:.2f} | "
                  f"{got['cluster_level']} | {got['levels']} | {got['bytes_by_level']} |", flush=True)

        print(f"\n## Levels at a steady fill (LRU, {args.seconds:.0f} s after the first eviction)\n")
        st = steady(args)
        print("| minutes | level changes / min | step downs / min | evictions / min | level at the end | "
              "after every sequence is dropped |")
        print("|---|---|---|---|---|---|")
        print(f"| {st['minutes']:.2f} | {st['changes_per_min']:.1f} | {st['downs_per_min']:.1f} | "
              f"{st['evictions_per_min']:.0f} | {st['level']} ({st['levels']}) | {st['after_drop']} |")
        for reason in st["reasons"]:
            print(f"\n- {reason}")
    finally:
        ray.shutdown()

    print("\n## Attention error of what comes back, per level (real SmolLM2-135M sample through a Store)\n")
    print("| level | eps_O mean | eps_O worst layer |")
    print("|---|---|---|")
    for name, mean, worst in quality():
        print(f"| {name} | {100 * mean:.2f}% | {100 * worst:.2f}% |")


if __name__ == "__main__":
    main()
