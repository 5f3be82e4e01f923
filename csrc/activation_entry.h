// The silu_and_mul op's entry point, written once: the device check, argument checks and output
// allocation around a device half (silu_and_mul_cpu / _cuda in ops.h).
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "checks.h"
#include "norm_rope_entry.h"  // check_kernel_device

namespace qspec_ext {

// rows: the input as validated [R, 2I] rows (strided rows allowed); out: [R, I], contiguous.
using SiluAndMulImpl = void (*)(const at::Tensor& rows, at::Tensor& out);

template <c10::DeviceType device, SiluAndMulImpl impl>
at::Tensor silu_and_mul_entry(const at::Tensor& input) {
  check_kernel_device<device>("silu_and_mul", "input", input);
  const at::Tensor rows = check_silu_and_mul(input);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, input.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() > 0) {
    at::Tensor out_rows = out.view({rows.size(0), rows.size(1) / 2});
    impl(rows, out_rows);
  }
  return out;
}

}  // namespace qspec_ext
