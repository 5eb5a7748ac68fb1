"""Which of kvd's Python modules are also built compiled, and the way back to their source.

The data path's modules (:data:`COMPILED`) are plain Python that setup.py also compiles with Cython as they are
(no annotations turned into C types, Python semantics kept): the interpreter's work per small request, which
bounds kvd's small-request latency, drops by about a quarter (docs/design.md, "Compiled Python modules"). The
``.py`` file stays the truth; the compiled module is only a faster build of it, and is never used when it could
be out of date:

* ``KVD_PURE_PYTHON=1`` (any value but empty or ``0``) at build time compiles nothing but the kernels; at import
  time it loads every module of :data:`COMPILED` from its source even where a compiled build exists (debugging,
  profiling with cProfile, the second test run of CI).
* In a source checkout (the package next to ``.git``: an editable install), a compiled module older than its
  source (edited or checked out after the last build) is skipped for its source, with one warning naming the
  rebuild command, so stale code never runs.

:func:`install` runs once, from ``kvd/__init__.py``, before any of these modules is imported. This module imports
nothing of kvd (setup.py reads :data:`COMPILED` from it).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ENV_VAR = "KVD_PURE_PYTHON"

# The data path, as dotted names below the package: protocol, server and client loops, the store and its page
# codec glue. Not here: the numpy reference (codec.reference, the oracle stays interpreted), the kernel dispatch
# (codec.kernels, called once per import), the control plane (cluster, policy: Ray calls dominate), the
# configuration, the command line and the package __init__ files (re-exports only).
COMPILED = (
    "client.aio",
    "client.conn",
    "client.core",
    "client.messages",
    "client.sync",
    "codec.assemble",
    "codec.batch",
    "codec.pages",
    "store.append",
    "store.buffers",
    "store.compact",
    "store.core",
    "store.evict",
    "store.pool",
    "store.sequences",
    "wire.messages",
    "wire.peek",
    "wire.protocol",
    "wire.routing",
    "wire.schema",
    "wire.server.admission",
    "wire.server.departures",
    "wire.server.lane",
    "wire.server.loop",
    "wire.server.metrics",
    "wire.server.shard",
    "wire.server.topology",
    "wire.sockets",
)

PACKAGE_DIR = Path(__file__).resolve().parent


def pure_requested(environ: Any = os.environ) -> bool:
    """Whether ``KVD_PURE_PYTHON`` asks for the sources (set, and neither empty nor ``0``)."""
    return environ.get(ENV_VAR, "").strip() not in ("", "0")


def source_file(directory: Path, name: str) -> Path:
    """The ``.py`` of module ``name`` (dotted, below the package in ``directory``)."""
    return directory.joinpath(*name.split(".")).with_suffix(".py")


def compiled_file(directory: Path, name: str) -> Path | None:
    """The compiled build of module ``name`` (dotted, below the package in ``directory``) for this interpreter,
    if there is one."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory.joinpath(*name.split(".")).with_name(name.rpartition(".")[2] + suffix)
        if path.exists():
            return path
    return None


def stale_modules(directory: Path, names: Iterable[str]) -> list[str]:
    """The modules of ``names`` whose compiled build in ``directory`` is older than their ``.py`` source."""
    stale = []
    for name in names:
        built = compiled_file(directory, name)
        source = source_file(directory, name)
        if built is not None and source.exists() and built.stat().st_mtime < source.stat().st_mtime:
            stale.append(name)
    return stale


class SourceFinder:
    """A meta path finder that loads the listed modules of the package in ``directory`` from their ``.py``."""

    def __init__(self, package: str, directory: Path, names: Iterable[str]) -> None:
        self.package, self.directory, self.names = package, directory, frozenset(names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix = self.package + "."
        name = fullname[len(prefix):]
        if not fullname.startswith(prefix) or name not in self.names:
            return None
        return importlib.util.spec_from_file_location(fullname, source_file(self.directory, name))


_installed: list[SourceFinder] = []


def install() -> tuple[str, ...]:
    """Route the modules that must not be loaded compiled to their source (see the module doc); returns their
    names. Idempotent."""
    if _installed:
        return tuple(sorted(_installed[0].names))
    if pure_requested():
        names = list(COMPILED)
    elif (PACKAGE_DIR.parent / ".git").exists():
        names = stale_modules(PACKAGE_DIR, COMPILED)
        if names:
            warnings.warn(
                f"kvd: the compiled build of {', '.join(names)} is older than the source; running the source "
                "(slower). Rebuild with `.venv/bin/python -m pip install -e .` or `bin/test`.",
                RuntimeWarning,
                stacklevel=3,
            )
    else:
        names = []
    finder = SourceFinder(__name__.rpartition(".")[0], PACKAGE_DIR, names)
    _installed.append(finder)
    if names:
        sys.meta_path.insert(0, finder)
    return tuple(sorted(names))


def compiled_modules() -> list[str]:
    """The modules of :data:`COMPILED` imported so far that run compiled (for benchmarks and checks)."""
    package = __name__.rpartition(".")[0]
    out = []
    for name in COMPILED:
        module = sys.modules.get(f"{package}.{name}")
        if module is not None and not str(getattr(module, "__file__", "")).endswith(".py"):
            out.append(name)
    return out
