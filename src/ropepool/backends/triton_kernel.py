"""The fused kernel: per-head norm, RoPE on q and k, k_rot and v into the pool, one launch.

One program per token, or per part of a token's heads when a call has too
few tokens to fill the GPU (grid axis 1 splits the heads). Every load is
issued before the first use, so a program waits for memory once, not once
per tensor (that is what keeps a decode-sized call near the launch floor).

A head is held as three tiles: the two halves of each rotated pair (``x1``,
``x2``: NeoX halves or GPT-J evens/odds) and the features past rotary_dim
(``xp``). Each feature of the call is a constexpr over those tiles: the
norm (a head_dim reduction on the row already in registers), MRoPE (each
frequency picks one of three position rows), the engine's cos/sin table
instead of computed angles, fp8 pools and fp8 q/k outputs, per-token-head
scales (``PTH``: each written row's amax gives its scale, vLLM's
int8/fp8_per_token_head), block-quantized pools (``NVFP4``; ``AFFINE``, the
code width of mx.quantize's format, and its ``GROUP``), a latent head of
another width (MLA's ``DV``), DeepSeek V3.2's fp8_ds_mla rows (``DS_MLA``:
the latent's e4m3 tiles and their scales into the uint8 row; k_pe is the
plain k pool, a view of the row's last bytes) and its indexer's keys
(``INDEXER``: 1, or 2 with ue8m0 scales; the k pool is the uint8 cache, no
value is stored).
cos/sin are computed once per (token, frequency) and reused for every head,
accurately at any angle (``_cos_sin``). The quantized formats' stores are
``triton_stores``' functions.

Pool stores are masked by ``0 <= slot < pool_size`` (core/layout.py:
``PoolGeometry.written``; ``pool_size`` is the plan's geometry's) and, with a
table, a position inside it, so no input can write outside the pool, and
nothing needs a device sync. Strides are compile-time constants (an engine has a
handful of layouts), which gives the compiler the alignment it needs for
wide accesses; addresses are int64.
"""
import os

import triton
import triton.language as tl

from .triton_stores import affine_store, ds_mla_store, indexer_store, nvfp4_store

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # (CI's CPU run: no compiled kernel)


@triton.jit
def _cos_sin(ang):
    """cos and sin of float32 angles, accurate to float32 rounding at any size below 2^26 rad.

    A decode-sized call waits on this chain (position, angle, cos/sin, store), so it is kept short. The
    angle is reduced to [-pi/4, pi/4] in float64: pi/2 is split into three float32 numbers (Cody-Waite),
    each product with n exact in float64 for angles below 2^26, and the constants mean the same whether
    Triton types a literal as float32 or float64 (Triton 3.6's fma rounds literals to float32). Two
    polynomials of r^2 on that interval (Cephes' sinf/cosf coefficients, within 1.5 float32 ulps) give sin
    and cos; the quadrant picks the signs. libdevice's cos/sin would reduce again, and switch to a slow
    exact reduction past ~1e5 rad that one lane of a warp runs while the others wait.
    """
    x = ang.to(tl.float64)
    n = tl.floor(x * 0.6366197723675814 + 0.5)  # the nearest multiple of pi/2
    r = ((x - n * 1.5707963705062866) - n * -4.371138828673793e-08 - n * -1.7151245100058819e-15).to(tl.float32)
    z = r * r
    s = tl.fma(r * z, tl.fma(z, tl.fma(z, -1.9515295891e-4, 8.3321608736e-3), -1.6666654611e-1), r)
    c = tl.fma(z * z, tl.fma(z, tl.fma(z, 2.443315711809948e-5, -1.388731625493765e-3), 4.166664568298827e-2),
               tl.fma(z, -0.5, 1.0))
    quadrant = n.to(tl.int32) & 3
    odd = (quadrant & 1) != 0
    cos = tl.where(odd, s, c)
    sin = tl.where(odd, c, s)
    return tl.where(((quadrant + 1) & 2) != 0, -cos, cos), tl.where((quadrant & 2) != 0, -sin, sin)


@triton.jit
def _rms_norm(x1, x2, xp, w_ptr, d1, d2, j, mi, mj, eps, offset, D: tl.constexpr, HAS_W: tl.constexpr):
    """The three tiles of [heads] rows, each row times rsqrt(mean(row^2) + eps) (and offset + weight)."""
    ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xp * xp, 1)
    r = tl.rsqrt(ss / D + eps)[:, None]
    x1, x2, xp = x1 * r, x2 * r, xp * r
    if HAS_W:
        x1 = x1 * (tl.load(w_ptr + d1, mask=mi, other=0.0).to(tl.float32) + offset)
        x2 = x2 * (tl.load(w_ptr + d2, mask=mi, other=0.0).to(tl.float32) + offset)
        xp = xp * (tl.load(w_ptr + j, mask=mj, other=0.0).to(tl.float32) + offset)
    return x1, x2, xp


@triton.jit
def _fp8(x, scale, out_ptr, FP8_MAX: tl.constexpr):
    """``x / scale`` saturated to the fp8 range, rounded once.

    The quotient is the reciprocal's product corrected by one fma (the
    residual ``x - y * scale`` is exact), which rounds as IEEE division does
    but for rare hard cases; ``div_rn``'s subroutine made fp8 q out compute-bound
    (54% of copy bandwidth against 98% this way, H200, docs/benchmarks.md)."""
    x = x.to(tl.float32)
    r = 1.0 / scale
    y = x * r
    return _saturate(tl.fma(tl.fma(-y, scale, x), r, y), out_ptr, FP8_MAX)


@triton.jit
def _saturate(y, out_ptr, QMAX: tl.constexpr):
    """float32 y clamped to [-QMAX, QMAX] and cast to out_ptr's dtype (int8: truncated)."""
    return tl.minimum(tl.maximum(y, -QMAX), QMAX).to(out_ptr.dtype.element_ty)


@triton.jit
def _quantize(x, scale, out_ptr, MODE: tl.constexpr, QMAX: tl.constexpr):
    """x in out_ptr's dtype. MODE 0: a cast; 1: ``x / scale`` (fp8, _fp8); 2: ``x * scale`` with
    ``scale`` the row's reciprocal, saturated (vLLM's per-token-head store; to int8 it truncates)."""
    if MODE == 1:
        return _fp8(x, scale, out_ptr, QMAX)
    elif MODE == 2:
        return _saturate(x.to(tl.float32) * scale, out_ptr, QMAX)
    else:
        return x.to(out_ptr.dtype.element_ty)


@triton.jit
def _store_out(ptr, x, mask, scale, MODE: tl.constexpr, QMAX: tl.constexpr):
    tl.store(ptr, _quantize(x, scale, ptr, MODE, QMAX), mask=mask)


@triton.jit
def _load_pairs(row, i, mask, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, GPTJ: tl.constexpr):
    """The two halves of each rotated pair as float32 [heads, BLOCK_HALF] tiles.

    GPT-J pairs are neighbours: the row is read whole and split in registers,
    since loads of every other element cannot be vectorised (DeepSeek's MLA
    ran at 6-18% of copy bandwidth that way)."""
    if GPTJ:
        c = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        x = tl.load(row + c, mask=mask & (c < 2 * HALF), other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [x.shape[0], BLOCK_HALF, 2]))
    else:
        x1 = tl.load(row + i, mask=mask & (i < HALF), other=0.0).to(tl.float32)
        x2 = tl.load(row + i + HALF, mask=mask & (i < HALF), other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _feature(d, TD: tl.constexpr, D1: tl.constexpr, D0: tl.constexpr):
    """Feature d's offset in a row: d itself (TD 1: untiled, the same code as a plain ``row + d``), or in a
    tiled pool (vLLM's AMX cache, core/layout.py: TILED) tile d // TD at stride D1, place d % TD at D0."""
    if TD == 1:
        off = d
    else:
        off = (d // TD) * D1 + (d % TD) * D0
    return off


@triton.jit
def _row(r, TT: tl.constexpr, ROW: tl.constexpr, ROW0: tl.constexpr):
    """Row r's offset in a page: r * ROW (TT 1: untiled), or in a tiled pool tile r // TT at stride ROW,
    place r % TT at ROW0."""
    if TT == 1:
        off = r * ROW
    else:
        off = (r // TT) * ROW + (r % TT) * ROW0
    return off


@triton.jit
def _store_pairs(row, x1, x2, i, mask, scale, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, GPTJ: tl.constexpr,
                 MODE: tl.constexpr, QMAX: tl.constexpr, TD: tl.constexpr = 1, D1: tl.constexpr = 1,
                 D0: tl.constexpr = 0):
    """_load_pairs' inverse: GPT-J halves joined back into whole rows, one contiguous store (untiled)."""
    if GPTJ:
        c = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        x = tl.reshape(tl.join(x1, x2), [x1.shape[0], 2 * BLOCK_HALF])
        _store_out(row + _feature(c, TD, D1, D0), x, mask & (c < 2 * HALF), scale, MODE, QMAX)
    else:
        _store_out(row + _feature(i, TD, D1, D0), x1, mask & (i < HALF), scale, MODE, QMAX)
        _store_out(row + _feature(i + HALF, TD, D1, D0), x2, mask & (i < HALF), scale, MODE, QMAX)


@triton.jit
def _absmax(x):
    """max |x| of each row of a [rows, features] tile (masked features hold 0)."""
    return tl.max(tl.abs(x.to(tl.float32)), 1)


@triton.jit
def _pth_scale(amax, QMAX: tl.constexpr):
    """Per-token-head scales of rows of this amax: max(amax / QMAX, 1e-6) and the reciprocal, [rows, 1],
    IEEE-rounded as vLLM's reference computes them on the host."""
    s = tl.maximum(tl.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), 1e-6)[:, None]
    return s, tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def _scale(ptr, head, mask, PER_HEAD: tl.constexpr):
    """A float32 scale: one element, or one per KV head."""
    if PER_HEAD:
        return tl.load(ptr + head, mask=mask, other=1.0)
    else:
        return tl.load(ptr)


@triton.jit(do_not_specialize=["pool_size", "pos_row_stride"])
def rope_pool_kernel(
    # plan.POINTERS, in its order (tests/test_plan.py), then the scalars and the constexprs (named, any order):
    q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, use_long, freqs, table, q_weight, k_weight,
    k_scale, v_scale, q_scale, k_out_scale, k_scale_cache, v_scale_cache, k_bias_cache, v_bias_cache,
    pool_size, pos_row_stride,
    Q_ST: tl.constexpr, Q_SH: tl.constexpr, K_ST: tl.constexpr, K_SH: tl.constexpr,
    V_ST: tl.constexpr, V_SH: tl.constexpr, QO_ST: tl.constexpr, QO_SH: tl.constexpr,
    KO_ST: tl.constexpr, KO_SH: tl.constexpr, KP_PAGE: tl.constexpr, KP_ROW: tl.constexpr, KP_SH: tl.constexpr,
    VP_PAGE: tl.constexpr, VP_ROW: tl.constexpr, VP_SH: tl.constexpr, KS_PAGE: tl.constexpr, KS_ROW: tl.constexpr,
    KS_SH: tl.constexpr, VS_PAGE: tl.constexpr, VS_ROW: tl.constexpr, VS_SH: tl.constexpr, KB_PAGE: tl.constexpr,
    KB_ROW: tl.constexpr, KB_SH: tl.constexpr, VB_PAGE: tl.constexpr, VB_ROW: tl.constexpr, VB_SH: tl.constexpr,
    KP_TT: tl.constexpr, KP_ROW0: tl.constexpr, KP_TD: tl.constexpr, KP_D1: tl.constexpr, KP_D0: tl.constexpr,
    VP_TT: tl.constexpr, VP_ROW0: tl.constexpr, VP_TD: tl.constexpr, VP_D1: tl.constexpr, VP_D0: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TABLE_ST: tl.constexpr, MAX_POSITION: tl.constexpr, ATTENTION_SCALING: tl.constexpr, NUM_KV: tl.constexpr,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, ROT: tl.constexpr, GPTJ: tl.constexpr, BHQ: tl.constexpr, BHKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_DV: tl.constexpr,
    LONGROPE: tl.constexpr, TABLE: tl.constexpr, MROPE: tl.constexpr, S_T: tl.constexpr, S_H: tl.constexpr,
    S_W: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr,
    NORM: tl.constexpr, Q_W: tl.constexpr, K_W: tl.constexpr, EPS: tl.constexpr, WEIGHT_OFFSET: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, K_PER_HEAD: tl.constexpr, V_PER_HEAD: tl.constexpr,
    Q_FP8: tl.constexpr, Q_FP8_MAX: tl.constexpr, K_FP8: tl.constexpr, K_FP8_MAX: tl.constexpr, PTH: tl.constexpr,
    NVFP4: tl.constexpr, AFFINE: tl.constexpr, GROUP: tl.constexpr, DS_MLA: tl.constexpr, INDEXER: tl.constexpr,
):
    # Tiles are [head, feature]. HQ and HKV are the heads of one program:
    # program (t, g) takes heads g * HQ ... of q and g * HKV ... of k and v
    # (none of k and v past NUM_KV: MQA and MLA split q heads alone).
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    HALF: tl.constexpr = ROT // 2
    POOL_Q: tl.constexpr = FP8 + 2 * PTH  # how pool rows are stored: _quantize's MODE
    hq = tl.arange(0, BHQ)[:, None]
    hk = tl.arange(0, BHKV)[:, None]
    q_head = g * HQ + hq  # the heads in memory
    kv_head = g * HKV + hk
    mqh = hq < HQ
    mkh = (hk < HKV) & (kv_head < NUM_KV)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mi = i < HALF
    if GPTJ:
        d1 = 2 * i
        d2 = 2 * i + 1
    else:
        d1 = i
        d2 = i + HALF
    j = ROT + tl.arange(0, BLOCK_PASS)[None, :]
    mj = j < D
    dv = tl.arange(0, BLOCK_DV)[None, :]

    # All loads first.
    slot = tl.load(slots + t).to(tl.int64)
    q_row = q + t * Q_ST + q_head * Q_SH
    k_row = k + t * K_ST + kv_head * K_SH
    vals = tl.load(v + t * V_ST + kv_head * V_SH + dv, mask=mkh & (dv < DV))
    pos_ok = slot == slot  # the token's positions are inside the table (always, without one)
    if ROT > 0:
        p0 = tl.load(positions + t).to(tl.int64)
        if MROPE:  # each frequency's row of [3, T] positions (docs/api.md, RopeSpec: MRoPE)
            p1 = tl.load(positions + pos_row_stride + t).to(tl.int64)
            p2 = tl.load(positions + 2 * pos_row_stride + t).to(tl.int64)
            if MROPE_INTERLEAVED:
                row = tl.where((i % 3 == 1) & (i < 3 * S_H), 1, tl.where((i % 3 == 2) & (i < 3 * S_W), 2, 0))
            else:
                row = (i >= S_T).to(tl.int32) + (i >= S_T + S_H).to(tl.int32)
            pos = tl.where(row == 1, p1, tl.where(row == 2, p2, p0))
        else:
            pos = p0
        if TABLE:
            if MROPE:
                pos_ok = (p0 >= 0) & (p0 < MAX_POSITION) & (p1 >= 0) & (p1 < MAX_POSITION) & (p2 >= 0) & \
                    (p2 < MAX_POSITION)
            else:
                pos_ok = (p0 >= 0) & (p0 < MAX_POSITION)
            at = table + tl.where(pos_ok, pos, 0) * TABLE_ST + i  # never outside the table
            cos = tl.load(at, mask=mi, other=1.0).to(tl.float32)
            sin = tl.load(at + HALF, mask=mi, other=0.0).to(tl.float32)
        elif LONGROPE:
            inv_freq = tl.load(freqs + i + tl.load(use_long).to(tl.int32) * HALF, mask=mi, other=0.0)
        else:
            inv_freq = tl.load(freqs + i, mask=mi, other=0.0)
        q1, q2 = _load_pairs(q_row, i, mqh, HALF, BLOCK_HALF, GPTJ)
        k1, k2 = _load_pairs(k_row, i, mkh, HALF, BLOCK_HALF, GPTJ)
    else:  # a layer without RoPE: the pass-through tile is the whole head
        q1 = tl.zeros([BHQ, BLOCK_HALF], tl.float32)
        q2 = q1
        k1 = tl.zeros([BHKV, BLOCK_HALF], tl.float32)
        k2 = k1
    if ROT < D:
        q_pass = tl.load(q_row + j, mask=mqh & mj, other=0.0).to(tl.float32)
        k_pass = tl.load(k_row + j, mask=mkh & mj, other=0.0).to(tl.float32)
    else:
        q_pass = tl.zeros([BHQ, BLOCK_PASS], tl.float32)
        k_pass = tl.zeros([BHKV, BLOCK_PASS], tl.float32)
    if FP8 or NVFP4:  # (NVFP4: the global decode scales)
        k_sc = _scale(k_scale, kv_head, mkh, K_PER_HEAD)
        v_sc = _scale(v_scale, kv_head, mkh, V_PER_HEAD)
    else:
        k_sc = 1.0
        v_sc = 1.0
    q_sc = 1.0
    ko_sc = 1.0
    if Q_FP8:
        q_sc = tl.load(q_scale)
    if K_FP8:
        ko_sc = tl.load(k_out_scale)

    if NORM == 1:  # normalise, then rotate (Qwen3, Gemma 3)
        q1, q2, q_pass = _rms_norm(q1, q2, q_pass, q_weight, d1, d2, j, mi, mj, EPS, WEIGHT_OFFSET, D, Q_W)
        k1, k2, k_pass = _rms_norm(k1, k2, k_pass, k_weight, d1, d2, j, mi, mj, EPS, WEIGHT_OFFSET, D, K_W)
    if ROT > 0:
        if TABLE:
            cos = tl.where(pos_ok, cos, 1.0)
            sin = tl.where(pos_ok, sin, 0.0)
        else:
            cos, sin = _cos_sin(pos.to(tl.float32) * inv_freq)
            if ATTENTION_SCALING != 1.0:
                cos = cos * ATTENTION_SCALING
                sin = sin * ATTENTION_SCALING
        q1, q2 = q1 * cos - q2 * sin, q1 * sin + q2 * cos
        k1, k2 = k1 * cos - k2 * sin, k1 * sin + k2 * cos
    if NORM == 2:  # rotate, then normalise (Llama 4)
        q1, q2, q_pass = _rms_norm(q1, q2, q_pass, q_weight, d1, d2, j, mi, mj, EPS, WEIGHT_OFFSET, D, Q_W)
        k1, k2, k_pass = _rms_norm(k1, k2, k_pass, k_weight, d1, d2, j, mi, mj, EPS, WEIGHT_OFFSET, D, K_W)

    qo_row = q_out + t * QO_ST + q_head * QO_SH
    ko_row = k_out + t * KO_ST + kv_head * KO_SH
    if ROT > 0:
        _store_pairs(qo_row, q1, q2, i, mqh, q_sc, HALF, BLOCK_HALF, GPTJ, Q_FP8, Q_FP8_MAX)
        _store_pairs(ko_row, k1, k2, i, mkh, ko_sc, HALF, BLOCK_HALF, GPTJ, K_FP8, K_FP8_MAX)
    if ROT < D:
        _store_out(qo_row + j, q_pass, mqh & mj, q_sc, Q_FP8, Q_FP8_MAX)
        _store_out(ko_row + j, k_pass, mkh & mj, ko_sc, K_FP8, K_FP8_MAX)
    # The pool stores k_rot as returned in k's dtype, whatever k_out holds.
    k1 = k1.to(k.dtype.element_ty)
    k2 = k2.to(k.dtype.element_ty)
    k_pass = k_pass.to(k.dtype.element_ty)

    # Pool rows. A skipped or out-of-range slot masks every head off; masks
    # come from comparisons only (the interpreter mishandles a tensor mask
    # ANDed with a scalar bool).
    write = (slot >= 0) & (slot < pool_size) & pos_ok
    p_heads = tl.where(write, HKV, 0)
    slot = tl.where(write, slot, 0)
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    kp_row = k_pool + page * KP_PAGE + _row(in_page, KP_TT, KP_ROW, KP_ROW0) + kv_head * KP_SH
    vp_row = v_pool + page * VP_PAGE + _row(in_page, VP_TT, VP_ROW, VP_ROW0) + kv_head * VP_SH
    mkw = (hk < p_heads) & (kv_head < NUM_KV)
    if INDEXER:  # the key as returned (k's dtype), read back once stored; the pool is the uint8 cache; no value
        tl.debug_barrier()
        k_row_out = tl.load(ko_row + dv, mask=mkh & (dv < DV), other=0.0).to(tl.float32)
        indexer_store(k_pool + page * KP_PAGE, in_page, k_row_out, mkw, DV, BLOCK_DV, PAGE_SIZE, INDEXER == 2)
    elif NVFP4 or AFFINE:  # blocks over the whole row: read k_rot back as returned (k's dtype) once it is stored
        tl.debug_barrier()
        k_row_out = tl.load(ko_row + dv, mask=mkh & (dv < DV), other=0.0).to(tl.float32)
        v_row = tl.where(dv < DV, vals.to(tl.float32), 0.0)
        ks_row = k_scale_cache + page * KS_PAGE + in_page * KS_ROW + kv_head * KS_SH
        vs_row = v_scale_cache + page * VS_PAGE + in_page * VS_ROW + kv_head * VS_SH
        if NVFP4:
            nvfp4_store(kp_row, ks_row, k_row_out, k_sc, mkw, DV, BLOCK_DV)
            nvfp4_store(vp_row, vs_row, v_row, v_sc, mkw, DV, BLOCK_DV)
        else:  # AFFINE: the code width; the words are int32 views of the caller's uint32
            kb_row = k_bias_cache + page * KB_PAGE + in_page * KB_ROW + kv_head * KB_SH
            vb_row = v_bias_cache + page * VB_PAGE + in_page * VB_ROW + kv_head * VB_SH
            affine_store(kp_row, ks_row, kb_row, k_row_out, mkw, DV, BLOCK_DV, AFFINE, GROUP)
            affine_store(vp_row, vs_row, vb_row, v_row, mkw, DV, BLOCK_DV, AFFINE, GROUP)
    else:
        if PTH:  # each (token, head) row's scale, stored where the pool keeps the row; the rows take its reciprocal
            ks, k_sc = _pth_scale(tl.maximum(tl.maximum(_absmax(k1), _absmax(k2)), _absmax(k_pass)), FP8_MAX)
            vs, v_sc = _pth_scale(_absmax(tl.where(dv < DV, vals, 0.0)), FP8_MAX)
            tl.store(k_scale_cache + page * KS_PAGE + in_page * KS_ROW + kv_head * KS_SH, ks, mask=mkw)
            tl.store(v_scale_cache + page * VS_PAGE + in_page * VS_ROW + kv_head * VS_SH, vs, mask=mkw)
        if ROT > 0:
            _store_pairs(kp_row, k1, k2, i, mkw, k_sc, HALF, BLOCK_HALF, GPTJ, POOL_Q, FP8_MAX, KP_TD, KP_D1, KP_D0)
        if ROT < D:
            _store_out(kp_row + _feature(j, KP_TD, KP_D1, KP_D0), k_pass, mkw & mj, k_sc, POOL_Q, FP8_MAX)
        if DS_MLA:  # the latent row's values and tile scales; k_pe went to the kpe view above (plain)
            ds_mla_store(vp_row, tl.where(dv < DV, vals.to(tl.float32), 0.0), mkw, DV, BLOCK_DV)
        else:
            _store_out(vp_row + _feature(dv, VP_TD, VP_D1, VP_D0), vals, mkw & (dv < DV), v_sc, POOL_Q, FP8_MAX)
