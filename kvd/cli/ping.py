"""``kvd ping``: a liveness check that speaks the protocol (hello, then ping), for scripts and probes."""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvd.cli.common import (
    _EXIT_ERROR,
    _EXIT_OK,
    _curve_client,
    _endpoint_arg,
    _live_note,
    _load,
    _say,
    no_kvd_message,
)


def _ping_endpoint(endpoint: str, timeout_s: float, curve: Any) -> tuple[str, str, float]:
    """Send ``hello`` and ``ping`` to one kvd server; ``(role, name, seconds of the ping round trip)``. Raises
    :class:`~kvd.errors.Timeout` if no reply comes within ``timeout_s`` (the error of a refused request as is)."""
    import zmq

    from kvd.errors import ProtocolError, Timeout
    from kvd.wire import protocol as p
    from kvd.wire.sockets import recv_frames, send_frames

    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply_client(sock)
        sock.connect(endpoint)  # the requests wait in the socket until the connection is up (no ZMQ_IMMEDIATE)
        deadline = time.monotonic() + timeout_s
        send_frames(sock, p.encode_request(p.HelloRequest(request_id=1)))
        replies: dict[int, Any] = {}
        sent = 0.0
        while len(replies) < 2:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(left * 1000, zmq.POLLIN):
                what = "hello" if not replies else "ping"
                raise Timeout(f"no reply from {endpoint} to {what} within {timeout_s:g} s")
            reply = p.decode_reply([f.buffer for f in recv_frames(sock)])
            if isinstance(reply, p.ErrorReply):
                raise reply.exception()
            replies[reply.request_id] = (reply, time.perf_counter())
            if reply.request_id == 1:
                sent = time.perf_counter()
                send_frames(sock, p.encode_request(p.PingRequest(request_id=2)))
        hello, (ping, answered) = replies[1][0], replies[2]
        if not isinstance(hello, p.HelloReply) or not isinstance(ping, p.PingReply):
            raise ProtocolError(f"{endpoint} answered hello and ping with {type(hello).__name__}, "
                                f"{type(ping).__name__}")
        return str(hello.role), str(hello.shard_id), answered - sent
    finally:
        sock.close(0)
        ctx.term()


def cmd_ping(args: argparse.Namespace) -> int:
    config = _load(args)
    endpoint = _endpoint_arg(args, config)
    curve = _curve_client(config)
    from kvd.errors import ShardUnavailable, Timeout

    try:
        role, name, seconds = _ping_endpoint(endpoint, args.timeout, curve)
    except (Timeout, ShardUnavailable) as exc:
        if args.address is None and _live_note(config.cluster.namespace) is None:
            _say(f"kvd ping: {no_kvd_message(config.cluster.namespace, endpoint)}")
            return _EXIT_ERROR
        raise exc from None
    if not args.quiet:
        who = role if name in ("", role) else f"{role} {name}"  # kvd's coordinator is named "coordinator"
        print(f"{who} at {endpoint}: ping {seconds * 1e3:.2f} ms")
    if not args.all_shards:
        return _EXIT_OK
    from kvd.client.sync import Client

    with Client(endpoint, timeout_s=args.timeout, curve=curve) as client:
        shards = client.topology()["shards"]
        failed = 0
        for shard in shards:
            try:
                with Client(shard["endpoint"], timeout_s=args.timeout, curve=curve) as one:
                    took = one.ping()[shard["id"]]
            except (Timeout, ShardUnavailable) as exc:
                failed += 1
                print(f"shard {shard['id']} at {shard['endpoint']}: no answer: {exc}")
                continue
            if not args.quiet:
                print(f"shard {shard['id']} at {shard['endpoint']}: ping {took * 1e3:.2f} ms")
    if role == "coordinator" and not shards:
        print("no shard is registered")
        return _EXIT_ERROR
    return _EXIT_ERROR if failed else _EXIT_OK
