// CPU kernel of silu_and_mul: rows in parallel; each row converted to fp32 a chunk of the gate and
// up halves at a time, its exp vectorized (vec_exp), rounded once into the output.
#include <algorithm>
#include <cstdint>


#include "activation_entry.h"
#include "cpu_common.h"
#include "ops.h"
#include "qspec_ext/activation.h"

namespace qspec_ext {
namespace {

using namespace cpu;

template <typename T>
QSPEC_INLINE void silu_and_mul_rows_impl(const T* in, int64_t in_stride, T* out, int64_t width, int64_t begin,
                                         int64_t end) {
  constexpr int64_t kChunk = 64;
  float gate[kChunk], up[kChunk];
  for (int64_t r = begin; r < end; ++r) {
    const T* row = in + r * in_stride;
    for (int64_t i = 0; i < width; i += kChunk) {
      const int64_t n = std::min(kChunk, width - i);
      load_float(row + i, gate, n);
      load_float(row + width + i, up, n);
      for (int64_t j = 0; j < n; ++j) gate[j] = silu_mul(gate[j], up[j], vec_exp(-gate[j]));
      store_float(gate, out + r * width + i, n);
    }
  }
}

QSPEC_CPU_CLONES void silu_and_mul_rows(const float* in, int64_t in_stride, float* out, int64_t width, int64_t begin,
                                        int64_t end) {
  silu_and_mul_rows_impl(in, in_stride, out, width, begin, end);
}
QSPEC_CPU_CLONES void silu_and_mul_rows(const c10::Half* in, int64_t in_stride, c10::Half* out, int64_t width,
                                        int64_t begin, int64_t end) {
  silu_and_mul_rows_impl(in, in_stride, out, width, begin, end);
}
QSPEC_CPU_CLONES void silu_and_mul_rows(const c10::BFloat16* in, int64_t in_stride, c10::BFloat16* out, int64_t width,
                                        int64_t begin, int64_t end) {
  silu_and_mul_rows_impl(in, in_stride, out, width, begin, end);
}

}  // namespace

void silu_and_mul_cpu(const Tensor& rows, Tensor& out) {
  const int64_t width = out.size(1);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(rows), "silu_and_mul_cpu", [&] {
    const scalar_t* in = const_data<scalar_t>(rows);
    scalar_t* dst = mutable_data<scalar_t>(out);
    torch::stable::parallel_for(0, rows.size(0), grain_for(2 * width), [&](int64_t begin, int64_t end) {
      silu_and_mul_rows(in, rows.stride(0), dst, width, begin, end);
    });
  });
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) {
  m.impl("silu_and_mul", TORCH_BOX((&silu_and_mul_entry<DeviceType::CPU, silu_and_mul_cpu>)));
}

}  // namespace qspec_ext
