"""vLLM's KV-cache layouts: how each attention backend's ``kv_cache`` holds K and V, told from its shape, and
the key and value views ropepool writes through (vllm/v1/attention/backends/: flash_attn.py, triton_attn.py,
flashinfer.py, cpu_attn.py)."""
from __future__ import annotations

import torch

from ..errors import RopePoolError

# How each backend's kv_cache holds K and V. All three give key and value caches seen as
# [num_blocks, block_size, num_kv_heads, head_size]; an HND physical order (vLLM's
# get_kv_cache_stride_order) only changes their strides, which ropepool takes as they are.
LAYOUTS = {
    "kv_first": "[2, num_blocks, block_size, heads, head_size], K/V = unbind(0): FlashAttention",
    "blocks_first": "[num_blocks, 2, block_size, heads, head_size], K/V = unbind(1): Triton, FlashInfer",
    "packed": "[num_blocks, heads, block_size, 2 * head_size], K then V in the last dim: vLLM's standardized layout",
    "cpu": "[num_blocks, heads, block_size, 2 * head_size], per block and head the keys as [head_size, block_size] "
           "then the values as rows: vLLM's CPU backend (isa vec / vec16)",
    "cpu_amx": "[num_blocks, heads, block_size, 2 * head_size], per block and head the keys then the values, each "
               "packed in AMX tiles: vLLM's CPU backend (isa amx; ropepool's kv_layout='amx')",
}
# The ropepool kv_layout of each layout's two views (cache_views): NHD unless named.
KV_LAYOUT = {"cpu": "HND", "cpu_amx": "amx"}


def detect_layout(kv_cache: torch.Tensor, head_size: int) -> str:
    """The layout of a layer's ``kv_cache`` from its shape (a name of ``LAYOUTS``)."""
    shape = tuple(kv_cache.shape)
    if len(shape) == 4 and shape[-1] == 2 * head_size:
        return "packed"
    if len(shape) == 5 and shape[-1] == head_size and (shape[0] == 2) != (shape[1] == 2):
        return "kv_first" if shape[0] == 2 else "blocks_first"
    raise RopePoolError(f"cannot tell the vLLM cache layout of kv_cache {list(shape)} with head_size {head_size}; "
                        f"expected one of {list(LAYOUTS.values())}. Fix: pass layout= (one of {sorted(LAYOUTS)}).")


def cache_views(kv_cache: torch.Tensor, layout: str, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches ``[num_blocks, block_size, heads, head_size]`` (``"cpu"``: HND,
    ``[num_blocks, heads, block_size, head_size]``, the keys' head dim strided; ``"cpu_amx"``: that shape,
    each (block, head) run AMX-packed): views into ``kv_cache``."""
    if layout == "kv_first":
        return kv_cache.unbind(0)
    if layout == "blocks_first":
        return kv_cache.unbind(1)
    if layout == "packed":
        nhd = kv_cache.transpose(1, 2)
        return nhd[..., :head_size], nhd[..., head_size:2 * head_size]
    if layout == "cpu":  # cpu_attn.py: view [blocks, heads, 2 * block_size, head_size], chunk(2, dim=2)
        blocks, heads, block_size, _ = kv_cache.shape
        keys = kv_cache.view(blocks, heads, 2, head_size, block_size)[:, :, 0]  # stored transposed
        return keys.transpose(-1, -2), kv_cache.view(blocks, heads, 2, block_size, head_size)[:, :, 1]
    if layout == "cpu_amx":  # the same halves, each (block, head) run packed (docs/layouts.md)
        blocks, heads, block_size, _ = kv_cache.shape
        return kv_cache.view(blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    raise RopePoolError(f"layout must be one of {sorted(LAYOUTS)}; got {layout!r}. Fix: pass the name of the "
                        "backend's cache layout, or None to read it from kv_cache's shape.")
