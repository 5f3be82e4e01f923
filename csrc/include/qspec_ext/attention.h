// Shared definitions of cached decode attention: torch-free, used by CPU and CUDA.
#pragma once

#include <cstdint>

#include "qspec_ext/norm_rope.h"  // QSPEC_HOST_DEVICE, kMaxHeadDim

namespace qspec_ext {

// Raw pointers, strides and sizes of one cached_attention call.
template <typename T>
struct AttentionParams {
  const T* query;  // [B, T, Hq, D], element strides q_stride_b / q_stride_t / q_stride_h, last dim contiguous
  int64_t q_stride_b, q_stride_t, q_stride_h;
  const T* k_cache;  // [B * L, Hkv, D] contiguous: request b's slots start at b * L
  const T* v_cache;
  const void* positions;  // [B, T] int32/int64 contiguous; -1 = padding query (output zeros)
  bool positions_i64;
  const int64_t* tree_start;  // [B] or nullptr: first slot of each request's tree scratch region, -1 = inactive
  const bool* tree_seen;      // [B, T, S]: scratch slot start + s is seen by query t
  T* out;                     // [B, T, Hq, D] contiguous
  int64_t batch, tokens, heads_q, heads_kv, head_dim, max_length, scratch;
  int64_t window;  // 0 = none; else key j is seen only when j > position - window
  float scale;
};

// The key slots [lo, hi) (relative to the request's first slot) that can hold a key query
// (b, t) sees: all work is confined to them. hi <= lo: the query sees nothing.
struct KeyRange {
  int64_t lo, hi;
};

QSPEC_HOST_DEVICE int64_t attention_position(const void* positions, bool i64, int64_t i) {
  return i64 ? static_cast<const int64_t*>(positions)[i] : static_cast<int64_t>(static_cast<const int32_t*>(positions)[i]);
}

template <typename T>
QSPEC_HOST_DEVICE KeyRange key_range(const AttentionParams<T>& p, int64_t b, int64_t t) {
  const int64_t position = attention_position(p.positions, p.positions_i64, b * p.tokens + t);
  if (position < 0) return {0, 0};
  int64_t hi = position + 1;
  if (p.tree_start != nullptr) {
    const int64_t start = p.tree_start[b];
    if (start < 0) return {0, 0};
    hi = start + p.scratch;
  }
  if (hi > p.max_length) hi = p.max_length;
  int64_t lo = p.window > 0 ? position - p.window + 1 : 0;
  if (lo < 0) lo = 0;
  return {lo, hi};
}

// Whether query (b, t) sees the key at slot j of its request, given j inside its key_range:
// causal by position, or (tree) the context before the scratch region plus the scratch slots
// its row of tree_seen marks.
template <typename T>
QSPEC_HOST_DEVICE bool key_seen(const AttentionParams<T>& p, int64_t b, int64_t t, int64_t j) {
  if (p.tree_start == nullptr) return true;
  const int64_t s = j - p.tree_start[b];
  return s < 0 || p.tree_seen[(b * p.tokens + t) * p.scratch + s];
}

}  // namespace qspec_ext
