"""bin/test reinstalls only when needed (issue 18, item 12: it took 139 s on every call). Its decision is read
with KVD_TEST_DRY_INSTALL=1 in a copy of the checkout: no stamp (a fresh clone, as in CI) or a changed build
input or a stale compiled module means install; otherwise not."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.backend_independent  # bin/test's install decision, in bash: no kvd code runs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "kvd-checkout"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(REPO / "bin" / "test", root / "bin" / "test")
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy2(REPO / name, root / name)
    shutil.copytree(REPO / "cython_ext", root / "cython_ext", ignore=shutil.ignore_patterns("*.c", "*.html"))
    shutil.copytree(REPO / "kvd", root / "kvd", ignore=shutil.ignore_patterns("*.c", "*.html", "__pycache__"))
    now = time.time()
    for built in (root / "kvd").rglob("*.so"):  # as just built: newer than their sources
        os.utime(built, (now + 1, now + 1))
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    python = venv_bin / "python"  # this interpreter, importing kvd from the copy
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{root}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return root


def decision(root: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("KVD_REINSTALL", "KVD_PURE_PYTHON")}
    result = subprocess.run(["bash", str(root / "bin" / "test")], capture_output=True, text=True, cwd=root,
                            env={**env, "KVD_TEST_DRY_INSTALL": "1"}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


def test_bin_test_installs_only_when_an_input_changed(checkout: Path) -> None:
    if not any((REPO / "kvd").rglob("*.so")):
        pytest.skip("no compiled build in this checkout to compare with")
    assert decision(checkout) == "kvd install: needed: no install stamp in .venv"
    stamp = checkout / ".venv" / ".kvd-install-stamp"
    stamp.touch()
    later = time.time() + 5
    os.utime(stamp, (later, later))
    assert decision(checkout) == "kvd install: up to date"

    for changed in ("pyproject.toml", "setup.py", "cython_ext/_kernels.pyx", "cython_ext/kvd_scalar.h"):
        path = checkout / changed
        os.utime(path, (later + 5, later + 5))
        assert decision(checkout) == f"kvd install: needed: {changed} changed"
        os.utime(path, (later - 60, later - 60))
    assert decision(checkout) == "kvd install: up to date"

    source = checkout / "kvd" / "codec" / "assemble.py"  # a compiled data-path module edited since the build
    os.utime(source, (later + 60, later + 60))
    assert "older than their source ['codec.assemble']" in decision(checkout)


def test_kvd_reinstall_forces_it(checkout: Path) -> None:
    (checkout / ".venv" / ".kvd-install-stamp").touch()
    env = {**os.environ, "KVD_TEST_DRY_INSTALL": "1", "KVD_REINSTALL": "1"}
    result = subprocess.run(["bash", str(checkout / "bin" / "test")], capture_output=True, text=True,
                            cwd=checkout, env=env, timeout=120)
    assert result.stdout.strip() == "kvd install: needed: KVD_REINSTALL is set"
