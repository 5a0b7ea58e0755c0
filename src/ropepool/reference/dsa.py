"""The oracle of DeepSeek V3.2's two caches (``ropepool.checks.dsa``): NumPy, float64, rounding where the writer rounds.

The writers round in two places, so the oracle does too: each scale is a float32 quotient
(``float32(amax / 448)``: a float64 quotient of two float32 numbers rounded once to float32 is the
correctly rounded float32 quotient), and each stored value is the float32 quotient ``float32(x / s)``
rounded to e4m3, nearest even, saturated to +-448. Everything else is exact in float64.

``ds_mla_rows`` and ``indexer_quantize`` take the rows as the cache receives them (kv_c, and the
rotated k in the inputs' dtype); ``rope_latent_ds_mla`` and ``rope_indexer`` are the whole ops:
rotate (``reference.cos_sin``), round to the inputs' dtype, quantize, write; they return new arrays.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..checks import dsa
from ..core.layout import page_and_row, paged_view, pool_geometry
from . import cos_sin, rope_and_norm

FLT_MIN = float(np.finfo(np.float32).tiny)  # the ds_mla tile scale's floor (CUDA's FLT_MIN)


def e4m3_bytes(q32):
    """float32 quotients as e4m3 bytes: nearest even, saturated to +-448 (``__NV_SATFINITE``)."""
    q32 = np.clip(np.asarray(q32, dtype=np.float32), -dsa.E4M3_MAX, dsa.E4M3_MAX)
    return q32.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _f32_quotient(x, s):
    return (np.asarray(x, dtype=np.float64) / np.asarray(s, dtype=np.float64)).astype(np.float32)


def ds_mla_rows(kv_c, k_pe):
    """``[T, 656]`` uint8 fp8_ds_mla rows of ``kv_c [T, 512]`` and the rotated ``k_pe [T, 64]`` (16-bit dtype)."""
    kv_c = np.asarray(kv_c)
    T = kv_c.shape[0]
    tiles = kv_c.astype(np.float64).reshape(T, dsa.DS_MLA_TILES, dsa.DS_MLA_TILE)
    scale = np.maximum(_f32_quotient(np.abs(tiles).max(-1), dsa.E4M3_MAX), np.float32(FLT_MIN))
    values = e4m3_bytes(_f32_quotient(tiles, scale[..., None])).reshape(T, dsa.DS_MLA_RANK)
    pe = np.ascontiguousarray(np.asarray(k_pe).reshape(T, dsa.DS_MLA_PE)).view(np.uint8)  # the 16-bit bytes as given
    return np.concatenate([values, scale.astype("<f4").view(np.uint8), pe.reshape(T, 2 * dsa.DS_MLA_PE)], axis=1)


def indexer_quantize(k, ue8m0: bool):
    """The indexer key ``k [T, D]`` (16-bit or float32) as e4m3 bytes ``[T, D]`` and float32 scales
    ``[T, D // 128]``: ``s = float32(max(amax, float32(1e-4)) / 448)``; with ue8m0
    ``2 ** ceil(float32(log2(s)))``, as ``exp2f(ceilf(log2f(s)))`` (a scale within a rounding step of
    log2 above a power of two stays that power)."""
    k = np.asarray(k)
    T, D = k.shape
    groups = k.astype(np.float64).reshape(T, D // dsa.INDEXER_GROUP, dsa.INDEXER_GROUP)
    amax = np.maximum(np.abs(groups).max(-1), np.float64(np.float32(dsa.INDEXER_SCALE_FLOOR)))
    scale = _f32_quotient(amax, dsa.E4M3_MAX)
    if ue8m0:
        scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)).astype(np.float32))).astype(np.float32)
    return e4m3_bytes(_f32_quotient(groups, scale[..., None])).reshape(T, D), scale


def write_ds_mla(kv_cache, slots, rows, kv_layout=None, layer=None):
    """A copy of ``kv_cache`` (``[pool_size, 656]``, paged ``[num_blocks, block_size, 656]`` with
    ``kv_layout="NHD"``, a leading layer dim with ``layer=``) with ``rows`` at ``slots`` (< 0: skipped)."""
    cache = np.array(kv_cache, copy=True)
    geom = pool_geometry(cache.shape, layer, kv_layout, headed=False)
    slots = np.asarray(slots)
    write = slots >= 0
    page, row = page_and_row(slots[write], geom.page_size)
    paged_view(cache, geom)[page, row, 0] = np.asarray(rows)[write]
    return cache


def write_indexer(k_cache, slots, values, scales, kv_layout=None, layer=None):
    """A copy of ``k_cache`` with the quantized keys at ``slots``, where vLLM keeps them: each page of
    ``page_size`` rows holds, from its first byte, the ``page_size * D`` values of its rows (row by
    row), then their ``page_size * D / 128`` float32 scales. A flat cache is pages of one row."""
    cache = np.array(k_cache, copy=True)
    geom = pool_geometry(cache.shape, layer, kv_layout, headed=False)
    slots = np.asarray(slots)
    write = slots >= 0
    page, row = page_and_row(slots[write], geom.page_size)
    values, scales = np.asarray(values)[write], np.asarray(scales, dtype="<f4")[write]
    D, width = values.shape[1], geom.dim
    # Byte b of a page is at (row b // width, column b % width) of that page's [page_size, width] rows.
    at_value = row[:, None] * D + np.arange(D)
    at_scale = geom.page_size * D + row[:, None] * 4 * scales.shape[1] + np.arange(4 * scales.shape[1])
    view = paged_view(cache, geom)[..., 0, :]  # [num_pages, page_size, width]
    for at, data in ((at_value, values), (at_scale, scales.view(np.uint8).reshape(len(scales), -1))):
        view[page[:, None], at // width, at % width] = data
    return cache


def _rotated(x, positions, rope):
    """``x [T, H, D]`` rotated by ``rope`` (its first rotary_dim features), float64."""
    rot = rope.rotation
    cos, sin = cos_sin(rot, positions)
    return rope_and_norm(x, cos, sin, rot, None, None)


def rope_latent_ds_mla(q_pe, k_pe, kv_c, positions, slots, kv_cache, *, rope, kv_layout=None, layer=None):
    """The whole op writing fp8_ds_mla rows: q_pe and k_pe rotated by ``rope``, the rows of kv_c and the
    rotated k_pe written at ``slots``. Returns ``(q_pe_rot, k_pe_rot, kv_cache)``: the rotations in
    float64, the cache a new array whose k_pe part holds k_pe_rot rounded to the inputs' dtype."""
    dsa.check_ds_mla(kv_c, k_pe, kv_cache)
    q_rot = _rotated(q_pe, positions, rope)
    k_rot = _rotated(np.asarray(k_pe).reshape(len(k_pe), 1, -1), positions, rope).reshape(np.shape(k_pe))
    rows = ds_mla_rows(kv_c, k_rot.reshape(len(k_pe), -1).astype(np.asarray(k_pe).dtype))
    return q_rot, k_rot, write_ds_mla(kv_cache, slots, rows, kv_layout, layer)


def rope_indexer(q, k, positions, slots, k_cache, *, rope, scale_fmt=None, quant_block_size=dsa.INDEXER_GROUP,
                 kv_layout=None, layer=None):
    """The whole indexer-key write: ``q [T, H, D]`` and ``k [T, D]`` rotated by ``rope`` (DeepSeek
    V3.2: the first 64 of 128 features, NeoX pairs), ``k_rot`` rounded to k's dtype, quantized and
    written. Returns ``(q_rot, k_rot, k_cache)``, the rotations in float64, the cache a new array."""
    dsa.check_indexer("rope_indexer", k, k_cache, quant_block_size, scale_fmt)
    q_rot = _rotated(q, positions, rope)
    k_rot = _rotated(np.asarray(k).reshape(len(k), 1, -1), positions, rope).reshape(np.shape(k))
    values, scales = indexer_quantize(k_rot.reshape(len(k), -1).astype(np.asarray(k).dtype), scale_fmt == "ue8m0")
    return q_rot, k_rot, write_indexer(k_cache, slots, values, scales, kv_layout, layer)
