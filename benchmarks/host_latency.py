"""Host cost of one eager call on CUDA, and of its parts (validation, launch, output allocation).

    PYTHONPATH=src python3 benchmarks/host_latency.py
"""
import time

import torch

import ropepool
from ropepool import validate
from ropepool.backends import triton_op


def per_call_us(fn, calls=500, reps=5):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def main():
    T, Hq, Hkv, D = 64, 32, 8, 128
    q, k, v = (torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    kp = torch.empty(262144, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    pos = torch.randint(0, 100000, (T,), device="cuda", dtype=torch.int32)
    sl = torch.randperm(262144, device="cuda")[:T].int()
    kw = dict(head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, rope_base=5e5)
    scalars = (D, Hq, Hkv, 5e5, None, None, None, None, None)  # validate.cached's order
    ropepool.rope_pool_fused(q, k, v, pos, sl, kp, vp, **kw)
    call = validate.cached(q, k, v, pos, sl, kp, vp, None, None, scalars)
    print("validation cache:", "on" if call is not None else "OFF (no TensorGuards in this torch)")
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    cf = torch.contiguous_format
    parts = {
        "full call": lambda: ropepool.rope_pool_fused(q, k, v, pos, sl, kp, vp, **kw),
        "validation (cached)": lambda: validate.cached(q, k, v, pos, sl, kp, vp, None, None, scalars),
        "launch": lambda: triton_op.launch(call, q, k, v, pos, sl, kp, vp, qo, ko),
        "two output allocations": lambda: (torch.empty_like(q, memory_format=cf), torch.empty_like(k, memory_format=cf)),
    }
    for name, fn in parts.items():
        print(f"{name:24s} {per_call_us(fn):7.2f} µs")


if __name__ == "__main__":
    main()
