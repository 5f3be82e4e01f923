// CPU kernels of the norm / RoPE family: parallel over rows (tokens) with torch::stable::parallel_for,
// vectorized by the compiler over fp32 scratch rows.
#include <algorithm>
#include <vector>


#include "cpu_common.h"
#include "norm_rope_entry.h"
#include "ops.h"

namespace qspec_ext {
namespace {

using namespace cpu;

// ---------------------------------------------------------------------------------------
// rms_norm / fused_add_rms_norm_ / eagle3_input_norm
// ---------------------------------------------------------------------------------------

template <typename T>
struct RowNormParams {
  const T* input;  // [rows, width], row stride input_stride
  int64_t input_stride;
  T* out;  // [rows, width], row stride out_stride
  int64_t out_stride;
  T* residual;  // fused add only: [rows, width], row stride residual_stride
  int64_t residual_stride;
  const float* weight;  // [width]
  int64_t width;
  float eps;
};

template <typename T>
QSPEC_INLINE void rms_norm_rows_impl(const RowNormParams<T>& p, int64_t begin, int64_t end) {
  std::vector<float> row(p.width);
  for (int64_t r = begin; r < end; ++r) {
    load_float(p.input + r * p.input_stride, row.data(), p.width);
    store_normalized(row.data(), p.weight, p.out + r * p.out_stride, p.width, p.eps);
  }
}

template <typename T>
QSPEC_INLINE void fused_add_rms_norm_rows_impl(const RowNormParams<T>& p, int64_t begin, int64_t end) {
  std::vector<float> row(p.width), res(p.width);
  for (int64_t r = begin; r < end; ++r) {
    T* residual = p.residual + r * p.residual_stride;
    load_float(p.input + r * p.input_stride, row.data(), p.width);
    load_float(residual, res.data(), p.width);
    for (int64_t i = 0; i < p.width; ++i) row[i] += res[i];
    store_float(row.data(), residual, p.width);
    store_normalized(row.data(), p.weight, p.out + r * p.out_stride, p.width, p.eps);  // the fp32 sum
  }
}

#define QSPEC_ROW_KERNELS(T)                                                                       \
  QSPEC_CPU_CLONES void rms_norm_rows(const RowNormParams<T>& p, int64_t b, int64_t e) {           \
    rms_norm_rows_impl(p, b, e);                                                                   \
  }                                                                                                \
  QSPEC_CPU_CLONES void fused_add_rms_norm_rows(const RowNormParams<T>& p, int64_t b, int64_t e) { \
    fused_add_rms_norm_rows_impl(p, b, e);                                                         \
  }
QSPEC_ROW_KERNELS(float)
QSPEC_ROW_KERNELS(c10::Half)
QSPEC_ROW_KERNELS(c10::BFloat16)
#undef QSPEC_ROW_KERNELS

// ---------------------------------------------------------------------------------------
// qk_norm_rope_
// ---------------------------------------------------------------------------------------

template <typename T>
struct QKNormRopeParams {
  T* qkv;  // [T, (Hq + 2 Hkv) * D], row stride qkv_stride
  int64_t qkv_stride;
  const float* q_weight;  // [D] or nullptr (no QK-norm)
  const float* k_weight;  // [D] or nullptr
  const float* cos_sin_f32;  // [max_pos, rot] when the cache is fp32
  const T* cos_sin_t;  // [max_pos, rot] when the cache has the activation dtype
  const Indices* positions;  // [T], validated
  const Indices* slot_mapping;  // [T] or nullptr
  T* k_cache;  // [num_slots, Hkv, D] strides (slot, head, 1)
  T* v_cache;
  int64_t k_cache_strides[2];
  int64_t v_cache_strides[2];
  int num_heads_q, num_heads_kv, head_dim, rot_dim;
  float eps;
  bool is_neox;
};

template <typename T>
QSPEC_INLINE void rope_row(float* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin,
                           int rot, bool is_neox) {
  const int half = rot / 2;
  if (is_neox) {
    for (int i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = rope_rotate_first(a, b, cos[i], sin[i]);
      x[i + half] = rope_rotate_second(a, b, cos[i], sin[i]);
    }
  } else {
    for (int i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = rope_rotate_first(a, b, cos[i], sin[i]);
      x[2 * i + 1] = rope_rotate_second(a, b, cos[i], sin[i]);
    }
  }
}

template <typename T>
QSPEC_INLINE void qk_norm_rope_rows_impl(const QKNormRopeParams<T>& p, int64_t begin, int64_t end) {
  alignas(64) float cos_sin[kMaxHeadDim];
  alignas(64) float head[kMaxHeadDim];
  const int D = p.head_dim;
  const int half = p.rot_dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t pos = (*p.positions)[t];
    if (p.cos_sin_f32 != nullptr) {
      std::copy_n(p.cos_sin_f32 + pos * p.rot_dim, p.rot_dim, cos_sin);
    } else {
      load_float(p.cos_sin_t + pos * p.rot_dim, cos_sin, p.rot_dim);
    }
    T* row = p.qkv + t * p.qkv_stride;
    const int64_t slot = p.slot_mapping != nullptr ? (*p.slot_mapping)[t] : -1;
    for (int h = 0; h < p.num_heads_q + p.num_heads_kv; ++h) {
      const bool is_q = h < p.num_heads_q;
      T* x = row + static_cast<int64_t>(h) * D;
      load_float(x, head, D);
      if (p.q_weight != nullptr) rms_normalize(head, is_q ? p.q_weight : p.k_weight, D, p.eps);
      rope_row<T>(head, cos_sin, cos_sin + half, p.rot_dim, p.is_neox);
      store_float(head, x, D);
      if (!is_q && slot >= 0) {
        const int kv_head = h - p.num_heads_q;
        store_float(head, p.k_cache + slot * p.k_cache_strides[0] + kv_head * p.k_cache_strides[1], D);
      }
    }
    if (slot >= 0) {
      const T* v = row + static_cast<int64_t>(p.num_heads_q + p.num_heads_kv) * D;
      for (int h = 0; h < p.num_heads_kv; ++h)
        std::copy_n(v + static_cast<int64_t>(h) * D, D,
                    p.v_cache + slot * p.v_cache_strides[0] + h * p.v_cache_strides[1]);
    }
  }
}

QSPEC_CPU_CLONES void qk_norm_rope_rows(const QKNormRopeParams<float>& p, int64_t b, int64_t e) {
  qk_norm_rope_rows_impl(p, b, e);
}
QSPEC_CPU_CLONES void qk_norm_rope_rows(const QKNormRopeParams<c10::Half>& p, int64_t b, int64_t e) {
  qk_norm_rope_rows_impl(p, b, e);
}
QSPEC_CPU_CLONES void qk_norm_rope_rows(const QKNormRopeParams<c10::BFloat16>& p, int64_t b, int64_t e) {
  qk_norm_rope_rows_impl(p, b, e);
}

// Two tokens written to one slot would race on CUDA (which cannot check values without a
// host sync); the CPU rejects it so tests catch a caller that does it.
void check_distinct_slots(std::string_view op, const Tensor& slot_mapping) {
  const Indices values(slot_mapping);
  std::vector<int64_t> slots;
  for (int64_t t = 0; t < values.size(); ++t)
    if (values[t] >= 0) slots.push_back(values[t]);
  std::sort(slots.begin(), slots.end());
  const auto repeated = std::adjacent_find(slots.begin(), slots.end());
  QSPEC_CHECK(repeated == slots.end(), op, "slot_mapping", "must not write one cache slot twice, got slot ",
              repeated == slots.end() ? 0 : *repeated, " more than once");
}

}  // namespace

void rms_norm_cpu(const Tensor& rows, const Tensor& weight, double eps, Tensor& out) {
  const FloatWeight w(weight);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(rows), "rms_norm_cpu", [&] {
    const RowNormParams<scalar_t> p{const_data<scalar_t>(rows), rows.stride(0), mutable_data<scalar_t>(out),
                                    rows.size(1), nullptr, 0, w.data(), rows.size(1), static_cast<float>(eps)};
    torch::stable::parallel_for(0, rows.size(0), grain_for(rows.size(1)),
                     [&](int64_t b, int64_t e) { rms_norm_rows(p, b, e); });
  });
}

void fused_add_rms_norm_cpu(Tensor& in_rows, Tensor& res_rows, const Tensor& weight, double eps) {
  const FloatWeight w(weight);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(in_rows), "fused_add_rms_norm_cpu", [&] {
    scalar_t* in = mutable_data<scalar_t>(in_rows);
    const RowNormParams<scalar_t> p{in, in_rows.stride(0), in, in_rows.stride(0), mutable_data<scalar_t>(res_rows),
                                    res_rows.stride(0), w.data(), in_rows.size(1), static_cast<float>(eps)};
    torch::stable::parallel_for(0, in_rows.size(0), grain_for(in_rows.size(1)),
                     [&](int64_t b, int64_t e) { fused_add_rms_norm_rows(p, b, e); });
  });
}

void eagle3_input_norm_cpu(const Tensor& embeds, const Tensor& hidden, const Tensor& embed_weight,
                           const Tensor& hidden_weight, double eps, bool norm_before_residual, Tensor& x,
                           Tensor& residual) {
  const int64_t rows = embeds.size(0), width = embeds.size(1);
  const FloatWeight we(embed_weight), wh(hidden_weight);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(embeds), "eagle3_input_norm_cpu", [&] {
    scalar_t* out = mutable_data<scalar_t>(x);
    const float e = static_cast<float>(eps);
    const RowNormParams<scalar_t> pe{const_data<scalar_t>(embeds), embeds.stride(0), out, 2 * width,
                                     nullptr, 0, we.data(), width, e};
    const RowNormParams<scalar_t> ph{const_data<scalar_t>(hidden), hidden.stride(0), out + width, 2 * width,
                                     nullptr, 0, wh.data(), width, e};
    const scalar_t* res_src = norm_before_residual ? out + width : const_data<scalar_t>(hidden);
    const int64_t res_stride = norm_before_residual ? 2 * width : hidden.stride(0);
    scalar_t* res_dst = mutable_data<scalar_t>(residual);
    torch::stable::parallel_for(0, rows, grain_for(2 * width), [&](int64_t b, int64_t end) {
      rms_norm_rows(pe, b, end);
      rms_norm_rows(ph, b, end);
      for (int64_t r = b; r < end; ++r) std::copy_n(res_src + r * res_stride, width, res_dst + r * width);
    });
  });
}

void qk_norm_rope_cpu(Tensor& qkv, const std::optional<Tensor>& q_weight,
                      const std::optional<Tensor>& k_weight, const Tensor& cos_sin_cache,
                      const Tensor& positions, double eps, bool is_neox, const std::optional<Tensor>& k_cache,
                      const std::optional<Tensor>& v_cache, const std::optional<Tensor>& slot_mapping,
                      const QKNormRopeShape& s) {
  constexpr std::string_view op = "qk_norm_rope_";
  // Index checks read the values: free on the host, a sync on CUDA (which checks in the kernel).
  check_index_range(op, "positions", positions, 0, s.max_position, "rows of cos_sin_cache");
  if (s.has_cache) {
    check_index_range(op, "slot_mapping", *slot_mapping, -1, s.num_slots, "cache slots, -1 = skip");
    check_distinct_slots(op, *slot_mapping);
  }
  if (s.num_tokens == 0) return;
  const std::optional<FloatWeight> qw = s.has_norm ? std::optional<FloatWeight>(*q_weight) : std::nullopt;
  const std::optional<FloatWeight> kw = s.has_norm ? std::optional<FloatWeight>(*k_weight) : std::nullopt;
  const bool cs_f32 = dtype_of(cos_sin_cache) == kFloat;
  const Indices position_values(positions);
  const std::optional<Indices> slot_values = s.has_cache ? std::optional<Indices>(*slot_mapping) : std::nullopt;
  QSPEC_DISPATCH_ACTIVATION(dtype_of(qkv), "qk_norm_rope_cpu", [&] {
    QKNormRopeParams<scalar_t> p{};
    p.qkv = mutable_data<scalar_t>(qkv);
    p.qkv_stride = qkv.stride(0);
    p.q_weight = s.has_norm ? qw->data() : nullptr;
    p.k_weight = s.has_norm ? kw->data() : nullptr;
    p.cos_sin_f32 = cs_f32 ? const_data<float>(cos_sin_cache) : nullptr;
    p.cos_sin_t = cs_f32 ? nullptr : const_data<scalar_t>(cos_sin_cache);
    p.positions = &position_values;
    if (s.has_cache) {
      p.slot_mapping = &*slot_values;
      p.k_cache = mutable_data<scalar_t>(*k_cache);
      p.v_cache = mutable_data<scalar_t>(*v_cache);
      p.k_cache_strides[0] = k_cache->stride(0);
      p.k_cache_strides[1] = k_cache->stride(1);
      p.v_cache_strides[0] = v_cache->stride(0);
      p.v_cache_strides[1] = v_cache->stride(1);
    }
    p.num_heads_q = static_cast<int>(s.num_heads_q);
    p.num_heads_kv = static_cast<int>(s.num_heads_kv);
    p.head_dim = static_cast<int>(s.head_dim);
    p.rot_dim = static_cast<int>(s.rot_dim);
    p.eps = static_cast<float>(eps);
    p.is_neox = is_neox;
    torch::stable::parallel_for(0, s.num_tokens, grain_for((s.num_heads_q + 2 * s.num_heads_kv) * s.head_dim),
                     [&](int64_t b, int64_t e) { qk_norm_rope_rows(p, b, e); });
  });
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) {
  constexpr auto cpu = DeviceType::CPU;
  m.impl("rms_norm", TORCH_BOX((&rms_norm_entry<cpu, rms_norm_cpu>)));
  m.impl("fused_add_rms_norm_", TORCH_BOX((&fused_add_rms_norm_entry<cpu, fused_add_rms_norm_cpu>)));
  m.impl("eagle3_input_norm", TORCH_BOX((&eagle3_input_norm_entry<cpu, eagle3_input_norm_cpu>)));
  m.impl("qk_norm_rope_", TORCH_BOX((&qk_norm_rope_entry<cpu, qk_norm_rope_cpu>)));
}

}  // namespace qspec_ext
