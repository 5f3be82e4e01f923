// Per-element math of the norm / RoPE family, shared by the CPU and CUDA kernels.
// Torch-free: plain floats and ints only.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define QSPEC_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define QSPEC_HOST_DEVICE inline __attribute__((always_inline))  // inlined into the vectorized CPU loops
#else
#define QSPEC_HOST_DEVICE inline
#endif

namespace qspec_ext {

// Largest head_dim the attention-prologue kernels accept.
constexpr int kMaxHeadDim = 512;

// 1 / sqrt(mean(x^2) + eps), given sum(x^2) over n elements.
QSPEC_HOST_DEVICE float rms_inv(float sum_squares, int n, float eps) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(sum_squares / static_cast<float>(n) + eps);
#else
  return 1.0f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
#endif
}

// The two element indices rotated together by pair i of a rotary block of `rot` dims:
// neox (rotate-half) pairs i with i + rot/2, GPT-J pairs 2i with 2i + 1.
QSPEC_HOST_DEVICE int rope_first(int i, bool is_neox) { return is_neox ? i : 2 * i; }
QSPEC_HOST_DEVICE int rope_second(int i, int rot, bool is_neox) { return is_neox ? i + rot / 2 : 2 * i + 1; }

// Rotation of one pair by the angle whose cosine and sine are given.
QSPEC_HOST_DEVICE float rope_rotate_first(float first, float second, float cos, float sin) {
  return first * cos - second * sin;
}
QSPEC_HOST_DEVICE float rope_rotate_second(float first, float second, float cos, float sin) {
  return second * cos + first * sin;
}

}  // namespace qspec_ext
