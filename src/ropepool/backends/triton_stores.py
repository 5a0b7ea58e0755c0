"""The fused kernel's stores of the quantized formats (``triton_kernel.rope_pool_kernel`` calls them).

Each takes float32 rows ``x [heads, BLOCK]`` and writes one destination's bytes: NVFP4 (FlashInfer's
e2m1 codes and e4m3 block scales), mx.quantize's affine words with their scales and biases, DeepSeek
V3.2's fp8_ds_mla rows and its indexer's keys. The roundings are written out by hand where the CPU
interpreter's casts mis-round, so CI's interpreter run checks the same bits a GPU stores.
"""
import triton
import triton.language as tl


@triton.jit
def e4m3(s):
    """float32 ``s >= 0`` rounded to float8_e4m3fn (nearest even, saturated at 448) as (its bits, its value).

    By hand, not by a cast: the CPU interpreter's fp8 casts mis-round (triton-lang/triton#8322). A step of
    e4m3 is 2^(e - 3) for a value in [2^e, 2^(e+1)), e >= -6 (below: subnormal, step 2^-9); dividing by a
    power of two is exact, so the quotient's nearest-even integer gives the rounded value."""
    s = tl.minimum(s, 448.0)
    e = tl.maximum(((s.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    q = s / step
    f = tl.floor(q)
    d = q - f
    odd = (f.to(tl.int32) & 1) == 1
    r = f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)
    val = tl.minimum(r * step, 448.0)
    ve = tl.maximum(((val.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127, -6)  # val's exponent
    normal = val >= 0.015625
    mant = tl.where(normal, val / ((ve + 127) << 23).to(tl.float32, bitcast=True) * 8.0 - 8.0, val * 512.0)
    bits = tl.where(normal, ((ve + 7) << 3), 0) + mant.to(tl.int32)
    return bits.to(tl.uint8), val


@triton.jit
def e2m1(y):
    """4-bit e2m1 codes of float32 ``y`` (nearest, ties to the even code, saturated at 6; sign in bit 3):
    how many midpoints the magnitude passes, > or >= by the parity of the code above (blockquant.py)."""
    m = tl.abs(y)
    code = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32) + \
        (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32)
    sign = (y.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    return code + sign * 8


@triton.jit
def nvfp4_store(row, sf_row, x, g, mask, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """FlashInfer's NVFP4 quantization of float32 rows ``x [heads, BLOCK_DV]`` (global decode scale ``g``):
    e2m1 codes two a byte at ``row``, one e4m3 scale per 16 features at ``sf_row`` (reference/quant.py)."""
    NB: tl.constexpr = BLOCK_DV // 16
    xb = tl.reshape(x, [x.shape[0], NB, 16])
    amax = tl.max(tl.abs(xb), 2)
    live = amax > 0.0
    six_g = tl.full(amax.shape, 6.0, tl.float32) * g
    sf_bits, sf = e4m3(tl.where(live, tl.div_rn(amax, six_g), 0.0))
    one = tl.full(amax.shape, 1.0, tl.float32)
    out_scale = tl.where(live & (sf > 0.0), tl.div_rn(one, tl.where(sf > 0.0, sf, 1.0) * g), 0.0)
    codes = tl.reshape(e2m1(xb * out_scale[:, :, None]), [x.shape[0], BLOCK_DV // 2, 2])
    lo, hi = tl.split(codes)
    c = tl.arange(0, BLOCK_DV // 2)[None, :]
    tl.store(row + c, (lo + hi * 16).to(tl.uint8), mask=mask & (c < DV // 2))
    b = tl.arange(0, NB)[None, :]
    tl.store(sf_row + b, sf_bits, mask=mask & (b < DV // 16))


@triton.jit
def rint(x):
    """float32 ``x`` rounded to the nearest integer, ties to even (``rint``, as mx.quantize rounds): the floor
    and the fraction are exact, the parity is read in float (codes past 2^31 at a 1e-7 scale)."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


@triton.jit
def to_elements(x, ptr):
    """float32 ``x`` in ptr's dtype, rounded to nearest even. To bfloat16 by hand: the CPU interpreter's cast
    truncates (Triton 3.9, even with fp_downcast_rounding="rtne"); the rounded float32 then casts exactly."""
    if ptr.dtype.element_ty == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        x = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def affine_store(row, s_row, b_row, x, mask, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BITS: tl.constexpr,
                  GROUP: tl.constexpr):
    """mx.quantize's affine format of float32 rows ``x [heads, BLOCK_DV]``: per group a scale and a bias (the
    edge of larger magnitude exact) at ``s_row``, ``b_row`` in their dtype; codes ``rint((x - bias) / scale)``
    in [0, 2^BITS - 1], ``32 // BITS`` a word at ``row``, element k at bit k * BITS (reference/quant.py).
    Every quotient is IEEE-rounded (``div_rn``), as the CPU's."""
    NG: tl.constexpr = BLOCK_DV // GROUP
    PER: tl.constexpr = 32 // BITS
    xg = tl.reshape(x, [x.shape[0], NG, GROUP])
    w_max = tl.max(xg, 2)
    w_min = tl.min(xg, 2)
    n_bins = tl.full(w_max.shape, (1 << BITS) - 1, tl.float32)
    use_min = tl.abs(w_min) > tl.abs(w_max)
    scale = tl.maximum(tl.div_rn(w_max - w_min, n_bins), 1e-7)
    scale = tl.where(use_min, scale, -scale)
    edge = tl.where(use_min, w_min, w_max)
    q0 = rint(tl.div_rn(edge, scale))
    nonzero = q0 != 0.0
    scale = tl.where(nonzero, tl.div_rn(edge, tl.where(nonzero, q0, 1.0)), scale)
    bias = tl.where(nonzero, edge, 0.0)
    q = rint(tl.div_rn(xg - tl.broadcast_to(bias[:, :, None], xg.shape), tl.broadcast_to(scale[:, :, None], xg.shape)))
    q = tl.minimum(tl.maximum(q, 0.0), (1 << BITS) - 1).to(tl.int64)
    shifts = (tl.arange(0, PER) * BITS).to(tl.int64)[None, None, :]
    words = tl.sum(tl.reshape(q, [x.shape[0], BLOCK_DV // PER, PER]) << shifts, 2)  # disjoint bits: sum = or
    c = tl.arange(0, BLOCK_DV // PER)[None, :]
    tl.store(row + c, words.to(tl.int32), mask=mask & (c < DV // PER))  # (the uint32 words seen as int32)
    b = tl.arange(0, NG)[None, :]
    tl.store(s_row + b, to_elements(scale, s_row), mask=mask & (b < DV // GROUP))
    tl.store(b_row + b, to_elements(bias, b_row), mask=mask & (b < DV // GROUP))


@triton.jit
def ds_mla_store(row, x, mask, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """fp8_ds_mla's first 528 bytes of each row (ropepool.checks.dsa): float32 ``x [heads, 512]`` (kv_c) in 4 tiles of
    128, each stored as e4m3 of ``x / s`` with ``s = max(amax / 448, FLT_MIN)`` (IEEE divisions, as vLLM's
    concat_and_cache_ds_mla_kernel), then the 4 scales' float32 bytes, little-endian. ``row``: uint8."""
    xt = tl.reshape(x, [x.shape[0], BLOCK_DV // 128, 128])
    s = tl.maximum(tl.div_rn(tl.max(tl.abs(xt), 2), tl.full([x.shape[0], BLOCK_DV // 128], 448.0, tl.float32)),
                   1.1754943508222875e-38)
    y = tl.div_rn(xt, s[:, :, None])
    mag_bits, _ = e4m3(tl.abs(y))  # saturated at 448, nearest even
    sign = (y.to(tl.uint32, bitcast=True) >> 31).to(tl.uint8)
    c = tl.arange(0, BLOCK_DV)[None, :]
    tl.store(row + c, tl.reshape(mag_bits | (sign << 7), [x.shape[0], BLOCK_DV]), mask=mask & (c < DV))
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    sb = ((s.to(tl.uint32, bitcast=True)[:, :, None] >> shifts[None, None, :]) & 0xFF).to(tl.uint8)
    b = tl.arange(0, 4 * (BLOCK_DV // 128))[None, :]
    tl.store(row + DV + b, tl.reshape(sb, [x.shape[0], 4 * (BLOCK_DV // 128)]), mask=mask & (b < 4 * (DV // 128)))


@triton.jit
def indexer_store(page_ptr, in_page, x, mask, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   UE8M0: tl.constexpr):
    """DeepSeek V3.2's indexer key (ropepool.checks.dsa): float32 ``x [heads, D]`` (k_rot as returned) in groups of 128,
    each stored as e4m3 of ``x / s``, ``s = max(amax, 1e-4) / 448`` (UE8M0: ``2 ** ceil(log2(s))``), as vLLM's
    indexer_k_quant_and_cache_kernel; a page holds its rows' values, then their float32 scales.
    ``page_ptr``: the page's first byte (uint8)."""
    G: tl.constexpr = BLOCK_D // 128
    xg = tl.reshape(x, [x.shape[0], G, 128])
    amax = tl.maximum(tl.max(tl.abs(xg), 2), 9.999999747378752e-05)  # fmaxf(amax, 1e-4f)
    s = tl.div_rn(amax, tl.full([x.shape[0], G], 448.0, tl.float32))
    if UE8M0:
        s = tl.exp2(tl.ceil(tl.log2(s)))
    y = tl.div_rn(xg, s[:, :, None])
    mag_bits, _ = e4m3(tl.abs(y))
    sign = (y.to(tl.uint32, bitcast=True) >> 31).to(tl.uint8)
    c = tl.arange(0, BLOCK_D)[None, :]
    tl.store(page_ptr + in_page * D + c, tl.reshape(mag_bits | (sign << 7), [x.shape[0], BLOCK_D]),
             mask=mask & (c < D))
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    sb = ((s.to(tl.uint32, bitcast=True)[:, :, None] >> shifts[None, None, :]) & 0xFF).to(tl.uint8)
    b = tl.arange(0, 4 * G)[None, :]
    tl.store(page_ptr + PAGE_SIZE * D + in_page * (4 * (D // 128)) + b, tl.reshape(sb, [x.shape[0], 4 * G]),
             mask=mask & (b < 4 * (D // 128)))
