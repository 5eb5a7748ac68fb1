"""The disk tier of a store (kvd.store.spill, kvd.store.disk) on a real filesystem: spill instead of forgetting,
reads served from disk bit-exact at every level, appends that take a sequence back, the disk budget, restarts
on the same directory, damaged files, and errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvd import pages
from kvd.errors import ConfigError, CorruptPage, OutOfMemory, UnknownSequence
from kvd.store import OnDisk, Store
from kvd.store.disk import files

NS = "m"
MiB = 1 << 20
L, H, D, P = 2, 2, 64, 16
SEQ_BYTES_FP16 = 4 * L * H * D * 64  # fp16 keys and values of a 64-token sequence: 64 KiB


def kv(t: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((L, t, H, D)) * 2
    k[..., 3] *= 8
    return k.astype(np.float16), rng.standard_normal((L, t, H, D)).astype(np.float16)


def make(path: str, capacity: int = 256 << 10, disk: int = 64 * MiB, **opts) -> Store:
    s = Store(capacity, page_tokens=P, disk_path=path, disk_bytes=disk, **opts)
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    return s


def fill(s: Store, n: int, t: int = 70, seed0: int = 0) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for i in range(seed0, seed0 + n):
        k, v = kv(t, i)
        s.append(NS, i, k, v)
        out[i] = (k, v)
    return out


def reference(data: dict, level: str, **opts) -> Store:
    """The same appends in a store large enough for all of them, at the same level: what a get must equal."""
    ref = Store(512 * MiB, page_tokens=P, **opts)
    ref.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    ref.set_level(level, 1)
    for i, (k, v) in data.items():
        ref.append(NS, i, k, v)
    return ref


@pytest.mark.parametrize("level,eight_bit", [("fp16", "q8"), ("q8", "q8"), ("fp8", "fp8_e4m3"), ("q4", "q8")])
def test_full_store_spills_instead_of_forgetting_and_reads_back_bit_exact(tmp_path, level, eight_bit):
    s = make(str(tmp_path), max_level=level, eight_bit=eight_bit)
    s.set_level(level, 1)
    data = fill(s, 40)
    st = s.stats()
    assert st["evictions"] == 0 and st["spills"] > 0 and st["disk_sequences"] == st["spills"]
    assert st["sequences"] + st["disk_sequences"] == 40
    assert s.flush()
    assert s.stats()["disk_pending_bytes"] == 0 and len(files.scan(str(tmp_path))) == s.stats()["disk_sequences"]
    ref = reference(data, level, eight_bit=eight_bit)
    for i in range(40):
        k, v = s.get(NS, i)
        rk, rv = ref.get(NS, i)
        assert np.array_equal(k, rk) and np.array_equal(v, rv), i
        got = s.get_pages(NS, i, 5, 60, layers=[1])
        want = ref.get_pages(NS, i, 5, 60, layers=[1])
        assert [(a, b, bytes(c), bytes(d)) for a, b, c, d in got] == \
            [(a, b, bytes(c), bytes(d)) for a, b, c, d in want]
    assert s.stats()["disk_hits"] > 0 and s.stats()["disk_reads"] > 0
    s.close(persist=False)


def test_spilled_pages_are_stored_at_their_level(tmp_path):
    s = make(str(tmp_path))
    s.set_level("q4", 1)
    fill(s, 30)
    s.flush()
    st = s.stats()
    assert st["disk_bytes_by_level"].keys() <= {"q8", "q4"} and st["disk_bytes_by_level"]["q4"] > 0
    on_disk = [i for i in range(30) if s.explain(NS, i, 1, 40)["reasons"][0].startswith("on disk")]
    assert on_disk and s.explain(NS, on_disk[0], 1, 40)["level"] == "q4"
    first = s.explain(NS, on_disk[0], 0, 0)
    assert first["level"] == "q8" and "sink" in first["reasons"]  # the sink page: 8 bits at most
    s.close(persist=False)


def test_compression_comes_before_the_disk(tmp_path):
    s = make(str(tmp_path))  # level fp16 in force: an append that does not fit compresses first
    fill(s, 3)
    assert s.stats()["squeezes"] == 0 and s.stats()["level"] == "fp16"
    fill(s, 1, seed0=3)  # a fourth does not fit at fp16: it compresses, and nothing leaves memory
    st = s.stats()
    assert st["squeezes"] > 0 and st["level"] != "fp16" and st["spills"] == 0 and st["sequences"] == 4
    fill(s, 40, seed0=4)
    st = s.stats()
    assert st["spills"] > 0 and st["evictions"] == 0
    s.close(persist=False)


def test_append_to_a_spilled_sequence_takes_it_back_bit_exact(tmp_path):
    s = make(str(tmp_path))
    s.set_level("q4", 1)
    data = fill(s, 30)
    s.flush()
    victim = next(i for i in range(30) if s.explain(NS, i, 0, 1)["reasons"][0].startswith("on disk"))
    before_k, before_v = s.get(NS, victim)
    k2, v2 = kv(20, 999)
    assert s.append(NS, victim, k2, v2) == 90
    assert s.stats()["promotions"] == 1
    k, v = s.get(NS, victim)
    # the sealed rows come back as they were; the old hot tail's tokens are sealed with the new ones
    assert np.array_equal(k[:, :64], before_k[:, :64]) and np.array_equal(v[:, :64], before_v[:, :64])
    ref = reference({victim: data[victim]}, "q4")
    ref.append(NS, victim, k2, v2)
    rk, rv = ref.get(NS, victim)
    assert np.array_equal(k, rk) and np.array_equal(v, rv)
    assert "on disk" not in " ".join(s.explain(NS, victim, 0, 80)["reasons"])
    s.close(persist=False)


def test_reads_that_need_the_disk_say_so_when_disk_io_is_not_allowed(tmp_path):
    s = make(str(tmp_path))
    s.set_level("q4", 1)
    fill(s, 30)
    s.flush()
    victim = next(i for i in range(30) if s.explain(NS, i, 0, 1)["reasons"][0].startswith("on disk"))
    gets = s.stats()["gets"]
    with pytest.raises(OnDisk):
        s.get_packed(NS, victim, disk_io=False)
    with pytest.raises(OnDisk):
        s.get_pages_packed(NS, victim, disk_io=False)
    with pytest.raises(OnDisk):
        s.append(NS, victim, *kv(1, 5), disk_io=False)
    assert s.stats()["gets"] == gets and s.length(NS, victim) == 70  # nothing was done
    assert s.lengths(NS, [victim, 12345]) == [70, None]
    s.close(persist=False)


def test_the_disk_budget_forgets_its_least_recently_used(tmp_path):
    s = make(str(tmp_path), disk=300 << 10)
    s.set_level("q4", 1)
    fill(s, 60)
    s.flush()
    st = s.stats()
    assert st["disk_evictions"] > 0 and st["disk_used_bytes"] <= 300 << 10 and st["evictions"] == 0
    assert sum(size for _, size in files.scan(str(tmp_path))) <= 300 << 10
    with pytest.raises(UnknownSequence):
        s.get(NS, 0)  # the oldest went first
    assert s.length(NS, 59) == 70
    s.close(persist=False)


def test_eviction_none_refuses_only_when_the_disk_is_full_too(tmp_path):
    s = make(str(tmp_path), disk=200 << 10, eviction="none")
    s.set_level("q4", 1)
    with pytest.raises(OutOfMemory, match="disk"):
        fill(s, 80)
    st = s.stats()
    assert st["spills"] > 0 and st["disk_evictions"] == 0 and st["evictions"] == 0 and st["refusals"] == 1
    s.close(persist=False)


def test_a_restarted_store_serves_what_its_disk_holds(tmp_path):
    s = make(str(tmp_path), max_level="q8")
    s.set_level("q8", 1)
    data = fill(s, 30)
    on_disk = {i for i in range(30) if s.explain(NS, i, 0, 1)["reasons"][0].startswith("on disk")}
    s.close(persist=False)  # what was in RAM is lost, as in a crash
    s2 = Store(256 << 10, page_tokens=P, disk_path=str(tmp_path), disk_bytes=64 * MiB)
    assert s2.stats()["recovered_sequences"] == len(on_disk) > 0
    ref = reference(data, "q8")
    for i in range(30):
        if i in on_disk:
            assert np.array_equal(s2.get(NS, i)[0], ref.get(NS, i)[0])  # the namespace came back with it
        else:
            with pytest.raises(UnknownSequence):
                s2.get(NS, i)
    s2.close(persist=True)  # a clean stop writes RAM out too
    s3 = Store(256 << 10, page_tokens=P, disk_path=str(tmp_path), disk_bytes=64 * MiB)
    assert all(s3.length(NS, i) == 70 for i in on_disk)
    s3.close(persist=False)
    s4 = Store(256 << 10, page_tokens=P, disk_path=str(tmp_path), disk_bytes=64 * MiB, disk_fresh=True)
    assert s4.stats()["disk_sequences"] == 0 and files.scan(str(tmp_path)) == []
    s4.close(persist=False)


def test_a_clean_stop_persists_ram_and_a_restart_serves_all_of_it(tmp_path):
    s = make(str(tmp_path), capacity=64 * MiB)
    data = fill(s, 5)
    assert s.stats()["spills"] == 0
    s.close()
    s2 = Store(64 * MiB, page_tokens=P, disk_path=str(tmp_path), disk_bytes=64 * MiB)
    for i, (k, v) in data.items():
        got_k, got_v = s2.get(NS, i)
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)  # fp16: the tokens themselves
    s2.close(persist=False)


def test_a_restart_with_other_page_geometry_drops_what_it_cannot_read(tmp_path):
    s = make(str(tmp_path), capacity=64 * MiB)
    fill(s, 3)
    s.close()
    s2 = Store(64 * MiB, page_tokens=2 * P, disk_path=str(tmp_path), disk_bytes=64 * MiB)
    assert s2.stats()["recovery_dropped_files"] == 3 and s2.stats()["disk_sequences"] == 0
    s2.close(persist=False)


def test_a_second_process_cannot_take_the_same_disk(tmp_path):
    s = make(str(tmp_path))
    with pytest.raises(ConfigError, match="in use"):
        make(str(tmp_path))
    s.close(persist=False)
    with pytest.raises(ConfigError, match="disk_path"):
        Store(MiB, disk_bytes=MiB)


def _spilled_file(s: Store, tmp_path) -> tuple[int, str]:
    s.flush()
    victim = next(i for i in range(30) if s.explain(NS, i, 0, 1)["reasons"][0].startswith("on disk"))
    from kvd.store.disk.tier import file_name

    return victim, os.path.join(str(tmp_path), file_name(NS, victim))


@pytest.mark.parametrize("where", ["page", "trailer", "header", "truncated"])
def test_a_damaged_file_is_an_error_and_is_dropped_never_data(tmp_path, where):
    s = make(str(tmp_path))
    s.set_level("q4", 1)
    fill(s, 30)
    victim, path = _spilled_file(s, tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if where == "truncated":
            f.truncate(size - 100)
        else:
            f.seek({"page": size // 2, "trailer": size - 2 * L * pages.nbytes("fp16", 6, H, D, role="key") - 20,
                    "header": 40}[where])
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    if where == "header":  # a header is read at start: a restart drops the file
        s.close(persist=False)
        s = make(str(tmp_path))
        assert s.stats()["recovery_dropped_files"] == 1
    else:
        with pytest.raises((CorruptPage, OSError)):
            s.get(NS, victim)
        assert s.stats()["disk_corrupt"] + s.stats()["disk_errors"] >= 1
    with pytest.raises(UnknownSequence):
        s.get(NS, victim)
    s.flush()
    assert not os.path.exists(path)
    s.close(persist=False)


def test_a_drop_of_a_spilled_sequence_removes_its_file(tmp_path):
    s = make(str(tmp_path))
    s.set_level("q4", 1)
    fill(s, 30)
    victim, path = _spilled_file(s, tmp_path)
    assert os.path.exists(path)
    assert s.drop(NS, victim) is True and s.drop(NS, victim) is False
    s.flush()
    assert not os.path.exists(path)
    with pytest.raises(UnknownSequence):
        s.length(NS, victim)
    s.close(persist=False)


def test_a_shards_store_takes_its_disk_from_the_settings_and_fresh_empties_it_once(tmp_path):
    """kvd.cluster.shard: disk_bytes over the shards, DIR/<namespace>/<shard id>, and `kvd up --fresh` empties a
    disk once per deployment: a shard Ray restarts with the same arguments keeps what its disk holds by then."""
    from kvd.cluster.shard import _open_store
    from kvd.config import load_config

    config = load_config(None, overrides={"cluster.disk_bytes": "64MiB", "cluster.disk_path": str(tmp_path),
                                          "cluster.shards": 2, "cluster.memory_bytes": "2MiB"})
    s = _open_store("shard-1", config, None)
    st = s.stats()
    assert st["disk_capacity_bytes"] == 32 << 20 and st["disk_path"] == str(tmp_path / "kvd" / "shard-1")
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    s.append(NS, 1, *kv(20, 1))
    s.close()  # a clean stop: written out
    s = _open_store("shard-1", config, "deploy-A")  # `kvd up --fresh`
    assert s.stats()["disk_sequences"] == 0
    s.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
    s.append(NS, 2, *kv(20, 2))
    s.close()
    s = _open_store("shard-1", config, "deploy-A")  # Ray restarts the shard: same token, the disk stays
    assert s.lengths(NS, [1, 2]) == [None, 20]
    s.close(persist=False)
    off = _open_store("shard-0", load_config(None, overrides={"cluster.memory_bytes": "2MiB"}), None)
    assert off.stats()["disk_capacity_bytes"] == 0


def test_files_move_more_buffers_than_one_system_call_takes(tmp_path):
    """kvd.store.disk.files: a 7B-class sequence of 4,096 tokens is 2,048 records, more than IOV_MAX."""
    rng = np.random.default_rng(3)
    chunks = [rng.integers(0, 255, int(n), np.uint8).tobytes() for n in rng.integers(1, 3000, 1500)]
    path = str(tmp_path / "x.kvs")
    assert files.write_file(path, chunks) == sum(map(len, chunks))
    back = [bytearray(len(c)) for c in chunks]
    files.read_into(path, 0, back)
    assert [bytes(b) for b in back] == chunks
    with pytest.raises(EOFError):
        files.read_into(path, 10, back)  # the file ends before the buffers are full
    assert files.scan(str(tmp_path)) == [(path, os.path.getsize(path))]


def test_a_store_reports_every_disk_key_the_status_view_reads(tmp_path):
    """tests/unit/test_status_view.py draws the disk table and the exporter from these keys (its DISK)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from test_status_view import DISK

    s = make(str(tmp_path))
    fill(s, 30)
    s.flush()
    s.get(NS, 0)
    stats = s.stats()
    s.close(persist=False)
    assert set(DISK) <= set(stats)
    assert all(type(stats[k]) is type(v) for k, v in DISK.items()), [k for k, v in DISK.items()
                                                                      if type(stats[k]) is not type(v)]


def test_a_sink_row_spilled_at_fp16_and_taken_back_is_compacted_to_the_8_bit_rung_and_no_further(tmp_path):
    s = make(str(tmp_path), max_level="fp16")  # full at fp16: it spills instead of compressing
    fill(s, 30)
    s.flush()
    victim = next(i for i in range(30) if s.explain(NS, i, 0, 1)["reasons"][0].startswith("on disk"))
    assert s.explain(NS, victim, 0, 1)["level"] == "fp16"
    s.append(NS, victim, *kv(2, 999))  # taken back into memory
    assert "on disk" not in s.explain(NS, victim, 0, 1)["reasons"][0]
    s.set_level("q4", 1)
    s.compact(1 << 30)
    assert s.stats()["compaction_backlog_bytes"] == 0
    levels = [s.explain(NS, victim, 0, r * P)["level"] for r in range(4)]
    assert levels == ["q8", "q4", "q4", "q4"]
    ns = s._ns[NS]
    for i in range(30):
        s.drop(NS, i)
    assert not any(ns.backlog.values()) and not any(ns.sink_backlog.values())
    s.close(persist=False)
