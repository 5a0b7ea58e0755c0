"""The fused step inside transformers' continuous batching, through its extension points.

Per attention layer and step, when the call comes from continuous batching
(a ``PagedAttentionCache`` in the layer's kwargs):

1. a forward pre-hook on the attention module hands transformers an identity
   rotation (``position_embeddings`` = cos 1, sin 0; the family's
   ``apply_rotary_pos_emb``, wrapped once, returns q and k as they are for
   it, without computing) and takes the cache out of the kwargs (so its
   ``cache.update`` writes nothing), passing it on as ``ropepool_cache``; the
   layer's own ``q_norm``/``k_norm`` return their input while the layer runs
   (an instance ``forward``), since ropepool fuses the norm;
2. the attention function transformers dispatches to, registered with
   ``AttentionInterface`` as a wrapper of its own, finds ``ropepool_cache``
   and makes ONE ``rope_pool_fused`` call: norm, RoPE on q and k, and the k/v
   write into transformers' cache at its slots; it reads the rows attention
   needs back as transformers does, and calls transformers' own function with
   a cache whose ``update`` returns those rows (nothing is written twice).

MLA layers (DeepSeek V3) differ in step 2: the module writes its latent cache
itself, through the ``cache`` the pre-hook hands it, which is latent.py's
``rope_latent_fused`` step; the wrapper only puts the rotated q_pe in the query.

Any other call (``generate``, a plain forward, a model never enabled) passes
through every hook and wrapper untouched.
"""
from __future__ import annotations

import sys
import weakref

from ... import plan
from ...api import rope_pool_fused
from ...checks.values import check_values
from ...errors import RopePoolError
from . import latent, paged

# Implementations continuous batching may run that this module hosts; the wrappers are registered
# for those the installed transformers has ("paged|sdpa" exists up to 5.2x).
HOSTED = ("sdpa", "paged|sdpa", "paged|eager")

_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> model.Layer
_FUSING: weakref.WeakSet = weakref.WeakSet()  # attention modules inside a fused step (their norms pass through)
_IDENTITY: dict = {}  # (dtype, device) -> (cos, sin) of the identity rotation
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
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = implementation if implementation in ALL_ATTENTION_FUNCTIONS else implementation.removeprefix("paged|")
    return hasattr(ALL_ATTENTION_FUNCTIONS.get(name), "__ropepool_wraps__")


def _wrap(original):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        latent_step = kwargs.pop("ropepool_latent", None)
        if latent_step is not None:  # MLA: the latents were written and read in cache.update (latent.py)
            return original(module, latent_step.query(query), key, value, attention_mask, *args, **kwargs)
        cache = kwargs.pop("ropepool_cache", None)
        if cache is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        query, (k_all, v_all) = fused_step(_LAYERS[module], cache, query, key, value, kwargs)
        # transformers 5.17's paged functions read K/V through cache.update; later ones take them as arguments.
        kwargs["cache"] = _Written(k_all, v_all)
        return original(module, query, _heads_first(k_all), _heads_first(v_all), attention_mask, *args, **kwargs)

    attention.__ropepool_wraps__ = original
    attention.__name__ = f"ropepool_{getattr(original, '__name__', 'attention')}"
    return attention


def fused_step(layer, cache, query, key, value, kwargs):
    """q/k norm, RoPE and the cache write in one ``rope_pool_fused`` call, then the rows attention reads.

    ``query``, ``key``, ``value``: ``[1, heads, T, head_dim]`` as transformers hands them to attention
    (unrotated, unnormalised); returns q rotated in that layout and (K, V) of every row read as
    ``[rows, heads, head_dim]``. The step's positions and slots are worked out once per step, for all layers.
    """
    q, k, v = (x.select(0, 0).transpose(0, 1) for x in (query, key, value))  # [T, heads, D] views
    kv = paged.layer_kv(cache, layer.index, kwargs)
    old = kv.read_before_write()
    q_rot, k_rot = run_layer(layer, q, k, v, kv)
    return _heads_first(q_rot), kv.read(old, k_rot, v)


_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Layer -> (layout, its bound runner)


def run_layer(layer, q, k, v, kv) -> tuple:
    """``rope_pool_fused``'s q_rot and k_rot for one layer, the pools of ``kv`` written.

    The first call of a layer's layout goes through ``rope_pool_fused`` (checked in full, bound, remembered);
    later calls of the same layout call its bound runner directly, skipping the api's keyword handling and
    the layout cache's lookup (~13 us a call on CPU, measured, against a step of ~35): ``layout`` holds what
    that lookup's guard compares (dtypes, sizes but the token count, strides of every array), and the slot and
    position values are checked as the lookup checks them, once per step (values.STEP)."""
    pos, slots, k_pool, v_pool = kv.positions, kv.slots, kv.k_pool, kv.v_pool
    layout = (q.dtype, q.shape[1:], q.stride(), k.shape[1:], k.stride(), v.shape[1:], v.stride(), pos.dtype,
              pos.stride(), slots.dtype, slots.stride(), k_pool.dtype, k_pool.shape, k_pool.stride(),
              v_pool.shape, v_pool.stride())
    bound = _BOUND.get(layer)
    if bound is not None and bound[0] == layout:
        check_values(pos, slots, k_pool.shape[0])
        return bound[1](q, k, v, pos, slots, k_pool, v_pool, None, None)[:2]
    keywords = dict(head_dim=q.shape[-1], num_qo_heads=q.shape[1], num_kv_heads=k.shape[1], rope=layer.rope,
                    qk_norm=layer.norm, backend=layer.backend)
    q_rot, k_rot, _, _ = rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, **keywords)
    # The runner that call remembered (None where the layout cache keeps none: every call then checks in full).
    scalars = plan.pool_key(keywords["head_dim"], keywords["num_qo_heads"], keywords["num_kv_heads"], 10000.0,
                            layer.rope, None, None, None, None, None, None, layer.backend, layer.norm, None, None,
                            None, None, q, k)
    runner = plan.lookup(scalars, (q, k, v, pos, slots, k_pool, v_pool, None, None))
    if runner is not None and k_pool.dtype == q.dtype and k_pool.data_ptr() != v_pool.data_ptr():
        _BOUND[layer] = (layout, runner)
    return q_rot, k_rot


def _heads_first(x):
    """``[T, heads, D]`` as ``[1, heads, T, D]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


class _Written:
    """A cache whose ``update`` returns the rows ropepool already wrote and read (transformers 5.17's paged
    attention functions read K/V through it)."""

    def __init__(self, key, value):
        self.key, self.value = key, value

    def update(self, *args, **kwargs):
        return self.key, self.value


def attach(layers: dict) -> list:
    """Hook every attention module of ``layers`` (``{module: Layer}``); returns the hook handles."""
    handles = []
    for module, layer in layers.items():
        _LAYERS[module] = layer
        handles.append(module.register_forward_pre_hook(_enter, with_kwargs=True))
        handles.append(module.register_forward_hook(_leave, always_call=True))
        if isinstance(layer, latent.LatentLayer):
            handles += latent.attach(module)
            continue
        _skip_identity_rotation(type(module))
        if layer.norm is not None:
            handles += [_NormPassthrough(norm, module) for norm in (module.q_norm, module.k_norm)]
    return handles


def detach(layers: dict, handles: list) -> None:
    for h in handles:
        h.remove()
    for module in layers:
        _LAYERS.pop(module, None)
        _leave(module, None, None)


def _enter(module, args, kwargs):
    from transformers.generation.continuous_batching import PagedAttentionCache

    if not isinstance(kwargs.get("cache"), PagedAttentionCache):
        return None
    implementation = module.config._attn_implementation
    if not hosted(implementation):
        raise RopePoolError(
            f"ropepool hosts continuous batching with the attention implementations {list(HOSTED)}; this step of "
            f"layer {module.layer_idx} runs {implementation!r}. Fix: load the model with attn_implementation='sdpa' "
            "(in half precision also pass ContinuousBatchingConfig(auto_switch_to_flash=False), where it exists), "
            "or ropepool.integrations.transformers.disable(model).")
    if "position_embeddings" not in kwargs or "position_ids" not in kwargs:
        raise RopePoolError(
            f"cannot host layer {module.layer_idx} ({type(module).__name__}): its decoder layer did not pass "
            "position_embeddings and position_ids by keyword. Fix: disable ropepool for this model; this "
            "transformers version calls attention differently from the ones tests/test_integration.py covers.")
    cos = kwargs["position_embeddings"][0]
    key = (cos.dtype, cos.device, cos.shape[-1])
    if key not in _IDENTITY:  # as wide as cos: DeepSeek's interleaved rotation slices it in halves
        _IDENTITY[key] = (cos.new_ones((1, 1, cos.shape[-1])), cos.new_zeros((1, 1, cos.shape[-1])))
        _IDENTITY_SIN.add(id(_IDENTITY[key][1]))
    kwargs["position_embeddings"] = _IDENTITY[key]
    layer = _LAYERS[module]
    if isinstance(layer, latent.LatentLayer):  # the module writes through cache.update: ropepool's call (latent.py)
        kwargs["cache"] = kwargs["ropepool_latent"] = latent.enter(module, layer, kwargs["cache"])
    else:
        kwargs["ropepool_cache"] = kwargs.pop("cache")
        _FUSING.add(module)
    return args, kwargs


def _leave(module, args, output):
    _FUSING.discard(module)
    latent.leave(module)


class _NormPassthrough:
    """The norm module's forward returns its input while its attention module is in a fused step (ropepool
    normalises): an instance ``forward``, so that the norm's own arithmetic does not run at all (a forward
    hook would replace its output after computing it). ``remove()`` puts the module's own forward back."""

    def __init__(self, norm, attention_module):
        ref, own = weakref.ref(attention_module), norm.forward

        def forward(x, *args, **kwargs):
            return x if ref() in _FUSING else own(x, *args, **kwargs)

        self.norm, self.had = norm, norm.__dict__.get("forward")
        norm.forward = self.forward = forward

    def remove(self):
        if self.norm.__dict__.get("forward") is self.forward:
            if self.had is None:
                del self.norm.forward
            else:
                self.norm.forward = self.had


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
