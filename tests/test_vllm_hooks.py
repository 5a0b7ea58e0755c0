"""vLLM's QK-norm hooks as ``register()`` installs them, against a port of the unfused ops they replace.

vLLM 0.32's ``AttentionImpl`` has three fused hooks (vllm/v1/attention/backend.py); its fusion passes
(vllm/compilation/passes/fusion/qk_norm_rope_kvcache_fusion.py) replace ``split(qkv)``, per-head
``rms_norm`` of q and k, the rotary op and ``unified_kv_cache_update`` with one of them. Here the
QK-norm ones are called on a stand-in impl (tests/test_vllm.py's ``fake_vllm``) with vLLM's cache
layouts and checked against ropepool's float64 oracle, against vLLM's unfused ops (ported,
tests/vllm_reference.py) and against a write done by indexing: every other byte of the cache and
``qkv`` untouched. tests/engines/test_vllm_hooks_engine.py runs the same hooks on vLLM's own impl
classes with vLLM's own ops (its CPU build). No GPU runs either.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: this module tests the torch paths")

import ropepool
from ropepool import reference
from ropepool.integrations import vllm as rv
from tests import vllm_reference as ref
from tests.harness import TOL, assert_close, assert_same_bits
from tests.test_vllm import fake_vllm, make_cache, rand, split  # noqa: F401 (fake_vllm: a fixture)
from tests.torch_fixtures import DEVICE, backend, rng  # noqa: F401

BF16, F32 = torch.bfloat16, torch.float32
HQ, HKV, T, N = 4, 2, 9, 7  # N of the T tokens have slots (two of them -1); T - N are CUDA-graph padding
EPS = 1e-6


def oracle(q, k, positions, table, is_neox, qw, kw, section, interleaved):
    """ropepool's float64 oracle of RoPE(rms_norm(x) * w) for q and k (every token)."""
    f = [x.detach().cpu().float().numpy() for x in (q, k, table, qw, kw)]
    rope = ropepool.CosSinCache(f[2], is_neox=is_neox, mrope_section=section, mrope_interleaved=interleaved)
    pools = [np.zeros((1, k.shape[1], k.shape[2]), np.float32)] * 2
    out = reference.rope_pool_fused(f[0], f[1], f[1], positions.cpu().numpy(), np.full(q.shape[0], -1), *pools,
                                    head_dim=q.shape[2], num_qo_heads=q.shape[1], num_kv_heads=k.shape[1],
                                    rope=rope, qk_norm=ropepool.QKNorm(f[3], f[4], eps=EPS))
    return out[0], out[1]


def unfused(x, w, positions, table, is_neox, section, interleaved):
    """vLLM's unfused ops (ported): rms_norm per head, then forward_native's rotation (MRoPE: its rows)."""
    x = ref.rms_norm(x.cpu(), w.cpu(), EPS)
    if section is None:
        return ref.rotate_native(x, table.cpu(), positions.cpu(), is_neox)
    rows = ref.mrope_rows(table.cpu(), positions.cpu(), section, interleaved)
    return ref.rotate_native(x, rows, torch.arange(x.shape[0]), is_neox)


# (layout, physical order, dtype, head size, rotary dim, pairs, MRoPE section, interleaved)
CASES = [
    pytest.param("packed", "HND", BF16, 128, 128, True, None, False, id="packed-HND-bf16-D128"),
    pytest.param("kv_first", "NHD", F32, 64, 32, False, None, False, id="kv_first-NHD-f32-D64-rot32-gptj"),
    pytest.param("packed", "NHD", F32, 64, 64, True, (8, 12, 12), False, id="packed-NHD-f32-mrope"),
    pytest.param("blocks_first", "HND", BF16, 128, 64, True, (16, 8, 8), True, id="blocks_first-bf16-mrope-il"),
]


@pytest.mark.parametrize("layout, physical, dtype, head_size, rotary_dim, is_neox, section, interleaved", CASES)
def test_qk_norm_hooks(fake_vllm, monkeypatch, layout, physical, dtype, head_size, rotary_dim, is_neox, section,
                       interleaved, backend, rng):
    """do_qk_norm_rope_kvcache_update (section None) and do_qk_norm_mrope_kvcache_update: q_out (and k_out)
    hold RoPE(rms_norm(x) * w) of every token, the padding too, as the ops they replace compute it; the
    cache holds the first N tokens' normalised, rotated keys and their values at their slots (a slot -1
    and the padding write nothing); qkv and every other cache byte are untouched."""
    monkeypatch.setattr(rv, "probe_layout", lambda backend_cls: None)  # the layout read from each cache
    rv.register()
    impl = fake_vllm()
    impl.num_heads, impl.num_kv_heads, impl.head_size = HQ, HKV, head_size
    mrope = section is not None
    assert (impl.fused_qk_norm_mrope_kvcache_supported() if mrope else impl.fused_qk_norm_rope_kvcache_supported())
    qkv = rand(rng, T, (HQ + 2 * HKV) * head_size, dtype=dtype)
    qw, kw = (1 + 0.5 * rand(rng, head_size)).to(dtype), (1 + 0.5 * rand(rng, head_size)).to(dtype)
    table = ref.cos_sin_cache(rotary_dim, 4096).to(DEVICE, dtype)
    positions = torch.randint(0, 4096, (3, T) if mrope else (T,), generator=rng).to(DEVICE)
    slots = torch.randperm(48, generator=rng)[:N]
    slots[[1, 4]] = -1
    slots = slots.to(DEVICE)
    kv_cache = make_cache(layout, physical, 3, 16, HKV, head_size, dtype, rng)
    before, qkv0 = kv_cache.clone(), qkv.clone()
    q_out, k_out = (torch.full((T, h, head_size), float("nan"), dtype=dtype, device=DEVICE) for h in (HQ, HKV))
    layer = types.SimpleNamespace(_k_scale=None, _v_scale=None)
    if mrope:
        impl.do_qk_norm_mrope_kvcache_update(layer, qkv, q_out, positions, qw, kw, EPS, table, is_neox, section,
                                             interleaved, rotary_dim, kv_cache, slots)
    else:
        impl.do_qk_norm_rope_kvcache_update(layer, qkv, q_out, k_out, positions, qw, kw, EPS, table, is_neox,
                                            kv_cache, slots)
    assert_same_bits("qkv (not written)", qkv, qkv0)
    q, k, v = (x.reshape(T, -1, head_size) for x in qkv0.split([HQ * head_size, HKV * head_size] + [HKV * head_size],
                                                                 -1))
    want_q, want_k = oracle(q, k, positions, table, is_neox, qw, kw, section, interleaved)
    k_cache = split(kv_cache, layout, head_size)[0]
    k_rows = torch.stack([k_cache[s // 16, s % 16] for s in slots.tolist() if s >= 0])
    written = [t for t, s in enumerate(slots.tolist()) if s >= 0]
    tol = TOL[str(dtype)[6:]]
    assert_close("q_out (the float64 oracle)", q_out.cpu().float().numpy(), want_q, tol)
    assert_close("cached keys (the float64 oracle)", k_rows.cpu().float().numpy(), want_k[written], tol)
    # vLLM's unfused ops round the normalised row, the gain and each RoPE product to bf16; ropepool once
    atol, rtol = (1e-5, 1e-5) if dtype == F32 else (2 * ref.ATOL[dtype], 2 * ref.RTOL[dtype])
    for name, got, x, w in (("q_out", q_out, q, qw), ("cached keys", k_rows, k[written], kw)):
        pos = positions[..., written] if name == "cached keys" else positions
        want = unfused(x, w, pos, table, is_neox, section, interleaved)
        torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol, msg=f"{name} vs vLLM's unfused ops")
    if not mrope:
        assert_same_bits("cached keys == k_out", k_rows, k_out[written])
        assert_close("k_out (the float64 oracle)", k_out.cpu().float().numpy(), want_k, tol)
    want_cache = before.clone()
    for view, rows in zip(split(want_cache, layout, head_size), (k_rows, v[written])):
        for row, s in zip(rows, [s for s in slots.tolist() if s >= 0]):
            view[s // 16, s % 16] = row  # the write done by indexing: keys as written, values as given
    assert_same_bits("kv_cache (written rows, the rest untouched)", kv_cache, want_cache)


def test_qk_norm_hooks_leave_other_layers_to_vllm(fake_vllm):
    """A layer ropepool does not serve keeps vLLM's gate (False here) and, called anyway, a clear error."""
    rv.register()
    impl = fake_vllm("int4_per_token_head")
    assert not impl.fused_qk_norm_rope_kvcache_supported() and not impl.fused_qk_norm_mrope_kvcache_supported()
    with pytest.raises(NotImplementedError, match=r"do_qk_norm_rope_kvcache_update: this layer is not one "):
        impl.do_qk_norm_rope_kvcache_update(*[None] * 12)


def test_mrope_rotary_dim_must_be_the_table_width(fake_vllm):
    rv.register()
    impl = fake_vllm()
    impl.num_heads, impl.num_kv_heads, impl.head_size = HQ, HKV, 64
    with pytest.raises(ValueError, match=r"^rotary_dim 32 is not the width of cos_sin_cache \[16, 64\]"):
        impl.do_qk_norm_mrope_kvcache_update(None, None, None, None, None, None, EPS, torch.zeros(16, 64), True,
                                             (8, 12, 12), False, 32, None, None)
