"""DeepSeek V3.2's two stores (``ropepool.dsa``) as array math on torch tensors and MLX arrays.

The float32 steps of vLLM's writers, in their order (``ropepool.reference_dsa`` is the float64
oracle that rounds where they round): scales by IEEE float32 division, values ``x / s`` saturated
and rounded to e4m3, nearest even. Each function takes the rows as the cache receives them and
returns bytes (uint8); where they go in the cache is ``rows_at`` / ``indexer_at``.
"""
from __future__ import annotations

from types import SimpleNamespace

from .. import dsa

FLT_MIN = 1.1754943508222875e-38  # float32's smallest normal: the floor of an fp8_ds_mla tile scale


def ds_mla_rows(kv_c, k_pe, ops):
    """``[N, 656]`` uint8 rows of ``kv_c [N, 512]`` and the rotated ``k_pe [N, 64]`` (both 16-bit)."""
    n = kv_c.shape[0]
    tiles = ops.f32(kv_c).reshape(n, dsa.DS_MLA_TILES, dsa.DS_MLA_TILE)
    scale = ops.maximum(ops.amax_abs(tiles) / ops.const(dsa.E4M3_MAX, kv_c), ops.const(FLT_MIN, kv_c))
    values = ops.to_e4m3(tiles / scale[..., None]).reshape(n, dsa.DS_MLA_RANK)
    return ops.cat([values, ops.bytes_of(scale), ops.bytes_of(k_pe.reshape(n, dsa.DS_MLA_PE))])


def indexer_rows(k, ue8m0: bool, ops):
    """The indexer key ``k [N, D]`` as ``(e4m3 bytes [N, D], scale bytes [N, 4 * D // 128])``."""
    n, d = k.shape
    groups = ops.f32(k).reshape(n, d // dsa.INDEXER_GROUP, dsa.INDEXER_GROUP)
    amax = ops.maximum(ops.amax_abs(groups), ops.const(dsa.INDEXER_SCALE_FLOOR, k))  # fmaxf(amax, 1e-4f)
    scale = amax / ops.const(dsa.E4M3_MAX, k)
    if ue8m0:
        scale = ops.exp2(ops.ceil(ops.log2(scale)))
    return ops.to_e4m3(groups / scale[..., None]).reshape(n, d), ops.bytes_of(scale)


def indexer_at(row, head_dim: int, page_size: int, ops):
    """Byte offsets in their page of the values ``[N, D]`` and scales ``[N, 4 * D // 128]`` of rows ``row``:
    a page holds its rows' values, row by row, then their scales (docs/layouts.md)."""
    groups = 4 * (head_dim // dsa.INDEXER_GROUP)
    values = row[:, None] * head_dim + ops.arange(head_dim, row)
    scales = page_size * head_dim + row[:, None] * groups + ops.arange(groups, row)
    return values, scales


def torch_ops():
    import torch

    def const(value, like):
        return torch.tensor(value, dtype=torch.float32, device=like.device)

    return SimpleNamespace(
        f32=lambda x: x.float(), const=const, maximum=torch.maximum, exp2=torch.exp2, ceil=torch.ceil,
        log2=torch.log2, amax_abs=lambda x: x.abs().amax(-1),
        # __NV_SATFINITE: saturate first (torch's cast would give NaN past 448), then nearest even
        to_e4m3=lambda x: x.clamp(-dsa.E4M3_MAX, dsa.E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8),
        bytes_of=lambda x: x.contiguous().view(torch.uint8),  # little-endian, as the CUDA kernels store
        cat=lambda xs: torch.cat(xs, dim=-1),
        arange=lambda n, like: torch.arange(n, device=like.device),
    )


def mlx_ops():
    import mlx.core as mx

    return SimpleNamespace(
        f32=lambda x: x.astype(mx.float32), const=lambda value, like: mx.array(value, dtype=mx.float32),
        maximum=mx.maximum, exp2=lambda x: mx.power(mx.array(2.0, dtype=mx.float32), x), ceil=mx.ceil,
        log2=mx.log2, amax_abs=lambda x: mx.max(mx.abs(x), axis=-1),
        to_e4m3=mx.to_fp8,  # saturated at 448, nearest even
        bytes_of=lambda x: mx.view(x, mx.uint8),
        cat=lambda xs: mx.concatenate(xs, axis=-1),
        arange=lambda n, like: mx.arange(n),
    )
