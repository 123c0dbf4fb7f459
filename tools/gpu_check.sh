#!/usr/bin/env bash
# One command for a machine with a GPU: builds the extension against the python3 that holds
# torch there (no venv, no downloads: the H200 lent to this project reaches no registry), runs
# the test suite on CPU and GPU, and the benchmark on the GPU, writing everything into OUTDIR.
#   usage: tools/gpu_check.sh OUTDIR
# Files: build_info.json, build.log, pytest.log, pytest.xml, bench-<date>-<device>.json, bench.log
set -uo pipefail
out="${1:?usage: tools/gpu_check.sh OUTDIR}"
mkdir -p "$out"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
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

echo "== benchmark"
device="$("$PY" -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "-"))')"
"$PY" -m qwen4exp_ext.bench --device cuda --json "$out/bench-$(date +%F)-$device.json" 2>&1 \
  | tee "$out/bench.log"
bench_status=${PIPESTATUS[0]}
echo "== tests exit $tests_status, bench exit $bench_status"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
