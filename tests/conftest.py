"""Options of the whole suite, used by bin/test.

``--only-backend-dependent`` (bin/test's second pass, ``KVD_KERNELS=reference KVD_PURE_PYTHON=1``): runs only the
tests whose code under test is the kernels or the compiled modules, i.e. every test but those marked
``backend_independent`` (the settings, the policy, the command line, and the control plane under Ray, whose shards'
data path the unmarked tests cover). The marker is the exception a module opts into, with the reason in its
docstring or next to the mark: a new kernel, codec, store or wire test runs on both engines without anyone
remembering to.

``--require-engines`` (bin/test's engine stage under CI): a test of tests/engines that skips (an engine or the
model missing: a broken .venv-engines) fails instead, so the run cannot pass without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ENGINES_DIR = Path(__file__).resolve().parent / "engines"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvd")
    group.addoption("--only-backend-dependent", action="store_true",
                    help="deselect the tests marked backend_independent (bin/test's second pass)")
    group.addoption("--require-engines", action="store_true",
                    help="an engine test that skips fails instead (bin/test under CI)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "backend_independent: the code under test is neither the kernels nor a compiled module, so the outcome "
        "cannot depend on them (say why); bin/test's second pass (--only-backend-dependent) leaves it out",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("only_backend_dependent"):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("backend_independent") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _in_engines(path: Any) -> bool:
    return path is not None and ENGINES_DIR in Path(str(path)).resolve().parents


def _required(config: pytest.Config, path: Any) -> bool:
    return bool(config.getoption("require_engines")) and _in_engines(path)


def _reason(longrepr: Any) -> str:
    """The reason of a skip (pytest keeps ``(path, line, "Skipped: reason")``)."""
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _required(collector.config, getattr(collector, "path", None)):
        report.outcome = "failed"  # a module that skipped itself: an engine is missing
        report.longrepr = f"--require-engines: {collector.nodeid} would skip. {_reason(report.longrepr)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and _required(item.config, item.path):
        report.outcome = "failed"
        report.longrepr = f"--require-engines: {item.nodeid} would skip. {_reason(report.longrepr)}"
