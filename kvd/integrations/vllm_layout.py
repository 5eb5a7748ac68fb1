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
        engine reuses the blocks)."""
        n, h, d, bs = len(block_ids), self.h, self.d, self.bs
        k = np.empty((n, self.num_layers, bs, h, d), np.float16)
        v = np.empty_like(k)
        tk, tv = torch.from_numpy(k), torch.from_numpy(v)
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        for li, rows in enumerate(self._rows):
            blk = rows.index_select(0, idx)  # [N, H, 2*bs*D]
            tk[:, li].copy_(blk[:, :, : bs * d].reshape(n, h, d, bs).permute(0, 3, 1, 2))
            tv[:, li].copy_(blk[:, :, bs * d:].reshape(n, h, bs, d).permute(0, 2, 1, 3))
        return k, v

    def write(self, block_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``/``values`` ``[N, L, bs, H, D]`` (any float dtype; converted to the cache's) into the
        blocks ``block_ids``."""
        n, h, d, bs = len(block_ids), self.h, self.d, self.bs
        want = (n, self.num_layers, bs, h, d)
        if tuple(keys.shape) != want or tuple(values.shape) != want:
            raise InvalidArgument(f"blocks of shape {tuple(keys.shape)}/{tuple(values.shape)}, expected {want}")
        ids = list(block_ids)
        if ids == list(range(ids[0], ids[0] + n)) if ids else False:
            # Consecutive blocks (the usual case for a new request): write straight into the cache, two copies
            # per layer and no staging buffer. Fewer, larger operations matter on a busy CPU.
            b0 = ids[0]
            for li, rows in enumerate(self._rows):
                dst = rows[b0:b0 + n]
                dst[:, :, : bs * d].view(n, h, d, bs).copy_(keys[:, li].permute(0, 2, 3, 1))
                dst[:, :, bs * d:].view(n, h, bs, d).copy_(values[:, li].permute(0, 2, 1, 3))
            return
        idx = torch.as_tensor(ids, dtype=torch.long)
        out = torch.empty((n, h, 2 * bs * d), dtype=self.dtype)
        for li, rows in enumerate(self._rows):
            out[:, :, : bs * d].view(n, h, d, bs).copy_(keys[:, li].permute(0, 2, 3, 1))
            out[:, :, bs * d:].view(n, h, bs, d).copy_(values[:, li].permute(0, 2, 1, 3))
            rows.index_copy_(0, idx, out)
