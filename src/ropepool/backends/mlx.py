"""The MLX path: rope_pool_fused as a few MLX graph nodes, functional and lazy.

Nothing here evaluates: ``run`` only adds nodes to MLX's graph (no
``mx.eval``, no ``.item()``, no conversion to NumPy), so a call can sit in a
larger lazy computation or under ``mx.compile``. The caller's arrays keep
their values: the pools come back as new arrays.

Rotation: explicit float32 math, the same as the PyTorch path. The angle is
``float32(position) * float32(inv_freq)`` with the frequencies taken from the
spec, cos/sin are MLX's float32 ``mx.cos``/``mx.sin`` (measured on the CPU
backend over float32 angles up to 1e6 rad: within 7.6e-8 of the float64
cos/sin of the same angle; NumPy's float32 ones: 6.5e-8), the rotation is
float32 and the result is cast back to q's dtype once.

``mx.fast.rope`` is not used. It derives the frequencies itself, from
``base`` or as ``1 / freqs[j]``, so it cannot reproduce an arbitrary float32
``inv_freq`` (not every float32 is the rounded reciprocal of one), and at
large positions one ulp of a frequency is a visible angle error. Measured on
the MLX CPU backend (0.32), D=128, base 5e5, each token its own "batch" with
its own offset, max error relative to max(1, |ref|) against the oracle at
positions <= 10 / 1e4 / 1e6: 2.6e-6 / 2.6e-3 / 0.23 with ``base=``, and
2.7e-6 / 2.4e-3 / 0.18 with ``freqs=1/inv_freq`` (the contract: 2e-6).

Pool write: one scatter per pool over the pool seen as rows of head_dim
(``[-1, head_dim]``, whatever the layout or layer), into a copy with one
extra scratch row at the end; tokens with a negative (or, as a safeguard for
callers that skip validation, out-of-range) slot are routed to that row,
which is then sliced off. Every other row is copied bit for bit.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..layout import page_and_row


@lru_cache(maxsize=256)
def freq_table(spec) -> mx.array:
    """float32 ``[n_sets, rotary_dim // 2]``: row 0 the frequencies, row 1 longrope's long ones."""
    rows = [spec.inv_freq] if spec.long_inv_freq is None else [spec.inv_freq, spec.long_inv_freq]
    return mx.array(np.stack(rows).astype(np.float32))


def cos_sin(spec, positions: mx.array):
    """float32 ``cos, sin [T, rotary_dim // 2]``, attention scaling included."""
    table = freq_table(spec)
    inv_freq = table[0]
    if spec.long_from is not None and positions.size:
        # Decided inside the graph: any position past the original context
        # switches the whole call to the long factors.
        inv_freq = mx.where(positions.max() >= spec.long_from, table[1], table[0])
    ang = positions.astype(mx.float32)[:, None] * inv_freq[None, :]
    cos, sin = mx.cos(ang), mx.sin(ang)
    if spec.attention_scaling != 1.0:
        cos, sin = cos * spec.attention_scaling, sin * spec.attention_scaling
    return cos, sin


def rotate(x: mx.array, cos, sin, spec) -> mx.array:
    r = spec.rotary_dim
    xf = x[..., :r].astype(mx.float32)
    c, s = cos[:, None, :], sin[:, None, :]
    if spec.style == "neox":
        x1, x2 = xf[..., : r // 2], xf[..., r // 2:]
        rot = mx.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rot = mx.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(*xf.shape)
    rot = rot.astype(x.dtype)
    if r < x.shape[-1]:
        return mx.concatenate([rot, x[..., r:]], axis=-1)
    return rot


def row_ids(call, shape, slots: mx.array) -> mx.array:
    """``[T, num_kv_heads]``: each token's rows in the pool seen as ``[-1, head_dim]``.

    Index arithmetic for the views of ropepool.layout.paged_view (layer, then
    NHD or HND pages; the flat pool is NHD with page_size 1). Skipped tokens
    get the row just past the pool.
    """
    rows = int(np.prod(shape[:-1]))
    idx = mx.int32 if rows < 2**31 - 1 else mx.int64
    heads, page_size = call.num_kv_heads, call.page_size
    valid = (slots >= 0) & (slots < call.pool_size)
    page, row = page_and_row(mx.where(valid, slots, 0).astype(idx), page_size)
    page, row, h = page[:, None], row[:, None], mx.arange(heads, dtype=idx)[None, :]
    if call.kv_layout == "HND":
        ids = (page * heads + h) * page_size + row
    else:
        ids = (page * page_size + row) * heads + h
    if call.layer is not None:
        ids = ids + call.layer * (rows // shape[0])
    return mx.where(valid[:, None], ids, rows)


def write(pool: mx.array, ids: mx.array, rows: mx.array) -> mx.array:
    """A new pool: ``pool`` with ``rows [T, H, D]`` at ``ids [T, H]``; the row past the end is scratch."""
    shape, dim = pool.shape, pool.shape[-1]
    flat = mx.concatenate([pool.reshape(-1, dim), mx.zeros((1, dim), dtype=pool.dtype)])
    n = flat.shape[0] - 1
    flat[ids.reshape(-1)] = rows.reshape(-1, dim)  # flat is ours: the caller's pool is not touched
    return flat[:n].reshape(shape)


def run(call, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):  # outs: torch only
    spec = call.spec
    cos, sin = cos_sin(spec, positions)
    q_rot, k_rot = rotate(q, cos, sin, spec), rotate(k, cos, sin, spec)
    ids = row_ids(call, k_pool.shape, slots)
    return q_rot, k_rot, write(k_pool, ids, k_rot), write(v_pool, ids, v)
