// Small CUDA helpers shared by the kernel files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>  // aoti_torch_get_current_cuda_stream (USE_CUDA)
#include <torch/csrc/stable/accelerator.h>
#include <torch/headeronly/macros/Macros.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "torch_stable.h"

// A CUDA runtime call that must succeed, as a RuntimeError naming the error.
#define QSPEC_CUDA_CHECK(expr)                                                                             \
  do {                                                                                                     \
    const cudaError_t qspec_error = (expr);                                                                \
    if (qspec_error != cudaSuccess) [[unlikely]]                                                           \
      throw std::runtime_error(::qspec_ext::concat("qspec_ext: CUDA error: ", cudaGetErrorString(qspec_error), \
                                                   " (", #expr, " at ", __FILE__, ":", __LINE__, ")"));    \
  } while (0)
// After a launch: a launch that failed (a bad configuration, an earlier kernel's fault) raises.
#define QSPEC_KERNEL_LAUNCH_CHECK() QSPEC_CUDA_CHECK(cudaGetLastError())

namespace qspec_ext::cuda {

// What a kernel launch on t's device needs: that device made current for the scope (CUDAGuard) and
// torch's current stream on it.
class DeviceContext {
 public:
  explicit DeviceContext(const Tensor& t) : guard_(t.get_device_index()) {
    void* stream = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
    stream_ = static_cast<cudaStream_t>(stream);
  }
  cudaStream_t stream() const { return stream_; }

 private:
  torch::stable::accelerator::DeviceGuard guard_;
  cudaStream_t stream_;
};

constexpr int kWarpSize = 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block, returned to every thread. blockDim.x must be a multiple of 32.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = warp_sum(v);
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int num_warps = blockDim.x / kWarpSize;
  v = lane < num_warps ? partial[lane] : 0.f;
  return warp_sum(v);
}

// N consecutive elements moved with one memory access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// A norm weight or cos/sin value stored either in fp32 or in the activation dtype T.
template <typename T>
__device__ __forceinline__ float load_mixed(const void* p, bool is_f32, int64_t i) {
  return is_f32 ? static_cast<const float*>(p)[i] : static_cast<float>(static_cast<const T*>(p)[i]);
}

__device__ __forceinline__ int64_t load_index(const void* p, bool is_i64, int64_t i) {
  return is_i64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// A row base pointer and its row stride (in elements), for alignment decisions.
using RowPtr = std::pair<const void*, int64_t>;

// Largest number of elements per access (up to 16 bytes) that divides the width and
// keeps every row start of every operand aligned.
template <typename T>
int pick_vec(int64_t width, const std::vector<RowPtr>& rows) {
  int vec = 16 / static_cast<int>(sizeof(T));
  auto fits = [&](int v) {
    if (width % v != 0) return false;
    for (const auto& [ptr, stride] : rows)
      if (reinterpret_cast<uintptr_t>(ptr) % (v * sizeof(T)) != 0 || stride % v != 0) return false;
    return true;
  };
  while (vec > 1 && !fits(vec)) vec /= 2;
  return vec;
}

// Calls launch(std::integral_constant<int, VEC>) for the runtime vec.
template <typename T, typename Launch>
void with_vec(int vec, Launch&& launch) {
  if constexpr (sizeof(T) == 2) {
    if (vec == 8) return launch(std::integral_constant<int, 8>{});
  }
  if (vec >= 4) return launch(std::integral_constant<int, 4>{});
  if (vec == 2) return launch(std::integral_constant<int, 2>{});
  launch(std::integral_constant<int, 1>{});
}

// Threads for a one-block-per-row kernel: enough for one pass over the row, 32..256.
inline int row_threads(int64_t width, int vec) {
  const int64_t needed = (width / vec + kWarpSize - 1) / kWarpSize * kWarpSize;
  return static_cast<int>(std::clamp<int64_t>(needed, kWarpSize, 256));
}

}  // namespace qspec_ext::cuda

// A value check inside a kernel: print what was wrong (once per warp: the lowest lane
// that fails), then fail the launch (the next CUDA call raises "device-side assert
// triggered"). The caller returns right after, so nothing is read or written out of bounds
// even where asserts are compiled out.
#define QSPEC_DEVICE_CHECK(cond, fmt, ...)                                                     \
  do {                                                                                         \
    if (C10_UNLIKELY(!(cond))) {                                                               \
      if (threadIdx.x % qspec_ext::cuda::kWarpSize == __ffs(__activemask()) - 1)              \
        printf("qspec_ext." fmt "\n", __VA_ARGS__);                                           \
      CUDA_KERNEL_ASSERT_MSG(false, "qspec_ext: " #cond);                                      \
    }                                                                                          \
  } while (0)
