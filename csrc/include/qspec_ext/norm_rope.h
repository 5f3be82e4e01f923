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

#if defined(__USE_FAST_MATH__)
#error "qspec_ext: built with --use_fast_math; the kernels rely on IEEE division and sqrt (CPU == CUDA)"
#endif

namespace qspec_ext {

// Largest head_dim the attention-prologue kernels accept.
constexpr int kMaxHeadDim = 512;

// Correctly rounded float add / multiply that the compiler may not fuse into an FMA:
// where CPU and CUDA must agree bit for bit, every rounding step is written out. (The CPU
// sources are compiled with -ffp-contract=off; nvcc contracts unless told not to.)
QSPEC_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
QSPEC_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// 1 / sqrt(mean(x^2) + eps), given sum(x^2) over n elements; correctly rounded steps on
// both devices (no rsqrtf approximation).
QSPEC_HOST_DEVICE float rms_inv(float sum_squares, int n, float eps) {
  const float mean = add_rn(sum_squares / static_cast<float>(n), eps);
#if defined(__CUDA_ARCH__)
  return 1.0f / sqrtf(mean);  // IEEE sqrt and division: nvcc's default -prec-sqrt/-prec-div
#else
  return 1.0f / std::sqrt(mean);
#endif
}

// The two element indices rotated together by pair i of a rotary block of `rot` dims:
// neox (rotate-half) pairs i with i + rot/2, GPT-J pairs 2i with 2i + 1.
QSPEC_HOST_DEVICE int rope_first(int i, bool is_neox) { return is_neox ? i : 2 * i; }
QSPEC_HOST_DEVICE int rope_second(int i, int rot, bool is_neox) { return is_neox ? i + rot / 2 : 2 * i + 1; }

// Rotation of one pair by the angle whose cosine and sine are given.
// Rounded product by product, then the sum: the same bits on CPU and CUDA.
QSPEC_HOST_DEVICE float rope_rotate_first(float first, float second, float cos, float sin) {
  return add_rn(mul_rn(first, cos), -mul_rn(second, sin));
}
QSPEC_HOST_DEVICE float rope_rotate_second(float first, float second, float cos, float sin) {
  return add_rn(mul_rn(second, cos), mul_rn(first, sin));
}

}  // namespace qspec_ext
