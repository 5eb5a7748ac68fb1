"""Which connections have left, for the serving loop (:class:`Departures`): a connection is known by the socket
inode of the descriptor its first message came on, and the connection guard passes on the inode of each
connection that ends. Why the loop needs this, and what it does with a connection that left: the loop's module
docstring ("A peer that left") and docs/design.md, "One client does not starve the others".

The loop thread only. No zmq: identities are bytes, descriptors ints, departures a deque of inodes.
"""

from __future__ import annotations

import collections
import os
import stat
from collections.abc import Callable

__all__ = ["GONE_PEERS_MAX", "KNOWN_PEERS_MAX", "Departures"]

KNOWN_PEERS_MAX = 65536  # connections whose socket inode is kept (one more forgets the oldest)
GONE_PEERS_MAX = 16384  # connections known to have left, whose messages still delivered are dropped unrun


class Departures:
    """The socket inode of each connection a message came from, by identity (ROUTER-made identities only), the
    reverse, and the connections known to have left (oldest first, bounded). ``on_gone(ident)`` is called once
    for each connection found to have left (the loop drops its queued reads); ``on_met(fd, inode)`` once for each
    connection whose inode is recorded (the loop tells the guard, which may not have taken it yet)."""

    __slots__ = ("_gone", "_inode_peers", "_left_unseen", "_on_gone", "_on_met", "_peer_inode")

    def __init__(self, on_gone: Callable[[bytes], None], on_met: Callable[[int, int], None]) -> None:
        self._on_gone, self._on_met = on_gone, on_met
        self._peer_inode: dict[bytes, int] = {}
        self._inode_peers: dict[int, list[bytes]] = {}
        self._gone: dict[bytes, None] = {}
        # inodes of connections that left before the loop saw any of their messages (ZeroMQ reports a disconnect
        # before it closes the descriptor, so a first message may still find it open)
        self._left_unseen: dict[int, None] = {}

    def left(self, departed: collections.deque[int], ident: bytes, fd: int) -> bool:
        """Whether the connection ``ident`` that sent a message on descriptor ``fd`` has left (``departed``: the
        inodes of the connections the guard saw end, taken first); the first message of a connection records
        its socket's inode."""
        if departed:
            self.take(departed)
        if ident in self._gone:
            return True
        if ident in self._peer_inode:
            return False
        # Its first message: while a connection lasts, the descriptor its messages carry is its own socket. Closed
        # already (or another kind of file now), or a socket whose departure came first: it left before the loop
        # saw it. Another socket now (the number reused): the connection is taken for that one, and its departure
        # is then learned late, never early.
        try:
            st = os.fstat(fd)
        except OSError:
            st = None
        if st is None or not stat.S_ISSOCK(st.st_mode) or st.st_ino in self._left_unseen:
            self._gone_peer(ident)
            return True
        peer_inode = self._peer_inode
        if len(peer_inode) >= KNOWN_PEERS_MAX:
            self._forget_peer(next(iter(peer_inode)))
        peer_inode[ident] = st.st_ino
        self._inode_peers.setdefault(st.st_ino, []).append(ident)
        self._on_met(fd, st.st_ino)
        return False

    def take(self, departed: collections.deque[int]) -> None:
        """Take the inodes of the connections the guard saw end."""
        while departed:
            ino = departed.popleft()
            idents = self._inode_peers.pop(ino, None)
            if idents is None:  # none of its messages seen yet: its first one may still find its descriptor open
                unseen = self._left_unseen
                if len(unseen) >= GONE_PEERS_MAX:
                    del unseen[next(iter(unseen))]
                unseen[ino] = None
                continue
            for ident in idents:
                self._peer_inode.pop(ident, None)
                self._gone_peer(ident)

    def _gone_peer(self, ident: bytes) -> None:
        gone = self._gone
        if len(gone) >= GONE_PEERS_MAX:
            del gone[next(iter(gone))]
        gone[ident] = None
        self._on_gone(ident)

    def _forget_peer(self, ident: bytes) -> None:
        ino = self._peer_inode.pop(ident)
        peers = self._inode_peers[ino]
        peers.remove(ident)
        if not peers:
            del self._inode_peers[ino]
