"""A shard's bulk lane (:class:`BulkLane`): the second serving thread that runs large requests, so the loop
keeps answering small ones.

A request that moves ``BULK_MIN_BYTES`` or more (an append of that size, a get whose
range decodes to that size) or may wait on another process (``register``, which asks the coordinator) runs on
the shard's *bulk lane*, a second thread, and its reply comes back to the loop to be sent. Small requests keep
running on the loop meanwhile, and the store encodes and decodes large requests without its lock (kvd.store,
"Threads"), so a decode step's append is never queued behind a 64 MiB prefill. Requests of one connection
still start in the order received: while one of its requests is on the bulk lane, the connection's next
requests follow it there. The lane takes its requests from the connections in turn, as the loop does (one
request of each connection with requests waiting, round-robin), so one connection's pipelined prefills do not
hold another's behind all of them. The bulk lane also compacts the store when it has nothing else to do. The
shard's
ZeroMQ context has two I/O threads, so a connection's bytes do not wait behind every other connection's MiBs
either.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import zmq

from kvd.wire import protocol as p

__all__ = ["BULK_NICE", "BULK_THREAD_NAME", "BulkLane", "lower_thread_priority"]

log = logging.getLogger("kvd.wire.server")

BULK_NICE = 10  # the bulk lane's thread (and the codec thread it starts) yield the CPU to the loop's requests
_POLLIN, _DONTWAIT = int(zmq.POLLIN), int(zmq.DONTWAIT)


class BulkLane:
    """A shard's second serving thread: runs the requests the loop hands it (those ``_is_bulk`` picks, and reads
    the store finds large as they run: ``ToBulkLane``), each connection's in the order submitted and the
    connections in turn, and the store's compaction when it has none. The loop submits ``(ident, request,
    frames, size, fd)``; the lane appends ``(ident, reply frames,
    size, fd, is_error)`` to :attr:`done` and wakes the loop through an inproc PAIR socket (ZeroMQ sockets stay
    with the threads that use them)."""

    def __init__(self, ctx: zmq.Context[Any], reply: Callable[[Any], tuple[list[p.Frame], bool]],
                 idle: Callable[[], bool], *, compact_every: int, tick_s: float, name: str) -> None:
        self.done: collections.deque[tuple[bytes, list[p.Frame], int, int, bool]] = collections.deque()
        # each connection's jobs in the order submitted, and the connections with jobs in the order they take turns
        self._jobs: dict[bytes, collections.deque[tuple[bytes, Any, list[zmq.Frame], int, int]]] = {}
        self._turns: collections.deque[bytes] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._reply, self._idle = reply, idle
        self._compact_every = compact_every  # jobs between idle-work calls while jobs keep coming (0: never)
        self._tick_s = tick_s  # the longest the lane waits before idle work, and the loop for its replies
        self._stopping = False
        self._endpoint = f"inproc://{name}-{id(self):x}"
        self._rx = ctx.socket(zmq.PAIR)  # the loop's end
        self._rx.setsockopt(zmq.LINGER, 0)
        self._rx.bind(self._endpoint)
        self._ctx = ctx
        self._poll = [(None, _POLLIN), (self._rx, _POLLIN)]
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait(5.0)

    def submit(self, job: tuple[bytes, Any, list[zmq.Frame], int, int]) -> None:
        ident = job[0]
        with self._cv:
            jobs = self._jobs.get(ident)
            if jobs is None:
                jobs = self._jobs[ident] = collections.deque()
                self._turns.append(ident)
            jobs.append(job)
            self._cv.notify()

    def wait(self, sock: zmq.Socket[Any]) -> None:
        """(Loop thread) block until ``sock`` has a message or the lane a reply, at most ``tick_s``."""
        if self.done:
            return
        self._poll[0] = (sock, _POLLIN)
        zmq.zmq_poll(self._poll, int(self._tick_s * 1000))
        rx = self._rx
        with contextlib.suppress(zmq.Again):
            while True:
                rx.recv(_DONTWAIT, copy=False)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(10.0)
        self._rx.close(0)

    def _main(self, ready: threading.Event) -> None:
        lower_thread_priority(BULK_NICE, BULK_THREAD_NAME)
        tx = self._ctx.socket(zmq.PAIR)
        tx.setsockopt(zmq.LINGER, 0)
        tx.connect(self._endpoint)
        ready.set()
        idle_work = True
        since_idle = 0
        try:
            while True:
                with self._cv:
                    while not self._jobs and not self._stopping and not idle_work:
                        idle_work = not self._cv.wait(self._tick_s)  # a tick without work: compact again
                    if self._stopping:
                        return
                    job = self._take() if self._jobs else None
                if job is None:
                    since_idle = 0
                    idle_work = self._run_idle()
                    continue
                ident, req, frames, size, fd = job
                reply, error = self._reply(req)
                del req, frames, job  # the request's buffers go before the reply is sent
                self.done.append((ident, reply, size, fd, error))
                with contextlib.suppress(zmq.Again):  # (the loop also looks at `done` every turn)
                    tx.send(b"", _DONTWAIT)
                idle_work = True
                since_idle += 1
                if since_idle >= self._compact_every > 0:
                    since_idle = 0
                    self._run_idle()
        finally:
            tx.close(0)

    def _take(self) -> tuple[bytes, Any, list[zmq.Frame], int, int]:
        """(Under the lock) the oldest job of the connection whose turn it is; that connection goes to the back."""
        ident = self._turns.popleft()
        jobs = self._jobs[ident]
        job = jobs.popleft()
        if jobs:
            self._turns.append(ident)
        else:
            del self._jobs[ident]
        return job

    def _run_idle(self) -> bool:
        try:
            return self._idle()
        except Exception:  # noqa: BLE001 - idle work must not stop the lane
            log.exception("bulk lane: idle work failed")
            return False


BULK_THREAD_NAME = "kvd-bulk"  # the lane's name in the kernel (top -H, /proc/PID/task/*/comm)


def lower_thread_priority(steps: int, name: str) -> None:
    """Raise the calling thread's nice value by ``steps`` and give it ``name`` in the kernel (Linux: nice and
    the name are per thread, and threads it creates inherit both). Elsewhere, or when refused, nothing
    changes."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError) as exc:
        log.debug("thread name unchanged: %s", exc)
    if steps <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    except OSError as exc:
        log.debug("thread priority unchanged: %s", exc)
