"""The PyTorch path: the array math of ``arraymath`` on torch tensors, for any torch device.

It is the general CPU implementation (``torch_cpu`` takes the calls it covers,
in fewer passes) and the fallback where Triton is missing. On a
GPU the boolean mask of valid slots makes it synchronise with the device; the
Triton kernel does not. Pools are written in place through views.
"""
from __future__ import annotations

import torch

from ..dtypes import FP8_MAX, QMAX
from ..layout import page_and_row, paged_view
from . import arraymath, torch_cpu


class TorchOps:
    """What arraymath needs, spelled for torch."""

    cos, sin, rsqrt, where, clip, trunc = torch.cos, torch.sin, torch.rsqrt, torch.where, torch.clamp, torch.trunc

    @staticmethod
    def div(x, number):
        """IEEE division by a number (by a float, CUDA kernels multiply by its reciprocal)."""
        return x / as_tensor_scale(number, x)

    @staticmethod
    def absmax_last(x):
        return x.abs().amax(-1)

    @staticmethod
    def f32(x):
        return x.float()

    @staticmethod
    def cat(xs, axis):
        return torch.cat(xs, dim=axis)

    @staticmethod
    def stack(xs, axis):
        return torch.stack(xs, dim=axis)

    @staticmethod
    def take(x, idx, axis):
        return x.index_select(axis, idx.long())

    @staticmethod
    def take_along(x, idx, axis):
        return torch.gather(x, axis, idx.long())

    @staticmethod
    def all_last(x):
        return x.all(-1)

    @staticmethod
    def mean_last(x):
        return x.mean(-1, keepdim=True)

    @staticmethod
    def numel(x):
        return x.numel()

    @staticmethod
    def const(values, like):
        return device_array(values, like.device)


def _to_device(values, device):
    return torch.from_numpy(values).to(device)


def device_array(values, device) -> torch.Tensor:
    """A NumPy array of a Rotation (frequencies, MRoPE rows) on ``device``, made once
    (under torch.compile: a constant of the graph)."""
    if torch.compiler.is_compiling():
        return _to_device(values, device)
    return arraymath.constant(values, _to_device, device)


def rotation_freqs(rot, device):
    """A Rotation's frequencies on ``device``; None where it needs none (an engine's table, no RoPE)."""
    return device_array(rot.freqs, device) if rot.table is None and rot.rotary_dim else None


def as_tensor_scale(scale, like):
    """A float scale as a float32 tensor: PyTorch's CUDA kernels turn division by a Python
    number into a multiplication by its reciprocal (an fp8 step off, now and then)."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.full((), scale, dtype=torch.float32, device=like.device)


class Prepared:
    def __init__(self, call):
        self.call = call

    def bind(self, *arrays):
        if torch_cpu.covers(self.call, arrays):
            return torch_cpu.Fast(self.call, rotation_freqs(self.call.rotation, arrays[0].device), self.run,
                                  torch_cpu.strided(arrays)).run
        return self.run

    def run(self, q, k, v, positions, slots, k_pool, v_pool, q_out=None, k_out=None):
        call, rot, ops = self.call, self.call.rotation, TorchOps
        freqs = rotation_freqs(rot, q.device)
        cos, sin, ok = arraymath.cos_sin(rot, positions, freqs, rot.table, ops) if rot.rotary_dim else (None,) * 3
        # Weights are read, not differentiated: a Parameter must not make the cache a graph node.
        qw, kw = (None, None) if call.norm is None else (w if w is None else w.detach() for w in call.norm.weights)
        k3, v3 = (x if x.ndim == 3 else x[:, None] for x in (k, v))  # MLA: one latent head
        q_rot = _out(arraymath.rope_and_norm(q, cos, sin, rot, call.norm, qw, ops), q, q_out, call.q_fp8, call.q_scale)
        k32 = arraymath.rope_and_norm(k3, cos, sin, rot, call.norm, kw, ops)
        k_rot = _out(k32.view(k.shape), k, k_out, call.k_fp8, call.k_out_scale)
        k_rows = k32.to(k.dtype) if call.k_fp8 else k_rot.view(k3.shape)  # what the pool stores: k_rot in k's dtype
        # Out-of-range slots are masked, not only negative ones: on a GPU nothing
        # has checked them, and no input may write outside the pool.
        write = (slots >= 0) & (slots < call.pool_size)
        if ok is not None:
            write &= ok
        page, row = page_and_row(slots[write].long(), call.pool.page_size)
        for pool, rows, scale, cache in ((k_pool, k_rows, call.k_scale, call.k_scale_cache),
                                         (v_pool, v3, call.v_scale, call.v_scale_cache)):
            rows = rows[write]
            if cache is not None:  # per-token-head: each row's scale, where the pool keeps the row
                rows, s = arraymath.quantize_per_token_head(rows.float(), QMAX[call.fp8], call.fp8 == "int8", ops)
                paged_view(cache[..., None], call.pool).index_put_((page, row), s[..., None])
            elif call.fp8:
                rows = arraymath.quantize(rows.float(), as_tensor_scale(scale, q), FP8_MAX[call.fp8], ops)
            paged_view(pool, call.pool).index_put_((page, row), rows.to(pool.dtype))
        return q_rot, k_rot, k_pool, v_pool


def _out(x32, like, out, fp8, scale):
    """The output in ``like``'s dtype (or quantized to an fp8 ``out``), in ``out`` if given."""
    if fp8:
        y = arraymath.quantize(x32, as_tensor_scale(scale, like), FP8_MAX[fp8], TorchOps).to(out.dtype)
    else:
        y = x32.to(like.dtype)
    return y if out is None else out.copy_(y)


def prepare(call, tuning):
    return Prepared(call)
