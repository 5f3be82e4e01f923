// CUDA kernels of the norm / RoPE family.
//  - row norms: one block per row, two passes (sum of squares, then normalize); the
//    second pass re-reads the row (from L1/L2) instead of staging it, so any width works.
//  - qk_norm_rope_: one warp per (token, head). The normalized head is staged in fp32
//    shared memory, so RoPE partners are read from there rather than shuffled between
//    lanes: any even head_dim up to 512 and any rotary_dim work, with no shuffle inside
//    a divergent branch (the partial-rotary bug seen in other implementations). Lanes
//    read elements other lanes staged only after a __syncwarp().

#include "checks.h"
#include "common.cuh"
#include "norm_rope_entry.h"
#include "ops.h"
#include "qspec_ext/norm_rope.h"

namespace qspec_ext {
namespace {

using cuda::block_sum;
using cuda::kWarpSize;
using cuda::load_index;
using cuda::load_mixed;
using cuda::row_threads;
using cuda::Pack;
using cuda::pick_vec;
using cuda::warp_sum;
using cuda::with_vec;

// ---------------------------------------------------------------------------------------
// Row norms. VEC elements per access (16-byte accesses when the row allows it).
// ---------------------------------------------------------------------------------------

template <typename T, int VEC>
__device__ __forceinline__ float row_sum_squares(const T* __restrict__ in, const T* __restrict__ add, int width) {
  float ss = 0.f;
  for (int i = threadIdx.x * VEC; i < width; i += blockDim.x * VEC) {
    const auto a = *reinterpret_cast<const Pack<T, VEC>*>(in + i);
    Pack<T, VEC> b{};
    if (add != nullptr) b = *reinterpret_cast<const Pack<T, VEC>*>(add + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = static_cast<float>(a.v[j]) + (add != nullptr ? static_cast<float>(b.v[j]) : 0.f);
      ss += x * x;
    }
  }
  return block_sum(ss);
}

// out = RMSNorm(in [+ add]) * weight. With add (fused add), the fp32 sum is also written
// to add. raw_copy / normed_copy, when not null, receive in (unnormalized) / out as well.
template <typename T, int VEC>
__device__ __forceinline__ void norm_row(const T* in, T* add, T* out, const void* __restrict__ weight,
                                         bool weight_f32, int width, float eps, T* __restrict__ raw_copy,
                                         T* __restrict__ normed_copy) {
  const float inv = rms_inv(row_sum_squares<T, VEC>(in, add, width), width, eps);
  for (int i = threadIdx.x * VEC; i < width; i += blockDim.x * VEC) {
    const auto a = *reinterpret_cast<const Pack<T, VEC>*>(in + i);
    Pack<T, VEC> b{}, sum, normed;
    if (add != nullptr) b = *reinterpret_cast<const Pack<T, VEC>*>(add + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float x = static_cast<float>(a.v[j]) + (add != nullptr ? static_cast<float>(b.v[j]) : 0.f);
      sum.v[j] = static_cast<T>(x);
      normed.v[j] = static_cast<T>(x * inv * load_mixed<T>(weight, weight_f32, i + j));
    }
    if (add != nullptr) *reinterpret_cast<Pack<T, VEC>*>(add + i) = sum;
    if (raw_copy != nullptr) *reinterpret_cast<Pack<T, VEC>*>(raw_copy + i) = a;
    *reinterpret_cast<Pack<T, VEC>*>(out + i) = normed;
    if (normed_copy != nullptr) *reinterpret_cast<Pack<T, VEC>*>(normed_copy + i) = normed;
  }
}

template <typename T, int VEC>
__global__ void rms_norm_kernel(const T* __restrict__ in,  // [rows, width], row stride in_stride
                                int64_t in_stride,
                                T* __restrict__ out,  // [rows, width], contiguous
                                const void* __restrict__ weight, bool weight_f32, int width, float eps) {
  const int64_t r = blockIdx.x;
  norm_row<T, VEC>(in + r * in_stride, nullptr, out + r * width, weight, weight_f32, width, eps, nullptr, nullptr);
}

template <typename T, int VEC>
__global__ void fused_add_rms_norm_kernel(T* input,  // [rows, width], row stride in_stride; normalized in place
                                          int64_t in_stride,
                                          T* residual,  // [rows, width], row stride res_stride; += input
                                          int64_t res_stride, const void* __restrict__ weight, bool weight_f32,
                                          int width, float eps) {
  const int64_t r = blockIdx.x;
  T* row = input + r * in_stride;
  norm_row<T, VEC>(row, residual + r * res_stride, row, weight, weight_f32, width, eps, nullptr, nullptr);
}

template <typename T, int VEC>
__global__ void eagle3_input_norm_kernel(const T* __restrict__ embeds,  // [rows, width], row stride embed_stride
                                         int64_t embed_stride,
                                         const T* __restrict__ hidden,  // [rows, width], row stride hidden_stride
                                         int64_t hidden_stride,
                                         T* __restrict__ x,  // [rows, 2 * width]
                                         T* __restrict__ residual,  // [rows, width]
                                         const void* __restrict__ embed_weight, bool embed_weight_f32,
                                         const void* __restrict__ hidden_weight, bool hidden_weight_f32, int width,
                                         float eps, bool norm_before_residual) {
  const int64_t r = blockIdx.x;
  T* x_row = x + r * 2 * width;
  T* res_row = residual + r * width;
  norm_row<T, VEC>(embeds + r * embed_stride, nullptr, x_row, embed_weight, embed_weight_f32, width, eps, nullptr,
                   nullptr);
  norm_row<T, VEC>(hidden + r * hidden_stride, nullptr, x_row + width, hidden_weight, hidden_weight_f32, width,
                   eps, norm_before_residual ? nullptr : res_row, norm_before_residual ? res_row : nullptr);
}

// ---------------------------------------------------------------------------------------
// qk_norm_rope_
// ---------------------------------------------------------------------------------------

constexpr int kWarpsPerBlock = 4;

template <typename T>
struct QKNormRopeArgs {
  T* qkv;  // [T, (Hq + 2 Hkv) * D], row stride qkv_stride
  int64_t qkv_stride;
  const void* q_weight;  // [D] fp32 or T, or nullptr (no QK-norm)
  const void* k_weight;  // [D]
  bool weight_f32;
  const void* cos_sin;  // [max_position, rot]: cos in the first half, sin in the second
  bool cos_sin_f32;
  const void* positions;  // [T] int32/int64
  bool positions_i64;
  const void* slot_mapping;  // [T] int32/int64 or nullptr; -1 = skip
  bool slots_i64;
  T* k_cache;  // [num_slots, Hkv, D], strides (k_slot_stride, k_head_stride, 1)
  T* v_cache;
  int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
  int64_t num_tokens, max_position, num_slots;
  int num_heads_q, num_heads_kv, head_dim, rot_dim;
  float eps;
  bool is_neox;
  bool has_cache;  // (an empty cache has a null data pointer)
};

// Grid: one warp per (token, head) over the q and k heads, plus the v heads when the
// caches are written.
template <typename T, int VEC>
__global__ void __launch_bounds__(kWarpsPerBlock* kWarpSize) qk_norm_rope_kernel(const QKNormRopeArgs<T> a) {
  __shared__ float staged[kWarpsPerBlock][kMaxHeadDim];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int heads_per_token = a.num_heads_q + a.num_heads_kv + (a.has_cache ? a.num_heads_kv : 0);
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (item >= a.num_tokens * heads_per_token) return;  // whole warp leaves together
  const int64_t t = item / heads_per_token;
  const int h = static_cast<int>(item % heads_per_token);
  const int D = a.head_dim;
  T* x = a.qkv + t * a.qkv_stride + static_cast<int64_t>(h) * D;

  int64_t slot = -1;
  if (a.has_cache) {
    slot = load_index(a.slot_mapping, a.slots_i64, t);
    QSPEC_DEVICE_CHECK(slot >= -1 && slot < a.num_slots,
                       "qk_norm_rope_: slot_mapping[%lld] = %lld outside [-1, num_slots=%lld)", (long long)t,
                       (long long)slot, (long long)a.num_slots);
    if (slot < -1 || slot >= a.num_slots) return;
  }

  if (h >= a.num_heads_q + a.num_heads_kv) {  // a v head: cache copy only
    if (slot < 0) return;
    T* dst = a.v_cache + slot * a.v_slot_stride + static_cast<int64_t>(h - a.num_heads_q - a.num_heads_kv) * a.v_head_stride;
    for (int i = lane; i < D; i += kWarpSize) dst[i] = x[i];
    return;
  }

  const int64_t pos = load_index(a.positions, a.positions_i64, t);
  QSPEC_DEVICE_CHECK(pos >= 0 && pos < a.max_position,
                     "qk_norm_rope_: positions[%lld] = %lld outside the cos_sin_cache rows [0, %lld)",
                     (long long)t, (long long)pos, (long long)a.max_position);
  if (pos < 0 || pos >= a.max_position) return;

  const bool is_q = h < a.num_heads_q;
  float* s = staged[warp];
  float ss = 0.f;
  for (int i = lane * VEC; i < D; i += kWarpSize * VEC) {  // VEC divides the even head_dim
    const auto v = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      s[i + j] = static_cast<float>(v.v[j]);
      ss += s[i + j] * s[i + j];
    }
  }
  __syncwarp();  // the loops below read elements other lanes staged (shuffles do not order shared memory)
  if (a.q_weight != nullptr) {
    const float inv = rms_inv(warp_sum(ss), D, a.eps);  // every lane reaches the shuffle
    const void* w = is_q ? a.q_weight : a.k_weight;
    for (int i = lane; i < D; i += kWarpSize) s[i] = s[i] * inv * load_mixed<T>(w, a.weight_f32, i);
  }
  __syncwarp();

  T* k_dst = nullptr;
  if (!is_q && slot >= 0) k_dst = a.k_cache + slot * a.k_slot_stride + static_cast<int64_t>(h - a.num_heads_q) * a.k_head_stride;
  const int half = a.rot_dim / 2;
  const int64_t cs_row = pos * a.rot_dim;
  for (int i = lane; i < half; i += kWarpSize) {
    const int i0 = rope_first(i, a.is_neox), i1 = rope_second(i, a.rot_dim, a.is_neox);
    const float c = load_mixed<T>(a.cos_sin, a.cos_sin_f32, cs_row + i);
    const float sn = load_mixed<T>(a.cos_sin, a.cos_sin_f32, cs_row + half + i);
    const T o0 = static_cast<T>(rope_rotate_first(s[i0], s[i1], c, sn));
    const T o1 = static_cast<T>(rope_rotate_second(s[i0], s[i1], c, sn));
    x[i0] = o0;
    x[i1] = o1;
    if (k_dst != nullptr) {
      k_dst[i0] = o0;
      k_dst[i1] = o1;
    }
  }
  for (int i = a.rot_dim + lane; i < D; i += kWarpSize) {  // partial rotary: the rest is only normalized
    const T o = static_cast<T>(s[i]);
    x[i] = o;
    if (k_dst != nullptr) k_dst[i] = o;
  }
}

}  // namespace

void rms_norm_cuda(const Tensor& rows, const Tensor& weight, double eps, Tensor& out) {
  const cuda::DeviceContext context(rows);
  const cudaStream_t stream = context.stream();
  const int64_t width = rows.size(1);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(rows), "rms_norm_cuda", [&] {
    const int vec = pick_vec<scalar_t>(width, {{rows.const_data_ptr(), rows.stride(0)}, {out.mutable_data_ptr(), width}});
    with_vec<scalar_t>(vec, [&](auto V) {
      rms_norm_kernel<scalar_t, decltype(V)::value><<<rows.size(0), row_threads(width, V), 0, stream>>>(
          const_data<scalar_t>(rows), rows.stride(0), mutable_data<scalar_t>(out), weight.const_data_ptr(),
          dtype_of(weight) == kFloat, static_cast<int>(width), static_cast<float>(eps));
    });
  });
  QSPEC_KERNEL_LAUNCH_CHECK();
}

void fused_add_rms_norm_cuda(Tensor& in_rows, Tensor& res_rows, const Tensor& weight, double eps) {
  const cuda::DeviceContext context(in_rows);
  const cudaStream_t stream = context.stream();
  const int64_t width = in_rows.size(1);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(in_rows), "fused_add_rms_norm_cuda", [&] {
    const int vec = pick_vec<scalar_t>(
        width, {{in_rows.mutable_data_ptr(), in_rows.stride(0)}, {res_rows.mutable_data_ptr(), res_rows.stride(0)}});
    with_vec<scalar_t>(vec, [&](auto V) {
      fused_add_rms_norm_kernel<scalar_t, decltype(V)::value><<<in_rows.size(0), row_threads(width, V), 0, stream>>>(
          mutable_data<scalar_t>(in_rows), in_rows.stride(0), mutable_data<scalar_t>(res_rows), res_rows.stride(0),
          weight.const_data_ptr(), dtype_of(weight) == kFloat, static_cast<int>(width),
          static_cast<float>(eps));
    });
  });
  QSPEC_KERNEL_LAUNCH_CHECK();
}

void eagle3_input_norm_cuda(const Tensor& embeds, const Tensor& hidden, const Tensor& embed_weight,
                            const Tensor& hidden_weight, double eps, bool norm_before_residual, Tensor& x,
                            Tensor& residual) {
  const int64_t rows = embeds.size(0), width = embeds.size(1);
  const cuda::DeviceContext context(embeds);
  const cudaStream_t stream = context.stream();
  QSPEC_DISPATCH_ACTIVATION(dtype_of(embeds), "eagle3_input_norm_cuda", [&] {
    const int vec = pick_vec<scalar_t>(width, {{embeds.const_data_ptr(), embeds.stride(0)},
                                               {hidden.const_data_ptr(), hidden.stride(0)},
                                               {x.mutable_data_ptr(), 2 * width},
                                               {residual.mutable_data_ptr(), width}});
    with_vec<scalar_t>(vec, [&](auto V) {
      eagle3_input_norm_kernel<scalar_t, decltype(V)::value><<<rows, row_threads(width, V), 0, stream>>>(
          const_data<scalar_t>(embeds), embeds.stride(0), const_data<scalar_t>(hidden), hidden.stride(0),
          mutable_data<scalar_t>(x), mutable_data<scalar_t>(residual), embed_weight.const_data_ptr(),
          dtype_of(embed_weight) == kFloat, hidden_weight.const_data_ptr(),
          dtype_of(hidden_weight) == kFloat, static_cast<int>(width), static_cast<float>(eps),
          norm_before_residual);
    });
  });
  QSPEC_KERNEL_LAUNCH_CHECK();
}

void qk_norm_rope_cuda(Tensor& qkv, const std::optional<Tensor>& q_weight,
                       const std::optional<Tensor>& k_weight, const Tensor& cos_sin_cache,
                       const Tensor& positions, double eps, bool is_neox, const std::optional<Tensor>& k_cache,
                       const std::optional<Tensor>& v_cache, const std::optional<Tensor>& slot_mapping,
                       const QKNormRopeShape& s) {
  if (s.num_tokens == 0) return;
  const int64_t num_heads_q = s.num_heads_q, num_heads_kv = s.num_heads_kv, head_dim = s.head_dim;
  const cuda::DeviceContext context(qkv);
  const cudaStream_t stream = context.stream();
  const int64_t heads_per_token = num_heads_q + num_heads_kv + (s.has_cache ? num_heads_kv : 0);
  const int64_t blocks = (s.num_tokens * heads_per_token + kWarpsPerBlock - 1) / kWarpsPerBlock;
  QSPEC_DISPATCH_ACTIVATION(dtype_of(qkv), "qk_norm_rope_cuda", [&] {
    QKNormRopeArgs<scalar_t> a{};
    a.qkv = mutable_data<scalar_t>(qkv);
    a.qkv_stride = qkv.stride(0);
    a.q_weight = s.has_norm ? q_weight->const_data_ptr() : nullptr;
    a.k_weight = s.has_norm ? k_weight->const_data_ptr() : nullptr;
    a.weight_f32 = s.has_norm && dtype_of(*q_weight) == kFloat;
    a.cos_sin = cos_sin_cache.const_data_ptr();
    a.cos_sin_f32 = dtype_of(cos_sin_cache) == kFloat;
    a.positions = positions.const_data_ptr();
    a.positions_i64 = dtype_of(positions) == kLong;
    if (s.has_cache) {
      a.slot_mapping = slot_mapping->const_data_ptr();
      a.slots_i64 = dtype_of(*slot_mapping) == kLong;
      a.k_cache = mutable_data<scalar_t>(*k_cache);
      a.v_cache = mutable_data<scalar_t>(*v_cache);
      a.k_slot_stride = k_cache->stride(0);
      a.k_head_stride = k_cache->stride(1);
      a.v_slot_stride = v_cache->stride(0);
      a.v_head_stride = v_cache->stride(1);
    }
    a.num_tokens = s.num_tokens;
    a.max_position = s.max_position;
    a.num_slots = s.num_slots;
    a.num_heads_q = static_cast<int>(num_heads_q);
    a.num_heads_kv = static_cast<int>(num_heads_kv);
    a.head_dim = static_cast<int>(head_dim);
    a.rot_dim = static_cast<int>(s.rot_dim);
    a.eps = static_cast<float>(eps);
    a.is_neox = is_neox;
    a.has_cache = s.has_cache;
    // Pairs of elements load with one access when every row start is pair-aligned.
    const bool pairs = pick_vec<scalar_t>(2, {{qkv.mutable_data_ptr(), qkv.stride(0)}}) >= 2;
    if (pairs) {
      qk_norm_rope_kernel<scalar_t, 2><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(a);
    } else {
      qk_norm_rope_kernel<scalar_t, 1><<<blocks, kWarpsPerBlock * kWarpSize, 0, stream>>>(a);
    }
  });
  QSPEC_KERNEL_LAUNCH_CHECK();
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CUDA, m) {
  constexpr auto cuda = DeviceType::CUDA;
  m.impl("rms_norm", TORCH_BOX((&rms_norm_entry<cuda, rms_norm_cuda>)));
  m.impl("fused_add_rms_norm_", TORCH_BOX((&fused_add_rms_norm_entry<cuda, fused_add_rms_norm_cuda>)));
  m.impl("eagle3_input_norm", TORCH_BOX((&eagle3_input_norm_entry<cuda, eagle3_input_norm_cuda>)));
  m.impl("qk_norm_rope_", TORCH_BOX((&qk_norm_rope_entry<cuda, qk_norm_rope_cuda>)));
}

}  // namespace qspec_ext
