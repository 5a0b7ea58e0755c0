"""Every check of a rope_pool_fused call, for every framework.

``check`` runs before any backend touches memory and returns a ``Call``: the
geometry the backends need. Messages start with the seed's words where the
seed has a message for the same condition, then say what was given and the
fix. docs/errors.md lists each one; tests/test_errors.py keeps the two in step.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from functools import lru_cache

from .errors import RopePoolError
from .spec import RopeSpec

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
INDEX_DTYPES = ("int32", "int64")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
KV_LAYOUTS = ("NHD", "HND")
_ARRAYS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")
_FRAMEWORK_TYPES = {"torch": "torch.Tensor", "mlx": "mx.array", "numpy": "numpy.ndarray"}


@dataclass(frozen=True)
class Call:
    """A checked call: what every backend needs besides the arrays."""

    framework: str
    num_tokens: int
    head_dim: int
    num_qo_heads: int
    num_kv_heads: int
    spec: RopeSpec
    layer: int | None
    kv_layout: str | None  # None: the seed's flat [pool_size, heads, dim]
    page_size: int  # 1 for a flat pool
    pool_size: int  # slots: num_pages * page_size
    k_scale: object  # None, a float, or a one-element tensor (fp8 pools)
    v_scale: object
    # Backends' state for this layout: a Call from the cache stands for every
    # call with the same scalars and tensor properties (see _CHECKED).
    cache: dict = field(default_factory=dict, compare=False, repr=False)


# Looked up per call on the hot path, so both are cached by type / dtype.
_FRAMEWORK_BY_TYPE: dict = {}
_DTYPE_NAMES: dict = {}


def framework_of(x) -> str | None:
    t = type(x)
    fw = _FRAMEWORK_BY_TYPE.get(t, False)
    if fw is False:
        fw = _FRAMEWORK_BY_TYPE[t] = _framework_of_type(t)
    return fw


def _framework_of_type(t) -> str | None:
    mod = t.__module__
    if mod.startswith("torch"):
        import torch

        return "torch" if issubclass(t, torch.Tensor) else None
    if mod.startswith("mlx"):
        return "mlx" if t.__name__ == "array" else None
    if mod == "numpy":
        import numpy as np

        return "numpy" if issubclass(t, np.ndarray) else None
    return None


def dtype_name(x) -> str:
    dt = x.dtype
    if _tracing():  # torch 2.11's dynamo cannot look a dtype up in a dict that holds NumPy dtypes
        return str(dt).rsplit(".", 1)[-1]
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt).rsplit(".", 1)[-1]
    return name


def _shape(x) -> list:
    return list(x.shape)


@lru_cache(maxsize=64)
def default_spec(head_dim: int, rope_base: float) -> RopeSpec:
    return RopeSpec(head_dim=head_dim, base=rope_base)


# Checked torch calls: an engine repeats a few layouts, and on a GPU the host
# time of a decode step is mostly Python. A hit costs one small dict lookup
# and one C++ check of every tensor's type, dtype, device, sizes and strides
# (dynamo's TensorGuards), about 10x less than reading those from Python.
_CHECKED: dict = {}  # scalars, their types, tokens, which outs -> [(guard, Call)]


def _cache_key(q, scalars, q_out, k_out):
    """The hashable part of a torch call (its tensors are guarded), or None to check it in full.

    Calls with tensor scales are not cached: backends read those per call.
    """
    k_scale, v_scale = scalars[6:8]
    if type(q).__module__ != "torch" or hasattr(k_scale, "shape") or hasattr(v_scale, "shape") or _tracing():
        return None
    try:
        # With each scalar's type: True == 1 and 1 == 1.0 as keys, but
        # layer=True and k_scale=True must still be rejected after a call with 1.
        key = (scalars, tuple(map(type, scalars)), q.shape[0], q_out is None, k_out is None)
        hash(key)
    except (AttributeError, TypeError, IndexError):  # not a tensor, or rope={...}: checked in full
        return None
    return key


def _guarded(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out):
    tensors = (q, k, v, positions, slots, k_pool, v_pool)
    if q_out is None and k_out is None:
        return tensors
    return tensors + tuple(x for x in (q_out, k_out) if x is not None)


def cached(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, scalars) -> Call | None:
    """The Call of an earlier torch call with this layout, or None (then ``check`` in full).

    ``scalars``: head_dim, num_qo_heads, num_kv_heads, rope_base, rope, layer,
    k_scale, v_scale, kv_layout.
    """
    layouts = _CHECKED.get(_cache_key(q, scalars, q_out, k_out))
    if layouts:
        tensors = _guarded(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
        for guard, call in layouts:
            # The same memory for both pools is the one thing a layout cannot show.
            if guard.check(*tensors) and k_pool.data_ptr() != v_pool.data_ptr():
                if positions.is_cpu:
                    check_values(positions, slots, call.pool_size)
                return call
    return None


def _tensor_guard(tensors):
    """A C++ check that tensors have these tensors' type, dtype, device, sizes and strides; None if
    this torch has no TensorGuards (calls are then checked in full every time)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        return TensorGuards(*tensors, dynamic_dims_sizes=[list(x.shape) for x in tensors],
                            dynamic_dims_strides=[list(x.stride()) for x in tensors])
    except Exception:  # a private API: any failure only turns the cache off
        return None


def check(q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads,
          num_kv_heads, rope_base, rope, layer, k_scale, v_scale, kv_layout,
          q_out=None, k_out=None, frameworks=("torch", "mlx")) -> Call:
    """Check a call in full (raising on bad input) and return its Call; torch calls are cached."""
    call = _check(q, k, v, positions, slots, k_pool, v_pool, head_dim=head_dim, num_qo_heads=num_qo_heads,
                  num_kv_heads=num_kv_heads, rope_base=rope_base, rope=rope, layer=layer, k_scale=k_scale,
                  v_scale=v_scale, kv_layout=kv_layout, q_out=q_out, k_out=k_out, frameworks=frameworks)
    if call.framework == "torch":
        key = _cache_key(q, (head_dim, num_qo_heads, num_kv_heads, rope_base, rope, layer, k_scale, v_scale,
                             kv_layout), q_out, k_out)
        tensors = _guarded(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out)
        # Only plain tensors with memory (as a hit needs) are cached: a subclass may change what _check sees.
        if (key is not None and all(type(x) in _plain_tensors() for x in tensors)
                and k_pool.data_ptr() != v_pool.data_ptr()):
            guard = _tensor_guard(tensors)
            if guard is not None:
                if len(_CHECKED) > 4096:
                    _CHECKED.clear()
                layouts = _CHECKED.setdefault(key, [])
                layouts.append((guard, call))
                del layouts[:-8]  # a few layouts per key in practice; never many
    return call


@lru_cache(maxsize=1)
def _plain_tensors():
    import torch

    return (torch.Tensor, torch.nn.Parameter)


def _check(q, k, v, positions, slots, k_pool, v_pool, *, head_dim, num_qo_heads,
           num_kv_heads, rope_base, rope, layer, k_scale, v_scale, kv_layout,
           q_out, k_out, frameworks) -> Call:
    arrays = (q, k, v, positions, slots, k_pool, v_pool)
    fw = _check_types(arrays, frameworks)
    if fw == "torch":
        _check_devices(arrays + (q_out, k_out))
    _check_ints(head_dim=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads)
    if head_dim % 2:
        raise RopePoolError(f"head_dim must be even (RoPE rotates pairs); got {head_dim}. "
                            "Fix: pass the model's head_dim.")
    if num_qo_heads % num_kv_heads:
        raise RopePoolError(
            f"num_qo_heads must be divisible by num_kv_heads; got {num_qo_heads} and {num_kv_heads}. "
            "Fix: pass the per-rank head counts of the model (GQA needs whole groups).")

    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise RopePoolError(
            f"rope_pool_fused expects q/k/v to be 3-D; got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}. "
            "Fix: reshape to [num_tokens, num_heads, head_dim], e.g. q.view(num_tokens, num_qo_heads, head_dim).")
    if positions.ndim != 1 or slots.ndim != 1:
        raise RopePoolError(
            f"rope_pool_fused expects positions/slots to be 1-D; got positions {_shape(positions)}, "
            f"slots {_shape(slots)}. Fix: flatten them to [num_tokens].")
    T = q.shape[0]
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
    if tuple(positions.shape) != (T,) or tuple(slots.shape) != (T,):
        raise RopePoolError(
            f"positions/slots must have one entry per token ({T}); got positions {_shape(positions)}, "
            f"slots {_shape(slots)}. Fix: one position and one slot per row of q.")

    dt = dtype_name(q)
    floats = FLOAT_DTYPES + (("float64",) if fw == "numpy" else ())
    if dt not in floats:
        raise RopePoolError(f"q dtype must be one of {floats}; got {dt}. Fix: cast q, k and v, e.g. q.to(torch.bfloat16).")
    if dtype_name(k) != dt or dtype_name(v) != dt:
        raise RopePoolError(f"q/k/v dtypes must match; got q {dt}, k {dtype_name(k)}, v {dtype_name(v)}. "
                            "Fix: cast k and v to q's dtype.")
    for name, x in (("positions", positions), ("slots", slots)):
        if dtype_name(x) not in INDEX_DTYPES:
            raise RopePoolError(f"{name} dtype must be int32 or int64; got {dtype_name(x)}. "
                                f"Fix: {name}.to(torch.int32) (or .astype(mx.int32)).")

    layer, page_size, num_pages = _check_pools(k_pool, v_pool, layer, kv_layout, num_kv_heads, head_dim)
    _check_scales(dt, k_pool, k_scale, v_scale, q)
    spec = _resolve_spec(rope, rope_base, head_dim)

    if fw == "torch":
        # positions/slots too: the kernel reads them as flat int arrays.
        _check_strides(q=q, k=k, v=v, positions=positions, slots=slots, k_pool=k_pool, v_pool=v_pool)
        # Meta tensors have no memory (data_ptr() is 0 for all of them).
        if (not _tracing() and k_pool.numel() and k_pool.device.type != "meta"
                and k_pool.data_ptr() == v_pool.data_ptr()):
            raise RopePoolError("k_pool and v_pool are the same memory. Fix: pass two pools "
                                "(for a combined [2, ...] tensor pass kv[0] and kv[1]).")
        _check_out("q_out", q_out, q)
        _check_out("k_out", k_out, k)
    elif q_out is not None or k_out is not None:
        raise TypeError(f"q_out/k_out are for torch tensors; got them with {_FRAMEWORK_TYPES[fw]} inputs. "
                        "Fix: drop q_out/k_out (MLX and NumPy calls are functional).")

    call = Call(fw, T, head_dim, num_qo_heads, num_kv_heads, spec, layer, kv_layout,
                page_size, num_pages * page_size, k_scale, v_scale)
    if fw == "mlx":
        try:
            check_values(positions, slots, call.pool_size)
        except ValueError as e:
            # Under mx.compile / vmap values cannot be read; the backend still
            # never writes outside the pool, but duplicates go unreported.
            if not str(e).startswith("[eval]"):
                raise
    elif fw == "numpy" or (positions.device.type == "cpu" and not _tracing()):
        check_values(positions, slots, call.pool_size)
    return call


def _tracing() -> bool:
    """Under torch.compile tensors are fakes: no data pointers, no values."""
    import torch

    return torch.compiler.is_compiling()


def _check_types(arrays, frameworks) -> str:
    found = None
    for name, x in zip(_ARRAYS, arrays):
        fw = framework_of(x)
        if fw not in frameworks:
            allowed = " or ".join(_FRAMEWORK_TYPES[f] for f in frameworks)
            given = type(x).__module__ + "." + type(x).__name__ if fw is None else _FRAMEWORK_TYPES[fw]
            hint = {"torch": "torch.as_tensor(x)", "mlx": "mx.array(x)", "numpy": "np.asarray(x)"}[frameworks[0]]
            raise TypeError(f"rope_pool_fused expects {name} to be a {allowed}; got {given}. Fix: convert it, e.g. {hint}.")
        if found is None:
            found = (name, fw)
        elif fw != found[1]:
            raise TypeError(f"rope_pool_fused expects every array from one framework; got {found[0]} as "
                            f"{_FRAMEWORK_TYPES[found[1]]} and {name} as {_FRAMEWORK_TYPES[fw]}. "
                            "Fix: convert all arrays to the same framework.")
    return found[1]


def _check_devices(tensors):
    names = _ARRAYS + ("q_out", "k_out")
    dev = tensors[0].device
    for name, x in zip(names, tensors):
        if x is None:
            continue
        if framework_of(x) != "torch":
            raise TypeError(f"rope_pool_fused expects {name} to be a torch.Tensor like q; got {type(x).__name__}. "
                            "Fix: pass a tensor or leave it None.")
        if x.device != dev:
            raise TypeError(f"rope_pool_fused expects every tensor on one device; got q on {dev} and {name} on "
                            f"{x.device}. Fix: move {name} with .to({str(dev)!r}).")


def _check_ints(**values):
    for name, val in values.items():
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int; got {type(val).__name__} {val!r}. Fix: pass an int.")
        if val <= 0:
            raise RopePoolError(f"{name} must be positive; got {val}. Fix: pass the model's value.")


def _pool_fix(pool, num_kv_heads, head_dim) -> str:
    shape = tuple(pool.shape)
    if pool.ndim == 4 and shape[0] == 1 and shape[2:] == (num_kv_heads, head_dim):
        return "squeeze the extra leading dim of size 1 (k_pool[0], or .squeeze(0)), or pass layer=0"
    if pool.ndim == 4:
        return ("pass layer=<index> or index the layer dimension first (k_pool[layer]) for a layer-stacked "
                "[num_layers, pool_size, num_kv_heads, head_dim] pool, or kv_layout='NHD'/'HND' for a paged pool")
    if pool.ndim == 2 and shape[1] == num_kv_heads * head_dim:
        return (f"reshape to [pool_size, num_kv_heads, head_dim]: "
                f"k_pool.view(-1, {num_kv_heads}, {head_dim})")
    if pool.ndim == 5:
        return "pass layer=<index> and kv_layout='NHD' or 'HND' for a layer-stacked paged pool"
    return "pass a [pool_size, num_kv_heads, head_dim] pool"


def _check_pools(k_pool, v_pool, layer, kv_layout, num_kv_heads, head_dim):
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise TypeError(f"layer must be an int; got {type(layer).__name__}. Fix: pass the layer index.")
    if kv_layout is not None and kv_layout not in KV_LAYOUTS:
        raise RopePoolError(f"kv_layout must be None, 'NHD' or 'HND'; got {kv_layout!r}. "
                            "Fix: None for [pool_size, heads, dim], 'NHD' for [pages, page_size, heads, dim], "
                            "'HND' for [pages, heads, page_size, dim].")
    want = (3 if kv_layout is None else 4) + (layer is not None)
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.ndim != want:
            if kv_layout is None and layer is None:
                raise RopePoolError(
                    f"rope_pool_fused expects pool tensors to be 3-D; got {name} of shape {_shape(pool)} "
                    f"({pool.ndim}-D). Fix: {_pool_fix(pool, num_kv_heads, head_dim)}.")
            lay = "" if kv_layout is None else f" with kv_layout={kv_layout!r}"
            lyr = "" if layer is None else " with layer= (a leading layer dim)"
            if pool.ndim == want - 1 and layer is not None:
                fix = "drop layer= for a single-layer pool"
            elif pool.ndim == want - 1:
                fix = "drop kv_layout= for a flat [pool_size, num_kv_heads, head_dim] pool"
            elif pool.ndim == want + 1 and layer is None:
                fix = "pass layer=<index> for a layer-stacked pool"
            else:
                fix = "pass the pool in the layout named"
            raise RopePoolError(
                f"rope_pool_fused expects pool tensors to be {want}-D{lay}{lyr}; got {name} of shape "
                f"{_shape(pool)}. Fix: {fix}.")
    if tuple(v_pool.shape) != tuple(k_pool.shape):
        raise RopePoolError(f"v_pool shape must match k_pool shape, got {_shape(v_pool)} vs {_shape(k_pool)}. "
                            "Fix: pass K and V pools of one cache.")
    if dtype_name(v_pool) != dtype_name(k_pool):
        raise RopePoolError(f"pool dtypes must match each other; got k_pool {dtype_name(k_pool)}, "
                            f"v_pool {dtype_name(v_pool)}. Fix: allocate both pools with one dtype.")
    shape = tuple(k_pool.shape)
    if layer is not None:
        if not 0 <= layer < shape[0]:
            raise RopePoolError(f"layer must be in [0, {shape[0]}) for a pool of {shape[0]} layers; got {layer}. "
                                "Fix: pass a layer index of this pool.")
        shape = shape[1:]
    if kv_layout is None:
        num_pages, page_size, heads, dim = shape[0], 1, shape[1], shape[2]
        expect = "[pool_size, num_kv_heads, head_dim]"
    elif kv_layout == "NHD":
        num_pages, page_size, heads, dim = shape
        expect = "[num_pages, page_size, num_kv_heads, head_dim]"
    else:
        num_pages, heads, page_size, dim = shape
        expect = "[num_pages, num_kv_heads, page_size, head_dim]"
    if (heads, dim) != (num_kv_heads, head_dim):
        raise RopePoolError(
            f"k_pool has incompatible shape {_shape(k_pool)}: expected {expect} with num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim}. Fix: pass the pool of this layer's KV heads (or the matching kv_layout).")
    return layer, page_size, num_pages


def _check_scales(dt, k_pool, k_scale, v_scale, q):
    pdt = dtype_name(k_pool)
    if pdt in FP8_DTYPES:
        if k_scale is None or v_scale is None:
            given = " and ".join(n for n, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is None)
            raise RopePoolError(f"an {pdt} pool needs k_scale= and v_scale= (stored value = value / scale); "
                                f"got no {given}. Fix: pass the cache's scales (1.0 if it has none).")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if isinstance(s, numbers.Real) and not isinstance(s, bool):  # NumPy scalars too
                if not (0 < float(s) < float("inf")):
                    raise RopePoolError(f"{name} must be a finite float > 0; got {s!r}. Fix: pass the cache's scale.")
            elif framework_of(s) is not None and tuple(s.shape) in ((), (1,)):
                if framework_of(s) != framework_of(q) or getattr(s, "device", None) != getattr(q, "device", None):
                    where = f" on {s.device}" if hasattr(s, "device") else ""
                    raise TypeError(f"{name} as a tensor must come from q's framework and device; got "
                                    f"{type(s).__module__}.{type(s).__name__}{where}. "
                                    f"Fix: pass float({name}), or move it next to q.")
                if dtype_name(s) != "float32":
                    raise RopePoolError(f"{name} as a tensor must be float32; got {dtype_name(s)}. "
                                        f"Fix: {name}.float().")
                # On the CPU the value costs no device sync: check it like a float's.
                if framework_of(s) == "torch" and s.device.type == "cpu" and not _tracing():
                    val = float(s.reshape(()))
                    if not 0 < val < float("inf"):
                        raise RopePoolError(f"{name} must be a finite float > 0; got a tensor holding {val!r}. "
                                            "Fix: pass the cache's scale.")
            else:
                raise TypeError(f"{name} must be a float or a one-element float32 tensor; got "
                                f"{type(s).__name__}. Fix: pass float(scale) or a tensor of shape [1].")
        return
    if k_scale is not None or v_scale is not None:
        raise RopePoolError(f"k_scale/v_scale are for float8 pools; got a {pdt} pool. "
                            "Fix: drop the scales, or allocate the pool as torch.float8_e4m3fn / float8_e5m2.")
    if pdt != dt:
        raise RopePoolError(f"pool dtypes must match q/k/v dtype; got pools {pdt}, q {dt}. "
                            "Fix: allocate the pools in q's dtype (or float8 with k_scale/v_scale).")


def _resolve_spec(rope, rope_base, head_dim) -> RopeSpec:
    if rope is None:
        if isinstance(rope_base, bool) or not isinstance(rope_base, numbers.Real) or not rope_base > 0:
            raise RopePoolError(f"rope_base must be a float > 0; got {rope_base!r}. Fix: pass the model's rope_theta.")
        return default_spec(head_dim, float(rope_base))
    if not isinstance(rope, RopeSpec):
        raise TypeError(f"rope must be a ropepool.RopeSpec; got {type(rope).__name__}. "
                        "Fix: RopeSpec.from_hf_config(config) or RopeSpec(head_dim=..., ...).")
    if rope.head_dim != head_dim:
        raise RopePoolError(f"rope.head_dim must equal head_dim; got rope.head_dim={rope.head_dim}, "
                            f"head_dim={head_dim}. Fix: build the RopeSpec for this head_dim.")
    if rope_base != 10000.0 and rope_base != rope.base:
        raise RopePoolError(f"rope_base conflicts with rope.base; got rope_base={rope_base}, rope.base={rope.base}. "
                            "Fix: with rope= given, leave rope_base at its default (the spec describes the rotation).")
    return rope


def _check_strides(**tensors):
    for name, x in tensors.items():
        if x.stride(-1) != 1 and x.shape[-1] > 1:
            fix = (f"{name}.contiguous() (it is only read)" if x.ndim == 1 else
                   "pass a view whose head_dim is contiguous (any token/head stride is fine)")
            raise RopePoolError(f"{name} must have a contiguous last dim (stride 1); got strides {list(x.stride())}. "
                                f"Fix: {fix}.")


def _check_out(name, out, like):
    if out is None:
        return
    if tuple(out.shape) != tuple(like.shape) or out.dtype != like.dtype:
        raise RopePoolError(f"{name} must have the shape and dtype of {name[0]}: {_shape(like)} {dtype_name(like)}; "
                            f"got {_shape(out)} {dtype_name(out)}. Fix: torch.empty_like({name[0]}) or {name[0]} itself.")
    _check_strides(**{name: out})


def check_values(positions, slots, pool_size: int) -> None:
    """Slots in ``[0, pool_size)`` or negative (skip), no slot twice, positions >= 0."""
    import numpy as np

    pos = np.asarray(positions.cpu() if hasattr(positions, "cpu") else positions)
    slt = np.asarray(slots.cpu() if hasattr(slots, "cpu") else slots)
    if pos.size and pos.min() < 0:
        t = int(np.argmax(pos < 0))
        raise RopePoolError(f"positions must be >= 0; got positions[{t}] = {int(pos[t])}. "
                            "Fix: pass each token's position in its sequence (padding tokens: 0 and slot -1).")
    used = slt[slt >= 0]
    if used.size and used.max() >= pool_size:
        t = int(np.argmax(slt >= pool_size))
        raise RopePoolError(f"slots must be < pool_size ({pool_size}); got slots[{t}] = {int(slt[t])}. "
                            "Fix: allocate slots inside the pool, or pass -1 to skip a token.")
    uniq, counts = np.unique(used, return_counts=True)
    if uniq.size != used.size:
        s = int(uniq[counts > 1][0])
        raise RopePoolError(f"slots must be unique within a call; got slot {s} {int(counts[counts > 1][0])} times. "
                            "Fix: give each token its own slot (two tokens in one row race).")


def validate_slots(slots, pool_size: int, positions=None) -> None:
    """Check slot (and position) values on any device; synchronises with it.

    The CUDA fast path skips this check (it would wait for the GPU) and masks
    out-of-range slots instead; call this where a bad slot is a bug to catch.
    """
    _check_ints(pool_size=pool_size)
    for name, x in (("slots", slots), ("positions", positions)):
        if x is None:
            continue
        if framework_of(x) is None:
            raise TypeError(f"validate_slots expects {name} as a torch.Tensor, mx.array or numpy.ndarray; got "
                            f"{type(x).__name__}. Fix: convert it.")
        if dtype_name(x) not in INDEX_DTYPES or x.ndim != 1:
            raise RopePoolError(f"validate_slots expects {name} as a 1-D int32 or int64 array; got "
                                f"{x.ndim}-D {dtype_name(x)}. Fix: pass the {name} given to rope_pool_fused.")
    check_values(slots[:0] if positions is None else positions, slots, pool_size)
