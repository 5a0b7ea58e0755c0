"""The block-quantized stores as array math on torch tensors and MLX arrays: NVFP4 and MLX's affine format.

The same float32 steps, in the same order, as the engines' own writers
(``ropepool.reference.quant`` has the NumPy models and cites the sources), so
the bytes agree exactly. On MLX the affine format is ``mx.quantize`` itself.
Each function takes float32 rows ``[..., D]`` and returns the parts a pool
stores for them; the pool write is the backend's. ``ops`` is the framework's
adapter (``torch_arrays.TorchOps``, ``mlx_arrays.MlxOps``).
"""
from __future__ import annotations

from ..formats.nvfp4 import E2M1_MAX, NVFP4_BLOCK

# e2m1 rounds to 0, 0.5, 1, 1.5, 2, 3, 4, 6: the code is how many midpoints a magnitude passes. A tie goes to
# the even code: a midpoint with an odd code above it counts only once passed (>), one with an even code above
# it counts from the midpoint itself (>=). NaN passes none: code 0.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(x32, ops):
    """4-bit codes (uint8, sign in bit 3) of float32 ``x32``, nearest even, saturated at 6."""
    mag = ops.abs(x32)
    code = ops.zeros_u8(x32)
    for mid, inclusive in _MIDPOINTS:
        code = code + ops.u8((mag >= mid) if inclusive else (mag > mid))
    return code | (ops.u8(ops.signbit(x32)) << 3)


def nvfp4(x32, global_scale, ops):
    """FlashInfer's NVFP4 block quantization of float32 rows ``[..., D]``: ``(data uint8 [..., D // 2],
    block scales as e4m3 bits uint8 [..., D // 16])``. ``global_scale``: a float32 scalar array."""
    *lead, D = x32.shape
    blocks = x32.reshape(*lead, D // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = ops.absmax_last(blocks)
    live = amax > 0
    zero = ops.scalar(0.0, x32)
    sf_bits = ops.to_e4m3(ops.where(live, amax / (ops.scalar(E2M1_MAX, x32) * global_scale), zero))
    sf = ops.from_e4m3(sf_bits)
    out_scale = ops.where(live & (sf > 0), ops.scalar(1.0, x32) / (sf * global_scale), zero)
    codes = e2m1_codes(blocks * out_scale[..., None], ops).reshape(*lead, D)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), sf_bits


def affine_torch(x32, bits: int, group_size: int, dtype):
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


def torch_store(x32, store, global_scale, dtype, ops):
    """The arrays a block-quantized torch pool (its ``stores.Store``) stores for float32 rows ``x32`` (NVFP4:
    data and block scales as uint8 bits; affine: words as int32 bits, scales and biases in ``dtype``). ``ops``:
    ``TorchOps``."""
    if store.format == "nvfp4":
        return nvfp4(x32, global_scale.reshape(()), ops)
    return affine_torch(x32, store.bits, store.group, dtype)

