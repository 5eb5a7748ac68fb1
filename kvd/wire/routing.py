"""Which shard owns a sequence: rendezvous (highest-random-weight) hashing over shard ids (docs/protocol.md §10).

Every client must compute the owner exactly like this, in any language, so all clients agree:

    key      = u32le(len(namespace)) || namespace
               || (0x00 || u64le(seq_id)  |  0x01 || u32le(len(seq_id)) || seq_id)
    score(s) = BLAKE2b-64(key || u32le(len(s)) || s), read big-endian
    owner    = the shard with the highest score; on a tie, the smallest id (bytewise)

Removing a shard moves only the sequences it owned; adding one moves about 1/n of them, all to the new shard.
Stable across processes (BLAKE2b, never Python's salted ``hash()``). Pure: no zmq.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from kvd.errors import InvalidArgument, ShardUnavailable
from kvd.wire.schema import SeqId, check_namespace, check_seq_id, check_shards, check_short_text, show

__all__ = ["Router", "Topology", "owner", "rendezvous_score", "routing_key"]


def routing_key(namespace: str, seq_id: SeqId) -> bytes:
    """The bytes hashed for ``(namespace, seq_id)``; raises :class:`InvalidArgument` for a bad name or id."""
    ns = check_namespace("namespace", namespace, InvalidArgument).encode("utf-8")
    seq = check_seq_id("seq_id", seq_id, InvalidArgument)
    if isinstance(seq, int):
        seq_part = b"\x00" + seq.to_bytes(8, "little")
    else:
        raw = seq.encode("utf-8")
        seq_part = b"\x01" + len(raw).to_bytes(4, "little") + raw
    return len(ns).to_bytes(4, "little") + ns + seq_part


def rendezvous_score(shard_id: str, namespace: str, seq_id: SeqId) -> int:
    """The highest-random-weight score of ``shard_id`` for a sequence (an unsigned 64-bit integer)."""
    raw = check_short_text("shard id", shard_id, InvalidArgument).encode("utf-8")
    data = routing_key(namespace, seq_id) + len(raw).to_bytes(4, "little") + raw
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Router:
    """Rendezvous routing over a fixed list of shard ids, validated once (the client keeps one per topology).

    Raises :class:`InvalidArgument` for an empty list, a bad or duplicate id.
    """

    __slots__ = ("shard_ids", "_suffixes")

    def __init__(self, shard_ids: Sequence[str]) -> None:
        if isinstance(shard_ids, str) or not isinstance(shard_ids, Sequence) or not shard_ids:
            raise InvalidArgument(f"shard_ids must be a non-empty sequence of shard ids, got {show(shard_ids)}")
        raws = [
            check_short_text(f"shard_ids[{i}]", s, InvalidArgument).encode("utf-8")
            for i, s in enumerate(shard_ids)
        ]
        if len(set(raws)) != len(raws):
            raise InvalidArgument(f"shard_ids has duplicates: {list(shard_ids)[:16]}")
        self.shard_ids: tuple[str, ...] = tuple(shard_ids)
        # the per-shard suffix of the hash input, with the raw id kept for the tie-break
        self._suffixes = [(len(raw).to_bytes(4, "little") + raw, raw) for raw in raws]

    def owner(self, namespace: str, seq_id: SeqId) -> int:
        """Index in :attr:`shard_ids` of the owner of ``(namespace, seq_id)``. Ties (never seen in practice) go
        to the smaller id by UTF-8 bytes, so the answer does not depend on the order of the list."""
        prefix = hashlib.blake2b(routing_key(namespace, seq_id), digest_size=8)
        best, best_score, best_raw = 0, -1, b""
        for i, (suffix, raw) in enumerate(self._suffixes):
            h = prefix.copy()
            h.update(suffix)
            score = int.from_bytes(h.digest(), "big")
            if score > best_score or (score == best_score and raw < best_raw):
                best, best_score, best_raw = i, score, raw
        return best


def owner(shard_ids: Sequence[str], namespace: str, seq_id: SeqId) -> int:
    """Index in ``shard_ids`` of the shard that owns ``(namespace, seq_id)`` (see :class:`Router`).

    Raises :class:`InvalidArgument` for an empty list, duplicate ids or a bad namespace / seq_id.
    """
    return Router(shard_ids).owner(namespace, seq_id)


_OWNER_CACHE_ENTRIES = 65536


class Topology:
    """A cluster's shards as a client holds them: ``shards`` (``{"id", "endpoint"}`` maps, in the order given),
    ``epoch``, ``level``, ``level_epoch``, and the owner of each sequence (cached until the next topology).

    Raises :class:`InvalidArgument` for a malformed shard list (bad or duplicate ids).
    """

    __slots__ = ("epoch", "shards", "level", "level_epoch", "_router", "_owners")

    def __init__(
        self,
        *,
        epoch: int | None,
        shards: Sequence[Mapping[str, str]],
        level: str | None = None,
        level_epoch: int | None = None,
    ) -> None:
        self.shards: tuple[dict[str, str], ...] = check_shards("shards", list(shards), InvalidArgument)
        self.epoch, self.level, self.level_epoch = epoch, level, level_epoch
        self._router = Router([s["id"] for s in self.shards]) if self.shards else None
        self._owners: dict[tuple[str, type, SeqId], dict[str, str]] = {}

    def owner(self, namespace: str, seq_id: SeqId) -> dict[str, str]:
        """The shard (``{"id", "endpoint"}``) that owns ``(namespace, seq_id)``. Raises
        :class:`ShardUnavailable` when the cluster has no shard, :class:`InvalidArgument` for a bad name."""
        key = (namespace, type(seq_id), seq_id)  # "5" and 5 are different sequences
        shard = self._owners.get(key)
        if shard is None:
            if self._router is None:
                raise ShardUnavailable(f"the cluster has no shards (topology epoch {self.epoch})")
            shard = self.shards[self._router.owner(namespace, seq_id)]
            if len(self._owners) >= _OWNER_CACHE_ENTRIES:
                self._owners.clear()
            self._owners[key] = shard
        return shard

    def as_dict(self) -> dict[str, Any]:
        """``{"epoch", "shards": [{"id", "endpoint"}], "level", "level_epoch"}`` (copies)."""
        return {
            "epoch": self.epoch,
            "shards": [dict(s) for s in self.shards],
            "level": self.level,
            "level_epoch": self.level_epoch,
        }
