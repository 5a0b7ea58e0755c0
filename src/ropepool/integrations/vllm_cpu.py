"""vLLM's CPU backend: each attention layer's RoPE and KV-cache write done by one ropepool call.

vLLM 0.32 reaches a fused RoPE + cache write only through its compilation passes
(``pass_config.fuse_rope_kvcache``), and those are built for ROCm and CUDA alone: on the
CPU platform ``PassConfig.__post_init__`` turns them off and the pass manager does not
import them. So on CPU the plugin routes the unfused pair itself, through vLLM's public
extension points (and one of torch's), registered by ``register()`` in every vLLM process:

- ``CustomOp.register_oot(name="RotaryEmbedding")``: the model's rotary op becomes
  ``DeferredRotaryEmbedding``. When every attention layer of the running model is served
  by ropepool (vLLM's forward context lists them) it rotates nothing and leaves the table,
  the positions and the key it was given for the attention layer that comes next.
  ``(name="DeepseekScalingRotaryEmbedding")`` does the same for DeepSeek's YaRN rotary, handing over
  the ``RopeSpec`` of its parameters (``deepseek_yarn_spec``) instead of its table.
- ``CustomOp.register_oot(name="MRotaryEmbedding")``: the same for vLLM's multimodal rotary op (Qwen2-VL,
  Qwen2.5-VL, Qwen3-VL: ``[3, T]`` positions), its table handed on as a ``CosSinCache`` with the op's
  ``mrope_section`` and ``mrope_interleaved`` (``mrope_rope``).
- ``register_backend(AttentionBackendEnum.CPU_ATTN, ...)``: vLLM's CPU attention backend
  becomes ``CPUBackend``, the same backend whose layers do their own cache write
  (``forward_includes_kv_cache_update``): one ``rope_and_cache`` call rotates q and k in
  place and writes k and v into the cache, then vLLM's own CPU attention kernel runs.
  vLLM's CPU cache keeps each block's keys transposed (``[head_size, block_size]`` per head,
  isa vec / vec16) and its values as rows: ropepool writes the keys through a transposed view,
  an HND pool whose head dim is strided (``cache_views(..., "cpu")``). With isa amx (bfloat16 on
  an AMX CPU, head size a multiple of 32) each block's keys and values are packed in AMX tiles:
  ropepool writes them as ``kv_layout="amx"`` (``cache_views(..., "cpu_amx")``, docs/layouts.md).
  Other ISAs (neon, vxe, ...) stay vLLM's, with a warning.

- ``CustomOp.register_oot(name="RMSNorm")`` and ``(name="GemmaRMSNorm")``: a per-head q/k norm
  (an attention module's ``q_norm`` / ``k_norm``: Qwen3, Gemma 3, ...) normalises nothing
  either; the attention layer passes the norms' weights as ``qk_norm=`` to the same call, so
  norm, RoPE and write are one ropepool call. Which norms are q/k norms is read when the
  model is built: torch's public module-registration hook sees each ``self.q_norm = ...``.
- ``register_backend(AttentionBackendEnum.AMX_MLA / CPU_MLA, ...)``: vLLM's CPU MLA backends
  get an impl whose latent-cache write (``do_kv_cache_update``) makes one ``rope_latent_fused``
  call with the deferred q_pe / k_pe rotation (DeepSeek V2/V3 shaped models; vllm_cpu_mla.py).

The deferring ops (``register_ops``), ``take_pending`` and ``route_write`` also serve eager CUDA runs
(vllm_cuda.py), whose write is FlashAttention's / Triton attention's ``do_kv_cache_update``.

A deferred rotation or norm that no ropepool layer takes (a model that changes q or k between
norm, RoPE and attention) raises instead of running unrotated or unnormalised. Compiled runs (no
``enforce_eager``) rotate and write as vLLM does: dynamo would trace the deferral away.
"""
from __future__ import annotations

import logging
import os
import types
import weakref

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import DeepseekScalingRotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from ..errors import RopePoolError
from ..rotation.norm import QKNorm
from ..rotation.spec import CosSinCache, RopeSpec
from .vllm import _table, layer_rope_and_cache

log = logging.getLogger(__name__)
# isa -> the cache layout of its cpu_attn_reshape_and_cache write (vllm.LAYOUTS), probed byte for byte against vLLM's
# (tests/engines/test_vllm_engine.py)
ISAS = {"vec": "cpu", "vec16": "cpu", "amx": "cpu_amx"}

# The rotation left for the next attention layer: (key's data pointer, positions, rope= (a CosSinCache of vLLM's
# table, or a RopeSpec), norms, query).
_pending: list = []
# The q/k norms left for the next rotary op: "q" / "k" -> (data pointer of the tensor not normalised, norm module).
_norms: dict = {}
# Whether a q/k norm ran vLLM's own op since the last attention layer (counted, ROPEPOOL_VLLM_CALLS).
_vllm_norm: list = []
# id(forward context's layer dict) -> whether every attention layer in it is ropepool's.
_served: dict = {}
# [weak reference to the forward context, every attention layer ropepool's, ROPEPOOL_VLLM_CALLS] of the running
# step, made at its first layer (weak: the step's metadata goes when vLLM drops it, not at our next step).
_step: list = [lambda: None, False, None]


def served_here(layer) -> bool:
    """Whether ropepool does this attention layer's RoPE and write: decoder attention writing its own
    unquantized cache (vLLM's fp8 writes have their own rounding, left to vLLM) in a layout the route's impl
    names (``ropepool_layout``: on CPU from ``layer.isa``, set by vLLM's CPU metadata builder)."""
    impl = layer.impl
    if getattr(impl, "ropepool_latent", False):  # MLA: rows of kv_lora_rank + rope dim, bfloat16 or float32
        return impl.kv_cache_dtype == "auto"
    return (hasattr(impl, "ropepool_layout") and impl.ropepool_layout(layer) is not None
            and impl.attn_type == AttentionType.DECODER and impl.kv_sharing_target_layer_name is None
            and impl.kv_cache_dtype in ("auto", "float32", "bfloat16", "float16"))


def _model_served() -> bool:
    """Whether ropepool does the RoPE and write of every attention layer of the running step."""
    if not is_forward_context_available():
        return False
    ctx = get_forward_context()
    return (_step if ctx is _step[0]() else _new_step(ctx))[1]


def _new_step(ctx) -> list:
    """``_step`` made for the forward context ``ctx`` (once per step; each layer reads it while ``ctx`` is
    ``_step[0]()``)."""
    # a dummy run (no metadata) writes nothing (MLA would not reach its write): vLLM rotates
    _step[:] = (weakref.ref(ctx), ctx.attn_metadata is not None and _layers_served(ctx.no_compile_layers),
                os.environ.get("ROPEPOOL_VLLM_CALLS"))
    return _step


def _calls_path():
    """ROPEPOOL_VLLM_CALLS as the running step read it (outside a step: now)."""
    if is_forward_context_available():
        ctx = get_forward_context()
        return (_step if ctx is _step[0]() else _new_step(ctx))[2]
    return os.environ.get("ROPEPOOL_VLLM_CALLS")


def _layers_served(layers) -> bool:
    hit = _served.get(id(layers))
    if hit is None or hit[0] is not layers:
        attn = [m for m in layers.values() if hasattr(m, "impl")]
        for name, m in layers.items():  # an MLA impl's write is not given its layer: it counts by this name
            if hasattr(m, "impl"):
                m.impl._ropepool_name = name
        isas = {getattr(m, "isa", None) for m in attn if isinstance(m.impl, CPUImpl)} - set(ISAS)
        if isas:
            log.warning("ropepool: vLLM's CPU attention lays its cache out for isa %s here; ropepool writes isa "
                        "%s only, so vLLM does RoPE and the cache writes itself.",
                        sorted(map(str, isas)), " / ".join(ISAS))
        hit = _served[id(layers)] = (layers, bool(attn) and all(served_here(m) for m in attn))
    return hit[1]


def _eager(x) -> bool:
    """An eager call on the CPU, or on a CUDA device outside graph capture (a captured graph would replay
    kernels chosen from this Python state: vLLM rotates and writes there)."""
    # (is_cpu / is_cuda: ~0.06 us each where x.device.type makes a device, ~0.4)
    return not torch.compiler.is_compiling() and (
        x.is_cpu or (x.is_cuda and not torch.cuda.is_current_stream_capturing()))


def _never_applied(what: str):
    raise RopePoolError(f"a {what} deferred to the next attention layer was never applied: some layer between it "
                         "and attention changed q or k. Fix: serve this model without ropepool (VLLM_PLUGINS='' or "
                         "a VLLM_PLUGINS list without ropepool).")


class _DeferredQKNorm:
    """vLLM's RMS norms; a per-head q/k norm among them (``_tag``) is left to the next ropepool attention layer."""

    offset = 0.0  # QKNorm.weight_offset: the gain is offset + weight


def _deferred_norm(self, x, *args, **kwargs):
    """A q/k norm's forward: deferred to be fused with RoPE and the write where ropepool can, else vLLM's op."""
    if (not args and not kwargs and x.dim() == 3 and x.shape[-1] == self._ropepool_width and _eager(x)
            and _model_served()):
        role = self._ropepool_role
        if role in _norms:
            _never_applied("q/k norm")
        _norms[role] = (x.data_ptr(), self)
        return x
    _vllm_norm.append(self._ropepool_role)
    return type(self).forward(self, x, *args, **kwargs)


class DeferredRMSNorm(_DeferredQKNorm, RMSNorm):
    """vLLM's ``RMSNorm`` (Qwen3's q/k norms: ``x * rsqrt(mean(x^2) + eps) * w``)."""


class DeferredGemmaRMSNorm(_DeferredQKNorm, GemmaRMSNorm):
    """vLLM's ``GemmaRMSNorm`` (Gemma 3's q/k norms: the gain is ``1 + w``)."""

    offset = 1.0


def _tag(module, name, submodule):
    """torch's module-registration hook: an attention module's ``q_norm`` / ``k_norm`` gets ``_deferred_norm`` as
    its forward, other norms none (a norm over all heads, as OLMo 2 has, is told apart at the call by its width)."""
    if name in ("q_norm", "k_norm") and isinstance(submodule, _DeferredQKNorm):
        weight = submodule.weight
        one = weight.dim() == 1 and getattr(submodule, "variance_size_override", None) is None
        submodule._ropepool_role = name[0]
        submodule._ropepool_width = weight.shape[0] if one else None
        submodule.forward = types.MethodType(_deferred_norm, submodule)


def _take_norms(query, key):
    """The deferred q and k norms if they were deferred for exactly this query and key (else raises)."""
    q, k = _norms.pop("q", None), _norms.pop("k", None)
    _norms.clear()
    if q is None or k is None or q[0] != query.data_ptr() or key is None or k[0] != key.data_ptr():
        _never_applied("q/k norm")
    return q[1], k[1]


class _DeferredRope:
    """A vLLM rotary op whose rotation the next ropepool attention layer does, with ``_ropepool_rope(query)``."""

    def forward(self, positions, query, key=None, *args, **kwargs):
        norms = _take_norms(query, key) if _norms else None
        if key is None or args or kwargs or not _eager(query) or not _model_served():
            if norms is not None:
                _never_applied("q/k norm")
            return super().forward(positions, query, key, *args, **kwargs)
        if _pending:
            _never_applied("RoPE")
        _pending.append((key.data_ptr(), positions, self._ropepool_rope(query), norms, query))
        return query, key

    def _ropepool_rope(self, query):
        """The rope= of vLLM's table as ``_match_cos_sin_cache_dtype`` gives it for ``query``, kept with the table,
        dtype and device it was made for (a later call reads the buffer dict only: ``self.cos_sin_cache`` costs
        ~0.9 us through nn.Module's ``__getattr__``, that method ~2.4)."""
        held = self.__dict__.get("_ropepool_held")
        if held is None or held[0] is not self._buffers.get("cos_sin_cache") or held[1] is not query.dtype or \
                held[2] != query.get_device():
            table = self._match_cos_sin_cache_dtype(query)
            held = self.__dict__["_ropepool_held"] = (table, query.dtype, query.get_device(), self._rope_of(table))
        return held[3]


class DeferredRotaryEmbedding(_DeferredRope, RotaryEmbedding):
    """vLLM's ``RotaryEmbedding``: ropepool rotates with vLLM's own cos/sin table."""

    def _rope_of(self, table):
        return _table(table, self.is_neox_style)


class DeferredMRotaryEmbedding(_DeferredRope, MRotaryEmbedding):
    """vLLM's ``MRotaryEmbedding`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: ``[3, T]`` positions, each frequency taking
    the time, height or width row by ``mrope_section``, chunked or ``mrope_interleaved``): ropepool rotates with
    vLLM's own table read through ``mrope_rope``."""

    def _rope_of(self, table):
        return mrope_rope(self, table)


def mrope_rope(rope, table) -> CosSinCache:
    """The ``CosSinCache`` of vLLM's ``MRotaryEmbedding`` ``rope`` over its table ``table``: vLLM's sections and
    interleaving (mrope.py's forward_native: chunks ``split(mrope_section)``, or ``apply_interleaved_rope``'s
    T H W T H W ...) are ropepool's ``mrope_section`` / ``mrope_interleaved``; one per table, kept on ``rope``."""
    held = rope.__dict__.get("_ropepool_mrope")
    if held is None or held.cos_sin_cache is not table:
        section = tuple(rope.mrope_section) if rope.mrope_section else None  # None: 1-D positions only
        held = CosSinCache(table, is_neox=rope.is_neox_style, mrope_section=section,
                           mrope_interleaved=rope.mrope_interleaved and bool(section))
        rope.__dict__["_ropepool_mrope"] = held
    return held


def deepseek_yarn_spec(rope) -> RopeSpec:
    """The ``RopeSpec`` of vLLM's ``DeepseekScalingRotaryEmbedding`` (deepseek_scaling_rope.py): YaRN over its
    ``max_position_embeddings`` (the checkpoint's original_max_position_embeddings), its factor and betas, and as
    attention factor its ``mscale`` (``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)``),
    which vLLM multiplies into cos and sin."""
    return RopeSpec(head_dim=rope.head_size, rotary_dim=rope.rotary_dim, base=rope.base,
                    style="neox" if rope.is_neox_style else "gptj",
                    scaling={"rope_type": "yarn", "factor": float(rope.scaling_factor), "beta_fast": rope.beta_fast,
                             "beta_slow": rope.beta_slow, "attention_factor": float(rope.mscale),
                             "original_max_position_embeddings": rope.max_position_embeddings})


class DeferredDeepseekScalingRotaryEmbedding(_DeferredRope, DeepseekScalingRotaryEmbedding):
    """vLLM's DeepSeek YaRN rotary (DeepSeek V2/V3 with rope_scaling yarn): ropepool rotates with the RopeSpec of
    its parameters (computed cos and sin; vLLM's table holds them rounded to the model dtype)."""

    def _ropepool_rope(self, query):
        spec = self.__dict__.get("_ropepool_spec")
        if spec is None:
            spec = self.__dict__["_ropepool_spec"] = deepseek_yarn_spec(self)
        return spec


def _count(path: str, name: str, route: str, q, k, norm: str, n: int | None = None) -> None:
    """With ROPEPOOL_VLLM_CALLS=path (called only then), one line per layer call: pid, tp rank, layer, route,
    tokens (q's, or ``n``), heads, and who normalised q and k since the last layer (``ropepool``: in this call;
    ``vllm``: vLLM's norm op; ``-``)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    with open(path, "a") as f:
        f.write(f"{os.getpid()} {get_tensor_model_parallel_rank()} {name} {route} "
                f"{q.shape[0] if n is None else n} {q.shape[1]} {k.shape[1]} {norm}\n")


def _qk_norm(impl, norms) -> QKNorm:
    """The layer's ``QKNorm`` from its deferred q and k norm modules (built once per layer)."""
    held = getattr(impl, "_ropepool_norm", None)
    if held is None or held[0] is not norms[0] or held[1] is not norms[1]:
        q, k = norms
        held = impl._ropepool_norm = (q, k, QKNorm(q.weight, k.weight, eps=q.variance_epsilon, weight_offset=q.offset))
    return held[2]


def take_pending(layer, key):
    """The rotation deferred for this layer (None: vLLM's rotary op rotated) and who normalised q and k (``_count``);
    raises where it was deferred for another key."""
    pending = _pending.pop() if _pending else None
    if _norms or (pending is not None and (key is None or pending[0] != key.data_ptr())):
        raise RopePoolError(f"layer {layer.layer_name}: the key given to attention is not the one RoPE or its "
                            "q/k norm was deferred for. Fix: serve this model without ropepool (VLLM_PLUGINS='').")
    if _vllm_norm:
        _vllm_norm.clear()
        return pending, "vllm"
    return pending, "-"


def route_write(impl, layer, pending, vllm_norm, query, key, value, kv_cache, slots, vllm_write, calls) -> None:
    """A layer's cache write: ``vllm_write`` (vLLM's own) where vLLM rotated, else the deferred norm, RoPE and write
    by one ropepool call into the layout ``impl.ropepool_layout(layer)`` (its runner bound to ``impl`` after a first
    checked call: ``layer_rope_and_cache``); counted in the file ``calls`` where there is one (``_count``)."""
    if pending is None:
        vllm_write(layer, key, value, kv_cache, slots)
        if calls:
            _count(calls, layer.layer_name, "vllm", query, key, vllm_norm, slots.shape[0])
        return
    _, positions, rope, norms, _ = pending
    qk_norm = None if norms is None else _qk_norm(impl, norms)
    layer_rope_and_cache(impl, query, key, value, positions, kv_cache, slots, layout=impl.ropepool_layout(layer),
                         rope=rope, qk_norm=qk_norm)
    if calls:
        _count(calls, layer.layer_name, "ropepool", query, key, vllm_norm if qk_norm is None else "ropepool",
               slots.shape[0])


class CPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, its RoPE and cache write done first by one ropepool call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (the layer writes a cache of its own: decoder attention, no other layer's cache; fixed when vLLM builds it)
        self._ropepool_writes = self.attn_type not in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER) and \
            self.kv_sharing_target_layer_name is None

    def ropepool_layout(self, layer):
        return ISAS.get(getattr(layer, "isa", None))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        pending, vllm_norm = take_pending(layer, key)
        if attn_metadata is not None and self._ropepool_writes:
            ctx = get_forward_context()
            slots = ctx.slot_mapping.get(layer.layer_name)
            if slots is not None:
                route_write(self, layer, pending, vllm_norm, query, key, value, kv_cache, slots,
                            self.do_kv_cache_update, (_step if ctx is _step[0]() else _new_step(ctx))[2])
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                               output_block_scale)


class CPUBackend(CPUAttentionBackend):
    """vLLM's CPU_ATTN backend whose layers write their own cache (in ``CPUImpl.forward``)."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls():
        return CPUImpl


OPS = (RotaryEmbedding, RMSNorm, GemmaRMSNorm, MRotaryEmbedding, DeepseekScalingRotaryEmbedding)


def register_ops() -> list[str]:
    """Install the deferring rotary and q/k norm ops (every route's; once per process); their names."""
    if not getattr(register_ops, "done", False):
        for ours, theirs in zip((DeferredRotaryEmbedding, DeferredRMSNorm, DeferredGemmaRMSNorm,
                                 DeferredMRotaryEmbedding, DeferredDeepseekScalingRotaryEmbedding), OPS):
            CustomOp.register_oot(ours, name=theirs.__name__)
            ours.name = theirs.name  # register_oot renames it; keep vLLM's custom_ops switch
        torch.nn.modules.module.register_module_module_registration_hook(_tag)
        register_ops.done = True
    return [op.__name__ for op in OPS]


def register() -> list[str]:
    """Install on vLLM's CPU platform (once per process); the names of what was installed."""
    if not getattr(register, "done", False):
        for enum, ours in ((AttentionBackendEnum.CPU_ATTN, f"{__name__}.CPUBackend"),
                           (AttentionBackendEnum.AMX_MLA, f"{__package__}.vllm_cpu_mla.AMXMLA"),
                           (AttentionBackendEnum.CPU_MLA, f"{__package__}.vllm_cpu_mla.CPUMLA")):
            register_backend(enum, ours)
        register.done = True
    return ["CPU_ATTN", "AMX_MLA", "CPU_MLA", *register_ops()]
