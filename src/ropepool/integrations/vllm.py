"""vLLM: the fused RoPE + KV-cache write of vLLM's attention backends, done by one ropepool call.

The hooks are vLLM's fusion passes (vllm/compilation/passes/fusion/rope_kvcache_fusion.py,
qk_norm_rope_kvcache_fusion.py). With ``pass_config.fuse_rope_kvcache`` on, every attention
layer whose ``impl.fused_rope_kvcache_supported()`` is True has its
``rotary_embedding`` + ``unified_kv_cache_update`` replaced by the custom op
``vllm.fused_rope_and_unified_kv_cache_update``, which calls::

    impl.do_rope_and_kv_cache_update(layer, query, key, value, positions,
                                     cos_sin_cache, is_neox, kv_cache, layer_slot_mapping)

That call rotates query and key in place (the op declares ``mutates_args=["query",
"key"]``) and writes the rotated key and the value into the layer's cache. With
``fuse_qk_norm_rope_kvcache`` the per-head q/k RMS norms are fused too:
``do_qk_norm_rope_kvcache_update(layer, qkv, q_out, k_out, positions, q_weight, k_weight,
eps, cos_sin_cache, is_neox, kv_cache, slots)`` and its MRoPE twin
``do_qk_norm_mrope_kvcache_update`` (``[3, T]`` positions, sections; no k_out) read the
fused projection ``qkv`` and write q_out (k_out) and the cache. ``rope_and_cache`` does each
with one ``ropepool.rope_pool_fused`` call, reading vLLM's own cos/sin table through
``ropepool.CosSinCache``; ``register`` (the ``vllm.general_plugins`` entry point) installs
all three on vLLM's CUDA backends. docs/engines.md says what was run (no GPU run of them).
"""
from __future__ import annotations

import importlib
import logging
import weakref

import torch

from .. import plan
from ..api import rope_pool_fused
from ..checks import validate
from ..errors import OtherLayout, RopePoolError
from ..rotation.norm import QKNorm
from ..rotation.spec import CosSinCache
from .vllm_layouts import KV_LAYOUT, LAYOUTS, cache_views, detect_layout  # noqa: F401  (names of this module too)

log = logging.getLogger(__name__)

# kv_cache_dtype -> the element type the cache holds (None: the tensor's own dtype). vLLM
# allocates fp8 caches as uint8 and views them as fp8; "fp8" means e4m3 on CUDA
# (FlashAttentionBackend.get_fp8_dtype_for_flashattn). The per-token-head modes (TRITON_ATTN) pad
# each head's row with its float32 scale; ropepool writes data and scale (docs/engines.md).
CACHE_DTYPES = {"auto": None, "float16": None, "bfloat16": None, "float32": None,
                "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                "int8_per_token_head": torch.int8, "fp8_per_token_head": torch.float8_e4m3fn}
PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head")

# vLLM's CUDA attention backends: (module, backend class).
BACKENDS = (("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
            ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
            ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"))


# (id(table), is_neox) -> a CosSinCache holding the table weakly; an entry goes with its table. At most
# _MAX_TABLES entries (a few hundred bytes each, no table): past it the map is emptied and refilled.
_TABLES: dict = {}
_MAX_TABLES = 256


def _table(cos_sin_cache: torch.Tensor, is_neox: bool) -> CosSinCache:
    """One CosSinCache per engine table, so ropepool's plan cache hits on every later call."""
    key = (id(cos_sin_cache), bool(is_neox))
    hit = _TABLES.get(key)
    if hit is None or hit[1].cos_sin_cache is not cos_sin_cache:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        hit = _TABLES[key] = (weakref.ref(cos_sin_cache, lambda _, key=key, tables=_TABLES: tables.pop(key, None)),
                              CosSinCache.held_weakly(cos_sin_cache, is_neox=is_neox))
    return hit[1]


def rope_and_cache(query, key, value, positions, cos_sin_cache, is_neox, kv_cache, slot_mapping, *,
                   kv_cache_dtype: str = "auto", k_scale=None, v_scale=None, layout: str | None = None,
                   backend: str | None = None, k_scale_cache=None, v_scale_cache=None, qk_norm=None,
                   q_out=None, k_out=None, rope=None) -> None:
    """What vLLM's ``do_rope_and_kv_cache_update`` does, as one ``ropepool.rope_pool_fused`` call.

    Parameters
    ----------
    query : [num_tokens, num_heads, head_size]; key, value : [num_tokens, num_kv_heads, head_size]
        float16 / bfloat16 / float32, any token stride (views of vLLM's fused QKV output).
        Rotated in place: on return query and key hold q_rot and k_rot.
    positions : [num_tokens] int64
    cos_sin_cache : [max_position, rotary_dim], vLLM's table (cos half, then sin half)
        Read as given (``ropepool.CosSinCache``); ``rotary_dim < head_size`` is partial rotary.
    is_neox : bool; False is GPT-J (interleaved) pairs.
    kv_cache : the layer's cache, in one of ``LAYOUTS``
    slot_mapping : [n] int64, n <= num_tokens
        Token t goes to block ``slot // block_size``, row ``slot % block_size``; a slot < 0 is
        not written. Tokens from n on are CUDA-graph padding: neither rotated nor written.
    kv_cache_dtype : a key of ``CACHE_DTYPES`` (vLLM's cache_config.cache_dtype)
    k_scale, v_scale : float32 tensors, one element or [num_kv_heads] (``layer._k_scale``,
        ``layer._v_scale``); fp8 caches store ``value / scale``. Ignored for other caches.
    k_scale_cache, v_scale_cache : the per-token-head modes' float32 scale views
        ``[num_blocks, block_size, num_kv_heads]`` (``impl._k_scale_cache`` after
        ``impl._ensure_scale_caches(kv_cache)``); required for those modes, whose rows are
        ``head_size`` data elements then the 4 bytes of the scale.
    layout : a key of ``LAYOUTS``; None reads it from kv_cache's shape.
    backend : ropepool backend (None: the Triton kernel on CUDA, the torch path elsewhere).
    qk_norm : a ``ropepool.QKNorm`` (the model's per-head q/k RMS norms, e.g. Qwen3's), applied to
        query and key in the same call; None: query and key are rotated as given.
    q_out, k_out : where q_rot and k_rot go (their first n tokens), shaped like query and key;
        None: query and key themselves (in place).
    rope : a ``ropepool.RopeSpec`` or ``CosSinCache`` that replaces ``CosSinCache(cos_sin_cache,
        is_neox)`` (MRoPE sections; a rotation ropepool computes itself, e.g. DeepSeek's YaRN).
    positions may be MRoPE's ``[3, num_tokens]``.
    """
    if kv_cache_dtype not in CACHE_DTYPES:
        raise RopePoolError(f"kv_cache_dtype {kv_cache_dtype!r} is not one ropepool writes; expected one of "
                            f"{sorted(CACHE_DTYPES)}. Fix: leave this layer to vLLM's own path (register() "
                            "reports it unsupported), e.g. int4_per_token_head or nvfp4.")
    head_size = key.shape[-1]
    n = slot_mapping.shape[0]
    q, k, v, pos = query[:n], key[:n], value[:n], positions[..., :n]
    fp8 = CACHE_DTYPES[kv_cache_dtype]
    scales = {} if fp8 is None else {"k_scale": k_scale, "v_scale": v_scale}
    row = head_size
    if kv_cache_dtype in PER_TOKEN_HEAD:
        if k_scale_cache is None or v_scale_cache is None:
            raise RopePoolError(f"kv_cache_dtype {kv_cache_dtype!r} needs k_scale_cache and v_scale_cache; got "
                                f"{'none' if k_scale_cache is None and v_scale_cache is None else 'one'}. Fix: "
                                "pass impl._k_scale_cache / impl._v_scale_cache after impl._ensure_scale_caches("
                                "kv_cache) (register() does).")
        row = head_size + 4 // kv_cache.element_size()  # the scale's float32 after each head's data
        scales = {"k_scale_cache": k_scale_cache, "v_scale_cache": v_scale_cache}
    k_cache, v_cache = (c[..., :head_size] for c in cache_views(kv_cache, layout or detect_layout(kv_cache, row),
                                                                 row))
    if fp8 is not None and k_cache.dtype != fp8:
        k_cache, v_cache = k_cache.view(fp8), v_cache.view(fp8)
    rope_pool_fused(q, k, v, pos, slot_mapping, k_cache, v_cache, head_dim=head_size, num_qo_heads=q.shape[1],
                    num_kv_heads=k.shape[1], rope=_table(cos_sin_cache, is_neox) if rope is None else rope,
                    kv_layout=KV_LAYOUT.get(layout, "NHD"), q_out=q if q_out is None else q_out[:n],
                    k_out=k if k_out is None else k_out[:n], backend=backend, qk_norm=qk_norm, **scales)


def _layout(x) -> tuple:
    """What the layout cache's guard compares of q, k, v or the slots (dim 0, the token, free but for its stride)."""
    return type(x), x.dtype, x.device, x.requires_grad, x.shape[1:], x.stride()


def _shape(q, k, v, pos, slots, layout) -> tuple:
    """The layout a bound runner that does not compare its own was bound to (``layer_rope_and_cache``)."""
    return (_layout(q), _layout(k), _layout(v), _layout(slots), type(pos), pos.dtype, pos.device, pos.requires_grad,
            pos.shape[:-1], pos.stride(), layout)


def layer_rope_and_cache(holder, query, key, value, positions, kv_cache, slot_mapping, *, layout: str, rope,
                         qk_norm=None) -> None:
    """``rope_and_cache`` of an engine layer's own calls (its cache in the model's dtype, q and k rotated in place)
    with ``rope`` given, ``holder`` (the layer's impl) keeping what its first checked call bound.

    A later call of the same layout calls the bound runner directly: no cache views made again, no keywords, no
    layout-cache lookup (~16 us of ~110 a decode call on CPU, measured). It compares what that lookup's guard
    compares (each array's type, dtype, device, autograd, sizes but the token count, strides; the pools are the
    views bound, of the very ``kv_cache``; the same ``rope`` and ``qk_norm`` objects, the scalars of its key),
    the token counts, and checks the slot and position values as the lookup does; anything else goes through
    ``rope_pool_fused`` in full (and is bound anew). The CPU kernel's runner compares the layout, the token counts
    and the values itself (``OtherLayout``: nothing done, checked in full here): only what it cannot see (types,
    autograd) is compared in Python."""
    n = slot_mapping.shape[0]
    # (views of the first n rows only where the engine padded: four slices cost ~6 us, a quarter of a CPU call)
    if query.shape[0] == key.shape[0] == value.shape[0] == positions.shape[-1] == n:
        q, k, v, pos = query, key, value, positions
    else:
        q, k, v, pos = query[:n], key[:n], value[:n], positions[..., :n]
    bound = getattr(holder, "_ropepool_bound", None)
    if bound is not None and bound[1] is kv_cache and bound[2] is rope and bound[3] is qk_norm and \
            not torch.compiler.is_compiling():
        run, values, k_cache, v_cache = bound[4:8]
        if bound[0] is None:  # the runner compares the layout and checks the values itself (the CPU kernel)
            T = torch.Tensor
            if type(q) is T and type(k) is T and type(v) is T and type(pos) is T and type(slot_mapping) is T and \
                    not (q.requires_grad or k.requires_grad or v.requires_grad) and bound[8] == layout:
                try:
                    run(q, k, v, pos, slot_mapping, k_cache, v_cache, q, k)
                    return
                except OtherLayout:  # nothing done: checked in full below
                    pass
        elif bound[0] == _shape(q, k, v, pos, slot_mapping, layout) and \
                q.shape[0] == k.shape[0] == v.shape[0] == pos.shape[-1] == n:
            if values is not None:
                validate.check_host_values(values, pos, slot_mapping)
            run(q, k, v, pos, slot_mapping, k_cache, v_cache, q, k)
            return
    rope_and_cache(query, key, value, positions, None, None, kv_cache, slot_mapping, layout=layout, qk_norm=qk_norm,
                   rope=rope)
    # The runner that call remembered, found as rope_pool_fused finds it (None where the layout cache keeps none:
    # every call then checks in full).
    d = key.shape[-1]
    k_cache, v_cache = (c[..., :d] for c in cache_views(kv_cache, layout, d))
    scalars = plan.pool_key(d, q.shape[1], k.shape[1], 10000.0, rope, None, None, None, KV_LAYOUT.get(layout, "NHD"),
                            q, k, None, qk_norm, None, None, None, None, q, k)
    hit = plan.entry(scalars, (q, k, v, pos, slot_mapping, k_cache, v_cache, q, k))
    if hit is None:
        holder._ropepool_bound = None
        return
    # A runner that compares its layout and checks the values (backends/torch_native.py) needs no Python layout
    self_checked = getattr(getattr(hit[0], "__self__", None), "checks_layout", False) and hit[1] is None
    holder._ropepool_bound = (None if self_checked else _shape(q, k, v, pos, slot_mapping, layout), kv_cache, rope,
                              qk_norm, *hit, k_cache, v_cache, layout)


# --- the vLLM plugin -----------------------------------------------------------------------------------

def supported(impl) -> bool:
    """Whether ropepool does this layer's write: decoder attention writing its own cache, a cache type
    ropepool stores (per-token-head: with vLLM's scale views, ``_ensure_scale_caches``), on an NVIDIA GPU
    (ROCm's fp8 is e4m3fnuz, which ropepool does not store)."""
    dtype = getattr(impl, "kv_cache_dtype", "auto")
    return (dtype in CACHE_DTYPES and (dtype not in PER_TOKEN_HEAD or hasattr(impl, "_ensure_scale_caches"))
            and getattr(impl, "kv_sharing_target_layer_name", None) is None
            and getattr(impl, "attn_type", "decoder") == "decoder"  # AttentionType.DECODER
            and _nvidia())


def _nvidia() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None


def probe_layout(backend_cls) -> str | None:
    """The layout a backend allocates, from its ``get_kv_cache_shape`` (None: read it from the tensor).
    vLLM's standardized layout removed that per-backend hook; its caches are "packed"."""
    shape_of = getattr(backend_cls, "get_kv_cache_shape", None)
    if shape_of is None:
        return "packed"
    shape = tuple(shape_of(3, 16, 1, 16))
    return {(2, 3, 16, 1, 16): "kv_first", (3, 2, 16, 1, 16): "blocks_first", (3, 1, 16, 32): "packed"}.get(shape)


# vLLM's fused hooks (vllm/v1/attention/backend.py, AttentionImpl) and the gate each fusion pass asks first.
HOOKS = {"do_rope_and_kv_cache_update": "fused_rope_kvcache_supported",
         "do_qk_norm_rope_kvcache_update": "fused_qk_norm_rope_kvcache_supported",
         "do_qk_norm_mrope_kvcache_update": "fused_qk_norm_mrope_kvcache_supported"}


def _cache_args(impl, layer, kv_cache, layout) -> dict:
    """rope_and_cache's cache arguments for a layer of ``impl``: its cache type, scales and layout."""
    caches = {}
    if impl.kv_cache_dtype in PER_TOKEN_HEAD:  # vLLM's float32 views of the scale bytes of each row
        impl._ensure_scale_caches(kv_cache)
        caches = {"k_scale_cache": impl._k_scale_cache, "v_scale_cache": impl._v_scale_cache}
    return dict(kv_cache_dtype=impl.kv_cache_dtype, k_scale=layer._k_scale, v_scale=layer._v_scale, layout=layout,
                **caches)


def _qkv(impl, qkv, q_weight, k_weight, eps, slot_mapping):
    """The QK-norm hooks' inputs as rope_and_cache takes them: q, k, v views of the fused projection ``qkv``
    ``[T, (num_heads + 2 * num_kv_heads) * head_size]``, the layer's ``QKNorm`` (made once per weights), and
    the slots padded with -1 to T: the fused op's q_out / k_out cover every token, CUDA-graph padding too
    (as the unfused rms_norm + rotary ops it replaces), while only the first n are written."""
    d, hq, hkv = impl.head_size, impl.num_heads, impl.num_kv_heads
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, qkv.shape[-1] - (hq + hkv) * d], dim=-1)
    held = getattr(impl, "_ropepool_qk_norm", None)
    if held is None or held[0] is not q_weight or held[1] is not k_weight or held[2] != eps:
        held = impl._ropepool_qk_norm = (q_weight, k_weight, eps, QKNorm(q_weight.reshape(-1), k_weight.reshape(-1),
                                                                         eps=float(eps)))
    n = slot_mapping.shape[0]
    slots = slot_mapping if n == t else torch.cat((slot_mapping, slot_mapping.new_full((t - n,), -1)))
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, -1), held[3], slots


def _rope_update(impl, layer, query, key, value, positions, cos_sin_cache, is_neox, kv_cache, layer_slot_mapping,
                 layout):
    """``do_rope_and_kv_cache_update``: query and key rotated in place, rotated key and value written."""
    rope_and_cache(query, key, value, positions, cos_sin_cache, is_neox, kv_cache, layer_slot_mapping,
                   **_cache_args(impl, layer, kv_cache, layout))


def _qk_norm_rope_update(impl, layer, qkv, q_out, k_out, positions, q_weight, k_weight, rms_norm_eps, cos_sin_cache,
                         is_neox, kv_cache, layer_slot_mapping, layout):
    """``do_qk_norm_rope_kvcache_update``: q_out and k_out get RoPE(rms_norm(q or k) * weight) of every token,
    the cache the first n keys and values (v split from qkv, unnormalised); qkv is not written."""
    q, k, v, qk_norm, slots = _qkv(impl, qkv, q_weight, k_weight, rms_norm_eps, layer_slot_mapping)
    rope_and_cache(q, k, v, positions, cos_sin_cache, is_neox, kv_cache, slots, q_out=q_out, k_out=k_out,
                   qk_norm=qk_norm, **_cache_args(impl, layer, kv_cache, layout))


def _qk_norm_mrope_update(impl, layer, qkv, q_out, positions, q_weight, k_weight, rms_norm_eps, cos_sin_cache, is_neox,
                          mrope_section, is_interleaved, rotary_dim, kv_cache, layer_slot_mapping, layout):
    """``do_qk_norm_mrope_kvcache_update``: as the QK-norm hook with MRoPE (``[3, T]`` positions, vLLM's
    ``[max_position, rotary_dim]`` table); the key goes to the cache only (vLLM's op has no k_out)."""
    if rotary_dim != cos_sin_cache.shape[-1]:
        raise RopePoolError(f"rotary_dim {rotary_dim} is not the width of cos_sin_cache {list(cos_sin_cache.shape)};"
                            " expected the MRoPE table's [max_position, rotary_dim]. Fix: pass the layer's rotary "
                            "embedding's cos_sin_cache and rotary_dim.")
    q, k, v, qk_norm, slots = _qkv(impl, qkv, q_weight, k_weight, rms_norm_eps, layer_slot_mapping)
    rope = CosSinCache(cos_sin_cache, is_neox=is_neox, mrope_section=tuple(mrope_section),
                       mrope_interleaved=is_interleaved)
    rope_and_cache(q, k, v, positions, cos_sin_cache, is_neox, kv_cache, slots, q_out=q_out,
                   k_out=torch.empty_like(k), rope=rope, qk_norm=qk_norm, **_cache_args(impl, layer, kv_cache, layout))


OURS = {"do_rope_and_kv_cache_update": _rope_update, "do_qk_norm_rope_kvcache_update": _qk_norm_rope_update,
        "do_qk_norm_mrope_kvcache_update": _qk_norm_mrope_update}


def _gate(own):
    def gate(self):
        return supported(self) or own(self)
    return gate


def _hook(name, own, layout):
    def hook(self, layer, *args):
        if supported(self):
            return OURS[name](self, layer, *args, layout=layout)
        if own is None:  # vLLM asks the gate first (False here): only a direct call gets this far
            raise NotImplementedError(f"{type(self).__name__}.{name}: this layer is not one ropepool serves "
                                      "(register()'s supported()) and the class has no such hook of its own. Fix: "
                                      f"call it only where {HOOKS[name]}() is True, as vLLM's fusion passes do.")
        return own(self, layer, *args)
    hook.__name__ = name
    return hook


def install(impl_cls, layout: str | None = None) -> None:
    """Route ``impl_cls``'s three fused hooks (``HOOKS``: RoPE + cache write, and QK-norm + RoPE or MRoPE +
    cache write) through ropepool wherever ``supported``; elsewhere the class keeps its own methods (e.g.
    ROCm's AITER kernels, a backend without scale views)."""
    if getattr(impl_cls, "_ropepool_installed", False):
        return
    for name, gate in HOOKS.items():
        setattr(impl_cls, gate, _gate(getattr(impl_cls, gate, lambda self: False)))
        setattr(impl_cls, name, _hook(name, getattr(impl_cls, name, None), layout))
    impl_cls._ropepool_installed = True


def _platform(name: str) -> bool:
    """Whether vLLM runs on its platform ``name`` ("cpu", "cuda": NVIDIA only); False for a vLLM without
    ``vllm.platforms``."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return getattr(current_platform, f"is_{name}")()


def register() -> list[str]:
    """The ``vllm.general_plugins`` entry point: install ropepool on vLLM's CUDA attention backends, their
    fused hooks and, on NVIDIA, the eager route of ``vllm_cuda.register`` (on vLLM's CPU build: on its CPU
    backend and rotary op, ``vllm_cpu.register``).

    vLLM loads general plugins in every process (front end, engine core, workers). Returns the
    names of the backends it installed on; without vLLM it logs why and returns [].
    """
    try:
        importlib.import_module("vllm")
    except ImportError as e:
        log.warning("ropepool: vLLM is not importable (%s); the vLLM adapter was not installed. "
                    "ropepool.integrations.vllm.rope_and_cache can still be called directly.", e)
        return []
    if _platform("cpu"):  # no fusion pass there: vllm_cpu.py says how ropepool is reached
        from . import vllm_cpu

        installed = vllm_cpu.register()
        log.warning("ropepool: RoPE + KV-cache writes of vLLM's CPU backend go through ropepool (%s replaced; "
                    "eager runs, cache dtypes float32/bfloat16/float16 with isa vec, vec16 or amx).",
                    ", ".join(installed))
        return installed
    installed = []
    for module, name in BACKENDS:
        try:
            backend_cls = getattr(importlib.import_module(module), name)
            install(backend_cls.get_impl_cls(), probe_layout(backend_cls))
        except (ImportError, AttributeError, TypeError, RuntimeError) as e:  # a backend this build lacks
            log.info("ropepool: not installed on %s.%s: %s", module, name, e)
            continue
        installed.append(name)
    if _platform("cuda"):  # 0.32 runs the fusion passes on ROCm only: vllm_cuda.py routes eager CUDA runs
        try:
            from . import vllm_cuda

            installed += vllm_cuda.register()
        except (ImportError, AttributeError) as e:  # a build without these backends: the hooks alone
            log.warning("ropepool: the eager CUDA route was not installed: %s", e)
    log.info("ropepool: RoPE + KV-cache writes of %s go through ropepool where supported "
             "(compilation pass_config.fuse_rope_kvcache must be on).", ", ".join(installed) or "no backend")
    return installed
