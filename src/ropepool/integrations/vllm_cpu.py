"""vLLM's CPU backend: each attention layer's RoPE and KV-cache write done by one ropepool call.

vLLM 0.32 reaches a fused RoPE + cache write only through its compilation passes
(``pass_config.fuse_rope_kvcache``), and those are built for ROCm and CUDA alone: on the
CPU platform ``PassConfig.__post_init__`` turns them off and the pass manager does not
import them. So on CPU the plugin routes the unfused pair itself, through two of vLLM's
public extension points, registered by ``register()`` in every vLLM process:

- ``CustomOp.register_oot(name="RotaryEmbedding")``: the model's rotary op becomes
  ``DeferredRotaryEmbedding``. When every attention layer of the running model is served
  by ropepool (vLLM's forward context lists them) it rotates nothing and leaves the table,
  the positions and the key it was given for the attention layer that comes next.
- ``register_backend(AttentionBackendEnum.CPU_ATTN, ...)``: vLLM's CPU attention backend
  becomes ``CPUBackend``, the same backend whose layers do their own cache write
  (``forward_includes_kv_cache_update``): one ``rope_and_cache`` call rotates q and k in
  place and writes k and v into the cache, then vLLM's own CPU attention kernel runs.
  vLLM's CPU cache keeps each block's keys transposed (``[head_size, block_size]`` per head,
  isa vec / vec16) and its values as rows: ropepool writes the keys through a transposed view,
  an HND pool whose head dim is strided (``cache_views(..., "cpu")``). The AMX layout (isa amx,
  bfloat16 on an AMX CPU) packs differently: those layers stay vLLM's, with a warning.

A deferred rotation that no ropepool layer takes (a model that changes q or k between
RoPE and attention) raises instead of running unrotated. Compiled runs (no
``enforce_eager``) rotate and write as vLLM does: dynamo would trace the deferral away.
"""
from __future__ import annotations

import logging
import os

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from ..errors import RopePoolError
from .vllm import rope_and_cache

log = logging.getLogger(__name__)
ISAS = ("vec", "vec16")  # the cpu_attn_reshape_and_cache layouts probed (tests/engines/test_vllm_engine.py)

# The rotation left for the next attention layer: (key's data pointer, positions, table, is_neox).
_pending: list = []
# id(forward context's layer dict) -> whether every attention layer in it is ropepool's.
_served: dict = {}


def served_here(layer) -> bool:
    """Whether ropepool does this attention layer's RoPE and write: decoder attention writing its own
    unquantized cache (vLLM's CPU fp8 write has its own rounding, left to vLLM) in a layout probed
    (``layer.isa``, set by vLLM's CPU metadata builder)."""
    impl = layer.impl
    return (isinstance(impl, CPUImpl) and impl.attn_type == AttentionType.DECODER
            and getattr(layer, "isa", None) in ISAS and impl.kv_sharing_target_layer_name is None
            and impl.kv_cache_dtype in ("auto", "float32", "bfloat16", "float16"))


def _model_served() -> bool:
    if not is_forward_context_available():
        return False
    layers = get_forward_context().no_compile_layers
    hit = _served.get(id(layers))
    if hit is None or hit[0] is not layers:
        attn = [m for m in layers.values() if hasattr(m, "impl")]
        isas = {getattr(m, "isa", None) for m in attn if isinstance(m.impl, CPUImpl)} - set(ISAS)
        if isas:
            log.warning("ropepool: vLLM's CPU attention packs its cache for isa %s here (bfloat16 on an AMX CPU: "
                        "'amx'); ropepool writes isa %s only, so vLLM does RoPE and the cache writes itself.",
                        sorted(map(str, isas)), " / ".join(ISAS))
        hit = _served[id(layers)] = (layers, bool(attn) and all(served_here(m) for m in attn))
    return hit[1]


class DeferredRotaryEmbedding(RotaryEmbedding):
    """vLLM's ``RotaryEmbedding`` whose rotation the next ropepool attention layer does."""

    def forward(self, positions, query, key=None, *args, **kwargs):
        if (key is None or args or kwargs or query.device.type != "cpu" or torch.compiler.is_compiling()
                or not _model_served()):
            return super().forward(positions, query, key, *args, **kwargs)
        if _pending:
            raise RopePoolError("a RoPE deferred to the next attention layer was never applied: some layer "
                                "between RoPE and attention changed the key. Fix: serve this model without "
                                "ropepool (VLLM_PLUGINS='' or a VLLM_PLUGINS list without ropepool).")
        _pending.append((key.data_ptr(), positions, self._match_cos_sin_cache_dtype(query), self.is_neox_style))
        return query, key


def _count(layer, route: str, q, k) -> None:
    """With ROPEPOOL_VLLM_CALLS=path, one line per layer call: pid, tp rank, layer, route, tokens, heads."""
    path = os.environ.get("ROPEPOOL_VLLM_CALLS")
    if path:
        from vllm.distributed import get_tensor_model_parallel_rank

        with open(path, "a") as f:
            f.write(f"{os.getpid()} {get_tensor_model_parallel_rank()} {layer.layer_name} {route} {q.shape[0]} "
                    f"{q.shape[1]} {k.shape[1]}\n")


class CPUImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, its RoPE and cache write done first by one ropepool call."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        pending = _pending.pop() if _pending else None
        if pending is not None and (key is None or pending[0] != key.data_ptr()):
            raise RopePoolError(f"layer {layer.layer_name}: the key given to attention is not the one RoPE was "
                                "deferred for. Fix: serve this model without ropepool (VLLM_PLUGINS='').")
        if attn_metadata is not None and self.attn_type not in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER) \
                and self.kv_sharing_target_layer_name is None:
            slots = get_forward_context().slot_mapping.get(layer.layer_name)
            if slots is not None:
                n = slots.shape[0]
                if pending is None:  # rotated by vLLM's rotary op: vLLM's own write
                    self.do_kv_cache_update(layer, key, value, kv_cache, slots)
                    _count(layer, "vllm", query[:n], key)
                else:
                    _, positions, table, is_neox = pending
                    rope_and_cache(query, key, value, positions, table, is_neox, kv_cache, slots, layout="cpu")
                    _count(layer, "ropepool", query[:n], key)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                               output_block_scale)


class CPUBackend(CPUAttentionBackend):
    """vLLM's CPU_ATTN backend whose layers write their own cache (in ``CPUImpl.forward``)."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls():
        return CPUImpl


def register() -> list[str]:
    """Install on vLLM's CPU platform (once per process); the names of what was installed."""
    if not getattr(register, "done", False):
        CustomOp.register_oot(DeferredRotaryEmbedding, name="RotaryEmbedding")
        DeferredRotaryEmbedding.name = RotaryEmbedding.name  # register_oot renames it; keep vLLM's custom_ops switch
        register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.CPUBackend")
        register.done = True
    return ["CPU_ATTN", "RotaryEmbedding"]
