// The binding of ropepool's CPU kernel (rope_kernel.h): arrays in (tvm-ffi TensorViews of the DLTensors rope_py.cc
// reads from torch tensors, zero-copy), the kernel's Args filled from their shapes, strides and dtypes and from
// the plan's ``cfg`` (backends/torch_native.py makes it once per layout). Errors are tvm-ffi's, which rope_py.cc
// raises as Python exceptions.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>

#include <cstring>

#include "layout.h"
#include "rope_kernel.h"

using tvm::ffi::TensorView;
namespace rp = ropepool;

namespace {

// cfg's entries, declared once: the enum below, and the names ``cfg_names`` gives backends/torch_native.py, which
// fills cfg by them. cfg itself, and the constant arrays of a layout (MRoPE's rows, the scales), are given by
// address (*_PTR): the binding keeps them alive while its cfg lives, and a call takes 10 tensor arguments, not 17
// (each costs ~0.2 us). Each scale is 4 entries in a row (PTR, N, STRIDE, QMAX: ``scale``); eps and offset are
// float32 bits. LAYOUTS: the layout the binding was made for (``bind``), layout.h's record of 9 arrays, compared
// at every call before anything else.
#define ROPEPOOL_SCALE(X, D) X(D##_SCALE_PTR) X(D##_SCALE_N) X(D##_SCALE_STRIDE) X(D##_QMAX)
#define ROPEPOOL_CFG(X)                                                                                              \
  X(ROTARY_DIM) X(GPTJ) X(LONG_FROM) X(BY_TOKEN) X(LAYER) X(KV_LAYOUT) X(HEADED) X(K_KIND) X(SIN_AT) X(LONG_AT)     \
  X(MROPE_ROWS_PTR) ROPEPOOL_SCALE(X, K_POOL) ROPEPOOL_SCALE(X, V_POOL) ROPEPOOL_SCALE(X, Q_OUT)                   \
  ROPEPOOL_SCALE(X, K_OUT) X(NORM) X(NORM_EPS) X(NORM_OFFSET) X(Q_WEIGHTED) X(K_WEIGHTED)
#define ROPEPOOL_ENTRY(name) name,
enum Cfg { ROPEPOOL_CFG(ROPEPOOL_ENTRY) LAYOUTS };
#undef ROPEPOOL_ENTRY
constexpr int NUM_ARRAYS = rp::layout::NUM_ARRAYS;  // q, k, v, positions, slots, k_pool, v_pool, q_out, k_out
constexpr int NUM_CFG = LAYOUTS + rp::layout::SIZE;
// What a call returns besides rope_kernel.h's: the arrays are not laid out as those bound (nothing read or
// written; the caller checks the call in full).
constexpr int64_t OTHER_LAYOUT = rp::layout::OTHER_LAYOUT;
enum Layout { FLAT = 0, NHD = 1, HND = 2, AMX = 3 };

int32_t kind_of(DLDataType t) {
  if (t.lanes != 1) return -1;
  if (t.code == kDLFloat && t.bits == 32) return rp::F32;
  if (t.code == kDLBfloat && t.bits == 16) return rp::BF16;
  if (t.code == kDLFloat && t.bits == 16) return rp::F16;
  if (t.code == kDLFloat8_e4m3fn && t.bits == 8) return rp::E4M3;
  if (t.code == kDLFloat8_e5m2 && t.bits == 8) return rp::E5M2;
  if (t.code == kDLInt && t.bits == 32) return rp::I32;
  if (t.code == kDLInt && t.bits == 64) return rp::I64;
  if (t.code == kDLFloat && t.bits == 64) return rp::F64;
  return -1;
}

using rp::layout::base;

int32_t checked_kind(const TensorView& x, const char* name) {
  TVM_FFI_CHECK(x.device().device_type == kDLCPU, ValueError) << name << " must be a CPU array";
  int32_t k = kind_of(x.dtype());
  TVM_FFI_CHECK(k >= 0, TypeError) << name << ": unsupported dtype";
  return k;
}

rp::Rows rows(const TensorView& x, const char* name, int64_t T) {
  rp::Rows r;
  r.p = base(x);
  r.kind = checked_kind(x, name);
  TVM_FFI_CHECK(r.kind <= rp::E5M2, TypeError) << name << ": float32, bfloat16, float16 or float8";
  TVM_FFI_CHECK((x.ndim() == 2 || x.ndim() == 3) && x.size(0) == T, ValueError) << name << ": [T, (heads,) dim]";
  r.s_tok = x.stride(0);
  r.dim = x.size(-1);
  r.s_dim = x.stride(-1);
  r.heads = x.ndim() == 3 ? x.size(1) : 1;
  r.s_head = x.ndim() == 3 ? x.stride(1) : 0;
  TVM_FFI_CHECK(r.dim <= rp::MAX_DIM, ValueError) << name << ": rows longer than " << rp::MAX_DIM;
  return r;
}

rp::Pool pool(const TensorView& x, const char* name, const int64_t* cfg, bool v) {
  rp::Pool p;
  p.kind = checked_kind(x, name);
  const int64_t layer = cfg[LAYER], layout = cfg[KV_LAYOUT];
  const bool headed = cfg[HEADED] != 0;
  int d = 0;
  p.p = base(x);
  if (layer >= 0) {
    TVM_FFI_CHECK(layer < x.size(0), IndexError) << name << ": layer out of range";
    p.p += layer * x.stride(0) * rp::esize(p.kind);
    d = 1;
  }
  TVM_FFI_CHECK(x.ndim() == d + 2 + (layout != FLAT) + headed, ValueError) << name << ": rank of its layout";
  p.pages = x.size(d);
  p.s_page = x.stride(d);
  p.dim = x.size(-1);
  p.s_dim = x.stride(-1);
  if (layout == FLAT) {
    p.page_size = 1;
    p.heads = headed ? x.size(d + 1) : 1;
    p.s_head = headed ? x.stride(d + 1) : 0;
  } else if (layout == NHD || !headed) {
    p.page_size = x.size(d + 1);
    p.s_row = x.stride(d + 1);
    p.heads = headed ? x.size(d + 2) : 1;
    p.s_head = headed ? x.stride(d + 2) : 0;
  } else {  // HND and the tiled layouts: [pages, heads, page_size, dim]
    p.heads = x.size(d + 1);
    p.s_head = x.stride(d + 1);
    p.page_size = x.size(d + 2);
    p.s_row = x.stride(d + 2);
  }
  if (layout == AMX) {  // checks/layout.py TILED["amx"]: k 16 tokens x 2 features token-major, v 2 x 16
    p.tiled = v ? 2 : 1;
    p.tt = v ? 2 : 16;
    p.td = v ? 16 : 2;
  }
  return p;
}

// Columns [at, at + half) of a float table [rows, cols] (cos or sin).
rp::Table table(const TensorView& x, int64_t at, int64_t half) {
  rp::Table t;
  t.kind = checked_kind(x, "table");
  TVM_FFI_CHECK(x.ndim() == 2 && t.kind <= rp::F16 && at >= 0 && (at + half - 1) < x.size(1), ValueError)
      << "table: a float [rows, cols] with columns " << at << ".." << at + half - 1;
  t.p = base(x) + at * x.stride(1) * rp::esize(t.kind);
  t.rows = x.size(0);
  t.s_row = x.stride(0);
  t.s_col = x.stride(1);
  return t;
}

rp::Scale scale(const int64_t* c) {  // (PTR, N, STRIDE, QMAX)
  rp::Scale s;
  if (c[3] == 0) return s;
  s.p = reinterpret_cast<const float*>(c[0]);
  s.n = c[1];
  s.s = c[2];
  s.qmax = static_cast<float>(c[3]);
  return s;
}

float float_bits(int64_t u) {
  const uint32_t b = static_cast<uint32_t>(u);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// A norm weight: [dim] float (float64 too), or none where cfg says so.
rp::Weight weight(const TensorView& x, const char* name, bool given, int64_t dim) {
  rp::Weight w;
  if (!given) return w;
  w.kind = checked_kind(x, name);
  TVM_FFI_CHECK(x.ndim() == 1 && x.size(0) == dim && (w.kind <= rp::F16 || w.kind == rp::F64), ValueError)
      << name << ": a float [" << dim << "]";
  w.p = base(x);
  w.s = x.stride(0);
  return w;
}

const rp::Runner RUN = rp::pick();

rp::Args args(TensorView q, TensorView k, TensorView v, TensorView positions, TensorView slots, TensorView k_pool,
              TensorView v_pool, TensorView q_out, TensorView k_out, TensorView cos_sin, const int64_t* cfg) {
  rp::Args a;
  a.T = q.size(0);
  a.r = cfg[ROTARY_DIM];
  a.gptj = cfg[GPTJ] != 0;
  a.q = rows(q, "q", a.T);
  a.k = rows(k, "k", a.T);
  a.v = rows(v, "v", a.T);
  a.q_out = rows(q_out, "q_out", a.T);
  a.k_out = rows(k_out, "k_out", a.T);
  TVM_FFI_CHECK(a.k.dim == a.q.dim && a.q_out.dim == a.q.dim && a.k_out.dim == a.q.dim && a.r <= a.q.dim &&
                a.q_out.heads == a.q.heads && a.k_out.heads == a.k.heads && a.v.heads == a.k.heads, ValueError)
      << "q/k/v/q_out/k_out shapes";
  a.k_kind = static_cast<int32_t>(cfg[K_KIND]);
  a.pos = base(positions);
  a.pos_kind = checked_kind(positions, "positions");
  a.pos_rows = positions.ndim() == 2 ? positions.size(0) : 1;
  a.pos_s_row = positions.ndim() == 2 ? positions.stride(0) : 0;
  a.pos_s = positions.stride(-1);
  a.slots = base(slots);
  a.slot_kind = checked_kind(slots, "slots");
  a.slot_s = slots.stride(0);
  TVM_FFI_CHECK((a.pos_kind == rp::I32 || a.pos_kind == rp::I64) && (a.slot_kind == rp::I32 || a.slot_kind == rp::I64)
                && positions.size(-1) == a.T && slots.ndim() == 1 && slots.size(0) == a.T && a.pos_rows <= 3,
                TypeError) << "positions/slots: int32 or int64, one per token";
  a.k_pool = pool(k_pool, "k_pool", cfg, false);
  a.v_pool = pool(v_pool, "v_pool", cfg, true);
  TVM_FFI_CHECK(a.k_pool.heads == a.k.heads && a.v_pool.heads == a.v.heads && a.k_pool.dim == a.k.dim &&
                a.v_pool.dim == a.v.dim && a.v_pool.pages * a.v_pool.page_size == a.k_pool.pages * a.k_pool.page_size,
                ValueError) << "pool shapes";
  a.k_pool_scale = scale(cfg + K_POOL_SCALE_PTR);
  a.v_pool_scale = scale(cfg + V_POOL_SCALE_PTR);
  a.q_out_scale = scale(cfg + Q_OUT_SCALE_PTR);
  a.k_out_scale = scale(cfg + K_OUT_SCALE_PTR);
  if (a.r > 0) {
    const int64_t half = a.r / 2;
    a.cos = table(cos_sin, 0, half);
    a.sin = table(cos_sin, cfg[SIN_AT], half);
    a.long_from = cfg[LONG_FROM];
    if (a.long_from >= 0) {
      a.cos_long = table(cos_sin, cfg[LONG_AT], half);
      a.sin_long = table(cos_sin, cfg[LONG_AT] + cfg[SIN_AT], half);
    }
    a.by_token = cfg[BY_TOKEN] != 0;
    TVM_FFI_CHECK(!a.by_token || a.cos.rows >= a.T, ValueError) << "cos/sin: a row per token";
    a.freq_row = reinterpret_cast<const int32_t*>(cfg[MROPE_ROWS_PTR]);
    TVM_FFI_CHECK(a.pos_rows == (a.freq_row != nullptr ? 3 : 1) || a.by_token, ValueError)
        << "[3, T] positions: MRoPE rows or cos/sin by token";
  }
  return a;
}

const int64_t* cfg_at(int64_t address) {
  TVM_FFI_CHECK(address != 0, ValueError) << "cfg: the address of an int64 [" << NUM_CFG << "]";
  return reinterpret_cast<const int64_t*>(address);
}

}  // namespace

// The number of cfg entries (the binding allocates them).
int64_t cfg_size() { return NUM_CFG; }

// The names of cfg's entries before LAYOUTS, in its order, separated by spaces (the binding fills cfg by them).
const char* cfg_names() {
#define ROPEPOOL_NAME(name) #name " "
  return ROPEPOOL_CFG(ROPEPOOL_NAME);
#undef ROPEPOOL_NAME
}

// Records the layout of these arrays (a call's, as ``rope_pool`` takes them) in cfg: every later call is
// compared with it.
void bind(TensorView q, TensorView k, TensorView v, TensorView positions, TensorView slots, TensorView k_pool,
          TensorView v_pool, TensorView q_out, TensorView k_out, int64_t cfg_address) {
  const TensorView xs[NUM_ARRAYS] = {q, k, v, positions, slots, k_pool, v_pool, q_out, k_out};
  int64_t* cfg = const_cast<int64_t*>(cfg_at(cfg_address));
  TVM_FFI_CHECK(rp::layout::record(xs, cfg + LAYOUTS), ValueError) << "arrays of at most " << rp::layout::MAX_NDIM
                                                                   << " dims";
}

// Returns 0 (done), -1 (a slot past the pool or twice, or a negative position: nothing written), -2 (the arrays are not laid
// out as those bound: nothing read or written) or n > 0 (the table needs rows for positions < n: nothing written).
// cfg_address: the address of the binding's int64 cfg.
int64_t rope_pool(TensorView q, TensorView k, TensorView v, TensorView positions, TensorView slots,
                  TensorView k_pool, TensorView v_pool, TensorView q_out, TensorView k_out, TensorView cos_sin,
                  int64_t cfg_address) {
  const int64_t* cfg = cfg_at(cfg_address);
  const TensorView xs[NUM_ARRAYS] = {q, k, v, positions, slots, k_pool, v_pool, q_out, k_out};
  if (!rp::layout::same(xs, cfg + LAYOUTS)) return OTHER_LAYOUT;
  return RUN(args(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cos_sin, cfg));
}

// rope_pool with the QK norm (cfg: NORM ...), its weights first (read per call: an in-place update is seen). A
// function of its own, so that calls without a norm pass no more arrays (each costs ~0.2 us).
int64_t rope_pool_norm(TensorView q_weight, TensorView k_weight, TensorView q, TensorView k, TensorView v,
                       TensorView positions, TensorView slots, TensorView k_pool, TensorView v_pool, TensorView q_out,
                       TensorView k_out, TensorView cos_sin, int64_t cfg_address) {
  const int64_t* cfg = cfg_at(cfg_address);
  const TensorView xs[NUM_ARRAYS] = {q, k, v, positions, slots, k_pool, v_pool, q_out, k_out};
  if (!rp::layout::same(xs, cfg + LAYOUTS)) return OTHER_LAYOUT;
  rp::Args a = args(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cos_sin, cfg);
  TVM_FFI_CHECK(cfg[NORM] == 1 || cfg[NORM] == 2, ValueError) << "cfg: norm 1 (before RoPE) or 2 (after)";
  a.norm = static_cast<int32_t>(cfg[NORM]);
  a.eps = float_bits(cfg[NORM_EPS]);
  a.weight_offset = float_bits(cfg[NORM_OFFSET]);
  a.q_weight = weight(q_weight, "q_weight", cfg[Q_WEIGHTED] != 0, a.q.dim);
  a.k_weight = weight(k_weight, "k_weight", cfg[K_WEIGHTED] != 0, a.k.dim);
  return RUN(a);
}

// Which build runs here ("avx512", "avx2", "baseline"): `ropepool env` prints it.
const char* isa() { return rp::isa_name(RUN); }
