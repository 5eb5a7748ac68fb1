"""The ``kvd`` command: ``main`` (up, down, status, config, bench, keygen), ``status`` (the status table and
metrics), ``loadgen`` (the load generator behind ``kvd bench``)."""

from kvd.cli.main import main

__all__ = ["main"]
