"""The readable definition of rope_pool_fused: NumPy, float64, no fast paths.

It is the oracle of every test. Same signature as ``ropepool.rope_pool_fused``;
takes NumPy arrays and returns new ones (inputs untouched). The angle is the
float32 product ``float32(position) * float32(inv_freq)``, as the contract
defines it (docs/precision.md); everything after it is float64.
"""
from __future__ import annotations

import numpy as np

from . import validate
from .layout import page_and_row, paged_view


def angles(spec, positions) -> np.ndarray:
    """float64 ``[num_tokens, rotary_dim // 2]``: the float32 angles of a call."""
    inv_freq = spec.inv_freq
    if spec.long_from is not None and positions.size and positions.max() >= spec.long_from:
        inv_freq = spec.long_inv_freq
    pos32 = np.asarray(positions).astype(np.float32)
    return (pos32[:, None] * inv_freq.astype(np.float32)[None, :]).astype(np.float64)


def rotate(x, cos, sin, spec):
    """Rotate ``x [T, H, head_dim]`` by ``cos, sin [T, rotary_dim // 2]``."""
    x = x.astype(np.float64)
    c, s = cos[:, None, :], sin[:, None, :]
    r = spec.rotary_dim
    if spec.style == "neox":
        x1, x2 = x[..., : r // 2], x[..., r // 2 : r]
    else:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    o1, o2 = x1 * c - x2 * s, x1 * s + x2 * c
    out = x.copy()
    if spec.style == "neox":
        out[..., : r // 2], out[..., r // 2 : r] = o1, o2
    else:
        out[..., 0:r:2], out[..., 1:r:2] = o1, o2
    return out


def quantize(x, scale, dtype):
    """What an fp8 pool stores: ``x / scale`` saturated to the format's finite range."""
    import ml_dtypes

    top = float(ml_dtypes.finfo(dtype).max)
    return np.clip(x / float(np.asarray(scale).reshape(())), -top, top).astype(dtype)


def rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads, num_kv_heads,
                    rope_base=10000.0, rope=None, layer=None, k_scale=None, v_scale=None, kv_layout=None):
    """Oracle of :func:`ropepool.rope_pool_fused`; returns ``(q_rot, k_rot, k_pool, v_pool)`` as new arrays."""
    call = validate.check(q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim,
                          num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, rope_base=rope_base,
                          rope=rope, layer=layer, k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout,
                          frameworks=("numpy",))
    spec = call.spec
    ang = angles(spec, positions)
    cos, sin = np.cos(ang) * spec.attention_scaling, np.sin(ang) * spec.attention_scaling
    q_rot, k_rot = rotate(q, cos, sin, spec), rotate(k, cos, sin, spec)

    k_pool, v_pool = k_pool.copy(), v_pool.copy()
    write = slots >= 0
    page, row = page_and_row(slots[write], call.page_size)
    for pool, rows, scale in ((k_pool, k_rot[write], k_scale), (v_pool, v[write], v_scale)):
        if scale is not None:
            rows = quantize(rows, scale, pool.dtype)
        paged_view(pool, call)[page, row] = rows
    return q_rot, k_rot, k_pool, v_pool
