#include "checks.h"

#include <algorithm>
#include <vector>


#include "qspec_ext/norm_rope.h"
#include "qspec_ext/verify.h"

namespace qspec_ext {

// Whether t's elements fill their memory span exactly once, in some order of the dims (ATen's
// is_non_overlapping_and_dense).
static bool dense(IntList sizes, IntList strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims longer than 1
  for (size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] > 1) dims.emplace_back(strides[d], sizes[d]);
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

// at::get_overlap_status's Full or Partial: memory spans that intersect, and either one tensor
// twice (the same memory, sizes and strides) or two dense tensors. Others with gaps cannot be told
// cheaply and pass, as in ATen ("TooHard").
static bool may_overlap(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const IntList a_sizes = a.sizes(), a_strides = a.strides(), b_sizes = b.sizes(), b_strides = b.strides();
  auto span = [](const Tensor& t, IntList sizes, IntList strides) {
    const auto* first = static_cast<const char*>(t.const_data_ptr());
    int64_t last = 0;  // the last element's offset (the ops take no negative strides)
    for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
    return std::pair{first, first + (last + 1) * static_cast<int64_t>(t.element_size())};
  };
  const auto [a0, a1] = span(a, a_sizes, a_strides);
  const auto [b0, b1] = span(b, b_sizes, b_strides);
  if (a1 <= b0 || b1 <= a0) return false;
  if (a0 == b0 && a_sizes == b_sizes && a_strides == b_strides) return true;
  return dense(a_sizes, a_strides) && dense(b_sizes, b_strides);
}

// "[Int, Long]", as an ArrayRef of dtypes prints.
static std::string dtype_names(std::initializer_list<ScalarType> dtypes) {
  std::ostringstream os;
  os << '[';
  for (auto it = dtypes.begin(); it != dtypes.end(); ++it) os << (it == dtypes.begin() ? "" : ", ") << *it;
  os << ']';
  return std::move(os).str();
}

void check_activation(std::string_view op, std::string_view name, const Tensor& t) {
  const auto dt = dtype_of(t);
  QSPEC_CHECK(dt == kFloat || dt == kHalf || dt == kBFloat16, op, name,
              "must be float32, float16 or bfloat16, got ", dt);
}

void check_same_device(std::string_view op, std::string_view name, const Tensor& t, const Tensor& ref) {
  QSPEC_CHECK(t.device() == ref.device(), op, name, "must be on ", ref.device(), ", got ", t.device());
}

void check_norm_weight(std::string_view op, std::string_view name, const Tensor& weight, int64_t width,
                       const Tensor& activation) {
  check_same_device(op, name, weight, activation);
  QSPEC_CHECK(weight.dim() == 1 && weight.size(0) == width, op, name, "must have shape [", width, "], got ",
              weight.sizes());
  QSPEC_CHECK(dtype_of(weight) == kFloat || dtype_of(weight) == dtype_of(activation), op, name,
              "must be float32 or the activation dtype ", dtype_of(activation), ", got ",
              dtype_of(weight));
  QSPEC_CHECK(weight.is_contiguous(), op, name, "must be contiguous, got strides ", weight.strides());
}

void check_index(std::string_view op, std::string_view name, const Tensor& t, int64_t length,
                 const Tensor& ref) {
  check_same_device(op, name, t, ref);
  QSPEC_CHECK(dtype_of(t) == kInt || dtype_of(t) == kLong, op, name,
              "must be int32 or int64, got ", dtype_of(t));
  QSPEC_CHECK(t.dim() == 1 && t.size(0) == length, op, name, "must have shape [", length, "], got ", t.sizes());
  QSPEC_CHECK(t.is_contiguous(), op, name, "must be contiguous (the kernels read it with stride 1), got strides ",
              t.strides());
}

void check_width(std::string_view op, std::string_view name, int64_t width) {
  QSPEC_CHECK(width <= kMaxWidth, op, name, "must have rows of at most ", kMaxWidth, " elements, got ", width);
}

void check_written_rows(std::string_view op, std::string_view name, const Tensor& rows) {
  QSPEC_CHECK(rows.size(0) <= 1 || rows.stride(0) >= rows.size(1), op, name,
              "is written in place and must not have overlapping rows, got shape ", rows.sizes(), " and strides ",
              rows.strides());
}

void check_no_overlap(std::string_view op, std::string_view name, const Tensor& a, std::string_view other,
                      const Tensor& b) {
  QSPEC_CHECK(!may_overlap(a, b), op, name, "must not share memory with '", other, "'");
}

void check_launch_size(std::string_view op, std::string_view name, int64_t count, std::string_view what) {
  QSPEC_CHECK(count <= kMaxLaunchBlocks, op, name, "is too large: ", what, " = ", count, " exceeds ",
              kMaxLaunchBlocks, ", the most blocks one CUDA grid dimension holds (split the call)");
}

Tensor as_rows(std::string_view op, std::string_view name, const Tensor& t) {
  QSPEC_CHECK(t.dim() >= 1, op, name, "must have at least 1 dimension, got a scalar");
  const int64_t width = t.size(-1);
  QSPEC_CHECK(t.stride(-1) == 1 || width == 1, op, name, "must have a contiguous last dimension, got strides ",
              t.strides());
  if (t.dim() == 1) return as_strided(t, {1, width}, {width, 1});
  if (t.numel() == 0) {  // nothing to read: any strides will do
    int64_t rows = 1;
    for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
    return as_strided(t, {rows, width}, {width, 1});
  }
  // Leading dims must collapse into one row dimension with a single stride.
  int64_t expected = t.stride(-2);
  for (int64_t d = t.dim() - 2; d > 0; --d) {
    expected *= t.size(d);
    QSPEC_CHECK(t.size(d - 1) == 1 || t.stride(d - 1) == expected, op, name,
                "must have rows with one common stride (leading dims that flatten without a copy), got shape ",
                t.sizes(), " and strides ", t.strides());
  }
  check_width(op, name, width);
  const int64_t rows = t.numel() / std::max<int64_t>(width, 1);
  check_launch_size(op, name, rows, "its number of rows");
  return as_strided(t, {rows, width}, {t.dim() > 1 ? t.stride(-2) : width, 1});
}

Tensor check_rms_norm(const Tensor& input, const Tensor& weight) {
  constexpr std::string_view op = "rms_norm";
  check_activation(op, "input", input);
  const Tensor rows = as_rows(op, "input", input);
  check_norm_weight(op, "weight", weight, rows.size(1), input);
  return rows;
}

Tensor check_silu_and_mul(const Tensor& input) {
  constexpr std::string_view op = "silu_and_mul";
  check_activation(op, "input", input);
  const Tensor rows = as_rows(op, "input", input);
  QSPEC_CHECK(rows.size(1) % 2 == 0, op, "input",
              "must have an even last dimension (the gate half, then the up half), got shape ", input.sizes());
  return rows;
}

std::pair<Tensor, Tensor> check_fused_add_rms_norm(const Tensor& input, const Tensor& residual,
                                                           const Tensor& weight) {
  constexpr std::string_view op = "fused_add_rms_norm_";
  check_activation(op, "input", input);
  check_same_device(op, "residual", residual, input);
  QSPEC_CHECK(dtype_of(residual) == dtype_of(input), op, "residual", "must have the dtype of input (",
              dtype_of(input), "), got ", dtype_of(residual));
  QSPEC_CHECK(residual.sizes() == input.sizes(), op, "residual", "must have the shape of input ", input.sizes(),
              ", got ", residual.sizes());
  Tensor in_rows = as_rows(op, "input", input);
  Tensor res_rows = as_rows(op, "residual", residual);
  check_written_rows(op, "input", in_rows);
  check_written_rows(op, "residual", res_rows);
  check_no_overlap(op, "residual", residual, "input", input);
  check_norm_weight(op, "weight", weight, in_rows.size(1), input);
  return {in_rows, res_rows};
}

static void check_cache(std::string_view name, const Tensor& cache, const Tensor& qkv, int64_t heads,
                        int64_t head_dim) {
  constexpr std::string_view op = "qk_norm_rope_";
  check_same_device(op, name, cache, qkv);
  QSPEC_CHECK(dtype_of(cache) == dtype_of(qkv), op, name, "must have the dtype of qkv (",
              dtype_of(qkv), "), got ", dtype_of(cache));
  QSPEC_CHECK(cache.dim() == 3 && cache.size(1) == heads && cache.size(2) == head_dim, op, name,
              "must have shape [num_slots, ", heads, ", ", head_dim, "], got ", cache.sizes());
  QSPEC_CHECK(cache.stride(2) == 1, op, name, "must have a contiguous last dimension, got strides ",
              cache.strides());
}

QKNormRopeShape check_qk_norm_rope(const Tensor& qkv, const std::optional<Tensor>& q_weight,
                                   const std::optional<Tensor>& k_weight, const Tensor& cos_sin_cache,
                                   const Tensor& positions, int64_t num_heads_q, int64_t num_heads_kv,
                                   int64_t head_dim, const std::optional<Tensor>& k_cache,
                                   const std::optional<Tensor>& v_cache,
                                   const std::optional<Tensor>& slot_mapping) {
  constexpr std::string_view op = "qk_norm_rope_";
  QKNormRopeShape s{};
  check_activation(op, "qkv", qkv);
  QSPEC_CHECK(num_heads_q > 0 && num_heads_kv > 0, op, "num_heads_q/num_heads_kv",
              "must be positive, got ", num_heads_q, " and ", num_heads_kv);
  QSPEC_CHECK(num_heads_q % num_heads_kv == 0, op, "num_heads_q",
              "must be a multiple of num_heads_kv (", num_heads_kv, "), got ", num_heads_q);
  QSPEC_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim, op, "head_dim",
              "must be even and in [2, ", kMaxHeadDim, "], got ", head_dim);
  QSPEC_CHECK(num_heads_q + 2 * num_heads_kv <= kMaxWidth / kMaxHeadDim, op, "num_heads_q/num_heads_kv",
              "must have num_heads_q + 2 * num_heads_kv at most ", kMaxWidth / kMaxHeadDim, ", got ",
              num_heads_q + 2 * num_heads_kv);
  const int64_t width = (num_heads_q + 2 * num_heads_kv) * head_dim;
  QSPEC_CHECK(qkv.dim() == 2 && qkv.size(1) == width, op, "qkv",
              "must have shape [num_tokens, (num_heads_q + 2 * num_heads_kv) * head_dim] = [num_tokens, ", width,
              "], got ", qkv.sizes());
  QSPEC_CHECK(qkv.stride(1) == 1, op, "qkv", "must have a contiguous last dimension, got strides ",
              qkv.strides());
  check_written_rows(op, "qkv", qkv);
  s.num_tokens = qkv.size(0);
  check_launch_size(op, "qkv", (s.num_tokens * (num_heads_q + 2 * num_heads_kv) + 3) / 4,
                    "num_tokens * (num_heads_q + 2 * num_heads_kv) / 4 (one warp per token and head)");
  s.num_heads_q = num_heads_q;
  s.num_heads_kv = num_heads_kv;
  s.head_dim = head_dim;

  QSPEC_CHECK(q_weight.has_value() == k_weight.has_value(), op, "q_weight/k_weight",
              "must both be given (QK-norm) or both be None (RoPE only)");
  s.has_norm = q_weight.has_value();
  if (s.has_norm) {
    check_norm_weight(op, "q_weight", *q_weight, head_dim, qkv);
    check_norm_weight(op, "k_weight", *k_weight, head_dim, qkv);
    QSPEC_CHECK(dtype_of(*k_weight) == dtype_of(*q_weight), op, "k_weight", "must have the dtype of q_weight (",
                dtype_of(*q_weight), "), got ", dtype_of(*k_weight));
  }

  check_same_device(op, "cos_sin_cache", cos_sin_cache, qkv);
  QSPEC_CHECK(cos_sin_cache.dim() == 2, op, "cos_sin_cache", "must have shape [max_position, rotary_dim], got ",
              cos_sin_cache.sizes());
  s.rot_dim = cos_sin_cache.size(1);
  s.max_position = cos_sin_cache.size(0);
  QSPEC_CHECK(s.rot_dim > 0 && s.rot_dim % 2 == 0 && s.rot_dim <= head_dim, op, "cos_sin_cache",
              "must have an even rotary_dim (size of dim 1) in [2, head_dim=", head_dim, "], got ", s.rot_dim);
  QSPEC_CHECK(dtype_of(cos_sin_cache) == kFloat || dtype_of(cos_sin_cache) == dtype_of(qkv), op,
              "cos_sin_cache", "must be float32 or the dtype of qkv (", dtype_of(qkv), "), got ",
              dtype_of(cos_sin_cache));
  QSPEC_CHECK(cos_sin_cache.is_contiguous(), op, "cos_sin_cache", "must be contiguous, got strides ",
              cos_sin_cache.strides());
  check_index(op, "positions", positions, s.num_tokens, qkv);

  QSPEC_CHECK(k_cache.has_value() == v_cache.has_value() && k_cache.has_value() == slot_mapping.has_value(), op,
              "k_cache/v_cache/slot_mapping", "must all be given or all be None");
  s.has_cache = k_cache.has_value();
  if (s.has_cache) {
    check_cache("k_cache", *k_cache, qkv, num_heads_kv, head_dim);
    check_cache("v_cache", *v_cache, qkv, num_heads_kv, head_dim);
    QSPEC_CHECK(v_cache->size(0) == k_cache->size(0), op, "v_cache", "must have as many slots as k_cache (",
                k_cache->size(0), "), got ", v_cache->size(0));
    check_index(op, "slot_mapping", *slot_mapping, s.num_tokens, qkv);
    check_no_overlap(op, "k_cache", *k_cache, "v_cache", *v_cache);
    check_no_overlap(op, "k_cache", *k_cache, "qkv", qkv);
    check_no_overlap(op, "v_cache", *v_cache, "qkv", qkv);
    s.num_slots = k_cache->size(0);
  }
  return s;
}

static AuxNormMode parse_aux_norm_mode(std::string_view op, std::string_view mode) {
  if (mode == "none") return AuxNormMode::kNone;
  if (mode == "fc_norm") return AuxNormMode::kFcNorm;
  if (mode == "norm_before_fc") return AuxNormMode::kNormBeforeFc;
  QSPEC_CHECK(false, op, "norm_mode", "must be \"none\", \"fc_norm\" or \"norm_before_fc\", got \"", mode, "\"");
  return AuxNormMode::kNone;
}

AuxGatherShape check_gather_aux_hidden(std::string_view op, const TensorList& aux, const Tensor& indices,
                                       const std::optional<TensorList>& residual, std::string_view norm_mode,
                                       const std::optional<Tensor>& norm_weight) {
  AuxGatherShape s{};
  QSPEC_CHECK(!aux.empty() && aux.size() <= static_cast<size_t>(kMaxAuxLayers), op, "aux",
              "must hold 1 to ", kMaxAuxLayers, " tensors, got ", aux.size());
  const Tensor& first = aux[0];
  check_activation(op, "aux[0]", first);
  QSPEC_CHECK(first.dim() == 2, op, "aux[0]", "must have shape [num_tokens, hidden_size], got ", first.sizes());
  s.num_aux = static_cast<int>(aux.size());
  s.num_source = first.size(0);
  s.hidden = first.size(1);
  auto check_list = [&](const TensorList& list, std::string_view list_name) {
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string name = std::string(list_name) + "[" + std::to_string(i) + "]";
      check_same_device(op, name, list[i], first);
      QSPEC_CHECK(dtype_of(list[i]) == dtype_of(first), op, name, "must have the dtype of aux[0] (",
                  dtype_of(first), "), got ", dtype_of(list[i]));
      QSPEC_CHECK(list[i].sizes() == first.sizes(), op, name, "must have the shape of aux[0] ", first.sizes(),
                  ", got ", list[i].sizes());
      QSPEC_CHECK(list[i].stride(1) == 1 || s.hidden <= 1, op, name,
                  "must have a contiguous last dimension, got strides ", list[i].strides());
    }
  };
  check_list(aux, "aux");
  s.has_residual = residual.has_value();
  if (s.has_residual) {
    QSPEC_CHECK(residual->size() == aux.size(), op, "residual", "must hold one tensor per aux tensor (",
                aux.size(), "), got ", residual->size());
    check_list(*residual, "residual");
  }
  check_same_device(op, "indices", indices, first);
  QSPEC_CHECK(dtype_of(indices) == kInt || dtype_of(indices) == kLong, op, "indices",
              "must be int32 or int64, got ", dtype_of(indices));
  QSPEC_CHECK(indices.dim() == 1, op, "indices", "must have shape [num_rows], got ", indices.sizes());
  QSPEC_CHECK(indices.is_contiguous(), op, "indices", "must be contiguous, got strides ", indices.strides());
  s.num_rows = indices.size(0);
  check_launch_size(op, "indices", s.num_rows, "its length (one block per output row)");
  check_width(op, "aux", s.num_aux * s.hidden);

  s.mode = parse_aux_norm_mode(op, norm_mode);
  if (s.mode == AuxNormMode::kNone) {
    QSPEC_CHECK(!norm_weight.has_value(), op, "norm_weight", "must be None for norm_mode \"none\"");
  } else {
    QSPEC_CHECK(norm_weight.has_value(), op, "norm_weight", "is required for norm_mode \"", norm_mode, "\"");
    const Tensor& w = *norm_weight;
    check_same_device(op, "norm_weight", w, first);
    QSPEC_CHECK(dtype_of(w) == kFloat || dtype_of(w) == dtype_of(first), op, "norm_weight",
                "must be float32 or the activation dtype ", dtype_of(first), ", got ", dtype_of(w));
    QSPEC_CHECK(w.is_contiguous(), op, "norm_weight", "must be contiguous, got strides ", w.strides());
    if (s.mode == AuxNormMode::kFcNorm) {
      QSPEC_CHECK(w.dim() == 2 && w.size(0) == s.num_aux && w.size(1) == s.hidden, op, "norm_weight",
                  "must have shape [n, hidden_size] = [", s.num_aux, ", ", s.hidden,
                  "] for norm_mode \"fc_norm\", got ", w.sizes());
    } else {
      QSPEC_CHECK(w.dim() == 1 && w.size(0) == s.num_aux * s.hidden, op, "norm_weight",
                  "must have shape [n * hidden_size] = [", s.num_aux * s.hidden,
                  "] for norm_mode \"norm_before_fc\", got ", w.sizes());
    }
  }
  return s;
}

void check_gather_out(const Tensor& out, const AuxGatherShape& shape, const Tensor& aux0) {
  constexpr std::string_view op = "gather_aux_hidden_out";
  check_same_device(op, "out", out, aux0);
  QSPEC_CHECK(dtype_of(out) == dtype_of(aux0), op, "out", "must have the dtype of aux (",
              dtype_of(aux0), "), got ", dtype_of(out));
  QSPEC_CHECK(out.dim() == 2 && out.size(0) == shape.num_rows && out.size(1) == shape.num_aux * shape.hidden, op,
              "out", "must have shape [num_rows, n * hidden_size] = [", shape.num_rows, ", ",
              shape.num_aux * shape.hidden, "], got ", out.sizes());
  QSPEC_CHECK(out.stride(1) == 1, op, "out", "must have a contiguous last dimension, got strides ", out.strides());
  check_written_rows(op, "out", out);
}

static void check_vector(std::string_view op, std::string_view name, const Tensor& t, int64_t length,
                         const Tensor& ref, std::initializer_list<ScalarType> dtypes) {
  check_same_device(op, name, t, ref);
  bool dtype_ok = false;
  for (auto d : dtypes) dtype_ok = dtype_ok || dtype_of(t) == d;
  QSPEC_CHECK(dtype_ok, op, name, "must have dtype ", dtype_names(dtypes), ", got ",
              dtype_of(t));
  QSPEC_CHECK(t.dim() == 1 && t.size(0) == length, op, name, "must have shape [", length, "], got ", t.sizes());
  QSPEC_CHECK(t.is_contiguous(), op, name, "must be contiguous, got strides ", t.strides());
}

// target_logits [batch, rows, vocab] with a contiguous last dim: returns the vocab size.
// rows_name names what rows counts (rows = rows_name + 1).
static int64_t check_target_logits(std::string_view op, const Tensor& target_logits, int64_t batch, int64_t rows,
                                   std::string_view rows_name) {
  QSPEC_CHECK(target_logits.dim() == 3 && target_logits.size(0) == batch && target_logits.size(1) == rows, op,
              "target_logits", "must have shape [batch, ", rows_name, " + 1, vocab] = [", batch, ", ", rows,
              ", vocab], got ", target_logits.sizes());
  QSPEC_CHECK(target_logits.stride(2) == 1, op, "target_logits",
              "must have a contiguous last dimension, got strides ", target_logits.strides());
  const int64_t vocab = target_logits.size(2);
  QSPEC_CHECK(vocab >= 1 && vocab < (int64_t{1} << 31), op, "target_logits", "must have a vocab size in [1, 2^31), got ",
              vocab);
  return vocab;
}

VerifyShape check_verify(std::string_view op, const Tensor& draft_ids, const Tensor& target_logits,
                         const std::optional<Tensor>& num_draft, const std::optional<Tensor>& draft_probs,
                         const std::optional<Tensor>& temperature, const std::optional<Tensor>& seed,
                         const std::optional<Tensor>& offset, const std::optional<Tensor>& d2t) {
  VerifyShape s{};
  QSPEC_CHECK(draft_ids.dim() == 2, op, "draft_ids", "must have shape [batch, num_draft_tokens], got ",
              draft_ids.sizes());
  QSPEC_CHECK(dtype_of(draft_ids) == kLong, op, "draft_ids", "must be int64, got ", dtype_of(draft_ids));
  s.batch = draft_ids.size(0);
  const int64_t k = draft_ids.size(1);
  QSPEC_CHECK(k >= 1 && k <= kMaxDraftTokens, op, "draft_ids", "must hold 1 to ", kMaxDraftTokens,
              " draft tokens per request, got ", k);
  s.num_draft_max = static_cast<int>(k);
  check_launch_size(op, "draft_ids", s.batch * (k + 1), "batch * (num_draft_tokens + 1) (one block per target row)");
  check_activation(op, "target_logits", target_logits);
  check_same_device(op, "draft_ids", draft_ids, target_logits);
  s.vocab = check_target_logits(op, target_logits, s.batch, k + 1, "num_draft_tokens");
  s.draft_vocab = s.vocab;
  s.has_num_draft = num_draft.has_value();
  if (s.has_num_draft) check_vector(op, "num_draft", *num_draft, s.batch, target_logits, {kInt, kLong});
  if (temperature.has_value()) check_vector(op, "temperature", *temperature, s.batch, target_logits, {kFloat});
  if (seed.has_value()) check_vector(op, "seed", *seed, s.batch, target_logits, {kLong});
  if (offset.has_value()) check_vector(op, "offset", *offset, s.batch, target_logits, {kLong});

  s.has_d2t = d2t.has_value();
  s.has_probs = draft_probs.has_value();
  QSPEC_CHECK(!s.has_d2t || s.has_probs, op, "d2t",
              "maps draft_probs to target ids and must come with draft_probs (argmax drafts are target ids)");
  if (s.has_d2t) {
    QSPEC_CHECK(d2t->dim() == 1, op, "d2t", "must have shape [draft_vocab], got ", d2t->sizes());
    s.draft_vocab = d2t->size(0);
    QSPEC_CHECK(s.draft_vocab >= 1, op, "d2t", "must map at least one draft id, got an empty tensor");
    check_vector(op, "d2t", *d2t, s.draft_vocab, target_logits, {kInt, kLong});
  }
  if (s.has_probs) {
    const Tensor& q = *draft_probs;
    check_same_device(op, "draft_probs", q, target_logits);
    QSPEC_CHECK(dtype_of(q) == kFloat || dtype_of(q) == dtype_of(target_logits), op, "draft_probs",
                "must be float32 or the dtype of target_logits (", dtype_of(target_logits), "), got ",
                dtype_of(q));
    QSPEC_CHECK(q.dim() == 3 && q.size(0) == s.batch && q.size(1) == k && q.size(2) == s.draft_vocab, op,
                "draft_probs", "must have shape [batch, num_draft_tokens, ", s.has_d2t ? "draft_vocab" : "vocab",
                "] = [", s.batch, ", ", k, ", ", s.draft_vocab, "], got ", q.sizes());
    QSPEC_CHECK(q.stride(2) == 1, op, "draft_probs", "must have a contiguous last dimension, got strides ",
                q.strides());
  }
  return s;
}

void check_verify_out(std::string_view op, const Tensor& out_ids, const Tensor& num_accepted,
                      const VerifyShape& shape, const Tensor& target_logits) {
  check_same_device(op, "out_ids", out_ids, target_logits);
  QSPEC_CHECK(dtype_of(out_ids) == kLong, op, "out_ids", "must be int64, got ", dtype_of(out_ids));
  QSPEC_CHECK(out_ids.dim() == 2 && out_ids.size(0) == shape.batch && out_ids.size(1) == shape.num_draft_max + 1,
              op, "out_ids", "must have shape [", shape.batch, ", ", shape.num_draft_max + 1, "], got ",
              out_ids.sizes());
  QSPEC_CHECK(out_ids.is_contiguous(), op, "out_ids", "must be contiguous, got strides ", out_ids.strides());
  check_vector(op, "num_accepted", num_accepted, shape.batch, target_logits, {kLong});
}

TreeVerifyShape check_verify_tree(std::string_view op, const Tensor& draft_ids, const Tensor& parents,
                                  const Tensor& target_logits, const std::optional<Tensor>& temperature,
                                  const std::optional<Tensor>& seed, const std::optional<Tensor>& offset) {
  TreeVerifyShape s{};
  QSPEC_CHECK(draft_ids.dim() == 2, op, "draft_ids", "must have shape [batch, num_nodes], got ", draft_ids.sizes());
  QSPEC_CHECK(dtype_of(draft_ids) == kLong, op, "draft_ids", "must be int64, got ", dtype_of(draft_ids));
  s.batch = draft_ids.size(0);
  const int64_t n = draft_ids.size(1);
  check_launch_size(op, "draft_ids", s.batch * (n + 1), "batch * (num_nodes + 1) (one block per target row)");
  s.num_nodes = static_cast<int>(n);
  check_activation(op, "target_logits", target_logits);
  check_same_device(op, "draft_ids", draft_ids, target_logits);
  check_same_device(op, "parents", parents, target_logits);
  QSPEC_CHECK(dtype_of(parents) == kInt || dtype_of(parents) == kLong, op, "parents",
              "must be int32 or int64, got ", dtype_of(parents));
  QSPEC_CHECK(parents.sizes() == draft_ids.sizes(), op, "parents", "must have the shape of draft_ids ",
              draft_ids.sizes(), ", got ", parents.sizes());
  QSPEC_CHECK(parents.is_contiguous(), op, "parents", "must be contiguous, got strides ", parents.strides());
  s.vocab = check_target_logits(op, target_logits, s.batch, n + 1, "num_nodes");
  if (temperature.has_value()) check_vector(op, "temperature", *temperature, s.batch, target_logits, {kFloat});
  if (seed.has_value()) check_vector(op, "seed", *seed, s.batch, target_logits, {kLong});
  if (offset.has_value()) check_vector(op, "offset", *offset, s.batch, target_logits, {kLong});
  return s;
}

void check_verify_tree_out(std::string_view op, const Tensor& out_ids, const Tensor& num_accepted,
                           const Tensor& path, const TreeVerifyShape& shape, const Tensor& target_logits) {
  for (const auto& [name, t] : {std::pair<std::string_view, const Tensor&>{"out_ids", out_ids}, {"path", path}}) {
    check_same_device(op, name, t, target_logits);
    QSPEC_CHECK(dtype_of(t) == kLong, op, name, "must be int64, got ", dtype_of(t));
    QSPEC_CHECK(t.dim() == 2 && t.size(0) == shape.batch && t.size(1) == shape.num_nodes + 1, op, name,
                "must have shape [", shape.batch, ", ", shape.num_nodes + 1, "], got ", t.sizes());
    QSPEC_CHECK(t.is_contiguous(), op, name, "must be contiguous, got strides ", t.strides());
  }
  check_vector(op, "num_accepted", num_accepted, shape.batch, target_logits, {kLong});
  check_no_overlap(op, "out_ids", out_ids, "path", path);
  check_no_overlap(op, "out_ids", out_ids, "num_accepted", num_accepted);
  check_no_overlap(op, "path", path, "num_accepted", num_accepted);
}

AttentionShape check_cached_attention(const Tensor& query, const Tensor& k_cache, const Tensor& v_cache,
                                      const Tensor& positions, int64_t window,
                                      const std::optional<Tensor>& tree_start,
                                      const std::optional<Tensor>& tree_seen) {
  constexpr std::string_view op = "cached_attention";
  AttentionShape s{};
  check_activation(op, "query", query);
  QSPEC_CHECK(query.dim() == 4, op, "query", "must have shape [batch, tokens, heads_q, head_dim], got ",
              query.sizes());
  QSPEC_CHECK(query.stride(3) == 1, op, "query", "must have a contiguous last dimension, got strides ",
              query.strides());
  s.batch = query.size(0);
  s.tokens = query.size(1);
  s.heads_q = query.size(2);
  s.head_dim = query.size(3);
  QSPEC_CHECK(s.head_dim > 0 && s.head_dim <= kMaxHeadDim, op, "query", "must have head_dim in [1, ", kMaxHeadDim,
              "], got ", s.head_dim);
  for (const auto& [name, cache] : {std::pair<std::string_view, const Tensor&>{"k_cache", k_cache},
                                    std::pair<std::string_view, const Tensor&>{"v_cache", v_cache}}) {
    check_same_device(op, name, cache, query);
    QSPEC_CHECK(dtype_of(cache) == dtype_of(query), op, name, "must have the dtype of query (",
                dtype_of(query), "), got ", dtype_of(cache));
    QSPEC_CHECK(cache.dim() == 3 && cache.size(2) == s.head_dim, op, name,
                "must have shape [batch * max_length, heads_kv, ", s.head_dim, "], got ", cache.sizes());
    QSPEC_CHECK(cache.is_contiguous(), op, name, "must be contiguous, got strides ", cache.strides());
  }
  QSPEC_CHECK(v_cache.sizes() == k_cache.sizes(), op, "v_cache", "must have the shape of k_cache (",
              k_cache.sizes(), "), got ", v_cache.sizes());
  s.heads_kv = k_cache.size(1);
  QSPEC_CHECK(s.heads_kv > 0 && s.heads_q % s.heads_kv == 0, op, "k_cache",
              "must have a number of heads (dim 1) that divides heads_q=", s.heads_q, ", got ", s.heads_kv);
  QSPEC_CHECK(s.batch == 0 || k_cache.size(0) % s.batch == 0, op, "k_cache",
              "must have batch * max_length slots (a multiple of batch=", s.batch, "), got ", k_cache.size(0));
  s.max_length = s.batch > 0 ? k_cache.size(0) / s.batch : 0;
  check_same_device(op, "positions", positions, query);
  QSPEC_CHECK(dtype_of(positions) == kInt || dtype_of(positions) == kLong, op, "positions",
              "must be int32 or int64, got ", dtype_of(positions));
  QSPEC_CHECK(positions.dim() == 2 && positions.size(0) == s.batch && positions.size(1) == s.tokens, op, "positions",
              "must have shape [", s.batch, ", ", s.tokens, "], got ", positions.sizes());
  QSPEC_CHECK(window >= 0, op, "window", "must be >= 0 (0 = no sliding window), got ", window);
  QSPEC_CHECK(tree_start.has_value() == tree_seen.has_value(), op, "tree_start/tree_seen",
              "must both be given (a draft tree) or both be None");
  s.has_tree = tree_start.has_value();
  if (s.has_tree) {
    check_same_device(op, "tree_start", *tree_start, query);
    QSPEC_CHECK(dtype_of(*tree_start) == kLong && tree_start->dim() == 1 && tree_start->size(0) == s.batch,
                op, "tree_start", "must be an int64 tensor of shape [", s.batch, "], got ",
                dtype_of(*tree_start), " ", tree_start->sizes());
    check_same_device(op, "tree_seen", *tree_seen, query);
    QSPEC_CHECK(dtype_of(*tree_seen) == kBool && tree_seen->dim() == 3 && tree_seen->size(0) == s.batch &&
                    tree_seen->size(1) == s.tokens,
                op, "tree_seen", "must be a bool tensor of shape [", s.batch, ", ", s.tokens,
                ", scratch], got ", dtype_of(*tree_seen), " ", tree_seen->sizes());
    s.scratch = tree_seen->size(2);
    QSPEC_CHECK(s.scratch <= s.max_length, op, "tree_seen", "must have a scratch size (dim 2) <= max_length=",
                s.max_length, ", got ", s.scratch);
  }
  check_launch_size(op, "query", s.batch * s.tokens * s.heads_q, "batch * tokens * heads_q (blocks per key split)");
  return s;
}

void check_eagle3_input_norm(const Tensor& embeds, const Tensor& hidden, const Tensor& embed_weight,
                             const Tensor& hidden_weight) {
  constexpr std::string_view op = "eagle3_input_norm";
  check_activation(op, "embeds", embeds);
  QSPEC_CHECK(embeds.dim() == 2, op, "embeds", "must have shape [num_tokens, hidden_size], got ", embeds.sizes());
  QSPEC_CHECK(dtype_of(hidden) == dtype_of(embeds), op, "hidden", "must have the dtype of embeds (",
              dtype_of(embeds), "), got ", dtype_of(hidden));
  check_same_device(op, "hidden", hidden, embeds);
  QSPEC_CHECK(hidden.sizes() == embeds.sizes(), op, "hidden", "must have the shape of embeds ", embeds.sizes(),
              ", got ", hidden.sizes());
  QSPEC_CHECK(embeds.stride(1) == 1 && hidden.stride(1) == 1, op, "embeds/hidden",
              "must have a contiguous last dimension, got strides ", embeds.strides(), " and ", hidden.strides());
  check_width(op, "embeds", embeds.size(1));
  check_launch_size(op, "embeds", embeds.size(0), "its number of rows");
  check_norm_weight(op, "embed_weight", embed_weight, embeds.size(1), embeds);
  check_norm_weight(op, "hidden_weight", hidden_weight, embeds.size(1), embeds);
}

}  // namespace qspec_ext
