"""Launcher of the fused Triton kernel, and its torch.library custom op.

``prepare`` turns a Call into a ``Launcher``: the kernel's constexprs that
do not depend on strides (``_features``, for decode-sized and larger
calls), its scalar arguments and the tensors it reads besides the arrays.
``Launcher.bind`` adds the strides of one tensor layout and returns a
runner. The first launch of a variant goes through Triton's JIT, which
compiles and returns the kernel; later launches hand the data pointers, as
ints, straight to the compiled kernel, skipping the JIT's per-argument
specialisation: at decode sizes the host time is the call's time.

Under torch.compile a runner calls ``torch.ops.ropepool.rope_pool``, which
declares the outputs and pools mutated and has a fake implementation, so
``fullgraph=True`` traces it and CUDA graphs capture it. A Launcher is plain
data, so the op carries it as lists (``Launcher.args``) and rebuilds it with
``Launcher.from_args``; strides are read again from the tensors the op gets,
which inductor may lay out differently from eager.
"""
from __future__ import annotations

import inspect
import math
from typing import List, Optional

import torch
import triton

from ..dtypes import FP8_MAX
from ..layout import paged_view, pool_geometry
from .torch_eager import device_array
from .triton_kernel import _INTERPRET, rope_pool_kernel

_CONSTEXPRS = [n for n, p in inspect.signature(rope_pool_kernel.fn).parameters.items()
               if p.annotation in ("tl.constexpr", triton.language.constexpr)]
_STRIDES = ("Q_ST", "Q_SH", "K_ST", "K_SH", "V_ST", "V_SH", "QO_ST", "QO_SH", "KO_ST", "KO_SH",
            "KP_PAGE", "KP_ROW", "KP_SH", "VP_PAGE", "VP_ROW", "VP_SH", "TABLE_ST")
_FLOAT_FEATURES = ("FP8_MAX", "Q_FP8_MAX", "K_FP8_MAX")
_INT_FEATURES = tuple(n for n in _CONSTEXPRS if n not in _STRIDES and n not in _FLOAT_FEATURES)
_KERNELS: dict = {}  # (constexpr values, warps, ...) -> compiled kernel, shared by every launcher
_LAUNCHERS: dict = {}  # Launcher.args -> Launcher, for the custom op


def _p2(n: int) -> int:
    """The power-of-two tile size that holds n (at least 1)."""
    return triton.next_power_of_2(max(n, 1))


def default_split(call) -> int:
    """Programs a decode-sized call's token is split over (at most ``small_tokens`` tokens).

    At T <= 64 one program per token leaves most SMs idle and each program
    waits on a long row; splitting the q heads over up to 8 programs took the
    H200's graph-replay time from 2.58 to 2.39-2.44 us (32/8, T = 16) and
    2.86 to 2.43 (64/8, T = 16). KV heads follow as far as they go (MQA and
    MLA: program 0 writes the one KV head). From T = 256 on it no longer
    helps (docs/benchmarks.md).
    """
    return next(s for s in (8, 4, 2, 1) if call.num_qo_heads % s == 0)


def default_warps(call) -> int:
    """Two warps a program won for every Llama-like geometry on the H200; tiles of
    more than ~8k elements (MLA's 128 heads) get more threads to hold them."""
    elements = (call.num_qo_heads + call.num_kv_heads) * call.head_dim + call.num_kv_heads * call.v_head_dim
    return 2 if elements <= 8192 else 4 if elements <= 16384 else 8


def _scale_mode(*scales) -> int:
    """0: floats; 1: one element each (a float beside a tensor becomes one); 2: one per KV head."""
    tensors = [s for s in scales if isinstance(s, torch.Tensor)]
    if not tensors:
        return 0
    return 2 if any(s.numel() > 1 for s in tensors) else 1


def _features(call, split: int) -> dict:
    """The kernel's constexprs that do not depend on strides (ints, and the three fp8 maxima)."""
    rot, norm = call.rotation, call.norm
    hq, hkv = call.num_qo_heads // split, -(-call.num_kv_heads // split)
    section = rot.mrope_section or (0, 0, 0)
    c = dict(
        PAGE_SIZE=call.pool.page_size, NUM_KV=call.num_kv_heads, HQ=hq, HKV=hkv, D=call.head_dim,
        DV=call.v_head_dim, ROT=rot.rotary_dim, GPTJ=rot.gptj, BHQ=_p2(hq), BHKV=_p2(hkv),
        BLOCK_HALF=_p2(rot.rotary_dim // 2), BLOCK_PASS=_p2(call.head_dim - rot.rotary_dim),
        BLOCK_DV=_p2(call.v_head_dim), LONGROPE=rot.long_from is not None and rot.table is None,
        TABLE=rot.table is not None, MROPE=call.position_rows == 3, S_T=section[0], S_H=section[1],
        S_W=section[2], MROPE_INTERLEAVED=rot.mrope_interleaved,
        NORM=0 if norm is None else 2 if norm.after_rope else 1,
        Q_W=norm is not None and norm.q_weight is not None, K_W=norm is not None and norm.k_weight is not None,
        FP8=call.fp8 is not None, SCALE_MODE=_scale_mode(call.k_scale, call.v_scale),
        Q_FP8=call.q_fp8 is not None, Q_SCALE_MODE=_scale_mode(call.q_scale),
        K_FP8=call.k_fp8 is not None, K_SCALE_MODE=_scale_mode(call.k_out_scale),
    )
    ints = {n: int(c[n]) for n in _INT_FEATURES}  # bools as ints: one spelling, one compiled kernel
    maxima = (FP8_MAX.get(call.fp8, 0.0), FP8_MAX.get(call.q_fp8, 0.0), FP8_MAX.get(call.k_fp8, 0.0))
    return {**ints, **dict(zip(_FLOAT_FEATURES, maxima))}


def _float(s) -> float:
    return 1.0 if s is None or isinstance(s, torch.Tensor) else float(s)


class Launcher:
    """What the kernel is launched with besides the tensors: plain data.

    ``features``: constexprs for calls of up to ``small_tokens`` tokens (heads
    split over ``split`` programs) and for larger ones. ``scalars``: k_scale,
    v_scale, q_scale, k_out_scale (floats where not tensors), attention
    scaling, norm eps and weight offset. ``where``: the pool layout's
    arguments (layer or -1, kv_layout or "", headed).
    """

    def __init__(self, small: dict, large: dict, scalars: tuple, small_tokens: int, split: int, warps: int,
                 max_position: int, where: tuple):
        self.features = (small, large)
        self.scalars, self.small_tokens, self.split, self.warps = scalars, small_tokens, split, warps
        self.max_position, self.where = max_position, where
        self._bound: dict = {}

    @classmethod
    def for_call(cls, call, tuning) -> "Launcher":
        rot, norm = call.rotation, call.norm
        split = tuning.head_split or default_split(call)
        eps, offset = (1.0, 0.0) if norm is None else (norm.eps, norm.weight_offset)
        scalars = (_float(call.k_scale), _float(call.v_scale), _float(call.q_scale), _float(call.k_out_scale),
                   rot.attention_scaling, eps, offset)
        geom = call.pool
        where = (-1 if geom.layer is None else geom.layer, geom.kv_layout or "", int(geom.headed))
        return cls(_features(call, split), _features(call, 1), scalars, tuning.small_tokens, split,
                   tuning.num_warps or default_warps(call), 0 if rot.table is None else rot.table.shape[0], where)

    def args(self) -> tuple:
        """This launcher as the custom op's arguments (lists of ints and floats, a str)."""
        small, large = self.features
        return ([small[n] for n in _INT_FEATURES], [large[n] for n in _INT_FEATURES],
                [small[n] for n in _FLOAT_FEATURES],
                [self.small_tokens, self.split, self.warps, self.max_position, self.where[0], self.where[2]],
                list(self.scalars), self.where[1])

    @classmethod
    def from_args(cls, small, large, maxima, ints, scalars, kv_layout) -> "Launcher":
        key = (tuple(small), tuple(large), tuple(maxima), tuple(ints), tuple(scalars), kv_layout)
        launcher = _LAUNCHERS.get(key)
        if launcher is None:
            fp8 = dict(zip(_FLOAT_FEATURES, maxima))
            small_tokens, split, warps, max_position, layer, headed = ints
            launcher = _LAUNCHERS[key] = cls(
                {**dict(zip(_INT_FEATURES, small)), **fp8}, {**dict(zip(_INT_FEATURES, large)), **fp8},
                tuple(scalars), small_tokens, split, warps, max_position, (layer, kv_layout, headed))
        return launcher

    def bind(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None, table=None):
        """The runner for this layout (outputs not given will be new contiguous tensors)."""
        layer, kv_layout, headed = self.where
        geom = pool_geometry(k_pool.shape, None if layer < 0 else layer, kv_layout or None, bool(headed))
        kp, vp = paged_view(k_pool, geom), paged_view(v_pool, geom)
        head = lambda x: x.stride(1) if x.ndim == 3 else 0  # noqa: E731  MLA's k_pe / kv_c: one head
        q_out_strides = (q.shape[1] * q.shape[2], q.shape[2]) if q_out is None else q_out.stride()[:2]
        k_out_strides = (math.prod(k.shape[1:]), k.shape[-1] if k.ndim == 3 else 0) if k_out is None else (
            k_out.stride(0), head(k_out))
        strides = (q.stride(0), q.stride(1), k.stride(0), head(k), v.stride(0), head(v), *q_out_strides,
                   *k_out_strides, kp.stride(0), kp.stride(1), kp.stride(2), vp.stride(0), vp.stride(1),
                   vp.stride(2), 0 if table is None else table.stride(0))
        offsets = ((kp.storage_offset() - k_pool.storage_offset()) * k_pool.element_size(),
                   (vp.storage_offset() - v_pool.storage_offset()) * v_pool.element_size())
        key = (strides, offsets, geom.pool_size)
        launch = self._bound.get(key)
        if launch is None:
            launch = self._bound[key] = _Launch(self, dict(zip(_STRIDES, strides)), offsets, geom.pool_size)
        return launch


class _Launch:
    """The compiled variants of one launcher for one layout, and the direct launch."""

    def __init__(self, launcher: Launcher, strides: dict, offsets: tuple, pool_size: int):
        self.launcher, self.offsets, self.pool_size = launcher, offsets, pool_size
        self.constexprs = tuple({n: {**f, **strides}[n] for n in _CONSTEXPRS} for f in launcher.features)
        self.tails = tuple((*launcher.scalars, *c.values()) for c in self.constexprs)
        self.kernels: dict = {}

    def __call__(self, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, use_long, extras):
        T = q.shape[0]
        if not T:
            return
        ln = self.launcher
        variant = 0 if T <= ln.small_tokens else 1
        split = ln.split if variant == 0 else 1
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                k_pool.data_ptr() + self.offsets[0], v_pool.data_ptr() + self.offsets[1], q_out.data_ptr(),
                k_out.data_ptr(), *(None if x is None else x.data_ptr() for x in (extras[0], extras[1], use_long)),
                *(None if x is None else x.data_ptr() for x in extras[2:]))
        scalars = (self.pool_size, positions.stride(0) if positions.ndim == 2 else 0, ln.max_position)
        # Triton specialises on which pointers are 16-byte aligned: almost always all are.
        bits = 0
        for p in ptrs:
            bits |= p or 0
        align = True if bits % 16 == 0 else tuple(p is None or p % 16 == 0 for p in ptrs)
        dtypes = (q.dtype, k_pool.dtype, q_out.dtype, k_out.dtype, positions.dtype, slots.dtype)
        kernel = self.kernels.get((variant, align, dtypes))
        if kernel is not None:
            # What JITFunction.run does once it has found the compiled kernel.
            stream = torch._C._cuda_getCurrentRawStream(q.device.index)
            hooks = triton.knobs.runtime
            enter = hooks.launch_enter_hook
            args = (*ptrs, *scalars, *self.tails[variant])
            meta = kernel.launch_metadata((T, split, 1), stream, *args) if enter else None
            kernel.run(T, split, 1, stream, kernel.function, kernel.packed_metadata, meta, enter,
                       hooks.launch_exit_hook, *args)
            return
        # First launch of this variant (or the interpreter): through the JIT, with tensors.
        # The written layer as a tensor (the interpreter copies whole storages, so one element will do).
        pools = [p.as_strided((1,), (1,), p.storage_offset() + off // p.element_size()) if off else p
                 for p, off in zip((k_pool, v_pool), self.offsets)]
        kernel = rope_pool_kernel[(T, split, 1)](
            q, k, v, positions, slots, *pools, q_out, k_out, extras[0], extras[1], use_long, *extras[2:],
            *scalars, *ln.scalars, **self.constexprs[variant], num_warps=ln.warps)
        if not _INTERPRET and _fast_launch_ok(kernel):
            key = (tuple(self.constexprs[variant].values()), ln.warps, dtypes, align, self.pool_size >= 2**31,
                   tuple(x is None for x in (*extras, use_long)))
            self.kernels[(variant, align, dtypes)] = _KERNELS.setdefault(key, kernel)


def _fast_launch_ok(kernel) -> bool:
    """The direct launch is written for Triton's launcher of 3.4 and later (triton.knobs)."""
    return hasattr(triton, "knobs") and all(
        hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))


def _scale_tensors(device, *scales):
    """Scales the kernel reads through a pointer (a float beside a tensor becomes one), else None."""
    if not any(isinstance(s, torch.Tensor) for s in scales):
        return (None,) * len(scales)
    return tuple(s if isinstance(s, torch.Tensor) else torch.tensor([float(s)], dtype=torch.float32, device=device)
                 for s in scales)


class Prepared:
    """A Call's Launcher and the tensors its kernel reads besides the arrays."""

    def __init__(self, call, tuning):
        self.call, self.launcher = call, Launcher.for_call(call, tuning)
        self._extras: dict = {}

    def extras(self, device) -> tuple:
        """freqs, table, q_weight, k_weight, k_scale, v_scale, q_scale, k_out_scale (None where absent)."""
        got = self._extras.get(device)
        if got is None:
            call, rot = self.call, self.call.rotation
            qw, kw = (None, None) if call.norm is None else call.norm.weights
            freqs = device_array(rot.freqs, device) if rot.table is None and rot.rotary_dim else None
            got = self._extras[device] = (freqs, rot.table, qw, kw, *_scale_tensors(device, call.k_scale, call.v_scale),
                                          *_scale_tensors(device, call.q_scale), *_scale_tensors(device,
                                                                                                call.k_out_scale))
        return got

    def bind(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
        """The runner for calls laid out like these arrays (under torch.compile: one that calls the op)."""
        extras = self.extras(q.device)
        long_from = self.call.rotation.long_from if self.call.rotation.table is None else None
        contiguous = torch.contiguous_format
        if torch.compiler.is_compiling():
            launch, op_args = None, self.launcher.args()
        else:
            launch = self.launcher.bind(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out,
                                        self.call.rotation.table)

        def run(q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
            # empty_like costs half of new_empty(shape) on the host (no size argument to parse).
            if q_out is None:
                q_out = torch.empty_like(q, memory_format=contiguous)
            if k_out is None:
                k_out = torch.empty_like(k, memory_format=contiguous)
            use_long = positions.max() >= long_from if long_from is not None and q.shape[0] else None
            if launch is None:
                rope_pool_op(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, use_long, *extras, *op_args)
            else:
                launch(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, use_long, extras)
            return q_out, k_out, k_pool, v_pool

        return run


@torch.library.custom_op("ropepool::rope_pool", mutates_args=("q_out", "k_out", "k_pool", "v_pool"))
def rope_pool_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
                 use_long: Optional[torch.Tensor], freqs: Optional[torch.Tensor], table: Optional[torch.Tensor],
                 q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], q_scale: Optional[torch.Tensor],
                 k_out_scale: Optional[torch.Tensor], small: List[int], large: List[int], maxima: List[float],
                 ints: List[int], scalars: List[float], kv_layout: str) -> None:
    launcher = Launcher.from_args(small, large, maxima, ints, scalars, kv_layout)
    launch = launcher.bind(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, table)
    launch(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, use_long,
           (freqs, table, q_weight, k_weight, k_scale, v_scale, q_scale, k_out_scale))


@rope_pool_op.register_fake
def _(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, *rest):
    return None


def prepare(call, tuning) -> Prepared:
    return Prepared(call, tuning)
