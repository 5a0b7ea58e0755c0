"""The fused kernel: RoPE on q and k, k_rot and v into the pool, one launch.

One program per token. cos/sin are computed once per (token, frequency) with
libdevice's accurate sin/cos (tl.sin/tl.cos lower to approximations on
CUDA that lose digits at large angles) and reused for every head. Pool stores are
masked by ``0 <= slot < pool_size``, so no slot value can write outside the
pool, and need no device sync. Addresses are int64 (pools past 2^31 elements).
"""
import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

# The interpreter (CI's CPU run) has no libdevice; its tl.cos is NumPy's, accurate.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _to_pool(x, pool_ptr, scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    if FP8:
        # Quantize the row the caller gets back (in q's dtype), saturating.
        y = x.to(tl.float32) / scale
        return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(pool_ptr.dtype.element_ty)
    return x


@triton.jit
def _rope_heads(x_row, x_sh, o_row, o_sh, p_row, p_sh, cos, sin, p_heads, scale,
                H: tl.constexpr, BH: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                ROT: tl.constexpr, D: tl.constexpr, BLOCK_PASS: tl.constexpr, GPTJ: tl.constexpr,
                TO_POOL: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Rotate heads [0, H) of one token's row; with TO_POOL, heads [0, p_heads) also go to the pool.

    p_heads is H or 0 (slot skipped): masks are built from comparisons only,
    as the interpreter mishandles a tensor mask ANDed with a scalar bool.
    """
    i = tl.arange(0, BLOCK_HALF)[None, :]
    if GPTJ:
        d1 = 2 * i
        d2 = 2 * i + 1
    else:
        d1 = i
        d2 = i + HALF
    for h0 in tl.static_range(0, H, BH):
        h = h0 + tl.arange(0, BH)[:, None]
        m = (h < H) & (i < HALF)
        mw = (h < p_heads) & (i < HALF)
        x1 = tl.load(x_row + h * x_sh + d1, mask=m).to(tl.float32)
        x2 = tl.load(x_row + h * x_sh + d2, mask=m).to(tl.float32)
        o1 = (x1 * cos - x2 * sin).to(o_row.dtype.element_ty)
        o2 = (x1 * sin + x2 * cos).to(o_row.dtype.element_ty)
        tl.store(o_row + h * o_sh + d1, o1, mask=m)
        tl.store(o_row + h * o_sh + d2, o2, mask=m)
        if TO_POOL:
            tl.store(p_row + h * p_sh + d1, _to_pool(o1, p_row, scale, FP8, FP8_MAX), mask=mw)
            tl.store(p_row + h * p_sh + d2, _to_pool(o2, p_row, scale, FP8, FP8_MAX), mask=mw)
        if BLOCK_PASS > 0:
            j = ROT + tl.arange(0, BLOCK_PASS)[None, :]
            mp = (h < H) & (j < D)
            mpw = (h < p_heads) & (j < D)
            xp = tl.load(x_row + h * x_sh + j, mask=mp)
            tl.store(o_row + h * o_sh + j, xp, mask=mp)
            if TO_POOL:
                tl.store(p_row + h * p_sh + j, _to_pool(xp, p_row, scale, FP8, FP8_MAX), mask=mpw)


@triton.jit
def rope_pool_kernel(
    q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, freqs, use_long, k_scale_ptr, v_scale_ptr,
    pool_size, page_size, k_scale, v_scale, attention_scaling,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, qo_st, qo_sh, ko_st, ko_sh,
    kp_page, kp_row, kp_sh, vp_page, vp_row, vp_sh,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, GPTJ: tl.constexpr,
    BHQ: tl.constexpr, BHKV: tl.constexpr, BHV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr,
    LONGROPE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, SCALE_PTR: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = ROT // 2
    pos = tl.load(positions + t).to(tl.float32)
    slot = tl.load(slots + t).to(tl.int64)
    write = (slot >= 0) & (slot < pool_size)
    p_heads = tl.where(write, HKV, 0)
    slot = tl.where(write, slot, 0)
    page = slot // page_size
    row = slot % page_size

    i = tl.arange(0, BLOCK_HALF)[None, :]
    if LONGROPE:
        i_freq = i + tl.load(use_long).to(tl.int32) * HALF
    else:
        i_freq = i
    ang = pos * tl.load(freqs + i_freq, mask=i < HALF, other=0.0)
    if _INTERPRET:
        cos = tl.cos(ang) * attention_scaling
        sin = tl.sin(ang) * attention_scaling
    else:
        cos = libdevice.cos(ang) * attention_scaling
        sin = libdevice.sin(ang) * attention_scaling

    if SCALE_PTR:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    _rope_heads(q + t * q_st, q_sh, q_out + t * qo_st, qo_sh, q_out, 0, cos, sin, 0, k_scale,
                HQ, BHQ, HALF, BLOCK_HALF, ROT, D, BLOCK_PASS, GPTJ, False, FP8, FP8_MAX)
    kp_row_ptr = k_pool + page * kp_page + row * kp_row
    _rope_heads(k + t * k_st, k_sh, k_out + t * ko_st, ko_sh, kp_row_ptr, kp_sh, cos, sin, p_heads, k_scale,
                HKV, BHKV, HALF, BLOCK_HALF, ROT, D, BLOCK_PASS, GPTJ, True, FP8, FP8_MAX)

    vp_row_ptr = v_pool + page * vp_page + row * vp_row
    d = tl.arange(0, BLOCK_D)[None, :]
    for h0 in tl.static_range(0, HKV, BHV):
        h = h0 + tl.arange(0, BHV)[:, None]
        m = (h < p_heads) & (d < D)
        x = tl.load(v + t * v_st + h * v_sh + d, mask=m)
        tl.store(vp_row_ptr + h * vp_sh + d, _to_pool(x, v_pool, v_scale, FP8, FP8_MAX), mask=m)
