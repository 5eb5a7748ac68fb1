"""Every thread of a kvd server process at normal priority (nice 0).

Ray starts its worker processes at nice 15 (Ray's ``worker_niceness``), so a shard or coordinator actor, every
thread of it (the serving thread, ZeroMQ's I/O thread, the reporter), yields the CPU to any ordinary process: on
2 busy cores a shard served 64 KiB puts at 0.02 GB/s (p50 4 ms) against 0.23 GB/s (p50 139 us) at nice 0
(issue 18). A server should not yield like that. ``renice -n 0 -p PID`` is not enough either: on Linux the nice
value belongs to each thread, and renice moves only the main one.

:func:`normal_priority` is called first thing in the actors' ``__init__``: it sets every thread that exists to
nice 0, and threads created afterwards (ZeroMQ's I/O thread, the server and reporter threads) inherit nice 0
from the thread that creates them. Lowering a nice value needs ``CAP_SYS_NICE`` (root) or an ``RLIMIT_NICE`` of
at least 20; without either it logs a warning that names the Ray setting which does the same from the start:
``RAY_worker_niceness=0`` in the environment of ``ray start`` on every node (or of the process whose
``ray.init`` starts Ray).
"""

from __future__ import annotations

import logging
import os

__all__ = ["NORMAL_NICE", "normal_priority", "thread_nice_values"]

log = logging.getLogger("kvd.cluster.priority")

NORMAL_NICE = 0
_TASKS = "/proc/self/task"


def _in_ray_worker() -> bool:
    """Whether this process is a Ray worker (an actor's process), where Ray has lowered the priority."""
    try:
        import ray
        from ray._private import worker

        return bool(ray.is_initialized() and worker.global_worker.mode == worker.WORKER_MODE)
    except Exception:  # noqa: BLE001 - no Ray, or its internals moved: act as outside a worker
        return False


def thread_nice_values(pid: int | str = "self") -> dict[int, int]:
    """``{thread id: nice}`` of every thread of process ``pid`` (Linux: /proc/PID/task/*/stat)."""
    out: dict[int, int] = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = int(fields[16])  # field 19 of stat(5); fields[0] is field 3 (the state)
    return out


def normal_priority(*, only_in_ray_worker: bool = True) -> int:
    """Set every thread of this process to nice 0; returns how many were changed. Outside a Ray worker it does
    nothing unless ``only_in_ray_worker`` is false (the actor classes also run in plain processes, e.g. tests,
    whose priority is their owner's business). Never raises: a server at low priority still serves."""
    if only_in_ray_worker and not _in_ray_worker():
        return 0
    if not hasattr(os, "setpriority") or not os.path.isdir(_TASKS):  # pragma: no cover - not Linux
        return 0
    changed = 0
    for tid, nice in thread_nice_values().items():
        if nice == NORMAL_NICE:
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, tid, NORMAL_NICE)  # Linux: a thread id names that thread alone
            changed += 1
        except ProcessLookupError:
            continue
        except PermissionError:
            log.warning(
                "kvd runs at nice %d (Ray's worker priority) and may not lower it: start Ray with "
                "RAY_worker_niceness=0 in the environment of `ray start` on every node, or give the workers "
                "CAP_SYS_NICE", nice,
            )
            break
    return changed
