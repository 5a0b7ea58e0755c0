"""vLLM's CUDA backends (FlashAttention, Triton attention): each attention layer's RoPE and KV-cache write done
by one ropepool call, in eager runs.

vLLM 0.32 calls its fused hooks (``do_rope_and_kv_cache_update``, vllm.py) only on ROCm:
``PassConfig.__post_init__`` (vllm/config/compilation.py) turns ``fuse_rope_kvcache`` and
``fuse_qk_norm_rope_kvcache`` off on every other platform. So on CUDA the plugin takes the CPU route's
deferral (vllm_cpu.py: vLLM's rotary and q/k norm ops registered out of tree, leaving the rotation for the
layer's attention) and differs only in where the write happens. FlashAttention and Triton attention keep vLLM's
own order: the attention layer calls ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``
(vllm/model_executor/layers/attention/attention.py, ``unified_kv_cache_update``), then ``impl.forward``. The
route's impl overrides the first: it rotates the deferred query (the tensor vLLM's rotary op was given, whose
view attention receives) and key in place and writes keys and values into vLLM's cache
(``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, rope_and_cache's ``"packed"``), one ropepool call;
its ``forward`` checks that attention reads that query. Only the first ``len(slot_mapping)`` tokens are
rotated and written (the rest is padding, which attention does not read).

``register_backend(AttentionBackendEnum.FLASH_ATTN / TRITON_ATTN, ...)`` installs it (``register()``, on
vLLM's CUDA platform only). Not deferred, vLLM's own path: compiled runs (dynamo traces vLLM's ops) and CUDA
graph capture. Tested on CPU tensors through vLLM's own impl classes; never run on a GPU (docs/engines.md).
"""
from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from ..errors import RopePoolError
from .vllm_cpu import _calls_path, register_ops, route_write, take_pending


class _CudaRoute:
    """A CUDA attention impl whose cache write also does the rotation deferred by the rotary op."""

    _ropepool_query = None  # data pointer of the query rotated by the last write, until forward reads it

    def ropepool_layout(self, layer):
        return "packed"  # vLLM 0.32's CUDA cache; per-token-head rows (Triton) are not unquantized: vLLM's

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        pending, vllm_norm = take_pending(layer, key)
        query = None
        if pending is not None:  # the query vLLM's rotary op was given; attention views it [T, heads, head_size]
            query = pending[4].view(pending[4].shape[0], self.num_heads, self.head_size)
            self._ropepool_query = query.data_ptr()
        route_write(self, layer, pending, vllm_norm, key if query is None else query, key, value, kv_cache,
                    slot_mapping, super().do_kv_cache_update, _calls_path())

    def forward(self, layer, query, *args, **kwargs):
        rotated, self._ropepool_query = self._ropepool_query, None
        if rotated is not None and query.data_ptr() != rotated:
            raise RopePoolError(f"layer {layer.layer_name}: the query given to attention is not the one RoPE was "
                                "deferred for. Fix: serve this model without ropepool (VLLM_PLUGINS='').")
        return super().forward(layer, query, *args, **kwargs)


class FlashAttentionRoute(_CudaRoute, FlashAttentionImpl):
    pass


class TritonAttentionRoute(_CudaRoute, TritonAttentionImpl):
    pass


class FlashAttention(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return FlashAttentionRoute


class TritonAttention(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TritonAttentionRoute


def register() -> list[str]:
    """Install on vLLM's CUDA platform (once per process); the names of what was installed."""
    if not getattr(register, "done", False):
        for enum, ours in ((AttentionBackendEnum.FLASH_ATTN, FlashAttention),
                           (AttentionBackendEnum.TRITON_ATTN, TritonAttention)):
            register_backend(enum, f"{__name__}.{ours.__name__}")
        register.done = True
    return ["FLASH_ATTN", "TRITON_ATTN", *register_ops()]
