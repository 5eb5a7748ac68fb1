"""The clients: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio), over ZeroMQ.

``sync`` and ``aio`` drive the same request plans from ``core`` (connections, topology, routing, retries), so
both clients behave alike; only the waiting differs.
"""

from kvd.client.aio import AsyncClient
from kvd.client.core import recycle_buffers
from kvd.client.sync import Client, Pending, aggregate_stats

__all__ = ["AsyncClient", "Client", "Pending", "aggregate_stats", "recycle_buffers"]
