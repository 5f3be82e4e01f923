// Shared definitions of the aux hidden-state gather: torch-free, used by CPU and CUDA.
#pragma once

#include <cstdint>

namespace qspec_ext {

// Most aux layers one gather accepts (drafters use 3; some list more).
constexpr int kMaxAuxLayers = 8;

enum class AuxNormMode : int {
  kNone = 0,          // concat only
  kFcNorm = 1,        // EAGLE 3.1: RMSNorm of each H-wide chunk with its own weight row
  kNormBeforeFc = 2,  // one RMSNorm over the whole n*H concatenation
};

// Raw pointers and strides of one gather; rows of each aux tensor may be strided.
template <typename T>
struct AuxGatherParams {
  const T* aux[kMaxAuxLayers];  // n tensors [T, H], row stride aux_stride[i]
  int64_t aux_stride[kMaxAuxLayers];
  const T* residual[kMaxAuxLayers];  // n tensors [T, H] or all nullptr
  int64_t residual_stride[kMaxAuxLayers];
  const void* indices;  // [N] int32/int64; -1 = padding row (zeros)
  bool indices_i64;
  const void* weight;  // fc_norm: [n, H]; norm_before_fc: [n*H]; none: nullptr
  bool weight_f32;
  T* out;  // [N, n*H], row stride out_stride
  int64_t out_stride;
  int64_t num_rows;    // N
  int64_t num_source;  // T
  int num_aux;         // n
  int hidden;          // H
  float eps;
  AuxNormMode mode;
};

}  // namespace qspec_ext
