"""MLX's side of the array math: ``MlxOps``, and a plan's extras as MLX arrays.

It imports MLX and never torch: the MLX path runs where torch is not
installed (tests/test_torch_free.py).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import arraymath


class MlxOps:
    """The one spelling, for MLX, of what the shared array math calls on MLX arrays (``arraymath``,
    the formats): the names and meanings of ``torch_arrays.TorchOps``, less the functions
    only torch's stores call (per-token-head scales: ``div``, ``trunc``; the byte offsets of ``put``:
    ``arange``).

    A class of static functions, passed as it is: nothing is made at import or per call, and mx.compile
    traces through it as through any function.
    """

    abs, cos, sin, rsqrt, where, clip = mx.abs, mx.cos, mx.sin, mx.rsqrt, mx.where, mx.clip
    maximum, ceil, log2 = mx.maximum, mx.ceil, mx.log2
    to_e4m3 = mx.to_fp8  # nearest even, saturated at 448 (checked against ml_dtypes in the tests)

    @staticmethod
    def exp2(x):
        return mx.power(mx.array(2.0, dtype=mx.float32), x)

    @staticmethod
    def signbit(x):
        return (mx.view(x, mx.uint32) >> 31) == 1

    @staticmethod
    def absmax_last(x):
        return mx.max(mx.abs(x), axis=-1)

    @staticmethod
    def f32(x):
        return x.astype(mx.float32)

    @staticmethod
    def cat(xs, axis):
        return mx.concatenate(xs, axis=axis)

    @staticmethod
    def stack(xs, axis):
        return mx.stack(xs, axis=axis)

    @staticmethod
    def take(x, idx, axis):
        return mx.take(x, idx, axis=axis)

    @staticmethod
    def take_along(x, idx, axis):
        return mx.take_along_axis(x, idx, axis=axis)

    @staticmethod
    def all_last(x):
        return mx.all(x, axis=-1)

    @staticmethod
    def mean_last(x):
        return mx.mean(x, axis=-1, keepdims=True)

    @staticmethod
    def numel(x):
        return x.size

    @staticmethod
    def const(values, like):
        """A Rotation's NumPy array (frequencies, MRoPE rows) as an MLX array, made once."""
        return device_array(values)

    @staticmethod
    def scalar(value, like):
        return mx.array(value, dtype=mx.float32)

    @staticmethod
    def u8(x):
        return x.astype(mx.uint8)

    @staticmethod
    def zeros_u8(like):
        return mx.zeros(like.shape, dtype=mx.uint8)

    @staticmethod
    def from_e4m3(bits):
        return mx.from_fp8(bits, dtype=mx.float32)

    @staticmethod
    def bytes_of(x):
        return mx.view(x, mx.uint8)


def device_array(values) -> mx.array:
    """A NumPy array of a Rotation (frequencies, MRoPE rows) as an MLX array, made once."""
    return arraymath.constant(values, mx.array)


def extras(values):
    """``values`` (a core/args.Extras) as MLX arrays: NumPy frequencies made once; floats and arrays as they
    are (a float scale is a constant of the traced graph, keyed by ``plan.Plan.key``)."""
    return type(values)(*(device_array(x) if isinstance(x, np.ndarray) else x for x in values))
