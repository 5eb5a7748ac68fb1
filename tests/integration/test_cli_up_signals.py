"""A stop of `kvd up` during its start-up is as clean as one after it (issue 31, section 3): Ctrl-C (SIGINT to the
terminal's process group), SIGTERM to `kvd up`, or SIGKILL of `kvd up`, while its embedded Ray starts or while
its actors start, must leave no process of it behind (Ray's DashboardAgent and RuntimeEnvAgent stayed, adopted by
init, ignoring SIGTERM), no run note, and no crash. Real `kvd up` processes, each in a session of its own; every
process of one carries a mark in its environment (inherited by all of Ray's processes, the workers too), so
what remains is found wherever it was re-parented."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from kvd.config import read_run_file

# a sibling test module (pytest puts this directory on sys.path): the `kvd` process helpers
from test_cli import ENV, REPO  # isort: skip

# backend_independent: every `kvd up` here runs without the second pass's KVD_PURE_PYTHON (test_cli.ENV)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.backend_independent]

MARK = "KVDTEST_UP_RUN"  # not KVD_*: kvd reads those as settings


def _comm(pid: int) -> str | None:
    """The name of ``pid``, or None if it is gone (or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    if raw.rsplit(b")", 1)[1].split()[0] == b"Z":
        return None
    return raw[raw.index(b"(") + 1: raw.rindex(b")")].decode(errors="replace")


def marked(value: str) -> dict[int, str]:
    """Every live process whose environment carries ``MARK=value``: pid -> name."""
    needle = f"{MARK}={value}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env and (name := _comm(int(entry))) is not None:
            found[int(entry)] = name
    return found


class Up:
    """A `kvd up` in a session of its own; stderr lines arrive on a queue."""

    def __init__(self, namespace: str) -> None:
        self.value = uuid.uuid4().hex
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd", "up", "--port", "0", "--memory", "64MiB", "--namespace", namespace,
             "--set", "cluster.shard_cpus=0", "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env={**ENV, MARK: self.value},
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout), daemon=True).start()

    def _pump(self, stream, sink) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            sink.append(line)
            self.lines.put(line)

    def wait_for(self, predicate, what: str, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.proc.poll() is None, f"kvd up exited {self.proc.returncode}: {''.join(self.stderr)}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s: {''.join(self.stderr)}"
            time.sleep(0.05)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pid in marked(self.value):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _ray_starting(up: Up) -> bool:
    """ray.init is under way: the embedded Ray's GCS or raylet runs, no endpoint yet."""
    return any(name in ("gcs_server", "raylet") for name in marked(up.value).values()) and not up.stdout


def _actors_starting(up: Up) -> bool:
    """Ray is up and the coordinator and shards are starting: the "starting" line, no endpoint yet."""
    return any("starting" in line for line in up.stderr) and not up.stdout


def _served(up: Up) -> bool:
    return any(line.startswith("kvd endpoint:") for line in up.stdout)


STOPS = {
    # Ctrl-C in the terminal: SIGINT to the whole foreground process group
    "ctrl-c": lambda pid: os.killpg(pid, signal.SIGINT),
    "sigterm": lambda pid: os.kill(pid, signal.SIGTERM),
    "kill-9": lambda pid: os.kill(pid, signal.SIGKILL),
}
MOMENTS = {"ray-starting": _ray_starting, "actors-starting": _actors_starting, "served": _served}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stop, moment", [
    ("ctrl-c", "ray-starting"), ("sigterm", "ray-starting"), ("kill-9", "ray-starting"),
    ("ctrl-c", "actors-starting"), ("kill-9", "actors-starting"),
    ("kill-9", "served"),
])
def test_a_stop_of_kvd_up_leaves_nothing_behind(stop: str, moment: str) -> None:
    namespace = f"kvd-sig-{os.getpid()}-{stop}-{moment}"
    up = Up(namespace)
    try:
        up.wait_for(lambda: MOMENTS[moment](up), moment)
        STOPS[stop](up.proc.pid)
        code = up.proc.wait(timeout=90)
        stderr = "".join(up.stderr)
        if stop == "kill-9":
            assert code == -signal.SIGKILL
        else:
            assert code == 0, f"exit {code}: {stderr}"  # as after start-up: a requested stop is no failure
        assert "Segmentation fault" not in stderr and "Traceback" not in stderr, stderr
        deadline = time.monotonic() + 30
        while (left := marked(up.value)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"left behind after {stop} during {moment}: {left}"
        deadline = time.monotonic() + 30  # the reaper removes it after its sweep (kvd/cli/reaper.py)
        while read_run_file(namespace) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_run_file(namespace) is None
    finally:
        up.cleanup()
