// ropepool's CPU kernel: RoPE on q and k, and the rotated k and v written into the KV-cache pools, one call.
// Pure C++ (no framework header): the tvm-ffi binding (rope_ffi.cc) fills ``Args`` from the arrays.
//
// Per the contract (docs/api.md, docs/precision.md) the arithmetic is float32 with the roundings of
// ropepool's torch code (backends/torch_eager.py over arraymath.py): each product rounded, then the sum
// (built with -ffp-contract=off: no fused multiply-add), one rounding to the destination's type, bf16 and fp16
// round-to-nearest-even, fp8 as PyTorch casts (c10/util/Float8_e4m3fn.h, Float8_e5m2.h). cos/sin are not
// computed here: the binding hands over tables made by torch's float32 functions (or the engine's table).
//
// Nothing is written before every slot and position is checked (``run`` validates all tokens first).
#pragma once
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"

namespace ropepool {

// An array seen as [tokens, heads, dim] (element strides; 2-D arrays: one head).
struct Rows {
  char* p = nullptr;
  int32_t kind = F32;
  int64_t heads = 0, dim = 0, s_tok = 0, s_head = 0, s_dim = 1;
};

// A pool seen as its layer's [pages, page_size, heads, dim] (element strides); tiled (vLLM's AMX cache): each
// (page, head) block of page_size x dim is stored in tt x td tiles, token-major or feature-major.
struct Pool {
  char* p = nullptr;
  int32_t kind = F32;
  int64_t pages = 0, page_size = 1, heads = 0, dim = 0, s_page = 0, s_row = 0, s_head = 0, s_dim = 1;
  int32_t tiled = 0;  // 0: none; 1: token-major tiles; 2: feature-major tiles
  int64_t tt = 1, td = 1;
};

// A float32 / bf16 / fp16 table [rows, half] (cos or sin).
struct Table {
  const char* p = nullptr;
  int32_t kind = F32;
  int64_t rows = 0, s_row = 0, s_col = 1;
};

// A norm weight [dim] (float32, bf16, fp16 or float64); p == nullptr: none (gain 1).
struct Weight {
  const char* p = nullptr;
  int32_t kind = F32;
  int64_t s = 1;
};

// A destination's store: plain (its kind), or fp8 holding x / scale saturated to +-qmax.
struct Scale {
  const float* p = nullptr;  // nullptr: plain
  int64_t n = 0, s = 1;      // 1: per tensor; else one per head
  float qmax = 0.f;
};

struct Args {
  int64_t T = 0, r = 0;  // tokens; rotary_dim (0: no rotation)
  bool gptj = false;
  Rows q, k, v, q_out, k_out;
  int32_t k_kind = F32;  // k's own type: a pool stores k_rot rounded to it
  const char* pos = nullptr;
  int32_t pos_kind = I64;
  int64_t pos_rows = 1, pos_s_row = 0, pos_s = 1;  // [T] or MRoPE's [3, T]
  const int32_t* freq_row = nullptr;               // MRoPE: each frequency's position row (nullptr: row 0)
  const char* slots = nullptr;
  int32_t slot_kind = I64;
  int64_t slot_s = 1;
  Pool k_pool, v_pool;
  Scale k_pool_scale, v_pool_scale, q_out_scale, k_out_scale;
  Table cos, sin, cos_long, sin_long;  // cos_long.p: longrope's tables, used from long_from
  int64_t long_from = -1;
  bool by_token = false;  // the tables hold a row per token (computed for this call), not per position
  int32_t norm = 0;       // the QK norm: 0 none; 1 before the rotation; 2 after it
  float eps = 0.f, weight_offset = 0.f;
  Weight q_weight, k_weight;
};

// What ``run`` returns: 0 done; BAD_VALUE a slot past the pool or twice, or a negative position (nothing written;
// the binding raises the validation's message); n > 0: the tables need rows for positions < n (nothing written).
constexpr int64_t BAD_VALUE = -1;


constexpr int64_t MAX_DIM = 2048;  // the longest row (the binding declines longer ones)

ROPEPOOL_INLINE int64_t index_at(const char* p, int32_t kind, int64_t i) {
  return kind == I32 ? reinterpret_cast<const int32_t*>(p)[i] : reinterpret_cast<const int64_t*>(p)[i];
}

// Element i of a row of n at p (stride s): where ``store`` writes it. Tiled pools go through ``at``.
struct Dest {
  char* p;
  int32_t kind;
  int64_t s;
  int64_t esize;
  // tiled: (row in page, tile geometry); tile == 0: plain strided
  int32_t tile = 0;
  int64_t row = 0, rows = 1, dim = 0, tt = 1, td = 1;
  inline int64_t at(int64_t i) const {  // element offset of feature i
    if (tile == 0) return i * s;
    if (tile == 1)  // token-major: block [rows / tt, dim / td, tt, td]
      return ((row / tt) * (dim / td) + i / td) * tt * td + (row % tt) * td + i % td;
    return ((i / td) * (rows / tt) + row / tt) * td * tt + (i % td) * tt + row % tt;  // [dim/td, rows/tt, td, tt]
  }
};

// ``x`` (n floats) stored at d: rounded to d's kind, or (scale given) x / scale saturated to +-qmax, as fp8.
ROPEPOOL_INLINE void store(const Dest& d, int64_t n, const float* __restrict x, const Scale& sc, int64_t head) {
  if (sc.p != nullptr) {
    const float scale = sc.p[sc.n == 1 ? 0 : head * sc.s], qmax = sc.qmax;
    alignas(64) float y[MAX_DIM];
    for (int64_t i = 0; i < n; ++i) {
      const float t = x[i] / scale;
      y[i] = t < -qmax ? -qmax : (t > qmax ? qmax : t);  // (NaN stays NaN, as torch.clamp)
    }
    uint8_t* o = reinterpret_cast<uint8_t*>(d.p);
    if (d.tile == 0 && d.s == 1) {
      if (d.kind == E4M3) for (int64_t i = 0; i < n; ++i) o[i] = f32_to_e4m3(y[i]);
      else for (int64_t i = 0; i < n; ++i) o[i] = f32_to_e5m2(y[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) o[d.at(i)] = d.kind == E4M3 ? f32_to_e4m3(y[i]) : f32_to_e5m2(y[i]);
    }
    return;
  }
  if (d.kind == F32) {
    float* o = reinterpret_cast<float*>(d.p);
    if (d.tile == 0 && d.s == 1) for (int64_t i = 0; i < n; ++i) o[i] = x[i];
    else for (int64_t i = 0; i < n; ++i) o[d.at(i)] = x[i];
  } else if (d.kind == BF16) {
    uint16_t* o = reinterpret_cast<uint16_t*>(d.p);
    if (d.tile == 0 && d.s == 1) for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(x[i]);
    else for (int64_t i = 0; i < n; ++i) o[d.at(i)] = f32_to_bf16(x[i]);
  } else {
    uint16_t* o = reinterpret_cast<uint16_t*>(d.p);
    if (d.tile == 0 && d.s == 1) for (int64_t i = 0; i < n; ++i) o[i] = f32_to_f16(x[i]);
    else for (int64_t i = 0; i < n; ++i) o[d.at(i)] = f32_to_f16(x[i]);
  }
}

ROPEPOOL_INLINE int64_t esize(int32_t kind) { return kind == F32 ? 4 : (kind == BF16 || kind == F16) ? 2 : 1; }

ROPEPOOL_INLINE Dest row_of(const Rows& x, int64_t t, int64_t h) {
  return Dest{x.p + (t * x.s_tok + h * x.s_head) * esize(x.kind), x.kind, x.s_dim, esize(x.kind)};
}

ROPEPOOL_INLINE Dest pool_row(const Pool& p, int64_t slot, int64_t h) {
  const int64_t page = slot / p.page_size, row = slot % p.page_size, e = esize(p.kind);
  if (p.tiled == 0) return Dest{p.p + (page * p.s_page + row * p.s_row + h * p.s_head) * e, p.kind, p.s_dim, e};
  return Dest{p.p + (page * p.s_page + h * p.s_head) * e, p.kind, 1, e, p.tiled, row, p.page_size, p.dim, p.tt,
              p.td};
}

// x (D floats) with its first r features rotated by c, s (r/2 each) into y.
ROPEPOOL_INLINE void rotate(const float* __restrict x, const float* __restrict c, const float* __restrict s,
                            int64_t D, int64_t r, bool gptj, float* __restrict y) {
  const int64_t h = r / 2;
  if (gptj) {
    for (int64_t i = 0; i < h; ++i) {
      const float x1 = x[2 * i], x2 = x[2 * i + 1];
      y[2 * i] = x1 * c[i] - x2 * s[i];
      y[2 * i + 1] = x1 * s[i] + x2 * c[i];
    }
  } else {
    for (int64_t i = 0; i < h; ++i) {
      const float x1 = x[i], x2 = x[i + h];
      y[i] = x1 * c[i] - x2 * s[i];
      y[i + h] = x1 * s[i] + x2 * c[i];
    }
  }
  for (int64_t i = r; i < D; ++i) y[i] = x[i];
}

// One row's NeoX rotation in one pass, for the common case: src and dst of one kind K, contiguous, no norm, no
// scale. The same operations and roundings as load, rotate and store (the features past r too go through float32
// and back, as store rounds them: a signalling NaN comes out quiet either way).
template <int32_t K>
ROPEPOOL_INLINE void rope_row(const char* src, char* dst, const float* __restrict c, const float* __restrict s,
                              int64_t D, int64_t r) {
  using E = typename std::conditional<K == F32, float, uint16_t>::type;
  const E* __restrict x = reinterpret_cast<const E*>(src);
  E* __restrict y = reinterpret_cast<E*>(dst);
  auto in = [](E v) { return K == F32 ? static_cast<float>(v) : K == BF16 ? bf16_to_f32(v) : f16_to_f32(v); };
  auto out = [](float v) { return K == F32 ? static_cast<E>(v) : K == BF16 ? f32_to_bf16(v) : f32_to_f16(v); };
  const int64_t h = r / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float x1 = in(x[i]), x2 = in(x[i + h]);
    y[i] = out(x1 * c[i] - x2 * s[i]);
    y[i + h] = out(x1 * s[i] + x2 * c[i]);
  }
  for (int64_t i = r; i < D; ++i) y[i] = out(in(x[i]));
}

ROPEPOOL_INLINE void rope_row_of(int32_t kind, const char* src, char* dst, const float* c, const float* s, int64_t D,
                                 int64_t r) {
  if (kind == F32) rope_row<F32>(src, dst, c, s, D, r);
  else if (kind == BF16) rope_row<BF16>(src, dst, c, s, D, r);
  else rope_row<F16>(src, dst, c, s, D, r);
}

// Whether rows of x go to out by rope_row: NeoX pairs, no norm, one plain kind, contiguous rows.
ROPEPOOL_INLINE bool one_pass(const Args& a, const Rows& x, const Rows& out, const Scale& sc) {
  return a.norm == 0 && !a.gptj && x.kind == out.kind && x.kind <= F16 && x.s_dim == 1 && out.s_dim == 1 &&
         sc.p == nullptr;
}

// The norm's gain ``float32(w) + weight_offset`` (float32 arithmetic, as arraymath.normalize).
ROPEPOOL_INLINE void gain(const Weight& w, int64_t n, float offset, float* __restrict g) {
  if (w.kind == F64) {
    const double* x = reinterpret_cast<const double*>(w.p);
    for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(x[i * w.s]);  // nearest even, as Tensor.float()
  } else {
    load(w.p, w.kind, w.s, n, g);
  }
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] + offset;
}

// x (n floats) RMS-normalised in place as arraymath.normalize: ``(x * rsqrt(sum(x * x) / n + eps)) * g``, each
// operation rounded to float32 (g == nullptr: no weight). The sum runs over 16 lanes, then halves them: a fixed
// order on every ISA (torch's mean sums in its own vector order: a difference of float32 rounding, measured in
// docs/precision.md), and a loop the compiler vectorizes without reassociating anything.
ROPEPOOL_INLINE void normalize(float* __restrict x, int64_t n, float eps, const float* __restrict g) {
  constexpr int64_t L = 16;
  float acc[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int64_t j = 0; j < L; ++j) acc[j] += x[i + j] * x[i + j];
  for (int64_t j = 0; i + j < n; ++j) acc[j] += x[i + j] * x[i + j];
  for (int64_t w = L / 2; w >= 1; w /= 2)
    for (int64_t j = 0; j < w; ++j) acc[j] += acc[j + w];
  const float r = 1.0f / __builtin_sqrtf(acc[0] / static_cast<float>(n) + eps);  // torch.rsqrt: 1 / sqrt
  if (g == nullptr) for (int64_t k = 0; k < n; ++k) x[k] = x[k] * r;
  else for (int64_t k = 0; k < n; ++k) x[k] = (x[k] * r) * g[k];
}

ROPEPOOL_INLINE void table_row(const Table& tb, const Args& a, int64_t t, const int64_t* rows_pos, float* out) {
  const int64_t h = a.r / 2;
  if (a.freq_row == nullptr) {
    load(tb.p + rows_pos[0] * tb.s_row * esize(tb.kind), tb.kind, tb.s_col, h, out);
    return;
  }
  for (int64_t i = 0; i < h; ++i)  // MRoPE: each frequency from its row's position
    load(tb.p + (rows_pos[a.freq_row[i]] * tb.s_row + i * tb.s_col) * esize(tb.kind), tb.kind, 1, 1, out + i);
  (void)t;
}

// No slot >= 0 twice (validation's rule, checks/values.py): pairs compared up to 64 tokens, sorted past that.
static inline bool unique_slots(const Args& a) {
  if (a.T <= 64) {
    for (int64_t t = 1; t < a.T; ++t) {
      const int64_t s = index_at(a.slots, a.slot_kind, t * a.slot_s);
      for (int64_t u = 0; s >= 0 && u < t; ++u)
        if (index_at(a.slots, a.slot_kind, u * a.slot_s) == s) return false;
    }
    return true;
  }
  std::vector<int64_t> used;
  used.reserve(static_cast<size_t>(a.T));
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t s = index_at(a.slots, a.slot_kind, t * a.slot_s);
    if (s >= 0) used.push_back(s);
  }
  std::sort(used.begin(), used.end());
  return std::adjacent_find(used.begin(), used.end()) == used.end();
}

// One head of q or k the general way: its row loaded, normalised (norm 1), rotated into y, normalised (norm 2),
// stored into ``out`` (x: scratch; y keeps the rotated floats for the pool).
ROPEPOOL_INLINE void rope_head(const Args& a, const Dest& src, const Dest& out, const Scale& scale, int64_t h,
                               const float* gain, const float* c, const float* s, float* x, float* y) {
  const int64_t D = a.q.dim;
  load(src.p, src.kind, src.s, D, x);
  if (a.norm == 1) normalize(x, D, a.eps, gain);
  rotate(x, c, s, D, a.r, a.gptj, y);
  if (a.norm == 2) normalize(y, D, a.eps, gain);
  store(out, D, y, scale, h);
}

ROPEPOOL_INLINE int64_t run_body(const Args& a) {
  const int64_t pool_size = a.k_pool.pages * a.k_pool.page_size;
  if (!unique_slots(a)) return BAD_VALUE;
  int64_t top = -1;
  for (int64_t t = 0; t < a.T; ++t) {  // every value checked before anything is written
    if (index_at(a.slots, a.slot_kind, t * a.slot_s) >= pool_size) return BAD_VALUE;
    for (int64_t j = 0; j < a.pos_rows; ++j) {
      const int64_t p = index_at(a.pos, a.pos_kind, j * a.pos_s_row + t * a.pos_s);
      if (p < 0) return BAD_VALUE;
      top = p > top ? p : top;
    }
  }
  const bool use_long = a.long_from >= 0 && top >= a.long_from;
  const Table& cos = use_long ? a.cos_long : a.cos;
  const Table& sin = use_long ? a.sin_long : a.sin;
  if (a.r > 0 && !a.by_token && (top >= cos.rows || top >= sin.rows)) return top + 1;

  const int64_t D = a.q.dim, Dv = a.v.dim, r = a.r;
  alignas(64) float c[MAX_DIM / 2], s[MAX_DIM / 2], x[MAX_DIM], y[MAX_DIM], z[MAX_DIM], gq[MAX_DIM], gk[MAX_DIM];
  const float* q_gain = nullptr;
  const float* k_gain = nullptr;
  if (a.norm != 0 && a.q_weight.p != nullptr) {
    gain(a.q_weight, D, a.weight_offset, gq);
    q_gain = gq;
  }
  if (a.norm != 0 && a.k_weight.p != nullptr) {
    gain(a.k_weight, D, a.weight_offset, gk);
    k_gain = gk;
  }
  const bool q_one_pass = one_pass(a, a.q, a.q_out, a.q_out_scale);
  // k's pool row: k_out's row as it is (the same rounding of the same floats) where the pool holds that kind plainly
  const bool k_one_pass = one_pass(a, a.k, a.k_out, a.k_out_scale) && a.k_pool_scale.p == nullptr &&
                          a.k_pool.kind == a.k.kind && a.k_pool.tiled == 0 && a.k_pool.s_dim == 1;
  for (int64_t t = 0; t < a.T; ++t) {
    if (r > 0) {
      int64_t rows_pos[3] = {t, t, t};
      if (!a.by_token)
        for (int64_t j = 0; j < a.pos_rows; ++j) rows_pos[j] = index_at(a.pos, a.pos_kind, j * a.pos_s_row + t * a.pos_s);
      table_row(cos, a, t, rows_pos, c);
      table_row(sin, a, t, rows_pos, s);
    }
    for (int64_t h = 0; q_one_pass && h < a.q.heads; ++h)
      rope_row_of(a.q.kind, row_of(a.q, t, h).p, row_of(a.q_out, t, h).p, c, s, D, r);
    for (int64_t h = 0; !q_one_pass && h < a.q.heads; ++h)
      rope_head(a, row_of(a.q, t, h), row_of(a.q_out, t, h), a.q_out_scale, h, q_gain, c, s, x, y);
    const int64_t slot = index_at(a.slots, a.slot_kind, t * a.slot_s);
    for (int64_t h = 0; k_one_pass && h < a.k.heads; ++h) {
      const Dest out = row_of(a.k_out, t, h);
      rope_row_of(a.k.kind, row_of(a.k, t, h).p, out.p, c, s, D, r);
      if (slot >= 0) std::memcpy(pool_row(a.k_pool, slot, h).p, out.p, D * out.esize);
    }
    for (int64_t h = 0; !k_one_pass && h < a.k.heads; ++h) {
      rope_head(a, row_of(a.k, t, h), row_of(a.k_out, t, h), a.k_out_scale, h, k_gain, c, s, x, y);
      if (slot < 0) continue;
      if (a.k_pool_scale.p != nullptr && a.k_kind != F32) {  // the pool stores k_rot as rounded to k's type
        if (a.k_kind == BF16) for (int64_t i = 0; i < D; ++i) z[i] = bf16_to_f32(f32_to_bf16(y[i]));
        else for (int64_t i = 0; i < D; ++i) z[i] = f16_to_f32(f32_to_f16(y[i]));
        store(pool_row(a.k_pool, slot, h), D, z, a.k_pool_scale, h);
      } else {
        store(pool_row(a.k_pool, slot, h), D, y, a.k_pool_scale, h);
      }
    }
    if (slot < 0) continue;
    for (int64_t h = 0; h < a.v.heads; ++h) {
      const Dest src = row_of(a.v, t, h), dst = pool_row(a.v_pool, slot, h);
      if (a.v_pool_scale.p == nullptr && src.kind == dst.kind && src.s == 1 && dst.s == 1 && dst.tile == 0) {
        std::memcpy(dst.p, src.p, Dv * src.esize);
        continue;
      }
      load(src.p, src.kind, src.s, Dv, x);
      store(dst, Dv, x, a.v_pool_scale, h);
    }
  }
  return 0;
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) static int64_t run_avx512(const Args& a) {
  return run_body(a);
}
__attribute__((target("avx2"))) static int64_t run_avx2(const Args& a) { return run_body(a); }
#endif
static int64_t run_base(const Args& a) { return run_body(a); }

using Runner = int64_t (*)(const Args&);

// The build for this CPU, picked once (x86-64: AVX-512, AVX2 or the baseline; elsewhere the compiler's own).
static inline Runner pick() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return run_avx512;
  if (__builtin_cpu_supports("avx2")) return run_avx2;
#endif
  return run_base;
}

static inline const char* isa_name(Runner f) {
#if defined(__x86_64__)
  if (f == run_avx512) return "avx512";
  if (f == run_avx2) return "avx2";
#endif
  (void)f;
  return "baseline";
}

}  // namespace ropepool
