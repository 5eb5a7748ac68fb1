"""Fixtures shared by the integration tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray (2 CPUs) for a module that deploys kvds: ``pytestmark = pytest.mark.usefixtures(...)``.
    ``address="local"``: a new instance even if `ray start` left a cluster address on this machine."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=96 << 20,
             logging_level=logging.WARNING, log_to_driver=False)
    yield
    ray.shutdown()
