"""bench/serve.py's reading of what vLLM reports: the result JSON of `vllm bench serve` and the engine's
Prometheus counters of prompt tokens by source."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("serve_bench", Path(__file__).resolve().parents[2] / "bench" /
                                               "serve.py")
assert _spec is not None and _spec.loader is not None
serve = importlib.util.module_from_spec(_spec)
sys.modules["serve_bench"] = serve  # (its dataclasses look their module up)
_spec.loader.exec_module(serve)

# The shape `vllm bench serve --save-result --percentile-metrics ttft --metric-percentiles 50,99` writes
# (vllm 0.32, vllm/benchmarks/serve.py), trimmed of the per-request lists the bench does not read.
RESULT = {
    "date": "20261128-093000", "endpoint_type": "vllm", "backend": "vllm", "label": None,
    "model_id": "smollm2", "tokenizer_id": "/root/.cache/kvd/smollm2-135m-instruct", "num_prompts": 48,
    "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 4, "duration": 53.3, "completed": 47,
    "failed": 1, "total_input_tokens": 30720, "total_output_tokens": 752, "request_throughput": 0.8818,
    "request_goodput": None, "output_throughput": 14.1, "total_token_throughput": 590.4,
    "max_output_tokens_per_s": 40.0, "max_concurrent_requests": 4,
    "mean_ttft_ms": 3120.5, "median_ttft_ms": 2960.25, "std_ttft_ms": 800.0, "p50_ttft_ms": 2960.25,
    "p99_ttft_ms": 6010.0,
    "input_lens": [640] * 48, "output_lens": [16] * 47 + [0], "ttfts": [3.1] * 47 + [0.0],
    "errors": [""] * 47 + ["Server disconnected"],
}

METRICS = """\
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2",source="local_compute"} 1.5e+04
vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2",source="local_cache_hit"} 2560.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2",source="external_kv_transfer"} 13184.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="smollm2",source="local_compute"} 100.0
vllm:prompt_tokens_total{engine="0",model_name="smollm2"} 30720.0
vllm:prefix_cache_hits_created 1.7645e+09
process_open_fds 42
"""


def test_a_vllm_result_gives_ttft_throughput_and_failures() -> None:
    run = serve.parse_bench_result(RESULT)
    assert (run.completed, run.failed) == (47, 1)
    assert (run.ttft_mean_ms, run.ttft_p50_ms, run.ttft_p99_ms) == (3120.5, 2960.25, 6010.0)
    assert run.rps == pytest.approx(47 / 53.3)
    assert run.errors == ["Server disconnected"]


def test_failures_are_counted_from_the_errors_when_the_count_is_absent() -> None:
    result = {k: v for k, v in RESULT.items() if k != "failed"}
    assert serve.parse_bench_result(result).failed == 1


@pytest.mark.parametrize("missing", ["p99_ttft_ms", "completed", "duration"])
def test_a_result_without_a_needed_field_is_refused_by_name(missing: str) -> None:
    result = {k: v for k, v in RESULT.items() if k != missing}
    with pytest.raises(ValueError, match=missing):
        serve.parse_bench_result(result)


def test_prompt_tokens_by_source_are_summed_over_engines() -> None:
    metrics = serve.parse_prometheus(METRICS)
    assert metrics[("process_open_fds", ())] == 42
    assert serve.prompt_sources(metrics) == {"local_compute": 15100.0, "local_cache_hit": 2560.0,
                                             "external_kv_transfer": 13184.0}


def test_the_chat_drivers_percentiles_are_nearest_rank() -> None:
    run = serve.run_from_ttfts([i / 1000 for i in range(1, 101)], failed=2, duration_s=10.0, errors=["x", "y"])
    assert (run.completed, run.failed) == (100, 2)
    assert run.ttft_p50_ms == pytest.approx(50.5)
    assert run.ttft_p99_ms == pytest.approx(99.0)
    assert run.ttft_mean_ms == pytest.approx(50.5)
    assert run.rps == pytest.approx(10.0)


def test_the_kvd_endpoint_is_read_from_what_kvd_up_printed() -> None:
    """The bench starts `kvd up --port 0` and takes the endpoint from its output, not a port it picked itself
    (the embedded Ray's processes took such a port first)."""
    log = ("2026-11-28 20:05:29,094\tWARNING authentication_token_setup.py:85 -- Token authentication ...\n"
           "kvd 0.1.0: starting 1 shards x 64.00MiB on an embedded Ray (namespace 'serve-bench-7-1') ...\n")
    assert serve.kvd_endpoint(log) is None  # not yet
    assert serve.kvd_endpoint(log + "kvd endpoint: tcp://127.0.0.1:40331\nCtrl-C stops kvd\n") == \
        "tcp://127.0.0.1:40331"


def test_mooncake_evictions_are_its_evicted_keys_not_a_sum_of_every_evict_counter() -> None:
    """The master exports evictions as keys, operations and bytes; the row's "evict" is the keys (one per engine
    block, as kvd's evictions count blocks), not a sum with the bytes."""
    master = """\
master_successful_evictions_total 47
master_attempted_evictions_total 47
master_evicted_key_count 94
master_evicted_size_bytes 554434560
master_evict_disk_replica_failures_total 0
"""
    store = object.__new__(serve.Mooncake)
    counters = {name: value for (name, _), value in serve.parse_prometheus(master).items()}
    store.stats = lambda: counters  # type: ignore[method-assign]
    before = {"master_evicted_key_count": 4.0, "master_evicted_size_bytes": 23592960.0}
    delta = serve.store_delta(store, before, put_failures=3)
    assert delta["evictions"] == 90
    assert delta["failed_puts"] == 3
