"""`kvd up` as an operator runs it (issue 18, items 6, 8, 9, 10 and 12): real `kvd up` processes, each in a
session of its own, an embedded Ray, sockets on 127.0.0.1. One kvd serves the module; the SIGTERM test starts
its own, since it ends it."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.config import read_run_file

# a sibling test module (pytest puts this directory on sys.path): the `kvd up` process helper
from test_cli import ENV, REPO, Running, free_port, kvd  # isort: skip

# kvd up / down as subprocesses without KVD_PURE_PYTHON (test_cli.ENV)
pytestmark = [pytest.mark.integration, pytest.mark.backend_independent]

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


# ------------------------------------------------------------------------------------ processes and sockets


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, session id, name) of ``pid``, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    name = raw[raw.index(b"(") + 1: raw.rindex(b")")].decode(errors="replace")
    fields = raw.rsplit(b")", 1)[1].split()
    if fields[0] == b"Z":
        return None
    return int(fields[1]), int(fields[3]), name


def process_tree(root: int) -> dict[int, str]:
    """Every live process descended from ``root`` or in its session (``root`` leads one): pid -> name."""
    table = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d))) is not None}
    keep = {root} if root in table else set()
    grew = True
    while grew:
        grew = False
        for pid, (ppid, sid, _name) in table.items():
            if pid not in keep and (ppid in keep or sid == root):
                keep.add(pid)
                grew = True
    return {pid: table[pid][2] for pid in keep}


def _ip(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # /proc/net/tcp6: 4 host-order words
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_sockets(pids: dict[int, str]) -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every listening TCP socket (IPv4 and IPv6) the processes ``pids`` hold."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            next(fh)
            for line in fh:
                f = line.split()
                if f[3] == "0A" and f[9] in owner:  # state 0A: LISTEN
                    addr, port = f[1].split(":")
                    pid = owner[f[9]]
                    out.append((pid, pids[pid], _ip(addr), int(port, 16)))
    return out


def start_up(*args: str) -> Running:
    """A `kvd up` that leads its own session and process group (as under `timeout` or systemd)."""
    up = Running.__new__(Running)
    up.proc = subprocess.Popen([sys.executable, "-m", "kvd", "up", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV, start_new_session=True)
    up.lines = queue.Queue()
    up.stderr = []
    threading.Thread(target=Running._pump, args=(up.proc.stdout, up.lines.put), daemon=True).start()
    threading.Thread(target=Running._pump, args=(up.proc.stderr, up.stderr.append), daemon=True).start()
    return up


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Running, str, str]]:
    namespace = f"kvd-up-{os.getpid()}"
    up = start_up("--port", "0", "--memory", "16MiB", "--namespace", namespace, "--report-interval", "0.2",
                  "--set", "cluster.shard_cpus=0", "--quiet")
    try:
        endpoint = up.wait_for("kvd endpoint:", timeout_s=120)
        yield up, endpoint, namespace
    finally:
        up.stop()
        _kill_session(up.proc.pid)


# ------------------------------------------------------------------------------------------------ item 6


def test_nothing_of_an_embedded_kvd_listens_beyond_loopback(served: tuple[Running, str, str]) -> None:
    up, endpoint, _ = served
    tree = process_tree(up.proc.pid)
    names = set(tree.values())
    assert "gcs_server" in names and "raylet" in names, names  # the embedded Ray is in the tree
    sockets = listening_sockets(tree)
    kvd_port = int(endpoint.rsplit(":", 1)[1])
    assert any(port == kvd_port for *_, port in sockets), sockets
    assert len(sockets) >= 8, sockets  # GCS, raylet, agents, workers' gRPC, kvd's own
    outside = [s for s in sockets if s[2] not in LOOPBACK]
    assert not outside, f"listening beyond loopback: {outside}"


# ------------------------------------------------------------------------------------------------ item 8


def test_a_second_up_in_the_namespace_is_refused_and_the_first_keeps_its_note(
        served: tuple[Running, str, str]) -> None:
    up, endpoint, namespace = served
    before = read_run_file(namespace)
    assert before is not None and before["pid"] == up.proc.pid and before["endpoint"] == endpoint
    t0 = time.monotonic()
    second = kvd("up", "--port", "0", "--memory", "16MiB", "--namespace", namespace, "--quiet", timeout_s=60)
    took = time.monotonic() - t0
    assert second.returncode == 2, second.stdout + second.stderr
    assert "already running" in second.stderr and str(up.proc.pid) in second.stderr
    assert f"kvd down --namespace {namespace}" in second.stderr
    assert "starting" not in second.stderr and took < 30  # refused before any Ray started
    assert read_run_file(namespace) == before  # neither overwritten nor removed
    assert up.proc.poll() is None


# ----------------------------------------------------------------------------------------------- item 12


def test_status_of_a_served_kvd_into_a_closed_pipe_prints_no_traceback(served: tuple[Running, str, str]) -> None:
    _, endpoint, _ = served
    for unbuffered in (False, True):
        env = {k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"}
        if unbuffered:
            env["PYTHONUNBUFFERED"] = "1"
        read_end, write_end = os.pipe()
        os.close(read_end)  # `| head -1` that has already gone: every write is EPIPE
        try:
            result = subprocess.run([sys.executable, "-m", "kvd", "status", "--address", endpoint],
                                    stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                                    timeout=60)
        finally:
            os.close(write_end)
        assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
        assert result.returncode == 1


def test_head_of_status_through_a_shell_pipe(served: tuple[Running, str, str]) -> None:
    _, endpoint, _ = served
    result = subprocess.run(f"{sys.executable} -m kvd status --address {endpoint} | head -1", shell=True,
                            capture_output=True, text=True, cwd=REPO, env=ENV, timeout=60)
    assert result.stdout.startswith(f"kvd at {endpoint}") and len(result.stdout.splitlines()) == 1
    assert "Traceback" not in result.stderr, result.stderr


def test_bench_draws_no_progress_bar_into_a_pipe(served: tuple[Running, str, str]) -> None:
    _, endpoint, _ = served
    bench = kvd("bench", "--address", endpoint, "--seconds", "2", "--clients", "1", "--layout", "small",
                "--prefill-tokens", "16", "--decode-steps", "2", timeout_s=120)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert "total" in bench.stdout
    assert "\r" not in bench.stderr and "[#" not in bench.stderr and "requests" not in bench.stderr, bench.stderr


def test_status_with_nothing_running_in_the_namespace_says_so() -> None:
    namespace = f"kvd-nothing-{os.getpid()}"
    result = kvd("status", "--namespace", namespace, "--set", f"cluster.port={free_port()}", "--timeout", "1")
    assert result.returncode == 1
    assert f"no kvd is running in namespace {namespace!r}" in result.stderr, result.stderr
    assert "--address" in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------------ item 9


def test_more_memory_than_the_machine_has_fails_before_ray_starts() -> None:
    t0 = time.monotonic()
    result = kvd("up", "--memory", "100TiB", "--port", "0", "--namespace", f"kvd-mem-{os.getpid()}", timeout_s=60)
    took = time.monotonic() - t0
    assert result.returncode == 2, result.stderr
    assert "more than this machine has" in result.stderr
    assert "starting" not in result.stderr and took < 30, (took, result.stderr)


def test_a_busy_client_port_is_reported_before_ray_starts() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        result = kvd("up", "--port", str(port), "--memory", "16MiB", "--namespace", f"kvd-port-{os.getpid()}",
                     timeout_s=60)
        took = time.monotonic() - t0
    assert result.returncode == 2, result.stderr
    assert f"port (--port) {port} on 127.0.0.1 is not free" in result.stderr
    assert "starting" not in result.stderr and took < 30, (took, result.stderr)


# ----------------------------------------------------------------------------------------------- item 10


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_stops_quickly_and_leaves_nothing(sig: signal.Signals) -> None:
    """SIGTERM to the group is what `timeout` and systemd send; SIGINT to the group is Ctrl-C."""
    namespace = f"kvd-term-{os.getpid()}-{sig.name}"
    up = start_up("--port", "0", "--memory", "16MiB", "--namespace", namespace, "--set", "cluster.shard_cpus=0",
                  "--quiet")
    pid = up.proc.pid
    try:
        up.wait_for("kvd endpoint:", timeout_s=120)
        tree = process_tree(pid)
        assert {"gcs_server", "raylet"} <= set(tree.values()), tree
        t0 = time.monotonic()
        os.killpg(pid, sig)  # the whole group at once
        code = up.proc.wait(timeout=60)
        took = time.monotonic() - t0
        stderr = "".join(up.stderr)
        assert code == 0, stderr
        assert took < 15.0, f"kvd up took {took:.1f} s to stop after {sig.name} to its group: {stderr}"
        assert "Failed to connect to GCS" not in stderr and "stopped 3 actors" in stderr, stderr
        deadline = time.monotonic() + 10
        while (left := {p: n for p, n in process_tree(pid).items() if p in tree}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"left behind: {left}"
        assert read_run_file(namespace) is None
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
        _kill_session(pid)


# ------------------------------------------------------------------------------------------------ item 8


@pytest.mark.timeout(180)
def test_down_still_finds_the_first_up(served: tuple[Running, str, str]) -> None:
    """Last in the module: stops the shared kvd."""
    up, _, namespace = served
    down = kvd("down", "--namespace", namespace, timeout_s=90)
    assert down.returncode == 0, down.stderr
    assert str(up.proc.pid) in down.stderr
    assert up.proc.wait(timeout=60) == 0
    assert read_run_file(namespace) is None
