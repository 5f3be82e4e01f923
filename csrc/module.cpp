// The Python module qspec_ext._C: importing it registers the ops (static initializers in
// the other translation units) and exposes what this binary was built with.
#include <pybind11/pybind11.h>

#include "ops.h"

PYBIND11_MODULE(_C, m) {
  m.attr("version") = QSPEC_VERSION;
  m.attr("with_cuda") = static_cast<bool>(QSPEC_WITH_CUDA);
  m.attr("cuda_archs") = QSPEC_CUDA_ARCHS;
  m.attr("built_with_torch") = QSPEC_TORCH_VERSION;
  m.def("cpu_bf16_dot", &qspec_ext::cpu_bf16_dot,
        "Whether the bf16 CPU kernels (packed_linear; cached_attention with >= 8 queries per KV head) run "
        "AVX512-BF16 dot products on this CPU (QSPEC_CPU_BF16_DOT=0: never)");
  m.def("cpu_avx512", &qspec_ext::cpu_avx512,
        "Whether fp32 cached_attention with >= 8 queries per KV head runs AVX-512 query lanes on this CPU "
        "(QSPEC_CPU_AVX512=0: never)");
  m.def("cpu_amx", &qspec_ext::cpu_amx,
        "Whether bf16 packed_linear runs AMX tiles on this CPU (QSPEC_CPU_AMX=0 or QSPEC_CPU_BF16_DOT=0: never)");
}
