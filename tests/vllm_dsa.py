"""vLLM's two DeepSeek V3.2 cache writers, ported to torch (CPU) as test oracles.

Read from vllm-project/vllm, csrc/libtorch_stable/cache_kernels.cu at commit
37cb21c1695d11baba8e369b071d2f44c1561c8f: ``concat_and_cache_mla`` with ``kv_cache_dtype="fp8_ds_mla"``
(``concat_and_cache_ds_mla_kernel``) and ``indexer_k_quant_and_cache`` (``indexer_k_quant_and_cache_kernel``),
with ``fp8::scaled_convert`` of csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh (``float(x) / scale``
in float32, then ``__nv_cvt_float_to_fp8(..., __NV_SATFINITE, __NV_E4M3)``: nearest even, saturated).
The code is written anew: one token at a time, every address computed as the kernel computes it, on
the cache's bytes (so a wrong offset in ropepool shows as a wrong byte here). vLLM's Python callers:
vllm/model_executor/layers/attention/mla_attention.py (concat_and_cache_mla) and
vllm/model_executor/layers/sparse_attn_indexer.py (indexer_k_quant_and_cache with the layer's
scale_fmt, "ue8m0" for DeepSeek V3.2: vllm/model_executor/models/deepseek_v2.py, Indexer).
"""
from __future__ import annotations

import torch

FLT_MIN = torch.finfo(torch.float32).tiny
E4M3_MAX = 448.0  # kFp8ScaleDivisor on CUDA


def _scaled_convert(x, scale):
    """fp8::scaled_convert<uint8_t, scalar_t, kFp8E4M3>: float32 x / scale, saturated, e4m3 byte."""
    q = x.float() / scale
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _bytes(cache):
    """The cache's memory from its first element as a flat uint8 tensor (a view: writes land in the cache)."""
    assert cache.dtype == torch.uint8
    extent = 1 + sum((n - 1) * s for n, s in zip(cache.shape, cache.stride()))
    return cache.as_strided((extent,), (1,))


def concat_and_cache_ds_mla(kv_c, k_pe, kv_cache, slot_mapping):
    """concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, "fp8_ds_mla", scale): kv_cache is the uint8
    ``[num_blocks, block_size, 656]`` tensor (any block and entry stride); ``scale`` is unused by this format."""
    kv_lora_rank, pe_dim = kv_c.shape[1], k_pe.shape[1]
    # The host checks of concat_and_cache_mla for fp8_ds_mla.
    assert kv_lora_rank == 512 and pe_dim == 64 and kv_cache.shape[2] == 656 // kv_cache.element_size()
    assert kv_c.element_size() == 2 and k_pe.element_size() == 2
    block_size, block_stride, entry_stride = kv_cache.shape[1], kv_cache.stride(0), kv_cache.stride(1)
    mem = _bytes(kv_cache)
    for token_idx in range(slot_mapping.shape[0]):
        slot_idx = int(slot_mapping[token_idx])
        if slot_idx < 0:
            continue
        dst_idx_start = (slot_idx // block_size) * block_stride + (slot_idx % block_size) * entry_stride
        # Warp 2: k_pe, raw 16-bit values at 16-bit index kv_lora_rank / 2 + 8 + i of the row.
        pe_at = dst_idx_start + 2 * (kv_lora_rank // 2 + 8)
        mem[pe_at: pe_at + 2 * pe_dim] = k_pe[token_idx].contiguous().view(torch.uint8)
        # Warps 0-1: four tiles of 128 values, each half-warp one tile.
        for tile_idx in range(4):
            vals = kv_c[token_idx, tile_idx * 128:(tile_idx + 1) * 128]
            max_abs = vals.float().abs().max()
            tile_scale = torch.clamp_min(max_abs / torch.tensor(E4M3_MAX), FLT_MIN)
            scale_at = dst_idx_start + 4 * (kv_lora_rank // 4 + tile_idx)  # float index kv_lora_rank / 4 + tile
            mem[scale_at: scale_at + 4] = tile_scale.reshape(1).view(torch.uint8)
            at = dst_idx_start + tile_idx * 128
            mem[at: at + 128] = _scaled_convert(vals, tile_scale)


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt):
    """indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt): k ``[T, head_dim]``
    read as contiguous rows, kv_cache uint8 ``[num_blocks, block_size, cache_stride]`` addressed as
    contiguous blocks (``block_idx * block_size * cache_stride``), as the kernel does."""
    num_tokens, head_dim = k.shape
    cache_block_size, cache_stride = kv_cache.shape[1], kv_cache.shape[2]
    use_ue8m0 = scale_fmt == "ue8m0"
    assert head_dim % quant_block_size == 0
    mem, flat_k = _bytes(kv_cache), k.contiguous().view(-1)
    for token_idx in range(num_tokens):
        slot_idx = int(slot_mapping[token_idx])
        if slot_idx < 0:
            continue
        block_idx, block_offset = slot_idx // cache_block_size, slot_idx % cache_block_size
        # Each warp: 32 lanes x 4 values = 128 consecutive values, amax reduced over the warp.
        for head_dim_idx in range(0, head_dim, 128):
            vals = flat_k[token_idx * head_dim + head_dim_idx: token_idx * head_dim + head_dim_idx + 128]
            amax = vals.float().abs().max()
            scale = torch.clamp_min(amax, torch.tensor(1e-4, dtype=torch.float32)) / torch.tensor(E4M3_MAX)
            if use_ue8m0:
                scale = torch.exp2(torch.ceil(torch.log2(scale)))
            dst_offset = block_idx * cache_block_size * cache_stride + block_offset * head_dim + head_dim_idx
            mem[dst_offset: dst_offset + 128] = _scaled_convert(vals, scale)
            dst_scale_idx = (block_idx * cache_block_size * cache_stride + cache_block_size * head_dim
                             + (block_offset * head_dim + head_dim_idx) * 4 // quant_block_size)
            at = 4 * (dst_scale_idx // 4)  # reinterpret_cast<float*>(kv_cache)[dst_scale_idx / 4]
            mem[at: at + 4] = scale.reshape(1).view(torch.uint8)
