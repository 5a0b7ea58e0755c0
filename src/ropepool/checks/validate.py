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

import numbers
import weakref
from dataclasses import dataclass
from functools import lru_cache

from ..core.dtypes import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, QMAX, dtype_name, tracing
from ..core.layout import TILED, PoolGeometry
from ..core.stores import PLAIN, Store, Stores
from ..errors import RopePoolError
from ..formats import NONE, fp8_ds_mla, indexer, per_token_head
from ..rotation.norm import QKNorm
from ..rotation.spec import CosSinCache, RopeSpec, Rotation
from ..support import takes
from .arrays import check_devices, check_ints, check_strides, check_types, reshape_word, same_place, shape_of
from .blocks import check_block_pools, first_array, is_block_pool
from .pools import (
    check_distinct_pools,
    check_pool_dtypes,
    check_pool_scales,
    check_pools,
    check_scale,
    check_scale_caches,
)
from .refusals import refuse
from .values import check_values

_ARRAYS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")
_LATENT_ARRAYS = ("q_pe", "k_pe", "kv_c", "positions", "slots", "ckv_cache", "kpe_cache")
_INDEXER_ARRAYS = ("q", "k", "positions", "slots", "k_cache")


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
    rotation: Rotation
    position_rows: int  # 3 for [3, num_tokens] MRoPE positions
    norm: QKNorm | None
    # How each destination stores its rows (core/stores.py): formats, bounds, scales. Per-token-head scale caches
    # are held weakly (Store.scale_ref): a remembered runner must not keep the caller's caches alive
    # (plan/cache.py drops its keys when they are freed).
    stores: Stores
    host_values: bool  # slot and position values are checked on every call (no device sync)
    latent: bool = False  # rope_latent_fused: k_pe may be [T, rope_dim]
    autograd: bool = False  # q, k or v require grad (torch)
    traced: bool = False  # under torch.compile: fake tensors

    @property
    def pool_size(self) -> int:
        return self.pool.pool_size


def _store(element, scale=None, cache=None) -> Store:
    """A destination's Store: plain without a quantized element, else scaled (a scale) or per token and head
    (a scale cache, held weakly)."""
    if element is None:
        return PLAIN
    if cache is not None:
        return Store(per_token_head.NAME, element, QMAX[element], scale_ref=weakref.ref(cache))
    return Store("scaled", element, QMAX[element], scale)


@lru_cache(maxsize=64)
def default_spec(head_dim: int, rope_base: float) -> RopeSpec:
    return RopeSpec(head_dim=head_dim, base=rope_base)


def check(q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads, num_kv_heads, rope_base=10000.0,
          rope=None, layer=None, k_scale=None, v_scale=None, kv_layout=None, q_out=None, k_out=None, qk_norm=None,
          q_scale=None, k_out_scale=None, k_scale_cache=None, v_scale_cache=None,
          frameworks=("torch", "mlx")) -> Call:
    """Check a rope_pool_fused call in full (raising on bad input) and describe it."""
    op = "rope_pool_fused"
    # A block-quantized pool (a tuple) is typed by its first array here; checks/blocks.py checks the others.
    kp, vp = first_array(k_pool), first_array(v_pool)
    fw = check_types(op, _ARRAYS, (q, k, v, positions, slots, kp, vp), frameworks)
    if fw == "torch":
        check_devices(op, ("q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_out", "k_out"),
                       (q, k, v, positions, slots, kp, vp, q_out, k_out))
    head_dim, num_qo_heads, num_kv_heads = check_ints(head_dim=head_dim, num_qo_heads=num_qo_heads,
                                                 num_kv_heads=num_kv_heads)
    if head_dim % 2:
        raise RopePoolError(f"head_dim must be even (RoPE rotates pairs); got {head_dim}. "
                            "Fix: pass the model's head_dim.")
    rotation = _resolve_rope(rope, rope_base, head_dim, q)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise RopePoolError(
            f"rope_pool_fused expects q/k/v to be 3-D; got q {shape_of(q)}, k {shape_of(k)}, v {shape_of(v)}. "
            f"Fix: reshape to [num_tokens, num_heads, head_dim], e.g. q.{reshape_word(fw)}(num_tokens, num_qo_heads, "
            "head_dim).")
    T = q.shape[0]
    rows = _check_positions(op, positions, slots, T, rotation)
    if tuple(q.shape) != (T, num_qo_heads, head_dim):
        raise RopePoolError(
            f"q shape must be [num_tokens, num_qo_heads, head_dim] = [{T}, {num_qo_heads}, {head_dim}], "
            f"got {shape_of(q)}. Fix: check num_qo_heads and head_dim (per tensor-parallel rank).")
    if tuple(k.shape) != (T, num_kv_heads, head_dim):
        raise RopePoolError(
            f"k shape must be [num_tokens, num_kv_heads, head_dim] = [{T}, {num_kv_heads}, {head_dim}], "
            f"got {shape_of(k)}. Fix: check num_kv_heads and that k has as many tokens as q.")
    if tuple(v.shape) != tuple(k.shape):
        raise RopePoolError(f"v shape must match k shape, got {shape_of(v)} vs {shape_of(k)}. "
                            "Fix: pass the values of the same tokens and heads as k.")
    dt = _check_dtypes(fw, ("q", "k", "v"), (q, k, v), positions, slots)
    caches = (k_scale_cache, v_scale_cache)
    pth = any(c is not None for c in caches)
    pools = None
    if is_block_pool(k_pool) or is_block_pool(v_pool):
        if pth:
            names = ("k_scale_cache", "v_scale_cache")
            raise RopePoolError(f"{'/'.join(names)} are for int8 or float8 pools; got them with block-quantized "
                                "(tuple) pools. Fix: drop them (the block scales are part of the tuple).")
        pools = check_block_pools(("k_pool", "v_pool"), k_pool, v_pool, head_dim, q, fw, (k_scale, v_scale))
        k_pool, v_pool = k_pool[0], v_pool[0]  # the layout is the first array's; the others were checked alike
    width = head_dim if pools is None else k_pool.shape[-1]
    pool = check_pools(op, ("k_pool", "v_pool"), k_pool, v_pool, layer, kv_layout, num_kv_heads, width, width, fw)
    if pth:
        refuse(fw, "pool.per_token_head")
    fp8 = None if pools else check_pool_dtypes(("k_pool", "v_pool"), k_pool, v_pool, dt, fw,
                                                pth if takes(fw, "pool.per_token_head") else None)
    if pth:
        caches = check_scale_caches(("k_scale_cache", "v_scale_cache"), caches, fp8, (k_pool, v_pool), q,
                                     (k_scale, v_scale), fw)
        pools = (_store(fp8, cache=caches[0]), _store(fp8, cache=caches[1]))
    elif pools is None:  # (a block pool's global scales were checked with it)
        k_scale, v_scale = check_pool_scales(("k_scale", "v_scale"), (k_scale, v_scale), fp8, k_pool, q,
                                              num_kv_heads)
        pools = (_store(fp8, k_scale), _store(fp8, v_scale))
    if pool.kv_layout in TILED:
        refuse(fw, "layout." + pool.kv_layout)
        if pools[0].quantized:
            raise RopePoolError(f"kv_layout={pool.kv_layout!r} takes pools in q's dtype; got {pools[0].format} pools "
                                f"({dtype_name(k_pool)}). Fix: allocate the cache in q's dtype (vLLM packs its AMX "
                                "cache for bfloat16 only), or pass kv_layout='HND' for an unpacked quantized cache.")
    norm = _check_norm(qk_norm, q, head_dim)
    if fw == "torch":
        # positions/slots too: the kernel reads them as flat int arrays. Pools may have a strided head dim
        # (vLLM's CPU key cache seen through a transpose): the torch path writes through any view, the
        # Triton backend refuses one (triton_op.Prepared.bind).
        check_strides(q=q, k=k, v=v, positions=positions, slots=slots)
        check_distinct_pools(("k_pool", "v_pool"), k_pool, v_pool)
        outs = (_store(*_check_out("q_out", q_out, q, "q_scale", q_scale)),
                _store(*_check_out("k_out", k_out, k, "k_out_scale", k_out_scale)))
    else:  # outputs are written in place: the backends of other frameworks may not take them (their rows say)
        if q_out is not None or k_out is not None:
            refuse(fw, "out", names="q_out/k_out")
        for name, s in (("q_scale", q_scale), ("k_out_scale", k_out_scale)):
            if s is not None:
                refuse(fw, f"{name[0]}_out.scaled", name=name)
        outs = (PLAIN, PLAIN)
    call = Call(framework=fw, dtype=dt, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                v_head_dim=head_dim, pool=pool, pool_dtype=dtype_name(k_pool), rotation=rotation, position_rows=rows,
                norm=norm, stores=Stores(*pools, *outs), host_values=_host_values(fw, positions),
                autograd=_autograd(fw, q, k, v), traced=tracing(fw))
    if call.host_values:
        check_host_values(call, positions, slots)
    return call


def check_latent(q_pe, k_pe, kv_c, positions, slots, ckv_cache, kpe_cache, *, rope, kv_layout=None, layer=None,
                 scale=None, q_pe_out=None, cache_format=None, frameworks=("torch", "mlx")) -> Call:
    """Check a rope_latent_fused call (MLA) in full and describe it as a call with one latent KV head.
    With ``cache_format="fp8_ds_mla"``, ckv_cache is the whole [..., 656] uint8 cache and kpe_cache the
    view of its k_pe part (``checks.dsa.ds_mla_kpe``, which has checked the format)."""
    op = "rope_latent_fused"
    fw = check_types(op, _LATENT_ARRAYS, (q_pe, k_pe, kv_c, positions, slots, ckv_cache, kpe_cache), frameworks)
    if fw == "torch":
        check_devices(op, _LATENT_ARRAYS + ("q_pe_out",),
                       (q_pe, k_pe, kv_c, positions, slots, ckv_cache, kpe_cache, q_pe_out))
    if rope is None:
        raise TypeError("rope_latent_fused needs rope=, a RopeSpec or CosSinCache; got None. "
                        "Fix: RopeSpec.from_hf_config(config) (DeepSeek: GPT-J pairs and YaRN).")
    if q_pe.ndim != 3 or k_pe.ndim not in (2, 3) or kv_c.ndim != 2:
        raise RopePoolError(
            f"rope_latent_fused expects q_pe [T, num_heads, rope_dim], k_pe [T, rope_dim] and kv_c [T, kv_lora_rank]; "
            f"got q_pe {shape_of(q_pe)}, k_pe {shape_of(k_pe)}, kv_c {shape_of(kv_c)}. Fix: pass the rope parts of q "
            "and the latent after its norm, one row per token.")
    T, heads, rope_dim = q_pe.shape
    kv_lora_rank = kv_c.shape[1]
    if tuple(k_pe.shape) not in ((T, rope_dim), (T, 1, rope_dim)) or kv_c.shape[0] != T:
        raise RopePoolError(
            f"rope_latent_fused expects k_pe [{T}, {rope_dim}] (or [{T}, 1, {rope_dim}]) and kv_c [{T}, kv_lora_rank] "
            f"for q_pe {shape_of(q_pe)}; got k_pe {shape_of(k_pe)}, kv_c {shape_of(kv_c)}. Fix: one shared k_pe head "
            "and one latent row per token of q_pe.")
    rotation = _resolve_rope(rope, 10000.0, rope_dim, q_pe)
    if rotation.rotary_dim != rope_dim:
        raise RopePoolError(f"rope_latent_fused rotates the whole rope_dim ({rope_dim}); got a rope with rotary_dim "
                            f"{rotation.rotary_dim}. Fix: build the RopeSpec with head_dim = rotary_dim = "
                            "qk_rope_head_dim.")
    rows = _check_positions(op, positions, slots, T, rotation)
    dt = _check_dtypes(fw, ("q_pe", "k_pe", "kv_c"), (q_pe, k_pe, kv_c), positions, slots)
    ds_mla = cache_format == fp8_ds_mla.NAME
    pool = check_pools(op, ("kpe_cache", "ckv_cache"), kpe_cache, ckv_cache[..., :kv_lora_rank] if ds_mla else
                       ckv_cache, layer, kv_layout, 1, rope_dim, kv_lora_rank, fw, headed=False)
    fp8 = None if ds_mla else check_pool_dtypes(("kpe_cache", "ckv_cache"), kpe_cache, ckv_cache, dt, fw)
    (scale,) = check_pool_scales(("scale",), (scale,), fp8, kpe_cache, q_pe, None)
    stores = Stores(PLAIN, Store(fp8_ds_mla.NAME, "float8_e4m3fn", QMAX["float8_e4m3fn"]), PLAIN, PLAIN) if ds_mla \
        else Stores(_store(fp8, scale), _store(fp8, scale), PLAIN, PLAIN)
    if fw == "torch":
        check_strides(q_pe=q_pe, k_pe=k_pe, kv_c=kv_c, positions=positions, slots=slots, ckv_cache=ckv_cache,
                      kpe_cache=kpe_cache)
        check_distinct_pools(("ckv_cache", "kpe_cache"), ckv_cache, kpe_cache)
        _check_out("q_pe_out", q_pe_out, q_pe, None, None)
    elif q_pe_out is not None:
        refuse(fw, "out", names="q_pe_out")
    call = Call(framework=fw, dtype=dt, num_qo_heads=heads, num_kv_heads=1, head_dim=rope_dim,
                v_head_dim=kv_lora_rank, pool=pool, pool_dtype=dtype_name(kpe_cache), rotation=rotation,
                position_rows=rows, norm=None, stores=stores,
                host_values=_host_values(fw, positions), latent=True, autograd=_autograd(fw, q_pe, k_pe, kv_c),
                traced=tracing(fw))
    if call.host_values:
        check_host_values(call, positions, slots)
    return call


def check_indexer(q, k, positions, slots, k_cache, *, rope, scale_fmt=None, quant_block_size=128, kv_layout=None,
                  layer=None, q_out=None, frameworks=("torch", "mlx")) -> Call:
    """Check a rope_indexer_fused call (DeepSeek V3.2's indexer key, formats/indexer.py) and describe it as a call
    with one KV head whose pool is the uint8 cache and which has no value (its v store is "none")."""
    op = "rope_indexer_fused"
    fw = check_types(op, _INDEXER_ARRAYS, (q, k, positions, slots, k_cache), frameworks)
    if fw == "torch":
        check_devices(op, _INDEXER_ARRAYS + ("q_out",), (q, k, positions, slots, k_cache, q_out))
    refuse(fw, "pool.indexer")
    if rope is None:
        raise TypeError("rope_indexer_fused needs rope=, a RopeSpec or CosSinCache; got None. Fix: DeepSeek V3.2's "
                        "indexer rotates NeoX pairs of its first 64 features: RopeSpec(head_dim=128, rotary_dim=64, "
                        "...) with the model's scaling.")
    T, heads, D = q.shape if q.ndim == 3 else (None, None, None)
    if q.ndim != 3 or tuple(k.shape) not in ((T, D), (T, 1, D)):
        raise RopePoolError(f"rope_indexer_fused expects q [T, num_heads, head_dim] and k [T, head_dim] (or [T, 1, "
                            f"head_dim]); got q {shape_of(q)}, k {shape_of(k)}. Fix: the indexer's q heads and its one "
                            "key per token, of the same head_dim.")
    indexer.check(op, k, k_cache, quant_block_size, scale_fmt)
    rotation = _resolve_rope(rope, 10000.0, D, q)
    rows = _check_positions(op, positions, slots, T, rotation)
    dt = _check_dtypes(fw, ("q", "k"), (q, k), positions, slots)
    width = k_cache.shape[-1]
    pool = check_pools(op, ("k_cache", "k_cache"), k_cache, k_cache, layer, kv_layout, 1, width, width, fw,
                       headed=False)
    if fw == "torch":
        check_strides(q=q, k=k, positions=positions, slots=slots, k_cache=k_cache)
        indexer.check_pages(op, k_cache, pool.page_size)
        _check_out("q_out", q_out, q, None, None)
    elif q_out is not None:
        refuse(fw, "out", names="q_out")
    key = Store(indexer.name(scale_fmt), "float8_e4m3fn", QMAX["float8_e4m3fn"])
    call = Call(framework=fw, dtype=dt, num_qo_heads=heads, num_kv_heads=1, head_dim=D, v_head_dim=D, pool=pool,
                pool_dtype="uint8", rotation=rotation, position_rows=rows, norm=None,
                stores=Stores(key, Store(NONE), PLAIN, PLAIN), host_values=_host_values(fw, positions), latent=True,
                autograd=_autograd(fw, q, k), traced=tracing(fw))
    if call.host_values:
        check_host_values(call, positions, slots)
    return call


# --- rotation and positions --------------------------------------------------------------------

def _resolve_rope(rope, rope_base, head_dim, q) -> Rotation:
    if rope is None:
        if isinstance(rope_base, bool) or not isinstance(rope_base, numbers.Real) or not rope_base > 0:
            raise RopePoolError(f"rope_base must be a float > 0; got {rope_base!r}. Fix: pass the model's rope_theta.")
        return default_spec(head_dim, float(rope_base)).rotation
    if isinstance(rope, CosSinCache):
        same_place("rope.cos_sin_cache", rope.cos_sin_cache, q)
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
        raise RopePoolError(f"{op} expects positions/slots to be 1-D; got positions {shape_of(positions)}, slots "
                            f"{shape_of(slots)}. Fix: {fix}.")
    rows = positions.shape[0] if positions.ndim == 2 else 1
    if positions.shape[-1] != T or slots.shape[0] != T or rows not in (1, 3):
        raise RopePoolError(f"positions/slots must have one entry per token ({T}); got positions "
                            f"{shape_of(positions)}, slots {shape_of(slots)}. Fix: one position (MRoPE: [3, {T}]) "
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


def _check_norm(norm, q, head_dim):
    if norm is None:
        return None
    if not isinstance(norm, QKNorm):
        raise TypeError(f"qk_norm must be a ropepool.QKNorm; got {type(norm).__name__}. "
                        "Fix: QKNorm(q_weight, k_weight, eps=...) or QKNorm.from_hf_attention(layer.self_attn).")
    for name, w in (("qk_norm.q_weight", norm.q_weight), ("qk_norm.k_weight", norm.k_weight)):
        if w is None:
            continue
        same_place(name, w, q)
        if w.shape[0] != head_dim:
            raise RopePoolError(f"{name} must have head_dim ({head_dim}) entries; got {w.shape[0]}. Fix: pass "
                                "the per-head norm of this layer (weights over all heads are another op).")
    return norm


def _check_out(name, out, like, scale_name, scale):
    """(fp8 format or None, scale) of an output tensor."""
    fp8 = None if out is None or dtype_name(out) not in FP8_DTYPES else dtype_name(out)
    if out is not None:
        if tuple(out.shape) != tuple(like.shape) or (out.dtype != like.dtype and not (fp8 and scale_name)):
            raise RopePoolError(f"{name} must have the shape and dtype of {name[:-4]}: {shape_of(like)} "
                                f"{dtype_name(like)}; got {shape_of(out)} {dtype_name(out)}. "
                                f"Fix: torch.empty_like({name[:-4]}) or {name[:-4]} itself.")
        check_strides(**{name: out})
    if fp8 and scale is None:
        raise RopePoolError(f"a {fp8} {name} needs {scale_name}= (it stores {name[0]}_rot / {scale_name}); got no "
                            f"{scale_name}. Fix: pass the attention's {name[0]} scale (1.0 if it has none).")
    if not fp8 and scale is not None:
        raise RopePoolError(f"{scale_name} is for a float8 {name}; got {scale_name} with "
                            f"{'no ' + name if out is None else 'a ' + dtype_name(out) + ' ' + name}. "
                            f"Fix: drop {scale_name}, or pass {name} as a float8_e4m3fn / float8_e5m2 tensor.")
    return fp8, (None if scale is None else check_scale(scale_name, scale, like, None))


# --- values ------------------------------------------------------------------------------------

def _autograd(fw, *xs) -> bool:
    return fw == "torch" and any(x.requires_grad for x in xs)


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
        # Under mx.compile / vmap MLX refuses to read any traced array (its API raises a plain ValueError
        # there; every value error of ours is a RopePoolError): the backends still never write outside the
        # pool, but duplicates go unreported.
        if type(e) is not ValueError or call.framework != "mlx":
            raise


