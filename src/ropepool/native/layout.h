// The layout of a call's 9 arrays as the layout cache's guard sees it (plan/cache.py), recorded when a native
// runner is bound and compared with every later call before anything is read or written: the native CPU kernel
// (rope_ffi.cc) and the native CUDA launcher (triton_launch.cc) both check their calls with it, so that the layout
// cache may hand them a call by its key alone.
#ifndef ROPEPOOL_LAYOUT_H_
#define ROPEPOOL_LAYOUT_H_

#include <tvm/ffi/container/tensor.h>

#include <cstdint>
#include <cstring>

namespace ropepool {
namespace layout {

using tvm::ffi::TensorView;

constexpr int MAX_NDIM = 6;
constexpr int SIG = 4 + 2 * MAX_NDIM;  // dtype, device type, device id, ndim, sizes, strides
constexpr int NUM_ARRAYS = 9;          // q, k, v, positions, slots, k_pool, v_pool, q_out, k_out
constexpr int SIZE = NUM_ARRAYS * SIG;  // int64 entries of a recorded layout
// What a native runner returns for a call whose arrays are not laid out as those bound: nothing was read or
// written (the caller checks the call in full).
constexpr int64_t OTHER_LAYOUT = -2;

inline char* base(const TensorView& x) { return static_cast<char*>(x.data_ptr()) + x.byte_offset(); }

// What the guard compares of an array: dtype, device, sizes and strides, the token count's size left out (-1;
// ``token``: its dim, -1 none) and, for [3, T] positions, the row stride (which is T). False: more dims than a
// signature holds.
inline bool signature(const TensorView& x, int64_t token, bool free_row_stride, int64_t* out) {
  const int64_t nd = x.ndim();
  if (nd > MAX_NDIM) return false;
  const DLDataType t = x.dtype();
  out[0] = t.code | (t.bits << 8) | (static_cast<int64_t>(t.lanes) << 16);
  out[1] = x.device().device_type;
  out[2] = x.device().device_id;
  out[3] = nd;
  for (int64_t d = 0; d < MAX_NDIM; ++d) {
    out[4 + d] = d >= nd ? 0 : d == token ? -1 : x.size(d);
    out[4 + MAX_NDIM + d] = d >= nd ? 0 : d == 0 && free_row_stride ? -1 : x.stride(d);
  }
  return true;
}

// The signatures of a call's arrays into out[SIZE] (false: one has too many dims). Rows and slots: dim 0 is the
// token; positions: the last.
inline bool record(const TensorView* xs, int64_t* out) {
  for (int i = 0; i < NUM_ARRAYS; ++i) {
    const bool pos = i == 3, pool = i == 5 || i == 6;
    const int64_t token = pool ? -1 : pos ? xs[i].ndim() - 1 : 0;
    if (!signature(xs[i], token, pos && xs[i].ndim() == 2, out + i * SIG)) return false;
  }
  return true;
}

// Whether a call's arrays are laid out as ``bound`` (``record``'s), with one token count and two pools: what the
// guard checks.
inline bool same(const TensorView* xs, const int64_t* bound) {
  int64_t sig[SIZE];
  if (!record(xs, sig) || std::memcmp(sig, bound, sizeof(sig)) != 0) return false;
  const int64_t T = xs[0].ndim() > 0 ? xs[0].size(0) : -1;
  for (int i : {1, 2, 4, 7, 8})
    if (xs[i].ndim() == 0 || xs[i].size(0) != T) return false;
  // (validation refuses one memory for both pools: checks/pools.py)
  return xs[3].ndim() > 0 && xs[3].size(-1) == T && (xs[5].numel() == 0 || base(xs[5]) != base(xs[6]));
}

}  // namespace layout
}  // namespace ropepool

#endif  // ROPEPOOL_LAYOUT_H_
