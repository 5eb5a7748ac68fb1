"""bin/test's second pass (``KVD_KERNELS=reference KVD_PURE_PYTHON=1``) runs only the tests that are not marked
``backend_independent`` (tests/conftest.py). The mark is an exception a test module opts into; these tests keep
it honest: a marked module touches nothing whose behaviour the second pass changes (the kernels and the modules
kvd also builds compiled, :data:`kvd._native.COMPILED`), and the option leaves out exactly the marked tests."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvd import _native

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

pytestmark = pytest.mark.backend_independent  # it reads test files and collects; it runs no kvd code

# What the second pass runs differently: the kernel dispatch and every module with a compiled build, with the
# packages and public names that reach them.
BACKEND_MODULES = (
    "kvd.codec", "kvd.kernels", "kvd.pages", "kvd.protocol", "kvd.store", "kvd.wire", "kvd.client",
    "kvd.evaluate", "kvd.integrations", *(f"kvd.{name}" for name in _native.COMPILED),
)

# Marked modules that import the data path only to drive, or stand in for, a kvd whose code under test is not the
# data path: processes run without the second pass's KVD_PURE_PYTHON (test_cli.ENV drops it), or the control
# plane under Ray: the reason for each.
DRIVERS_ONLY = {
    "test_cli_ping.py": "a TopologyServer for the `kvd ping` subprocess to find",
    "test_two_nodes.py": "a client round trip through the kvd that `kvd up` started on two Ray nodes",
    "test_disk_tier.py": "client round trips through the kvd that `kvd up --disk` started, its shard killed and "
                         "the kvd restarted (the disk tier's own code runs in both passes: test_store_disk.py)",
    # Ray actors under test: the coordinator, membership, deployment and restarts (kvd.cluster, never compiled).
    # Their shards run the compiled data path, which the second pass covers where it is the code under test
    # (tests/unit, test_wire*.py, test_shard_lifecycle.py, test_pressure.py); here it only carries the traffic.
    "test_cluster.py": "clients and raw shard requests driving a Ray deployment: spread, levels, kills",
    "test_lifecycle.py": "clients driving a Ray deployment through shard and coordinator restarts",
    "test_cluster_calibration.py": "a client giving a Ray deployment a calibration through shard and coordinator "
                                   "restarts, and `kvd calibrate` / `kvd status` subprocesses",
    "test_priority.py": "a Ray deployment whose actors' thread priorities are read from /proc",
}


def _marked(tree: ast.Module) -> bool:
    """Whether the module-level ``pytestmark`` names ``backend_independent``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            return "backend_independent" in ast.unparse(node.value)
    return False


def _marked_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """The test functions decorated with the mark themselves."""
    return [node for node in tree.body if isinstance(node, ast.FunctionDef)
            and any("backend_independent" in ast.unparse(d) for d in node.decorator_list)]


def _imports(path: Path, seen: set[Path] | None = None, within: ast.AST | None = None) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (or of ``within`` and the module's top level), and
    those of the sibling test modules it imports (``from test_cli import ...``)."""
    seen = set() if seen is None else seen
    seen.add(path)
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    nodes = list(ast.walk(tree)) if within is None else [*tree.body, *ast.walk(within)]
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    for name in list(names):
        sibling = path.with_name(f"{name}.py")
        if "." not in name and sibling.exists() and sibling not in seen:
            names |= _imports(sibling, seen)
    return names


def _marked_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if _marked(ast.parse(p.read_text())))


def test_a_test_marked_alone_imports_none_of_the_backend_either() -> None:
    wrong = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for fn in _marked_functions(ast.parse(path.read_text())):
            hits = sorted(n for n in _imports(path, within=fn) if n.startswith(BACKEND_MODULES))
            if hits:
                wrong[f"{path.relative_to(REPO)}::{fn.name}"] = hits
    assert wrong == {}, f"marked backend_independent but import what the second pass changes: {wrong}"


def test_some_modules_are_marked_and_none_of_them_imports_the_backend() -> None:
    marked = _marked_modules()
    assert marked, "the scan found no marked module: is the mark still spelt backend_independent?"
    wrong = {}
    for path in marked:
        hits = sorted(n for n in _imports(path) if n.startswith(BACKEND_MODULES))
        if hits and path.name not in DRIVERS_ONLY:
            wrong[str(path.relative_to(REPO))] = hits
    assert wrong == {}, f"marked backend_independent but import what the second pass changes: {wrong}"


def test_the_kernel_and_wire_tests_are_not_marked() -> None:
    marked = {p.name for p in _marked_modules()}
    for name in ("test_kernels.py", "test_pages.py", "test_protocol.py", "test_store.py", "test_wire.py",
                 "test_native.py", "test_pressure.py"):
        assert name not in marked


@pytest.mark.timeout(120)
def test_only_backend_dependent_leaves_out_exactly_the_marked_tests() -> None:
    """Collection with and without the option, over one marked and one unmarked module."""
    marked = _marked_modules()[0]
    unmarked = TESTS / "unit" / "test_pages.py"

    def collected(*extra: str) -> set[str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra,
             str(marked), str(unmarked)], capture_output=True, text=True, cwd=REPO, env=env, timeout=110)
        assert result.returncode == 0, result.stdout + result.stderr
        return {line.split("::")[0] for line in result.stdout.splitlines() if "::" in line}

    rel_marked, rel_unmarked = (str(p.relative_to(REPO)) for p in (marked, unmarked))
    assert collected() == {rel_marked, rel_unmarked}
    assert collected("--only-backend-dependent") == {rel_unmarked}
