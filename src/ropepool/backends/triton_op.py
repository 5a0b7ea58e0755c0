"""Launcher of the fused Triton kernel, and its torch.library custom op.

``prepare`` turns a plan into a ``Launcher``: the kernel's constexprs that
do not depend on strides (``_features``, for decode-sized and larger
calls), its scalar arguments and the tensors it reads besides the arrays.
``Launcher.bind`` adds the strides of one tensor layout and returns a
runner: ``triton_launch.Launch``, the direct launch of that layout.

Under torch.compile a runner calls ``torch.ops.ropepool.rope_pool``, which
declares the outputs and pools mutated and has a fake implementation, so
``fullgraph=True`` traces it and CUDA graphs capture it. A Launcher is plain
data, so the op carries it as lists (``Launcher.args``) and rebuilds it with
``Launcher.from_args``; strides are read again from the tensors the op gets,
which inductor may lay out differently from eager.

The kernel's arguments come by name: its pointers in core/args.POINTERS'
order, its constexprs as one dict (``_features`` and ``Launcher.bind``'s
strides, each named ``<array>_<field>``; triton_launch orders them by the
kernel's signature), the pools' strides from the plan's one pool geometry
(``call.pool``), which also gives the slots' bound ``pool_size``.
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
import triton

from ..core.args import Extras
from ..core.layout import TILED, PoolGeometry, paged_view, tiled_view
from ..errors import RopePoolError
from ..formats import BLOCK
from .torch_arrays import extras
from .triton_launch import CONSTEXPRS, MAX_ENTRIES, Launch, long_factors

# The kernel's stride constexprs, in elements, named <array>_<field> (a layout's strides are compiled in; see
# triton_kernel.py). _ROWS' fields: per token (ST) and per head (SH; 0 for MLA's one head) of q, k, v, q_out,
# k_out. _POOL's: the k and v pools (KP, VP) seen as [pages, page_size, heads, dim] (layout.paged_view) per page,
# per row of a page (slot % page_size) and per head, and a tiled pool's (layout.tiled_view: vLLM's AMX cache)
# tokens a tile (ROW is then the tile's stride, ROW0 a row's within it), features a tile and their strides
# (untiled: 1, 0, 1, 1, 0). _CACHE's: the per-token-head scale caches (KS, VS; block pools: their scales) and
# the affine pools' biases (KB, VB), the same view without the last dim. TABLE_ST: the engine's table per position.
_ROWS, _POOL, _CACHE = ("ST", "SH"), ("PAGE", "ROW", "SH", "TT", "ROW0", "TD", "D1", "D0"), ("PAGE", "ROW", "SH")
_CACHES = (("KS", "k_scale_cache"), ("VS", "v_scale_cache"), ("KB", "k_bias_cache"), ("VB", "v_bias_cache"))
_STRIDES = frozenset([f"{a}_{f}" for a in ("Q", "K", "V", "QO", "KO") for f in _ROWS] +
                     [f"{a}_{f}" for a in ("KP", "VP") for f in _POOL] +
                     [f"{a}_{f}" for a, _ in _CACHES for f in _CACHE] + ["TABLE_ST"])
_FLOAT_FEATURES = ("FP8_MAX", "Q_FP8_MAX", "K_FP8_MAX", "ATTENTION_SCALING", "EPS", "WEIGHT_OFFSET")
_INT_FEATURES = tuple(n for n in CONSTEXPRS if n not in _STRIDES and n not in _FLOAT_FEATURES)
# Bounds: plain data (no caller tensor); past its bound it is emptied and refilled.
_LAUNCHERS: dict = {}  # Launcher.args -> Launcher, for the custom op; MAX_ENTRIES
_VARIANTS: dict = {}  # (plan.Plan.key, head split) -> the constexprs of that variant (_features); MAX_ENTRIES
_MAX_BOUND = 64  # layouts a Launcher keeps (Launcher._bound)


def _tile(n: int) -> int:
    """The power-of-two tile size that holds n (at least 1)."""
    return triton.next_power_of_2(max(n, 1))


def default_split(call) -> int:
    """Programs a decode-sized call's token is split over (at most ``small_tokens`` tokens).

    At small T one program per token leaves most SMs idle and each program
    waits on a long row; splitting the q heads over up to 8 programs is
    faster there, and no longer helps from a few hundred tokens on (the H200
    sweep is in docs/benchmarks.md). KV heads follow as far as they go (MQA
    and MLA: program 0 writes the one KV head).
    """
    return next(s for s in (8, 4, 2, 1) if call.num_qo_heads % s == 0)


def large_split(call) -> int:
    """Programs a token's heads are split over above ``small_tokens`` tokens.

    With the fused norm a program's q tile stays at most Llama-3-8B's 32 x 128
    features: the norm's reduction holds it in registers, and larger tiles
    spill ((64, 8) heads ran 8% slower whole than split in two). Without it
    one program a token is faster: (64, 8) heads lost 4% of copy bandwidth and
    DeepSeek-V3's 128-head latent call 3-4% when split (H200, docs/benchmarks.md).
    """
    split = 1
    while call.norm is not None and _tile(call.num_qo_heads // split) * call.head_dim > 4096 and \
            call.num_qo_heads % (2 * split) == 0:
        split *= 2
    return split


def default_warps(call, split: int) -> int:
    """Warps a program, given the large calls' head split.

    Two: what the H200 sweep chose for every Llama-like geometry (four for
    tiles over 8k elements was tried: (64, 8) heads with the fused norm then
    reached 60% of copy bandwidth). One for a latent call whose q tile is at
    most 1024 features (DeepSeek-V3 at TP-8: 16 heads x 64): 94% of copy
    against 82-86% with two, fp8 cache or bf16 (docs/benchmarks.md).
    """
    return 1 if call.latent and _tile(call.num_qo_heads // split) * call.head_dim <= 1024 else 2


def _features(plan, split: int) -> dict:
    """The kernel's constexprs that do not depend on strides (ints, and the floats of _FLOAT_FEATURES).

    Attention scaling, eps and the weight offset are constants of a model, so
    they are compiled in; scales are read through pointers, since engines
    keep one per layer (or update them)."""
    call, st, features = plan.call, plan.stores, plan.features
    rot, norm = call.rotation, call.norm
    hq, hkv = call.num_qo_heads // split, -(-call.num_kv_heads // split)
    section = rot.mrope_section or (0, 0, 0)
    c = dict(
        PAGE_SIZE=call.pool.page_size, NUM_KV=call.num_kv_heads, HQ=hq, HKV=hkv, D=call.head_dim,
        DV=call.v_head_dim, ROT=rot.rotary_dim, GPTJ=rot.gptj, BHQ=_tile(hq), BHKV=_tile(hkv),
        BLOCK_HALF=_tile(rot.rotary_dim // 2), BLOCK_PASS=_tile(call.head_dim - rot.rotary_dim),
        BLOCK_DV=_tile(call.v_head_dim), LONGROPE="longrope" in features,
        TABLE="table" in features, MAX_POSITION=0 if rot.table is None else rot.table.shape[0],
        MROPE="mrope" in features, S_T=section[0], S_H=section[1],
        S_W=section[2], MROPE_INTERLEAVED=rot.mrope_interleaved,
        NORM=0 if norm is None else 2 if norm.after_rope else 1,
        Q_W=norm is not None and norm.q_weight is not None, K_W=norm is not None and norm.k_weight is not None,
        FP8="pool.scaled" in features, K_PER_HEAD=_numel(st.k_pool.scale) > 1,
        V_PER_HEAD=_numel(st.v_pool.scale) > 1, Q_FP8="q_out.scaled" in features, K_FP8="k_out.scaled" in features,
        PTH="pool.per_token_head" in features, NVFP4="pool.nvfp4" in features,
        AFFINE=st.k_pool.bits if "pool.affine" in features else 0, GROUP=st.k_pool.group,
        DS_MLA="pool.fp8_ds_mla" in features,
        INDEXER=2 if "pool.indexer_ue8m0" in features else int("pool.indexer" in features),
    )
    ints = {n: int(x) for n, x in c.items()}  # bools as ints: one spelling, one compiled kernel
    eps, offset = (1.0, 0.0) if norm is None else (norm.eps, norm.weight_offset)
    floats = (st.k_pool.qmax, st.q_out.qmax, st.k_out.qmax, rot.attention_scaling, eps, offset)
    return {**ints, **dict(zip(_FLOAT_FEATURES, floats))}


def _variant(plan, split: int) -> dict:
    """``_features`` of a plan, found by its static key (``plan.Plan.key``: everything _features reads)."""
    if "traced" in plan.features:  # under torch.compile: made in the graph, never kept
        return _features(plan, split)
    got = _VARIANTS.get((plan.key, split))
    if got is None:
        if len(_VARIANTS) >= MAX_ENTRIES:
            _VARIANTS.clear()
        got = _VARIANTS[(plan.key, split)] = _features(plan, split)
    return got


def _numel(scale) -> int:
    return scale.numel() if isinstance(scale, torch.Tensor) else 1


class Launcher:
    """What the kernel is launched with besides the tensors: plain data.

    ``features``: constexprs for calls of up to ``small_tokens`` tokens (heads
    split over ``split`` programs) and for larger ones. ``geom``: the plan's
    pool geometry (core/layout.PoolGeometry), which every layout's pool strides
    and the slots' bound come from.
    """

    def __init__(self, small: dict, large: dict, small_tokens: int, splits: tuple, warps: int, geom: PoolGeometry):
        self.features, self.splits = (small, large), splits  # per variant: constexprs, programs a token
        self.small_tokens, self.warps, self.geom = small_tokens, warps, geom
        self._bound: dict = {}

    @classmethod
    def for_plan(cls, plan, tuning) -> "Launcher":
        call = plan.call
        splits = (tuning.head_split or default_split(call), large_split(call))
        return cls(*(_variant(plan, s) for s in splits), tuning.small_tokens, splits,
                   tuning.num_warps or default_warps(call, splits[1]), call.pool)

    def args(self) -> tuple:
        """This launcher as the custom op's arguments: lists of ints and floats, and a str (the layout)."""
        small, large = self.features
        g = self.geom
        return ([small[n] for n in _INT_FEATURES], [large[n] for n in _INT_FEATURES],
                [small[n] for n in _FLOAT_FEATURES],
                [self.small_tokens, *self.splits, self.warps, -1 if g.layer is None else g.layer, int(g.headed),
                 *(getattr(g, n) for n in _SIZES)], g.kv_layout or "")

    @classmethod
    def from_args(cls, small, large, floats, ints, kv_layout) -> "Launcher":
        key = (tuple(small), tuple(large), tuple(floats), tuple(ints), kv_layout)
        launcher = _LAUNCHERS.get(key)
        if launcher is None:
            if len(_LAUNCHERS) >= MAX_ENTRIES:
                _LAUNCHERS.clear()
            f = dict(zip(_FLOAT_FEATURES, floats))
            small_tokens, split_small, split_large, warps, layer, headed, *sizes = ints
            geom = PoolGeometry(None if layer < 0 else layer, kv_layout or None, bool(headed),
                                **dict(zip(_SIZES, sizes)))
            launcher = _LAUNCHERS[key] = cls({**dict(zip(_INT_FEATURES, small)), **f},
                                             {**dict(zip(_INT_FEATURES, large)), **f}, small_tokens,
                                             (split_small, split_large), warps, geom)
        return launcher

    def bind(self, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, extras):
        """The runner for this layout (outputs None: new contiguous tensors). ``extras``: a
        core/args.Extras whose table and scale and bias caches (4-D NHD views of the layer written,
        Prepared.extras) are read for their strides."""
        head = lambda x: x.stride(1) if x.ndim == 3 else 0  # noqa: E731  MLA's k_pe / kv_c: one head
        # New outputs are contiguous, whatever the token count: strides from the shape alone. (empty_like in
        # its default format would copy the strides of a one-token view, which the layout cache then reuses
        # for every token count.)
        qo = q_out.stride()[:2] if q_out is not None else (q.shape[1] * q.shape[2], q.shape[2])
        ko = (k_out.stride(0), head(k_out)) if k_out is not None else (
            (k.shape[1] * k.shape[2], k.shape[2]) if k.ndim == 3 else (k.shape[1], 0))
        rows = (q.stride(0), q.stride(1)), (k.stride(0), head(k)), (v.stride(0), head(v)), qo, ko
        strides = {f"{a}_{f}": s for a, pair in zip(("Q", "K", "V", "QO", "KO"), rows) for f, s in zip(_ROWS, pair)}
        offsets = []
        for a, which, pool in (("KP", 0, k_pool), ("VP", 1, v_pool)):
            pool_strides, offset = _pool_strides(pool, self.geom, which)
            strides.update((f"{a}_{f}", s) for f, s in zip(_POOL, pool_strides))
            offsets.append((offset - pool.storage_offset()) * pool.element_size())
        for a, name in _CACHES:
            c = getattr(extras, name)
            strides.update((f"{a}_{f}", s) for f, s in zip(_CACHE, (0, 0, 0) if c is None else c.stride()))
        strides["TABLE_ST"] = 0 if extras.table is None else extras.table.stride(0)
        dtypes = (q.dtype, k.dtype, k_pool.dtype, q_out.dtype if q_out is not None else q.dtype,
                  k_out.dtype if k_out is not None else k.dtype, positions.dtype, slots.dtype, positions.ndim)
        key = (tuple(strides.values()), tuple(offsets), dtypes)
        launch = self._bound.get(key)
        if launch is None:
            if len(self._bound) >= _MAX_BOUND:
                self._bound.clear()
            launch = self._bound[key] = Launch(self, strides, tuple(offsets))
        return launch


_SIZES = ("num_layers", "num_pages", "page_size", "num_heads", "dim")  # PoolGeometry's ints, by name


def _pool_strides(pool, geom, which: int) -> tuple:
    """How the kernel addresses a pool (``which``: 0 k, 1 v): (its _POOL strides, the storage offset of the layer
    written). Untiled: the 4-D NHD view's, tiles (1, 0, 1, 1, 0). Tiled (vLLM's AMX cache): the 6-D view
    [pages, rows // TT, TT, heads, dim // TD, TD]'s, ROW the row tile's."""
    if geom.kv_layout not in TILED:
        view = paged_view(pool, geom)
        return (*view.stride()[:3], 1, 0, 1, 1, 0), view.storage_offset()
    view = tiled_view(pool, geom, which)
    page, row, row0, head, d1, d0 = view.stride()
    return (page, row, head, view.shape[2], row0, view.shape[5], d1, d0), view.storage_offset()


def _scale_views(plan) -> tuple:
    """The per-token-head scale caches as the kernel reads them (4-D NHD views of the layer written; None
    where absent), made from the stores' weak references on each use: nothing kept holds them."""
    return tuple(None if c is None else paged_view(c[..., None], plan.call.pool)
                 for c in (plan.stores.k_pool.scale_cache, plan.stores.v_pool.scale_cache))


class Prepared:
    """A plan's Launcher and the tensors its kernel reads besides the arrays."""

    def __init__(self, plan, tuning):
        self.plan, self.call, self.launcher = plan, plan.call, Launcher.for_plan(plan, tuning)
        self._extras: dict = {}

    def extras(self, device) -> tuple:
        """The plan's extras (``plan.Extras``' order) as the kernel reads them: tensors on ``device``, the
        per-token-head scale caches as 4-D NHD views of the layer written (None where absent)."""
        got = self._extras.get(device)
        if got is None:
            got = self._extras[device] = extras(self.plan.fixed, device)
        table = self.call.rotation.table  # held weakly (spec.Rotation), as the scale caches: never kept here
        k_sc, v_sc = _scale_views(self.plan)
        return got._replace(table=table, k_scale_cache=k_sc, v_scale_cache=v_sc)

    def fixed_pointers(self) -> bool:
        """Whether the kernel's extra tensors are all ropepool's own or the engine's table, whose memory
        stays put; norm weights, tensor scales and scale caches belong to the caller and are read on every
        call."""
        fixed, features = self.plan.fixed, self.plan.features
        caller = any(isinstance(x, torch.Tensor) for x in fixed)  # (freqs: NumPy, ropepool's own)
        return not caller and "pool.per_token_head" not in features and "longrope" not in features

    def bind(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
        """The runner for calls laid out like these arrays (under torch.compile: one that calls the op)."""
        if self.plan.stores.k_pool.format in BLOCK:
            return self.block_run
        for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
            if pool.stride(-1) != 1 and pool.shape[-1] > 1:  # the kernel stores each head's row as one run
                raise RopePoolError(f"backend 'triton' writes pools whose head dim is contiguous; got {name} with "
                                    f"strides {list(pool.stride())}. Fix: backend='torch' (it writes through any "
                                    "view), or a pool whose last dim has stride 1.")
        extras = self.extras(q.device)
        long_from = self.call.rotation.long_from if "longrope" in self.plan.features else None
        if not torch.compiler.is_compiling():
            views = functools.partial(_scale_views, self.plan) if "pool.per_token_head" in self.plan.features else None
            return self.launcher.bind(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, extras).adopt(
                extras, long_from, self.fixed_pointers(), self.call.rotation.table_ref, views)
        op_args = self.launcher.args()

        def run(q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
            if q_out is None:
                q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
            if k_out is None:
                k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
            rope_pool_op(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, long_factors(positions, long_from),
                         *extras, *op_args)
            return q_out, k_out, k_pool, v_pool

        return run


    def block_run(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
        """A call into block-quantized pools: NVFP4's ``(data, block_scales)`` or the affine ``(words, scales,
        biases)``. The scales ride where per-token-head scale caches do, the biases in the bias caches (4-D NHD
        views; NVFP4's e4m3 scales read as bytes, the affine uint32 words written as int32); no direct launch
        (the caller's arrays change per call)."""
        (kd, *k_parts), (vd, *v_parts) = k_pool, v_pool
        if kd.dtype == torch.uint32:
            kd, vd = kd.view(torch.int32), vd.view(torch.int32)
        views = {}  # the parts after the data: the scales, then the biases where the format has them
        for which, parts in (("k", k_parts), ("v", v_parts)):
            views.update(zip((f"{which}_scale_cache", f"{which}_bias_cache"), (paged_view(
                x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x, self.call.pool) for x in parts)))
        extras = self.extras(q.device)._replace(**views)
        rot = self.call.rotation
        launch = self.launcher.bind(q, k, v, positions, slots, kd, vd, q_out, k_out, extras)
        long_from = rot.long_from if "longrope" in self.plan.features else None
        q_out, k_out, _, _ = launch(q, k, v, positions, slots, kd, vd, q_out, k_out, long_factors(positions, long_from),
                                    extras)
        return q_out, k_out, k_pool, v_pool


@torch.library.custom_op("ropepool::rope_pool", mutates_args=("q_out", "k_out", "k_pool", "v_pool", "k_scale_cache",
                                                             "v_scale_cache", "k_bias_cache", "v_bias_cache"))
def rope_pool_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
                 use_long: Optional[torch.Tensor], freqs: Optional[torch.Tensor], table: Optional[torch.Tensor],
                 q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], q_scale: Optional[torch.Tensor],
                 k_out_scale: Optional[torch.Tensor], k_scale_cache: Optional[torch.Tensor],
                 v_scale_cache: Optional[torch.Tensor], k_bias_cache: Optional[torch.Tensor],
                 v_bias_cache: Optional[torch.Tensor], small: List[int], large: List[int], floats: List[float],
                 ints: List[int], kv_layout: str) -> None:
    launcher = Launcher.from_args(small, large, floats, ints, kv_layout)
    # (the parameters above in core/args.Extras' order: tests/test_plan.py)
    extras = Extras(freqs, table, q_weight, k_weight, k_scale, v_scale, q_scale, k_out_scale, k_scale_cache,
                    v_scale_cache, k_bias_cache, v_bias_cache)
    launch = launcher.bind(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, extras)
    launch(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, use_long, extras)


@rope_pool_op.register_fake
def _(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, *rest):
    return None


def prepare(plan, tuning, fallback=None) -> Prepared:
    return Prepared(plan, tuning)
