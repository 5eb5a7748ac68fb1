"""A broken engine venv must not pass as a run of skips: with ``--require-engines`` (what bin/test gives the engine
stage under CI=true) an engine test that would skip fails instead, whether its module skips itself at import
or a test skips on its own; without the option they stay skips. Run here in the main venv, which has no engine:
exactly a .venv-engines whose engines are missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.backend_independent  # pytest's verdict on skips; no kvd code runs

REPO = Path(__file__).resolve().parents[2]
MODULE_SKIP = "tests/engines/test_transformers.py"  # skips itself at import without torch
TEST_SKIP = "tests/engines/test_glue.py::test_block_io_reads_keys_transposed_and_round_trips"  # skips in a fixture


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=110)


@pytest.fixture(autouse=True)
def _no_engines() -> None:
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is importable here: the engine tests would run, not skip")


@pytest.mark.timeout(120)
def test_without_the_option_missing_engines_are_skips() -> None:
    result = run(MODULE_SKIP, TEST_SKIP)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 skipped" in result.stdout, result.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", [MODULE_SKIP, TEST_SKIP], ids=["module", "test"])
def test_with_require_engines_a_missing_engine_fails(target: str) -> None:
    result = run("--require-engines", target)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "--require-engines" in result.stdout and "needs torch" in result.stdout, result.stdout
    assert "skipped" not in result.stdout.splitlines()[-1], result.stdout
