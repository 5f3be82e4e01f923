// Shared math of draft verification: the counter-based random numbers, the per-row
// softmax statistics and the accept / sample rules. CPU and CUDA kernels use exactly
// these functions, so they draw the same random numbers and make the same decisions.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "qspec_ext/norm_rope.h"  // QSPEC_HOST_DEVICE

namespace qspec_ext {

// Most draft tokens one verification accepts per request.
constexpr int kMaxDraftTokens = 32;

// ---- math with the same bits on host and device ----
// Explicit fused multiply-adds (no compiler contraction choices) and a polynomial exp, so
// the CPU kernels vectorize and compute what the CUDA kernels compute.

QSPEC_HOST_DEVICE float fma_f(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

QSPEC_HOST_DEVICE float float_from_bits(int32_t bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// exp(x) for x <= 0 (0 below -87 and for -inf), within 2 ulp: Cephes' expf polynomial
// after reduction by ln 2.
QSPEC_HOST_DEVICE float exp_nonpositive(float x) {
  const float t = x < -87.f ? -87.f : x;
  const float n = fma_f(t, 1.44269504088896341f, 12582912.f) - 12582912.f;  // round(t / ln 2)
  float r = fma_f(n, -0.693359375f, t);
  r = fma_f(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fma_f(p, r, 1.3981999507e-3f);
  p = fma_f(p, r, 8.3334519073e-3f);
  p = fma_f(p, r, 4.1665795894e-2f);
  p = fma_f(p, r, 1.6666665459e-1f);
  p = fma_f(p, r, 5.0000001201e-1f);
  p = fma_f(p, r * r, r + 1.f);
  const float scale = float_from_bits((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.f ? 0.f : mul_rn(p, scale);  // not fused into a caller's sum
}

QSPEC_HOST_DEVICE bool is_finite(float x) { return x == x && x - x == 0.f; }

// ---- Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3") ----

struct Philox4 {
  uint32_t v[4];
};

QSPEC_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(product >> 32);
  lo = static_cast<uint32_t>(product);
}

QSPEC_HOST_DEVICE Philox4 philox4x32_10(Philox4 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kMul0, counter.v[0], hi0, lo0);
    philox_mulhilo(kMul1, counter.v[2], hi1, lo1);
    counter = Philox4{{hi1 ^ counter.v[1] ^ key0, lo1, hi0 ^ counter.v[3] ^ key1, lo0}};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// The random stream is keyed only by (seed, position, use): position is offset + row (the
// absolute token position when the caller passes it as offset); use tells the acceptance
// uniform from the sampling uniform. Replays reproduce; grouping into steps does not matter.
constexpr uint32_t kAcceptUse = 0;
constexpr uint32_t kSampleUse = 1;

QSPEC_HOST_DEVICE uint64_t random_bits(int64_t seed, int64_t position, uint32_t use) {
  const uint64_t s = static_cast<uint64_t>(seed), p = static_cast<uint64_t>(position);
  const Philox4 out = philox4x32_10(
      Philox4{{use, static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32), 0x5eed0001u}},
      static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  return (static_cast<uint64_t>(out.v[0]) << 32) | out.v[1];
}

// Uniform in [0, 1) with 53 random bits (exactly 0 is possible; see accept_draft).
QSPEC_HOST_DEVICE double uniform_01(uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

// ---- per-row statistics ----

// The running argmax with torch.argmax semantics: the first NaN wins, else the largest
// value, ties to the lowest index.
struct ArgMax {
  float value;
  int64_t index;
};

QSPEC_HOST_DEVICE bool argmax_prefers(float value, int64_t index, const ArgMax& current) {
  const bool nan = value != value, current_nan = current.value != current.value;
  if (nan || current_nan) return nan && (!current_nan || index < current.index);
  return value > current.value || (value == current.value && index < current.index);
}

QSPEC_HOST_DEVICE void argmax_update(ArgMax& current, float value, int64_t index) {
  if (argmax_prefers(value, index, current)) current = ArgMax{value, index};
}

// Softmax statistics of logits / temperature: the max and sum of exp(x - max).
struct SoftmaxStats {
  float max;
  float sum;
};

// ---- the summation structure, shared by CPU and CUDA ----
// Both kernels add the same values in the same order, so the row statistics, the accept
// decisions and the draws are bit-identical on CPU and CUDA (the per-element math above is
// shared and every rounding step is explicit).
//  - softmax sum of a row: the vocab is cut into splits of kVerifySplitIds ids (fixed, so the
//    order never depends on the device or on how many blocks a kernel gives a row). Partial j
//    (CUDA: thread j of a 256-thread block) adds, split by split, the terms of v = j, j + 256,
//    j + 512, ... inside the split in order, starting each split from 0, and adds each split's
//    sum to its running total in split order (split_partial_sum: a split kernel computes the
//    per-split sums in parallel and adds them in the same order). The 256 partials are
//    combined by warps of 32 in the order of an xor butterfly (offsets 16, 8, 4, 2, 1), then
//    the 8 warp sums in order (combine_partials is that order written out for the CPU).
//  - a draw over a row: the vocab is split into 256 chunks of draw_chunk_size(V) ids;
//    chunk c's weights are summed in order in double; choose_chunk walks the chunk sums
//    in order; the chosen chunk is scanned 32 ids at a time with an inclusive
//    Hillis-Steele scan in double (walk_group is that scan written out for the CPU).
constexpr int kVerifyThreads = 256;
constexpr int kVerifyWarps = kVerifyThreads / 32;
// 32 terms per partial per split: short enough that V = 151936 gives 19 splits per row (a
// split kernel can fill a GPU at B = 1), long enough that the extra adds cost nothing.
constexpr int64_t kVerifySplitIds = kVerifyThreads * 32;

QSPEC_HOST_DEVICE int64_t verify_num_splits(int64_t vocab) { return (vocab + kVerifySplitIds - 1) / kVerifySplitIds; }

// Partial `lane` of a row's softmax sum over ids [begin, end) (begin a multiple of
// kVerifySplitIds): term(v) for v = begin + lane, begin + lane + 256, ..., folded split by split.
template <typename Term>
QSPEC_HOST_DEVICE float split_partial_sum(int64_t begin, int64_t end, int lane, Term term) {
  float total = 0.f;
  for (int64_t split = begin; split < end; split += kVerifySplitIds) {
    const int64_t split_end = split + kVerifySplitIds < end ? split + kVerifySplitIds : end;
    float sum = 0.f;
    for (int64_t v = split + lane; v < split_end; v += kVerifyThreads) sum = add_rn(sum, term(v));
    total = add_rn(total, sum);
  }
  return total;
}

// partial[0..255] -> the sum in the CUDA kernel's order (see above).
inline float combine_partials(const float* partial) {
  float total = 0.f;
  for (int w = 0; w < kVerifyWarps; ++w) {
    float lane[32];
    for (int i = 0; i < 32; ++i) lane[i] = partial[w * 32 + i];
    for (int offset = 16; offset > 0; offset /= 2) {
      float next[32];
      for (int i = 0; i < 32; ++i) next[i] = lane[i] + lane[i ^ offset];
      for (int i = 0; i < 32; ++i) lane[i] = next[i];
    }
    total = w == 0 ? lane[0] : total + lane[0];
  }
  return total;
}

QSPEC_HOST_DEVICE int64_t draw_chunk_size(int64_t vocab) { return (vocab + kVerifyThreads - 1) / kVerifyThreads; }

struct DrawChoice {
  int chunk;      // the chunk holding the target, or -1 if rounding left it past the end
  double before;  // sum of the chunks before it
};

QSPEC_HOST_DEVICE DrawChoice choose_chunk(const double* chunk_sums, double target) {
  double running = 0.0;
  for (int c = 0; c < kVerifyThreads; ++c) {
    if (chunk_sums[c] > 0.0 && running + chunk_sums[c] > target) return {c, running};
    running += chunk_sums[c];
  }
  return {-1, running};
}

QSPEC_HOST_DEVICE double chunk_total(const double* chunk_sums) {
  double total = 0.0;
  for (int c = 0; c < kVerifyThreads; ++c) total += chunk_sums[c];
  return total;
}

// One group of 32 weights w[0..31] of the chosen chunk (0 past its end): the index of the
// first positive weight whose inclusive prefix (added to before) passes target, or -1;
// before grows by the group's sum. The CUDA kernel does the same with warp shuffles.
inline int walk_group(const float* w, double& before, double target) {
  double inclusive[32];
  for (int i = 0; i < 32; ++i) inclusive[i] = w[i];
  for (int offset = 1; offset < 32; offset *= 2)
    for (int i = 31; i >= offset; --i) inclusive[i] = inclusive[i] + inclusive[i - offset];
  for (int i = 0; i < 32; ++i)
    if (w[i] > 0.f && before + inclusive[i] > target) return i;
  before += inclusive[31];
  return -1;
}

// The target id of draft id d: d + d2t[d] (d2t holds int32 or int64 offsets).
QSPEC_HOST_DEVICE int64_t d2t_target(const void* d2t, bool d2t_i64, int64_t d) {
  return d + (d2t_i64 ? static_cast<const int64_t*>(d2t)[d] : static_cast<int64_t>(static_cast<const int32_t*>(d2t)[d]));
}

// The first draft id whose target id is >= target_id (draft_vocab if none). d2t maps draft
// ids to strictly increasing target ids (the ops check it), so this is a binary search.
QSPEC_HOST_DEVICE int64_t d2t_lower_bound(const void* d2t, bool d2t_i64, int64_t draft_vocab, int64_t target_id) {
  int64_t lo = 0, hi = draft_vocab;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (d2t_target(d2t, d2t_i64, mid) < target_id) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The draft id d with d + d2t[d] == target_id, or -1 (outside the draft vocabulary).
QSPEC_HOST_DEVICE int64_t draft_index_of(const void* d2t, bool d2t_i64, int64_t draft_vocab, int64_t target_id) {
  const int64_t d = d2t_lower_bound(d2t, d2t_i64, draft_vocab, target_id);
  return d < draft_vocab && d2t_target(d2t, d2t_i64, d) == target_id ? d : -1;
}

// A row gives a distribution only if it has a finite maximum (no NaN, not all -inf).
QSPEC_HOST_DEVICE bool softmax_valid(const SoftmaxStats& s) {
  return is_finite(s.max) && is_finite(s.sum) && s.sum > 0.f;
}

// p(v) from the scaled logit x = logit / temperature.
QSPEC_HOST_DEVICE float softmax_prob(const SoftmaxStats& s, float x) { return exp_nonpositive(x - s.max) / s.sum; }

// Accept a draft with probability min(1, p / q); never when p or q is 0 (a uniform of
// exactly 0 included).
QSPEC_HOST_DEVICE bool accept_draft(float p, float q, double u) {
  return p > 0.f && q > 0.f && u * static_cast<double>(q) < static_cast<double>(p);
}

// The weight of target id v in the one sampling draw of a row (unnormalized): p for the
// bonus token, max(0, p - q) after a rejection. x is logit / temperature.
QSPEC_HOST_DEVICE float sample_weight(bool residual, const SoftmaxStats& s, float x, float q) {
  const float unnormalized = exp_nonpositive(x - s.max);
  if (!residual) return unnormalized;
  const float w = unnormalized / s.sum - q;
  return w > 0.f ? w : 0.f;
}

}  // namespace qspec_ext

namespace qspec_ext {

// What pass 1 learns about one target row (b, i).
struct VerifyRowStats {
  ArgMax argmax;         // over the raw logits
  SoftmaxStats softmax;  // of logits / temperature (sampling rows only)
  float draft_logit;     // logits[draft_ids[i]] / temperature (i < num_draft)
  float draft_q;         // q(draft_ids[i]): 1 for argmax drafts, 0 if outside the draft vocabulary
};

enum class VerifyEmit : int {
  kArgmax = 0,    // greedy row, or a degenerate row (NaN / all -inf): torch.argmax of the logits
  kTarget = 1,    // all drafts accepted at temperature > 0: sample the bonus token from p
  kResidual = 2,  // rejection at temperature > 0: sample from normalize(max(0, p - q))
};

struct VerifyDecision {
  int accepted;  // drafts kept; the emitted token goes to row `accepted`
  VerifyEmit emit;
};

QSPEC_HOST_DEVICE bool row_has_distribution(const VerifyRowStats& r) {
  return r.argmax.value == r.argmax.value && softmax_valid(r.softmax);
}

// Walks the drafts of one request in order; the same rule on every device.
QSPEC_HOST_DEVICE VerifyDecision decide_request(const VerifyRowStats* rows, const int64_t* draft_ids,
                                                int64_t draft_col_stride, int num_draft, float temperature, int64_t seed,
                                                int64_t offset) {
  if (temperature == 0.f) {
    for (int i = 0; i < num_draft; ++i)
      if (draft_ids[i * draft_col_stride] != rows[i].argmax.index) return {i, VerifyEmit::kArgmax};
    return {num_draft, VerifyEmit::kArgmax};
  }
  for (int i = 0; i < num_draft; ++i) {
    if (!row_has_distribution(rows[i])) return {i, VerifyEmit::kArgmax};
    const float p = softmax_prob(rows[i].softmax, rows[i].draft_logit);
    const double u = uniform_01(random_bits(seed, offset + i, kAcceptUse));
    if (!accept_draft(p, rows[i].draft_q, u)) return {i, VerifyEmit::kResidual};
  }
  return {num_draft, row_has_distribution(rows[num_draft]) ? VerifyEmit::kTarget : VerifyEmit::kArgmax};
}

}  // namespace qspec_ext

namespace qspec_ext {

// Raw pointers and strides of one verification. T is the logits dtype.
template <typename T>
struct VerifyParams {
  const int64_t* draft_ids;  // [B, K] (target-vocab ids), strides (draft_stride, draft_col_stride)
  int64_t draft_stride, draft_col_stride;
  const T* logits;  // [B, K+1, V], strides (logits_stride_b, logits_stride_i, 1)
  int64_t logits_stride_b, logits_stride_i;
  const void* draft_probs;  // [B, K, Vq] fp32 or T, or nullptr (argmax drafts: q one-hot)
  bool probs_f32;
  int64_t probs_stride_b, probs_stride_i;
  const void* d2t;  // [Vq] offsets: draft id d is target id d + d2t[d], increasing; nullptr when Vq == V
  bool d2t_i64;
  const void* num_draft;  // [B] or nullptr (every request has K drafts)
  bool num_draft_i64;
  const float* temperature;  // [B] or nullptr (all greedy); 0 = greedy row
  const int64_t* seed;       // [B]
  const int64_t* offset;     // [B]
  VerifyRowStats* rows;      // workspace [B, K+1]
  int64_t* out_ids;          // [B, K+1]
  int64_t* num_accepted;     // [B]
  int64_t batch;
  int num_draft_max;  // K
  int64_t vocab;      // V
  int64_t draft_vocab;  // Vq
};

}  // namespace qspec_ext

namespace qspec_ext {

// ---- tree verification ----
// A tree per request: node 0 is the root (the last verified token), draft nodes 1..N in
// topological order; parent(i) is the parent of node i + 1, in [0, i], or -1 (an unused node,
// for ragged trees). token(node, depth) is the target's token at a node: the argmax of its
// row, or at temperature > 0 one draw from softmax(row / T) keyed by (seed, offset + depth,
// kSampleUse). Drawing at every node and following the draw is exactly the target's own
// sampling, so the walk is lossless for any tree of deterministic (top-k) drafts.
//
// The walk emits the current node's token and moves to its lowest-index child holding it,
// stopping at a node with none. Children come after their parents, so one pass over the
// nodes in order finds the path. Writes out[0..N] (tokens, then -1) and path[0..N] (nodes,
// then -1); returns the number of accepted drafts.
template <typename Parent, typename Draft, typename Token>
QSPEC_HOST_DEVICE int walk_tree(int num_nodes, Parent parent, Draft draft, Token token, int64_t* out, int64_t* path) {
  int current = 0, accepted = 0;
  int64_t want = token(0, 0);
  out[0] = want;
  path[0] = 0;
  for (int node = 1; node <= num_nodes; ++node) {
    if (parent(node - 1) != current || draft(node - 1) != want) continue;
    current = node;
    ++accepted;
    want = token(node, accepted);
    out[accepted] = want;
    path[accepted] = node;
  }
  for (int i = accepted + 1; i <= num_nodes; ++i) out[i] = path[i] = -1;
  return accepted;
}

// Raw pointers and strides of one tree verification. T is the logits dtype.
template <typename T>
struct TreeVerifyParams {
  const int64_t* draft_ids;  // [B, N], strides (draft_stride, draft_col_stride)
  int64_t draft_stride, draft_col_stride;
  const void* parents;  // [B, N] int32 or int64, contiguous
  bool parents_i64;
  const T* logits;  // [B, N+1, V], strides (logits_stride_b, logits_stride_i, 1)
  int64_t logits_stride_b, logits_stride_i;
  const float* temperature;  // [B] or nullptr (all greedy); 0 = greedy row
  const int64_t* seed;       // [B]
  const int64_t* offset;     // [B]
  int64_t* tokens;           // workspace [B, N+1] (CUDA): the target's token at each node, -1 unused
  int64_t* out_ids;          // [B, N+1]
  int64_t* num_accepted;     // [B]
  int64_t* path;             // [B, N+1]
  int64_t batch;
  int num_nodes;  // N
  int64_t vocab;  // V
};

}  // namespace qspec_ext
