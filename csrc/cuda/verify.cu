// CUDA kernels of draft verification, with the math of qspec_ext/verify.h:
//  1. row_stats_kernel, one block per target row (b, i): argmax and online-softmax
//     statistics in one coalesced pass over the logits, plus p and q of the draft token;
//  2. emit_kernel, one block per request: the accept walk (decide_request) and, where
//     needed, one inverse-CDF draw over the vocab: warps sum contiguous segments, the
//     segment holding u * total is walked 32 tokens at a time with a warp scan.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "common.cuh"
#include "ops.h"
#include "verify_entry.h"
#include "qspec_ext/verify.h"

namespace qspec_ext {
namespace {

using cuda::kWarpSize;
using cuda::load_index;
using cuda::load_mixed;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;

template <typename T>
__device__ __forceinline__ int num_draft_of(const VerifyParams<T>& p, int64_t b) {
  return p.num_draft == nullptr ? p.num_draft_max : static_cast<int>(load_index(p.num_draft, p.num_draft_i64, b));
}

__device__ __forceinline__ void warp_reduce(ArgMax& a, SoftmaxStats& s) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float value = __shfl_xor_sync(0xffffffffu, a.value, offset);
    const long long index = __shfl_xor_sync(0xffffffffu, static_cast<long long>(a.index), offset);
    argmax_update(a, value, index);
    const SoftmaxStats other{__shfl_xor_sync(0xffffffffu, s.max, offset), __shfl_xor_sync(0xffffffffu, s.sum, offset)};
    s = softmax_merge(s, other);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) row_stats_kernel(const VerifyParams<T> p) {
  const int i = blockIdx.x;
  const int64_t b = blockIdx.y;
  const int n = num_draft_of(p, b);
  if (threadIdx.x == 0)
    QSPEC_DEVICE_CHECK(n >= 0 && n <= p.num_draft_max, "verify: num_draft[%lld] = %d outside [0, %d]",
                       (long long)b, n, p.num_draft_max);
  if (n < 0 || n > p.num_draft_max || i > n) return;
  const float temperature = p.temperature == nullptr ? 0.f : p.temperature[b];
  if (threadIdx.x == 0)
    QSPEC_DEVICE_CHECK(temperature >= 0.f && temperature < INFINITY,
                       "verify_sampling: temperature[%lld] = %f is not a finite value >= 0", (long long)b,
                       temperature);
  if (!(temperature >= 0.f && temperature < INFINITY)) return;
  const bool sampling = temperature > 0.f;
  const T* logits = p.logits + b * p.logits_stride_b + i * p.logits_stride_i;

  ArgMax best{-INFINITY, p.vocab};
  SoftmaxStats stats{-INFINITY, 0.f};
  for (int64_t v = threadIdx.x; v < p.vocab; v += kThreads) {
    const float x = static_cast<float>(logits[v]);
    argmax_update(best, x, v);
    if (sampling) softmax_update(stats, x / temperature);
  }
  warp_reduce(best, stats);
  __shared__ ArgMax warp_best[kWarps];
  __shared__ SoftmaxStats warp_stats[kWarps];
  __shared__ int64_t draft_index;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_stats[warp] = stats;
  }
  if (threadIdx.x == 0) draft_index = p.draft_vocab;
  __syncthreads();

  const bool needs_q = sampling && i < n;
  const int64_t x = i < n ? p.draft_ids[b * p.draft_stride + i * p.draft_col_stride] : 0;
  if (threadIdx.x == 0)
    QSPEC_DEVICE_CHECK(x >= 0 && x < p.vocab, "verify: draft_ids[%lld, %d] = %lld outside [0, vocab=%lld)",
                       (long long)b, i, (long long)x, (long long)p.vocab);
  if (x < 0 || x >= p.vocab) return;
  if (needs_q && p.d2t != nullptr) {  // the draft-vocab id of x, if any
    for (int64_t d = threadIdx.x; d < p.draft_vocab; d += kThreads) {
      const int64_t target = d + load_index(p.d2t, p.d2t_i64, d);
      QSPEC_DEVICE_CHECK(target >= 0 && target < p.vocab, "verify_sampling: d2t maps draft id %lld to %lld, outside [0, %lld)",
                         (long long)d, (long long)target, (long long)p.vocab);
      if (target == x) atomicMin(reinterpret_cast<unsigned long long*>(&draft_index), static_cast<unsigned long long>(d));
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  VerifyRowStats r{};
  r.argmax = warp_best[0];
  r.softmax = warp_stats[0];
  for (int w = 1; w < kWarps; ++w) {
    argmax_update(r.argmax, warp_best[w].value, warp_best[w].index);
    r.softmax = softmax_merge(r.softmax, warp_stats[w]);
  }
  if (needs_q) {
    r.draft_logit = static_cast<float>(logits[x]) / temperature;
    const int64_t prob_row = b * p.probs_stride_b + i * p.probs_stride_i;
    if (p.draft_probs == nullptr) {
      r.draft_q = 1.f;
    } else if (p.d2t == nullptr) {
      r.draft_q = load_mixed<T>(p.draft_probs, p.probs_f32, prob_row + x);
    } else {
      r.draft_q = draft_index < p.draft_vocab ? load_mixed<T>(p.draft_probs, p.probs_f32, prob_row + draft_index) : 0.f;
    }
  }
  p.rows[b * (p.num_draft_max + 1) + i] = r;
}

// The sampling weight of target id v at row j of request b.
template <typename T>
__device__ __forceinline__ float weight_at(const VerifyParams<T>& p, const T* logits, int64_t v, float temperature,
                                           bool residual, const SoftmaxStats& stats, const float* q_dense,
                                           int64_t b, int j, int64_t draft) {
  float q = 0.f;
  if (residual) {
    if (p.draft_probs == nullptr) {
      q = v == draft ? 1.f : 0.f;
    } else if (q_dense != nullptr) {
      q = q_dense[v];
    } else {
      q = load_mixed<T>(p.draft_probs, p.probs_f32, b * p.probs_stride_b + j * p.probs_stride_i + v);
    }
  }
  return sample_weight(residual, stats, static_cast<float>(logits[v]) / temperature, q);
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) emit_kernel(const VerifyParams<T> p) {
  const int64_t b = blockIdx.x;
  const int rows_per_request = p.num_draft_max + 1;
  const int n = num_draft_of(p, b);
  const float temperature = p.temperature == nullptr ? 0.f : p.temperature[b];
  if (n < 0 || n > p.num_draft_max || !(temperature >= 0.f && temperature < INFINITY)) return;  // reported above
  const VerifyRowStats* rows = p.rows + b * rows_per_request;
  const int64_t* drafts = p.draft_ids + b * p.draft_stride;
  const int64_t seed = p.seed != nullptr ? p.seed[b] : 0, offset = p.offset != nullptr ? p.offset[b] : 0;
  for (int i = 0; i < n; ++i)
    if (drafts[i * p.draft_col_stride] < 0 || drafts[i * p.draft_col_stride] >= p.vocab) return;  // reported above
  const VerifyDecision decision = decide_request(rows, drafts, p.draft_col_stride, n, temperature, seed, offset);
  const int j = decision.accepted;

  __shared__ int64_t token;
  if (decision.emit == VerifyEmit::kArgmax) {
    if (threadIdx.x == 0) token = rows[j].argmax.index;
  } else {
    const T* logits = p.logits + b * p.logits_stride_b + j * p.logits_stride_i;
    bool residual = decision.emit == VerifyEmit::kResidual;
    const float* q_dense = nullptr;
    if (residual && p.d2t != nullptr) {  // q over target ids for this row
      float* q = p.q_dense + b * p.vocab;
      for (int64_t v = threadIdx.x; v < p.vocab; v += kThreads) q[v] = 0.f;
      __syncthreads();
      const int64_t prob_row = b * p.probs_stride_b + j * p.probs_stride_i;
      for (int64_t d = threadIdx.x; d < p.draft_vocab; d += kThreads) {
        const int64_t target = d + load_index(p.d2t, p.d2t_i64, d);
        if (target >= 0 && target < p.vocab) q[target] = load_mixed<T>(p.draft_probs, p.probs_f32, prob_row + d);
      }
      __syncthreads();
      q_dense = q;
    }
    // Each warp owns a contiguous segment of the vocab, read by its lanes in order.
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int64_t segment = (p.vocab + kWarps - 1) / kWarps;
    const int64_t begin = warp * segment, end = min(p.vocab, begin + segment);
    __shared__ double warp_total[kWarps];
    __shared__ long long warp_last[kWarps];
    __shared__ bool use_residual;
    __shared__ int chosen_warp;
    __shared__ double before_chosen;
    __shared__ double target;
    for (int attempt = 0; attempt < 2; ++attempt) {
      double sum = 0.0;
      long long last = -1;
      for (int64_t v = begin + lane; v < end; v += kWarpSize) {
        const float w = weight_at(p, logits, v, temperature, residual, rows[j].softmax, q_dense, b, j, drafts[(j < n ? j : 0) * p.draft_col_stride]);
        sum += w;
        if (w > 0.f) last = v;
      }
      sum = warp_sum_d(sum);
#pragma unroll
      for (int o = kWarpSize / 2; o > 0; o /= 2) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
      if (lane == 0) {
        warp_total[warp] = sum;
        warp_last[warp] = last;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < kWarps; ++w) total += warp_total[w];
        use_residual = residual && total > 0.0;
        if (residual && !(total > 0.0)) {  // p <= q everywhere: fall back to p itself
          chosen_warp = -2;
        } else {
          target = uniform_01(random_bits(seed, offset + j, kSampleUse)) * total;
          double running = 0.0;
          chosen_warp = -1;
          for (int w = 0; w < kWarps && chosen_warp < 0; ++w) {
            if (warp_total[w] > 0.0 && running + warp_total[w] > target) {
              chosen_warp = w;
              before_chosen = running;
              token = warp_last[w];  // kept if rounding lets the walk below pass the segment
            } else {
              running += warp_total[w];
            }
          }
          if (chosen_warp < 0) {  // rounding left target at the very end
            long long last_all = -1;
            for (int w = 0; w < kWarps; ++w) last_all = max(last_all, warp_last[w]);
            token = last_all;
          }
        }
      }
      __syncthreads();
      if (chosen_warp != -2) break;
      residual = false;
      __syncthreads();
    }
    if (chosen_warp >= 0 && warp == chosen_warp) {
      double running = before_chosen;
      for (int64_t base = begin; base < end; base += kWarpSize) {
        const int64_t v = base + lane;
        const float w = v < end ? weight_at(p, logits, v, temperature, use_residual, rows[j].softmax, q_dense, b, j,
                                            drafts[(j < n ? j : 0) * p.draft_col_stride])
                                : 0.f;
        double inclusive = w;
#pragma unroll
        for (int o = 1; o < kWarpSize; o *= 2) {
          const double up = __shfl_up_sync(0xffffffffu, inclusive, o);
          if (lane >= o) inclusive += up;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, w > 0.f && running + inclusive > target);
        if (hit != 0) {
          if (lane == __ffs(hit) - 1) token = v;
          break;
        }
        running += __shfl_sync(0xffffffffu, inclusive, kWarpSize - 1);
      }
    }
    __syncthreads();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t* out = p.out_ids + b * rows_per_request;
    for (int i = 0; i < rows_per_request; ++i) out[i] = i < j ? drafts[i * p.draft_col_stride] : (i == j ? token : -1);
    p.num_accepted[b] = j;
  }
}

}  // namespace

void verify_cuda(std::string_view op, const at::Tensor& draft_ids, const std::optional<at::Tensor>& draft_probs,
                 const at::Tensor& target_logits, const std::optional<at::Tensor>& temperature,
                 const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                 const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& num_draft,
                 const VerifyShape& s, at::Tensor& out_ids, at::Tensor& num_accepted) {
  QSPEC_CHECK(target_logits.is_cuda(), op, "target_logits", "must be a CUDA tensor for the CUDA kernel, got ",
              target_logits.device());
  if (s.batch == 0) return;
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor rows = verify_rows_workspace(s, target_logits);
  at::Tensor q_dense;
  if (s.has_d2t) q_dense = at::empty({s.batch, s.vocab}, target_logits.options().dtype(at::kFloat));
  QSPEC_DISPATCH_ACTIVATION(target_logits.scalar_type(), "verify_cuda", [&] {
    const VerifyParams<scalar_t> p = verify_params<scalar_t>(draft_ids, draft_probs, target_logits, temperature, seed,
                                                             offset, d2t, num_draft, s, rows, (s.has_d2t ? q_dense.data_ptr<float>() : nullptr), out_ids,
                                                             num_accepted);
    row_stats_kernel<scalar_t><<<dim3(s.num_draft_max + 1, s.batch), kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    emit_kernel<scalar_t><<<s.batch, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

TORCH_LIBRARY_IMPL(qspec_ext, CUDA, m) {
  m.impl("verify_greedy", &verify_greedy_entry<verify_cuda>);
  m.impl("verify_greedy_out", &verify_greedy_out_entry<verify_cuda>);
  m.impl("verify_sampling", &verify_sampling_entry<verify_cuda>);
  m.impl("verify_sampling_out", &verify_sampling_out_entry<verify_cuda>);
}

}  // namespace qspec_ext
