// The kernel's CPython entry: ``rope_pool`` (rope_ffi.cc) called with torch tensors read through torch's DLPack
// exchange API as non-owning DLTensors (the caller holds the tensors for the call). tvm-ffi's call makes an owned
// DLPack tensor and an ffi::Tensor of each array and frees them after (~0.14 us more an array than reading it
// here, measured); a one-token Llama-3-8B call of the kernel took 2.9 us through this entry, 3.8 through tvm-ffi
// (docs/native.md). backends/torch_native.py uses it where it loads (native.entry()), tvm-ffi's call elsewhere.
// The same library is tvm-ffi's module: loaded twice, one copy.
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

namespace {

constexpr Py_ssize_t kArrays = 10;  // rope_pool's arrays, then cfg's address
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

PyObject* raise(const char* kind, const std::string& message) {
  const std::string k(kind);
  PyObject* type = k == "ValueError" ? PyExc_ValueError : k == "TypeError" ? PyExc_TypeError
                   : k == "IndexError" ? PyExc_IndexError : PyExc_RuntimeError;
  PyErr_SetString(type, message.c_str());
  return nullptr;
}

// rope_pool(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cos_sin, cfg_address): rope_ffi.cc's, the GIL
// released while it runs (as tvm-ffi's call releases it); its errors raised as tvm-ffi raises them.
PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (read_array == nullptr) return raise("RuntimeError", "rope_pool: use() the DLPack exchange API first");
  if (n != kArrays + 1) return raise("TypeError", "rope_pool: 10 arrays and cfg's address");
  DLTensor dl[kArrays];
  for (Py_ssize_t i = 0; i < kArrays; ++i)
    if (read_array(args[i], &dl[i]) != 0) return nullptr;
  const int64_t cfg = PyLong_AsLongLong(args[kArrays]);
  if (cfg == -1 && PyErr_Occurred()) return nullptr;
  int64_t done = 0;
  std::string kind, message;
  Py_BEGIN_ALLOW_THREADS
  try {
    done = rope_pool(&dl[0], &dl[1], &dl[2], &dl[3], &dl[4], &dl[5], &dl[6], &dl[7], &dl[8], &dl[9], cfg);
  } catch (const tvm::ffi::Error& e) {
    kind = e.kind();
    message = e.message();
  } catch (const std::exception& e) {
    kind = "RuntimeError";
    message = e.what();
  }
  Py_END_ALLOW_THREADS
  if (!kind.empty()) return raise(kind.c_str(), message);
  return PyLong_FromLongLong(done);
}

PyMethodDef methods[] = {
    {"use", use, METH_O, "use(torch.Tensor.__dlpack_c_exchange_api__): how arrays are read"},
    {"rope_pool", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(call)), METH_FASTCALL,
     "rope_pool(q, k, v, positions, slots, k_pool, v_pool, q_out, k_out, cos_sin, cfg_address) -> int"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rope_native", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__rope_native() { return PyModule_Create(&module); }
