"""KvdCache under real transformers (SmolLM2-135M, fp32) against a real kvd shard server at level fp16.

Greedy generation through a KvdCache must give the tokens a DynamicCache gives: when it loaded nothing (it is
a DynamicCache then), when it resumes a stored sequence, when it reuses a stored prompt prefix, and when the model
attends over the stored sequence in kvd instead of loading it (``attend=True``, ``attn_implementation="kvd"``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_helpers import KvdServer, missing_engines  # isort: skip  (tests/engines/engine_helpers.py)

_reason = missing_engines("torch", "transformers")
if _reason:
    pytest.skip(_reason, allow_module_level=True)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.errors import InvalidArgument, UnknownSequence  # noqa: E402
from kvd.integrations import prefix  # noqa: E402
from kvd.integrations.transformers import ATTENTION, KvdCache  # noqa: E402

pytestmark = [pytest.mark.engines, pytest.mark.timeout(600)]

SYSTEM = ("You are a careful assistant for a museum of river trade. The museum keeps boats, ledgers, maps and "
          "the letters of the merchants who built the town. ") * 6


@pytest.fixture(scope="module")
def model(model_folder: Path) -> tuple[Any, Any]:
    torch.manual_seed(0)
    return (AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(model_folder))


@pytest.fixture(scope="module")
def kvd_model(model_folder: Path) -> Any:
    """The same model with kvd's attention function (attends over a cache's stored tokens in kvd)."""
    return AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32,
                                                attn_implementation=ATTENTION).eval()


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    srv = KvdServer(level="fp16")
    try:
        with Client(srv.endpoint) as kv:
            yield kv
    finally:
        srv.stop()


def ids_of(tok: Any, text: str) -> torch.Tensor:
    return tok(text, return_tensors="pt").input_ids


def greedy(model: Any, ids: torch.Tensor, cache: Any, n: int) -> torch.Tensor:
    """Exactly ``n`` greedy tokens (EOS suppressed: this small model likes to stop after a few tokens)."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=model.config.eos_token_id or 0)


def test_a_fresh_kvd_cache_generates_what_dynamic_cache_does(model: tuple[Any, Any], client: Client) -> None:
    m, tok = model
    ids = ids_of(tok, SYSTEM + "Question: what is in the museum?")
    want = greedy(m, ids, DynamicCache(config=m.config), 24)
    cache = KvdCache(client, m.config)
    assert torch.equal(greedy(m, ids, cache, 24), want)
    assert cache.get_seq_length() == want.shape[1] - 1


def test_a_stored_sequence_resumes_with_the_same_tokens(model: tuple[Any, Any], client: Client) -> None:
    m, tok = model
    ids = ids_of(tok, SYSTEM + "Question: who built the town?")
    want = greedy(m, ids, DynamicCache(config=m.config), 40)  # one call: 40 tokens

    first = KvdCache(client, m.config)
    part = greedy(m, ids, first, 20)
    assert first.save("conversation-1") == part.shape[1] - 1
    assert first.save("conversation-1") == part.shape[1] - 1  # nothing new: no second append

    resumed = KvdCache.resume(client, m.config, "conversation-1")
    assert resumed.loaded_tokens == part.shape[1] - 1
    out = greedy(m, part, resumed, 20)  # the model computes only the last token of `part`, then 19 more
    assert torch.equal(out, want)
    assert resumed.save("conversation-1") == out.shape[1] - 1  # only the new tokens are appended

    with pytest.raises(UnknownSequence):
        KvdCache.resume(client, m.config, "never-stored")


def test_a_stored_prompt_prefix_is_loaded_instead_of_recomputed(model: tuple[Any, Any], client: Client) -> None:
    m, tok = model
    a = ids_of(tok, SYSTEM + "Question: what do the maps show?")
    b = ids_of(tok, SYSTEM + "Question: where are the ledgers kept?")

    writer = KvdCache(client, m.config)
    with torch.no_grad():
        m(a, past_key_values=writer, use_cache=True)  # prefill only
    stored = writer.save_prefix(a)
    assert stored == a.shape[1] // writer.block_tokens >= 2
    keys = prefix.block_keys(a[0].tolist(), writer.block_tokens)  # only the prompt's first block has sinks
    assert "sink" in client.explain(writer.namespace, keys[0], 0, 0)["reasons"]
    assert "sink" not in client.explain(writer.namespace, keys[1], 0, 0)["reasons"]

    reader = KvdCache.for_prompt(client, m.config, b)
    shared = next(i for i in range(min(a.shape[1], b.shape[1])) if a[0, i] != b[0, i])
    assert reader.loaded_tokens == shared // reader.block_tokens * reader.block_tokens > 0
    want = greedy(m, b, DynamicCache(config=m.config), 24)
    assert torch.equal(greedy(m, b, reader, 24), want)

    other = KvdCache.for_prompt(client, m.config, ids_of(tok, "An unrelated prompt about the weather today."))
    assert other.loaded_tokens == 0 and other.get_seq_length() == 0


# The level's measured error (BENCHMARKS.md, "Quality a user sees": the largest next-token KL over 1,280 scored
# positions of 5 real texts): a load at that level stays within it; a load that mixed up layers, heads or tokens
# would be orders of magnitude off.
LEVEL_KL = {"q8": 5e-3, "q4": 1e-1}


@pytest.mark.parametrize("level", sorted(LEVEL_KL))
def test_a_prefix_stored_compressed_loads_within_the_levels_error(model: tuple[Any, Any], level: str) -> None:
    m, tok = model
    a = ids_of(tok, SYSTEM + "Question: what do the maps show?")
    b = ids_of(tok, SYSTEM + "Question: where are the ledgers kept?")
    srv = KvdServer(level=level)
    try:
        with Client(srv.endpoint) as kv:
            writer = KvdCache(kv, m.config)
            with torch.no_grad():
                m(a, past_key_values=writer, use_cache=True)
            assert writer.save_prefix(a) >= 2
            keys = prefix.block_keys(a[0].tolist(), writer.block_tokens)
            assert kv.explain(writer.namespace, keys[1], 0, 0)["level"] == level  # held compressed
            reader = KvdCache.for_prompt(kv, m.config, b)
            n = reader.loaded_tokens
            assert n >= 2 * reader.block_tokens
            with torch.no_grad():
                got = m(b[:, n:], past_key_values=reader, use_cache=True).logits[0, -1]
                want = m(b).logits[0, -1]
    finally:
        srv.stop()
    kl = torch.sum(torch.softmax(want, -1) * (torch.log_softmax(want, -1) - torch.log_softmax(got, -1))).item()
    assert 0 < kl <= LEVEL_KL[level], kl


def test_another_model_id_does_not_see_the_stored_prefix(model: tuple[Any, Any], client: Client) -> None:
    m, tok = model
    a = ids_of(tok, SYSTEM + "Question: what do the maps show?")
    writer = KvdCache(client, m.config)
    with torch.no_grad():
        m(a, past_key_values=writer, use_cache=True)
    writer.save_prefix(a)
    assert KvdCache.for_prompt(client, m.config, a).loaded_tokens > 0
    assert KvdCache.for_prompt(client, m.config, a, model_id="another-model").loaded_tokens == 0
    assert KvdCache.for_prompt(client, m.config, a, dtype=torch.bfloat16).loaded_tokens == 0


def test_a_conversation_spilled_to_disk_resumes_and_grows(model: tuple[Any, Any], tmp_path: Path) -> None:
    """A store whose memory holds about one conversation: saving a second one moves the first to its disk tier.
    Resuming the first reads it back from disk, and saving it again (an append) takes it back into memory."""
    m, tok = model
    srv = KvdServer(level="fp16", capacity_bytes=8 << 20, max_level="fp16", disk_path=str(tmp_path),
                    disk_bytes=256 << 20)  # a 219-token conversation of this model takes 5.9 MB at fp16
    try:
        with Client(srv.endpoint) as kv:
            ids = ids_of(tok, SYSTEM + "Question: who kept the ledgers?")
            want = greedy(m, ids, DynamicCache(config=m.config), 40)
            first = KvdCache(kv, m.config)
            part = greedy(m, ids, first, 20)
            first.save("conversation-a")
            second = KvdCache(kv, m.config)
            greedy(m, ids_of(tok, SYSTEM + "Question: what did the boats carry?"), second, 20)
            second.save("conversation-b")
            assert srv.stats()["spills"] >= 1
            assert kv.explain(first.namespace, "conversation-a", 0, 0)["reasons"][0].startswith("on disk")
            resumed = KvdCache.resume(kv, m.config, "conversation-a")
            out = greedy(m, part, resumed, 20)
            assert torch.equal(out, want)
            assert resumed.save("conversation-a") == out.shape[1] - 1
            stats = srv.stats()
            assert stats["disk_hits"] >= 1 and stats["promotions"] == 1 and stats["evictions"] == 0
    finally:
        srv.stop()


def test_attending_in_kvd_generates_what_dynamic_cache_does(model: tuple[Any, Any], kvd_model: Any,
                                                            client: Client) -> None:
    """The stored conversation stays in kvd: the cache holds only what comes after it, reports it in its length,
    and the model's layers attend over it there. A follow-up of several tokens (a causal block after the stored
    prefix, query heads grouped 3 to a KV head in this model) then greedy decoding: DynamicCache's tokens."""
    m, tok = model
    ids = ids_of(tok, SYSTEM + "Question: what did the merchants write?")
    writer = KvdCache(client, m.config)
    part = greedy(m, ids, writer, 12)
    stored = writer.save("conversation-attend")
    follow = torch.cat([part, ids_of(tok, " Answer in one sentence, then name a boat.")], -1)
    want = greedy(m, follow, DynamicCache(config=m.config), 20)

    assert torch.equal(greedy(kvd_model, ids, DynamicCache(config=m.config), 12), part)  # nothing stored: local
    cache = KvdCache.resume(client, kvd_model.config, "conversation-attend", attend=True)
    assert cache.stored_tokens == stored and cache.loaded_tokens == 0
    assert cache.get_seq_length() == stored and cache.layers[0].keys is None  # nothing of it held here
    out = greedy(kvd_model, follow, cache, 20)
    assert torch.equal(out, want)
    assert cache.layers[0].keys.shape[2] == out.shape[1] - 1 - stored  # only the tokens after the stored ones
    assert cache.get_seq_length() == out.shape[1] - 1
    assert cache.save("conversation-attend") == out.shape[1] - 1  # appends what came after

    with pytest.raises(UnknownSequence):
        KvdCache.resume(client, kvd_model.config, "never-stored", attend=True)
    with pytest.raises(InvalidArgument, match="attn_implementation"):  # a model that would not look in kvd
        greedy(m, follow, KvdCache.resume(client, m.config, "conversation-attend", attend=True), 1)


def test_attending_in_kvd_over_compressed_pages_stays_within_the_levels_error(model: tuple[Any, Any],
                                                                               kvd_model: Any) -> None:
    """Next-token KL of attending in kvd over a prompt stored at q8 / q4, against the model over the raw prompt:
    within the level's own error (LEVEL_KL), and above zero (the pages are compressed)."""
    m, tok = model
    ids = ids_of(tok, SYSTEM + "Question: where are the ledgers kept?")
    n = ids.shape[1] - 7  # the model computes the last 7 tokens over the n stored ones
    with torch.no_grad():
        want = m(ids).logits[0, -1]
    srv = KvdServer(level="q8")
    try:
        with Client(srv.endpoint) as kv:
            for level in sorted(LEVEL_KL, reverse=True):  # q8, then q4
                srv.set_level(level)
                writer = KvdCache(kv, m.config)
                with torch.no_grad():
                    m(ids[:, :n], past_key_values=writer, use_cache=True)
                assert writer.save(f"prompt-{level}") == n
                assert kv.explain(writer.namespace, f"prompt-{level}", 0, 64)["level"] == level
                cache = KvdCache.resume(kv, kvd_model.config, f"prompt-{level}", attend=True)
                with torch.no_grad():
                    got = kvd_model(ids[:, n:], past_key_values=cache, use_cache=True).logits[0, -1]
                kl = torch.sum(torch.softmax(want, -1) * (torch.log_softmax(want, -1)
                                                          - torch.log_softmax(got, -1))).item()
                assert 0 < kl <= LEVEL_KL[level], (level, kl)
    finally:
        srv.stop()
