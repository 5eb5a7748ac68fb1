"""``KvdConnector``: vLLM's KV connector (``KVConnectorBase_V1``) for kvd — prompt-prefix reuse across requests
and across engine restarts, with kvd's precision levels on.

Select it with::

    KVTransferConfig(kv_connector="KvdConnector", kv_connector_module_path="kvd.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"kvd_endpoint": "tcp://127.0.0.1:7070"})

Options in ``kv_connector_extra_config`` (all but the endpoint optional):

- ``kvd_endpoint``: a kvd coordinator or shard endpoint (required).
- ``kvd_timeout_s`` (2.0): bound of every kvd call; ``kvd_retry_after_s`` (5.0): after a failure kvd is not
  asked again for this long (lookups miss, saves are dropped), so a dead kvd costs one timeout, not one per
  request.
- ``kvd_format`` (``"fp16"``): how loads travel: ``"fp16"`` (the shard decodes, one frame per tensor) or
  ``"pages"`` (as stored, decoded here: about 1.9x fewer bytes at q8 and 3x at q4, for a kvd across a slow
  network). On loopback ``"fp16"`` fetched a block in 0.85 ms against 1.44 (BENCHMARKS.md, "Engines").
- ``kvd_async_saves`` (true): appends run on a background thread; false makes every step wait for them.
- ``kvd_save_buffer_mb`` (256): bound of the KV copied out of the engine and not yet in kvd; saves beyond it
  are dropped and counted (a dropped save is only a later miss).
- ``kvd_model_id``: what identifies the model in keys (default: vLLM's model path and revision).
- ``kvd_parents`` (true): each block names the previous one as its parent (protocol 1.6), so a full kvd gives
  up blocks no lookup can reach first, then chain tails (kvd.store.chains); false leaves kvd's order to
  recency alone (what bench/serve.py compares against).

How it works. The prompt is cut into full blocks of vLLM's block size; block i is one kvd sequence of
``block_size`` tokens, under a chained hash of the prompt's token ids up to block i seeded with the request's
cache salt and LoRA (:mod:`kvd.integrations.prefix`). The namespace covers model, dtype, KV layout, block size
and shape, so engines that differ in any of them never share a false hit.

- Scheduler: ``get_num_new_matched_tokens`` asks kvd for the longest stored prefix of whole blocks (leaving at
  least one prompt token to compute); ``update_state_after_alloc`` records which engine blocks to fill;
  ``build_connector_meta`` hands the worker the blocks to load and the newly computed full prompt blocks to save.
  A kvd that does not answer means no hit.
- Worker: ``start_load_kv`` fetches the blocks (pipelined), decodes them into the engine's dtype and writes them
  into the paged cache in its layout (:mod:`kvd.integrations.vllm_layout`, which refuses unverified layouts).
  A block that fails to load is reported through ``get_block_ids_with_load_errors``; vLLM then recomputes it
  under ``kv_load_failure_policy="recompute"`` (``"fail"``, vLLM's default, fails the request instead).
- Saves: at ``wait_for_save`` (after the forward pass) the step's full prompt blocks are copied out of the
  engine's cache as fp16 into a bounded buffer; a background thread appends them to kvd. A request whose saves
  were scheduled is held by ``request_finished`` until ``get_finished`` reports its saves done (stored, refused
  or dropped), so "finished sending" means "in kvd or given up".

Also: with vLLM's own prefix cache on, only the blocks it lacks are looked up and loaded; requests with
multimodal inputs or prompt embeddings are neither looked up nor saved (their KV depends on more than the token
ids). Each block is appended with its ``position`` in the prompt (protocol 1.3), so only the prompt's first
block keeps kvd's sink page at fp16; the others are stored at the level in force.

Calibration. The connector's namespace is compressed with kvd's default protection until it has a calibration
(kvd.calibration): capture a sample of the same model's queries, keys and values with transformers
(:func:`kvd.integrations.capture.capture_sample`, ``path="m.npz"``), then run ``kvd calibrate NAMESPACE --sample
m.npz`` once against the kvd; the namespace is in the start-up log line ("KvdConnector (...): namespace ...")
and in ``kvd status``. The coordinator keeps it with the namespace and hands it to every shard, a restarted
one too; pages sealed from then on follow it.

Only ``kvd.*`` public names, torch and vLLM are imported; ``import kvd`` itself never imports this module.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvd.errors import Conflict, InvalidArgument, KvdError
from kvd.integrations import prefix
from kvd.integrations.link import KvdDown, KvdLink
from kvd.integrations.vllm_layout import BlockIO, UnverifiedLayout, check_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvd.client import Client

log = logging.getLogger(__name__)

Block = tuple[int, str]  # (engine block id, kvd sequence id)
_LOAD_WINDOW = 4  # block fetches in flight during a load
SaveBlock = tuple[int, str, int, str | None]  # (engine block id, kvd sequence id, its first token, previous block)


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: blocks to load before the forward, blocks to save after it."""

    loads: list[tuple[str, list[Block]]] = field(default_factory=list)
    saves: list[tuple[str, list[SaveBlock]]] = field(default_factory=list)


@dataclass
class _Req:
    """Scheduler-side state of one request."""

    keys: list[str]  # kvd sequence ids of the prompt's full blocks
    stored: int = 0  # leading blocks known to be in kvd (found by the lookup, or saved)
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV the engine has (after the scheduled step)
    saving: bool = False  # saves were scheduled: request_finished holds the blocks until get_finished
    local: int = 0  # tokens vLLM had itself (its own prefix cache) at the last lookup


@dataclass
class _Settings:
    endpoint: str
    timeout_s: float
    retry_after_s: float
    fmt: str
    async_saves: bool
    save_buffer_bytes: int
    model_id: str
    parents: bool


def _settings(vllm_config: VllmConfig) -> _Settings:
    kt = vllm_config.kv_transfer_config
    get = kt.get_from_extra_config
    endpoint = get("kvd_endpoint", None)
    if not endpoint:
        raise InvalidArgument('KvdConnector needs kv_connector_extra_config={"kvd_endpoint": "tcp://host:port"}')
    fmt = str(get("kvd_format", "fp16"))
    if fmt not in ("pages", "fp16"):
        raise InvalidArgument(f"kvd_format must be 'pages' or 'fp16', got {fmt!r}")
    mc = vllm_config.model_config
    model_id = str(get("kvd_model_id", "") or f"{mc.model}@{mc.revision or ''}")
    return _Settings(
        endpoint=str(endpoint), timeout_s=float(get("kvd_timeout_s", 2.0)),
        retry_after_s=float(get("kvd_retry_after_s", 5.0)), fmt=fmt,
        async_saves=_flag(get("kvd_async_saves", True)),
        save_buffer_bytes=int(float(get("kvd_save_buffer_mb", 256)) * (1 << 20)), model_id=model_id,
        parents=_flag(get("kvd_parents", True)),
    )  # fmt: skip


def _flag(value: object) -> bool:
    return str(value).lower() not in ("false", "0", "no")


def _expected_isa(dtype: torch.dtype, block_size: int, head_dim: int, kv_cache_dtype: str) -> tuple[str, str]:
    """(backend, isa) vLLM will use, computed the way its CPU backend does, so the scheduler (which has no
    attention layers) names the same layout as the worker (which checks the real one)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "non-CPU", "?"
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return "CPU_ATTN", "?"
    return "CPU_ATTN", _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)


class KvdConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._cfg = _settings(vllm_config)
        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise InvalidArgument("KvdConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 only")
        self._bs = int(cc.block_size)
        self._dtype: torch.dtype = mc.dtype
        self._layout = (mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size())
        backend, isa = _expected_isa(self._dtype, self._bs, self._layout[2], cc.cache_dtype)
        self._layout_name = check_layout(backend, isa, self._dtype, cc.cache_dtype)
        self.namespace = prefix.namespace_for(
            "vllm", self._cfg.model_id, dtype=str(self._dtype), layout=self._layout_name, block_size=self._bs,
            shape=list(self._layout))
        self._link = KvdLink(self._cfg.endpoint, self.namespace, self._layout, timeout_s=self._cfg.timeout_s,
                             retry_after_s=self._cfg.retry_after_s, name=f"kvd ({role.name.lower()})")
        self.counters: dict[str, int] = dict.fromkeys(
            ("lookups", "lookup_hit_blocks", "lookup_failures", "loaded_blocks", "load_failed_blocks",
             "load_fetch_us", "load_write_us", "saved_blocks", "save_existing_blocks", "save_failed_blocks",
             "save_dropped_blocks"), 0)
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._loads: dict[str, list[Block]] = {}
        # worker side
        self._io: BlockIO | None = None
        self._load_errors: set[int] = set()
        self._saver: _Saver | None = None
        # vLLM stopped by SIGTERM gives its engine process `shutdown_timeout` seconds (5 s when 0) before it kills
        # it: queued saves are flushed for that long less a second, so the shutdown ends before the kill.
        grace = float(getattr(vllm_config, "shutdown_timeout", 0) or 5.0)
        self._flush_s = max(0.5, grace - 1.0)
        log.info("KvdConnector (%s): namespace %s at %s", role.name, self.namespace, self._cfg.endpoint)

    # ------------------------------------------------------------------------------------------ scheduler

    def _state(self, request: Request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            lora = getattr(request, "lora_request", None)
            seed = prefix.chain_seed(getattr(request, "cache_salt", None),
                                     None if lora is None else f"{lora.lora_name}:{lora.lora_int_id}")
            if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
                # The KV depends on more than the token ids (images, audio, embeddings share placeholder ids):
                # no keys, so such requests are neither looked up nor saved rather than risk a false hit.
                st = _Req(keys=[])
            else:
                st = _Req(keys=prefix.block_keys(list(request.prompt_token_ids or ()), self._bs, seed))
            self._reqs[request.request_id] = st
        return st

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        st.local = num_computed_tokens
        n_prompt = len(request.prompt_token_ids or ())
        usable = st.keys[: max(0, (n_prompt - 1) // self._bs)]  # the engine must compute >= 1 prompt token
        # Blocks vLLM has itself (its own prefix cache, block-aligned) need no kvd copy: ask from the first
        # block it lacks. Those local blocks were saved when this engine computed them, so they count as stored
        # (not saved again, which kvd would refuse as a Conflict after the copy out of the engine and the send).
        first = num_computed_tokens // self._bs
        st.stored = max(st.stored, min(first, len(usable)))
        if len(usable) * self._bs <= num_computed_tokens:
            return 0, False
        self.counters["lookups"] += 1
        try:
            found = self._link.call(lambda c: prefix.stored_prefix(
                lambda keys: c.lengths(self.namespace, keys), usable[first:], self._bs))
        except (KvdDown, KvdError) as exc:
            self.counters["lookup_failures"] += 1
            log.debug("kvd lookup failed, recomputing: %s", exc)
            return 0, False
        hits = first + found
        st.stored = max(st.stored, hits)
        self.counters["lookup_hit_blocks"] += found
        return max(0, hits * self._bs - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._state(request)
        ids = blocks.get_block_ids()[0]
        first, end = st.local // self._bs, (st.local + num_external_tokens) // self._bs
        self._loads[request.request_id] = [(ids[i], st.keys[i]) for i in range(first, end)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvdConnectorMetadata(loads=list(self._loads.items()))
        self._loads.clear()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            st.computed = new.num_computed_tokens + sched.get(new.req_id, 0)
            self._plan_saves(new.req_id, st, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            st.computed = cached.num_computed_tokens[i] + sched.get(req_id, 0)
            self._plan_saves(req_id, st, meta)
        return meta

    def _plan_saves(self, req_id: str, st: _Req, meta: KvdConnectorMetadata) -> None:
        full = min(len(st.keys), st.computed // self._bs, len(st.block_ids))
        if full > st.stored:
            chained = self._cfg.parents
            blocks = [(st.block_ids[i], st.keys[i], i * self._bs, st.keys[i - 1] if i and chained else None)
                      for i in range(st.stored, full)]
            meta.saves.append((req_id, blocks))
            st.stored = full
            st.saving = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return (st is not None and st.saving), None

    # ------------------------------------------------------------------------------------------ worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ctx = self._vllm_config.compilation_config.static_forward_context
        names = sorted(kv_caches, key=_layer_index)
        for name in names:
            layer = ctx.get(name)
            backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: "?")()
            check_layout(backend, getattr(layer, "isa", None), kv_caches[name].dtype,
                         self._vllm_config.cache_config.cache_dtype)
            if self._layout_name != check_layout(backend, layer.isa, kv_caches[name].dtype, "auto"):
                raise UnverifiedLayout(f"layer {name}: layout {backend}/{layer.isa} is not the expected "
                                       f"{self._layout_name}")
        if len(names) != self._layout[0]:
            raise UnverifiedLayout(f"{len(names)} KV cache tensors for a {self._layout[0]}-layer model "
                                   "(hybrid or shared-KV models are not supported)")
        _, heads, dim = self._layout
        self._io = BlockIO([kv_caches[n] for n in names], heads, dim, self._bs)
        cfg = self._cfg
        link = KvdLink(cfg.endpoint, self.namespace, self._layout, timeout_s=cfg.timeout_s,
                       retry_after_s=cfg.retry_after_s, name="kvd (saves)")  # its own: the saver has a thread
        self._saver = _Saver(link, self.namespace, cfg.save_buffer_bytes, self.counters)
        if self._cfg.async_saves:
            self._saver.start()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvdConnectorMetadata) or not meta.loads or self._io is None:
            return
        for _req_id, blocks in meta.loads:
            self._load(blocks)

    def _load(self, blocks: list[Block]) -> None:
        """Fetch the blocks, ``_LOAD_WINDOW`` requests in flight, and write each into the engine's cache as soon
        as it arrives: the shard prepares the next replies while this process writes (the engine waits for
        the whole load, so the two processes' work overlaps instead of adding up)."""
        io = self._io
        assert io is not None
        ns, fmt, t = self.namespace, self._cfg.fmt, self._cfg.timeout_s
        done: list[int] = [0, 0]  # blocks written (a prefix: after a failure the rest is recomputed), write ns

        def stream(c: Client) -> object:
            pending = [c.get_nowait(ns, key, format=fmt, timeout_s=t)
                       for _, key in blocks[:_LOAD_WINDOW]]
            for j, (block_id, _key) in enumerate(blocks):
                if j + _LOAD_WINDOW < len(blocks):
                    pending.append(c.get_nowait(ns, blocks[j + _LOAD_WINDOW][1], format=fmt, timeout_s=t))
                k, v = pending[j].result()
                if k.shape[1] != self._bs:
                    return "short block"
                w0 = time.perf_counter_ns()
                io.write([block_id], [k], [v])
                done[0] += 1
                done[1] += time.perf_counter_ns() - w0
            return None

        t0 = time.perf_counter_ns()
        failed: object
        try:
            failed = self._link.call(stream)
        except (KvdDown, KvdError) as exc:  # KvdDown, or a per-item error such as an evicted block
            failed = exc
        good, write_ns = done
        self.counters["loaded_blocks"] += good
        self.counters["load_fetch_us"] += (time.perf_counter_ns() - t0 - write_ns) // 1000  # bench/engines.py
        self.counters["load_write_us"] += write_ns // 1000
        if good < len(blocks):
            log.warning("kvd: %d of %d blocks did not load (%s); vLLM recomputes them", len(blocks) - good,
                        len(blocks), failed)
            self.counters["load_failed_blocks"] += len(blocks) - good
            self._load_errors.update(b for b, _ in blocks[good:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # blocks are copied out once per step, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvdConnectorMetadata) or self._io is None or self._saver is None:
            return
        for req_id, blocks in meta.saves:
            self._saver.submit(req_id, blocks, self._io)
        if not self._cfg.async_saves:
            self._saver.drain_here()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._saver is None:
            return None, None
        done = self._saver.finished(finished_req_ids)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_saves(self, timeout_s: float) -> bool:
        """Wait until every save handed to this (worker) connector is done (stored, refused or dropped), at
        most ``timeout_s``; True if they all are. For callers that must know the KV is in kvd (tests, a
        graceful hand-over); the engine itself never waits for saves."""
        return self._saver is None or self._saver.wait(timeout_s)

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.stop(timeout_s=self._flush_s)
        self._link.close()
        log.info("KvdConnector (%s) counters: %s", self.role.name, self.counters)


def _layer_index(name: str) -> tuple[int, str]:
    m = re.search(r"layers\.(\d+)\.", name)
    return (int(m.group(1)) if m else 1 << 30, name)


class _Saver:
    """Appends copied blocks to kvd off the forward pass. Memory is bounded by ``budget`` bytes of copied KV:
    a save that does not fit is dropped (counted). Tracks which finished requests still have saves in flight,
    for ``get_finished``."""

    def __init__(self, link: KvdLink, namespace: str, budget: int, counters: dict[str, int]) -> None:
        self._link, self._ns, self._budget, self._counters = link, namespace, budget, counters
        self._q: queue.Queue[tuple[str, str, int, str | None, np.ndarray, np.ndarray] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._bytes = 0
        self._pending: dict[str, int] = {}  # request -> jobs not yet done
        self._seen: set[str] = set()  # requests that had saves (the scheduler holds exactly these)
        self._awaiting: set[str] = set()  # finished requests whose saves are still pending
        self._thread: threading.Thread | None = None
        self._next_warning = 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvd-saver", daemon=True)
        self._thread.start()

    def submit(self, req_id: str, blocks: Sequence[SaveBlock], io: BlockIO) -> None:
        with self._lock:
            self._seen.add(req_id)
        if self._link.down:  # kvd failed recently: do not copy what cannot be stored
            self._counters["save_dropped_blocks"] += len(blocks)
            return
        block_bytes = 2 * io.num_layers * io.bs * io.h * io.d * 2
        with self._lock:
            room = max(0, (self._budget - self._bytes) // block_bytes)
        take = list(blocks[:room])
        if len(take) < len(blocks):
            self._counters["save_dropped_blocks"] += len(blocks) - len(take)
            log.warning("kvd: save buffer full (%d MB); dropping %d blocks", self._budget >> 20,
                        len(blocks) - len(take))
        if not take:
            return
        k, v = io.read([b for b, _, _, _ in take])  # copy out now: the engine may reuse the blocks after this step
        with self._lock:
            self._bytes += block_bytes * len(take)
            self._pending[req_id] = self._pending.get(req_id, 0) + len(take)
        for i, (_, key, position, parent) in enumerate(take):
            self._q.put((req_id, key, position, parent, k[i], v[i]))

    def _save(self, job: tuple[str, str, int, str | None, np.ndarray, np.ndarray]) -> None:
        req_id, key, position, parent, k, v = job
        try:
            # position: only the prompt's first block holds the attention sinks that kvd keeps at fp16;
            # parent: the block a lookup must find before this one (kvd evicts what it cannot reach first)
            self._link.call(lambda c: c.append(self._ns, key, k, v, offset=0, position=position, parent=parent))
            self._counters["saved_blocks"] += 1
        except Conflict:
            self._counters["save_existing_blocks"] += 1  # another request or engine stored it first
        except (KvdDown, KvdError) as exc:
            self._counters["save_failed_blocks"] += 1
            now = time.monotonic()
            if now >= self._next_warning:  # counted always, logged at most every 10 s: kvd may be down for long
                self._next_warning = now + 10.0
                log.warning("kvd: a save failed (%s); %d failed so far, the engine carries on", exc,
                            self._counters["save_failed_blocks"])
        finally:
            with self._lock:
                self._bytes -= k.nbytes + v.nbytes
                self._pending[req_id] -= 1
                if not self._pending[req_id]:
                    del self._pending[req_id]

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            self._save(job)

    def drain_here(self) -> None:
        """Run the queued saves on this thread (synchronous mode)."""
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._save(job)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        with self._lock:
            self._awaiting |= finished_req_ids & self._seen
            done = {r for r in self._awaiting if r not in self._pending}
            self._awaiting -= done
            self._seen -= done
        return done

    def wait(self, timeout_s: float) -> bool:
        if self._thread is None:
            self.drain_here()
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._pending

    def stop(self, timeout_s: float) -> None:
        """Let queued saves finish for at most ``timeout_s``, then stop the thread (what is left is dropped)."""
        self.wait(timeout_s)
        if self._thread is None:
            return
        self._q.put(None)
        self._thread.join(1.0)  # a save still running ends within its own timeout; the thread is a daemon
