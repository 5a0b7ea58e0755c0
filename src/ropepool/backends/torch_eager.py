"""The PyTorch path: the array math of ``arraymath`` on torch tensors, for any torch device.

It is the general torch implementation and the fallback of the CPU lane
(``torch_native``, the compiled kernel, which takes the calls its registry row
declares). On a GPU the boolean mask of valid slots makes it synchronise with
the device; the Triton kernel does not. Pools are written in place through
views.
"""
from __future__ import annotations

from ..core.layout import page_and_row, paged_view, write_at
from ..formats import BLOCK, BYTES, NONE, per_token_head
from . import arraymath
from .torch_arrays import TorchOps, as_tensor_scale, extras


class Prepared:
    def __init__(self, plan):
        self.plan, self.call = plan, plan.call
        self.fixed = {}  # device -> the plan's fixed extras as tensors there

    def bind(self, *arrays):
        return self.run

    def run(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
        call, rot, ops, st = self.call, self.call.rotation, TorchOps, self.plan.stores
        ex = self.fixed.get(q.device)
        if ex is None:
            ex = self.fixed[q.device] = extras(self.plan.fixed, q.device)
        cos, sin, ok = arraymath.cos_sin(rot, positions, ex.freqs, rot.table, ops) if rot.rotary_dim else (None,) * 3
        # Weights are read, not differentiated: a Parameter must not make the cache a graph node.
        qw, kw = (w if w is None else w.detach() for w in (ex.q_weight, ex.k_weight))
        k3, v3 = (x if x.ndim == 3 else x[:, None] for x in (k, v))  # MLA: one latent head
        q_rot = _out(arraymath.rope_and_norm(q, cos, sin, rot, call.norm, qw, ops), q, q_out, st.q_out, ex.q_scale)
        k32 = arraymath.rope_and_norm(k3, cos, sin, rot, call.norm, kw, ops)
        k_rot = _out(k32.view(k.shape), k, k_out, st.k_out, ex.k_out_scale)
        k_rows = k32.to(k.dtype) if st.k_out.quantized else k_rot.view(k3.shape)  # the pool stores k_rot in k's dtype
        write = call.pool.written(slots)  # (past the pool too: on a GPU nothing has checked them)
        if ok is not None:
            write &= ok
        page, row = page_and_row(slots[write].long(), call.pool.page_size)
        if st.k_pool.bits:  # block-quantized: each pool a tuple of arrays, each written in place
            for pool, rows, store, scale in ((k_pool, k_rows, st.k_pool, ex.k_scale),
                                             (v_pool, v3, st.v_pool, ex.v_scale)):
                stored_parts = BLOCK[store.format].rows(rows[write], store, scale, ops)
                for part, stored in zip(pool, stored_parts):
                    paged_view(part.view(stored.dtype), call.pool).index_put_((page, row), stored)
            return q_rot, k_rot, k_pool, v_pool
        for which, (pool, rows, store, scale) in enumerate(((k_pool, k_rows, st.k_pool, ex.k_scale),
                                                            (v_pool, v3, st.v_pool, ex.v_scale))):
            rows = rows[write]
            if store.format in BYTES:  # DeepSeek V3.2's byte rows (formats/fp8_ds_mla.py, formats/indexer.py)
                BYTES[store.format].put(store.format, pool, call.pool, page, row, rows[:, 0], ops)
                continue
            if store.format == NONE:
                continue
            if store.format == per_token_head.NAME:  # each row's scale, where the pool keeps the row
                rows, s = per_token_head.rows(rows.float(), store.qmax, store.integer, ops)
                paged_view(store.scale_cache[..., None], call.pool).index_put_((page, row), s[..., None])
            elif store.format == "scaled":
                rows = arraymath.quantize(rows.float(), scale, store.qmax, ops)
            view, index, rows = write_at(pool, call.pool, which, page, row, rows.to(pool.dtype))
            view.index_put_(index, rows)
        return q_rot, k_rot, k_pool, v_pool


def _out(x32, like, out, store, scale):
    """The output in ``like``'s dtype (or quantized to an fp8 ``out``), in ``out`` if given."""
    if store.format == "scaled":
        y = arraymath.quantize(x32, as_tensor_scale(scale, like), store.qmax, TorchOps).to(out.dtype)
    else:
        y = x32.to(like.dtype)
    return y if out is None else out.copy_(y)


def prepare(plan, tuning, fallback=None):
    return Prepared(plan)
