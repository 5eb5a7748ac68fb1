"""Process and socket settings shared by kvd's servers and clients: glibc malloc tuning (:func:`tune_malloc`,
:func:`trim_malloc`), heartbeat defaults, multipart frame I/O with a copy threshold (:func:`send_frames`,
:func:`recv_frames`), and the :class:`ConnectionGuard` that bounds what a server's peers make ZeroMQ buffer."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import fcntl
import ipaddress
import logging
import os
import socket
import stat
import struct
import termios
import threading
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.backend

__all__ = ["COPY_BELOW_BYTES", "COPY_THRESHOLD_BYTES", "DEFAULT_HEARTBEAT_IVL_S", "DEFAULT_HEARTBEAT_TIMEOUT_S",
           "HANDSHAKE_TIMEOUT_S", "ConnectionGuard", "is_loopback", "recv_frames", "send_frames",
           "TRIM_EVERY_S", "socket_buffer_cap", "trim_malloc", "tune_malloc", "wire_bytes"]

log = logging.getLogger(__name__)

# Frames under this size are copied into ZeroMQ's message when sent, larger ones sent from their own memory.
# A zero-copy send has a fixed cost (pyzmq's free callback through its garbage thread): 64-512 KiB frames cost
# 10-45% less sender CPU copied, 1 MiB is level, and from 2 MiB zero-copy wins (bench/wire.py --copy).
COPY_BELOW_BYTES = 1 << 20
# A reply up to this size still goes to a peer that has read all its replies when the reply budget is spent
# (ConnectionGuard.reply_allowed): the size of a small request's reply (pyzmq's default copy threshold).
COPY_THRESHOLD_BYTES = 64 * 1024
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
    """Send ``frames`` as one multipart message: frames of ``COPY_BELOW_BYTES`` and more without copying
    them. ``first_flags`` apply to the first part only (NOBLOCK: raises zmq.Again before anything is sent).
    Returns the bytes sent."""
    last = len(frames) - 1
    size = 0
    for i, f in enumerate(frames):
        n = len(f)
        size += n
        flags = (first_flags if i == 0 else 0) | (0 if i == last else _SNDMORE)
        _send(sock, f, flags, n < COPY_BELOW_BYTES, False)
    return size


# ZMTP 3 puts 1 flags byte and a 1-byte (up to 255) or 8-byte length before each frame; under CURVE each frame
# is a MESSAGE command: "\x07MESSAGE" (8), a nonce (8), and a box of 1 flags byte + the frame + a 16-byte MAC.
_CURVE_FRAME_OVERHEAD = 8 + 8 + 1 + 16


def wire_bytes(sizes: Any, curve: bool) -> int:
    """The bytes that frames of these ``sizes`` take on a ZMTP 3 connection (NULL or CURVE): what the kernel's
    counters of the connection count for them."""
    total = 0
    if curve:
        for n in sizes:
            n += _CURVE_FRAME_OVERHEAD
            total += n + (2 if n < 256 else 9)
    else:
        for n in sizes:
            total += n + (2 if n < 256 else 9)
    return total


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


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback, where only local clients
    connect."""
    if not isinstance(host, str):
        return False
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def socket_buffer_cap() -> int | None:
    """The largest TCP buffer a process may set without CAP_NET_ADMIN: the smaller of Linux's
    ``net.core.rmem_max`` and ``net.core.wmem_max`` (a larger SO_RCVBUF / SO_SNDBUF is silently cut to it); None
    where they cannot be read."""
    try:
        caps = [int(Path(f"/proc/sys/net/core/{name}").read_text()) for name in ("rmem_max", "wmem_max")]
    except (OSError, ValueError):
        return None
    return min(caps)


def trim_malloc() -> bool:
    """Give the free memory of glibc's heap back to the system now (``malloc_trim(0)``: the top of the heap and
    the free pages inside it). :func:`tune_malloc` keeps up to its trim threshold of free heap for reuse; after a
    burst that is over (peers that pinned memory were cut or left) that memory should not stay with the process.
    Returns whether anything was released (False where malloc is not glibc's)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


# ------------------------------------------------------------------------------------------ connection guard

_TCP_INFO_BYTES_ACKED, _TCP_INFO_BYTES_RECEIVED = 120, 128  # offsets in Linux's struct tcp_info (>= 4.1)
_TCP_INFO_LEN = 136
_SIOCOUTQ = getattr(termios, "TIOCOUTQ", 0x5411)  # bytes of a TCP socket's send queue not acked yet
_MONITOR_EVENTS = int(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
# bytes a peer sends that no message counts: the handshake, then heartbeats (PING/PONG commands, CURVE-boxed:
# under 64 bytes each, a few per heartbeat interval): allowed per connection, so idle peers are never suspects
HANDSHAKE_ALLOWANCE_BYTES = 4096
HEARTBEAT_ALLOWANCE_BYTES_PER_S = 256
TRIM_AFTER_S = 0.25  # after a heavy peer goes, ZeroMQ frees its pipes on the serving thread's next socket call
TRIM_HEAVY_BYTES = 16 << 20  # a peer that held this much (in or out) makes its departure trim the heap
# The free heap a busy server holds is trimmed this often too: buffers of every size from kilobytes to tens of MiB
# leave holes in glibc's heap that it keeps (tune_malloc), and the holes grow with time (bench/soak.py: 60-70 MiB
# free next to 310 MiB in use, RSS +3% in 10 minutes after warm-up). Trimming returns their pages; the buffers
# that reuse a hole then fault it in again, once per interval rather than once per request.
TRIM_EVERY_S = 30.0
# connections that ended, kept for the serving loop until it looks (it looks every turn): a bound, not a window
DEPARTED_MAX = 65536


def _dup_socket(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of descriptor ``fd``; None (nothing left open) if ``fd`` is closed or is not
    a socket now."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _names(fd: int, ino: int) -> bool:
    """Whether descriptor number ``fd`` names the socket of inode ``ino`` now."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_ino == ino


class _Conn:
    __slots__ = ("sock", "fd", "ino", "opened", "base_received", "base_acked", "base_in", "base_out", "unread",
                 "held", "left", "stalled", "suspect", "cut", "leaving")

    def __init__(self, sock: socket.socket, fd: int, ino: int, opened: float) -> None:
        self.sock, self.fd, self.ino, self.opened = sock, fd, ino, opened
        self.base_received = self.base_acked = self.base_in = self.base_out = 0
        self.unread = self.held = self.left = 0  # left: reply bytes that reached the kernel
        self.stalled = self.cut = False
        self.leaving = False  # it may have ended: the look checks that its number still names it (_events)
        self.suspect: tuple[int, int] | None = None  # (drains, delivered) when it was seen over the limit


class ConnectionGuard:
    """Bounds, for the whole server, the bytes that its peers make ZeroMQ hold outside the serving loop's reach.

    ZeroMQ assembles a whole multipart message before the application sees any of it, and ``MAXMSGSIZE`` bounds
    each frame, not a message: a peer sending many legal frames makes the server buffer all of them. And replies
    that a peer does not read wait in its pipe (``SNDHWM`` replies per peer). Neither is visible through ZeroMQ's
    API, so the guard compares, per TCP connection, the kernel's counters (``TCP_INFO``: bytes received, bytes
    the peer acknowledged; the socket's send queue) with what the serving loop took from and gave to that
    connection (messages carry their connection's descriptor, ``ZMQ_SRCFD``; sizes are counted as on the wire,
    :func:`wire_bytes`). Connections are learned from the socket's monitor (accepted / disconnected); the guard
    keeps a duplicate of each descriptor, so it only ever acts on the connection it measured. The events of one
    connection can come out of order (ACCEPTED is sent by the listener's I/O thread, DISCONNECTED by the
    engine's: a peer refused at once is announced closed first), so by the time an ACCEPTED is read its
    descriptor number may name another socket: the guard takes it only if it is a connection to the listener
    that announced it (same local port) and not one it already holds (same socket inode, e.g. its own copy).
    So the copy it took on a late ACCEPTED may be a newer connection's, and the events of the number that follow
    (the earlier connection's DISCONNECTED, the newer one's ACCEPTED) must not end it: a connection is taken for
    ended only once its number no longer names the socket held (ZeroMQ closes a descriptor right after announcing
    its disconnect; the next look checks), else the serving loop would drop a live client's reads as a departed
    peer's. A connection taken on an ACCEPTED that came after a DISCONNECTED of its number (the order of a peer
    refused at once) is checked the same way, so it is let go once closed.

    Every ``interval_s`` it

    * **cuts a peer that is sending a message larger than** ``max_message_bytes``: more than that received and
      not taken, and the loop has since found no complete message waiting and took nothing from this peer, so
      those bytes are one unfinished message (no legal message is that large);
    * **cuts the peers holding the most** while all connections together hold more than ``max_inbound_bytes``
      received and not taken (pipelined legal messages while the loop is busy count too), or more than
      ``max_reply_bytes`` of replies that are not yet in the kernel (the peers not reading: the largest that made
      no progress since the last look);
    * publishes the reply bytes held, per connection and in total, for the loop's :meth:`reply_allowed`;
    * gives freed heap back to the system (:func:`trim_malloc`) once a peer that held much is cut or gone, and
      every ``trim_every_s`` (default ``TRIM_EVERY_S``: the holes that buffers of many sizes leave in the heap).

    It also tells the serving loop which connections ended, as they end: :attr:`departed` receives the socket
    inode of every connection it held once ZeroMQ announces it disconnected (or closed). ZeroMQ still delivers
    what such a peer sent before leaving (a ROUTER reads a departed peer's pipe to its end), and a reply to it
    fails only once that is read; the inode, unlike the descriptor number, names that one connection even after
    the number is reused.

    A cut is ``shutdown(SHUT_RDWR)`` of the connection: ZeroMQ sees it closed, drops its half-received message
    and unsent replies, and a reconnecting DEALER starts afresh. The bound is therefore the budget plus what
    arrives within one interval. Linux only (elsewhere :meth:`start` returns False and nothing is bounded).

    Threads: the serving loop calls :meth:`took` and :meth:`gave`, bumps :attr:`drains` and takes from
    :attr:`departed`; the guard's thread does the rest; counters are plain ints and dicts, :attr:`departed` a
    deque (single operations are atomic under the GIL).
    """

    def __init__(self, monitor: zmq.Socket[Any], *, curve: bool, max_message_bytes: int, max_inbound_bytes: int,
                 max_reply_bytes: int, interval_s: float, name: str, trim_every_s: float = TRIM_EVERY_S) -> None:
        self._monitor = monitor
        self.curve = curve
        self.max_message_bytes, self.max_inbound_bytes = max_message_bytes, max_inbound_bytes
        self.max_reply_bytes = max_reply_bytes
        self._interval = interval_s
        self._name = name
        # written by the serving loop
        self.delivered: dict[int, int] = {}  # fd -> wire bytes of the messages the loop took from it
        self.sent: dict[int, int] = {}  # fd -> wire bytes of the replies the loop gave ZeroMQ for it
        self.sent_total = 0
        self.drains = 0  # times the loop found no complete message waiting
        self._met: collections.deque[tuple[int, int]] = collections.deque(maxlen=DEPARTED_MAX)  # (fd, inode)
        # written by the guard's thread
        self.in_kernel: dict[int, int] = {}  # fd -> reply bytes (in `sent` units) that left ZeroMQ, last look
        self.held_total = 0  # reply bytes held by ZeroMQ over all connections, last look
        self.sent_total_seen = 0  # sent_total at that look
        self.cuts = 0
        self.departed: collections.deque[int] = collections.deque(maxlen=DEPARTED_MAX)  # inodes, for the loop
        self.departures = 0  # connections that ended (those the guard held or the loop met)
        self._gone_inodes: dict[int, None] = {}  # the inodes announced departed, latest DEPARTED_MAX (for _meet)
        self._conns: dict[int, _Conn] = {}
        self._inodes: set[int] = set()  # the sockets of _conns
        self._unheld_gone: set[int] = set()  # numbers announced disconnected while the guard held none there
        self._trim_at: float | None = None
        self._trim_every = trim_every_s
        self._trim_next = time.monotonic() + trim_every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------------------------- the serving loop's side

    def took(self, fd: int, sizes: Any) -> None:
        """The loop received a message of frames of ``sizes`` (identity excluded) from connection ``fd``."""
        self.delivered[fd] = self.delivered.get(fd, 0) + wire_bytes(sizes, self.curve)

    def gave(self, fd: int, sizes: Any) -> None:
        """The loop handed ZeroMQ a reply of frames of ``sizes`` for connection ``fd``."""
        n = wire_bytes(sizes, self.curve)
        self.sent[fd] = self.sent.get(fd, 0) + n
        self.sent_total += n

    def met(self, fd: int, ino: int) -> None:
        """The loop took the first message of a connection: descriptor ``fd``, socket inode ``ino`` (read then).
        The guard holds it from then on if it does not already, so its departure is announced even when the guard
        reads its ACCEPTED only after ZeroMQ closed it (a peer that sends and leaves at once, the guard's thread
        not run in between), which leaves nothing to take."""
        self._met.append((fd, ino))

    def reply_allowed(self, fd: int, size: int) -> bool:
        """Whether a reply of ``size`` bytes to ``fd`` fits the reply budget. Over it, only a peer that has read
        all its earlier replies still gets a small one (up to COPY_THRESHOLD_BYTES): so a peer that reads is
        answered, and one that does not read holds at most the budget together with every other such peer."""
        held_total = self.held_total + self.sent_total - self.sent_total_seen
        if held_total + size <= self.max_reply_bytes:
            return True
        sent = self.sent.get(fd, 0)
        return size <= COPY_THRESHOLD_BYTES and sent <= self.in_kernel.get(fd, sent)

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> bool:
        """Start the guard's thread; False (nothing started) where the kernel's TCP counters are not available.
        Then the caller must stop the socket's monitor first (``disable_monitor``), then :meth:`stop`: libzmq's
        I/O thread sends monitor events blocking, so they must be read for as long as the monitor is on."""
        if not hasattr(socket, "TCP_INFO"):
            log.warning("%s: no TCP_INFO on this platform: what peers make ZeroMQ buffer is not bounded",
                        self._name)
            return False
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-guard", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and close the monitor's socket. Call it after the socket's ``disable_monitor``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        else:
            self._monitor.close(0)

    # ------------------------------------------------------------------------------------------ the guard

    def _run(self) -> None:
        monitor = self._monitor
        try:
            while not self._stop.is_set():
                try:
                    # the events first, always: libzmq's I/O thread blocks while they are not read
                    if monitor.poll(int(self._interval * 1000)):
                        self._events()
                    if self._met:
                        self._meet()
                    self._look(time.monotonic())
                except Exception:  # noqa: BLE001 - the guard must not die on one odd connection
                    log.exception("%s: connection guard error, guarding on", self._name)
                    time.sleep(self._interval)
        finally:
            for conn in self._conns.values():
                conn.sock.close()
            self._conns.clear()
            self._inodes.clear()
            monitor.close(0)

    def _events(self) -> None:
        while True:
            try:
                parts = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event, fd = struct.unpack("=Hi", parts[0][:6])
            held = self._conns.get(fd)
            if held is not None and _names(fd, held.ino):
                # The number still names the socket the guard holds. An ACCEPTED: that connection's own, read
                # after the guard took it on an earlier connection's late ACCEPTED. A DISCONNECTED: either it is
                # ending (ZeroMQ announces that before it closes the descriptor) or an earlier connection of that
                # number is, read late: the look forgets it once ZeroMQ has closed it. Once leaving, it stays so
                # (the look only lets go of a connection whose number no longer names it, never of a live one): its
                # own ACCEPTED may come after its DISCONNECTED (a connection the loop met first, _meet).
                held.leaving = held.leaving or event != zmq.EVENT_ACCEPTED
                continue
            self._forget(fd)  # (the number names another socket now, or none: the connection held has ended)
            if event == zmq.EVENT_ACCEPTED:
                conn = self._accept(fd, parts[1] if len(parts) > 1 else b"")
                if fd in self._unheld_gone:
                    self._unheld_gone.discard(fd)
                    if conn is not None:  # perhaps the one announced closed before accepted (two I/O threads)
                        conn.leaving = True
            elif held is None:
                self._unheld_gone.add(fd)

    def _accept(self, fd: int, endpoint: bytes) -> _Conn | None:
        """The connection at ``fd`` taken (None: not one to take)."""
        sock = _dup_socket(fd)
        if sock is None:
            return None  # already closed again, or not a socket now
        try:
            ino = os.fstat(sock.fileno()).st_ino
            port = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else None
        except OSError:
            ino, port = None, None
        # the listener's port ends the endpoint it announced ("tcp://host:port", "tcp://[::1]:port")
        listener_port = endpoint.rpartition(b":")[2]
        if (sock.type != socket.SOCK_STREAM or port is None or ino is None or ino in self._inodes
                or not listener_port.isdigit() or port != int(listener_port)):
            sock.close()  # a late event: the number now names another socket, or one already held
            return None
        return self._hold(sock, fd, ino)

    def _meet(self) -> None:
        """Hold each connection the loop met that the guard does not hold; one already closed has ended."""
        met = self._met
        while met:
            fd, ino = met.popleft()
            if ino in self._inodes or ino in self._gone_inodes:
                continue  # held, or announced departed already
            held = self._conns.get(fd)
            if held is not None and not _names(fd, held.ino):
                self._forget(fd)  # (its number names another socket now: the connection held has ended)
            sock = _dup_socket(fd)
            try:
                named = sock is not None and os.fstat(sock.fileno()).st_ino == ino
            except OSError:
                named = False
            if sock is None or not named:  # closed since the loop met it (its number may be a newer one's, held)
                if sock is not None:
                    sock.close()
                self._announce(ino)
                continue
            conn = self._hold(sock, fd, ino)
            if conn is not None:
                conn.leaving = True  # its DISCONNECTED may have been read before, while the guard held none

    def _hold(self, sock: socket.socket, fd: int, ino: int) -> _Conn | None:
        """Hold the connection ``sock`` (the guard's copy of ``fd``; closed if it cannot be measured)."""
        conn = _Conn(sock, fd, ino, time.monotonic())
        # the bases: what was already counted on either side when the guard met the connection
        conn.base_in, conn.base_out = self.delivered.get(fd, 0), self.sent.get(fd, 0)
        info = self._info(conn)
        if info is None:
            sock.close()
            return None
        conn.base_received, conn.base_acked = info
        self._conns[fd] = conn
        self._inodes.add(ino)
        return conn

    def _forget(self, fd: int) -> None:
        conn = self._conns.pop(fd, None)
        if conn is None:
            return
        self._inodes.discard(conn.ino)
        self._announce(conn.ino)
        if max(conn.unread, conn.held) >= TRIM_HEAVY_BYTES:
            self._trim_at = time.monotonic() + TRIM_AFTER_S
        self.in_kernel.pop(fd, None)
        conn.sock.close()

    def _announce(self, ino: int) -> None:
        """The connection of socket inode ``ino`` has ended: tell the loop, once."""
        self.departed.append(ino)
        self.departures += 1
        gone = self._gone_inodes
        if len(gone) >= DEPARTED_MAX:
            del gone[next(iter(gone))]
        gone[ino] = None

    @staticmethod
    def _info(conn: _Conn) -> tuple[int, int] | None:
        try:
            info = conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except OSError:
            return None
        if len(info) < _TCP_INFO_LEN:
            return None
        (acked,) = struct.unpack_from("=Q", info, _TCP_INFO_BYTES_ACKED)
        (received,) = struct.unpack_from("=Q", info, _TCP_INFO_BYTES_RECEIVED)
        return received, acked

    def _look(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.leaving and not _names(c.fd, c.ino)]:
            self._forget(conn.fd)  # ZeroMQ has closed it (its number names another socket now, or none): ended
        sent_total = self.sent_total
        unread_total = held_total = 0
        for conn in self._conns.values():
            if conn.cut:
                continue
            info = self._info(conn)
            if info is None:
                continue
            received, acked = info
            fd = conn.fd
            delivered = self.delivered.get(fd, 0) - conn.base_in  # read after the kernel's counters: never high
            drains = self.drains  # read after them too: a later drain happened after this look
            allowance = HANDSHAKE_ALLOWANCE_BYTES + int((now - conn.opened) * HEARTBEAT_ALLOWANCE_BYTES_PER_S)
            conn.unread = max(0, received - conn.base_received - delivered - allowance)
            # a message larger than max_message_bytes in progress. Suspect while over; proven once the loop has
            # since found no complete message waiting (a drain) and took nothing from this connection: then all
            # the bytes it holds are one unfinished message, and no legal message is that large
            if conn.unread > self.max_message_bytes:
                if conn.suspect is not None and drains > conn.suspect[0] and delivered == conn.suspect[1]:
                    self._cut(conn, f"{conn.unread} bytes of one message, more than max_message_bytes "
                                    f"{self.max_message_bytes}")
                    continue
                if conn.suspect is None or delivered != conn.suspect[1]:
                    conn.suspect = (drains, delivered)
            else:
                conn.suspect = None
            unread_total += conn.unread
            # replies: what the loop gave minus what reached the kernel (acknowledged, or still in its queue)
            sent = self.sent.get(fd, 0) - conn.base_out
            left = acked - conn.base_acked
            if sent > left:
                with contextlib.suppress(OSError):
                    left += struct.unpack("=i", fcntl.ioctl(conn.sock.fileno(), _SIOCOUTQ, b"\0\0\0\0"))[0]
            conn.held = max(0, sent - left)
            conn.stalled = conn.held > 0 and left <= conn.left
            conn.left = left
            self.in_kernel[fd] = conn.base_out + left
            held_total += conn.held
        # the server-wide budgets: cut the largest holders until under (for replies: those not reading)
        if unread_total > self.max_inbound_bytes:
            for conn in sorted(self._conns.values(), key=lambda c: c.unread, reverse=True):
                if unread_total <= self.max_inbound_bytes or conn.unread == 0:
                    break
                if conn.cut:
                    continue
                unread_total -= conn.unread
                self._cut(conn, f"{conn.unread} bytes received and not taken, while all peers together had more "
                                f"than max_inbound_bytes {self.max_inbound_bytes}")
        if held_total > self.max_reply_bytes:
            for conn in sorted(self._conns.values(), key=lambda c: c.held, reverse=True):
                if held_total <= self.max_reply_bytes or conn.held == 0:
                    break
                if conn.cut or not conn.stalled:
                    continue
                held_total -= conn.held
                self._cut(conn, f"{conn.held} bytes of replies not read, while all peers together had more than "
                                f"max_reply_bytes {self.max_reply_bytes}")
        self.held_total, self.sent_total_seen = held_total, sent_total
        if (self._trim_at is not None and now >= self._trim_at) or now >= self._trim_next:
            self._trim_at, self._trim_next = None, now + self._trim_every
            trim_malloc()

    def _cut(self, conn: _Conn, why: str) -> None:
        log.warning("%s: cutting a peer (%s)", self._name, why)
        self.cuts += 1
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        self._trim_at = time.monotonic() + TRIM_AFTER_S
        self.in_kernel.pop(conn.fd, None)
        conn.cut = True
        conn.unread = conn.held = 0
        conn.suspect = None
