"""Adversarial slots and positions for `compute-sanitizer --tool memcheck python benchmarks/memcheck.py`,
and (``--cpu``) for the native CPU kernel built with AddressSanitizer (.ci/sanitize).

Out-of-range and negative slots, and positions outside a CosSinCache (past
it, negative, huge; MRoPE rows too), straight into the kernel: the public
call on CUDA reads no values, so nothing checks them. Every pool layout
(flat, paged NHD / HND, layer-stacked), fp8 pools with fp8 q/k outputs
and the fused QK-norm, MLA's latent caches, per-token-head scale caches
(int8 and fp8), the block-quantized pools (NVFP4, the 4/8-bit affine
format), DeepSeek V3.2's fp8_ds_mla and indexer caches, vLLM's tiled AMX
layout, each pool or output a view inside a larger buffer whose other bytes
are canaries. The sanitizer
must report no invalid access; the canaries must be intact; no token whose
slot or position is bad may write. On CPU the public call checks every value
before anything runs, so ``--cpu`` hands them to the bound runner instead (the
call checked on valid values first, as tests/harness.py's ``bypass``): the native
kernel must raise before it writes, the general torch code (the QK norm,
per-token-head caches) masks them.
"""
import sys

import torch

import ropepool
from ropepool import CosSinCache, RopePoolError, RopeSpec, plan
from ropepool.checks import validate

DEV = "cpu" if "--cpu" in sys.argv else "cuda"
T, Hq, Hkv, D, P, MAX_POS = 512, 8, 2, 128, 64, 4096
# Duplicated in-range slots (7, 7) are a caller's bug: they race, but stay inside the pool.
BAD_SLOTS = [P, P + 1, 10**9, 2**62, -1, -(2**62), 7, 7, 0, P - 1]
BAD_POSITIONS = [MAX_POS, -1, 2**62, -(2**62), 2**31 - 1, 5, MAX_POS - 1, 0, 10**9, 3]


def table(rotary_dim, scale=1.0):
    ang = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * torch.tensor(RopeSpec(head_dim=rotary_dim).inv_freq)
    return (torch.cat([ang.cos(), ang.sin()], 1) * scale).float().to(DEV)


def repeat(values, n):
    return torch.tensor(values, device=DEV).repeat(n // len(values) + 1)[:n]


def in_canaries(shape, dtype=torch.bfloat16):
    """A pool of ``shape`` in the middle third of a buffer, and the buffer (whose other thirds are canaries)."""
    n = torch.Size(shape).numel()
    big = torch.randn(3 * n, device=DEV).to(dtype)
    return big[n: 2 * n].view(shape), big


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def fused(q, k, v, positions, slots, k_pool, v_pool, **kw):
    """rope_pool_fused; on CPU the runner of the call checked on valid values, given these."""
    if DEV == "cuda":
        return ropepool.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)
    call = validate.check(q, k, v, torch.zeros_like(positions), torch.full_like(slots, -1), k_pool, v_pool, **kw)
    arrays = (q, k, v, positions, slots, k_pool, v_pool, kw.get("q_out"), kw.get("k_out"))
    return _bypassed(call, q, arrays)


def latent(q_pe, k_pe, kv_c, positions, slots, ckv, kpe, **kw):
    """rope_latent_fused, as ``fused``."""
    if DEV == "cuda":
        return ropepool.rope_latent_fused(q_pe, k_pe, kv_c, positions, slots, ckv, kpe, **kw)
    call = validate.check_latent(q_pe, k_pe, kv_c, torch.zeros_like(positions), torch.full_like(slots, -1), ckv, kpe,
                                 **kw)
    return _bypassed(call, q_pe, (q_pe, k_pe, kv_c, positions, slots, kpe, ckv, None, None))


def _bypassed(call, q, arrays):
    try:
        return plan.make(call, q).bind(*arrays)(*arrays)
    except RopePoolError as e:  # the native kernel: raised before it wrote (the canaries and pools say so)
        print(f"  raised: {str(e)[:80]}")


def check_canaries(name, big, before):
    """Bytes compared (fp8 tensors have no comparison ops)."""
    big, before = big.view(torch.uint8), before.view(torch.uint8)
    n = big.numel() // 3
    outside = torch.cat(((big[:n] != before[:n]), (big[2 * n:] != before[2 * n:])))
    assert not outside.any(), f"{name}: wrote outside the pool"


def pools_case(kv_layout, layers, rope, positions):
    q, k, v = (torch.randn(T, h, D, device=DEV, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    one = {None: (P, Hkv, D), "NHD": (P // 16, 16, Hkv, D), "HND": (P // 16, Hkv, 16, D)}[kv_layout]
    shape = ((layers,) if layers else ()) + one
    (k_pool, k_big), (v_pool, v_big) = in_canaries(shape), in_canaries(shape)
    before = (k_big.clone(), v_big.clone())
    fused(q, k, v, positions, repeat(BAD_SLOTS, T), k_pool, v_pool, head_dim=D,
                             num_qo_heads=Hq, num_kv_heads=Hkv, rope=rope, kv_layout=kv_layout,
                             layer=-1 if layers else None)
    sync()
    name = f"layout {kv_layout or 'flat'}{' layer-stacked' if layers else ''} rope {type(rope).__name__}"
    check_canaries(name + " k", k_big, before[0])
    check_canaries(name + " v", v_big, before[1])
    print(f"{name}: no write outside the pools")


def latent_case(rope, positions):
    q_pe = torch.randn(T, 16, 64, device=DEV, dtype=torch.bfloat16)
    k_pe, kv_c = torch.randn(T, 64, device=DEV).bfloat16(), torch.randn(T, 512, device=DEV).bfloat16()
    cache, big = in_canaries((P // 16, 16, 576), torch.float8_e4m3fn)
    before = big.clone()
    latent(q_pe, k_pe, kv_c, positions, repeat(BAD_SLOTS, T), cache[..., :512], cache[..., 512:],
                               rope=rope, kv_layout="NHD", scale=0.05)
    sync()
    check_canaries(f"MLA {type(rope).__name__}", big, before)
    print(f"MLA latent cache, rope {type(rope).__name__}: no write outside the caches")


def fp8_norm_case(rope, positions):
    """fp8 e4m3 pools with scales, fp8 q_rot and k_rot written to given outputs, Gemma-style QK-norm
    (64 q heads: the large-call head split, taken with the norm)."""
    q = torch.randn(T, 64, D, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(T, Hkv, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    f8 = torch.float8_e4m3fn
    (k_pool, k_big), (v_pool, v_big) = (in_canaries((P, Hkv, D), f8) for _ in range(2))
    (q_out, q_big), (k_out, ko_big) = in_canaries((T, 64, D), f8), in_canaries((T, Hkv, D), f8)
    bigs = (k_big, v_big, q_big, ko_big)
    before = [b.clone() for b in bigs]
    norm = ropepool.QKNorm(torch.rand(D, device=DEV), torch.rand(D, device=DEV), weight_offset=1.0)
    fused(q, k, v, positions, repeat(BAD_SLOTS, T), k_pool, v_pool, head_dim=D, num_qo_heads=64,
                             num_kv_heads=Hkv, rope=rope, k_scale=0.5, v_scale=0.5, q_out=q_out, q_scale=0.5,
                             k_out=k_out, k_out_scale=0.5, qk_norm=norm)
    sync()
    for name, big, b in zip(("k pool", "v pool", "q out", "k out"), bigs, before):
        check_canaries(f"fp8 + QK-norm rope {type(rope).__name__} {name}", big, b)
    print(f"fp8 pools, fp8 q/k out, QK-norm, rope {type(rope).__name__}: no write outside them")


def per_token_head_case(positions, dtype):
    """Paged pools of ``dtype`` with per-token-head scale caches, 64 q heads (the large-call head split)."""
    q = torch.randn(T, 64, D, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(T, Hkv, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    (k_pool, k_big), (v_pool, v_big) = (in_canaries((P // 16, 16, Hkv, D), dtype) for _ in range(2))
    (k_sc, ks_big), (v_sc, vs_big) = (in_canaries((P // 16, 16, Hkv), torch.float32) for _ in range(2))
    bigs = (k_big, v_big, ks_big, vs_big)
    before = [b.clone() for b in bigs]
    fused(q, k, v, positions, repeat(BAD_SLOTS, T), k_pool, v_pool, head_dim=D, num_qo_heads=64,
                             num_kv_heads=Hkv, kv_layout="NHD", k_scale_cache=k_sc, v_scale_cache=v_sc)
    sync()
    for name, big, b in zip(("k pool", "v pool", "k scales", "v scales"), bigs, before):
        check_canaries(f"per-token-head {dtype} {name}", big, b)
    print(f"per-token-head {dtype} pools and scale caches: no write outside them")


def block_case(fmt, kv_layout, positions):
    """Block-quantized pools, each array of each tuple in its own canaried buffer: NVFP4 ``(data, scales)`` or
    the affine ``(words, scales, biases)`` of ``bits`` (4 or 8) with groups of 64."""
    q, k, v = (torch.randn(T, h, D, device=DEV, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    lead = {None: (P,), "NHD": (P // 16, 16), "HND": (P // 16, Hkv, 16)}[kv_layout]
    where = (lambda n: lead + (Hkv, n)) if kv_layout != "HND" else (lambda n: lead + (n,))
    if fmt == "nvfp4":
        parts, kw = ((D // 2, torch.uint8), (D // 16, torch.float8_e4m3fn)), dict(k_scale=0.25, v_scale=0.5)
    else:
        bits = int(fmt[-1])
        parts, kw = ((D * bits // 32, torch.uint32), (D // 64, torch.bfloat16), (D // 64, torch.bfloat16)), {}
    made = [[in_canaries(where(n), dt) for n, dt in parts] for _ in "kv"]
    bigs = [big for cache in made for _, big in cache]
    before = [b.clone() for b in bigs]
    fused(q, k, v, positions, repeat(BAD_SLOTS, T), tuple(x for x, _ in made[0]), tuple(x for x, _ in made[1]),
          head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv, kv_layout=kv_layout, **kw)
    sync()
    for i, (big, b) in enumerate(zip(bigs, before)):
        check_canaries(f"{fmt} {kv_layout or 'flat'} array {i}", big, b)
    print(f"{fmt} pools, layout {kv_layout or 'flat'}: no write outside them")


def dsa_case(fmt, positions):
    """DeepSeek V3.2's caches (NHD pages of 16): fp8_ds_mla's 656-byte rows, the indexer's keys (both scale
    formats)."""
    if fmt == "fp8_ds_mla":
        q_pe = torch.randn(T, 16, 64, device=DEV, dtype=torch.bfloat16)
        k_pe, kv_c = torch.randn(T, 64, device=DEV).bfloat16(), torch.randn(T, 512, device=DEV).bfloat16()
        cache, big = in_canaries((P // 16, 16, 656), torch.uint8)
        before = big.clone()
        ropepool.rope_latent_fused(q_pe, k_pe, kv_c, positions, repeat(BAD_SLOTS, T), cache, None,
                                   rope=RopeSpec(head_dim=64, style="gptj"), kv_layout="NHD", cache_format=fmt)
    else:
        q, k = torch.randn(T, 4, 128, device=DEV, dtype=torch.bfloat16), torch.randn(T, 128, device=DEV).bfloat16()
        cache, big = in_canaries((P // 16, 16, 132), torch.uint8)
        before = big.clone()
        ropepool.rope_indexer_fused(q, k, positions, repeat(BAD_SLOTS, T), cache,
                                    rope=RopeSpec(head_dim=128, rotary_dim=64), kv_layout="NHD",
                                    scale_fmt="ue8m0" if fmt == "indexer_ue8m0" else None)
    torch.cuda.synchronize()
    check_canaries(fmt, big, before)
    print(f"{fmt} cache: no write outside it")


def amx_case(dtype, positions):
    """vLLM's CPU AMX-tiled cache layout (kv_layout="amx", the HND shape; taken by the kernel on CUDA too)."""
    q, k, v = (torch.randn(T, h, D, device=DEV, dtype=dtype) for h in (Hq, Hkv, Hkv))
    (k_pool, k_big), (v_pool, v_big) = (in_canaries((P // 16, Hkv, 16, D), dtype) for _ in range(2))
    before = (k_big.clone(), v_big.clone())
    fused(q, k, v, positions, repeat(BAD_SLOTS, T), k_pool, v_pool, head_dim=D, num_qo_heads=Hq, num_kv_heads=Hkv,
          kv_layout="amx")
    sync()
    check_canaries(f"amx {dtype} k", k_big, before[0])
    check_canaries(f"amx {dtype} v", v_big, before[1])
    print(f"amx-tiled {dtype} pools: no write outside them")


def table_positions_never_write():
    """Positions outside the table write nothing, whatever their slot: a flat pool, all slots good."""
    q, k, v = (torch.randn(T, h, D, device=DEV, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    kp, vp = (torch.randn(T, Hkv, D, device=DEV).bfloat16() for _ in range(2))
    before = kp.clone()
    pos = repeat(BAD_POSITIONS, T)
    fused(q, k, v, pos, torch.arange(T, device=DEV), kp, vp, head_dim=D, num_qo_heads=Hq,
                             num_kv_heads=Hkv, rope=CosSinCache(table(D)))
    changed = set((kp != before).flatten(1).any(1).nonzero().flatten().tolist())
    good = set(((pos >= 0) & (pos < MAX_POS)).nonzero().flatten().tolist())
    assert changed <= good, f"tokens {sorted(changed - good)} wrote with a position outside the table"
    print("positions outside the table: those tokens wrote nothing")


def main():
    pos = torch.randint(0, MAX_POS, (T,), device=DEV)
    bad_pos = repeat(BAD_POSITIONS, T)
    bad_pos3 = torch.stack([pos, bad_pos, pos.flip(0)])
    for kv_layout in (None, "NHD", "HND"):
        for layers in (None, 3):
            pools_case(kv_layout, layers, None, pos)
            pools_case(kv_layout, layers, CosSinCache(table(D)), bad_pos)
    pools_case("NHD", 3, CosSinCache(table(64), mrope_section=(8, 12, 12)), bad_pos3)
    latent_case(RopeSpec(head_dim=64, style="gptj"), pos)
    latent_case(CosSinCache(table(64), is_neox=False), bad_pos)
    fp8_norm_case(RopeSpec(head_dim=D, base=1e6), pos)
    fp8_norm_case(CosSinCache(table(D)), bad_pos)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        per_token_head_case(pos, dtype)
    for fmt in ("nvfp4", "affine4", "affine8"):
        for kv_layout in (None, "NHD", "HND"):
            block_case(fmt, kv_layout, pos)
    # DeepSeek V3.2's caches: the Triton kernel on CUDA; on CPU the general torch code runs them, not the native
    # kernel, and their public calls check every value first.
    for fmt in ("fp8_ds_mla", "indexer", "indexer_ue8m0") if DEV == "cuda" else ():
        dsa_case(fmt, pos)
    for dtype in (torch.bfloat16, torch.float32):
        amx_case(dtype, pos)
    table_positions_never_write()
    print("memcheck driver done")


if __name__ == "__main__":
    main()
