// Building blocks of the CPU kernels: fp32 scratch rows, conversions, and the
// vectorizable loops the row kernels are made of.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <string_view>
#include <vector>


#include "checks.h"
#include "qspec_ext/norm_rope.h"

// Row kernels are compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QSPEC_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QSPEC_CPU_CLONES
#endif
#define QSPEC_INLINE inline __attribute__((always_inline))

// AVX-512 and AVX512-BF16 (vdpbf16ps) kernels: GCC on x86-64, as the target clones; a target
// attribute, and cpu_avx512() / cpu_bf16_dot() pick them at run time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define QSPEC_BF16_DOT 1
#define QSPEC_TARGET_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define QSPEC_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#else
#define QSPEC_BF16_DOT 0
#endif

namespace qspec_ext::cpu {

// 8 fp32 lanes as one GCC vector: one AVX2 / AVX-512VL register, two SSE ones. (A 16-lane vector is
// one AVX-512 register but goes through the stack in the AVX2 clone.) Helpers that take or return
// it are always inlined: no call ABI to warn about in the baseline (SSE) clone.
typedef float Lanes8 __attribute__((vector_size(32)));
#pragma GCC diagnostic ignored "-Wpsabi"

QSPEC_INLINE Lanes8 load8(const float* p) {
  Lanes8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// exp(x) written with plain float / int operations so that a loop of them vectorizes (libm's expf
// does not): Cody-Waite range reduction x = n ln2 + r and Cephes' degree-6 polynomial for e^r,
// within 2 ulp of expf. x below -87 (e^x under FLT_MIN, and -inf) gives 0; above 88.3 (2^127: the
// largest power of two, near expf's own overflow at 88.72), e^88.3: it saturates.
QSPEC_INLINE float vec_exp(float x) {
  const bool underflow = x < -87.f;
  x = std::clamp(x, -87.f, 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float er = poly * r * r + r + 1.f;
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.f : er * two_n;
}

// Rows per parallel task: enough work (about 64K elements) to pay for a thread.
inline int64_t grain_for(int64_t elements_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(elements_per_row, 1));
}

template <typename T>
QSPEC_INLINE void load_float(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
QSPEC_INLINE void store_float(const float* __restrict__ src, T* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Sum of squares with 16 independent partial sums, so the loop vectorizes without
// reassociating one serial float sum.
QSPEC_INLINE float sum_squares(const float* __restrict__ x, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * x[i + j];
  float total = 0.f;
  for (; i < n; ++i) total += x[i] * x[i];
  for (int j = 0; j < 16; ++j) total += acc[j];
  return total;
}

// dst = RMSNorm(x) * weight from an fp32 row, converted to T on the way out.
template <typename T>
QSPEC_INLINE void store_normalized(const float* __restrict__ x, const float* __restrict__ weight, T* __restrict__ dst,
                                   int64_t n, float eps) {
  const float inv = rms_inv(sum_squares(x, n), static_cast<int>(n), eps);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(x[i] * inv * weight[i]);
}

// x = RMSNorm(x) * weight, in place on an fp32 row.
QSPEC_INLINE void rms_normalize(float* __restrict__ x, const float* __restrict__ weight, int64_t n, float eps) {
  const float inv = rms_inv(sum_squares(x, n), static_cast<int>(n), eps);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * weight[i];
}

// A norm weight's values (contiguous; stored in fp32 or the activation dtype) as fp32 on the host:
// its own data when it is fp32, else a copy converted here (a few KB per call; a tensor op's
// allocation and dispatch cost more).
class FloatWeight {
 public:
  explicit FloatWeight(const Tensor& weight) {
    STD_TORCH_CHECK(weight.is_contiguous());  // the ops' checks
    if (dtype_of(weight) == kFloat) {
      data_ = const_data<float>(weight);
      return;
    }
    copy_.resize(weight.numel());
    QSPEC_DISPATCH_ACTIVATION(dtype_of(weight), "FloatWeight", [&] {
      load_float(const_data<scalar_t>(weight), copy_.data(), weight.numel());
    });
    data_ = copy_.data();
  }
  const float* data() const { return data_; }

 private:
  std::vector<float> copy_;
  const float* data_ = nullptr;
};

// The values of a contiguous int32 / int64 index tensor, read without asking torch per element.
class Indices {
 public:
  explicit Indices(const Tensor& t)
      : data_(t.const_data_ptr()), i64_(dtype_of(t) == kLong), size_(t.numel()) {}
  int64_t operator[](int64_t i) const {
    return i64_ ? static_cast<const int64_t*>(data_)[i] : static_cast<const int32_t*>(data_)[i];
  }
  int64_t size() const { return size_; }

 private:
  const void* data_;
  bool i64_;
  int64_t size_;
};

// Value checks done before any write, so a bad call leaves its outputs untouched.
inline void check_index_range(std::string_view op, std::string_view name, const Tensor& t, int64_t lo, int64_t hi,
                       std::string_view what) {
  const Indices values(t);
  for (int64_t i = 0; i < values.size(); ++i) {
    const int64_t v = values[i];
    QSPEC_CHECK(v >= lo && v < hi, op, name, "must hold values in [", lo, ", ", hi, ") (", what, "), got ", v,
                " at index ", i);
  }
}

}  // namespace qspec_ext::cpu
