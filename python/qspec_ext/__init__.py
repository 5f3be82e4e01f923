"""qspec_ext: kernels for EAGLE-3 speculative decoding with Qwen3-architecture drafters.

The custom ops live in ``torch.ops.qspec_ext``; :mod:`qspec_ext.ops` has a typed,
documented wrapper for each, and :mod:`qspec_ext.reference` the pure-PyTorch spec.
"""

import sys

import torch

try:
    from . import _C
except ImportError as error:  # built against another torch (or a broken install)
    EXTENSION_PROBLEM = (f"qspec_ext's compiled extension does not load with torch {torch.__version__}: {error}. "
                         "Rebuild it against this torch: pip install --no-build-isolation qspec_ext")
    if "vllm.plugins" not in sys.modules:
        raise ImportError(EXTENSION_PROBLEM) from error
    # Inside vLLM's plugin loader the package stays importable (without its API), so the plugin can log
    # one line and leave vLLM stock instead of failing the load with a traceback.
else:
    EXTENSION_PROBLEM = None

if EXTENSION_PROBLEM is None:
    from . import ops, reference
    from .capture import AuxHiddenCapture, default_aux_layer_ids
    from .decode import GenerateResult, SpecDecodeStats, SpeculativeDecoder, generate_plain
    from .models import Eagle3Config, Eagle3Drafter
    from .pair import load_pair
    from .targets import Capabilities, HFTarget, NativeTarget, Target, load_target
    from .ops import (
        eagle3_input_norm,
        fused_add_rms_norm_,
        gather_aux_hidden,
        gather_aux_hidden_out,
        qk_norm_rope_,
        rms_norm,
        verify_greedy,
        verify_greedy_out,
        verify_sampling,
        verify_sampling_out,
        verify_tree_greedy,
        verify_tree_greedy_out,
        verify_tree_sampling,
        verify_tree_sampling_out,
    )
    from .sampling import apply_top_k_top_p
    from .rope import rope_cos_sin_cache

    __version__ = _C.version

__all__ = [
    "AuxHiddenCapture",
    "Capabilities",
    "Target",
    "load_pair",
    "load_target",
    "Eagle3Config",
    "Eagle3Drafter",
    "GenerateResult",
    "HFTarget",
    "NativeTarget",
    "SpecDecodeStats",
    "SpeculativeDecoder",
    "generate_plain",
    "apply_top_k_top_p",
    "build_info",
    "default_aux_layer_ids",
    "gather_aux_hidden",
    "gather_aux_hidden_out",
    "eagle3_input_norm",
    "fused_add_rms_norm_",
    "ops",
    "qk_norm_rope_",
    "reference",
    "rms_norm",
    "rope_cos_sin_cache",
    "verify_greedy",
    "verify_greedy_out",
    "verify_sampling",
    "verify_sampling_out",
    "verify_tree_greedy",
    "verify_tree_greedy_out",
    "verify_tree_sampling",
    "verify_tree_sampling_out",
]


def build_info() -> dict:
    """What this installation was built with (package version, torch versions, CUDA archs) and what
    its CPU kernels use here (``cpu_bf16_dot``: AVX512-BF16 in bf16 ``packed_linear`` and
    ``cached_attention``; ``cpu_amx``: AMX tiles in bf16 ``packed_linear``; ``cpu_avx512``: AVX-512 in
    fp32 ``cached_attention``)."""
    return {
        "version": _C.version,
        "torch_version": torch.__version__,
        "built_with_torch": _C.built_with_torch,
        "cuda_kernels": _C.with_cuda,
        "cuda_archs": [a for a in _C.cuda_archs.split(",") if a],
        "cuda_available": torch.cuda.is_available(),
        "cpu_bf16_dot": _C.cpu_bf16_dot(),
        "cpu_amx": _C.cpu_amx(),
        "cpu_avx512": _C.cpu_avx512(),
    }
