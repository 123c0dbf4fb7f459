#!/usr/bin/env bash
# One command for a machine with a GPU: builds the extension against the python3 that holds
# torch there (no venv, no downloads: the H200 lent to this project reaches no registry), runs
# the test suite on CPU and GPU, and the benchmark on the GPU, writing everything into OUTDIR.
#   usage: tools/gpu_check.sh OUTDIR
# Files: build_info.json, build.log, pytest.log, pytest.xml, memcheck.log, cmake.log,
#        bench-<date>-<device>.json, bench.log (8 with nvidia-smi.txt: the device tool returns 8)
# MEMCHECK_SECONDS (default 240) bounds the compute-sanitizer run; 0 skips it.
# The bench's "vllm" baselines are vLLM 0.33.0's Triton kernels: from an installed vLLM, else
# from ./.vllm-source when present (made beforehand where vLLM is installed with
# `python -m qwen4exp_ext.bench.vllm_triton .vllm-source`, and carried here: git ignores it).
set -uo pipefail
out="${1:?usage: tools/gpu_check.sh OUTDIR}"
mkdir -p "$out"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# The SIMT emulator runs on the CPU, and CI tests it on every run: device time is for the GPU.
export QWEN4EXP_BUILD_SIMT=0
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  # Build for the GPU that is here, plus nothing else: the check is about this machine.
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  export TORCH_CUDA_ARCH_LIST
fi
nvidia-smi -L 2>/dev/null | tee "$out/nvidia-smi.txt"

echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
start=$SECONDS
if ! "$PY" -m pip install -v --no-deps --no-build-isolation --no-index -e . >"$out/build.log" 2>&1; then
  tail -n 60 "$out/build.log"
  echo "== build FAILED"
  exit 1
fi
echo "== built in $((SECONDS - start)) s"
"$PY" -c 'import json, qwen4exp_ext; print(json.dumps(qwen4exp_ext.build_info()))' \
  | tee "$out/build_info.json"

echo "== tests"
"$PY" -m pytest tests -q -rs --junitxml "$out/pytest.xml" 2>&1 | tee "$out/pytest.log"
tests_status=${PIPESTATUS[0]}

echo "== compute-sanitizer memcheck over the GPU tests"
# The GPU cases only (their ids say cuda; tests/test_gpu_debug_checks.py runs the bad-index data
# that the kernels must survive without debug checks). No caching allocator: memcheck then sees
# each tensor's own bounds rather than a pooled block's. A timeout ends a slow run early (124).
memcheck_seconds="${MEMCHECK_SECONDS:-240}"
memcheck_status=0
if [ "$memcheck_seconds" != 0 ]; then
  if command -v compute-sanitizer >/dev/null 2>&1; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$memcheck_seconds" \
      compute-sanitizer --tool memcheck --error-exitcode 86 --print-limit 20 \
      "$PY" -m pytest tests -q -x -p no:cacheprovider -k "cuda or gpu_debug_checks" \
      >"$out/memcheck.log" 2>&1
    memcheck_status=$?
    tail -n 5 "$out/memcheck.log"
  else
    echo "compute-sanitizer not found" | tee "$out/memcheck.log"
    memcheck_status=127
  fi
fi
echo "== memcheck exit $memcheck_status (86: a memory error; 124: ran out of time)"

echo "== CMake package (tools/check-cmake.sh: its C++ consumer runs on this GPU)"
cmake_status=0
if command -v cmake >/dev/null 2>&1; then
  CUDA_ARCH="${TORCH_CUDA_ARCH_LIST//./}" tools/check-cmake.sh >"$out/cmake.log" 2>&1
  cmake_status=$?
  tail -n 3 "$out/cmake.log"
else
  echo "cmake not found" | tee "$out/cmake.log"
fi

echo "== benchmark"
if [ -z "${QWEN4EXP_VLLM_SOURCE:-}" ] && [ -f "$root/.vllm-source/VLLM_VERSION" ]; then
  export QWEN4EXP_VLLM_SOURCE="$root/.vllm-source"
fi
"$PY" -c 'from qwen4exp_ext.bench import vllm_triton as v; print("vLLM kernels:", v.source_origin())'
# --threads all: host threads do not change GPU kernel times; "1,all" would double the run.
device="$("$PY" -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "-"))')"
"$PY" -m qwen4exp_ext.bench --device cuda --threads all \
  --json "$out/bench-$(date +%F)-$device.json" 2>&1 | tee "$out/bench.log"
bench_status=${PIPESTATUS[0]}
echo "== tests exit $tests_status, memcheck exit $memcheck_status, cmake exit $cmake_status," \
  "bench exit $bench_status"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ] && [ "$cmake_status" -eq 0 ] &&
  { [ "$memcheck_status" -eq 0 ] || [ "$memcheck_status" -eq 124 ]; }
