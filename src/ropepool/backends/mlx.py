"""The MLX path: the array math of ``arraymath`` on MLX arrays, lazy, pools donated.

Nothing here evaluates: ``run`` only adds nodes to MLX's graph (no
``mx.eval``, no ``.item()``), so a call can sit in a larger lazy computation
or under ``mx.compile``. q, k and v keep their values; q_rot and k_rot are
new arrays.

The pools are donated, as the seed's are: each pool is scattered into as a
``[rows, dim]`` reshape of itself and the result is the returned pool. When
the caller rebinds its names to the returned pools (``k_pool, v_pool =
out[2], out[3]``) and holds no other reference, MLX reuses the pool's buffer
at evaluation, so a call costs time in proportion to its tokens, not to the
pool (tests/test_mlx.py measures it).

Skipped tokens (slot < 0, or out of range: no input writes outside the pool)
need no scratch row and no host sync: each is sent to the row of the first
valid token of the call, with that token's values, so a row written twice
gets the same bytes twice; in a call with no valid token, they all rewrite
slot 0's row with the values it already holds.

Rotation: explicit float32 math, as on PyTorch. ``mx.fast.rope`` is not
used: it derives the frequencies itself (from ``base``, or as ``1 / freqs``),
so it cannot reproduce the contract's float32 ``inv_freq``; docs/mlx.md has
the measured errors.
"""
from __future__ import annotations

import mlx.core as mx

from ..dtypes import FP8_MAX
from ..layout import page_and_row, row_ids
from . import arraymath


class MlxOps:
    """What arraymath needs, spelled for MLX."""

    cos, sin, rsqrt, where, clip = mx.cos, mx.sin, mx.rsqrt, mx.where, mx.clip

    @staticmethod
    def f32(x):
        return x.astype(mx.float32)

    @staticmethod
    def cat(xs, axis):
        return mx.concatenate(xs, axis=axis)

    @staticmethod
    def stack(xs, axis):
        return mx.stack(xs, axis=axis)

    @staticmethod
    def take(x, idx, axis):
        return mx.take(x, idx, axis=axis)

    @staticmethod
    def take_along(x, idx, axis):
        return mx.take_along_axis(x, idx, axis=axis)

    @staticmethod
    def all_last(x):
        return mx.all(x, axis=-1)

    @staticmethod
    def mean_last(x):
        return mx.mean(x, axis=-1, keepdims=True)

    @staticmethod
    def numel(x):
        return x.size

    @staticmethod
    def const(values, like):
        return device_array(values)


def device_array(values) -> mx.array:
    """A NumPy array of a Rotation (frequencies, MRoPE rows) as an MLX array, made once."""
    return arraymath.constant(values, mx.array)


def write(pool: mx.array, call, slots: mx.array, ok, rows: mx.array) -> mx.array:
    """``pool`` with ``rows [T, H, dim]`` at the tokens' slots: one scatter into the pool's own buffer."""
    geom, dim = call.pool, pool.shape[-1]
    if slots.shape[0] == 0:
        return pool
    idx = mx.int32 if geom.rows < 2**31 - 1 else mx.int64
    valid = (slots >= 0) & (slots < geom.pool_size)
    if ok is not None:
        valid = valid & ok
    heads = mx.arange(geom.num_heads, dtype=idx)
    page, row = page_and_row(mx.where(valid, slots, 0).astype(idx), geom.page_size)
    ids = row_ids(geom, page[:, None], row[:, None], heads[None, :])
    # The donor: the first valid token's rows, or slot 0's rows as they are.
    any_valid = mx.any(valid)
    first = mx.argmax(valid.astype(mx.int32))
    flat = pool.reshape(-1, dim)
    donor_ids = mx.where(any_valid, ids[first], row_ids(geom, 0, 0, heads))
    donor = mx.where(any_valid, rows[first], flat[donor_ids])
    ids = mx.where(valid[:, None], ids, donor_ids[None])
    rows = mx.where(valid[:, None, None], rows, donor[None])
    flat[ids.reshape(-1)] = rows.reshape(-1, dim)
    return flat.reshape(pool.shape)


def _to_pool(rows, call, scale, pool):
    if call.fp8:  # MLX stores e4m3 as uint8 (mx.to_fp8)
        return mx.to_fp8(arraymath.quantize(rows.astype(mx.float32), scale, FP8_MAX[call.fp8], MlxOps))
    return rows.astype(pool.dtype)


class Prepared:
    def __init__(self, call):
        self.call = call

    def bind(self, *arrays):
        return self.run

    def run(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):  # outs: torch only
        call, rot, ops = self.call, self.call.rotation, MlxOps
        freqs = None if rot.table is not None or not rot.rotary_dim else device_array(rot.freqs)
        cos, sin, ok = arraymath.cos_sin(rot, positions, freqs, rot.table, ops) if rot.rotary_dim else (None,) * 3
        qw, kw = (None, None) if call.norm is None else call.norm.weights
        k3, v3 = (k, v) if k.ndim == 3 else (k[:, None], v[:, None])  # MLA: one latent head
        q_rot = arraymath.rope_and_norm(q, cos, sin, rot, call.norm, qw, ops).astype(q.dtype)
        k_rot = arraymath.rope_and_norm(k3, cos, sin, rot, call.norm, kw, ops).astype(k.dtype)
        k_pool = write(k_pool, call, slots, ok, _to_pool(k_rot, call, call.k_scale, k_pool))
        v_pool = write(v_pool, call, slots, ok, _to_pool(v3, call, call.v_scale, v_pool))
        return q_rot, k_rot.reshape(k.shape), k_pool, v_pool


def prepare(call, tuning):
    return Prepared(call)
