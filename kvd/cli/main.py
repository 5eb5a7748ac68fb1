"""The ``kvd`` command: ``up``, ``status``, ``ping``, ``bench``, ``down``, ``keygen``, ``config``.

``kvd up`` with no arguments starts an embedded local Ray, a coordinator and two shards, prints the client
endpoint and a live status line, and stops everything on Ctrl-C or SIGTERM. ``--address auto`` joins a running
Ray cluster instead. Settings: defaults < ``--config`` TOML < ``KVD_*`` environment < flags (kvd.config).
``kvd status`` and ``kvd bench`` talk to the coordinator's ZeroMQ endpoint like any client; ``kvd down``
stops a kvd through the process that runs it (embedded) or through Ray (``--address``). What the status
table, the live line and the Prometheus exporter show is drawn by kvd.cli.status.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvd import __version__
from kvd.cli.status import StatusMetrics, fmt_bytes, shard_table, status_line
from kvd.config.settings import (
    DEFAULT_PORT,
    Config,
    claim_run_file,
    default_memory_bytes,
    describe,
    format_size,
    load_config,
    physical_memory_bytes,
    read_run_file,
    remove_run_file,
    run_file_path,
    write_run_file,
)
from kvd.errors import ConfigError, KvdError

__all__ = ["main"]

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


def _endpoint_arg(args: argparse.Namespace, config: Config) -> str:
    """``--address`` (a client endpoint for status and bench) checked at once, or the local kvd's endpoint."""
    if args.address is None:
        return _default_endpoint(config)
    from kvd.client.core import check_endpoint
    from kvd.errors import InvalidArgument

    try:
        return check_endpoint("--address", args.address)
    except InvalidArgument as exc:
        raise ConfigError(str(exc)) from None


def _curve_client(config: Config) -> Any:
    if config.curve.server_public_key is None:
        return None
    from kvd.wire.server import CurveConfig

    return CurveConfig.for_client(
        server_public_key_file=config.curve.server_public_key, secret_key_file=config.curve.client_secret_key
    )


# -------------------------------------------------------------------------------------------------- verbs


def _ray_init(config: Config) -> str:
    """Connect to (or start) Ray for ``config``; returns the bind host for the actors."""
    import logging

    import ray

    cluster = config.cluster
    if cluster.address:
        _ray_connect(cluster.address, cluster.namespace)
        return "node" if cluster.host == "auto" else cluster.host
    cpus = cluster.num_cpus or max(os.cpu_count() or 1, int(-(-cluster.shards * cluster.shard_cpus // 1)), 1)
    # An embedded Ray serves this machine only, so nothing of it may listen beyond loopback (_loopback_ray). A
    # --host other than auto (kvd's own sockets elsewhere) leaves Ray's choice alone.
    node_ip = {}
    if cluster.host in ("auto", "127.0.0.1"):
        _loopback_ray()
        node_ip = {"_node_ip_address": "127.0.0.1"}
    _become_subreaper()
    # SIGTERM to the whole process group (`timeout`, systemd) also reaches Ray's processes, which then stop
    # answering while `kvd up` still needs them to tear down: its Ray calls waited 60 s for the GCS. Ray blocks
    # SIGINT in the processes it starts for the same reason (Ctrl-C goes to the group); block SIGTERM as well
    # while they are started (a blocked signal is inherited), so only `kvd up` handles it and stops them itself.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        ray.init(address="local", num_cpus=cpus, namespace=cluster.namespace, include_dashboard=False,
                 object_store_memory=_EMBEDDED_OBJECT_STORE_BYTES, logging_level=logging.WARNING,
                 log_to_driver=False, **node_ip)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    _no_graceful_ray_kill()
    return "127.0.0.1" if cluster.host == "auto" else cluster.host


def _loopback_ray() -> None:
    """Make the Ray that ray.init starts bind 127.0.0.1 only. Ray's servers (the GCS, the raylet, the object
    manager, the agents, every worker's gRPC port) listen on all interfaces unless the node IP is 127.0.0.1, and
    ray.init replaces a 127.0.0.1 given as ``_node_ip_address`` by the machine's outward IP. The one switch
    Ray has for "this Ray is no cluster, use loopback" is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (its default
    on macOS and Windows): set for this process and for every process Ray starts from it."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:  # ray is imported already: its constant was read from the environment at import
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):  # pragma: no cover - another Ray layout: the variable still applies
        pass


def _become_subreaper() -> None:
    """Adopt the orphans of this process's descendants (Linux ``PR_SET_CHILD_SUBREAPER``). When the raylet is
    killed its agents are orphaned, and a Ray agent whose GCS is gone never exits by itself: adopted, they are
    found and killed by :func:`_kill_leftovers` instead of outliving `kvd up`."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _kill_leftovers(timeout_s: float = 5.0) -> int:
    """SIGKILL and reap every child this process still has after ray.shutdown() (adopted Ray agents, workers
    that outlived their raylet); returns how many there were. `kvd up` starts no other child processes."""
    me = os.getpid()
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me:
            children.append(int(entry))
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    waiting = set(children)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                waiting.discard(pid)
        if waiting:
            time.sleep(0.02)
    return len(children)


def _no_graceful_ray_kill() -> None:
    """Make ``ray.shutdown()`` kill the embedded Ray's processes at once. It sends each one SIGTERM and waits up
    to a second before SIGKILL, and they block SIGTERM (:func:`_ray_init`): 5 s of waiting for nothing. Only
    touches Ray's node object if it looks as expected."""
    import ray

    node = getattr(getattr(ray, "_private", None) and ray._private.worker, "_global_node", None)
    kill = getattr(node, "kill_all_processes", None)
    if node is None or not callable(kill):
        return

    def kill_now(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_graceful"] = False
        return kill(*args, **kwargs)

    node.kill_all_processes = kill_now


def _ray_connect(address: str, namespace: str) -> None:
    import logging
    import socket

    import ray

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if sep and port.isdigit():
        # ray.init retries an unreachable GCS for minutes: find out at once whether anything listens there.
        try:
            socket.create_connection((host, int(port)), timeout=_RAY_PROBE_TIMEOUT_S).close()
        except OSError as exc:
            raise ConfigError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from None
    try:
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise ConfigError(
            f"cannot connect to the Ray cluster at {address!r}: {str(exc).splitlines()[0]} (is it running? "
            "a cluster started with token authentication also needs RAY_AUTH_MODE=token here)"
        ) from None


def _claim_namespace(namespace: str, detach: bool) -> None:
    """Take the run note of ``namespace`` before anything starts, or refuse: one `kvd up` per namespace on a
    machine (a second one would overwrite the first one's note, remove it on exit, and `kvd down` would then
    not find the first)."""
    mine = {"pid": os.getpid(), "endpoint": None, "detached": detach, "ray_address": None,
            "namespace": namespace, "starting": True}
    for _ in range(2):
        note = claim_run_file(namespace, mine)
        if note is None:
            return
        if _live_note(namespace) is not None:  # removes the note of a `kvd up` that no longer runs
            where = note.get("endpoint") or "starting"
            how = (f"pid {note.get('pid')}" if not note.get("detached")
                   else f"detached on Ray cluster {note.get('ray_address')}")
            raise ConfigError(
                f"a kvd is already running in namespace {namespace!r} ({how}, endpoint {where}): stop it with "
                f"`kvd down --namespace {namespace}` or pick another --namespace"
            )
    raise ConfigError(f"cannot take the run note {run_file_path(namespace)}: another `kvd up` is starting")


def _preflight(config: Config, *, detach: bool = False) -> None:
    """What can be checked before Ray starts (Ray itself takes seconds to start and minutes to give up): the
    memory asked for against this machine's, and whether the client and metrics ports are free."""
    import socket

    cluster = config.cluster
    if not cluster.address:
        total = physical_memory_bytes()
        if total is not None and cluster.memory_bytes > total:
            raise ConfigError(
                f"--memory {format_size(cluster.memory_bytes)} is more than this machine has "
                f"({format_size(total)}): ask for less (the default is 25% of it, at most 8 GiB)"
            )
    checks = []
    if not cluster.address and cluster.port:
        checks.append(("client port (--port)", "127.0.0.1" if cluster.host == "auto" else cluster.host,
                       cluster.port))
    if cluster.metrics_port and not detach:  # a detached kvd serves its metrics on the Ray head, not here
        checks.append(("metrics port (--metrics-port)", "127.0.0.1", cluster.metrics_port))
    for what, host, port in checks:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is free
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise ConfigError(f"the {what} {port} on {host} is not free: {exc.strerror} (another kvd? "
                                  "pick another port, or 0 for any)") from None


def _check_ray_memory(config: Config) -> None:
    """An embedded Ray's memory resource against what the shards will ask for: fail now, not after a timeout."""
    import ray

    from kvd.cluster.deploy import shard_memory_request

    have = ray.cluster_resources().get("memory", 0)
    need = shard_memory_request(config) * config.cluster.shards
    if have and need > have:
        raise ConfigError(
            f"{config.cluster.shards} shards of {format_size(config.shard_capacity_bytes)} need "
            f"{format_size(need)} of Ray memory with their processes, but this machine's Ray offers "
            f"{format_size(have)}: ask for less --memory"
        )


def cmd_up(args: argparse.Namespace) -> int:
    config = _load(args)
    cluster = config.cluster
    if args.detach and not cluster.address:
        raise ConfigError("--detach needs --address (an embedded Ray lives only as long as `kvd up`)")
    import ray

    from kvd.cluster.deploy import deploy, deploy_metrics, teardown
    from kvd.cluster.naming import metrics_bind_host, resolve_host

    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    deployment = None
    metrics = None
    claimed = False
    try:
        _claim_namespace(cluster.namespace, bool(args.detach))
        claimed = True
        _preflight(config, detach=bool(args.detach))
        host = _ray_init(config)
        # Ray's core installs a failure-signal handler that dumps a stack on SIGTERM: take the signals back.
        signal.signal(signal.SIGTERM, _raise_stop)
        signal.signal(signal.SIGINT, _raise_stop)
        if not cluster.address:
            _check_ray_memory(config)
        where = f"Ray cluster {cluster.address}" if cluster.address else "an embedded Ray"
        _say(f"kvd {__version__}: starting {cluster.shards} shards x {fmt_bytes(config.shard_capacity_bytes)} "
             f"on {where} (namespace {cluster.namespace!r}) ...")
        deployment = deploy(config, host=host)
        metrics_url = None
        if cluster.metrics_port and args.detach:
            # nothing of this process stays to serve them: an actor on the Ray head does, until `kvd down`
            try:
                metrics_url = deploy_metrics(cluster.namespace, cluster.metrics_port, host=host,
                                             timeout_s=cluster.ray_timeout_s * 3)
            except BaseException:
                teardown(cluster.namespace, timeout_s=cluster.ray_timeout_s)
                deployment = None
                raise
        elif cluster.metrics_port:
            bind = resolve_host(host)
            metrics = StatusMetrics(cluster.metrics_port, metrics_bind_host(bind))
            metrics_url = f"http://{bind}:{cluster.metrics_port}/metrics"
        write_run_file(cluster.namespace, {
            "pid": os.getpid(), "endpoint": deployment.endpoint, "detached": bool(args.detach),
            "ray_address": ray.get_runtime_context().gcs_address, "namespace": cluster.namespace,
            "metrics": metrics_url,
        })
        print(f"kvd endpoint: {deployment.endpoint}", flush=True)
        if metrics_url:
            _say(f"metrics: {metrics_url}" + (" (served on the Ray head until `kvd down`)" if args.detach else ""))
        if args.detach:
            _say(f"detached; stop it with `kvd down --address {cluster.address}`")
            return _EXIT_OK
        _say("Ctrl-C stops kvd")
        _watch(deployment, metrics, live=sys.stdout.isatty() and not args.quiet, quiet=args.quiet)
        return _EXIT_OK
    except _Stop as stop:
        _say(f"\nkvd: {stop}: stopping")
        return _EXIT_OK
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the teardown
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if metrics is not None:
            metrics.close()
        if ray.is_initialized():
            if not args.detach and deployment is not None:
                stopped = teardown(cluster.namespace, timeout_s=cluster.ray_timeout_s)
                _say(f"kvd: stopped {stopped} actors")
            ray.shutdown()
            if not cluster.address:
                _kill_leftovers()
        if claimed and not (args.detach and deployment is not None):
            remove_run_file(cluster.namespace, pid=os.getpid())


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _watch(deployment: Any, metrics: StatusMetrics | None, *, live: bool, quiet: bool) -> None:
    """Refresh the status line (and metrics) every second until the coordinator is gone (kvd down)."""
    import ray

    last_level = None
    while True:
        try:
            cluster = deployment.status()
        except ray.exceptions.ActorDiedError:
            _say("\nkvd: the coordinator was stopped (kvd down); exiting")
            return
        except Exception as exc:  # noqa: BLE001 - restarting coordinator: keep watching
            if live:
                print(f"\r\x1b[Kcoordinator not answering: {type(exc).__name__}", end="", flush=True)
            time.sleep(_STATUS_PERIOD_S)
            continue
        shards = deployment.shard_stats()
        if metrics is not None:
            metrics.update(cluster, shards)
        line = status_line(cluster, shards)
        if live:
            print(f"\r\x1b[K{line}", end="", flush=True)
        elif not quiet and (cluster["level"], cluster["level_epoch"]) != last_level:
            print(line, flush=True)
        last_level = (cluster["level"], cluster["level_epoch"])
        time.sleep(_STATUS_PERIOD_S)  # the refresh period of a display, not a wait for a condition


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
            ns = config.cluster.namespace
            _say(f"kvd status: no kvd is running in namespace {ns!r} on this machine (no `kvd up` of it, and "
                 f"nothing answers at {endpoint}); for a kvd elsewhere give --address ENDPOINT")
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


def _ping_endpoint(endpoint: str, timeout_s: float, curve: Any) -> tuple[str, str, float]:
    """Send ``hello`` and ``ping`` to one kvd server; ``(role, name, seconds of the ping round trip)``. Raises
    :class:`~kvd.errors.Timeout` if no reply comes within ``timeout_s`` (the error of a refused request as is)."""
    import zmq

    from kvd.errors import ProtocolError, Timeout
    from kvd.wire import protocol as p
    from kvd.wire.sockets import recv_frames, send_frames

    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply_client(sock)
        sock.connect(endpoint)  # the requests wait in the socket until the connection is up (no ZMQ_IMMEDIATE)
        deadline = time.monotonic() + timeout_s
        send_frames(sock, p.encode_request(p.HelloRequest(request_id=1)))
        replies: dict[int, Any] = {}
        sent = 0.0
        while len(replies) < 2:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(left * 1000, zmq.POLLIN):
                what = "hello" if not replies else "ping"
                raise Timeout(f"no reply from {endpoint} to {what} within {timeout_s:g} s")
            reply = p.decode_reply([f.buffer for f in recv_frames(sock)])
            if isinstance(reply, p.ErrorReply):
                raise reply.exception()
            replies[reply.request_id] = (reply, time.perf_counter())
            if reply.request_id == 1:
                sent = time.perf_counter()
                send_frames(sock, p.encode_request(p.PingRequest(request_id=2)))
        hello, (ping, answered) = replies[1][0], replies[2]
        if not isinstance(hello, p.HelloReply) or not isinstance(ping, p.PingReply):
            raise ProtocolError(f"{endpoint} answered hello and ping with {type(hello).__name__}, "
                                f"{type(ping).__name__}")
        return str(hello.role), str(hello.shard_id), answered - sent
    finally:
        sock.close(0)
        ctx.term()


def cmd_ping(args: argparse.Namespace) -> int:
    config = _load(args)
    endpoint = _endpoint_arg(args, config)
    curve = _curve_client(config)
    from kvd.errors import ShardUnavailable, Timeout

    try:
        role, name, seconds = _ping_endpoint(endpoint, args.timeout, curve)
    except (Timeout, ShardUnavailable) as exc:
        if args.address is None and _live_note(config.cluster.namespace) is None:
            _say(f"kvd ping: no kvd is running in namespace {config.cluster.namespace!r} on this machine (no "
                 f"`kvd up` of it, and nothing answers at {endpoint}); for a kvd elsewhere give --address "
                 "ENDPOINT")
            return _EXIT_ERROR
        raise exc from None
    if not args.quiet:
        print(f"{role} {name} at {endpoint}: ping {seconds * 1e3:.2f} ms")
    if not args.all_shards:
        return _EXIT_OK
    from kvd.client.sync import Client

    with Client(endpoint, timeout_s=args.timeout, curve=curve) as client:
        shards = client.topology()["shards"]
        failed = 0
        for shard in shards:
            try:
                with Client(shard["endpoint"], timeout_s=args.timeout, curve=curve) as one:
                    took = one.ping()[shard["id"]]
            except (Timeout, ShardUnavailable) as exc:
                failed += 1
                print(f"shard {shard['id']} at {shard['endpoint']}: no answer: {exc}")
                continue
            if not args.quiet:
                print(f"shard {shard['id']} at {shard['endpoint']}: ping {took * 1e3:.2f} ms")
    if role == "coordinator" and not shards:
        print("no shard is registered")
        return _EXIT_ERROR
    return _EXIT_ERROR if failed else _EXIT_OK


def cmd_down(args: argparse.Namespace) -> int:
    config = _load(args)
    ns = config.cluster.namespace
    note = _live_note(ns)
    if not config.cluster.address and note and not note.get("detached"):
        pid = int(note["pid"])
        os.kill(pid, signal.SIGTERM)  # the foreground `kvd up` owns the embedded Ray: let it tear down
        deadline = time.monotonic() + args.timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            _say(f"kvd down: `kvd up` (pid {pid}) did not exit within {args.timeout:.0f} s")
            return _EXIT_ERROR
        _say(f"kvd down: stopped the kvd of pid {pid} (namespace {ns!r})")
        return _EXIT_OK
    address = config.cluster.address or (note or {}).get("ray_address")
    if not address:
        _say(f"kvd down: no kvd found in namespace {ns!r} on this machine (use --address for a Ray cluster)")
        return _EXIT_ERROR
    import ray

    from kvd.cluster.deploy import teardown

    _ray_connect(str(address), ns)
    try:
        stopped = teardown(ns, timeout_s=config.cluster.ray_timeout_s)
    finally:
        ray.shutdown()
    remove_run_file(ns)
    _say(f"kvd down: stopped {stopped} actors in namespace {ns!r}" if stopped else f"kvd down: nothing in {ns!r}")
    return _EXIT_OK if stopped else _EXIT_ERROR


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


def build_parser() -> argparse.ArgumentParser:
    memory = format_size(default_memory_bytes())
    parser = argparse.ArgumentParser(
        prog="kvd",
        description="kvd: a distributed cache for the attention KV cache of LLM inference.",
        epilog="Start with `kvd up`; `kvd VERB --help` explains each verb.",
    )
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")

    up = verbs.add_parser(
        "up", help="start kvd (embedded Ray by default) and show its status",
        description="Start a coordinator and shards, print the client endpoint and a live status line; Ctrl-C "
        "or SIGTERM stops everything. With no arguments: an embedded local Ray, 2 shards sharing "
        f"--memory (default 25% of this machine's memory, at most 8 GiB: here {memory}), client "
        f"endpoint tcp://127.0.0.1:{DEFAULT_PORT}.",
    )
    _common(up)
    up.add_argument("--address", dest="ray_address", metavar="RAY",
                    help='join a Ray cluster instead: "auto" (started with `ray start`/`ray up` on this machine) '
                    'or "ray://head:10001"; shards are spread over its nodes')
    up.add_argument("--shards", type=int, help="number of shards (default 2)")
    up.add_argument("--memory", help=f"total KV memory over all shards, e.g. 8GiB (default here: {memory})")
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
    up.add_argument("--detach", action="store_true",
                    help="with --address: leave kvd running on the cluster and exit (stop it with `kvd down`); "
                    "metrics (--metrics-port) are then served on the Ray head")
    up.add_argument("--quiet", action="store_true", help="no status output (only the endpoint line)")
    up.set_defaults(func=cmd_up)

    status = verbs.add_parser(
        "status", help="per-shard table: level, epoch, pressure, bytes per level, tokens, ...",
        description="Ask a running kvd for every shard's figures. Exit status 1 if a shard does not answer.",
    )
    _common(status)
    status.add_argument("--address", metavar="ENDPOINT",
                        help=f"coordinator endpoint (default: the local `kvd up`, else tcp://127.0.0.1:{DEFAULT_PORT})")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds per request (default 5)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(func=cmd_status)

    bench = verbs.add_parser(
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

    ping = verbs.add_parser(
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

    down = verbs.add_parser(
        "down", help="stop a running kvd",
        description="Stop the kvd of --namespace: the local `kvd up` process (embedded Ray), or the detached "
        "actors on the Ray cluster given by --address.",
    )
    _common(down)
    down.add_argument("--address", dest="ray_address", metavar="RAY", help='Ray cluster ("auto", "ray://...")')
    down.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for it to stop (default 30)")
    down.set_defaults(func=cmd_down)

    keygen = verbs.add_parser(
        "keygen", help="write CURVE key pairs for encrypted, authenticated ZeroMQ",
        description="Write NAME.key (public) and NAME.key_secret (secret, mode 0600) into DIR for each --name.",
    )
    keygen.add_argument("dir", metavar="DIR", help="directory to write the keys to (created if missing)")
    keygen.add_argument("--name", action="append", default=None, help="key pair names (default: server, client)")
    keygen.set_defaults(func=cmd_keygen)

    cfg = verbs.add_parser("config", help="print the effective settings (or --describe all of them)",
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
