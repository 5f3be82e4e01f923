// CUDA kernel of silu_and_mul: one block per row, each thread VEC consecutive elements of the gate
// and up halves per access (VEC: the widest access every row's alignment allows).

#include "activation_entry.h"
#include "checks.h"
#include "common.cuh"
#include "ops.h"
#include "qspec_ext/activation.h"

namespace qspec_ext {
namespace {

using cuda::Pack;

template <typename T, int VEC>
__global__ void silu_and_mul_kernel(const T* __restrict__ in,  // [rows, 2 * width], row stride in_stride
                                    int64_t in_stride,
                                    T* __restrict__ out,  // [rows, width], contiguous
                                    int width) {
  const int64_t r = blockIdx.x;
  const T* gate = in + r * in_stride;
  const T* up = gate + width;
  T* dst = out + r * width;
  for (int i = threadIdx.x * VEC; i < width; i += blockDim.x * VEC) {
    const auto g = *reinterpret_cast<const Pack<T, VEC>*>(gate + i);
    const auto u = *reinterpret_cast<const Pack<T, VEC>*>(up + i);
    Pack<T, VEC> y;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float x = static_cast<float>(g.v[k]);
      y.v[k] = static_cast<T>(silu_mul(x, static_cast<float>(u.v[k]), expf(-x)));
    }
    *reinterpret_cast<Pack<T, VEC>*>(dst + i) = y;
  }
}

}  // namespace

void silu_and_mul_cuda(const Tensor& rows, Tensor& out) {
  const cuda::DeviceContext context(rows);
  const cudaStream_t stream = context.stream();
  const int64_t width = out.size(1);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(rows), "silu_and_mul_cuda", [&] {
    const scalar_t* in = const_data<scalar_t>(rows);
    const int vec = cuda::pick_vec<scalar_t>(
        width, {{in, rows.stride(0)}, {in + width, rows.stride(0)}, {out.const_data_ptr(), width}});
    cuda::with_vec<scalar_t>(vec, [&](auto V) {
      silu_and_mul_kernel<scalar_t, decltype(V)::value><<<rows.size(0), cuda::row_threads(width, V), 0, stream>>>(
          in, rows.stride(0), mutable_data<scalar_t>(out), static_cast<int>(width));
    });
  });
  QSPEC_KERNEL_LAUNCH_CHECK();
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CUDA, m) {
  m.impl("silu_and_mul", TORCH_BOX((&silu_and_mul_entry<DeviceType::CUDA, silu_and_mul_cuda>)));
}

}  // namespace qspec_ext
