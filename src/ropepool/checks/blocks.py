"""Checks of block-quantized pools (each cache a tuple of arrays): what every such format shares.

A block-quantized K (or V) cache is passed as the tuple of arrays the engine
keeps; each format's module (formats/: nvfp4, affine) says what its arrays
hold and checks them. Every part has the pool's layout (flat, NHD, HND,
``layer=``) and differs only in its last dim. ``check_block_pools`` raises
before anything is written, naming the part, and returns the two pools'
``stores.Store``.
"""
from __future__ import annotations

from ..core.dtypes import FRAMEWORK_TYPES, framework_of
from ..core.stores import Store
from ..errors import RopePoolError
from ..formats import BLOCK_BY_PARTS
from .arrays import same_place, shape_of
from .pools import check_pool_scales


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
        if len(parts) not in BLOCK_BY_PARTS:
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
    fmt = BLOCK_BY_PARTS[len(k_pool)]
    fields = fmt.check(names, pools, head_dim, q, fw)
    for name, parts in pools.items():
        for i, part in enumerate(parts[1:], 1):
            if shape_of(part)[:-1] != shape_of(parts[0])[:-1]:
                raise RopePoolError(f"{name}[{i}] ({fmt.PARTS[i]}) must have {name}[0]'s shape but its last "
                                    f"dim, {shape_of(parts[0])[:-1]}; got {shape_of(part)}. Fix: allocate every array "
                                    "of a cache in the same layout.")
    scales = check_pool_scales(("k_scale", "v_scale"), scales, fmt.NAME if fmt.GLOBAL_SCALE else None, k_pool[0], q,
                               None)
    return tuple(Store(scale=s, **fields) for s in scales)
