// The silu_and_mul op's entry point, written once: the device check, argument checks and output
// allocation around a device half (silu_and_mul_cpu / _cuda in ops.h).
#pragma once

#include <vector>


#include "checks.h"
#include "norm_rope_entry.h"  // check_kernel_device

namespace qspec_ext {

// rows: the input as validated [R, 2I] rows (strided rows allowed); out: [R, I], contiguous.
using SiluAndMulImpl = void (*)(const Tensor& rows, Tensor& out);

template <DeviceType device, SiluAndMulImpl impl>
Tensor silu_and_mul_entry(const Tensor& input) {
  check_kernel_device<device>("silu_and_mul", "input", input);
  const Tensor rows = check_silu_and_mul(input);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() /= 2;
  Tensor out = empty(sizes, input);
  if (out.numel() > 0) {
    Tensor out_rows = as_strided(out, {rows.size(0), rows.size(1) / 2}, {rows.size(1) / 2, 1});
    impl(rows, out_rows);
  }
  return out;
}

}  // namespace qspec_ext
