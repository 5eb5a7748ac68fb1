"""`vllm serve` (the OpenAI-compatible server, started through kvd.integrations.vllm_cli) with KvdConnector
against a real kvd shard server: a prompt asked twice is served the second time from kvd, with the same answer.

vLLM's own prefix cache is off, so prompt tokens the engine reports as coming from an external KV transfer can
only have come from kvd.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine_helpers import KvdServer, missing_engines  # isort: skip  (tests/engines/engine_helpers.py)

_reason = missing_engines("torch", "vllm", "transformers")
if _reason:
    pytest.skip(_reason, allow_module_level=True)

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
PROMPT = ("The harbor town kept its records in a stone archive above the market, where clerks copied every "
          "ledger twice and sent one copy upriver each spring. ") * 14 + "What did the clerks do?"
BLOCK = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


def _external_tokens(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    pattern = r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\}\s+(\S+)'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def test_a_repeated_prompt_is_served_from_kvd(model_folder: Path, tmp_path: Path) -> None:
    server = KvdServer(level="fp16")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    kv = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"kvd_endpoint": server.endpoint}}
    log = open(tmp_path / "vllm.log", "wb")  # noqa: SIM115 - closed below
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd.integrations.vllm_cli", "serve", str(model_folder), "--served-model-name",
         "m", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--no-enable-prefix-caching",
         "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", json.dumps(kv)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not answer in 600 s"
                time.sleep(1.0)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
        first = _post(f"{url}/v1/completions", body)
        n_prompt = first["usage"]["prompt_tokens"]
        assert n_prompt > 3 * BLOCK
        assert _external_tokens(url) == 0  # nothing stored yet: a miss
        stored = 0
        for _ in range(100):  # the saves run off the forward pass: wait until kvd holds the blocks
            stored = server.stats()["sequences"]
            if stored >= n_prompt // BLOCK:
                break
            time.sleep(0.1)
        assert stored == n_prompt // BLOCK  # every full block of the prompt
        second = _post(f"{url}/v1/completions", body)
        want = (n_prompt - 1) // BLOCK * BLOCK  # every full block, from kvd
        deadline = time.monotonic() + 10  # vLLM publishes its counters about once a second
        while (got := _external_tokens(url)) != want and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got == want
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        server.stop()
