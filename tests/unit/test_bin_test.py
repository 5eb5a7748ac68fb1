"""bin/test reinstalls only when needed (issue 18, item 12: it took 139 s on every call). Its decision is read
with KVD_TEST_DRY_INSTALL=1 in a copy of the checkout: no stamp (a fresh clone, as in CI) or a changed build
input or a stale compiled module means install; otherwise not. bin/kvd installs the same way, with the same stamp
(issue 31: `bin/test` after `bin/kvd up` rebuilt everything, 194 s), and says each step as it runs."""

from __future__ import annotations

import os
import re
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
    for script in ("test", "kvd", "kvd-install"):
        shutil.copy2(REPO / "bin" / script, root / "bin" / script)
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


def _fake_pip(root: Path) -> Path:
    """Make the copy's .venv/bin/python log `-m pip ...` calls to pip.log instead of running pip."""
    log = root / "pip.log"
    python = root / ".venv" / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "$*" >> "{log}"; exit 0; fi\n'
        f'PYTHONPATH="{root}" exec "{sys.executable}" "$@"\n'
    )
    return log


def _run(root: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("KVD_REINSTALL", "KVD_PURE_PYTHON",
                                                            "KVD_TEST_DRY_INSTALL")}
    result = subprocess.run(["bash", *argv], capture_output=True, text=True, cwd=root, env={**base, **env},
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_bin_kvd_installs_with_the_stamp_so_bin_test_does_not_rebuild(checkout: Path) -> None:
    if not any((REPO / "kvd").rglob("*.so")):
        pytest.skip("no compiled build in this checkout to compare with")
    log = _fake_pip(checkout)
    assert _run(checkout, "bin/kvd", KVD_TEST_DRY_INSTALL="1").stdout.strip() == \
        "kvd install: needed: no install stamp in .venv"

    first = _run(checkout, "bin/kvd", "--version")  # the first `bin/kvd ...`: installs, then runs kvd
    assert first.stdout.startswith("kvd "), first.stdout
    installs = [line for line in log.read_text().splitlines() if " install " in f" {line} " and " -e " in line]
    assert len(installs) == 1 and installs[0].endswith("-e ."), installs
    # each step is said as it runs, with its time
    assert "kvd install: upgrade pip ..." in first.stderr and "build its compiled modules" in first.stderr
    assert re.search(r"done in \d+ s", first.stderr), first.stderr
    assert (checkout / ".venv" / ".kvd-install-stamp").exists()

    # then bin/test: no rebuild, only the test extra's packages (kvd's own install wrote the stamp)
    assert decision(checkout) == "kvd install: needed: the test extra (its packages only: the build is current)"
    # and bin/kvd again: nothing to do, and nothing said
    calls = log.read_text()
    again = _run(checkout, "bin/kvd", "--version")
    assert log.read_text() == calls and "kvd install" not in again.stderr


def test_a_stamp_with_the_test_extra_is_current_for_both(checkout: Path) -> None:
    stamp = checkout / ".venv" / ".kvd-install-stamp"
    stamp.write_text("# kvd install stamp: the build's inputs are older than this file; extras installed:\n"
                     "extra test\n")
    later = time.time() + 5
    os.utime(stamp, (later, later))
    if not any((REPO / "kvd").rglob("*.so")):
        pytest.skip("no compiled build in this checkout to compare with")
    assert decision(checkout) == "kvd install: up to date"
    assert _run(checkout, "bin/kvd", KVD_TEST_DRY_INSTALL="1").stdout.strip() == "kvd install: up to date"
