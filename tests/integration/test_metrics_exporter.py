"""The metrics exporter of a detached kvd (issue 18, item 13), in-process on a local Ray: it serves the figures of
`kvd status` from the Ray head without any `kvd up` process, reports a port it cannot take, and `teardown` (what
`kvd down` runs) stops it with the rest. The two-node test runs the whole `kvd up --detach` path."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

# the exporter's figures and port, not the data path
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("local_ray"), pytest.mark.backend_independent]


def _scrape(url: str, want: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        if want in text:
            return text
        time.sleep(0.2)  # the exporter refreshes once a second
    raise AssertionError(f"{want!r} not in the metrics within {timeout_s} s:\n{text}")


def test_the_exporter_serves_a_kvd_reports_a_taken_port_and_goes_down_with_it(
        small_config: Callable[..., Any]) -> None:
    import ray

    from kvd.cluster.deploy import deploy, deploy_metrics, teardown
    from kvd.cluster.naming import metrics_name
    from kvd.errors import ConfigError

    config = small_config("metrics", 1)
    ns = config.cluster.namespace
    deploy(config, host="127.0.0.1", ready_timeout_s=60)
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(ConfigError, match="metrics exporter did not start"):
                deploy_metrics(ns, taken.getsockname()[1], host="127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = deploy_metrics(ns, port, host="127.0.0.1")
        assert url == f"http://127.0.0.1:{port}/metrics"
        text = _scrape(url, 'kvd_shard_up{shard="shard-0"} 1.0')
        assert "kvd_cluster_level_epoch" in text and "kvd_shard_capacity_bytes" in text
    finally:
        stopped = teardown(ns, timeout_s=10)
    assert stopped == 3  # the exporter, the shard, the coordinator
    with pytest.raises(ValueError):
        ray.get_actor(metrics_name(), namespace=ns)
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)
