"""Malformed endpoints are refused at once (issue 18, item 7): before, ``Client("127.0.0.1:17000")`` (no
``tcp://``) and ``kvd status --address 127.0.0.1:17001`` hung forever, because the failed ``connect`` left a
socket open and ``Context.term()`` waited for it. Each case runs in its own process with a deadline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvd.errors import InvalidArgument

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("KVD_") or k == "KVD_KERNELS"},
       "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
DEADLINE_S = 30.0  # an import of kvd and an exit; a hang is what the test catches


def run(*argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    try:
        result = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO, env=ENV,
                                timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv[-1][:80]!r} still ran after {DEADLINE_S:.0f} s (a bad endpoint must fail at once)")
    return result, time.monotonic() - t0


# the client under test runs in a subprocess without KVD_PURE_PYTHON (ENV): the same build in both of bin/test's
# passes
@pytest.mark.backend_independent
@pytest.mark.parametrize("cls", ["Client", "AsyncClient"])
@pytest.mark.parametrize("address", ["127.0.0.1:17000", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://:7070",
                                     "tcp://127.0.0.1:99999", "udp://127.0.0.1:7070"])
def test_a_client_refuses_a_malformed_endpoint_at_once_and_exits(cls: str, address: str) -> None:
    code = (
        "from kvd.client import AsyncClient, Client\n"
        "from kvd.errors import InvalidArgument\n"
        "try:\n"
        f"    {cls}({address!r}, timeout_s=2)\n"
        "except InvalidArgument as exc:\n"
        "    print('refused:', exc)\n"
    )
    result, took = run("-c", code)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "tcp://" in result.stdout, result.stdout
    assert took < DEADLINE_S


def test_a_list_of_endpoints_names_the_bad_one() -> None:
    from kvd.client.core import check_endpoint

    with pytest.raises(InvalidArgument, match=r"address\[1\].*'127.0.0.1:7071'"):
        check_endpoint("address[1]", "127.0.0.1:7071")
    for good in ("tcp://127.0.0.1:7070", "tcp://[::1]:7070", "tcp://kvd-head.local:1", "ipc:///tmp/kvd.sock",
                 "inproc://kvd"):
        assert check_endpoint("address", good) == good


@pytest.mark.backend_independent  # `kvd status` in a subprocess without KVD_PURE_PYTHON
def test_status_with_an_endpoint_without_scheme_is_a_usage_error_at_once() -> None:
    result, _ = run("-m", "kvd", "status", "--address", "127.0.0.1:17001", "--timeout", "1")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--address" in result.stderr and "tcp://" in result.stderr
    assert "Traceback" not in result.stderr
