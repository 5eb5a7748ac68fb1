"""The paged KV store in-process: throughput, memory held per level, re-compression rate, real-KV error.

    python bench/store.py            # the full tables (about 2 minutes with compiled kernels)
    python bench/store.py --quick    # a smoke run with small sizes (well under a minute)
    python bench/store.py --only full   # only the appends to full stores
    python bench/store.py --only tail --against DIR   # the hot tail's cost against another kvd tree

1. Append and get throughput in GB/s of fp16 bytes (keys + values), medians over repetitions, per level, for
   the sample layout (30 layers, 3 KV heads, head_dim 64) and a 7B-class layout (32 layers, 8 KV heads,
   head_dim 128), next to numpy.copyto of the same bytes into a reused buffer and a plain copy into a fresh
   array (what get() has to do: it returns new arrays) in the same run; get_into decodes into reused buffers,
   the fair comparison with copyto. Appends come in 512-token chunks into a store in steady state (the previous
   sequence is dropped before the next is timed).
   Then appends to a full store (each one evicts, as in a serving cache's steady state), to full stores of
   growing capacity (an append must cost the same however many sequences are kept), and decode-step
   appends: one token of every layer at a time, median and mean us per append.
2. Tokens held per GiB at each level relative to fp16, for 4,096-token sequences with the default settings
   (sink page one rung less compact, no window): the ratio of used_bytes at fp16 to used_bytes at the level
   (metadata and page headers included on both sides), and against the raw fp16 bytes of the tokens. Then a
   prompt stored one 128-token block per sequence (what the vLLM connector does): every block at position 0, as
   before protocol 1.3 (each block's first page kept as a sink page), against each block at its prompt
   position.
3. Re-compression (compact) from fp16 to q4: GB/s of stored fp16 pages re-encoded.
5. The hot tail (``--only tail``): bytes held by a sequence of 1, 16 and 63 tokens (used_bytes of a store holding
   only it, less the namespace's charge), decode-step appends (one token, median and mean us, the mean carrying
   the appends that grow or seal the tail) and prefill appends (one append of a 200-token prompt: three pages
   sealed, an 8-token tail; median us). ``--against DIR`` runs the same measurements on the kvd source tree in
   DIR (built: a copy of a checkout's ``kvd/`` with its compiled modules) in alternating subprocesses, and
   gives each figure's ratio to it.
4. Attention error of the real sample read back through the store, sink and window on and off (sink 4: the
   default, the sink page one rung less compact; sink 4 fp16: ``sink_raw``):
   eps_O = ||softmax(q K^T / sqrt(d)) V - O|| / ||O||, causal, grouped-query (9 query heads share 3 KV heads),
   the last 256 queries, O from the unquantized keys (post-RoPE) and values; mean and worst over 30 layers.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def _tree() -> str:
    """The kvd source tree this process measures: this checkout's, or the one named by ``--tree`` (a child of
    ``--against``)."""
    if "--tree" in sys.argv:
        return sys.argv[sys.argv.index("--tree") + 1]
    return str(Path(__file__).resolve().parents[1])


sys.path.insert(0, _tree())

from kvd.codec import batch as page_batch  # noqa: E402
from kvd.codec import kernels  # noqa: E402
from kvd.evaluate import attention, sample_path  # noqa: E402
from kvd.store import Store  # noqa: E402
from kvd.store import pool as sp  # noqa: E402
from kvd.wire.sockets import tune_malloc  # noqa: E402

GiB = 1 << 30
LEVELS = ("fp16", "q8", "fp8_e4m3", "q4")
LAYOUTS = {"sample (30x3x64)": (30, 3, 64), "7B-class (32x8x128)": (32, 8, 128)}
CHUNK = 512


def make_store(level: str, layout: tuple[int, int, int], capacity: int = 64 * GiB, **opts) -> Store:
    """A store whose level seals ``level`` pages (fp8_e4m3 through eight_bit, as a deployment would)."""
    eight_bit = level if level.startswith("fp8") else "q8"
    s = Store(capacity, eight_bit=eight_bit, **opts)
    layers, heads, dim = layout
    s.register("m", num_layers=layers, num_kv_heads=heads, head_dim=dim)
    s.set_level({"fp16": "fp16", "q4": "q4"}.get(level, "q8"), 1)
    assert s.stats()["format"] == level
    return s


def random_kv(layout: tuple[int, int, int], tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    layers, heads, dim = layout
    rng = np.random.default_rng(seed)
    shape = (layers, tokens, heads, dim)
    return rng.standard_normal(shape, np.float32).astype(np.float16), rng.standard_normal(
        shape, np.float32
    ).astype(np.float16)


def median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------ 1. throughput


def _copyto(dk: np.ndarray, dv: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    np.copyto(dk, k)
    np.copyto(dv, v)


def _fresh_copy(k: np.ndarray, v: np.ndarray) -> None:
    k.copy()
    v.copy()


def _append_seq(s: Store, seq_id: int, k: np.ndarray, v: np.ndarray) -> None:
    for a in range(0, k.shape[1], CHUNK):
        s.append("m", seq_id, k[:, a : a + CHUNK], v[:, a : a + CHUNK])


def throughput(quick: bool) -> list[list[str]]:
    """Per layout and level: append and get GB/s next to the two copy baselines, each a median, the baselines
    re-measured next to every level (the machine is shared and noisy)."""
    rows = []
    for name, layout in LAYOUTS.items():
        tokens = (512 if quick else 4096) if layout[1] == 3 else (256 if quick else 1024)
        reps = 3 if quick else 5
        k, v = random_kv(layout, tokens)
        gb = 2 * k.nbytes / 1e9
        dk, dv = np.empty_like(k), np.empty_like(v)
        _copyto(dk, dv, k, v)  # fault the destination in once
        for level in LEVELS:
            s = make_store(level, layout)
            _append_seq(s, 0, k, v)  # warm: the pool and the allocator reach steady state
            app, get, into, copy, fresh = [], [], [], [], []
            for rep in range(1, reps + 1):
                s.drop("m", rep - 1)  # steady state: one sequence live, as in a serving store
                app.append(median_time(functools.partial(_append_seq, s, rep, k, v), 1))
                get.append(median_time(functools.partial(s.get, "m", rep), 1))
                into.append(median_time(functools.partial(s.get_into, "m", rep, dk, dv), 1))
                copy.append(median_time(functools.partial(_copyto, dk, dv, k, v), 1))
                fresh.append(median_time(functools.partial(_fresh_copy, k, v), 1))
            a_s, g_s, i_s, c_s, f_s = (statistics.median(x) for x in (app, get, into, copy, fresh))
            rows.append([
                name, str(tokens), level, f"{gb / a_s:.2f}", f"{gb / g_s:.2f}", f"{gb / i_s:.2f}",
                f"{gb / c_s:.2f}", f"{gb / f_s:.2f}", f"{c_s / a_s:.2f}x", f"{c_s / g_s:.2f}x",
                f"{c_s / i_s:.2f}x", f"{f_s / g_s:.2f}x",
            ])  # fmt: skip
            del s
    return rows


def _evicting_appends(s: Store, append: Callable[[int], tuple[object, np.ndarray, np.ndarray]], evicted: int,
                      n: int) -> tuple[float, float, float]:
    """Fill ``s`` until it has evicted ``evicted`` sequences, then time ``n`` appends, ``append(i)`` giving the
    i-th's (seq_id, keys, values), each next to a numpy.copyto of the same bytes: (median seconds per append,
    per copyto, evictions per append). A full store's steady state: every append evicts."""
    i = 0
    while s.stats()["evictions"] < evicted:
        s.append("m", *append(i))
        i += 1
    k, v = append(0)[1:]
    dk, dv = np.empty_like(k), np.empty_like(v)
    app, copy = [], []
    ev0 = s.stats()["evictions"]
    for _ in range(n):
        seq_id, kk, vv = append(i)
        app.append(median_time(functools.partial(s.append, "m", seq_id, kk, vv), 1))
        copy.append(median_time(functools.partial(_copyto, dk, dv, kk, vv), 1))
        i += 1
    st = s.stats()
    assert st["used_bytes"] <= st["capacity_bytes"]
    return statistics.median(app), statistics.median(copy), (st["evictions"] - ev0) / n


def full_store_appends(quick: bool) -> list[list[str]]:
    """Per level, fp16 and q4: 8 MiB appends (64 tokens of every layer of the 7B-class layout) to a 256 MiB store
    kept full, over 32 sequences in rotation, so that every append evicts the least recently used: a cache's
    steady state. Median us per append and GB/s, next to numpy.copyto of the same bytes in the same rounds."""
    rows = []
    layout, tokens, rotation = LAYOUTS["7B-class (32x8x128)"], 64, 32
    n = 40 if quick else 200
    inputs = [random_kv(layout, tokens, seed) for seed in range(4)]
    gb = 2 * inputs[0][0].nbytes / 1e9
    for level in ("fp16", "q4"):
        s = make_store(level, layout, capacity=256 << 20)
        a_s, c_s, per = _evicting_appends(s, lambda i: (i % rotation, *inputs[i % 4]), rotation, n)
        rows.append([level, f"{a_s * 1e6:.0f}", f"{gb / a_s:.2f}", f"{gb / c_s:.2f}", f"{c_s / a_s:.2f}x",
                     f"{per:.2f}"])
        del s
    return rows


def full_store_by_capacity(quick: bool) -> list[list[str]]:
    """1 MiB appends (256 tokens of one 7B-class layer, 8 KV heads x 128: a per-layer store's unit) to full fp16
    stores of growing capacity, every append evicting the least recently used sequence. A full store's append
    must cost the same however many sequences it keeps (an eviction must not rebuild the whole compaction log:
    docs/design.md). Median us per append, next to numpy.copyto of the same bytes."""
    rows = []
    layout, tokens = (1, 8, 128), 256
    caps = (64 << 20, 256 << 20) if quick else (256 << 20, 1 << 30, 4 << 30)
    n = 100 if quick else 400
    k, v = random_kv(layout, tokens)
    for cap in caps:
        s = make_store("fp16", layout, capacity=cap, max_level="fp16")
        a_s, c_s, per = _evicting_appends(s, lambda i: (i, k, v), 1, n)
        rows.append([f"{cap >> 20}", f"{s.stats()['sequences']}", f"{a_s * 1e6:.0f}", f"{c_s * 1e6:.0f}",
                     f"{c_s / a_s:.2f}x", f"{per:.2f}"])
        del s
    return rows


def decode_times(s: Store, layout: tuple[int, int, int], sequences: int) -> list[float]:
    """Seconds of each one-token append to ``sequences`` sequences of 256 tokens, each dropped when the next is
    full (steady state: buffers come from the pool); the first sequence, which warms the pool, is left out."""
    k, v = random_kv(layout, 1)
    times = []
    for seq in range(sequences):
        for _ in range(256):
            t0 = time.perf_counter()
            s.append("m", seq, k, v)
            times.append(time.perf_counter() - t0)
        if seq:
            s.drop("m", seq - 1)
    return times[256:]


def decode_steps(quick: bool) -> list[list[str]]:
    """Per layout, fp16 and q4: one-token appends (the decode step) to sequences of 256 tokens in steady state
    (each sequence dropped when full, so records come from the pool): median and mean us per append; the mean
    carries the 1-in-64 appends that seal a row of pages."""
    rows = []
    for name, layout in LAYOUTS.items():
        for level in ("fp16", "q4"):
            s = make_store(level, layout)
            times = decode_times(s, layout, 2 if quick else 8)
            med, mean = statistics.median(times) * 1e6, statistics.mean(times) * 1e6
            rows.append([name, level, f"{med:.1f}", f"{mean:.1f}"])
            del s
    return rows


# ------------------------------------------------------------------------------------------ 5. the hot tail

TAIL_LENGTHS = (1, 16, 63)
PROMPT = 200


def tail_round(quick: bool) -> dict[str, float]:
    """One round of the hot tail's measurements in this process (the tree on sys.path): ``{figure: value}``."""
    out: dict[str, float] = {}
    for name, layout in LAYOUTS.items():
        short = name.split(" ")[0]
        for n in TAIL_LENGTHS:
            s = make_store("fp16", layout)
            s.append("m", 1, *random_kv(layout, n))
            out[f"{short} bytes {n}"] = s.stats()["used_bytes"] - sp.namespace_meta_bytes(layout[0])
            del s
        s = make_store("fp16", layout)
        times = decode_times(s, layout, 2 if quick else 6)
        out[f"{short} decode median"] = statistics.median(times) * 1e6
        out[f"{short} decode mean"] = statistics.mean(times) * 1e6
        del s
        s = make_store("fp16", layout)
        k, v = random_kv(layout, PROMPT)
        times = []
        for seq in range(6 if quick else 30):
            t0 = time.perf_counter()
            s.append("m", seq, k, v)
            times.append(time.perf_counter() - t0)
            if seq:
                s.drop("m", seq - 1)
        out[f"{short} prefill median"] = statistics.median(times[1:]) * 1e6
        del s
    return out


def tail_table(quick: bool, against: str | None) -> None:
    """The hot tail's figures of this tree (medians over rounds), and with ``against`` the other tree's, measured
    in alternating subprocesses, and the ratio this / other."""
    rounds = 1 if quick else 5
    trees = [("this", _tree())] + ([("against", against)] if against else [])
    got: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    for r in range(rounds):
        for label, tree in trees if r % 2 == 0 else trees[::-1]:
            cmd = [sys.executable, __file__, "--tail-round", "--tree", tree] + (["--quick"] if quick else [])
            res = subprocess.run(cmd, check=True, capture_output=True, text=True)
            got[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
    med = {label: {key: statistics.median(x[key] for x in runs) for key in runs[0]} for label, runs in got.items()}
    header = ["figure", "this tree"] + (["against", "this / against"] if against else [])
    rows = []
    for key, value in med["this"].items():
        unit = "bytes" if " bytes " in key else "us"
        fmt = (lambda x: f"{x:,.0f}") if unit == "bytes" else (lambda x: f"{x:.1f}")
        row = [f"{key} ({unit})", fmt(value)]
        if against:
            base = med["against"][key]
            row += [fmt(base), f"{value / base:.3f}x"]
        rows.append(row)
    print(f"## The hot tail ({rounds} rounds, medians; against: {against or '-'})\n")
    table(header, rows)


# ------------------------------------------------------------------------------------------ 2. tokens per GiB


def tokens_per_gib(quick: bool) -> list[list[str]]:
    rows = []
    tokens = 4096
    for name, layout in LAYOUTS.items():
        # --quick keeps 2 layers: the ratio is per (sequence, layer) but for the per-sequence metadata
        lay = (2, *layout[1:]) if quick else layout
        k, v = random_kv(lay, tokens, seed=1)
        raw = 2 * k.nbytes
        used = {}
        for level in LEVELS:
            s = make_store(level, lay)
            s.append("m", 1, k, v)
            used[level] = s.stats()["used_bytes"] - sp.namespace_meta_bytes(lay[0])
            del s
        for level in LEVELS:
            rows.append(
                [
                    name + (" [2 layers]" if quick else ""),
                    level,
                    f"{used[level] / 1e6:.2f}",
                    f"{tokens * GiB / used[level]:,.0f}",
                    f"{used['fp16'] / used[level]:.3f}x",
                    f"{raw / used[level]:.3f}x",
                ]
            )
    return rows


def block_tokens_per_gib(quick: bool) -> list[list[str]]:
    """A prompt stored one 128-token block per sequence, as the vLLM connector stores it: each block at its
    position in the prompt (protocol 1.3), against every block a sequence of its own at position 0 (before)."""
    rows = []
    layout, blocks, bs = LAYOUTS["sample (30x3x64)"], (4 if quick else 16), 128
    k, v = random_kv(layout, blocks * bs, seed=3)
    used: dict[tuple[str, bool], int] = {}
    for level in LEVELS:
        for positioned in (False, True):
            s = make_store(level, layout)
            for b in range(blocks):
                sl = slice(b * bs, (b + 1) * bs)
                s.append("m", b, k[:, sl], v[:, sl], position=b * bs if positioned else None)
            used[level, positioned] = s.stats()["used_bytes"] - sp.namespace_meta_bytes(layout[0])
    for level in LEVELS:
        before, after = used[level, False], used[level, True]
        rows.append([level, f"{blocks} x {bs}", f"{blocks * bs * GiB / before:,.0f}",
                     f"{blocks * bs * GiB / after:,.0f}", f"{used['fp16', True] / after:.3f}x",
                     f"{before / after:.2f}x"])
    return rows


# ------------------------------------------------------------------------------------------ 3. re-compression


def recompression(quick: bool) -> list[list[str]]:
    rows = []
    for name, layout in LAYOUTS.items():
        tokens = 1024 if quick else 4096
        if layout[1] == 8:
            tokens //= 4
        k, v = random_kv(layout, tokens, seed=2)
        s = make_store("fp16", layout)
        s.append("m", 1, k, v)
        s.set_level("q4", 2)
        before = s.stats()
        t0 = time.perf_counter()
        while s.stats()["compaction_backlog_bytes"]:
            s.compact(8 << 20)  # bounded steps, as a server would call it between requests
        dt = time.perf_counter() - t0
        after = s.stats()
        done = after["recompressed_bytes"] - before["recompressed_bytes"]
        rows.append(
            [
                name,
                str(tokens),
                f"{done / 1e6:.1f}",
                f"{dt:.2f}",
                f"{done / dt / 1e9:.2f}",
                f"{(before['used_bytes'] - after['used_bytes']) / 1e6:.1f}",
            ]
        )
    return rows


# ------------------------------------------------------------------------------------------ 4. attention error


def attention_error(quick: bool) -> list[list[str]] | None:
    path = sample_path()
    if not path.exists():
        print(f"(real KV sample not found at {path}: attention error skipped)")
        return None
    with np.load(path, allow_pickle=False) as z:
        n = sum(1 for f in z.files if f.endswith("_v"))
        q = np.stack([z[f"L{i}_q"] for i in range(n)])
        k = np.stack([z[f"L{i}_k"] for i in range(n)])
        v = np.stack([z[f"L{i}_v"] for i in range(n)])
    layers, t, heads, dim = k.shape
    ref = [attention(q[i], k[i], v[i]) for i in range(layers)]
    configs = {"none": (0, 0, False), "sink 4": (4, 0, False), "sink 4 fp16": (4, 0, True),
               "window 128": (0, 128, False), "sink 4 + window 128": (4, 128, False)}
    if quick:
        configs = {"none": (0, 0, False), "sink 4": (4, 0, False)}
    levels: list[tuple[str, list[tuple[str, int]]]] = [
        (lv, [(lv, 1)]) for lv in ("q8", "fp8_e4m3", "fp8_e5m2", "q4")
    ]
    levels.append(("q8 -> q4 (re-compressed)", [("q8", 1), ("q4", 2)]))
    rows = []
    for label, steps in levels:
        for cname, (sink, window, sink_raw) in configs.items():
            first = steps[0][0]
            s = make_store(first, (layers, heads, dim), sink_tokens=sink, window_tokens=window, sink_raw=sink_raw)
            for a, b in ((0, 100), (100, 101), (101, t)):
                s.append("m", 1, k[:, a:b], v[:, a:b])
            for fmt, epoch in steps[1:]:
                s.set_level(fmt, epoch)
                s.compact(1 << 40)
            gk, gv = s.get("m", 1)
            errs = [
                float(np.linalg.norm(attention(q[i], gk[i], gv[i]) - ref[i]) / np.linalg.norm(ref[i]))
                for i in range(layers)
            ]
            rows.append([label, cname, f"{100 * np.mean(errs):.2f}%", f"{100 * np.max(errs):.2f}%"])
    return rows


# ------------------------------------------------------------------------------------------ main


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()


def full_table(quick: bool) -> None:
    print("## Appends to a full store (8 MiB each, 7B-class, 256 MiB store, LRU eviction; medians)\n")
    table(["level", "us per append", "GB/s", "copyto GB/s", "append / copyto", "evictions per append"],
          full_store_appends(quick))
    print("## Appends to full stores of growing capacity (1 MiB each, one 7B-class layer, fp16, LRU; medians)\n")
    table(["capacity MiB", "sequences kept", "us per append", "copyto us", "append / copyto",
           "evictions per append"], full_store_by_capacity(quick))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument(
        "--default-malloc", action="store_true",
        help="leave glibc's malloc as it is (by default the bench tunes it as a shard process does)",
    )  # fmt: skip
    ap.add_argument(
        "--one-thread", action="store_true",
        help="never split a large append or get over the codec's second thread (the default splits from 4 MiB)",
    )  # fmt: skip
    ap.add_argument("--only", choices=("full", "tail"),
                    help="only one table: full = appends to a full store, tail = the hot tail's cost")
    ap.add_argument("--against", metavar="DIR", help="with --only tail: a kvd source tree to compare with")
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # (read by _tree: the tree a --tail-round child measures)
    ap.add_argument("--tail-round", action="store_true", help=argparse.SUPPRESS)  # a child of --only tail
    args = ap.parse_args()
    if args.one_thread:
        page_batch.PARALLEL_MIN_BYTES = 1 << 62
    if args.tail_round:
        tune_malloc()
        print(json.dumps(tail_round(args.quick)))
        return
    t0 = time.perf_counter()
    # A shard's process recycles large buffers (ShardServer.start calls tune_malloc): measure the store there.
    tuned = not args.default_malloc and tune_malloc()
    print(
        f"kernels backend: {kernels.BACKEND}; batched page codec: {page_batch.ENABLED}; malloc tuned: {tuned}; "
        f"codec threads: {1 if args.one_thread else 2}; "
        "page_tokens 64, sink_tokens 4, window_tokens 0 (defaults)\n"
    )

    if args.only == "full":
        full_table(args.quick)
        return
    if args.only == "tail":
        tail_table(args.quick, args.against)
        return
    print("## Throughput (GB/s of fp16 keys + values; medians)\n")
    table(
        [
            "layout",
            "tokens",
            "level",
            "append",
            "get",
            "get_into (reused)",
            "copyto (reused)",
            "copy (fresh)",
            "append / copyto",
            "get / copyto",
            "get_into / copyto",
            "get / fresh copy",
        ],
        throughput(args.quick),
    )

    full_table(args.quick)
    print("## Decode-step appends (one token, every layer; us per append)\n")
    table(["layout", "level", "median", "mean"], decode_steps(args.quick))

    print("## Tokens held per GiB, 4,096-token sequences, default settings\n")
    table(
        ["layout", "level", "used MB / seq", "tokens per GiB", "vs fp16 store", "vs raw fp16 bytes"],
        tokens_per_gib(args.quick),
    )

    print("## Tokens held per GiB, a prompt stored one 128-token block per sequence (sample layout)\n")
    table(["level", "blocks", "tokens per GiB, every block at position 0", "... each at its prompt position",
           "vs fp16", "gain"], block_tokens_per_gib(args.quick))

    print("## Re-compression fp16 -> q4 (compact in 8 MiB steps)\n")
    table(["layout", "tokens", "fp16 MB re-encoded", "seconds", "GB/s", "MB freed"], recompression(args.quick))

    rows = attention_error(args.quick)
    if rows is not None:
        print("## Attention error of the real sample through the store (eps_O over 30 layers)\n")
        table(["level", "protection", "mean", "worst"], rows)
    print(f"(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
