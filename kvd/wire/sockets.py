"""Process and socket settings shared by kvd's servers and clients: glibc malloc tuning (:func:`tune_malloc`),
heartbeat defaults, and multipart frame I/O with a copy threshold (:func:`send_frames`, :func:`recv_frames`)."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import zmq
import zmq.backend

__all__ = ["COPY_THRESHOLD_BYTES", "DEFAULT_HEARTBEAT_IVL_S", "DEFAULT_HEARTBEAT_TIMEOUT_S", "HANDSHAKE_TIMEOUT_S",
           "recv_frames", "send_frames", "tune_malloc"]

COPY_THRESHOLD_BYTES = 64 * 1024  # frames at least this big are sent zero-copy (pyzmq's own threshold)
DEFAULT_HEARTBEAT_IVL_S = 2.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
# A peer must finish the ZMTP handshake (greeting, and CURVE if on) within this: a connection that sends
# garbage or nothing is closed instead of being held for ZeroMQ's default 30 s. A real client takes milliseconds.
HANDSHAKE_TIMEOUT_S = 3.0
# Plain ints and pyzmq's backend methods on the hot path: the sugar layer's enum flags and option wrappers cost
# microseconds per call, a measurable share of a small request.
_SNDMORE = int(zmq.SNDMORE)
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv


def recv_frames(sock: zmq.Socket[Any], flags: int = 0) -> list[zmq.Frame]:
    """One multipart message as zero-copy frames (``frame.buffer`` is a view of the received bytes)."""
    part = _recv(sock, flags, False, False)
    parts = [part]
    while part.more:  # the frame's own flag: a getsockopt(RCVMORE) per frame costs ~2 us
        part = _recv(sock, 0, False, False)
        parts.append(part)
    return parts


def send_frames(sock: zmq.Socket[Any], frames: list[Any], first_flags: int = 0) -> int:
    """Send ``frames`` as one multipart message: frames of ``COPY_THRESHOLD_BYTES`` and more without copying
    them. ``first_flags`` apply to the first part only (NOBLOCK: raises zmq.Again before anything is sent).
    Returns the bytes sent."""
    last = len(frames) - 1
    size = 0
    for i, f in enumerate(frames):
        n = len(f)
        size += n
        flags = (first_flags if i == 0 else 0) | (0 if i == last else _SNDMORE)
        _send(sock, f, flags, n < COPY_THRESHOLD_BYTES, False)
    return size


MALLOC_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: every buffer of a legal message but the biggest
MALLOC_TRIM_THRESHOLD_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)


def tune_malloc(*, mmap_threshold_bytes: int = MALLOC_MMAP_THRESHOLD_BYTES,
                trim_threshold_bytes: int = MALLOC_TRIM_THRESHOLD_BYTES) -> bool:
    """Make glibc's malloc recycle large buffers in this process instead of returning them to the OS.

    Every request and reply of MiBs allocates buffers of that size (ZeroMQ's receive buffers, the store's
    results). By default glibc maps such buffers fresh and unmaps them when freed, so each one costs a page fault
    per 4 KiB on first touch: measured here (bench/wire.py) that doubles the time of an 8 MiB request with 8 in
    flight. With buffers up to ``mmap_threshold_bytes`` taken from the heap, and up to ``trim_threshold_bytes``
    of free heap kept, they are reused warm. Process-wide; the cost is that up to ``trim_threshold_bytes`` of
    freed memory stays mapped. Returns False (and changes nothing) where malloc is not glibc's.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # one arena: a thread's own arena unmaps a heap as soon as it is all free, whatever the trim threshold, so
    # the serving thread's buffers would be fresh pages again on every request
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes)) == 1
                and mallopt(_M_TRIM_THRESHOLD, int(trim_threshold_bytes)) == 1
                and mallopt(_M_ARENA_MAX, 1) == 1)
