// packed_linear: input [M, K] @ W^T for a weight oneDNN packed (mkldnn::_reorder_linear_weight), as a
// qspec_ext op of its own so that a compiled decode step calls it without Python in between (Inductor
// lowers oneDNN's op only for weights that are graph constants; a decode step takes them as inputs).
// CPU only: packed weights are oneDNN's CPU layout.
#include <string_view>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/List.h>
#include <torch/library.h>

#include "checks.h"

namespace qspec_ext {
namespace {

constexpr std::string_view kOp = "packed_linear";

at::Tensor packed_linear_cpu(const at::Tensor& input, const at::Tensor& packed_weight) {
  QSPEC_CHECK(input.dim() == 2, kOp, "input", "must be 2-D [rows, in_features], got ", input.dim(), "-D ",
              input.sizes());
  QSPEC_CHECK(packed_weight.dim() == 2, kOp, "packed_weight",
              "must be a 2-D [out_features, in_features] weight packed by mkldnn._reorder_linear_weight, got ",
              packed_weight.dim(), "-D ", packed_weight.sizes());
  QSPEC_CHECK(input.size(1) == packed_weight.size(1), kOp, "input", "must have ", packed_weight.size(1),
              " columns (the packed weight's in_features), got ", input.sizes());
  QSPEC_CHECK(input.scalar_type() == packed_weight.scalar_type(), kOp, "input", "must have the packed weight's dtype ",
              packed_weight.scalar_type(), ", got ", input.scalar_type());
  QSPEC_CHECK(input.device().is_cpu() && packed_weight.device().is_cpu(), kOp, "input",
              "and packed_weight must be on the CPU, got ", input.device(), " and ", packed_weight.device());
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               std::string_view, c10::List<std::optional<at::Scalar>>,
                               std::optional<std::string_view>);
  static const auto linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<Signature>();
  return linear.call(input, packed_weight, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                     std::string_view(""));
}

}  // namespace

// A packed weight is an opaque oneDNN tensor (dispatch key MkldnnCPU); oneDNN's op also takes a weight as
// stored (CPU): the same kernel for both.
TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) { m.impl("packed_linear", &packed_linear_cpu); }
TORCH_LIBRARY_IMPL(qspec_ext, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear_cpu); }

}  // namespace qspec_ext
