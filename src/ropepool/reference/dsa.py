"""The oracle of DeepSeek V3.2's two caches (formats/fp8_ds_mla.py, formats/indexer.py): NumPy, float64,
rounding where the writer rounds (formats/e4m3.py says where). Everything else is exact in float64.

``ds_mla_rows`` and ``indexer_quantize`` (each format's model) take the rows as the cache receives them (kv_c,
and the rotated k in the inputs' dtype); ``rope_latent_ds_mla`` and ``rope_indexer`` are the whole ops: rotate
(``reference.cos_sin``), round to the inputs' dtype, quantize, write; they return new arrays.
"""
from __future__ import annotations

import numpy as np

from ..core.layout import page_and_row, paged_view, pool_geometry
from ..formats import fp8_ds_mla, indexer
from ..formats.fp8_ds_mla import oracle_rows as ds_mla_rows
from ..formats.indexer import oracle_rows as indexer_quantize
from ..formats.indexer import oracle_write as write_indexer
from . import cos_sin, rope_and_norm

__all__ = ["ds_mla_rows", "indexer_quantize", "write_ds_mla", "write_indexer", "rope_latent_ds_mla", "rope_indexer"]


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


def _rotated(x, positions, rope):
    """``x [T, H, D]`` rotated by ``rope`` (its first rotary_dim features), float64."""
    rot = rope.rotation
    cos, sin = cos_sin(rot, positions)
    return rope_and_norm(x, cos, sin, rot, None, None)


def rope_latent_ds_mla(q_pe, k_pe, kv_c, positions, slots, kv_cache, *, rope, kv_layout=None, layer=None):
    """The whole op writing fp8_ds_mla rows: q_pe and k_pe rotated by ``rope``, the rows of kv_c and the
    rotated k_pe written at ``slots``. Returns ``(q_pe_rot, k_pe_rot, kv_cache)``: the rotations in
    float64, the cache a new array whose k_pe part holds k_pe_rot rounded to the inputs' dtype."""
    fp8_ds_mla.check(kv_c, k_pe, kv_cache)
    q_rot = _rotated(q_pe, positions, rope)
    k_rot = _rotated(np.asarray(k_pe).reshape(len(k_pe), 1, -1), positions, rope).reshape(np.shape(k_pe))
    rows = ds_mla_rows(kv_c, k_rot.reshape(len(k_pe), -1).astype(np.asarray(k_pe).dtype))
    return q_rot, k_rot, write_ds_mla(kv_cache, slots, rows, kv_layout, layer)


def rope_indexer(q, k, positions, slots, k_cache, *, rope, scale_fmt=None, quant_block_size=indexer.INDEXER_GROUP,
                 kv_layout=None, layer=None):
    """The whole indexer-key write: ``q [T, H, D]`` and ``k [T, D]`` rotated by ``rope`` (DeepSeek
    V3.2: the first 64 of 128 features, NeoX pairs), ``k_rot`` rounded to k's dtype, quantized and
    written. Returns ``(q_rot, k_rot, k_cache)``, the rotations in float64, the cache a new array."""
    indexer.check("rope_indexer", k, k_cache, quant_block_size, scale_fmt)
    q_rot = _rotated(q, positions, rope)
    k_rot = _rotated(np.asarray(k).reshape(len(k), 1, -1), positions, rope).reshape(np.shape(k))
    values, scales = indexer_quantize(k_rot.reshape(len(k), -1).astype(np.asarray(k).dtype), scale_fmt == "ue8m0")
    return q_rot, k_rot, write_indexer(k_cache, slots, values, scales, kv_layout, layer)
