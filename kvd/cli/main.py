"""The ``kvd`` command: ``up``, ``status``, ``calibrate``, ``ping``, ``bench``, ``down``, ``keygen``, ``config``.

``kvd up`` with no arguments starts an embedded local Ray, a coordinator and two shards, prints the client
endpoint and a live status line, and stops everything on Ctrl-C or SIGTERM. ``--ray-address auto`` joins a
running Ray cluster instead. Settings: defaults < ``--config`` TOML < ``KVD_*`` environment < flags (kvd.config).
``kvd status`` and ``kvd bench`` talk to the coordinator's ZeroMQ endpoint like any client; ``kvd down``
stops a kvd through the process that runs it (embedded) or through Ray (``--ray-address``). ``--address`` is
always a kvd client endpoint (status, ping, bench), ``--ray-address`` always a Ray cluster (up, down). The status
table and the live line are drawn by kvd.cli.status, the Prometheus exporter is kvd.cluster.metrics.

This module holds the parser and the small verbs; ``up``/``down`` live in kvd.cli.up, ``ping`` in kvd.cli.ping,
``calibrate`` in kvd.cli.calibrate, and what they all share in kvd.cli.common.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvd import __version__
from kvd.cli import calibrate as cli_calibrate
from kvd.cli.common import (
    _EXIT_ERROR,
    _EXIT_OK,
    _EXIT_USAGE,
    NoKvd,
    _common,
    _curve_client,
    _endpoint_arg,
    _live_note,
    _load,
    _say,
    no_kvd_message,
)
from kvd.cli.ping import cmd_ping
from kvd.cli.status import fmt_bytes, shard_table
from kvd.cli.up import cmd_down, cmd_up
from kvd.config.settings import (
    DEFAULT_PORT,
    default_memory_bytes,
    describe,
    format_size,
)
from kvd.errors import ConfigError, KvdError

__all__ = ["main"]


def cmd_status(args: argparse.Namespace) -> int:
    config = _load(args)
    endpoint = _endpoint_arg(args, config)
    from kvd.client.sync import Client
    from kvd.errors import ShardUnavailable, Timeout

    try:
        with Client(endpoint, timeout_s=args.timeout, curve=_curve_client(config)) as client:
            topology = client.topology() if hasattr(client, "topology") else None
            stats = client.shard_stats()
    except (Timeout, ShardUnavailable) as exc:
        if args.address is None and _live_note(config.cluster.namespace) is None:
            _say(f"kvd status: {no_kvd_message(config.cluster.namespace, endpoint)}")
            return _EXIT_ERROR
        raise exc from None
    rows = []
    for i, s in enumerate(stats):
        sid = (s or {}).get("shard_id") or (topology["shards"][i]["id"] if topology else f"shard-{i}")
        rows.append((str(sid), s if isinstance(s, dict) and "used_bytes" in s else None))
    if args.json:
        doc = {"endpoint": endpoint, "topology": topology, "shards": dict(rows)}
        print(json.dumps(doc, indent=2, default=str))
        return _EXIT_OK
    head = f"kvd at {endpoint}"
    if topology:
        head += (f": level {topology.get('level')} (epoch {topology.get('level_epoch')}), "
                 f"topology epoch {topology.get('epoch')}")
    good = [s for _, s in rows if s]
    if good:
        used, cap = sum(s["used_bytes"] for s in good), sum(s["capacity_bytes"] for s in good)
        head += f", pressure {used / cap:.3f} ({fmt_bytes(used)} of {fmt_bytes(cap)})"
    print(head)
    print(shard_table(rows))
    return _EXIT_OK if len(good) == len(rows) else _EXIT_ERROR


def cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    os.makedirs(args.dir, mode=0o700, exist_ok=True)
    for name in args.name:
        public, secret = zmq.auth.create_certificates(args.dir, name)
        os.chmod(secret, 0o600)
        print(f"{name}: public {public}  secret {secret}")
    print("\nconfigure (kvd.toml):\n[curve]")
    print(f'server_secret_key = "{os.path.join(args.dir, "server.key_secret")}"  # servers')
    print(f'server_public_key = "{os.path.join(args.dir, "server.key")}"  # clients')
    print(f'client_secret_key = "{os.path.join(args.dir, "client.key_secret")}"  # clients')
    print("# authorized_keys = \"DIR\"  # a directory holding only the allowed clients' *.key files")
    return _EXIT_OK


def cmd_config(args: argparse.Namespace) -> int:
    if args.describe:
        print(describe())
        return _EXIT_OK
    config = _load(args)
    for section, table in config.to_dict().items():
        print(f"[{section}]")
        for key, value in table.items():
            if value is not None:
                print(f"{key} = {json.dumps(value)}")
        print()
    return _EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from kvd.cli.loadgen import LAYOUTS, print_report, run_load

    config = _load(args)
    endpoint = _endpoint_arg(args, config)
    layout = LAYOUTS[args.layout]
    result = run_load(endpoint, clients=args.clients, seconds=args.seconds, layout=layout,
                      prefill_tokens=args.prefill_tokens, decode_steps=args.decode_steps,
                      curve=_curve_client(config),
                      # a progress bar redraws itself with \r: only on a terminal (a log or a pipe gets the table)
                      progress=not args.quiet and sys.stderr.isatty())
    print_report(result)
    return _EXIT_OK if result["errors"] == 0 else _EXIT_ERROR


# ------------------------------------------------------------------------------------------------- parser


class _RayAddressRenamed(argparse.Action):
    """``--address`` given to `kvd up` / `kvd down`: a usage error that names ``--ray-address``. One flag name, one
    meaning: ``--address`` is a kvd client endpoint everywhere (status, ping, bench)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"--address {values}: --address names a kvd endpoint (kvd status, ping, bench); a Ray "
                     "cluster is --ray-address (\"auto\", \"ray://head:10001\"); `kvd down` without it stops the "
                     "local `kvd up` of --namespace")


def _renamed_to_ray_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", action=_RayAddressRenamed, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    memory = format_size(default_memory_bytes())
    parser = argparse.ArgumentParser(
        prog="kvd",
        description="kvd: a distributed cache for the attention KV cache of LLM inference.",
        epilog="Start with `kvd up`; `kvd VERB --help` explains each verb.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    # No abbreviated flags (`--mem` for --memory, `--shard` for --shards): a typo or a future flag must not
    # silently become another one. Every verb's parser is made with the same switch.
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    add_verb = functools.partial(verbs.add_parser, allow_abbrev=False)

    up = add_verb(
        "up", help="start kvd (embedded Ray by default) and show its status",
        description="Start a coordinator and shards, print the client endpoint and a live status line; Ctrl-C "
        "or SIGTERM stops everything. With no arguments: an embedded local Ray, 2 shards sharing "
        f"--memory (default 25% of this machine's memory, at most 8 GiB: here {memory}), client "
        f"endpoint tcp://127.0.0.1:{DEFAULT_PORT}.",
    )
    _common(up)
    up.add_argument("--ray-address", metavar="RAY",
                    help='join a Ray cluster instead: "auto" (started with `ray start`/`ray up` on this machine) '
                    'or "ray://head:10001"; shards are spread over its nodes')
    _renamed_to_ray_address(up)
    up.add_argument("--shards", type=int, help="number of shards (default 2)")
    up.add_argument("--memory", metavar="SIZE",
                    help="total KV memory over all shards, with its unit: 8GiB is 8 x 2^30 bytes (binary: KiB MiB "
                    "GiB TiB), 8GB is 8 x 10^9 bytes (decimal: KB MB GB TB); a number without a unit is bytes "
                    f"(default here: {memory})")
    up.add_argument("--port", type=int, help=f"coordinator's client port (default {DEFAULT_PORT}; 0 = any)")
    up.add_argument("--host",
                    help='bind address of every actor (default "auto": 127.0.0.1 embedded; on a cluster each '
                    "node's IP as Ray has it, i.e. its `ray start --node-ip-address` if given, but Ray replaces "
                    "a loopback one by the outward IP: see cluster/README.md)")
    up.add_argument("--metrics-port", type=int,
                    help="serve Prometheus metrics on this port (default 0 = off): from `kvd up` itself, or with "
                    "--detach from an actor on the Ray head until `kvd down`")
    up.add_argument("--report-interval", type=float, help="seconds between shard reports (default 0.5)")
    up.add_argument("--pressure-mode", choices=["sum", "max"], help="cluster pressure: total or fullest shard")
    up.add_argument("--profile", choices=["default", "fp16_only", "aggressive"], help="policy profile")
    up.add_argument("--eviction", choices=["lru", "none"], help="when full: evict LRU sequences or refuse")
    up.add_argument("--disk", metavar="SIZE",
                    help="disk tier, total over all shards, e.g. 100GiB: when memory is full at the most compact "
                         "level, sequences move to disk instead of being forgotten, and a restart serves them "
                         "(default 0: off)")
    up.add_argument("--disk-path", metavar="DIR",
                    help="directory of the disk tier, on a local disk (default ~/.cache/kvd); `kvd up` again on "
                         "the same DIR comes back with what it holds")
    up.add_argument("--fresh", action="store_true", help="start with an empty disk tier (remove what DIR holds)")
    up.add_argument("--detach", action="store_true",
                    help="with --ray-address: leave kvd running on the cluster and exit (stop it with `kvd "
                    "down`); metrics (--metrics-port) are then served on the Ray head")
    up.add_argument("--quiet", action="store_true", help="no status output (only the endpoint line)")
    up.set_defaults(func=cmd_up)

    status = add_verb(
        "status", help="per-shard table: level, epoch, pressure, bytes per level, tokens, ...",
        description="Ask a running kvd for every shard's figures. Exit status 1 if a shard does not answer.",
    )
    _common(status)
    status.add_argument("--address", metavar="ENDPOINT",
                        help=f"coordinator endpoint (default: the local `kvd up`, else tcp://127.0.0.1:{DEFAULT_PORT})")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds per request (default 5)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(func=cmd_status)

    cli_calibrate.add_parser(add_verb, _common, DEFAULT_PORT)

    bench = add_verb(
        "bench", help="drive load against a running kvd: throughput and latency",
        description="Client processes append a prefill chunk, then decode steps (one token, all layers), read "
        "the sequence back and drop it, for --seconds; prints GB/s (fp16 bytes), requests/s, p50 and p99.",
    )
    _common(bench)
    bench.add_argument("--address", metavar="ENDPOINT", help="coordinator endpoint (default as for status)")
    bench.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    bench.add_argument("--seconds", type=float, default=10.0, help="duration (default 10)")
    bench.add_argument("--layout", choices=["7b", "small"], default="7b",
                       help="7b: 32 layers x 8 KV heads x 128 (default); small: 4 x 2 x 64")
    bench.add_argument("--prefill-tokens", type=int, default=512, help="tokens per prefill append (default 512)")
    bench.add_argument("--decode-steps", type=int, default=32, help="one-token appends per sequence (default 32)")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(func=cmd_bench)

    ping = add_verb(
        "ping", help="liveness check: does the coordinator (or a shard) answer? exit status 0 if so",
        description="Send the protocol's hello and ping to a kvd server (the coordinator by default) and report "
        "the round trip. Exit status 0 when it answered, 1 when not (within --timeout). With --shards, also ping "
        "every shard of the topology (exit 1 if one does not answer). Meant for liveness probes and scripts: it "
        "touches no data and does not need Ray.",
    )
    _common(ping)
    ping.add_argument("--address", metavar="ENDPOINT",
                      help=f"endpoint to ping (default: the local `kvd up`, else tcp://127.0.0.1:{DEFAULT_PORT})")
    ping.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each reply (default 5)")
    ping.add_argument("--shards", dest="all_shards", action="store_true",
                      help="also ping every shard of the topology")
    ping.add_argument("--quiet", action="store_true", help="print nothing but failures")
    ping.set_defaults(func=cmd_ping)

    down = add_verb(
        "down", help="stop a running kvd",
        description="Stop the kvd of --namespace: the local `kvd up` process (embedded Ray), or the detached "
        "actors on the Ray cluster given by --ray-address.",
    )
    _common(down)
    down.add_argument("--ray-address", metavar="RAY", help='Ray cluster ("auto", "ray://...")')
    _renamed_to_ray_address(down)
    down.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for it to stop (default 30)")
    down.set_defaults(func=cmd_down)

    keygen = add_verb(
        "keygen", help="write CURVE key pairs for encrypted, authenticated ZeroMQ",
        description="Write NAME.key (public) and NAME.key_secret (secret, mode 0600) into DIR for each --name.",
    )
    keygen.add_argument("dir", metavar="DIR", help="directory to write the keys to (created if missing)")
    keygen.add_argument("--name", action="append", default=None, help="key pair names (default: server, client)")
    keygen.set_defaults(func=cmd_keygen)

    cfg = add_verb("config", help="print the effective settings (or --describe all of them)",
                           description="Print the settings after defaults, --config, KVD_* and --set.")
    _common(cfg)
    cfg.add_argument("--describe", action="store_true", help="list every setting, its default and env variable")
    cfg.set_defaults(func=cmd_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return _EXIT_USAGE
    if args.verb == "keygen" and not args.name:
        args.name = ["server", "client"]
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit: a reader that went away is a BrokenPipeError caught below
        return code
    except ConfigError as exc:
        print(f"kvd {args.verb}: configuration error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    except NoKvd as exc:
        print(f"kvd {args.verb}: {exc}", file=sys.stderr)
        return _EXIT_ERROR
    except KvdError as exc:
        print(f"kvd {args.verb}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`kvd status | head -1`): what it did not read is not an error worth a traceback;
        # point stdout at /dev/null so that the interpreter's final flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
