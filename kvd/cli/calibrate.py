"""``kvd calibrate NAMESPACE --sample FILE``: measure a namespace's model on a sample of its own keys, values
and queries (kvd.calibration), choose the protection that meets each level's error budget, and give it to a
running kvd (``Client.calibrate``: the coordinator keeps it with the namespace and hands it to every shard).

The page geometry the errors are measured with (``page_tokens``, ``sink_tokens``, the 8-bit format) is the
shards' own, read from their stats first, so the measurement is of pages as that kvd stores them. Prints the
table of errors and the protection chosen (``Calibration.table()``), then the state the shards report.
``--require`` / ``--no-require`` set the namespace's own ``require_calibration`` (protocol 1.8), with a sample
or alone (then the namespace keeps its calibration, if any).
Exit status: 0 when the calibration is active (without a sample: when the setting was applied), 1 when it is not
(quarantined: measured on another layout) or the kvd or the namespace could not be reached, 2 for a bad sample
file or bad options.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kvd.cli.common import (
    _EXIT_ERROR,
    _EXIT_OK,
    _EXIT_USAGE,
    _curve_client,
    _endpoint_arg,
    _live_note,
    _load,
    _say,
    no_kvd_message,
)
from kvd.errors import InvalidArgument, ProtocolError, ShardUnavailable, Timeout, UnknownNamespace

__all__ = ["add_parser", "cmd_calibrate"]


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"a budget is eps_O as a fraction in (0, 1), e.g. 0.06 for 6%, got "
                                         f"{text}")
    return value


# kvd.calibration's DEFAULT_BUDGETS and MIN_TOKENS as the help states them (not imported here: the calibration
# module brings numpy, 0.85 s on every `kvd` command; tests/unit/test_cli_parser.py keeps them equal)
HELP_BUDGETS = {"8bit": 0.01, "q4": 0.06}
HELP_MIN_TOKENS = 128


def add_parser(add_verb: Any, common: Any, default_port: int) -> None:
    cal = add_verb(
        "calibrate", help="measure a namespace's model on a sample and give kvd the protection it needs",
        description="Measure the attention error (eps_O) of each layer and KV head of NAMESPACE's model at each "
        "level kvd stores (the 8-bit format and q4), from a sample of the model's own queries, keys and values, "
        "choose the cheapest protection (heads kept fp16 or held at 8 bits) whose mean eps_O meets each level's "
        "budget, and give that calibration to a running kvd: every shard seals the namespace's pages with it "
        "from then on, and a restarted shard or coordinator gets it back. Prints the errors and the protection "
        "chosen. The sample is an .npz with L{i}_q [T, query heads, D], L{i}_k and L{i}_v [T, kv heads, D] per "
        f"layer (keys after RoPE, at least {HELP_MIN_TOKENS} tokens), as kvd.integrations.capture writes it from "
        "a transformers model and a few texts. NAMESPACE must be registered (the engine's first register does "
        "it). Exit status 0 when the calibration is active, 1 when it is quarantined (the sample is of another "
        "layout) or kvd or the namespace could not be reached, 2 for a bad sample or options. --require / "
        "--no-require set whether the namespace requires a calibration (its own require_calibration, kept with "
        "its calibration by the coordinator): with --sample together with the calibration, without it alone.",
        epilog="A sample from a transformers model: kvd.integrations.capture.capture_sample(model, tokenizer, "
        "texts, tokens=1024, path='m.npz'); then: kvd calibrate NAMESPACE --sample m.npz. `kvd status` lists "
        "the namespaces (a vLLM connector's is kvd/vllm/<model>/<digest>) with their calibration state.",
    )
    common(cal)
    cal.add_argument("kv_namespace", metavar="NAMESPACE",
                     help="the KV namespace (one model's layout) to calibrate (--namespace is the kvd's Ray "
                     "namespace)")
    cal.add_argument("--sample", metavar="FILE",
                     help="the .npz sample of the model's q/k/v (required unless --require / --no-require)")
    cal.add_argument("--require", action=argparse.BooleanOptionalAction, default=None,
                     help="the namespace requires a calibration (--no-require: it does not), whatever the shards' "
                     "store.require_calibration says: without one its pages stay fp16 (store.allow_raw_fallback) "
                     "or its appends report that it needs one. Default: unchanged")
    cal.add_argument("--budget-8bit", type=_budget, metavar="EPS",
                     help=f"mean eps_O allowed at the 8-bit rung (default {HELP_BUDGETS['8bit']}: "
                     f"{100 * HELP_BUDGETS['8bit']:g}%%)")
    cal.add_argument("--budget-q4", type=_budget, metavar="EPS",
                     help=f"mean eps_O allowed at q4 (default {HELP_BUDGETS['q4']}: "
                     f"{100 * HELP_BUDGETS['q4']:g}%%); a budget no protection meets for fewer bits than 8 "
                     "turns q4 off for the namespace (its pages are sealed at 8 bits instead)")
    cal.add_argument("--model", help="the model id recorded in the calibration (default: the sample's meta)")
    cal.add_argument("--address", metavar="ENDPOINT",
                     help=f"coordinator endpoint (default: the local `kvd up`, else tcp://127.0.0.1:{default_port})")
    cal.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    cal.add_argument("--json", action="store_true", help="print the calibration record and state as JSON")
    cal.set_defaults(func=cmd_calibrate)


def _geometry(stats: list[dict[str, Any]], namespace: str) -> tuple[int, int, str]:
    """``(page_tokens, sink_tokens, eight_bit)`` of the shards (they must agree), checked before anything is
    measured: ProtocolError for a shard older than protocol 1.7 (its stats list no ``calibration_states``: it
    cannot take a calibration), UnknownNamespace when a shard lists every namespace it has and not this one."""
    good = [s for s in stats if "error" not in s]
    if not good:
        raise ShardUnavailable(f"no shard answered: {stats[0]['error'] if stats else 'kvd has no shard'}")
    old = [str(s.get("shard_id")) for s in good if "calibration_states" not in s]
    if old:
        raise ProtocolError(f"shard(s) {', '.join(old)} run a kvd older than protocol 1.7 and cannot take a "
                            "calibration (nothing was measured or sent); upgrade the cluster's kvd")
    geometry = {(int(s["page_tokens"]), int(s["sink_tokens"]), str(s["eight_bit"])) for s in good}
    if len(geometry) != 1:
        raise InvalidArgument(f"the shards store pages differently ({sorted(geometry)}): calibrate each alike")
    first = good[0]
    listed = first.get("calibration_states")
    if isinstance(listed, dict) and not first.get("calibration_unlisted") and namespace not in listed:
        names = ", ".join(sorted(listed)[:8]) or "none"
        raise UnknownNamespace(f"namespace {namespace!r} is not registered in this kvd (it has: {names}); an "
                               "engine registers its namespace when it starts (Client.register)")
    return geometry.pop()


def cmd_calibrate(args: argparse.Namespace) -> int:
    config = _load(args)
    endpoint = _endpoint_arg(args, config)
    if args.sample is None:
        if args.require is None:
            _say("kvd calibrate: give --sample FILE, --require / --no-require, or both")
            return _EXIT_USAGE
        return _require_only(args, endpoint, config)
    from kvd.calibration import DEFAULT_BUDGETS, calibrate, load_sample
    from kvd.client.sync import Client

    try:
        sample = load_sample(args.sample)
    except InvalidArgument as exc:
        _say(f"kvd calibrate: bad sample: {exc}")
        return _EXIT_USAGE
    with Client(endpoint, timeout_s=args.timeout, curve=_curve_client(config)) as client:
        try:
            stats = client.shard_stats()
        except (Timeout, ShardUnavailable):
            if args.address is None and _live_note(config.cluster.namespace) is None:
                _say(f"kvd calibrate: {no_kvd_message(config.cluster.namespace, endpoint)}")
                return _EXIT_ERROR
            raise
        page_tokens, sink_tokens, eight_bit = _geometry(stats, args.kv_namespace)
        _say(f"measuring {sample.layout[0]} layers x {sample.layout[1]} KV heads of {sample.tokens} tokens "
             f"(pages of {page_tokens}, sink {sink_tokens}, 8-bit rung {eight_bit}) ...")
        try:
            budgets = {level: DEFAULT_BUDGETS[level] if given is None else given
                       for level, given in (("8bit", args.budget_8bit), ("q4", args.budget_q4))}
            cal = calibrate(sample, budgets=budgets, eight_bit=eight_bit, page_tokens=page_tokens,
                            sink_tokens=sink_tokens, model=args.model)
        except InvalidArgument as exc:  # e.g. too few tokens for a page past the sink at this geometry
            _say(f"kvd calibrate: bad sample: {exc}")
            return _EXIT_USAGE
        state = client.calibrate(args.kv_namespace, cal, require=args.require)
    if args.json:
        print(json.dumps({"namespace": args.kv_namespace, "state": state, "calibration": cal.to_dict()}, indent=2))
    else:
        print(cal.table())
        print("\n" + _state_line(args.kv_namespace, state))
    sys.stdout.flush()
    return _EXIT_OK if state["state"] == "active" else _EXIT_ERROR


def _require_only(args: argparse.Namespace, endpoint: str, config: Any) -> int:
    """``kvd calibrate NAMESPACE --require`` (or ``--no-require``) without a sample: the setting alone."""
    from kvd.client.sync import Client

    with Client(endpoint, timeout_s=args.timeout, curve=_curve_client(config)) as client:
        state = client.calibrate(args.kv_namespace, require=args.require)
    if args.json:
        print(json.dumps({"namespace": args.kv_namespace, "state": state}, indent=2))
    else:
        print(_state_line(args.kv_namespace, state))
    sys.stdout.flush()
    return _EXIT_OK


def _state_line(namespace: str, state: dict[str, Any]) -> str:
    """``namespace 'm': calibration active (reason)``, and whether it requires one when the reply says."""
    line = f"namespace {namespace!r}: calibration {state['state']}" + (
        f" ({state['reason']})" if state.get("reason") else "")
    if "required" in state:
        line += f"; requires a calibration: {'yes' if state['required'] else 'no'}"
    return line
