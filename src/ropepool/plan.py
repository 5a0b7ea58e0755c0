"""The plan of a call: the one record between the checked call and the backends, and the layout cache.

The flow is one-way: ``validate`` checks a call and describes it (a frozen
``Call``), ``build`` turns that into a ``Plan``, ``make`` picks the backend
row whose declared support covers the plan's features (backends/__init__.py)
and lets it prepare its launch state once, and ``Ready.bind`` gives the
function that runs calls of that layout. Tuning values (warps, the head split)
are an argument of ``make``, never module globals.

A ``Plan`` is framework-neutral and frozen. It holds:

- ``call``: the checked Call (geometry, rotation, norm);
- ``features``: the named features the call uses (``FEATURES``): a backend
  is picked only if it supports all of them;
- ``stores``: how each destination (k pool, v pool, q_out, k_out) stores its
  rows, one ``stores.Store`` each;
- ``fixed``: the extra arrays the kernels read besides the call's arrays, by
  name, in ``Extras``' one order (the Triton kernel's, the MLX graph's); those
  held weakly (``HELD``: an engine's table, the scale caches) are None there
  and read per call (``extras()``);
- ``key``: the one static key of what compiled code reads of the plan; the MLX
  graph cache and the Triton launchers are keyed by it.

The layout cache's key is built before any check, from the public keywords
(``pool_key``, ``latent_key``; tests/test_plan.py proves each keyword of the
public signatures reaches it).

On CUDA the host time of a decode step is mostly Python, so calls on torch
tensors are remembered: ``lookup`` finds the runner of an earlier call with
the same scalar arguments whose tensors have the same type, dtype, device,
sizes (except the token count) and strides, compared in one C++ call
(dynamo's ``TensorGuards``). Without TensorGuards every call is checked in
full. Nothing here imports torch unless the call's arrays are torch tensors.

Bounds (both layout caches): at most ``_MAX_KEYS`` keys of scalar arguments,
each with at most 8 torch layouts, and at most ``_MAX_BYTES`` of the small
caller arrays a key holds (scales, norm weights; past either bound all is
forgotten and relearnt). An engine's cos/sin table is held only weakly: a
key holds a ``CosSinCache``'s ``key`` (the table's id, its pairs), which any
new ``CosSinCache`` over the same table shares, the runners read the table
through ``Rotation.table_ref``, and when the table is freed its keys go.
The per-token-head scale caches (``k_scale_cache``, ``v_scale_cache``) are
held the same way: a key holds their ids (``ScaleKey``), the ``Call`` and
the runners read them through weak references, and their keys go when
either is freed.
"""
from __future__ import annotations

import atexit
import functools
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from . import backends
from .dtypes import tracing
from .spec import CosSinCache, ScaleKey, TableKey
from .stores import DESTINATIONS, Stores, feature
from .validate import Call, check_host_values

# Every feature a plan may name (a backend row's ``supports`` is a subset).
FEATURES = backends.ALL


class Extras(NamedTuple):
    """The arrays the kernels read besides the call's, in the one order every backend uses."""

    freqs: Any = None  # float32 [sets, rotary_dim // 2] (NumPy; None with a table or without RoPE)
    table: Any = None  # the engine's cos/sin table (held weakly)
    q_weight: Any = None
    k_weight: Any = None
    k_scale: Any = None  # a float or an array (the stores' scales)
    v_scale: Any = None
    q_scale: Any = None
    k_out_scale: Any = None
    k_scale_cache: Any = None  # per-token-head scale caches (held weakly)
    v_scale_cache: Any = None


EXTRAS = Extras._fields
HELD = ("table", "k_scale_cache", "v_scale_cache")  # read through weak references, per call


@dataclass(frozen=True, eq=False)
class Plan:
    call: Call
    features: frozenset
    stores: Stores
    fixed: Extras
    key: tuple

    def extras(self) -> Extras:
        """``fixed`` with the weakly held arrays read now (None where the caller has dropped one)."""
        if self.call.rotation.table_ref is None and self.stores.k_pool.scale_ref is None:
            return self.fixed
        st = self.stores
        return self.fixed._replace(table=self.call.rotation.table, k_scale_cache=st.k_pool.scale_cache,
                                   v_scale_cache=st.v_pool.scale_cache)


def build(call: Call) -> Plan:
    """The plan of a checked call."""
    rot, norm, st = call.rotation, call.norm, call.stores
    used = {"norm": norm is not None, "mrope": call.position_rows == 3, "table": rot.table_ref is not None,
            "longrope": rot.long_from is not None and rot.table_ref is None, "latent": call.latent,
            "autograd": call.autograd, "traced": call.traced}
    features = frozenset([f for f, on in used.items() if on] +
                         [f for f in map(feature, DESTINATIONS, st) if f is not None])
    qw, kw = (None, None) if norm is None else norm.weights
    fixed = Extras(freqs=rot.freqs if rot.table_ref is None and rot.rotary_dim else None, q_weight=qw, k_weight=kw,
                   k_scale=st.k_pool.scale, v_scale=st.v_pool.scale, q_scale=st.q_out.scale,
                   k_out_scale=st.k_out.scale)
    table = rot.table
    rotation = (rot.rotary_dim, rot.gptj, rot.attention_scaling, rot.long_from, rot.mrope_section,
                rot.mrope_interleaved, None if table is None else tuple(table.shape))
    norm_key = None if norm is None else (norm.eps, norm.weight_offset, norm.after_rope, qw is None, kw is None)
    g = call.pool  # (plain values: torch.compile traces this, and cannot rebuild a dataclass it did not see made)
    pool = (g.layer, g.kv_layout, g.headed, g.num_layers, g.num_pages, g.page_size, g.num_heads, g.dim)
    key = (call.framework, call.dtype, call.pool_dtype, call.num_qo_heads, call.num_kv_heads, call.head_dim,
           call.v_head_dim, pool, call.position_rows, rotation, norm_key, tuple(s.key for s in st),
           tuple(sorted(features)))
    return Plan(call, features, st, fixed, key)


@dataclass(frozen=True)
class Tuning:
    """The Triton launcher's choices; None picks the measured default for the call (docs/benchmarks.md)."""

    num_warps: int | None = None
    head_split: int | None = None  # programs a token's heads are split over, at up to small_tokens tokens
    small_tokens: int = 64


DEFAULT_TUNING = Tuning()


class Ready:
    """A plan and the backend row that runs it, with that backend's launch state."""

    def __init__(self, plan: Plan, backend: backends.Backend, tuning: Tuning):
        self.plan, self.call, self.backend, self.tuning = plan, plan.call, backend, tuning
        fallback = None if backend.fallback is None else backends.load(backend.fallback).prepare(plan, tuning, None)
        self.prepared = backend.load().prepare(plan, tuning, fallback)

    def bind(self, *arrays) -> Callable:
        """The function running calls whose arrays are laid out like ``arrays``."""
        return self.prepared.bind(*arrays)


def make(call: Call, q, backend: str | None = None, tuning: Tuning | None = None) -> Ready:
    # None, not a Tuning default: torch 2.11's dynamo cannot trace a frozen dataclass default argument.
    plan = build(call)
    return Ready(plan, backends.pick(call.framework, q, backend, plan.features), tuning or DEFAULT_TUNING)


def out_kind(out, x):
    """An output argument as a key's scalar: None (not given), True (``x`` itself: in place), False."""
    return None if out is None else out is x


def _rope_key(rope):
    """``rope`` as a layout key holds it: a CosSinCache by its key, so that a new one over the same table finds
    the last one's layout and the key does not hold the table."""
    return rope.key if type(rope) is CosSinCache else rope


def pool_key(head_dim, num_qo_heads, num_kv_heads, rope_base, rope, layer, k_scale, v_scale, kv_layout, q_out, k_out,
             backend, qk_norm, q_scale, k_out_scale, k_scale_cache, v_scale_cache, q, k) -> tuple:
    """rope_pool_fused's layout key: its keyword arguments in its signature's order (``q``, ``k``: what the
    outputs are compared with). The scale caches by their ids, not held (watched: the key goes when one is
    freed)."""
    scale_key = None if k_scale_cache is None and v_scale_cache is None else \
        ScaleKey((id(k_scale_cache), id(v_scale_cache)))
    return (head_dim, num_qo_heads, num_kv_heads, rope_base, _rope_key(rope), layer, k_scale, v_scale, kv_layout,
            out_kind(q_out, q), out_kind(k_out, k), backend, qk_norm, q_scale, k_out_scale, scale_key)


def latent_key(rope, kv_layout, layer, scale, q_pe_out, backend, q_pe) -> tuple:
    """rope_latent_fused's layout key, as ``pool_key``."""
    return ("latent", _rope_key(rope), kv_layout, layer, scale, out_kind(q_pe_out, q_pe), backend)


# --- the torch layout cache --------------------------------------------------------------------

_SEEN: dict = {}  # (scalars, their types) -> [(guard, runner, call to value-check or None)]
_MAX_KEYS = 4096
_MAX_BYTES = 64 << 20  # of caller arrays held in keys (scales, norm weights): a few KB each in practice
_held = [0]  # bytes of caller arrays the keys of both caches hold
_compiling = None  # torch.compiler.is_compiling, once a torch call is remembered
_Tensor = None  # torch.Tensor, from then on


def lookup(scalars: tuple, arrays: tuple) -> Callable | None:
    """The runner of an earlier call with these scalars and this tensor layout, or None.

    ``arrays``: q, k, v, positions, slots, k_pool, v_pool, q_out, k_out.
    Scalars equal but of another type (``layer=True`` after ``layer=1``)
    are another key: they must be rejected by a full check.
    """
    if _compiling is None or _compiling() or not _SEEN:  # under torch.compile: traced in full, every time
        return _lookup_mlx(scalars, arrays) if _SEEN_MLX else None
    try:
        entries = _SEEN.get((scalars, tuple(map(type, scalars))))
    except TypeError:  # an unhashable argument (rope={...}): checked in full, and rejected there
        return None
    if entries and isinstance(arrays[0], _Tensor):
        q, k, v, positions, slots, k_pool, v_pool, q_out, k_out = arrays
        tensors = arrays[:7] if q_out is None and k_out is None else _guarded(arrays)
        # The guard leaves every token dim free, each on its own: the counts must agree with q's.
        try:
            T = q.shape[0]
            if not (k.shape[0] == v.shape[0] == slots.shape[0] == positions.shape[-1] == T) or \
                    (len(tensors) > 7 and any(x.shape[0] != T for x in tensors[7:])):
                return None
        except (AttributeError, IndexError, TypeError):  # not arrays: a full check says what is wrong
            return None
        for guard, run, values in entries:
            # The same memory for both pools is the one thing a layout cannot show.
            if guard.check(*tensors) and k_pool.data_ptr() != v_pool.data_ptr():
                if values is not None:
                    check_host_values(values, positions, slots)
                return run
    # MLX arrays with a torch call's scalars (one process running both)
    return _lookup_mlx(scalars, arrays) if _SEEN_MLX else None


def remember(scalars: tuple, arrays: tuple, call: Call, run: Callable) -> None:
    """Keep ``run`` for later calls like this one (torch tensors with memory; MLX arrays)."""
    global _compiling, _Tensor
    if call.framework == "mlx":
        key = _mlx_key(scalars, arrays)
        if key is not None:
            _store(_SEEN_MLX, key, call, (run, call))
        return
    if call.framework != "torch" or tracing("torch"):
        return
    tensors = _guarded(arrays)
    # Only plain tensors: a subclass may change what validation saw.
    torch = sys.modules["torch"]
    _compiling, _Tensor = torch.compiler.is_compiling, torch.Tensor
    if any(type(x) not in (torch.Tensor, torch.nn.Parameter) or x.device.type == "meta" for x in tensors):
        return
    guard = _tensor_guard(tensors, arrays[3].ndim == 2)
    if guard is None:
        return
    try:
        key = (scalars, tuple(map(type, scalars)))
        entries = _SEEN.get(key)
    except TypeError:
        return
    if entries is None:
        entries = _store(_SEEN, key, call, [])
    entries.append((guard, run, call if call.host_values else None))
    del entries[:-8]  # a few layouts per key in practice; never many


def _guarded(arrays: tuple) -> tuple:
    """The tensors a guard checks: q_out / k_out only where they are not q / k themselves (in place: the
    scalars say so). TensorGuards.check fails on a tensor passed twice, so an in-place call never hit."""
    q, k, q_out, k_out = arrays[0], arrays[1], arrays[7], arrays[8]
    return tuple(x for x in arrays[:7] if x is not None) + \
        tuple(x for x, given in ((q_out, q), (k_out, k)) if x is not None and x is not given)


def _store(cache: dict, key: tuple, call: Call, value):
    """``cache[key] = value`` within the bounds, the engine's table and the scale caches watched; returns
    value."""
    held = _held_bytes(key[0])
    if len(_SEEN) + len(_SEEN_MLX) >= _MAX_KEYS or _held[0] + held > _MAX_BYTES:
        forget()
    for array in (call.rotation.table, call.stores.k_pool.scale_cache, call.stores.v_pool.scale_cache):
        if array is not None and id(array) not in _WATCHED:
            _WATCHED[id(array)] = weakref.ref(array, functools.partial(_array_freed, id(array)))
    _held[0] += held
    cache[key] = value
    return value


# id(array) -> a weak reference to it, whose callback drops the keys of that array (a CosSinCache's key
# holds its table's id, a ScaleKey the scale caches'): it runs when the array is freed, before its id can be
# another array's.
_WATCHED: dict = {}
# At exit the caches go with the process: drop the watches first, so that no callback runs while the
# interpreter's shutdown is setting this module's names to None.
atexit.register(_WATCHED.clear)


def _array_freed(array_id: int, ref) -> None:
    _WATCHED.pop(array_id, None)
    for cache in (_SEEN, _SEEN_MLX):
        for key in [k for k in cache if any(type(x) is TableKey and x[0] == array_id
                                            or type(x) is ScaleKey and array_id in x for x in k[0])]:
            _held[0] -= _held_bytes(key[0])
            cache.pop(key, None)


def _held_bytes(scalars) -> int:
    """Bytes of the caller's arrays among these scalars that a key holds."""
    n = 0
    for x in scalars:
        for a in getattr(x, "weights", (x,)):  # QKNorm: its weights
            nbytes = getattr(a, "nbytes", None)
            if isinstance(nbytes, int):
                n += nbytes
    return n


# --- the MLX layout cache: what validation read of an MLX call is its arrays' types, shapes and dtypes.

_SEEN_MLX: dict = {}  # (scalars, their types, each array's type, shape but the token count, dtype) -> (run, call)


def _mlx_key(scalars, arrays):
    """The key of an MLX call's layout, or None (token counts that disagree, an unhashable argument)."""
    try:
        T = arrays[0].shape[0]
        if not arrays[1].shape[0] == arrays[2].shape[0] == arrays[4].shape[0] == arrays[3].shape[-1] == T:
            return None
        token_free = [x.shape[1:] for x in arrays[:3]] + [arrays[3].shape[:-1], ()]
        layout = tuple((type(x), shape, x.dtype) for x, shape in zip(arrays, token_free + [arrays[5].shape,
                                                                                            arrays[6].shape]))
        key = (scalars, tuple(map(type, scalars)), layout, arrays[7] is None and arrays[8] is None)
        hash(key)
        return key
    except (AttributeError, IndexError, TypeError):
        return None


def _lookup_mlx(scalars, arrays):
    key = _mlx_key(scalars, arrays)
    hit = None if key is None else _SEEN_MLX.get(key)
    if hit is None:
        return None
    run, call = hit
    check_host_values(call, arrays[3], arrays[4])  # values are per call
    return run


def forget() -> None:
    """Drop every remembered layout (after tuning changes, in tests, past the bounds)."""
    _SEEN.clear()
    _SEEN_MLX.clear()
    _WATCHED.clear()
    _held[0] = 0


def _tensor_guard(tensors, mrope_positions: bool):
    """A C++ check of the tensors' type, dtype, device, sizes but the token count, and strides; None if
    this torch has no TensorGuards (calls are then checked in full every time)."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:  # a private API: its absence only turns the cache off
        return None
    sizes, strides = [], []
    for i, x in enumerate(tensors):
        size, stride = list(x.shape), list(x.stride())
        if i in (0, 1, 2, 4) or i > 6:  # q, k, v, slots, q_out, k_out: dim 0 is the token
            size[0] = None
        if i == 3:  # positions: the last dim is the token; [3, T]'s row stride is T
            size[-1] = None
            if mrope_positions:
                stride[0] = None
        sizes.append(size)
        strides.append(stride)
    try:
        return TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
    except Exception:
        return None
