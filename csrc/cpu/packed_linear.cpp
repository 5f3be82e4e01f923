// packed_linear: input [M, K] @ W^T for a weight W [N, K] stored in panels of kPanel output columns,
// packed [ceil(N / kPanel), K, kPanel] (column n of W is lane n % kPanel of panel n / kPanel, zero past
// N): a decode step's GEMM (M = batch x tokens, a few rows) streams each panel once, contiguously,
// and every weight it loads serves all the tile's rows. fp32 or bf16 weights (bf16 widened to fp32 in
// registers: half the bytes streamed), fp32 accumulation, the output in the input's dtype. CPU only:
// on CUDA the projections run cuBLAS on the weight as stored.
//
// Why not oneDNN's packed weights (mkldnn::_reorder_linear_weight + _linear_pointwise, what this op
// called before): on a CPU without AVX-512 oneDNN keeps the plain layout and has no bf16 kernels, and
// each call costs 50-100 us of primitive lookup on top of the GEMM (a 192 x 320 fp32 projection, one
// row: 130 us against F.linear's 23 us; benchmarks/HISTORY.md).
#include <cstdint>
#include <cstring>
#include <string_view>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu_common.h"

namespace qspec_ext {
namespace {

using namespace cpu;

constexpr std::string_view kOp = "packed_linear";
constexpr int64_t kPanel = 16;     // output columns per panel: two 8-lane registers
constexpr int64_t kTileRows = 4;   // input rows per register tile: 8 accumulators + 2 weights + 1 row value
constexpr int64_t kBlockRows = 64; // input rows per work item (a prefill's rows, in L2 while a panel is reused)

typedef uint16_t Halves8 __attribute__((vector_size(16)));
typedef uint32_t Words8 __attribute__((vector_size(32)));

QSPEC_INLINE Lanes8 load_weights(const float* p) { return load8(p); }

// bf16 is the top half of an fp32: widen and shift.
QSPEC_INLINE Lanes8 load_weights(const c10::BFloat16* p) {
  Halves8 h;
  std::memcpy(&h, p, sizeof h);
  const Words8 w = __builtin_convertvector(h, Words8) << 16;
  Lanes8 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// out rows [0, R) x the panel's valid columns = x rows [0, R) (fp32, row stride x_stride) @ the panel.
template <int R, typename W, typename T>
QSPEC_INLINE void panel_tile(const float* __restrict__ x, int64_t x_stride, const W* __restrict__ panel, int64_t K,
                             T* __restrict__ out, int64_t out_stride, int64_t columns) {
  Lanes8 acc[R][2] = {};
  for (int64_t k = 0; k < K; ++k) {
    const Lanes8 w0 = load_weights(panel + k * kPanel), w1 = load_weights(panel + k * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const float v = x[r * x_stride + k];
      acc[r][0] += v * w0;
      acc[r][1] += v * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[kPanel];
    std::memcpy(row, &acc[r][0], sizeof acc[r][0]);
    std::memcpy(row + 8, &acc[r][1], sizeof acc[r][1]);
    for (int64_t c = 0; c < columns; ++c) out[r * out_stride + c] = static_cast<T>(row[c]);
  }
}

// Rows [row, row + rows) of the output, columns of panel p.
template <typename W, typename T>
QSPEC_INLINE void panel_rows_impl(const float* x, int64_t x_stride, const W* packed, int64_t K, int64_t N, int64_t p,
                                  int64_t row, int64_t rows, T* out) {
  const W* panel = packed + p * K * kPanel;
  const int64_t columns = std::min(kPanel, N - p * kPanel);
  T* dst = out + row * N + p * kPanel;
  const float* src = x + row * x_stride;
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    panel_tile<kTileRows>(src + r * x_stride, x_stride, panel, K, dst + r * N, N, columns);
  switch (rows - r) {
    case 3: panel_tile<3>(src + r * x_stride, x_stride, panel, K, dst + r * N, N, columns); break;
    case 2: panel_tile<2>(src + r * x_stride, x_stride, panel, K, dst + r * N, N, columns); break;
    case 1: panel_tile<1>(src + r * x_stride, x_stride, panel, K, dst + r * N, N, columns); break;
    default: break;
  }
}

QSPEC_CPU_CLONES void panel_rows(const float* x, int64_t x_stride, const float* packed, int64_t K, int64_t N,
                                 int64_t p, int64_t row, int64_t rows, float* out) {
  panel_rows_impl(x, x_stride, packed, K, N, p, row, rows, out);
}
QSPEC_CPU_CLONES void panel_rows(const float* x, int64_t x_stride, const c10::BFloat16* packed, int64_t K, int64_t N,
                                 int64_t p, int64_t row, int64_t rows, c10::BFloat16* out) {
  panel_rows_impl(x, x_stride, packed, K, N, p, row, rows, out);
}

template <typename T>
void packed_linear_typed(const at::Tensor& x, const at::Tensor& packed_weight, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), panels = packed_weight.size(0);
  const int64_t row_blocks = (M + kBlockRows - 1) / kBlockRows;
  const float* xs = x.const_data_ptr<float>();
  const T* packed = packed_weight.const_data_ptr<T>();
  T* dst = out.mutable_data_ptr<T>();
  // Items panel-major: a thread's consecutive items reuse one panel over the row blocks.
  const int64_t item_work = std::min(M, kBlockRows) * K * kPanel;
  at::parallel_for(0, panels * row_blocks, grain_for(item_work), [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t p = item / row_blocks, block = item % row_blocks;
      const int64_t row = block * kBlockRows;
      panel_rows(xs, x.stride(0), packed, K, N, p, row, std::min(kBlockRows, M - row), dst);
    }
  });
}

at::Tensor packed_linear_cpu(const at::Tensor& input, const at::Tensor& packed_weight, int64_t out_features) {
  QSPEC_CHECK(input.dim() == 2, kOp, "input", "must be 2-D [rows, in_features], got ", input.dim(), "-D ",
              input.sizes());
  QSPEC_CHECK(packed_weight.dim() == 3 && packed_weight.size(2) == kPanel, kOp, "packed_weight",
              "must be 3-D [ceil(out_features / ", kPanel, "), in_features, ", kPanel,
              "] (qspec_ext.models.linear.pack_weight), got ", packed_weight.sizes());
  QSPEC_CHECK(out_features > 0 && (out_features + kPanel - 1) / kPanel == packed_weight.size(0), kOp, "out_features",
              "must need the packed weight's ", packed_weight.size(0), " panels of ", kPanel, " columns, got ",
              out_features);
  QSPEC_CHECK(input.size(1) == packed_weight.size(1), kOp, "input", "must have ", packed_weight.size(1),
              " columns (the packed weight's in_features), got ", input.sizes());
  QSPEC_CHECK(input.scalar_type() == packed_weight.scalar_type(), kOp, "input", "must have the packed weight's dtype ",
              packed_weight.scalar_type(), ", got ", input.scalar_type());
  QSPEC_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16, kOp, "input",
              "must be float32 or bfloat16, got ", input.scalar_type());
  QSPEC_CHECK(packed_weight.is_contiguous(), kOp, "packed_weight", "must be contiguous, got strides ",
              packed_weight.strides());
  at::Tensor out = at::empty({input.size(0), out_features}, input.options());
  if (input.size(0) == 0 || input.size(1) == 0) return out.zero_();
  // The rows in fp32 with unit column stride (a bf16 input is widened once, not per panel).
  at::Tensor x = input.scalar_type() == at::kFloat && input.stride(1) == 1 ? input : input.to(at::kFloat).contiguous();
  if (input.scalar_type() == at::kFloat)
    packed_linear_typed<float>(x, packed_weight, out);
  else
    packed_linear_typed<c10::BFloat16>(x, packed_weight, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(qspec_ext, CPU, m) { m.impl("packed_linear", &packed_linear_cpu); }

}  // namespace qspec_ext
