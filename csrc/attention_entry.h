// The cached_attention op's entry point, written once: the device check, argument checks and
// output allocation around a device half (cached_attention_cpu / _cuda in ops.h).
#pragma once

#include <optional>


#include "checks.h"
#include "norm_rope_entry.h"  // check_kernel_device

namespace qspec_ext {

// out [B, T, Hq, D] contiguous, uninitialized: the kernels write every element (zeros for padding
// queries and queries that see no key).
using CachedAttentionImpl = void (*)(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                                     const Tensor& positions, double scale, int64_t window,
                                     const std::optional<Tensor>& tree_start,
                                     const std::optional<Tensor>& tree_seen, const AttentionShape& s,
                                     Tensor& out);

template <DeviceType device, CachedAttentionImpl impl>
Tensor cached_attention_entry(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                                  const Tensor& positions, double scale, int64_t window,
                                  const std::optional<Tensor>& tree_start,
                                  const std::optional<Tensor>& tree_seen) {
  check_kernel_device<device>("cached_attention", "query", query);
  const AttentionShape s = check_cached_attention(query, k_cache, v_cache, positions, window, tree_start, tree_seen);
  if (query.numel() == 0 || s.max_length == 0) return zeros(query.sizes().vec(), query);  // no key to see
  Tensor out = empty(query.sizes().vec(), query);
  // The small index tensors may come strided (expanded positions): the kernels read them flat.
  std::optional<Tensor> start, seen;
  if (s.has_tree) start = as_contiguous(*tree_start), seen = as_contiguous(*tree_seen);
  impl(query, k_cache, v_cache, as_contiguous(positions), scale, window, start, seen, s, out);
  return out;
}

}  // namespace qspec_ext
