// The verification ops' entry points, written once: argument checks and output
// allocation around a device half (verify_cpu / verify_cuda) that fills the outputs.
#pragma once

#include <optional>
#include <string_view>
#include <tuple>


#include "checks.h"
#include "qspec_ext/verify.h"

namespace qspec_ext {

// The device half: validated inputs in, out_ids [B, K+1] and num_accepted [B] filled.
using VerifyImpl = void (*)(std::string_view op, const Tensor& draft_ids,
                            const std::optional<Tensor>& draft_probs, const Tensor& target_logits,
                            const std::optional<Tensor>& temperature, const std::optional<Tensor>& seed,
                            const std::optional<Tensor>& offset, const std::optional<Tensor>& d2t,
                            const std::optional<Tensor>& num_draft, const VerifyShape& s, Tensor& out_ids,
                            Tensor& num_accepted);

template <VerifyImpl impl>
std::tuple<Tensor, Tensor> verify_greedy_entry(const Tensor& draft_ids, const Tensor& target_logits,
                                                       const std::optional<Tensor>& num_draft) {
  const VerifyShape s = check_verify("verify_greedy", draft_ids, target_logits, num_draft, {}, {}, {}, {}, {});
  Tensor out_ids = empty({s.batch, s.num_draft_max + 1}, draft_ids);
  Tensor num_accepted = empty({s.batch}, draft_ids);
  impl("verify_greedy", draft_ids, {}, target_logits, {}, {}, {}, {}, num_draft, s, out_ids, num_accepted);
  return {out_ids, num_accepted};
}

template <VerifyImpl impl>
void verify_greedy_out_entry(const Tensor& draft_ids, const Tensor& target_logits,
                             const std::optional<Tensor>& num_draft, Tensor& out_ids,
                             Tensor& num_accepted) {
  const VerifyShape s = check_verify("verify_greedy_out", draft_ids, target_logits, num_draft, {}, {}, {}, {}, {});
  check_verify_out("verify_greedy_out", out_ids, num_accepted, s, target_logits);
  impl("verify_greedy_out", draft_ids, {}, target_logits, {}, {}, {}, {}, num_draft, s, out_ids, num_accepted);
}

template <VerifyImpl impl>
std::tuple<Tensor, Tensor> verify_sampling_entry(const Tensor& draft_ids,
                                                         const std::optional<Tensor>& draft_probs,
                                                         const Tensor& target_logits,
                                                         const Tensor& temperature, const Tensor& seed,
                                                         const Tensor& offset,
                                                         const std::optional<Tensor>& d2t,
                                                         const std::optional<Tensor>& num_draft) {
  const VerifyShape s = check_verify("verify_sampling", draft_ids, target_logits, num_draft, draft_probs, temperature,
                                     seed, offset, d2t);
  Tensor out_ids = empty({s.batch, s.num_draft_max + 1}, draft_ids);
  Tensor num_accepted = empty({s.batch}, draft_ids);
  impl("verify_sampling", draft_ids, draft_probs, target_logits, temperature, seed, offset, d2t, num_draft, s, out_ids,
       num_accepted);
  return {out_ids, num_accepted};
}

template <VerifyImpl impl>
void verify_sampling_out_entry(const Tensor& draft_ids, const std::optional<Tensor>& draft_probs,
                               const Tensor& target_logits, const Tensor& temperature, const Tensor& seed,
                               const Tensor& offset, const std::optional<Tensor>& d2t,
                               const std::optional<Tensor>& num_draft, Tensor& out_ids,
                               Tensor& num_accepted) {
  const VerifyShape s = check_verify("verify_sampling_out", draft_ids, target_logits, num_draft, draft_probs,
                                     temperature, seed, offset, d2t);
  check_verify_out("verify_sampling_out", out_ids, num_accepted, s, target_logits);
  impl("verify_sampling_out", draft_ids, draft_probs, target_logits, temperature, seed, offset, d2t, num_draft, s,
       out_ids, num_accepted);
}

// ---- tree verification ----

// The device half: validated shapes in, out_ids [B, N+1], num_accepted [B] and path [B, N+1]
// filled. The values (parents, draft ids, temperatures) are checked by the device half.
using TreeVerifyImpl = void (*)(std::string_view op, const Tensor& draft_ids, const Tensor& parents,
                                const Tensor& target_logits, const std::optional<Tensor>& temperature,
                                const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                                const TreeVerifyShape& s, Tensor& out_ids, Tensor& num_accepted,
                                Tensor& path);

inline std::tuple<Tensor, Tensor, Tensor> tree_outputs(const TreeVerifyShape& s, const Tensor& ids) {
  return {empty({s.batch, s.num_nodes + 1}, ids), empty({s.batch}, ids),
          empty({s.batch, s.num_nodes + 1}, ids)};
}

template <TreeVerifyImpl impl>
std::tuple<Tensor, Tensor, Tensor> verify_tree_greedy_entry(const Tensor& draft_ids,
                                                                        const Tensor& parents,
                                                                        const Tensor& target_logits) {
  const TreeVerifyShape s = check_verify_tree("verify_tree_greedy", draft_ids, parents, target_logits, {}, {}, {});
  auto [out_ids, num_accepted, path] = tree_outputs(s, draft_ids);
  impl("verify_tree_greedy", draft_ids, parents, target_logits, {}, {}, {}, s, out_ids, num_accepted, path);
  return {out_ids, num_accepted, path};
}

template <TreeVerifyImpl impl>
void verify_tree_greedy_out_entry(const Tensor& draft_ids, const Tensor& parents,
                                  const Tensor& target_logits, Tensor& out_ids, Tensor& num_accepted,
                                  Tensor& path) {
  const TreeVerifyShape s = check_verify_tree("verify_tree_greedy_out", draft_ids, parents, target_logits, {}, {}, {});
  check_verify_tree_out("verify_tree_greedy_out", out_ids, num_accepted, path, s, target_logits);
  impl("verify_tree_greedy_out", draft_ids, parents, target_logits, {}, {}, {}, s, out_ids, num_accepted, path);
}

template <TreeVerifyImpl impl>
std::tuple<Tensor, Tensor, Tensor> verify_tree_sampling_entry(
    const Tensor& draft_ids, const Tensor& parents, const Tensor& target_logits,
    const Tensor& temperature, const Tensor& seed, const Tensor& offset) {
  const TreeVerifyShape s =
      check_verify_tree("verify_tree_sampling", draft_ids, parents, target_logits, temperature, seed, offset);
  auto [out_ids, num_accepted, path] = tree_outputs(s, draft_ids);
  impl("verify_tree_sampling", draft_ids, parents, target_logits, temperature, seed, offset, s, out_ids,
       num_accepted, path);
  return {out_ids, num_accepted, path};
}

template <TreeVerifyImpl impl>
void verify_tree_sampling_out_entry(const Tensor& draft_ids, const Tensor& parents,
                                    const Tensor& target_logits, const Tensor& temperature,
                                    const Tensor& seed, const Tensor& offset, Tensor& out_ids,
                                    Tensor& num_accepted, Tensor& path) {
  const TreeVerifyShape s =
      check_verify_tree("verify_tree_sampling_out", draft_ids, parents, target_logits, temperature, seed, offset);
  check_verify_tree_out("verify_tree_sampling_out", out_ids, num_accepted, path, s, target_logits);
  impl("verify_tree_sampling_out", draft_ids, parents, target_logits, temperature, seed, offset, s, out_ids,
       num_accepted, path);
}

// Raw pointers for the tree kernels; tokens is a [B, N+1] int64 workspace or undefined (CPU).
template <typename T>
TreeVerifyParams<T> tree_verify_params(const Tensor& draft_ids, const Tensor& parents,
                                       const Tensor& target_logits, const std::optional<Tensor>& temperature,
                                       const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                                       const TreeVerifyShape& s, Tensor& tokens, Tensor& out_ids,
                                       Tensor& num_accepted, Tensor& path) {
  TreeVerifyParams<T> p{};
  p.draft_ids = const_data<int64_t>(draft_ids);
  p.draft_stride = draft_ids.stride(0);
  p.draft_col_stride = draft_ids.stride(1);
  p.parents = parents.const_data_ptr();
  p.parents_i64 = dtype_of(parents) == kLong;
  p.logits = const_data<T>(target_logits);
  p.logits_stride_b = target_logits.stride(0);
  p.logits_stride_i = target_logits.stride(1);
  p.temperature = temperature.has_value() ? const_data<float>(*temperature) : nullptr;
  p.seed = seed.has_value() ? const_data<int64_t>(*seed) : nullptr;
  p.offset = offset.has_value() ? const_data<int64_t>(*offset) : nullptr;
  p.tokens = tokens.defined() ? mutable_data<int64_t>(tokens) : nullptr;
  p.out_ids = mutable_data<int64_t>(out_ids);
  p.num_accepted = mutable_data<int64_t>(num_accepted);
  p.path = mutable_data<int64_t>(path);
  p.batch = s.batch;
  p.num_nodes = s.num_nodes;
  p.vocab = s.vocab;
  return p;
}

// Raw pointers for the kernels; rows is a workspace the caller owns.
template <typename T>
VerifyParams<T> verify_params(const Tensor& draft_ids, const std::optional<Tensor>& draft_probs,
                              const Tensor& target_logits, const std::optional<Tensor>& temperature,
                              const std::optional<Tensor>& seed, const std::optional<Tensor>& offset,
                              const std::optional<Tensor>& d2t, const std::optional<Tensor>& num_draft,
                              const VerifyShape& s, Tensor& rows, Tensor& out_ids,
                              Tensor& num_accepted) {
  VerifyParams<T> p{};
  p.draft_ids = const_data<int64_t>(draft_ids);
  p.draft_stride = draft_ids.stride(0);
  p.draft_col_stride = draft_ids.stride(1);
  p.logits = const_data<T>(target_logits);
  p.logits_stride_b = target_logits.stride(0);
  p.logits_stride_i = target_logits.stride(1);
  if (s.has_probs) {
    p.draft_probs = draft_probs->const_data_ptr();
    p.probs_f32 = dtype_of(*draft_probs) == kFloat;
    p.probs_stride_b = draft_probs->stride(0);
    p.probs_stride_i = draft_probs->stride(1);
  }
  if (s.has_d2t) {
    p.d2t = d2t->const_data_ptr();
    p.d2t_i64 = dtype_of(*d2t) == kLong;
  }
  if (s.has_num_draft) {
    p.num_draft = num_draft->const_data_ptr();
    p.num_draft_i64 = dtype_of(*num_draft) == kLong;
  }
  p.temperature = temperature.has_value() ? const_data<float>(*temperature) : nullptr;
  p.seed = seed.has_value() ? const_data<int64_t>(*seed) : nullptr;
  p.offset = offset.has_value() ? const_data<int64_t>(*offset) : nullptr;
  p.rows = reinterpret_cast<VerifyRowStats*>(rows.mutable_data_ptr());
  p.out_ids = mutable_data<int64_t>(out_ids);
  p.num_accepted = mutable_data<int64_t>(num_accepted);
  p.batch = s.batch;
  p.num_draft_max = s.num_draft_max;
  p.vocab = s.vocab;
  p.draft_vocab = s.draft_vocab;
  return p;
}

// Workspace for the per-row statistics of one call.
inline Tensor verify_rows_workspace(const VerifyShape& s, const Tensor& like) {
  return empty({s.batch * (s.num_draft_max + 1) * static_cast<int64_t>(sizeof(VerifyRowStats))}, like, kByte);
}

}  // namespace qspec_ext
