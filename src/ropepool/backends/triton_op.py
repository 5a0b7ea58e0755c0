"""Launcher of the fused Triton kernel, and its torch.library custom op.

Eager calls launch the kernel directly (the dispatcher adds host latency);
under torch.compile the call goes through ``torch.ops.ropepool.rope_pool``,
which declares the pools and outputs as mutated and has a fake
implementation, so ``fullgraph=True`` traces it and CUDA graphs capture it.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ..layout import paged_view
from ..validate import Call
from .torch_eager import FP8_MAX, freq_table
from .triton_kernel import rope_pool_kernel

# Elements per head-block tile: keeps registers in check at 64 heads x D=256.
_TILE = 2048


def _p2(n: int) -> int:
    return triton.next_power_of_2(n) if n > 0 else 0


def _heads_per_block(heads: int, width: int) -> int:
    return max(1, min(_p2(heads), _TILE // max(width, 1)))


def launch(call: Call, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out):
    spec = call.spec
    T, D = call.num_tokens, call.head_dim
    if T == 0:
        return
    freqs = freq_table(spec, q.device)
    use_long = (positions.max() >= spec.long_from) if spec.long_from is not None else None
    kp, vp = paged_view(k_pool, call), paged_view(v_pool, call)
    fp8 = call.k_scale is not None
    scale_ptr = fp8 and isinstance(call.k_scale, torch.Tensor)
    half_block = _p2(spec.rotary_dim // 2)
    rope_pool_kernel[(T,)](
        q, k, v, positions, slots, kp, vp, q_out, k_out, freqs, use_long,
        call.k_scale if scale_ptr else None, call.v_scale if scale_ptr else None,
        call.pool_size, call.page_size,
        float(call.k_scale) if fp8 and not scale_ptr else 1.0,
        float(call.v_scale) if fp8 and not scale_ptr else 1.0,
        spec.attention_scaling,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        kp.stride(0), kp.stride(1), kp.stride(2), vp.stride(0), vp.stride(1), vp.stride(2),
        HQ=call.num_qo_heads, HKV=call.num_kv_heads, D=D, ROT=spec.rotary_dim, GPTJ=spec.style == "gptj",
        BHQ=_heads_per_block(call.num_qo_heads, half_block),
        BHKV=_heads_per_block(call.num_kv_heads, half_block),
        BHV=_heads_per_block(call.num_kv_heads, _p2(D)),
        BLOCK_HALF=half_block, BLOCK_PASS=_p2(D - spec.rotary_dim), BLOCK_D=_p2(D),
        LONGROPE=use_long is not None, FP8=fp8, FP8_MAX=FP8_MAX.get(k_pool.dtype, 0.0), SCALE_PTR=scale_ptr,
        num_warps=4,
    )


# The custom op carries the call as primitives; the spec travels by id.
_SPECS: dict = {}


@torch.library.custom_op("ropepool::rope_pool", mutates_args=("q_out", "k_out", "k_pool", "v_pool"))
def rope_pool_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, q_out: torch.Tensor,
                 k_out: torch.Tensor, spec_id: int, layer: int, kv_layout: str,
                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
    launch(_call_from(q, k_pool, spec_id, layer, kv_layout, k_scale, v_scale),
           q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)


@rope_pool_op.register_fake
def _(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, spec_id, layer, kv_layout, k_scale, v_scale):
    return None


def _call_from(q, k_pool, spec_id, layer, kv_layout, k_scale, v_scale) -> Call:
    spec = _SPECS[spec_id]
    layer = None if layer < 0 else layer
    kv_layout = kv_layout or None
    shape = k_pool.shape[1:] if layer is not None else k_pool.shape
    if kv_layout is None:
        pages, page_size, heads = shape[0], 1, shape[1]
    elif kv_layout == "NHD":
        pages, page_size, heads = shape[0], shape[1], shape[2]
    else:
        pages, heads, page_size = shape[0], shape[1], shape[2]
    return Call("torch", q.shape[0], q.shape[2], q.shape[1], heads, spec, layer, kv_layout,
                page_size, pages * page_size, k_scale, v_scale)


def run(call: Call, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    if torch.compiler.is_compiling():
        spec_id = _SPECS.setdefault(id(call.spec), call.spec) and id(call.spec)
        rope_pool_op(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, spec_id,
                     -1 if call.layer is None else call.layer, call.kv_layout or "",
                     _as_tensor(call.k_scale, q), _as_tensor(call.v_scale, q))
    else:
        launch(call, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
    return q_out, k_out, k_pool, v_pool


def _as_tensor(scale, like):
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor([float(scale)], dtype=torch.float32, device=like.device)
