"""The package's shape holds: no import circles, a pure core that imports neither ray nor zmq (nor a shell), and
every public name that README.md, docs/ and BENCHMARKS.md tell users to import still importable.

The graph is read from the source (every ``import`` statement, those inside functions too: a lazy import is
still a dependency), so the rules hold for code paths a test run may never execute.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import kvd

PACKAGE_DIR = Path(kvd.__file__).resolve().parent

# The pure core: computation and state with no I/O framework (docs/design.md, "Layout").
CORE_PREFIXES = ("kvd.codec", "kvd.store", "kvd.config")
CORE_MODULES = {
    "kvd", "kvd._native", "kvd.errors", "kvd.evaluate", "kvd.calibration", "kvd.policy", "kvd.pages",
    "kvd.kernels", "kvd.protocol",
    "kvd.wire", "kvd.wire.protocol", "kvd.wire.peek", "kvd.wire.messages", "kvd.wire.schema", "kvd.wire.routing",
    "kvd.cluster", "kvd.cluster.membership", "kvd.cluster.registry",
}
FORBIDDEN_IN_CORE = {"ray", "zmq"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    base = PACKAGE_DIR / rel
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(kvd modules, top-level names of other packages) that the file at ``path`` imports anywhere."""
    module = _module_name(path)
    is_pkg = path.name == "__init__.py"
    inner, outer = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [(source, a.name) for a in node.names]
        else:
            continue
        for source, attr in names:
            if source.split(".")[0] != "kvd":
                outer.add(source.split(".")[0])
                continue
            # `from kvd.codec import pages` depends on the module kvd.codec.pages, not only on kvd.codec
            target = f"{source}.{attr}" if attr and _is_module(f"{source}.{attr}") else source
            if target != module:
                inner.add(target)
    return inner, outer


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    inner, outer = {}, {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = _module_name(path)
        inner[name], outer[name] = _imports(path)
    return inner, outer


GRAPH, EXTERNAL = _graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(GRAPH.get(m, ()))
    return seen


def _is_core(name: str) -> bool:
    return name in CORE_MODULES or any(name == p or name.startswith(p + ".") for p in CORE_PREFIXES)


CORE = sorted(m for m in GRAPH if _is_core(m))


def test_the_graph_was_read() -> None:
    # a walker that found nothing would pass every rule below
    assert len(GRAPH) > 40
    assert "kvd.codec.pages" in GRAPH["kvd.store.pool"]
    assert "kvd.store.core" in GRAPH["kvd.wire.server.shard"]
    assert "zmq" in EXTERNAL["kvd.wire.server.loop"] and "ray" in EXTERNAL["kvd.cluster.deploy"]


def test_no_import_circles() -> None:
    assert _cycles(GRAPH) == []


# Layers that may not reach up into the command line: the control plane (and everything below it) is what the
# CLI drives, never the reverse (a deployment helper that imports kvd.cli drags the parser into every actor).
BELOW_THE_CLI = ("kvd.cluster", "kvd.client", "kvd.wire", "kvd.store", "kvd.codec", "kvd.config",
                 "kvd.integrations")


@pytest.mark.parametrize("package", BELOW_THE_CLI)
def test_nothing_below_the_command_line_imports_it(package: str) -> None:
    modules = [m for m in GRAPH if m == package or m.startswith(package + ".")]
    assert modules, package
    up = {m: sorted(t for t in GRAPH[m] if t == "kvd.cli" or t.startswith("kvd.cli.")) for m in modules}
    assert {m: targets for m, targets in up.items() if targets} == {}


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", CORE)
def test_the_core_imports_neither_ray_nor_zmq_nor_a_shell(module: str) -> None:
    reached = _closure(module)
    shells = sorted(m for m in reached if not _is_core(m))
    assert shells == [], f"{module} reaches the shells {shells}"
    forbidden = sorted({name for m in reached for name in EXTERNAL.get(m, ()) if name in FORBIDDEN_IN_CORE})
    assert forbidden == [], f"{module} imports {forbidden}"


def test_importing_the_core_loads_neither_ray_nor_zmq() -> None:
    """The same rule at run time, in a fresh interpreter (nothing else imported first)."""
    code = (
        "import importlib, sys\n"
        f"for name in {CORE!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in ('ray', 'zmq', 'torch', 'vllm', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# Every name README.md, docs/ and BENCHMARKS.md tell users to import, as they write it.
PUBLIC = {
    "kvd": ["KvdError", "__version__"],
    "kvd.pages": ["encode", "decode", "decode_into", "encode_into", "nbytes", "header", "assemble",
                  "assemble_into", "GROUPS", "LEVELS", "PageHeader"],
    "kvd.kernels": ["BACKEND", "available"],
    "kvd.store": ["Store", "PACK_FRAME_BYTES"],
    "kvd.client": ["Client", "AsyncClient"],
    "kvd.policy": ["Level", "Policy", "PolicyConfig"],
    "kvd.errors": ["KvdError", "OutOfMemory", "UnknownSequence", "NonFiniteError", "CorruptPage"],
    "kvd.evaluate": ["attention", "eps_o", "load_sample", "sample_path"],
    "kvd.protocol": ["encode_request", "decode_reply", "GetRequest", "Limits", "owner", "PROTOCOL_VERSION"],
    "kvd.cli": ["main"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_keep_working(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(mod, name)]
    assert missing == []


def test_public_facades_are_the_real_objects() -> None:
    from kvd import kernels, pages
    from kvd.codec import assemble
    from kvd.codec import kernels as codec_kernels
    from kvd.codec import pages as codec_pages
    from kvd.store import Store
    from kvd.store.core import Store as CoreStore

    assert pages.encode is codec_pages.encode and pages.assemble is assemble.assemble
    assert kernels.BACKEND == codec_kernels.BACKEND
    assert Store is CoreStore
