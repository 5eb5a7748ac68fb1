"""Helpers of the engine tests (the kvd server process, skip reasons), in a module of their own: the tests import
them by this unique name, and a spawn child finds ``_serve`` here (a function in a ``conftest`` module cannot be
found again once several test folders each have a ``conftest``)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
from typing import Any


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
    epoch = 1
    while True:
        cmd = conn.recv()
        if cmd == "stats":
            conn.send(store.stats())
        elif isinstance(cmd, tuple) and cmd[0] == "level":
            epoch += 1
            conn.send(store.set_level(cmd[1], epoch))
        elif cmd == "stop":
            server.stop()
            store.close(persist=False)
            conn.send("stopped")
            return


class KvdServer:
    """A kvd shard server in a spawn process, at precision ``level`` (:meth:`set_level` changes it);
    :attr:`endpoint` once it serves."""

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

    def set_level(self, level: str) -> None:
        """The level new pages are sealed at from now on (a coordinator's order, as a cluster would give it)."""
        self._conn.send(("level", level))
        assert self._conn.poll(10), "the kvd server did not answer"
        assert self._conn.recv(), f"the store did not take level {level}"

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
