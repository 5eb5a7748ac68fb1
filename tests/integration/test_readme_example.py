"""The README's client example, run as a newcomer runs it (issue 31, section 3): against a serving kvd it must
print something that shows it worked. The kvd here is a coordinator's topology server and one shard server in
this process (no Ray); the example's endpoint is pointed at it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from kvd.store import Store
from kvd.wire.server import ShardServer, TopologyServer

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def _client_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if "from kvd.client import Client" in b and "kv.append(" in b)


@pytest.mark.timeout(60)
def test_the_readme_client_example_prints_that_it_worked() -> None:
    code = _client_example()
    assert 'Client("tcp://127.0.0.1:7070")' in code
    shard = ShardServer(Store(64 << 20), shard_id="shard-0")
    shard_endpoint = shard.start()
    topology = {"epoch": 1, "level": "fp16", "level_epoch": 0,
                "shards": [{"id": "shard-0", "endpoint": shard_endpoint}]}
    coordinator = TopologyServer(lambda: topology)
    try:
        endpoint = coordinator.start()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.replace("tcp://127.0.0.1:7070", endpoint), "README.md", "exec"), {})
    finally:
        coordinator.stop(timeout_s=2)
        shard.stop(timeout_s=2)
    printed = out.getvalue().strip()
    assert printed == "16 tokens stored; read back exactly: True", printed
    assert f"# prints: {printed}" in code  # the README shows what it prints
