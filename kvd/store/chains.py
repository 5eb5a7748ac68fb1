"""Which sequence a full store gives up first: what no lookup can reach, then chain tails (those unused for longer
than the store's reuse has shown worth waiting for first, then the deepest), then by recency.

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

**Stale tails first.** Depth alone would keep the chains of prompts nobody sends any more: a stale chain loses
its deepest block first like a live one, so its head stays while live chains lose their deeper blocks. So the
order learns how long sequences wait between uses: every use of a sequence that was used before (a lookup's
load, an append that stores it again after it was evicted, a promotion from disk; not the append that first
stores it) is one *reuse distance*, in uses of the store (ticks). Once ``REUSE_MIN`` distances are known, a
tail unused for longer than ``STALE_FACTOR`` x the ``STALE_QUANTILE`` quantile of the last ``REUSE_WINDOW``
distances is *stale*, and the least recently used stale tail goes before every other tail (not before an
unreachable sequence). A workload whose prompts recur keeps its chains within that bound and is ordered by
depth as before; when the prompts change, the old chains outlive the bound and go first. The distances of
sequences that left memory are kept for the last ``GHOSTS`` of them (or twice the sequences in memory), so a
sequence evicted and stored again counts (the long distances a cache too small for its workload sees).

Replaying bench/serve.py's workloads into a store (bench/serve.py --replay, BENCHMARKS.md "Serving"; the
measured reasons in docs/design.md, "Prefix-aware eviction"): under LRU each prompt's unique last block pushes out
older prompts' shared prefixes; ranked by depth, the unique blocks go first; with stale tails first, a change of
prompts no longer leaves the old ones' chains in the way.

Each sequence has one current heap entry ``(tier, -depth, tick, key)`` (``tick``: a use counter at its last
use), and each tail one entry ``(tick, key)`` in a second heap, by recency; a use or a tier change pushes new ones
and leaves the old ones outdated, skipped when they surface, and a heap is rebuilt from the current entries when
outdated ones outnumber them. A use costs O(log n), an eviction O(log n) amortized; the staleness bound is
recomputed every ``REUSE_RECOMPUTE`` distances (a walk of at most 256 bucket counts); making a subtree
unreachable or reachable again walks it once.

A sequence that moves to a disk tier leaves memory but counts as reachable (a lookup finds it on disk): its
children in memory are reachable and name a parent no longer in memory. The chain is known within one store: a
client sends a parent only when both sequences live on the same shard, so a chain that crosses shards is
ranked as several shorter ones.

Pure core: no Ray, no ZeroMQ.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Hashable, Iterator
from typing import Any

__all__ = ["Chains", "INNER", "TAIL", "UNREACHABLE", "bucket_floor", "reuse_bucket"]

UNREACHABLE, TAIL, INNER = 0, 1, 2
_REBUILD_SLACK = 64  # outdated heap entries tolerated beyond the live ones before a rebuild
# Stale tails (module docstring). The values were chosen on bench/serve.py --replay's two workloads at 32-96 MiB,
# three seeds, three changes of prompts each (docs/design.md, "Prefix-aware eviction", has the sweep).
REUSE_WINDOW = 1024  # the last reuse distances the bound is taken from
REUSE_MIN = 64  # distances known before any tail counts as stale
REUSE_RECOMPUTE = 16  # new distances between two recomputations of the bound
STALE_QUANTILE = 0.7
STALE_FACTOR = 1.5
GHOSTS = 4096  # sequences that left memory whose last use is kept (at least; twice those in memory if more)


_BUCKETS = 4 * 64  # reuse_bucket of any distance below 2**64


def reuse_bucket(distance: int) -> int:
    """A reuse distance's bucket: 0-3 exact, then four buckets per power of two (each a quarter of it wide), so
    the quantile the staleness bound takes is kept in counts, not sorted (a quarter of a power of two is the
    precision it needs: the factor on it is 1.5)."""
    if distance < 4:
        return max(0, distance)
    top = distance.bit_length() - 1
    return 4 * (top - 1) + ((distance >> (top - 2)) & 3)


def bucket_floor(bucket: int) -> int:
    """The smallest distance in ``bucket`` (:func:`reuse_bucket`)."""
    if bucket < 4:
        return bucket
    return (4 + bucket % 4) << (bucket // 4 - 1)


class Chains:
    """The eviction order of the sequences a store holds in memory (see the module docstring). Keys are any
    hashable (the store's ``(namespace, seq_id)``); the caller holds the store's lock."""

    __slots__ = ("_state", "_parent", "_children", "_lost", "_heap", "_tick", "_depth", "_by_prefix", "_recent",
                 "_left_at", "_reuse", "_reuse_counts", "_reuse_new", "_stale_after", "_reuse_min", "_reuse_every",
                 "_ghosts")

    def __init__(self, *, by_prefix: bool = True, reuse_min: int = REUSE_MIN, reuse_every: int = REUSE_RECOMPUTE,
                 ghosts: int = GHOSTS) -> None:
        """``reuse_min``, ``reuse_every``, ``ghosts``: the module's ``REUSE_MIN``, ``REUSE_RECOMPUTE`` and
        ``GHOSTS`` (smaller in tests)."""
        self._by_prefix = by_prefix
        self._recent: list[tuple[int, Hashable]] = []  # (tick, key) of tails, least recently used first
        self._left_at: dict[Hashable, int] = {}  # key that left memory -> its last use (oldest first, bounded)
        self._reuse: collections.deque[int] = collections.deque()  # the last reuse distances' buckets
        self._reuse_counts = [0] * _BUCKETS  # how many of them fall in each bucket
        self._reuse_new = 0  # distances since the bound was computed
        self._stale_after: int | None = None  # a tail unused for more ticks than this is stale (None: not yet)
        self._reuse_min, self._reuse_every, self._ghosts = max(1, reuse_min), max(1, reuse_every), ghosts
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

    @property
    def stale_after(self) -> int | None:
        """The ticks (uses of the store) beyond which an unused tail is stale; None until enough reuse is known
        (or with ``by_prefix=False``)."""
        return self._stale_after

    @property
    def reuses_known(self) -> int:
        """How many reuse distances the bound is taken from (at most ``REUSE_WINDOW``; none is set before
        ``reuse_min``)."""
        return len(self._reuse)

    def _reused(self, distance: int) -> None:
        """A sequence used again ``distance`` ticks after its last use: the bound on staleness follows."""
        reuse, counts = self._reuse, self._reuse_counts
        bucket = reuse_bucket(distance)
        reuse.append(bucket)
        counts[bucket] += 1
        if len(reuse) > REUSE_WINDOW:
            counts[reuse.popleft()] -= 1
        self._reuse_new += 1
        if self._reuse_new >= self._reuse_every and len(reuse) >= self._reuse_min:
            self._reuse_new = 0
            rank = min(len(reuse) - 1, int(STALE_QUANTILE * len(reuse)))  # (0-based, in ascending order)
            seen = at = 0
            for at, n in enumerate(counts):  # noqa: B007 - the bucket the loop stops at is the one wanted
                seen += n
                if seen > rank:
                    break
            self._stale_after = int(STALE_FACTOR * bucket_floor(at))

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
        if self._by_prefix and entry[0] == TAIL:
            heapq.heappush(self._recent, (tick, key))
            if len(self._recent) > 2 * len(self._state) + _REBUILD_SLACK:
                self._recent = [(e[2], k) for k, e in self._state.items() if e[0] == TAIL]
                heapq.heapify(self._recent)

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
        if self._by_prefix:
            last = self._left_at.pop(key, None)
            if last is not None:  # back: stored again after an eviction, or promoted from disk
                self._reused(self._tick - last)
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
        state = self._state.get(key)
        if state is not None:
            self._tick += 1
            if self._by_prefix:
                self._reused(self._tick - state[2])
            self._push(key, self._tick)

    def remove(self, key: Hashable, *, held: bool = False) -> None:
        """``key`` leaves memory: to a disk tier (``held``: its children are reachable) or for good (evicted or
        dropped: its descendants in memory become unreachable). Also for a key not in memory that is dropped
        from the disk tier."""
        state = self._state.pop(key, None)
        if state is not None:
            self._lost.discard(key)
            self._depth.pop(key, None)
            if self._by_prefix:
                left_at = self._left_at
                left_at[key] = state[2]
                while len(left_at) > max(self._ghosts, 2 * len(self._state)):
                    del left_at[next(iter(left_at))]
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
        state = self._state
        found = _top(self._heap, lambda e: state.get(e[3]) == e[:3], exclude)
        if found is not None and self._stale_after is not None and state[found][0] == TAIL:
            oldest = _top(self._recent, lambda e: (s := state.get(e[1])) is not None and s[0] == TAIL
                          and s[2] == e[0], exclude)  # the least recently used tail
            if oldest is not None and self._tick - state[oldest][2] > self._stale_after:
                return oldest
        return found


def _top(heap: list[Any], current: Callable[[Any], bool], exclude: Hashable | None) -> Hashable | None:
    """The key (an entry's last item) of ``heap``'s first entry that is ``current``, other than ``exclude``;
    outdated entries on the way are dropped."""
    held = []
    found = None
    while heap:
        entry = heap[0]
        if not current(entry):
            heapq.heappop(heap)  # outdated
            continue
        if entry[-1] == exclude:
            held.append(heapq.heappop(heap))
            continue
        found = entry[-1]
        break
    for entry in held:
        heapq.heappush(heap, entry)
    return found
