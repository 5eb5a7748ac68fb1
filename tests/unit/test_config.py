"""kvd.config: precedence (defaults < TOML < KVD_* env < flags), unknown keys, sizes, validation."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from kvd.config.settings import (
    DEFAULT_MEMORY_CAP_BYTES,
    SETTINGS,
    Config,
    default_memory_bytes,
    describe,
    env_name,
    format_size,
    load_config,
    parse_size,
)
from kvd.errors import ConfigError
from kvd.policy import Level, PolicyConfig

pytestmark = pytest.mark.backend_independent  # settings: no kernel, no compiled module

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("512 mib", 512 * 1024**2),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("4096", 4096),
        ("64KiB", 65536),
        ("2Gi", 2 * 1024**3),
        ("2G", 2 * 1024**3),
        ("1GB", 10**9),
        ("3MB", 3 * 10**6),
        ("10B", 10),
        (12345, 12345),
        (0, 0),
    ],
)
def test_parse_size_accepts_units_and_ints(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "GiB", "8 GiBs", "-1GiB", "8 XB", "1e9", "eight", True, -5, [1], float("inf")]
)
def test_parse_size_refuses_garbage_naming_the_value(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, name="cluster.memory_bytes")
    assert "cluster.memory_bytes" in str(info.value)


def test_format_size_round_trips_through_parse_size() -> None:
    for n in (17, 3 * 1024, 5 * 1024**2, 7 * 1024**3):
        assert parse_size(format_size(n).replace(" ", "")) == n


# ------------------------------------------------------------------------------------------- precedence


def test_defaults_without_any_source() -> None:
    config = load_config(env={})
    assert config == Config(cluster=config.cluster)  # memory default is machine-dependent, the rest is fixed
    assert config.cluster.shards == 2
    assert config.cluster.port == 7070
    assert config.cluster.memory_bytes == default_memory_bytes()
    assert 64 * 1024**2 <= config.cluster.memory_bytes <= DEFAULT_MEMORY_CAP_BYTES
    assert config.policy_config() == PolicyConfig.default()


def test_precedence_defaults_toml_env_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[cluster]
shards = 3
memory_bytes = "6GiB"
port = 9000
report_interval_s = 0.25

[store]
page_tokens = 32
""",
    )
    env = {"KVD_CLUSTER_SHARDS": "5", "KVD_CLUSTER_PORT": "9100", "KVD_KERNELS": "reference"}
    config = load_config(path, env=env, overrides={"cluster.port": 9200, "cluster.namespace": None})
    assert config.cluster.port == 9200  # flag beats env beats file
    assert config.cluster.shards == 5  # env beats file
    assert config.cluster.memory_bytes == 6 * 1024**3  # file beats default
    assert config.cluster.report_interval_s == 0.25
    assert config.store.page_tokens == 32
    assert config.cluster.namespace == "kvd"  # a flag given as None (not on the command line) is skipped
    assert config.cluster.pressure_mode == "max"  # untouched default
    assert config.shard_capacity_bytes == 6 * 1024**3 // 5
    assert config.source == (f"file {path}", "environment", "flags")


def test_config_file_from_kvd_config_env(tmp_path: Path) -> None:
    path = write(tmp_path, "[cluster]\nshards = 7\n")
    assert load_config(env={"KVD_CONFIG": str(path)}).cluster.shards == 7
    other = write(tmp_path, "[cluster]\nshards = 9\n")
    assert load_config(other, env={"KVD_CONFIG": "/nonexistent.toml"}).cluster.shards == 9


def test_env_values_are_parsed_like_toml_values() -> None:
    env = {
        "KVD_STORE_RAW_LAYERS": "31, 0",
        "KVD_STORE_CAPACITY_BYTES": "256MiB",
        "KVD_POLICY_Q8_THRESHOLD": "0.6",
        "KVD_POLICY_MAX_LEVEL": "Q8",
        "KVD_STORE_WINDOW_TOKENS": "none",
    }
    config = load_config(env=env)
    assert config.store.raw_layers == (0, 31)
    assert config.store.capacity_bytes == 256 * 1024**2
    assert config.shard_capacity_bytes == 256 * 1024**2
    assert config.store.window_tokens is None
    policy = config.policy_config()
    assert policy.q8_threshold == 0.6 and policy.max_level is Level.Q8


def test_every_setting_has_an_env_variable_that_loads() -> None:
    samples = {"address": "auto", "namespace": "kvd2", "host": "127.0.0.1", "pressure_mode": "max"}
    for dotted, setting in SETTINGS.items():
        assert setting.env == env_name(setting.section, setting.key)
        if setting.default is not None and not isinstance(setting.default, (str, tuple)):
            load_config(env={setting.env: str(setting.default)})  # every default survives a text round trip
        if setting.key in samples:
            config = load_config(env={setting.env: samples[setting.key]})
            assert getattr(getattr(config, setting.section), setting.key) == samples[setting.key], dotted


# ------------------------------------------------------------------------------------------ unknown keys


def test_unknown_toml_key_names_it_and_lists_valid_ones(tmp_path: Path) -> None:
    path = write(tmp_path, "[cluster]\nshard = 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "'shard'" in message and "did you mean shards" in message
    assert "memory_bytes" in message and "report_interval_s" in message


def test_unknown_toml_section_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown section \[clustr\].*\[cluster\]"):
        load_config(write(tmp_path, "[clustr]\nshards = 4\n"), env={})


def test_top_level_key_outside_a_section_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="shards"):
        load_config(write(tmp_path, "shards = 4\n"), env={})


def test_unknown_env_variable_names_it_and_lists_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVD_CLUSTER_SHRADS": "4"})
    message = str(info.value)
    assert "KVD_CLUSTER_SHRADS" in message and "did you mean KVD_CLUSTER_SHARDS" in message
    assert "KVD_STORE_PAGE_TOKENS" in message


def test_foreign_kvd_variables_and_other_env_are_ignored() -> None:
    config = load_config(env={"KVD_KERNELS": "simd", "KVD_SAMPLE": "/x.npz", "HOME": "/root", "KVDX": "1"})
    assert config.cluster.shards == 2


def test_unknown_override_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'cluster.shardz'.*cluster.shards"):
        load_config(env={}, overrides={"cluster.shardz": 3})


# ------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("cluster.shards", 0, "cluster.shards"),
        ("cluster.shards", "two", "cluster.shards: expected an integer"),
        ("cluster.shards", True, "cluster.shards"),
        ("cluster.port", 70000, "cluster.port"),
        ("cluster.report_interval_s", 0, "cluster.report_interval_s"),
        ("cluster.pressure_mode", "mean", "sum, max"),
        ("cluster.memory_bytes", "lots", "cluster.memory_bytes"),
        ("cluster.memory_bytes", "100KiB", "at least 1.00 MiB"),
        ("cluster.namespace", "a b", "cluster.namespace"),
        ("store.eviction", "fifo", "lru, none"),
        ("store.eight_bit", "int8", "fp8_e4m3"),
        ("store.raw_layers", [0, -1], "store.raw_layers"),
        ("store.raw_layers", "1,1", "duplicate"),
        ("policy.profile", "turbo", "aggressive"),
        ("policy.q8_threshold", 1.5, "policy.q8_threshold"),
        ("policy.min_level", "q2", "fp16"),
    ],
)
def test_bad_values_are_refused_naming_the_key(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={key: value})
    assert fragment in str(info.value)


def test_contradictory_policy_is_refused_at_load_time(tmp_path: Path) -> None:
    path = write(tmp_path, "[policy]\nq8_threshold = 0.9\nq4_threshold = 0.5\n")
    with pytest.raises(ConfigError, match="q4_threshold"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="min_level"):
        load_config(env={"KVD_POLICY_PROFILE": "aggressive", "KVD_POLICY_MAX_LEVEL": "fp16"})


def test_too_little_memory_per_shard_is_refused() -> None:
    with pytest.raises(ConfigError, match="less than 1 MiB per shard"):
        load_config(env={}, overrides={"cluster.memory_bytes": "4MiB", "cluster.shards": 8})


def test_bad_toml_and_missing_file_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[cluster\nshards = 2\n"), env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})


# --------------------------------------------------------------------------------------- derived values


def test_policy_config_layers_profile_numbers_and_eight_bit() -> None:
    config = load_config(
        env={},
        overrides={"policy.profile": "aggressive", "policy.hysteresis": 0.1, "store.eight_bit": "fp8_e4m3"},
    )
    policy = config.policy_config()
    assert policy.q8_threshold == PolicyConfig.aggressive().q8_threshold
    assert policy.hysteresis == 0.1
    assert policy.eight_bit is Level.FP8
    assert policy.min_level is Level.Q8


def test_store_kwargs_leave_unset_options_to_the_store() -> None:
    config = load_config(env={}, overrides={"store.page_tokens": 64, "store.raw_heads": [1]})
    kwargs = config.store_kwargs()
    assert kwargs["page_tokens"] == 64 and kwargs["raw_heads"] == (1,)
    assert "window_tokens" not in kwargs and "sink_tokens" not in kwargs
    assert kwargs["eviction"] == "lru" and kwargs["eight_bit"] == "q8"


def test_config_is_frozen_picklable_and_round_trips_through_to_dict() -> None:
    config = load_config(env={}, overrides={"cluster.shards": 3, "store.raw_layers": "0,5"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cluster.shards = 4  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(config)) == config  # Ray ships it to the actors
    flat = {f"{s}.{k}": v for s, table in config.to_dict().items() for k, v in table.items()}
    again = load_config(env={}, overrides=flat)
    assert again.cluster == config.cluster and again.store == config.store


def test_example_config_in_cluster_dir_loads_and_describe_lists_every_setting() -> None:
    example = REPO / "cluster" / "kvd.toml"
    config = load_config(example, env={})
    assert config.cluster.shards >= 1
    text = describe()
    for setting in SETTINGS.values():
        assert setting.env in text

