"""`kvd ping`, the liveness check of the KubeRay head pod (issue 18, item 13): it must tell a serving coordinator
from one that accepts TCP connections but no longer answers (what the TCP readiness probe cannot see), find the
local `kvd up` by its run note as the probe runs it (no --address), and fail fast and clearly otherwise. The
servers here are kvd's own ZeroMQ servers in this process, no Ray; the two-node test pings a real cluster."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import zmq

from kvd.config import remove_run_file, write_run_file
from kvd.wire.server import TopologyServer

# a sibling test module (pytest puts this directory on sys.path): the `kvd` process helper
from test_cli import free_port, kvd  # isort: skip

# kvd ping as a subprocess without KVD_PURE_PYTHON; the TopologyServer is its target
pytestmark = [pytest.mark.integration, pytest.mark.backend_independent]


@pytest.fixture
def coordinator() -> Iterator[str]:
    topo = {"epoch": 1, "shards": [], "level": "fp16", "level_epoch": 0}
    server = TopologyServer(lambda: topo, name="kvd-coordinator")
    endpoint = server.start()
    try:
        yield endpoint
    finally:
        server.stop(timeout_s=2)


def test_ping_reports_a_serving_coordinator(coordinator: str) -> None:
    result = kvd("ping", "--address", coordinator, "--timeout", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"coordinator kvd-coordinator at {coordinator}: ping "), result.stdout


def test_ping_names_the_coordinator_once() -> None:
    """kvd's coordinator serves under the name "coordinator": not "coordinator coordinator at ..."."""
    server = TopologyServer(lambda: {"epoch": 1, "shards": [], "level": "fp16", "level_epoch": 0})
    endpoint = server.start()
    try:
        result = kvd("ping", "--address", endpoint, "--timeout", "5")
    finally:
        server.stop(timeout_s=2)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"coordinator at {endpoint}: ping "), result.stdout


def test_ping_fails_when_the_port_accepts_connections_but_nothing_answers() -> None:
    # a hung server: the TCP readiness probe is satisfied, a liveness check must not be
    ctx = zmq.Context()
    hung = ctx.socket(zmq.ROUTER)
    hung.setsockopt(zmq.LINGER, 0)
    port = hung.bind_to_random_port("tcp://127.0.0.1")
    try:
        started = time.monotonic()
        result = kvd("ping", "--address", f"tcp://127.0.0.1:{port}", "--timeout", "1")
        took = time.monotonic() - started
    finally:
        hung.close(0)
        ctx.term()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no reply" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert took < 10, took  # the timeout, plus starting Python


def test_ping_fails_when_nothing_listens() -> None:
    result = kvd("ping", "--address", f"tcp://127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr


def test_ping_finds_the_local_kvd_by_its_run_note_as_the_probe_runs_it(coordinator: str) -> None:
    namespace = f"kvd-ping-{os.getpid()}"
    write_run_file(namespace, {"pid": os.getpid(), "endpoint": coordinator, "detached": False,
                               "ray_address": "", "namespace": namespace})
    try:
        result = kvd("ping", "--namespace", namespace, "--timeout", "5")
    finally:
        remove_run_file(namespace)
    assert result.returncode == 0, result.stderr
    assert coordinator in result.stdout


def test_ping_with_no_kvd_in_the_namespace_says_so() -> None:
    result = kvd("ping", "--namespace", f"kvd-none-{os.getpid()}", "--timeout", "1")
    assert result.returncode == 1
    assert "no kvd is running in namespace" in result.stderr, result.stderr


@pytest.mark.parametrize("verb", ["ping", "status"])
def test_a_namespace_with_no_kvd_is_an_error_even_when_another_kvd_answers_on_the_default_port(
        coordinator: str, verb: str) -> None:
    """`kvd status --namespace nosuch` must not report the kvd that answers on the default port (another
    namespace's): with no `kvd up` of the namespace on this machine and no --address, there is nothing to ask."""
    port = coordinator.rsplit(":", 1)[1]  # the kvd of the default namespace listens here
    namespace = f"kvd-nosuch-{os.getpid()}"
    result = kvd(verb, "--namespace", namespace, "--set", f"cluster.port={port}", "--timeout", "5")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"kvd {verb}: no kvd is running in namespace {namespace!r}" in result.stderr, result.stderr
    assert "--address" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""
    # the default namespace still falls back to the default port (a kvd not started by `kvd up` here)
    assert kvd(verb, "--set", f"cluster.port={port}", "--timeout", "5").returncode == 0


def test_ping_help_says_what_it_is_for() -> None:
    result = kvd("ping", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.lower().split())
    assert "liveness" in text and "--shards" in text and "exit status 0" in text, result.stdout
