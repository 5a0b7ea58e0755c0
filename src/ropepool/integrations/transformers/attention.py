"""The fused step inside transformers' continuous batching, through its extension points.

Per attention layer and step, when the call comes from continuous batching
(a ``PagedAttentionCache`` in the layer's kwargs):

1. the attention module's forward (an instance ``forward`` that wraps its
   own: no hook dispatch) hands transformers an identity rotation
   (``position_embeddings`` = cos 1, sin 0; the family's
   ``apply_rotary_pos_emb``, wrapped once, returns q and k as they are for
   it, without computing) and takes the cache out of the kwargs (so its
   ``cache.update`` writes nothing), passing it on (with the layer) as ``ropepool_cache``; the
   layer's own ``q_norm``/``k_norm`` return their input while the layer runs
   (instance ``forward``s too), since ropepool fuses the norm; and once per
   step the model's rotary embeddings return that identity instead of
   computing cos/sin that no fused layer reads;
2. the attention function transformers dispatches to, registered with
   ``AttentionInterface`` as a wrapper of its own, finds ``ropepool_cache``
   and makes ONE ``rope_pool_fused`` call: norm, RoPE on q and k, and the k/v
   write into transformers' cache at its slots; it reads the rows attention
   needs back as transformers does, and calls transformers' own function with
   a cache whose ``update`` returns those rows (nothing is written twice).

MLA layers (DeepSeek V3) differ in step 2: the module writes its latent cache
itself, through the ``cache`` step 1 hands it, which is latent.py's
``rope_latent_fused`` step; the wrapper only puts the rotated q_pe in the query.

Any other call (``generate``, a plain forward, a model never enabled) passes
through every hook and wrapper untouched.
"""
from __future__ import annotations

import sys
import threading
import weakref

import torch

from ... import plan
from ...api import rope_pool_fused
from ...checks.values import check_values
from ...errors import OtherLayout, RopePoolError
from . import latent, paged
from .model import cpu_table

# Implementations continuous batching may run that this module hosts; the wrappers are registered
# for those the installed transformers has ("paged|sdpa" exists up to 5.2x).
HOSTED = ("sdpa", "paged|sdpa", "paged|eager")

_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> model.Layer
_IDENTITY: dict = {}  # (dtype, device, width) -> (cos, sin) of the identity rotation
_IDENTITY_SIN: set = set()  # their sin tensors' ids (they live as long as _IDENTITY)


def install_attention_functions() -> None:
    """Wrap transformers' own hosted attention functions once per process (calls not ours pass through)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in HOSTED:
        original = ALL_ATTENTION_FUNCTIONS.get(name)
        if original is not None and not hasattr(original, "__ropepool_wraps__"):
            AttentionInterface.register(name, _wrap(original))


def hosted(implementation: str) -> bool:
    """Whether the layers of a model set to ``implementation`` run through a wrapper of this module."""
    functions = sys.modules["transformers.modeling_utils"].ALL_ATTENTION_FUNCTIONS  # (an import here: ~2 us)
    name = implementation if implementation in functions else implementation.removeprefix("paged|")
    return hasattr(functions.get(name), "__ropepool_wraps__")


def _wrap(original):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        latent_step = kwargs.pop("ropepool_latent", None)
        if latent_step is not None:  # MLA: the latents were written and read in cache.update (latent.py)
            return original(module, latent_step.query(query), key, value, attention_mask, *args, **kwargs)
        step = kwargs.pop("ropepool_cache", None)
        if step is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        query, (k_all, v_all) = fused_step(*step, query, key, value, kwargs)
        # transformers 5.17's paged functions read K/V through cache.update; later ones take them as arguments.
        kwargs["cache"] = _Written(k_all, v_all)
        return original(module, query, k_all.transpose(0, 1).unsqueeze(0), v_all.transpose(0, 1).unsqueeze(0),
                        attention_mask, *args, **kwargs)

    attention.__ropepool_wraps__ = original
    attention.__name__ = f"ropepool_{getattr(original, '__name__', 'attention')}"
    return attention


def fused_step(layer, cache, query, key, value, kwargs):
    """q/k norm, RoPE and the cache write in one ``rope_pool_fused`` call, then the rows attention reads.

    ``query``, ``key``, ``value``: ``[1, heads, T, head_dim]`` as transformers hands them to attention
    (unrotated, unnormalised); returns ``query`` (normalised and) rotated in place and (K, V) of every row read
    as ``[rows, heads, head_dim]``. The step's positions and slots are worked out once per step, for all layers.
    """
    # [1, heads, T, D] -> [T, heads, D] views, written out: this runs per layer and step
    q, k, v = query.select(0, 0).transpose(0, 1), key.select(0, 0).transpose(0, 1), value.select(0, 0).transpose(0, 1)
    kv = paged.layer_kv(cache, layer.index, kwargs)
    old = kv.read_before_write()
    # q and k are the layer's own projections, read by nothing after attention: rotated in place (docs/api.md:
    # q_out / k_out may be q and k), no new q_rot / k_rot nor q's views back (2-3% of a demo run's CPU time on
    # the dev VM, measured against new tensors)
    run_layer(layer, q, k, v, kv, in_place=True)
    return query, kv.read(old, k, v)


# Layer -> (layout, k_pool, v_pool, rope, runner, in place, values checked here)
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_layer(layer, q, k, v, kv, in_place: bool = False) -> tuple:
    """``rope_pool_fused``'s q_rot and k_rot for one layer, the pools of ``kv`` written (``in_place``: into q and
    k themselves, which are returned).

    The first call of a layer's layout goes through ``rope_pool_fused`` (checked in full, bound, remembered);
    later calls of the same layout call its bound runner directly, skipping the api's keyword handling and
    the layout cache's lookup (~13 us a call on CPU, measured, against a step of ~35): ``layout`` and the
    step's ``kv.layout`` hold what that lookup's guard compares (dtypes, sizes but the token count, strides of
    every array; the pools are the very views bound, paged.py keeps one per layer and cache), and on CPU the slot
    and position values are checked as the lookup checks them, once per step (values.STEP; on a GPU, as there,
    not at all: the kernel masks what lies outside the pool). A runner that compares the layout itself (the CPU
    kernel's, which checks the values too, and the CUDA launcher's) is called with no comparison here
    (``OtherLayout``: nothing done, checked in full). On CPU the
    rotation is the model's cos/sin table (``model.cpu_table``: rows made once, not per layer), the same object
    until a step reaches past its rows."""
    pos, slots, k_pool, v_pool = kv.positions, kv.slots, kv.k_pool, kv.v_pool
    q_out, k_out = (q, k) if in_place else (None, None)
    rope = cpu_table(layer.rope, kv.top) if q.device.type == "cpu" else layer.rope
    bound = _BOUND.get(layer)
    if bound is not None and bound[1] is k_pool and bound[2] is v_pool and bound[3] is rope and \
            bound[5] is in_place:
        if bound[0] is None:  # the runner compares the layout itself (and checks the values where they are checked)
            if not (q.requires_grad or k.requires_grad or v.requires_grad):
                try:
                    return bound[4](q, k, v, pos, slots, k_pool, v_pool, q_out, k_out)[:2]
                except OtherLayout:  # nothing done: checked in full below
                    pass
        elif bound[0] == _layout(q, k, v, kv):
            if bound[6]:
                check_values(pos, slots, k_pool.shape[0])
            return bound[4](q, k, v, pos, slots, k_pool, v_pool, q_out, k_out)[:2]
    keywords = dict(head_dim=q.shape[-1], num_qo_heads=q.shape[1], num_kv_heads=k.shape[1], rope=rope,
                    qk_norm=layer.norm, backend=layer.backend)
    q_rot, k_rot, _, _ = rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, q_out=q_out, k_out=k_out, **keywords)
    # The runner that call remembered (None where the layout cache keeps none: every call then checks in full).
    scalars = plan.pool_key(keywords["head_dim"], keywords["num_qo_heads"], keywords["num_kv_heads"], 10000.0,
                            rope, None, None, None, None, q_out, k_out, layer.backend, layer.norm, None, None,
                            None, None, q, k)
    # (with its guards: by the key alone the layout cache may give another layout's runner that checks its own)
    runner = plan.lookup(scalars, (q, k, v, pos, slots, k_pool, v_pool, q_out, k_out), fast=False)
    if runner is not None and k_pool.dtype == q.dtype and k_pool.data_ptr() != v_pool.data_ptr():
        owner = getattr(runner, "__self__", runner)  # a bound method's object, or the runner itself (CUDA's Launch)
        # Values are checked here where rope_pool_fused checks them: where reading them needs no device sync.
        host_values = not pos.is_cuda
        self_checked = getattr(owner, "checks_layout", False) and (not host_values or
                                                                   getattr(owner, "checks_values", False))
        _BOUND[layer] = (None if self_checked else _layout(q, k, v, kv), k_pool, v_pool, rope, runner, in_place,
                         host_values)
    return q_rot, k_rot


def _layout(q, k, v, kv) -> tuple:
    """What the layout cache's guard compares of a layer's call (a bound runner that does not compare its own)."""
    return (q.dtype, q.shape[1:], q.stride(), k.dtype, k.shape[1:], k.stride(), v.dtype, v.shape[1:], v.stride(),
            kv.layout)


class _Written:
    """A cache whose ``update`` returns the rows ropepool already wrote and read (transformers 5.17's paged
    attention functions read K/V through it)."""

    def __init__(self, key, value):
        self.key, self.value = key, value

    def update(self, *args, **kwargs):
        return self.key, self.value


def attach(model, layers: dict) -> list:
    """Give ``model``'s rotary embeddings and every attention module of ``layers`` (``{module: Layer}``) their
    fused-step forwards; returns the handles (each has ``remove()``)."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    _PAGED[:] = [PagedAttentionCache]
    handles = []
    for module, layer in layers.items():
        _LAYERS[module] = layer
        handles.append(_Forward(module, _fused_forward, module, isinstance(layer, latent.LatentLayer)))
        if isinstance(layer, latent.LatentLayer):
            handles += latent.attach(module)
            continue
        _skip_identity_rotation(type(module))
        if layer.norm is not None:
            handles += [_Forward(norm, _passthrough, module) for norm in (module.q_norm, module.k_norm)]
    # transformers computes cos/sin once per step for all layers (``rotary_emb``), which no fused layer uses:
    # inside a step its rotary modules return the identity rotation; the module that calls them (the decoder
    # stack) marks the step.
    for parent in {m for m in model.modules() if any(map(_rotary, m.children()))}:
        handles.append(_Forward(parent, _stepping))
        handles += [_Forward(c, _identity_rotary) for c in parent.children() if _rotary(c)]
    return handles


def detach(layers: dict, handles: list) -> None:
    for h in handles:
        h.remove()
    for module in layers:
        _LAYERS.pop(module, None)
        latent.leave(module)


_PAGED: list = []  # transformers' PagedAttentionCache class (imported once by attach, read on every call)
# What the thread running a forward is inside of: ``fusing``, the attention module in a fused step (its
# norms pass through); ``step``, a continuous-batching step (the rotary modules return the identity).
# Per thread: a plain forward of the same model on another thread computes as shipped.
_STATE = threading.local()


def _paged(kwargs) -> bool:
    """Whether a forward's keywords carry transformers' continuous-batching cache."""
    cache = kwargs.get("cache")
    return cache is not None and isinstance(cache, _PAGED[0])


class _Forward:
    """An instance ``forward`` on ``module``, ``make(own, *extra)``, built from the module's own forward.
    Unlike hooks it keeps torch's fast module call (with any hook, every call of the module goes through
    hook dispatch), and what it skips does not run at all. ``remove()`` puts the module's own back."""

    def __init__(self, module, make, *extra):
        self.module, self.had = module, module.__dict__.get("forward")
        module.forward = self.forward = make(module.forward, *extra)

    def remove(self):
        if self.module.__dict__.get("forward") is self.forward:
            if self.had is None:
                del self.module.forward
            else:
                self.module.forward = self.had


def _fused_forward(own, module, mla: bool):
    """An attention module's forward: a continuous-batching call runs as a fused step (``_enter``)."""
    ref = weakref.ref(module)

    def forward(*args, **kwargs):
        if not _paged(kwargs):
            return own(*args, **kwargs)
        module = ref()
        kwargs = _enter(module, kwargs)
        outer = getattr(_STATE, "fusing", None)
        _STATE.fusing = module
        try:
            return own(*args, **kwargs)
        finally:
            _STATE.fusing = outer
            if mla:
                latent.leave(module)

    return forward


def _enter(module, kwargs) -> dict:
    """A fused step's keywords for an attention module's forward: the identity rotation, and the cache moved
    to ``ropepool_cache`` with the layer (its ``cache.update`` writes nothing; MLA: a ``LatentStep`` in its
    place, latent.py)."""
    config = module.config
    checked = getattr(_STATE, "checked", None)  # the configs checked in this step (_stepping), or None
    if checked is None or id(config) not in checked:
        _check_hosted(module, config._attn_implementation)
        if checked is not None:
            checked.add(id(config))
    if "position_embeddings" not in kwargs or "position_ids" not in kwargs:
        raise RopePoolError(
            f"cannot host layer {module.layer_idx} ({type(module).__name__}): its decoder layer did not pass "
            "position_embeddings and position_ids by keyword. Fix: disable ropepool for this model; this "
            "transformers version calls attention differently from the ones tests/test_integration.py covers.")
    cos, sin = kwargs["position_embeddings"]
    if id(sin) not in _IDENTITY_SIN:  # (the rotary modules hand it already where _identity_rotary runs)
        # as wide as cos: DeepSeek's interleaved rotation slices it in halves
        kwargs["position_embeddings"] = identity(cos.dtype, cos.device, cos.shape[-1])
    layer = _LAYERS[module]
    if isinstance(layer, latent.LatentLayer):  # the module writes through cache.update: ropepool's call (latent.py)
        kwargs["cache"] = kwargs["ropepool_latent"] = latent.enter(module, layer, kwargs["cache"])
    else:
        kwargs["ropepool_cache"] = (layer, kwargs.pop("cache"))
    return kwargs


def _check_hosted(module, implementation: str) -> None:
    if not hosted(implementation):
        raise RopePoolError(
            f"ropepool hosts continuous batching with the attention implementations {list(HOSTED)}; this step of "
            f"layer {module.layer_idx} runs {implementation!r}. Fix: load the model with attn_implementation='sdpa' "
            "(in half precision also pass ContinuousBatchingConfig(auto_switch_to_flash=False), where it exists), "
            "or ropepool.integrations.transformers.disable(model).")


def _passthrough(own, attention_module):
    """A q/k norm's forward: its input, while its attention module is in a fused step (ropepool normalises)."""
    ref = weakref.ref(attention_module)

    def forward(x, *args, **kwargs):
        return x if getattr(_STATE, "fusing", None) is ref() else own(x, *args, **kwargs)

    return forward


def _stepping(own):
    """The forward of the module that calls the rotary embeddings: marks a continuous-batching step."""
    def forward(*args, **kwargs):
        if not _paged(kwargs):
            return own(*args, **kwargs)
        outer = getattr(_STATE, "step", False), getattr(_STATE, "checked", None)
        _STATE.step, _STATE.checked = True, set()  # (each config's implementation is checked once a step)
        try:
            return own(*args, **kwargs)
        finally:
            _STATE.step, _STATE.checked = outer

    return forward


def _rotary(module) -> bool:
    return type(module).__name__.endswith("RotaryEmbedding")


def _identity_rotary(own):
    """A rotary embedding's forward: in a step, the identity rotation, as wide as its cos/sin (learnt from one
    computed call per set of arguments, e.g. Gemma 3's layer types), in x's dtype, without computing."""
    widths = {}

    def forward(x, position_ids, *args, **kwargs):
        if not getattr(_STATE, "step", False):
            return own(x, position_ids, *args, **kwargs)
        key = (args, tuple(kwargs.items()))
        if key not in widths:
            widths[key] = own(x, position_ids, *args, **kwargs)[0].shape[-1]
        return identity(x.dtype, x.device, widths[key])

    return forward


def identity(dtype, device, width: int) -> tuple:
    """cos 1, sin 0, ``[1, 1, width]``: made once per dtype, device and width."""
    key = (dtype, device, width)
    if key not in _IDENTITY:
        cos = torch.ones((1, 1, width), dtype=dtype, device=device)
        _IDENTITY[key] = (cos, torch.zeros_like(cos))
        _IDENTITY_SIN.add(id(_IDENTITY[key][1]))
    return _IDENTITY[key]


def _skip_identity_rotation(module_class) -> None:
    """Wrap the ``apply_rotary_pos_emb`` of the module's modeling file (once per process) so that with the
    identity rotation ``_enter`` hands over it returns q and k untouched: transformers' own RoPE would
    otherwise still run, as about ten ops per layer and step that change nothing. Any other call passes
    through to transformers' function (or the kernels hub's wrapper of it)."""
    modeling = sys.modules.get(module_class.__module__)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if original is None or hasattr(original, "__ropepool_wraps__"):
        return

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if id(sin) in _IDENTITY_SIN:
            return q, k
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__ropepool_wraps__ = original
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
