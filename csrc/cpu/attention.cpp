// CPU kernel of cached decode attention. Work items are (request, key split): an item reads its
// slice of the request's used key slots once, in blocks of kKeyBlock slots (each slot whole: all
// KV heads, one contiguous row, so the hardware streams it), for all the request's queries (the
// T tokens x the query heads), with an online softmax in fp32. A second pass merges the splits'
// partial (max, sum, accumulator) states into the output.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_entry.h"
#include "cpu_common.h"
#include "ops.h"
#include "qspec_ext/attention.h"

namespace qspec_ext {
namespace {

using namespace cpu;

constexpr int64_t kKeyBlock = 32;
// Fewest keys a split is given: below that a thread costs more than the keys it reads.
constexpr int64_t kMinKeysPerSplit = 128;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for the softmax weights, written with plain float / int operations so that a loop of
// them vectorizes (libm's expf does not): Cody-Waite range reduction x = n ln2 + r and Cephes'
// degree-6 polynomial for e^r, within 2 ulp of expf; x below -87 (e^x under FLT_MIN, and -inf:
// masked keys) gives 0.
QSPEC_INLINE float softmax_exp(float x) {
  const bool underflow = x < -87.f;
  x = std::max(x, -87.f);
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

// op over a block's kKeyBlock values, folded in halves (each fold vectorizes; a serial float
// reduction would not).
template <typename Op>
QSPEC_INLINE float block_fold(const float* __restrict__ w, Op op) {
  static_assert(kKeyBlock == 32);
  float h16[16], h8[8], h4[4];
  for (int l = 0; l < 16; ++l) h16[l] = op(w[l], w[l + 16]);
  for (int l = 0; l < 8; ++l) h8[l] = op(h16[l], h16[l + 8]);
  for (int l = 0; l < 4; ++l) h4[l] = op(h8[l], h8[l + 4]);
  return op(op(h4[0], h4[2]), op(h4[1], h4[3]));
}

typedef int32_t LaneIndex8 __attribute__((vector_size(32)));

// a . b over n: 8-lane partial sums, then their horizontal sum.
QSPEC_INLINE float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  Lanes8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
  float total = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// Lanes of x and y, pairwise: out = x[even] + x[odd] in lanes 2i, y's in 2i + 1 (and the same
// shape one level up): three levels turn 8 vectors of partial sums into one vector of 8 totals,
// 7 adds instead of 8 horizontal sums.
QSPEC_INLINE Lanes8 add_pairs(Lanes8 x, Lanes8 y) {
  return __builtin_shuffle(x, y, LaneIndex8{0, 8, 2, 10, 4, 12, 6, 14}) +
         __builtin_shuffle(x, y, LaneIndex8{1, 9, 3, 11, 5, 13, 7, 15});
}
QSPEC_INLINE Lanes8 add_quads(Lanes8 x, Lanes8 y) {
  return __builtin_shuffle(x, y, LaneIndex8{0, 1, 8, 9, 4, 5, 12, 13}) +
         __builtin_shuffle(x, y, LaneIndex8{2, 3, 10, 11, 6, 7, 14, 15});
}
QSPEC_INLINE Lanes8 add_halves(Lanes8 x, Lanes8 y) {
  return __builtin_shuffle(x, y, LaneIndex8{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(x, y, LaneIndex8{4, 5, 6, 7, 12, 13, 14, 15});
}

// scores[k] = q . keys[k * stride] over D for 8 keys at once.
QSPEC_INLINE void dot8(const float* __restrict__ q, const float* __restrict__ keys, int64_t stride, int64_t D,
                       float* __restrict__ scores) {
  Lanes8 acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    const Lanes8 x = load8(q + i);
    for (int k = 0; k < 8; ++k) acc[k] += x * load8(keys + k * stride + i);
  }
  const Lanes8 totals = add_halves(add_quads(add_pairs(acc[0], acc[1]), add_pairs(acc[2], acc[3])),
                                   add_quads(add_pairs(acc[4], acc[5]), add_pairs(acc[6], acc[7])));
  for (int k = 0; k < 8; ++k) {
    float total = totals[k];
    for (int64_t d = i; d < D; ++d) total += q[d] * keys[k * stride + d];
    scores[k] = total;
  }
}

// acc[D] += sum_j w[j] * values[j * stride + d] over the block's n keys. The accumulator is held
// kValueChunk dims at a time in registers across the keys (read and written once per block).
constexpr int64_t kValueChunk = 64;
QSPEC_INLINE void accumulate_values(const float* __restrict__ w, const float* __restrict__ values, int64_t stride,
                                    int64_t n, int64_t D, float* __restrict__ acc) {
  int64_t d0 = 0;
  for (; d0 + kValueChunk <= D; d0 += kValueChunk) {
    float a[kValueChunk];
    for (int64_t l = 0; l < kValueChunk; ++l) a[l] = acc[d0 + l];
    for (int64_t j = 0; j < n; ++j) {
      const float wj = w[j];
      if (wj == 0.f) continue;  // an unseen key (its value is never read) or one that underflowed
      const float* v = values + j * stride + d0;
      for (int64_t l = 0; l < kValueChunk; ++l) a[l] += wj * v[l];
    }
    for (int64_t l = 0; l < kValueChunk; ++l) acc[d0 + l] = a[l];
  }
  for (int64_t j = 0; j < n; ++j)
    if (w[j] != 0.f)
      for (int64_t d = d0; d < D; ++d) acc[d] += w[j] * values[j * stride + d];
}

// The online-softmax state of one query: running max m, running sum l, accumulator acc[D].
// Stored as [m, l, acc...] rows of width D + 2.
QSPEC_INLINE void reset_states(float* state, int64_t count, int64_t width) {
  for (int64_t i = 0; i < count; ++i) {
    float* row = state + i * width;
    row[0] = kNegInf;
    std::fill_n(row + 1, width - 1, 0.f);
  }
}

// Keys [begin, end) of request b, every KV head, for all the request's queries. State row
// (h * T + t) * G + g belongs to query head h * G + g of token t.
template <typename T>
QSPEC_INLINE void attend_keys_impl(const AttentionParams<T>& p, int64_t b, int64_t begin, int64_t end, float* state) {
  const int64_t D = p.head_dim, G = p.heads_q / p.heads_kv, width = D + 2;
  const int64_t slot_stride = p.heads_kv * D;  // one slot: all KV heads
  reset_states(state, p.heads_q * p.tokens, width);
  if (begin >= end) return;
  std::vector<KeyRange> ranges(p.tokens);
  std::vector<float> q(p.heads_q * p.tokens * D);  // scaled, in state-row order
  for (int64_t t = 0; t < p.tokens; ++t) {
    ranges[t] = key_range(p, b, t);
    for (int64_t head = 0; head < p.heads_q; ++head) {
      const T* src = p.query + b * p.q_stride_b + t * p.q_stride_t + head * p.q_stride_h;
      float* dst = q.data() + ((head / G * p.tokens + t) * G + head % G) * D;
      load_float(src, dst, D);
      for (int64_t d = 0; d < D; ++d) dst[d] *= p.scale;
    }
  }
  constexpr bool kFloat = std::is_same_v<T, float>;
  // fp32 caches are read in place; others are converted a block (K then V) at a time.
  std::vector<float> converted(kFloat ? 0 : 2 * kKeyBlock * slot_stride);
  std::vector<char> active(p.tokens), seen(p.tokens * kKeyBlock);
  float scores[kKeyBlock] = {}, weights[kKeyBlock];  // (scores past a block's n: never computed, masked)
  const int64_t first_slot = b * p.max_length;
  for (int64_t block = begin; block < end; block += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - block);
    const T* k_src = p.k_cache + (first_slot + block) * slot_stride;
    const T* v_src = p.v_cache + (first_slot + block) * slot_stride;
    const float *keys, *values;
    if constexpr (kFloat) {
      keys = k_src, values = v_src;
    } else {
      load_float(k_src, converted.data(), n * slot_stride);
      load_float(v_src, converted.data() + kKeyBlock * slot_stride, n * slot_stride);
      keys = converted.data(), values = converted.data() + kKeyBlock * slot_stride;
    }
    for (int64_t t = 0; t < p.tokens; ++t) {
      const KeyRange range = ranges[t];
      active[t] = range.hi > block && range.lo < block + n;
      for (int64_t j = 0; j < kKeyBlock && active[t]; ++j) {
        const int64_t key = block + j;
        seen[t * kKeyBlock + j] = j < n && key >= range.lo && key < range.hi && key_seen(p, b, t, key);
      }
    }
    for (int64_t h = 0; h < p.heads_kv; ++h) {
      for (int64_t t = 0; t < p.tokens; ++t) {
        if (!active[t]) continue;
        const char* sees = seen.data() + t * kKeyBlock;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = (h * p.tokens + t) * G + g;
          const float* qi = q.data() + i * D;
          float* row = state + i * width;
          float* acc = row + 2;
          // Keys past the block's n slots are never read; an unseen key inside them may be
          // (its slot is in the cache, any value), and its score is replaced.
          int64_t j = 0;
          for (; j + 8 <= n; j += 8) dot8(qi, keys + j * slot_stride + h * D, slot_stride, D, scores + j);
          for (; j < n; ++j) scores[j] = dot(qi, keys + j * slot_stride + h * D, D);
          for (j = 0; j < kKeyBlock; ++j) scores[j] = sees[j] ? scores[j] : kNegInf;
          const float block_max = block_fold(scores, [](float a, float b) { return std::max(a, b); });
          if (block_max == kNegInf) continue;
          const float new_max = std::max(row[0], block_max);
          const float correction = softmax_exp(row[0] - new_max);  // 0 while nothing was seen
          if (correction != 1.f) {
            row[1] *= correction;
            for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
          }
          for (int64_t j = 0; j < kKeyBlock; ++j) weights[j] = softmax_exp(scores[j] - new_max);  // unseen: 0
          row[1] += block_fold(weights, [](float a, float b) { return a + b; });
          accumulate_values(weights, values + h * D, slot_stride, n, D, acc);
          row[0] = new_max;
        }
      }
    }
  }
}

QSPEC_CPU_CLONES void attend_keys(const AttentionParams<float>& p, int64_t b, int64_t begin, int64_t end,
                                  float* state) {
  attend_keys_impl(p, b, begin, end, state);
}
QSPEC_CPU_CLONES void attend_keys(const AttentionParams<c10::Half>& p, int64_t b, int64_t begin, int64_t end,
                                  float* state) {
  attend_keys_impl(p, b, begin, end, state);
}
QSPEC_CPU_CLONES void attend_keys(const AttentionParams<c10::BFloat16>& p, int64_t b, int64_t begin, int64_t end,
                                  float* state) {
  attend_keys_impl(p, b, begin, end, state);
}

// out = the softmax-weighted values of KV head h's queries, merged over the splits' states (split
// s's rows start at states + s * split_stride).
template <typename T>
void merge_splits(const AttentionParams<T>& p, int64_t b, int64_t h, int64_t splits, const float* states,
                  int64_t split_stride) {
  const int64_t D = p.head_dim, G = p.heads_q / p.heads_kv, queries = p.tokens * G, width = D + 2;
  std::vector<float> merged(D);
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t t = i / G, g = i % G;
    float top = kNegInf;
    for (int64_t s = 0; s < splits; ++s) top = std::max(top, states[s * split_stride + i * width]);
    if (top == kNegInf) continue;  // sees no key: the output keeps its zeros
    float total = 0.f;
    std::fill(merged.begin(), merged.end(), 0.f);
    for (int64_t s = 0; s < splits; ++s) {
      const float* row = states + s * split_stride + i * width;
      if (row[0] == kNegInf) continue;
      const float factor = softmax_exp(row[0] - top);
      total += row[1] * factor;
      for (int64_t d = 0; d < D; ++d) merged[d] += row[2 + d] * factor;
    }
    T* out = p.out + ((b * p.tokens + t) * p.heads_q + h * G + g) * D;
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(merged[d] * inv);
  }
}

}  // namespace

void cached_attention_cpu(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& positions, double scale, int64_t window,
                          const std::optional<at::Tensor>& tree_start, const std::optional<at::Tensor>& tree_seen,
                          const AttentionShape& s, at::Tensor& out) {
  constexpr std::string_view op = "cached_attention";
  check_index_range(op, "positions", positions, -1, s.max_length, "cache positions, -1 = padding");
  if (s.has_tree) check_index_range(op, "tree_start", *tree_start, -1, s.max_length, "cache slots, -1 = inactive");
  QSPEC_DISPATCH_ACTIVATION(query.scalar_type(), "cached_attention_cpu", [&] {
    AttentionParams<scalar_t> p{};
    p.query = query.const_data_ptr<scalar_t>();
    p.q_stride_b = query.stride(0), p.q_stride_t = query.stride(1), p.q_stride_h = query.stride(2);
    p.k_cache = k_cache.const_data_ptr<scalar_t>();
    p.v_cache = v_cache.const_data_ptr<scalar_t>();
    p.positions = positions.const_data_ptr();
    p.positions_i64 = positions.scalar_type() == at::kLong;
    p.tree_start = s.has_tree ? tree_start->const_data_ptr<int64_t>() : nullptr;
    p.tree_seen = s.has_tree ? tree_seen->const_data_ptr<bool>() : nullptr;
    p.out = out.mutable_data_ptr<scalar_t>();
    p.batch = s.batch, p.tokens = s.tokens, p.heads_q = s.heads_q, p.heads_kv = s.heads_kv;
    p.head_dim = s.head_dim, p.max_length = s.max_length, p.scratch = s.scratch;
    p.window = window;
    p.scale = static_cast<float>(scale);

    // Each request's used key span: the union of its queries' key ranges.
    std::vector<KeyRange> span(s.batch);
    int64_t longest = 0;
    for (int64_t b = 0; b < s.batch; ++b) {
      KeyRange u{s.max_length, 0};
      for (int64_t t = 0; t < s.tokens; ++t) {
        const KeyRange r = key_range(p, b, t);
        if (r.hi > r.lo) u = {std::min(u.lo, r.lo), std::max(u.hi, r.hi)};
      }
      span[b] = u;
      longest = std::max(longest, u.hi - u.lo);
    }
    // Enough items to keep every thread busy when the batch is small (flash-decoding).
    const int64_t wanted = (2 * at::get_num_threads() + s.batch - 1) / s.batch;
    const int64_t splits = std::max<int64_t>(1, std::min(wanted, (longest + kMinKeysPerSplit - 1) / kMinKeysPerSplit));
    const int64_t queries = s.tokens * (s.heads_q / s.heads_kv), width = s.head_dim + 2;
    const int64_t item_states = s.heads_kv * queries * width;
    std::vector<float> states(s.batch * splits * item_states);
    // Items per task: small calls (a short context) stay on one thread, where waking the others
    // would cost more than the work.
    const int64_t item_work = std::max<int64_t>(1, (longest + splits - 1) / splits * s.heads_q * s.tokens * s.head_dim);
    at::parallel_for(0, s.batch * splits, grain_for(item_work), [&](int64_t first, int64_t last) {
      for (int64_t item = first; item < last; ++item) {
        const int64_t b = item / splits, split = item % splits;
        const KeyRange u = span[b];
        const int64_t chunk = std::max<int64_t>(0, (u.hi - u.lo + splits - 1) / splits);
        const int64_t begin = u.lo + split * chunk, end = std::min(u.hi, begin + chunk);
        attend_keys(p, b, begin, end, states.data() + item * item_states);
      }
    });
    at::parallel_for(0, s.batch * s.heads_kv, grain_for(splits * queries * s.head_dim), [&](int64_t first, int64_t last) {
      for (int64_t group = first; group < last; ++group) {
        const int64_t b = group / s.heads_kv, h = group % s.heads_kv;
        merge_splits(p, b, h, splits, states.data() + b * splits * item_states + h * queries * width, item_states);
      }
    });
  });
}

TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) {
  m.impl("cached_attention", &cached_attention_entry<c10::DeviceType::CPU, cached_attention_cpu>);
}

}  // namespace qspec_ext
