"""The kernels' C headers (cython_ext/*.h) depend on each other in one direction: no include circle, and each
header compiles on its own, so that it includes everything it uses (the AVX2 fast paths kvd_avx2_q8.h and
kvd_avx2_q4.h take their helpers from kvd_avx2_util.h, not from the kvd_avx2.h that includes them).

backend_independent: it reads and compiles the headers with the C compiler and imports nothing of kvd, so the
second pass (reference kernels, modules from source) would run it unchanged."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.backend_independent

HEADERS = Path(__file__).resolve().parents[2] / "cython_ext"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _graph() -> dict[str, set[str]]:
    return {h.name: set(_INCLUDE.findall(h.read_text())) for h in sorted(HEADERS.glob("*.h"))}


def test_every_quoted_include_names_a_header_here() -> None:
    graph = _graph()
    assert len(graph) > 10
    assert {h: sorted(inc - set(graph)) for h, inc in graph.items() if inc - set(graph)} == {}


def test_the_headers_include_each_other_in_one_direction() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(h: str, path: list[str]) -> None:
        state[h] = 1
        for nxt in sorted(graph[h]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[h] = 2

    for h in graph:
        if h not in state:
            visit(h, [h])
    assert circles == []


def _compiles_here(name: str) -> bool:
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686")
    if "neon" in name:
        return platform.machine().lower() in ("aarch64", "arm64")
    if "avx" in name:
        return x86
    return True


@pytest.mark.parametrize("header", sorted(h.name for h in HEADERS.glob("*.h")))
def test_each_header_compiles_on_its_own(header: str) -> None:
    """A header that needs definitions its includer happens to make first is half of a circle."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    if not _compiles_here(header):
        pytest.skip(f"{header}: another architecture's intrinsics")
    result = subprocess.run([cc, "-fsyntax-only", "-std=c11", "-Wall", "-Wno-unused-function", "-I", str(HEADERS),
                             "-x", "c", str(HEADERS / header)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
