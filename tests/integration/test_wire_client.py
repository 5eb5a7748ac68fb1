"""The blocking client against scripted servers: what its fast path (a call's first attempt made without the
request plan) must still refuse or hand on to the plan."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest

from kvd.client import AsyncClient, Client
from kvd.errors import ProtocolError
from kvd.wire import protocol as p

from scripted_shard import Scripted  # isort: skip  (tests/integration/scripted_shard.py)


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


class _Malformed(Scripted):
    """Answers every request other than hello with a reply the client's strict decoder refuses (an unknown key),
    under the request's id."""

    def serve(self, ident: bytes, req: Any) -> None:
        self.requests.append(req)
        header = msgpack.unpackb(bytes(p.encode_reply(p.DropReply(request_id=req.request_id, dropped=True))[0]))
        self.sock.send_multipart([ident, msgpack.packb({**header, "surprise": 1})])


@pytest.mark.timeout(60)
def test_a_malformed_reply_fails_its_call_at_once_as_a_protocol_error_not_a_timeout() -> None:
    server = _Malformed(lambda req: None)
    try:
        with Client(server.endpoint, timeout_s=5) as c:
            with pytest.raises(ProtocolError, match="surprise"):
                c.drop("m", "s")

        async def run() -> None:
            async with AsyncClient(server.endpoint, timeout_s=5) as c:
                with pytest.raises(ProtocolError, match="surprise"):
                    await c.drop("m", "s")

        asyncio.run(run())
    finally:
        server.close()
