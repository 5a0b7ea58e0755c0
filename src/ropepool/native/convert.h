// The kernel's number conversions (rope_kernel.h), as PyTorch rounds them: float32 to and from bf16 and fp16
// (round to nearest even), to fp8 e4m3 / e5m2, and a row of any float kind read as float32. Written without
// branches (``pick``) so that the compiler vectorizes the loops that call them; the kernel's results are compared
// with the torch backend's bits on every dtype (tests/test_native.py).
#pragma once

#include <cstdint>
#include <cstring>

namespace ropepool {

enum Kind : int32_t { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4, I32 = 5, I64 = 6, F64 = 7 };

#define ROPEPOOL_INLINE static inline __attribute__((always_inline))

static inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t x) { return float_of(static_cast<uint32_t>(x) << 16); }
// a if c else b, as arithmetic on masks: GCC's vectorizer takes no branch (nor a select it did not make itself)
// in a loop, so every conversion below picks its cases this way.
static inline uint32_t pick(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}
// Round to nearest even; NaN stays a (quiet) NaN, as c10's: (u >> 16) | 0x40. Written as one sum whose NaN case
// sets the quiet bit and adds no rounding (the same 2^32 results as picking between the two, checked exhaustively;
// ~0.6 us less a one-token Llama-3-8B call: GCC's vector code for the pick of two 32-bit results was the slower).
static inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t nan = 0u - static_cast<uint32_t>(f != f);  // (one float compare; the same 2^32 results)
  const uint32_t quiet = u | (nan & 0x400000u);
  return static_cast<uint16_t>((quiet + ((0x7fffu + ((quiet >> 16) & 1u)) & ~nan)) >> 16);
}
static inline float f16_to_f32(uint16_t h) {  // exact
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  const uint32_t special = sign | 0x7f800000u | (m << 13);                                    // inf, NaN
  const uint32_t subnormal = sign | bits_of(static_cast<float>(m) * 5.9604644775390625e-8f);  // m * 2^-24
  const uint32_t normal = sign | ((e + 112) << 23) | (m << 13);
  return float_of(pick(e == 0x1f, special, pick(e == 0, subnormal, normal)));
}
// c10/util/Half.h fp16_ieee_from_fp32_value (PyTorch; from FP16 by Marat Dukhan): round to nearest even.
static inline uint16_t f32_to_f16(float f) {
  float base = (__builtin_fabsf(f) * float_of(0x77800000u)) * float_of(0x08800000u);
  const uint32_t w = bits_of(f), shl1_w = w + w, sign = w & 0x80000000u;
  const uint32_t bias = pick((shl1_w & 0xff000000u) < 0x71000000u, 0x71000000u, shl1_w & 0xff000000u);
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits_of(base);
  const uint32_t nonsign = ((b >> 13) & 0x7c00u) + (b & 0x0fffu);
  return static_cast<uint16_t>((sign >> 16) | pick(shl1_w > 0xff000000u, 0x7e00u, nonsign));
}
// PyTorch's fp8e4m3fn_from_fp32_value and fp8e5m2_from_fp32_value (c10/util/Float8_e4m3fn.h, Float8_e5m2.h) as
// one function of the format: MANT mantissa bits, exponent BIAS, MAX_BITS the float32 bits from which a value is
// past the range (NaN, or with INF infinity where the input is not NaN; callers saturate first). Nearest even; each
// case computed, then one picked (``pick``): no branch, so a loop of them vectorizes.
template <int MANT, int BIAS, uint32_t MAX_BITS, bool INF>
ROPEPOOL_INLINE uint8_t f32_to_fp8(float f) {
  constexpr int SHIFT = 23 - MANT;
  constexpr uint32_t DENORM = static_cast<uint32_t>(127 - BIAS + SHIFT + 1) << 23;
  constexpr uint32_t MIN_NORMAL = static_cast<uint32_t>(127 - BIAS + 1) << 23;
  uint32_t b = bits_of(f);
  const uint32_t sign = b & 0x80000000u;
  b ^= sign;
  const uint32_t subnormal = bits_of(float_of(b) + float_of(DENORM)) - DENORM;
  const uint32_t normal = (b + (static_cast<uint32_t>(BIAS - 127) << 23) + ((1u << (SHIFT - 1)) - 1u) +
                           ((b >> SHIFT) & 1u)) >> SHIFT;
  const uint32_t big = INF ? pick(b > 0x7f800000u, 0x7fu, 0x7cu) : 0x7fu;
  const uint32_t r = pick(b >= MAX_BITS, big, pick(b < MIN_NORMAL, subnormal, normal));
  return static_cast<uint8_t>(r | (sign >> 24));
}
ROPEPOOL_INLINE uint8_t f32_to_e4m3(float f) { return f32_to_fp8<3, 7, 1087u << 20, false>(f); }
ROPEPOOL_INLINE uint8_t f32_to_e5m2(float f) { return f32_to_fp8<2, 15, 143u << 23, true>(f); }

// n elements of a row (element stride s) as float32 (exact).
ROPEPOOL_INLINE void load(const char* p, int32_t kind, int64_t s, int64_t n, float* __restrict out) {
  if (kind == F32) {
    const float* x = reinterpret_cast<const float*>(p);
    if (s == 1) for (int64_t i = 0; i < n; ++i) out[i] = x[i];
    else for (int64_t i = 0; i < n; ++i) out[i] = x[i * s];
  } else {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(p);
    if (kind == BF16) {
      if (s == 1) for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(x[i]);
      else for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(x[i * s]);
    } else {
      if (s == 1) for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(x[i]);
      else for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(x[i * s]);
    }
  }
}

}  // namespace ropepool
