"""Adversarial slots for `compute-sanitizer --tool memcheck python benchmarks/memcheck.py`.

Out-of-range, negative and duplicated slots straight into the kernel (no
validation), pools that are views inside larger buffers, every layout. The
sanitizer must report no invalid access; the canaries must be intact.
"""
import torch

from ropepool.backends import triton_op
from ropepool.validate import check


def main():
    dev = "cuda"
    T, Hq, Hkv, D, P = 512, 8, 2, 128, 64
    q, k, v = (torch.randn(T, h, D, device=dev, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    pos = torch.randint(0, 10**6, (T,), device=dev)
    bad = torch.tensor([P, P + 1, 10**9, 2**62, -1, -(2**62), 7, 7, 0, P - 1], device=dev).repeat(T // 10 + 1)[:T]
    for kv_layout, shape in ((None, (P, Hkv, D)), ("NHD", (P // 16, 16, Hkv, D)), ("HND", (P // 16, Hkv, 16, D))):
        big = torch.randn(3 * P * Hkv * D, device=dev, dtype=torch.bfloat16)
        k_pool = big[P * Hkv * D : 2 * P * Hkv * D].view(shape)
        v_pool = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        canary = big.clone()
        good = torch.arange(T, device=dev) % P  # validation sees a legal call ...
        call = check(q, k, v, pos, good.clone().fill_(-1), k_pool, v_pool, head_dim=D, num_qo_heads=Hq,
                     num_kv_heads=Hkv, rope_base=1e4, rope=None, layer=None, k_scale=None, v_scale=None,
                     kv_layout=kv_layout)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        triton_op.launch(call, q, k, v, pos, bad, k_pool, v_pool, q_out, k_out)  # ... the kernel gets bad slots
        torch.cuda.synchronize()
        outside = torch.cat((big[: P * Hkv * D] != canary[: P * Hkv * D], big[2 * P * Hkv * D :] != canary[2 * P * Hkv * D :]))
        assert not outside.any(), f"{kv_layout}: wrote outside the pool"
        print(f"layout {kv_layout or 'flat'}: no write outside the pool")
    print("memcheck driver done")


if __name__ == "__main__":
    main()
