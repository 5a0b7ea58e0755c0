"""The torch backend on CPU tensors: the same math as ``torch_eager`` in fewer passes over memory.

``torch_eager`` builds whole float32 intermediates with some 25 small ops, each
a pass over the tokens. Here the work goes in blocks of tokens small enough to
stay in the L2 cache. Each pair's two elements are one axis of a view, so the
rotation is ``x * cos + swap(x) * (-sin, sin)``: five ops per block, written
straight into the output (float32) or upcast once and rounded once into it
(bf16, fp16); cos/sin are made once per call for q and k (for up to 64 tokens
at positions < 2^17, rows of a table made once). One token's q and k heads
that lie in a row (a fused QKV output) are rotated as one tensor: at one token
a torch op costs more than its arithmetic (~2 us). The pools are written with
one ``index_copy_`` each. From 2 tokens ``torch_cpu_compiled`` runs the
rotation as one inductor-compiled step instead, which also picks the table's
cos/sin rows and, where it can, writes the pools; at one token
(``compiled_one_token``) one compiled call does all of a decode call once its graph is there. Per the contract
(docs/precision.md) angles are ``float32(p) * inv_freq32``, cos/sin are
torch's accurate float32 functions and the arithmetic is float32 throughout,
with the same roundings as ``torch_eager`` (its results bit for bit).

It takes the plans its registry row supports (backends/__init__.py: plain,
partial, GPT-J, scaled and longrope rotations, an engine's table, every pool
layout, MLA's latent, the QK norm (normalised by arraymath's operations, then
rotated here), fp8 pools with per-tensor or per-head scales (quantized by
arraymath's operations)); the rest (per-token-head caches, fp8 q/k outputs,
MRoPE, autograd, torch.compile tracing) go to ``torch_eager``, the row's
fallback, which also runs what a runner declines at run time. Positions and slots
a serving step registers (``values.STEP``) get their cos/sin once per step.
"""
from __future__ import annotations

import torch

from ..checks.layout import TILED, page_and_row, paged_view, write_at
from ..checks.values import STEP
from . import arraymath, dsa_store, paths, torch_cpu_compiled
from .torch_arrays import TorchOps, extras
from .torch_cpu_norm import Normed
from .torch_cpu_one_token import OneToken

# A block of tokens: about 128K floats (512 KB); of 16K-256K, measured fastest on a
# 2 MB-per-core L2 (docs/benchmarks.md, CPU section).
_BLOCK_ELEMENTS = 1 << 17
_FLIP_ELEMENTS = 1 << 14
# Up to this many q and k elements a call (q and k not one view) rotates them as one tensor (run's few lane).
_FEW_ELEMENTS = 1 << 12
# cos/sin rows of positions below this come from a table made once per rotation (96 MB at rotary_dim 128),
# one index_select instead of four ops; above, or past 64 tokens, they are computed per call.
_TABLE_POSITIONS, _TABLE_TOKENS, _TABLE_CHUNK = 1 << 17, 64, 1 << 12
# The frequencies' bytes -> {(set, shape, scaling): (cos, sin)}: equal rotations share tables, whatever
# object holds them. Bounded in bytes: past _TABLE_BYTES every table is dropped (and regrown on demand).
_TABLES: dict = {}
_TABLE_BYTES = 256 << 20
_table_bytes = [0]


def _parts(both, Hq: int) -> tuple:
    """A contiguous ``[T, Hq + Hkv, D]`` tensor's q and k heads, as views (as_strided: one call each, where
    indexing with slices costs about twice as much in a serving step)."""
    (T, H, D), at = both.shape, both.storage_offset()
    return both.as_strided((T, Hq, D), (H * D, D, 1), at), both.as_strided((T, H - Hq, D), (H * D, D, 1), at + Hq * D)


def _kept(slots):
    """The indices of the tokens a negative slot does not skip, and their slots (int64); once per step for a
    step's slots (values.STEP: each layer's call would otherwise mask both pools' rows and slots again)."""
    key = ("kept", id(slots)) if STEP.holds(slots) else None
    hit = STEP.memo.get(key)
    if hit is None:
        index = (slots >= 0).nonzero().view(-1)
        hit = index, slots.index_select(0, index).long()
        if key is not None:
            STEP.memo[key] = hit
    return hit


def _in_table(positions, table) -> bool:
    """Whether every position has a row of the table; few read as Python ints (0.6 us; min() and max(): 4.5)."""
    if positions.ndim == 1 and positions.shape[0] <= _TABLE_TOKENS:
        few = positions.tolist()
        return 0 <= min(few) and max(few) < table.shape[0]
    return bool(0 <= positions.min() and positions.max() < table.shape[0])


def strided(plan, arrays) -> bool:
    """Whether a pool's head dim is strided (vLLM's CPU key cache, seen transposed) or the pools are tiled
    (vLLM's AMX cache): ``write`` stores through the view; one_token's lane and the compiled step's pool
    writes are not tested with them."""
    return plan.call.pool.kv_layout in TILED or any(p.stride(-1) != 1 and p.shape[-1] != 1 for p in arrays[5:7])


def _tables_of(freqs) -> dict:
    """The cos/sin tables made from these frequencies (shared by every rotation with the same values).
    Holds no caller array: the key is the values (a few hundred bytes), the tables ropepool's own."""
    key = freqs.numpy().tobytes()
    if key not in _TABLES and len(_TABLES) >= 64:
        _drop_tables()
    return _TABLES.setdefault(key, {})


def _drop_tables() -> None:
    """Every table goes (the runners keep their dicts, emptied, and regrow what they use)."""
    for tables in _TABLES.values():
        tables.clear()
    _TABLES.clear()
    _table_bytes[0] = 0


class Prepared:
    def __init__(self, plan, fallback):
        self.plan, self.fallback = plan, fallback

    def bind(self, *arrays):
        ex = extras(self.plan.fixed, arrays[0].device)
        return Fast(self.plan, ex, self.fallback.bind(*arrays), strided(self.plan, arrays)).run


def prepare(plan, tuning, fallback):
    return Prepared(plan, fallback)


class Fast(OneToken, Normed):
    """The runner for one plan and layout (``general``: the fallback's runner, for what this one declines;
    the one-token lanes: torch_cpu_one_token; the QK norm: torch_cpu_norm)."""

    table_positions = _TABLE_POSITIONS  # the lanes' bound on a position of the table

    def __init__(self, plan, ex, general, strided=False):
        call, freqs = plan.call, ex.freqs
        self.call, self.rot, self.general, self.strided = call, call.rotation, general, strided
        r, gptj = self.rot.rotary_dim, self.rot.gptj
        # x's rotated features seen as [..., 2, r/2] (NeoX: the pair's two halves) or [..., r/2, 2] (GPT-J);
        # cos/sin as [T, 1, 1, r/2] / [T, 1, r/2, 1] broadcast over them, the signs of -sin, sin over a pair.
        self.pairs, self.pair_dim = ((r // 2, 2), -1) if gptj else ((2, r // 2), -2)
        self.cs_shape = (-1, 1, r // 2, 1) if gptj else (-1, 1, 1, r // 2)
        self.sign = torch.tensor([-1.0, 1.0]).view((1, 2) if gptj else (2, 1))
        self.freqs = None if freqs is None else [f.view(self.cs_shape[2:]) for f in freqs]  # None with a table
        self._freqs = freqs
        # The table's values are those computed per call only where each call's T * r/2 angles take torch's
        # vector cos/sin (ATen computes a tail of < 32 floats with libm's): r/2 a multiple of 32.
        self.tables = None if freqs is None or (r // 2) % 32 else _tables_of(freqs)
        self.tables_key = None if self.tables is None else freqs.numpy().tobytes()
        geom = call.pool
        # A flat pool is [rows, heads, dim] already, slot = row: no view per call.
        self.flat = geom.kv_layout is None and geom.layer is None and geom.headed
        self.compiled = {}  # torch_cpu_compiled's functions for this layout
        self.ops = TorchOps  # arraymath's and dsa_store's operations (the QK norm, fp8 and DeepSeek V3.2's stores)
        self.gain_kept = (None, None)  # gain's key and value
        # fp8 pools (the row takes only "scaled" ones): their bound, and k's and v's scales as float32 tensors
        self.quantized, self.qmax = plan.stores.k_pool.quantized, plan.stores.k_pool.qmax
        # DeepSeek V3.2's stores of k and v (backends/dsa_store.py), or None: written by dsa_store.put
        self.dsa = tuple(s.format if s.format in dsa_store.FORMATS else None for s in plan.stores[:2])
        self.scales = (ex.k_scale, ex.v_scale) if self.quantized else (None, None)
        self.plain_rows = not self.quantized and self.dsa == (None, None)  # write's rows go in as they are
        # The one-token lanes: pools of one layer with a head dim, of q's dtype or fp8, no norm, cos/sin of a
        # table of ours; compiled_one_token's any such layout, one_token's (torch ops) flat pools only.
        self.pool_size = call.pool_size
        self.lane = geom.layer is None and geom.headed and call.norm is None and not strided and \
            (self.quantized or call.pool_dtype == call.dtype) and self.tables is not None and self.rot.long_from is None
        self.ops_lane = self.lane and self.flat
        # The few-rows lane (run): every feature rotates, pools of q's dtype, no norm (normed rotates q and k as
        # one tensor already), no DeepSeek V3.2 store.
        self.few = self.rot.rotary_dim == call.head_dim and not self.quantized and call.norm is None and \
            self.dsa == (None, None) and call.pool_dtype == call.dtype
        self.one_graph = torch_cpu_compiled.one_token_graph(self.pairs, self.pair_dim,
                                                            self.qmax if self.quantized else None,
                                                            geom.kv_layout, geom.page_size)

    @property
    def source(self):
        """What cos/sin are made of: the frequencies (ropepool's), or the caller's table, which the runner
        reaches through the rotation's weak reference only (a dropped table is freed: docs/memory.md)."""
        return self._freqs if self._freqs is not None else self.rot.table

    def cos_sin(self, positions, pick=True):
        """float32 ``cos`` and ``-sin, sin``, shaped to broadcast over ``x`` seen as ``[T, H, *pairs]``, and
        None; or, with ``pick=False`` where a table holds them, that table's two parts and the positions whose
        rows they are (the compiled rotation picks them itself). Positions a serving step registered
        (values.STEP) get them once per step for every layer of this rotation."""
        if STEP.holds(positions):
            source = self.source
            key = ("cos_sin", id(positions), source, self.cs_shape, self.rot.attention_scaling, pick)
            hit = STEP.memo.get(key)
            if hit is None or hit[0] is not source:  # (the entry keeps its source alive: ids stay theirs)
                hit = STEP.memo[key] = (source, self._cos_sin(positions, pick))
            return hit[1]
        return self._cos_sin(positions, pick)

    def _cos_sin(self, positions, pick):
        rot = self.rot
        if rot.table is not None:
            half = rot.rotary_dim // 2
            rows = rot.table.index_select(0, positions).float()
            return rows[:, :half].view(self.cs_shape), rows[:, half:2 * half].view(self.cs_shape) * self.sign, None
        T = positions.shape[0]
        # Few positions are read as Python ints (0.4 us; a tensor max and int() cost 1.5).
        top = (max(positions.tolist()) if T <= _TABLE_TOKENS else int(positions.max())) if T else -1
        s = int(rot.long_from is not None and top >= rot.long_from)
        tables = self.from_table(s, top) if self.tables is not None and T <= _TABLE_TOKENS and \
            top < _TABLE_POSITIONS else None
        if tables is not None:
            cos, sin = tables
            if not pick:
                return cos, sin, positions
            return cos.index_select(0, positions), sin.index_select(0, positions), None
        return (*self.compute(self.freqs[s], positions), None)

    def compute(self, inv, positions):
        rot = self.rot
        ang = positions.view(-1, 1, 1, 1) * inv  # int * float32: float32(p) * inv_freq32, one rounding
        cos, sin = torch.cos(ang), torch.sin(ang) * self.sign
        if rot.attention_scaling != 1.0:
            cos.mul_(rot.attention_scaling)
            sin.mul_(rot.attention_scaling)
        return cos, sin

    def from_table(self, s, top):
        """Tables of ``compute``'s cos and sin, a row per position, shaped like them, for positions up to ``top``
        < _TABLE_POSITIONS: grown on demand in chunks of _TABLE_CHUNK positions (index_select keeps the shape);
        None where they would not fit in _TABLE_BYTES."""
        key = (s, self.cs_shape, self.rot.attention_scaling)
        tables = self.tables.get(key)
        if tables is None or tables[0].shape[0] <= top:
            # After a drop this runner's dict is emptied and unlisted: it takes the listed one again.
            self.tables = _TABLES.setdefault(self.tables_key, self.tables)
            tables = self.tables.get(key)
            have = 0 if tables is None else tables[0].shape[0]
            new = self.compute(self.freqs[s], torch.arange(have, (top // _TABLE_CHUNK + 1) * _TABLE_CHUNK))
            grown = sum(t.nbytes for t in new)
            if _table_bytes[0] + grown > _TABLE_BYTES:
                if not _table_bytes[0]:  # more than the bound alone: computed per call
                    return None
                _drop_tables()
                return self.from_table(s, top)
            _table_bytes[0] += grown
            # New tensors, then the swap: a concurrent call keeps reading the old tables.
            tables = self.tables[key] = new if tables is None else tuple(map(torch.cat, zip(tables, new)))
        return tables

    def pairs_of(self, x, out):
        """``out`` (new when None) and the rotated features of x and out as ``[T, H, *pairs]`` views
        (None, None without RoPE); features past rotary_dim are copied through here."""
        r = self.rot.rotary_dim
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype)
        T, H, D = x.shape
        y = out
        if r < D:
            if out.data_ptr() != x.data_ptr():
                out[..., r:].copy_(x[..., r:])
            if r == 0:
                return out, None, None
            x, y = x[..., :r], out[..., :r]
        return out, x.view(T, H, *self.pairs), y.view(T, H, *self.pairs)

    def rotate(self, x, cs, out):
        """``[T, H, *pairs]`` x rotated by ``cs`` (``cos_sin``'s) into out, in blocks of tokens."""
        T, H = x.shape[:2]
        step = max(1, _BLOCK_ELEMENTS // (H * x.shape[2] * x.shape[3]))
        if T <= step:
            self._block(x, *cs, out)
        else:
            for i in range(0, T, step):
                self._block(x[i:i + step], cs[0][i:i + step], cs[1][i:i + step], out[i:i + step])

    def _block(self, x, cos, sin, out):
        """``out = x * cos + swap(x) * (-sin, sin)`` for a block of tokens, in float32.

        Each product is rounded, then the sum, as in torch_eager and vLLM's kernel (bit for bit
        their results; addcmul_ would fuse a product into the sum)."""
        p = self.pair_dim
        xf = x if x.dtype == torch.float32 else x.float()  # bf16 / fp16: upcast once
        # swap(x) * (-sin, sin), a new tensor: read before out (maybe x itself) is written. flip is
        # one call, but at over ~16K elements two half-size products into the swapped halves are faster.
        if xf.numel() <= _FLIP_ELEMENTS:
            swapped = xf.flip(p).mul_(sin)
        else:
            swapped = torch.empty(xf.shape, dtype=torch.float32)
            torch.mul(xf.select(p, 1), sin.select(p, 0), out=swapped.select(p, 0))
            torch.mul(xf.select(p, 0), sin.select(p, 1), out=swapped.select(p, 1))
        # Into out only where it is float32 (else the product would be rounded to its dtype before the sum);
        # where x is float32 and out is not, x is a float32 copy of the caller's (normed) that may be overwritten.
        y = torch.mul(xf, cos, out=out if out.dtype == torch.float32 else xf)
        torch.add(y, swapped, out=out)  # the one rounding to out's dtype

    def rows_of(self, pool):
        """The pool as ``[rows, heads, dim]`` (slot = row), or None where a page's rows are not one run (HND)."""
        if self.flat:
            return pool
        if self.call.pool.kv_layout in TILED:
            return None
        view = paged_view(pool, self.call.pool)
        return view.flatten(0, 1) if view.stride(0) == view.shape[1] * view.stride(1) else None

    def write(self, pool, rows, slots, keep, scale=None, at=None):  # scale: 0 the k pool, 1 the v pool
        """``rows [T, H, dim]`` into the pool at ``slots`` (int64); ``keep``: the indices of the tokens written,
        ``slots`` theirs (None: all); ``at``: a list holding the slots' (page, row) once a write made them (the
        other pool's write takes them: two torch ops a call fewer), or None.
        An fp8 pool stores ``rows / scale`` saturated, as torch_eager quantizes (arraymath.quantize), its
        bytes copied (index_copy_ has no fp8 kernels)."""
        if keep is not None:
            rows = rows.index_select(0, keep)
        if self.flat and self.plain_rows and rows.dtype == pool.dtype:  # the common case first
            pool.index_copy_(0, slots, rows)
            paths.took("torch_cpu.write")
            return
        if self.dsa[scale] is not None:  # one latent head: [T, 1, dim]
            dsa_store.put(self.dsa[scale], pool, self.call.pool, *self.page_and_row(slots, at), rows[:, 0], self.ops)
            return
        if self.quantized:
            scale = self.scales[scale]
            rows = arraymath.quantize(rows.float(), scale, self.qmax, self.ops).to(pool.dtype)
            pool, rows = pool.view(torch.uint8), rows.view(torch.uint8)
        elif rows.dtype != pool.dtype:
            rows = rows.to(pool.dtype)
        flat = self.rows_of(pool)
        if flat is not None:  # one index a slot
            flat.index_copy_(0, slots, rows)
        else:
            view, index, rows = write_at(pool, self.call.pool, scale, *self.page_and_row(slots, at), rows)
            view.index_put_(index, rows)
        paths.took("torch_cpu.write")

    def page_and_row(self, slots, at):
        """The slots' (page, row), kept in the list ``at`` (None: not kept) for the other pool's write."""
        if not at:
            made = page_and_row(slots, self.call.pool.page_size)
            if at is None:
                return made
            at += made
        return at

    def run(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
        one = q_out is None and k_out is None and q.shape[0] == 1
        if one and self.lane:
            done = self.compiled_one_token(q, k, v, positions, slots, k_pool, v_pool)
            if done is not None:
                return done
        x = self.fused_pairs(q, k) if one else None
        if x is not None and self.ops_lane:
            done = self.one_token(x, q, k, v, positions, slots, k_pool, v_pool)
            if done is not None:
                return done
        # Few slots are read as Python ints (0.7 us; aminmax and int() cost 4).
        if slots.shape[0] <= _TABLE_TOKENS:
            few = slots.tolist()
            lo, hi = (min(few), max(few)) if few else (0, 0)
        else:
            lo, hi = map(int, slots.aminmax())
        table = self.rot.table
        # Slots past the pool, positions outside the engine's table: only a runner called without
        # validation sees them (tests do); the general path masks them.
        if hi >= self.pool_size or (table is not None and positions.numel() and not _in_table(positions, table)):
            return self.general(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
        v3 = v if v.ndim == 3 else v[:, None]  # MLA: one latent head
        written = False
        if self.call.norm is not None:  # QK norm: q and k as one new tensor, normalised and rotated in place
            k3, Hq = (k if k.ndim == 3 else k[:, None]), q.shape[1]
            both = self.normed(torch.cat((q, k3), 1), Hq, positions)
            q_rot, k_rot = _parts(both, Hq)
            if q_out is not None:
                q_rot = q_out.copy_(q_rot)
            if k_out is not None:
                k_rot = k_out.view(k3.shape).copy_(k_rot)
        elif x is not None:  # one token's q and k heads in a row: rotated as one tensor, 5 torch ops instead of 10
            both = torch.empty(x.shape, dtype=q.dtype)
            self._block(x, *self.cos_sin(positions)[:2], both)
            # Its two parts, each contiguous (as_strided: one call, where a slice and a view are two).
            (Hq, D), Hkv = q.shape[1:], k.shape[1]
            row = (Hq + Hkv) * D
            q_rot, k_rot = both.as_strided((1, Hq, D), (row, D, 1)), both.as_strided((1, Hkv, D), (row, D, 1), Hq * D)
        elif self.few and q_out is None and k_out is None and k.ndim == 3 and k.shape[2] == q.shape[2] and \
                q.shape[0] * (q.shape[1] + k.shape[1]) * q.shape[2] <= _FEW_ELEMENTS:
            # Few rows, q and k apart (a model's own projections): one copy of both into one tensor, rotated in
            # place by _block's ops, then each part copied out contiguous (as every path returns them): 8 torch
            # ops where two rotations take 10 and the compiled step's wrappers cost more than its loop
            # (measured on the shared 2-core VM at ropepool demo's sizes: ~27 us a call against ~37).
            both = torch.cat((q, k), 1)
            T, H, D = both.shape
            x = both.view(T, H, *self.pairs)
            self._block(x, *self.cos_sin(positions)[:2], x)
            q_rot, k_rot = _parts(both, q.shape[1])
            q_rot, k_rot = q_rot.contiguous(), k_rot.contiguous()
            paths.took("torch_cpu.few")
        else:
            k3 = k if k.ndim == 3 else k[:, None]
            q_rot, qx, qy = self.pairs_of(q, q_out)
            k_rot, kx, ky = self.pairs_of(k3, None if k_out is None else k_out.view(k3.shape))
            if qx is not None:
                # k_rot is ky, every token written, and few tokens: from 256 inductor's scatter is slower
                # than index_copy_ (measured), below the two ops cost more than the rows.
                whole = lo >= 0 and self.rot.rotary_dim == k3.shape[2] and q.shape[0] <= _TABLE_TOKENS and \
                    not self.quantized and not self.strided and self.dsa == (None, None)
                written = self.compiled_step(qx, kx, qy, ky, v3, positions, slots, k_pool, v_pool, whole)
        if not written:
            # index_copy_'s index type; a negative slot skips the token's write
            keep, slots = (None, slots.long()) if lo >= 0 else _kept(slots)
            at = []  # the slots' (page, row), made by the first write that needs them
            self.write(k_pool, k_rot, slots, keep, 0, at)
            self.write(v_pool, v3, slots, keep, 1, at)
        return q_rot, k_out if k_out is not None else k_rot if k.ndim == 3 else k_rot.view(k.shape), k_pool, v_pool

    def compiled_step(self, qx, kx, qy, ky, v3, positions, slots, k_pool, v_pool, whole) -> bool:
        """The rotation of q and k: through torch_cpu_compiled where wanted, which also picks the cos/sin rows
        of a table and, where ``whole`` and the pools are rows, writes them; else (or where it did not run)
        by torch ops. Whether the pools are written."""
        compiled = torch_cpu_compiled.wanted(qx.shape[0])
        cos, sin, picked = self.cos_sin(positions, pick=not compiled)
        if compiled:
            k_rows = v_rows = None
            if whole:
                k_rows, v_rows = self.rows_of(k_pool), self.rows_of(v_pool)
            writes = None if k_rows is None or v_rows is None else (v3, slots, k_rows, v_rows)
            if torch_cpu_compiled.rotate(qx, kx, cos, sin, self.pair_dim, qy, ky, self.compiled, picked, writes):
                return writes is not None
        if picked is not None:
            cos, sin = cos.index_select(0, picked), sin.index_select(0, picked)
        self.rotate(qx, (cos, sin), qy)
        self.rotate(kx, (cos, sin), ky)
        return False
