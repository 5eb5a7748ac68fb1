"""How kvd's status figures are shown: the per-shard table of ``kvd status``, the live status line of ``kvd up``
and the Prometheus exporter of ``kvd up --metrics-port``.

Inputs are the plain dicts the cluster hands out: a shard's ``stats()`` (``used_bytes``, ``capacity_bytes``,
``level``, ``bytes_by_level``, ...) and the coordinator's status (``level``, ``level_epoch``, ``pressure``, ...).
Missing figures print as ``-``; a shard that did not answer is ``None`` (or any non-dict) and shows as down.
Nothing here talks to the cluster; kvd.cli fetches the figures and decides when to draw.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvd.config.settings import format_size
from kvd.policy import Level

__all__ = ["disk_table", "fmt_bytes", "imbalance", "serving_table", "shard_table", "status_line", "StatusMetrics"]


# ------------------------------------------------------------------------------------------------ display


def fmt_bytes(n: Any) -> str:
    """A byte count without the space (``"1.50GiB"``), or ``"-"`` for None."""
    return "-" if n is None else format_size(float(n)).replace(" ", "")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _by_level(stats: dict[str, Any]) -> str:
    parts = [f"{k}:{fmt_bytes(v)}" for k, v in sorted((stats.get("bytes_by_level") or {}).items()) if v]
    return " ".join(parts) or "-"


def _rate(stats: dict[str, Any]) -> str:
    for key in ("requests_per_s", "server_requests_per_s"):
        if isinstance(stats.get(key), (int, float)):
            return f"{stats[key]:.0f}"
    return "-"


def _level(stats: dict[str, Any]) -> str:
    level = str(stats.get("level", "-"))
    return f"{level}*" if stats.get("ahead") else level  # * = ahead of the cluster under its own pressure


def shard_table(shards: Sequence[tuple[str, dict[str, Any] | None]]) -> str:
    """The per-shard table of ``kvd status``: ``shards`` is ``[(shard_id, stats or None if down)]``; below it,
    each shard's reason for its level and how evenly routing fills the shards."""
    headers = ["shard", "level", "epoch", "pressure", "used", "capacity", "bytes by level", "tokens",
               "sequences", "compactions", "evictions", "refusals", "req/s"]
    rows, notes = [], []
    for sid, s in shards:
        if s is None:
            rows.append([sid, "DOWN", *["-"] * (len(headers) - 2)])
            continue
        rows.append([
            sid, _level(s), s.get("epoch", "-"), f"{float(s.get('pressure', 0.0)):.3f}",
            fmt_bytes(s.get("used_bytes")), fmt_bytes(s.get("capacity_bytes")), _by_level(s),
            s.get("tokens", "-"), s.get("sequences", "-"), s.get("recompressed_pages", "-"),
            s.get("evictions", "-"), s.get("refusals", "-"), _rate(s),
        ])
        if s.get("level_reason"):
            notes.append(f"  {sid}: {s['level_reason']}")
    out = _table(headers, rows)
    if any(isinstance(s, dict) and s.get("ahead") for _, s in shards):
        out += "\n* ahead of the cluster: the shard compressed its own pages to make room (kvd.store.compact)"
    good = [s for _, s in shards if isinstance(s, dict)]
    if good:
        balance = imbalance(good)
        out += "\nfullest shard / mean pressure: " + (
            f"{balance:.2f} (1.00 = routing fills the shards evenly)" if balance is not None else "- (empty)"
        )
    if notes:
        out += "\nwhy each level:\n" + "\n".join(notes)
    disk = disk_table(shards)
    if disk:
        out += "\n\ndisk tier (spilled sequences, counts since each shard started):\n" + disk
    serving = serving_table(shards)
    if serving:
        out += "\n\nserving (counts since each shard started):\n" + serving
    return out


def _count(stats: dict[str, Any], key: str) -> int | None:
    """A server counter of ``stats``, or None when it is missing or not an integer."""
    value = stats.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def disk_table(shards: Sequence[tuple[str, dict[str, Any] | None]]) -> str:
    """Each shard's disk tier (docs/protocol.md §6.8): bytes used of its budget and by level, sequences and
    tokens there, spills (and those refused: memory then forgets), reads from disk, the disk's own LRU evictions,
    write errors with the last one. Empty when no shard has a disk tier."""
    headers = ["shard", "disk used", "disk", "by level", "sequences", "tokens", "spills", "refused", "reads",
               "evictions", "errors"]
    rows, notes = [], []
    for sid, s in shards:
        if not isinstance(s, dict) or not s.get("disk_capacity_bytes"):
            continue
        levels = " ".join(f"{k}:{fmt_bytes(v)}" for k, v in sorted((s.get("disk_bytes_by_level") or {}).items()))
        rows.append([sid, fmt_bytes(s.get("disk_used_bytes")), fmt_bytes(s.get("disk_capacity_bytes")),
                     levels or "-",
                     s.get("disk_sequences", "-"), s.get("disk_tokens", "-"), s.get("spills", "-"),
                     s.get("spill_refusals", "-"), s.get("disk_reads", "-"), s.get("disk_evictions", "-"),
                     s.get("disk_errors", "-")])
        if s.get("disk_last_error"):
            notes.append(f"  {sid}: last disk error: {s['disk_last_error']}")
    if not rows:
        return ""
    return _table(headers, rows) + ("\n" + "\n".join(notes) if notes else "")


def serving_table(shards: Sequence[tuple[str, dict[str, Any] | None]]) -> str:
    """How each shard's server copes (its ``server_*`` stats, docs/protocol.md §6.8): requests queued now and on
    the large-request lane, Busy replies (the queue was full: clients retried), error replies, replies dropped
    (peer gone or not reading), peers cut (oversize message, or holding a spent budget), the TCP buffer size
    each connection asks for. Empty when no shard reports them (a store without a server)."""
    headers = ["shard", "requests", "queued", "bulk now", "bulk", "busy", "errors", "dropped", "peers cut",
               "socket buffers"]
    rows = []
    for sid, s in shards:
        if not isinstance(s, dict) or "server_requests" not in s:
            continue
        counts = [_count(s, key) for key in ("server_requests", "server_queue_depth", "server_bulk_depth",
                                             "server_bulk_requests", "server_busy", "server_errors",
                                             "server_replies_dropped", "server_peers_cut")]
        buffer = _count(s, "server_socket_buffer_bytes")
        rows.append([sid, *("-" if n is None else n for n in counts),
                     "autotuned" if buffer == 0 else fmt_bytes(buffer)])
    return _table(headers, rows) if rows else ""


def imbalance(stats: Sequence[dict[str, Any]]) -> float | None:
    """The fullest shard's pressure over the mean (None without shards or data)."""
    pressures = [float(s.get("pressure", 0.0)) for s in stats]
    mean = sum(pressures) / len(pressures) if pressures else 0.0
    return max(pressures) / mean if mean > 0 else None


def status_line(cluster: dict[str, Any], shards: dict[str, Any]) -> str:
    """One line for `kvd up`: ``cluster`` is the coordinator's status, ``shards`` {shard_id: stats or error}."""
    up = sum(1 for s in shards.values() if isinstance(s, dict))
    good = [s for s in shards.values() if isinstance(s, dict)]
    pressure = cluster.get("pressure")
    rps = sum(float(s.get("server_requests_per_s") or 0.0) for s in good)
    return (
        f"level {cluster['level']} (epoch {cluster['level_epoch']}) | pressure "
        f"{'-' if pressure is None else f'{pressure:.3f}'} | used {fmt_bytes(cluster.get('used_bytes'))} of "
        f"{fmt_bytes(cluster.get('capacity_bytes'))} | shards {up}/{len(shards)} up | "
        f"{sum(int(s.get('sequences', 0)) for s in good)} seqs {sum(int(s.get('tokens', 0)) for s in good)} tokens"
        f" | {rps:.0f} req/s | evictions {sum(int(s.get('evictions', 0)) for s in good)}"
        f" refusals {sum(int(s.get('refusals', 0)) for s in good)}"
        + (f" | ahead {','.join(sid for sid, s in shards.items() if isinstance(s, dict) and s.get('ahead'))}"
           if any(s.get("ahead") for s in good) else "")
    )


# ------------------------------------------------------------------------------------------------ metrics


class StatusMetrics:
    """Prometheus exporter with the figures of `kvd status`, refreshed by the status loop of `kvd up`.

    Serves ``http://host:port/metrics`` from construction until :meth:`close`; needs prometheus_client.
    """

    def __init__(self, port: int, host: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._lock = threading.Lock()
        self._snapshot: tuple[dict[str, Any], dict[str, Any]] | None = None
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)

    def update(self, cluster: dict[str, Any], shards: dict[str, Any]) -> None:
        with self._lock:
            self._snapshot = (cluster, shards)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            snap = self._snapshot
        if snap is None:
            return
        cluster, shards = snap
        rank = {lv.tag: lv.value for lv in Level}
        g = GaugeMetricFamily
        yield g("kvd_cluster_pressure", "Cluster pressure (used / capacity, or the fullest shard)",
                value=cluster.get("pressure") or 0.0)
        yield g("kvd_cluster_level", "Level in force: 0 fp16, 1 q8, 2 fp8, 3 q4", value=rank[cluster["level"]])
        yield g("kvd_cluster_level_epoch", "Level epoch", value=cluster["level_epoch"])
        if cluster.get("imbalance") is not None:
            yield g("kvd_cluster_imbalance", "Fullest shard's pressure over the mean", value=cluster["imbalance"])
        yield g("kvd_cluster_topology_epoch", "Topology epoch", value=cluster["topology_epoch"])
        yield CounterMetricFamily("kvd_policy_upgrades", "Changes to a more compact level",
                                  value=cluster.get("upgrades", 0))
        yield CounterMetricFamily("kvd_policy_downgrades", "Changes to a less compact level",
                                  value=cluster.get("downgrades", 0))
        families: dict[str, Any] = {
            "up": g("kvd_shard_up", "1 if the shard answered", labels=["shard"]),
            "level": g("kvd_shard_level", "Level applied: 0 fp16, 1 q8, 2 fp8, 3 q4", labels=["shard"]),
            "epoch": g("kvd_shard_epoch", "Level epoch applied", labels=["shard"]),
            "pressure": g("kvd_shard_pressure", "used / capacity", labels=["shard"]),
            "used_bytes": g("kvd_shard_used_bytes", "Bytes used", labels=["shard"]),
            "capacity_bytes": g("kvd_shard_capacity_bytes", "Bytes of capacity", labels=["shard"]),
            "tokens": g("kvd_shard_tokens", "Tokens held", labels=["shard"]),
            "sequences": g("kvd_shard_sequences", "Sequences held", labels=["shard"]),
            "evictions": CounterMetricFamily("kvd_shard_evictions", "Sequences evicted", labels=["shard"]),
            "refusals": CounterMetricFamily("kvd_shard_refusals", "Appends refused for want of room",
                                            labels=["shard"]),
            "recompressed_pages": CounterMetricFamily("kvd_shard_recompressed_pages", "Pages re-encoded more "
                                                      "compactly (compaction)", labels=["shard"]),
            "squeezes": CounterMetricFamily("kvd_shard_squeezes", "Appends that compressed pages to make room",
                                            labels=["shard"]),
            "rps": g("kvd_shard_requests_per_second", "Requests per second", labels=["shard"]),
        }
        serving: dict[str, Any] = {  # the server's counters (docs/protocol.md §6.8), where a shard reports them
            "server_requests": CounterMetricFamily("kvd_shard_requests", "Messages received", labels=["shard"]),
            "server_busy": CounterMetricFamily("kvd_shard_busy_replies", "Requests refused with Busy (queue full; "
                                               "not executed, clients retry)", labels=["shard"]),
            "server_errors": CounterMetricFamily("kvd_shard_error_replies", "Error replies other than Busy",
                                                 labels=["shard"]),
            "server_replies_dropped": CounterMetricFamily(
                "kvd_shard_replies_dropped", "Replies dropped (peer gone, not reading, or over the reply budget)",
                labels=["shard"]),
            "server_peers_cut": CounterMetricFamily("kvd_shard_peers_cut", "Peers disconnected for an oversize "
                                                    "message or for holding a spent budget", labels=["shard"]),
            "server_bulk_requests": CounterMetricFamily("kvd_shard_bulk_requests", "Requests run on the "
                                                        "large-request lane", labels=["shard"]),
            "server_queue_depth": g("kvd_shard_queue_depth", "Requests received and not yet answered",
                                    labels=["shard"]),
            "server_bulk_depth": g("kvd_shard_bulk_depth", "Requests on the large-request lane now",
                                   labels=["shard"]),
            "server_replies_held_bytes": g("kvd_shard_replies_held_bytes", "Reply bytes sent and not yet read by "
                                           "their peers", labels=["shard"]),
        }
        disk: dict[str, Any] = {  # the disk tier (docs/protocol.md §6.8), where a shard has one
            "disk_used_bytes": g("kvd_shard_disk_used_bytes", "Bytes of the disk tier's files (and spills waiting "
                                 "to be written)", labels=["shard"]),
            "disk_capacity_bytes": g("kvd_shard_disk_capacity_bytes", "Bytes of the disk tier's budget",
                                     labels=["shard"]),
            "disk_pending_bytes": g("kvd_shard_disk_pending_bytes", "Spilled bytes waiting to be written",
                                    labels=["shard"]),
            "disk_sequences": g("kvd_shard_disk_sequences", "Sequences on disk", labels=["shard"]),
            "disk_tokens": g("kvd_shard_disk_tokens", "Tokens on disk", labels=["shard"]),
            "spills": CounterMetricFamily("kvd_shard_spills", "Sequences moved from memory to disk",
                                          labels=["shard"]),
            "spilled_bytes": CounterMetricFamily("kvd_shard_spilled_bytes", "Bytes moved from memory to disk",
                                                 labels=["shard"]),
            "spill_refusals": CounterMetricFamily("kvd_shard_spill_refusals", "Spills the disk refused (full "
                                                  "write buffer, failing disk, over its budget)",
                                                  labels=["shard"]),
            "disk_reads": CounterMetricFamily("kvd_shard_disk_reads", "Spilled sequences read back from their "
                                              "files", labels=["shard"]),
            "disk_read_bytes": CounterMetricFamily("kvd_shard_disk_read_bytes", "Bytes read back from disk",
                                                   labels=["shard"]),
            "disk_hits": CounterMetricFamily("kvd_shard_disk_hits", "Reads served from the disk tier",
                                             labels=["shard"]),
            "disk_misses": CounterMetricFamily("kvd_shard_disk_misses", "Reads of a sequence found neither in "
                                               "memory nor on disk", labels=["shard"]),
            "promotions": CounterMetricFamily("kvd_shard_promotions", "Spilled sequences taken back into memory "
                                              "(an append to them)", labels=["shard"]),
            "disk_evictions": CounterMetricFamily("kvd_shard_disk_evictions", "Sequences the disk tier forgot "
                                                  "(its budget was full)", labels=["shard"]),
            "disk_errors": CounterMetricFamily("kvd_shard_disk_errors", "Disk reads, writes or removals that "
                                               "failed", labels=["shard"]),
            "disk_corrupt": CounterMetricFamily("kvd_shard_disk_corrupt", "Spilled sequences dropped because a "
                                                "checksum failed on read", labels=["shard"]),
        }
        tier = g("kvd_shard_tier_bytes", "Bytes held by tier and page format", labels=["shard", "tier", "level"])
        by_level = g("kvd_shard_level_bytes", "Bytes of pages by page format", labels=["shard", "level"])
        ahead = g("kvd_shard_ahead_level", "Level a shard runs at ahead of the cluster under its own pressure "
                  "(-1: none)", labels=["shard"])
        why = g("kvd_shard_level_reason", "Why the shard's level is what it is (the label)",
                labels=["shard", "reason"])
        for sid, s in shards.items():
            families["up"].add_metric([sid], 1.0 if isinstance(s, dict) else 0.0)
            if not isinstance(s, dict):
                continue
            families["level"].add_metric([sid], rank.get(str(s.get("level")), -1))
            families["rps"].add_metric([sid], float(s.get("server_requests_per_s") or 0.0))
            for key in ("epoch", "pressure", "used_bytes", "capacity_bytes", "tokens", "sequences", "evictions",
                        "refusals", "recompressed_pages", "squeezes"):
                families[key].add_metric([sid], float(s.get(key, 0)))
            for key, family in serving.items():
                if (value := _count(s, key)) is not None:
                    family.add_metric([sid], float(value))
            ahead.add_metric([sid], float(rank.get(str(s.get("ahead")), -1)))
            why.add_metric([sid, str(s.get("level_reason", ""))], 1.0)
            for level, n in (s.get("bytes_by_level") or {}).items():
                by_level.add_metric([sid, level], float(n))
                tier.add_metric([sid, "ram", level], float(n))
            if s.get("disk_capacity_bytes"):
                for key, family in disk.items():
                    if (value := _count(s, key)) is not None:
                        family.add_metric([sid], float(value))
                for level, n in (s.get("disk_bytes_by_level") or {}).items():
                    tier.add_metric([sid, "disk", level], float(n))
        yield from families.values()
        yield from serving.values()
        yield from disk.values()
        yield tier
        yield by_level
        yield ahead
        yield why

    def close(self) -> None:
        self.server.shutdown()
