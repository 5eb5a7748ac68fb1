"""A vLLM engine in a process of its own, driven by the tests one command at a time (not a test module).

Why a process: each test wants a fresh engine (a restart must find what the previous one stored), vLLM keeps
its KV connector in a process-wide global, and a kvd server must be stoppable while the engine lives.

The processes come from a multiprocessing forkserver that imported vLLM once (:func:`context`): an engine then
starts in seconds instead of paying the import (about 20 s of CPU) each time. :func:`run` serves one engine:
``args`` ``{"model": ..., "endpoint": ..., "dtype": "float32", ...}``, then on ``conn`` one command at a time,
each answered by one reply:

- ``{"generate": [text, ...], "max_tokens": n, "logprobs": k}`` -> ``{"outputs": [{"token_ids": [...], "cached": n,
  "first_logprobs": {token id: logprob} (the first generated token's top k, with k)}, ...]}``
- ``{"tokenize": text}`` -> ``{"ids": [...]}``: the prompt's token ids, as generate gets them
- ``{"flush": seconds}`` -> ``{"flushed": bool}``: waits for the connector's saves to reach kvd
- ``{"counters": true}`` -> the worker connector's counters, and ``link_failures``: how many calls of its saver
  waited for kvd's timeout (each failure marks kvd down for ``kvd_retry_after_s``)
- ``{"quit": true}``
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

# Read by vLLM when an engine starts; set before the forkserver starts so that every engine inherits them.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # scheduler and worker in the engine's process
       "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
# What an engine's start imports, by its entry points (import only: nothing here starts a thread or touches torch's
# thread pools, so forking after it is safe).
PRELOAD = ["torch", "vllm", "vllm.config", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine",
           "vllm.v1.engine.core", "vllm.v1.engine.core_client", "vllm.v1.executor.uniproc_executor",
           "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.model_loader",
           "vllm.model_executor.models.llama", "vllm.distributed.kv_transfer", "kvd.integrations.vllm"]

_context: Any = None


def context() -> Any:
    """The forkserver context whose server has vLLM imported (started at the first engine)."""
    global _context
    if _context is None:
        for key, value in ENV.items():
            os.environ.setdefault(key, value)
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run(args: dict[str, Any], conn: Connection) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"kvd_endpoint": args["endpoint"], "kvd_timeout_s": 1.0, "kvd_retry_after_s": 2.0,
             **args.get("extra", {})}
    kv = None
    if args.get("endpoint"):
        kv = KVTransferConfig(kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config=extra)
    llm = LLM(model=args["model"], dtype=args.get("dtype", "float32"), enforce_eager=True, seed=0,
              enable_prefix_caching=args.get("prefix_caching", False), max_model_len=args.get("max_len", 4096),
              kv_transfer_config=kv, **args.get("llm", {}))
    connector = None
    if kv is not None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
    conn.send({"ready": True})
    while True:
        cmd = conn.recv()
        if "generate" in cmd:
            sp = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 16), ignore_eos=True,
                                logprobs=cmd.get("logprobs"))
            t0 = time.perf_counter()
            outs = llm.generate(cmd["generate"], sp, use_tqdm=False)
            reply = {"seconds": time.perf_counter() - t0, "outputs": [
                {"token_ids": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                 "prompt_ids": list(o.prompt_token_ids),
                 "first_logprobs": {str(t): lp.logprob for t, lp in (o.outputs[0].logprobs or [{}])[0].items()}}
                for o in outs]}
        elif "tokenize" in cmd:
            reply = {"ids": list(llm.get_tokenizer().encode(cmd["tokenize"]))}
        elif "flush" in cmd:
            reply = {"flushed": connector.wait_saves(cmd["flush"]) if connector is not None else True}
        elif "namespace" in cmd:
            reply = {"namespace": connector.namespace if connector is not None else None}
        elif "counters" in cmd:
            reply = {**connector.counters, "link_failures": connector._saver._link.failures} \
                if connector is not None else {}
        elif "quit" in cmd:
            conn.send({"bye": True})
            break
        else:
            reply = {"error": f"unknown command {cmd}"}
        conn.send(reply)
