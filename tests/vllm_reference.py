"""vLLM's reference semantics, ported for ropepool's tests (vLLM itself is not installed here).

Each function names the vLLM file and function whose behaviour it reproduces;
the code is written anew, small, on torch tensors (CPU). Layouts and rounding
rules are written down in docs/engines.md with the places they were read from.
"""
from __future__ import annotations

import torch

# kv_cache_dtype strings of vLLM's per-tensor fp8 caches and their element types on CUDA
# (vllm/v1/attention/backends/flash_attn.py get_fp8_dtype_for_flashattn: "fp8" is e4m3).
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# vLLM's kernel-test tolerances (tests/kernels/allclose_default.py: default_atol, default_rtol),
# used by tests/kernels/core/test_pos_encoding.py to compare its rotary kernel with forward_native.
# bfloat16's atol is 1e-2 in the current file; older ones had 1e-3, from when the CUDA kernel rounded
# each product to bf16 as forward_native does (its float32 kernel misses 1e-3 on ~0.3% of elements).
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6}


def cos_sin_cache(rotary_dim: int, max_position: int, base: float = 10000.0) -> torch.Tensor:
    """float32 ``[max_position, rotary_dim]``: cos half then sin half.

    Follows RotaryEmbedding._compute_inv_freq / _compute_cos_sin_cache
    (vllm/model_executor/layers/rotary_embedding/base.py): float32 inverse
    frequencies, the float32 outer product position x frequency, cos and sin.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def pairs(x, is_neox):
    """The rotated pairs (x1, x2): halves (NeoX) or even and odd features (GPT-J)."""
    if is_neox:
        return x.chunk(2, dim=-1)
    return x[..., 0::2], x[..., 1::2]


def unpair(o1, o2, is_neox):
    return torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)


def _rotate(x, table, positions, is_neox, compute_dtype):
    """x ``[T, H, D]`` with its first ``table.shape[1]`` features rotated; math in ``compute_dtype``."""
    r = table.shape[1]
    cos, sin = table.index_select(0, positions.flatten().long()).chunk(2, dim=-1)
    cos, sin = cos[:, None].to(compute_dtype), sin[:, None].to(compute_dtype)
    x1, x2 = pairs(x[..., :r].to(compute_dtype), is_neox)
    rot = unpair(x1 * cos - x2 * sin, x2 * cos + x1 * sin, is_neox).to(x.dtype)
    return torch.cat((rot, x[..., r:]), dim=-1)


def rotate_native(x, table, positions, is_neox):
    """RotaryEmbedding.forward_native (base.py) with apply_rotary_emb_torch
    (vllm/model_executor/layers/rotary_embedding/common.py): rows ``positions`` of the
    table, cos and sin cast to x's dtype, the rotation computed in x's dtype (each
    product and sum rounded to it), partial rotary on the first ``rotary_dim`` features."""
    return _rotate(x, table, positions, is_neox, x.dtype)


def rotate_fp32(x, table, positions, is_neox):
    """vLLM's CUDA rotary kernel (csrc pos_encoding_kernels.cu, apply_token_rotary_embedding,
    and the fused rope + reshape_and_cache_flash kernel that mirrors it): x, cos and sin
    upcast to float32, ``x*cos - y*sin`` and ``y*cos + x*sin`` in float32, one cast back."""
    return _rotate(x, table, positions, is_neox, torch.float32)


def quantize_fp8(x, scale, fp8_dtype):
    """fp8::scaled_convert as reshape_and_cache_flash uses it (csrc/quantization/.../quant_utils.cuh):
    ``float(x) / scale``, saturated to the format's finite range, rounded to nearest even.
    ``scale``: a float32 tensor of one element, or one per head (broadcast over ``x [..., H, D]``)."""
    s = scale.float().reshape(-1)
    s = s[:, None] if s.numel() > 1 else s
    big = torch.finfo(fp8_dtype).max
    return (x.float() / s).clamp(-big, big).to(fp8_dtype)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """reshape_and_cache_flash (csrc/cache_kernels.cu; its Triton twin is triton_reshape_and_cache_flash in
    vllm/v1/attention/ops/triton_reshape_and_cache_flash.py), in place on the caches.

    key, value ``[T, H, D]``; key_cache, value_cache ``[num_blocks, block_size, H, D]`` (any strides).
    Only the first ``len(slot_mapping)`` tokens are written (CUDA-graph padding beyond them is
    ignored); a slot < 0 is skipped; slot s goes to block ``s // block_size``, row ``s % block_size``.
    fp8 caches store ``quantize_fp8(x, scale)``; others store the row as it is.
    """
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, block_size)
        for cache, x, scale in ((key_cache, key[t], k_scale), (value_cache, value[t], v_scale)):
            cache[block, row] = quantize_fp8(x, scale, FP8[kv_cache_dtype]) if kv_cache_dtype in FP8 else x


# --- per-token-head quantization (kv_cache_dtype "int8_per_token_head" / "fp8_per_token_head") ------------

def quant_range(cache_dtype):
    """(QUANT_MAX, QUANT_MIN) of _reshape_cache_per_token_head's launcher
    (triton_reshape_and_cache_flash_per_token_head_quant): int8 127 / -128, fp8 its finite max."""
    if cache_dtype == torch.int8:
        return 127.0, -128.0
    big = torch.finfo(cache_dtype).max
    return big, -big


def reshape_and_cache_per_token_head(key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping):
    """_reshape_cache_per_token_head (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py), in place.

    key, value ``[T, H, D]``; key_cache, value_cache ``[num_blocks, block_size, H, D]`` int8 or fp8;
    k_scale_cache, v_scale_cache ``[num_blocks, block_size, H]`` float32 (any strides). For each
    token with a slot >= 0 and each head, in float32: ``scale = max(amax|x| / QUANT_MAX, 1e-6)``
    is stored, and the row stores ``clamp(x * (1 / scale), QUANT_MIN, QUANT_MAX)`` converted to
    the cache type as Triton's store converts it: int8 truncates toward zero (fptosi), fp8
    rounds to nearest even.
    """
    qmax, qmin = quant_range(key_cache.dtype)
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, row = divmod(slot, block_size)
        for cache, scales, x in ((key_cache, k_scale_cache, key[t]), (value_cache, v_scale_cache, value[t])):
            x = x.float()
            scale = torch.clamp_min(x.abs().amax(dim=-1) / torch.tensor(qmax), 1e-6)
            data = torch.clamp(x * torch.reciprocal(scale)[:, None], qmin, qmax)
            cache[block, row] = data.to(cache.dtype)  # torch's float -> int8 cast truncates, as fptosi does
            scales[block, row] = scale


def per_token_head_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, layout, fill=0):
    """vLLM's per-token-head cache, as uint8 storage filled with ``fill``: each head's row padded by
    ``4 // itemsize`` elements to hold its float32 scale (TritonAttentionBackend.get_kv_cache_shape,
    customize_spec). ``layout``: ``"blocks_first"`` ``[num_blocks, 2, block_size, H, head_size + 4]``,
    or ``"packed"`` ``[num_blocks, H, block_size, 2 * (head_size + 4)]`` (rows ``[K | K scale | V | V scale]``)."""
    row = head_size + 4 // torch.empty((), dtype=cache_dtype).element_size()
    shape = {"blocks_first": (num_blocks, 2, block_size, num_kv_heads, row),
             "packed": (num_blocks, num_kv_heads, block_size, 2 * row)}[layout]
    return torch.full(shape, fill, dtype=torch.uint8)


def per_token_head_views(kv_cache, head_size, cache_dtype, layout):
    """``(key_data, value_data, k_scales, v_scales)``: views into a per-token-head ``kv_cache`` (uint8).

    Data ``[num_blocks, block_size, H, head_size]`` of ``cache_dtype``; scales ``[num_blocks, block_size, H]``
    float32 over bytes ``[head_size, head_size + 4)`` of each (block, K or V, slot, head) row, the bytes
    TritonAttentionImpl._ensure_scale_caches reads as that row's scale.
    """
    if layout == "blocks_first":
        halves = kv_cache.unbind(1)
    else:
        row = kv_cache.shape[-1] // 2
        nhd = kv_cache.transpose(1, 2)
        halves = (nhd[..., :row], nhd[..., row:])
    data = tuple(h[..., :head_size].view(cache_dtype) for h in halves)
    scales = tuple(h[..., head_size:].view(torch.float32)[..., 0] for h in halves)
    return (*data, *scales)


# --- the QK-norm hooks' unfused ops (vllm/compilation/passes/fusion/qk_norm_rope_kvcache_fusion.py) -------------

def rms_norm(x, weight, eps):
    """vllm.ir.ops.rms_norm (vllm/ir/ops/layernorm.py), the op QkNormRopeKvCachePattern matches per head: x in
    float32, ``x * rsqrt(mean(x^2) + eps)``, cast to the weight's dtype, times the weight, cast to x's dtype."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y.to(weight.dtype) * weight).to(x.dtype)


def mrope_rows(table, positions, section, interleaved):
    """MRotaryEmbedding.forward_native's table rows for ``[3, T]`` positions (vllm/model_executor/layers/
    rotary_embedding/mrope.py): frequency i of the cos (and sin) half from the row of the time, height or
    width position, chunks of ``section`` (or apply_interleaved_rope's T/H/W cycle). ``[T, rotary_dim]``:
    rotate_native(x, rows, arange(T), ...) is the rotation."""
    halves = []
    for half in table[positions].chunk(2, dim=-1):  # [3, T, rotary_dim / 2]
        if interleaved:
            c = torch.arange(half.shape[-1])
            pick = torch.where((c % 3 == 1) & (c < section[1] * 3), 1, 0)
            pick = torch.where((c % 3 == 2) & (c < section[2] * 3), 2, pick)
            halves.append(half.gather(0, pick.expand(1, half.shape[1], -1)).squeeze(0))
        else:
            halves.append(torch.cat([m[i] for i, m in enumerate(half.split(list(section), dim=-1))], dim=-1))
    return torch.cat(halves, dim=-1)
