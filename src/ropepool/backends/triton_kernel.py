"""The fused kernel: RoPE on q and k, k_rot and v into the pool, one launch.

One program per token, or per part of a token's heads when a call has too
few tokens to fill the GPU (grid axis 1 splits the heads). Every load is
issued before the first use, so a program waits for memory once, not once
per tensor (that is what keeps a decode-sized call near the launch floor).
cos/sin are computed once per (token, frequency) and reused for every head,
accurately at any angle (see _cos_sin). Pool stores are masked by
``0 <= slot < pool_size``, so no slot value can write outside the pool, and
need no device sync. Strides are compile-time constants (an engine has a
handful of layouts), which gives the compiler the alignment it needs for
wide accesses; addresses are int64.
"""
import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

# The interpreter (CI's CPU run) has no libdevice; its tl.cos is NumPy's, accurate.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _cos_sin(ang):
    """cos and sin of float32 angles, accurate to float32 rounding at any size.

    tl.cos/tl.sin lower to approximations that lose digits at large angles;
    libdevice's accurate ones switch to a slow exact reduction past ~1e5 rad,
    which one lane of a warp then runs while the others wait (positions past
    ~1e5 at the highest frequency: on the H200 that cost 6% of the 8/1/128
    geometry's time at T = 16384). So the angle is reduced to [-pi/4, pi/4]
    here, in float64, and libdevice only ever sees small ones; the quadrant
    picks the signs. pi/2 is split into three float32 numbers (Cody-Waite):
    each product with n is exact in float64 for angles below 2^26, and the
    constants mean the same whether Triton types a literal as float32 or
    float64 (Triton 3.6's fma rounds literals to float32).
    """
    x = ang.to(tl.float64)
    n = tl.floor(x * 0.6366197723675814 + 0.5)  # the nearest multiple of pi/2
    r = ((x - n * 1.5707963705062866) - n * -4.371138828673793e-08 - n * -1.7151245100058819e-15).to(tl.float32)
    if _INTERPRET:  # no libdevice; NumPy's float32 cos/sin are accurate
        c = tl.cos(r)
        s = tl.sin(r)
    else:
        c = libdevice.cos(r)
        s = libdevice.sin(r)
    quadrant = n.to(tl.int64) & 3
    odd = (quadrant & 1) != 0
    cos = tl.where(odd, s, c)
    sin = tl.where(odd, c, s)
    return tl.where(((quadrant + 1) & 2) != 0, -cos, cos), tl.where((quadrant & 2) != 0, -sin, sin)


@triton.jit
def _to_pool(x, pool_ptr, scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    if FP8:
        # Quantize the row the caller gets back (in q's dtype), saturating.
        y = x.to(tl.float32) / scale
        return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(pool_ptr.dtype.element_ty)
    else:
        return x.to(pool_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["pool_size"])
def rope_pool_kernel(
    q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, freqs, use_long, k_scale_ptr, v_scale_ptr,
    pool_size, k_scale, v_scale, attention_scaling,
    Q_ST: tl.constexpr, Q_SH: tl.constexpr, K_ST: tl.constexpr, K_SH: tl.constexpr,
    V_ST: tl.constexpr, V_SH: tl.constexpr, QO_ST: tl.constexpr, QO_SH: tl.constexpr,
    KO_ST: tl.constexpr, KO_SH: tl.constexpr,
    KP_PAGE: tl.constexpr, KP_ROW: tl.constexpr, KP_SH: tl.constexpr,
    VP_PAGE: tl.constexpr, VP_ROW: tl.constexpr, VP_SH: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, GPTJ: tl.constexpr,
    BHQ: tl.constexpr, BHKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr, LONGROPE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    SCALE_PTR: tl.constexpr,
):
    # Tiles are [head, feature]. HQ and HKV are the heads of one program:
    # program (t, g) takes heads g * HQ ... of q and g * HKV ... of k and v.
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    HALF: tl.constexpr = ROT // 2
    hq = tl.arange(0, BHQ)[:, None]
    hk = tl.arange(0, BHKV)[:, None]
    q_head = g * HQ + hq  # the heads in memory
    kv_head = g * HKV + hk
    i = tl.arange(0, BLOCK_HALF)[None, :]
    if GPTJ:
        d1 = 2 * i
        d2 = 2 * i + 1
    else:
        d1 = i
        d2 = i + HALF
    mq = (hq < HQ) & (i < HALF)
    mk = (hk < HKV) & (i < HALF)

    # All loads first.
    pos = tl.load(positions + t).to(tl.float32)
    slot = tl.load(slots + t).to(tl.int64)
    if LONGROPE:
        inv_freq = tl.load(freqs + i + tl.load(use_long).to(tl.int32) * HALF, mask=i < HALF, other=0.0)
    else:
        inv_freq = tl.load(freqs + i, mask=i < HALF, other=0.0)
    q_row = q + t * Q_ST + q_head * Q_SH
    k_row = k + t * K_ST + kv_head * K_SH
    q1 = tl.load(q_row + d1, mask=mq).to(tl.float32)
    q2 = tl.load(q_row + d2, mask=mq).to(tl.float32)
    k1 = tl.load(k_row + d1, mask=mk).to(tl.float32)
    k2 = tl.load(k_row + d2, mask=mk).to(tl.float32)
    dv = tl.arange(0, BLOCK_D)[None, :]
    mv = (hk < HKV) & (dv < D)
    vals = tl.load(v + t * V_ST + kv_head * V_SH + dv, mask=mv)
    if BLOCK_PASS > 0:
        j = ROT + tl.arange(0, BLOCK_PASS)[None, :]
        mqp = (hq < HQ) & (j < D)
        mkp = (hk < HKV) & (j < D)
        q_pass = tl.load(q_row + j, mask=mqp)
        k_pass = tl.load(k_row + j, mask=mkp)
    if SCALE_PTR:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    cos, sin = _cos_sin(pos * inv_freq)
    cos = cos * attention_scaling
    sin = sin * attention_scaling

    qo_row = q_out + t * QO_ST + q_head * QO_SH
    tl.store(qo_row + d1, (q1 * cos - q2 * sin).to(q_out.dtype.element_ty), mask=mq)
    tl.store(qo_row + d2, (q1 * sin + q2 * cos).to(q_out.dtype.element_ty), mask=mq)
    k1r = (k1 * cos - k2 * sin).to(k_out.dtype.element_ty)
    k2r = (k1 * sin + k2 * cos).to(k_out.dtype.element_ty)
    ko_row = k_out + t * KO_ST + kv_head * KO_SH
    tl.store(ko_row + d1, k1r, mask=mk)
    tl.store(ko_row + d2, k2r, mask=mk)
    if BLOCK_PASS > 0:
        tl.store(qo_row + j, q_pass, mask=mqp)
        tl.store(ko_row + j, k_pass, mask=mkp)

    # Pool rows. A skipped or out-of-range slot masks every head off; masks
    # come from comparisons only (the interpreter mishandles a tensor mask
    # ANDed with a scalar bool).
    write = (slot >= 0) & (slot < pool_size)
    p_heads = tl.where(write, HKV, 0)
    slot = tl.where(write, slot, 0)
    page = slot // PAGE_SIZE
    row = slot % PAGE_SIZE
    kp_row = k_pool + page * KP_PAGE + row * KP_ROW + kv_head * KP_SH
    vp_row = v_pool + page * VP_PAGE + row * VP_ROW + kv_head * VP_SH
    mkw = (hk < p_heads) & (i < HALF)
    tl.store(kp_row + d1, _to_pool(k1r, k_pool, k_scale, FP8, FP8_MAX), mask=mkw)
    tl.store(kp_row + d2, _to_pool(k2r, k_pool, k_scale, FP8, FP8_MAX), mask=mkw)
    if BLOCK_PASS > 0:
        tl.store(kp_row + j, _to_pool(k_pass, k_pool, k_scale, FP8, FP8_MAX), mask=(hk < p_heads) & (j < D))
    tl.store(vp_row + dv, _to_pool(vals, v_pool, v_scale, FP8, FP8_MAX), mask=(hk < p_heads) & (dv < D))
