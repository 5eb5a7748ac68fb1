"""kvd settings: frozen dataclasses, loaded with the precedence defaults < TOML file < ``KVD_*`` env < flags.

Theory of operation
-------------------
Every setting lives in one of four sections, each a frozen, slotted dataclass: :class:`StoreSettings`
(``[store]``: one shard's page store), :class:`PolicySettings` (``[policy]``: the pressure policy),
:class:`ClusterSettings` (``[cluster]``: Ray, ports, shards, memory) and :class:`CurveSettings` (``[curve]``:
ZeroMQ CURVE key files). A setting has one name used everywhere: ``section.key`` in code and on the command
line (``--set cluster.shards=4``), ``key = value`` under ``[section]`` in TOML, and ``KVD_SECTION_KEY`` in the
environment (``KVD_CLUSTER_SHARDS=4``). Each field carries its parser and help text in its dataclass
metadata, so parsing, validation, ``--help`` and error messages all come from one table (:data:`SETTINGS`).

:func:`load_config` layers the sources. Values from TOML are typed (an int stays an int); values from the
environment are strings and go through the same parser. Unknown keys, in TOML or as ``KVD_*`` variables, are
errors: :class:`~kvd.errors.ConfigError` naming the key and listing the valid ones. The ``KVD_*`` variables
that belong to other parts of kvd are left alone here (:data:`FOREIGN_ENV`): ``KVD_KERNELS`` (kernel backend,
read by kvd.kernels), ``KVD_PURE_PYTHON`` (run the data path from source, kvd._native), ``KVD_MODEL_CACHE``
(kvd.integrations' model folder), ``KVD_SAMPLE`` (path of the real-KV sample used by tests and benches) and
those of the scripts in bin/: ``KVD_PYTHON``, ``KVD_REINSTALL``, ``KVD_TEST_DRY_INSTALL``, ``KVD_TEST_WORKERS``,
``KVD_ENGINES``, ``KVD_ENGINES_VENV``. ``KVD_CONFIG`` names the TOML file when no path is given explicitly.

This module is the only place in kvd that reads configuration from the environment or from files; it also
keeps the small run notes `kvd up` leaves for `kvd status` and `kvd down` (:func:`write_run_file`). The value
parsers themselves (sizes, bounded numbers, choices, ...) are pure and live in :mod:`kvd.config.parsers`;
:func:`parse_size` and :func:`format_size` are re-exported from here.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvd.config.parsers import (
    GIB,
    KIB,
    MIB,
    Parser,
    boolean,
    choice,
    format_size,
    identifier,
    int_tuple,
    integer_in,
    number_in,
    optional,
    parse_size,
    port_range,
    size_at_least,
    text_value,
)
from kvd.errors import ConfigError
from kvd.policy import PROFILES, Level, PolicyConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - kvd runs on 3.11 here; 3.10 needs the tomli backport
    import tomli as tomllib

__all__ = [
    "Config",
    "StoreSettings",
    "PolicySettings",
    "ClusterSettings",
    "CurveSettings",
    "SETTINGS",
    "load_config",
    "parse_size",
    "format_size",
    "default_memory_bytes",
    "env_name",
    "describe",
    "run_file_path",
    "write_run_file",
    "claim_run_file",
    "read_run_file",
    "remove_run_file",
]

ENV_PREFIX = "KVD_"
CONFIG_ENV = "KVD_CONFIG"
# KVD_* variables owned by other modules and by the scripts in bin/: never reported as unknown settings (a `kvd`
# started with one of them set, e.g. KVD_PURE_PYTHON=1 or inside `KVD_ENGINES=0 bin/test`, must still run).
FOREIGN_ENV = frozenset({
    "KVD_KERNELS", "KVD_PURE_PYTHON", "KVD_MODEL_CACHE", "KVD_SAMPLE", CONFIG_ENV,
    "KVD_PYTHON", "KVD_REINSTALL", "KVD_TEST_DRY_INSTALL", "KVD_TEST_WORKERS", "KVD_ENGINES", "KVD_ENGINES_VENV",
})

# Default total memory of `kvd up`: a quarter of this machine's memory, capped, so a laptop keeps room for the
# inference process itself; at least 64 MiB so that tiny containers still start.
DEFAULT_MEMORY_FRACTION = 0.25
DEFAULT_MEMORY_CAP_BYTES = 8 * GIB
DEFAULT_MEMORY_FLOOR_BYTES = 64 * MIB
DEFAULT_PORT = 7070

# ------------------------------------------------------------------------------------------------ parsers
# The generic parsers are in kvd.config.parsers; these two stay here: one needs the policy's levels, the other
# expands "~" (which reads $HOME, and only this module reads the environment).


def _level_tag(name: str, value: object) -> str:
    tags = [level.tag for level in Level]
    return choice(*tags)(name, value)


def _path(name: str, value: object) -> str | None:
    text = optional(text_value)(name, value)
    return None if text is None else os.path.expanduser(text)


def _setting(default: Any, parse: Parser, doc: str) -> Any:
    return field(default=default, metadata={"parse": parse, "doc": doc})


# ----------------------------------------------------------------------------------------------- sections


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreSettings:
    """``[store]``: one shard's page store. ``None`` means "the Store's own default" (chosen by measurement)."""

    capacity_bytes: int | None = _setting(
        None,
        optional(size_at_least(MIB)),
        "bytes of KV memory per shard (default: cluster.memory_bytes / cluster.shards)",
    )
    page_tokens: int | None = _setting(
        None, optional(integer_in(1, 65535)), "tokens per page (default: the store's)"
    )
    window_tokens: int | None = _setting(
        None, optional(integer_in(0)), "recent tokens kept at fp16 per sequence (default: the store's)"
    )
    sink_tokens: int | None = _setting(
        None,
        optional(integer_in(0)),
        "first tokens per sequence, attention sinks, kept one level less compact: fp16, 8-bit at q4 (default: the "
        "store's)",
    )
    sink_raw: bool = _setting(False, boolean, "keep the sink tokens' pages at fp16 at q4 too")
    raw_layers: tuple[int, ...] = _setting((), int_tuple, "layers never quantized, e.g. [0, 31]")
    raw_heads: tuple[int, ...] = _setting((), int_tuple, "KV heads never quantized")
    require_calibration: bool = _setting(
        False, boolean, "a namespace is compressed only with a calibration (kvd calibrate; kvd.store.calibrated)"
    )
    allow_raw_fallback: bool = _setting(
        True, boolean, "with require_calibration: an uncalibrated namespace's pages stay fp16 (false: compressed "
        "with the default protection, and it reports that it needs a calibration)"
    )
    eviction: str = _setting(
        "lru", choice("lru", "none"), "when full at the most compact level: lru = evict least recently used "
        "sequences, none = refuse appends with OutOfMemory"
    )
    eviction_order: str = _setting(
        "prefix", choice("prefix", "recency"), "which sequences go first: prefix = what no lookup can reach, then "
        "chain tails, deepest in their prompt first, then least recently used (kvd.store.chains); recency = "
        "least recently used alone"
    )
    eight_bit: str = _setting(
        "q8", choice("q8", "fp8_e4m3", "fp8_e5m2"), "the 8-bit rung: q8 (int8, most accurate), fp8_e4m3, fp8_e5m2"
    )
    compact_budget_bytes: int = _setting(
        8 * MIB, size_at_least(4 * KIB), "bytes re-encoded per compaction step between requests after a level rise"
    )
    warm_cache_bytes: int = _setting(
        256 * MIB, size_at_least(0), "freed result buffers of large gets kept warm for reuse, per shard process "
        "(outside capacity_bytes; 0 turns it off)"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySettings:
    """``[policy]``: the pressure policy. Numbers left at ``None`` come from ``profile``."""

    profile: str = _setting("default", choice(*PROFILES), f"policy profile: {', '.join(PROFILES)}")
    q8_threshold: float | None = _setting(
        None, optional(number_in(0.0, 1.0)), "pressure for the 8-bit rung (0.80)"
    )
    q4_threshold: float | None = _setting(None, optional(number_in(0.0, 1.0)), "pressure for q4 (0.95)")
    hysteresis: float | None = _setting(
        None, optional(number_in(0.0, 1.0)), "margin below a threshold before stepping down (0.05)"
    )
    ewma_alpha: float | None = _setting(
        None, optional(number_in(0.0, 1.0)), "EWMA weight of the newest sample (0.20)"
    )
    min_level: str | None = _setting(None, optional(_level_tag), "least compact level allowed (fp16)")
    max_level: str | None = _setting(None, optional(_level_tag), "most compact level allowed (q4)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSettings:
    """``[cluster]``: Ray, shards, memory, ports."""

    address: str = _setting(
        "",
        text_value,
        'Ray cluster to join: "" starts an embedded local Ray; "auto" joins the cluster running on '
        'this machine; or "ray://host:10001" / "host:6379"',
    )
    namespace: str = _setting("kvd", identifier, "Ray namespace of the kvd actors (run several kvds side by side)")
    shards: int = _setting(2, integer_in(1, 4096), "number of shard actors")
    memory_bytes: int = _setting(
        None,
        size_at_least(MIB),
        "total KV memory over all shards (default: 25% of this machine's memory, at most 8 GiB)",
    )
    report_interval_s: float = _setting(
        0.5, number_in(0.0, 60.0, open_low=True), "seconds between a shard's pressure reports"
    )
    ready_grace_s: float | None = _setting(
        None, optional(number_in(0.0, 3600.0, open_low=True)), "seconds a coordinator started without a "
        "persisted topology (a first start, or its state lost) waits for every shard to register before it "
        "publishes a topology without the missing ones (clients would route a missing shard's sequences "
        "elsewhere); unset: 3 x a shard's stale time, max(3 x report_interval_s, 1 s)"
    )
    pressure_mode: str = _setting(
        "max", choice("sum", "max"), "cluster pressure: max = the fullest shard (a full shard evicts whatever the "
        "others hold), sum = total used / total capacity"
    )
    host: str = _setting(
        "auto", text_value, 'address the coordinator and shards bind: "auto" = 127.0.0.1 on an embedded Ray, '
        "the node's IP on a cluster"
    )
    port: int = _setting(DEFAULT_PORT, integer_in(0, 65535), "coordinator's client port (0 = any free port)")
    shard_ports: str = _setting(
        "", port_range, 'ports shards bind, e.g. "7500-7599" for a firewall ("" = any free port)'
    )
    metrics_port: int = _setting(
        0, integer_in(0, 65535), "Prometheus metrics port of `kvd up` (0 = off); with --detach served on the Ray "
        "head"
    )
    shard_cpus: float = _setting(1.0, number_in(0.0, 1024.0), "logical CPUs Ray reserves per shard (0 = none)")
    disk_bytes: int = _setting(
        0, size_at_least(MIB, or_zero=True), "total disk over all shards for the disk tier: when memory is full "
        "at the most compact level, whole sequences move to disk instead of being forgotten, and a restarted "
        "shard serves them (0 = off, the default of `kvd up`: a quick start writes nothing to disk)"
    )
    disk_path: str = _setting(
        "~/.cache/kvd", text_value, "directory of the disk tier on each node (a local disk); shard files go under "
        "DIR/<namespace>/<shard id>, and a kvd started again on the same DIR serves what they hold"
    )
    shard_socket_buffer_bytes: int | None = _setting(
        None, optional(size_at_least(4 * KIB, or_zero=True)), "TCP send and receive buffer of each connection to "
        "a shard; unset: 256 KiB where shards bind a loopback address (kvd up's default), else the system's "
        "autotuned buffers; 0: always the system's. Smaller buffers cut how long a small request waits behind "
        "other clients' MiB transfers, but cap one connection at about buffer / network round trip, and make "
        "MiB appends and lone MiB reads 20-40% slower (docs/design.md)"
    )
    max_namespaces: int = _setting(
        1024, integer_in(1, 1 << 20), "namespaces the cluster holds at most (one per model KV layout, never "
        "removed; each costs about 10 KB in the coordinator and 6 KB in every shard): a register past it is "
        "refused with InvalidArgument"
    )
    shard_reply_bytes: int | None = _setting(
        None, optional(size_at_least(MIB)), "replies a shard holds for peers that have not read them, all peers "
        "together; over it, replies to peers that do not read are dropped. Unset: 4 x the shard's memory "
        "(its largest reply: a whole store at q4 read back as fp16), at least 64 MiB, at most 2 x the protocol's "
        "max_message_bytes (1 GiB)"
    )
    num_cpus: int | None = _setting(
        None,
        optional(integer_in(1, 1 << 16)),
        "CPUs of an embedded Ray (default: this machine's, at least enough for the shards)",
    )
    ray_timeout_s: float = _setting(10.0, number_in(0.0, 3600.0, open_low=True), "timeout of every Ray call")

    def __post_init__(self) -> None:
        if self.memory_bytes is None:
            object.__setattr__(self, "memory_bytes", default_memory_bytes())

    @property
    def shard_port_range(self) -> tuple[int, int] | None:
        """``(low, high)`` inclusive, or None for any free port."""
        if not self.shard_ports:
            return None
        low, high = self.shard_ports.split("-")
        return int(low), int(high)


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveSettings:
    """``[curve]``: ZeroMQ CURVE encryption (``kvd keygen DIR`` writes the files). Off unless a key is set."""

    server_secret_key: str | None = _setting(
        None, _path, "servers: the server key pair file (server.key_secret); enables CURVE"
    )
    authorized_keys: str | None = _setting(
        None, _path, "servers: directory of allowed client public keys (*.key); unset = any client with the "
        "server's public key"
    )
    client_secret_key: str | None = _setting(None, _path, "clients: this client's key pair (client.key_secret)")
    server_public_key: str | None = _setting(None, _path, "clients: the server's public key (server.key)")


_SECTIONS: dict[str, type] = {
    "store": StoreSettings,
    "policy": PolicySettings,
    "cluster": ClusterSettings,
    "curve": CurveSettings,
}


@dataclass(frozen=True, slots=True)
class Setting:
    """One entry of :data:`SETTINGS`: where it lives, how to parse it, what it means."""

    section: str
    key: str
    parse: Parser
    doc: str
    default: Any

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def env(self) -> str:
        return env_name(self.section, self.key)


SETTINGS: dict[str, Setting] = {
    f"{section}.{f.name}": Setting(section, f.name, f.metadata["parse"], f.metadata["doc"], f.default)
    for section, cls in _SECTIONS.items()
    for f in dataclasses.fields(cls)
}


def env_name(section: str, key: str) -> str:
    """The environment variable of a setting: ``KVD_CLUSTER_SHARDS`` for ``cluster.shards``."""
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


_BY_ENV = {s.env: s for s in SETTINGS.values()}


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """All kvd settings. Build with :func:`load_config`; ``Config()`` is the built-in defaults."""

    store: StoreSettings = field(default_factory=StoreSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    curve: CurveSettings = field(default_factory=CurveSettings)
    source: tuple[str, ...] = ()  # where values came from, for `kvd up` to print ("file kvd.toml", "env", ...)

    def __post_init__(self) -> None:
        self.policy_config()  # cross-field checks (q4 >= q8, min <= max) surface at load time
        if self.store.capacity_bytes is None and self.shard_capacity_bytes < MIB:
            raise ConfigError(
                f"cluster.memory_bytes ({format_size(self.cluster.memory_bytes)}) over {self.cluster.shards} "
                "shards gives less than 1 MiB per shard"
            )

    @property
    def shard_capacity_bytes(self) -> int:
        """Bytes of KV memory each shard's Store gets."""
        if self.store.capacity_bytes is not None:
            return self.store.capacity_bytes
        return self.cluster.memory_bytes // self.cluster.shards

    @property
    def shard_disk_bytes(self) -> int:
        """Bytes of disk each shard's disk tier gets (0: no disk tier)."""
        return self.cluster.disk_bytes // self.cluster.shards

    def shard_disk_path(self, shard_id: str) -> str:
        """The directory of one shard's disk tier."""
        return os.path.join(os.path.expanduser(self.cluster.disk_path), self.cluster.namespace, shard_id)

    def policy_config(self) -> PolicyConfig:
        """The :class:`PolicyConfig`: the profile, then any explicit numbers; the 8-bit rung from the store."""
        base = PolicyConfig.profile(self.policy.profile)
        changes: dict[str, Any] = {}
        for name in ("q8_threshold", "q4_threshold", "hysteresis", "ewma_alpha", "min_level", "max_level"):
            value = getattr(self.policy, name)
            if value is not None:
                changes[name] = value
        changes["eight_bit"] = Level.Q8 if self.store.eight_bit == "q8" else Level.FP8
        try:
            return dataclasses.replace(base, **changes)
        except ConfigError as exc:
            raise ConfigError(f"[policy] {exc}") from None

    def store_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Store(shard_capacity_bytes, **kwargs)``; unset options are left out."""
        s = self.store
        out: dict[str, Any] = {
            "raw_layers": s.raw_layers,
            "raw_heads": s.raw_heads,
            "eviction": s.eviction,
            "eviction_order": s.eviction_order,
            "eight_bit": s.eight_bit,
            "sink_raw": s.sink_raw,
            "require_calibration": s.require_calibration,
            "allow_raw_fallback": s.allow_raw_fallback,
            "max_level": self.policy_config().max_level.tag,  # how far an append that does not fit may compress
        }
        for name in ("page_tokens", "window_tokens", "sink_tokens"):
            if getattr(s, name) is not None:
                out[name] = getattr(s, name)
        return out

    def with_values(self, values: Mapping[str, Any], *, source: str = "overrides") -> Config:
        """A copy with ``{"section.key": value}`` applied (values parsed as from TOML or env)."""
        return _apply(self, values, source=source)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}``, loadable again with :meth:`with_values` (tuples become lists)."""
        out: dict[str, dict[str, Any]] = {}
        for section in _SECTIONS:
            obj = getattr(self, section)
            out[section] = {
                f.name: list(v) if isinstance(v := getattr(obj, f.name), tuple) else v
                for f in dataclasses.fields(obj)
            }
        return out


# ---------------------------------------------------------------------------------------------- loading


def _setting_for(dotted: str) -> Setting:
    setting = SETTINGS.get(dotted)
    if setting is None:
        section = dotted.split(".", 1)[0]
        valid = [k for k in SETTINGS if k.startswith(section + ".")] or list(SETTINGS)
        close = difflib.get_close_matches(dotted, list(SETTINGS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown setting {dotted!r}{hint}; valid: {', '.join(valid)}")
    return setting


def _apply(config: Config, values: Mapping[str, Any], *, source: str) -> Config:
    if not values:
        return config
    per_section: dict[str, dict[str, Any]] = {}
    for dotted, raw in values.items():
        setting = _setting_for(dotted)
        try:
            parsed = setting.parse(setting.dotted, raw)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from {source})") from None
        per_section.setdefault(setting.section, {})[setting.key] = parsed
    sections = {name: getattr(config, name) for name in _SECTIONS}
    for name, changes in per_section.items():
        sections[name] = dataclasses.replace(sections[name], **changes)
    return Config(**sections, source=(*config.source, source))


def _flatten_toml(data: Mapping[str, Any], path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, table in data.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{path}: unknown section [{section}]; valid sections: {', '.join(f'[{s}]' for s in _SECTIONS)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}]), got {table!r}")
        for key, value in table.items():
            dotted = f"{section}.{key}"
            if dotted not in SETTINGS:
                valid = [k.split(".", 1)[1] for k in SETTINGS if k.startswith(section + ".")]
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"{path}: unknown key {key!r} in [{section}]{hint}; valid: {', '.join(valid)}")
            out[dotted] = value
    return out


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"section.key": value}`` from a TOML file; ConfigError for a missing file, bad TOML or unknown keys."""
    p = Path(path).expanduser()
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    return _flatten_toml(data, str(p))


def read_env(env: Mapping[str, str]) -> dict[str, str]:
    """``{"section.key": text}`` from the ``KVD_*`` variables of ``env``; ConfigError for an unknown one."""
    out: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in FOREIGN_ENV:
            continue
        setting = _BY_ENV.get(name)
        if setting is None:
            valid = sorted(_BY_ENV)
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"unknown environment variable {name}{hint}; valid: {', '.join(valid)} "
                f"(and {', '.join(sorted(FOREIGN_ENV))}, read elsewhere)"
            )
        out[setting.dotted] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Defaults < TOML file < ``KVD_*`` environment < ``overrides`` (command-line flags).

    ``path``: the TOML file; when None, ``$KVD_CONFIG`` if set, else no file. ``env``: the environment to read
    (default ``os.environ``). ``overrides``: ``{"section.key": value}``, typed or as text; ``None`` values are
    skipped (a flag that was not given). Raises :class:`ConfigError` naming the key for unknown keys, bad
    values or contradictory settings.
    """
    environ = os.environ if env is None else env
    if path is None and environ.get(CONFIG_ENV):
        path = environ[CONFIG_ENV]
    config = Config()
    if path is not None:
        config = _apply(config, read_toml(path), source=f"file {os.fspath(path)}")
    config = _apply(config, read_env(environ), source="environment")
    if overrides:
        given = {k: v for k, v in overrides.items() if v is not None}
        config = _apply(config, given, source="flags")
    return config


# ------------------------------------------------------------------------------------------ machine facts


def physical_memory_bytes() -> int | None:
    """This machine's memory, or the cgroup (container) limit when lower; None when unknown."""
    total: int | None = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        total = None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = int(text)
            if total is None or 0 < limit < total:
                total = limit
        break
    return total


def default_memory_bytes() -> int:
    """The default of ``cluster.memory_bytes``: 25% of this machine's memory, capped at 8 GiB, at least 64 MiB."""
    total = physical_memory_bytes() or 4 * GIB
    return max(DEFAULT_MEMORY_FLOOR_BYTES, min(DEFAULT_MEMORY_CAP_BYTES, int(total * DEFAULT_MEMORY_FRACTION)))


# ------------------------------------------------------------------------------------------- run files
# `kvd up` leaves a small JSON note (its pid, the Ray address, the client endpoint) so that `kvd status` and
# `kvd down` on the same machine find an embedded kvd without being told where it is.


def run_file_path(namespace: str) -> Path:
    """Where ``kvd up`` notes the kvd of ``namespace`` on this machine: ``$TMPDIR/kvd-<uid>/<namespace>.json``."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"kvd-{uid}" / f"{namespace}.json"


def _staged_run_file(namespace: str, info: Mapping[str, Any]) -> tuple[Path, Path]:
    """(the run note's path, a complete private copy of ``info`` beside it, 0600) to move or link into place."""
    path = run_file_path(namespace)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(dict(info), fh)
    return path, tmp


def write_run_file(namespace: str, info: Mapping[str, Any]) -> Path:
    """Write the run note of ``namespace`` atomically (0600); returns its path."""
    path, tmp = _staged_run_file(namespace, info)
    os.replace(tmp, path)
    return path


def claim_run_file(namespace: str, info: Mapping[str, Any]) -> dict[str, Any] | None:
    """Create the run note of ``namespace`` only if there is none: None when it is now ours, else the note that
    is already there (read as :func:`read_run_file` does; ``{}`` if unreadable). Atomic: of two ``kvd up`` of one
    namespace, exactly one gets the note (the complete file is linked into place, which fails if it exists)."""
    path, tmp = _staged_run_file(namespace, info)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return read_run_file(namespace) or {}
    finally:
        os.unlink(tmp)
    return None


def read_run_file(namespace: str) -> dict[str, Any] | None:
    """The run note of ``namespace``, or None if there is none (or it is unreadable)."""
    try:
        data = json.loads(run_file_path(namespace).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remove_run_file(namespace: str, *, pid: int | None = None) -> None:
    """Remove the run note (only if it belongs to ``pid`` when given)."""
    path = run_file_path(namespace)
    if pid is not None:
        note = read_run_file(namespace)
        if note is None or note.get("pid") != pid:
            return
    try:
        path.unlink()
    except OSError:
        pass


def _effective_defaults() -> dict[str, str]:
    """What an unset setting (None) means, where that is a value: the store's own defaults, the policy
    profile's numbers, the sizes derived from this machine. Settings left out have no default (CURVE keys)."""
    from kvd.cluster.membership import READY_GRACE_STALES, default_stale_after_s
    from kvd.store.core import DEFAULT_PAGE_TOKENS, DEFAULT_SINK_TOKENS, DEFAULT_WINDOW_TOKENS

    policy = PolicyConfig.profile(SETTINGS["policy.profile"].default)
    shards = SETTINGS["cluster.shards"].default
    memory = default_memory_bytes()
    out = {
        "store.capacity_bytes": f"{format_size(memory // shards)}*",
        "store.page_tokens": repr(DEFAULT_PAGE_TOKENS),
        "store.window_tokens": repr(DEFAULT_WINDOW_TOKENS),
        "store.sink_tokens": repr(DEFAULT_SINK_TOKENS),
        "cluster.memory_bytes": f"{format_size(memory)}*",
        "cluster.shard_reply_bytes": f"{format_size(min(GIB, max(64 * MIB, 4 * (memory // shards))))}*",
        "cluster.num_cpus": f"{max(os.cpu_count() or 1, 1)}*",
        "cluster.ready_grace_s": repr(READY_GRACE_STALES * default_stale_after_s(
            SETTINGS["cluster.report_interval_s"].default)),
    }
    for key in ("q8_threshold", "q4_threshold", "hysteresis", "ewma_alpha"):
        out[f"policy.{key}"] = repr(getattr(policy, key))
    for key in ("min_level", "max_level"):
        out[f"policy.{key}"] = repr(getattr(policy, key).tag)
    return out


def describe() -> str:
    """Every setting with its env variable, default and meaning (for ``kvd config --help`` and docs). A default
    marked * is this machine's (derived from its memory or CPUs); "-" means unset, with no default value."""
    lines = ["(* = derived from this machine; - = unset)"]
    effective = _effective_defaults()
    for section in _SECTIONS:
        lines.append(f"[{section}]")
        for s in SETTINGS.values():
            if s.section != section:
                continue
            default = repr(s.default) if s.default is not None else effective.get(s.dotted, "-")
            lines.append(f"  {s.key:<22} {default:<12} {s.env}")
            lines.append(f"      {s.doc}")
    return "\n".join(lines)
