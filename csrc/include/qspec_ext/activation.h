// Shared definitions of the gated MLP's activation: torch-free, used by CPU and CUDA.
#pragma once

#include "qspec_ext/norm_rope.h"  // QSPEC_HOST_DEVICE

namespace qspec_ext {

// silu(gate) * up = gate / (1 + e^-gate) * up, in fp32, given exp_neg_gate = e^-gate (each device
// computes it its own way; infinite or saturated for a gate below about -88, the result is then 0
// or within 1e-36 of it, as silu's limit).
QSPEC_HOST_DEVICE float silu_mul(float gate, float up, float exp_neg_gate) {
  return gate / (1.f + exp_neg_gate) * up;
}

}  // namespace qspec_ext
