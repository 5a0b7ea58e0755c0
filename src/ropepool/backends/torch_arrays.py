"""Torch's side of the array math: ``TorchOps``, and a plan's extras as torch tensors.

Every torch backend (torch_eager, torch_native, the Triton launcher) reads the
plan's extra arrays (``plan.Extras``) through ``extras`` here: frequencies
made once per device, float scales as float32 tensors.
"""
from __future__ import annotations

import numpy as np
import torch

from ..formats.e4m3 import E4M3_MAX
from . import arraymath


class TorchOps:
    """The one spelling, for torch, of every function the shared array math calls (``arraymath``, the formats;
    ``mlx_arrays.MlxOps`` is MLX's, with the same names and meanings).

    A class of static functions, passed as it is: nothing is made at import or per call, and torch.compile
    traces through it as through any module-level function (it cannot trace making a namespace of lambdas).
    """

    abs, cos, sin, rsqrt, where, clip, trunc = torch.abs, torch.cos, torch.sin, torch.rsqrt, torch.where, \
        torch.clamp, torch.trunc
    maximum, exp2, ceil, log2, signbit = torch.maximum, torch.exp2, torch.ceil, torch.log2, torch.signbit

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
        """A Rotation's NumPy array (frequencies, MRoPE rows) on ``like``'s device, made once."""
        return device_array(values, like.device)

    @staticmethod
    def scalar(value, like):
        """A float as a float32 scalar on ``like``'s device (the float32 steps of the engines' quantizers)."""
        return torch.tensor(value, dtype=torch.float32, device=like.device)

    @staticmethod
    def arange(n, like):
        return torch.arange(n, device=like.device)

    @staticmethod
    def u8(x):
        return x.to(torch.uint8)

    @staticmethod
    def zeros_u8(like):
        return torch.zeros(like.shape, dtype=torch.uint8, device=like.device)

    @staticmethod
    def to_e4m3(x):
        """float32 ``x`` rounded to e4m3 (nearest even), as its bits (uint8). Saturated first, as CUDA's
        ``__nv_fp8_e4m3`` (``__NV_SATFINITE``) and ``mx.to_fp8`` do: torch's cast gives NaN past 448."""
        return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    @staticmethod
    def from_e4m3(bits):
        return bits.view(torch.float8_e4m3fn).to(torch.float32)

    @staticmethod
    def bytes_of(x):
        """``x``'s bytes along its last axis, little-endian, as the CUDA kernels store them."""
        return x.contiguous().view(torch.uint8)


def _to_device(values, device):
    return torch.from_numpy(values).to(device)


def device_array(values, device) -> torch.Tensor:
    """A NumPy array of a Rotation (frequencies, MRoPE rows) on ``device``, made once
    (under torch.compile: a constant of the graph)."""
    if torch.compiler.is_compiling():
        return _to_device(values, device)
    return arraymath.constant(values, _to_device, device)


def as_tensor_scale(scale, like):
    """A float scale as a float32 tensor: PyTorch's CUDA kernels turn division by a Python
    number into a multiplication by its reciprocal (an fp8 step off, now and then)."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.full((), scale, dtype=torch.float32, device=like.device)


def _tensor(x, device):
    if x is None or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return device_array(x, device)
    return torch.tensor([float(x)], dtype=torch.float32, device=device)  # a float scale, as the kernel reads it


def extras(values, device):
    """``values`` (a ``plan.Extras``) as torch tensors on ``device``: NumPy frequencies made once, floats as
    one-element float32 tensors; tensors as they are."""
    return type(values)(*(_tensor(x, device) for x in values))
