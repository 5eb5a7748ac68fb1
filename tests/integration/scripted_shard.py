"""A scripted stand-in for a shard, for client tests: a real ROUTER on 127.0.0.1 that answers ``hello`` and then
every other request with a function of it (Busy, WrongShard, a wrong reply...)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import zmq

from kvd.wire import protocol as p


class Scripted:
    """A ROUTER that answers hello as shard ``shard_id``, then each other request with ``answer(request)``
    (every such request is kept in ``requests``)."""

    def __init__(self, answer: Callable[[Any], Any], shard_id: str = "sc") -> None:
        self.shard_id = shard_id
        self.answer = answer
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.requests: list[Any] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            req = p.decode_request(frames)
            if isinstance(req, p.HelloRequest):
                self.send(ident, p.HelloReply(request_id=req.request_id, kvd_version="t", page_format_version=1,
                                              shard_id=self.shard_id, page_tokens=64))
            else:
                self.serve(ident, req)
        self.sock.close()
        self.ctx.term()

    def serve(self, ident: bytes, req: Any) -> None:
        """Answer a request other than hello (a subclass may hold or reorder replies)."""
        self.requests.append(req)
        self.send(ident, self.answer(req))

    def send(self, ident: bytes, reply: Any) -> None:
        self.sock.send_multipart([ident, *p.encode_reply(reply)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
