"""The torch backend on CPU tensors: one call of ropepool's compiled kernel (ropepool/native) per call.

The kernel (native/rope_kernel.h) rotates q and k, writes q_rot / k_rot (new tensors, or q_out / k_out) and
stores k_rot and v into the pools at their slots, every layout through its strides, in one pass over the tokens;
it checks every slot and position before it writes a byte. This module only binds: it reads what a call needs
from the plan once per layout (``cfg``: the rotation's shape, the pool layout, the stores' bounds), and hands
over the cos/sin rows:

- ropepool's frequencies: tables ``[positions, rotary_dim // 2]`` made by torch's float32 ``cos`` / ``sin`` of
  ``float32(p) * inv_freq`` as ``torch_eager`` makes them (its bits, docs/precision.md), once per rotation,
  grown on demand (``_TABLES``, bounded in bytes); longrope's two sets, the kernel picking one per call;
- the engine's table (``CosSinCache``) as it is, read through the rotation's weak reference;
- where a table's rows would not be torch_eager's bits (``rotary_dim // 2`` not a multiple of 32: ATen computes
  a tail of a tensor with libm's functions, not its vector ones), for MRoPE with ropepool's frequencies, and
  past ``_TABLE_POSITIONS``: ``arraymath.cos_sin`` per call, as torch_eager computes them, a row per token.

It takes what its registry row declares (backends/__init__.py); the row's fallback, ``torch_eager``, runs the
rest, and what a bound layout declines (rows longer than the kernel's buffers).
"""
from __future__ import annotations

import torch

from .. import native
from ..checks.layout import KV_LAYOUTS
from ..checks.values import check_values
from ..errors import RopePoolError
from . import arraymath, paths
from .torch_arrays import TorchOps, extras

# cfg's entries, in rope_ffi.cc's order (enum Cfg).
CFG = ("rotary_dim", "gptj", "long_from", "by_token", "layer", "kv_layout", "headed", "mrope", "k_pool_qmax",
       "v_pool_qmax", "q_out_qmax", "k_out_qmax", "k_kind")
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MAX_DIM = 2048  # rope_kernel.h MAX_DIM
# Tables cover positions below this (64 MB a rotation at rotary_dim 128), grown in chunks; past it, per call.
_TABLE_POSITIONS, _TABLE_CHUNK = 1 << 17, 1 << 12
# (frequencies' bytes, set, attention scaling) -> (cos, sin): equal rotations share tables. Past _TABLE_BYTES
# every table is dropped (and regrown on demand).
_TABLES: dict = {}
_TABLE_BYTES = 256 << 20
_table_bytes = [0]


def drop_tables() -> None:
    _TABLES.clear()
    _table_bytes[0] = 0


def _table(freqs, s: int, scaling: float, top: int):
    """cos and sin ``[n, half]`` of rotation set ``s`` for positions ``< n``, n > ``top``; None where they would
    pass the bound (the caller computes per call)."""
    key = (freqs.numpy().tobytes(), s, scaling)
    have = _TABLES.get(key)
    n = 0 if have is None else have[0].shape[0]
    if n > top:
        return have
    if top >= _TABLE_POSITIONS:
        return None
    new_n = (top // _TABLE_CHUNK + 1) * _TABLE_CHUNK
    # As torch_eager (arraymath.cos_sin): float32(p) * inv_freq32, torch's float32 cos and sin, then the scaling.
    ang = torch.arange(n, new_n).view(-1, 1) * freqs[s].view(1, -1)
    cos, sin = torch.cos(ang), torch.sin(ang)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    grown = cos.nbytes + sin.nbytes
    if _table_bytes[0] + grown > _TABLE_BYTES:
        drop_tables()
        return _table(freqs, s, scaling, top) if grown <= _TABLE_BYTES else None
    if have is not None:
        cos, sin = torch.cat((have[0], cos)), torch.cat((have[1], sin))
    _table_bytes[0] += grown
    _TABLES[key] = (cos, sin)  # new tensors, then the swap: a call running keeps the old ones
    return _TABLES[key]


class Prepared:
    def __init__(self, plan, fallback):
        self.plan, self.fallback = plan, fallback

    def bind(self, *arrays):
        general = self.fallback.bind(*arrays)
        if native.kernel() is None or max(a.shape[-1] for a in arrays[:3]) > _MAX_DIM:
            return general
        return Native(self.plan, arrays, general).run


def prepare(plan, tuning, fallback):
    return Prepared(plan, fallback)


_NONE = torch.zeros(1)  # an argument the call has not (a table, a scale): the kernel does not read it


class Native:
    """The runner of one plan and layout."""

    def __init__(self, plan, arrays, general):
        call, rot, st = plan.call, plan.call.rotation, plan.stores
        self.call, self.rot, self.general = call, rot, general
        self.fn = native.kernel().rope_pool
        self.ex = ex = extras(plan.fixed, torch.device("cpu"))
        r, half = rot.rotary_dim, rot.rotary_dim // 2
        geom = call.pool
        self.freqs = ex.freqs
        self.own = rot.table_ref is None and r > 0
        # Per call (a row per token) where tables would not give torch_eager's bits, and for MRoPE of ours.
        self.per_call = self.own and (half % 32 != 0 or call.position_rows == 3)
        self.mrope_rows = _NONE if call.position_rows != 3 or self.own else \
            torch.from_numpy(rot.rows.astype("int32"))
        k = arrays[1]
        # By token, cos/sin are arraymath's, longrope's set chosen there: the kernel picks no table.
        values = dict(rotary_dim=r, gptj=int(rot.gptj),
                      long_from=-1 if rot.long_from is None or self.per_call else rot.long_from,
                      by_token=int(self.per_call), layer=-1 if geom.layer is None else geom.layer,
                      kv_layout=0 if geom.kv_layout is None else 1 + KV_LAYOUTS.index(geom.kv_layout),
                      headed=int(geom.headed), mrope=int(self.mrope_rows is not _NONE),
                      k_pool_qmax=st.k_pool.qmax, v_pool_qmax=st.v_pool.qmax, q_out_qmax=st.q_out.qmax,
                      k_out_qmax=st.k_out.qmax, k_kind=_KINDS[k.dtype])
        self.cfg = torch.tensor([int(values[n]) for n in CFG], dtype=torch.int64)
        values.update(by_token=1, long_from=-1)
        self.cfg_by_token = torch.tensor([int(values[n]) for n in CFG], dtype=torch.int64)  # cos/sin per call
        self.scales = tuple(_NONE if s is None else s.reshape(-1) for s in (ex.k_scale, ex.v_scale, ex.q_scale,
                                                                             ex.k_out_scale))
        self.tables = (_NONE,) * 4
        if self.own and not self.per_call:
            self.tables = self._tables(0)

    def _tables(self, top):
        """cos, sin (and longrope's long set) covering positions up to ``top``; None past the bound."""
        rot, freqs = self.rot, self.freqs
        short = _table(freqs, 0, rot.attention_scaling, top)
        long = _NONE, _NONE
        if rot.long_from is not None:
            long = _table(freqs, 1, rot.attention_scaling, top)
        if short is None or long is None:
            return None
        return (*short, *long)

    def per_token(self, positions) -> tuple:
        """cos, sin per call, a row per token, as torch_eager computes them."""
        return *arraymath.cos_sin(self.rot, positions, self.freqs, None, TorchOps)[:2], _NONE, _NONE

    def run(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
        q_rot = torch.empty(q.shape, dtype=q.dtype) if q_out is None else q_out
        k_rot = torch.empty(k.shape, dtype=k.dtype) if k_out is None else k_out
        cfg = self.cfg
        if self.per_call:
            tables = self.per_token(positions)
        elif self.rot.table_ref is None:  # ropepool's tables (none without RoPE)
            tables = self.tables
        else:  # the engine's table, cos half and sin half
            table, half = self.rot.table, self.rot.rotary_dim // 2
            tables = (table[:, :half], table[:, half:2 * half], _NONE, _NONE)
        scales, rows = self.scales, self.mrope_rows
        done = self.fn(q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot, *tables, rows, *scales, cfg)
        if done > 0 and self.own:  # positions past ropepool's tables (nothing written): grow them, or per call
            grown = self._tables(done - 1)
            if grown is None:
                tables, cfg = self.per_token(positions), self.cfg_by_token
            else:
                tables = self.tables = grown
            done = self.fn(q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot, *tables, rows, *scales, cfg)
        if done != 0:  # a slot past the pool, a position outside the table (nothing written): validation's message
            table = self.rot.table
            check_values(positions, slots, self.call.pool_size, None if table is None else table.shape[0])
            raise RopePoolError(f"the CPU kernel found a slot >= pool_size ({self.call.pool_size}) or a position < 0 "
                                "or outside the cos/sin table that the value check passed; nothing was written. Fix: "
                                "report it (a bug of ropepool's), with the call's slots and positions.")
        paths.took("torch_native.call")
        return q_rot, k_rot, k_pool, v_pool
