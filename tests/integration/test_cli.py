"""The `kvd` command as a user runs it: real processes, an embedded Ray, sockets on 127.0.0.1."""

from __future__ import annotations

import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from kvd.config import run_file_path, write_run_file

# kvd's command line, run as subprocesses without KVD_PURE_PYTHON (ENV)
pytestmark = [pytest.mark.integration, pytest.mark.backend_independent]

REPO = Path(__file__).resolve().parents[2]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("KVD_") or k in ("KVD_KERNELS",)},
       "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def kvd(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Running:
    """A `kvd up` process; its stdout lines arrive on a queue (readiness = the endpoint line)."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvd", "up", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True).start()

    @staticmethod
    def _pump(stream, sink) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            sink(line)

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                assert self.proc.poll() is None, f"kvd up exited {self.proc.returncode}: {''.join(self.stderr)}"
                continue
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise AssertionError(f"no {prefix!r} line within {timeout_s} s: {''.join(self.stderr)}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def running() -> Iterator[tuple[Running, str, str, int]]:
    namespace = f"kvd-cli-{os.getpid()}"
    metrics_port = free_port()
    up = Running("--port", "0", "--memory", "16MiB", "--namespace", namespace, "--report-interval", "0.1",
                 "--metrics-port", str(metrics_port), "--set", "cluster.shard_cpus=0", "--quiet")
    try:
        endpoint = up.wait_for("kvd endpoint:", timeout_s=120)
        yield up, endpoint, namespace, metrics_port
    finally:
        up.stop()


# ---------------------------------------------------------------------------------------------- no Ray needed


@pytest.mark.parametrize("verb", ["up", "status", "calibrate", "bench", "down", "keygen", "config"])
def test_every_verb_has_help(verb: str) -> None:
    result = kvd(verb, "--help")
    assert result.returncode == 0
    assert f"usage: kvd {verb}" in result.stdout and len(result.stdout.splitlines()) > 5


def test_top_level_help_lists_the_verbs_and_no_verb_is_a_usage_error() -> None:
    result = kvd()
    assert result.returncode == 2
    for verb in ("up", "status", "bench", "down", "keygen"):
        assert verb in result.stdout


def test_up_help_states_the_memory_default() -> None:
    assert "25% of this machine's memory" in kvd("up", "--help").stdout


def test_unknown_setting_is_a_usage_error_naming_it_before_anything_starts() -> None:
    result = kvd("up", "--set", "cluster.shardz=3", timeout_s=30)
    assert result.returncode == 2
    assert "cluster.shardz" in result.stderr and "cluster.shards" in result.stderr
    bad_env = subprocess.run([sys.executable, "-m", "kvd", "config"], capture_output=True, text=True, cwd=REPO,
                             env={**ENV, "KVD_CLUSTER_SHRADS": "2"}, timeout=30)
    assert bad_env.returncode == 2 and "KVD_CLUSTER_SHRADS" in bad_env.stderr


def test_config_shows_precedence_of_file_env_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text("[cluster]\nshards = 3\nport = 9000\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvd", "config", "--config", str(path), "--set", "cluster.port=9100"],
        capture_output=True, text=True, cwd=REPO, env={**ENV, "KVD_CLUSTER_SHARDS": "4"}, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "shards = 4" in result.stdout and "port = 9100" in result.stdout


def test_keygen_writes_loadable_key_pairs_with_private_secrets(tmp_path: Path) -> None:
    result = kvd("keygen", str(tmp_path / "keys"))
    assert result.returncode == 0, result.stderr
    for name in ("server", "client"):
        public, secret = tmp_path / "keys" / f"{name}.key", tmp_path / "keys" / f"{name}.key_secret"
        pub_key, no_secret = zmq.auth.load_certificate(public)
        pub_again, secret_key = zmq.auth.load_certificate(secret)
        assert len(pub_key) == 40 and no_secret is None and pub_again == pub_key and len(secret_key) == 40
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "server_secret_key" in result.stdout


def test_down_cleans_a_stale_note_of_a_dead_kvd_up() -> None:
    namespace = f"kvd-stale-{os.getpid()}"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=30)
    write_run_file(namespace, {"pid": int(dead.stdout), "endpoint": "tcp://127.0.0.1:1", "detached": False,
                               "ray_address": "", "namespace": namespace})
    result = kvd("down", "--namespace", namespace)
    assert result.returncode == 1 and "no kvd found" in result.stderr
    assert not run_file_path(namespace).exists()


def test_status_of_nothing_running_fails_clearly() -> None:
    result = kvd("status", "--address", f"tcp://127.0.0.1:{free_port()}", "--timeout", "1", timeout_s=60)
    assert result.returncode != 0
    assert "Timeout" in result.stderr or "Unavailable" in result.stderr


# --------------------------------------------------------------------------------------------- a running kvd


@pytest.mark.timeout(240)
def test_up_status_metrics_bench_and_down(running: tuple[Running, str, str, int]) -> None:
    up, endpoint, namespace, metrics_port = running
    assert endpoint.startswith("tcp://127.0.0.1:")

    status = kvd("status", "--address", endpoint)
    assert status.returncode == 0, status.stderr
    for column in ("shard", "level", "epoch", "pressure", "bytes by level", "tokens", "sequences", "compactions",
                   "evictions", "refusals", "req/s", "fullest shard / mean pressure"):
        assert column in status.stdout
    assert "shard-0" in status.stdout and "shard-1" in status.stdout and "fp16" in status.stdout
    # Without --address, status finds the local `kvd up` of the namespace.
    assert kvd("status", "--namespace", namespace).returncode == 0

    bench = kvd("bench", "--address", endpoint, "--seconds", "2", "--clients", "2", "--layout", "small",
                "--prefill-tokens", "64", "--decode-steps", "4", "--quiet", timeout_s=120)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    for op in ("prefill", "decode", "get", "total"):
        assert op in bench.stdout
    assert "p99 ms" in bench.stdout

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
            return reply.read().decode()

    deadline = time.monotonic() + 30
    while "kvd_shard_used_bytes" not in (text := scrape()):
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    assert 'kvd_shard_up{shard="shard-0"} 1.0' in text and "kvd_cluster_level_epoch" in text
    assert "kvd_shard_requests_per_second" in text
    for family in ("kvd_shard_refusals", "kvd_shard_recompressed_pages", "kvd_shard_squeezes",
                   "kvd_shard_ahead_level", "kvd_shard_level_reason"):
        assert family in text, family

    down = kvd("down", "--namespace", namespace, timeout_s=90)
    assert down.returncode == 0, down.stderr
    assert up.proc.wait(timeout=60) == 0  # `kvd up` stopped cleanly
    assert "stopped" in "".join(up.stderr)
    assert not run_file_path(namespace).exists()
    after = kvd("status", "--address", endpoint, "--timeout", "1")
    assert after.returncode != 0
