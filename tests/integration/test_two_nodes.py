"""kvd on a two-node Ray cluster built on one machine the way an operator builds one (issue 18, item 13): two
`ray start`, the second joining the first, with token authentication as cluster/README.md tells operators to set
it up (RAY_AUTH_MODE=token and the token on every `ray start`), then `kvd up --ray-address ... --detach` with its
metrics, a client round trip, `kvd ping`, and `kvd down`.

The worker node is given ``--node-ip-address 127.0.0.2`` (any 127.x address is this machine's loopback on Linux):
an address this machine would never pick for itself, so a shard that advertises it follows the node's
``--node-ip-address``. Each node offers one CPU and each shard asks for one, so the two shards must land on two
nodes. Every process of the cluster is started in a session of its own and killed with it, whatever happens;
no `ray stop` (it would stop every Ray of this machine, other tests' and other users' too)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

# a sibling test module (pytest puts this directory on sys.path): the environment and port helpers
from test_cli import ENV, REPO, free_port  # isort: skip

# ray start / kvd up as subprocesses without KVD_PURE_PYTHON; the client only drives them
pytestmark = [pytest.mark.integration, pytest.mark.backend_independent]

HEAD_IP, WORKER_IP = "127.0.0.3", "127.0.0.2"
RAY = str(Path(sys.executable).with_name("ray"))
NODE_MEMORY = 1 << 30  # what each node offers Ray: a shard of 8 MiB asks for ~0.5 GiB with its warm cache


def _sessions(sids: set[int]) -> list[int]:
    """Live processes whose session id is one of ``sids``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = raw.rsplit(b")", 1)[1].split()
        if fields[0] != b"Z" and int(fields[3]) in sids:
            out.append(int(entry))
    return out


@dataclass
class Cluster:
    gcs: str
    env: dict[str, str]
    temp_dir: str
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start_node(self, *args: str, name: str) -> None:
        log = Path(self.temp_dir) / f"{name}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            # --block: `ray start` stays as the leader of the node's session and stops its processes on SIGTERM
            self.nodes.append(subprocess.Popen(
                [RAY, "start", "--block", "--num-cpus", "1", "--memory", str(NODE_MEMORY),
                 "--object-store-memory", str(80 << 20), "--dashboard-agent-listen-port", str(free_port()),
                 "--disable-usage-stats", *args],
                stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=REPO, start_new_session=True))

    def tail(self) -> str:
        return "\n".join(f"--- {log.name}\n" + log.read_text(errors="replace")[-3000:]
                         for log in self.logs if log.exists())

    def wait_for_nodes(self, n: int, timeout_s: float) -> None:
        """Until ``n`` nodes are alive: the GCS port first (cheap), then one Ray driver that polls the node table
        (starting Python and Ray once, not once per poll)."""
        deadline = time.monotonic() + timeout_s
        host, port = self.gcs.rsplit(":", 1)
        while True:
            for node in self.nodes:
                assert node.poll() is None, f"a `ray start` exited {node.returncode}:\n{self.tail()}"
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"no GCS at {self.gcs} within {timeout_s} s:\n{self.tail()}"
                time.sleep(0.2)  # the head is starting its GCS
        code = (f"import ray, time; ray.init(address={self.gcs!r}, log_to_driver=False, logging_level='ERROR')\n"
                f"while sum(x['Alive'] for x in ray.nodes()) < {n}: time.sleep(0.2)\n")
        left = max(1.0, deadline - time.monotonic())
        try:
            probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self.env,
                                   cwd=REPO, timeout=left)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{n} Ray nodes not up within {timeout_s} s:\n{self.tail()}") from None
        assert probe.returncode == 0, f"{probe.stderr[-3000:]}\n{self.tail()}"

    def stop(self) -> None:
        sids = {p.pid for p in self.nodes}
        for node in reversed(self.nodes):  # the worker first, then the head
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for node in self.nodes:
            try:
                node.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # whatever outlived its `ray start` (a worker, an agent) is still in the node's session
        for pid in _sessions(sids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for node in self.nodes:
            if node.poll() is None:
                node.kill()
                node.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started = time.monotonic()
    temp_dir = tempfile.mkdtemp(prefix="kvd2n-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    c = Cluster(gcs=f"{HEAD_IP}:{port}", env=env, temp_dir=temp_dir)
    try:
        c.start_node("--head", "--port", str(port), "--node-ip-address", HEAD_IP, "--temp-dir", temp_dir,
                     "--include-dashboard", "false", "--ray-client-server-port", str(free_port()), name="head")
        c.wait_for_nodes(1, timeout_s=60)
        c.start_node("--address", c.gcs, "--node-ip-address", WORKER_IP, name="worker")
        c.wait_for_nodes(2, timeout_s=60)
        print(f"two-node cluster up in {time.monotonic() - started:.1f} s")
        yield c
    finally:
        c.stop()
        left = _sessions({p.pid for p in c.nodes})
        shutil.rmtree(temp_dir, ignore_errors=True)
        print(f"two-node module: {time.monotonic() - started:.1f} s")
        assert not left, f"processes of the test cluster outlived it: {left}"


def _kvd(cluster: Cluster, *args: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, cwd=REPO,
                          env=cluster.env, timeout=timeout_s)


def test_kvd_spreads_over_two_ray_nodes_serves_a_client_and_goes_down(cluster: Cluster) -> None:
    from kvd.client.sync import Client
    from kvd.wire.routing import owner

    namespace = f"kvd-2n-{os.getpid()}"
    metrics_port = free_port()
    started = time.monotonic()
    up = _kvd(cluster, "up", "--ray-address", cluster.gcs, "--detach", "--namespace", namespace, "--shards", "2",
              "--memory", "16MiB", "--port", "0", "--metrics-port", str(metrics_port), "--report-interval", "0.2")
    try:
        assert up.returncode == 0, up.stderr
        endpoint = next(line.split(": ", 1)[1] for line in up.stdout.splitlines()
                        if line.startswith("kvd endpoint: "))
        metrics_url = next(line.split(": ", 1)[1].split()[0] for line in up.stderr.splitlines()
                           if line.startswith("metrics: "))
        print(f"kvd up --detach on two nodes: {time.monotonic() - started:.1f} s")

        # the coordinator is on the head, the two shards on the two nodes, each at its node's --node-ip-address
        assert endpoint.startswith(f"tcp://{HEAD_IP}:"), endpoint
        with Client(endpoint, timeout_s=10) as client:
            shards = client.topology()["shards"]
            hosts = sorted(s["endpoint"].rsplit(":", 1)[0].removeprefix("tcp://") for s in shards)
            assert hosts == sorted([HEAD_IP, WORKER_IP]), shards

            # a client round trip through both shards
            client.register("t", num_layers=2, num_kv_heads=2, head_dim=16)
            rng = np.random.default_rng(7)
            stored = {}
            for seq in range(8):
                keys = rng.standard_normal((2, 40, 2, 16)).astype(np.float16)
                values = rng.standard_normal((2, 40, 2, 16)).astype(np.float16)
                assert client.append("t", seq, keys, values) == 40
                stored[seq] = (keys, values)
            ids = [s["id"] for s in shards]
            owners = {ids[owner(ids, "t", seq)] for seq in stored}
            assert len(owners) == 2, owners  # the round trip went through both nodes
            for seq, (keys, values) in stored.items():
                got_k, got_v = client.get("t", seq)
                np.testing.assert_array_equal(got_k, keys)
                np.testing.assert_array_equal(got_v, values)

        # liveness: the coordinator and both shards answer the protocol's ping
        ping = _kvd(cluster, "ping", "--address", endpoint, "--shards", "--timeout", "5")
        assert ping.returncode == 0, ping.stdout + ping.stderr
        assert ping.stdout.count(": ping ") == 3, ping.stdout
        # ... and without --address, as the head pod's liveness probe runs it: the run note of `kvd up --detach`
        probe = _kvd(cluster, "ping", "--namespace", namespace, "--timeout", "2")
        assert probe.returncode == 0 and endpoint in probe.stdout, probe.stdout + probe.stderr

        # `kvd up` has exited, its metrics are still served (from the Ray head) with both shards in them
        deadline = time.monotonic() + 20
        text = ""
        while time.monotonic() < deadline:
            with urllib.request.urlopen(metrics_url, timeout=5) as reply:
                text = reply.read().decode()
            if 'kvd_shard_up{shard="shard-0"} 1.0' in text and 'kvd_shard_up{shard="shard-1"} 1.0' in text:
                break
            time.sleep(0.2)  # the exporter refreshes its figures once a second
        assert 'kvd_shard_up{shard="shard-0"} 1.0' in text and 'kvd_shard_up{shard="shard-1"} 1.0' in text, text
        assert "kvd_cluster_pressure" in text
    finally:
        down = _kvd(cluster, "down", "--ray-address", cluster.gcs, "--namespace", namespace)
    assert down.returncode == 0, down.stderr
    assert "stopped 4 actors" in down.stderr, down.stderr  # 2 shards, the coordinator, the metrics exporter
    gone = _kvd(cluster, "ping", "--address", endpoint, "--timeout", "1")
    assert gone.returncode == 1, gone.stdout + gone.stderr
    with pytest.raises(OSError):
        urllib.request.urlopen(metrics_url, timeout=2)
