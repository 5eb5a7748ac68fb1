"""kvd.cli.status: what `kvd status` shows per shard, from plain stats dicts (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.cli.status import calibration_table, disk_table, imbalance, serving_table, shard_table, status_line
from kvd.cluster.metrics import StatusMetrics

pytestmark = pytest.mark.backend_independent  # kvd status tables from given figures: no kernel, no compiled module


def shard(level: str, pressure: float, **extra: object) -> dict:
    return {
        "level": level, "epoch": 2, "pressure": pressure, "used_bytes": int(pressure * 1000),
        "capacity_bytes": 1000, "bytes_by_level": {"q8": 300, "q4": 200}, "tokens": 64, "sequences": 2,
        "recompressed_pages": 7, "evictions": 1, "refusals": 3, "server_requests_per_s": 12.0, **extra,
    }


# A shard's disk-tier stats as a real store reports them (tests/unit/test_store_disk.py checks the store has every
# key): 30 sequences appended to a 256 KiB store with an 8 MiB disk, one read back.
DISK = {
    "disk_path": "/var/lib/kvd/kvd/shard-0", "disk_capacity_bytes": 8388608, "disk_used_bytes": 1622000,
    "disk_pending_bytes": 0, "disk_write_buffer_bytes": 67108864, "disk_sequences": 25, "disk_tokens": 1000,
    "disk_index_bytes": 15000, "disk_pages_by_level": {"fp16": 50, "q4": 100},
    "disk_bytes_by_level": {"fp16": 819200, "q4": 801600}, "disk_last_error": "", "disk_recovery_s": 0.001,
    "spills": 25, "spilled_bytes": 1622000, "spill_refusals": 0, "disk_writes": 25, "disk_written_bytes": 1622000,
    "disk_reads": 1, "disk_read_bytes": 64880, "disk_evictions": 0, "disk_evicted_tokens": 0, "disk_errors": 0,
    "disk_corrupt": 0, "recovered_sequences": 0, "recovered_bytes": 0, "recovery_dropped_files": 0,
    "spill_overflows": 0, "promotions": 0, "disk_hits": 1, "disk_misses": 0,
}


def test_the_disk_table_shows_each_shards_disk_tier() -> None:
    stats = shard("q4", 0.9, **DISK)
    out = shard_table([("shard-0", stats), ("shard-1", shard("q4", 0.9))])
    assert "disk tier" in out
    table = disk_table([("shard-0", {**stats, "disk_last_error": "write x: [Errno 28] No space left on device"}),
                        ("shard-1", shard("q4", 0.9))])
    head, _, row, note = table.splitlines()
    assert head.split()[:3] == ["shard", "disk", "used"] and row.split()[0] == "shard-0"
    assert str(stats["disk_sequences"]) in row.split() and "No space left" in note
    assert disk_table([("shard-1", shard("q4", 0.9))]) == ""  # no disk tier: no table


def test_the_table_shows_compactions_evictions_refusals_and_why_each_level() -> None:
    rows = [
        ("shard-0", shard("q8", 0.5, level_reason="order of epoch 2: up to q8: smoothed pressure 0.850 >= ...")),
        ("shard-1", shard("q4", 0.9, ahead="q4", level_reason="an append needed 4096 bytes ...: running ahead")),
        ("shard-2", None),
    ]
    out = shard_table(rows)
    header, _, first, second, down = out.splitlines()[:5]
    for column in ("compactions", "evictions", "refusals", "bytes by level"):
        assert column in header
    assert first.split()[1] == "q8" and second.split()[1] == "q4*" and "DOWN" in down
    assert "7" in first.split() and "3" in first.split()  # compactions, refusals
    assert "* ahead of the cluster" in out
    assert "fullest shard / mean pressure: 1.29" in out  # 0.9 / 0.7
    assert "shard-0: order of epoch 2: up to q8" in out and "shard-1: an append needed" in out


def test_imbalance_is_the_fullest_over_the_mean() -> None:
    assert imbalance([{"pressure": 0.5}, {"pressure": 0.5}]) == 1.0
    uneven = [{"pressure": 0.98}, {"pressure": 0.84}, {"pressure": 0.84}]
    assert imbalance(uneven) == pytest.approx(0.98 / (2.66 / 3))
    assert imbalance([]) is None and imbalance([{"pressure": 0.0}]) is None


def test_the_status_line_counts_refusals_and_names_shards_ahead() -> None:
    cluster = {"level": "q8", "level_epoch": 2, "pressure": 0.9, "used_bytes": 1400, "capacity_bytes": 2000}
    line = status_line(cluster, {"shard-0": shard("q8", 0.5), "shard-1": shard("q4", 0.9, ahead="q4")})
    assert "refusals 6" in line and "ahead shard-1" in line
    assert "ahead" not in status_line(cluster, {"shard-0": shard("q8", 0.5)})


def test_an_empty_cluster_says_so_instead_of_a_ratio() -> None:
    assert "fullest shard / mean pressure: - (empty)" in shard_table([("shard-0", shard("fp16", 0.0))])


SERVING = {"server_requests": 1200, "server_queue_depth": 3, "server_bulk_depth": 1, "server_bulk_requests": 40,
           "server_busy": 17, "server_errors": 2, "server_replies_dropped": 5, "server_peers_cut": 1,
           "server_socket_buffer_bytes": 262144, "server_replies_held_bytes": 4096}


def test_kvd_status_shows_how_each_shard_serves_busy_replies_drops_cuts_and_socket_buffers() -> None:
    rows = [("shard-0", shard("fp16", 0.1, **SERVING)),
            ("shard-1", shard("fp16", 0.1, **{**SERVING, "server_busy": 0, "server_socket_buffer_bytes": 0})),
            ("shard-2", None)]
    out = shard_table(rows)
    assert "serving (counts since each shard started):" in out
    table = out.split("serving (counts since each shard started):\n")[1].splitlines()
    header = table[0].split("  ")
    assert [h.strip() for h in header if h.strip()] == ["shard", "requests", "queued", "bulk now", "bulk", "busy",
                                                         "errors", "dropped", "peers cut", "socket buffers"]
    assert table[2].split() == ["shard-0", "1200", "3", "1", "40", "17", "2", "5", "1", "256.00KiB"]
    assert table[3].split() == ["shard-1", "1200", "3", "1", "40", "0", "2", "5", "1", "autotuned"]
    assert len(table) == 4  # a shard that is down has no server figures


def test_a_store_without_server_counters_gets_no_serving_table() -> None:
    assert serving_table([("shard-0", shard("fp16", 0.1)), ("shard-1", None)]) == ""
    assert "serving" not in shard_table([("shard-0", shard("fp16", 0.1))])
    # a missing or odd counter prints as "-" rather than breaking the table
    out = serving_table([("shard-0", {"server_requests": 5, "server_busy": True,
                                      "server_socket_buffer_bytes": "big"})])
    assert out.splitlines()[2].split() == ["shard-0", "5", *["-"] * 8]


def test_the_exporter_serves_each_shards_busy_replies_drops_cuts_and_queue() -> None:
    pytest.importorskip("prometheus_client")
    metrics = StatusMetrics(0, "127.0.0.1")
    try:
        cluster = {"level": "fp16", "level_epoch": 1, "pressure": 0.1, "topology_epoch": 1}
        metrics.update(cluster, {"shard-0": shard("fp16", 0.1, **SERVING), "shard-1": None})
        samples = {(m.name, smp.name): smp for m in metrics.collect() for smp in m.samples
                   if smp.labels.get("shard") == "shard-0"}
        want = {"kvd_shard_busy_replies_total": 17, "kvd_shard_error_replies_total": 2,
                "kvd_shard_replies_dropped_total": 5, "kvd_shard_peers_cut_total": 1,
                "kvd_shard_bulk_requests_total": 40, "kvd_shard_requests_total": 1200, "kvd_shard_queue_depth": 3,
                "kvd_shard_bulk_depth": 1, "kvd_shard_replies_held_bytes": 4096}
        got = {name: smp.value for (_, name), smp in samples.items() if name in want}
        assert got == want
    finally:
        metrics.close()


def test_every_metric_the_exporter_serves_is_named_in_the_cluster_readme() -> None:
    pytest.importorskip("prometheus_client")
    disk = DISK
    readme = (Path(__file__).resolve().parents[2] / "cluster" / "README.md").read_text()
    metrics = StatusMetrics(0, "127.0.0.1")
    try:
        cluster = {"level": "q8", "level_epoch": 3, "pressure": 0.5, "topology_epoch": 2, "imbalance": 1.2,
                   "upgrades": 1, "downgrades": 0}
        metrics.update(cluster, {"shard-0": shard("q4", 0.9, ahead="q4", level_reason="full", squeezes=2,
                                                  **SERVING, **disk)})
        served = {smp.name for m in metrics.collect() for smp in m.samples}
    finally:
        metrics.close()
    assert len(served) > 45 and "kvd_shard_disk_reads_total" in served
    assert sorted(name for name in served if f"`{name}" not in readme) == []


# Calibration stats as a real store reports them (tests/unit/test_store_calibration.py checks the store's keys)
CALIBRATED = {
    "calibration_states": {"llama": "active", "plain": "none", "wrong": "quarantined"},
    "calibration_budgets": {"llama": "8bit 0.90% <= 1.00%, q4 5.51% <= 6.00%", "wrong": "8bit 0.90% <= 1.00%"},
    "calibration_reasons": {"wrong": "quarantined: calibration 5d2c0e9e1a7f3b64 was measured on layout (layers, "
                                     "kv_heads, head_dim) (3, 4, 32), the namespace is (3, 4, 64)"},
    "calibration_unlisted": 0, "calibration_held_pages": 12, "calibration_raw_pages": 3,
    "calibrated_namespaces": 1, "calibration_required": {"llama": True}, "require_calibration": False,
}


def test_kvd_status_lists_each_namespaces_calibration_state_and_the_budgets_met() -> None:
    behind = {**CALIBRATED, "calibration_states": {**CALIBRATED["calibration_states"], "llama": "none"}}
    out = shard_table([("shard-0", shard("q4", 0.5, **CALIBRATED)), ("shard-1", shard("q4", 0.5, **behind)),
                       ("shard-2", None)])
    assert "namespaces and their calibration (kvd calibrate)" in out
    table = calibration_table([("shard-0", shard("q4", 0.5, **CALIBRATED)), ("shard-1", shard("q4", 0.5,
                                                                                         **CALIBRATED))])
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["namespace", "calibration", "requires", "one"]
    assert lines[2].split()[:3] == ["llama", "active", "yes"]  # its own setting
    assert lines[2].endswith("8bit 0.90% <= 1.00%, q4 5.51% <= 6.00%")
    assert lines[3].split() == ["plain", "none", "(no)", "-"]  # the shards' setting
    assert lines[4].split()[:3] == ["wrong", "quarantined", "(no)"]
    assert "  wrong: quarantined: calibration 5d2c0e9e1a7f3b64 was measured on layout" in table
    assert lines[-1] == "pages held back by calibrations: 24 at a less compact level, 6 kept fp16"
    # shards that disagree (one has not got it yet) say so, naming each
    mixed = calibration_table([("shard-0", shard("q4", 0.5, **CALIBRATED)),
                               ("shard-1", shard("q4", 0.5, **behind))]).splitlines()
    assert mixed[2].split()[0] == "llama" and "mixed: shard-0 active, shard-1 none" in mixed[2]
    assert calibration_table([("shard-0", shard("q4", 0.5))]) == ""  # no namespace reported: no table
    # shards whose own setting differs, and a shard older than protocol 1.8 (neither key)
    required = {**CALIBRATED, "require_calibration": True}
    differ = calibration_table([("shard-0", shard("q4", 0.5, **CALIBRATED)),
                                ("shard-1", shard("q4", 0.5, **required))]).splitlines()
    assert differ[3].split()[:3] == ["plain", "none", "(mixed)"]
    old = {k: v for k, v in CALIBRATED.items() if k not in ("calibration_required", "require_calibration")}
    assert calibration_table([("shard-0", shard("q4", 0.5, **old))]).splitlines()[3].split()[:3] == [
        "plain", "none", "-"]


def test_the_exporter_counts_pages_held_back_by_calibration() -> None:
    pytest.importorskip("prometheus_client")
    metrics = StatusMetrics(0, "127.0.0.1")
    try:
        cluster = {"level": "q4", "level_epoch": 1, "pressure": 0.5, "topology_epoch": 1}
        metrics.update(cluster, {"shard-0": shard("q4", 0.5, **CALIBRATED)})
        got = {smp.name: smp.value for m in metrics.collect() for smp in m.samples
               if smp.labels.get("shard") == "shard-0" and "calibrat" in smp.name}
        assert got == {"kvd_shard_calibration_held_pages_total": 12, "kvd_shard_calibration_raw_pages_total": 3,
                       "kvd_shard_calibrated_namespaces": 1}
    finally:
        metrics.close()
