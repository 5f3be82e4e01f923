// CUDA kernels of draft verification, with the math and the summation structure of
// qspec_ext/verify.h (shared with the CPU kernels, so both make the same decisions):
//  1. row_stats_kernel, one 256-thread block per target row (b, i): the argmax in one
//     coalesced pass, then (sampling rows) the softmax sum in a second pass over the row
//     (from L2), plus p and q of the draft token;
//  2. emit_kernel, one block per request: the accept walk (decide_request) and, where
//     needed, one inverse-CDF draw in two levels: thread c sums the weights of vocab
//     chunk c, thread 0 picks the chunk holding u * total, warp 0 scans that chunk 32 ids
//     at a time. With d2t, q at a target id is found by a cursor into the (increasing)
//     draft vocabulary: no [B, V] workspace.
//
// Small batches: at B = 1, K = 3 step 1 launches 4 blocks on an H100's 132 SMs, so one logits
// row (600 KB at V = 151936) is read by one SM. The split-V variant (split_*_kernel, opt-in
// with QSPEC_VERIFY_SPLIT until a GPU run shows it faster) gives each row one block per
// kVerifySplitIds ids (19 at V = 151936): the splits' argmaxes, then the splits' softmax
// partials, then one block per row combines them in split order (verify.h's
// split_partial_sum), so its statistics are those of row_stats_kernel and of the CPU, bit for
// bit. bench_verify.py's B = 1 / 8, K = 3 / 7, V = 151936 rows measure both (% of copy
// bandwidth; benchmarks/gpu_check.sh).

#include <cstdlib>
#include <limits>
#include <string_view>

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
using cuda::warp_sum;

constexpr int kThreads = kVerifyThreads;  // the summation structure assumes exactly this
constexpr int kWarps = kThreads / kWarpSize;
static_assert(kWarps == kVerifyWarps);

// num_draft[b] in 64 bits (range-checked by the caller before any narrowing).
template <typename T>
__device__ __forceinline__ int64_t num_draft_of(const VerifyParams<T>& p, int64_t b) {
  return p.num_draft == nullptr ? p.num_draft_max : load_index(p.num_draft, p.num_draft_i64, b);
}

__device__ __forceinline__ void warp_argmax(ArgMax& a) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float value = __shfl_xor_sync(0xffffffffu, a.value, offset);
    const long long index = __shfl_xor_sync(0xffffffffu, static_cast<long long>(a.index), offset);
    argmax_update(a, value, index);
  }
}

// The argmax (torch.argmax semantics), returned to every thread.
// Over ids [begin, end); `none` (>= end) is the index while no value has been seen.
template <typename T>
__device__ ArgMax block_argmax(const T* logits, int64_t begin, int64_t end, int64_t none) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  ArgMax best{-INFINITY, none};
  for (int64_t v = begin + threadIdx.x; v < end; v += kThreads) argmax_update(best, static_cast<float>(logits[v]), v);
  warp_argmax(best);
  __shared__ ArgMax warp_best[kWarps];
  __shared__ ArgMax row_best;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    row_best = warp_best[0];
    for (int w = 1; w < kWarps; ++w) argmax_update(row_best, warp_best[w].value, warp_best[w].index);
  }
  __syncthreads();
  return row_best;
}

// The 256 partials of a row (one per thread) in combine_partials' order; valid in thread 0.
__device__ float combine_block(float sum) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  sum = warp_sum(sum);
  __shared__ float warp_sums[kWarps];
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  float total = warp_sums[0];
  if (threadIdx.x == 0)
    for (int w = 1; w < kWarps; ++w) total = add_rn(total, warp_sums[w]);
  return total;
}

// The softmax sum of logits / temperature at max_x, in the shared order; valid in thread 0.
template <typename T>
__device__ float block_softmax_sum(const T* logits, int64_t vocab, float temperature, float max_x) {
  return combine_block(split_partial_sum(0, vocab, threadIdx.x, [&](int64_t v) {
    return exp_nonpositive(static_cast<float>(logits[v]) / temperature - max_x);
  }));
}

// One inverse-CDF draw at uniform u over the weights weight(v, cursor) of ids [0, vocab), in
// two levels: thread c sums the weights of chunk c in order (double), thread 0 picks the chunk
// holding u * total, warp 0 scans it 32 ids at a time. start(v) gives a weight cursor for ids
// from v on. Returns the id to every thread, or -1 when no weight is positive.
template <typename Weight, typename Start>
__device__ int64_t block_draw(int64_t vocab, double u, Weight weight, Start start) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t size = draw_chunk_size(vocab);
  __shared__ double sums[kThreads];
  __shared__ int64_t last_positive[kThreads];
  __shared__ DrawChoice choice;
  __shared__ double target;
  __shared__ int64_t token;
  __shared__ bool empty;
  {
    const int64_t begin = min(vocab, threadIdx.x * size), end = min(vocab, begin + size);
    int64_t d = start(begin), last = -1;
    double sum = 0.0;
    for (int64_t v = begin; v < end; ++v) {
      const float w = weight(v, d);
      sum += w;
      if (w > 0.f) last = v;
    }
    sums[threadIdx.x] = sum;
    last_positive[threadIdx.x] = last;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const double total = chunk_total(sums);
    empty = !(total > 0.0);
    target = u * total;
    choice = choose_chunk(sums, target);
    token = -1;
  }
  __syncthreads();
  if (empty) return -1;
  if (choice.chunk < 0) {  // rounding left the target past the end
    if (threadIdx.x == 0) {
      int64_t last = -1;
      for (int c = 0; c < kThreads; ++c) last = max(last, last_positive[c]);
      token = last;
    }
  } else if (warp == 0) {
    const int64_t begin = choice.chunk * size, end = min(vocab, begin + size);
    double before = choice.before;
    int64_t d = start(begin + lane), found = -1;
    for (int64_t group = begin; group < end; group += kWarpSize) {
      const int64_t v = group + lane;
      const float w = v < end ? weight(v, d) : 0.f;
      double inclusive = w;
#pragma unroll
      for (int o = 1; o < kWarpSize; o *= 2) {
        const double up = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += up;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, w > 0.f && before + inclusive > target);
      if (hit != 0) {
        found = group + __ffs(hit) - 1;
        break;
      }
      before += __shfl_sync(0xffffffffu, inclusive, kWarpSize - 1);
    }
    if (lane == 0) token = found >= 0 ? found : last_positive[choice.chunk];  // rounding passed the chunk
  }
  __syncthreads();
  return token;
}

// Block 0 checks the whole mapping once per call: target ids in range and increasing.
template <typename T>
__device__ void check_d2t(const VerifyParams<T>& p) {
  __shared__ unsigned long long first_bad;
  if (threadIdx.x == 0) first_bad = static_cast<unsigned long long>(p.draft_vocab);
  __syncthreads();
  for (int64_t d = threadIdx.x; d < p.draft_vocab; d += kThreads) {
    const int64_t t = d2t_target(p.d2t, p.d2t_i64, d);
    const bool ok = t >= 0 && t < p.vocab && (d == 0 || t > d2t_target(p.d2t, p.d2t_i64, d - 1));
    if (!ok) atomicMin(&first_bad, static_cast<unsigned long long>(d));
  }
  __syncthreads();
  if (threadIdx.x == 0 && first_bad < static_cast<unsigned long long>(p.draft_vocab)) {
    const long long d = static_cast<long long>(first_bad);
    QSPEC_DEVICE_CHECK(false,
                       "verify_sampling: d2t must map draft ids to strictly increasing target ids in [0, %lld), "
                       "got draft id %lld -> %lld",
                       (long long)p.vocab, d, (long long)d2t_target(p.d2t, p.d2t_i64, d));
  }
}

// What a target row (b, i) needs: its request's draft count, temperature and draft id,
// checked (reported by thread 0 when `report`; invalid rows compute nothing).
struct RowJob {
  int64_t b;
  int i;
  int64_t n;
  float temperature;
  int64_t x;  // the draft id at row i (0 for the bonus row)
  bool valid;
};

template <typename T>
__device__ RowJob row_job(const VerifyParams<T>& p, int64_t row, bool report) {
  const int rows_per_request = p.num_draft_max + 1;
  RowJob job{row / rows_per_request, static_cast<int>(row % rows_per_request), 0, 0.f, 0, false};
  job.n = num_draft_of(p, job.b);
  if (report && threadIdx.x == 0)
    QSPEC_DEVICE_CHECK(job.n >= 0 && job.n <= p.num_draft_max, "verify: num_draft[%lld] = %lld outside [0, %d]",
                       (long long)job.b, (long long)job.n, p.num_draft_max);
  if (job.n < 0 || job.n > p.num_draft_max || job.i > job.n) return job;
  job.temperature = p.temperature == nullptr ? 0.f : p.temperature[job.b];
  if (report && threadIdx.x == 0)
    QSPEC_DEVICE_CHECK(job.temperature >= 0.f && job.temperature < INFINITY,
                       "verify_sampling: temperature[%lld] = %f is not a finite value >= 0", (long long)job.b,
                       job.temperature);
  if (!(job.temperature >= 0.f && job.temperature < INFINITY)) return job;
  job.x = job.i < job.n ? p.draft_ids[job.b * p.draft_stride + job.i * p.draft_col_stride] : 0;
  if (report && threadIdx.x == 0)
    QSPEC_DEVICE_CHECK(job.x >= 0 && job.x < p.vocab, "verify: draft_ids[%lld, %d] = %lld outside [0, vocab=%lld)",
                       (long long)job.b, job.i, (long long)job.x, (long long)p.vocab);
  job.valid = job.x >= 0 && job.x < p.vocab;
  return job;
}

template <typename T>
__device__ __forceinline__ const T* row_logits(const VerifyParams<T>& p, const RowJob& job) {
  return p.logits + job.b * p.logits_stride_b + job.i * p.logits_stride_i;
}

// Thread 0 writes the row's statistics, with p and q of its draft token.
template <typename T>
__device__ void finish_row(const VerifyParams<T>& p, int64_t row, const RowJob& job, ArgMax argmax,
                           SoftmaxStats softmax) {
  if (threadIdx.x != 0) return;
  VerifyRowStats r{};
  r.argmax = argmax;
  r.softmax = softmax;
  if (job.i < job.n && job.temperature > 0.f) {
    r.draft_logit = static_cast<float>(row_logits(p, job)[job.x]) / job.temperature;
    const int64_t prob_row = job.b * p.probs_stride_b + job.i * p.probs_stride_i;
    if (p.draft_probs == nullptr) {
      r.draft_q = 1.f;
    } else if (p.d2t == nullptr) {
      r.draft_q = load_mixed<T>(p.draft_probs, p.probs_f32, prob_row + job.x);
    } else {
      const int64_t d = draft_index_of(p.d2t, p.d2t_i64, p.draft_vocab, job.x);
      r.draft_q = d >= 0 ? load_mixed<T>(p.draft_probs, p.probs_f32, prob_row + d) : 0.f;
    }
  }
  p.rows[row] = r;
}

// One block per target row: the argmax in one coalesced pass, then (sampling rows with a
// finite max) the softmax sum in a second pass over the row, in the shared order.
template <typename T>
__global__ void __launch_bounds__(kThreads) row_stats_kernel(const VerifyParams<T> p) {
  if (blockIdx.x == 0 && p.d2t != nullptr) check_d2t(p);
  const RowJob job = row_job(p, blockIdx.x, true);
  if (!job.valid) return;
  const T* logits = row_logits(p, job);
  const ArgMax best = block_argmax(logits, 0, p.vocab, p.vocab);
  SoftmaxStats softmax{-INFINITY, 0.f};
  if (job.temperature > 0.f && is_finite(best.value)) {  // block-uniform; no distribution otherwise
    const float max_x = best.value / job.temperature;
    softmax = SoftmaxStats{max_x, block_softmax_sum(logits, p.vocab, job.temperature, max_x)};
  }
  finish_row(p, blockIdx.x, job, best, softmax);
}

// ---- split-V row statistics: B * (K + 1) * splits blocks instead of B * (K + 1) ----
// Block (row, s) covers ids [s * kVerifySplitIds, (s + 1) * kVerifySplitIds). Same results
// as row_stats_kernel, bit for bit: the argmax does not depend on the order, and each softmax
// partial is folded split by split as split_partial_sum does.

__device__ __forceinline__ ArgMax combine_split_argmax(const ArgMax* split_best, int splits) {
  ArgMax best = split_best[0];
  for (int s = 1; s < splits; ++s) argmax_update(best, split_best[s].value, split_best[s].index);
  return best;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) split_argmax_kernel(const VerifyParams<T> p, ArgMax* split_best,
                                                                 int splits) {
  const int64_t row = blockIdx.x / splits;
  const int s = static_cast<int>(blockIdx.x % splits);
  const RowJob job = row_job(p, row, false);
  if (!job.valid) return;
  const int64_t begin = s * kVerifySplitIds, end = min(p.vocab, begin + kVerifySplitIds);
  const ArgMax best = block_argmax(row_logits(p, job), begin, end, p.vocab);
  if (threadIdx.x == 0) split_best[blockIdx.x] = best;
}

// Sampling rows only: thread j's sum of partial j's terms inside split s.
template <typename T>
__global__ void __launch_bounds__(kThreads) split_softmax_kernel(const VerifyParams<T> p, const ArgMax* split_best,
                                                                  float* split_partials, int splits) {
  const int64_t row = blockIdx.x / splits;
  const int s = static_cast<int>(blockIdx.x % splits);
  const RowJob job = row_job(p, row, false);
  if (!job.valid || !(job.temperature > 0.f)) return;
  const ArgMax best = combine_split_argmax(split_best + row * splits, splits);
  if (!is_finite(best.value)) return;
  const float max_x = best.value / job.temperature;
  const T* logits = row_logits(p, job);
  const int64_t begin = s * kVerifySplitIds, end = min(p.vocab, begin + kVerifySplitIds);
  split_partials[blockIdx.x * kThreads + threadIdx.x] = split_partial_sum(begin, end, threadIdx.x, [&](int64_t v) {
    return exp_nonpositive(static_cast<float>(logits[v]) / job.temperature - max_x);
  });
}

// One block per row: the splits' argmaxes and partials combined, the checks reported.
template <typename T>
__global__ void __launch_bounds__(kThreads) split_combine_kernel(const VerifyParams<T> p, const ArgMax* split_best,
                                                                  const float* split_partials, int splits) {
  if (blockIdx.x == 0 && p.d2t != nullptr) check_d2t(p);
  const RowJob job = row_job(p, blockIdx.x, true);
  if (!job.valid) return;
  const ArgMax best = combine_split_argmax(split_best + blockIdx.x * splits, splits);
  SoftmaxStats softmax{-INFINITY, 0.f};
  if (job.temperature > 0.f && is_finite(best.value)) {  // block-uniform
    float partial = 0.f;
    for (int s = 0; s < splits; ++s)
      partial = add_rn(partial, split_partials[(blockIdx.x * splits + s) * kThreads + threadIdx.x]);
    softmax = SoftmaxStats{best.value / job.temperature, combine_block(partial)};
  }
  finish_row(p, blockIdx.x, job, best, softmax);
}

// q(v) of the emitted row; v must not decrease between calls with the same cursor d
// (a position in the draft vocabulary, used with d2t).
template <typename T>
__device__ __forceinline__ float q_at(const VerifyParams<T>& p, int64_t prob_row, int64_t draft, int64_t v,
                                      int64_t& d) {
  if (p.draft_probs == nullptr) return v == draft ? 1.f : 0.f;
  if (p.d2t == nullptr) return load_mixed<T>(p.draft_probs, p.probs_f32, prob_row + v);
  while (d < p.draft_vocab && d2t_target(p.d2t, p.d2t_i64, d) < v) ++d;
  return d < p.draft_vocab && d2t_target(p.d2t, p.d2t_i64, d) == v
             ? load_mixed<T>(p.draft_probs, p.probs_f32, prob_row + d)
             : 0.f;
}

// The sampling weight of target id v in the emitted row (cursor d: see q_at).
template <typename T>
__device__ __forceinline__ float emit_weight(const VerifyParams<T>& p, const T* logits, int64_t prob_row,
                                             int64_t draft, SoftmaxStats stats, float temperature, bool residual,
                                             int64_t v, int64_t& d) {
  const float q = residual ? q_at(p, prob_row, draft, v, d) : 0.f;
  return sample_weight(residual, stats, static_cast<float>(logits[v]) / temperature, q);
}

// A q_at cursor for ids from v on.
template <typename T>
__device__ __forceinline__ int64_t emit_cursor(const VerifyParams<T>& p, bool residual, int64_t v) {
  return residual && p.d2t != nullptr ? d2t_lower_bound(p.d2t, p.d2t_i64, p.draft_vocab, v) : int64_t{0};
}

// One block per SM is plenty (B blocks in all): without the hint ptxas aims for occupancy,
// stops at 48 registers and spills.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) emit_kernel(const VerifyParams<T> p) {
  const int64_t b = blockIdx.x;
  const int rows_per_request = p.num_draft_max + 1;
  const int64_t n64 = num_draft_of(p, b);
  const float temperature = p.temperature == nullptr ? 0.f : p.temperature[b];
  if (n64 < 0 || n64 > p.num_draft_max || !(temperature >= 0.f && temperature < INFINITY)) return;  // reported above
  const int n = static_cast<int>(n64);
  const VerifyRowStats* rows = p.rows + b * rows_per_request;
  const int64_t* drafts = p.draft_ids + b * p.draft_stride;
  const int64_t seed = p.seed != nullptr ? p.seed[b] : 0, offset = p.offset != nullptr ? p.offset[b] : 0;
  for (int i = 0; i < n; ++i)
    if (drafts[i * p.draft_col_stride] < 0 || drafts[i * p.draft_col_stride] >= p.vocab) return;  // reported above
  const VerifyDecision decision = decide_request(rows, drafts, p.draft_col_stride, n, temperature, seed, offset);
  const int j = decision.accepted;

  int64_t token = rows[j].argmax.index;
  if (decision.emit != VerifyEmit::kArgmax) {  // block-uniform
    const T* logits = p.logits + b * p.logits_stride_b + j * p.logits_stride_i;
    const int64_t prob_row = b * p.probs_stride_b + j * p.probs_stride_i;
    const int64_t draft = j < n ? drafts[j * p.draft_col_stride] : -1;
    const SoftmaxStats stats = rows[j].softmax;
    const double u = uniform_01(random_bits(seed, offset + j, kSampleUse));
    // A residual with no positive weight (p <= q everywhere) falls back to p.
    for (bool residual = decision.emit == VerifyEmit::kResidual;; residual = false) {
      token = block_draw(
          p.vocab, u,
          [&](int64_t v, int64_t& d) {
            return emit_weight(p, logits, prob_row, draft, stats, temperature, residual, v, d);
          },
          [&](int64_t v) { return emit_cursor(p, residual, v); });
      if (token >= 0 || !residual) break;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t* out = p.out_ids + b * rows_per_request;
    for (int i = 0; i < rows_per_request; ++i) out[i] = i < j ? drafts[i * p.draft_col_stride] : (i == j ? token : -1);
    p.num_accepted[b] = j;
  }
}


// ---- tree verification: every node's token first, then one walk per request ----

template <typename T>
__device__ __forceinline__ int64_t tree_parent(const TreeVerifyParams<T>& p, int64_t b, int i) {
  return load_index(p.parents, p.parents_i64, b * p.num_nodes + i);
}

// One block per node (b, j): the node's parent checked, its depth, then the target's token
// at the node as walk_tree defines it (argmax, or one draw keyed by offset + depth). Unused
// nodes get -1.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) tree_token_kernel(const TreeVerifyParams<T> p) {
  const int nodes = p.num_nodes + 1;
  const int64_t b = blockIdx.x / nodes;
  const int j = static_cast<int>(blockIdx.x % nodes);
  __shared__ int depth;  // -1: unused, or under an invalid parent (reported by its own block)
  if (threadIdx.x == 0) {
    int d = 0;
    if (j > 0) {
      const int64_t parent = tree_parent(p, b, j - 1);
      QSPEC_DEVICE_CHECK(parent >= -1 && parent < j,
                         "verify_tree: parents[%lld, %d] = %lld must be in [0, %d] (topological order) or -1",
                         (long long)b, j - 1, (long long)parent, j - 1);
      QSPEC_DEVICE_CHECK(parent < 1 || parent >= j || tree_parent(p, b, parent - 1) != -1,
                         "verify_tree: node %d of request %lld hangs under node %lld, which is unused", j,
                         (long long)b, (long long)parent);
      for (int node = j; node > 0; ++d) {  // up to the root; parents strictly decrease
        const int64_t parent = tree_parent(p, b, node - 1);
        if (parent < 0 || parent >= node) {
          d = -1;
          break;
        }
        node = static_cast<int>(parent);
      }
    }
    const float temperature = p.temperature == nullptr ? 0.f : p.temperature[b];
    QSPEC_DEVICE_CHECK(temperature >= 0.f && temperature < INFINITY,
                       "verify_tree_sampling: temperature[%lld] = %f is not a finite value >= 0", (long long)b,
                       temperature);
    depth = temperature >= 0.f && temperature < INFINITY ? d : -1;
  }
  __syncthreads();
  if (depth < 0) {
    if (threadIdx.x == 0) p.tokens[blockIdx.x] = -1;
    return;
  }
  const T* logits = p.logits + b * p.logits_stride_b + j * p.logits_stride_i;
  const float temperature = p.temperature == nullptr ? 0.f : p.temperature[b];
  const ArgMax best = block_argmax(logits, 0, p.vocab, p.vocab);
  int64_t token = best.index;
  if (temperature > 0.f && is_finite(best.value)) {  // block-uniform
    const float max_x = best.value / temperature;
    const float sum = block_softmax_sum(logits, p.vocab, temperature, max_x);
    __shared__ SoftmaxStats stats;
    if (threadIdx.x == 0) stats = SoftmaxStats{max_x, sum};
    __syncthreads();
    if (softmax_valid(stats)) {
      const int64_t seed = p.seed != nullptr ? p.seed[b] : 0, offset = p.offset != nullptr ? p.offset[b] : 0;
      const SoftmaxStats row = stats;
      token = block_draw(
          p.vocab, uniform_01(random_bits(seed, offset + depth, kSampleUse)),
          [&](int64_t v, int64_t&) { return sample_weight(false, row, static_cast<float>(logits[v]) / temperature, 0.f); },
          [](int64_t) { return int64_t{0}; });
    }
  }
  if (threadIdx.x == 0) p.tokens[blockIdx.x] = token;
}

// One thread per request: walk_tree over the nodes' tokens.
template <typename T>
__global__ void tree_walk_kernel(const TreeVerifyParams<T> p) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  const int N = p.num_nodes;
  const int64_t* tokens = p.tokens + b * (N + 1);
  for (int i = 0; i < N; ++i) {
    const int64_t x = p.draft_ids[b * p.draft_stride + i * p.draft_col_stride];
    const bool used = tokens[i + 1] >= 0;
    QSPEC_DEVICE_CHECK(!used || (x >= 0 && x < p.vocab),
                       "verify_tree: draft_ids[%lld, %d] = %lld outside [0, vocab=%lld)", (long long)b, i,
                       (long long)x, (long long)p.vocab);
    if (used && (x < 0 || x >= p.vocab)) return;
  }
  if (tokens[0] < 0) return;  // reported by tree_token_kernel
  const auto parent = [&](int i) { return tree_parent(p, b, i); };
  const auto draft = [&](int i) { return p.draft_ids[b * p.draft_stride + i * p.draft_col_stride]; };
  const auto token = [&](int node, int) { return tokens[node]; };
  p.num_accepted[b] = walk_tree(N, parent, draft, token, p.out_ids + b * (N + 1), p.path + b * (N + 1));
}

// Split-V row statistics are not the default until a GPU run shows them faster (benchmarks/
// gpu_check.sh): QSPEC_VERIFY_SPLIT=1 takes them where B * (K + 1) rows would leave more than
// half the SMs idle, =always at every size (for the checks), unset or 0 never.
bool use_split_rows(std::string_view op, int64_t num_rows, const Tensor& like) {
  const char* setting = std::getenv("QSPEC_VERIFY_SPLIT");
  const std::string_view mode = setting == nullptr ? "0" : setting;
  QSPEC_CHECK(mode == "0" || mode == "1" || mode == "always", op, "QSPEC_VERIFY_SPLIT",
              "must be 0, 1 or always, got '", mode, "'");
  if (mode != "1") return mode == "always";
  int sms = 0;
  QSPEC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, like.get_device_index()));
  return num_rows < 2 * static_cast<int64_t>(sms);
}

}  // namespace

void verify_cuda(std::string_view op, const Tensor& draft_ids, const std::optional<Tensor>& draft_probs,
                 const Tensor& target_logits, const std::optional<Tensor>& temperature,
                 const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                 const std::optional<Tensor>& d2t, const std::optional<Tensor>& num_draft,
                 const VerifyShape& s, Tensor& out_ids, Tensor& num_accepted) {
  QSPEC_CHECK(target_logits.is_cuda(), op, "target_logits", "must be a CUDA tensor for the CUDA kernel, got ",
              target_logits.device());
  if (s.batch == 0) return;
  const cuda::DeviceContext context(target_logits);
  const cudaStream_t stream = context.stream();
  Tensor rows = verify_rows_workspace(s, target_logits);
  const int64_t num_rows = s.batch * (s.num_draft_max + 1);
  const int splits = use_split_rows(op, num_rows, target_logits) ? static_cast<int>(verify_num_splits(s.vocab)) : 1;
  Tensor split_workspace;
  if (splits > 1) {
    QSPEC_CHECK(num_rows * splits <= std::numeric_limits<int32_t>::max(), op, "target_logits",
                "split-V verification needs B * (K + 1) * splits <= 2^31 - 1 blocks, got ", num_rows * splits);
    split_workspace = empty({num_rows * splits * static_cast<int64_t>(sizeof(ArgMax) + kThreads * sizeof(float))},
                            target_logits, kByte);
  }
  QSPEC_DISPATCH_ACTIVATION(dtype_of(target_logits), "verify_cuda", [&] {
    const VerifyParams<scalar_t> p = verify_params<scalar_t>(draft_ids, draft_probs, target_logits, temperature, seed,
                                                             offset, d2t, num_draft, s, rows, out_ids, num_accepted);
    // 1-D grids: B * (K + 1) <= 2^31 - 1 is checked with the shapes.
    if (splits == 1) {
      row_stats_kernel<scalar_t><<<num_rows, kThreads, 0, stream>>>(p);
      QSPEC_KERNEL_LAUNCH_CHECK();
    } else {
      auto* split_best = reinterpret_cast<ArgMax*>(mutable_data<uint8_t>(split_workspace));
      auto* split_partials = reinterpret_cast<float*>(split_best + num_rows * splits);
      split_argmax_kernel<scalar_t><<<num_rows * splits, kThreads, 0, stream>>>(p, split_best, splits);
      QSPEC_KERNEL_LAUNCH_CHECK();
      split_softmax_kernel<scalar_t><<<num_rows * splits, kThreads, 0, stream>>>(p, split_best, split_partials, splits);
      QSPEC_KERNEL_LAUNCH_CHECK();
      split_combine_kernel<scalar_t><<<num_rows, kThreads, 0, stream>>>(p, split_best, split_partials, splits);
      QSPEC_KERNEL_LAUNCH_CHECK();
    }
    emit_kernel<scalar_t><<<s.batch, kThreads, 0, stream>>>(p);
    QSPEC_KERNEL_LAUNCH_CHECK();
  });
}

void verify_tree_cuda(std::string_view op, const Tensor& draft_ids, const Tensor& parents,
                      const Tensor& target_logits, const std::optional<Tensor>& temperature,
                      const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                      const TreeVerifyShape& s, Tensor& out_ids, Tensor& num_accepted, Tensor& path) {
  QSPEC_CHECK(target_logits.is_cuda(), op, "target_logits", "must be a CUDA tensor for the CUDA kernel, got ",
              target_logits.device());
  if (s.batch == 0) return;
  const cuda::DeviceContext context(target_logits);
  const cudaStream_t stream = context.stream();
  Tensor tokens = empty({s.batch, s.num_nodes + 1}, draft_ids);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(target_logits), "verify_tree_cuda", [&] {
    const TreeVerifyParams<scalar_t> p = tree_verify_params<scalar_t>(draft_ids, parents, target_logits, temperature,
                                                                     seed, offset, s, tokens, out_ids, num_accepted,
                                                                     path);
    // 1-D grids: B * (N + 1) <= 2^31 - 1 is checked with the shapes.
    tree_token_kernel<scalar_t><<<s.batch * (s.num_nodes + 1), kThreads, 0, stream>>>(p);
    QSPEC_KERNEL_LAUNCH_CHECK();
    constexpr int kWalkThreads = 128;
    tree_walk_kernel<scalar_t><<<(s.batch + kWalkThreads - 1) / kWalkThreads, kWalkThreads, 0, stream>>>(p);
    QSPEC_KERNEL_LAUNCH_CHECK();
  });
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CUDA, m) {
  m.impl("verify_greedy", TORCH_BOX((&verify_greedy_entry<verify_cuda>)));
  m.impl("verify_greedy_out", TORCH_BOX((&verify_greedy_out_entry<verify_cuda>)));
  m.impl("verify_sampling", TORCH_BOX((&verify_sampling_entry<verify_cuda>)));
  m.impl("verify_sampling_out", TORCH_BOX((&verify_sampling_out_entry<verify_cuda>)));
  m.impl("verify_tree_greedy", TORCH_BOX((&verify_tree_greedy_entry<verify_tree_cuda>)));
  m.impl("verify_tree_greedy_out", TORCH_BOX((&verify_tree_greedy_out_entry<verify_tree_cuda>)));
  m.impl("verify_tree_sampling", TORCH_BOX((&verify_tree_sampling_entry<verify_tree_cuda>)));
  m.impl("verify_tree_sampling_out", TORCH_BOX((&verify_tree_sampling_out_entry<verify_tree_cuda>)));
}

}  // namespace qspec_ext
