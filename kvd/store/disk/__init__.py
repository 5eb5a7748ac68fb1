"""A shard's disk tier: the rung below q4 on the ladder fp16 -> 8-bit -> 4-bit -> disk -> forget.

``format`` the bytes of one spilled sequence's file (pure); ``index`` which sequences are on disk and which go
first when the disk is full (pure); ``files`` the file I/O (thin); ``tier`` the :class:`DiskTier` that ties them
together with a writer thread. :class:`kvd.store.Store` uses it when given a ``disk_path``.
"""

from kvd.store.disk.tier import DEFAULT_WRITE_BUFFER_BYTES, DiskTier

__all__ = ["DEFAULT_WRITE_BUFFER_BYTES", "DiskTier"]
