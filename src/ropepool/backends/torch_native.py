"""The torch backend on CPU tensors: one call of ropepool's compiled kernel (ropepool/native) per call.

The kernel (native/rope_kernel.h) rotates q and k (with the QK norm before or after, if the call has one:
``rope_pool_norm``, given the weights at each call), writes q_rot / k_rot (new tensors, or q_out / k_out) and
stores k_rot and v into the pools at their slots, every layout through its strides, in one pass over the tokens;
it checks every slot and position before it writes a byte. This module only binds: it reads what a call needs
from the plan once per layout (``cfg``: the rotation's shape, the pool layout, the stores' bounds), and hands
over the cos/sin rows:

- ropepool's frequencies: one table per rotation, a row per position (each frequency set's cos, then its sin),
  made by torch's float32 ``cos`` / ``sin`` of ``float32(p) * inv_freq`` as ``torch_eager`` makes them (its bits,
  docs/precision.md), grown on demand (``_TABLES``, bounded in bytes); longrope's two sets side by side, the kernel
  picking one per call from its largest position;
- the engine's table (``CosSinCache``) as it is, read through the rotation's weak reference;
- where a table's rows would not be torch_eager's bits (``rotary_dim // 2`` not a multiple of 32: ATen computes
  a tail of a tensor with libm's functions, not its vector ones), for MRoPE with ropepool's frequencies, and
  past ``plan.Tuning.table_positions``: ``arraymath.cos_sin`` per call, as torch_eager computes them, a row per token.

It takes what its registry row declares (backends/__init__.py); the row's fallback, ``torch_eager``, runs the
rest, and what a bound layout declines (rows longer than the kernel's buffers).
"""
from __future__ import annotations

import functools
import struct

import torch

from .. import native
from ..checks.validate import check_host_values
from ..checks.values import _PRECISE_POSITIONS, check_values
from ..core.args import OTHER_LAYOUT
from ..core.layout import KV_LAYOUTS
from ..errors import OtherLayout, RopePoolError
from . import arraymath, paths
from .torch_arrays import TorchOps, extras

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MAX_DIM = 2048  # rope_kernel.h MAX_DIM
# (frequencies' bytes, attention scaling) -> float32 [positions, sets * rotary_dim]: per frequency set its cos
# then its sin columns; equal rotations share one. Past _TABLE_BYTES every table is dropped (regrown on demand).
_TABLES: dict = {}
_TABLE_BYTES = 256 << 20
_table_bytes = [0]


def _f32_bits(x: float) -> int:
    """A float as float32, its bits (how torch adds a Python float to a float32 tensor)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def drop_tables() -> None:
    _TABLES.clear()
    _table_bytes[0] = 0


def cos_sin_rows(freqs, scaling: float, start: int, stop: int):
    """float32 ``[stop - start, sets * rotary_dim]``: for positions start..stop-1, per frequency set (``freqs``:
    float32 ``[sets, rotary_dim // 2]``) its cos then its sin columns, as torch_eager computes them
    (arraymath.cos_sin): float32(p) * inv_freq32, torch's float32 cos and sin, then the attention scaling."""
    ang = torch.arange(start, stop).view(-1, 1, 1) * freqs.view(1, *freqs.shape)
    cos, sin = torch.cos(ang), torch.sin(ang)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return torch.cat((cos, sin), 2).flatten(1)


def _table(freqs, scaling: float, top: int, tuning):
    """The rotation's table, rows for positions up to at least ``top``, grown by ``tuning.table_chunk`` rows; None
    from ``tuning.table_positions`` on (computed per call)."""
    key = (freqs.numpy().tobytes(), scaling)
    have = _TABLES.get(key)
    if have is None and len(_TABLES) >= 64:
        drop_tables()
    n = 0 if have is None else have.shape[0]
    if n > top:
        return have
    if top >= tuning.table_positions:
        return None
    new = cos_sin_rows(freqs, scaling, n, (top // tuning.table_chunk + 1) * tuning.table_chunk)
    old = 0 if have is None else have.nbytes
    if old + new.nbytes > _TABLE_BYTES:  # more than the bound alone
        return None
    if _table_bytes[0] + new.nbytes > _TABLE_BYTES:  # room made: every table dropped, this one made again
        drop_tables()
        return _table(freqs, scaling, top, tuning)
    if have is not None:
        new = torch.cat((have, new))
    _table_bytes[0] += new.nbytes - old
    _TABLES[key] = new  # a new tensor, then the swap: a call running keeps the old one
    return new


class Prepared:
    def __init__(self, plan, tuning, fallback):
        self.plan, self.tuning, self.fallback = plan, tuning, fallback

    def bind(self, *arrays):
        if native.kernel() is None or max(a.shape[-1] for a in arrays[:3]) > _MAX_DIM:
            return self.fallback.bind(*arrays)
        return Native(self.plan, arrays, self.tuning).run


def prepare(plan, tuning, fallback):
    return Prepared(plan, tuning, fallback)


@functools.cache
def cfg_names() -> tuple:
    """The kernel's cfg entries in its order, by name (rope_ffi.cc: ``ROPEPOOL_CFG``)."""
    return tuple(native.kernel().cfg_names().lower().split())


_empty_dense = functools.partial(torch.empty_like, memory_format=torch.contiguous_format)
_calls = paths.cell("torch_native.call")
_NONE = torch.zeros(1, 1)  # no table (a layer without RoPE): the kernel does not read it


def _contiguous_strides(shape) -> tuple:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= max(size, 1)
    return tuple(reversed(strides))


class Native:
    """The runner of one plan and layout. The kernel compares every call's arrays with the layout it was bound to
    (``checks_layout``) and raises ``OtherLayout`` for another one, before it reads or writes anything: the layout
    cache may hand it a call by its key alone (plan/cache.py)."""

    checks_layout = True

    def __init__(self, plan, arrays, tuning):
        call, rot, st = plan.call, plan.call.rotation, plan.stores
        self.call, self.rot, self.tuning = call, rot, tuning
        self.fn = native.kernel().rope_pool
        norm = call.norm
        ex = extras(plan.fixed, torch.device("cpu"))
        r, half = rot.rotary_dim, rot.rotary_dim // 2
        geom = call.pool
        self.freqs = ex.freqs
        self.own = rot.table_ref is None and r > 0
        # cos/sin per call (a row per token) where tables would not give torch_eager's bits, and for MRoPE of ours.
        self.per_call = self.own and (half % 32 != 0 or call.position_rows == 3)
        # Arrays the kernel reads by address (cfg): kept alive here.
        rows = None if call.position_rows != 3 or self.own else torch.from_numpy(rot.rows.astype("int32"))
        scales = [None if x is None else x.reshape(-1) for x in (ex.k_scale, ex.v_scale, ex.q_scale, ex.k_out_scale)]
        if any(x is not None and x.dtype != torch.float32 for x in scales):
            scales = [None if x is None else x.float() for x in scales]
        self.held = (rows, scales)
        values = dict(rotary_dim=r, gptj=int(rot.gptj), by_token=int(self.per_call),
                      long_from=-1 if rot.long_from is None or self.per_call else rot.long_from,
                      layer=-1 if geom.layer is None else geom.layer,
                      kv_layout=0 if geom.kv_layout is None else 1 + KV_LAYOUTS.index(geom.kv_layout),
                      headed=int(geom.headed), k_kind=_KINDS[arrays[1].dtype], sin_at=half, long_at=2 * half,
                      mrope_rows_ptr=0 if rows is None else rows.data_ptr())
        if norm is not None:  # the weights go first, per call (read as they are then: detached views of them)
            qw, kw = (_NONE if w is None else w.detach() for w in (ex.q_weight, ex.k_weight))
            self.fn = functools.partial(native.kernel().rope_pool_norm, qw, kw)
            values.update(norm=2 if norm.after_rope else 1, norm_eps=_f32_bits(norm.eps),
                          norm_offset=_f32_bits(norm.weight_offset), q_weighted=int(ex.q_weight is not None),
                          k_weighted=int(ex.k_weight is not None))
        for d, store, x in zip(("k_pool", "v_pool", "q_out", "k_out"), st, scales):
            if store.qmax:
                values.update({f"{d}_scale_ptr": x.data_ptr(), f"{d}_scale_n": x.numel(),
                               f"{d}_scale_stride": x.stride(0), f"{d}_qmax": store.qmax})
        # q_rot / k_rot: empty_like keeps q's strides where q is dense (~0.2 us cheaper than asking for contiguous
        # ones); the same strides as asked for where q (whose strides the kernel compares) is laid out contiguously.
        self.q_like, self.k_like = (torch.empty_like if x.stride() == _contiguous_strides(x.shape) else _empty_dense
                                    for x in arrays[:2])
        self.cfg = self.bound(values, arrays)
        values.update(by_token=1, long_from=-1)  # cos/sin per call: arraymath's, longrope's set chosen there
        self.cfg_by_token = self.bound(values, arrays)
        self.at, self.at_by_token = self.cfg.data_ptr(), self.cfg_by_token.data_ptr()  # (kept alive by self)
        self.table = _table(self.freqs, rot.attention_scaling, 0, tuning) if self.own and not self.per_call else _NONE
        self.fixed_table = not self.per_call and rot.table_ref is None  # else ``table_now`` per call
        # The layout cache skips its value check of calls this runner takes (plan/cache.py): the kernel finds a
        # slot past the pool or twice and a negative position, run raises validation's message. A position past
        # 2^24 (the precision warning) cannot hide in ropepool's table (fewer rows: run sees it) nor in an
        # engine's of <= 2^24 + 1 rows; per-call cos/sin and no RoPE have no bound, so those runners keep the check.
        engine = rot.table
        self.checks_values = (self.own and not self.per_call) or (
            engine is not None and engine.shape[0] <= _PRECISE_POSITIONS + 1)

    def bound(self, values, arrays):
        """cfg: ``values`` by the names the kernel gives its entries (rope_ffi.cc: ``cfg_names``, lower case; those
        not given are 0), then the layout of ``arrays`` (the call's) as the kernel records it."""
        kernel = native.kernel()
        names = cfg_names()
        unknown = values.keys() - set(names)
        if unknown:  # a name the kernel does not have: its cfg and this module no longer agree
            raise RopePoolError(f"the CPU kernel has no cfg entries {sorted(unknown)}; nothing was written. Fix: "
                                "rebuild the kernel from this checkout (`pip install -e .`).")
        cfg = torch.zeros(kernel.cfg_size(), dtype=torch.int64)
        cfg[:len(names)] = torch.tensor([int(values.get(n, 0)) for n in names], dtype=torch.int64)
        outs = [like(x) if out is None else out for like, x, out in zip((self.q_like, self.k_like), arrays[:2],
                                                                        arrays[7:9])]
        kernel.bind(*arrays[:7], *outs, cfg.data_ptr())  # q_rot / k_rot as run makes them
        return cfg

    def per_token(self, positions):
        """cos | sin ``[T, rotary_dim]`` for this call, as torch_eager computes them."""
        return torch.cat(arraymath.cos_sin(self.rot, positions, self.freqs, None, TorchOps)[:2], 1)

    def table_now(self, positions):
        """The table of a runner whose table is not fixed (``fixed_table``): this call's rows, or the engine's."""
        if self.per_call:
            return self.per_token(positions)
        table = self.rot.table  # the engine's: cos half, then sin half
        if table is None:
            raise RopePoolError("the engine's cos/sin table of this rotation (a CosSinCache held weakly) was freed; "
                                "nothing was written. Fix: keep the table alive while layers that were given it run "
                                "(vLLM's rotary op holds its cos_sin_cache).")
        return table

    def run(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
        # Outputs as ``bound`` made them (empty_like: ~1.2 us where torch.empty(shape, dtype=) costs ~3); the kernel,
        # then, where it did not finish (0), ``redo``. (The fewest Python operations a call: each costs tens of ns.)
        q_rot = self.q_like(q) if q_out is None else q_out
        k_rot = self.k_like(k) if k_out is None else k_out
        table = self.table if self.fixed_table else self.table_now(positions)
        done = self.fn(q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot, table, self.at)
        if done:
            self.redo(done, q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot)
        _calls[0] += 1
        return q_rot, k_rot, k_pool, v_pool

    def redo(self, done, q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot):
        """After a kernel call that did nothing (``done`` != 0): raise, or grow ropepool's table and call again."""
        if done == OTHER_LAYOUT:
            raise OtherLayout("the CPU kernel was handed arrays of another layout than the one it was bound to; "
                              "nothing was written. Fix: report it (a bug of ropepool's), with the call's shapes and "
                              "strides.")
        if done > 0 and self.own:  # positions past ropepool's table (nothing written): grow it, or per call
            if done > _PRECISE_POSITIONS + 1:  # not value-checked by the cache: its warning
                check_host_values(self.call, positions, slots)
            grown = _table(self.freqs, self.rot.attention_scaling, done - 1, self.tuning)
            if grown is None:
                table, cfg = self.per_token(positions), self.at_by_token
            else:
                table, cfg = grown, self.at
                self.table = grown
            done = self.fn(q, k, v, positions, slots, k_pool, v_pool, q_rot, k_rot, table, cfg)
        if done != 0:  # a slot past the pool, a position outside the table (nothing written): validation's message
            table = self.rot.table
            check_values(positions, slots, self.call.pool_size, None if table is None else table.shape[0])
            raise RopePoolError(f"the CPU kernel found a slot >= pool_size ({self.call.pool_size}) or a position < 0 "
                                "or outside the cos/sin table that the value check passed; nothing was written. Fix: "
                                "report it (a bug of ropepool's), with the call's slots and positions.")
