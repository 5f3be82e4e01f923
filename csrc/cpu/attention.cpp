// CPU kernel of cached decode attention. Work items are (request, key split): an item reads its
// slice of the request's used key slots once, in blocks of kKeyBlock slots (each slot whole: all
// KV heads, one contiguous row), for all the request's queries (the T tokens x the query heads),
// with an online softmax in fp32, asking for the next block's slots while it computes one.
// (Register tiles of two queries sharing each key and value they load measured slower in the 8-lane
// row kernel, benchmarks/HISTORY.md; with AVX-512 FMAs, three per tile measured 1.4x faster.)
// Where keys were split, a second pass merges the splits' partial (max, sum, accumulator) states
// into the output; unsplit, each item writes its own. An item's keys are attended by one of three
// kernels: for fp32 and bf16 calls with enough queries per KV head on a CPU with AVX-512 (bf16:
// AVX512-BF16), attend_keys_lanes (16 queries in the lanes of a register: FMAs, vdpbf16ps); for
// fewer queries (a decode step's) on AVX-512 with head_dim a multiple of 16,
// attend_keys_grouped (three queries at a time share each key and value vector loaded: FMAs);
// elsewhere attend_keys (any dtype and CPU: each query row on its own, 8-lane vectors).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>


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

// Asks the memory for the key and value slots (all KV heads) of the block after the one at
// `block`, of an item ending at `end`, so that they arrive while this block is computed: once the
// caches outgrow the L3 (every layer's, between one step's calls) a request's slots come from
// DRAM, and the hardware prefetcher stops at each 4 KB page. Into L2 (prefetcht1), one block
// ahead: measured faster than into L1, or four blocks ahead.
template <typename T>
QSPEC_INLINE void prefetch_next_block(const T* k_cache, const T* v_cache, int64_t first_slot, int64_t slot_stride,
                                      int64_t block, int64_t end) {
  const int64_t from = block + kKeyBlock, to = std::min(end, from + kKeyBlock);
  if (from >= to) return;
  const char* k = reinterpret_cast<const char*>(k_cache + (first_slot + from) * slot_stride);
  const char* v = reinterpret_cast<const char*>(v_cache + (first_slot + from) * slot_stride);
  const int64_t bytes = (to - from) * slot_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t at = 0; at < bytes; at += 64) {
    __builtin_prefetch(k + at, 0, 2);
    __builtin_prefetch(v + at, 0, 2);
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

// Request b's queries in fp32, scaled, in state-row order (row (h * T + t) * G + g: query head
// h * G + g of token t), and each token's key range into ranges.
template <typename T>
QSPEC_INLINE std::vector<float> scaled_queries(const AttentionParams<T>& p, int64_t b, std::vector<KeyRange>& ranges) {
  const int64_t D = p.head_dim, G = p.heads_q / p.heads_kv;
  std::vector<float> q(p.heads_q * p.tokens * D);
  for (int64_t t = 0; t < p.tokens; ++t) {
    ranges[t] = key_range(p, b, t);
    for (int64_t head = 0; head < p.heads_q; ++head) {
      const T* src = p.query + b * p.q_stride_b + t * p.q_stride_t + head * p.q_stride_h;
      float* dst = q.data() + ((head / G * p.tokens + t) * G + head % G) * D;
      load_float(src, dst, D);
      for (int64_t d = 0; d < D; ++d) dst[d] *= p.scale;
    }
  }
  return q;
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
  const std::vector<float> q = scaled_queries(p, b, ranges);
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
    prefetch_next_block(p.k_cache, p.v_cache, first_slot, slot_stride, block, end);
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

#if QSPEC_BF16_DOT
// Query-lane tiles (AVX-512): a KV head's queries (state rows h * queries + i) are taken 16 at a
// time, one per lane of a 512-bit register, so that every step is a vertical operation on 16
// queries: the scores of a key are 16 lanes of dot products over head_dim (the key's elements
// broadcast, the queries transposed once per item), the online softmax runs per lane (no
// horizontal sums), the values are weighted the same way. Used when a head has enough queries to
// fill the lanes (a verify step's T x G, a prefill); a decode step's few queries take the kernel
// above. fp32 with FMAs; bf16 on AVX512-BF16 with vdpbf16ps on element pairs: the softmax
// numerators of two keys as a bf16 pair per lane, the two keys' values interleaved into pairs
// (FlashAttention's bf16 P; the running sum stays in fp32).
constexpr int64_t kLanes = 16;
// Fewest queries per KV head for the lane kernels: below, the other kernel measured faster (fp32:
// 3 and 6 queries slower, 9 faster; bf16: 3 slower, 12 faster).
constexpr int64_t kMinLaneQueries = 8;

QSPEC_TARGET_AVX512 QSPEC_INLINE __m512 exp16(__m512 x) {
  // vec_exp's steps on 16 lanes: 0 below -87 (and for -inf), saturating at 88.3.
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 poly = _mm512_set1_ps(1.9875691500e-4f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.3981999507e-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.3334519073e-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1665795894e-2f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666665459e-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 er = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(poly, r), r, r), _mm512_set1_ps(1.f));
  const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), er, _mm512_castsi512_ps(two_n));
}

// One item's query-lane tiles: each lane's keys in [begin, end) (the same for every head; a lane
// past the queries sees none), each tile's union of them, and per (KV head, tile) unit the online-
// softmax state: max m and sum l per lane, accumulator acc[unit][d][lane].
struct LaneTiles {
  int64_t tiles, units, D;
  std::vector<int32_t> lo, hi, token;
  std::vector<KeyRange> keys;
  std::vector<float> m, l, acc;

  template <typename T>
  LaneTiles(const AttentionParams<T>& p, int64_t b, int64_t begin, int64_t end)
      : tiles((p.tokens * (p.heads_q / p.heads_kv) + kLanes - 1) / kLanes), units(p.heads_kv * tiles), D(p.head_dim),
        lo(tiles * kLanes, 0), hi(tiles * kLanes, 0), token(tiles * kLanes, 0), keys(tiles, KeyRange{end, begin}),
        m(units * kLanes, kNegInf), l(units * kLanes, 0.f), acc(units * D * kLanes, 0.f) {
    const int64_t G = p.heads_q / p.heads_kv;
    for (int64_t i = 0; i < p.tokens * G; ++i) {
      const int64_t t = i / G;
      const KeyRange r = key_range(p, b, t);
      const int64_t first = std::max(r.lo, begin), last = std::min(r.hi, end);
      token[i] = static_cast<int32_t>(t);
      if (last <= first) continue;
      lo[i] = static_cast<int32_t>(first), hi[i] = static_cast<int32_t>(last);
      KeyRange& u = keys[i / kLanes];
      u = {std::min(u.lo, first), std::max(u.hi, last)};
    }
  }
  bool active(int64_t tile, int64_t block, int64_t n) const { return keys[tile].hi > block && keys[tile].lo < block + n; }

  // The lanes' states into the state rows.
  void store(int64_t heads_kv, int64_t queries, float* state) const {
    for (int64_t h = 0; h < heads_kv; ++h)
      for (int64_t i = 0; i < queries; ++i) {
        float* row = state + (h * queries + i) * (D + 2);
        const int64_t unit = h * tiles + i / kLanes, lane = i % kLanes;
        row[0] = m[unit * kLanes + lane];
        row[1] = l[unit * kLanes + lane];
        for (int64_t d = 0; d < D; ++d) row[2 + d] = acc[(unit * D + d) * kLanes + lane];
      }
  }
};

// sees[tile][j]: the lanes that see key block + j (of the block's n); seen_by_any[j]: whether any
// lane of any tile does.
template <typename T>
QSPEC_TARGET_AVX512 QSPEC_INLINE void block_sees(const AttentionParams<T>& p, int64_t b, const LaneTiles& lanes,
                                                 int64_t block, int64_t n, __mmask16* sees, bool* seen_by_any) {
  const bool tree = p.tree_start != nullptr;
  const int64_t scratch_begin = tree ? p.tree_start[b] : p.max_length;
  std::fill_n(seen_by_any, kKeyBlock, false);
  for (int64_t tile = 0; tile < lanes.tiles; ++tile) {
    if (!lanes.active(tile, block, n)) continue;
    const __m512i lo = _mm512_loadu_si512(lanes.lo.data() + tile * kLanes);
    const __m512i hi = _mm512_loadu_si512(lanes.hi.data() + tile * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t key = block + j;
      const __m512i k = _mm512_set1_epi32(static_cast<int>(key));
      __mmask16 bits = _mm512_cmple_epi32_mask(lo, k) & _mm512_cmplt_epi32_mask(k, hi);
      if (tree && key >= scratch_begin)
        for (int64_t lane = 0; lane < kLanes; ++lane)
          if ((bits >> lane) & 1 && !key_seen(p, b, lanes.token[tile * kLanes + lane], key))
            bits &= static_cast<__mmask16>(~(1u << lane));
      sees[tile * kKeyBlock + j] = bits;
      seen_by_any[j] |= bits != 0;
    }
  }
}

// One unit's online softmax over a block's n scores (16 lanes each, unscaled): unseen keys'
// scores -inf, the block max, the running max and sum moved, the accumulator rescaled; scores[j]
// becomes key j's softmax numerators (0 in lanes that do not see it).
QSPEC_TARGET_AVX512 QSPEC_INLINE void softmax_lanes(__m512* __restrict__ scores, int64_t n,
                                                    const __mmask16* __restrict__ sees, float scale, int64_t D,
                                                    float* __restrict__ m, float* __restrict__ l,
                                                    float* __restrict__ acc) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __m512 top = neg_inf;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = _mm512_mask_mul_ps(neg_inf, sees[j], scores[j], _mm512_set1_ps(scale));
    top = _mm512_max_ps(top, scores[j]);
  }
  const __m512 old_max = _mm512_loadu_ps(m), new_max = _mm512_max_ps(old_max, top);
  const __mmask16 live = _mm512_cmp_ps_mask(new_max, neg_inf, _CMP_NEQ_OQ);  // lanes that saw a key
  const __m512 correction = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.f), exp16(_mm512_sub_ps(old_max, new_max)));
  const __mmask16 moved = _mm512_cmp_ps_mask(correction, _mm512_set1_ps(1.f), _CMP_NEQ_OQ);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = _mm512_maskz_mov_ps(sees[j], exp16(_mm512_sub_ps(scores[j], new_max)));
    sum = _mm512_add_ps(sum, scores[j]);
  }
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), correction, sum));
  _mm512_storeu_ps(m, new_max);
  if (moved)
    for (int64_t d = 0; d < D; ++d)
      _mm512_storeu_ps(acc + d * kLanes, _mm512_mul_ps(_mm512_loadu_ps(acc + d * kLanes), correction));
}

// fp32: scores[j] (16 lanes) = the lanes' queries . key j, for the block's keys [j0, j0 + R); key
// rows past n - 1 read key n - 1 (masked later). qt: the tile's queries, [D][16].
template <int R>
QSPEC_TARGET_AVX512 QSPEC_INLINE void score_lanes(const float* __restrict__ qt, const float* __restrict__ keys,
                                                  int64_t stride, int64_t j0, int64_t n, int64_t D,
                                                  __m512* __restrict__ scores) {
  const float* rows[R];
  for (int k = 0; k < R; ++k) rows[k] = keys + std::min<int64_t>(j0 + k, n - 1) * stride;
  __m512 acc[R];
  for (int k = 0; k < R; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 q = _mm512_loadu_ps(qt + d * kLanes);
    for (int k = 0; k < R; ++k) acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(rows[k][d]), q, acc[k]);
  }
  for (int k = 0; k < R; ++k) scores[j0 + k] = acc[k];
}

// fp32: acc[d] (16 lanes, d in [d0, d0 + C)) += sum over the block's keys seen by some lane of the
// lanes' weights x the key's value (a key no lane sees is skipped: its slot may hold NaN).
template <int C>
QSPEC_TARGET_AVX512 QSPEC_INLINE void weigh_values(const __m512* __restrict__ weights, const float* __restrict__ values,
                                                   int64_t stride, int64_t n, const bool* __restrict__ seen_by_any,
                                                   int64_t d0, float* __restrict__ acc) {
  __m512 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + (d0 + c) * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    if (!seen_by_any[j]) continue;
    const float* v = values + j * stride + d0;
    for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(weights[j], _mm512_set1_ps(v[c]), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (d0 + c) * kLanes, a[c]);
}

// attend_keys for fp32 with query-lane tiles: keys [begin, end) of request b, the same state rows.
// Key blocks outer, KV heads inner, as attend_keys: a block's slots are read whole (all heads).
QSPEC_TARGET_AVX512 void attend_keys_lanes(const AttentionParams<float>& p, int64_t b, int64_t begin, int64_t end,
                                           float* state) {
  const int64_t D = p.head_dim, G = p.heads_q / p.heads_kv, queries = p.tokens * G;
  const int64_t slot_stride = p.heads_kv * D;
  reset_states(state, p.heads_q * p.tokens, D + 2);
  if (begin >= end) return;
  LaneTiles lanes(p, b, begin, end);
  const int64_t tiles = lanes.tiles;
  std::vector<float> qt(lanes.units * D * kLanes, 0.f);  // per unit, [D][lane]; lanes past the queries 0
  for (int64_t h = 0; h < p.heads_kv; ++h)
    for (int64_t i = 0; i < queries; ++i) {
      const float* q = p.query + b * p.q_stride_b + i / G * p.q_stride_t + (h * G + i % G) * p.q_stride_h;
      float* dst = qt.data() + (h * tiles + i / kLanes) * D * kLanes + i % kLanes;
      for (int64_t d = 0; d < D; ++d) dst[d * kLanes] = q[d];
    }
  std::vector<__mmask16> sees(tiles * kKeyBlock);
  bool seen_by_any[kKeyBlock];
  __m512 scores[kKeyBlock];
  const int64_t first_slot = b * p.max_length;
  for (int64_t block = begin; block < end; block += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - block);
    prefetch_next_block(p.k_cache, p.v_cache, first_slot, slot_stride, block, end);
    block_sees(p, b, lanes, block, n, sees.data(), seen_by_any);
    for (int64_t h = 0; h < p.heads_kv; ++h) {
      const float* keys = p.k_cache + (first_slot + block) * slot_stride + h * D;
      const float* values = p.v_cache + (first_slot + block) * slot_stride + h * D;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        if (!lanes.active(tile, block, n)) continue;
        const int64_t unit = h * tiles + tile;
        const float* unit_qt = qt.data() + unit * D * kLanes;
        int64_t j0 = 0;
        for (; j0 + 8 <= n; j0 += 8) score_lanes<8>(unit_qt, keys, slot_stride, j0, n, D, scores);
        for (; j0 < n; j0 += 4) score_lanes<4>(unit_qt, keys, slot_stride, j0, n, D, scores);
        float* unit_acc = lanes.acc.data() + unit * D * kLanes;
        softmax_lanes(scores, n, sees.data() + tile * kKeyBlock, p.scale, D, lanes.m.data() + unit * kLanes,
                      lanes.l.data() + unit * kLanes, unit_acc);
        int64_t d0 = 0;
        for (; d0 + 16 <= D; d0 += 16) weigh_values<16>(scores, values, slot_stride, n, seen_by_any, d0, unit_acc);
        for (; d0 + 4 <= D; d0 += 4) weigh_values<4>(scores, values, slot_stride, n, seen_by_any, d0, unit_acc);
        for (; d0 < D; ++d0) weigh_values<1>(scores, values, slot_stride, n, seen_by_any, d0, unit_acc);
      }
    }
  }
  lanes.store(p.heads_kv, queries, state);
}

QSPEC_TARGET_BF16_DOT QSPEC_INLINE __m512bh broadcast_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
}

// bf16: scores[j] (16 lanes) = the lanes' queries . key j, for the block's keys [j0, j0 + R); key
// rows past n - 1 read key n - 1 (masked later). qt: the tile's query pairs, [pairs][16].
template <int R>
QSPEC_TARGET_BF16_DOT QSPEC_INLINE void score_lanes(const uint32_t* __restrict__ qt, const uint16_t* __restrict__ keys,
                                                    int64_t stride, int64_t j0, int64_t n, int64_t pairs,
                                                    __m512* __restrict__ scores) {
  const uint16_t* rows[R];
  for (int k = 0; k < R; ++k) rows[k] = keys + std::min<int64_t>(j0 + k, n - 1) * stride;
  __m512 acc[R];
  for (int k = 0; k < R; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t pp = 0; pp < pairs; ++pp) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(qt + pp * kLanes);
    for (int k = 0; k < R; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], broadcast_pair(rows[k] + 2 * pp), q);
  }
  for (int k = 0; k < R; ++k) scores[j0 + k] = acc[k];
}

// bf16: acc[d] (16 lanes, d in [d0, d0 + C)) += sum over key pairs of the lanes' weight pairs .
// the pairs' interleaved values: [key pairs][D] 4-byte pairs.
template <int C>
QSPEC_TARGET_BF16_DOT QSPEC_INLINE void weigh_values(const uint32_t* __restrict__ weight_pairs,
                                                     const uint16_t* __restrict__ value_pairs, int64_t key_pairs,
                                                     int64_t D, int64_t d0, float* __restrict__ acc) {
  __m512 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + (d0 + c) * kLanes);
  for (int64_t jp = 0; jp < key_pairs; ++jp) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(weight_pairs + jp * kLanes);
    const uint16_t* v = value_pairs + (jp * D + d0) * 2;
    for (int c = 0; c < C; ++c) a[c] = _mm512_dpbf16_ps(a[c], broadcast_pair(v + 2 * c), w);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (d0 + c) * kLanes, a[c]);
}

// The values of keys 2jp and 2jp + 1 interleaved into pairs, [key pairs][D][2]; a key no query
// sees (or past n) is zeros (its slot may hold anything, and 0 * NaN is NaN).
QSPEC_TARGET_BF16_DOT QSPEC_INLINE void pair_values(const uint16_t* __restrict__ values, int64_t stride, int64_t n,
                                                    int64_t D, const bool* __restrict__ seen_by_any,
                                                    uint16_t* __restrict__ out) {
  // Lanes 2i and 2i + 1 of the result: element i of the first operand and of the second.
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                           8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t j = 0; j < n; j += 2) {
    const uint16_t* even = seen_by_any[j] ? values + j * stride : nullptr;
    const uint16_t* odd = j + 1 < n && seen_by_any[j + 1] ? values + (j + 1) * stride : nullptr;
    uint16_t* dst = out + j * D;  // pair j / 2: D pairs of 2
    for (int64_t d = 0; d < D; d += 16) {  // 16 dims of each key, 32 values out
      const int64_t left = std::min<int64_t>(16, D - d);
      const __mmask32 in = (__mmask32{1} << left) - 1, out_lanes = left == 16 ? ~__mmask32{0} : (__mmask32{1} << 2 * left) - 1;
      const __m512i a = even ? _mm512_maskz_loadu_epi16(in, even + d) : _mm512_setzero_si512();
      const __m512i b = odd ? _mm512_maskz_loadu_epi16(in, odd + d) : _mm512_setzero_si512();
      _mm512_mask_storeu_epi16(dst + 2 * d, out_lanes, _mm512_permutex2var_epi16(a, interleave, b));
    }
  }
}

// attend_keys for bf16 with query-lane tiles (AVX512-BF16): as the fp32 one, with element pairs.
QSPEC_TARGET_BF16_DOT void attend_keys_lanes(const AttentionParams<c10::BFloat16>& p, int64_t b, int64_t begin,
                                             int64_t end, float* state) {
  const int64_t D = p.head_dim, G = p.heads_q / p.heads_kv, queries = p.tokens * G;
  const int64_t pairs = D / 2, slot_stride = p.heads_kv * D;
  reset_states(state, p.heads_q * p.tokens, D + 2);
  if (begin >= end) return;
  LaneTiles lanes(p, b, begin, end);
  const int64_t tiles = lanes.tiles;
  const auto* k_cache = reinterpret_cast<const uint16_t*>(p.k_cache);
  const auto* v_cache = reinterpret_cast<const uint16_t*>(p.v_cache);
  const auto* query = reinterpret_cast<const uint16_t*>(p.query);
  std::vector<uint32_t> qt(lanes.units * pairs * kLanes, 0u);  // per unit, [pair][lane]; lanes past the queries 0
  for (int64_t h = 0; h < p.heads_kv; ++h)
    for (int64_t i = 0; i < queries; ++i) {
      const uint16_t* q = query + b * p.q_stride_b + i / G * p.q_stride_t + (h * G + i % G) * p.q_stride_h;
      uint32_t* dst = qt.data() + (h * tiles + i / kLanes) * pairs * kLanes + i % kLanes;
      for (int64_t pp = 0; pp < pairs; ++pp) std::memcpy(dst + pp * kLanes, q + 2 * pp, 4);
    }
  std::vector<uint16_t> value_pairs(kKeyBlock * D);
  std::vector<uint32_t> weight_pairs(kKeyBlock / 2 * kLanes);
  std::vector<__mmask16> sees(tiles * kKeyBlock);
  bool seen_by_any[kKeyBlock];
  __m512 scores[kKeyBlock];
  const int64_t first_slot = b * p.max_length;
  for (int64_t block = begin; block < end; block += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - block);
    prefetch_next_block(k_cache, v_cache, first_slot, slot_stride, block, end);
    block_sees(p, b, lanes, block, n, sees.data(), seen_by_any);
    const int64_t key_pairs = (n + 1) / 2;
    for (int64_t h = 0; h < p.heads_kv; ++h) {
      pair_values(v_cache + (first_slot + block) * slot_stride + h * D, slot_stride, n, D, seen_by_any,
                  value_pairs.data());
      const uint16_t* keys = k_cache + (first_slot + block) * slot_stride + h * D;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        if (!lanes.active(tile, block, n)) continue;
        const int64_t unit = h * tiles + tile;
        const uint32_t* unit_qt = qt.data() + unit * pairs * kLanes;
        int64_t j0 = 0;
        for (; j0 + 8 <= n; j0 += 8) score_lanes<8>(unit_qt, keys, slot_stride, j0, n, pairs, scores);
        for (; j0 < n; j0 += 4) score_lanes<4>(unit_qt, keys, slot_stride, j0, n, pairs, scores);
        float* unit_acc = lanes.acc.data() + unit * D * kLanes;
        softmax_lanes(scores, n, sees.data() + tile * kKeyBlock, p.scale, D, lanes.m.data() + unit * kLanes,
                      lanes.l.data() + unit * kLanes, unit_acc);
        // The numerators of keys 2jp and 2jp + 1 as one bf16 pair per lane (past n: 0).
        for (int64_t j = 0; j < key_pairs * 2; j += 2) {
          const __m512 odd = j + 1 < n ? scores[j + 1] : _mm512_setzero_ps();
          const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(scores[j]));
          const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
          _mm512_storeu_si512(weight_pairs.data() + j / 2 * kLanes, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        int64_t d0 = 0;
        for (; d0 + 16 <= D; d0 += 16) weigh_values<16>(weight_pairs.data(), value_pairs.data(), key_pairs, D, d0, unit_acc);
        for (; d0 + 4 <= D; d0 += 4) weigh_values<4>(weight_pairs.data(), value_pairs.data(), key_pairs, D, d0, unit_acc);
        for (; d0 < D; d0 += 2) weigh_values<2>(weight_pairs.data(), value_pairs.data(), key_pairs, D, d0, unit_acc);
      }
    }
  }
  lanes.store(p.heads_kv, queries, state);
}

// Decode-step queries (a KV head's few queries, fewer than fill the lanes) on AVX-512 with FMAs, for a
// head_dim that is a multiple of 16: up to three of the head's queries at a time share each key and
// value vector they load (the scores of 8 keys x 3 queries in 24 registers, summed across lanes 8 at a
// time; the values weighed for the three at once), keys in blocks as attend_keys, K/V of any dtype
// widened to fp32 in registers.
constexpr int kGroupQueries = 3;

QSPEC_TARGET_AVX512 QSPEC_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
QSPEC_TARGET_AVX512 QSPEC_INLINE __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
QSPEC_TARGET_AVX512 QSPEC_INLINE __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lanes of x and y summed pairwise in blocks of kBlock lanes: even blocks of the result from x, odd
// ones from y. Three levels over 8 vectors, then the two halves: lane k = the sum of vector k.
template <int kBlock>
struct PairwiseIndex {
  alignas(64) int32_t first[16] = {}, second[16] = {};
  constexpr PairwiseIndex() {
    for (int lane = 0; lane < 16; ++lane) {
      const int block = lane / kBlock;
      first[lane] = (block % 2 ? 16 : 0) + block / 2 * 2 * kBlock + lane % kBlock;
      second[lane] = first[lane] + kBlock;
    }
  }
};
template <int kBlock>
QSPEC_TARGET_AVX512 QSPEC_INLINE __m512 add_blocks(__m512 x, __m512 y) {
  static constexpr PairwiseIndex<kBlock> index;
  return _mm512_add_ps(_mm512_permutex2var_ps(x, _mm512_load_si512(index.first), y),
                       _mm512_permutex2var_ps(x, _mm512_load_si512(index.second), y));
}
QSPEC_TARGET_AVX512 QSPEC_INLINE __m256 lane_sums8(const __m512 (&v)[8]) {
  const __m512 quad0 = add_blocks<2>(add_blocks<1>(v[0], v[1]), add_blocks<1>(v[2], v[3]));
  const __m512 quad1 = add_blocks<2>(add_blocks<1>(v[4], v[5]), add_blocks<1>(v[6], v[7]));
  const __m512 halves = add_blocks<4>(quad0, quad1);
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(halves), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(halves), upper);
}

// scores[qi * kKeyBlock + j0 + k] = query qi . key j0 + k (k < 8) for the NQ queries (rows of q, D
// apart); key rows past n - 1 read key n - 1 (masked later).
template <int NQ, typename T>
QSPEC_TARGET_AVX512 QSPEC_INLINE void score_group8(const float* __restrict__ q, const T* __restrict__ keys,
                                                   int64_t stride, int64_t j0, int64_t n, int64_t D,
                                                   float* __restrict__ scores) {
  const T* rows[8];
  for (int k = 0; k < 8; ++k) rows[k] = keys + std::min<int64_t>(j0 + k, n - 1) * stride;
  __m512 acc[NQ][8];
  for (int qi = 0; qi < NQ; ++qi)
    for (int k = 0; k < 8; ++k) acc[qi][k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 x[NQ];
    for (int qi = 0; qi < NQ; ++qi) x[qi] = _mm512_loadu_ps(q + qi * D + d);
    for (int k = 0; k < 8; ++k) {
      const __m512 key = load16(rows[k] + d);
      for (int qi = 0; qi < NQ; ++qi) acc[qi][k] = _mm512_fmadd_ps(x[qi], key, acc[qi][k]);
    }
  }
  for (int qi = 0; qi < NQ; ++qi) _mm256_storeu_ps(scores + qi * kKeyBlock + j0, lane_sums8(acc[qi]));
}

// acc rows (state rows' accumulators, width apart) [d0, d0 + 16 C) += each query's weights x the
// values of the keys in `keys` (bits of the block).
template <int NQ, int C, typename T>
QSPEC_TARGET_AVX512 QSPEC_INLINE void weigh_group(const float* __restrict__ weights, uint32_t keys,
                                                  const T* __restrict__ values, int64_t stride, int64_t d0,
                                                  float* __restrict__ acc, int64_t width) {
  __m512 a[NQ][C];
  for (int qi = 0; qi < NQ; ++qi)
    for (int c = 0; c < C; ++c) a[qi][c] = _mm512_loadu_ps(acc + qi * width + d0 + 16 * c);
  for (; keys != 0; keys &= keys - 1) {
    const int j = __builtin_ctz(keys);
    const T* v = values + j * stride + d0;
    for (int c = 0; c < C; ++c) {
      const __m512 value = load16(v + 16 * c);
      for (int qi = 0; qi < NQ; ++qi)
        a[qi][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[qi * kKeyBlock + j]), value, a[qi][c]);
    }
  }
  for (int qi = 0; qi < NQ; ++qi)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + qi * width + d0 + 16 * c, a[qi][c]);
}

// NQ queries (scaled rows q, state rows from `state`, width apart) over a block's n keys; sees[qi]: the
// keys query qi sees (bits; none past n).
template <int NQ, typename T>
QSPEC_TARGET_AVX512 QSPEC_INLINE void attend_group(const float* __restrict__ q, const T* __restrict__ keys,
                                                   const T* __restrict__ values, int64_t stride, int64_t n,
                                                   int64_t D, const uint32_t* sees, float* __restrict__ state,
                                                   int64_t width) {
  alignas(64) float scores[NQ * kKeyBlock], weights[NQ * kKeyBlock];
  for (int64_t j0 = 0; j0 < n; j0 += 8) score_group8<NQ>(q, keys, stride, j0, n, D, scores);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  uint32_t weighed = 0;  // keys some query of the group sees
  for (int qi = 0; qi < NQ; ++qi) {
    float* row = state + qi * width;
    const uint32_t seen = sees[qi];
    __m512 lo = _mm512_mask_mov_ps(neg_inf, static_cast<__mmask16>(seen), _mm512_loadu_ps(scores + qi * kKeyBlock));
    __m512 hi = n > 16 ? _mm512_mask_mov_ps(neg_inf, static_cast<__mmask16>(seen >> 16),
                                            _mm512_loadu_ps(scores + qi * kKeyBlock + 16))
                       : neg_inf;
    const float top = seen ? _mm512_reduce_max_ps(_mm512_max_ps(lo, hi)) : kNegInf;
    if (top == kNegInf) {  // sees none of the block: weights 0
      _mm512_storeu_ps(weights + qi * kKeyBlock, _mm512_setzero_ps());
      _mm512_storeu_ps(weights + qi * kKeyBlock + 16, _mm512_setzero_ps());
      continue;
    }
    weighed |= seen;
    const float new_max = std::max(row[0], top);
    const float correction = vec_exp(row[0] - new_max);  // 0 while nothing was seen
    if (correction != 1.f) {
      row[1] *= correction;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(row + 2 + d, _mm512_mul_ps(_mm512_loadu_ps(row + 2 + d), _mm512_set1_ps(correction)));
    }
    const __m512 top16 = _mm512_set1_ps(new_max);
    lo = exp16(_mm512_sub_ps(lo, top16)), hi = exp16(_mm512_sub_ps(hi, top16));  // unseen: 0
    _mm512_storeu_ps(weights + qi * kKeyBlock, lo);
    _mm512_storeu_ps(weights + qi * kKeyBlock + 16, hi);
    row[1] += _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    row[0] = new_max;
  }
  if (weighed == 0) return;
  int64_t d0 = 0;
  for (; d0 + 128 <= D; d0 += 128) weigh_group<NQ, 8>(weights, weighed, values, stride, d0, state + 2, width);
  for (; d0 + 64 <= D; d0 += 64) weigh_group<NQ, 4>(weights, weighed, values, stride, d0, state + 2, width);
  for (; d0 < D; d0 += 16) weigh_group<NQ, 1>(weights, weighed, values, stride, d0, state + 2, width);
}

// attend_keys with attend_group: keys [begin, end) of request b, the same state rows.
template <typename T>
QSPEC_TARGET_AVX512 void attend_keys_grouped(const AttentionParams<T>& p, int64_t b, int64_t begin, int64_t end,
                                             float* state) {
  const int64_t D = p.head_dim, G = p.heads_q / p.heads_kv, queries = p.tokens * G, width = D + 2;
  const int64_t slot_stride = p.heads_kv * D;
  reset_states(state, p.heads_q * p.tokens, width);
  if (begin >= end) return;
  std::vector<KeyRange> ranges(p.tokens);
  const std::vector<float> q = scaled_queries(p, b, ranges);
  const int64_t scratch_begin = p.tree_start != nullptr ? p.tree_start[b] : p.max_length;
  std::vector<uint32_t> sees(queries);
  const int64_t first_slot = b * p.max_length;
  for (int64_t block = begin; block < end; block += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - block);
    prefetch_next_block(p.k_cache, p.v_cache, first_slot, slot_stride, block, end);
    for (int64_t t = 0; t < p.tokens; ++t) {  // the keys of the block token t sees, as bits
      const int64_t from = std::max(ranges[t].lo, block) - block, to = std::min(ranges[t].hi, block + n) - block;
      uint32_t bits = 0;
      if (from < to) bits = static_cast<uint32_t>(((uint64_t{1} << to) - 1) & ~((uint64_t{1} << from) - 1));
      for (uint32_t tree = block + n > scratch_begin ? bits : 0; tree != 0; tree &= tree - 1) {
        const int j = __builtin_ctz(tree);
        if (block + j >= scratch_begin && !key_seen(p, b, t, block + j)) bits &= ~(uint32_t{1} << j);
      }
      for (int64_t g = 0; g < G; ++g) sees[t * G + g] = bits;
    }
    for (int64_t h = 0; h < p.heads_kv; ++h) {
      const T* keys = p.k_cache + (first_slot + block) * slot_stride + h * D;
      const T* values = p.v_cache + (first_slot + block) * slot_stride + h * D;
      for (int64_t i = 0; i < queries; i += kGroupQueries) {
        const int64_t row = h * queries + i;
        const float* group_q = q.data() + row * D;
        float* group_state = state + row * width;
        switch (std::min<int64_t>(kGroupQueries, queries - i)) {
          case 3: attend_group<3>(group_q, keys, values, slot_stride, n, D, sees.data() + i, group_state, width); break;
          case 2: attend_group<2>(group_q, keys, values, slot_stride, n, D, sees.data() + i, group_state, width); break;
          default: attend_group<1>(group_q, keys, values, slot_stride, n, D, sees.data() + i, group_state, width);
        }
      }
    }
  }
}
#endif

// Keys [begin, end) of request b into its item's state rows, by the kernel that suits the call.
template <typename T>
void attend_item(const AttentionParams<T>& p, bool lanes, int64_t b, int64_t begin, int64_t end, float* state) {
#if QSPEC_BF16_DOT
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>)
    if (lanes) return attend_keys_lanes(p, b, begin, end, state);
  if (p.head_dim % 16 == 0 && cpu_avx512()) return attend_keys_grouped(p, b, begin, end, state);
#endif
  attend_keys(p, b, begin, end, state);
}

// Whether a call takes the query-lane tiles: fp32 on AVX-512, bf16 on AVX512-BF16 with an even
// head_dim, and enough queries per KV head to fill the lanes.
template <typename T>
bool use_lanes(const AttentionShape& s) {
#if QSPEC_BF16_DOT
  const int64_t queries = s.tokens * (s.heads_q / s.heads_kv);
  if constexpr (std::is_same_v<T, float>) return cpu_avx512() && queries >= kMinLaneQueries;
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    return cpu_bf16_dot() && s.head_dim % 2 == 0 && queries >= kMinLaneQueries;
#endif
  return false;
}

}  // namespace

void cached_attention_cpu(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                          const Tensor& positions, double scale, int64_t window,
                          const std::optional<Tensor>& tree_start, const std::optional<Tensor>& tree_seen,
                          const AttentionShape& s, Tensor& out) {
  constexpr std::string_view op = "cached_attention";
  check_index_range(op, "positions", positions, -1, s.max_length, "cache positions, -1 = padding");
  if (s.has_tree) check_index_range(op, "tree_start", *tree_start, -1, s.max_length, "cache slots, -1 = inactive");
  QSPEC_DISPATCH_ACTIVATION(dtype_of(query), "cached_attention_cpu", [&] {
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
    const int64_t wanted = (2 * static_cast<int64_t>(torch::stable::get_num_threads()) + s.batch - 1) / s.batch;
    const int64_t splits = std::max<int64_t>(1, std::min(wanted, (longest + kMinKeysPerSplit - 1) / kMinKeysPerSplit));
    const int64_t queries = s.tokens * (s.heads_q / s.heads_kv), width = s.head_dim + 2;
    const int64_t item_states = s.heads_kv * queries * width;
    std::vector<float> states(s.batch * splits * item_states);
    const bool lanes = use_lanes<scalar_t>(s);
    // Items per task: small calls (a short context) stay on one thread, where waking the others
    // would cost more than the work.
    const int64_t item_work = std::max<int64_t>(1, (longest + splits - 1) / splits * s.heads_q * s.tokens * s.head_dim);
    torch::stable::parallel_for(0, s.batch * splits, grain_for(item_work), [&](int64_t first, int64_t last) {
      for (int64_t item = first; item < last; ++item) {
        const int64_t b = item / splits, split = item % splits;
        const KeyRange u = span[b];
        const int64_t chunk = std::max<int64_t>(0, (u.hi - u.lo + splits - 1) / splits);
        const int64_t begin = u.lo + split * chunk, end = std::min(u.hi, begin + chunk);
        attend_item(p, lanes, b, begin, end, states.data() + item * item_states);
        if (splits == 1)  // the item's states are final: no merge pass
          for (int64_t h = 0; h < s.heads_kv; ++h)
            merge_splits(p, b, h, 1, states.data() + item * item_states + h * queries * width, item_states);
      }
    });
    if (splits == 1) return;
    torch::stable::parallel_for(0, s.batch * s.heads_kv, grain_for(splits * queries * s.head_dim), [&](int64_t first, int64_t last) {
      for (int64_t group = first; group < last; ++group) {
        const int64_t b = group / s.heads_kv, h = group % s.heads_kv;
        merge_splits(p, b, h, splits, states.data() + b * splits * item_states + h * queries * width, item_states);
      }
    });
  });
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) {
  m.impl("cached_attention", TORCH_BOX((&cached_attention_entry<DeviceType::CPU, cached_attention_cpu>)));
}

}  // namespace qspec_ext
