// CPU kernel of cached decode attention. Work items are (request, key split): an item reads its
// slice of the request's used key slots once, in blocks of kKeyBlock slots (each slot whole: all
// KV heads, one contiguous row, so the hardware streams it), for all the request's queries (the
// T tokens x the query heads), with an online softmax in fp32. (Register tiles of two queries
// sharing each key and value they load measured slower: benchmarks/HISTORY.md.) Where keys
// were split, a second pass merges the splits' partial (max, sum, accumulator) states into the
// output; unsplit, each item writes its own.
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

// The max and the sum of a block's kKeyBlock values: four vectors folded into one, then its lanes.
QSPEC_INLINE float block_max(const float* __restrict__ w) {
  static_assert(kKeyBlock == 32);
  const auto max8 = [](Lanes8 a, Lanes8 b) { return a > b ? a : b; };
  const Lanes8 m = max8(max8(load8(w), load8(w + 8)), max8(load8(w + 16), load8(w + 24)));
  const float a = std::max(std::max(m[0], m[4]), std::max(m[1], m[5]));
  return std::max(a, std::max(std::max(m[2], m[6]), std::max(m[3], m[7])));
}
QSPEC_INLINE float block_sum(const float* __restrict__ w) {
  const Lanes8 t = (load8(w) + load8(w + 8)) + (load8(w + 16) + load8(w + 24));
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

typedef int32_t LaneIndex8 __attribute__((vector_size(32)));

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

// scores[k] = q . keys[k * stride] over D for eight keys: 8 partial-sum vectors, summed by lanes.
// Keys [n, 8) (a block's last n < 8 keys) are read from key n - 1, in the block: their scores are
// masked.
QSPEC_INLINE void score_keys8(const float* __restrict__ q, const float* __restrict__ keys, int64_t stride, int64_t n,
                              int64_t D, float* __restrict__ scores) {
  const float* key_rows[8];
  for (int k = 0; k < 8; ++k) key_rows[k] = keys + std::min<int64_t>(k, n - 1) * stride;
  Lanes8 acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) {
    const Lanes8 x = load8(q + i);
    for (int k = 0; k < 8; ++k) acc[k] += x * load8(key_rows[k] + i);
  }
  const Lanes8 totals = add_halves(add_quads(add_pairs(acc[0], acc[1]), add_pairs(acc[2], acc[3])),
                                   add_quads(add_pairs(acc[4], acc[5]), add_pairs(acc[6], acc[7])));
  std::memcpy(scores, &totals, sizeof totals);
  for (; i < D; ++i)  // a head_dim that is not a multiple of 8
    for (int k = 0; k < 8; ++k) scores[k] += q[i] * key_rows[k][i];
}

// acc[d] += sum_j w[j] * values[j * stride + d] over the block's n keys, held in registers 8 x
// kVectors dims at a time (read and written once a block). kSkipUnweighed: a key of weight 0 is
// skipped, its value never read (a slot no query sees may hold anything, NaN included, and
// 0 * NaN is NaN); without it every key's value is read (a block whose every key some query
// sees: written slots).
template <int kVectors, bool kSkipUnweighed>
QSPEC_INLINE void accumulate_chunk(const float* __restrict__ w, const float* __restrict__ values, int64_t stride,
                                   int64_t n, float* __restrict__ acc) {
  Lanes8 a[kVectors];
  for (int c = 0; c < kVectors; ++c) a[c] = load8(acc + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    if (kSkipUnweighed && w[j] == 0.f) continue;
    for (int c = 0; c < kVectors; ++c) a[c] += w[j] * load8(values + j * stride + 8 * c);
  }
  for (int c = 0; c < kVectors; ++c) std::memcpy(acc + 8 * c, &a[c], sizeof a[c]);
}

template <bool kSkipUnweighed>
QSPEC_INLINE void accumulate_values(const float* __restrict__ w, const float* __restrict__ values, int64_t stride,
                                    int64_t n, int64_t D, float* __restrict__ acc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) accumulate_chunk<8, kSkipUnweighed>(w, values + d0, stride, n, acc + d0);
  for (; d0 + 8 <= D; d0 += 8) accumulate_chunk<1, kSkipUnweighed>(w, values + d0, stride, n, acc + d0);
  if (d0 == D) return;
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

// One state row's update by a key block: scores of unseen keys masked, the running max and sum
// moved, the accumulator rescaled; weights = the block's softmax numerators (0 for unseen keys).
// False (the row and weights untouched) when the row sees no key of the block.
QSPEC_INLINE bool online_softmax(float* __restrict__ scores, const char* __restrict__ sees, int64_t D,
                                 float* __restrict__ row, float* __restrict__ weights) {
  for (int64_t j = 0; j < kKeyBlock; ++j) scores[j] = sees[j] ? scores[j] : kNegInf;
  const float top = block_max(scores);
  if (top == kNegInf) return false;
  const float new_max = std::max(row[0], top);
  const float correction = vec_exp(row[0] - new_max);  // 0 while nothing was seen
  if (correction != 1.f) {
    row[1] *= correction;
    for (int64_t d = 0; d < D; ++d) row[2 + d] *= correction;
  }
  for (int64_t j = 0; j < kKeyBlock; ++j) weights[j] = vec_exp(scores[j] - new_max);  // unseen: 0
  row[1] += block_sum(weights);
  row[0] = new_max;
  return true;
}

// One query (its scaled row q, its state row) over one key block of KV head h (keys, values).
// scores, weights: kKeyBlock floats of scratch; scores past the 8-key groups over the block's n
// keys are not computed (they keep old values, masked: no query sees them).
QSPEC_INLINE void attend_block(const float* __restrict__ q, const float* __restrict__ keys,
                               const float* __restrict__ values, int64_t stride, int64_t n, int64_t D,
                               const char* __restrict__ sees, bool every_key_seen, float* __restrict__ row,
                               float* __restrict__ scores, float* __restrict__ weights) {
  for (int64_t j = 0; j < n; j += 8) score_keys8(q, keys + j * stride, stride, n - j, D, scores + j);
  if (!online_softmax(scores, sees, D, row, weights)) return;
  if (every_key_seen)
    accumulate_values<false>(weights, values, stride, n, D, row + 2);
  else
    accumulate_values<true>(weights, values, stride, n, D, row + 2);
}

// Keys [begin, end) of request b, every KV head, for all the request's queries. State row
// (h * T + t) * G + g belongs to query head h * G + g of token t.
template <typename T>
QSPEC_INLINE void attend_keys_impl(const AttentionParams<T>& p, int64_t b, int64_t begin, int64_t end, float* state) {
  const int64_t D = p.head_dim, G = p.heads_q / p.heads_kv, queries = p.tokens * G, width = D + 2;
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
  // fp32 caches are read in place; others are converted a block and a KV head (K then V) at a
  // time: 16 KB at head_dim 64, in L1 while the head's queries read it (all heads at once spilled).
  std::vector<float> converted(kFloat ? 0 : 2 * kKeyBlock * D);
  std::vector<char> active(p.tokens), seen(p.tokens * kKeyBlock);
  float scores[kKeyBlock] = {}, weights[kKeyBlock];
  const int64_t first_slot = b * p.max_length;
  for (int64_t block = begin; block < end; block += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - block);
    const T* k_src = p.k_cache + (first_slot + block) * slot_stride;
    const T* v_src = p.v_cache + (first_slot + block) * slot_stride;
    char seen_by_any[kKeyBlock] = {};
    for (int64_t t = 0; t < p.tokens; ++t) {
      const KeyRange range = ranges[t];
      active[t] = range.hi > block && range.lo < block + n;
      if (!active[t]) continue;  // its row of seen is not read
      for (int64_t j = 0; j < kKeyBlock; ++j) {
        const int64_t key = block + j;
        seen[t * kKeyBlock + j] = j < n && key >= range.lo && key < range.hi && key_seen(p, b, t, key);
        seen_by_any[j] |= seen[t * kKeyBlock + j];
      }
    }
    bool every_key_seen = true;
    for (int64_t j = 0; j < n; ++j) every_key_seen &= seen_by_any[j] != 0;
    for (int64_t h = 0; h < p.heads_kv; ++h) {
      const float *head_keys, *head_values;
      int64_t key_stride;
      if constexpr (kFloat) {
        head_keys = k_src + h * D, head_values = v_src + h * D, key_stride = slot_stride;
      } else {
        float* keys = converted.data();
        float* values = keys + kKeyBlock * D;
        for (int64_t j = 0; j < n; ++j) {
          load_float(k_src + j * slot_stride + h * D, keys + j * D, D);
          load_float(v_src + j * slot_stride + h * D, values + j * D, D);
        }
        head_keys = keys, head_values = values, key_stride = D;
      }
      for (int64_t i = 0; i < queries; ++i) {
        const int64_t t = i / G, row = h * queries + i;
        if (active[t])
          attend_block(q.data() + row * D, head_keys, head_values, key_stride, n, D, seen.data() + t * kKeyBlock,
                       every_key_seen, state + row * width, scores, weights);
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
    T* out = p.out + ((b * p.tokens + t) * p.heads_q + h * G + g) * D;
    float top = kNegInf;
    for (int64_t s = 0; s < splits; ++s) top = std::max(top, states[s * split_stride + i * width]);
    if (top == kNegInf) {  // sees no key (a padding query, or none in its range): zeros
      std::fill_n(out, D, static_cast<T>(0.f));
      continue;
    }
    float total = 0.f;
    std::fill(merged.begin(), merged.end(), 0.f);
    for (int64_t s = 0; s < splits; ++s) {
      const float* row = states + s * split_stride + i * width;
      if (row[0] == kNegInf) continue;
      const float factor = vec_exp(row[0] - top);
      total += row[1] * factor;
      for (int64_t d = 0; d < D; ++d) merged[d] += row[2 + d] * factor;
    }
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
        if (splits == 1)  // the item's states are final: no merge pass
          for (int64_t h = 0; h < s.heads_kv; ++h)
            merge_splits(p, b, h, 1, states.data() + item * item_states + h * queries * width, item_states);
      }
    });
    if (splits == 1) return;
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
