// CPU kernels of draft verification, in three steps with the math and the summation
// structure of qspec_ext/verify.h (the CUDA kernels' order, so both decide the same):
//  1. per target row (b, i), in parallel: argmax, softmax statistics of logits / T, and
//     p and q of the draft token;
//  2. per request: the accept walk (decide_request);
//  3. per request, where needed: one inverse-CDF draw over the vocab (bonus or residual).
#include <algorithm>
#include <vector>


#include "cpu_common.h"
#include "ops.h"
#include "verify_entry.h"
#include "qspec_ext/verify.h"

namespace qspec_ext {
namespace {

using namespace cpu;

template <typename T>
float draft_prob_at(const VerifyParams<T>& p, int64_t b, int64_t i, int64_t index) {
  const int64_t at = b * p.probs_stride_b + i * p.probs_stride_i + index;
  return p.probs_f32 ? static_cast<const float*>(p.draft_probs)[at]
                     : static_cast<float>(static_cast<const T*>(p.draft_probs)[at]);
}

template <typename T>
int num_draft_of(const VerifyParams<T>& p, int64_t b) {  // validated to [0, K] before any work
  if (p.num_draft == nullptr) return p.num_draft_max;
  return static_cast<int>(p.num_draft_i64 ? static_cast<const int64_t*>(p.num_draft)[b]
                                          : static_cast<const int32_t*>(p.num_draft)[b]);
}

template <typename T>
float temperature_of(const VerifyParams<T>& p, int64_t b) {
  return p.temperature == nullptr ? 0.f : p.temperature[b];
}

// q(x) of draft token x at (b, i).
template <typename T>
float draft_q(const VerifyParams<T>& p, int64_t b, int i, int64_t x) {
  if (p.draft_probs == nullptr) return 1.f;
  if (p.d2t == nullptr) return draft_prob_at(p, b, i, x);
  const int64_t d = draft_index_of(p.d2t, p.d2t_i64, p.draft_vocab, x);
  return d >= 0 ? draft_prob_at(p, b, i, d) : 0.f;  // outside the draft vocabulary: 0
}

typedef int32_t Mask8 __attribute__((vector_size(32)));

// The max of a row's logits and whether it holds a NaN, in 16 vector lanes (x > m ? x : m keeps m
// when x is NaN; x != x flags it). GCC leaves the same pass written over a float[16] scalar.
template <typename T>
QSPEC_INLINE float row_max(const T* __restrict__ logits, int64_t vocab, bool& nan) {
  const Lanes8 lowest = Lanes8{} - INFINITY;
  Lanes8 max0 = lowest, max1 = lowest;
  Mask8 nans = {};
  int64_t v = 0;
  for (; v + 16 <= vocab; v += 16) {
    float x[16];
    for (int j = 0; j < 16; ++j) x[j] = static_cast<float>(logits[v + j]);
    const Lanes8 x0 = load8(x), x1 = load8(x + 8);
    max0 = x0 > max0 ? x0 : max0;
    max1 = x1 > max1 ? x1 : max1;
    nans |= (x0 != x0) | (x1 != x1);
  }
  max0 = max1 > max0 ? max1 : max0;
  float max = -INFINITY;
  nan = false;
  for (int j = 0; j < 8; ++j) {
    max = max0[j] > max ? max0[j] : max;
    nan |= nans[j] != 0;
  }
  for (; v < vocab; ++v) {
    const float x = static_cast<float>(logits[v]);
    max = x > max ? x : max;
    nan |= x != x;
  }
  return max;
}

// Step 1 for one row: vectorizable passes over the logits (max and NaN; the argmax
// position; the softmax sum), each reading the row from cache after the first.
template <typename T>
QSPEC_INLINE VerifyRowStats row_stats_impl(const T* __restrict__ logits, int64_t vocab, float temperature) {
  // The max (and whether a NaN is present), then the position of its first occurrence,
  // searched a block at a time.
  bool nan;
  const float max = row_max(logits, vocab, nan);
  ArgMax best{nan ? NAN : max, 0};  // all -inf: torch.argmax gives 0
  constexpr int64_t kBlock = 64;
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t stop = std::min(vocab, start + kBlock);
    int32_t hits = 0;
    for (int64_t u = start; u < stop; ++u) {
      const float x = static_cast<float>(logits[u]);
      hits += nan ? x != x : x == max;
    }
    if (hits == 0) continue;
    for (int64_t u = start; u < stop; ++u) {
      const float x = static_cast<float>(logits[u]);
      if (nan ? x != x : x == max) {
        best.index = u;
        break;
      }
    }
    break;
  }
  VerifyRowStats r{};
  r.argmax = best;
  r.softmax = SoftmaxStats{-INFINITY, 0.f};
  if (temperature > 0.f && !nan && is_finite(max)) {  // no distribution otherwise
    const float max_x = max / temperature;
    // split_partial_sum's order, 256 partials at a time (vectorized over j).
    float partial[kVerifyThreads] = {};
    for (int64_t split = 0; split < vocab; split += kVerifySplitIds) {
      const int64_t split_end = std::min(vocab, split + kVerifySplitIds);
      float sum[kVerifyThreads] = {};
      int64_t base = split;
      for (; base + kVerifyThreads <= split_end; base += kVerifyThreads)
        for (int j = 0; j < kVerifyThreads; ++j)
          sum[j] += exp_nonpositive(static_cast<float>(logits[base + j]) / temperature - max_x);
      for (int j = 0; base + j < split_end; ++j)
        sum[j] += exp_nonpositive(static_cast<float>(logits[base + j]) / temperature - max_x);
      for (int j = 0; j < kVerifyThreads; ++j) partial[j] += sum[j];
    }
    r.softmax = SoftmaxStats{max_x, combine_partials(partial)};
  }
  return r;
}

// Step 3: the sampling weights of one row into w[] (vectorizable).
template <bool kResidual>
QSPEC_INLINE void row_weights_impl(const float* __restrict__ x, const float* __restrict__ q, int64_t vocab,
                                   SoftmaxStats stats, float* __restrict__ w) {
  for (int64_t v = 0; v < vocab; ++v) w[v] = sample_weight(kResidual, stats, x[v], kResidual ? q[v] : 0.f);
}

#define QSPEC_VERIFY_CLONES(T)                                                                               \
  QSPEC_CPU_CLONES VerifyRowStats row_stats(const T* logits, int64_t vocab, float temperature) { \
    return row_stats_impl(logits, vocab, temperature);                                              \
  }
QSPEC_VERIFY_CLONES(float)
QSPEC_VERIFY_CLONES(c10::Half)
QSPEC_VERIFY_CLONES(c10::BFloat16)
#undef QSPEC_VERIFY_CLONES

QSPEC_CPU_CLONES void row_weights(const float* x, const float* q, int64_t vocab, bool residual, SoftmaxStats stats,
                                  float* w) {
  residual ? row_weights_impl<true>(x, q, vocab, stats, w) : row_weights_impl<false>(x, q, vocab, stats, w);
}

// Chunk sums (in double, each chunk's weights added in id order, as one CUDA thread adds
// them) and the last positive id of each chunk. Eight chunks advance together: the same
// sums, without one long chain of dependent adds.
void chunk_sums(const std::vector<float>& w, double* sums, int64_t* last_positive) {
  constexpr int kLanes = 8;
  static_assert(kVerifyThreads % kLanes == 0);
  const int64_t vocab = static_cast<int64_t>(w.size()), size = draw_chunk_size(vocab);
  for (int c = 0; c < kVerifyThreads; c += kLanes) {
    double sum[kLanes] = {};
    int64_t last[kLanes];
    for (int j = 0; j < kLanes; ++j) last[j] = -1;
    for (int64_t i = 0; i < size; ++i)
      for (int j = 0; j < kLanes; ++j) {
        const int64_t v = (c + j) * size + i;
        const float x = v < vocab ? w[v] : 0.f;
        sum[j] += x;
        last[j] = x > 0.f ? v : last[j];
      }
    for (int j = 0; j < kLanes; ++j) {
      sums[c + j] = sum[j];
      last_positive[c + j] = last[j];
    }
  }
}

// The one draw of a row: inverse CDF at u * total over the chunk sums, then within the
// chosen chunk 32 ids at a time (the CUDA kernel's structure).
int64_t draw(const std::vector<float>& w, const double* sums, const int64_t* last_positive, double u) {
  const int64_t vocab = static_cast<int64_t>(w.size()), size = draw_chunk_size(vocab);
  const double target = u * chunk_total(sums);
  DrawChoice choice = choose_chunk(sums, target);
  if (choice.chunk < 0) return *std::max_element(last_positive, last_positive + kVerifyThreads);  // rounding
  const int64_t begin = choice.chunk * size, end = std::min(vocab, begin + size);
  for (int64_t group = begin; group < end; group += 32) {
    float lanes[32];
    for (int i = 0; i < 32; ++i) lanes[i] = group + i < end ? w[group + i] : 0.f;
    const int hit = walk_group(lanes, choice.before, target);
    if (hit >= 0) return group + hit;
  }
  return last_positive[choice.chunk];  // rounding let the walk pass the chunk
}

// One thread's buffers for draws.
struct DrawScratch {
  std::vector<float> x, q, w;
  double sums[kVerifyThreads];
  int64_t last_positive[kVerifyThreads];
};

// One draw at uniform u from a row whose logits / temperature have softmax statistics
// `stats`: from p, or with q given from normalize(max(0, p - q)), falling back to p where
// p <= q everywhere.
template <typename T>
int64_t sample_row(const T* logits, int64_t vocab, float temperature, SoftmaxStats stats, const float* q, double u,
                   DrawScratch& s) {
  s.x.resize(vocab);
  s.w.resize(vocab);
  for (int64_t v = 0; v < vocab; ++v) s.x[v] = static_cast<float>(logits[v]) / temperature;
  const bool residual = q != nullptr;
  row_weights(s.x.data(), q, vocab, residual, stats, s.w.data());
  chunk_sums(s.w, s.sums, s.last_positive);
  if (residual && !(chunk_total(s.sums) > 0.0)) {
    row_weights(s.x.data(), nullptr, vocab, false, stats, s.w.data());
    chunk_sums(s.w, s.sums, s.last_positive);
  }
  return draw(s.w, s.sums, s.last_positive, u);
}

template <typename T>
void verify_cpu_impl(const VerifyParams<T>& p) {
  const int rows_per_request = p.num_draft_max + 1;
  const int64_t V = p.vocab;
  // Step 1.
  torch::stable::parallel_for(0, p.batch * rows_per_request, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / rows_per_request;
      const int i = static_cast<int>(r % rows_per_request);
      const int n = num_draft_of(p, b);
      if (i > n) continue;
      const float temperature = temperature_of(p, b);
      const T* logits = p.logits + b * p.logits_stride_b + i * p.logits_stride_i;
      VerifyRowStats stats = row_stats(logits, V, temperature);
      if (i < n && temperature > 0.f) {
        const int64_t x = p.draft_ids[b * p.draft_stride + i * p.draft_col_stride];
        stats.draft_logit = static_cast<float>(logits[x]) / temperature;
        stats.draft_q = draft_q(p, b, i, x);
      }
      p.rows[r] = stats;
    }
  });
  // Steps 2 and 3.
  torch::stable::parallel_for(0, p.batch, 1, [&](int64_t begin, int64_t end) {
    DrawScratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      const int n = num_draft_of(p, b);
      const float temperature = temperature_of(p, b);
      const VerifyRowStats* rows = p.rows + b * rows_per_request;
      const int64_t* drafts = p.draft_ids + b * p.draft_stride;
      const int64_t seed = p.seed != nullptr ? p.seed[b] : 0, offset = p.offset != nullptr ? p.offset[b] : 0;
      VerifyDecision decision = decide_request(rows, drafts, p.draft_col_stride, n, temperature, seed, offset);
      const int j = decision.accepted;
      int64_t token = rows[j].argmax.index;
      if (decision.emit != VerifyEmit::kArgmax) {
        const T* logits = p.logits + b * p.logits_stride_b + j * p.logits_stride_i;
        const float* q_row = nullptr;
        if (decision.emit == VerifyEmit::kResidual) {
          std::vector<float>& q = scratch.q;
          q.assign(V, 0.f);
          if (p.draft_probs == nullptr) {
            q[drafts[j * p.draft_col_stride]] = 1.f;
          } else if (p.d2t == nullptr) {
            for (int64_t v = 0; v < V; ++v) q[v] = draft_prob_at(p, b, j, v);
          } else {
            for (int64_t d = 0; d < p.draft_vocab; ++d) q[d2t_target(p.d2t, p.d2t_i64, d)] = draft_prob_at(p, b, j, d);
          }
          q_row = q.data();
        }
        token = sample_row(logits, V, temperature, rows[j].softmax, q_row,
                           uniform_01(random_bits(seed, offset + j, kSampleUse)), scratch);
      }
      int64_t* out = p.out_ids + b * rows_per_request;
      for (int i = 0; i < rows_per_request; ++i) out[i] = i < j ? drafts[i * p.draft_col_stride] : (i == j ? token : -1);
      p.num_accepted[b] = j;
    }
  });
}

void check_temperatures(std::string_view op, const std::optional<Tensor>& temperature, int64_t batch) {
  if (!temperature.has_value()) return;
  const float* t = const_data<float>(*temperature);
  for (int64_t b = 0; b < batch; ++b)
    QSPEC_CHECK(t[b] >= 0.f && t[b] < INFINITY, op, "temperature", "must hold finite values >= 0 (0 = greedy), got ",
                t[b], " at index ", b);
}

// Value checks done before any work; CUDA checks the same in its kernels.
void check_verify_values(std::string_view op, const Tensor& draft_ids, const VerifyShape& s,
                         const std::optional<Tensor>& num_draft, const std::optional<Tensor>& temperature,
                         const std::optional<Tensor>& d2t) {
  if (num_draft.has_value())
    check_index_range(op, "num_draft", *num_draft, 0, s.num_draft_max + 1, "drafts per request, at most K");
  const int64_t* ids = const_data<int64_t>(draft_ids);
  const int64_t row_stride = draft_ids.stride(0), col_stride = draft_ids.stride(1);
  const std::optional<Indices> drafts = num_draft.has_value() ? std::optional<Indices>(*num_draft) : std::nullopt;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t n = drafts.has_value() ? (*drafts)[b] : s.num_draft_max;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t x = ids[b * row_stride + i * col_stride];
      QSPEC_CHECK(x >= 0 && x < s.vocab, op, "draft_ids", "must hold target-vocab ids in [0, ", s.vocab, "), got ",
                  x, " at [", b, ", ", i, "]");
    }
  }
  check_temperatures(op, temperature, s.batch);
  if (d2t.has_value()) {
    const Indices offsets(*d2t);
    int64_t previous = -1;
    for (int64_t d = 0; d < s.draft_vocab; ++d) {
      const int64_t target = d + offsets[d];
      QSPEC_CHECK(target >= 0 && target < s.vocab, op, "d2t", "must map every draft id into [0, ", s.vocab,
                  "), got draft id ", d, " -> ", target);
      QSPEC_CHECK(target > previous, op, "d2t",
                  "must map draft ids to strictly increasing target ids (a sorted draft vocabulary, as EAGLE-3 "
                  "and speculators build it), got draft id ", d - 1, " -> ", previous, " and ", d, " -> ", target);
      previous = target;
    }
  }
}


// The walk of walk_tree per request, in parallel over requests; only the rows on the path
// are read (the CUDA kernels compute every node's token first: the same tokens).
template <typename T>
void verify_tree_cpu_impl(const TreeVerifyParams<T>& p) {
  const int N = p.num_nodes;
  torch::stable::parallel_for(0, p.batch, 1, [&](int64_t begin, int64_t end) {
    DrawScratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      const float temperature = p.temperature == nullptr ? 0.f : p.temperature[b];
      const int64_t seed = p.seed != nullptr ? p.seed[b] : 0, offset = p.offset != nullptr ? p.offset[b] : 0;
      const auto parent = [&](int i) {
        const int64_t at = b * N + i;
        return p.parents_i64 ? static_cast<const int64_t*>(p.parents)[at]
                             : static_cast<int64_t>(static_cast<const int32_t*>(p.parents)[at]);
      };
      const auto draft = [&](int i) { return p.draft_ids[b * p.draft_stride + i * p.draft_col_stride]; };
      const auto token = [&](int node, int depth) -> int64_t {
        const T* logits = p.logits + b * p.logits_stride_b + node * p.logits_stride_i;
        const VerifyRowStats stats = row_stats(logits, p.vocab, temperature);
        if (temperature == 0.f || !row_has_distribution(stats)) return stats.argmax.index;
        return sample_row(logits, p.vocab, temperature, stats.softmax, nullptr,
                          uniform_01(random_bits(seed, offset + depth, kSampleUse)), scratch);
      };
      p.num_accepted[b] = walk_tree(N, parent, draft, token, p.out_ids + b * (N + 1), p.path + b * (N + 1));
    }
  });
}

// parents topological (node i + 1's parent in [0, i], or -1), no used node under an unused
// one, draft ids of used nodes in the vocab, temperatures finite and >= 0: before any work.
void check_tree_values(std::string_view op, const Tensor& draft_ids, const Tensor& parents,
                       const TreeVerifyShape& s, const std::optional<Tensor>& temperature) {
  const int64_t N = s.num_nodes;
  const int64_t* ids = const_data<int64_t>(draft_ids);
  const int64_t row_stride = draft_ids.stride(0), col_stride = draft_ids.stride(1);
  const Indices parent_of(parents);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t i = 0; i < N; ++i) {
      const int64_t parent = parent_of[b * N + i];
      QSPEC_CHECK(parent >= -1 && parent <= i, op, "parents",
                  "must hold the parent of node i + 1 in [0, i] (nodes in topological order) or -1 (unused), got ",
                  parent, " at [", b, ", ", i, "]");
      if (parent == -1) continue;
      QSPEC_CHECK(parent == 0 || parent_of[b * N + parent - 1] != -1, op, "parents",
                  "must not hang a node under an unused one: node ", i + 1, " has parent ", parent,
                  ", which is unused, at [", b, ", ", i, "]");
      const int64_t x = ids[b * row_stride + i * col_stride];
      QSPEC_CHECK(x >= 0 && x < s.vocab, op, "draft_ids", "must hold target-vocab ids in [0, ", s.vocab,
                  ") at used nodes, got ", x, " at [", b, ", ", i, "]");
    }
  check_temperatures(op, temperature, s.batch);
}
}  // namespace

void verify_cpu(std::string_view op, const Tensor& draft_ids, const std::optional<Tensor>& draft_probs,
                const Tensor& target_logits, const std::optional<Tensor>& temperature,
                const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                const std::optional<Tensor>& d2t, const std::optional<Tensor>& num_draft,
                const VerifyShape& s, Tensor& out_ids, Tensor& num_accepted) {
  QSPEC_CHECK(target_logits.device().is_cpu(), op, "target_logits", "must be a CPU tensor for the CPU kernel, got ",
              target_logits.device());
  check_verify_values(op, draft_ids, s, num_draft, temperature, d2t);
  if (s.batch == 0) return;
  Tensor rows = verify_rows_workspace(s, target_logits);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(target_logits), "verify_cpu", [&] {
    const VerifyParams<scalar_t> p = verify_params<scalar_t>(draft_ids, draft_probs, target_logits, temperature, seed,
                                                             offset, d2t, num_draft, s, rows, out_ids, num_accepted);
    verify_cpu_impl(p);
  });
}

void verify_tree_cpu(std::string_view op, const Tensor& draft_ids, const Tensor& parents,
                     const Tensor& target_logits, const std::optional<Tensor>& temperature,
                     const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                     const TreeVerifyShape& s, Tensor& out_ids, Tensor& num_accepted, Tensor& path) {
  QSPEC_CHECK(target_logits.device().is_cpu(), op, "target_logits", "must be a CPU tensor for the CPU kernel, got ",
              target_logits.device());
  check_tree_values(op, draft_ids, parents, s, temperature);
  if (s.batch == 0) return;
  Tensor no_workspace;
  QSPEC_DISPATCH_ACTIVATION(dtype_of(target_logits), "verify_tree_cpu", [&] {
    verify_tree_cpu_impl(tree_verify_params<scalar_t>(draft_ids, parents, target_logits, temperature, seed, offset, s,
                                                      no_workspace, out_ids, num_accepted, path));
  });
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) {
  m.impl("verify_greedy", TORCH_BOX((&verify_greedy_entry<verify_cpu>)));
  m.impl("verify_greedy_out", TORCH_BOX((&verify_greedy_out_entry<verify_cpu>)));
  m.impl("verify_sampling", TORCH_BOX((&verify_sampling_entry<verify_cpu>)));
  m.impl("verify_sampling_out", TORCH_BOX((&verify_sampling_out_entry<verify_cpu>)));
  m.impl("verify_tree_greedy", TORCH_BOX((&verify_tree_greedy_entry<verify_tree_cpu>)));
  m.impl("verify_tree_greedy_out", TORCH_BOX((&verify_tree_greedy_out_entry<verify_tree_cpu>)));
  m.impl("verify_tree_sampling", TORCH_BOX((&verify_tree_sampling_entry<verify_tree_cpu>)));
  m.impl("verify_tree_sampling_out", TORCH_BOX((&verify_tree_sampling_out_entry<verify_tree_cpu>)));
}

}  // namespace qspec_ext
