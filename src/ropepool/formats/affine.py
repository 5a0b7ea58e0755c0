"""MLX's affine 4/8-bit KV cache: ``mx.quantize``'s format, as mlx-lm's ``QuantizedKVCache`` keeps it.

A K (or V) cache is the tuple ``(words, scales, biases)``: uint32 ``[..., head_dim * bits // 32]`` (bits 4 or 8)
and two arrays of q's dtype ``[..., head_dim // group_size]`` (group 32, 64 or 128), each in the pool's layout.
docs/layouts.md draws the bytes.

The quantizer is ml-explore/mlx mlx/backend/cpu/quantized.cpp ``quantize``, commit 846d176: each group of
``group_size`` values gets a scale and a bias in float32 (the edge of larger magnitude is represented exactly),
then each value is ``rint((w - bias) / scale)`` clipped to ``[0, 2**bits - 1]``, and ``32 // bits`` of them
fill one uint32 word, element ``k`` at bit ``k * bits``. Scales and biases are stored in the row's dtype.

Here: the check of a cache's parts (``check``), the NumPy model (``oracle_rows``), the same steps on torch
(``torch_quantize``; on MLX the format is ``mx.quantize`` itself: ``rows``). The Triton
kernel's store is ``backends/triton_stores.py: affine_store``.
"""
from __future__ import annotations

import numpy as np

from ..core.dtypes import dtype_name, framework_of
from ..errors import RopePoolError
from .parts import dtype

NAME = "affine"
MEANS = ("mx.quantize's affine format (mlx-lm's quantized cache): bits-wide codes in uint32 words, a scale and "
         "a bias per group of group values")
PARTS = ("words", "scales", "biases")
GLOBAL_SCALE = False
BACKENDS = frozenset({".triton_op", ".torch_eager", ".mlx"})  # the rows that write it (backends/__init__.py)

AFFINE_BITS = (4, 8)  # the kv_bits mlx-lm's quantized cache is used with here
AFFINE_GROUP_SIZES = (32, 64, 128)  # the group sizes mx.quantize has


def check(names, pools, head_dim, q, fw) -> dict:
    """The store fields of two affine caches (``pools``: name -> parts), raising on a wrong part."""
    found = []
    for name, parts in pools.items():
        dtype(name, 0, parts[0], PARTS, "uint32")
        width = parts[0].shape[-1] if parts[0].ndim else 0
        bits = width * 32 // head_dim
        if width * 32 % head_dim or bits not in AFFINE_BITS:
            options = " or ".join(f"{head_dim * b // 32} (bits {b})" for b in AFFINE_BITS)
            raise RopePoolError(f"{name}[0] (words) must have a last dim of head_dim * bits // 32, {options}; got "
                                f"{width}. Fix: mlx-lm's kv_bits 4 or 8 (mx.quantize packs 32 // bits codes a "
                                "uint32 word).")
        for i in (1, 2):
            dtype(name, i, parts[i], PARTS, dtype_name(q))
            n = parts[i].shape[-1] if parts[i].ndim else 0
            group = head_dim // n if n else 0
            if group not in AFFINE_GROUP_SIZES or group * n != head_dim:
                raise RopePoolError(
                    f"{name}[{i}] ({PARTS[i]}) must have head_dim // group_size entries, group_size "
                    f"{', '.join(map(str, AFFINE_GROUP_SIZES))} (the ones mx.quantize has); got a last dim of {n} "
                    f"for head_dim {head_dim}. Fix: mlx-lm's kv_group_size 64: head_dim // 64 entries.")
        found.append((bits, group))
    if found[0] != found[1]:
        raise RopePoolError(f"{names[0]} and {names[1]} must be caches of one format; got (bits, group_size) "
                            f"{found[0]} and {found[1]}. Fix: quantize K and V alike.")
    bits, group = found[0]
    return dict(format=NAME, element=f"uint{bits}", qmax=float(2 ** bits - 1), bits=bits, group=group)


def affine_rows(x, bits: int, group_size: int):
    """The NumPy model: rows ``x [..., D]`` as ``(words uint32 [..., D * bits // 32], scales, biases)``, scales
    and biases ``[..., D // group_size]`` in x's dtype (as ``mx.quantize`` returns them)."""
    x = np.asarray(x)
    w = x.astype(np.float32)
    *lead, D = w.shape
    groups = w.reshape(*lead, D // group_size, group_size)
    n_bins = np.float32(2 ** bits - 1)
    w_max, w_min = groups.max(-1), groups.min(-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nonzero, edge / q0, scale).astype(np.float32)
    bias = np.where(nonzero, edge, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((groups - bias[..., None]) / scale[..., None]), 0, n_bins).astype(np.uint32)
    per_word = 32 // bits
    q = q.reshape(*lead, D // per_word, per_word)
    words = np.bitwise_or.reduce(q << (np.arange(per_word, dtype=np.uint32) * bits), axis=-1)
    return words.astype(np.uint32), scale.astype(x.dtype), bias.astype(x.dtype)


def oracle_rows(x, store):
    """The parts the cache stores for rows ``x [..., D]`` (in the row's dtype), NumPy."""
    return affine_rows(x, store.bits, store.group)


def torch_quantize(x32, bits: int, group_size: int, dtype):
    """``mx.quantize``'s affine format on torch: ``(words as int32 bits [..., D * bits // 32], scales, biases)``,
    scales and biases in ``dtype``. Words are int32 holding the uint32 bits (torch's uint32 has few ops)."""
    import torch

    *lead, D = x32.shape
    groups = x32.reshape(*lead, D // group_size, group_size)
    n_bins = float(2 ** bits - 1)
    w_max, w_min = groups.amax(-1), groups.amin(-1)
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=torch.tensor(1e-7, dtype=torch.float32))
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / q0, scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    q = torch.clamp(torch.round((groups - bias[..., None]) / scale[..., None]), 0, n_bins).to(torch.int64)
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64, device=x32.device) * bits
    words = (q.reshape(*lead, D // per_word, per_word) << shifts).sum(-1)  # disjoint bits: the sum is the or
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words, scale.to(dtype), bias.to(dtype)


def rows(x, store, scale, ops):
    """The parts the cache stores for rows ``x [..., D]`` (in the row's dtype), torch or MLX. On MLX,
    ``mx.quantize`` itself: mlx-lm's quantized cache stores exactly what it returns."""
    if framework_of(x) == "mlx":
        import mlx.core as mx

        parts = mx.quantize(x.reshape(-1, x.shape[-1]), group_size=store.group, bits=store.bits)
        return tuple(p.reshape(*x.shape[:-1], -1) for p in parts)
    return torch_quantize(x.float(), store.bits, store.group, x.dtype)
