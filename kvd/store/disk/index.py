"""The disk tier's index (pure): which sequences are on disk, what they take, and which go first when the disk
budget is full (least recently used). No I/O and no locking: :class:`kvd.store.disk.tier.DiskTier` owns both.

An :class:`Entry` is either *pending* (spilled, its records still in memory, waiting for the writer thread) or
*written* (its file is whole on disk). Both count against the disk budget from the moment of the spill, so the
budget is never over-committed by writes in flight.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvd.codec import pages
from kvd.store.disk.format import SeqHeader, record_sizes

__all__ = ["Entry", "DiskIndex", "ENTRY_META_BYTES"]

# The index's own memory per sequence on disk (the entry, its header object, its key), outside the RAM budget.
ENTRY_META_BYTES = 600

Key = tuple[str, Any]


class Entry:
    """One sequence on disk. ``records`` / ``tail`` hold its data while it is pending (None once written);
    ``nbytes`` is its file's size."""

    __slots__ = ("key", "header", "path", "offset", "nbytes", "head", "records", "tail", "written", "by_fmt")

    def __init__(self, key: Key, header: SeqHeader, path: str, offset: int, nbytes: int) -> None:
        self.key = key
        self.header = header
        self.path = path
        self.offset = offset  # where the records start in the file (after the prefix and header)
        self.nbytes = nbytes
        self.head = b""  # the prefix and header to write, while pending
        self.records: list[list[bytearray]] | None = None
        self.tail: Any = None
        self.written = False
        by_fmt: dict[str, list[int]] = {}
        for code, size in zip(header.fmts, record_sizes(header), strict=True):
            c = by_fmt.setdefault(pages.LEVELS[code], [0, 0])
            c[0] += 1
            c[1] += size
        self.by_fmt = by_fmt

    @property
    def length(self) -> int:
        return self.header.length


class DiskIndex:
    """Entries in least-recently-used order (first = coldest), and their totals against ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[Key, Entry] = OrderedDict()
        self.used_bytes = 0
        self.tokens = 0
        self.pages_by_fmt = dict.fromkeys(pages.LEVELS, 0)
        self.bytes_by_fmt = dict.fromkeys(pages.LEVELS, 0)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: Key) -> Entry | None:
        return self.entries.get(key)

    def add(self, entry: Entry) -> None:
        """Count ``entry`` as the most recently used (a key already present is replaced)."""
        if entry.key in self.entries:
            self.remove(entry.key)
        self.entries[entry.key] = entry
        self.used_bytes += entry.nbytes
        self.tokens += entry.length
        for fmt, (n, b) in entry.by_fmt.items():
            self.pages_by_fmt[fmt] += n
            self.bytes_by_fmt[fmt] += b

    def remove(self, key: Key) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes
            self.tokens -= entry.length
            for fmt, (n, b) in entry.by_fmt.items():
                self.pages_by_fmt[fmt] -= n
                self.bytes_by_fmt[fmt] -= b
        return entry

    def touch(self, key: Key) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def victims(self, nbytes: int) -> list[Key] | None:
        """The least recently used keys whose removal makes room for ``nbytes`` more; None if even removing
        every entry would not."""
        if nbytes > self.capacity_bytes:
            return None
        free = self.capacity_bytes - self.used_bytes
        out: list[Key] = []
        it = iter(self.entries.values())
        while free < nbytes:
            entry = next(it)
            out.append(entry.key)
            free += entry.nbytes
        return out
