"""The disk tier's file I/O, and nothing else: whole-file writes that appear atomically, vectored reads into
the caller's buffers, dropping a file from the page cache, a directory lock. Every function raises OSError
as the system gives it; :mod:`kvd.store.disk.tier` turns them into kvd errors.

A file is written under a temporary name and renamed into place, so a file with the final name is always
whole: a process killed mid-write leaves only a ``*.tmp`` file, which :func:`scan` removes at the next start.
Writes are not fsynced: a killed process loses nothing the kernel accepted, and after a power loss a torn
file fails its checksums when read (and is dropped), never passing for data.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["SUFFIX", "write_file", "read_into", "read_head", "drop_cache", "scan", "lock_dir", "remove"]

SUFFIX = ".kvs"
_TMP = ".tmp"
_IOV_MAX = 512  # buffers per preadv / pwritev call (the system's IOV_MAX is 1024 on Linux)


def write_file(path: str, chunks: Sequence[Any]) -> int:
    """Write ``chunks`` (buffers) back to back as the file ``path``, atomically (temporary file, then rename).
    Returns the bytes written. On any error the temporary file is removed and the error raised."""
    tmp = path + _TMP
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    off = 0
    try:
        views = [memoryview(c).cast("B") for c in chunks if len(c)]
        i = 0
        while i < len(views):
            batch = views[i : i + _IOV_MAX]
            n = os.pwritev(fd, batch, off)
            off += n
            i = _advance(views, i, n)  # a short write goes on from where it stopped
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return off


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """After ``n`` bytes moved into or out of ``views[i:]``, the index of the first view not yet done (a partly
    done one is cut to what is left)."""
    while n:
        head = len(views[i])
        if n < head:
            views[i] = views[i][n:]
            break
        n -= head
        i += 1
    return i


def read_into(path: str, offset: int, buffers: Sequence[Any]) -> None:
    """Fill ``buffers`` (writable) from ``path`` starting at ``offset``, back to back. EOFError if the file ends
    before they are full (a file shorter than its header says: damaged, not an I/O error)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        i = 0
        while i < len(views):
            n = os.preadv(fd, views[i : i + _IOV_MAX], offset)
            if n == 0:
                raise EOFError(f"{path} ends at byte {offset}, before the pages its header lists")
            offset += n
            i = _advance(views, i, n)
    finally:
        os.close(fd)


def read_head(path: str, nbytes: int) -> bytes:
    """The first ``nbytes`` of ``path`` (fewer if it is shorter)."""
    with open(path, "rb", buffering=0) as f:
        return f.read(nbytes)


def drop_cache(path: str) -> None:
    """Ask the kernel to drop ``path`` from the page cache (a benchmark's cold read)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def remove(path: str) -> bool:
    """Unlink ``path``; False if it was not there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def scan(directory: str) -> list[tuple[str, int]]:
    """``(path, size)`` of every spill file in ``directory``; temporary files of writes a killed process left
    are removed."""
    out = []
    with os.scandir(directory) as it:
        for entry in it:
            if entry.name.endswith(_TMP):
                remove(entry.path)
            elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                out.append((entry.path, entry.stat(follow_symlinks=False).st_size))
    return out


def lock_dir(directory: str) -> int:
    """Create ``directory`` if needed and take an exclusive lock on it (a ``LOCK`` file) for this process's
    life: two shards on one directory would each delete the other's files. Returns the lock's fd. OSError
    (BlockingIOError) if another process holds it."""
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd
