"""FlashInfer's NVFP4 KV cache: e2m1 codes two a byte and an e4m3 scale per block of 16, under a global scale.

A K (or V) cache is the tuple ``(data, block_scales)``: uint8 ``[..., head_dim // 2]`` and float8_e4m3fn
``[..., head_dim // 16]`` (MLX: uint8 holding e4m3), each in the pool's layout; ``k_scale`` / ``v_scale`` are
the global decode scales (a value is ``e2m1 * sf * global_scale``). docs/layouts.md draws the bytes.

The quantizer is FlashInfer's paged KV append, ``nvfp4_append_quantize_block`` in flashinfer-ai/flashinfer
include/flashinfer/page.cuh, commit fb28d72: each block of 16 values of a row gets ``sf = amax / (6 *
global_scale)``, stored as float8_e4m3fn (round to nearest even, saturated at 448); each value is multiplied by
``1 / (float(sf_e4m3) * global_scale)`` and rounded to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to
the even code, saturated at 6), sign in bit 3. Two values a byte, the even-indexed one in the low nibble.

Here: the check of a cache's parts (``check``), the NumPy model of the quantizer (``oracle_rows``, float32 steps:
bit-exact agreement needs them), the same steps as array math on torch tensors and MLX arrays (``rows``). The
Triton kernel's store is ``backends/triton_stores.py: nvfp4_store``.
"""
from __future__ import annotations

import numpy as np

from ..errors import RopePoolError
from .parts import dtype, last_dim

NAME = "nvfp4"
MEANS = ("FlashInfer's NVFP4: e2m1 codes two a byte and an e4m3 scale per block of 16, under the global decode "
         "scale (scale)")
PARTS = ("data", "block scales")
GLOBAL_SCALE = True  # k_scale / v_scale: the global decode scales
BACKENDS = frozenset({".triton_op", ".torch_eager", ".mlx"})  # the rows that write it (backends/__init__.py)

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # code 0..7: the magnitudes of e2m1
E4M3_MAX = 448.0


def check(names, pools, head_dim, q, fw) -> dict:
    """The store fields of two NVFP4 caches (``pools``: name -> parts), raising on a wrong part."""
    if head_dim % NVFP4_BLOCK:
        raise RopePoolError(f"NVFP4 quantizes blocks of {NVFP4_BLOCK} features; got head_dim {head_dim}. Fix: "
                            "use NVFP4 caches only for a head_dim that is a multiple of 16.")
    sf_dtype = "uint8" if fw == "mlx" else "float8_e4m3fn"  # MLX keeps e4m3 bits in uint8 (mx.to_fp8)
    for name, (data, sf) in pools.items():
        dtype(name, 0, data, PARTS, "uint8")
        last_dim(name, 0, data, PARTS, head_dim // 2, "two e2m1 codes a byte: head_dim // 2")
        dtype(name, 1, sf, PARTS, sf_dtype)
        last_dim(name, 1, sf, PARTS, head_dim // NVFP4_BLOCK,
                 "one e4m3 scale per block of 16 features (NVFP4 has no other block size): head_dim // 16")
    return dict(format=NAME, element="float4_e2m1", qmax=E2M1_MAX, bits=4, group=NVFP4_BLOCK)


# --- the NumPy model (the oracle's) ------------------------------------------------------------------------

def _f32(x):
    return np.asarray(x).astype(np.float32)


def e4m3(x):
    """float32 ``x >= 0`` to float8_e4m3fn, nearest even, saturated at 448 (CUDA's ``__nv_fp8_e4m3(float)``)."""
    import ml_dtypes

    return np.minimum(_f32(x), np.float32(E4M3_MAX)).astype(ml_dtypes.float8_e4m3fn)


def e2m1_codes(x):
    """The 4-bit e2m1 codes of float32 ``x``: nearest magnitude (ties to the even code, above 6: 6), sign bit 3.

    Computed from distances in float64 (exact for float32 inputs), not from thresholds: an independent
    model of the kernel's comparison ladder. NaN gives code 0 with its sign, as the kernel's ladder does."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.abs(x).astype(np.float64)
    dist = np.abs(mag[..., None] - E2M1_VALUES)
    best = dist.min(-1, keepdims=True)
    tied = dist == best
    # Among the nearest (one, or two at a tie), take the even code; beyond the last value, the last.
    even = tied & (np.arange(8) % 2 == 0)
    code = np.where(even.any(-1), even.argmax(-1), tied.argmax(-1))
    code = np.where(mag >= E2M1_MAX, 7, np.where(np.isnan(mag), 0, code))  # saturated (also where 6 is lost)
    return (code | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


def nvfp4_rows(x, global_scale):
    """FlashInfer's NVFP4 quantization of rows ``x [..., D]`` (D a multiple of 16).

    Returns ``(data uint8 [..., D // 2], block_scales float8_e4m3fn [..., D // 16])``."""
    x = _f32(x)
    *lead, D = x.shape
    blocks = x.reshape(*lead, D // NVFP4_BLOCK, NVFP4_BLOCK)
    gs = np.float32(global_scale)
    amax = np.abs(blocks).max(-1)
    live = amax > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        sf = e4m3(np.where(live, amax / (np.float32(E2M1_MAX) * gs), np.float32(0)))
        sf32 = sf.astype(np.float32)
        out_scale = np.where(live & (sf32 > 0), np.float32(1) / (sf32 * gs), np.float32(0)).astype(np.float32)
        codes = e2m1_codes(blocks * out_scale[..., None]).reshape(*lead, D)
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return data.astype(np.uint8), sf


def oracle_rows(x, store):
    """The parts the cache stores for rows ``x [..., D]`` (in the row's dtype), NumPy."""
    return nvfp4_rows(x, float(np.asarray(store.scale, dtype=np.float32).reshape(())))


# --- array math: torch tensors and MLX arrays ---------------------------------------------------------------

# e2m1 rounds to 0, 0.5, 1, 1.5, 2, 3, 4, 6: the code is how many midpoints a magnitude passes. A tie goes to
# the even code: a midpoint with an odd code above it counts only once passed (>), one with an even code above
# it counts from the midpoint itself (>=). NaN passes none: code 0.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes_of(x32, ops):
    """4-bit codes (uint8, sign in bit 3) of float32 ``x32``, nearest even, saturated at 6. ``ops``: the
    framework's adapter (``torch_arrays.TorchOps``, ``mlx_arrays.MlxOps``)."""
    mag = ops.abs(x32)
    code = ops.zeros_u8(x32)
    for mid, inclusive in _MIDPOINTS:
        code = code + ops.u8((mag >= mid) if inclusive else (mag > mid))
    return code | (ops.u8(ops.signbit(x32)) << 3)


def nvfp4(x32, global_scale, ops):
    """The quantizer on float32 rows ``[..., D]``: ``(data uint8 [..., D // 2], block scales as e4m3 bits uint8
    [..., D // 16])``. ``global_scale``: a float32 scalar array."""
    *lead, D = x32.shape
    blocks = x32.reshape(*lead, D // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = ops.absmax_last(blocks)
    live = amax > 0
    zero = ops.scalar(0.0, x32)
    sf_bits = ops.to_e4m3(ops.where(live, amax / (ops.scalar(E2M1_MAX, x32) * global_scale), zero))
    sf = ops.from_e4m3(sf_bits)
    out_scale = ops.where(live & (sf > 0), ops.scalar(1.0, x32) / (sf * global_scale), zero)
    codes = e2m1_codes_of(blocks * out_scale[..., None], ops).reshape(*lead, D)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), sf_bits


def rows(x, store, scale, ops):
    """The parts the cache stores for rows ``x [..., D]`` (in the row's dtype; ``scale``: the global scale, a
    float or a one-element array), as bits: data and block scales, uint8."""
    return nvfp4(ops.f32(x), scale if isinstance(scale, float) else scale.reshape(()), ops)
