"""The disk tier under faults, with real processes and real filesystems: a writer killed with SIGKILL at random
moments (mid-spill, mid-eviction, mid-removal), then restarted on the same directory, must serve every sequence
whole and bit-exact, shorter (a later append lost), or not at all, never wrong; a filesystem that fills gives
explicit errors while the store keeps serving what it holds."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvd.errors import OutOfMemory, UnknownSequence
from kvd.store import Store

NS = "m"
L, H, D, P = 2, 2, 32, 16
FULL = 160  # tokens each sequence may reach

pytestmark = pytest.mark.integration


def full(seq: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seq)
    return (rng.standard_normal((L, FULL, H, D)).astype(np.float16),
            rng.standard_normal((L, FULL, H, D)).astype(np.float16))


# The writer: appends 40 tokens to a new sequence and 30 more to an older one, drops a few, in a store whose
# memory holds a few sequences and whose disk holds dozens: it spills, takes sequences back, and forgets from
# disk all the time. It starts on whatever the directory holds. Its data is full(seq)[:, :n].
WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_disk_faults import full, NS, L, H, D, P, FULL
    from kvd.store import Store
    s = Store(256 << 10, page_tokens=P, disk_path={path!r}, disk_bytes=2 << 20, max_level={level!r})
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    s.set_level({level!r}, 1)
    first = {first}
    print("ready", flush=True)
    lens = {{}}
    told = False
    for n in range(first, first + 100000):
        k, v = full(n)
        s.append(NS, n, k[:, :40], v[:, :40])
        lens[n] = 40
        if not told and s.stats()["disk_writes"]:
            print("spilling", flush=True)
            told = True
        old = n - 1 - (n * 7919) % min(n - first + 1, 25)
        if old in lens and lens[old] + 30 <= FULL:
            k, v = full(old)
            s.append(NS, old, k[:, lens[old]:lens[old] + 30], v[:, lens[old]:lens[old] + 30])
            lens[old] += 30
        if n % 11 == 0 and n - 3 in lens:
            s.drop(NS, n - 3)
            lens.pop(n - 3, None)
""")


def expected(level: str, seq: int, n: int) -> np.ndarray:
    """What a get of the first ``n`` tokens of ``seq`` returns when stored at ``level`` (pages are encoded row by
    row, so it does not depend on how the tokens were appended)."""
    ref = Store(64 << 20, page_tokens=P, max_level=level)
    ref.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    ref.set_level(level, 1)
    k, v = full(seq)
    ref.append(NS, seq, k[:, :n], v[:, :n])
    return ref.get_packed(NS, seq)


@pytest.mark.parametrize("level", ["fp16", "q4"])
def test_sigkill_at_any_moment_never_makes_a_sequence_wrong(tmp_path, level):
    path = str(tmp_path / "disk")
    tests = os.path.dirname(__file__)
    rnd = random.Random(7)
    first = 0
    checked = 0
    for _ in range(6):
        code = WRITER.format(tests=tests, path=path, level=level, first=first)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready", proc.stderr.read()
            assert proc.stdout.readline().strip() == b"spilling", proc.stderr.read()  # type: ignore[union-attr]
            try:
                proc.wait(timeout=rnd.uniform(0.05, 1.0))
                pytest.fail(f"the writer ended by itself: {proc.stderr.read()!r}")  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        s = Store(256 << 10, page_tokens=P, disk_path=path, disk_bytes=2 << 20, max_level=level)
        st = s.stats()
        assert st["recovery_dropped_files"] == 0  # a killed writer leaves whole files (and temporary ones)
        seen = sorted(k[1] for k in s._disk._index.entries)  # noqa: SLF001 - the recovered index
        assert seen, "nothing reached the disk before the kill"
        for seq in seen:
            got = s.get_packed(NS, seq)
            n = got.shape[2]
            assert n in range(40, FULL + 1, 30), n
            assert np.array_equal(got, expected(level, seq, n)), (seq, n)
            checked += 1
        with pytest.raises(UnknownSequence):
            s.get(NS, max(seen) + 10**6)
        first = max(seen) + 1000  # the next writer appends new sequences beside the recovered ones
        s.close(persist=False)
    assert checked > 20


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MiB tmpfs (needs root, as CI runs)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("mounting a tmpfs needs root, which CI has")
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def kv(seq: int, t: int = 64) -> tuple[np.ndarray, np.ndarray]:
    k, v = full(seq)
    return k[:, :t], v[:, :t]


@pytest.mark.parametrize("eviction", ["lru", "none"])
def test_a_full_filesystem_gives_explicit_errors_and_the_store_keeps_serving(small_fs, eviction):
    s = Store(256 << 10, page_tokens=P, disk_path=small_fs, disk_bytes=64 << 20, max_level="fp16",
              eviction=eviction)
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    held = []
    refused = None
    for seq in range(200):
        try:
            s.append(NS, seq, *kv(seq))
            held.append(seq)
        except OutOfMemory as exc:
            refused = str(exc)
            break
        s.flush(5)
    st = s.stats()
    assert st["disk_errors"] > 0 and "No space left" in st["disk_last_error"]
    if eviction == "none":
        assert refused is not None and "No space left" in refused
    else:
        assert refused is None and st["spill_overflows"] > 0
    # every sequence still known reads back exactly as appended: on disk, pending in memory, or in RAM
    known = [seq for seq in held if s.lengths(NS, [seq])[0] is not None]
    assert len(known) > 10
    for seq in known:
        k, v = kv(seq)
        got_k, got_v = s.get(NS, seq)
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v), seq
    s.close(persist=False)
