"""Checks of block-quantized pools: NVFP4 and MLX's affine 4/8-bit format, each cache a tuple of arrays.

A block-quantized K (or V) cache is passed as the tuple of arrays the engine
keeps (docs/layouts.md shows their bytes):

- NVFP4 (FlashInfer): ``(data, block_scales)``: uint8 ``[..., head_dim // 2]``
  and float8_e4m3fn ``[..., head_dim // 16]`` (MLX: uint8 holding e4m3), with
  the global decode scales as ``k_scale`` / ``v_scale``;
- affine (``mx.quantize``, mlx-lm's ``QuantizedKVCache``): ``(words, scales,
  biases)``: uint32 ``[..., head_dim * bits // 32]`` (bits 4 or 8) and two
  arrays of q's dtype ``[..., head_dim // group_size]`` (group 32, 64 or 128).

Every part has the pool's layout (flat, NHD, HND, ``layer=``) and differs
only in its last dim. ``check_block_pools`` raises before anything is
written, naming the part, and returns the two pools' ``stores.Store``.
"""
from __future__ import annotations

from ..core.dtypes import FRAMEWORK_TYPES, dtype_name, framework_of
from ..core.stores import Store
from ..errors import RopePoolError
from ..formats.affine import AFFINE_BITS, AFFINE_GROUP_SIZES
from ..formats.nvfp4 import E2M1_MAX, NVFP4_BLOCK
from .arrays import same_place, shape_of
from .pools import check_pool_scales

PARTS = {"nvfp4": ("data", "block scales"), "affine": ("words", "scales", "biases")}


def is_block_pool(pool) -> bool:
    return isinstance(pool, tuple)


def first_array(pool):
    """A block-quantized pool's first array (what type and device checks read), any other pool itself."""
    return pool[0] if is_block_pool(pool) and pool else pool


def parts_layout(k_pool, v_pool) -> tuple:
    """What the layout cache keys of two tuple pools besides their first arrays (which it guards): each
    array's type, dtype, shape and (torch) strides and device. Equal for calls whose full checks agree."""
    def one(x):
        return (type(x), str(getattr(x, "dtype", None)), tuple(getattr(x, "shape", ())),
                x.stride() if hasattr(x, "stride") else None, str(getattr(x, "device", None)))

    return tuple(tuple(one(x) for x in p) if is_block_pool(p) else None for p in (k_pool, v_pool))


def check_block_pools(names, k_pool, v_pool, head_dim, q, fw, scales) -> tuple:
    """The stores of two tuple pools (raising on any misuse); ``scales``: k_scale, v_scale (NVFP4's global ones)."""
    pools = dict(zip(names, (k_pool, v_pool)))
    plain = [n for n, p in pools.items() if not is_block_pool(p)]
    if plain:
        raise RopePoolError(f"{names[0]} and {names[1]} must both be tuples (a block-quantized cache) or both "
                            f"arrays; got {plain[0]} as {type(pools[plain[0]]).__name__}. Fix: pass each cache as "
                            "(data, block_scales) for NVFP4 or (words, scales, biases) for the affine format.")
    for name, parts in pools.items():
        if len(parts) not in (2, 3):
            raise RopePoolError(f"{name} as a tuple must hold (data, block_scales) for NVFP4 or (words, scales, "
                                f"biases) for the affine format; got {len(parts)} arrays. Fix: pass the cache's "
                                "arrays in that order (docs/layouts.md).")
        for i, part in enumerate(parts):
            if framework_of(part) != fw:
                raise TypeError(f"{name}[{i}] must be a {FRAMEWORK_TYPES[fw]} like q; got {type(part).__name__}. "
                                "Fix: pass the cache's arrays.")
            same_place(f"{name}[{i}]", part, q)
    if len(k_pool) != len(v_pool):
        raise RopePoolError(f"{names[0]} and {names[1]} must be caches of one format; got {len(k_pool)} and "
                            f"{len(v_pool)} arrays. Fix: quantize K and V alike.")
    fmt = _nvfp4(names, pools, head_dim, fw) if len(k_pool) == 2 else _affine(names, pools, head_dim, q)
    for name, parts in pools.items():
        for i, part in enumerate(parts[1:], 1):
            if shape_of(part)[:-1] != shape_of(parts[0])[:-1]:
                raise RopePoolError(f"{name}[{i}] ({PARTS[fmt['format']][i]}) must have {name}[0]'s shape but its last "
                                    f"dim, {shape_of(parts[0])[:-1]}; got {shape_of(part)}. Fix: allocate every array "
                                    "of a cache in the same layout.")
    scales = check_pool_scales(("k_scale", "v_scale"), scales, "nvfp4" if fmt["format"] == "nvfp4" else None,
                                k_pool[0], q, None)
    return tuple(Store(scale=s, **fmt) for s in scales)


def _last(name, i, part, fmt, want, fix):
    if part.ndim == 0 or part.shape[-1] != want:
        got = part.shape[-1] if part.ndim else "a scalar"
        raise RopePoolError(f"{name}[{i}] ({PARTS[fmt][i]}) must have a last dim of {want}; got {got}. Fix: {fix}.")


def _dtype(name, i, part, fmt, want):
    if dtype_name(part) != want:
        raise RopePoolError(f"{name}[{i}] ({PARTS[fmt][i]}) must have dtype {want}; got {dtype_name(part)}. "
                            f"Fix: allocate it as {want} (docs/layouts.md).")


def _nvfp4(names, pools, head_dim, fw) -> dict:
    if head_dim % NVFP4_BLOCK:
        raise RopePoolError(f"NVFP4 quantizes blocks of {NVFP4_BLOCK} features; got head_dim {head_dim}. Fix: "
                            "use NVFP4 caches only for a head_dim that is a multiple of 16.")
    sf_dtype = "uint8" if fw == "mlx" else "float8_e4m3fn"  # MLX keeps e4m3 bits in uint8 (mx.to_fp8)
    for name, (data, sf) in pools.items():
        _dtype(name, 0, data, "nvfp4", "uint8")
        _last(name, 0, data, "nvfp4", head_dim // 2, "two e2m1 codes a byte: head_dim // 2")
        _dtype(name, 1, sf, "nvfp4", sf_dtype)
        _last(name, 1, sf, "nvfp4", head_dim // NVFP4_BLOCK,
              "one e4m3 scale per block of 16 features (NVFP4 has no other block size): head_dim // 16")
    return dict(format="nvfp4", element="float4_e2m1", qmax=E2M1_MAX, bits=4, group=NVFP4_BLOCK)


def _affine(names, pools, head_dim, q) -> dict:
    found = []
    for name, parts in pools.items():
        _dtype(name, 0, parts[0], "affine", "uint32")
        width = parts[0].shape[-1] if parts[0].ndim else 0
        bits = width * 32 // head_dim
        if width * 32 % head_dim or bits not in AFFINE_BITS:
            options = " or ".join(f"{head_dim * b // 32} (bits {b})" for b in AFFINE_BITS)
            raise RopePoolError(f"{name}[0] (words) must have a last dim of head_dim * bits // 32, {options}; got "
                                f"{width}. Fix: mlx-lm's kv_bits 4 or 8 (mx.quantize packs 32 // bits codes a "
                                "uint32 word).")
        for i in (1, 2):
            _dtype(name, i, parts[i], "affine", dtype_name(q))
            n = parts[i].shape[-1] if parts[i].ndim else 0
            group = head_dim // n if n else 0
            if group not in AFFINE_GROUP_SIZES or group * n != head_dim:
                raise RopePoolError(
                    f"{name}[{i}] ({PARTS['affine'][i]}) must have head_dim // group_size entries, group_size "
                    f"{', '.join(map(str, AFFINE_GROUP_SIZES))} (the ones mx.quantize has); got a last dim of {n} "
                    f"for head_dim {head_dim}. Fix: mlx-lm's kv_group_size 64: head_dim // 64 entries.")
        found.append((bits, group))
    if found[0] != found[1]:
        raise RopePoolError(f"{names[0]} and {names[1]} must be caches of one format; got (bits, group_size) "
                            f"{found[0]} and {found[1]}. Fix: quantize K and V alike.")
    bits, group = found[0]
    return dict(format="affine", element=f"uint{bits}", qmax=float(2 ** bits - 1), bits=bits, group=group)
