"""The `kvd` command line as parsed (issue 31, section 3): no abbreviated flags, one meaning per flag name, sizes
whose unit is said. Parsing only: nothing starts, no Ray, no network."""

from __future__ import annotations

import argparse

import pytest

from kvd.cli.main import build_parser

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
