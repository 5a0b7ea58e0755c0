"""Every check of a call, for every framework, returning a frozen description of it.

``check`` (rope_pool_fused) and ``check_latent`` (rope_latent_fused) run
before any backend touches memory and return a ``Call``: the framework, the
dtypes, the geometry (``layout.pool_geometry``), the rotation record
(``spec.Rotation``), the norm and the scales. Nothing here imports a
framework it is not handed. Messages start with the seed's words where the
seed has a message for the same condition, then say what was given and the
fix. docs/errors.md lists each one; tests/test_errors.py keeps the two in step.
"""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .dtypes import FLOAT_DTYPES, FP8_DTYPES, FRAMEWORK_TYPES, INDEX_DTYPES, MLX_FP8, dtype_name, framework_of, tracing
from .errors import RopePoolError
from .layout import KV_LAYOUTS, PoolGeometry, pool_geometry, pool_rank
from .norm import QKNorm
from .spec import CosSinCache, RopeSpec, Rotation

_ARRAYS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")
_LATENT_ARRAYS = ("q_pe", "k_pe", "kv_c", "positions", "slots", "ckv_cache", "kpe_cache")
_PRECISE_POSITIONS = 2**24  # float32 holds every integer up to here: the precision promise's end


@dataclass(frozen=True, eq=False)
class Call:
    """A checked call: everything a backend needs besides the arrays (independent of num_tokens)."""

    framework: str
    dtype: str  # of q, k and v
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int  # of q and k
    v_head_dim: int  # of v; MLA's latent width
    pool: PoolGeometry  # of k_pool; v_pool's rows are v_head_dim wide
    pool_dtype: str
    fp8: str | None  # the pools' fp8 format, if they are fp8
    rotation: Rotation
    position_rows: int  # 3 for [3, num_tokens] MRoPE positions
    norm: QKNorm | None
    k_scale: object  # None, a float, or an array of one element or [num_kv_heads]
    v_scale: object
    q_fp8: str | None  # fp8 q_out: its format, and q_scale
    q_scale: object
    k_fp8: str | None
    k_out_scale: object
    host_values: bool  # slot and position values are checked on every call (no device sync)
    latent: bool = False  # rope_latent_fused: k_pe may be [T, rope_dim]

    @property
    def pool_size(self) -> int:
        return self.pool.pool_size


@lru_cache(maxsize=64)
def default_spec(head_dim: int, rope_base: float) -> RopeSpec:
    return RopeSpec(head_dim=head_dim, base=rope_base)


def _shape(x) -> list:
    return list(x.shape)


def check(q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads, num_kv_heads, rope_base=10000.0,
          rope=None, layer=None, k_scale=None, v_scale=None, kv_layout=None, q_out=None, k_out=None, qk_norm=None,
          q_scale=None, k_out_scale=None, frameworks=("torch", "mlx")) -> Call:
    """Check a rope_pool_fused call in full (raising on bad input) and describe it."""
    op = "rope_pool_fused"
    fw = _check_types(op, _ARRAYS, (q, k, v, positions, slots, k_pool, v_pool), frameworks)
    if fw == "torch":
        _check_devices(op, ("q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_out", "k_out"),
                       (q, k, v, positions, slots, k_pool, v_pool, q_out, k_out))
    head_dim, num_qo_heads, num_kv_heads = _ints(head_dim=head_dim, num_qo_heads=num_qo_heads,
                                                 num_kv_heads=num_kv_heads)
    if head_dim % 2:
        raise RopePoolError(f"head_dim must be even (RoPE rotates pairs); got {head_dim}. "
                            "Fix: pass the model's head_dim.")
    rotation = _resolve_rope(rope, rope_base, head_dim, q)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise RopePoolError(
            f"rope_pool_fused expects q/k/v to be 3-D; got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}. "
            f"Fix: reshape to [num_tokens, num_heads, head_dim], e.g. q.{_reshape(fw)}(num_tokens, num_qo_heads, "
            "head_dim).")
    T = q.shape[0]
    rows = _check_positions(op, positions, slots, T, rotation)
    if tuple(q.shape) != (T, num_qo_heads, head_dim):
        raise RopePoolError(
            f"q shape must be [num_tokens, num_qo_heads, head_dim] = [{T}, {num_qo_heads}, {head_dim}], "
            f"got {_shape(q)}. Fix: check num_qo_heads and head_dim (per tensor-parallel rank).")
    if tuple(k.shape) != (T, num_kv_heads, head_dim):
        raise RopePoolError(
            f"k shape must be [num_tokens, num_kv_heads, head_dim] = [{T}, {num_kv_heads}, {head_dim}], "
            f"got {_shape(k)}. Fix: check num_kv_heads and that k has as many tokens as q.")
    if tuple(v.shape) != tuple(k.shape):
        raise RopePoolError(f"v shape must match k shape, got {_shape(v)} vs {_shape(k)}. "
                            "Fix: pass the values of the same tokens and heads as k.")
    dt = _check_dtypes(fw, ("q", "k", "v"), (q, k, v), positions, slots)
    pool = _check_pools(op, ("k_pool", "v_pool"), k_pool, v_pool, layer, kv_layout, num_kv_heads, head_dim,
                        head_dim, fw)
    fp8 = _check_pool_dtypes(("k_pool", "v_pool"), k_pool, v_pool, dt, fw)
    k_scale, v_scale = _check_pool_scales(("k_scale", "v_scale"), (k_scale, v_scale), fp8, k_pool, q, num_kv_heads)
    norm = _check_norm(qk_norm, q, head_dim)
    if fw == "torch":
        # positions/slots too: the kernel reads them as flat int arrays.
        _check_strides(q=q, k=k, v=v, positions=positions, slots=slots, k_pool=k_pool, v_pool=v_pool)
        _check_distinct_pools(("k_pool", "v_pool"), k_pool, v_pool)
        q_fp8, q_scale = _check_out("q_out", q_out, q, "q_scale", q_scale)
        k_fp8, k_out_scale = _check_out("k_out", k_out, k, "k_out_scale", k_out_scale)
    else:
        if q_out is not None or k_out is not None:
            raise TypeError(f"q_out/k_out are for torch tensors; got them with {FRAMEWORK_TYPES[fw]} inputs. "
                            "Fix: drop q_out/k_out (MLX and NumPy calls are functional).")
        for name, s in (("q_scale", q_scale), ("k_out_scale", k_out_scale)):
            if s is not None:
                raise RopePoolError(f"{name} is for a float8 {name[0]}_out tensor; got {name} without one. "
                                    f"Fix: drop {name} (fp8 outputs are torch tensors passed as {name[0]}_out).")
        q_fp8 = k_fp8 = None
    call = Call(fw, dt, num_qo_heads, num_kv_heads, head_dim, head_dim, pool, dtype_name(k_pool), fp8, rotation,
                rows, norm, k_scale, v_scale, q_fp8, q_scale, k_fp8, k_out_scale, _host_values(fw, positions))
    if call.host_values:
        check_host_values(call, positions, slots)
    return call


def check_latent(q_pe, k_pe, kv_c, positions, slots, ckv_cache, kpe_cache, *, rope, kv_layout=None, layer=None,
                 scale=None, q_pe_out=None, frameworks=("torch", "mlx")) -> Call:
    """Check a rope_latent_fused call (MLA) in full and describe it as a call with one latent KV head."""
    op = "rope_latent_fused"
    fw = _check_types(op, _LATENT_ARRAYS, (q_pe, k_pe, kv_c, positions, slots, ckv_cache, kpe_cache), frameworks)
    if fw == "torch":
        _check_devices(op, _LATENT_ARRAYS + ("q_pe_out",),
                       (q_pe, k_pe, kv_c, positions, slots, ckv_cache, kpe_cache, q_pe_out))
    if rope is None:
        raise TypeError("rope_latent_fused needs rope=, a RopeSpec or CosSinCache; got None. "
                        "Fix: RopeSpec.from_hf_config(config) (DeepSeek: GPT-J pairs and YaRN).")
    if q_pe.ndim != 3 or k_pe.ndim not in (2, 3) or kv_c.ndim != 2:
        raise RopePoolError(
            f"rope_latent_fused expects q_pe [T, num_heads, rope_dim], k_pe [T, rope_dim] and kv_c [T, kv_lora_rank]; "
            f"got q_pe {_shape(q_pe)}, k_pe {_shape(k_pe)}, kv_c {_shape(kv_c)}. Fix: pass the rope parts of q and "
            "the latent after its norm, one row per token.")
    T, heads, rope_dim = q_pe.shape
    kv_lora_rank = kv_c.shape[1]
    if tuple(k_pe.shape) not in ((T, rope_dim), (T, 1, rope_dim)) or kv_c.shape[0] != T:
        raise RopePoolError(
            f"rope_latent_fused expects k_pe [{T}, {rope_dim}] (or [{T}, 1, {rope_dim}]) and kv_c [{T}, kv_lora_rank] "
            f"for q_pe {_shape(q_pe)}; got k_pe {_shape(k_pe)}, kv_c {_shape(kv_c)}. Fix: one shared k_pe head and "
            "one latent row per token of q_pe.")
    rotation = _resolve_rope(rope, 10000.0, rope_dim, q_pe)
    if rotation.rotary_dim != rope_dim:
        raise RopePoolError(f"rope_latent_fused rotates the whole rope_dim ({rope_dim}); got a rope with rotary_dim "
                            f"{rotation.rotary_dim}. Fix: build the RopeSpec with head_dim = rotary_dim = "
                            "qk_rope_head_dim.")
    rows = _check_positions(op, positions, slots, T, rotation)
    dt = _check_dtypes(fw, ("q_pe", "k_pe", "kv_c"), (q_pe, k_pe, kv_c), positions, slots)
    pool = _check_pools(op, ("kpe_cache", "ckv_cache"), kpe_cache, ckv_cache, layer, kv_layout, 1, rope_dim,
                        kv_lora_rank, fw, headed=False)
    fp8 = _check_pool_dtypes(("kpe_cache", "ckv_cache"), kpe_cache, ckv_cache, dt, fw)
    (scale,) = _check_pool_scales(("scale",), (scale,), fp8, kpe_cache, q_pe, None)
    if fw == "torch":
        _check_strides(q_pe=q_pe, k_pe=k_pe, kv_c=kv_c, positions=positions, slots=slots, ckv_cache=ckv_cache,
                       kpe_cache=kpe_cache)
        _check_distinct_pools(("ckv_cache", "kpe_cache"), ckv_cache, kpe_cache)
        _check_out("q_pe_out", q_pe_out, q_pe, None, None)
    elif q_pe_out is not None:
        raise TypeError(f"q_out/k_out are for torch tensors; got them with {FRAMEWORK_TYPES[fw]} inputs. "
                        "Fix: drop q_pe_out (MLX and NumPy calls are functional).")
    call = Call(fw, dt, heads, 1, rope_dim, kv_lora_rank, pool, dtype_name(kpe_cache), fp8, rotation, rows, None,
                scale, scale, None, None, None, None, _host_values(fw, positions), latent=True)
    if call.host_values:
        check_host_values(call, positions, slots)
    return call


# --- arrays, devices, numbers ------------------------------------------------------------------

def _check_types(op, names, arrays, frameworks) -> str:
    found = None
    for name, x in zip(names, arrays):
        fw = framework_of(x)
        if fw not in frameworks:
            allowed = " or ".join(FRAMEWORK_TYPES[f] for f in frameworks)
            given = type(x).__module__ + "." + type(x).__name__ if fw is None else FRAMEWORK_TYPES[fw]
            hint = {"torch": "torch.as_tensor(x)", "mlx": "mx.array(x)", "numpy": "np.asarray(x)"}[frameworks[0]]
            raise TypeError(f"{op} expects {name} to be a {allowed}; got {given}. Fix: convert it, e.g. {hint}.")
        if found is None:
            found = (name, fw)
        elif fw != found[1]:
            raise TypeError(f"{op} expects every array from one framework; got {found[0]} as "
                            f"{FRAMEWORK_TYPES[found[1]]} and {name} as {FRAMEWORK_TYPES[fw]}. "
                            "Fix: convert all arrays to the same framework.")
    return found[1]


def _check_devices(op, names, tensors):
    dev = tensors[0].device
    for name, x in zip(names, tensors):
        if x is None:
            continue
        if framework_of(x) != "torch":
            raise TypeError(f"{op} expects {name} to be a torch.Tensor like {names[0]}; got {type(x).__name__}. "
                            "Fix: pass a tensor or leave it None.")
        if x.device != dev:
            raise TypeError(f"{op} expects every tensor on one device; got {names[0]} on {dev} and {name} on "
                            f"{x.device}. Fix: move {name} with .to({str(dev)!r}).")


def _same_place(name, x, q):
    """``x`` (a norm weight, a table, a scale) must be an array of q's framework and device."""
    if framework_of(x) != framework_of(q) or getattr(x, "device", None) != getattr(q, "device", None):
        where = f" on {x.device}" if hasattr(x, "device") else ""
        raise TypeError(f"{name} as a tensor must come from q's framework and device; got "
                        f"{type(x).__module__}.{type(x).__name__}{where}. Fix: move it next to q "
                        f"(.to(q.device)), or pass a float where one is accepted.")


def _is_int(val) -> bool:
    return isinstance(val, numbers.Integral) and not isinstance(val, (bool, np.bool_))


def _ints(**values):
    out = []
    for name, val in values.items():
        if not _is_int(val):
            raise TypeError(f"{name} must be an int; got {type(val).__name__} {val!r}. Fix: pass an int.")
        if val <= 0:
            raise RopePoolError(f"{name} must be positive; got {val}. Fix: pass the model's value.")
        out.append(int(val))
    return out


def _reshape(fw) -> str:
    """The call that reshapes without a copy, in the framework's words."""
    return "view" if fw == "torch" else "reshape"


# --- rotation and positions --------------------------------------------------------------------

def _resolve_rope(rope, rope_base, head_dim, q) -> Rotation:
    if rope is None:
        if isinstance(rope_base, bool) or not isinstance(rope_base, numbers.Real) or not rope_base > 0:
            raise RopePoolError(f"rope_base must be a float > 0; got {rope_base!r}. Fix: pass the model's rope_theta.")
        return default_spec(head_dim, float(rope_base)).rotation
    if isinstance(rope, CosSinCache):
        _same_place("rope.cos_sin_cache", rope.cos_sin_cache, q)
        if rope.rotary_dim > head_dim:
            raise RopePoolError(f"rope.cos_sin_cache must be at most head_dim ({head_dim}) wide; got rotary_dim "
                                f"{rope.rotary_dim}. Fix: pass the table of this layer's rotary embedding.")
        return rope.rotation
    if not isinstance(rope, RopeSpec):
        raise TypeError(f"rope must be a ropepool.RopeSpec or ropepool.CosSinCache; got {type(rope).__name__}. "
                        "Fix: RopeSpec.from_hf_config(config), RopeSpec(head_dim=..., ...) or CosSinCache(table).")
    if rope.head_dim != head_dim:
        raise RopePoolError(f"rope.head_dim must equal head_dim; got rope.head_dim={rope.head_dim}, "
                            f"head_dim={head_dim}. Fix: build the RopeSpec for this head_dim.")
    if rope_base != 10000.0 and rope_base != rope.base:
        raise RopePoolError(f"rope_base conflicts with rope.base; got rope_base={rope_base}, rope.base={rope.base}. "
                            "Fix: with rope= given, leave rope_base at its default (the spec describes the rotation).")
    return rope.rotation


def _check_positions(op, positions, slots, T, rotation) -> int:
    """1, or 3 for MRoPE positions ``[3, T]``."""
    mrope = rotation.mrope_section is not None
    if slots.ndim != 1 or not (positions.ndim == 1 or (mrope and positions.ndim == 2)):
        fix = ("flatten them to [num_tokens]" if not mrope else
               "slots [num_tokens], positions [num_tokens] or [3, num_tokens]")
        if positions.ndim == 2 and not mrope:
            fix += "; [3, num_tokens] MRoPE positions need a spec with mrope_section"
        raise RopePoolError(f"{op} expects positions/slots to be 1-D; got positions {_shape(positions)}, slots "
                            f"{_shape(slots)}. Fix: {fix}.")
    rows = positions.shape[0] if positions.ndim == 2 else 1
    if positions.shape[-1] != T or slots.shape[0] != T or rows not in (1, 3):
        raise RopePoolError(f"positions/slots must have one entry per token ({T}); got positions "
                            f"{_shape(positions)}, slots {_shape(slots)}. Fix: one position (MRoPE: [3, {T}]) "
                            "and one slot per row of q.")
    return rows


def _check_dtypes(fw, names, xs, positions, slots) -> str:
    dt = dtype_name(xs[0])
    floats = FLOAT_DTYPES + (("float64",) if fw == "numpy" else ())
    if dt not in floats:
        cast = {"torch": ".to(torch.bfloat16)", "mlx": ".astype(mx.bfloat16)", "numpy": ".astype(np.float32)"}[fw]
        raise RopePoolError(f"{names[0]} dtype must be one of {floats}; got {dt}. Fix: cast all three, e.g. "
                            f"{names[0]}{cast}.")
    others = [dtype_name(x) for x in xs[1:]]
    if any(o != dt for o in others):
        given = ", ".join(f"{n} {d}" for n, d in zip(names, [dt] + others))
        raise RopePoolError(f"{'/'.join(names)} dtypes must match; got {given}. "
                            f"Fix: cast {' and '.join(names[1:])} to {names[0]}'s dtype.")
    for name, x in (("positions", positions), ("slots", slots)):
        if dtype_name(x) not in INDEX_DTYPES:
            cast = {"torch": ".to(torch.int32)", "mlx": ".astype(mx.int32)", "numpy": ".astype(np.int32)"}[fw]
            raise RopePoolError(f"{name} dtype must be int32 or int64; got {dtype_name(x)}. Fix: {name}{cast}.")
    return dt


# --- pools and scales --------------------------------------------------------------------------

def _pool_fix(fw, name, pool, heads, dim) -> str:
    shape = tuple(pool.shape)
    if pool.ndim == 4 and shape[0] == 1 and shape[2:] == (heads, dim):
        return f"squeeze the extra leading dim of size 1 ({name}[0]), or pass layer=0"
    if pool.ndim == 4:
        return (f"pass layer=<index> or index the layer dimension first ({name}[layer]) for a layer-stacked "
                "[num_layers, pool_size, num_kv_heads, head_dim] pool, or kv_layout='NHD'/'HND' for a paged pool")
    if pool.ndim == 2 and shape[1] == heads * dim:
        return f"reshape to [pool_size, num_kv_heads, head_dim]: {name}.{_reshape(fw)}(-1, {heads}, {dim})"
    if pool.ndim == 5:
        return "pass layer=<index> and kv_layout='NHD' or 'HND' for a layer-stacked paged pool"
    return "pass a [pool_size, num_kv_heads, head_dim] pool"


def _check_pools(op, names, k_pool, v_pool, layer, kv_layout, heads, dim, v_dim, fw, headed=True) -> PoolGeometry:
    """Geometry of the pools (k_pool's; v_pool has the same but rows v_dim wide)."""
    if layer is not None and not _is_int(layer):
        raise TypeError(f"layer must be an int; got {type(layer).__name__}. Fix: pass the layer index.")
    if kv_layout is not None and kv_layout not in KV_LAYOUTS:
        raise RopePoolError(f"kv_layout must be None, 'NHD' or 'HND'; got {kv_layout!r}. "
                            "Fix: None for [pool_size, heads, dim], 'NHD' for [pages, page_size, heads, dim], "
                            "'HND' for [pages, heads, page_size, dim].")
    want = pool_rank(kv_layout, layer, headed)
    for name, pool in zip(names, (k_pool, v_pool)):
        if pool.ndim == want:
            continue
        if kv_layout is None and layer is None and headed:
            raise RopePoolError(
                f"rope_pool_fused expects pool tensors to be 3-D; got {name} of shape {_shape(pool)} "
                f"({pool.ndim}-D). Fix: {_pool_fix(fw, name, pool, heads, dim)}.")
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
        raise RopePoolError(f"{op} expects pool tensors to be {want}-D{where}{stacked}; got {name} of shape "
                            f"{_shape(pool)}. Fix: {fix}.")
    k_geom = pool_geometry(k_pool.shape, layer, kv_layout, headed)
    v_geom = pool_geometry(v_pool.shape, layer, kv_layout, headed)
    if (k_geom.num_layers, k_geom.num_pages, k_geom.page_size, k_geom.num_heads) != \
            (v_geom.num_layers, v_geom.num_pages, v_geom.page_size, v_geom.num_heads) or v_geom.dim != v_dim:
        if headed:
            raise RopePoolError(f"v_pool shape must match k_pool shape, got {_shape(v_pool)} vs {_shape(k_pool)}. "
                                "Fix: pass K and V pools of one cache.")
        raise RopePoolError(f"ckv_cache must have kpe_cache's slots and kv_lora_rank ({v_dim}) features; got "
                            f"ckv_cache {_shape(v_pool)}, kpe_cache {_shape(k_pool)}. Fix: pass the two column "
                            "views of one latent cache (cache[..., :kv_lora_rank], cache[..., kv_lora_rank:]).")
    if layer is not None:
        n = k_geom.num_layers
        if not -n <= layer < n:
            raise RopePoolError(f"layer must be in [{-n}, {n}) for a pool of {n} layers; got {layer}. "
                                "Fix: pass a layer index of this pool.")
        k_geom = pool_geometry(k_pool.shape, int(layer) % n, kv_layout, headed)
    if (k_geom.num_heads, k_geom.dim) != (heads, dim):
        expect = {None: "[pool_size, num_kv_heads, head_dim]", "NHD": "[num_pages, page_size, num_kv_heads, head_dim]",
                  "HND": "[num_pages, num_kv_heads, page_size, head_dim]"}[kv_layout]
        if not headed:
            expect = expect.replace("num_kv_heads, ", "").replace("head_dim", "rope_dim")
        raise RopePoolError(
            f"{names[0]} has incompatible shape {_shape(k_pool)}: expected {expect} with num_kv_heads={heads}, "
            f"head_dim={dim}. Fix: pass the pool of this layer's KV heads (or the matching kv_layout).")
    return k_geom


def _check_pool_dtypes(names, k_pool, v_pool, dt, fw) -> str | None:
    """The pools' fp8 format, or None when they hold q's dtype."""
    fp8_names = MLX_FP8 if fw == "mlx" else {n: n for n in FP8_DTYPES}
    for name, pool in zip(names, (k_pool, v_pool)):
        pdt = dtype_name(pool)
        if pdt != dt and pdt not in fp8_names:
            fp8 = "uint8 (e4m3, as mx.to_fp8 stores it)" if fw == "mlx" else "float8_e4m3fn / float8_e5m2"
            raise RopePoolError(f"pool dtypes must match q/k/v dtype; got {name} {pdt}, q {dt}. Fix: allocate "
                                f"{name} in q's dtype, or as {fp8} with scales.")
    if dtype_name(k_pool) != dtype_name(v_pool):
        raise RopePoolError(f"pool dtypes must match each other; got {names[0]} {dtype_name(k_pool)}, {names[1]} "
                            f"{dtype_name(v_pool)}. Fix: allocate both pools with one dtype.")
    return fp8_names.get(dtype_name(k_pool)) if dtype_name(k_pool) != dt else None


def _check_pool_scales(names, scales, fp8, pool, q, per_head):
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
    return tuple(_check_scale(n, s, q, per_head) for n, s in zip(names, scales))


def _check_scale(name, s, q, per_head):
    """A float > 0, or a float32 array of q's framework and device: one element, or [per_head]."""
    if isinstance(s, numbers.Real) and not isinstance(s, (bool, np.bool_)):  # NumPy scalars too
        if not (0 < float(s) < math.inf):
            raise RopePoolError(f"{name} must be a finite float > 0; got {s!r}. Fix: pass the cache's scale.")
        return float(s)
    shapes = ((), (1,)) + (((per_head,),) if per_head else ())
    if framework_of(s) is None or tuple(s.shape) not in shapes:
        given = type(s).__name__ if framework_of(s) is None else f"shape {_shape(s)}"
        if per_head:
            raise TypeError(f"{name} must be a float, a one-element float32 tensor or one per KV head "
                            f"([{per_head}]); got {given}. Fix: pass float(scale) or a tensor of shape [1] or "
                            f"[{per_head}].")
        raise TypeError(f"{name} must be a float or a one-element float32 tensor; got {given}. "
                        "Fix: pass float(scale) or a tensor of shape [1].")
    _same_place(name, s, q)
    if dtype_name(s) != "float32":
        raise RopePoolError(f"{name} as a tensor must be float32; got {dtype_name(s)}. Fix: {name}.float().")
    # On the CPU the value costs no device sync: check it like a float's.
    if framework_of(s) == "numpy" or (framework_of(s) == "torch" and s.device.type == "cpu" and not tracing("torch")):
        vals = np.asarray(s, dtype=np.float64).reshape(-1)
        if not ((vals > 0) & (vals < math.inf)).all():
            raise RopePoolError(f"{name} must be a finite float > 0; got a tensor holding {vals.tolist()!r}. "
                                "Fix: pass the cache's scale.")
    return s


def _check_distinct_pools(names, a, b):
    # Meta tensors have no memory (data_ptr() is 0 for all of them); fakes under torch.compile neither.
    if not tracing("torch") and a.numel() and a.device.type != "meta" and a.data_ptr() == b.data_ptr():
        raise RopePoolError(f"{names[0]} and {names[1]} are the same memory. Fix: pass two pools "
                            "(for a combined [2, ...] tensor pass kv[0] and kv[1]).")


def _check_norm(norm, q, head_dim):
    if norm is None:
        return None
    if not isinstance(norm, QKNorm):
        raise TypeError(f"qk_norm must be a ropepool.QKNorm; got {type(norm).__name__}. "
                        "Fix: QKNorm(q_weight, k_weight, eps=...) or QKNorm.from_hf_attention(layer.self_attn).")
    for name, w in (("qk_norm.q_weight", norm.q_weight), ("qk_norm.k_weight", norm.k_weight)):
        if w is None:
            continue
        _same_place(name, w, q)
        if w.shape[0] != head_dim:
            raise RopePoolError(f"{name} must have head_dim ({head_dim}) entries; got {w.shape[0]}. Fix: pass "
                                "the per-head norm of this layer (weights over all heads are another op).")
    return norm


def _check_strides(**tensors):
    for name, x in tensors.items():
        if x.stride(-1) != 1 and x.shape[-1] > 1 and x.numel():  # an empty tensor's strides mean nothing
            fix = (f"{name}.contiguous() (it is only read)" if name == "positions" or x.ndim == 1 else
                   "pass a view whose last dim is contiguous (any token/head stride is fine)")
            raise RopePoolError(f"{name} must have a contiguous last dim (stride 1); got strides {list(x.stride())}. "
                                f"Fix: {fix}.")


def _check_out(name, out, like, scale_name, scale):
    """(fp8 format or None, scale) of an output tensor."""
    fp8 = None if out is None or dtype_name(out) not in FP8_DTYPES else dtype_name(out)
    if out is not None:
        if tuple(out.shape) != tuple(like.shape) or (out.dtype != like.dtype and not (fp8 and scale_name)):
            raise RopePoolError(f"{name} must have the shape and dtype of {name[:-4]}: {_shape(like)} "
                                f"{dtype_name(like)}; got {_shape(out)} {dtype_name(out)}. "
                                f"Fix: torch.empty_like({name[:-4]}) or {name[:-4]} itself.")
        _check_strides(**{name: out})
    if fp8 and scale is None:
        raise RopePoolError(f"a {fp8} {name} needs {scale_name}= (it stores {name[0]}_rot / {scale_name}); got no "
                            f"{scale_name}. Fix: pass the attention's {name[0]} scale (1.0 if it has none).")
    if not fp8 and scale is not None:
        raise RopePoolError(f"{scale_name} is for a float8 {name}; got {scale_name} with "
                            f"{'no ' + name if out is None else 'a ' + dtype_name(out) + ' ' + name}. "
                            f"Fix: drop {scale_name}, or pass {name} as a float8_e4m3fn / float8_e5m2 tensor.")
    return fp8, (None if scale is None else _check_scale(scale_name, scale, like, None))


# --- values ------------------------------------------------------------------------------------

def _host_values(fw, positions) -> bool:
    """Whether slot/position values can be read without a device sync."""
    if fw == "torch":
        return positions.device.type == "cpu" and not tracing("torch")
    return True


def check_host_values(call: Call, positions, slots) -> None:
    table = call.rotation.table
    try:
        check_values(positions, slots, call.pool_size, None if table is None else table.shape[0])
    except ValueError as e:
        # Under mx.compile / vmap MLX values cannot be read; the backends still
        # never write outside the pool, but duplicates go unreported.
        if not (call.framework == "mlx" and str(e).startswith("[eval]")):
            raise


def check_values(positions, slots, pool_size: int, max_position: int | None = None) -> None:
    """Slots in ``[0, pool_size)`` or negative (skip), no slot twice, positions >= 0 (and in the table)."""
    pos = np.asarray(positions.cpu() if hasattr(positions, "cpu") else positions)
    slt = np.asarray(slots.cpu() if hasattr(slots, "cpu") else slots)
    if pos.size and pos.min() < 0:
        t = np.unravel_index(int(np.argmax(pos < 0)), pos.shape)
        raise RopePoolError(f"positions must be >= 0; got positions[{_index(t)}] = {int(pos[t])}. "
                            "Fix: pass each token's position in its sequence (padding tokens: 0 and slot -1).")
    if max_position is not None and pos.size and pos.max() >= max_position:
        t = np.unravel_index(int(np.argmax(pos >= max_position)), pos.shape)
        raise RopePoolError(f"positions must be < the cos/sin table's max_position ({max_position}); got "
                            f"positions[{_index(t)}] = {int(pos[t])}. "
                            "Fix: build the table for the longest context served.")
    if pos.size and pos.max() > _PRECISE_POSITIONS:
        warnings.warn(f"positions above 2^24 ({int(pos.max())}): float32 no longer holds every position exactly, "
                      "so RoPE's precision promise ends there (docs/precision.md).", RuntimeWarning, stacklevel=3)
    used = slt[slt >= 0]
    if used.size and used.max() >= pool_size:
        t = int(np.argmax(slt >= pool_size))
        raise RopePoolError(f"slots must be < pool_size ({pool_size}); got slots[{t}] = {int(slt[t])}. "
                            "Fix: allocate slots inside the pool, or pass -1 to skip a token.")
    if used.size < 2:  # a decode step of one token: nothing to repeat (np.unique costs ~20 us)
        return
    uniq, counts = np.unique(used, return_counts=True)
    if uniq.size != used.size:
        s = int(uniq[counts > 1][0])
        raise RopePoolError(f"slots must be unique within a call; got slot {s} {int(counts[counts > 1][0])} times. "
                            "Fix: give each token its own slot (two tokens in one row race).")


def _index(t) -> str:
    """``3`` for [T] positions, ``1, 3`` for [3, T] ones: what goes between the brackets of a message."""
    return ", ".join(str(int(i)) for i in t)


def validate_slots(slots, pool_size: int, positions=None) -> None:
    """Check slot (and position) values on any device; synchronises with it.

    The CUDA fast path skips this check (it would wait for the GPU) and masks
    out-of-range slots instead; call this where a bad slot is a bug to catch.
    """
    (pool_size,) = _ints(pool_size=pool_size)
    for name, x in (("slots", slots), ("positions", positions)):
        if x is None:
            continue
        if framework_of(x) is None:
            raise TypeError(f"validate_slots expects {name} as a torch.Tensor, mx.array or numpy.ndarray; got "
                            f"{type(x).__name__}. Fix: convert it.")
        if dtype_name(x) not in INDEX_DTYPES or x.ndim != 1 + (name == "positions" and x.ndim == 2):
            raise RopePoolError(f"validate_slots expects {name} as a 1-D int32 or int64 array; got "
                                f"{x.ndim}-D {dtype_name(x)}. Fix: pass the {name} given to rope_pool_fused.")
    check_values(slots[:0] if positions is None else positions, slots, pool_size)
