"""The reaper of a `kvd up` that runs an embedded Ray: a small process that outlives it and stops what it leaves.

`kvd up` tears its Ray down itself on Ctrl-C, SIGTERM or `kvd down`. What it cannot handle is its own sudden end
(SIGKILL, the OOM killer, a crash): Ray's processes then lose their parent, and some of them (the dashboard and
runtime-env agents) never exit by themselves. So before Ray starts, `kvd up` starts this reaper (as a script:
stdlib only, no kvd import, in a session of its own so that a signal to the terminal's group does not reach it),
with a pipe on its stdin, and marks every process Ray will start with an environment variable (:data:`MARK`,
inherited by all of them, the workers too). The reaper waits for the pipe to close (`kvd up` closes it when it
has finished, and the kernel closes it when `kvd up` dies), then SIGKILLs every process that carries the mark
(but `kvd up` itself, if it is still running) until none is left, and removes the run note if it is still that
of the dead `kvd up`.

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
            with open(f"/proc/{entry}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":  # exited, waiting for its parent
                    continue
        except (OSError, IndexError):
            continue
        found.append(int(entry))
    return found


def sweep(value: str, *, exclude: frozenset[int] = frozenset(), timeout_s: float = _SWEEP_S,
          quiet_s: float = 0.0) -> int:
    """SIGKILL every process marked ``value`` until none has been seen for ``quiet_s`` (or ``timeout_s``); how
    many were killed. ``quiet_s`` covers a process that a Ray process started just before it was killed, and
    that appears only after a look that found none."""
    killed: set[int] = set()
    now = time.monotonic()
    deadline, seen = now + timeout_s, now
    while True:
        pids = marked(value, exclude=exclude)
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


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


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
                self._proc.stdin.close()
            self._proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()


def main(argv: list[str]) -> int:
    value, parent = argv[0], int(argv[1])
    note = argv[2] if len(argv) > 2 else ""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # stopped only by the pipe's end (or SIGKILL)
    try:
        while sys.stdin.buffer.read(4096):  # `kvd up` writes nothing: this returns at its end
            pass
    except OSError:
        pass
    if _alive(parent):  # a `kvd up` that finished: it stopped its Ray; sweep up what may have slipped through
        sweep(value, exclude=frozenset({os.getpid(), parent}))
        return 0
    sweep(value, exclude=frozenset({os.getpid()}), quiet_s=_QUIET_S)
    if note:
        _forget_note(note, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
