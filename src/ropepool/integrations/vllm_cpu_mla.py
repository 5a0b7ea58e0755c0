"""vLLM's CPU MLA backends (AMX_MLA, CPU_MLA: DeepSeek V2/V3 shaped models): the latent-cache write
(``do_kv_cache_update``) makes one ``rope_latent_fused`` call with the q_pe / k_pe rotation that vllm_cpu.py's
rotary op deferred; installed by ``vllm_cpu.register``."""
from __future__ import annotations

from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend, AMXMLAImpl
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from ..api import rope_latent_fused
from ..errors import RopePoolError
from .vllm_cpu import _calls_path, _count, _pending


class _MLARoute:
    """vLLM's CPU MLA impl (AMX_MLA, CPU_MLA) whose latent-cache write also rotates q_pe and k_pe, deferred by
    the rotary op: one ``rope_latent_fused`` call (q_pe rotated in place in vLLM's q, k_pe rotated and written
    with the latent row). vLLM calls this write before the layer's attention reads q, k_pe or the cache."""

    ropepool_latent = True  # (served_here: a latent cache)

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        pending = _pending.pop() if _pending else None
        name, calls = getattr(self, "_ropepool_name", "?"), _calls_path()
        if pending is None:  # rotated by vLLM's rotary op: vLLM's own write
            super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
            if calls:
                _count(calls, name, "vllm", k_pe, k_pe, "-")
            return
        _, positions, rope, _, q_pe = pending
        if pending[0] != k_pe.data_ptr():
            raise RopePoolError(f"layer {name}: the key given to attention is not the one RoPE or its q/k norm was "
                                "deferred for. Fix: serve this model without ropepool (VLLM_PLUGINS='').")
        rank, kpe = kv_c_normed.shape[-1], k_pe.squeeze(1)  # [T, rope_dim]: one head
        _, k_rot, _, _ = rope_latent_fused(q_pe, kpe, kv_c_normed, positions, slot_mapping.flatten(),
                                           kv_cache[..., :rank], kv_cache[..., rank:], rope=rope,
                                           kv_layout="NHD", q_pe_out=q_pe)
        kpe.copy_(k_rot)  # the layer's attention reads k_pe too (prefill)
        if calls:
            _count(calls, name, "ropepool", q_pe, k_pe, "-")


class AMXMLARoute(_MLARoute, AMXMLAImpl):
    pass


class CPUMLARoute(_MLARoute, CPUMLAImpl):
    pass


class AMXMLA(AMXMLABackend):
    @staticmethod
    def get_impl_cls():
        return AMXMLARoute


class CPUMLA(CPUMLABackend):
    @staticmethod
    def get_impl_cls():
        return CPUMLARoute
