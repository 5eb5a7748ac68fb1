"""The serving loop's admission (kvd.wire.server.admission), without sockets: which request runs next, what a
request in slices, a connection that left and a full queue do to the queues and their counts. Frames are opaque
to it: here a string names each request."""

from __future__ import annotations

from typing import Any

from kvd.wire.server.admission import FULL, OVER_SHARE, Admission

BIG = 1 << 30


def _admission(max_requests: int = 1000, max_bytes: int = BIG, max_peer: int = 1000) -> Admission:
    return Admission(max_requests, max_bytes, max_peer)


def _admit(adm: Admission, ident: bytes, *names: str, size: int = 10) -> None:
    for name in names:
        assert adm.admit(ident, name, size, 7) > 0


def _take(adm: Admission, n: int) -> list[str]:
    return [adm.take()[1] for _ in range(n)]


def _writes(frames: Any) -> bool:
    return str(frames).startswith("w")


def test_connections_with_requests_queued_take_turns() -> None:
    adm = _admission()
    _admit(adm, b"a", "a0", "a1", "a2", "a3")
    _admit(adm, b"b", "b0", "b1", "b2", "b3")
    _admit(adm, b"c", "c0", "c1", "c2", "c3")
    order = _take(adm, 12)
    # a0 as a newcomer, a1 (a newcomer never twice in a row while the rotation waits), then each of b and c
    # joins as a newcomer between two turns of the rotation
    assert order[:6] == ["a0", "a1", "b0", "a2", "c0", "b1"]
    # then one request of each connection in turn, whatever they have queued
    assert order[6:] == ["a3", "c1", "b2", "c2", "b3", "c3"]
    assert adm.queued == 0 and adm.queued_bytes == 120 and not adm.peers  # bytes leave as each request is answered


def test_take_gives_the_connection_its_request_and_how_it_came() -> None:
    adm = _admission()
    assert adm.admit(b"a", "a0", 33, 5) == 1
    assert adm.take() == (b"a", "a0", 33, 5)
    assert adm.queued == 0 and adm.queued_bytes == 33
    adm.ran(33)
    assert adm.queued_bytes == 0


def test_a_newcomer_goes_ahead_of_the_rotation_but_not_twice_in_a_row() -> None:
    adm = _admission()
    _admit(adm, b"a", "a0", "a1", "a2", "a3", "a4")
    assert _take(adm, 2) == ["a0", "a1"]  # a alone: it is the rotation
    _admit(adm, b"b", "b0")
    assert _take(adm, 1) == ["b0"]  # ahead of a2
    _admit(adm, b"c", "c0")
    assert _take(adm, 2) == ["a2", "c0"]  # not a second newcomer in a row while a waits
    _admit(adm, b"x", "x0")
    _admit(adm, b"y", "y0")
    assert _take(adm, 4) == ["a3", "x0", "a4", "y0"]  # newcomers and the rotation alternate


def test_newcomers_run_one_after_another_when_no_rotation_waits() -> None:
    adm = _admission()
    _admit(adm, b"x", "x0")
    _admit(adm, b"y", "y0")
    _admit(adm, b"z", "z0")
    assert _take(adm, 3) == ["x0", "y0", "z0"]


def test_a_request_with_slices_left_goes_back_to_the_front_of_its_connections_queue() -> None:
    adm = _admission()
    _admit(adm, b"a", "a0", "a1", "a2")
    _admit(adm, b"b", "b0", "b1", "b2")
    assert _take(adm, 3) == ["a0", "a1", "b0"]  # the rotation is a, b
    going = ("request", iter(()))
    adm.requeue(b"b", "b0", 10, 7, going)
    assert adm.slicing == {b"b": going}
    assert adm.queued == 4 and adm.queued_bytes == 60  # counted again; its bytes never left
    assert adm.peers[b"b"].nbytes == 30
    assert _take(adm, 4) == ["a2", "b0", "b1", "b2"]  # b's turn comes after a's; its own order is kept


def test_a_sliced_request_of_a_connection_with_nothing_else_queued_joins_the_back_of_the_rotation() -> None:
    adm = _admission()
    _admit(adm, b"c", "c0", "c1", "c2")
    assert _take(adm, 2) == ["c0", "c1"]  # the rotation is c
    _admit(adm, b"a", "a0")
    assert _take(adm, 1) == ["a0"]  # a newcomer; nothing else of a is queued
    adm.requeue(b"a", "a0", 10, 7, ("request", iter(())))
    _admit(adm, b"b", "b0")
    # a is in the rotation behind c, not a newcomer: b, the newcomer, goes ahead of it
    assert _take(adm, 3) == ["c2", "b0", "a0"]


def test_a_connection_that_left_keeps_its_writes_and_loses_its_reads() -> None:
    adm = _admission()
    _admit(adm, b"g", "r0", size=100)
    _admit(adm, b"g", "w1", size=10)
    _admit(adm, b"g", "r2", size=200)
    _admit(adm, b"g", "w3", size=20)
    _admit(adm, b"h", "h0", size=1)
    adm.slicing[b"g"] = ("r0", iter(()))  # as if r0 were between two slices
    assert adm.abandon(b"g", _writes) == 2
    assert adm.queued == 3 and adm.queued_bytes == 31
    assert adm.peers[b"g"].nbytes == 30 and not adm.slicing
    assert _take(adm, 3) == ["w1", "w3", "h0"]  # the writes in their order
    assert adm.abandon(b"g", _writes) == 0  # nothing queued any more


def test_a_connection_that_left_with_only_reads_leaves_the_rotation() -> None:
    adm = _admission()
    _admit(adm, b"h", "h0", "h1", "h2", "h3")
    _admit(adm, b"g", "r0", "r1")
    assert _take(adm, 3) == ["h0", "h1", "r0"]  # the rotation is h, g
    assert adm.abandon(b"g", _writes) == 1
    assert adm.queued == 2 and adm.queued_bytes == 50 and b"g" not in adm.peers  # (taken ones: until answered)
    assert _take(adm, 2) == ["h2", "h3"]  # g's turn is gone with it
    _admit(adm, b"g2", "r9")
    assert adm.abandon(b"g2", _writes) == 1  # a newcomer: out of the newcomers
    assert adm.queued == 0 and not adm.peers
    _admit(adm, b"h", "h4")
    assert _take(adm, 1) == ["h4"]


def test_one_request_is_admitted_when_nothing_is_queued_whatever_its_size() -> None:
    adm = _admission(max_requests=1, max_bytes=100, max_peer=1)
    assert adm.admit(b"a", "a0", 1000, 7) == 1
    assert adm.admit(b"b", "b0", 1, 7) == FULL
    assert adm.queued == 1 and adm.queued_bytes == 1000


def test_a_connection_at_its_share_is_refused_counting_its_requests_on_the_bulk_lane() -> None:
    adm = _admission(max_peer=3)
    _admit(adm, b"a", "a0", "a1")
    adm.to_lane(b"x")  # another connection's request on the lane
    _admit(adm, b"a", "a2")
    assert adm.admit(b"a", "a3", 10, 7) == OVER_SHARE
    assert adm.held(b"a") == 3 and adm.queued == 3
    adm.to_lane(b"b")
    adm.to_lane(b"b")
    _admit(adm, b"b", "b0")
    assert adm.admit(b"b", "b1", 10, 7) == OVER_SHARE
    assert adm.queued + adm.bulk_pending == 7
    adm.from_lane(b"b", 0)
    assert adm.held(b"b") == 2 and adm.admit(b"b", "b1", 10, 7) == 7
    adm.from_lane(b"x", 0)
    assert adm.bulk_owed == {b"b": 1} and adm.bulk_pending == 1


def test_a_full_queue_displaces_the_newest_request_of_the_connection_that_holds_the_most() -> None:
    adm = _admission(max_requests=6)
    _admit(adm, b"b", "b0", "b1")
    _admit(adm, b"a", "a0", "a1", "a2")
    _admit(adm, b"c", "c0")
    assert adm.admit(b"d", "d0", 10, 7) == FULL and adm.full(10)
    assert adm.displace(b"d", 10) == (b"a", "a2", 7)  # not b, which also holds more than d
    assert adm.queued == 5 and adm.queued_bytes == 50 and adm.peers[b"a"].nbytes == 20
    assert not adm.full(10)
    assert adm.push(b"d", "d0", 10, 7) == 6


def test_requests_on_the_bulk_lane_count_to_a_connections_weight() -> None:
    adm = _admission(max_requests=6)
    _admit(adm, b"a", "a0", "a1")
    adm.to_lane(b"b")
    adm.to_lane(b"b")
    _admit(adm, b"b", "b0")  # 3 held against a's 2
    _admit(adm, b"c", "c0")
    assert adm.full(10)
    assert adm.displace(b"c", 10) == (b"b", "b0", 7)


def test_over_the_bytes_the_connection_with_the_most_bytes_is_displaced() -> None:
    adm = _admission(max_bytes=500)
    _admit(adm, b"a", "a0", size=300)
    _admit(adm, b"b", "b0", "b1", "b2", size=50)
    assert adm.admit(b"c", "c0", 100, 7) == FULL
    assert adm.displace(b"c", 100) == (b"a", "a0", 7)  # fewer requests than b, more bytes
    assert b"a" not in adm.peers and adm.queued_bytes == 150
    assert _take(adm, 3) == ["b0", "b1", "b2"]  # a left the newcomers with its last request


def test_no_connection_is_displaced_for_one_that_would_hold_as_much() -> None:
    adm = _admission(max_requests=4)
    _admit(adm, b"a", "a0", "a1")
    _admit(adm, b"b", "b0", "b1")
    assert adm.displace(b"b", 10) is None  # a holds 2 against b's 2 and the arriving one
    assert adm.displace(b"a", 10) is None
    assert adm.queued == 4
    assert adm.displace(b"c", 10) == (b"a", "a1", 7)  # c would hold 1: the first of the heaviest gives way


def test_displacing_a_request_between_two_of_its_slices_leaves_nothing_of_it() -> None:
    adm = _admission(max_bytes=100)
    _admit(adm, b"a", "a0", size=60)
    assert _take(adm, 1) == ["a0"]
    adm.requeue(b"a", "a0", 60, 7, ("request", iter(())))
    assert adm.admit(b"c", "c0", 50, 7) == FULL
    assert adm.displace(b"c", 50) == (b"a", "a0", 7)
    assert not adm.slicing and not adm.peers and adm.queued == 0 and adm.queued_bytes == 0
    assert adm.push(b"c", "c0", 50, 7) == 1
    assert _take(adm, 1) == ["c0"]  # a's turn is gone with it
