#!/usr/bin/env bash
# Sourced by tools/run-tests.sh and tools/run-bench.sh: makes sure ./.venv exists with torch and
# the test dependencies (tools/venv.sh) and a build of the extension that is current with csrc/
# and setup.py.
#
# Knobs: those of tools/venv.sh (QWEN4EXP_VENV, QWEN4EXP_TORCH), QWEN4EXP_BUILD_TARGET
# (auto|cpu|cuda|rocm, see setup.py), QWEN4EXP_BUILD_SIMT (default 1 here: the tests run the HIP
# kernels on the SIMT emulator too), and the usual TORCH_CUDA_ARCH_LIST / PYTORCH_ROCM_ARCH /
# CUDA_HOME / MAX_JOBS.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"

# A toolkit whose nvcc on PATH is a wrapper script (as on these machines) hides its root from
# torch; point CUDA_HOME at the usual location when nothing else says where it is.
if [ -z "${CUDA_HOME:-}" ] && [ -f /usr/local/cuda/include/cuda_runtime.h ]; then
  export CUDA_HOME=/usr/local/cuda
fi
# No GPU to detect the arch from: build for Hopper (the H200 this project benchmarks on) rather
# than every arch torch knows, which would multiply the nvcc time.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  export TORCH_CUDA_ARCH_LIST="9.0"
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export QWEN4EXP_BUILD_SIMT="${QWEN4EXP_BUILD_SIMT:-1}"

# Rebuild when a library is missing, or a source or the build script is newer than it.
needs_build() {
  local module lib
  local modules=(_kernels)
  case "$QWEN4EXP_BUILD_SIMT" in
    1) modules+=(_simt32 _simt64) ;;
    32 | 64) modules+=("_simt$QWEN4EXP_BUILD_SIMT") ;;
  esac
  for module in "${modules[@]}"; do
    lib=$(compgen -G "$QWEN4EXP_ROOT/python/qwen4exp_ext/$module*.so" | sed -n 1p)
    [ -n "$lib" ] || return 0
    [ -z "$(find "$QWEN4EXP_ROOT/csrc" "$QWEN4EXP_ROOT/setup.py" -type f -newer "$lib" | sed -n 1p)" ] || return 0
  done
  ! "$PY" -c "import qwen4exp_ext" >/dev/null 2>&1
}
if needs_build; then
  echo "== building qwen4exp_ext (target ${QWEN4EXP_BUILD_TARGET:-auto}, SIMT emulator" \
    "$QWEN4EXP_BUILD_SIMT; log: $VENV/build.log)"
  if ! (cd "$QWEN4EXP_ROOT" && "$PY" -m pip install -v --disable-pip-version-check \
      --no-build-isolation -e . >"$VENV/build.log" 2>&1); then
    tail -n 80 "$VENV/build.log"
    echo "== build FAILED"
    exit 1
  fi
  # One line per compiled file: which compiler built which source (the CI log's proof that nvcc
  # or hipcc built the GPU kernels).
  awk '/^ *\[[0-9]+\/[0-9]+\] / { src = ""; for (i = 3; i < NF; i++) if ($i == "-c" && $(i+1) != "-c") src = $(i+1); print "   ", $1, $2, src }' \
    "$VENV/build.log"
  "$PY" -c "import qwen4exp_ext, json; print('== built', json.dumps(qwen4exp_ext.build_info()))"
fi
