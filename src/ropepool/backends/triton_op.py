"""Launcher of the fused Triton kernel, and its torch.library custom op.

Host cost matters as much as the kernel at decode sizes, so the launcher
works out a layout once per checked Call (strides, constexprs, frequency
table; see _Layout): the first call of a layout goes through Triton's JIT,
which compiles and returns the kernel; later calls hand the data pointers,
as ints, straight to the compiled kernel, skipping the JIT's per-argument
specialisation. Under torch.compile the call goes through
``torch.ops.ropepool.rope_pool``, which declares the pools and outputs as
mutated and has a fake implementation, so ``fullgraph=True`` traces it and
CUDA graphs capture it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton

from ..layout import paged_view
from ..validate import Call
from .torch_eager import FP8_MAX, freq_table
from .triton_kernel import _INTERPRET, rope_pool_kernel

_PLANS: dict = {}  # (layout key, alignment) -> compiled kernel


class _Rotation(NamedTuple):
    """What the kernel reads of a RopeSpec; the custom op rebuilds it from primitives."""

    freqs: torch.Tensor
    rotary_dim: int
    style: str
    attention_scaling: float
    long_from: Optional[int]


class _Layout(NamedTuple):
    """What a checked call fixes for the launcher, worked out once per Call.

    validate caches one Call per layout (the scalar arguments and every
    shape, stride, dtype and device), so a Call from its cache stands for one layout
    and the launcher keeps this in ``call.cache``; only the data pointers
    (and their alignment) change from call to call.
    """

    key: tuple  # with the pointers' alignment: what the compiled kernel depends on
    grid: tuple
    warps: int
    device: int
    k_off: int  # bytes from the pool tensor to the layer written
    v_off: int
    freqs: torch.Tensor
    freqs_ptr: int
    scalars: tuple  # pool_size, k_scale, v_scale, attention_scaling
    constexprs: dict  # in the kernel's signature order
    tail: tuple  # scalars and constexpr values: the launcher's arguments after the pointers
    longrope: bool
    scale_ptr: bool
    kernels: dict  # alignment key -> compiled kernel


def _p2(n: int) -> int:
    return triton.next_power_of_2(n) if n > 0 else 0


def _split(call) -> int:
    """Programs a token's heads are split over.

    At T <= 64 one program per token leaves most SMs idle and each program
    waits on a long row; splitting the heads over up to 8 programs took the
    H200's graph-replay time from 2.58 to 2.39-2.44 us (32/8, T = 16) and
    2.86 to 2.43 (64/8, T = 16). From T = 256 on it no longer helps
    (docs/benchmarks.md). The split must divide both head counts.
    """
    if call.num_tokens > 64:
        return 1
    return next(s for s in (8, 4, 2, 1) if call.num_kv_heads % s == 0 and call.num_qo_heads % s == 0)


# Swept on the H200 (1-16 warps, 1-4 tokens a program; docs/benchmarks.md):
# two warps a program win for every geometry and T.
NUM_WARPS = 2


def _layout(call: Call, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out) -> _Layout:
    spec = call.spec
    kp, vp = paged_view(k_pool, call), paged_view(v_pool, call)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
               kp.stride(0), kp.stride(1), kp.stride(2), vp.stride(0), vp.stride(1), vp.stride(2))
    fp8 = call.k_scale is not None
    # One tensor scale makes both pointers (a float beside it becomes a tensor).
    scale_ptr = fp8 and (isinstance(call.k_scale, torch.Tensor) or isinstance(call.v_scale, torch.Tensor))
    split = _split(call)
    hq, hkv = call.num_qo_heads // split, call.num_kv_heads // split
    c = dict(zip(("Q_ST", "Q_SH", "K_ST", "K_SH", "V_ST", "V_SH", "QO_ST", "QO_SH", "KO_ST", "KO_SH",
                  "KP_PAGE", "KP_ROW", "KP_SH", "VP_PAGE", "VP_ROW", "VP_SH"), strides))
    c.update(PAGE_SIZE=call.page_size, HQ=hq, HKV=hkv, D=call.head_dim, ROT=spec.rotary_dim,
             GPTJ=spec.style == "gptj", BHQ=_p2(hq), BHKV=_p2(hkv), BLOCK_HALF=_p2(spec.rotary_dim // 2),
             BLOCK_PASS=_p2(call.head_dim - spec.rotary_dim), BLOCK_D=_p2(call.head_dim),
             LONGROPE=spec.long_from is not None, FP8=fp8, FP8_MAX=FP8_MAX.get(k_pool.dtype, 0.0),
             SCALE_PTR=scale_ptr)
    c = {name: c[name] for name in rope_pool_kernel.arg_names if name in c}  # the launcher's order
    warps = NUM_WARPS
    # Besides the constexprs Triton specialises on the pointers' alignment
    # (part of the key per call) and on whether pool_size needs 64 bits.
    key = (tuple(c.values()), warps, q.dtype, q_out.dtype, k_pool.dtype, positions.dtype, slots.dtype,
           call.pool_size >= 2**31, q.device.index)
    freqs = spec.freqs if isinstance(spec, _Rotation) else freq_table(spec, q.device)
    scalars = (call.pool_size, float(call.k_scale) if fp8 and not scale_ptr else 1.0,
               float(call.v_scale) if fp8 and not scale_ptr else 1.0, spec.attention_scaling)
    return _Layout(key, (call.num_tokens, split, 1), warps, q.device.index,
                   kp.data_ptr() - k_pool.data_ptr(), vp.data_ptr() - v_pool.data_ptr(), freqs, freqs.data_ptr(),
                   scalars, c, (*scalars, *c.values()), c["LONGROPE"], scale_ptr, {})


def launch(call: Call, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out):
    if call.num_tokens == 0:
        return
    lay = call.cache.get("triton")
    if lay is None:
        lay = call.cache["triton"] = _layout(call, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
    use_long = (positions.max() >= call.spec.long_from) if lay.longrope else None
    k_scale = _as_tensor(call.k_scale, q) if lay.scale_ptr else None
    v_scale = _as_tensor(call.v_scale, q) if lay.scale_ptr else None
    # Pointers as ints: Triton's launcher then takes them as they are, with
    # no data_ptr() call and no driver query per pointer.
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            k_pool.data_ptr() + lay.k_off, v_pool.data_ptr() + lay.v_off, q_out.data_ptr(), k_out.data_ptr(),
            lay.freqs_ptr, None if use_long is None else use_long.data_ptr(),
            None if k_scale is None else k_scale.data_ptr(), None if v_scale is None else v_scale.data_ptr())
    # Triton specialises on which pointers are 16-byte aligned; almost always all are.
    bits = ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5] | ptrs[6] | ptrs[7] | ptrs[8]
    for p in ptrs[10:]:
        bits |= p or 0
    align = True if bits % 16 == 0 else tuple(p is None or p % 16 == 0 for p in ptrs)
    kernel = lay.kernels.get(align)
    if kernel is None:
        kernel = lay.kernels[align] = _PLANS.get((lay.key, align))
    if kernel is not None:
        # What JITFunction.run does once it has found the compiled kernel.
        stream = torch._C._cuda_getCurrentRawStream(lay.device)
        hooks = triton.knobs.runtime
        enter = hooks.launch_enter_hook
        meta = kernel.launch_metadata(lay.grid, stream, *ptrs, *lay.tail) if enter else None
        kernel.run(*lay.grid, stream, kernel.function, kernel.packed_metadata, meta,
                   enter, hooks.launch_exit_hook, *ptrs, *lay.tail)
        return
    # First call of this layout (or the interpreter): through the JIT, with tensors.
    kernel = rope_pool_kernel[lay.grid](
        q, k, v, positions, slots, paged_view(k_pool, call), paged_view(v_pool, call), q_out, k_out,
        lay.freqs, use_long, k_scale, v_scale, *lay.scalars, **lay.constexprs, num_warps=lay.warps)
    if not _INTERPRET and _fast_launch_ok(kernel):
        _PLANS[(lay.key, align)] = lay.kernels[align] = kernel


def _fast_launch_ok(kernel) -> bool:
    """The direct launch is written for Triton's launcher of 3.4 and later (triton.knobs)."""
    return hasattr(triton, "knobs") and all(
        hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))


# The custom op carries the call as primitives: the spec as its frequency
# table and the few numbers the kernel reads (see _Rotation).
@torch.library.custom_op("ropepool::rope_pool", mutates_args=("q_out", "k_out", "k_pool", "v_pool"))
def rope_pool_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, q_out: torch.Tensor,
                 k_out: torch.Tensor, freqs: torch.Tensor, rotary_dim: int, gptj: bool,
                 attention_scaling: float, long_from: int, layer: int, kv_layout: str,
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
    rot = _Rotation(freqs, rotary_dim, "gptj" if gptj else "neox", attention_scaling,
                    None if long_from < 0 else long_from)
    launch(_call_from(q, k_pool, rot, layer, kv_layout, k_scale, v_scale),
           q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)


@rope_pool_op.register_fake
def _(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, freqs, rotary_dim, gptj, attention_scaling,
      long_from, layer, kv_layout, k_scale, v_scale):
    return None


def _call_from(q, k_pool, rot, layer, kv_layout, k_scale, v_scale) -> Call:
    layer = None if layer < 0 else layer
    kv_layout = kv_layout or None
    shape = k_pool.shape[1:] if layer is not None else k_pool.shape
    if kv_layout is None:
        pages, page_size, heads = shape[0], 1, shape[1]
    elif kv_layout == "NHD":
        pages, page_size, heads = shape[0], shape[1], shape[2]
    else:
        pages, heads, page_size = shape[0], shape[1], shape[2]
    return Call("torch", q.shape[0], q.shape[2], q.shape[1], heads, rot, layer, kv_layout,
                page_size, pages * page_size, k_scale, v_scale)


def run(call: Call, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
    # empty_like costs half of new_empty(shape) on the host (no size argument to parse).
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format) if q_out is None else q_out
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format) if k_out is None else k_out
    if torch.compiler.is_compiling():
        spec = call.spec
        rope_pool_op(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, freq_table(spec, q.device),
                     spec.rotary_dim, spec.style == "gptj", spec.attention_scaling,
                     -1 if spec.long_from is None else spec.long_from, -1 if call.layer is None else call.layer, call.kv_layout or "",
                     _as_tensor(call.k_scale, q), _as_tensor(call.v_scale, q))
    else:
        launch(call, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
    return q_out, k_out, k_pool, v_pool


def _as_tensor(scale, like):
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor([float(scale)], dtype=torch.float32, device=like.device)
