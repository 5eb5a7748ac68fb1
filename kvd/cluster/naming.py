"""Names and addresses every part of a kvd cluster agrees on: actor names, shard ids, the persisted state's
key, the bind host, the server side of CURVE. Imported by the coordinator, the shards and deployment alike, so
neither of the two actors has to import the other."""

from __future__ import annotations

from typing import Any

from kvd.config.settings import Config

__all__ = ["coordinator_name", "curve_server_config", "metrics_bind_host", "metrics_name", "resolve_host",
           "shard_ids", "shard_name", "state_key"]


def coordinator_name() -> str:
    return "kvd-coordinator"


def metrics_name() -> str:
    """The detached actor that serves a detached kvd's Prometheus metrics (kvd.cluster.deploy)."""
    return "kvd-metrics"


def shard_name(shard_id: str) -> str:
    return f"kvd-{shard_id}"


def shard_ids(n: int) -> list[str]:
    """The stable ids of a cluster of ``n`` shards: ``shard-0`` ... (routing hashes over these ids)."""
    return [f"shard-{i}" for i in range(n)]


def state_key(namespace: str) -> str:
    return f"kvd/{namespace}/coordinator"


def resolve_host(host: str) -> str:
    """The address to bind: ``"node"`` means this Ray node's IP (for actors on a real cluster)."""
    if host == "node":
        import ray

        return str(ray.util.get_node_ip_address())
    return host


def metrics_bind_host(host: str) -> str:
    """Where the Prometheus exporter listens for a kvd bound to ``host`` (resolved): loopback stays loopback,
    anything else listens on every interface (a scraper may come through any of them, or a port-forward)."""
    return "127.0.0.1" if host == "127.0.0.1" else "0.0.0.0"


def curve_server_config(config: Config) -> Any:
    """The server-side CurveConfig of kvd.wire.server for ``config.curve``, or None when CURVE is off."""
    if config.curve.server_secret_key is None:
        return None
    from kvd.wire.server import CurveConfig

    return CurveConfig.for_server(
        secret_key_file=config.curve.server_secret_key, authorized_keys_dir=config.curve.authorized_keys
    )
