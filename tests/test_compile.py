"""torch.compile(fullgraph=True) of a function that calls rope_pool_fused traces the whole call.

The aot_eager backend keeps it fast; the "triton" backend goes through the
torch.ops.ropepool.rope_pool custom op (on the GPU where there is one, else
the kernel under the interpreter). The version with inductor and CUDA graphs
is in tests/gpu.
"""
import numpy as np
import torch

import ropepool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_compile_fullgraph_matches_eager(backend):
    T, Hq, Hkv, D, P = 8, 4, 2, 64, 16

    def step(q, k, v, pos, slots, kp, vp):
        return ropepool.rope_pool_fused(q, k, v, pos, slots, kp, vp, head_dim=D, num_qo_heads=Hq,
                                        num_kv_heads=Hkv, rope_base=5e5, backend=backend)[:2]

    # NumPy dtypes in the validation caches first, as after any oracle call.
    ropepool.reference.rope_pool_fused(
        np.random.randn(T, Hq, D), np.random.randn(T, Hkv, D), np.random.randn(T, Hkv, D), np.arange(T),
        np.arange(T), np.zeros((P, Hkv, D)), np.zeros((P, Hkv, D)), head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv)
    q, k, v = (torch.randn(T, h, D, device=DEVICE) for h in (Hq, Hkv, Hkv))
    pos, slots = torch.randint(0, 10**5, (T,), device=DEVICE), torch.randperm(P, device=DEVICE)[:T]
    kp, vp = torch.randn(P, Hkv, D, device=DEVICE), torch.randn(P, Hkv, D, device=DEVICE)
    kp2, vp2 = kp.clone(), vp.clone()
    want = step(q, k, v, pos, slots, kp, vp)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, pos, slots, kp2, vp2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(kp, kp2) and torch.equal(vp, vp2)
