#!/usr/bin/env bash
# The CMake package of the torch-free kernel library (CMakeLists.txt): for each backend this
# machine can build — CPU (the CPU kernels alone) and SIMT (those and the HIP kernels on the CPU,
# 64-wide waves) always, CUDA where nvcc is — configure, build, install into a scratch prefix,
# then build tests/cpp/cmake_consumer against the installed package (find_package(
# qwen4exp_kernels)) and run it: on CPU and SIMT always, on CUDA only where a GPU answers. Fails
# on any step, when a build tree lacks compile_commands.json, and when the CPU kernels' shared
# library exports anything of ours but its entry points (QWEN4EXP_API).
#
# The CPU tree builds Release, as a user would; the SIMT and CUDA trees build Debug (-O0). What
# those two prove is the package (targets, install, find_package, link, a run on SIMT); each
# rebuilds the CPU kernels, and at -O3 that was 2/3 of this check's compile time (CI runs it on 2
# cores). setup.py's build compiles the same sources at -O3.
#   tools/check-cmake.sh            (CUDA_ARCH=90 by default; CUDA_HOME picks the toolkit)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

# Runs a command with its output in $log; on failure prints the log and fails.
logged() {
  "$@" >>"$log" 2>&1 || { cat "$log"; echo "check-cmake: FAIL: $*"; return 1; }
}

# The qwen4exp symbols the CPU kernels' library exports must be its entry points and no more: an
# exported inline helper could bind to an emulator build's version of it in the same program.
check_exports() {
  local library
  library="$(find "$2" -name 'libqwen4exp_cpu_kernels.so' | head -n 1)"
  [ -n "$library" ] || { echo "check-cmake: $1: no libqwen4exp_cpu_kernels.so installed"; return 1; }
  local exported
  # Each defined dynamic symbol, demangled, without its parameter list; ours start qwen4exp::.
  exported="$(nm -DC --defined-only "$library" | cut -d' ' -f3- | sed 's/(.*//' |
    grep '^qwen4exp::' | sort -u | tr '\n' ' ')"
  local want="qwen4exp::cpu_conv_silu_lookup qwen4exp::cpu_gather_calls qwen4exp::cpu_gather_fp8_lookup qwen4exp::cpu_gather_path qwen4exp::cpu_gather_stream_bytes qwen4exp::cpu_gather_timing qwen4exp::cpu_hc_dot qwen4exp::cpu_ngram_hash_isa qwen4exp::run_gather_rows_cpu qwen4exp::run_hc_combine_cpu qwen4exp::run_hc_down_silu_inject_cpu qwen4exp::run_hc_gate_mix_cpu qwen4exp::run_hc_rmsnorm_cpu qwen4exp::run_hc_silu_cpu qwen4exp::run_hc_up_gate_mix_cpu qwen4exp::run_ngram_gather_rows_cpu qwen4exp::run_ngram_ids_cpu qwen4exp::run_ple_conv_cpu qwen4exp::run_ple_gate_cpu qwen4exp::run_read_file_rows_cpu qwen4exp::set_cpu_conv_silu_lookup qwen4exp::set_cpu_gather_fp8_lookup qwen4exp::set_cpu_gather_path qwen4exp::set_cpu_gather_stream_bytes qwen4exp::set_cpu_hc_dot qwen4exp::set_cpu_ngram_hash_isa "
  if [ "$exported" != "$want" ]; then
    echo "check-cmake: $1: libqwen4exp_cpu_kernels.so exports: $exported"
    echo "check-cmake: $1: want only: $want"
    return 1
  fi
}

check_backend() {  # backend, build type, extra cmake arguments...
  local backend="$1" build_type="$2"
  shift 2
  local build="$work/$backend/build" prefix="$work/$backend/install"
  log="$work/$backend.log"
  echo "check-cmake: $backend ($build_type): configure, build, install"
  logged cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE="$build_type" \
    -DQWEN4EXP_BACKEND="$backend" "$@"
  logged cmake --build "$build"
  if [ ! -s "$build/compile_commands.json" ]; then
    echo "check-cmake: $backend: no compile_commands.json"
    return 1
  fi
  logged cmake --install "$build" --prefix "$prefix"
  check_exports "$backend" "$prefix"
  echo "check-cmake: $backend: the consumer, against the installed package"
  logged cmake -S "$root/tests/cpp/cmake_consumer" -B "$work/$backend/consumer" "${generator[@]}" \
    -DCMAKE_PREFIX_PATH="$prefix" "$@"
  logged cmake --build "$work/$backend/consumer"
}

check_backend CPU Release
"$work/CPU/consumer/run_gather"
check_backend SIMT Debug -DQWEN4EXP_SIMT_WAVE_SIZE=64
"$work/SIMT/consumer/run_gather"

cuda_home="${CUDA_HOME:-/usr/local/cuda}"
if [ -x "$cuda_home/bin/nvcc" ]; then
  check_backend CUDA Debug -DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" \
    -DCUDAToolkit_ROOT="$cuda_home" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}"
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    "$work/CUDA/consumer/run_gather"
  else
    echo "check-cmake: CUDA: built and linked; not run (no GPU here)"
  fi
else
  echo "check-cmake: CUDA: skipped (no nvcc at $cuda_home)"
fi
echo "check-cmake: ok"
