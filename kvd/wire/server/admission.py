"""Which received requests wait and which runs next (:class:`Admission`): a FIFO per connection, the turns the
connections take, the bounds of what all of them and each of them may hold, and the bookkeeping of a request run
in slices or on the bulk lane. Why these rules: the loop's module docstring ("Admission") and docs/design.md,
"One client does not starve the others".

The loop thread only. No zmq: a request's frames are opaque here, identities are bytes, descriptors ints.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FULL", "OVER_SHARE", "Admission"]

# What Admission.admit answers for a request it did not queue (a queued one gets the queue's depth, at least 1)
OVER_SHARE = -1  # its connection holds its share (max_peer) already
FULL = -2  # the shared queue is full (max_requests or max_bytes): room may be made (Admission.displace)

_Request = tuple[Any, int, int]  # (frames, size in bytes, descriptor it came on)


class _PeerQueue:
    """One connection's admitted requests, oldest first, and their bytes."""

    __slots__ = ("nbytes", "requests")

    def __init__(self) -> None:
        self.requests: collections.deque[_Request] = collections.deque()
        self.nbytes = 0


class Admission:
    """The requests received and not yet run, per connection (``peers``: identity -> its queue); the connections
    with requests queued, in the order they take turns; and the counts the bounds are checked against:
    ``queued`` / ``queued_bytes`` (requests queued, and the bytes of those plus of the request running or on the
    bulk lane: their buffers are held until they are answered), ``bulk_owed`` / ``bulk_pending`` (requests on the
    bulk lane, per connection and in all). ``slicing``: connection -> (request, its remaining slices), the long
    read at the front of that connection's queue until its last slice.

    Bounds: ``max_requests`` requests queued or on the bulk lane, ``max_bytes`` bytes (one request is always
    admitted when nothing is queued, whatever its size), ``max_peer`` requests of one connection."""

    __slots__ = ("_fresh", "_took_fresh", "_turns", "bulk_owed", "bulk_pending", "max_bytes", "max_peer",
                 "max_requests", "peers", "queued", "queued_bytes", "slicing")

    def __init__(self, max_requests: int, max_bytes: int, max_peer: int) -> None:
        self.max_requests, self.max_bytes, self.max_peer = max_requests, max_bytes, max_peer
        self.peers: dict[bytes, _PeerQueue] = {}
        self._turns: collections.deque[bytes] = collections.deque()  # peers with requests queued, in turn
        self._fresh: collections.deque[bytes] = collections.deque()  # peers that had nothing queued, in order
        self._took_fresh = False  # whether the last request taken was a newcomer's
        self.queued = 0
        self.queued_bytes = 0
        self.bulk_owed: dict[bytes, int] = {}
        self.bulk_pending = 0
        self.slicing: dict[bytes, tuple[Any, Iterator[None]]] = {}

    def held(self, ident: bytes) -> int:
        """The requests connection ``ident`` has queued or on the bulk lane."""
        queue = self.peers.get(ident)
        return (len(queue.requests) if queue is not None else 0) + self.bulk_owed.get(ident, 0)

    def admit(self, ident: bytes, frames: Any, size: int, fd: int) -> int:
        """Queue a request of ``size`` bytes from connection ``ident`` if the bounds allow: the number of requests
        queued or on the bulk lane with it. Else, not queued: :data:`OVER_SHARE` or :data:`FULL`."""
        depth = self.queued + self.bulk_pending
        if depth:
            queue = self.peers.get(ident)
            if (len(queue.requests) if queue is not None else 0) + self.bulk_owed.get(ident, 0) >= self.max_peer:
                return OVER_SHARE
            if depth >= self.max_requests or self.queued_bytes + size > self.max_bytes:
                return FULL
        return self.push(ident, frames, size, fd)

    def push(self, ident: bytes, frames: Any, size: int, fd: int) -> int:
        """Queue a request whatever the bounds (:meth:`admit`'s, or once :meth:`displace` made room): the number of
        requests queued or on the bulk lane with it. A connection that had nothing queued is a newcomer."""
        queue = self.peers.get(ident)
        if queue is None:
            queue = self.peers[ident] = _PeerQueue()
            self._fresh.append(ident)
        queue.requests.append((frames, size, fd))
        queue.nbytes += size
        self.queued += 1
        self.queued_bytes += size
        return self.queued + self.bulk_pending

    def full(self, size: int) -> bool:
        """Whether a request of ``size`` bytes exceeds the shared bounds."""
        return self.queued + self.bulk_pending >= self.max_requests or self.queued_bytes + size > self.max_bytes

    def displace(self, ident: bytes, size: int) -> tuple[bytes, Any, int] | None:
        """The shared queue is full: take out the newest queued request of the connection that holds the most
        (bytes when only the bytes are over, else requests), if it holds more than ``ident`` would with its request
        of ``size`` bytes: ``(its connection, frames, descriptor)``, to be refused. None if no other connection
        holds more (``ident``'s is among the heaviest: it is the one over its share)."""
        own = self.peers.get(ident)
        by_bytes = self.queued + self.bulk_pending < self.max_requests
        owed = self.bulk_owed
        victim, most = None, ((own.nbytes if own is not None else 0) + size if by_bytes else self.held(ident) + 1)
        for other, queue in self.peers.items():
            weight = queue.nbytes if by_bytes else len(queue.requests) + owed.get(other, 0)
            if other != ident and weight > most and queue.requests:
                victim, most = other, weight
        if victim is None:
            return None
        queue = self.peers[victim]
        frames, vsize, vfd = queue.requests.pop()
        queue.nbytes -= vsize
        self.queued -= 1
        self.queued_bytes -= vsize
        if not queue.requests:
            self.slicing.pop(victim, None)  # (it was the front: a read in slices, refused like any other)
            del self.peers[victim]
            self._unturn(victim)
        return victim, frames, vfd

    def take(self) -> tuple[bytes, Any, int, int]:
        """The next request to run (something is queued): ``(connection, frames, size, descriptor)``, the oldest of
        the connection whose turn it is; that connection goes to the back of the rotation. A connection that had
        nothing queued goes ahead of the rotation, but never twice in a row while the rotation waits. Its bytes
        stay counted until :meth:`ran` (or, on the bulk lane, :meth:`from_lane`)."""
        turns, fresh = self._turns, self._fresh
        if fresh and (not turns or not self._took_fresh):
            ident = fresh.popleft()
            self._took_fresh = True
        else:
            ident = turns.popleft()
            self._took_fresh = False
        queue = self.peers[ident]
        frames, size, fd = queue.requests.popleft()
        queue.nbytes -= size
        self.queued -= 1
        if queue.requests:
            turns.append(ident)
        else:
            del self.peers[ident]
        return ident, frames, size, fd

    def ran(self, size: int) -> None:
        """The request :meth:`take` gave, of ``size`` bytes, was answered: its bytes leave the count."""
        self.queued_bytes -= size

    def requeue(self, ident: bytes, frames: Any, size: int, fd: int, going: tuple[Any, Iterator[None]]) -> None:
        """The request :meth:`take` gave has slices left (``going``: the request and its remaining slices): back to
        the front of its connection's queue, its bytes still counted; the connection to the back of the rotation
        (:meth:`take` put it there if it has other requests queued)."""
        queue = self.peers.get(ident)
        if queue is None:
            queue = self.peers[ident] = _PeerQueue()
            self._turns.append(ident)
        queue.requests.appendleft((frames, size, fd))
        queue.nbytes += size
        self.queued += 1
        self.slicing[ident] = going

    def to_lane(self, ident: bytes) -> None:
        """The request :meth:`take` gave went to the bulk lane; its bytes stay counted until :meth:`from_lane`."""
        self.bulk_owed[ident] = self.bulk_owed.get(ident, 0) + 1
        self.bulk_pending += 1

    def from_lane(self, ident: bytes, size: int) -> None:
        """A request of connection ``ident``, of ``size`` bytes, came back from the bulk lane answered."""
        self.bulk_pending -= 1
        self.queued_bytes -= size
        owed = self.bulk_owed
        n = owed[ident] - 1
        if n:
            owed[ident] = n
        else:
            del owed[ident]

    def abandon(self, ident: bytes, writes: Callable[[Any], bool]) -> int:
        """Connection ``ident`` is gone: drop its queued requests but those whose frames ``writes`` (they still
        run); returns how many were dropped."""
        queue = self.peers.get(ident)
        if queue is None:
            return 0
        self.slicing.pop(ident, None)  # (a request in slices only reads)
        kept = collections.deque(r for r in queue.requests if writes(r[0]))
        n = len(queue.requests) - len(kept)
        size = queue.nbytes - sum(r[1] for r in kept)
        self.queued -= n
        self.queued_bytes -= size
        if kept:
            queue.requests, queue.nbytes = kept, queue.nbytes - size
        else:
            del self.peers[ident]
            queue.requests.clear()
            self._unturn(ident)
        return n

    def _unturn(self, ident: bytes) -> None:
        """``ident`` has nothing queued any more: out of the rotation (or of the newcomers)."""
        (self._fresh if ident in self._fresh else self._turns).remove(ident)
