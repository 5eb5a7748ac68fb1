"""One shard's memory, pure (no ray, no zmq): :class:`Store` and its parts.

``core`` is the Store (its public methods, locking, accounting); ``sequences`` the page tables of namespaces and
sequences; ``pool`` records and the page writers; ``compact`` re-encoding of cold pages at a new level; ``evict``
admission, LRU eviction and removal; ``spill`` the store's side of its disk tier and ``disk/`` the tier itself
(file format, index, file I/O, writer thread); ``buffers`` the warm result buffers of large gets.
"""

from kvd.store.core import (
    DEFAULT_PAGE_TOKENS,
    DEFAULT_SINK_TOKENS,
    DEFAULT_WINDOW_TOKENS,
    EIGHT_BIT_FORMATS,
    PACK_FRAME_BYTES,
    OnDisk,
    ReadTooLarge,
    Store,
)

__all__ = ["DEFAULT_PAGE_TOKENS", "DEFAULT_SINK_TOKENS", "DEFAULT_WINDOW_TOKENS", "EIGHT_BIT_FORMATS",
           "OnDisk", "PACK_FRAME_BYTES", "ReadTooLarge", "Store"]
