"""qspec_ext: kernels for EAGLE-3 speculative decoding with Qwen3-architecture drafters.

The custom ops live in ``torch.ops.qspec_ext``; :mod:`qspec_ext.ops` has a typed,
documented wrapper for each, and :mod:`qspec_ext.reference` the pure-PyTorch spec.
"""

import sys
import warnings
from pathlib import Path

import torch

# The compiled ops are on torch's stable ABI as of this version: one build loads in it and every later torch.
TORCH_TARGET = (2, 10)


def _load_cuda_kernels() -> tuple[bool, str | None]:
    """The CUDA kernels are a library of their own, _C_cuda.so, loaded where torch is a CUDA build (a
    CPU build of torch, vLLM's for one, has no libtorch_cuda for it to link). Returns (loaded, why not)."""
    if not _C.with_cuda:
        return False, "this build has no CUDA kernels"
    if torch.version.cuda is None:
        return False, "torch is a CPU build"
    if int(torch.version.cuda.split(".")[0]) < int(_C.cuda_version.split(".")[0]):
        return False, (f"they are built with CUDA {_C.cuda_version} (its runtime linked in), torch with CUDA "
                       f"{torch.version.cuda}: its driver may be too old for them")
    try:
        torch.ops.load_library(str(Path(__file__).with_name("_C_cuda.so")))
    except OSError as error:  # the CPU ops stay usable
        warnings.warn(f"qspec_ext: the CUDA kernels did not load: {error}")
        return False, f"_C_cuda.so did not load: {error}"
    return True, None


def _torch_older_than(version: tuple[int, int]) -> bool:
    try:
        return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < version
    except ValueError:  # an unusual version string: the extension's own load decides
        return False


try:
    if _torch_older_than(TORCH_TARGET):
        raise ImportError(f"it needs torch >= {TORCH_TARGET[0]}.{TORCH_TARGET[1]} (the stable ABI it is built on)")
    from . import _C

    CUDA_KERNELS, CUDA_KERNELS_OFF = _load_cuda_kernels()
except ImportError as error:  # a torch too old, a broken install or build
    CUDA_KERNELS, CUDA_KERNELS_OFF = False, None
    EXTENSION_PROBLEM = (f"qspec_ext's compiled extension does not load with torch {torch.__version__}: {error}. "
                         "Reinstall or rebuild it: pip install --no-build-isolation qspec_ext")
    if "vllm.plugins" not in sys.modules:
        raise ImportError(EXTENSION_PROBLEM) from error
    # Inside vLLM's plugin loader the package stays importable (without its API), so the plugin can log
    # one line and leave vLLM stock instead of failing the load with a traceback.
else:
    EXTENSION_PROBLEM = None

if EXTENSION_PROBLEM is None:
    from . import ops, reference
    from .capture import AuxFeatures, AuxHiddenCapture, default_aux_layer_ids
    from .decode import DecodeStats, GenerateResult, SpecDecodeStats, SpeculativeDecoder, generate_plain
    from .models import Eagle3Config, Eagle3Drafter
    from .pair import load_pair
    from .targets import Capabilities, HFTarget, NativeTarget, Target, TargetOutput, load_target
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
    "AuxFeatures",
    "AuxHiddenCapture",
    "Capabilities",
    "Target",
    "TargetOutput",
    "load_pair",
    "load_target",
    "Eagle3Config",
    "Eagle3Drafter",
    "GenerateResult",
    "HFTarget",
    "NativeTarget",
    "DecodeStats",
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
    """What this installation was built with (package version, the ABI and the torch versions it is
    for, CUDA archs) and what its kernels use here (``cuda_kernels``: compiled in and loaded, torch
    being a CUDA build of the same or a later CUDA major version, else ``cuda_kernels_off_because``;
    ``cpu_bf16_dot``: AVX512-BF16 in bf16 ``packed_linear`` and ``cached_attention``; ``cpu_amx``: AMX
    tiles in bf16 ``packed_linear``; ``cpu_avx512``: AVX-512 in fp32 ``cached_attention``)."""
    return {
        "version": _C.version,
        "torch_version": torch.__version__,
        "built_with_torch": _C.built_with_torch,
        "abi": f"LibTorch stable ABI, torch >= {_C.torch_target_version}; CPython abi3",
        "torch_versions": f">={_C.torch_target_version}",
        "cuda_kernels_built": bool(_C.with_cuda),
        "cuda_version_built": _C.cuda_version or None,
        "cuda_kernels": CUDA_KERNELS,
        "cuda_kernels_off_because": CUDA_KERNELS_OFF,
        "cuda_archs": [a for a in _C.cuda_archs.split(",") if a],
        "cuda_available": torch.cuda.is_available(),
        "cpu_bf16_dot": _C.cpu_bf16_dot(),
        "cpu_amx": _C.cpu_amx(),
        "cpu_avx512": _C.cpu_avx512(),
    }
