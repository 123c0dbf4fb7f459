#!/usr/bin/env bash
# One command for a machine with a GPU: builds the extension against the python3 that holds
# torch there (no venv, no downloads: the H200 lent to this project reaches no registry), runs
# the GPU tests, the same under compute-sanitizer memcheck, the CMake package's C++ consumer on
# the GPU, and the benchmark on the GPU, writing everything into OUTDIR.
#   usage: tools/check-gpu.sh OUTDIR
# Files: nvidia-smi.txt, build.log, build_info.json, pytest.log, pytest.xml, memcheck.log,
#        shared.log, cmake.log, bench-<op>.log, bench-<date>-<device>-<op>.json, summary.txt
#        (each stage's exit, and per bench op a line of every case's speedup_vs_vllm)
#
# Every stage has a time limit, so that a lent GPU's minutes go where they were planned and a
# hang in one stage still leaves the others' results (a stage cut short exits 124). The defaults
# fit one call of at most nine minutes on an H200 (build 40 s, tests 90 s there on 2026-12-04),
# leaving a lease of 15 minutes room for the machine's start and a second, shorter call:
#   TESTS          pytest -k expression (default "cuda or gpu or linking": the GPU tests and how
#                  this machine's compiler linked the modules; the CPU kernels and the SIMT
#                  emulator are CI's, on every run); TESTS="" runs the whole suite. With vLLM
#                  0.34.0 importable (PYTHONPATH=its unpacked site), that includes the check of
#                  our host decode of disk_offload's FP8/NVFP4 rows against vLLM's decode_rows
#                  (tests/test_vllm_disk_offload_step.py, ..._on_the_gpu)
#   TEST_WORKERS   pytest-xdist workers (default 8), TESTS_SECONDS (default 150)
#   SHARED_SECONDS tools/shared_gpu_check.py's limit (default 60; 0 skips): the shared table file's
#                  registered mapping (whole, and a vLLM rank's rows) against a pinned table
#   MEMCHECK_TESTS (default: the GPU kernel tests that cover every kernel and layout),
#   MEMCHECK_SECONDS (default 150; 0 skips), CMAKE_SECONDS (default 200, beside the tests; 0 skips)
#   BENCH_OPS      ops to bench (default all, BENCH_FIRST's first), BENCH_CASES (--cases regex; default the headline
#                  shapes, prefill T = 8192 and decode T = 64 / R = 64, as the bench's
#                  registry.HEADLINE_CASES; "." for every case),
#   BENCH_SECONDS  (default 200, all ops together; the first op at most BENCH_FIRST_SHARE
#                  percent of it, default 50), BENCH_REPEAT (timed calls per contender,
#                  default 100: the H200 took 5-8 s a case at that), BENCH_ARGS (more arguments)
# The bench's "vllm" baselines are vLLM 0.33.0's Triton kernels: from an installed vLLM, else
# from ./.vllm-source when present (made beforehand where vLLM is installed with
# `python -m qwen4exp_ext.bench.vllm_triton .vllm-source`, and carried here: git ignores it).
set -uo pipefail
out="${1:?usage: tools/check-gpu.sh OUTDIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# The SIMT emulator runs on the CPU, and CI tests it on every run: device time is for the GPU.
export QWEN4EXP_BUILD_SIMT=0
export QWEN4EXP_BUILD_TARGET=cuda # fail, rather than fall back to a CPU-only build
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# A toolkit whose nvcc on PATH is a wrapper hides its root from torch (as tools/env.sh says).
if [ -z "${CUDA_HOME:-}" ] && [ -f /usr/local/cuda/include/cuda_runtime.h ]; then
  export CUDA_HOME=/usr/local/cuda
fi
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  # Build for the GPU that is here, plus nothing else: the check is about this machine.
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  export TORCH_CUDA_ARCH_LIST
fi
summary="$out/summary.txt"
: >"$summary"
# stage NAME STATUS: one line of the summary (printed again at the end).
stage() { echo "$1: exit $2" | tee -a "$summary"; }
start=$SECONDS
nvidia-smi -L 2>/dev/null | tee "$out/nvidia-smi.txt"

echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs)"
# --no-build-isolation builds with the setuptools that is here: pyproject.toml's floor is not
# enforced then, and an older one fails on its metadata after minutes of nothing.
if ! "$PY" - <<'PYEOF'
import sys, setuptools
major = int(setuptools.__version__.split(".")[0])
print(f"setuptools {setuptools.__version__}")
sys.exit(0 if major >= 77 else f"setuptools {setuptools.__version__} < 77 (pyproject.toml): "
         "carry a newer wheel and put it on PYTHONPATH")
PYEOF
then
  stage build 1
  exit 1
fi
if ! "$PY" -m pip install -v --no-deps --no-build-isolation --no-index -e . >"$out/build.log" 2>&1; then
  tail -n 60 "$out/build.log"
  stage build 1
  exit 1
fi
stage "build ($((SECONDS - start)) s)" 0
"$PY" -c 'import json, qwen4exp_ext; print(json.dumps(qwen4exp_ext.build_info()))' \
  | tee "$out/build_info.json"

# The CMake package check compiles on the CPU while the tests run on the GPU.
cmake_seconds="${CMAKE_SECONDS:-200}"
cmake_pid=""
if [ "$cmake_seconds" != 0 ] && command -v cmake >/dev/null 2>&1; then
  CUDA_ARCH="${TORCH_CUDA_ARCH_LIST//./}" timeout "$cmake_seconds" tools/check-cmake.sh \
    >"$out/cmake.log" 2>&1 &
  cmake_pid=$!
fi

echo "== tests (-k '${TESTS-cuda or gpu or linking}', ${TEST_WORKERS:-8} workers)"
t0=$SECONDS
timeout "${TESTS_SECONDS:-150}" "$PY" -m pytest tests -q -rs -p no:cacheprovider \
  -n "${TEST_WORKERS:-8}" -k "${TESTS-cuda or gpu or linking}" --junitxml "$out/pytest.xml" \
  >"$out/pytest.log" 2>&1
tests_status=$?
tail -n 15 "$out/pytest.log"
stage "tests ($((SECONDS - t0)) s)" $tests_status

echo "== shared table file on the GPU (tools/shared_gpu_check.py: % of the H2D copy)"
shared_seconds="${SHARED_SECONDS:-60}"
if [ "$shared_seconds" != 0 ]; then
  t0=$SECONDS
  timeout "$shared_seconds" "$PY" tools/shared_gpu_check.py >"$out/shared.log" 2>&1
  shared_status=$?
  tail -n 12 "$out/shared.log"
  stage "shared table file ($((SECONDS - t0)) s)" $shared_status
fi

echo "== compute-sanitizer memcheck"
# No caching allocator: memcheck then sees each tensor's own bounds rather than a pooled block's.
# The debug_checks tests of tests/<op>/test_bad_inputs.py run the bad-index data the kernels must survive without debug
# checks. 86: a memory error; 124: ran out of time.
memcheck_seconds="${MEMCHECK_SECONDS:-150}"
memcheck_tests="${MEMCHECK_TESTS:-cuda and (debug_checks or matches_reference or oracle_composition or decode_window)}"
memcheck_status=0
if [ "$memcheck_seconds" != 0 ]; then
  t0=$SECONDS
  if command -v compute-sanitizer >/dev/null 2>&1; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$memcheck_seconds" \
      compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
      "$PY" -m pytest tests -q -p no:cacheprovider -n 4 -k "$memcheck_tests" \
      >"$out/memcheck.log" 2>&1
    memcheck_status=$?
    tail -n 5 "$out/memcheck.log"
  else
    echo "compute-sanitizer not found" | tee "$out/memcheck.log"
    memcheck_status=127
  fi
  stage "memcheck ($((SECONDS - t0)) s)" $memcheck_status
fi

cmake_status=0
if [ -n "$cmake_pid" ]; then
  wait "$cmake_pid"
  cmake_status=$?
  tail -n 3 "$out/cmake.log"
  stage "cmake package, its consumer on this GPU" $cmake_status
fi

echo "== benchmark"
if [ -z "${QWEN4EXP_VLLM_SOURCE:-}" ] && [ -f "$root/.vllm-source/VLLM_VERSION" ]; then
  export QWEN4EXP_VLLM_SOURCE="$root/.vllm-source"
fi
"$PY" -c 'from qwen4exp_ext.bench import vllm_triton as v; print("vLLM kernels:", v.source_origin())'
# --threads all: host threads do not change GPU kernel times; "1,all" would double the run.
device="$("$PY" -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "-"))')"
t0=$SECONDS
# The headline shapes (prefill T = 8192, decode T = 64 / R = 64): the bench's own subset.
headline_cases="$("$PY" -c 'from qwen4exp_ext.bench.registry import HEADLINE_CASES; print(HEADLINE_CASES)')"
bench_seconds="${BENCH_SECONDS:-200}"
bench_status=0
# One process and one JSON per op, each given the time the others left: an op that crashes or
# hangs costs the rest of its own cases, not the other ops' (each JSON keeps the cases run).
# BENCH_FIRST (default host_lookup: the open issue's figures, the step with pinned tables) runs
# before the others, so that a budget cut short costs the ops measured before.
all_ops="$("$PY" -c 'import sys; from qwen4exp_ext.bench.registry import OP_MODULES; first = sys.argv[1].split(); print(*[o for o in first if o in OP_MODULES], *[o for o in OP_MODULES if o not in first])' "${BENCH_FIRST-host_lookup}")"
# shellcheck disable=SC2086 # BENCH_OPS and BENCH_ARGS are word lists
for op in ${BENCH_OPS:-$all_ops}; do
  left=$((bench_seconds - (SECONDS - t0)))
  if [ "$left" -le 0 ]; then
    stage "bench $op (no time left)" 124
    bench_status=124
    continue
  fi
  # The first op (host_lookup, the largest: steps, staged lookups, files) gets at most
  # BENCH_FIRST_SHARE % of the budget, so that the kernels' figures always get the rest.
  if [ "$op" = "${all_ops%% *}" ] && [ -z "${BENCH_OPS:-}" ]; then
    cap=$((bench_seconds * ${BENCH_FIRST_SHARE:-50} / 100))
    [ "$left" -gt "$cap" ] && left=$cap
  fi
  json="$out/bench-$(date +%F)-$device-$op.json"
  timeout "$left" "$PY" -m qwen4exp_ext.bench "$op" --device cuda --threads all \
    --cases "${BENCH_CASES:-$headline_cases}" --repeat "${BENCH_REPEAT:-100}" ${BENCH_ARGS:-} \
    --json "$json" >"$out/bench-$op.log" 2>&1
  op_status=$?
  tail -n 25 "$out/bench-$op.log"
  stage "bench $op ($((SECONDS - t0)) s)" $op_status
  # The JSON keeps every row whole (speedup_vs_vllm, vllm_baseline, vllm_note among them);
  # the summary gets one line of the speedup over vLLM's own code per case ("-": not timed).
  "$PY" "$root/tools/vs_vllm_summary.py" "$json" | tee -a "$summary"
  [ "$op_status" -eq 0 ] || bench_status=$op_status
done
echo "== summary ($((SECONDS - start)) s)"
cat "$summary"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ] && [ "$cmake_status" -eq 0 ] &&
  { [ "$memcheck_status" -eq 0 ] || [ "$memcheck_status" -eq 124 ]; }
