"""Ports of the engines' own block-quantized KV writers, the second oracle of the quantized pools.

- FlashInfer's NVFP4 paged append, ported statement by statement to torch
  float32 (flashinfer-ai/flashinfer at fb28d7242b3506a2348265962041acc1fb56cca4,
  include/flashinfer/page.cuh: ``nvfp4_append_quantize_e2m1``,
  ``nvfp4_append_quantize_block`` and
  ``NVFP4QuantizeAppendPagedKVCacheWithSlotMappingKernel``; Python entry
  ``flashinfer.page.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping``).
  The kernel's comparison ladder is kept as written; ``ropepool.reference.quant``
  models the same rounding from distances instead, so the two are independent.
  FlashInfer builds its kernels with ``-use_fast_math``: on the GPU its two
  divisions may be approximate; the port, like the source, divides exactly.
- MLX's affine format is checked against ``mx.quantize`` itself (no port):
  ``mlx_affine_rows`` runs it on the rows and returns NumPy arrays (mlx-lm's
  ``QuantizedKVCache.update_and_fetch`` stores exactly what it returns).
- ``scatter``: an engine's slot write, one token and head at a time, with the
  index arithmetic spelled out per layout (ropepool's own uses views).
"""
from __future__ import annotations

import numpy as np

BLOCK = 16


def _torch():
    import torch

    return torch


def fi_quantize_e2m1(value):
    """``nvfp4_append_quantize_e2m1`` on a float32 tensor: the kernel's threshold ladder, sign in bit 3."""
    torch = _torch()
    mag = value.abs()
    code = torch.full(value.shape, 7, dtype=torch.uint8)
    # The ladder from the top down, so that the first (lowest) matching rung wins as in the if/else chain.
    for rung, hit in ((6, mag <= 5.0), (5, mag < 3.5), (4, mag <= 2.5), (3, mag < 1.75), (2, mag <= 1.25),
                      (1, mag < 0.75), (0, ~(mag > 0.25))):
        code = torch.where(hit, torch.tensor(rung, dtype=torch.uint8), code)
    return code | (torch.signbit(value).to(torch.uint8) << 3)


def fi_quantize_block(values, global_scale: float):
    """``nvfp4_append_quantize_block`` on float32 ``values [..., 16]``: ``(packed uint8 [..., 8], sf uint8 [...])``."""
    torch = _torch()
    gs = torch.tensor(global_scale, dtype=torch.float32)
    amax = values.abs().amax(-1)
    zero = torch.zeros((), dtype=torch.float32)
    live = (amax > 0) & (gs > 0)
    sf_value = torch.where(live, amax / (torch.tensor(6.0, dtype=torch.float32) * gs), zero)
    # __nv_fp8_e4m3(float): round to nearest even, saturating (torch's cast would give NaN past 448).
    sf_fp8 = sf_value.clamp(max=448.0).to(torch.float8_e4m3fn)
    sf_rounded = sf_fp8.to(torch.float32)
    ok = live & (sf_rounded > 0)
    output_scale = torch.where(ok, torch.tensor(1.0, dtype=torch.float32) / (sf_rounded * gs), zero)
    scaled = values * output_scale[..., None]
    lo, hi = fi_quantize_e2m1(scaled[..., 0::2]), fi_quantize_e2m1(scaled[..., 1::2])
    return lo | (hi << 4), sf_fp8.view(torch.uint8)


def fi_append_slot_mapping(key, slot_mapping, k_cache, k_sf_cache, k_scale: float, kv_layout: str = "NHD"):
    """The slot-mapping kernel's K half (V is the same code with v's tensors): for each token with
    ``0 <= slot < pages * page_size``, every head's row quantized block by block into ``k_cache``
    (uint8 ``[pages, page_size, H, D // 2]`` NHD or ``[pages, H, page_size, D // 2]`` HND) and its block
    scales into ``k_sf_cache`` (float8_e4m3fn, last dim ``D // 16``). In place, as the kernel writes."""
    torch = _torch()
    T, H, D = key.shape
    pages = k_cache.shape[0]
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    sf_bytes = k_sf_cache.view(torch.uint8)
    for t in range(T):
        slot = int(slot_mapping[t])
        if slot < 0 or slot >= pages * page_size:
            continue
        page, entry = slot // page_size, slot % page_size
        for h in range(H):
            row = key[t, h].to(torch.float32)  # nvfp4_append_to_float
            packed, sf = fi_quantize_block(row.reshape(D // BLOCK, BLOCK), k_scale)
            if kv_layout == "NHD":
                k_cache[page, entry, h] = packed.reshape(-1)
                sf_bytes[page, entry, h] = sf
            else:
                k_cache[page, h, entry] = packed.reshape(-1)
                sf_bytes[page, h, entry] = sf


def mlx_affine_rows(rows, bits: int, group_size: int):
    """``mx.quantize(rows, group_size, bits)`` (affine) as NumPy ``(words, scales, biases)``."""
    import mlx.core as mx

    w, s, b = mx.quantize(to_mx(rows), group_size=group_size, bits=bits)
    return np.array(w), mx_to_np(s), mx_to_np(b)


def to_mx(rows):
    """A NumPy array as an MLX array, bits kept (bfloat16 through its uint16 bits: NaN payloads too)."""
    import ml_dtypes
    import mlx.core as mx

    rows = np.ascontiguousarray(rows)
    if rows.dtype == ml_dtypes.bfloat16:
        return mx.view(mx.array(rows.view(np.uint16)), mx.bfloat16)
    return mx.array(rows)


def mx_to_np(a):
    """An MLX array as NumPy, bits kept (bfloat16 as ml_dtypes')."""
    import ml_dtypes
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        return np.array(mx.view(a, mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(a)


def scatter(part, rows, slots, kv_layout=None, layer=None):
    """A copy of ``part`` with ``rows[t]`` (all heads) written at slot ``slots[t]`` (below 0: skipped)."""
    part = np.array(part, copy=True)
    one = part if layer is None else part[layer]  # a view: writes land in ``part``
    page_size = 1 if kv_layout is None else one.shape[1 if kv_layout == "NHD" else 2]
    for t, slot in enumerate(np.asarray(slots).tolist()):
        if slot < 0:
            continue
        page, entry = divmod(slot, page_size)
        for h in range(rows.shape[1]):
            if kv_layout is None:
                one[slot, h] = rows[t, h]
            elif kv_layout == "NHD":
                one[page, entry, h] = rows[t, h]
            else:
                one[page, h, entry] = rows[t, h]
    return part
