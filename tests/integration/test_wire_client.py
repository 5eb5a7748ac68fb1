"""The blocking client against scripted servers: what its fast path (a call's first attempt made without the
request plan) must still refuse or hand on to the plan."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from kvd.client import Client
from kvd.errors import ProtocolError
from kvd.wire import protocol as p


class Scripted:
    """A ROUTER that answers hello as shard "sc", then each other request with ``answer(request)``."""

    def __init__(self, answer: Callable[[Any], Any]) -> None:
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
                reply: Any = p.HelloReply(request_id=req.request_id, kvd_version="t", page_format_version=1,
                                          shard_id="sc", page_tokens=64)
            else:
                self.requests.append(req)
                reply = self.answer(req)
            self.sock.send_multipart([ident, *p.encode_reply(reply)])
        self.sock.close()
        self.ctx.term()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def _fp16_reply(req: Any) -> Any:
    keys = np.zeros((1, 2, 1, 4), np.float16)
    return p.GetReply(request_id=req.request_id, start=0, end=2, layers=(0,), keys=keys, values=keys)


@pytest.mark.timeout(30)
def test_a_get_for_pages_answered_with_fp16_tensors_is_refused_not_returned() -> None:
    server = Scripted(_fp16_reply)
    try:
        with Client(server.endpoint, timeout_s=5) as c:
            keys, values = c.get("m", "s")  # asked for fp16: the reply answers it
            assert keys.shape == (1, 2, 1, 4)
            with pytest.raises(ProtocolError, match="does not answer"):
                c.get("m", "s", format="pages")
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_a_reply_of_another_operation_is_refused_on_every_fast_call() -> None:
    server = Scripted(lambda req: p.DropReply(request_id=req.request_id, dropped=True))
    keys = np.zeros((1, 2, 1, 4), np.float16)
    try:
        with Client(server.endpoint, timeout_s=5) as c:
            for call in (lambda: c.get("m", "s"), lambda: c.length("m", "s"),
                         lambda: c.append("m", "s", keys, keys)):
                with pytest.raises(ProtocolError, match="does not answer"):
                    call()
            assert c.drop("m", "s") is True
    finally:
        server.close()
