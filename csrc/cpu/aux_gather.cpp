// CPU kernel of the aux hidden-state gather: parallel over output rows; each row reads
// its n source rows once into an fp32 scratch row, normalizes, and writes the fc input.
#include <vector>


#include "cpu_common.h"
#include "aux_gather_entry.h"
#include "ops.h"
#include "qspec_ext/aux_gather.h"

namespace qspec_ext {
namespace {

using namespace cpu;

template <typename T>
QSPEC_INLINE void gather_rows_impl(const AuxGatherParams<T>& p, int64_t begin, int64_t end) {
  const float* weight = static_cast<const float*>(p.weight);  // fp32 here: the caller converts it
  const int64_t H = p.hidden, width = p.num_aux * H;
  std::vector<float> row(width), res(H);
  for (int64_t j = begin; j < end; ++j) {
    T* out = p.out + j * p.out_stride;
    const int64_t src = p.indices_i64 ? static_cast<const int64_t*>(p.indices)[j]
                                      : static_cast<const int32_t*>(p.indices)[j];
    if (src < 0) {  // padding row
      std::fill_n(out, width, T(0));
      continue;
    }
    if (p.mode == AuxNormMode::kNone && p.residual[0] == nullptr) {  // a plain concat: no conversions
      for (int i = 0; i < p.num_aux; ++i) std::copy_n(p.aux[i] + src * p.aux_stride[i], H, out + i * H);
      continue;
    }
    for (int i = 0; i < p.num_aux; ++i) {
      float* chunk = row.data() + i * H;
      load_float(p.aux[i] + src * p.aux_stride[i], chunk, H);
      if (p.residual[0] != nullptr) {
        load_float(p.residual[i] + src * p.residual_stride[i], res.data(), H);
        for (int64_t e = 0; e < H; ++e) chunk[e] += res[e];
      }
    }
    switch (p.mode) {
      case AuxNormMode::kNone:
        store_float(row.data(), out, width);
        break;
      case AuxNormMode::kFcNorm:
        for (int i = 0; i < p.num_aux; ++i) store_normalized(row.data() + i * H, weight + i * H, out + i * H, H, p.eps);
        break;
      case AuxNormMode::kNormBeforeFc:
        store_normalized(row.data(), weight, out, width, p.eps);
        break;
    }
  }
}

QSPEC_CPU_CLONES void gather_rows(const AuxGatherParams<float>& p, int64_t b, int64_t e) {
  gather_rows_impl(p, b, e);
}
QSPEC_CPU_CLONES void gather_rows(const AuxGatherParams<c10::Half>& p, int64_t b, int64_t e) {
  gather_rows_impl(p, b, e);
}
QSPEC_CPU_CLONES void gather_rows(const AuxGatherParams<c10::BFloat16>& p, int64_t b, int64_t e) {
  gather_rows_impl(p, b, e);
}

}  // namespace

void gather_aux_hidden_cpu(std::string_view op, const TensorList& aux, const Tensor& indices,
                           const std::optional<TensorList>& residual, const std::optional<Tensor>& norm_weight,
                           double eps, const AuxGatherShape& s, Tensor& out) {
  QSPEC_CHECK(aux[0].device().is_cpu(), op, "aux[0]", "must be a CPU tensor for the CPU kernel, got ",
              aux[0].device());
  check_index_range(op, "indices", indices, -1, s.num_source, "source rows, -1 = padding");
  if (s.num_rows == 0 || s.hidden == 0) return;
  std::optional<FloatWeight> weight;
  if (norm_weight.has_value()) weight.emplace(*norm_weight);
  QSPEC_DISPATCH_ACTIVATION(dtype_of(aux[0]), "gather_aux_hidden_cpu", [&] {
    AuxGatherParams<scalar_t> p = aux_gather_params<scalar_t>(aux, indices, residual, norm_weight, eps, s, out);
    if (weight.has_value()) p.weight = weight->data(), p.weight_f32 = true;
    torch::stable::parallel_for(0, s.num_rows, grain_for(s.num_aux * s.hidden),
                     [&](int64_t b, int64_t e) { gather_rows(p, b, e); });
  });
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) {
  m.impl("gather_aux_hidden", TORCH_BOX((&gather_aux_hidden_entry<gather_aux_hidden_cpu>)));
  m.impl("gather_aux_hidden_out", TORCH_BOX((&gather_aux_hidden_out_entry<gather_aux_hidden_cpu>)));
}

}  // namespace qspec_ext
