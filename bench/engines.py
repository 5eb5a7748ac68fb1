"""What a user of an inference engine sees with kvd: time to first token (vLLM) and output quality (transformers)
per precision level. SmolLM2-135M-Instruct, fp32, CPU; run in the engine venv (bin/engines-env).

    .venv-engines/bin/python bench/engines.py ttft     [--tokens 1906] [--rounds 5] [--levels fp16,q8,q4]
    .venv-engines/bin/python bench/engines.py quality  [--prefix 1024] [--cont 256] [--gen 128] [--configs ...]
    .venv-engines/bin/python bench/engines.py decode   [--context 8128] [--gen 64] [--levels fp16,q4]

ttft: one vLLM engine in this process (vLLM's own prefix cache off) with KvdConnector, a kvd shard server in a
child process whose level is switched between phases. "recompute": prompts whose first block is new each round
(a miss: one lookup round trip, the prefill, and the copy-out of the new blocks for the asynchronous save).
"kvd <level>": a prompt stored at that level once, then asked again every round (all full blocks loaded).
TTFT = wall time of ``generate(max_tokens=1)``; medians over the rounds, which interleave the cases; saves are
flushed after every request.

--disk adds "kvd disk <level>" for each level: a prompt stored at that level whose blocks the shard then moves to
its disk tier (a directory under /var/tmp), with the page cache of their files dropped before every round, so
each such hit reads the blocks back from the disk.

--floor adds an engine with vLLM's own prefix cache on and no connector, the same prompt asked every round: a
hit that loads nothing (the same forward pass over the uncached tail), so TTFT minus it is what each store adds.

--mooncake adds Mooncake Store through vLLM's own MooncakeStoreConnector, in its own engine process (the two
engines never run at once): mooncake_master and, by default, a mooncake_client storage process (standalone-store
mode, the deployment comparable to a kvd server) on 127.0.0.1; ``--mooncake-mode embedded`` keeps the pool in
the engine process instead.

quality: for several real texts found on every Debian machine (licenses, Python's own reference docs), the
first ``--prefix`` tokens' KV (the model's, fp32) is stored in kvd at a level and loaded back into a
KvdCache; the next ``--cont`` tokens are then scored with it (teacher forcing). Reference: the same KV rounded
to fp16 (what kvd's fp16 level stores). Reported: KL(reference || level) of the next-token distributions
(mean over positions and texts), perplexity of the continuation, top-1 agreement, in free generation the
number of the ``--gen`` greedy tokens produced before the first one that differs from the reference, and the bits
per stored value as the store counts them (``used_bytes``). The row "q4 calibrated" first gives the namespace the
calibration made from ``--sample`` (the shared SmolLM2 sample by default) at the default budgets
(:mod:`kvd.calibration`), so its pages keep the heads that calibration holds at 8 bits; with the shared sample,
which is the start of GPL-3, every row is then measured on texts without GPL-3 (another chapter of Python's
reference instead). ``--configs`` picks rows.

decode: a ``--context``-token context (real texts) prefilled once and stored in kvd at a level as one sequence,
then a greedy decode of ``--gen`` tokens over it through transformers, two ways: "load" (``KvdCache.resume``: the
whole context comes over the wire into the local cache, then the model decodes locally) and "attend"
(``KvdCache.resume(attend=True)`` with ``attn_implementation="kvd"``: the context stays in kvd and every layer
of every step sends its queries there). Reported: the load time, decode tokens/s, end-to-end tokens/s (load
included), bytes on the wire per generated token (the shard's bytes in + out over the whole run, divided by
``--gen``), and whether the two produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---- a kvd shard server in a child process, level switchable ----------------------------------------------------


def _shard_server_class() -> Any:
    from kvd.wire.server import ShardServer

    return ShardServer


def _serve(conn: Any, level: str, store_kwargs: dict[str, Any]) -> None:
    from kvd.store import Store
    from kvd.store.disk import files

    store = Store(2 << 30, **store_kwargs)
    store.set_level(level, 1)
    # No background compaction: it would re-encode the prompts stored at fp16 and q8 once the level rises to q4
    # (and compete for the CPU during the rounds); each prompt must stay at the level it was stored at.
    server = _shard_server_class()(store, shard_id="bench-0", compact_budget_bytes=0)
    conn.send(server.start())
    epoch = 1
    marked: set[Any] = set()
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            server.stop()
            store.close(persist=False)
            conn.send("stopped")
            return
        if cmd == "mark":  # remember the sequences held now
            marked = set(store._seqs)  # noqa: SLF001 - the bench's own shard
            conn.send(len(marked))
        elif cmd == "spill":  # move every sequence stored since the mark to disk
            with store._lock:  # noqa: SLF001
                new = [seq for key, seq in store._seqs.items() if key not in marked]  # noqa: SLF001
                for seq in new:
                    store._spill(seq, wait_s=60)  # noqa: SLF001
            store.flush()
            conn.send(len(new))
        elif cmd == "used":  # the bytes the store holds, as it counts them
            conn.send(store.stats()["used_bytes"])
        elif isinstance(cmd, tuple) and cmd[0] == "calibrate":  # ("calibrate", namespace, record)
            conn.send(store.calibrate(cmd[1], cmd[2]))
        elif cmd == "drop_cache":  # the next reads of spilled blocks come from the disk, not the page cache
            for path, _ in files.scan(store.stats()["disk_path"]):
                files.drop_cache(path)
            conn.send(True)
        else:
            epoch += 1
            conn.send(store.set_level(cmd, epoch))


class Server:
    def __init__(self, level: str = "fp16", **store_kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, level, store_kwargs), daemon=True)
        self.proc.start()
        self.endpoint: str = self._conn.recv()

    def set_level(self, level: str) -> None:
        self.ask(level)

    def ask(self, cmd: Any) -> Any:
        self._conn.send(cmd)
        return self._conn.recv()

    def stop(self) -> None:
        self._conn.send("stop")
        self._conn.recv()
        self.proc.join(10)


# ---- texts ------------------------------------------------------------------------------------------------------


def texts() -> dict[str, str]:
    """Real English text that every Debian machine with Python has: long, not chosen for or tuned on kvd."""
    import pydoc_data.topics as topics

    out = {}
    for name in ("GPL-3", "Apache-2.0", "MPL-2.0"):
        path = Path("/usr/share/common-licenses") / name
        if path.is_file():
            out[name] = path.read_text()
    for name in ("datamodel", "compound", "execmodel"):
        if name in topics.topics:
            out[f"python:{name}"] = topics.topics[name]
    return out


# ---- ttft -------------------------------------------------------------------------------------------------------


def _engine(conn: Any, model: str, kind: str, extra: dict[str, Any], env: dict[str, str]) -> None:
    """One vLLM engine in a process of its own (vLLM keeps its connector in a process global), answering
    ("gen", ids) -> (seconds, cached tokens), ("flush",), ("counters",), ("tokenize", text), ("stop",)."""
    os.environ.update(env)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv: Any = None  # "local": no connector, vLLM's own prefix cache (the floor: a hit that costs no load)
    if kind == "kvd":
        kv = KVTransferConfig(kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config=extra)
    elif kind == "mooncake":
        kv = KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                              kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=kind == "local", seed=0,
              max_model_len=4096, kv_transfer_config=kv)
    started = time.perf_counter() - t0
    connector = None
    if kind == "kvd":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    conn.send(started)
    while True:
        cmd = conn.recv()
        if cmd[0] == "gen":
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": cmd[1]}], sp, use_tqdm=False)[0]
            conn.send((time.perf_counter() - t, out.num_cached_tokens or 0))
        elif cmd[0] == "flush":
            if connector is not None:
                connector.wait_saves(60)
            elif kind == "mooncake":
                time.sleep(1.0)  # Mooncake's saves: no public wait; they take well under a second here
            conn.send(True)
        elif cmd[0] == "counters":
            conn.send(dict(connector.counters) if connector is not None else {})
        elif cmd[0] == "tokenize":
            conn.send(llm.get_tokenizer()(cmd[1]).input_ids)
        else:
            conn.send(True)
            return


class Engine:
    def __init__(self, model: str, kind: str, extra: dict[str, Any], env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine, args=(child, model, kind, extra, env or {}), daemon=True)
        self.proc.start()
        self.start_s: float = self._conn.recv()

    def ask(self, *cmd: Any) -> Any:
        self._conn.send(cmd)
        return self._conn.recv()

    def once(self, ids: list[int]) -> tuple[float, int]:
        result = self.ask("gen", ids)
        self.ask("flush")
        return result

    def stop(self) -> None:
        self.ask("stop")
        self.proc.join(30)


class Mooncake:
    """mooncake_master (and, in ``standalone-store`` mode, a mooncake_client storage process holding the pool)
    on 127.0.0.1, with the JSON config vLLM's MooncakeStoreConnector reads from $MOONCAKE_CONFIG_PATH. In
    ``embedded`` mode the engine process contributes the memory itself (a local copy on a hit)."""

    def __init__(self, workdir: Path, mode: str, port: int = 50551) -> None:
        master = shutil.which("mooncake_master") or str(Path(sys.executable).with_name("mooncake_master"))
        if not Path(master).is_file():
            raise FileNotFoundError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda "
                                    "(and apt-get install libibverbs1)")
        self.dir = Path(tempfile.mkdtemp(dir=workdir))
        self.log = open(self.dir / "mooncake.log", "w")  # noqa: SIM115 - closed in stop()
        self.procs = [subprocess.Popen([master, "-rpc_address", "127.0.0.1", "-rpc_port", str(port),
                                        "-metrics_port", str(port + 1)], stdout=self.log, stderr=self.log)]
        time.sleep(2.0)
        if mode == "standalone-store":
            client = str(Path(master).with_name("mooncake_client"))
            self.procs.append(subprocess.Popen(
                [client, "-host", "127.0.0.1", "-port", str(port + 2), "-master_server_address",
                 f"127.0.0.1:{port}", "-metadata_server", "P2PHANDSHAKE", "-protocol", "tcp",
                 "-global_segment_size", "2 GB"], stdout=self.log, stderr=self.log))
            time.sleep(2.0)
        self.config = self.dir / "mooncake.json"
        self.config.write_text(json.dumps({
            "metadata_server": "P2PHANDSHAKE", "master_server_address": f"127.0.0.1:{port}", "protocol": "tcp",
            "device_name": "", "mode": mode, "global_segment_size": "2GB" if mode == "embedded" else 0,
            "local_buffer_size": "512MB"}))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            proc.wait(10)
        self.log.close()


def ttft(args: argparse.Namespace) -> None:
    from kvd.integrations.model import build_model_folder

    model = str(build_model_folder(args.cache))
    disk_dir = tempfile.mkdtemp(prefix="kvd-engines-disk-", dir="/var/tmp") if args.disk else None
    server = Server("fp16", **({"disk_path": disk_dir, "disk_bytes": 8 << 30} if disk_dir else {}))
    kvd = Engine(model, "kvd", {"kvd_endpoint": server.endpoint, "kvd_format": args.format})
    print(f"engine start, kvd connector: {kvd.start_s:.1f} s")
    mooncake = mc_engine = None
    if args.mooncake:
        mooncake = Mooncake(Path(tempfile.gettempdir()), args.mooncake_mode)
        loopback = {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1"}
        mc_engine = Engine(model, "mooncake", {}, {"MOONCAKE_CONFIG_PATH": str(mooncake.config), **loopback})
        print(f"engine start, Mooncake connector ({args.mooncake_mode}): {mc_engine.start_s:.1f} s")
    local = Engine(model, "local", {}) if args.floor else None
    body = kvd.ask("tokenize", "\n\n".join(texts().values()))

    def prompt(tag: str) -> list[int]:
        head = kvd.ask("tokenize", f"Document {tag}. Read it and answer the question at the end.\n")
        return head + body[: args.tokens - len(head) - 8] + kvd.ask("tokenize", "\nQuestion: what is it?")[:8]

    kvd.once(prompt("warm-up"))
    levels = args.levels.split(",")
    stored = {}
    for level in levels:  # each prompt is sealed at its level when it is first computed and saved
        server.set_level(level)
        stored[level] = prompt(f"stored-{level}")
        kvd.once(stored[level])
    cases: dict[str, tuple[Engine, Any]] = {"recompute": (kvd, None), **{f"kvd {lv}": (kvd, stored[lv])
                                                                          for lv in levels}}
    if disk_dir is not None:
        for level in levels:
            server.set_level(level)
            server.ask("mark")
            stored[f"disk {level}"] = prompt(f"stored-disk-{level}")
            kvd.once(stored[f"disk {level}"])
            print(f"kvd disk {level}: {server.ask('spill')} blocks moved to disk")
            cases[f"kvd disk {level}"] = (kvd, stored[f"disk {level}"])
    if mc_engine is not None:
        mc_engine.once(prompt("warm-up"))
        stored["mooncake"] = prompt("stored-mooncake")
        mc_engine.once(stored["mooncake"])
        cases["mooncake"] = (mc_engine, stored["mooncake"])
    if local is not None:
        local.once(prompt("warm-up"))
        stored["local"] = prompt("stored-local")
        local.once(stored["local"])
        cases["vLLM's own cache"] = (local, stored["local"])
    # Rounds interleave the cases (one engine runs at a time), so that a load change on a shared machine hits
    # every case alike.
    times: dict[str, list[tuple[float, int]]] = {name: [] for name in cases}
    for r in range(args.rounds):
        for name, (eng, ids) in cases.items():
            if name.startswith("kvd disk"):
                server.ask("drop_cache")
            times[name].append(eng.once(ids if ids is not None else prompt(f"miss-{r}")))
    rows = [(name, statistics.median(t for t, _ in ts), min(c for _, c in ts)) for name, ts in times.items()]
    base = rows[0][1]
    print(f"\nTTFT, {args.tokens}-token prompt, fp32, block 128, kvd format={args.format}, "
          f"medians of {args.rounds} interleaved rounds")
    # On a shared machine the medians carry other processes' load; the minimum over rounds estimates the
    # uncontended cost. Both are printed.
    print(f"{'case':<14} {'TTFT ms':>9} {'x recompute':>12} {'min ms':>8} {'tokens loaded':>14}")
    for name, t, cached in rows:
        raw = " ".join(f"{x * 1000:.0f}" for x, _ in times[name])
        best = min(x for x, _ in times[name])
        print(f"{name:<14} {t * 1000:>9.0f} {t / base:>12.3f} {best * 1000:>8.0f} {cached:>14}   rounds: {raw}")
    if mc_engine is not None:
        mc = next(t for n, t, _ in rows if n == "mooncake")
        mc_best = min(x for x, _ in times["mooncake"])
        for name, t, _ in rows:
            if name.startswith("kvd"):
                best = min(x for x, _ in times[name])
                print(f"{name}: TTFT ratio Mooncake / kvd = {mc / t:.2f} (medians), {mc_best / best:.2f} (minima)")
    if local is not None:
        # What a store adds to a hit: TTFT minus vLLM's own cached hit of the same blocks (same forward pass
        # over the uncached tail, no load at all).
        floor = next(t for n, t, _ in rows if n == "vLLM's own cache")
        for name, t, _ in rows:
            if name.startswith(("kvd", "mooncake")):
                print(f"{name}: load overhead over vLLM's own cache {1000 * (t - floor):.0f} ms (medians)")
    print(f"kvd connector counters (worker): {kvd.ask('counters')}")
    kvd.stop()
    if local is not None:
        local.stop()
    if mc_engine is not None and mooncake is not None:
        mc_engine.stop()
        mooncake.stop()
    server.stop()
    if disk_dir is not None:
        shutil.rmtree(disk_dir, ignore_errors=True)


# ---- quality ----------------------------------------------------------------------------------------------------

# (name, level, sink_tokens, window_tokens, sink_raw); "calibrated": the namespace calibrated (--sample)
CONFIGS = [
    ("fp16", "fp16", 4, 0, False),
    ("q8", "q8", 4, 0, False),
    ("q4 sink4", "q4", 4, 0, False),
    ("q4 sink4 fp16", "q4", 4, 0, True),
    ("q4 calibrated", "q4", 4, 0, False),
    ("q4 sink4 win128", "q4", 4, 128, False),
    ("q4 sink1 win128", "q4", 1, 128, False),
    ("q4 sink0", "q4", 0, 0, False),
]


def quality(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from kvd.client import Client
    from kvd.evaluate import sample_path
    from kvd.integrations.model import build_model_folder
    from kvd.integrations.transformers import KvdCache

    torch.set_num_threads(max(1, args.threads))
    folder = build_model_folder(args.cache)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    need = args.prefix + args.cont
    found = texts()
    configs = [c for c in CONFIGS if not args.configs or c[0] in args.configs.split(",")]
    if any("calibrated" in c[0] for c in configs) and not args.sample:
        # the shared sample is the start of GPL-3: a calibrated row is measured on other text only, every row alike
        import pydoc_data.topics as topics

        found.pop("GPL-3", None)
        found["python:specialnames"] = topics.topics["specialnames"]
    docs = {k: ids for k, v in found.items() if len(ids := tok(v).input_ids) >= need}
    print(f"texts: {', '.join(docs)} ({args.prefix} prefix + {args.cont} scored tokens each)")

    def scored(cache: Any, cont: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(cont, past_key_values=cache, use_cache=True).logits[0].float().log_softmax(-1)

    def gen(cache: Any, ids: torch.Tensor) -> list[int]:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=args.gen, min_new_tokens=args.gen, do_sample=False,
                                 pad_token_id=model.config.eos_token_id or 0)
        return out[0, ids.shape[1]:].tolist()

    def prefill(ids: torch.Tensor) -> Any:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        return cache

    def fp16_copy(cache: Any) -> Any:
        out = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.layers):
            out.update(layer.keys.half().float(), layer.values.half().float(), i)
        return out

    refs = {}
    for name, ids in docs.items():
        pre = torch.tensor([ids[: args.prefix]])
        cont = torch.tensor([ids[args.prefix: need]])
        full = prefill(pre)
        ref_lp = scored(fp16_copy(full), cont)
        gen_ids = torch.tensor([ids[: args.prefix + 1]])
        refs[name] = (pre, cont, full, ref_lp, gen(fp16_copy(full), gen_ids))

    record = None
    if any("calibrated" in c[0] for c in configs):
        from kvd import calibration as cal

        t0 = time.perf_counter()
        made = cal.calibrate(cal.load_sample(args.sample or sample_path()))
        record = made.to_dict()
        layers, heads, _ = made.layout
        print(f"calibration {made.digest[:16]} from {args.sample or sample_path()} "
              f"({time.perf_counter() - t0:.0f} s): " + "; ".join(
                  f"{lv}: budget {p.budget:.1%}, eps_O on the sample {p.mean:.2%} mean, "
                  f"{p.protected} of {layers * heads * 2} head tensors held"
                  + (f", off ({p.off})" if p.off else "") for lv, p in made.plans.items()))
    values = sum(args.prefix * 2 * model.config.num_hidden_layers * model.config.num_key_value_heads
                 * (model.config.hidden_size // model.config.num_attention_heads) for _ in refs)
    print(f"\n{'config':<18} {'KL mean':>9} {'KL max':>9} {'ppl':>8} {'top-1 agree':>12} {'gen agree':>10} "
          f"{'bits/value':>10}")
    for cname, level, sink, window, sink_raw in configs:
        server = Server(level, sink_tokens=sink, window_tokens=window, sink_raw=sink_raw)
        kls, kl_max, nll, agree, gens = [], 0.0, [], [], []
        with Client(server.endpoint) as kv:
            if "calibrated" in cname:
                state = server.ask(("calibrate", KvdCache(kv, model.config).namespace, record))
                assert state["state"] == "active", state
            for name, (pre, cont, full, ref_lp, ref_gen) in refs.items():
                saver = KvdCache(kv, model.config)
                for i, layer in enumerate(full.layers):
                    saver.update(layer.keys, layer.values, i)
                saver.save(name)
                lp = scored(KvdCache.resume(kv, model.config, name), cont)
                kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
                kls.append(float(kl.mean()))
                kl_max = max(kl_max, float(kl.max()))
                nll.append(float(-lp[:-1].gather(-1, cont[0, 1:, None]).mean()))
                agree.append(float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean()))
                gen_ids = torch.cat([pre, cont[:, :1]], dim=1)
                got = gen(KvdCache.resume(kv, model.config, name), gen_ids)
                gens.append(next((i for i, (a, b) in enumerate(zip(got, ref_gen, strict=True)) if a != b),
                                 len(ref_gen)))
        bits = server.ask("used") * 8 / values
        server.stop()
        ppl = float(torch.tensor(nll).mean().exp())
        print(f"{cname:<18} {statistics.mean(kls):>9.2e} {kl_max:>9.2e} {ppl:>8.3f} "
              f"{statistics.mean(agree):>12.4f} {statistics.mean(gens):>7.1f}/{args.gen} {bits:>10.3f}")


def decode(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from kvd.client import Client
    from kvd.integrations.model import build_model_folder
    from kvd.integrations.transformers import ATTENTION, KvdCache

    folder = build_model_folder(args.cache)
    local = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    remote = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  attn_implementation=ATTENTION).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = [t for text in texts().values() for t in tok(text).input_ids]
    if len(ids) < args.context + 1:
        raise SystemExit(f"the texts hold {len(ids)} tokens, fewer than --context {args.context} + 1")
    ids = torch.tensor([ids[: args.context + 1]])
    prefill = DynamicCache(config=local.config)
    with torch.no_grad():
        for s in range(0, args.context, 1024):
            local(ids[:, s: min(s + 1024, args.context)], past_key_values=prefill, use_cache=True)
    with torch.no_grad():  # warm both models up (first-call costs) on a short prompt
        for model in (local, remote):
            model.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=4,
                           do_sample=False, pad_token_id=model.config.eos_token_id or 0)
    print(f"context {args.context} tokens, {args.gen} generated, torch threads {torch.get_num_threads()}")
    print("| level | way | load s | decode tok/s | end-to-end tok/s | wire bytes / generated token "
          "| same tokens as load |")
    print("|---|---|---|---|---|---|---|")
    for level in args.levels.split(","):
        server = Server(level)
        with Client(server.endpoint, timeout_s=300) as kv:
            saver = KvdCache(kv, local.config)
            for i, layer in enumerate(prefill.layers):
                saver.update(layer.keys, layer.values, i)
            saver.save("context")
            outs = {}
            for way, model, attend in (("load", local, False), ("attend", remote, True)):
                before = kv.shard_stats()[0]
                t0 = time.perf_counter()
                cache = KvdCache.resume(kv, model.config, "context", attend=attend)
                t1 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                         max_new_tokens=args.gen, min_new_tokens=args.gen, do_sample=False,
                                         pad_token_id=model.config.eos_token_id or 0)
                t2 = time.perf_counter()
                after = kv.shard_stats()[0]
                wire = sum(after[k] - before[k] for k in ("server_bytes_in", "server_bytes_out"))
                outs[way] = out[0, ids.shape[1]:].tolist()
                differ = [i for i, (a, b) in enumerate(zip(outs["load"], outs[way], strict=True)) if a != b]
                same = "" if way == "load" else f"from token {differ[0]} on" if differ else "yes"
                print(f"| {level} | {way} | {t1 - t0:.2f} | {args.gen / (t2 - t1):.1f} | "
                      f"{args.gen / (t2 - t0):.1f} | {wire / args.gen:,.0f} | {same} |", flush=True)
                del cache
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("ttft", help="time to first token through vLLM")
    t.add_argument("--tokens", type=int, default=1906)
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--levels", default="fp16,q8,q4")
    t.add_argument("--format", default="fp16", choices=("pages", "fp16"),
                   help="the connector's kvd_format (its default: fp16)")
    t.add_argument("--mooncake", action="store_true",
                   help="also Mooncake Store through vLLM's MooncakeStoreConnector (mooncake_master on 127.0.0.1)")
    t.add_argument("--mooncake-mode", default="standalone-store", choices=("standalone-store", "embedded"))
    t.add_argument("--disk", action="store_true", help="add prompts served from the shard's disk tier")
    t.add_argument("--floor", action="store_true",
                   help="also an engine with vLLM's own prefix cache and no connector: the same hit with no load, "
                        "so each store's load overhead (TTFT minus that floor) is printed")
    q = sub.add_parser("quality", help="KL / perplexity / agreement per level through transformers")
    q.add_argument("--prefix", type=int, default=1024)
    q.add_argument("--cont", type=int, default=256)
    q.add_argument("--gen", type=int, default=128)
    q.add_argument("--threads", type=int, default=1)
    q.add_argument("--configs", default="", help="only these rows, by name, comma-separated (default: all)")
    q.add_argument("--sample", default=None,
                   help="the calibration sample of the calibrated row (default: the shared SmolLM2 sample)")
    d = sub.add_parser("decode", help="decode over a stored context: attend in kvd against loading it")
    d.add_argument("--context", type=int, default=8128)
    d.add_argument("--gen", type=int, default=64)
    d.add_argument("--levels", default="fp16,q4")
    for p in (t, q, d):
        p.add_argument("--cache", default=None, help="model folder cache (kvd.integrations.model)")
    args = ap.parse_args()
    {"ttft": ttft, "quality": quality, "decode": decode}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
