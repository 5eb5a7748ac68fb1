"""``kvd up`` and ``kvd down``: start a coordinator and shards on an embedded or existing Ray (checks
before Ray starts, loopback-only embedded Ray, signals, leftovers), watch them, and stop them."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Collection
from typing import Any

from kvd import __version__
from kvd.cli.common import (
    _EMBEDDED_OBJECT_STORE_BYTES,
    _EXIT_ERROR,
    _EXIT_OK,
    _RAY_PROBE_TIMEOUT_S,
    _STATUS_PERIOD_S,
    _alive,
    _live_note,
    _load,
    _raise_stop,
    _say,
    _Stop,
)
from kvd.cli.reaper import Reaper
from kvd.cli.status import fmt_bytes, status_line
from kvd.cluster.metrics import StatusMetrics
from kvd.config.settings import (
    Config,
    claim_run_file,
    format_size,
    physical_memory_bytes,
    remove_run_file,
    run_file_path,
    write_run_file,
)
from kvd.errors import ConfigError


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
    # SIGINT is held here too: a stop raised inside ray.init left its processes running, unknown to
    # ray.is_initialized(), and once crashed the interpreter. A signal that came meanwhile is taken when the mask
    # is restored, by kvd's handlers (Ray's core installs its own: they are put back first), once Ray is whole.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        ray.init(address="local", num_cpus=cpus, namespace=cluster.namespace, include_dashboard=False,
                 object_store_memory=_EMBEDDED_OBJECT_STORE_BYTES, logging_level=logging.WARNING,
                 log_to_driver=False, **node_ip)
        _no_graceful_ray_kill()
    finally:
        signal.signal(signal.SIGTERM, _raise_stop)
        signal.signal(signal.SIGINT, _raise_stop)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
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


def _kill_leftovers(timeout_s: float = 5.0, *, keep: Collection[int] = ()) -> int:
    """SIGKILL and reap every child this process still has after ray.shutdown() (adopted Ray agents, workers
    that outlived their raylet), but ``keep`` (the reaper); returns how many there were. `kvd up` starts no other
    child processes."""
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
        if ppid == me and int(entry) not in keep:
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
        raise ConfigError("--detach needs --ray-address (an embedded Ray lives only as long as `kvd up`)")
    import ray

    from kvd.cluster.deploy import deploy, deploy_metrics, teardown
    from kvd.cluster.naming import metrics_bind_host, resolve_host

    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    deployment = None
    metrics = None
    claimed = False
    reaper = None
    try:
        _claim_namespace(cluster.namespace, bool(args.detach))
        claimed = True
        _preflight(config, detach=bool(args.detach))
        if not cluster.address:  # an embedded Ray: whatever ends `kvd up`, none of its processes may outlive it
            reaper = Reaper(str(run_file_path(cluster.namespace)))
            reaper.mark()
        host = _ray_init(config)
        # Ray's core installs a failure-signal handler that dumps a stack on SIGTERM: take the signals back.
        signal.signal(signal.SIGTERM, _raise_stop)
        signal.signal(signal.SIGINT, _raise_stop)
        if not cluster.address:
            _check_ray_memory(config)
        where = f"Ray cluster {cluster.address}" if cluster.address else "an embedded Ray"
        _say(f"kvd {__version__}: starting {cluster.shards} shards x {fmt_bytes(config.shard_capacity_bytes)} "
             f"on {where} (namespace {cluster.namespace!r}) ...")
        deployment = deploy(config, host=host, fresh=bool(getattr(args, "fresh", False)))
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
            _say(f"detached; stop it with `kvd down --ray-address {cluster.address}`")
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
        if reaper is not None:  # also when ray.init failed half-way: what it started is our child or marked
            _kill_leftovers(keep=(reaper.pid,))
            reaper.close()
        if claimed and not (args.detach and deployment is not None):
            remove_run_file(cluster.namespace, pid=os.getpid())


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
        _say(f"kvd down: no kvd found in namespace {ns!r} on this machine (use --ray-address for a Ray cluster)")
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
