#!/usr/bin/env bash
# The one script to run on a lent GPU machine (offline; torch, nvcc, cmake, ninja,
# pybind11, pytest and compute-sanitizer preinstalled). Within about 8 minutes it:
#   1. builds and installs qspec_ext offline for this GPU's arch only,
#   2. runs the whole test suite (CPU and CUDA),
#   3. runs the CUDA kernel tests under compute-sanitizer memcheck,
#   4. runs every benchmark with --check,
# and writes report.md, report.json and the logs into OUT_DIR. A failing step is
# recorded and the next one still runs; the exit code is non-zero if any step failed.
#
#   benchmarks/gpu_check.sh OUT_DIR
#   benchmarks/gpu_check.sh --build-only OUT_DIR   # step 1 as a wheel, no GPU needed (CI runs this)
set -uo pipefail

build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; shift; fi
out=$(mkdir -p "${1:?usage: gpu_check.sh [--build-only] OUT_DIR}" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}

arch=${QSPEC_CUDA_ARCHS:-}
if [ -z "$arch" ] && command -v nvidia-smi >/dev/null; then
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')
fi
arch=${arch:-9.0}

# The offline build: no network, no build isolation, no dependency resolution.
build=(env QSPEC_CUDA=1 QSPEC_CUDA_ARCHS="$arch" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
       "$py" -m pip --no-input)
pip_flags=(--no-build-isolation --no-deps --no-index)

if [ "$build_only" = 1 ]; then
  echo "gpu_check: build step only (arch $arch)"
  "${build[@]}" wheel "${pip_flags[@]}" -w "$out" . >"$out/build.log" 2>&1 || { tail -n 40 "$out/build.log"; exit 1; }
  "$py" - "$out" <<'PY'
import sys, zipfile, glob
wheel = glob.glob(f"{sys.argv[1]}/qspec_ext-*.whl")[0]
names = zipfile.ZipFile(wheel).namelist()
assert any(n.startswith("qspec_ext/_C") and n.endswith(".so") for n in names), names
print(f"gpu_check: build step OK: {wheel}")
PY
  exit $?
fi

declare -a steps=()
status=0
run_step() {  # name, timeout seconds, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS rc=0
  echo "== $name"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  local took=$((SECONDS - start))
  tail -n 5 "$out/$name.log"
  steps+=("$name|$rc|$took")
  [ "$rc" = 0 ] || status=1
}

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
run_step build 240 "${build[@]}" install "${pip_flags[@]}" .
run_step build_info 60 "$py" -c "import json, qspec_ext; i = qspec_ext.build_info(); print(json.dumps(i)); assert i['cuda_kernels'] and i['cuda_available'], i"
run_step tests 180 "$py" -m pytest -q -p no:cacheprovider tests
run_step sanitizer 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
  "$py" -m pytest -q -p no:cacheprovider tests -k "cuda and not out_of_range and not compile and not opcheck and not distribution"
for bench in benchmarks/bench_*.py; do
  name=$(basename "$bench" .py)
  # torch.compile baselines would spend minutes compiling every shape: CPU runs report them.
  run_step "$name" 60 "$py" "$bench" --check --min-time 0.1 --no-compile --json "$out/$name.json"
done

"$py" - "$out" "${steps[@]}" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
steps = [dict(zip(("step", "rc", "seconds"), s.split("|"))) for s in sys.argv[2:]]
benches = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("bench_*.json"))}
(out / "report.json").write_text(json.dumps({"steps": steps, "benchmarks": benches}, indent=1))
lines = ["# qspec_ext GPU check", "", "| step | result | seconds | last line |", "|---|---|---|---|"]
for s in steps:
    log = (out / f"{s['step']}.log").read_text(errors="replace").strip().splitlines()
    lines.append(f"| {s['step']} | {'ok' if s['rc'] == '0' else 'FAILED rc=' + s['rc']} | {s['seconds']} | {log[-1] if log else ''} |")
for name in benches:
    log = (out / f"{name}.log").read_text(errors="replace")
    lines += ["", f"## {name}", "", "```", log.strip()[-6000:], "```"]
(out / "report.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines[:4 + len(steps)]))
PY
exit $status
