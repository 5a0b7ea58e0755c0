"""The Triton kernel on a real GPU against the float64 oracle (skipped without CUDA)."""
import numpy as np
import pytest
import torch

import ropepool
from tests.util import assert_close, oracle, to_numpy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"


def make(T, Hq, Hkv, D, dtype, pool_size, idx=torch.int32, max_pos=1_000_000, gen=None, fused_qkv=True):
    gen = gen or torch.Generator().manual_seed(T * 31 + Hq * 7 + D)
    if fused_qkv:  # views of one projection output: token stride (Hq + 2 Hkv) * D
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(DEV, dtype)
        q, k, v = (t.view(T, h, D) for t, h in zip(qkv.split([Hq * D, Hkv * D, Hkv * D], -1), (Hq, Hkv, Hkv)))
    else:
        q, k, v = (torch.randn(T, h, D, generator=gen).to(DEV, dtype) for h in (Hq, Hkv, Hkv))
    pos = torch.randint(0, max_pos, (T,), generator=gen).to(DEV, idx)
    slots = torch.randperm(pool_size, generator=gen)[:T]
    slots[::5] = -1
    return q, k, v, pos, slots.to(DEV, idx)


def run_and_check(q, k, v, pos, slots, k_pool, v_pool, **kw):
    """Call the kernel on poisoned outputs; compare everything with the oracle."""
    before_k, before_v = k_pool.clone(), v_pool.clone()
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()
    q_rot, k_rot, kp, vp = ropepool.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, **kw)
    assert kp is k_pool and vp is v_pool
    assert torch.equal(q, q_in) and torch.equal(k, k_in) and torch.equal(v, v_in)
    ref = oracle(q, k, v, pos, slots, before_k, before_v, **kw)
    assert_close("q_rot", q_rot, ref[0], q.dtype)
    assert_close("k_rot", k_rot, ref[1], q.dtype)
    # Written rows hold exactly k_rot and v; the rest is untouched, bit for bit.
    w = slots.long()[slots >= 0]
    assert torch.equal(k_pool[w].view(torch.uint8), k_rot[slots >= 0].view(torch.uint8))
    assert torch.equal(v_pool[w].view(torch.uint8), v[slots >= 0].contiguous().view(torch.uint8))
    keep = torch.ones(k_pool.shape[0], dtype=torch.bool, device=DEV)
    keep[w] = False
    assert torch.equal(k_pool[keep].view(torch.uint8), before_k[keep].view(torch.uint8))
    assert torch.equal(v_pool[keep].view(torch.uint8), before_v[keep].view(torch.uint8))
    return q_rot, k_rot


def poisoned_pool(P, Hkv, D, dtype):
    p = torch.randn(P, Hkv, D, device=DEV).to(dtype)
    p[::7] = float("nan")
    p[3::11] = float("inf")
    p[5::13] = -0.0
    return p


CASES = [
    pytest.param(1, 32, 8, 128, id="T1-Hq32-Hkv8-D128"),
    pytest.param(17, 32, 8, 128, id="T17-Hq32-Hkv8-D128"),
    pytest.param(423, 8, 1, 128, id="T423-MQA-D128"),
    pytest.param(64, 64, 8, 128, id="T64-Hq64-Hkv8-D128"),
    pytest.param(33, 12, 4, 80, id="T33-Hq12-Hkv4-D80"),
    pytest.param(33, 8, 8, 96, id="T33-MHA-D96"),
    pytest.param(19, 7, 1, 112, id="T19-Hq7-D112"),
    pytest.param(40, 16, 2, 192, id="T40-D192"),
    pytest.param(40, 16, 4, 256, id="T40-D256"),
    pytest.param(50, 4, 2, 32, id="T50-D32"),
    pytest.param(65536, 32, 8, 128, id="T65536-Hq32-Hkv8-D128"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("T,Hq,Hkv,D", CASES)
def test_matrix(T, Hq, Hkv, D, dtype):
    P = max(2 * T, 64)
    idx = torch.int64 if T % 2 else torch.int32
    q, k, v, pos, slots = make(T, Hq, Hkv, D, dtype, P, idx=idx)
    run_and_check(q, k, v, pos, slots, poisoned_pool(P, Hkv, D, dtype), poisoned_pool(P, Hkv, D, dtype),
                  head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope_base=500000.0)


@pytest.mark.parametrize("spec", [
    pytest.param(dict(rotary_dim=32), id="partial-32of128"),
    pytest.param(dict(style="gptj"), id="gptj"),
    pytest.param(dict(style="gptj", rotary_dim=64), id="gptj-partial"),
])
def test_spec_variants(spec):
    T, Hq, Hkv, D, P = 37, 8, 2, 128, 128
    rope = ropepool.RopeSpec(head_dim=D, base=10000.0, **spec)
    q, k, v, pos, slots = make(T, Hq, Hkv, D, torch.bfloat16, P)
    run_and_check(q, k, v, pos, slots, poisoned_pool(P, Hkv, D, torch.bfloat16),
                  poisoned_pool(P, Hkv, D, torch.bfloat16), head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope=rope)


def test_layer_and_combined_kv_views():
    T, Hq, Hkv, D, P, L = 29, 8, 2, 64, 96, 3
    q, k, v, pos, slots = make(T, Hq, Hkv, D, torch.float16, P)
    kv = torch.randn(2, L, P, Hkv, D, device=DEV).half()  # [2, layers, pool, heads, dim]
    before = kv.clone()
    ropepool.rope_pool_fused(q, k, v, pos, slots, kv[0], kv[1], head_dim=D, num_qo_heads=Hq,
                             num_kv_heads=Hkv, layer=1)
    ref = oracle(q, k, v, pos, slots, before[0, 1], before[1, 1], head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    assert_close("k_pool", kv[0, 1], ref[2], torch.float16)
    assert_close("v_pool", kv[1, 1], ref[3], torch.float16)
    for lyr in (0, 2):  # other layers untouched
        assert torch.equal(kv[:, lyr], before[:, lyr])


def test_out_of_range_slots_never_write():
    """Canary rows around the pool: the kernel masks slots < 0 and >= pool_size."""
    T, Hq, Hkv, D, P = 64, 4, 2, 64, 32
    q, k, v, pos, _ = make(T, Hq, Hkv, D, torch.bfloat16, P)
    big_k = torch.randn(P + 16, Hkv, D, device=DEV).bfloat16()
    big_v = torch.randn(P + 16, Hkv, D, device=DEV).bfloat16()
    k_pool, v_pool = big_k[8 : 8 + P], big_v[8 : 8 + P]
    canary_k, canary_v = big_k.clone(), big_v.clone()
    slots = torch.tensor([P, P + 1, P + 8, 2**31 - 1, -1, -(2**31), -9] * 9 + [3], dtype=torch.int64)[:T]
    slots[-1] = 3
    slots = slots.to(DEV)
    ropepool.rope_pool_fused(q, k, v, pos, slots, k_pool, v_pool, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    torch.cuda.synchronize()
    changed = (big_k != canary_k).flatten(1).any(1) | (big_v != canary_v).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == [8 + 3]
    with pytest.raises(ValueError, match="slots must be < pool_size"):
        ropepool.validate_slots(slots, P)


def test_q_out_k_out_in_place():
    T, Hq, Hkv, D, P = 48, 16, 4, 128, 64
    q, k, v, pos, slots = make(T, Hq, Hkv, D, torch.bfloat16, P)
    kp, vp = poisoned_pool(P, Hkv, D, torch.bfloat16), poisoned_pool(P, Hkv, D, torch.bfloat16)
    ref = oracle(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    q_rot, k_rot, _, _ = ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                                  num_kv_heads=Hkv, q_out=q, k_out=k)
    assert q_rot.data_ptr() == q.data_ptr() and k_rot.data_ptr() == k.data_ptr()
    assert_close("q in place", q, ref[0], torch.bfloat16)
    assert_close("k in place", k, ref[1], torch.bfloat16)


def test_precision_at_2_24():
    """Accurate sin/cos: positions up to 2^24 match the oracle's float32 angles."""
    T, H, D, P = 256, 2, 128, 512
    q, k, v, _, slots = make(T, H, H, D, torch.float32, P, fused_qkv=False)
    pos = torch.randint(2**23, 2**24, (T,), device=DEV)
    q_rot, _, _, _ = ropepool.rope_pool_fused(q, k, v, pos, slots, torch.zeros(P, H, D, device=DEV),
                                              torch.zeros(P, H, D, device=DEV), head_dim=D, num_qo_heads=H,
                                              num_kv_heads=H)
    ref = oracle(q, k, v, pos, slots, torch.zeros(P, H, D), torch.zeros(P, H, D), head_dim=D, num_qo_heads=H,
                 num_kv_heads=H)
    assert_close("q_rot at 2^24", q_rot, ref[0], torch.float32)


def test_pool_past_2_31_elements():
    """int64 addressing: the last slot of a 2.2M x 8 x 128 pool (2.25e9 elements)."""
    P, H, D = 2_200_000, 8, 128
    kp = torch.zeros(P, H, D, device=DEV, dtype=torch.bfloat16)
    vp = torch.zeros(P, H, D, device=DEV, dtype=torch.bfloat16)
    q, k, v, pos, _ = make(3, 8, H, D, torch.bfloat16, 16)
    slots = torch.tensor([P - 1, 2**31 // (H * D) + 5, 0], device=DEV)
    _, k_rot, _, _ = ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=8,
                                              num_kv_heads=H)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kp[s], k_rot[i]) and torch.equal(vp[s], v[i])
    assert int((kp != 0).flatten(1).any(1).sum()) == 3


def _step(q, k, v, pos, slots, kp, vp):
    return ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=128, num_qo_heads=32,
                                    num_kv_heads=8, rope_base=500000.0)[:2]


def test_torch_compile_fullgraph():
    q, k, v, pos, slots = make(24, 32, 8, 128, torch.bfloat16, 64)
    kp1, vp1 = poisoned_pool(64, 8, 128, torch.bfloat16), poisoned_pool(64, 8, 128, torch.bfloat16)
    kp2, vp2 = kp1.clone(), vp1.clone()
    want = _step(q, k, v, pos, slots, kp1, vp1)
    got = torch.compile(_step, fullgraph=True)(q, k, v, pos, slots, kp2, vp2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(kp1.view(torch.int16), kp2.view(torch.int16))
    assert torch.equal(vp1.view(torch.int16), vp2.view(torch.int16))


def test_cuda_graph_capture():
    q, k, v, pos, slots = make(8, 32, 8, 128, torch.bfloat16, 64)
    kp, vp = poisoned_pool(64, 8, 128, torch.bfloat16), poisoned_pool(64, 8, 128, torch.bfloat16)
    kp_ref, vp_ref = kp.clone(), vp.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _step(q, k, v, pos, slots, kp, vp)  # warm-up compiles the kernel outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _step(q, k, v, pos, slots, kp, vp)
    # New inputs in the captured buffers, then replay.
    q.copy_(torch.randn_like(q))
    pos.copy_(torch.randint(0, 10**6, pos.shape, device=DEV))
    g.replay()
    torch.cuda.synchronize()
    want = _step(q, k, v, pos, slots, kp_ref, vp_ref)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert torch.equal(kp.view(torch.int16), kp_ref.view(torch.int16))


def test_fp8_scalar_and_tensor_scales():
    T, Hq, Hkv, D, P = 40, 8, 2, 128, 64
    q, k, v, pos, slots = make(T, Hq, Hkv, D, torch.bfloat16, P)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        for scale in (0.05, torch.tensor([0.05], device=DEV)):
            kp = torch.zeros(P, Hkv, D, device=DEV, dtype=dt)
            vp = torch.zeros(P, Hkv, D, device=DEV, dtype=dt)
            ref = oracle(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv,
                         k_scale=0.05, v_scale=0.05)
            _, k_rot, _, _ = ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                                      num_kv_heads=Hkv, k_scale=scale, v_scale=scale)
            # Quantized from the returned bf16 row: at most one fp8 step from the oracle's.
            for name, got, want in (("k_pool", kp, ref[2]), ("v_pool", vp, ref[3])):
                g = to_numpy(got).astype(np.float64)
                w = np.asarray(want, dtype=np.float64)
                step = 2.0 ** (-3 if dt == torch.float8_e4m3fn else -2)
                assert np.all(np.abs(g - w) <= step * np.maximum(np.abs(w), 2.0**-6) + 1e-12), (name, dt)
