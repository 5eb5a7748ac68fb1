"""What every ``kvd`` command shares: settings from flags, config file and environment, the run note of
a local ``kvd up``, the endpoint and CURVE keys a command talks to, exit codes and messages."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from kvd.config.settings import (
    Config,
    load_config,
    read_run_file,
    remove_run_file,
)
from kvd.errors import ConfigError, KvdError

_EMBEDDED_OBJECT_STORE_BYTES = 128 << 20  # kvd moves no data through Ray's object store
_STATUS_PERIOD_S = 1.0
_RAY_PROBE_TIMEOUT_S = 5.0
_EXIT_OK, _EXIT_ERROR, _EXIT_USAGE = 0, 1, 2



class _Stop(BaseException):
    """Raised in the main thread by SIGTERM / SIGINT. A BaseException, so that no ``except Exception`` on the
    way (status polling tolerates errors) can swallow it."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signal.Signals(signum).name)


# ------------------------------------------------------------------------------------------------- config


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML settings file (default: $KVD_CONFIG if set)")
    parser.add_argument(
        "--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
        help="set any setting, e.g. --set store.page_tokens=32 (repeatable; `kvd config --describe` lists them)",
    )
    parser.add_argument("--namespace", help="Ray namespace of the kvd to act on (default: kvd)")


_FLAG_SETTINGS = {
    "ray_address": "cluster.address",
    "shards": "cluster.shards",
    "memory": "cluster.memory_bytes",
    "port": "cluster.port",
    "host": "cluster.host",
    "namespace": "cluster.namespace",
    "metrics_port": "cluster.metrics_port",
    "report_interval": "cluster.report_interval_s",
    "pressure_mode": "cluster.pressure_mode",
    "profile": "policy.profile",
    "eviction": "store.eviction",
    "disk": "cluster.disk_bytes",
    "disk_path": "cluster.disk_path",
}


def _load(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects SECTION.KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value
    for attr, key in _FLAG_SETTINGS.items():
        if getattr(args, attr, None) is not None:
            overrides[key] = getattr(args, attr)
    return load_config(args.config, overrides=overrides)


def _live_note(namespace: str) -> dict[str, Any] | None:
    """The run note of ``namespace`` unless it is stale (a foreground `kvd up` that no longer runs)."""
    note = read_run_file(namespace)
    if note is not None and not note.get("detached") and not _alive(int(note.get("pid", 0))):
        remove_run_file(namespace)
        return None
    return note


def _default_endpoint(config: Config) -> str:
    note = _live_note(config.cluster.namespace)
    if note and note.get("endpoint"):
        return str(note["endpoint"])
    return f"tcp://127.0.0.1:{config.cluster.port}"


class NoKvd(KvdError):
    """No ``--address`` was given and no `kvd up` of the namespace runs on this machine."""


_DEFAULT_NAMESPACE = "kvd"


def _endpoint_arg(args: argparse.Namespace, config: Config) -> str:
    """``--address`` (a client endpoint for status, ping and bench) checked at once, or the endpoint of the local
    `kvd up` of the namespace. Only the default namespace falls back to ``tcp://127.0.0.1:<port>`` (a kvd not
    started by `kvd up` here): any other namespace without a run note has no kvd here, and another namespace's
    kvd answering on the default port must not be reported in its place. Raises :class:`NoKvd` then."""
    if args.address is None:
        ns = config.cluster.namespace
        if ns != _DEFAULT_NAMESPACE and _live_note(ns) is None:
            raise NoKvd(no_kvd_message(ns))
        return _default_endpoint(config)
    from kvd.client.conn import check_endpoint
    from kvd.errors import InvalidArgument

    try:
        return check_endpoint("--address", args.address)
    except InvalidArgument as exc:
        raise ConfigError(str(exc)) from None


def no_kvd_message(namespace: str, endpoint: str | None = None) -> str:
    """Why a command found no kvd of ``namespace`` on this machine (``endpoint``: where nothing answered)."""
    nothing = f", and nothing answers at {endpoint}" if endpoint else ""
    return (f"no kvd is running in namespace {namespace!r} on this machine (no `kvd up` of it{nothing}); "
            "for a kvd elsewhere give --address ENDPOINT")


def _curve_client(config: Config) -> Any:
    if config.curve.server_public_key is None:
        return None
    from kvd.wire.server import CurveConfig

    return CurveConfig.for_client(
        server_public_key_file=config.curve.server_public_key, secret_key_file=config.curve.client_secret_key
    )


# -------------------------------------------------------------------------------------------------- verbs


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:  # Linux: the state follows the parenthesised name
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
