"""A shard's disk tier: spilled sequences in files, a writer thread, verified reads, recovery at start.

Theory of operation
-------------------
The store (:class:`kvd.store.Store`) calls :meth:`DiskTier.spill` under its lock when it must make room and
can compress no further: the sequence's records (already encoded, never written again) and a copy of its hot
tail become a *pending* entry of the index, and the store frees them from its RAM budget at once. No I/O runs
on the caller's thread: one writer thread per tier writes pending entries to files (:mod:`.files`, whole
files renamed into place) and performs removals, in the order they were asked. Pending data waits in a
bounded write buffer (``write_buffer_bytes``); when it is full a spill is refused and the store forgets (or
refuses, under ``eviction="none"``) as it does without a disk, counting it (``spill_refusals``). A pending
entry is served from memory; a written one is read back by :meth:`load`, which verifies every page's checksum,
the trailers' digest and the geometry before returning anything (CorruptPage otherwise, and the file is
dropped). When the disk budget is full, the least recently used entries are removed to make room.

A write that fails (ENOSPC, EIO) keeps its entry pending, served from memory, and stops spilling for
``RETRY_S``; it is then tried again. The error is counted and kept (``disk_errors``, ``disk_last_error``),
and every spill refused meanwhile says why, so an append that cannot be placed names the disk's error.

At start, :meth:`recover` scans the directory, reads only each file's header, and rebuilds the index (spill
order = LRU order). Files that fail their header check, or whose geometry the store does not take, are removed.

Lock order: the store's lock, then the tier's. The writer thread takes only the tier's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import xxhash

from kvd.codec import batch as page_batch
from kvd.codec import pages
from kvd.errors import ConfigError, CorruptPage, DiskError
from kvd.store.disk import files
from kvd.store.disk import format as fmt
from kvd.store.disk.index import ENTRY_META_BYTES, DiskIndex, Entry, Key

__all__ = ["DiskTier", "DEFAULT_WRITE_BUFFER_BYTES", "RETRY_S", "Loaded"]

log = logging.getLogger("kvd.store.disk")

DEFAULT_WRITE_BUFFER_BYTES = 64 << 20
RETRY_S = 1.0  # after a failed write, spills are refused this long, then the write is tried again
_HEAD_READ = 64 << 10  # bytes read per file at recovery: the prefix and, almost always, the whole header

# (per-layer record lists, tail [2, L, fill, H, D] float16 or None)
Loaded = tuple[list[list[bytearray]], "np.ndarray | None"]


def file_name(namespace: str, seq_id: str | int) -> str:
    """A sequence's file name: a stable 128-bit hash of its key (names can hold any characters)."""
    return xxhash.xxh3_128_hexdigest(msgpack.packb([namespace, seq_id], use_bin_type=True)) + files.SUFFIX


class DiskTier:
    """The disk tier of one store, in ``directory`` (created; locked against a second process), holding at most
    ``capacity_bytes`` of files. ``fresh``: remove whatever the directory holds instead of recovering it.
    ``allow_evict``: remove least recently used files when the budget is full (the store's ``eviction="lru"``);
    else a spill that does not fit is refused. Raises ConfigError for a directory it cannot use."""

    def __init__(self, directory: str, capacity_bytes: int, *,
                 write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_BYTES, fresh: bool = False,
                 allow_evict: bool = True) -> None:
        if capacity_bytes < 1:
            raise ConfigError(f"disk capacity must be positive, got {capacity_bytes}")
        self.directory = os.path.abspath(directory)
        try:
            self._lock_fd = files.lock_dir(self.directory)
        except BlockingIOError:
            raise ConfigError(f"disk path {self.directory} is in use by another store (a kvd shard of this or "
                              "another process): one directory per shard") from None
        except OSError as exc:
            raise ConfigError(f"disk path {self.directory} cannot be used: {exc}") from None
        if fresh:
            for path, _ in files.scan(self.directory):
                files.remove(path)
        self.write_buffer_bytes = write_buffer_bytes
        self.allow_evict = allow_evict
        self._index = DiskIndex(capacity_bytes)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._queue: deque[tuple[str, Any]] = deque()
        self._pending_bytes = 0
        self._serial = 0
        self._failing_until = 0.0
        self._failed: list[Entry] = []  # pending entries whose write failed, tried again after RETRY_S
        self._closed = False
        self._busy = False  # the writer is between taking a job and finishing it
        self.counters = dict.fromkeys((
            "spills", "spilled_bytes", "spill_refusals", "disk_writes", "disk_written_bytes", "disk_reads",
            "disk_read_bytes", "disk_evictions", "disk_evicted_tokens", "disk_errors", "disk_corrupt",
            "recovered_sequences", "recovered_bytes", "recovery_dropped_files"), 0)
        self.last_error = ""
        self.recovery_s = 0.0
        self._thread = threading.Thread(target=self._writer, name="kvd-disk-writer", daemon=True)

    # ------------------------------------------------------------------------------------------ start, stop

    def recover(self, accept: Callable[[fmt.SeqHeader], str | None]) -> list[fmt.SeqHeader]:
        """Rebuild the index from the directory's files, then start the writer. ``accept(header)`` returns None
        to take a sequence, or why not (the file is then removed). Returns the headers taken, oldest spill
        first. Call once, before any other method."""
        t0 = time.perf_counter()
        found: list[Entry] = []
        for path, size in files.scan(self.directory):
            try:
                entry = self._read_entry(path, size)
            except (CorruptPage, OSError) as exc:
                log.warning("disk tier: removing %s: %s", path, exc)
                files.remove(path)
                self.counters["recovery_dropped_files"] += 1
                continue
            why = accept(entry.header)
            if why is not None:
                log.warning("disk tier: removing %s (%r in %r): %s", path, entry.header.seq_id,
                            entry.header.namespace, why)
                files.remove(path)
                self.counters["recovery_dropped_files"] += 1
                continue
            found.append(entry)
        found.sort(key=lambda e: e.header.serial)
        for entry in found:
            entry.written = True
            self._index.add(entry)
        self._serial = found[-1].header.serial + 1 if found else 0
        victims = self._index.victims(0) or []  # a smaller budget than the last run's: the coldest go
        for key in victims:
            gone = self._index.remove(key)
            assert gone is not None
            files.remove(gone.path)
            self.counters["disk_evictions"] += 1
            self.counters["disk_evicted_tokens"] += gone.length
        self.counters["recovered_sequences"] = len(self._index)
        self.counters["recovered_bytes"] = self._index.used_bytes
        self.recovery_s = time.perf_counter() - t0
        self._thread.start()
        return [e.header for e in self._index.entries.values()]

    def _read_entry(self, path: str, size: int) -> Entry:
        head = files.read_head(path, _HEAD_READ)
        n, digest = fmt.parse_prefix(head)
        if fmt.PREFIX_BYTES + n > len(head):
            head = files.read_head(path, fmt.PREFIX_BYTES + n)
        h = fmt.parse_header(head[fmt.PREFIX_BYTES : fmt.PREFIX_BYTES + n], digest)
        offset = fmt.PREFIX_BYTES + n
        if size != offset + h.body_bytes():
            raise CorruptPage(f"file is {size} bytes, its header says {offset + h.body_bytes()}")
        if os.path.basename(path) != file_name(h.namespace, h.seq_id):
            raise CorruptPage("the file's name does not match the sequence its header names")
        return Entry((h.namespace, h.seq_id), h, path, offset, size)

    def close(self, *, flush: bool = True) -> None:
        """Stop the writer (``flush``: after every pending write and removal is done) and release the
        directory. Idempotent."""
        with self._cv:
            if self._closed:
                return
            if flush:
                self._failing_until = 0.0
                self._requeue_failed()
                while (self._queue or self._busy) and self._thread.is_alive():
                    self._cv.wait(0.1)
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ------------------------------------------------------------------------------------------ the store's side

    def get(self, key: Key) -> Entry | None:
        with self._lock:
            return self._index.get(key)

    def spill(self, header: fmt.SeqHeader, records: list[list[bytearray]], tail: np.ndarray | None, *,
              wait_s: float = 0.0) -> str | None:
        """Take a sequence out of RAM: ``records`` per layer (never written again), ``tail`` its hot tail's filled
        tokens ``[2, L, fill, H, D]`` (a copy). Returns None when taken, else why not (nothing changed).
        ``wait_s``: wait up to that long for room in the write buffer (or a failing disk) instead of refusing at
        once (a shard stopping)."""
        key = (header.namespace, header.seq_id)
        deadline = time.monotonic() + wait_s
        with self._cv:
            header = dataclasses.replace(header, serial=self._serial)
            head = fmt.encode_header(header)
            nbytes = len(head) + header.body_bytes()
            while True:
                why = self._spill_refusal(nbytes)
                if why is None or self._closed or time.monotonic() >= deadline:
                    break
                self._cv.wait(0.1)
            if why is None:
                victims = self._index.victims(nbytes)
                if victims is None:
                    why = f"larger ({nbytes} bytes) than the disk budget of {self._index.capacity_bytes} bytes"
                elif victims and not self.allow_evict:
                    why = f"the disk budget ({self._index.capacity_bytes} bytes) is full and eviction is off"
            if why is not None:
                self.counters["spill_refusals"] += 1
                return why
            for victim in victims or ():
                self._evict(victim)
            entry = Entry(key, header, os.path.join(self.directory, file_name(*key)), len(head), nbytes)
            entry.head, entry.records, entry.tail = head, records, tail
            self._index.add(entry)
            self._serial += 1
            self._pending_bytes += nbytes
            self._queue.append(("write", entry))
            self._cv.notify_all()
            self.counters["spills"] += 1
            self.counters["spilled_bytes"] += nbytes
            return None

    def _spill_refusal(self, nbytes: int) -> str | None:
        if self._closed:
            return "the disk tier is closed"
        if time.monotonic() < self._failing_until:
            return f"the disk failed a write: {self.last_error}"
        if self._pending_bytes and self._pending_bytes + nbytes > self.write_buffer_bytes:
            return (f"the disk write buffer is full ({self._pending_bytes} of {self.write_buffer_bytes} bytes "
                    "waiting to be written)")
        return None

    def _evict(self, key: Key) -> None:
        entry = self._forget(key)
        if entry is not None:
            self.counters["disk_evictions"] += 1
            self.counters["disk_evicted_tokens"] += entry.length

    def _forget(self, key: Key) -> Entry | None:
        """(Under the lock) take ``key`` out of the index; its file goes by the writer, in order."""
        entry = self._index.remove(key)
        if entry is None:
            return None
        if entry.written:
            self._queue.append(("unlink", entry.path))
            self._cv.notify_all()
        else:  # pending: its write is skipped (the writer checks the index); its memory is released now
            self._pending_bytes -= entry.nbytes
            entry.records = entry.tail = None
            if entry in self._failed:
                self._failed.remove(entry)
            self._cv.notify_all()
        return entry

    def remove(self, key: Key) -> Entry | None:
        """Forget ``key`` (a drop, or a sequence taken back into RAM). Returns its entry, or None."""
        with self._cv:
            return self._forget(key)

    def discard(self, entry: Entry) -> None:
        """Remove ``entry`` if it is still the current one for its key (a damaged file), counting it."""
        with self._cv:
            if self._index.get(entry.key) is entry:
                self.counters["disk_corrupt"] += 1
                self._forget(entry.key)

    def touch(self, key: Key) -> None:
        with self._lock:
            self._index.touch(key)

    def pending(self, entry: Entry) -> Loaded | None:
        """``entry``'s records and tail if it is still pending (in memory: no disk read needed), else None."""
        with self._lock:
            return None if entry.records is None else (entry.records, entry.tail)

    def load(self, entry: Entry, *, verify_pages: bool = True) -> Loaded:
        """``entry``'s records per layer and its tail: from memory while pending, else read from its file and
        verified (the trailers' digest, the formats the header lists, and with ``verify_pages`` every page's
        checksum; a caller that decodes every page, which checks it, passes False and calls :meth:`discard`
        on CorruptPage). Raises CorruptPage (the entry is then removed), DiskError for an I/O error,
        FileNotFoundError if the entry was removed meanwhile. Run it without the store's lock: it reads."""
        with self._lock:
            records, tail = entry.records, entry.tail
        if records is not None:
            return records, tail
        h = entry.header
        layers, heads, dim = h.layout
        sizes = fmt.record_sizes(h)
        recs = [page_batch.new_record(s) for s in sizes]
        tp = h.tail_page_bytes()
        tail_bufs = [bytearray(tp) for _ in range(2 * layers)] if tp else []
        try:
            try:
                files.read_into(entry.path, entry.offset, recs + tail_bufs)
            except EOFError as exc:
                raise CorruptPage(str(exc)) from None
            out = _verified(h, recs, tail_bufs, verify_pages)
        except FileNotFoundError:
            raise
        except OSError as exc:
            with self._lock:
                self.counters["disk_errors"] += 1
                self.last_error = f"read {entry.path}: {exc}"
            raise DiskError(f"reading sequence {h.seq_id!r} of {h.namespace!r} from {entry.path}: {exc}") from None
        except CorruptPage as exc:
            self.discard(entry)
            raise CorruptPage(f"sequence {h.seq_id!r} of {h.namespace!r} on disk is damaged ({exc}); it was "
                              "dropped") from None
        with self._lock:
            self.counters["disk_reads"] += 1
            self.counters["disk_read_bytes"] += entry.nbytes
        return out

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every spill and removal asked so far is on disk (or failed). Returns False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cv.wait(min(left, 0.1))
            return True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            idx = self._index
            out: dict[str, Any] = {
                "disk_path": self.directory,
                "disk_capacity_bytes": idx.capacity_bytes,
                "disk_used_bytes": idx.used_bytes,
                "disk_pending_bytes": self._pending_bytes,
                "disk_write_buffer_bytes": self.write_buffer_bytes,
                "disk_sequences": len(idx),
                "disk_tokens": idx.tokens,
                "disk_index_bytes": len(idx) * ENTRY_META_BYTES,
                "disk_pages_by_level": {k: v for k, v in idx.pages_by_fmt.items() if v},
                "disk_bytes_by_level": {k: v for k, v in idx.bytes_by_fmt.items() if v},
                "disk_last_error": self.last_error,
                "disk_recovery_s": self.recovery_s,
            }
            out.update(self.counters)
            return out

    # ------------------------------------------------------------------------------------------ the writer

    def _requeue_failed(self) -> None:
        for entry in self._failed:
            self._queue.append(("write", entry))
        self._failed.clear()
        self._cv.notify_all()

    def _writer(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    if self._failed and time.monotonic() >= self._failing_until:
                        self._requeue_failed()
                        continue
                    self._cv.wait(RETRY_S if self._failed else None)
                if not self._queue:
                    return
                op, item = self._queue.popleft()
                if op == "write":
                    entry: Entry = item
                    if self._index.get(entry.key) is not entry or entry.records is None:
                        continue  # dropped or evicted while pending
                    chunks = [entry.head, *(r for recs in entry.records for r in recs)]
                    tail = entry.tail
                self._busy = True
            try:
                if op == "unlink":
                    self._unlink(item)
                else:
                    self._write(item, chunks, tail)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _unlink(self, path: str) -> None:
        try:
            files.remove(path)
        except OSError as exc:
            with self._lock:
                self.counters["disk_errors"] += 1
                self.last_error = f"remove {path}: {exc}"
            log.error("disk tier: cannot remove %s: %s", path, exc)

    def _write(self, entry: Entry, chunks: list[Any], tail: np.ndarray | None) -> None:
        if tail is not None:
            for i in range(tail.shape[1]):
                chunks.append(pages.encode(tail[0, i], "fp16", role="key"))
                chunks.append(pages.encode(tail[1, i], "fp16", role="value"))
        try:
            n = files.write_file(entry.path, chunks)
        except OSError as exc:
            with self._cv:
                self.counters["disk_errors"] += 1
                self.last_error = f"write {entry.path}: {exc}"
                self._failing_until = time.monotonic() + RETRY_S
                if self._index.get(entry.key) is entry:
                    self._failed.append(entry)  # still pending, still served from memory
            log.error("disk tier: cannot write %s: %s", entry.path, exc)
            return
        with self._cv:
            if self._index.get(entry.key) is entry:
                entry.written = True
                entry.records = entry.tail = None
                entry.head = b""
                self._pending_bytes -= entry.nbytes
                self.counters["disk_writes"] += 1
                self.counters["disk_written_bytes"] += n
                return
        files.remove(entry.path)  # dropped while it was being written (a newer write of the key comes later)


def _verified(h: fmt.SeqHeader, recs: list[bytearray], tail_bufs: list[bytearray], verify_pages: bool) -> Loaded:
    """Check what was read against the header (and every page's own checksum if ``verify_pages``); the records
    per layer and the tail as an array (its pages are checked as they are decoded)."""
    if fmt.trailers_digest(recs) != h.trailers:
        raise CorruptPage("page trailers do not match the header's digest")
    off = fmt.TRAILER_BYTES - 27  # the current format byte, from the record's end (kvd.store.pool)
    for rec, code in zip(recs, h.fmts, strict=True):
        if rec[len(rec) - off] != code:
            raise CorruptPage("a page's format is not the one the header lists")
    layers, heads, dim = h.layout
    for rec, code in zip(recs, h.fmts, strict=True) if verify_pages else ():
        f = pages.LEVELS[code]
        rh = () if f == "fp16" else h.raw_heads
        mv = memoryview(rec)
        kb = pages.nbytes(f, h.page_tokens, heads, dim, role="key", raw_heads=rh) if h.sizes is None \
            else pages.header(mv).nbytes
        pages.verify(mv[:kb])
        pages.verify(mv[kb : len(rec) - fmt.TRAILER_BYTES])
    per_layer = [recs[i * h.rows : (i + 1) * h.rows] for i in range(layers)]
    tail = None
    if tail_bufs:
        tail = np.empty((2, layers, h.tail_fill, heads, dim), np.float16)
        for i in range(layers):
            pages.decode_into(tail_bufs[2 * i], tail[0, i])
            pages.decode_into(tail_bufs[2 * i + 1], tail[1, i])
    return per_layer, tail
