"""Which sequence a full store gives up first: what no lookup can reach, then chain tails, the deepest first,
then by recency.

Theory of operation
-------------------
An engine that stores a prompt one block per sequence (the vLLM connector) chains the blocks: block i is found
only through blocks 0..i-1, because a lookup stops at the first missing block. An append that creates a
sequence may name its *parent* (the previous block's sequence, in the same namespace) and states its
``position`` in the prompt; the store then ranks every sequence it holds in memory:

0. **unreachable**: its parent left the store (evicted or dropped), or its parent is unreachable. No lookup can
   reach it while it still takes memory. A parent that comes back (a later prompt recomputes and stores it)
   makes its chain reachable again. A parent the store never held (on another shard, or only in the engine's
   own cache) leaves the child reachable.
1. **tail**: reachable, and no sequence in memory names it as parent: a chain's last block, or a sequence
   outside any chain.
2. **inner**: some sequence in memory names it as parent. It goes only after every tail: evicting it would
   make its descendants unreachable.

Within a tier the sequence deepest in its prompt (the largest ``position``) goes first, then the least recently
used: a prompt's later blocks are shared by fewer prompts than its earlier ones (a block is reused only by prompts
that share everything before it), so they are the cheapest to lose. Sequences outside chains (no parent,
position 0) are ordered by recency alone, as LRU; ``by_prefix=False`` orders everything that way (the store's
``eviction_order="recency"``).

Replaying the prefix workload of bench/serve.py into a 64 MiB store (bench/serve.py --replay): LRU served 18.3%
of prompt tokens from the store, this order 25.0%, what an unlimited budget serves (BENCHMARKS.md, "Serving"):
under LRU each prompt's unique last block pushes out older prompts' shared prefixes; ranked by depth, the
unique blocks go first.

Each sequence has one current heap entry ``(tier, -depth, tick, key)`` (``tick``: a use counter at its last
use); a use or a tier change pushes a new one and leaves the old one stale, skipped when it surfaces, and the
heap is rebuilt from the current entries when stale ones outnumber them. A use costs O(log n), an eviction
O(log n) amortized; making a subtree unreachable or reachable again walks it once.

A sequence that moves to a disk tier leaves memory but counts as reachable (a lookup finds it on disk): its
children in memory are reachable and name a parent no longer in memory. The chain is known within one store: a
client sends a parent only when both sequences live on the same shard, so a chain that crosses shards is
ranked as several shorter ones.

Pure core: no Ray, no ZeroMQ.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator

__all__ = ["Chains", "INNER", "TAIL", "UNREACHABLE"]

UNREACHABLE, TAIL, INNER = 0, 1, 2
_REBUILD_SLACK = 64  # stale heap entries tolerated beyond the live ones before a rebuild


class Chains:
    """The eviction order of the sequences a store holds in memory (see the module docstring). Keys are any
    hashable (the store's ``(namespace, seq_id)``); the caller holds the store's lock."""

    __slots__ = ("_state", "_parent", "_children", "_lost", "_heap", "_tick", "_depth", "_by_prefix")

    def __init__(self, *, by_prefix: bool = True) -> None:
        self._by_prefix = by_prefix
        self._state: dict[Hashable, tuple[int, int, int]] = {}  # key in memory -> its current entry
        self._parent: dict[Hashable, Hashable] = {}  # key in memory -> the parent it named
        self._children: dict[Hashable, set[Hashable]] = {}  # parent (in memory or not) -> its children in memory
        self._lost: set[Hashable] = set()  # keys in memory no lookup can reach
        self._heap: list[tuple[int, int, int, Hashable]] = []
        self._depth: dict[Hashable, int] = {}
        self._tick = 0

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def tier(self, key: Hashable) -> int:
        """The tier of a key in memory (KeyError otherwise)."""
        return self._state[key][0]

    def _tier_of(self, key: Hashable) -> int:
        if not self._by_prefix:
            return TAIL
        if key in self._lost:
            return UNREACHABLE
        return INNER if self._children.get(key) else TAIL

    def _push(self, key: Hashable, tick: int) -> None:
        entry = (self._tier_of(key), -self._depth.get(key, 0) if self._by_prefix else 0, tick)
        if self._state.get(key) == entry:
            return
        self._state[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._state) + _REBUILD_SLACK:
            self._heap = [(*e, k) for k, e in self._state.items()]
            heapq.heapify(self._heap)

    def _retier(self, key: Hashable) -> None:
        state = self._state.get(key)
        if state is not None:
            self._push(key, state[2])

    def add(self, key: Hashable, parent: Hashable | None = None, *, depth: int = 0) -> None:
        """``key`` enters memory (created, or back from disk) as the most recently used. ``parent``: the sequence
        it follows in its chain (unreachable if that one is); ``depth``: its position in its prompt."""
        if key in self._state:
            raise ValueError(f"{key!r} is already in memory")
        self._tick += 1
        self._depth[key] = depth
        if parent is not None and parent != key:
            self._parent[key] = parent
            self._children.setdefault(parent, set()).add(key)
            if parent in self._lost:
                self._lost.add(key)
            self._retier(parent)
        self._push(key, self._tick)
        if key not in self._lost:  # children that were waiting for it are reachable again
            self._mark(self._children.get(key, ()), lost=False)

    def touch(self, key: Hashable) -> None:
        """A use of ``key`` (in memory): the most recently used of its tier."""
        if key in self._state:
            self._tick += 1
            self._push(key, self._tick)

    def remove(self, key: Hashable, *, held: bool = False) -> None:
        """``key`` leaves memory: to a disk tier (``held``: its children are reachable) or for good (evicted or
        dropped: its descendants in memory become unreachable). Also for a key not in memory that is dropped
        from the disk tier."""
        if self._state.pop(key, None) is not None:
            self._lost.discard(key)
            self._depth.pop(key, None)
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[parent]
            self._retier(parent)
        self._mark(self._children.get(key, ()), lost=not held)

    def _mark(self, roots: Iterator[Hashable] | set[Hashable] | tuple[()], *, lost: bool) -> None:
        """Make the subtrees under ``roots`` (in memory) unreachable, or reachable again."""
        todo = list(roots)
        seen: set[Hashable] = set()
        while todo:
            key = todo.pop()
            if key in seen or key not in self._state:
                continue
            seen.add(key)
            if lost:
                self._lost.add(key)
            else:
                self._lost.discard(key)
            self._retier(key)
            todo.extend(self._children.get(key, ()))

    def victim(self, exclude: Hashable | None = None) -> Hashable | None:
        """The key to give up first, never ``exclude``; None if there is none."""
        heap, held = self._heap, []
        found = None
        while heap:
            tier, depth, tick, key = heap[0]
            if self._state.get(key) != (tier, depth, tick):
                heapq.heappop(heap)  # stale
                continue
            if key == exclude:
                held.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in held:
            heapq.heappush(heap, entry)
        return found
