"""Requests as a client sends them and replies as its caller gets them: a request shaped for what the server on
a connection speaks (:func:`_on_wire`), an append split to the server's limits, a reply turned into the caller's
value or kvd error (:func:`_value`), and per-shard stats summed for the cluster (:func:`aggregate_stats`). Pure:
no sockets (the connection is only read for what its server speaks)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvd.codec.assemble import assemble
from kvd.errors import Busy, KvdError, ProtocolError
from kvd.wire import protocol as p

if TYPE_CHECKING:
    from kvd.client.conn import _Conn

__all__ = ["PACK_BELOW_BYTES", "aggregate_stats"]

log = logging.getLogger("kvd.client")

# Appends of keys and values together under this many bytes go packed, in one frame, to a 1.4 server: each
# ZeroMQ frame of 8 KiB or more costs both processes' I/O threads a send and a receive of its own, and packing
# costs the client a copy of both tensors. Measured (bench/wire_phases.py --threads --op append, kvd against
# kvd 1.3): 64 KiB level one at a time and 10% faster 8 in flight; from 128 KiB the copy makes a lone append
# 5-9% slower (pipelined ones still gain 6-9%), and a decode step's latency is what an engine waits on.
PACK_BELOW_BYTES = 128 << 10
_NOT_ADDITIVE = frozenset({"epoch", "page_tokens", "sink_tokens", "window_tokens", "server_uptime_s",
                           "server_queue_peak", "topology_epoch"})
# A shard's own, with no cluster total: its identity, and its eviction order's state (one bound per store)
_PER_SHARD = frozenset({"shard_id", "endpoint", "eviction_stale_after", "eviction_reuses_known"})



def aggregate_stats(per_shard: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Cluster totals from per-shard stats: numbers summed (``epoch`` and settings: the maximum), maps of numbers
    summed per key, ``pressure`` recomputed as used/capacity, a string or flag kept when all shards agree (else
    ``"mixed"``), in maps too, per key; ``shards`` counts the shards, ``errors`` those that did not answer. A
    shard's own keys (``_PER_SHARD``: its id, endpoint, eviction order's state) are left to :meth:`shard_stats`."""
    good = [s for s in per_shard if "error" not in s]
    out: dict[str, Any] = {"shards": len(per_shard), "errors": len(per_shard) - len(good)}
    for stats in good:
        for key, value in stats.items():
            if key in _PER_SHARD:
                continue
            have = out.get(key)
            if isinstance(value, bool) or value is None:
                out[key] = value if have is None or have == value else "mixed"
            elif isinstance(value, (int, float)):
                if key in _NOT_ADDITIVE:
                    out[key] = value if have is None else max(have, value)
                else:
                    out[key] = (have or 0) + value
            elif isinstance(value, dict):
                merged = dict(have) if isinstance(have, dict) else {}
                for k, v in value.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        merged[k] = merged.get(k, 0) + v
                    else:  # a flag or a state per key (calibration_required, calibration_states)
                        merged[k] = v if k not in merged or merged[k] == v else "mixed"
                out[key] = merged
            else:
                out[key] = value if key not in out or have == value else "mixed"
    if out.get("capacity_bytes"):
        out["pressure"] = out.get("used_bytes", 0) / out["capacity_bytes"]
    return out


def _decode_reply(frames: list[Any], limits: p.Limits, endpoint: str) -> Any:
    """The reply in ``frames``; for one the strict decoder refuses, a ProtocolError reply under its request id
    when the header names one (its caller fails at once instead of waiting out its timeout), else None (logged,
    discarded: nobody can be told)."""
    try:
        return p.decode_reply(frames, limits)
    except KvdError as exc:
        rid = p.salvage_request_id(frames[0]) if frames else None
        log.warning("a malformed reply from %s%s: %s", endpoint, "" if rid is None else f" to request {rid}", exc)
        if rid is None:
            return None
        return p.ErrorReply(request_id=rid, code=ProtocolError.code, error="ProtocolError",
                            message=f"malformed reply from {endpoint}: {exc}")


def _value(req: Any, reply: Any) -> Any:
    """The caller's result for ``reply`` to ``req``; an error reply is raised as its kvd error."""
    if isinstance(reply, p.ErrorReply):
        raise reply.exception()
    if reply.OP != req.OP or (isinstance(req, p.GetRequest)
                              and isinstance(reply, p.GetPagesReply) != (req.format == "pages")):
        raise ProtocolError(f"reply {type(reply).__name__} does not answer {type(req).__name__}")
    if isinstance(reply, (p.AppendReply, p.LengthReply)):
        return reply.length
    if isinstance(reply, p.LengthsReply):
        if len(reply.lengths) != len(req.seq_ids):
            raise ProtocolError(f"lengths reply holds {len(reply.lengths)} items for {len(req.seq_ids)} seq_ids")
        return list(reply.lengths)
    if isinstance(reply, p.GetReply):
        return reply.keys, reply.values
    if isinstance(reply, p.AttendReply):
        if reply.out.shape != req.queries.shape:
            raise ProtocolError(f"attend reply has shape {list(reply.out.shape)} for queries "
                                f"{list(req.queries.shape)}")
        return reply.out, reply.lse
    if isinstance(reply, p.GetPagesReply):
        return assemble(reply.entries, reply.start, reply.end, reply.layers)
    if isinstance(reply, p.DropReply):
        return reply.dropped
    if isinstance(reply, p.StatsReply):
        return reply.stats
    if isinstance(reply, p.CalibrateReply):
        out = {"state": reply.state, "reason": reply.reason, "digest": reply.digest, "model": reply.model,
               "levels": dict(reply.levels or {})}
        if reply.required is not None:
            out["required"] = reply.required
        return out
    if isinstance(reply, p.ExplainReply):
        return {"level": reply.level, "reasons": list(reply.reasons), **(reply.details or {})}
    if isinstance(reply, p.TopologyReply):
        return {"epoch": reply.epoch, "shards": [dict(s) for s in reply.shards], "level": reply.level,
                "level_epoch": reply.level_epoch}
    return None


def _append_chunks(keys: Any, values: Any, limits: p.Limits) -> list[tuple[Any, Any]]:
    """Split an append along T so that each message fits ``limits`` (docs/protocol.md §6.4)."""
    room = min(limits.max_frame_bytes, (limits.max_message_bytes - limits.max_header_bytes) // 2)
    if isinstance(keys, np.ndarray) and keys.nbytes <= room:
        return [(keys, values)]  # the common case, without a second look at the arrays
    k, v = p.as_array(keys, "keys"), p.as_array(values, "values")
    if k.ndim != 4 or k.shape[1] < 2:
        return [(keys, values)]
    per_token = k.nbytes // k.shape[1]
    step = max(1, room // max(per_token, 1))
    if k.shape[1] <= step:
        return [(keys, values)]
    return [(k[:, t:t + step], v[:, t:t + step]) for t in range(0, k.shape[1], step)]


_SLOTS: dict[type, tuple[str, ...]] = {}  # a message class -> every slot of it and its bases


def _replace(req: Any, **changes: Any) -> Any:
    """``req`` with ``changes`` (messages are frozen; their fields were validated already, the changes must be
    valid too)."""
    cls = type(req)
    names = _SLOTS.get(cls)
    if names is None:
        names = _SLOTS[cls] = tuple(name for c in cls.__mro__ for name in getattr(c, "__slots__", ())
                                    if name != "__weakref__")
    clone = object.__new__(cls)
    setattr_ = object.__setattr__
    for name in names:
        setattr_(clone, name, changes[name] if name in changes else getattr(req, name))
    return clone


def _renumber(req: Any, rid: int) -> Any:
    """``req`` under a new request id."""
    return _replace(req, request_id=rid)


def _on_wire(conn: _Conn, req: Any) -> Any:
    """``req`` as sent on ``conn``. A get asks for its reply packed (fewer frames, docs/protocol.md §6.5) where
    the server speaks it: pages from protocol 1.1, fp16 keys and values from 1.4 (the client's gets ask for it
    from the start, and it is taken out here for an older server). An append under ``PACK_BELOW_BYTES`` (and
    within the frame limit) goes packed to a 1.4 server (§6.4), and names the shard incarnation the connection's
    hello found (protocol 1.3), so a successor on the same port refuses it. The caller's result is the same. An
    append's ``position`` is left out for a server older than 1.3: it only spares pages the sink protection, so
    such a server stores the tokens the same, at most with one more fp16 page; its ``parent`` for a server older
    than 1.6, which stores the tokens the same and evicts by recency alone. An append to a 1.8 server asks for
    its reply's ``notice`` (``notices``), which the client surfaces (:meth:`kvd.client.core._Core._note`)."""
    kind = type(req)
    if kind is p.GetRequest:
        if req.packed != (conn.packs if req.format == "pages" else conn.packs_tensors):
            return _replace(req, packed=not req.packed)
        return req
    if kind is not p.AppendRequest:
        return req
    changes: dict[str, Any] = {}
    if not conn.positions and req.position is not None:
        changes["position"] = None
    if not conn.parents and req.parent is not None:
        changes["parent"] = None
    if conn.incarnation is not None and req.incarnation is None:
        changes["incarnation"] = conn.incarnation
    if req.notices is not conn.notices:  # (a request resent to another shard: that shard's own)
        changes["notices"] = conn.notices
    if conn.packs_tensors and not req.packed:
        size = 2 * req.keys.nbytes  # (one frame: it must fit the server's frame limit too)
        if size < PACK_BELOW_BYTES and size <= conn.limits.max_frame_bytes:
            changes["packed"] = True
    return _replace(req, **changes) if changes else req


def _is_busy(reply: Any) -> bool:
    return isinstance(reply, p.ErrorReply) and reply.code == Busy.code
