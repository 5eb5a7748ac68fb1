"""Fixtures shared by the integration tests."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

PAGE = 16  # tokens per page in the small clusters: 16 KiB at fp16 for the tests' layout
_names = itertools.count()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray (2 CPUs) for a module that deploys kvds: ``pytestmark = pytest.mark.usefixtures(...)``.
    ``address="local"``: a new instance even if `ray start` left a cluster address on this machine."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=96 << 20,
             logging_level=logging.WARNING, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def small_config() -> Callable[..., Any]:
    """``small_config(prefix, shards, **overrides)``: the config of a small, fast kvd for one test, in a Ray
    namespace of its own: 1 MiB per shard, pages of 16 tokens, no sink or window, 0.1 s reports, any port."""
    from kvd.config import load_config

    def make(prefix: str, shards: int, **extra: Any) -> Any:
        return load_config(env={}, overrides={
            "cluster.namespace": f"{prefix}-{os.getpid()}-{next(_names)}",
            "cluster.port": 0,
            "cluster.shards": shards,
            "cluster.memory_bytes": f"{shards}MiB",
            "cluster.shard_cpus": 0,
            "cluster.report_interval_s": 0.1,
            "cluster.ray_timeout_s": 10.0,
            "store.page_tokens": PAGE,
            "store.sink_tokens": 0,
            "store.window_tokens": 0,
            **extra,
        })

    return make
