// The Python module qspec_ext._C, on Python's stable ABI (abi3, no pybind11): importing it
// registers the ops (static initializers in the other translation units) and exposes what this
// binary was built with.
#include <Python.h>

#include "ops.h"

namespace {

PyObject* as_bool(bool value) { return PyBool_FromLong(value); }
PyObject* cpu_bf16_dot(PyObject*, PyObject*) { return as_bool(qspec_ext::cpu_bf16_dot()); }
PyObject* cpu_avx512(PyObject*, PyObject*) { return as_bool(qspec_ext::cpu_avx512()); }
PyObject* cpu_amx(PyObject*, PyObject*) { return as_bool(qspec_ext::cpu_amx()); }

PyMethodDef methods[] = {
    {"cpu_bf16_dot", cpu_bf16_dot, METH_NOARGS,
     "Whether the bf16 CPU kernels (packed_linear; cached_attention with >= 8 queries per KV head) run "
     "AVX512-BF16 dot products on this CPU (QSPEC_CPU_BF16_DOT=0: never)"},
    {"cpu_avx512", cpu_avx512, METH_NOARGS,
     "Whether fp32 cached_attention with >= 8 queries per KV head runs AVX-512 query lanes on this CPU "
     "(QSPEC_CPU_AVX512=0: never)"},
    {"cpu_amx", cpu_amx, METH_NOARGS,
     "Whether bf16 packed_linear runs AMX tiles on this CPU (QSPEC_CPU_AMX=0 or QSPEC_CPU_BF16_DOT=0: never)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "qspec_ext's ops (torch.ops.qspec_ext) and build facts", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  if (PyModule_AddStringConstant(m, "version", QSPEC_VERSION) < 0 ||
      PyModule_AddIntConstant(m, "with_cuda", QSPEC_WITH_CUDA) < 0 ||
      PyModule_AddStringConstant(m, "cuda_version", QSPEC_CUDA_VERSION) < 0 ||
      PyModule_AddStringConstant(m, "cuda_archs", QSPEC_CUDA_ARCHS) < 0 ||
      PyModule_AddStringConstant(m, "built_with_torch", QSPEC_TORCH_VERSION) < 0 ||
      PyModule_AddStringConstant(m, "torch_target_version", QSPEC_TORCH_TARGET) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
