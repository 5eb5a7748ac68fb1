"""The disk tier: capacity beyond RAM, disk bandwidth against the raw filesystem, decode steps while spills and
disk reads run, and a warm restart after SIGKILL. In-process stores on the machine's real disk.

    python bench/tiers.py                 # every table (about 3 minutes on 2 cores)
    python bench/tiers.py --only restart  # one of: capacity, bandwidth, hol, engine, restart
    python bench/tiers.py --restart-gib 2 --dir /mnt/nvme/kvd-bench

1. Capacity: 256-token sequences of the 7B-class layout (32 layers, 8 KV heads, head_dim 128) appended until
   the first eviction, with RAM R and disk D, against RAM alone (same R) and against fp16 alone (same R, no
   compression), in the same run. The goal: tokens held >= 0.95 x what R + D hold at the most compact level
   (q4), i.e. RAM alone's q4 tokens x (R + D) / R.
2. Bandwidth: one spilled 256-token sequence of the 7B-class layout read back from its file with the page cache
   dropped (posix_fadvise DONTNEED after fsync), the tier's verified read alone (pread into page records + every
   page's checksum, as a pages get needs) and a whole fp16 get (read + decode, which checks each page as it
   decodes it), against a raw sequential read of a file of the same size on the same filesystem into a new
   buffer, dropped the same way, in the same run; medians of repetitions. Also in fp16-
   equivalent bytes (what the read delivers / time). Spill writes: N sequences spilled and flushed then
   fsynced, against writing the same bytes as N files and fsyncing them.
3. No head-of-line blocking: one thread makes decode-step appends (one token, every layer) to a sequence held in
   RAM, while another appends 256-token sequences into a full store (each append spills one) and reads spilled
   ones back from disk; decode p50/p99 against the same background with no disk tier (the full store forgets
   instead) and against no background.
4. Storage engine: the same records written and read back cold through plain files (the tier's own
   :mod:`kvd.store.disk.files`: one file per sequence, pwritev + rename, preadv into page records) and through
   LMDB (``lmdb`` 3.x, pip-installed into this venv if missing; one key per sequence, one transaction per
   write, ``sync=False`` as the tier does not fsync either; a read copies the value out of the map into page
   records, which the decoder needs), against a raw sequential read in the same run.
5. Warm restart: a child process fills a disk tier with >= --restart-gib GiB of q4 sequences and is killed with
   SIGKILL; a new store on the directory rebuilds its index (seconds, and per GiB), serves its first get, and
   every sequence is read back and compared bit for bit with what it held.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.errors import UnknownSequence  # noqa: E402
from kvd.store import Store  # noqa: E402
from kvd.store.disk import files  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
LAYOUT = (32, 8, 128)
TOKENS = 256
# Where the bandwidth and engine tables' sequences start in their prompt: a 256-token chunk of a longer prompt
# (as the vLLM connector stores blocks), so no page of it is a sink kept at fp16.
POSITION = 1024


def data(seed: int, tokens: int = TOKENS, layout: tuple[int, int, int] = LAYOUT) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    layers, heads, dim = layout
    k = rng.standard_normal((layers, tokens, heads, dim)).astype(np.float16)
    k[..., 5] *= 8  # an outlier channel, as real keys have
    return k, rng.standard_normal((layers, tokens, heads, dim)).astype(np.float16)


def new_store(capacity: int, disk_dir: str | None = None, disk: int = 0, **opts) -> Store:
    s = Store(capacity, disk_path=disk_dir, disk_bytes=disk, **opts)
    s.register("m", num_layers=LAYOUT[0], num_kv_heads=LAYOUT[1], head_dim=LAYOUT[2])
    return s


def table(title: str, head: list[str], rows: list[list[object]]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))


# ------------------------------------------------------------------------------------------------ capacity

def held_before_first_eviction(s: Store, kv: tuple[np.ndarray, np.ndarray], limit: int = 10000) -> int:
    """Tokens held when an append first makes the store forget (RAM or disk); appends wait for the disk."""
    for n in range(limit):
        before = s.stats()
        s.append("m", n, *kv)
        s.flush()
        st = s.stats()
        if st["evictions"] > before["evictions"] or st.get("disk_evictions", 0) > before.get("disk_evictions", 0):
            return int(before["tokens"] + before.get("disk_tokens", 0))
    raise RuntimeError("no eviction within the limit")


def capacity(args: argparse.Namespace, root: str) -> None:
    ram, disk = args.ram_mib * MiB, args.disk_mib * MiB
    kv = data(1)
    fp16 = held_before_first_eviction(new_store(ram, max_level="fp16"), kv)
    ram_q4 = held_before_first_eviction(new_store(ram), kv)
    d = os.path.join(root, "capacity")
    s = new_store(ram, d, disk)
    tiers = held_before_first_eviction(s, kv)
    st = s.stats()
    s.close(persist=False)
    shutil.rmtree(d, ignore_errors=True)
    ideal = ram_q4 * (ram + disk) / ram
    table(f"Capacity: 256-token sequences of the 7B-class layout; R = {args.ram_mib} MiB, D = {args.disk_mib} MiB",
          ["store", "tokens held", "x fp16 alone", "/ (R+D at q4)"],
          [["fp16 alone (R)", fp16, "1.00", f"{fp16 / ideal:.3f}"],
           ["compressing, RAM alone (R)", ram_q4, f"{ram_q4 / fp16:.2f}", f"{ram_q4 / ideal:.3f}"],
           ["compressing + disk (R + D)", tiers, f"{tiers / fp16:.2f}", f"{tiers / ideal:.3f}"]])
    print(f"  disk: {st['disk_used_bytes'] / MiB:.1f} MiB of {disk / MiB:.0f} MiB used, "
          f"{st['disk_tokens']} tokens, "
          f"levels {st['disk_bytes_by_level']}; spill refusals {st['spill_refusals']}")


# ------------------------------------------------------------------------------------------------ bandwidth

def _raw_read(path: str, nbytes: int) -> float:
    """A raw sequential read of ``path`` into a new buffer (as the tier reads into new page records)."""
    files.drop_cache(path)
    t0 = time.perf_counter()
    buf = bytearray(nbytes)
    files.read_into(path, 0, [buf])
    return time.perf_counter() - t0


def bandwidth(args: argparse.Namespace, root: str) -> None:
    rows = []
    wrows = []
    for level in ("fp16", "q8", "q4"):
        d = os.path.join(root, f"bw-{level}")
        s = new_store(64 * GiB, d, 64 * GiB, max_level=level)
        s.set_level(level, 1)
        n_seq = args.write_seqs
        kvs = [data(i) for i in range(2)]
        for i in range(n_seq):
            s.append("m", i, *kvs[i % 2], position=POSITION)
        # spill writes: hand every sequence to the tier, time until it is on disk (flushed, then fsynced)
        t0 = time.perf_counter()
        with s._lock:  # noqa: SLF001 - a bench spills directly
            for i in range(n_seq):
                s._spill(s._seqs[("m", i)], wait_s=60)  # noqa: SLF001
        s.flush()
        paths = [p for p, _ in files.scan(d)]
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        t_spill = time.perf_counter() - t0
        total = sum(os.path.getsize(p) for p in paths)
        raw_dir = os.path.join(root, f"raw-{level}")
        os.makedirs(raw_dir, exist_ok=True)
        blob = np.random.default_rng(0).integers(0, 255, total // n_seq, np.uint8).tobytes()
        t0 = time.perf_counter()
        for i in range(n_seq):
            fd = os.open(os.path.join(raw_dir, str(i)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, blob)
            os.fsync(fd)
            os.close(fd)
        t_raw_w = time.perf_counter() - t0
        wrows.append([level, f"{total / n_seq / MiB:.1f}", f"{total / t_spill / 1e9:.2f}",
                      f"{total / t_raw_w / 1e9:.2f}", f"{t_raw_w / t_spill:.2f}"])
        # reads: the tier's verified read, a whole get, a raw read of a file of the same size
        entry = s._disk.get(("m", 0))  # noqa: SLF001
        assert entry is not None and entry.written
        raw_path = os.path.join(raw_dir, "0")
        fp16_bytes = 2 * kvs[0][0].nbytes
        t_load, t_get, t_raw = [], [], []
        for _ in range(args.reps):
            files.drop_cache(entry.path)
            t0 = time.perf_counter()
            s._disk.load(entry)  # noqa: SLF001
            t_load.append(time.perf_counter() - t0)
            files.drop_cache(entry.path)
            t0 = time.perf_counter()
            s.get_packed("m", 0)
            t_get.append(time.perf_counter() - t0)
            t_raw.append(_raw_read(raw_path, entry.nbytes))
        ld, gt, rw = (statistics.median(x) for x in (t_load, t_get, t_raw))
        rows.append([level, f"{entry.nbytes / MiB:.1f}", f"{entry.nbytes / rw / 1e9:.2f}",
                     f"{entry.nbytes / ld / 1e9:.2f}", f"{rw / ld:.2f}", f"{fp16_bytes / ld / 1e9:.2f}",
                     f"{fp16_bytes / ld / (entry.nbytes / rw):.2f}", f"{gt * 1e3:.1f}",
                     f"{fp16_bytes / gt / (entry.nbytes / rw):.2f}"])
        s.close(persist=False)
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(raw_dir, ignore_errors=True)
    table(f"Disk reads: one spilled 256-token 7B-class sequence, page cache dropped; medians of {args.reps}",
          ["level", "file MiB", "raw GB/s", "tier GB/s", "tier/raw", "fp16-eq GB/s", "fp16-eq/raw",
           "get ms", "get fp16-eq/raw"], rows)
    table(f"Spill writes: {args.write_seqs} sequences spilled, flushed and fsynced, against the same bytes "
          "written "
          "as files and fsynced", ["level", "MiB/seq", "spill GB/s", "raw GB/s", "spill/raw"], wrows)


# ------------------------------------------------------------------------------------------------ head of line

def _background(s: Store, kv: tuple[np.ndarray, np.ndarray], disk: bool, stop: threading.Event,
                done: list[int]) -> None:
    """Appends into a full store (each spills or forgets) and, with a disk, reads of long-spilled sequences."""
    n = 0
    while not stop.is_set():
        s.append("m", n, *kv)
        if disk and n > 40:
            try:
                s.get_packed("m", n - 40)  # long spilled: a disk read
            except UnknownSequence:
                pass
        n += 1
        done[0] = n


def hol(args: argparse.Namespace, root: str) -> None:
    layout_small = (32, 8, 128)
    one = data(7, 1)
    rows = []
    for mode in ("idle", "no disk (forgets)", "disk (spills + reads)"):
        d = os.path.join(root, "hol")
        disk = mode.startswith("disk")
        s = new_store(args.ram_mib * MiB, d if disk else None, 4 * GiB if disk else 0)
        s.set_level("q4", 1)
        s.append("m", "decode", *data(8, 100, layout_small))
        kv = data(9)
        stop = threading.Event()
        done = [0]
        if mode != "idle":
            for n in range(30):  # fill the store first
                s.append("m", 10**6 + n, *kv)
            th = threading.Thread(target=_background, args=(s, kv, disk, stop, done))
            th.start()
        lat = []
        t_end = time.perf_counter() + args.hol_seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            s.append("m", "decode", *one)
            lat.append(time.perf_counter() - t0)
            if s.length("m", "decode") > 4000:
                s.drop("m", "decode")
                s.append("m", "decode", *data(8, 100, layout_small))
            time.sleep(0.001)
        stop.set()
        if mode != "idle":
            th.join()
        st = s.stats()
        lat.sort()
        p99 = lat[int(0.99 * len(lat))]
        rows.append([mode, len(lat), f"{statistics.median(lat) * 1e6:.0f}", f"{p99 * 1e6:.0f}",
                     done[0], st.get("spills", 0), st.get("disk_reads", 0), st["evictions"]])
        s.close(persist=False)
        shutil.rmtree(d, ignore_errors=True)
    table(f"Decode-step appends (one token, 32 layers) during {args.hol_seconds:.0f} s of 256-token appends "
          "into a "
          f"full {args.ram_mib} MiB store at q4", ["background", "steps", "p50 us", "p99 us", "bg appends",
                                                  "spills", "disk reads", "evictions"], rows)


# ------------------------------------------------------------------------------------------------ engine

def _lmdb():  # type: ignore[no-untyped-def]
    try:
        import lmdb
    except ImportError:
        print("installing lmdb (pip) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "lmdb>=1.4"], check=True)
        import lmdb
    return lmdb


def engine(args: argparse.Namespace, root: str) -> None:
    lmdb = _lmdb()
    from kvd.codec import batch as page_batch

    s = new_store(64 * GiB, max_level="q4")
    s.set_level("q4", 1)
    s.append("m", 0, *data(0), position=POSITION)
    recs = [r for layer in s._seqs[("m", 0)].pages for r in layer]  # noqa: SLF001 - the records as spilled
    size = sum(len(r) for r in recs)
    n = args.write_seqs * 4
    rows = []
    d = os.path.join(root, "engine-files")
    os.makedirs(d)
    t0 = time.perf_counter()
    for i in range(n):
        files.write_file(os.path.join(d, f"{i}.kvs"), recs)
    os.sync()
    t_wf = time.perf_counter() - t0
    e = os.path.join(root, "engine-lmdb")
    env = lmdb.open(e, map_size=4 * n * size + GiB, sync=False, metasync=False, max_dbs=0)
    t0 = time.perf_counter()
    for i in range(n):
        with env.begin(write=True) as txn:
            txn.put(str(i).encode(), b"".join(recs))
    env.sync(True)
    os.sync()
    t_wl = time.perf_counter() - t0
    t_rf, t_rl, t_raw = [], [], []
    for rep in range(args.reps):
        i = rep % n
        path = os.path.join(d, f"{i}.kvs")
        files.drop_cache(path)
        t0 = time.perf_counter()
        out = [page_batch.new_record(len(r)) for r in recs]
        files.read_into(path, 0, out)
        t_rf.append(time.perf_counter() - t0)
        files.drop_cache(os.path.join(e, "data.mdb"))
        t0 = time.perf_counter()
        with env.begin(buffers=True) as txn:
            mv = memoryview(txn.get(str(i).encode()))
            out, off = [], 0
            for r in recs:
                b = page_batch.new_record(len(r))
                b[:] = mv[off : off + len(r)]
                out.append(b)
                off += len(r)
        t_rl.append(time.perf_counter() - t0)
        t_raw.append(_raw_read(os.path.join(d, f"{(i + 1) % n}.kvs"), size))
    env.close()
    raw = size / statistics.median(t_raw)
    rows.append(["plain files (chosen)", f"{n * size / t_wf / 1e9:.2f}",
                 f"{size / statistics.median(t_rf) / 1e9:.2f}",
                 f"{size / statistics.median(t_rf) / raw:.2f}"])
    rows.append([f"lmdb {lmdb.__version__}", f"{n * size / t_wl / 1e9:.2f}",
                 f"{size / statistics.median(t_rl) / 1e9:.2f}", f"{size / statistics.median(t_rl) / raw:.2f}"])
    rows.append(["raw sequential read", "", f"{raw / 1e9:.2f}", "1.00"])
    table(f"Storage engine: {n} q4 sequences of {size / MiB:.1f} MiB written (then synced), one read back cold; "
          f"medians of {args.reps}", ["engine", "write GB/s", "cold read GB/s", "read / raw"], rows)
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(e, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ restart

CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {bench!r})
    from tiers import data, new_store, GiB
    s = new_store(256 << 20, {path!r}, {disk}, max_level="q4")
    s.set_level("q4", 1)
    kvs = [data(i) for i in range(4)]
    n = 0
    while s.stats()["disk_used_bytes"] < {target}:
        s.append("m", n, *kvs[n % 4])
        n += 1
    s.flush()
    print(n, flush=True)
    sys.stdin.read()
""")


def restart(args: argparse.Namespace, root: str) -> None:
    d = os.path.join(root, "restart")
    target = int(args.restart_gib * GiB)
    code = CHILD.format(bench=str(Path(__file__).parent), path=d, disk=target + GiB, target=target)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    n = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    os.sync()
    for p, _ in files.scan(d):
        files.drop_cache(p)
    t0 = time.perf_counter()
    s = Store(256 << 20, disk_path=d, disk_bytes=target + GiB)
    t_index = time.perf_counter() - t0
    held = s.stats()["disk_sequences"]
    s.get_packed("m", held - 1 if ("m", held - 1) in s._disk._index.entries else next(  # noqa: SLF001
        k[1] for k in s._disk._index.entries))  # noqa: SLF001
    t_first = time.perf_counter() - t0
    ref = new_store(64 * GiB, max_level="q4")
    ref.set_level("q4", 1)
    want = []
    for i in range(4):
        ref.append("m", i, *data(i))
        want.append(ref.get_packed("m", i))
    exact = 0
    keys = list(s._disk._index.entries)  # noqa: SLF001
    t0 = time.perf_counter()
    for _, seq in keys:
        exact += bool(np.array_equal(s.get_packed("m", seq), want[seq % 4]))
    t_all = time.perf_counter() - t0
    gib = s.stats()["disk_used_bytes"] / GiB
    table(f"Warm restart after SIGKILL: {n} sequences appended, {held} on disk ({gib:.2f} GiB of q4 files), page "
          "cache dropped", ["index rebuilt s", "s per GiB", "first get served s", "read back bit-exact",
                            "reading all back s"],
          [[f"{t_index:.3f}", f"{t_index / gib:.3f}", f"{t_first:.3f}", f"{exact}/{len(keys)}", f"{t_all:.1f}"]])
    s.close(persist=False)
    shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--only", choices=["capacity", "bandwidth", "hol", "engine", "restart"])
    ap.add_argument("--dir", help="directory on the disk to measure (default: a temporary one under /var/tmp)")
    ap.add_argument("--ram-mib", type=int, default=256, help="RAM budget R of the capacity and HOL tables")
    ap.add_argument("--disk-mib", type=int, default=1024, help="disk budget D of the capacity table")
    ap.add_argument("--reps", type=int, default=7, help="repetitions of each read")
    ap.add_argument("--write-seqs", type=int, default=8, help="sequences spilled in the write table")
    ap.add_argument("--hol-seconds", type=float, default=8.0)
    ap.add_argument("--restart-gib", type=float, default=2.0, help="GiB on disk before the SIGKILL")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="kvd-tiers-", dir=args.dir or "/var/tmp")
    print(f"kvd disk tier bench in {root} ({os.uname().machine}, {os.cpu_count()} CPUs)")
    try:
        for name, fn in (("capacity", capacity), ("bandwidth", bandwidth), ("hol", hol), ("engine", engine),
                         ("restart", restart)):
            if args.only in (None, name):
                fn(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
