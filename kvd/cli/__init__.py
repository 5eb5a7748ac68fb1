"""The ``kvd`` command: ``main`` (the parser; status, config, bench, keygen), ``up`` (up and down), ``ping``,
``common`` (what the commands share), ``status`` (the status table and metrics), ``loadgen`` (the load
generator behind ``kvd bench``)."""

from kvd.cli.main import main

__all__ = ["main"]
