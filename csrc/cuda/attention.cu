// CUDA kernels of cached decode attention (flash-decoding). One block per (query row, key split):
// its warps take the split's used key slots in turn, each key a coalesced row read by the whole
// warp (lanes across head_dim), with an online softmax in fp32 per warp; the warps' states merge
// in shared memory. With one split the block writes the output; with several it writes its
// (max, sum, accumulator) state and a second kernel merges the splits of each query row.
#include <cmath>


#include "attention_entry.h"
#include "checks.h"
#include "common.cuh"
#include "ops.h"
#include "qspec_ext/attention.h"

namespace qspec_ext {
namespace {

using cuda::kWarpSize;
using cuda::warp_sum;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
// Fewest key slots (of the cache allocated) per split: splits are sized from the cache, the keys
// of each split from the row's used length.
constexpr int64_t kMinSlotsPerSplit = 256;
constexpr int kMaxSplits = 32;

// state: [max, sum, acc[D]] of one query row and split, in fp32.
template <typename T, int EPL>  // EPL: head_dim elements per lane, ceil(D / 32)
__global__ void __launch_bounds__(kThreads) cached_attention_kernel(const AttentionParams<T> p, float* states) {
  const int64_t row = blockIdx.x;  // (b * T + t) * Hq + hq
  const int split = blockIdx.y, splits = gridDim.y;
  const int64_t hq = row % p.heads_q, b = row / p.heads_q / p.tokens, t = row / p.heads_q % p.tokens;
  const int64_t h = hq / (p.heads_q / p.heads_kv), D = p.head_dim;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;

  const KeyRange range = key_range(p, b, t);
  const int64_t span = range.hi > range.lo ? range.hi - range.lo : 0;
  const int64_t chunk = (span + splits - 1) / splits;
  const int64_t begin = range.lo + split * chunk;
  const int64_t end = begin + chunk < range.hi ? begin + chunk : range.hi;

  const T* q_row = p.query + b * p.q_stride_b + t * p.q_stride_t + hq * p.q_stride_h;
  float q[EPL], acc[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int64_t d = lane + e * kWarpSize;
    q[e] = d < D ? static_cast<float>(q_row[d]) * p.scale : 0.f;
    acc[e] = 0.f;
  }
  float top = -INFINITY, total = 0.f;
  const int64_t row_stride = p.heads_kv * D;
  const T* k_base = p.k_cache + b * p.max_length * row_stride + h * D;
  const T* v_base = p.v_cache + b * p.max_length * row_stride + h * D;
  for (int64_t j = begin + warp; j < end; j += kWarps) {
    if (!key_seen(p, b, t, j)) continue;  // the same j for the whole warp
    const T* k = k_base + j * row_stride;
    const T* v = v_base + j * row_stride;
    float score = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int64_t d = lane + e * kWarpSize;
      if (d < D) score += q[e] * static_cast<float>(k[d]);
    }
    score = warp_sum(score);
    const float new_top = fmaxf(top, score);
    const float correction = expf(top - new_top);  // 0 while nothing was seen
    const float weight = expf(score - new_top);
    total = total * correction + weight;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int64_t d = lane + e * kWarpSize;
      acc[e] = acc[e] * correction + (d < D ? weight * static_cast<float>(v[d]) : 0.f);
    }
    top = new_top;
  }

  __shared__ float warp_top[kWarps], warp_total[kWarps];
  __shared__ float warp_acc[kWarps][kMaxHeadDim];
  if (lane == 0) warp_top[warp] = top, warp_total[warp] = total;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int64_t d = lane + e * kWarpSize;
    if (d < D) warp_acc[warp][d] = acc[e];
  }
  __syncthreads();
  float block_top = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) block_top = fmaxf(block_top, warp_top[w]);
  float factor[kWarps], block_total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    factor[w] = warp_top[w] == -INFINITY ? 0.f : expf(warp_top[w] - block_top);
    block_total += warp_total[w] * factor[w];
  }
  float* state = states == nullptr ? nullptr : states + (row * splits + split) * (D + 2);
  if (state != nullptr && threadIdx.x == 0) state[0] = block_top, state[1] = block_total;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += warp_acc[w][d] * factor[w];
    if (state != nullptr)
      state[2 + d] = sum;
    else
      p.out[row * D + d] = block_top == -INFINITY ? T(0) : static_cast<T>(sum / block_total);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) merge_splits_kernel(const AttentionParams<T> p, const float* states,
                                                                int splits) {
  const int64_t row = blockIdx.x, D = p.head_dim;
  const float* rows = states + row * splits * (D + 2);
  float top = -INFINITY;
  for (int s = 0; s < splits; ++s) top = fmaxf(top, rows[s * (D + 2)]);
  float total = 0.f;
  for (int s = 0; s < splits; ++s)
    if (rows[s * (D + 2)] != -INFINITY) total += rows[s * (D + 2) + 1] * expf(rows[s * (D + 2)] - top);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float* state = rows + s * (D + 2);
      if (state[0] != -INFINITY) sum += state[2 + d] * expf(state[0] - top);
    }
    p.out[row * D + d] = top == -INFINITY ? T(0) : static_cast<T>(sum / total);
  }
}

template <typename T, int EPL>
void launch(const AttentionParams<T>& p, int64_t rows, int splits, float* states, cudaStream_t stream) {
  cached_attention_kernel<T, EPL><<<dim3(rows, splits), kThreads, 0, stream>>>(p, states);
  QSPEC_KERNEL_LAUNCH_CHECK();
  if (states != nullptr) {
    merge_splits_kernel<T><<<rows, kThreads, 0, stream>>>(p, states, splits);
    QSPEC_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

void cached_attention_cuda(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                           const Tensor& positions, double scale, int64_t window,
                           const std::optional<Tensor>& tree_start, const std::optional<Tensor>& tree_seen,
                           const AttentionShape& s, Tensor& out) {
  const cuda::DeviceContext context(query);
  const cudaStream_t stream = context.stream();
  const int64_t rows = s.batch * s.tokens * s.heads_q;
  // Flash-decoding: split the keys when there are too few rows to fill the device.
  int sms = 0;
  QSPEC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, query.get_device_index()));
  const int64_t wanted = (2 * static_cast<int64_t>(sms) + rows - 1) / rows;
  const int64_t by_length = (s.max_length + kMinSlotsPerSplit - 1) / kMinSlotsPerSplit;
  const int splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({wanted, by_length, kMaxSplits})));
  Tensor states;
  if (splits > 1) states = empty({rows * splits * (s.head_dim + 2)}, query, kFloat);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(query), "cached_attention_cuda", [&] {
    AttentionParams<scalar_t> p{};
    p.query = const_data<scalar_t>(query);
    p.q_stride_b = query.stride(0), p.q_stride_t = query.stride(1), p.q_stride_h = query.stride(2);
    p.k_cache = const_data<scalar_t>(k_cache);
    p.v_cache = const_data<scalar_t>(v_cache);
    p.positions = positions.const_data_ptr();
    p.positions_i64 = dtype_of(positions) == kLong;
    p.tree_start = s.has_tree ? const_data<int64_t>(*tree_start) : nullptr;
    p.tree_seen = s.has_tree ? const_data<bool>(*tree_seen) : nullptr;
    p.out = mutable_data<scalar_t>(out);
    p.batch = s.batch, p.tokens = s.tokens, p.heads_q = s.heads_q, p.heads_kv = s.heads_kv;
    p.head_dim = s.head_dim, p.max_length = s.max_length, p.scratch = s.scratch;
    p.window = window;
    p.scale = static_cast<float>(scale);
    float* state_ptr = splits > 1 ? mutable_data<float>(states) : nullptr;
    const int64_t per_lane = (s.head_dim + kWarpSize - 1) / kWarpSize;
    if (per_lane <= 2)
      launch<scalar_t, 2>(p, rows, splits, state_ptr, stream);
    else if (per_lane <= 4)
      launch<scalar_t, 4>(p, rows, splits, state_ptr, stream);
    else if (per_lane <= 8)
      launch<scalar_t, 8>(p, rows, splits, state_ptr, stream);
    else
      launch<scalar_t, 16>(p, rows, splits, state_ptr, stream);
  });
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CUDA, m) {
  m.impl("cached_attention", TORCH_BOX((&cached_attention_entry<DeviceType::CUDA, cached_attention_cuda>)));
}

}  // namespace qspec_ext
