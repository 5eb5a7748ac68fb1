"""A calibration sample captured from a transformers model: its real queries, keys and values on a few texts.

:func:`capture_sample` runs the model once over the texts (joined, the first ``tokens`` tokens) with an
attention function that records what the model attends with: the queries and keys after RoPE (what an engine
caches and what kvd stores) and the values, per layer, as float16. The result is a
:class:`kvd.calibration.Sample` (and, with ``path``, an ``.npz`` in the layout of ``shared/data``'s sample:
``L{i}_q``, ``L{i}_k``, ``L{i}_v``, ``meta``) to give to :func:`kvd.calibration.calibrate` or
``kvd calibrate NAMESPACE --sample FILE``::

    sample = capture_sample(model, tokenizer, [open("docs.txt").read()], tokens=1024, path="sample.npz")
    client.calibrate(namespace, calibration.calibrate(sample))

Batch of one; the model's own attention runs unchanged (scaled dot-product), only observed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvd.calibration import Sample, check_sample
from kvd.errors import InvalidArgument

CAPTURE = "kvd_capture"
_seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _capture(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    _seen[int(getattr(module, "layer_idx", len(_seen)))] = (query[0].detach(), key[0].detach(), value[0].detach())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE, _capture)


def capture_sample(model: Any, tokenizer: Any, texts: Sequence[str], *, tokens: int = 512,
                   path: str | Path | None = None, model_id: str | None = None) -> Sample:
    """The model's queries, keys (post-RoPE) and values over the first ``tokens`` tokens of ``texts`` (joined by
    blank lines). InvalidArgument if the texts are shorter than ``tokens``."""
    ids = tokenizer("\n\n".join(texts)).input_ids
    if len(ids) < tokens:
        raise InvalidArgument(f"the texts give {len(ids)} tokens, fewer than the {tokens} asked for")
    before = model.config._attn_implementation
    _seen.clear()
    try:
        model.set_attn_implementation(CAPTURE)
        with torch.no_grad():
            model(torch.tensor([ids[:tokens]]), use_cache=False)
        layers = []
        for i in range(len(_seen)):
            q, k, v = (x.transpose(0, 1).to(torch.float32).numpy() for x in _seen[i])  # [T, heads, D]
            layers.append((q, k, v))
    finally:
        model.set_attn_implementation(before)
        _seen.clear()
    name = model_id or getattr(model.config, "name_or_path", "") or type(model).__name__
    sample = check_sample(layers, model=name, dtype=str(model.dtype).removeprefix("torch."))
    if path is not None:
        arrays = {f"L{i}_{x}": a for i, trio in enumerate(sample.layers) for x, a in zip("qkv", trio, strict=True)}
        n, h, d = sample.layout
        meta = (f"{name}, {n} layers, {sample.layers[0][0].shape[1]} query heads, {h} kv heads, head_dim {d}, "
                f"{tokens} tokens, captured by kvd.integrations.capture")
        np.savez(path, meta=np.array(meta), **arrays)
    return sample


__all__ = ["CAPTURE", "capture_sample"]
