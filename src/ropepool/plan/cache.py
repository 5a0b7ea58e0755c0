"""The layout cache: the runner of a layout already seen, found before any check.

On CUDA the host time of a decode step is mostly Python, so calls on torch
tensors are remembered: ``lookup`` finds the runner of an earlier call with
the same scalar arguments whose tensors have the same type, dtype, device,
sizes (except the token count) and strides, compared in one C++ call
(dynamo's ``TensorGuards``; where a torch has none, the same facts as one
tuple compared in Python, ``LayoutGuard``). Nothing here imports torch unless the call's arrays are torch tensors.

A runner that compares the layout itself (``checks_layout``: the native CPU kernel's and the native CUDA launcher's,
which compare dtypes, devices, sizes but the token count and strides before they read or write anything, and raise
``errors.OtherLayout`` for any other layout) is found by the key alone where nothing else needs checking here
(``_FAST``: plain tensors, no autograd on q, k, v, slot and position values the host need not check: the
CPU kernel checks them, on CUDA they are not host-checked); the caller then
catches ``OtherLayout`` and looks up again with the guards (``lookup(..., fast=False)``).

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
from typing import Callable

from ..checks import validate
from ..core.dtypes import tracing
from ..rotation.spec import CosSinCache, ScaleKey, TableKey


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
    freed). (``_rope_key`` and ``out_kind`` written out: each call of a function costs a warm call ~0.05 us.)"""
    scale_key = None if k_scale_cache is None and v_scale_cache is None else \
        ScaleKey((id(k_scale_cache), id(v_scale_cache)))
    return (head_dim, num_qo_heads, num_kv_heads, rope_base, rope.key if type(rope) is CosSinCache else rope, layer,
            k_scale, v_scale, kv_layout, None if q_out is None else q_out is q, None if k_out is None else k_out is k,
            backend, qk_norm, q_scale, k_out_scale, scale_key)


def latent_key(rope, kv_layout, layer, scale, q_pe_out, backend, cache_format, q_pe) -> tuple:
    """rope_latent_fused's layout key, as ``pool_key``."""
    return ("latent", _rope_key(rope), kv_layout, layer, scale, out_kind(q_pe_out, q_pe), backend, cache_format)


def indexer_key(rope, scale_fmt, quant_block_size, kv_layout, layer, q_out, backend, q) -> tuple:
    """rope_indexer_fused's layout key, as ``pool_key``."""
    return ("indexer", _rope_key(rope), scale_fmt, quant_block_size, kv_layout, layer, out_kind(q_out, q), backend)


# --- the torch layout cache --------------------------------------------------------------------

_SEEN: dict = {}  # (scalars, their types) -> [(guard, runner, call to value-check or None, the object whose
#                                              checks_layout says whether it may go to _FAST, or None)]
_FAST: dict = {}  # the same key -> the last runner that checks its layout and the values
_MAX_KEYS = 4096
_MAX_BYTES = 64 << 20  # of caller arrays held in keys (scales, norm weights): a few KB each in practice
_held = [0]  # bytes of caller arrays the keys of both caches hold
_compiling = None  # torch.compiler.is_compiling, once a torch call is remembered
_Tensor = None  # torch.Tensor, from then on


def lookup(scalars: tuple, arrays: tuple, fast: bool = True) -> Callable | None:
    """The runner of an earlier call with these scalars and this tensor layout, or None.

    ``arrays``: q, k, v, positions, slots, k_pool, v_pool, q_out, k_out.
    Scalars equal but of another type (``layer=True`` after ``layer=1``)
    are another key: they must be rejected by a full check. ``fast``: a runner
    that checks its own layout may come by the key alone (the caller catches
    ``OtherLayout`` and looks up again with ``fast=False``).
    """
    if fast and _FAST and not _compiling():
        # The runner of this key that checks its layout and the values itself, where the call leaves the kernel all
        # to check: plain tensors (the kernel sees no Python type), q, k, v without autograd (another backend).
        try:
            run = _FAST.get((scalars, (*map(type, scalars),)))
        except TypeError:  # an unhashable argument: checked in full below
            run = None
        if run is not None:
            q, k, v, positions, slots, k_pool, v_pool, q_out, k_out = arrays
            T = _Tensor
            if type(q) is T and type(k) is T and type(v) is T and type(positions) is T and type(slots) is T and \
                    type(k_pool) is T and type(v_pool) is T and (q_out is None or type(q_out) is T) and \
                    (k_out is None or type(k_out) is T) and not (q.requires_grad or k.requires_grad or v.requires_grad):
                return run
    hit = entry(scalars, arrays)
    if hit is not None:
        run, values = hit
        if values is not None:
            validate.check_host_values(values, arrays[3], arrays[4])
        return run
    # MLX arrays with a torch call's scalars (one process running both)
    return _lookup_mlx(scalars, arrays) if _SEEN_MLX else None


def entry(scalars: tuple, arrays: tuple) -> tuple | None:
    """``lookup``'s hit among torch calls before its value check: (runner, the ``Call`` whose slot and position
    values each call must check with ``validate.check_host_values``, or None: no host values), or None. For a
    caller that binds the runner and repeats the rest itself (integrations/vllm.py)."""
    if _compiling is None or _compiling() or not _SEEN:  # under torch.compile: traced in full, every time
        return None
    try:
        entries = _SEEN.get((scalars, tuple(map(type, scalars))))
    except TypeError:  # an unhashable argument (rope={...}): checked in full, and rejected there
        return None
    if entries and isinstance(arrays[0], _Tensor):
        q, k, v, positions, slots, k_pool, v_pool, q_out, k_out = arrays
        # None: no such array (DeepSeek V3.2's caches: formats/; api.py passes what the call was given)
        whole = v is not None and k_pool is not None and v_pool is not None
        tensors = arrays[:7] if whole and q_out is None and k_out is None else _guarded(arrays)
        # The guard leaves every token dim free, each on its own: the counts must agree with q's.
        try:
            T = q.shape[0]
            if not (k.shape[0] == slots.shape[0] == positions.shape[-1] == T) or (v is not None and v.shape[0] != T) \
                    or (q_out is not None and q_out.shape[0] != T) or (k_out is not None and k_out.shape[0] != T):
                return None
        except (AttributeError, IndexError, TypeError):  # not arrays: a full check says what is wrong
            return None
        for guard, run, values, fast in entries:
            # The same memory for both pools is the one thing a layout cannot show.
            if guard.check(*tensors) and (not whole or k_pool.data_ptr() != v_pool.data_ptr()):
                if getattr(fast, "checks_layout", False):  # this layout's runner: a key-only lookup's from now on
                    _FAST[scalars, tuple(map(type, scalars))] = run
                return run, values
    return None


def remember(scalars: tuple, arrays: tuple, call: validate.Call, run: Callable) -> None:
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
    try:
        key = (scalars, tuple(map(type, scalars)))
        entries = _SEEN.get(key)
    except TypeError:
        return
    if entries is None:
        entries = _store(_SEEN, key, call, [])
    # A runner whose kernel checks the slots and positions itself (in range, no slot twice), raising validation's
    # message before any write (backends/torch_native.py), declares it: its calls skip the check here.
    owner = getattr(run, "__self__", run)  # a bound method's object, or the runner itself (triton_launch.Launch)
    values = call if call.host_values and not getattr(owner, "checks_values", False) else None
    # A runner that checks its own layout, bound to plain tensors, needing no value check here: found by the key
    # alone (``lookup``) from now on. ``checks_layout`` is read again at each guarded hit: the CUDA launcher checks the
    # layout once its kernel is compiled, after its first call.
    fast = owner if values is None and not call.autograd and all(type(x) is torch.Tensor for x in tensors) else None
    entries.append((guard, run, values, fast))
    del entries[:-8]  # a few layouts per key in practice; never many
    if getattr(fast, "checks_layout", False):
        _FAST[key] = run


def _guarded(arrays: tuple) -> tuple:
    """The tensors a guard checks: q_out / k_out only where they are not q / k themselves (in place: the
    scalars say so). TensorGuards.check fails on a tensor passed twice, so an in-place call never hit."""
    q, k, q_out, k_out = arrays[0], arrays[1], arrays[7], arrays[8]
    head = arrays[:7]
    if any(x is None for x in head):  # an array the call has not (formats/indexer.py): a stand-in of its own, in place
        head = tuple(_absent(i) if x is None else x for i, x in enumerate(head))
    return head + tuple(x for x, given in ((q_out, q), (k_out, k)) if x is not None and x is not given)


@functools.cache
def _absent(i: int):
    """The stand-in of argument ``i`` where a call has none: the guards check arguments by position."""
    return sys.modules["torch"].empty(0)


def _store(cache: dict, key: tuple, call: validate.Call, value):
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
            _FAST.pop(key, None)


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
    validate.check_host_values(call, arrays[3], arrays[4])  # values are per call
    return run


def forget() -> None:
    """Drop every remembered layout (after tuning changes, in tests, past the bounds)."""
    _SEEN.clear()
    _SEEN_MLX.clear()
    _FAST.clear()
    _WATCHED.clear()
    _held[0] = 0


def _tensor_guards():
    """dynamo's ``TensorGuards`` (a private torch API: a C++ check of many tensors at once), or None."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:
        return None
    return TensorGuards


def _tensor_guard(tensors, mrope_positions: bool):
    """A check of the tensors' type, dtype, device, requires_grad, sizes but the token count, and strides:
    TensorGuards' C++ check where this torch has it, else the same facts compared in Python (``LayoutGuard``)."""
    guards = _tensor_guards()
    if guards is None:
        return LayoutGuard(tensors, mrope_positions)
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
        return guards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
    except Exception:  # another signature in another torch
        return LayoutGuard(tensors, mrope_positions)


class LayoutGuard:
    """What TensorGuards checks, as one tuple compared in Python (a few microseconds more a call than the C++
    check): for torches without it, or whose TensorGuards takes other arguments."""

    __slots__ = ("layout", "mrope")

    def __init__(self, tensors, mrope_positions: bool):
        self.mrope = mrope_positions
        self.layout = self.of(tensors)

    def of(self, tensors) -> tuple:
        """Per tensor: type, dtype, device, requires_grad, sizes but the token dim, strides (the row stride of
        [3, T] MRoPE positions left out: it is T)."""
        q, k, v, positions, slots, k_pool, v_pool, *outs = tensors
        return (tuple((type(x), x.dtype, x.device, x.requires_grad, x.shape[1:], x.stride())
                      for x in (q, k, v, slots, *outs)),
                (type(positions), positions.dtype, positions.device, positions.requires_grad, positions.shape[:-1],
                 positions.stride()[1:] if self.mrope else positions.stride()),
                tuple((type(x), x.dtype, x.device, x.requires_grad, x.shape, x.stride()) for x in (k_pool, v_pool)))

    def check(self, *tensors) -> bool:
        return len(tensors) == len(self.layout[0]) + 3 and self.of(tensors) == self.layout
