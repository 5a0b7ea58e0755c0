"""DeepSeek V3.2's ``fp8_ds_mla`` latent cache (vLLM's ``kv_cache_dtype``, FlashMLA's sparse format).

One 656-byte row per token: the 512 features of kv_c as float8_e4m3 in four tiles of 128, each tile divided
by its own scale ``max(amax(|tile|) / 448, FLT_MIN)``; the four float32 scales; the 64 rotated k_pe features
in the inputs' 16-bit dtype, not quantized. The semantics are vLLM's writer, read from vllm-project/vllm
csrc/libtorch_stable/cache_kernels.cu at 37cb21c1695d11baba8e369b071d2f44c1561c8f
(concat_and_cache_ds_mla_kernel); docs/layouts.md draws the bytes.

Here: the check of the arrays (``check``, shapes and dtype names only: NumPy, PyTorch and MLX share it), the
NumPy model (``oracle_rows``: float64, rounding where the writer rounds), the writer's float32 steps as array
math (``rows``; ``put``, torch: ``put(fmt, pool, geom, page, row, rows, ops)`` as every byte format). The call's
``cache_format=`` argument is checked in checks/dsa.py; the Triton kernel's store is
``backends/triton_stores.py: ds_mla_store``.
"""
from __future__ import annotations

import numpy as np

from ..core.dtypes import dtype_name
from ..core.layout import paged_view
from ..errors import RopePoolError
from .e4m3 import E4M3_MAX, e4m3_bytes, f32_quotient

NAME = "fp8_ds_mla"
MEANS = ("kv_c's 512 features as e4m3 in 4 tiles of 128, x / s with s = max(amax / 448, FLT_MIN), then the 4 "
         "float32 scales, at the start of each 656-byte row (the row's k_pe: the plain k pool, a view)")
BACKENDS = frozenset({".triton_op", ".torch_eager"})  # the rows that write it (MLX has no views of a byte row)

DS_MLA_RANK = 512  # kv_lora_rank: 512 float8 values
DS_MLA_TILE = 128  # features per scale
DS_MLA_TILES = DS_MLA_RANK // DS_MLA_TILE
DS_MLA_PE = 64  # rope_dim: 64 16-bit features
DS_MLA_SCALES_AT = DS_MLA_RANK  # byte offset of the four float32 scales
DS_MLA_PE_AT = DS_MLA_SCALES_AT + 4 * DS_MLA_TILES  # 528: byte offset of k_pe
DS_MLA_ROW = DS_MLA_PE_AT + 2 * DS_MLA_PE  # 656 bytes
FLT_MIN = 1.1754943508222875e-38  # float32's smallest normal: the floor of a tile scale (CUDA's FLT_MIN)


def _last(x) -> int:
    return x.shape[-1]


def check(kv_c, k_pe, kv_cache) -> None:
    """Rows of ``fp8_ds_mla``: 512 + 64 features in a 16-bit dtype, a uint8 cache of 656-byte rows."""
    if dtype_name(kv_cache) != "uint8" or _last(kv_cache) != DS_MLA_ROW:
        raise RopePoolError(f"fp8_ds_mla rows must be uint8 [..., {DS_MLA_ROW}] (512 fp8 values, 4 float32 scales, "
                            f"64 16-bit k_pe features); got {dtype_name(kv_cache)} with last dim {_last(kv_cache)}. "
                            f"Fix: allocate the cache as vLLM does, torch.zeros(num_blocks, block_size, "
                            f"{DS_MLA_ROW}, dtype=torch.uint8).")
    if _last(kv_c) != DS_MLA_RANK or _last(k_pe) != DS_MLA_PE:
        raise RopePoolError(f"fp8_ds_mla needs kv_lora_rank {DS_MLA_RANK} and rope_dim {DS_MLA_PE}; got kv_c with "
                            f"{_last(kv_c)} and k_pe with {_last(k_pe)} features. Fix: this format is DeepSeek "
                            "V3.2's; other latent sizes use bfloat16 or fp8 caches with scale=.")
    if dtype_name(kv_c) not in ("float16", "bfloat16"):
        raise RopePoolError(f"fp8_ds_mla stores k_pe in the inputs' 16-bit dtype; got {dtype_name(kv_c)}. Fix: "
                            "pass float16 or bfloat16 q_pe, k_pe and kv_c.")


# --- the NumPy model (the oracle's) ------------------------------------------------------------------------

def oracle_rows(kv_c, k_pe):
    """``[T, 656]`` uint8 fp8_ds_mla rows of ``kv_c [T, 512]`` and the rotated ``k_pe [T, 64]`` (16-bit dtype)."""
    kv_c = np.asarray(kv_c)
    T = kv_c.shape[0]
    tiles = kv_c.astype(np.float64).reshape(T, DS_MLA_TILES, DS_MLA_TILE)
    scale = np.maximum(f32_quotient(np.abs(tiles).max(-1), E4M3_MAX), np.float32(FLT_MIN))
    values = e4m3_bytes(f32_quotient(tiles, scale[..., None])).reshape(T, DS_MLA_RANK)
    pe = np.ascontiguousarray(np.asarray(k_pe).reshape(T, DS_MLA_PE)).view(np.uint8)  # the 16-bit bytes as given
    return np.concatenate([values, scale.astype("<f4").view(np.uint8), pe.reshape(T, 2 * DS_MLA_PE)], axis=1)


# --- array math: torch tensors and MLX arrays ---------------------------------------------------------------

def ds_mla_head(kv_c, ops):
    """The first 528 bytes of the fp8_ds_mla rows of ``kv_c [N, 512]``: its e4m3 values, then the 4 scales."""
    n = kv_c.shape[0]
    tiles = ops.f32(kv_c).reshape(n, DS_MLA_TILES, DS_MLA_TILE)
    scale = ops.maximum(ops.absmax_last(tiles) / ops.scalar(E4M3_MAX, kv_c), ops.scalar(FLT_MIN, kv_c))
    values = ops.to_e4m3(tiles / scale[..., None]).reshape(n, DS_MLA_RANK)
    return ops.cat([values, ops.bytes_of(scale)], -1)


def rows(kv_c, k_pe, ops):
    """``[N, 656]`` uint8 rows of ``kv_c [N, 512]`` and the rotated ``k_pe [N, 64]`` (both 16-bit)."""
    return ops.cat([ds_mla_head(kv_c, ops), ops.bytes_of(k_pe.reshape(kv_c.shape[0], DS_MLA_PE))], -1)


def put(fmt, cache, geom, page, row, kv_c, ops):
    """Torch: kv_c's values and scales into the first 528 bytes of the cache rows (page, row) of the layout
    ``geom`` (through views, in place; the rest of each row is the k pool's)."""
    head = ds_mla_head(kv_c, ops)
    paged_view(cache[..., :head.shape[1]], geom).index_put_((page, row, row * 0), head)
