#!/usr/bin/env bash
# The one script to run on a lent GPU machine (offline; torch, nvcc, cmake, ninja,
# pytest and compute-sanitizer preinstalled). Within GPU_CHECK_BUDGET seconds
# (default 480) it runs the steps below in order; each has its own time limit, a step
# that no longer fits is recorded as skipped, a failing one is recorded and the next
# still runs. report.md (pass/fail per step, then the three rows furthest below the
# measured copy bandwidth), report.json and every step's log land in OUT_DIR, rewritten
# after each step, so a run cut short still leaves the verdicts of the steps it finished.
#   build             build and install qspec_ext offline for this GPU's arch only
#   ptxas             registers, stack, shared memory and spills per kernel (ptxas.txt); fails on a spill store
#   build_info        the CUDA kernels are in, a GPU is visible, an error message formats
#   tests             the CUDA cases of the test suite (CI runs the rest)
#   decode            end-to-end decode of the shipped pair in bf16: plain vs speculative tokens/s
#   table             benchmarks/gpu_table.py: verification one block per row vs split-V, attention
#                     vs flash SDPA, compiled chain vs plain; printed last
#   sanitizer_*       compute-sanitizer memcheck over the CUDA kernel tests; racecheck,
#                     synccheck and initcheck over one small shape per kernel
#   cuda_graphs       every op captured in a CUDA graph and replayed (also in the suite)
#   bench_*           every kernel benchmark with --check (GB/s as a fraction of copy bandwidth)
# The exit code is non-zero if any step failed. GPU_CHECK_LIMIT_SCALE=N multiplies every
# step's time limit (dry runs on slower machines: PYTHON=<a venv's python> keeps the install there).
#
#   benchmarks/gpu_check.sh OUT_DIR
#   benchmarks/gpu_check.sh --build-only OUT_DIR   # build + ptxas as a wheel, no GPU needed (CI runs this)
#   GPU_CHECK_WHEEL=qspec_ext-...-cp310-abi3-linux_x86_64.whl benchmarks/gpu_check.sh OUT_DIR
#                                                  # installs that wheel instead of building (no ptxas step)
set -uo pipefail

build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; shift; fi
out=$(mkdir -p "${1:?usage: gpu_check.sh [--build-only] OUT_DIR}" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
budget=${GPU_CHECK_BUDGET:-480}

arch=${QSPEC_CUDA_ARCHS:-}
if [ -z "$arch" ] && command -v nvidia-smi >/dev/null; then
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ')
fi
arch=${arch:-9.0}

# The offline build: no network, no build isolation, no dependency resolution. It builds in
# a fresh tree (not ./build, which an earlier build leaves up to date) so that ptxas compiles
# every kernel, and pip -v passes ptxas's -v report through into build.log.
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
printf '[build]\nbuild_base = %s\n' "$tree" >"$tree/setup.cfg"
build=(env QSPEC_CUDA=1 QSPEC_CUDA_ARCHS="$arch" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
       CUDAFLAGS="${CUDAFLAGS:-} -Xptxas -v" DIST_EXTRA_CONFIG="$tree/setup.cfg" "$py" -m pip --no-input -v)
pip_flags=(--no-build-isolation --no-deps --no-index)

# build.log -> ptxas.txt: one line per (kernel, arch); exit 1 on a spill store or on no report at all.
IFS= read -r -d '' ptxas_py <<'PY'
import re, shutil, subprocess, sys
log, dest = sys.argv[1:3]
kernels, entry, func, spilled = {}, None, None, []  # entry: the (mangled name, arch) being reported on
for line in open(log, errors="replace"):
    if m := re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line):
        entry = (m[1], m[2])
    elif m := re.search(r"Function properties for (\S+)", line):
        func = m[1]
    elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
        if entry and func == entry[0]:
            kernels[entry] = dict(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        if int(m[2]):  # an entry's or a called function's
            spilled.append((func, f" ({entry[1] if entry else '?'}): {m[2]} bytes"))
    elif entry in kernels and (m := re.search(r"Used (\d+) registers", line)):
        smem = re.search(r"(\d+) bytes smem", line)
        kernels[entry].update(registers=int(m[1]), smem=int(smem[1]) if smem else 0)
        entry = None
if not kernels:
    sys.exit(f"ptxas: no 'ptxas info' lines in {log} (built without -Xptxas -v, or without CUDA kernels?)")

def short(name):  # "void ns::(anonymous namespace)::k<c10::BFloat16, 8>(args)" -> "k<BFloat16, 8>"
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0 and name[i] == "(":
            name = name[:i]
            break
    return re.sub(r"(\(anonymous namespace\)|\w+)::", "", name.removeprefix("void "))

mangled = sorted({k for k, _ in kernels})
demangle = shutil.which("cu++filt") or shutil.which("c++filt")
names = subprocess.run([demangle], input="\n".join(mangled), capture_output=True, text=True).stdout.splitlines() if demangle else []
names = dict(zip(mangled, map(short, names))) if len(names) == len(mangled) else {m: m for m in mangled}
rows = sorted((names[k], arch, v) for (k, arch), v in kernels.items())
width = max(len(r[0]) for r in rows)
lines = ["# ptxas -v per kernel: registers per thread; bytes per thread of stack frame (local memory),",
         "# spill stores and loads; bytes per block of static shared memory",
         f"{'kernel':<{width}}  arch    regs  stack  smem  spill_st  spill_ld"]
lines += [f"{n:<{width}}  {a:<6} {v['registers']:>5}  {v['stack']:>5}  {v['smem']:>4}  {v['spill_stores']:>8}  {v['spill_loads']:>8}"
          for n, a, v in rows]
open(dest, "w").write("\n".join(lines) + "\n")
families = {}
for n, a, v in rows:
    families.setdefault((n.split("<")[0], a), []).append(v)
print(f"ptxas: {len(rows)} kernels (all in {dest})")
for (family, a), vs in sorted(families.items()):
    regs = sorted(v["registers"] for v in vs)
    print(f"  {family:<28} {a}  {len(vs):>2} instances  registers {regs[0]}-{regs[-1]}  "
          f"stack <= {max(v['stack'] for v in vs)}  smem <= {max(v['smem'] for v in vs)}  "
          f"spill stores {sum(v['spill_stores'] for v in vs)}")
if spilled:
    sys.exit("ptxas: spill stores in " + "; ".join(names.get(f, f) + rest for f, rest in spilled))
print("ptxas: no spill stores")
PY

if [ "$build_only" = 1 ]; then
  echo "gpu_check: build step only (arch $arch)"
  "${build[@]}" wheel "${pip_flags[@]}" -w "$out" . >"$out/build.log" 2>&1 || { tail -n 40 "$out/build.log"; exit 1; }
  "$py" - "$out" <<'PY' || exit 1
import sys, zipfile, glob
wheel = glob.glob(f"{sys.argv[1]}/qspec_ext-*.whl")[0]
names = zipfile.ZipFile(wheel).namelist()
assert {"qspec_ext/_C.abi3.so", "qspec_ext/_C_cuda.so"} <= set(names), names
print(f"gpu_check: build step OK: {wheel}")
PY
  "$py" -c "$ptxas_py" "$out/build.log" "$out/ptxas.txt"
  exit $?
fi

# report.md starts with one line per step, then the three worst rows of all the benchmarks.
IFS= read -r -d '' report_py <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
steps = [dict(zip(("step", "rc", "seconds"), s.split("|"))) for s in sys.argv[2:]]
results = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "report.json"}
(out / "report.json").write_text(json.dumps({"steps": steps, "results": results}, indent=1))

def log_tail(step, n):
    path = out / f"{step}.log"
    return path.read_text(errors="replace").strip().splitlines()[-n:] if path.exists() else []

def verdict(s):
    last = (log_tail(s["step"], 1) or [""])[0]
    return {"0": f"ok ({s['seconds']} s)",
            "unavailable": "sanitizer unavailable on this machine",
            "skipped": "skipped: no time left in the budget",
            "running": "did not finish: the run ended during this step"}.get(
        s["rc"], f"FAILED ({'timed out' if s['rc'] in ('124', '137') else 'rc=' + s['rc']}, {s['seconds']} s): {last}")

failed = [s["step"] for s in steps if s["rc"] not in ("0", "unavailable", "skipped")]
skipped = [s["step"] for s in steps if s["rc"] == "skipped"]
summary = "; ".join([f"FAILED: {', '.join(failed)}"] * bool(failed) + [f"skipped: {', '.join(skipped)}"] * bool(skipped))
lines = [f"# qspec_ext GPU check: {summary or 'all steps passed'}", ""]
lines += [f"- {s['step']}: {verdict(s)}" for s in steps]
worst = sorted((dict(r, bench=name, copy=b.get("meta", {}).get("copy_bandwidth")) for name, b in results.items()
                for r in b.get("worst_rows", [])), key=lambda r: r["fraction"])[:3]
lines += ["", "worst % of copy bandwidth:"]
lines += [f"- {r['op']} {r['shape']} {r['dtype']}: {100 * r['fraction']:.1f}% of {r['copy'] / 1e9:.0f} GB/s ({r['bench']})"
          if r["copy"] else f"- {r['op']} {r['shape']} {r['dtype']}: {100 * r['fraction']:.1f}% ({r['bench']})"
          for r in worst] or ["- none: no benchmark JSON with worst_rows"]
for s in steps:
    if s["rc"] != "skipped":
        lines += ["", f"## {s['step']}", "", "```", *log_tail(s["step"], 60), "```"]
(out / "report.md").write_text("\n".join(lines) + "\n")
PY

declare -a steps=()
status=0
report() { "$py" -c "$report_py" "$out" "${steps[@]}" "$@"; }
run_step() {  # name, time limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS rc=0 left=$((budget - SECONDS))
  limit=$((limit * ${GPU_CHECK_LIMIT_SCALE:-1}))
  if [ "$left" -lt 20 ]; then
    steps+=("$name|skipped|0"); status=1; report; return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (limit $limit s)"
  report "$name|running|"
  # SIGINT first: pytest then still prints which tests failed before it was stopped.
  timeout -s INT -k 10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  case $name in
    sanitizer_*) grep -q "Device not supported" "$out/$name.log" && rc=unavailable ;;
  esac
  tail -n 5 "$out/$name.log"
  steps+=("$name|$rc|$((SECONDS - start))")
  [ "$rc" = 0 ] || [ "$rc" = unavailable ] || status=1
  report
}

pytest=("$py" -m pytest -q -p no:cacheprovider -o addopts="")  # one process unless workers say so
# One small shape per CUDA kernel (rms_norm, fused_add_rms_norm, eagle3_input_norm,
# qk_norm_rope, gather_aux_hidden, verify row_stats + emit (and split-V), tree token + walk, cached_attention,
# silu_and_mul):
# racecheck and synccheck
# slow kernels down by orders of magnitude, memcheck's broad selection would not fit.
kernel_tests=(
  "tests/test_norm_rope.py::test_rms_norm[cuda-False-shape1-dtype2]"
  "tests/test_norm_rope.py::test_fused_add_rms_norm[cuda-False-shape1-dtype2]"
  "tests/test_norm_rope.py::test_eagle3_input_norm[cuda-False-7-4096-dtype2]"
  "tests/test_norm_rope.py::test_qk_norm_rope[cuda-T16-h32x8-D128-rot128-bfloat16-neox-weight_f32-kv_cache]"
  "tests/test_aux_gather.py::test_gather_aux_hidden[cuda-n3-H4096-N5-float16-fc_norm]"
  "tests/test_verify.py::test_greedy_matches_reference[cuda-5-3-1000-dtype2]"
  "tests/test_verify.py::test_sampling_matches_reference[cuda-dtype2-d2t]"
  "tests/test_verify.py::test_sampling_cpu_equals_cuda[1000-dtype2-d2t-always]"
  "tests/test_verify_tree.py::test_sampling_matches_reference[cuda-24-3-5-dtype1]"
  "tests/test_attention.py::test_draft_trees_match_the_reference[cuda-6-dtype1]"
  "tests/test_activation.py::test_strided_rows[cuda]"
)
sanitize=(compute-sanitizer --error-exitcode 1 --tool)

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
if [ -n "${GPU_CHECK_WHEEL:-}" ]; then  # a wheel built elsewhere (CI's one wheel: sm_80 to sm_120): no build here
  run_step install 60 "$py" -m pip install --force-reinstall "${pip_flags[@]}" "$GPU_CHECK_WHEEL"
else
  run_step build 240 "${build[@]}" install "${pip_flags[@]}" .
  run_step ptxas 30 "$py" -c "$ptxas_py" "$out/build.log" "$out/ptxas.txt"
fi
# ... and an error message that formats numbers does not crash the process (a C++ runtime linked
# into _C statically did: CMakeLists.txt links torch's libstdc++).
run_step build_info 60 "$py" -c "
import json, torch, qspec_ext
i = qspec_ext.build_info(); print(json.dumps(i)); assert i['cuda_kernels'] and i['cuda_available'], i
for device in ('cpu', 'cuda'):
    try:
        qspec_ext.rms_norm(torch.zeros(2, 8, device=device), torch.ones(4, device=device))
    except RuntimeError as e:
        assert 'must have shape [8], got [4]' in str(e), e
    else:
        raise SystemExit('rms_norm took a weight of the wrong shape')
print('error messages: ok')"
# CPU-only tests are CI's job (every run); here the CUDA cases (device-parametrized ids hold "cuda").
# In 8 pytest-xdist workers where it is installed (it is on the H200 image): a test that crashes
# the process then fails alone, named, instead of ending the step (the first GPU run lost its last
# hundred tests to one segfault).
workers=()
"$py" -c "import xdist" 2>/dev/null && workers=(-n 8)
run_step tests 180 "${pytest[@]}" "${workers[@]}" tests -k "cuda and not test_compiled"
# bf16: a mismatch with plain decoding is reported, not a failure (the verify forward rounds differently).
# Eager vs compiled (CUDA graphs) decoding, and the drafter step / verify forward split.
# +cudagraphs logs each CUDA-graph recording and why a graph records again ("static input data
# pointer changed"): on the first GPU run the compiled speculative step ran about as fast as eager.
run_step decode 180 env TORCH_LOGS=+cudagraphs "$py" benchmarks/bench_decode.py --device cuda --dtype bf16 --modes eager compiled --repeat 1 \
  --json "$out/decode.json"
# The one table: each kernel old vs new (% of copy bandwidth, identical outputs), attention
# against flash SDPA, compiled chain vs compiled plain (from the decode step's JSON).
run_step table 90 "$py" benchmarks/gpu_table.py --decode-json "$out/decode.json" --json "$out/table.json"
run_step sanitizer_memcheck 120 "${sanitize[@]}" memcheck \
  "${pytest[@]}" tests -k "cuda and not out_of_range and not compile and not opcheck and not distribution and not long_contexts"
for tool in racecheck synccheck initcheck; do
  if [[ "${steps[-1]}" == *"|unavailable|"* ]]; then  # the sanitizer cannot run here: say so once per tool
    echo "== sanitizer_$tool: sanitizer unavailable on this machine"
    steps+=("sanitizer_$tool|unavailable|0"); report
  else
    run_step "sanitizer_$tool" 60 "${sanitize[@]}" "$tool" "${pytest[@]}" "${kernel_tests[@]}"
  fi
done
run_step cuda_graphs 40 "${pytest[@]}" tests/test_cuda_graphs.py
# compile=True on CUDA: the decode steps as CUDA graphs (mode="reduce-overhead"), == eager.
run_step compiled_decode 150 "${pytest[@]}" tests/test_compiled.py -k "cuda and not sampling"
# The kernel benchmarks (the others take other arguments: bench_decode below; bench_train,
# bench_hf_targets and bench_vllm are CPU-side comparisons).
# bench_attention: decode attention at context 1k / 8k / 32k (Qwen3-8B heads), bytes = the used K/V.
for name in bench_norm_rope bench_aux_gather bench_verify bench_attention; do
  # torch.compile baselines would spend minutes compiling every shape: CPU runs report them.
  run_step "$name" 60 "$py" "benchmarks/$name.py" --check --min-time 0.1 --no-compile --json "$out/$name.json"
done
sed -n '1,/^## /p' "$out/report.md" | sed '$d'
sed -n '/^qspec_ext GPU table/,$p' "$out/table.log"
exit $status
