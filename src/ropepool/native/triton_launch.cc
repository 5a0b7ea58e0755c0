// The eager CUDA call's launch of ropepool's compiled Triton kernel, in one C++ call (backends/triton_native.py).
//
// Triton's own launcher parses every kernel argument from Python objects on each call; here the arguments that
// never change for a layout (the compiled kernel's handle, its grid split, block size, shared memory, and every
// parameter but the arrays' addresses) are packed once, with the layout of the arrays it was made for (layout.h),
// into a ``Launcher``: a Python callable taking the 9 arrays of a call. It reads them through torch's DLPack
// exchange API as borrowed DLTensors (the caller holds the tensors for the call; nothing is allocated), compares
// them with that layout first (as the layout cache's guard would compare them), then adds the pools' layer
// offsets and runs cuLaunchKernel on torch's current stream, read through the same API.
// The CUDA driver is found with dlopen at the first launch (torch and Triton have loaded it), so this file needs
// neither CUDA's headers nor libcuda at build time and builds (unused) on machines without CUDA.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <dlpack/dlpack.h>

#include <array>
#include <cstdint>
#include <new>
#include <vector>

#include "layout.h"

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

// How arrays and the stream are read: torch's DLPack exchange API (``use``).
DLPackDLTensorFromPyObjectNoSync read_array = nullptr;
DLPackCurrentWorkStream current_stream = nullptr;

// The arrays of a call, in the order the caller passes them (triton_launch.Launch.__call__).
constexpr int kArrays = layout::NUM_ARRAYS;  // q, k, v, positions, slots, k_pool, v_pool, q_out, k_out

// One compiled variant (decode-sized or large): spec = [function, split, threads, shared bytes, k pool byte
// offset, v pool byte offset, the parameter index of each of the 9 arrays (-1: none), then every parameter's
// value as 8 bytes (the arrays' ones are overwritten per call; 4-byte parameters read the low half)].
struct Variant {
  bool compiled = false;
  void* function = nullptr;
  unsigned split = 0, threads = 0, shared = 0;
  int64_t offsets[2] = {0, 0};
  int at[kArrays];
  std::vector<uint64_t> words;
};

constexpr Py_ssize_t kHead = 6 + kArrays;
constexpr size_t kMaxWords = 64;  // parameters of a kernel (this one has ~26)

// ``spec`` (a list of ints, empty: not compiled) into ``v``; false with a Python error set.
bool read_variant(PyObject* spec, Variant* v) {
  if (!PyList_Check(spec)) return PyErr_SetString(PyExc_TypeError, "spec: a list of ints"), false;
  const Py_ssize_t n = PyList_GET_SIZE(spec);
  if (n == 0) return true;
  if (n < kHead || static_cast<size_t>(n - kHead) > kMaxWords) {
    PyErr_Format(PyExc_ValueError, "spec: %zd header entries and at most %zu parameters, got %zd entries",
                 kHead, kMaxWords, n);
    return false;
  }
  std::vector<int64_t> xs(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    xs[i] = PyLong_AsLongLong(PyList_GET_ITEM(spec, i));
    if (xs[i] == -1 && PyErr_Occurred()) return false;
  }
  v->compiled = true;
  v->function = reinterpret_cast<void*>(static_cast<uintptr_t>(xs[0]));
  v->split = static_cast<unsigned>(xs[1]);
  v->threads = static_cast<unsigned>(xs[2]);
  v->shared = static_cast<unsigned>(xs[3]);
  v->offsets[0] = xs[4];
  v->offsets[1] = xs[5];
  for (Py_ssize_t i = kHead; i < n; ++i) v->words.push_back(static_cast<uint64_t>(xs[i]));
  for (int i = 0; i < kArrays; ++i) {
    v->at[i] = static_cast<int>(xs[6 + i]);
    if (v->at[i] >= static_cast<int>(v->words.size()))
      return PyErr_Format(PyExc_ValueError, "spec: array %d past the parameters", i), false;
  }
  return true;
}

// One launch of ``var`` over T tokens: the arrays' addresses (the pools' before their layer offset). 0, having
// done nothing, where an address is not 16-byte aligned or no CUDA context is current; -1: a Python error set.
int launch(const Variant& var, int64_t T, const DLTensor* xs, void* stream) {
  uintptr_t ptrs[kArrays];
  uintptr_t bits = 0;
  for (int i = 0; i < kArrays; ++i) {
    ptrs[i] = reinterpret_cast<uintptr_t>(static_cast<char*>(xs[i].data) + xs[i].byte_offset) +
              (i == 5 ? var.offsets[0] : i == 6 ? var.offsets[1] : 0);
    bits |= ptrs[i];
  }
  if (bits % 16) return 0;  // the kernel was compiled for 16-byte aligned arrays
  const Driver& drv = driver();
  void* ctx = nullptr;
  if (drv.launch == nullptr || drv.current(&ctx) != 0 || ctx == nullptr) return 0;
  uint64_t words[kMaxWords + 2];  // + Triton 3.x's scratch pointers, null (this kernel uses none); a kernel
  void* params[kMaxWords + 2];    // with fewer parameters never reads past its own
  const size_t n = var.words.size();
  for (size_t i = 0; i < n; ++i) words[i] = var.words[i];
  words[n] = words[n + 1] = 0;
  for (int i = 0; i < kArrays; ++i)
    if (var.at[i] >= 0) words[var.at[i]] = ptrs[i];
  for (size_t i = 0; i < n + 2; ++i) params[i] = &words[i];
  const CUresult rc = drv.launch(var.function, static_cast<unsigned>(T), var.split, 1, var.threads, 1, 1,
                                 var.shared, stream, params, nullptr);
  if (rc != 0) {
    const char* msg = "unknown error";
    if (drv.error != nullptr) drv.error(rc, &msg);
    PyErr_Format(PyExc_RuntimeError, "ropepool: cuLaunchKernel failed (%d): %s", rc, msg);
    return -1;
  }
  return 1;
}

// What a launcher's call returns: the kernel was launched; nothing was done, the arrays being laid out as those
// bound (the caller takes Triton's own launch); nothing was done, the arrays being laid out otherwise.
constexpr long LAUNCHED = 1, DECLINED = 0;

// A launcher of one layout's kernel (``make``), called with ``go`` and the 9 arrays of each later call. It
// compares them with the bound layout (OTHER_LAYOUT where they differ), then launches and returns LAUNCHED, or
// returns DECLINED having done nothing: ``go`` false (a launch hook is set: Triton's launch calls it), a variant
// not compiled yet, no token, arrays not on a GPU, an address not 16-byte aligned, no CUDA driver or current
// context. The caller's fallback, Triton's own launch, handles those.
struct Launcher {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  int64_t small_tokens;
  bool on_gpu;
  Variant variants[2];
  int64_t bound[layout::SIZE];
};

// Reads the 9 arrays into ``dl``; false with a Python error set.
bool read_arrays(PyObject* const* args, DLTensor* dl) {
  if (read_array == nullptr) return PyErr_SetString(PyExc_RuntimeError, "use() the DLPack exchange API first"), false;
  for (int i = 0; i < kArrays; ++i)
    if (read_array(args[i], &dl[i]) != 0) return false;
  return true;
}

using Views = std::array<layout::TensorView, kArrays>;
Views views(DLTensor* dl) { return {&dl[0], &dl[1], &dl[2], &dl[3], &dl[4], &dl[5], &dl[6], &dl[7], &dl[8]}; }

PyObject* call(PyObject* self_, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const auto* self = reinterpret_cast<const Launcher*>(self_);
  if (PyVectorcall_NARGS(nargsf) != 1 + kArrays || kwnames != nullptr) {
    PyErr_SetString(PyExc_TypeError, "a launcher takes go and the 9 arrays, positionally");
    return nullptr;
  }
  DLTensor dl[kArrays];
  if (!read_arrays(args + 1, dl)) return nullptr;
  if (!layout::same(views(dl).data(), self->bound)) return PyLong_FromLong(layout::OTHER_LAYOUT);
  const int64_t T = dl[0].shape[0];
  const Variant& var = self->variants[T > self->small_tokens];
  if (args[0] != Py_True || !self->on_gpu || !var.compiled || T <= 0) return PyLong_FromLong(DECLINED);
  void* stream = nullptr;
  if (current_stream(dl[0].device.device_type, dl[0].device.device_id, &stream) != 0) return nullptr;
  const int done = launch(var, T, dl, stream);
  return done < 0 ? nullptr : PyLong_FromLong(done ? LAUNCHED : DECLINED);
}

void dealloc(PyObject* self) {
  reinterpret_cast<Launcher*>(self)->~Launcher();
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject LauncherType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// make(small_tokens, small_spec, large_spec, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out): a Launcher
// for calls laid out as these arrays (a call's 9, its new outputs included).
PyObject* make(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 3 + kArrays) return PyErr_SetString(PyExc_TypeError, "make: small_tokens, 2 specs, 9 arrays"), nullptr;
  DLTensor dl[kArrays];
  const int64_t small_tokens = PyLong_AsLongLong(args[0]);
  if ((small_tokens == -1 && PyErr_Occurred()) || !read_arrays(args + 3, dl)) return nullptr;
  auto* self = PyObject_New(Launcher, &LauncherType);
  if (self == nullptr) return nullptr;
  for (Variant& v : self->variants) new (&v) Variant();
  self->vectorcall = call;
  self->small_tokens = small_tokens;
  self->on_gpu = dl[0].device.device_type == kDLCUDA;
  if (!read_variant(args[1], &self->variants[0]) || !read_variant(args[2], &self->variants[1])) {
    Py_DECREF(self);
    return nullptr;
  }
  if (!layout::record(views(dl).data(), self->bound)) {
    Py_DECREF(self);
    PyErr_Format(PyExc_ValueError, "arrays of at most %d dims", layout::MAX_NDIM);
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(self);
}

// use(torch.Tensor.__dlpack_c_exchange_api__): the API arrays and streams are read through, once.
PyObject* use(PyObject*, PyObject* capsule) {
  const auto* api = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  if (api == nullptr) return nullptr;
  if (api->header.version.major != DLPACK_MAJOR_VERSION || api->dltensor_from_py_object_no_sync == nullptr ||
      api->current_work_stream == nullptr) {
    PyErr_SetString(PyExc_ValueError, "the DLPack exchange API has no array reader or stream of this version");
    return nullptr;
  }
  read_array = api->dltensor_from_py_object_no_sync;
  current_stream = api->current_work_stream;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"use", use, METH_O, "use(torch.Tensor.__dlpack_c_exchange_api__): how arrays and streams are read"},
    {"make", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(make)), METH_FASTCALL,
     "make(small_tokens, small_spec, large_spec, *arrays) -> launcher(go, *arrays) -> int"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_triton_launch", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__triton_launch() {
  LauncherType.tp_name = "ropepool.native._triton_launch.Launcher";
  LauncherType.tp_basicsize = sizeof(Launcher);
  LauncherType.tp_dealloc = dealloc;
  LauncherType.tp_vectorcall_offset = offsetof(Launcher, vectorcall);
  LauncherType.tp_call = PyVectorcall_Call;
  LauncherType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  LauncherType.tp_doc = "launcher(go, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out) -> int";
  if (PyType_Ready(&LauncherType) < 0) return nullptr;
  return PyModule_Create(&module);
}
