// The cached_attention op's entry point, written once: the device check, argument checks and
// output allocation around a device half (cached_attention_cpu / _cuda in ops.h).
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "checks.h"
#include "norm_rope_entry.h"  // check_kernel_device

namespace qspec_ext {

// out [B, T, Hq, D] contiguous, uninitialized: the kernels write every element (zeros for padding
// queries and queries that see no key).
using CachedAttentionImpl = void (*)(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& positions, double scale, int64_t window,
                                     const std::optional<at::Tensor>& tree_start,
                                     const std::optional<at::Tensor>& tree_seen, const AttentionShape& s,
                                     at::Tensor& out);

template <c10::DeviceType device, CachedAttentionImpl impl>
at::Tensor cached_attention_entry(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& positions, double scale, int64_t window,
                                  const std::optional<at::Tensor>& tree_start,
                                  const std::optional<at::Tensor>& tree_seen) {
  check_kernel_device<device>("cached_attention", "query", query);
  const AttentionShape s = check_cached_attention(query, k_cache, v_cache, positions, window, tree_start, tree_seen);
  const auto options = query.options().memory_format(at::MemoryFormat::Contiguous);
  if (query.numel() == 0 || s.max_length == 0) return at::zeros(query.sizes(), options);  // no key to see
  at::Tensor out = at::empty(query.sizes(), options);
  // The small index tensors may come strided (expanded positions): the kernels read them flat.
  std::optional<at::Tensor> start, seen;
  if (s.has_tree) start = tree_start->contiguous(), seen = tree_seen->contiguous();
  impl(query, k_cache, v_cache, positions.contiguous(), scale, window, start, seen, s, out);
  return out;
}

}  // namespace qspec_ext
