"""Torch's side of the array math: ``TorchOps`` for ``arraymath``, and a plan's extras as torch tensors.

Every torch backend (torch_eager, torch_cpu, the Triton launcher) reads the
plan's extra arrays (``plan.Extras``) through ``extras`` here: frequencies
made once per device, float scales as float32 tensors.
"""
from __future__ import annotations

import numpy as np
import torch

from . import arraymath


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
