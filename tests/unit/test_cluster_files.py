"""The deployment files in cluster/ agree with each other and with kvd (issue 18, item 13): the example kvd.toml,
the Ray cluster launcher YAML and the KubeRay manifest (its ConfigMap holds the kvd.toml the head pod runs with)
name the same shards, sizes and ports; what each node offers Ray fits in the node and holds what a shard asks Ray
for; every `ray start` of a token-authenticated cluster has the token; the head pod has a liveness probe.

Only files are read here: nothing is deployed. The YAMLs are parsed (PyYAML comes with Ray), kvd.toml through
kvd's own loader, so a key kvd does not know fails here as it would fail `kvd up`."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvd.cluster.deploy import shard_memory_request
from kvd.config import load_config
from kvd.config.parsers import parse_size

pytestmark = pytest.mark.backend_independent  # manifests and settings: no kernel, no compiled module

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"
GIB = 1 << 30

# What Ray's own processes on a node (raylet, GCS on the head, dashboard and runtime-env agents, log monitor) and
# the container around them need beside the `memory` and object store Ray hands out: kept free of both.
RAY_DAEMONS_BYTES = 1 * GIB
# Memory of the launcher's instance types (AWS), for the check that Ray's share fits the machine.
INSTANCE_MEMORY = {"m6i.large": 8 * GIB, "r6i.xlarge": 32 * GIB}


def _kube_quantity(text: Any) -> int:
    """A Kubernetes memory quantity ("24Gi", "512Mi", "8G", plain bytes) in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9,
             "T": 10**12}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text).strip())
    assert m and (not m.group(2) or m.group(2) in units), f"not a memory quantity: {text!r}"
    return int(m.group(1)) * units.get(m.group(2), 1)


@pytest.fixture(scope="module")
def toml_config() -> Any:
    return load_config(CLUSTER / "kvd.toml", env={})


@pytest.fixture(scope="module")
def kuberay() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((CLUSTER / "kuberay-raycluster.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def kuberay_config(kuberay: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("configmap") / "kvd.toml"
    path.write_text(kuberay["ConfigMap"]["data"]["kvd.toml"])
    return load_config(path, env={})


@pytest.fixture(scope="module")
def launcher() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    return loaded


def _ray_start_flags(command: str) -> dict[str, str]:
    """``--key=value`` / ``--key value`` flags of the `ray start` in a shell command line."""
    words = shlex.split(command.split("ray start", 1)[1].split(";")[0].split("&&")[0])
    flags: dict[str, str] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            key, sep, value = word[2:].partition("=")
            if not sep and i + 1 < len(words) and not words[i + 1].startswith("--"):
                value = words[i + 1]
                i += 1
            flags[key] = value if (sep or value) else "true"
        i += 1
    return flags


def _start_command(commands: list[str]) -> str:
    found = [c for c in commands if "ray start" in c]
    assert len(found) == 1, commands
    return found[0]


def _groups(kuberay: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = kuberay["RayCluster"]["spec"]
    return {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}


def _container(group: dict[str, Any]) -> dict[str, Any]:
    containers = group["template"]["spec"]["containers"]
    assert len(containers) == 1, containers
    container: dict[str, Any] = containers[0]
    return container


# ------------------------------------------------------------------------------------------- one sizing


def test_the_example_kvd_toml_confines_shards_to_a_port_range(toml_config: Any) -> None:
    assert toml_config.cluster.shard_port_range is not None, "cluster/kvd.toml sets no cluster.shard_ports"
    low, high = toml_config.cluster.shard_port_range
    assert high - low + 1 >= toml_config.cluster.shards  # room for every shard (and restarts)


def test_the_kuberay_configmap_is_the_example_kvd_toml(toml_config: Any, kuberay_config: Any) -> None:
    for key in ("shards", "memory_bytes", "port", "shard_ports", "metrics_port", "shard_cpus", "address"):
        assert getattr(kuberay_config.cluster, key) == getattr(toml_config.cluster, key), key
    assert kuberay_config.shard_capacity_bytes == toml_config.shard_capacity_bytes


def test_every_comment_on_the_shard_size_says_what_kvd_toml_gives_each_shard(toml_config: Any) -> None:
    per_shard = toml_config.shard_capacity_bytes
    shards = toml_config.cluster.shards
    seen = 0
    for name in ("kvd.toml", "ray-cluster.yaml", "kuberay-raycluster.yaml", "README.md"):
        text = (CLUSTER / name).read_text()
        for m in re.finditer(r"(\d+) shards? x (\d+(?:\.\d+)?) ?GiB", text):
            assert (int(m.group(1)), float(m.group(2)) * GIB) == (shards, per_shard), f"{name}: {m.group(0)!r}"
            seen += 1
        for m in re.finditer(r"(\d+(?:\.\d+)?) GiB of KV", text):
            assert float(m.group(1)) * GIB == per_shard, f"{name}: {m.group(0)!r}"
            seen += 1
    assert seen >= 4  # kvd.toml, both YAMLs and the README each say it


def test_the_shard_port_range_is_the_one_the_yamls_tell_operators_to_open(toml_config: Any,
                                                                           kuberay: dict[str, Any]) -> None:
    wanted = toml_config.cluster.shard_ports
    for name in ("ray-cluster.yaml", "kuberay-raycluster.yaml", "README.md"):
        ranges = set(re.findall(r"\b(\d{4,5}-\d{4,5})\b", (CLUSTER / name).read_text()))
        assert ranges == {wanted}, f"{name} names the shard ports {ranges}, kvd.toml {wanted!r}"
    worker = _container(_groups(kuberay)["shards"])
    assert [p["containerPort"] for p in worker["ports"]] == [toml_config.cluster.shard_port_range[0]]


def test_the_head_pod_and_its_service_expose_the_client_and_metrics_ports(toml_config: Any,
                                                                          kuberay: dict[str, Any]) -> None:
    head = _container(_groups(kuberay)["head"])
    ports = {p["containerPort"] for p in head["ports"]}
    assert {toml_config.cluster.port, toml_config.cluster.metrics_port} <= ports
    assert head["readinessProbe"]["tcpSocket"]["port"] == toml_config.cluster.port
    service = {(p["port"], p["targetPort"]) for p in kuberay["Service"]["spec"]["ports"]}
    assert service == {(toml_config.cluster.port,) * 2, (toml_config.cluster.metrics_port,) * 2}


# ------------------------------------------------------------------------------------- memory per node


def test_each_kuberay_pod_offers_ray_no_more_memory_than_its_limit(toml_config: Any,
                                                                   kuberay: dict[str, Any]) -> None:
    for name, group in _groups(kuberay).items():
        params = group["rayStartParams"]
        resources = _container(group)["resources"]
        limit = _kube_quantity(resources["limits"]["memory"])
        assert _kube_quantity(resources["requests"]["memory"]) == limit, name  # no overcommit of a cache
        # KubeRay passes the whole limit as --memory unless told otherwise; the object store comes on top
        assert "memory" in params and "object-store-memory" in params, f"{name}: {params}"
        ray_memory, store = int(params["memory"]), int(params["object-store-memory"])
        assert ray_memory + store + RAY_DAEMONS_BYTES <= limit, (
            f"{name}: Ray memory {ray_memory / GIB:.2f} GiB + object store {store / GIB:.2f} GiB + "
            f"{RAY_DAEMONS_BYTES / GIB:.0f} GiB for Ray's daemons > the container limit {limit / GIB:.2f} GiB")


def test_one_shard_fits_each_kuberay_worker_pod_and_none_lands_on_the_head(toml_config: Any,
                                                                           kuberay: dict[str, Any]) -> None:
    need = shard_memory_request(toml_config)
    groups = _groups(kuberay)
    workers = groups["shards"]
    ray_memory = int(workers["rayStartParams"]["memory"])
    assert ray_memory // need == 1, f"Ray memory {ray_memory / GIB:.2f} GiB per pod, a shard asks {need / GIB:.2f}"
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == toml_config.cluster.shards
    cpus = _container(workers)["resources"]["limits"]["cpu"]
    assert float(cpus) >= toml_config.cluster.shard_cpus
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0" and toml_config.cluster.shard_cpus > 0


def test_each_launcher_node_offers_ray_what_fits_the_machine_and_one_shard(toml_config: Any,
                                                                          launcher: dict[str, Any]) -> None:
    need = shard_memory_request(toml_config)
    types = launcher["available_node_types"]
    for kind, commands in (("head", launcher["head_start_ray_commands"]),
                           ("worker", launcher["worker_start_ray_commands"])):
        node_type = types[launcher["head_node_type"]] if kind == "head" else types["ray.worker.kvd"]
        machine = INSTANCE_MEMORY[node_type["node_config"]["InstanceType"]]
        flags = _ray_start_flags(_start_command(commands))
        assert "memory" in flags and "object-store-memory" in flags, f"{kind}: {flags}"
        ray_memory, store = int(flags["memory"]), int(flags["object-store-memory"])
        assert ray_memory + store + RAY_DAEMONS_BYTES <= machine, kind
        if kind == "worker":
            assert ray_memory // need == 1, f"Ray memory {ray_memory / GIB:.2f} GiB, a shard asks {need / GIB:.2f}"
    workers = types["ray.worker.kvd"]
    assert workers["min_workers"] == workers["max_workers"] == toml_config.cluster.shards
    assert types[launcher["head_node_type"]]["resources"].get("CPU") == 0


def test_a_shard_asks_ray_for_its_store_its_warm_cache_and_its_process() -> None:
    # the warm buffers of large gets are kept outside the store's capacity (kvd.toml says so): Ray must count them,
    # or a node offering Ray exactly what the shards ask for is over its memory by that much per shard
    small = load_config(env={}, overrides={"cluster.memory_bytes": "64MiB", "cluster.shards": 1,
                                           "store.warm_cache_bytes": "256MiB"})
    need = shard_memory_request(small)
    assert need >= small.shard_capacity_bytes + small.store.warm_cache_bytes + parse_size("256MiB")


# ------------------------------------------------------------------------------------ token authentication


def test_every_kuberay_ray_container_has_the_same_token(kuberay: dict[str, Any]) -> None:
    refs = set()
    for name, group in _groups(kuberay).items():
        env = {e["name"]: e for e in _container(group).get("env", [])}
        assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{name}: RAY_AUTH_MODE=token missing"
        ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
        assert ref, f"{name}: RAY_AUTH_TOKEN is not taken from a Secret"
        refs.add((ref["name"], ref["key"]))
    assert len(refs) == 1, refs


def test_every_launcher_ray_start_has_token_mode_and_every_node_the_token(launcher: dict[str, Any]) -> None:
    # a worker's `ray start` does not turn token mode on by itself (only the head's does, when it finds a token)
    for kind in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = _start_command(launcher[kind])
        assert re.search(r"\bRAY_AUTH_MODE=token\b", start), f"{kind}: {start}"
    assert "~/.ray/auth_token" in launcher["file_mounts"], launcher["file_mounts"]


# ------------------------------------------------------------------------------------------- liveness


def test_the_head_pod_has_a_liveness_probe_that_pings_kvd(kuberay: dict[str, Any], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from kvd.cli.main import _load, build_parser

    for name in [n for n in os.environ if n.startswith("KVD_")]:
        monkeypatch.delenv(name)  # the pod's environment has none of this runner's

    head = _container(_groups(kuberay)["head"])
    probe = head.get("livenessProbe")
    assert probe, "the head pod has no livenessProbe"
    command = probe["exec"]["command"]
    assert command[:2] == ["kvd", "ping"], command
    # the probe's command line is one `kvd` takes, with the settings `kvd up` runs with (the ConfigMap's file)
    mount = {m["name"]: m["mountPath"] for m in head["volumeMounts"]}["kvd-config"]
    (tmp_path / "kvd.toml").write_text(kuberay["ConfigMap"]["data"]["kvd.toml"])
    argv = [a.replace(f"{mount}/kvd.toml", str(tmp_path / "kvd.toml")) for a in command[1:]]
    assert argv != command[1:], f"the probe does not read {mount}/kvd.toml: {command}"
    args = build_parser().parse_args(argv)
    assert args.func.__name__ == "cmd_ping" and args.address is None  # the endpoint `kvd up` noted in the pod
    _load(args)
    # patient enough for a coordinator restart (Ray brings it back on the head within seconds)
    assert probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10) >= 30, probe
