"""The block-quantized KV-cache formats, as the engines' own writers store them: NumPy models.

Both formats quantize each written row in float32 arithmetic, so bit-exact
agreement needs the same float32 steps, not float64: these functions are
float32 models of the engines' quantizers, read from their source, and take
the rows as the engine receives them (already rounded to the model's dtype).
The float64 oracle (``ropepool.reference``) rotates in float64, rounds the
row to q's dtype and hands it here.

NVFP4 (FlashInfer's paged KV append, ``nvfp4_append_quantize_block`` in
flashinfer-ai/flashinfer include/flashinfer/page.cuh, commit fb28d72): each
block of 16 values of a row gets ``sf = amax / (6 * global_scale)``, stored as
float8_e4m3fn (round to nearest even, saturated at 448); each value is
multiplied by ``1 / (float(sf_e4m3) * global_scale)`` and rounded to the
nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the even code,
saturated at 6), sign in bit 3. Two values a byte, the even-indexed one in
the low nibble. ``global_scale`` is the decode scale: a value is
``e2m1 * sf * global_scale``.

Affine (MLX's ``mx.quantize``, the format of mlx-lm's ``QuantizedKVCache``;
ml-explore/mlx mlx/backend/cpu/quantized.cpp ``quantize``, commit 846d176):
each group of ``group_size`` values gets a scale and a bias in float32 (the
edge of larger magnitude is represented exactly), then each value is
``rint((w - bias) / scale)`` clipped to ``[0, 2**bits - 1]``, and
``32 // bits`` of them fill one uint32 word, element ``k`` at bit ``k * bits``.
Scales and biases are stored in the row's dtype.
"""
from __future__ import annotations

import numpy as np

from ..core.layout import page_and_row, paged_view, pool_geometry
from ..formats.nvfp4 import E2M1_MAX, NVFP4_BLOCK

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # code 0..7: the magnitudes of e2m1
E4M3_MAX = 448.0


def _f32(x):
    return np.asarray(x).astype(np.float32)


def e4m3(x):
    """float32 ``x >= 0`` to float8_e4m3fn, nearest even, saturated at 448 (CUDA's ``__nv_fp8_e4m3(float)``)."""
    import ml_dtypes

    return np.minimum(_f32(x), np.float32(E4M3_MAX)).astype(ml_dtypes.float8_e4m3fn)


def e2m1_codes(x):
    """The 4-bit e2m1 codes of float32 ``x``: nearest magnitude (ties to the even code, above 6: 6), sign bit 3.

    Computed from distances in float64 (exact for float32 inputs), not from thresholds: an independent
    model of the kernel's comparison ladder. NaN gives code 0 with its sign, as the kernel's ladder does."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.abs(x).astype(np.float64)
    dist = np.abs(mag[..., None] - E2M1_VALUES)
    best = dist.min(-1, keepdims=True)
    tied = dist == best
    # Among the nearest (one, or two at a tie), take the even code; beyond the last value, the last.
    even = tied & (np.arange(8) % 2 == 0)
    code = np.where(even.any(-1), even.argmax(-1), tied.argmax(-1))
    code = np.where(mag >= E2M1_MAX, 7, np.where(np.isnan(mag), 0, code))  # saturated (also where 6 is lost)
    return (code | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


def nvfp4_rows(x, global_scale):
    """FlashInfer's NVFP4 quantization of rows ``x [..., D]`` (D a multiple of 16).

    Returns ``(data uint8 [..., D // 2], block_scales float8_e4m3fn [..., D // 16])``."""
    x = _f32(x)
    *lead, D = x.shape
    blocks = x.reshape(*lead, D // NVFP4_BLOCK, NVFP4_BLOCK)
    gs = np.float32(global_scale)
    amax = np.abs(blocks).max(-1)
    live = amax > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        sf = e4m3(np.where(live, amax / (np.float32(E2M1_MAX) * gs), np.float32(0)))
        sf32 = sf.astype(np.float32)
        out_scale = np.where(live & (sf32 > 0), np.float32(1) / (sf32 * gs), np.float32(0)).astype(np.float32)
        codes = e2m1_codes(blocks * out_scale[..., None]).reshape(*lead, D)
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return data.astype(np.uint8), sf


def affine_rows(x, bits: int, group_size: int):
    """MLX's affine quantization of rows ``x [..., D]``: ``(words uint32 [..., D * bits // 32], scales, biases)``,
    scales and biases ``[..., D // group_size]`` in x's dtype (as ``mx.quantize`` returns them)."""
    x = np.asarray(x)
    w = x.astype(np.float32)
    *lead, D = w.shape
    groups = w.reshape(*lead, D // group_size, group_size)
    n_bins = np.float32(2 ** bits - 1)
    w_max, w_min = groups.max(-1), groups.min(-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nonzero, edge / q0, scale).astype(np.float32)
    bias = np.where(nonzero, edge, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((groups - bias[..., None]) / scale[..., None]), 0, n_bins).astype(np.uint32)
    per_word = 32 // bits
    q = q.reshape(*lead, D // per_word, per_word)
    words = np.bitwise_or.reduce(q << (np.arange(per_word, dtype=np.uint32) * bits), axis=-1)
    return words.astype(np.uint32), scale.astype(x.dtype), bias.astype(x.dtype)


def write_rows(parts, stored, slots, *, kv_layout=None, layer=None):
    """New copies of a pool's ``parts`` (data, scales, ...: each shaped like the pool with its own last dim),
    token ``t``'s ``stored[i][t]`` written at slot ``slots[t]`` of part ``i``; slots below 0 write nothing."""
    slots = np.asarray(slots)
    write = slots >= 0
    out = []
    for part, rows in zip(parts, stored):
        part = np.array(part, copy=True)
        geom = pool_geometry(part.shape, layer, kv_layout)
        page, row = page_and_row(slots[write], geom.page_size)
        paged_view(part, geom)[page, row] = np.asarray(rows)[write]
        out.append(part)
    return out
