"""kvd._native: compiled data-path modules never run out of date; KVD_PURE_PYTHON brings back the source."""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvd import _native

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _touch(path: Path, mtime: float, text: str = "") -> None:
    path.write_text(text)
    os.utime(path, (mtime, mtime))


def _run(
    code: str, *, cwd: Path, env_extra: dict[str, str], pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != _native.ENV_VAR}
    env.update(env_extra)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(
    ("value", "pure"), [("", False), ("0", False), (" 0 ", False), ("1", True), ("yes", True)]
)
def test_pure_requested_reads_the_variable(value: str, pure: bool) -> None:
    assert _native.pure_requested({_native.ENV_VAR: value}) is pure
    assert _native.pure_requested({}) is False


def test_stale_modules_are_the_builds_older_than_their_source(tmp_path: Path) -> None:
    _touch(tmp_path / "fresh.py", 1000)
    _touch(tmp_path / f"fresh{SUFFIX}", 2000)
    _touch(tmp_path / "edited.py", 3000)
    _touch(tmp_path / f"edited{SUFFIX}", 2000)
    _touch(tmp_path / "unbuilt.py", 3000)
    assert _native.compiled_file(tmp_path, "fresh") == tmp_path / f"fresh{SUFFIX}"
    assert _native.compiled_file(tmp_path, "unbuilt") is None
    assert _native.stale_modules(tmp_path, ["fresh", "edited", "unbuilt"]) == ["edited"]


def test_stale_modules_work_below_subpackages(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    _touch(tmp_path / "sub" / "edited.py", 3000)
    _touch(tmp_path / "sub" / f"edited{SUFFIX}", 2000)
    _touch(tmp_path / "edited.py", 1000)  # a module of the same name one level up is another module
    assert _native.compiled_file(tmp_path, "sub.edited") == tmp_path / "sub" / f"edited{SUFFIX}"
    assert _native.compiled_file(tmp_path, "edited") is None
    assert _native.stale_modules(tmp_path, ["sub.edited", "edited"]) == ["sub.edited"]


def test_source_finder_answers_for_its_modules_only(tmp_path: Path) -> None:
    finder = _native.SourceFinder("pkg", tmp_path, ["a", "sub.b"])
    spec = finder.find_spec("pkg.a")
    assert spec is not None and spec.origin == str(tmp_path / "a.py")
    spec = finder.find_spec("pkg.sub.b")
    assert spec is not None and spec.origin == str(tmp_path / "sub" / "b.py")
    assert finder.find_spec("pkg.b") is None
    assert finder.find_spec("pkg.sub.a") is None
    assert finder.find_spec("other.a") is None
    assert finder.find_spec("pkgx.a") is None


def test_pure_python_variable_loads_every_listed_module_from_source() -> None:
    root = _native.PACKAGE_DIR.parent
    out = _run(
        """
        import importlib
        from kvd import _native
        for name in _native.COMPILED:
            importlib.import_module("kvd." + name)
        print(_native.compiled_modules())
        import kvd.wire.protocol
        print(kvd.wire.protocol.__file__)
        """,
        cwd=root, env_extra={_native.ENV_VAR: "1"},
    )
    assert out.returncode == 0, out.stderr
    listed, proto = out.stdout.split("\n")[:2]
    assert listed == "[]"
    assert proto == str(_native.PACKAGE_DIR / "wire" / "protocol.py")


def test_default_import_uses_a_current_build_where_there_is_one() -> None:
    root = _native.PACKAGE_DIR.parent
    out = _run("import kvd.wire.routing, sys; print(kvd.wire.routing.__file__)", cwd=root, env_extra={})
    assert out.returncode == 0, out.stderr
    built = _native.compiled_file(_native.PACKAGE_DIR, "wire.routing")
    current = built is not None and not _native.stale_modules(_native.PACKAGE_DIR, ["wire.routing"])
    assert out.stdout.strip() == str(built if current else _native.PACKAGE_DIR / "wire" / "routing.py")


def test_a_stale_build_in_a_checkout_is_skipped_with_a_warning(tmp_path: Path) -> None:
    """An edited source next to an older build (here a file that is not even a loadable module: loading it would
    fail) runs from source, and says so once; an untouched module keeps its build."""
    pkg = tmp_path / "kvd"
    shutil.copytree(_native.PACKAGE_DIR, pkg, ignore=shutil.ignore_patterns("*.so", "*.pyd", "*.c", "__pycache__"))
    (tmp_path / ".git").mkdir()
    _touch(pkg / "wire" / f"routing{SUFFIX}", 1000, "not a shared object")
    os.utime(pkg / "wire" / "routing.py", (2000, 2000))
    out = _run(
        """
        import kvd.wire.routing
        print(kvd.wire.routing.__file__)
        print(kvd.wire.routing.Router.__name__)
        """,
        cwd=tmp_path, env_extra={}, pythonpath=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [str(pkg / "wire" / "routing.py"), "Router"]
    assert out.stderr.count("older than the source") == 1
    assert "routing" in out.stderr

    # the same stale file outside a checkout (an installed package): no mtime games, the build is trusted
    shutil.rmtree(tmp_path / ".git")
    out = _run("import kvd.wire.routing", cwd=tmp_path, env_extra={}, pythonpath=tmp_path)
    assert out.returncode != 0 and "older than the source" not in out.stderr
