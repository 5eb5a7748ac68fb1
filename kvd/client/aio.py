"""The asyncio client, :class:`AsyncClient`: :class:`kvd.client.Client`'s methods as coroutines (theory of
operation: :mod:`kvd.client`; the request plans are shared, :mod:`kvd.client.core`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from kvd.client.conn import _open_socket
from kvd.client.core import (
    CONNECT_GRACE_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WINDOW,
    Plan,
    _Conn,
    _Core,
    _on_wire,
    aggregate_stats,
)
from kvd.client.messages import _decode_reply
from kvd.errors import InvalidArgument, KvdError
from kvd.wire import protocol as p
from kvd.wire.curve import CurveConfig

log = logging.getLogger(__name__)

__all__ = ["AsyncClient"]


class AsyncClient(_Core):
    """The asyncio client: :class:`Client`'s methods as coroutines (``topology()`` stays a plain method).
    Concurrent calls are pipelined on the shards' connections (one reader task per connection matches replies
    by id). Connects on first use or in ``async with``; ``await close()``. Use it from one event loop."""

    def __init__(self, address: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 curve: CurveConfig | None = None, limits: p.Limits | None = None) -> None:
        super().__init__(address, timeout_s=timeout_s, curve=curve, limits=limits)
        self._ctx: zmq.asyncio.Context = zmq.asyncio.Context()
        self._connected = False
        self._connecting: asyncio.Lock | None = None

    async def connect(self, *, timeout_s: float | None = None) -> AsyncClient:
        """Greet the servers and read the topology (done by the first call if not called). Idempotent."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if not self._connected:
                await self._drive(self._g_bootstrap(self._deadline(timeout_s)), connected=False)
                self._connected = True
        return self

    async def _drive(self, plan: Plan, *, connected: bool = True) -> Any:
        if connected and not self._connected:
            await self.connect()
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                action = plan.throw(error) if error is not None else plan.send(value)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                kind = action[0]
                if kind == "wait":
                    value = await self._wait(*action[1:])
                elif kind == "send":
                    await self._send(*action[1:])
                elif kind == "open":
                    value = self._open(action[1])
                else:
                    await asyncio.sleep(action[1])
            except (Exception, asyncio.CancelledError) as exc:  # thrown into the plan at its yield
                error = exc

    def _open(self, endpoint: str) -> _Conn:
        conn = self._track(_open_socket(self._ctx, endpoint, self._curve, self._limits))
        conn.reader = asyncio.ensure_future(self._reader(conn))
        return conn

    async def _reader(self, conn: _Conn) -> None:
        while True:
            try:
                msg = await conn.sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            reply = _decode_reply([f.buffer for f in msg], self._limits, conn.endpoint)
            if reply is None:
                continue
            fut = conn.waiting.pop(reply.request_id, None) if reply.request_id is not None else None
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def _send(self, conn: _Conn, req: Any, deadline: float) -> None:
        frames = p.encode_request(_on_wire(conn, req), conn.limits)
        fut = asyncio.get_running_loop().create_future()
        conn.waiting[req.request_id] = fut  # the reader resolves it
        conn.replies[req.request_id] = fut  # _wait takes it from here (it may be resolved before _wait runs)
        sent = conn.sock.send_multipart(frames, copy=False)  # pyzmq copies frames under its threshold
        if not sent.done():  # not connected (ZMQ_IMMEDIATE) or SNDHWM: wait a little for the pipe
            grace = min(deadline, time.monotonic() + CONNECT_GRACE_S) - time.monotonic()
            try:
                await asyncio.wait_for(sent, max(grace, 0.0))
            except asyncio.TimeoutError:
                conn.waiting.pop(req.request_id, None)
                conn.replies.pop(req.request_id, None)
                raise self._unavailable(conn, req.OP, deadline, self.timeout_s) from None
        else:
            sent.result()

    async def _wait(self, conn: _Conn, req: Any, deadline: float, timeout_s: float) -> Any:
        fut = conn.replies.pop(req.request_id, None)
        if fut is None:
            raise self._timeout(conn, req.OP, timeout_s)
        try:
            return await asyncio.wait_for(fut, max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            conn.waiting.pop(req.request_id, None)
            raise self._timeout(conn, req.OP, timeout_s) from None
        except asyncio.CancelledError:
            conn.waiting.pop(req.request_id, None)  # a late reply is discarded
            raise

    # -------------------------------------------------------------------------------------------- the API

    async def refresh(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """See :meth:`Client.refresh`."""
        return await self._drive(self._g_refresh(self._deadline(timeout_s)))

    async def register(self, namespace: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
                       timeout_s: float | None = None) -> None:
        """See :meth:`Client.register`."""
        await self._drive(self._plan_register(namespace, (num_layers, num_kv_heads, head_dim), timeout_s))

    async def calibrate(self, namespace: str, calibration: Any = None, *, require: bool | None = None,
                        timeout_s: float | None = None) -> dict[str, Any]:
        """See :meth:`Client.calibrate`."""
        return await self._drive(self._plan_calibrate(namespace, calibration, require, timeout_s))

    async def append(self, namespace: str, seq_id: p.SeqId, keys: Any, values: Any, *,
                     offset: int | None = None, dtype: str | None = None, position: int | None = None,
                     parent: p.SeqId | None = None,
                     timeout_s: float | None = None) -> int:
        """See :meth:`Client.append`."""
        return await self._drive(
            self._plan_append(namespace, seq_id, keys, values, offset, dtype, timeout_s, position,
                              parent=self._parent_here(namespace, seq_id, parent)))

    async def get(self, namespace: str, seq_id: p.SeqId, start: int = 0, end: int | None = None,
                  layers: Sequence[int] | None = None, *, format: str = "fp16",  # noqa: A002
                  timeout_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`Client.get`."""
        return await self._drive(
            self._plan_get(namespace, seq_id, start, end, layers, format, timeout_s))

    async def drop(self, namespace: str, seq_id: p.SeqId, *, timeout_s: float | None = None) -> bool:
        """See :meth:`Client.drop`."""
        return await self._drive(self._plan_simple(
            lambda rid: p.DropRequest(request_id=rid, namespace=namespace, seq_id=seq_id), namespace, seq_id,
            timeout_s))

    async def length(self, namespace: str, seq_id: p.SeqId, *, timeout_s: float | None = None) -> int:
        """See :meth:`Client.length`."""
        return await self._drive(self._plan_simple(
            lambda rid: p.LengthRequest(request_id=rid, namespace=namespace, seq_id=seq_id), namespace, seq_id,
            timeout_s))

    async def lengths(self, namespace: str, seq_ids: Sequence[p.SeqId], *,
                      timeout_s: float | None = None) -> list[int | None]:
        """See :meth:`Client.lengths`."""
        return await self._drive(self._plan_lengths(namespace, seq_ids, timeout_s))

    async def attend(self, namespace: str, seq_id: p.SeqId, layer: int, queries: Any, *, start: int = 0,
                     end: int | None = None, scale: float | None = None, positions: Any = None,
                     timeout_s: float | None = None) -> tuple[Any, Any]:
        """See :meth:`Client.attend`."""
        return await self._drive(self._plan_attend(namespace, seq_id, layer, queries, start, end, scale,
                                                   positions, timeout_s))

    async def explain(self, namespace: str, seq_id: p.SeqId, layer: int, token: int, *,
                      timeout_s: float | None = None) -> dict[str, Any]:
        """See :meth:`Client.explain`."""
        return await self._drive(self._plan_simple(
            lambda rid: p.ExplainRequest(request_id=rid, namespace=namespace, seq_id=seq_id, layer=layer,
                                         token=token), namespace, seq_id, timeout_s))

    async def shard_stats(self, *, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """See :meth:`Client.shard_stats`."""
        return await self._drive(self._plan_shard_stats(timeout_s))

    async def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """See :meth:`Client.stats`."""
        return aggregate_stats(await self.shard_stats(timeout_s=timeout_s))

    async def ping(self, *, timeout_s: float | None = None) -> dict[str, float]:
        """See :meth:`Client.ping`."""
        return await self._drive(self._plan_ping(timeout_s))

    async def _gather(self, calls: list[Any], window: int, return_exceptions: bool) -> list[Any]:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidArgument(f"window must be a positive integer, got {window!r}")
        gate = asyncio.Semaphore(window)

        async def one(call: Any) -> Any:
            async with gate:
                try:
                    return await call()
                except KvdError as exc:
                    if not return_exceptions:
                        raise
                    return exc

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def append_many(self, items: Iterable[Sequence[Any]], *, window: int = DEFAULT_WINDOW,
                          return_exceptions: bool = False, timeout_s: float | None = None) -> list[Any]:
        """Concurrent appends, at most ``window`` in flight (see :meth:`Client.append_many`)."""
        calls = [lambda it=it: self.append(*it[:4], offset=it[4] if len(it) > 4 else None, timeout_s=timeout_s)
                 for it in items]
        return await self._gather(calls, window, return_exceptions)

    async def get_many(self, items: Iterable[Sequence[Any]], *, format: str = "fp16",  # noqa: A002
                       window: int = DEFAULT_WINDOW, return_exceptions: bool = False,
                       timeout_s: float | None = None) -> list[Any]:
        """Concurrent gets, at most ``window`` in flight (see :meth:`Client.get_many`)."""
        calls = [lambda it=it: self.get(*it, format=format, timeout_s=timeout_s) for it in items]
        return await self._gather(calls, window, return_exceptions)

    async def close(self) -> None:
        """Close every connection and cancel the reader tasks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        conns = self._all_conns()
        for conn in conns:
            conn.close()
        readers = [c.reader for c in conns if c.reader is not None]
        if readers:
            await asyncio.gather(*readers, return_exceptions=True)
        self._conns.clear()
        self._coordinator = None
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
