// CUDA kernel of the aux hidden-state gather: one block per output row. Without a norm
// the row is copied in one pass; with one, pass 1 reduces the sums of squares (one per
// chunk for fc_norm, one in all for norm_before_fc) and pass 2 re-reads the source rows
// (now in L1/L2) and writes the normalized fc input.

#include "checks.h"
#include "common.cuh"
#include "aux_gather_entry.h"
#include "ops.h"
#include "qspec_ext/aux_gather.h"
#include "qspec_ext/norm_rope.h"

namespace qspec_ext {
namespace {

using cuda::block_sum;
using cuda::load_index;
using cuda::load_mixed;
using cuda::Pack;

// Feature i of source row `src`, elements [e, e + VEC), in fp32.
template <typename T, int VEC>
__device__ __forceinline__ void load_feature(const AuxGatherParams<T>& p, int i, int64_t src, int e,
                                             float (&v)[VEC]) {
  const auto a = *reinterpret_cast<const Pack<T, VEC>*>(p.aux[i] + src * p.aux_stride[i] + e);
#pragma unroll
  for (int k = 0; k < VEC; ++k) v[k] = static_cast<float>(a.v[k]);
  if (p.residual[0] != nullptr) {
    const auto r = *reinterpret_cast<const Pack<T, VEC>*>(p.residual[i] + src * p.residual_stride[i] + e);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] += static_cast<float>(r.v[k]);
  }
}

template <typename T, int VEC>
__global__ void gather_aux_hidden_kernel(const AuxGatherParams<T> p) {
  const int64_t j = blockIdx.x;
  const int H = p.hidden;
  T* out = p.out + j * p.out_stride;
  const int64_t src = load_index(p.indices, p.indices_i64, j);
  if (threadIdx.x == 0)  // one message per bad row
    QSPEC_DEVICE_CHECK(src >= -1 && src < p.num_source,
                       "gather_aux_hidden: indices[%lld] = %lld outside [-1, num_tokens=%lld)", (long long)j,
                       (long long)src, (long long)p.num_source);
  if (src < -1 || src >= p.num_source) return;
  if (src == -1) {  // padding row
    for (int e = threadIdx.x; e < p.num_aux * H; e += blockDim.x) out[e] = T(0);
    return;
  }

  float inv[kMaxAuxLayers];
  if (p.mode != AuxNormMode::kNone) {
    float total = 0.f;
    for (int i = 0; i < p.num_aux; ++i) {
      float ss = 0.f;
      for (int e = threadIdx.x * VEC; e < H; e += blockDim.x * VEC) {
        float v[VEC];
        load_feature<T, VEC>(p, i, src, e, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) ss += v[k] * v[k];
      }
      if (p.mode == AuxNormMode::kFcNorm) {
        inv[i] = rms_inv(block_sum(ss), H, p.eps);
      } else {
        total += ss;
      }
    }
    if (p.mode == AuxNormMode::kNormBeforeFc) {
      const float all = rms_inv(block_sum(total), p.num_aux * H, p.eps);
      for (int i = 0; i < p.num_aux; ++i) inv[i] = all;
    }
  }

  for (int i = 0; i < p.num_aux; ++i) {
    const float scale = p.mode == AuxNormMode::kNone ? 1.f : inv[i];
    for (int e = threadIdx.x * VEC; e < H; e += blockDim.x * VEC) {
      float v[VEC];
      load_feature<T, VEC>(p, i, src, e, v);
      Pack<T, VEC> o;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float w = p.mode == AuxNormMode::kNone ? 1.f : load_mixed<T>(p.weight, p.weight_f32, i * H + e + k);
        o.v[k] = static_cast<T>(v[k] * scale * w);
      }
      *reinterpret_cast<Pack<T, VEC>*>(out + i * H + e) = o;
    }
  }
}

}  // namespace

void gather_aux_hidden_cuda(std::string_view op, const TensorList& aux, const Tensor& indices,
                            const std::optional<TensorList>& residual,
                            const std::optional<Tensor>& norm_weight, double eps, const AuxGatherShape& s,
                            Tensor& out) {
  QSPEC_CHECK(aux[0].is_cuda(), op, "aux[0]", "must be a CUDA tensor for the CUDA kernel, got ", aux[0].device());
  if (s.num_rows == 0 || s.hidden == 0) return;
  const cuda::DeviceContext context(aux[0]);
  const cudaStream_t stream = context.stream();
  QSPEC_DISPATCH_ACTIVATION(dtype_of(aux[0]), "gather_aux_hidden_cuda", [&] {
    const AuxGatherParams<scalar_t> p = aux_gather_params<scalar_t>(aux, indices, residual, norm_weight, eps, s, out);
    std::vector<cuda::RowPtr> rows{{out.mutable_data_ptr(), out.stride(0)}};
    for (int i = 0; i < s.num_aux; ++i) {
      rows.emplace_back(p.aux[i], p.aux_stride[i]);
      if (s.has_residual) rows.emplace_back(p.residual[i], p.residual_stride[i]);
    }
    cuda::with_vec<scalar_t>(cuda::pick_vec<scalar_t>(s.hidden, rows), [&](auto V) {
      constexpr int vec = decltype(V)::value;
      gather_aux_hidden_kernel<scalar_t, vec>
          <<<s.num_rows, cuda::row_threads(s.hidden, vec), 0, stream>>>(p);
    });
  });
  QSPEC_KERNEL_LAUNCH_CHECK();
}

STABLE_TORCH_LIBRARY_IMPL(qspec_ext, CUDA, m) {
  m.impl("gather_aux_hidden", TORCH_BOX((&gather_aux_hidden_entry<gather_aux_hidden_cuda>)));
  m.impl("gather_aux_hidden_out", TORCH_BOX((&gather_aux_hidden_out_entry<gather_aux_hidden_cuda>)));
}

}  // namespace qspec_ext
