// The eager CUDA call's launch of ropepool's compiled Triton kernel, in one C++ call (backends/triton_native.py).
//
// Triton's own launcher parses every kernel argument from Python objects on each call; here the arguments that
// never change for a layout (the compiled kernel's handle, its grid split, block size, shared memory, and every
// parameter but the arrays' addresses) are packed once, with the layout of the arrays it was made for (layout.h).
// A call passes the 9 arrays as tensors: they are compared with that layout first (as the layout cache's guard
// would compare them), then the pools' layer offsets are added and cuLaunchKernel runs on the stream tvm-ffi read
// from torch for this call (its current stream).
// The CUDA driver is found with dlopen at the first call (torch and Triton have loaded it), so this file needs
// neither CUDA's headers nor libcuda at build time and builds (unused) on machines without CUDA.
#include <dlfcn.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "layout.h"

using tvm::ffi::Array;
using tvm::ffi::Function;
using tvm::ffi::TensorView;
namespace layout = ropepool::layout;

namespace {

using CUresult = int;
using LaunchKernel = CUresult (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                  unsigned bz, unsigned shared, void* stream, void** params, void** extra);
using CtxGetCurrent = CUresult (*)(void** ctx);
using GetErrorString = CUresult (*)(CUresult, const char**);

struct Driver {
  LaunchKernel launch = nullptr;
  CtxGetCurrent current = nullptr;
  GetErrorString error = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib != nullptr) {
      r.launch = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
      r.current = reinterpret_cast<CtxGetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
      r.error = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    }
    return r;
  }();
  return d;
}

// The arrays of a call, in the order the caller passes them (triton_launch.Launch.__call__).
constexpr int kArrays = layout::NUM_ARRAYS;  // q, k, v, positions, slots, k_pool, v_pool, q_out, k_out

// One compiled variant (decode-sized or large): spec = [function, split, threads, shared bytes, k pool byte
// offset, v pool byte offset, the parameter index of each of the 9 arrays (-1: none), then every parameter's
// value as 8 bytes (the arrays' ones are overwritten per call; 4-byte parameters read the low half)].
struct Variant {
  void* function = nullptr;
  unsigned split = 0, threads = 0, shared = 0;
  int64_t offsets[2] = {0, 0};
  int at[kArrays];
  std::vector<uint64_t> words;
};

constexpr int kHead = 6 + kArrays;
constexpr size_t kMaxWords = 64;  // parameters of a kernel (this one has ~26)

std::unique_ptr<Variant> variant_of(const Array<int64_t>& spec) {
  if (spec.empty()) return nullptr;
  TVM_FFI_CHECK(spec.size() >= kHead, ValueError) << "spec: " << kHead << " header entries, got " << spec.size();
  auto v = std::make_unique<Variant>();
  v->function = reinterpret_cast<void*>(static_cast<uintptr_t>(spec[0]));
  v->split = static_cast<unsigned>(spec[1]);
  v->threads = static_cast<unsigned>(spec[2]);
  v->shared = static_cast<unsigned>(spec[3]);
  v->offsets[0] = spec[4];
  v->offsets[1] = spec[5];
  TVM_FFI_CHECK(spec.size() - kHead <= kMaxWords, ValueError) << "spec: at most " << kMaxWords << " parameters";
  for (size_t i = kHead; i < spec.size(); ++i) v->words.push_back(static_cast<uint64_t>(spec[i]));
  for (int i = 0; i < kArrays; ++i) {
    v->at[i] = static_cast<int>(spec[6 + i]);
    TVM_FFI_CHECK(v->at[i] < static_cast<int>(v->words.size()), ValueError) << "spec: array " << i << " past the parameters";
  }
  return v;
}

// One launch of ``var`` over T tokens: the arrays' addresses (the pools' before their layer offset). False,
// having done nothing, where an address is not 16-byte aligned or no CUDA context is current.
bool launch(const Variant& var, int64_t T, const TensorView* xs, void* stream) {
  uintptr_t ptrs[kArrays];
  uintptr_t bits = 0;
  for (int i = 0; i < kArrays; ++i) {
    ptrs[i] = reinterpret_cast<uintptr_t>(layout::base(xs[i])) + (i == 5 ? var.offsets[0] : i == 6 ? var.offsets[1] : 0);
    bits |= ptrs[i];
  }
  if (bits % 16) return false;  // the kernel was compiled for 16-byte aligned arrays
  const Driver& drv = driver();
  void* ctx = nullptr;
  if (drv.launch == nullptr || drv.current(&ctx) != 0 || ctx == nullptr) return false;
  uint64_t words[kMaxWords + 2];  // + Triton 3.x's scratch pointers, null (this kernel uses none); a kernel
  void* params[kMaxWords + 2];    // with fewer parameters never reads past its own
  const size_t n = var.words.size();
  for (size_t i = 0; i < n; ++i) words[i] = var.words[i];
  words[n] = words[n + 1] = 0;
  for (int i = 0; i < kArrays; ++i)
    if (var.at[i] >= 0) words[var.at[i]] = ptrs[i];
  for (size_t i = 0; i < n + 2; ++i) params[i] = &words[i];
  CUresult rc = drv.launch(var.function, static_cast<unsigned>(T), var.split, 1, var.threads, 1, 1, var.shared,
                           stream, params, nullptr);
  if (rc != 0) {
    const char* msg = "unknown error";
    if (drv.error != nullptr) drv.error(rc, &msg);
    TVM_FFI_THROW(RuntimeError) << "ropepool: cuLaunchKernel failed (" << rc << "): " << msg;
  }
  return true;
}

// What a launcher's call returns: the kernel was launched; nothing was done, the arrays being laid out as those
// bound (the caller takes Triton's own launch); nothing was done, the arrays being laid out otherwise.
constexpr int64_t LAUNCHED = 1, DECLINED = 0;

// A launcher of one layout's kernel, made for the arrays of a call (``arrays``: as the runner was given them, its
// new outputs included) and called with ``go`` and the 9 arrays of each later call (tensors: through DLPack, which
// also sets the stream). It compares them with the bound layout (OTHER_LAYOUT where they differ), then launches
// and returns LAUNCHED, or returns DECLINED having done nothing: ``go`` false (a launch hook is set: Triton's
// launch calls it), a variant not compiled yet, no token, arrays not on a GPU, an address not 16-byte aligned, no
// CUDA driver or current context. The caller's fallback, Triton's own launch, handles those.
Function make(int64_t small_tokens, Array<int64_t> small, Array<int64_t> large, TensorView q, TensorView k,
              TensorView v, TensorView positions, TensorView slots, TensorView k_pool, TensorView v_pool,
              TensorView q_out, TensorView k_out) {
  std::shared_ptr<Variant> variants[2] = {variant_of(small), variant_of(large)};
  const TensorView xs[kArrays] = {q, k, v, positions, slots, k_pool, v_pool, q_out, k_out};
  auto bound = std::make_shared<std::vector<int64_t>>(layout::SIZE);
  TVM_FFI_CHECK(layout::record(xs, bound->data()), ValueError) << "arrays of at most " << layout::MAX_NDIM << " dims";
  const bool on_gpu = q.device().device_type == kDLCUDA;
  return Function::FromTyped([variants, bound, small_tokens, on_gpu](
                                 bool go, TensorView q, TensorView k, TensorView v, TensorView positions,
                                 TensorView slots, TensorView k_pool, TensorView v_pool, TensorView q_out,
                                 TensorView k_out) -> int64_t {
    const TensorView xs[kArrays] = {q, k, v, positions, slots, k_pool, v_pool, q_out, k_out};
    if (!layout::same(xs, bound->data())) return layout::OTHER_LAYOUT;
    const int64_t T = q.size(0);
    const Variant* var = variants[T > small_tokens].get();
    if (!go || !on_gpu || var == nullptr || T <= 0) return DECLINED;
    const DLDevice dev = q.device();
    void* stream = TVMFFIEnvGetStream(dev.device_type, dev.device_id);
    return launch(*var, T, xs, stream) ? LAUNCHED : DECLINED;
  });
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(make, make);
