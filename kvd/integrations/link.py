"""A kvd client for an inference engine: a kvd that is down costs a bounded wait once, never a hang or a crash.

An engine must keep serving when its cache is gone: every call here has a short timeout, and after a failure
the link stays *down* for ``retry_after_s`` (calls fail at once with :class:`KvdDown`) before one new attempt
reconnects. The caller turns :class:`KvdDown` into "no hit" (lookups, loads) or "save not made" (saves).

The namespace is registered on first use and again after kvd forgot it (a restarted, empty kvd answers
``UnknownNamespace``). Not thread-safe, like :class:`kvd.client.Client`: one link per thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from kvd.client import Client
from kvd.errors import (
    Conflict,
    CorruptPage,
    InvalidArgument,
    KvdError,
    OutOfMemory,
    UnknownNamespace,
    UnknownSequence,
)

log = logging.getLogger(__name__)
_PER_ITEM = (UnknownSequence, UnknownNamespace, Conflict, OutOfMemory, InvalidArgument, CorruptPage)
T = TypeVar("T")


class KvdDown(Exception):
    """kvd did not answer (or answered recently that it could not); the call was not made or did not finish."""


class KvdLink:
    """``endpoint``: a kvd coordinator or shard endpoint. ``layout``: ``(num_layers, num_kv_heads, head_dim)``
    registered for ``namespace``. ``timeout_s`` bounds each call; ``retry_after_s`` is how long a failure keeps
    the link down."""

    def __init__(self, endpoint: str, namespace: str, layout: tuple[int, int, int], *, timeout_s: float = 2.0,
                 retry_after_s: float = 5.0, name: str = "kvd") -> None:
        if not endpoint:
            raise InvalidArgument("a kvd endpoint is required (e.g. tcp://127.0.0.1:7070)")
        self.endpoint, self.namespace, self.layout = endpoint, namespace, layout
        self.timeout_s, self.retry_after_s, self.name = float(timeout_s), float(retry_after_s), name
        self._client: Client | None = None
        self._down_until = 0.0
        self.failures = 0

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def _connect(self) -> Client:
        if self._client is None:
            if self.down:
                raise KvdDown(f"{self.name}: {self.endpoint} is marked down for {self.retry_after_s:g} s")
            client = Client(self.endpoint, timeout_s=self.timeout_s)
            try:
                self._register(client)
            except BaseException:
                client.close()
                raise
            self._client = client
        return self._client

    def _register(self, client: Client) -> None:
        layers, heads, dim = self.layout
        client.register(self.namespace, num_layers=layers, num_kv_heads=heads, head_dim=dim)

    def call(self, fn: Callable[[Client], T]) -> T:
        """``fn(client)`` with the namespace registered. Raises :class:`KvdDown` if kvd is down or fails here
        with anything but a per-item answer; per-item errors (UnknownSequence, Conflict, OutOfMemory, ...)
        propagate as themselves."""
        try:
            client = self._connect()
            try:
                return fn(client)
            except UnknownNamespace:
                self._register(client)  # kvd restarted empty: register again, then once more
                return fn(client)
        except KvdDown:
            raise
        except KvdError as exc:
            if _per_item(exc):
                raise
            self._fail(exc)
            raise KvdDown(f"{self.name}: {exc}") from exc
        except Exception as exc:  # zmq or OS errors: same treatment, the engine must not see them
            self._fail(exc)
            raise KvdDown(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    def _fail(self, exc: BaseException) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.retry_after_s
        log.warning("%s at %s failed (%s); not asked again for %.1f s", self.name, self.endpoint, exc,
                    self.retry_after_s)
        self.close()

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            finally:
                self._client = None


def _per_item(exc: KvdError) -> bool:
    """Errors about one item that leave kvd usable (the caller handles them, e.g. a miss or a full store);
    anything else (Timeout, ShardUnavailable, Busy past its retries, protocol errors) marks kvd down."""
    return isinstance(exc, _PER_ITEM)


__all__ = ["KvdDown", "KvdLink"]
