"""The reaper of a `kvd up` that runs an embedded Ray: a small process that outlives it and stops what it leaves.

`kvd up` tears its Ray down itself on Ctrl-C, SIGTERM or `kvd down`. What it cannot handle is its own sudden end
(SIGKILL, the OOM killer, a crash): Ray's processes then lose their parent, and some of them (the dashboard and
runtime-env agents) wait a minute or more for the dead GCS before they exit. So before Ray starts, `kvd up` starts
this reaper (as a script: stdlib only, no kvd import, in a session of its own so that a signal to the terminal's
group does not reach it), with a pipe on its stdin, and marks every process Ray will start with an environment
variable (:data:`MARK`, inherited by all of them, the workers too). While `kvd up` runs, the reaper also notes its
descendants (pid and start time): after a `kill -9` on a loaded machine a Ray agent can be without the mark (seen
in the signals test: tests/integration/test_cli_up_signals.py), and the tree does not depend on what a process
keeps of its environment. The reaper waits for the pipe to close: `kvd up` writes :data:`DONE` and closes it when
it has finished, and the kernel closes it when `kvd up` dies (a pipe that ends without DONE: whether the process
is still exiting or a zombie does not matter). It then SIGKILLs every process that carries the mark or that it
noted (the same process: pid and start time), but `kvd up` itself, until none is left, and after a death removes
the run note if it is still that of the dead `kvd up`.

    python -I kvd/cli/reaper.py MARK-VALUE PID-OF-KVD-UP [RUN-NOTE-PATH]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

MARK = "_KVD_UP_RUN"  # not KVD_*: those are settings (kvd.config)
_SWEEP_S = 10.0  # how long to keep sweeping: a raylet killed in the same sweep may have started a worker
_POLL_S = 0.05
_QUIET_S = 3.0  # after `kvd up` died: sweep on until no marked process was seen for this long
# While `kvd up` runs, its descendants are noted (pid and start time), in case one of them does not carry the
# mark: every second while Ray and the actors start (minutes on a loaded machine), then every 10 s.
_LOOK_S, _LOOK_EARLY_S, _LOOK_LATE_S = 1.0, 300.0, 10.0
DONE = b"done\n"  # what `kvd up` writes before it closes the pipe when it finished (did not die)


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the name (state, ppid, ...), or None if ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _started(fields: list[bytes]) -> int:
    """A process's start time (clock ticks since boot): with its pid, what tells it from a later one."""
    return int(fields[19])


def marked(value: str, *, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Pids of the live processes whose environment holds ``MARK=value`` (this user's: others are unreadable)."""
    needle = f"{MARK}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exclude:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
        except OSError:
            continue
        fields = _stat(int(entry))
        if fields is not None and fields[0] != b"Z":  # not exited (a zombie waits for its parent)
            found.append(int(entry))
    return found


def descendants(root: int) -> dict[int, int]:
    """The live descendants of ``root``: pid -> start time."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is None or fields[0] == b"Z":
            continue
        try:
            children.setdefault(int(fields[1]), []).append((int(entry), _started(fields)))
        except (IndexError, ValueError):
            continue
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, started in children.get(todo.pop(), ()):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def _still(known: dict[int, int], exclude: frozenset[int]) -> list[int]:
    """The processes of ``known`` (pid -> start time) that still run, the same processes (not a reused pid)."""
    pids = []
    for pid, started in known.items():
        fields = _stat(pid)
        if pid not in exclude and fields is not None and fields[0] != b"Z" and _started(fields) == started:
            pids.append(pid)
    return pids


def sweep(value: str, *, exclude: frozenset[int] = frozenset(), known: dict[int, int] | None = None,
          timeout_s: float = _SWEEP_S, quiet_s: float = 0.0) -> int:
    """SIGKILL every process marked ``value`` or in ``known`` (pid -> start time) until none has been seen for
    ``quiet_s`` (or ``timeout_s``); how many were killed. ``quiet_s`` covers a process that a Ray process started
    just before it was killed, and that appears only after a look that found none."""
    killed: set[int] = set()
    now = time.monotonic()
    deadline, seen = now + timeout_s, now
    while True:
        pids = set(marked(value, exclude=exclude)) | set(_still(known or {}, exclude))
        now = time.monotonic()
        if pids:
            seen = now
        if (not pids and now - seen >= quiet_s) or now > deadline:
            return len(killed)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(_POLL_S)


def _forget_note(path: str, pid: int) -> None:
    """Remove the run note at ``path`` if it is still that of ``pid`` (a `kvd up` that is gone)."""
    try:
        with open(path) as fh:
            note = json.load(fh)
        if int(note.get("pid", 0)) == pid and not note.get("detached"):
            os.unlink(path)
    except (OSError, ValueError, TypeError, AttributeError):
        pass


class Reaper:
    """The reaper of this `kvd up` (the module's docstring), started before Ray: :meth:`mark` the environment that
    Ray's processes will inherit, :meth:`close` once they are stopped (it sweeps and exits; this waits)."""

    def __init__(self, run_note: str = "") -> None:
        import secrets
        import subprocess

        self.value = secrets.token_hex(8)
        self._proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), self.value, str(os.getpid()), run_note],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True,
        )

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    def mark(self) -> None:
        """Mark this process's environment: every process started from here on carries the mark."""
        os.environ[MARK] = self.value

    def close(self, timeout_s: float = _SWEEP_S + 5.0) -> None:
        """Let the reaper sweep (nothing is left after a clean stop) and wait for it to exit."""
        import subprocess

        os.environ.pop(MARK, None)
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.write(DONE)  # a finish, not a death: the pipe's end alone says `kvd up` died
                self._proc.stdin.close()
            self._proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()


def watch(parent: int, fd: int) -> tuple[bool, dict[int, int]]:
    """Wait for the pipe ``fd`` to end, looking at the descendants of ``parent`` meanwhile; returns whether
    ``parent`` said it finished (:data:`DONE`) and its descendants at the last look (pid -> start time)."""
    import select

    known: dict[int, int] = {}
    data = b""
    began = time.monotonic()
    while True:
        period = _LOOK_S if time.monotonic() - began < _LOOK_EARLY_S else _LOOK_LATE_S
        try:
            ready, _, _ = select.select([fd], [], [], period)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    return data.endswith(DONE), known
                data = (data + chunk)[-len(DONE):]
                continue
        except OSError:
            return False, known
        # the tree as it is: while `kvd up` runs it adopts its descendants' orphans (a subreaper), so a process
        # that left the tree has ended, and what is noted stays as large as the tree
        known = descendants(parent)


def main(argv: list[str]) -> int:
    value, parent = argv[0], int(argv[1])
    note = argv[2] if len(argv) > 2 else ""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # stopped only by the pipe's end (or SIGKILL)
    finished, known = watch(parent, sys.stdin.fileno())
    me = os.getpid()
    if finished:  # `kvd up` stopped its Ray itself; sweep up what may have slipped through
        sweep(value, exclude=frozenset({me, parent}), known=known)
        return 0
    sweep(value, exclude=frozenset({me}), known=known, quiet_s=_QUIET_S)
    if note:
        _forget_note(note, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
