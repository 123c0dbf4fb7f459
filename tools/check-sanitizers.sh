#!/usr/bin/env bash
# Builds the CPU kernels and the SIMT emulator's (the HIP kernels run on the CPU) once with
# AddressSanitizer + UndefinedBehaviorSanitizer, out of tree, and runs the kernel tests on that
# build, so an out-of-bounds access in CPU or GPU kernel code fails. Fails on a build error, a test
# failure, or any sanitizer report (also one from a subprocess). Never touches the in-tree build
# (python/qwen4exp_ext/_kernels*.so, _simt*.so).
#
#   usage: tools/check-sanitizers.sh [PYTEST_ARG ...]       e.g. -k ple_conv
#   PYTHON: the interpreter (needs torch, pytest, hypothesis, setuptools); default the venv of
#           tools/env.sh, $QWEN4EXP_VENV/bin/python (./.venv unless set) - run tools/run-tests.sh
#           once to create it. MAX_JOBS: parallel compile (default: the core count, as
#           tools/env.sh). QWEN4EXP_SANITIZE: the sanitizers (default address,undefined).
#           QWEN4EXP_SANITIZE_KEEP=1 keeps the work dir (build, build.log, reports).
#
# How it works:
# - csrc/, python/, tests/, setup.py, pyproject.toml are copied to a temp dir, and the extension
#   is built there in place (setup.py build_ext --inplace, QWEN4EXP_BUILD_TARGET=cpu,
#   QWEN4EXP_BUILD_SIMT=64, QWEN4EXP_SANITIZE=address,undefined: setup.py then compiles with
#   -O1 -g -fsanitize=...
#   -fno-sanitize-recover=all -fno-omit-frame-pointer -fno-wrapv; without -fno-wrapv, Python's
#   -fwrapv would hide signed overflow from UBSan). The tests run from that copy with its
#   python/ first on PYTHONPATH, so its sanitized _kernels shadows the installed one; a pytest
#   plugin written next to it fails the session unless the loaded _kernels is the sanitized copy.
# - python and torch are not instrumented, so the ASan runtime must come first in the process:
#   LD_PRELOAD of the compiler's libasan.so (the one the build linked against; without it ASan
#   aborts with "ASan runtime does not come first in initial library list"). UBSan's runtime
#   (libubsan, a DT_NEEDED of the .so) loads fine after it.
# - ASAN_OPTIONS: detect_leaks=0, since CPython and torch keep allocations until exit by design
#   and LeakSanitizer would report them. log_path sends every ASan report (also from subprocesses,
#   such as the compilers that test_fast_divmod and the torch.compile tests start, which inherit
#   LD_PRELOAD) to files that this script prints and fails on. UBSAN_OPTIONS: halt_on_error=1,
#   print_stacktrace=1. UBSan ignores its log_path next to the preloaded ASan (GCC 12): its
#   reports go to stderr, so pytest runs with --capture=sys (else a report lands in pytest's
#   capture file and dies with the process) and its output is scanned for "runtime error:".
#   Both exit with code 86 after a report, to tell it from a plain test failure.
# - The emulator is built at wave 64 only (QWEN4EXP_BUILD_SIMT=64), for CI's 30 minutes: the
#   kernels index global memory by block and thread, which the wave size does not change; what it
#   changes (the reductions' lanes, a block's scratch) the plain build's tests run at both sizes.
#   pytest runs with QWEN4EXP_REQUIRE_SIMT unset (it asks for both wave sizes); the plugin below
#   requires the wave-64 module, sanitized, instead.
# - The sanitized build has CPU kernels only, so the tests run with no GPU visible
#   (CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES empty): the tests then never start a GPU driver
#   under ASan. protect_shadow_gap=0 is there in case one still does (CUDA maps memory in ASan's
#   shadow gap); neither was needed on the GPU-less machine this was written on.
# - tests/cpp/fast_divmod_check.cpp (the exhaustive edge cases of csrc/common/fast_divmod.h, which
#   the kernels share), tests/cpp/ngram_hash_check.cpp (ngram_ids' head reduction in every width
#   the CPU has, tails and strided stores included) and tests/cpp/simt_selftest.cpp (the emulator's own test; its fibers tell
#   ASan of every stack switch) are also built and run with the same sanitizers: seconds.
# - Only the target_clones variant that this CPU selects (csrc/cpu/simd.h: AVX-512, AVX2 or the
#   baseline) is exercised.
#
# Proof that a report fails the job (done once by hand, nothing of it kept): in a scratch copy of
# the repo, csrc/cpu/ngram_ids.cpp got, at the end of ngram_ids_cpu, (a) a one-byte write past
# the end of the output's storage and, separately, (b) a signed int overflow of INT_MAX + T. The
# copy's tools/check-sanitizers.sh then failed (exit 1) at the first ngram_ids call
# (then tests/test_ngram_ids.py::test_golden_toy_case) with (a) "AddressSanitizer: heap-buffer-overflow ...
# WRITE of size 1 ... ngram_ids.cpp:99" and (b) "ngram_ids.cpp:102:28: runtime error: signed
# integer overflow"; (b) went unreported until -fno-wrapv was added, and was lost in pytest's
# capture until --capture=sys.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=$SECONDS
venv="${QWEN4EXP_VENV:-$root/.venv}"
py="${PYTHON:-$venv/bin/python}"
sanitize="${QWEN4EXP_SANITIZE:-address,undefined}"
cxx="${CXX:-c++}"  # the compiler torch's cpp_extension builds with
# Every kernel op's folder (its test_fuzz.py draws random shapes, strides and layouts: what a
# sanitizer is best at catching), the fused op's bad inputs, and every hyper-connection op's
# folder (tests/hc_*/ but the oracle's, which runs no kernel).
tests=(
  tests/ngram_ids tests/gather_rows tests/ple_gate tests/ple_conv
  tests/ngram_gather_rows/test_bad_inputs.py tests/test_fast_divmod.py tests/grouped_gemma_rmsnorm
)
for dir in "$root"/tests/hc_*/; do
  name="$(basename "$dir")"
  [ "$name" = hc_oracle ] || tests+=("tests/$name")
done
# The fuzz budget per op under the sanitizers (slower than a plain build: fewer examples).
export QWEN4EXP_FUZZ_SECONDS="${QWEN4EXP_FUZZ_SECONDS:-6}"

if ! "$py" -c "import torch, pytest, hypothesis, setuptools" >/dev/null 2>&1; then
  echo "check-sanitizers: $py lacks torch/pytest/hypothesis/setuptools;" \
    "set PYTHON, or run tools/run-tests.sh once to create $venv"
  exit 1
fi
# ninja (parallel build) lives next to the venv's python.
PATH="$(dirname "$py"):$PATH"
export PATH

work="$(mktemp -d "${TMPDIR:-/tmp}/qwen4exp-sanitize.XXXXXX")"
if [ "${QWEN4EXP_SANITIZE_KEEP:-0}" = 1 ]; then
  echo "check-sanitizers: work dir $work (kept)"
else
  trap 'rm -rf "$work"' EXIT
fi
src="$work/src"
mkdir -p "$src"
cp -r "$root/csrc" "$root/python" "$root/tests" "$root/setup.py" "$root/pyproject.toml" \
  "$root/README.md" "$src/"
find "$src" \( -name '_kernels*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +

echo "== [sanitize] building the CPU kernels with -fsanitize=$sanitize (log: build.log)"
t0=$SECONDS
if ! (cd "$src" && QWEN4EXP_SANITIZE="$sanitize" QWEN4EXP_BUILD_TARGET=cpu QWEN4EXP_BUILD_SIMT=64 \
    MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$py" setup.py build_ext --inplace \
    >"$work/build.log" 2>&1); then
  tail -n 80 "$work/build.log"
  echo "check-sanitizers: build FAILED"
  exit 1
fi
lib="$(compgen -G "$src/python/qwen4exp_ext/_kernels*.so" | sed -n 1p)"
[ -n "$lib" ] || { echo "check-sanitizers: no _kernels*.so after the build"; exit 1; }
compgen -G "$src/python/qwen4exp_ext/_simt64*.so" >/dev/null ||
  { echo "check-sanitizers: no _simt64*.so after the build"; exit 1; }
echo "   built $(basename "$lib") and the SIMT emulator's modules in $((SECONDS - t0)) s"

# The runtimes the library was linked against: preload exactly that libasan.
runtimes="$(readelf -d "$lib" | sed -n 's/.*Shared library: \[\(lib[a-z]*san\.so[^]]*\)\].*/\1/p')"
echo "   sanitizer runtimes needed: $(echo "$runtimes" | tr '\n' ' ')"
preload=""
if [[ ",$sanitize," == *,address,* ]]; then
  asan_so="$(echo "$runtimes" | sed -n '/^libasan/p')"
  [ -n "$asan_so" ] || { echo "check-sanitizers: $lib does not link libasan"; exit 1; }
  preload="$("$cxx" -print-file-name="$asan_so")"
  [ -f "$preload" ] || { echo "check-sanitizers: $cxx has no $asan_so"; exit 1; }
  # python does not link libstdc++: loaded only later (by torch), its __cxa_throw is then missed
  # by ASan's interceptor, and the first C++ exception (pybind11's, in triton's import) dies in
  # "CHECK failed: asan_interceptors.cpp ... real___cxa_throw != 0". Preload it right after.
  stdcxx="$("$cxx" -print-file-name=libstdc++.so.6)"
  [ -f "$stdcxx" ] || { echo "check-sanitizers: $cxx has no libstdc++.so.6"; exit 1; }
  preload="$preload:$stdcxx"
fi

# Fails the session unless the sanitized copy is the _kernels that got loaded; and notes the test
# that runs, since a sanitizer ends the process before pytest can say.
cat >"$work/sanitized_build_check.py" <<EOF
import qwen4exp_ext
import qwen4exp_ext._kernels as k


def pytest_runtest_logstart(nodeid, location):
    with open("$work/current_test", "w") as f:
        f.write(nodeid + "\\n")


def pytest_sessionstart(session):
    expected = "$src/python/qwen4exp_ext/"
    info = qwen4exp_ext.build_info()
    if not k.__file__.startswith(expected) or info.get("sanitize") != "$sanitize":
        raise SystemExit(f"check-sanitizers: loaded {k.__file__} {info}, not the sanitized build")
    if tuple(info.get("simt_wave_sizes", ())) != (64,):
        raise SystemExit(f"check-sanitizers: the sanitized build has no wave-64 emulator: {info}")
    import qwen4exp_ext._simt64 as s64
    if not s64.__file__.startswith(expected):
        raise SystemExit(f"check-sanitizers: loaded {s64.__file__}, not the sanitized one")
    print(f"\nsanitized build loaded: {k.__file__} (+ _simt64) sanitize={info['sanitize']}")
EOF

reports="$work/reports"
mkdir -p "$reports"
export PYTHONPATH="$src/python:$work${PYTHONPATH:+:$PYTHONPATH}"
ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:protect_shadow_gap=0:exitcode=86"
export ASAN_OPTIONS="$ASAN_OPTIONS:log_path=$reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=86:log_path=$reports/ubsan"
export CUDA_VISIBLE_DEVICES="" HIP_VISIBLE_DEVICES=""

# A torch-free C++ check: built with the sanitizers, run, passed when its first word is "ok".
cpp_status=0
run_cpp_check() {  # name, extra compiler arguments...
  local name="$1" status=0 first=""
  shift
  echo "== [sanitize] tests/cpp/$name.cpp $*"
  if "$cxx" -std=c++17 -O1 -g -fsanitize="$sanitize" -fno-sanitize-recover=all \
      -fno-omit-frame-pointer -Wall -Wextra -Werror -I "$src/csrc" \
      "$src/tests/cpp/$name.cpp" "$@" -o "$work/$name"; then
    "$work/$name" >"$work/$name.log" 2>&1 || status=$?
    read -r first _ <"$work/$name.log" || true
    [ "$first" = ok ] || [ "$status" -ne 0 ] || status=1
    echo "   $(sed -n 1p "$work/$name.log") (exit $status)"
  else
    status=1
  fi
  cat "$work/$name.log" >>"$work/cpp.log"
  if [ "$status" -ne 0 ] && [ "$cpp_status" -ne 86 ]; then cpp_status=$status; fi
}
run_cpp_check fast_divmod_check
run_cpp_check ngram_hash_check "$src/csrc/cpu/ngram_hash_simd.cpp"
for wave in 32 64; do
  run_cpp_check simt_selftest -Wno-unknown-pragmas -DQWEN4EXP_SIMT_WAVE_SIZE=$wave \
    "$src/csrc/simt/runtime.cpp"
done

echo "== [sanitize] kernel tests (LD_PRELOAD=$preload, ASAN_OPTIONS=$ASAN_OPTIONS)"
t0=$SECONDS
test_status=0
# --capture=sys leaves fd 2 alone: a UBSan report (written there, see above) must not end in
# pytest's capture file of a process that dies before printing it.
(cd "$src" && LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}" QWEN4EXP_REQUIRE_SIMT= \
  "$py" -m pytest -q -x -p no:cacheprovider --capture=sys -p sanitized_build_check \
  "${tests[@]}" "$@") >"$work/pytest.log" 2>&1 || test_status=$?
cat "$work/pytest.log"
echo "   tests: exit $test_status in $((SECONDS - t0)) s"

n_reports=0
for f in "$reports"/*; do
  [ -f "$f" ] || continue
  n_reports=$((n_reports + 1))
  echo "== sanitizer report $(basename "$f")"
  cat "$f"
done
n_ubsan=0
for f in "$work/pytest.log" "$work/cpp.log"; do
  [ -f "$f" ] || continue
  n_ubsan=$((n_ubsan + $(grep -c ': runtime error: ' "$f" || true)))
done
n_reports=$((n_reports + n_ubsan))
if [ "$n_reports" -gt 0 ] || [ "$test_status" -eq 86 ] || [ "$cpp_status" -eq 86 ]; then
  echo "check-sanitizers: FAIL ($n_reports sanitizer report(s) above, exit 86 = one aborted;" \
    "last test started: $(cat "$work/current_test" 2>/dev/null || echo none))"
  exit 1
fi
if [ "$cpp_status" -ne 0 ] || [ "$test_status" -ne 0 ]; then
  echo "check-sanitizers: FAIL (C++ checks exit $cpp_status, pytest exit $test_status)"
  exit 1
fi
echo "check-sanitizers: ok ($sanitize, $((SECONDS - start)) s)"
