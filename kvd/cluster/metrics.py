"""The Prometheus exporter of a kvd's status figures (:class:`StatusMetrics`): served by a foreground
`kvd up --metrics-port` and, for a detached kvd, by the exporter actor of kvd.cluster.deploy.

Its inputs are the plain dicts the cluster hands out (a shard's ``stats()``, the coordinator's ``status()``), the
same figures `kvd status` draws as a table (kvd.cli.status). Nothing here talks to the cluster."""

from __future__ import annotations

import threading
from typing import Any

from kvd.policy import Level

__all__ = ["StatusMetrics", "server_count"]


def server_count(stats: dict[str, Any], key: str) -> int | None:
    """A server counter of ``stats``, or None when it is missing or not an integer."""
    value = stats.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
            "calibration_held_pages": CounterMetricFamily(
                "kvd_shard_calibration_held_pages", "Pages sealed with heads a calibration held at a less compact "
                "level (or kept fp16)", labels=["shard"]),
            "calibration_raw_pages": CounterMetricFamily(
                "kvd_shard_calibration_raw_pages", "Pages kept fp16 because of calibration (a level it turned "
                "off, or a required calibration missing)", labels=["shard"]),
            "calibrated_namespaces": g("kvd_shard_calibrated_namespaces", "Namespaces whose calibration is active",
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
        disk = _disk_families(g, CounterMetricFamily)
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
                        "refusals", "recompressed_pages", "squeezes", "calibration_held_pages",
                        "calibration_raw_pages", "calibrated_namespaces"):
                families[key].add_metric([sid], float(s.get(key, 0)))
            for key, family in serving.items():
                if (value := server_count(s, key)) is not None:
                    family.add_metric([sid], float(value))
            ahead.add_metric([sid], float(rank.get(str(s.get("ahead")), -1)))
            why.add_metric([sid, str(s.get("level_reason", ""))], 1.0)
            for level, n in (s.get("bytes_by_level") or {}).items():
                by_level.add_metric([sid, level], float(n))
                tier.add_metric([sid, "ram", level], float(n))
            if s.get("disk_capacity_bytes"):
                for key, family in disk.items():
                    if (value := server_count(s, key)) is not None:
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


def _disk_families(g: Any, counter: Any) -> dict[str, Any]:
    """The disk tier's families by stats key (docs/protocol.md §6.8), filled for shards that have one."""
    return {
        "disk_used_bytes": g("kvd_shard_disk_used_bytes", "Bytes of the disk tier's files (and spills waiting to "
                             "be written)", labels=["shard"]),
        "disk_capacity_bytes": g("kvd_shard_disk_capacity_bytes", "Bytes of the disk tier's budget",
                                 labels=["shard"]),
        "disk_pending_bytes": g("kvd_shard_disk_pending_bytes", "Spilled bytes waiting to be written",
                                labels=["shard"]),
        "disk_sequences": g("kvd_shard_disk_sequences", "Sequences on disk", labels=["shard"]),
        "disk_tokens": g("kvd_shard_disk_tokens", "Tokens on disk", labels=["shard"]),
        "spills": counter("kvd_shard_spills", "Sequences moved from memory to disk", labels=["shard"]),
        "spilled_bytes": counter("kvd_shard_spilled_bytes", "Bytes moved from memory to disk", labels=["shard"]),
        "spill_refusals": counter("kvd_shard_spill_refusals", "Spills the disk refused (full write buffer, "
                                  "failing disk, over its budget)", labels=["shard"]),
        "disk_reads": counter("kvd_shard_disk_reads", "Spilled sequences read back from their files",
                              labels=["shard"]),
        "disk_read_bytes": counter("kvd_shard_disk_read_bytes", "Bytes read back from disk", labels=["shard"]),
        "disk_hits": counter("kvd_shard_disk_hits", "Reads served from the disk tier", labels=["shard"]),
        "disk_misses": counter("kvd_shard_disk_misses", "Reads of a sequence found neither in memory nor on disk",
                               labels=["shard"]),
        "promotions": counter("kvd_shard_promotions", "Spilled sequences taken back into memory (an append to "
                              "them)", labels=["shard"]),
        "disk_evictions": counter("kvd_shard_disk_evictions", "Sequences the disk tier forgot (its budget was "
                                  "full)", labels=["shard"]),
        "disk_errors": counter("kvd_shard_disk_errors", "Disk reads, writes or removals that failed",
                               labels=["shard"]),
        "disk_corrupt": counter("kvd_shard_disk_corrupt", "Spilled sequences dropped because a checksum failed on "
                                "read", labels=["shard"]),
    }
