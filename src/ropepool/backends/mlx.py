"""The MLX path: the array math of ``arraymath`` on MLX arrays, lazy, pools donated.

Nothing here evaluates: a call only adds nodes to MLX's graph (no
``mx.eval``, no ``.item()``), so it can sit in a larger lazy computation or
under the caller's own ``mx.compile``. q, k and v keep their values; q_rot and
k_rot are new arrays.

Pools are donated, as the seed's are: each pool is scattered into as a
``[rows, words]`` view of its own buffer and the result is the returned pool.
When the caller rebinds its names to the returned pools (``k_pool, v_pool =
out[2], out[3]``) and holds no other reference, MLX reuses the buffer at
evaluation, so a call costs time in proportion to its tokens, never to the
pool (tests/test_mlx_cost.py measures it). Nothing may read the old pool in
the same graph: MLX keeps a buffer alive until its readers have run, and the
scatter would then copy the pool.

Speed on MLX's CPU backend (docs/mlx.md has the measurements): every node of
the graph costs several microseconds to schedule, so a decode-sized call
(up to ``plan.Tuning.compile_tokens`` tokens) runs as one ``mx.compile``d graph, traced
once per layout and token count; larger calls run the same function eagerly,
where compiling gains nothing and each new token count would trace anew.
``MLX_DISABLE_COMPILE=1`` (MLX's own switch) runs everything eagerly.

Rotation: explicit float32 math, as on PyTorch. ``mx.fast.rope`` is not
used: it derives the frequencies itself (from ``base``, or as ``1 / freqs``),
and on the CPU it rounds cos/sin to the input dtype and rotates in it, so it
cannot meet the contract's float32 precision; docs/mlx.md has the measured
errors.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..core.layout import page_and_row, row_ids
from ..formats import BLOCK
from . import arraymath, paths
from .mlx_arrays import MlxOps, extras

CHUNK_TOKENS = 256  # larger calls run in chunks on MLX's CPU backend, of plan.Tuning.chunk_features q features


# --- the pool write ----------------------------------------------------------------------------

_WORDS = {8: mx.uint64, 4: mx.uint32, 2: mx.uint16, 1: mx.uint8}
_ALL_ONES = {n: mx.array(np.array(-1, dtype=np.int64).astype(f"uint{8 * n}")) for n in _WORDS}


def targets(geom, slots: mx.array, ok):
    """Where each token's rows go: ``ids`` into the pool seen as ``[rows, width]`` and ``keep [ids, 1]``
    (False: a skipped token, slot < 0 or outside the pool, or a position outside the cos/sin table).

    A row is a token's heads where they lie together (flat and NHD pools: one
    index per token), else one head (HND: one index per token and head).
    """
    valid = geom.written(slots)
    if ok is not None:
        valid = valid & ok
    idx = mx.int32 if geom.rows < 2**31 else mx.int64
    slot = mx.where(valid, slots, 0).astype(idx)
    if geom.kv_layout == "HND":
        page, row = page_and_row(slot[:, None], geom.page_size)
        ids = row_ids(geom, page, row, mx.arange(geom.num_heads, dtype=idx)[None, :]).reshape(-1)
        return ids, mx.repeat(valid, geom.num_heads)[:, None]
    return (slot if geom.layer is None else slot + geom.layer * geom.pool_size), valid[:, None]


def write(pool: mx.array, geom, ids: mx.array, keep: mx.array, rows: mx.array) -> mx.array:
    """``pool`` with ``rows [T, H, dim]`` (the pool's dtype) at ``ids``, scattered into the pool's own buffer.

    The scatter works on the raw bits, as the widest unsigned words that
    divide a row: ``max`` with a row's bits, then ``min`` with them, sets the
    row to exactly those bits whatever it held (integers have no NaN and no
    -0.0), while a skipped token's ``max(x, 0)`` and ``min(x, all ones)``
    leave any row as it was. So a skipped token needs no scratch row, no host
    sync and no read of the pool, and a row that a valid and a skipped token
    both name still ends as the valid token's.
    """
    nbytes = pool.shape[-1] * pool.itemsize * (1 if geom.kv_layout == "HND" else geom.num_heads)
    if ids.shape[0] == 0 or pool.size == 0:
        return pool
    word = next(n for n in (8, 4, 2, 1) if nbytes % n == 0)
    width = nbytes // pool.itemsize  # elements of one row
    bits = mx.view(pool.reshape(pool.size // width, width), _WORDS[word])
    new = mx.view(rows.reshape(ids.shape[0], width), _WORDS[word])
    bits = bits.at[ids].maximum(mx.where(keep, new, 0))
    bits = bits.at[ids].minimum(mx.where(keep, new, _ALL_ONES[word]))
    return mx.view(bits, pool.dtype).reshape(pool.shape)


def _block(rows, store, scale):
    """The arrays a block-quantized pool stores for ``rows [T, H, D]`` (the row's dtype), each ``[T, H, ...]``."""
    return BLOCK[store.format].rows(rows, store, scale, MlxOps)


def _to_pool(rows, store, scale, pool):
    if store.format == "scaled":  # MLX stores e4m3 as uint8 (mx.to_fp8)
        return mx.to_fp8(arraymath.quantize(rows.astype(mx.float32), scale, store.qmax, MlxOps))
    return rows.astype(pool.dtype)


# --- the op ------------------------------------------------------------------------------------

# The plan's extras the graph reads (core/args.Extras' names): the row takes no fp8 outputs and no scale caches.
READS = ("freqs", "table", "q_weight", "k_weight", "k_scale", "v_scale")


def _graph(plan):
    """The op as a function of arrays only (core/args.ARRAYS up to v_pool, then the extras named ``READS``, in
    that order: tests/test_plan.py), so mx.compile can trace it."""
    call, st, ops = plan.call, plan.stores, MlxOps
    rot, norm = call.rotation, call.norm

    def graph(q, k, v, positions, slots, k_pool, v_pool, freqs, table, q_weight, k_weight, k_scale, v_scale):
        paths.took("mlx.traced")  # Python runs here at each eager call, but once per trace when compiled
        cos, sin, ok = arraymath.cos_sin(rot, positions, freqs, table, ops) if rot.rotary_dim else (None,) * 3
        k3 = k if k.ndim == 3 else k[:, None]  # MLA: one latent head, k_pe [T, r] or [T, 1, r]
        v3 = v if v.ndim == 3 else v[:, None]  # and kv_c [T, rank]
        q_rot = arraymath.rope_and_norm(q, cos, sin, rot, norm, q_weight, ops).astype(q.dtype)
        k_rot = arraymath.rope_and_norm(k3, cos, sin, rot, norm, k_weight, ops).astype(k.dtype)
        ids, keep = targets(call.pool, slots, ok)
        if st.k_pool.bits:  # block-quantized: tuples of arrays, each scattered like a pool
            k_pool = tuple(write(p, call.pool, ids, keep, r) for p, r in zip(k_pool, _block(k_rot, st.k_pool, k_scale)))
            v_pool = tuple(write(p, call.pool, ids, keep, r) for p, r in zip(v_pool, _block(v3, st.v_pool, v_scale)))
            return q_rot, k_rot.reshape(k.shape), k_pool, v_pool
        k_pool = write(k_pool, call.pool, ids, keep, _to_pool(k_rot, st.k_pool, k_scale, k_pool))
        v_pool = write(v_pool, call.pool, ids, keep, _to_pool(v3, st.v_pool, v_scale, v_pool))
        return q_rot, k_rot.reshape(k.shape), k_pool, v_pool

    return graph


# plan.Plan.key -> (eager graph, compiled graph); at most _MAX_GRAPHS, each holding its first plan's small arrays
# (norm weights, scales: a few KB) but no engine table (read through Rotation.table_ref).
_GRAPHS: dict = {}
_MAX_GRAPHS = 256


class Prepared:
    def __init__(self, plan, tuning):
        self.call = call = plan.call
        self.compile_tokens, self.chunk_features = tuning.compile_tokens, tuning.chunk_features
        graphs = _GRAPHS.get(plan.key)
        if graphs is None:
            if len(_GRAPHS) >= _MAX_GRAPHS:
                _GRAPHS.clear()
            graph = _graph(plan)
            graphs = _GRAPHS[plan.key] = (graph, mx.compile(graph))
        self.eager, self.compiled = graphs
        # An engine's table is read per call through its weak reference (spec.Rotation): a graph or a runner
        # the layout cache keeps must not keep the caller's table alive.
        ex = extras(plan.fixed)
        self.arrays, self.table_ref = tuple(getattr(ex, n) for n in READS), call.rotation.table_ref
        self.table_at = READS.index("table")
        self.block = bool(plan.stores.k_pool.bits)  # block-quantized (tuple) pools: counted per call

    def bind(self, *arrays):
        return self.run

    def run(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):  # outs: torch only
        if self.block:
            paths.took("mlx.block_store")
        if self.table_ref is not None:
            at = self.table_at
            return self.run_with(self.arrays[:at] + (self.table_ref(),) + self.arrays[at + 1:], q, k, v, positions,
                                 slots, k_pool, v_pool)
        return self.run_with(self.arrays, q, k, v, positions, slots, k_pool, v_pool)

    def run_with(self, arrays, q, k, v, positions, slots, k_pool, v_pool):
        T = q.shape[0]
        if T <= self.compile_tokens:
            paths.took("mlx.compiled")
            return self.compiled(q, k, v, positions, slots, k_pool, v_pool, *arrays)
        if T <= CHUNK_TOKENS or self.call.rotation.long_from is not None or mx.default_device() != mx.cpu:
            # longrope: one choice of factors per call; a GPU runs the whole call in one pass of each op
            return self.eager(q, k, v, positions, slots, k_pool, v_pool, *arrays)
        # On the CPU, chunks of about chunk_features q features keep each float32 temporary in the
        # caches and small enough for the allocator to reuse (docs/mlx.md; the comparison of chunk sizes
        # that chose this was not recorded, the records under docs/bench are of the chosen size).
        # Each chunk writes the pools the last returned, so they stay donated.
        q_rot, k_rot = [], []
        step = max(1, self.chunk_features // (q.shape[1] * q.shape[2]))
        for s in range(0, T, step):
            part = slice(s, s + step)
            pos = positions[..., part]  # [T] or MRoPE's [3, T]
            qr, kr, k_pool, v_pool = self.eager(q[part], k[part], v[part], pos, slots[part], k_pool, v_pool,
                                                *arrays)
            q_rot.append(qr)
            k_rot.append(kr)
        return mx.concatenate(q_rot), mx.concatenate(k_rot), k_pool, v_pool


def prepare(plan, tuning, fallback=None):
    return Prepared(plan, tuning)
