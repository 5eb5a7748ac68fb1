"""kvd.cli.status: what `kvd status` shows per shard, from plain stats dicts (no cluster needed)."""

from __future__ import annotations

import pytest

from kvd.cli.status import imbalance, shard_table, status_line


def shard(level: str, pressure: float, **extra: object) -> dict:
    return {
        "level": level, "epoch": 2, "pressure": pressure, "used_bytes": int(pressure * 1000),
        "capacity_bytes": 1000, "bytes_by_level": {"q8": 300, "q4": 200}, "tokens": 64, "sequences": 2,
        "recompressed_pages": 7, "evictions": 1, "refusals": 3, "server_requests_per_s": 12.0, **extra,
    }


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
