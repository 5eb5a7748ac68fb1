"""Every ``KVD_*`` variable that kvd itself or its scripts read is accepted by the settings loader. Unknown
``KVD_*`` variables are errors (a typo must not pass silently), so one that kvd documents but the loader does not
know stops every `kvd` command: ``KVD_PURE_PYTHON=1 kvd up`` failed with "unknown environment variable
KVD_PURE_PYTHON", and so did `kvd` inside `KVD_ENGINES=0 bin/test`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvd.config import load_config
from kvd.config.settings import ENV_PREFIX, SETTINGS

pytestmark = pytest.mark.backend_independent  # settings: no kernel, no compiled module

REPO = Path(__file__).resolve().parents[2]
SECTIONS = {s.section.upper() for s in SETTINGS.values()}


def _read_by_kvd() -> set[str]:
    """``KVD_*`` names in kvd's package and its scripts that are not settings (``KVD_<SECTION>_<KEY>``)."""
    sources = [*(REPO / "kvd").rglob("*.py"), *(p for p in (REPO / "bin").iterdir() if p.is_file())]
    names: set[str] = set()
    for path in sources:
        names |= set(re.findall(r"\bKVD_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    return {n for n in names if n.split("_")[1] not in SECTIONS and n != "KVD_SECTION_KEY"}


def test_the_scan_finds_the_variables_kvd_reads() -> None:
    found = _read_by_kvd()
    assert {"KVD_KERNELS", "KVD_PURE_PYTHON", "KVD_CONFIG", "KVD_REINSTALL"} <= found, found


@pytest.mark.parametrize("name", sorted(_read_by_kvd()))
def test_a_variable_kvd_reads_is_not_an_unknown_setting(name: str, tmp_path: Path) -> None:
    value = str(tmp_path / "x.toml") if name == "KVD_CONFIG" else "1"
    if name == "KVD_CONFIG":
        (tmp_path / "x.toml").write_text("")
    config = load_config(env={name: value})
    assert config.cluster.shards == SETTINGS["cluster.shards"].default


def test_a_misspelt_setting_is_still_an_error() -> None:
    from kvd.errors import ConfigError

    with pytest.raises(ConfigError, match="KVD_CLUSTER_SHARD "):
        load_config(env={f"{ENV_PREFIX}CLUSTER_SHARD": "3"})
