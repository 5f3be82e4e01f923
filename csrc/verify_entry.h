// The verification ops' entry points, written once: argument checks and output
// allocation around a device half (verify_cpu / verify_cuda) that fills the outputs.
#pragma once

#include <optional>
#include <string_view>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "checks.h"
#include "qspec_ext/verify.h"

namespace qspec_ext {

// The device half: validated inputs in, out_ids [B, K+1] and num_accepted [B] filled.
using VerifyImpl = void (*)(std::string_view op, const at::Tensor& draft_ids,
                            const std::optional<at::Tensor>& draft_probs, const at::Tensor& target_logits,
                            const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& seed,
                            const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& d2t,
                            const std::optional<at::Tensor>& num_draft, const VerifyShape& s, at::Tensor& out_ids,
                            at::Tensor& num_accepted);

template <VerifyImpl impl>
std::tuple<at::Tensor, at::Tensor> verify_greedy_entry(const at::Tensor& draft_ids, const at::Tensor& target_logits,
                                                       const std::optional<at::Tensor>& num_draft) {
  const VerifyShape s = check_verify("verify_greedy", draft_ids, target_logits, num_draft, {}, {}, {}, {}, {});
  at::Tensor out_ids = at::empty({s.batch, s.num_draft_max + 1}, draft_ids.options());
  at::Tensor num_accepted = at::empty({s.batch}, draft_ids.options());
  impl("verify_greedy", draft_ids, {}, target_logits, {}, {}, {}, {}, num_draft, s, out_ids, num_accepted);
  return {out_ids, num_accepted};
}

template <VerifyImpl impl>
void verify_greedy_out_entry(const at::Tensor& draft_ids, const at::Tensor& target_logits,
                             const std::optional<at::Tensor>& num_draft, at::Tensor& out_ids,
                             at::Tensor& num_accepted) {
  const VerifyShape s = check_verify("verify_greedy_out", draft_ids, target_logits, num_draft, {}, {}, {}, {}, {});
  check_verify_out("verify_greedy_out", out_ids, num_accepted, s, target_logits);
  impl("verify_greedy_out", draft_ids, {}, target_logits, {}, {}, {}, {}, num_draft, s, out_ids, num_accepted);
}

template <VerifyImpl impl>
std::tuple<at::Tensor, at::Tensor> verify_sampling_entry(const at::Tensor& draft_ids,
                                                         const std::optional<at::Tensor>& draft_probs,
                                                         const at::Tensor& target_logits,
                                                         const at::Tensor& temperature, const at::Tensor& seed,
                                                         const at::Tensor& offset,
                                                         const std::optional<at::Tensor>& d2t,
                                                         const std::optional<at::Tensor>& num_draft) {
  const VerifyShape s = check_verify("verify_sampling", draft_ids, target_logits, num_draft, draft_probs, temperature,
                                     seed, offset, d2t);
  at::Tensor out_ids = at::empty({s.batch, s.num_draft_max + 1}, draft_ids.options());
  at::Tensor num_accepted = at::empty({s.batch}, draft_ids.options());
  impl("verify_sampling", draft_ids, draft_probs, target_logits, temperature, seed, offset, d2t, num_draft, s, out_ids,
       num_accepted);
  return {out_ids, num_accepted};
}

template <VerifyImpl impl>
void verify_sampling_out_entry(const at::Tensor& draft_ids, const std::optional<at::Tensor>& draft_probs,
                               const at::Tensor& target_logits, const at::Tensor& temperature, const at::Tensor& seed,
                               const at::Tensor& offset, const std::optional<at::Tensor>& d2t,
                               const std::optional<at::Tensor>& num_draft, at::Tensor& out_ids,
                               at::Tensor& num_accepted) {
  const VerifyShape s = check_verify("verify_sampling_out", draft_ids, target_logits, num_draft, draft_probs,
                                     temperature, seed, offset, d2t);
  check_verify_out("verify_sampling_out", out_ids, num_accepted, s, target_logits);
  impl("verify_sampling_out", draft_ids, draft_probs, target_logits, temperature, seed, offset, d2t, num_draft, s,
       out_ids, num_accepted);
}

// Raw pointers for the kernels; rows is a workspace the caller owns.
template <typename T>
VerifyParams<T> verify_params(const at::Tensor& draft_ids, const std::optional<at::Tensor>& draft_probs,
                              const at::Tensor& target_logits, const std::optional<at::Tensor>& temperature,
                              const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                              const std::optional<at::Tensor>& d2t, const std::optional<at::Tensor>& num_draft,
                              const VerifyShape& s, at::Tensor& rows, at::Tensor& out_ids,
                              at::Tensor& num_accepted) {
  VerifyParams<T> p{};
  p.draft_ids = draft_ids.const_data_ptr<int64_t>();
  p.draft_stride = draft_ids.stride(0);
  p.draft_col_stride = draft_ids.stride(1);
  p.logits = target_logits.const_data_ptr<T>();
  p.logits_stride_b = target_logits.stride(0);
  p.logits_stride_i = target_logits.stride(1);
  if (s.has_probs) {
    p.draft_probs = draft_probs->const_data_ptr();
    p.probs_f32 = draft_probs->scalar_type() == at::kFloat;
    p.probs_stride_b = draft_probs->stride(0);
    p.probs_stride_i = draft_probs->stride(1);
  }
  if (s.has_d2t) {
    p.d2t = d2t->const_data_ptr();
    p.d2t_i64 = d2t->scalar_type() == at::kLong;
  }
  if (s.has_num_draft) {
    p.num_draft = num_draft->const_data_ptr();
    p.num_draft_i64 = num_draft->scalar_type() == at::kLong;
  }
  p.temperature = temperature.has_value() ? temperature->const_data_ptr<float>() : nullptr;
  p.seed = seed.has_value() ? seed->const_data_ptr<int64_t>() : nullptr;
  p.offset = offset.has_value() ? offset->const_data_ptr<int64_t>() : nullptr;
  p.rows = reinterpret_cast<VerifyRowStats*>(rows.data_ptr());
  p.out_ids = out_ids.data_ptr<int64_t>();
  p.num_accepted = num_accepted.data_ptr<int64_t>();
  p.batch = s.batch;
  p.num_draft_max = s.num_draft_max;
  p.vocab = s.vocab;
  p.draft_vocab = s.draft_vocab;
  return p;
}

// Workspace for the per-row statistics of one call.
inline at::Tensor verify_rows_workspace(const VerifyShape& s, const at::Tensor& like) {
  return at::empty({s.batch * (s.num_draft_max + 1) * static_cast<int64_t>(sizeof(VerifyRowStats))},
                   like.options().dtype(at::kByte));
}

}  // namespace qspec_ext
