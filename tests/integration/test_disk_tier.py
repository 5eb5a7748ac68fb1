"""A kvd with a disk tier as an operator runs it: `kvd up --disk` spills what memory cannot hold, serves it back
through the same client, shows it in `kvd status` and the metrics, serves it again after its shard process is
killed (Ray restarts it on the same disk), and after a stop and a new `kvd up` on the same --disk-path.

Backend-independent: the kvd under test runs in `kvd up` processes whose environment drops KVD_PURE_PYTHON
(test_cli.ENV), so bin/test's second pass would only run the same build again; the disk tier's code runs in both
passes in tests/unit/test_store_disk.py and tests/integration/test_disk_faults.py."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvd.client import Client
from kvd.cluster.deploy import wait_until

# a sibling test module (pytest puts this directory on sys.path): the `kvd up` process helper
from test_cli import Running, free_port, kvd  # isort: skip
from test_cli_up import process_tree  # isort: skip

pytestmark = [pytest.mark.integration, pytest.mark.backend_independent]

NS = "model"
L, H, D = 4, 2, 64


def kv(seq: int, t: int = 200) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seq)
    return (rng.standard_normal((L, t, H, D)).astype(np.float16),
            rng.standard_normal((L, t, H, D)).astype(np.float16))


def up(disk: Path, namespace: str, *extra: str) -> tuple[Running, str]:
    run = Running("--port", "0", "--shards", "1", "--memory", "1MiB", "--disk", "64MiB", "--disk-path", str(disk),
                  "--namespace", namespace, "--report-interval", "0.1", "--set", "cluster.shard_cpus=0", "--quiet",
                  *extra)
    return run, run.wait_for("kvd endpoint:", timeout_s=120)


def test_a_kvd_with_a_disk_spills_serves_and_comes_back_warm(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    namespace = f"kvd-disk-{os.getpid()}"
    metrics_port = free_port()
    run, endpoint = up(disk, namespace, "--metrics-port", str(metrics_port))
    try:
        with Client(endpoint) as client:
            client.register(NS, num_layers=L, num_kv_heads=H, head_dim=D)
            for seq in range(40):
                client.append(NS, seq, *kv(seq))
            stats = client.shard_stats()[0]
            assert stats["spills"] > 0 and stats["evictions"] == 0, stats
            assert stats["disk_sequences"] + stats["sequences"] == 40
            held = {seq: _get(client, seq) for seq in range(40)}  # most from disk, through the same API
            first_k, _ = kv(0)
            assert np.abs(held[0][0].astype(np.float32) - first_k).mean() < 0.2  # q4 of N(0, 1): close
            assert all(np.stack(client.get(NS, seq, format="pages")).tobytes() == held[seq].tobytes()
                       for seq in range(40))
            explain = client.explain(NS, 0, 1, 100)
            assert explain["reasons"][0].startswith("on disk"), explain
            shard_pid = _shard_pid(run)
            incarnation = stats["incarnation"]

        status = kvd("status", "--address", endpoint, "--json")
        assert status.returncode == 0, status.stderr
        shard = next(iter(json.loads(status.stdout)["shards"].values()))
        assert shard["disk_used_bytes"] > 0 and shard["disk_bytes_by_level"]
        table = kvd("status", "--address", endpoint)
        assert "disk" in table.stdout, table.stdout
        deadline = time.monotonic() + 30
        while "kvd_shard_disk_used_bytes" not in (text := _scrape(metrics_port)):
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        for family in ("kvd_shard_disk_used_bytes", "kvd_shard_spills", "kvd_shard_disk_reads",
                       "kvd_shard_disk_hits", "kvd_shard_disk_evictions", "kvd_shard_tier_bytes"):
            assert family in text, family

        # kill -9 the shard's process: Ray starts it again on the same disk, which serves what it holds
        os.kill(shard_pid, signal.SIGKILL)
        with Client(endpoint) as client:
            def served() -> bool:
                return client.shard_stats()[0]["incarnation"] != incarnation and client.length(NS, 0) == 200

            wait_until(served, timeout_s=120, what="the restarted shard to serve its disk")
            stats = client.shard_stats()[0]
            assert stats["recovered_sequences"] > 0
            on_disk = [seq for seq in range(40) if client.lengths(NS, [seq])[0] is not None]
            assert set(on_disk) and all(_get(client, seq).tobytes() == held[seq].tobytes() for seq in on_disk)
    finally:
        assert run.stop() == 0, "".join(run.stderr)

    # a stop writes memory out; `kvd up` on the same path serves all of it, bit-exact
    run, endpoint = up(disk, namespace)
    try:
        with Client(endpoint) as client:
            wait_until(lambda: client.length(NS, on_disk[0]) == 200, timeout_s=60, what="the namespace to return")
            for seq in on_disk:
                assert _get(client, seq).tobytes() == held[seq].tobytes(), seq
    finally:
        assert run.stop() == 0, "".join(run.stderr)

    run, endpoint = up(disk, namespace, "--fresh")
    try:
        with Client(endpoint) as client:
            assert client.shard_stats()[0]["disk_sequences"] == 0
    finally:
        run.stop()


def _shard_pid(run: Running) -> int:
    """The pid of the shard actor's process, among those of this `kvd up` (Ray names it after the actor)."""
    for pid in process_tree(run.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"ray::Shard"):
            return pid
    raise AssertionError("no shard process found under the kvd up process")


def _get(client: Client, seq: int) -> np.ndarray:
    k, v = client.get(NS, seq)
    return np.stack([k, v])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()
