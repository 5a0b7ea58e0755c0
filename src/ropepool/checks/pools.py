"""Checks of the KV pools of a call: rank and layout, shapes, dtypes (fp8), scales, distinct memory.

Part of validation (validate.py calls them in order); each raises before
anything is written, naming the argument and the fix.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..core.dtypes import FP8_DTYPES, FRAMEWORK_TYPES, MLX_FP8, dtype_name, framework_of, tracing
from ..core.layout import KV_LAYOUTS, TILED, PoolGeometry, pool_geometry, pool_rank
from ..errors import RopePoolError
from .arrays import as_float32, is_int, reshape_word, same_place, shape_of


def _pool_fix(fw, name, pool, heads, dim) -> str:
    shape = tuple(pool.shape)
    if pool.ndim == 4 and shape[0] == 1 and shape[2:] == (heads, dim):
        return f"squeeze the extra leading dim of size 1 ({name}[0]), or pass layer=0"
    if pool.ndim == 4:
        return (f"pass layer=<index> or index the layer dimension first ({name}[layer]) for a layer-stacked "
                "[num_layers, pool_size, num_kv_heads, head_dim] pool, or kv_layout='NHD'/'HND' for a paged pool")
    if pool.ndim == 2 and shape[1] == heads * dim:
        return f"reshape to [pool_size, num_kv_heads, head_dim]: {name}.{reshape_word(fw)}(-1, {heads}, {dim})"
    if pool.ndim == 5:
        return "pass layer=<index> and kv_layout='NHD' or 'HND' for a layer-stacked paged pool"
    return "pass a [pool_size, num_kv_heads, head_dim] pool"


def _each(names, describe) -> str:
    """'k_pool X and v_pool Y', or 'k_pool and v_pool X' when both are described alike."""
    said = [describe(n) for n in names]
    if len(names) == 2 and said[0] == said[1]:
        return f"{names[0]} and {names[1]} {said[0]}"
    return " and ".join(f"{n} {d}" for n, d in zip(names, said))


def check_pools(op, names, k_pool, v_pool, layer, kv_layout, heads, dim, v_dim, fw, headed=True) -> PoolGeometry:
    """Geometry of the pools (k_pool's; v_pool has the same but rows v_dim wide)."""
    if layer is not None and not is_int(layer):
        raise TypeError(f"layer must be an int; got {type(layer).__name__}. Fix: pass the layer index.")
    if kv_layout is not None and kv_layout not in KV_LAYOUTS:
        raise RopePoolError(f"kv_layout must be None, 'NHD', 'HND' or 'amx'; got {kv_layout!r}. "
                            "Fix: None for [pool_size, heads, dim], 'NHD' for [pages, page_size, heads, dim], "
                            "'HND' for [pages, heads, page_size, dim], 'amx' for vLLM's CPU AMX-packed cache.")
    if kv_layout in TILED and not headed:
        raise RopePoolError(f"kv_layout={kv_layout!r} is for rope_pool_fused's k and v pools; got it for {op}'s "
                            f"{' and '.join(dict.fromkeys(names))}. Fix: pass kv_layout='NHD' (or None).")
    want = pool_rank(kv_layout, layer, headed)
    pools = dict(zip(names, (k_pool, v_pool)))
    wrong = [n for n, pool in pools.items() if pool.ndim != want]
    if wrong:
        # Name every pool of the wrong rank (the fix is for the first one; a second of its shape needs the same).
        name, pool = wrong[0], pools[wrong[0]]
        got = _each(wrong, lambda n: f"of shape {shape_of(pools[n])} ({pools[n].ndim}-D)")
        likewise = f" (likewise {wrong[1]})" if len(wrong) == 2 else ""
        if kv_layout is None and layer is None and headed:
            raise RopePoolError(f"rope_pool_fused expects pool tensors to be 3-D; got {got}. "
                                f"Fix: {_pool_fix(fw, name, pool, heads, dim)}{likewise}.")
        where = "" if kv_layout is None else f" with kv_layout={kv_layout!r}"
        stacked = "" if layer is None else " with layer= (a leading layer dim)"
        if pool.ndim == want - 1 and layer is not None:
            fix = "drop layer= for a single-layer pool"
        elif pool.ndim == want - 1:
            fix = "drop kv_layout= for a flat pool"
        elif pool.ndim == want + 1 and layer is None:
            fix = "pass layer=<index> for a layer-stacked pool"
        else:
            fix = "pass the pool in the layout named"
        raise RopePoolError(f"{op} expects pool tensors to be {want}-D{where}{stacked}; got {got}. "
                            f"Fix: {fix}{likewise}.")
    k_geom = pool_geometry(k_pool.shape, layer, kv_layout, headed)
    v_geom = pool_geometry(v_pool.shape, layer, kv_layout, headed)
    k_bad = (k_geom.num_heads, k_geom.dim) != (heads, dim)
    v_bad = (v_geom.num_heads, v_geom.dim) != (heads, v_dim)
    if k_bad:  # k_pool's own heads or width first, as the seed checks them: a v_pool equally wrong is no mismatch
        expect = {None: "[pool_size, num_kv_heads, head_dim]", "NHD": "[num_pages, page_size, num_kv_heads, head_dim]",
                  "HND": "[num_pages, num_kv_heads, page_size, head_dim]",
                  "amx": "[num_pages, num_kv_heads, page_size, head_dim]"}[kv_layout]
        if not headed:
            expect = expect.replace("num_kv_heads, ", "").replace("head_dim", "rope_dim")
        also = ""
        if v_bad and headed:
            also = (" (v_pool too, of the same shape)" if shape_of(v_pool) == shape_of(k_pool) else
                    f" (v_pool's shape {shape_of(v_pool)} does not fit either)")
        raise RopePoolError(
            f"{names[0]} has incompatible shape {shape_of(k_pool)}: expected {expect} with num_kv_heads={heads}, "
            f"head_dim={dim}{also}. Fix: pass the pool of this layer's KV heads (or the matching kv_layout).")
    if v_bad or (k_geom.num_layers, k_geom.num_pages, k_geom.page_size) != \
            (v_geom.num_layers, v_geom.num_pages, v_geom.page_size):
        if headed:  # k_pool fits, so the shapes differ
            raise RopePoolError(f"v_pool shape must match k_pool shape, got v_pool {shape_of(v_pool)} vs k_pool "
                                f"{shape_of(k_pool)}. Fix: pass K and V pools of one cache.")
        raise RopePoolError(f"ckv_cache must have kpe_cache's slots and kv_lora_rank ({v_dim}) features; got "
                            f"ckv_cache {shape_of(v_pool)}, kpe_cache {shape_of(k_pool)}. Fix: pass the two column "
                            "views of one latent cache (cache[..., :kv_lora_rank], cache[..., kv_lora_rank:]).")
    if layer is not None:
        n = k_geom.num_layers
        if not -n <= layer < n:
            raise RopePoolError(f"layer must be in [{-n}, {n}) for a pool of {n} layers; got {layer}. "
                                "Fix: pass a layer index of this pool.")
        k_geom = pool_geometry(k_pool.shape, int(layer) % n, kv_layout, headed)
    if kv_layout in TILED:
        check_tiled(names, (k_pool, v_pool), k_geom, fw)
    return k_geom


def check_tiled(names, pools, geom: PoolGeometry, fw) -> None:
    """A tiled layout's pools (vLLM's CPU AMX cache): rows and features whole tiles, each (page, head) block
    one contiguous run (the tiles' address assumes it)."""
    tiles = TILED[geom.kv_layout]
    tt, td = (max(t[i] for t in tiles) for i in (0, 1))
    if geom.page_size % tt or geom.dim % td:
        raise RopePoolError(f"kv_layout={geom.kv_layout!r} stores tiles of {tiles[0][0]} x {tiles[0][1]} (keys) and "
                            f"{tiles[1][0]} x {tiles[1][1]} (values) tokens x features, so page_size must be a "
                            f"multiple of {tt} and head_dim of {td}; got page_size {geom.page_size}, head_dim "
                            f"{geom.dim}. Fix: pass a cache whose block size and head size are (vLLM picks isa 'amx' "
                            "for block sizes that are multiples of 32), or kv_layout='HND' for an unpacked one.")
    if fw != "torch":
        return  # MLX is refused by its backend row; NumPy's oracle addresses the bytes itself
    for name, pool in zip(names, pools):
        if pool.stride(-1) != 1 or pool.stride(-2) != geom.dim:
            raise RopePoolError(f"kv_layout={geom.kv_layout!r} needs each (page, head) block of {name} to be one "
                                f"contiguous page_size x head_dim run (strides [..., {geom.dim}, 1]); got strides "
                                f"{list(pool.stride())}. Fix: pass vLLM's cache half as it is (a view of "
                                "kv_cache.view(blocks, heads, 2 * block_size, head_size)), not a transpose or slice of "
                                "its last dims.")


def check_pool_dtypes(names, k_pool, v_pool, dt, fw, per_token_head=None) -> str | None:
    """The pools' quantized format (fp8, or int8 with per-token-head scales), or None when they hold q's dtype.

    ``per_token_head``: whether scale caches were given; None where the call cannot take them."""
    fp8_names = MLX_FP8 if fw == "mlx" else {n: n for n in FP8_DTYPES}
    if per_token_head:
        fp8_names = {**fp8_names, "int8": "int8"}
    pools = dict(zip(names, (k_pool, v_pool)))
    int8 = [n for n, pool in pools.items() if dtype_name(pool) == "int8"]
    if int8 and per_token_head is False:
        raise RopePoolError(f"an int8 pool needs per-token-head scales; got {_each(int8, lambda n: 'int8')} without "
                            "k_scale_cache/v_scale_cache. Fix: pass k_scale_cache= and v_scale_cache= (float32, "
                            "shaped like the pool without its last dim), or allocate the pool in q's dtype.")
    wrong = [n for n, pool in pools.items() if dtype_name(pool) != dt and dtype_name(pool) not in fp8_names]
    if wrong:
        fp8 = "uint8 (e4m3, as mx.to_fp8 stores it)" if fw == "mlx" else "float8_e4m3fn / float8_e5m2"
        raise RopePoolError(f"pool dtypes must match q/k/v dtype; got "
                            f"{_each(wrong, lambda n: dtype_name(pools[n]))}, q {dt}. Fix: allocate "
                            f"{' and '.join(wrong)} in q's dtype, or as {fp8} with scales.")
    if dtype_name(k_pool) != dtype_name(v_pool):
        raise RopePoolError(f"pool dtypes must match each other; got {names[0]} {dtype_name(k_pool)}, {names[1]} "
                            f"{dtype_name(v_pool)}. Fix: allocate both pools with one dtype.")
    return fp8_names.get(dtype_name(k_pool)) if dtype_name(k_pool) != dt else None


def check_pool_scales(names, scales, fp8, pool, q, per_head):
    if fp8 is None:
        given = [n for n, s in zip(names, scales) if s is not None]
        if given:
            raise RopePoolError(f"{'/'.join(names)} {'are' if len(names) > 1 else 'is'} for float8 pools; got "
                                f"{'/'.join(given)} with a {dtype_name(pool)} pool. Fix: drop the scales, or "
                                "allocate the pool as float8_e4m3fn / float8_e5m2.")
        return scales
    missing = [n for n, s in zip(names, scales) if s is None]
    if missing:
        raise RopePoolError(f"a {fp8} pool needs {' and '.join(n + '=' for n in names)} (stored value = value / "
                            f"scale); got no {' and '.join(missing)}. Fix: pass the cache's scales (1.0 if it "
                            "has none).")
    return tuple(check_scale(n, s, q, per_head) for n, s in zip(names, scales))


def check_scale(name, s, q, per_head):
    """A float > 0, or a float32 array of q's framework and device: one element, or [per_head]."""
    if isinstance(s, numbers.Real) and not isinstance(s, (bool, np.bool_)):  # NumPy scalars too
        if not (0 < float(s) < math.inf):
            raise RopePoolError(f"{name} must be a finite float > 0; got {s!r}. Fix: pass the cache's scale.")
        return float(s)
    shapes = ((), (1,)) + (((per_head,),) if per_head else ())
    if framework_of(s) is None or tuple(s.shape) not in shapes:
        given = type(s).__name__ if framework_of(s) is None else f"shape {shape_of(s)}"
        if per_head:
            raise TypeError(f"{name} must be a float, a one-element float32 tensor or one per KV head "
                            f"([{per_head}]); got {given}. Fix: pass float(scale) or a tensor of shape [1] or "
                            f"[{per_head}].")
        raise TypeError(f"{name} must be a float or a one-element float32 tensor; got {given}. "
                        "Fix: pass float(scale) or a tensor of shape [1].")
    same_place(name, s, q)
    if dtype_name(s) != "float32":
        raise RopePoolError(f"{name} as a tensor must be float32; got {dtype_name(s)}. "
                            f"Fix: {as_float32(framework_of(s), name)}.")
    # On the CPU the value costs no device sync: check it like a float's.
    if framework_of(s) == "numpy" or (framework_of(s) == "torch" and s.device.type == "cpu" and not tracing("torch")):
        vals = np.asarray(s, dtype=np.float64).reshape(-1)
        if not ((vals > 0) & (vals < math.inf)).all():
            raise RopePoolError(f"{name} must be a finite float > 0; got a tensor holding {vals.tolist()!r}. "
                                "Fix: pass the cache's scale.")
    return s


def check_scale_caches(names, caches, fmt, pools, q, scales, fw):
    """Per-token-head scale caches (vLLM's int8/fp8_per_token_head): float32, each shaped like its pool
    without the last dim, on q's device; only with quantized pools and without static scales."""
    given = [n for n, c in zip(names, caches) if c is not None]
    if len(given) == 1:
        raise RopePoolError(f"per-token-head scales need both {' and '.join(names)}; got only {given[0]}. "
                            "Fix: pass both (one float32 scale per slot and KV head for each pool).")
    static = [n for n, s in zip(("k_scale", "v_scale"), scales) if s is not None]
    if static:
        raise RopePoolError(f"{'/'.join(static)} cannot be combined with {'/'.join(names)}; got both. Fix: drop "
                            f"{'/'.join(static)} (per-token-head pools compute each row's scale).")
    if fmt is None:
        raise RopePoolError(f"{'/'.join(names)} are for int8 or float8 pools; got them with a "
                            f"{dtype_name(pools[0])} pool. Fix: drop them, or allocate the pools as int8 / "
                            "float8_e4m3fn / float8_e5m2.")
    for name, cache, pool in zip(names, caches, pools):
        want = shape_of(pool)[:-1]
        if framework_of(cache) != fw:
            raise TypeError(f"{name} must be a float32 {FRAMEWORK_TYPES[fw]} of shape {want} ({name[0]}_pool's "
                            f"shape without its last dim); got {type(cache).__name__}. Fix: torch.empty({want}, "
                            "dtype=torch.float32, device=q.device).")
        same_place(name, cache, q)
        if shape_of(cache) != want:
            raise RopePoolError(f"{name} must have {name[0]}_pool's shape without its last dim, {want}; got "
                                f"{shape_of(cache)}. Fix: one scale per slot and KV head, laid out like the pool "
                                "(vLLM: [num_blocks, block_size, num_kv_heads]; transpose(1, 2) of it for HND).")
        if dtype_name(cache) != "float32":
            raise RopePoolError(f"{name} must be float32; got {dtype_name(cache)}. Fix: allocate it as float32 "
                                "(vLLM's scale caches are float32).")
    if fw == "torch":
        check_distinct_pools(names, *caches)
    return caches


def check_distinct_pools(names, a, b):
    # Meta tensors have no memory (data_ptr() is 0 for all of them); fakes under torch.compile neither.
    if not tracing("torch") and a.numel() and a.device.type != "meta" and a.data_ptr() == b.data_ptr():
        raise RopePoolError(f"{names[0]} and {names[1]} are the same memory. Fix: pass two pools "
                            "(for a combined [2, ...] tensor pass kv[0] and kv[1]).")
