"""The coordinator's topology endpoint: :class:`TopologyServer`, a :class:`~kvd.wire.server.loop.RouterServer`
that answers ``hello``, ``ping`` and ``topology``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvd.errors import ConfigError, ProtocolError
from kvd.wire import protocol as p
from kvd.wire.curve import CurveConfig
from kvd.wire.server.loop import DEFAULT_HWM, DEFAULT_LINGER_S, RouterServer
from kvd.wire.sockets import DEFAULT_HEARTBEAT_IVL_S, DEFAULT_HEARTBEAT_TIMEOUT_S

__all__ = ["TopologyServer"]


class TopologyServer(RouterServer):
    """Serves ``hello`` / ``ping`` / ``topology`` for the coordinator. ``get_topology()`` is called on the
    serving thread for each request and returns ``{"epoch": int, "shards": [{"id", "endpoint"}, ...],
    "level": tag, "level_epoch": int}``. Data operations are refused with ProtocolError (they go to shards)."""

    _NAME = "topology server"

    def __init__(self, get_topology: Callable[[], dict[str, Any]], *, host: str = "127.0.0.1", port: int = 0,
                 curve: CurveConfig | None = None, name: str = "coordinator", limits: p.Limits | None = None,
                 hwm: int = DEFAULT_HWM, heartbeat_ivl_s: float = DEFAULT_HEARTBEAT_IVL_S,
                 heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 linger_s: float = DEFAULT_LINGER_S) -> None:
        super().__init__(host=host, port=port, limits=limits, curve=curve, max_queued_requests=256,
                         max_queued_bytes=16 << 20, hwm=hwm, heartbeat_ivl_s=heartbeat_ivl_s,
                         heartbeat_timeout_s=heartbeat_timeout_s, linger_s=linger_s)
        if not callable(get_topology):
            raise ConfigError(f"get_topology must be callable, got {type(get_topology).__name__}")
        self._get_topology = get_topology
        self._name = p.check_short_text("name", name, ConfigError)

    def _execute(self, req: Any) -> Any:
        if isinstance(req, p.HelloRequest):
            return self._hello(req, role="coordinator", name=self._name, page_tokens=None)
        if isinstance(req, p.PingRequest):
            return p.PingReply(request_id=req.request_id)
        if isinstance(req, p.TopologyRequest):
            topo = self._get_topology()
            return p.TopologyReply(request_id=req.request_id, epoch=topo["epoch"], shards=tuple(topo["shards"]),
                                   level=topo["level"], level_epoch=topo["level_epoch"])
        raise ProtocolError(f"op {req.OP!r} is served by the shards; this is the coordinator's topology endpoint "
                            "(ops: hello, ping, topology)")
