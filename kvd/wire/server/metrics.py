"""A server's counters and its request rate (:class:`Metrics`), written by the serving loop; what they mean:
:meth:`~kvd.wire.server.loop.RouterServer.metrics`."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["RATE_WINDOW_S", "Metrics"]

RATE_WINDOW_S = 10


class Metrics:
    """Counters written by the server thread only; :meth:`snapshot` may run on any thread (ints are read
    atomically; the rate is approximate by design)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests = self.errors = self.busy = self.bytes_in = self.bytes_out = 0
        self.replies_dropped = self.queue_peak = self.compactions = self.compacted_bytes = 0
        self.replies_over_budget = self.bulk_requests = 0
        self.busy_share = self.requests_abandoned = 0
        self._stamp = [0] * RATE_WINDOW_S
        self._count = [0] * RATE_WINDOW_S

    def tick(self, now: float) -> None:
        sec = int(now)
        i = sec % RATE_WINDOW_S
        if self._stamp[i] != sec:
            self._stamp[i], self._count[i] = sec, 0
        self._count[i] += 1

    def rate(self) -> float:
        now = time.monotonic()
        sec = int(now)
        total = sum(c for s, c in zip(self._stamp, self._count, strict=True) if sec - RATE_WINDOW_S < s <= sec)
        span = min(float(RATE_WINDOW_S), max(now - self.started, 1e-3))
        return total / span

    def snapshot(self, queue_depth: int, queued_bytes: int, peers_cut: int, replies_held: int,
                 bulk_depth: int, peers_queued: int) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "busy": self.busy,
                "busy_share": self.busy_share, "requests_abandoned": self.requests_abandoned,
                "peers_queued": peers_queued,
                "bulk_requests": self.bulk_requests, "bulk_depth": bulk_depth,
                "requests_per_s": round(self.rate(), 3), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "replies_dropped": self.replies_dropped, "replies_over_budget": self.replies_over_budget,
                "peers_cut": peers_cut, "replies_held_bytes": replies_held,
                "queue_depth": queue_depth, "queued_bytes": queued_bytes,
                "queue_peak": self.queue_peak, "compactions": self.compactions,
                "compacted_bytes": self.compacted_bytes, "uptime_s": round(time.monotonic() - self.started, 3)}
