"""The `kvd` command line as parsed (issue 31, section 3): no abbreviated flags, one meaning per flag name, sizes
whose unit is said. Parsing only: nothing starts, no Ray, no network."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from kvd.cli.main import build_parser, main
from kvd.config import load_config
from kvd.errors import ConfigError, InvalidArgument

VERBS = ("up", "status", "bench", "ping", "down", "keygen", "config")


def _verb_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["up", "--mem", "0"], "--mem"),
    (["up", "--shard", "3"], "--shard"),
    (["status", "--time", "1"], "--time"),
    (["ping", "--addr", "tcp://127.0.0.1:1"], "--addr"),
    (["down", "--time", "1"], "--time"),
    (["--vers"], "--vers"),
])
def test_abbreviated_flags_are_refused(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert f"unrecognized arguments: {flag}" in _usage_error(argv, capsys)


def test_every_parser_refuses_abbreviations() -> None:
    parsers = {"kvd": build_parser(), **_verb_parsers()}
    assert set(VERBS) <= set(parsers)
    assert {name: p.allow_abbrev for name, p in parsers.items() if p.allow_abbrev} == {}


def test_whole_flags_still_parse() -> None:
    args = build_parser().parse_args(["up", "--memory", "64MiB", "--shards", "3"])
    assert (args.memory, args.shards) == ("64MiB", 3)


# ------------------------------------------------------------------------- --address: one name, one meaning


@pytest.mark.parametrize("verb", ["up", "down"])
def test_a_ray_cluster_is_ray_address(verb: str) -> None:
    args = build_parser().parse_args([verb, "--ray-address", "auto"])
    assert args.ray_address == "auto"
    assert load_config(None, overrides={"cluster.address": args.ray_address}).cluster.address == "auto"


@pytest.mark.parametrize("verb", ["up", "down"])
def test_address_given_to_up_or_down_is_a_usage_error_naming_ray_address(
        verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    # `kvd down --address tcp://127.0.0.1:7070` used to ask Ray to connect to a ZeroMQ endpoint
    err = _usage_error([verb, "--address", "tcp://127.0.0.1:7070"], capsys)
    assert "--ray-address" in err and "kvd endpoint" in err, err
    assert "--address" not in _verb_parsers()[verb].format_help()


@pytest.mark.parametrize("verb", ["status", "ping", "bench", "calibrate"])
def test_address_is_a_kvd_endpoint_for_the_client_verbs(verb: str) -> None:
    given = ["NS", "--sample", "s.npz"] if verb == "calibrate" else []
    args = build_parser().parse_args([verb, *given, "--address", "tcp://127.0.0.1:7070"])
    assert args.address == "tcp://127.0.0.1:7070"
    assert "ENDPOINT" in _verb_parsers()[verb].format_help()
    with pytest.raises(SystemExit):
        build_parser().parse_args([verb, "--ray-address", "auto"])


REPO = Path(__file__).resolve().parents[2]
_COMMAND = re.compile(r"\bkvd (up|down|status|ping|bench)((?: --?[\w-]+(?:[ =](?!-)[^\s'`\")|]+)?)*)")


def _documented_commands() -> list[tuple[str, str]]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "cluster").iterdir())]:
        if path.is_file():
            for m in _COMMAND.finditer(path.read_text()):
                found.append((path.name, f"{m.group(1)}{m.group(2)}"))
    return found


def test_the_documented_command_lines_parse(capsys: pytest.CaptureFixture[str]) -> None:
    """README.md and cluster/ (the READMEs, the KubeRay pod, the launcher) spell the flags as `kvd` takes them."""
    commands = _documented_commands()
    assert ("kuberay-raycluster.yaml", "up --ray-address auto --config /etc/kvd/kvd.toml --quiet") in commands
    bad = []
    for where, line in commands:
        try:
            build_parser().parse_args(shlex.split(line))
        except SystemExit as exit_:
            if exit_.code:  # --help exits 0
                bad.append((where, line))
    assert bad == []


def test_kvd_calibrate_takes_the_kv_namespace_apart_from_the_ray_namespace_and_states_the_defaults() -> None:
    from kvd.calibration import DEFAULT_BUDGETS, MIN_TOKENS
    from kvd.cli.calibrate import HELP_BUDGETS, HELP_MIN_TOKENS

    args = build_parser().parse_args(["calibrate", "kvd/vllm/m/abc", "--sample", "s.npz", "--namespace", "prod",
                                      "--budget-q4", "0.05"])
    assert (args.kv_namespace, args.namespace, args.budget_q4, args.budget_8bit) == ("kvd/vllm/m/abc", "prod",
                                                                                     0.05, None)
    assert (HELP_BUDGETS, HELP_MIN_TOKENS) == (DEFAULT_BUDGETS, MIN_TOKENS)  # what --help says is what runs
    assert "default 0.06: 6%" in _verb_parsers()["calibrate"].format_help()


def test_kvd_calibrate_checks_the_shards_before_it_measures() -> None:
    from kvd.cli.calibrate import _geometry
    from kvd.errors import ProtocolError, ShardUnavailable, UnknownNamespace

    def shard(sid: str, **extra: object) -> dict[str, object]:
        return {"shard_id": sid, "page_tokens": 64, "sink_tokens": 4, "eight_bit": "q8",
                "calibration_states": {"m": "none"}, "calibration_unlisted": 0, **extra}

    assert _geometry([shard("shard-0"), shard("shard-1")], "m") == (64, 4, "q8")
    old = {k: v for k, v in shard("shard-1").items() if not k.startswith("calibration")}
    with pytest.raises(ProtocolError, match=r"shard\(s\) shard-1 run a kvd older than protocol 1.7"):
        _geometry([shard("shard-0"), old], "m")
    with pytest.raises(UnknownNamespace, match="'x' is not registered in this kvd \\(it has: m\\)"):
        _geometry([shard("shard-0")], "x")
    # a shard that does not list every namespace: the calibrate operation itself says whether it is there
    assert _geometry([shard("shard-0", calibration_unlisted=3)], "x") == (64, 4, "q8")
    with pytest.raises(InvalidArgument, match="store pages differently"):
        _geometry([shard("shard-0"), shard("shard-1", page_tokens=32)], "m")
    with pytest.raises(ShardUnavailable, match="no shard answered: Timeout"):
        _geometry([{"shard_id": "shard-0", "error": "Timeout: ..."}], "m")


def test_kvd_calibrate_takes_require_with_or_without_a_sample(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert (parse(["calibrate", "m", "--require"]).sample, parse(["calibrate", "m", "--require"]).require) == (
        None, True)
    args = parse(["calibrate", "m", "--sample", "s.npz", "--no-require"])
    assert (args.sample, args.require) == ("s.npz", False)
    assert parse(["calibrate", "m", "--sample", "s.npz"]).require is None  # unchanged
    from kvd.cli.main import main

    assert main(["calibrate", "m", "--address", "tcp://127.0.0.1:1"]) == 2  # neither: before any connection
    assert "give --sample FILE, --require / --no-require, or both" in capsys.readouterr().err


@pytest.mark.parametrize("budget", ["0", "1.5", "nan", "six"])
def test_a_budget_outside_0_1_is_a_usage_error(budget: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["calibrate", "m", "--sample", "s.npz", "--budget-q4", budget], capsys)
    assert "--budget-q4" in err


# ------------------------------------------------------------------------------------------ --memory's unit


def test_memory_help_says_the_unit_and_which_units_are_binary() -> None:
    text = " ".join(_verb_parsers()["up"].format_help().split())
    assert "a number without a unit is bytes" in text, text
    assert "8GiB is 8 x 2^30 bytes (binary" in text and "8GB is 8 x 10^9 bytes (decimal" in text, text


def test_memory_without_a_unit_is_an_error_that_says_it_was_read_as_bytes() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides={"cluster.memory_bytes": "8"})
    message = str(err.value)
    assert "8 bytes" in message and "without a unit is in bytes" in message, message
    assert "8GiB" in message and "2^30" in message and "8GB" in message and "10^9" in message, message


def test_memory_8_on_the_command_line_says_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--memory", "8", "--namespace", "kvd-unit-test-no-start"]) == 2  # fails before Ray starts
    err = capsys.readouterr().err
    assert "cluster.memory_bytes" in err and "8 bytes: a size without a unit is in bytes" in err, err


def test_a_size_with_a_unit_gets_no_hint() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides={"cluster.memory_bytes": "8KiB"})
    assert "without a unit" not in str(err.value)
