// The kernel's CPython module, ``_rope_native``: rope_ffi.cc's functions called with torch tensors read through
// torch's DLPack exchange API as non-owning DLTensors (the caller holds the tensors for the call). Nothing is
// copied or allocated per call, and no Python package but torch is imported: tvm-ffi's own call made an owned
// DLPack tensor and an ffi::Tensor of each array (a one-token Llama-3-8B call of the kernel took 3.8 us that way,
// 2.9 us here) and ``import tvm_ffi`` cost 26-65 ms of a process's first call (docs/native.md). tvm-ffi's C++
// library stays: rope_ffi.cc reads arrays as its TensorViews and raises its errors, which are raised here as the
// Python exceptions of their kind.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include <string>

using tvm::ffi::TensorView;

int64_t rope_pool(TensorView q, TensorView k, TensorView v, TensorView positions, TensorView slots,
                  TensorView k_pool, TensorView v_pool, TensorView q_out, TensorView k_out, TensorView cos_sin,
                  int64_t cfg_address);
int64_t rope_pool_norm(TensorView q_weight, TensorView k_weight, TensorView q, TensorView k, TensorView v,
                       TensorView positions, TensorView slots, TensorView k_pool, TensorView v_pool, TensorView q_out,
                       TensorView k_out, TensorView cos_sin, int64_t cfg_address);
void bind(TensorView q, TensorView k, TensorView v, TensorView positions, TensorView slots, TensorView k_pool,
          TensorView v_pool, TensorView q_out, TensorView k_out, int64_t cfg_address);
int64_t cfg_size();
const char* cfg_names();
const char* isa();

namespace {

constexpr Py_ssize_t kMaxArrays = 12;  // rope_pool_norm's
DLPackDLTensorFromPyObjectNoSync read_array = nullptr;

// use(torch.Tensor.__dlpack_c_exchange_api__): the API the arrays are read through, once.
PyObject* use(PyObject*, PyObject* capsule) {
  const auto* api = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  if (api == nullptr) return nullptr;
  if (api->header.version.major != DLPACK_MAJOR_VERSION || api->dltensor_from_py_object_no_sync == nullptr) {
    PyErr_SetString(PyExc_ValueError, "the DLPack exchange API has no non-owning reader of this DLPack version");
    return nullptr;
  }
  read_array = api->dltensor_from_py_object_no_sync;
  Py_RETURN_NONE;
}

PyObject* raise(const std::string& kind, const std::string& message) {
  PyObject* type = kind == "ValueError" ? PyExc_ValueError : kind == "TypeError" ? PyExc_TypeError
                   : kind == "IndexError" ? PyExc_IndexError : PyExc_RuntimeError;
  PyErr_SetString(type, message.c_str());
  return nullptr;
}

// fn(N arrays, cfg's address) with ``args``: the arrays read, the GIL released while it runs, its errors raised as
// Python exceptions of their kind. ``fn`` takes the DLTensors and the address and returns an int64.
template <Py_ssize_t N, typename Fn>
PyObject* call_with_arrays(const char* name, PyObject* const* args, Py_ssize_t n, Fn fn) {
  static_assert(N <= kMaxArrays);
  if (read_array == nullptr) return raise("RuntimeError", std::string(name) + ": use() the DLPack exchange API first");
  if (n != N + 1) return raise("TypeError", std::string(name) + ": " + std::to_string(N) + " arrays and cfg's address");
  DLTensor dl[N];
  for (Py_ssize_t i = 0; i < N; ++i)
    if (read_array(args[i], &dl[i]) != 0) return nullptr;
  const int64_t cfg = PyLong_AsLongLong(args[N]);
  if (cfg == -1 && PyErr_Occurred()) return nullptr;
  int64_t done = 0;
  std::string kind, message;
  Py_BEGIN_ALLOW_THREADS
  try {
    done = fn(dl, cfg);
  } catch (const tvm::ffi::Error& e) {
    kind = e.kind();
    message = e.message();
  } catch (const std::exception& e) {
    kind = "RuntimeError";
    message = e.what();
  }
  Py_END_ALLOW_THREADS
  if (!kind.empty()) return raise(kind, message);
  return PyLong_FromLongLong(done);
}

// rope_pool(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cos_sin, cfg_address) -> int
PyObject* py_rope_pool(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return call_with_arrays<10>("rope_pool", args, n, [](DLTensor* d, int64_t cfg) {
    return rope_pool(&d[0], &d[1], &d[2], &d[3], &d[4], &d[5], &d[6], &d[7], &d[8], &d[9], cfg);
  });
}

// rope_pool_norm(q_weight, k_weight, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cos_sin, cfg_address)
PyObject* py_rope_pool_norm(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return call_with_arrays<12>("rope_pool_norm", args, n, [](DLTensor* d, int64_t cfg) {
    return rope_pool_norm(&d[0], &d[1], &d[2], &d[3], &d[4], &d[5], &d[6], &d[7], &d[8], &d[9], &d[10], &d[11], cfg);
  });
}

// bind(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cfg_address) -> 0
PyObject* py_bind(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return call_with_arrays<9>("bind", args, n, [](DLTensor* d, int64_t cfg) {
    bind(&d[0], &d[1], &d[2], &d[3], &d[4], &d[5], &d[6], &d[7], &d[8], cfg);
    return int64_t{0};
  });
}

PyObject* py_cfg_size(PyObject*, PyObject*) { return PyLong_FromLongLong(cfg_size()); }
PyObject* py_cfg_names(PyObject*, PyObject*) { return PyUnicode_FromString(cfg_names()); }
PyObject* py_isa(PyObject*, PyObject*) { return PyUnicode_FromString(isa()); }

template <typename F>
PyCFunction fast(F f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(f));
}

PyMethodDef methods[] = {
    {"use", use, METH_O, "use(torch.Tensor.__dlpack_c_exchange_api__): how arrays are read"},
    {"rope_pool", fast(py_rope_pool), METH_FASTCALL,
     "rope_pool(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cos_sin, cfg_address) -> int"},
    {"rope_pool_norm", fast(py_rope_pool_norm), METH_FASTCALL,
     "rope_pool_norm(q_weight, k_weight, q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cos_sin, "
     "cfg_address) -> int"},
    {"bind", fast(py_bind), METH_FASTCALL, "bind(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cfg_address)"},
    {"cfg_size", py_cfg_size, METH_NOARGS, "cfg_size() -> int: the number of cfg entries"},
    {"cfg_names", py_cfg_names, METH_NOARGS, "cfg_names() -> str: cfg's entries before the layout, in order"},
    {"isa", py_isa, METH_NOARGS, "isa() -> str: the build that runs here"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rope_native", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__rope_native() { return PyModule_Create(&module); }
