"""Reading and writing whole blocks of vLLM's paged KV cache as kvd arrays ``[blocks, layers, tokens, heads,
head_dim]``, for the KV layouts that were checked against the model's own K/V; every other layout is refused.

Why refuse: kvd quantizes keys per channel, so it must know which axis is the channel. Copying blocks as opaque
bytes would "work" on any layout and store garbage as soon as one is read the wrong way round. vLLM's CPU
backend (``CPU_ATTN``) keeps one tensor per layer, ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, and
each (block, head) row holds the keys first, then the values; with the ``vec`` instruction set the keys are
stored *transposed*, ``[head_dim, block_size]``, the values as ``[block_size, head_dim]``. That was verified
against transformers' K/V for the same prompt (fp32 and bf16, notes of issue 17); other ISAs (amx, vec16,
neon...) may lay keys out differently and are refused until someone verifies them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvd.errors import InvalidArgument

#: (backend name, isa) pairs whose layout was verified, for the engine dtypes listed.
VERIFIED: dict[tuple[str, str], tuple[torch.dtype, ...]] = {
    ("CPU_ATTN", "vec"): (torch.float32, torch.bfloat16),
}


class UnverifiedLayout(InvalidArgument):
    """vLLM's KV cache is in a layout kvd has not verified; nothing is stored or loaded."""


def layout_name(backend: str, isa: str) -> str:
    return f"{backend}/{isa}/keys-transposed" if (backend, isa) == ("CPU_ATTN", "vec") else f"{backend}/{isa}"


def check_layout(backend: str, isa: str | None, dtype: torch.dtype, kv_cache_dtype: str) -> str:
    """The layout's name if kvd can read it, else :class:`UnverifiedLayout` saying what was found."""
    if kv_cache_dtype not in ("auto", None):
        raise UnverifiedLayout(f"kvd cannot store a quantized vLLM KV cache (kv_cache_dtype={kv_cache_dtype!r}); "
                               "use kv_cache_dtype='auto'")
    key = (backend, str(isa))
    if key not in VERIFIED:
        raise UnverifiedLayout(
            f"vLLM's KV layout {backend}/isa={isa} has not been verified for kvd (verified: "
            f"{', '.join(f'{b}/isa={i}' for b, i in VERIFIED)}); refusing it rather than storing keys read the "
            "wrong way round. See kvd/integrations/vllm_layout.py for how a layout is verified.")
    if dtype not in VERIFIED[key]:
        raise UnverifiedLayout(f"vLLM's KV layout {backend}/isa={isa} was not verified for dtype {dtype}")
    return layout_name(backend, str(isa))


class BlockIO:
    """Block copies for one worker's caches: ``caches`` in layer order, each ``[num_blocks, H, bs, 2*D]``,
    contiguous. Keys transposed per (block, head) as described in the module docstring."""

    def __init__(self, caches: Sequence[torch.Tensor], num_kv_heads: int, head_dim: int, block_size: int) -> None:
        if not caches:
            raise InvalidArgument("no KV cache tensors")
        h, d, bs = num_kv_heads, head_dim, block_size
        for i, c in enumerate(caches):
            if c.dim() != 4 or tuple(c.shape[1:]) != (h, bs, 2 * d) or not c.is_contiguous():
                raise UnverifiedLayout(
                    f"layer {i}: KV cache of shape {tuple(c.shape)} (contiguous={c.is_contiguous()}), expected a "
                    f"contiguous [num_blocks, {h}, {bs}, {2 * d}]")
        self.h, self.d, self.bs = h, d, bs
        self.dtype = caches[0].dtype
        # [num_blocks, H, 2*bs*D] views: one row per (block, head), keys then values
        self._rows = [c.view(c.shape[0], h, 2 * bs * d) for c in caches]

    @property
    def num_layers(self) -> int:
        return len(self._rows)

    def read(self, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Blocks as float16 ``(keys, values)``, each ``[N, L, bs, H, D]`` (new arrays, safe to keep after the
        engine reuses the blocks). Per block: each layer's rows are one contiguous converting copy, then the
        transposition is done in float16 (see :meth:`write`)."""
        n, h, d, bs = len(block_ids), self.h, self.d, self.bs
        k = np.empty((n, self.num_layers, bs, h, d), np.float16)
        v = np.empty_like(k)
        rows16 = np.empty((self.num_layers, h, 2 * bs * d), np.float16)
        staged = torch.from_numpy(rows16)
        for j, b in enumerate(block_ids):
            for li, rows in enumerate(self._rows):
                staged[li].copy_(rows[b])
            np.copyto(k[j], rows16[:, :, : bs * d].reshape(-1, h, d, bs).transpose(0, 3, 1, 2))
            np.copyto(v[j], rows16[:, :, bs * d:].reshape(-1, h, bs, d).transpose(0, 2, 1, 3))
        return k, v

    def write(self, block_ids: Sequence[int], keys: Sequence[Any], values: Sequence[Any]) -> None:
        """Write block ``j``'s ``keys[j]``/``values[j]`` ``[L, bs, H, D]`` into engine block ``block_ids[j]``:
        numpy arrays or tensors of any float dtype (converted to the cache's), e.g. ``[N, L, bs, H, D]`` arrays or
        a list of the ``[L, bs, H, D]`` arrays kvd's client returned (no stacking needed).

        Per block, the transposition is done first in the source dtype (numpy, half the bytes for float16), then
        each layer's rows are one contiguous converting copy into the cache. Converting and transposing in one
        strided torch copy cost 5-10x more, most of all on a busy CPU (BENCHMARKS.md, "Engines")."""
        n, h, d, bs = len(block_ids), self.h, self.d, self.bs
        want = (self.num_layers, bs, h, d)
        if len(keys) != n or len(values) != n:
            raise InvalidArgument(f"{len(keys)}/{len(values)} key/value blocks for {n} block ids")
        for j, b in enumerate(block_ids):
            k, v = _as_numpy(keys[j]), _as_numpy(values[j])
            if k.shape != want or v.shape != want:
                raise InvalidArgument(f"block {j}: shape {k.shape}/{v.shape}, expected {want}")
            kt = torch.from_numpy(np.ascontiguousarray(k.transpose(0, 2, 3, 1)))  # [L, H, D, bs]
            vt = torch.from_numpy(np.ascontiguousarray(v.transpose(0, 2, 1, 3)))  # [L, H, bs, D]
            for li, rows in enumerate(self._rows):
                dst = rows[b]  # [H, 2*bs*D]: keys then values of each head
                dst[:, : bs * d].copy_(kt[li].view(h, d * bs))
                dst[:, bs * d:].copy_(vt[li].view(h, bs * d))


def _as_numpy(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
