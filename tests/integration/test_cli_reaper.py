"""The reaper of a `kvd up` (kvd/cli/reaper.py) with real processes and no Ray: what a killed `kvd up` started is
stopped even when it does not carry the mark, a finished `kvd up` is told from a dead one by what it wrote, and
the run note of a dead one goes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvd.cli import reaper

pytestmark = [pytest.mark.integration, pytest.mark.backend_independent]  # stdlib processes, no kvd data path

REPO = Path(__file__).resolve().parents[2]
# Long enough for the reaper to start (seconds on a loaded machine) and look at the tree a few times
NOTED_S = reaper._LOOK_S * 3 + 7


def _running(pid: int) -> bool:
    fields = reaper._stat(pid)
    return fields is not None and fields[0] != b"Z"


def _wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# A stand-in for `kvd up`: starts the reaper, then a shell (a raylet) with a child of its own (an agent), neither
# with the mark in its environment, prints the grandchild's pid and the reaper's, then waits.
STAND_IN = textwrap.dedent("""
    import os, subprocess, sys, time
    from kvd.cli.reaper import MARK, Reaper
    r = Reaper(sys.argv[1])
    r.mark()
    env = {k: v for k, v in os.environ.items() if k != MARK}
    shell = subprocess.Popen(["sh", "-c", "sleep 300 > /dev/null 2>&1 & echo $!; wait"], env=env,
                             stdout=subprocess.PIPE, text=True)
    print(shell.stdout.readline().strip(), r.pid, flush=True)
    time.sleep(float(sys.argv[2]))
    if sys.argv[3] == "close":
        r.close()
    time.sleep(300)
""")


def _stand_in(note: Path, hold_s: float, end: str) -> tuple[subprocess.Popen[str], int, int]:
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(note), str(hold_s), end], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    grandchild, reaper_pid = (int(x) for x in proc.stdout.readline().split())
    return proc, grandchild, reaper_pid


def test_a_killed_kvd_ups_unmarked_descendant_is_stopped_and_its_run_note_removed(tmp_path: Path) -> None:
    note = tmp_path / "run.json"
    proc, grandchild, reaper_pid = _stand_in(note, 1000, "die")
    try:
        note.write_text(json.dumps({"pid": proc.pid}))
        time.sleep(NOTED_S)  # the reaper has looked at the tree since the grandchild started
        assert _running(grandchild)
        proc.kill()
        proc.wait(10)
        assert _wait_gone(grandchild), "a descendant without the mark outlived the killed kvd up"
        assert _wait_gone(reaper_pid)
        assert not note.exists()
    finally:
        proc.kill()
        for pid in (grandchild, reaper_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_finished_kvd_up_keeps_its_note_and_the_reaper_exits(tmp_path: Path) -> None:
    """close() says DONE: the reaper sweeps what it noted (the unmarked grandchild too) and exits, and leaves the
    run note alone (kvd up removes its own, or keeps it for a detached deployment)."""
    note = tmp_path / "run.json"
    note.write_text("{}")
    proc, grandchild, reaper_pid = _stand_in(note, NOTED_S, "close")
    try:
        assert _wait_gone(reaper_pid)
        assert _wait_gone(grandchild)
        assert proc.poll() is None  # the stand-in itself is excluded
        assert note.exists()
    finally:
        proc.kill()
        proc.wait(10)
        for pid in (grandchild, reaper_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("written, finished", [(reaper.DONE, True), (b"", False), (b"do", False)])
def test_only_done_before_the_pipes_end_is_a_finish(written: bytes, finished: bool) -> None:
    r, w = os.pipe()
    try:
        os.write(w, written)
        os.close(w)
        w = -1
        said, known = reaper.watch(os.getpid(), r)
        assert said is finished
        assert isinstance(known, dict)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_descendants_are_the_whole_tree_with_start_times() -> None:
    child = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    under: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 10
        while not (under := reaper.descendants(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = reaper.descendants(os.getpid())  # this process may have others (a test worker's servers)
        assert under and all(reaper._stat(p)[1] == str(child.pid).encode() for p in under)  # the sleep
        assert child.pid in found and all(found.get(p) == started for p, started in under.items())
        assert found[child.pid] == reaper._started(reaper._stat(child.pid))
        # a pid whose start time differs is another process: not killed
        assert reaper._still({child.pid: found[child.pid] + 1}, frozenset()) == []
    finally:
        for p in (*under, child.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        child.wait(10)
