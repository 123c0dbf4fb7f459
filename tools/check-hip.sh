#!/usr/bin/env bash
# Compiles every HIP kernel in csrc/hip/ for AMD with hipcc, without torch: the proof that the
# AMD build of the kernels compiles on a machine with no ROCm torch. Fails on any error or
# warning. Debian's hipcc (ROCm 5.2) targets gfx90a (MI200) and gfx940 (MI300 family, the closest
# it knows to gfx942); a full ROCm toolchain builds gfx942/gfx950 through setup.py.
#
# Each kernel is compiled for every arch with the wavefront-size macros removed
# (__AMDGCN_WAVEFRONT_SIZE and __AMDGCN_WAVEFRONT_SIZE__: deprecated in ROCm 6.3, gone in ROCm
# 7.2). ROCm 5.2's own headers still need them, so they are removed right after
# <hip/hip_runtime.h>, before any of our code: what our code sees is then what ROCm 7.2 gives it.
# With the macros as the compiler defines them (ROCm before 7.2) it goes through the front end
# only (-fsyntax-only: the host pass and each arch's device pass, errors and warnings). Our code
# never reads the macros (the wave size comes from the target: csrc/common/platform.h); what
# their presence can change is what ROCm's own headers do with them, which the front end checks
# in a tenth of a full compile's time. (A second full compile doubled this script's time.)
# The kernels built on wave reductions (REDUCING below) must keep cross-lane instructions (DPP,
# ds_swizzle/permute/bpermute, permlane) in every one of their AMD functions: a wave size that
# silently fell back to 1 would leave none.
# Every kernel must also be free of calls into the AMD device libraries (__ocml_*/__ockl_*): the
# libraries are linked into the code object, so a call left in the assembly means they were not.
#   usage: tools/check-hip.sh [ARCH ...]     (default: gfx90a gfx940)
# QWEN4EXP_HIP_ASM_DIR=DIR keeps each kernel's assembly (macros removed) as DIR/<kernel>-<arch>.s.
# QWEN4EXP_HIP_CLANG=CLANG compiles with that clang as HIP (clang -x hip) instead of hipcc: a
# current LLVM for the targets ROCm 5.2 lacks (Debian's clang++-19 targets gfx942, MI300X; not
# gfx950), with Debian's HIP headers (hipcc's package) and its ROCm device libraries
# (rocm-device-libs; QWEN4EXP_ROCM_DEVICE_LIBS=DIR names another bitcode directory). Those libraries
# are ROCm 5.2's, which has no oclc_isa_version_<arch>.bc for a newer arch: it is made here, the
# one constant it holds (the ISA version, 9402 for gfx942) in the layout of gfx940's file.
#   e.g. QWEN4EXP_HIP_CLANG=clang++-19 tools/check-hip.sh gfx942
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(gfx90a gfx940)
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
if [ -n "${QWEN4EXP_HIP_CLANG:-}" ]; then
  clang="$(command -v "$QWEN4EXP_HIP_CLANG")" || { echo "check-hip: $QWEN4EXP_HIP_CLANG not found"; exit 1; }
  llvm_bin="$(dirname "$(readlink -f "$clang")")"
  libs="${QWEN4EXP_ROCM_DEVICE_LIBS:-/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)/amdgcn/bitcode}"
  [ -f "$libs/ocml.bc" ] || { echo "check-hip: no ROCm device libraries in $libs (apt-get install rocm-device-libs)"; exit 1; }
  mkdir -p "$out/device-libs"
  ln -s "$libs"/*.bc "$out/device-libs/"
  for arch in "${archs[@]}"; do
    isa="${arch#gfx}"
    [ -f "$out/device-libs/oclc_isa_version_$isa.bc" ] && continue
    # gfx<major><minor><stepping>, the last two one hex digit each: 942 -> 9402, 90a -> 9010.
    version=$(( ${isa:0:${#isa}-2} * 1000 + 16#${isa: -2:1} * 100 + 16#${isa: -1} ))
    "$llvm_bin/llvm-dis" "$libs/oclc_isa_version_940.bc" -o - | sed "s/i32 9400,/i32 $version,/" |
      "$llvm_bin/llvm-as" -o "$out/device-libs/oclc_isa_version_$isa.bc"
  done
  compiler=("$clang" -x hip --rocm-device-lib-path="$out/device-libs")
  compiler_name="$(basename "$QWEN4EXP_HIP_CLANG")"
else
  command -v hipcc >/dev/null || { echo "check-hip: hipcc not found (apt-get install hipcc)"; exit 1; }
  # Debian's hipcc targets NVIDIA when it finds nvcc; we want the AMD path.
  export HIP_PLATFORM=amd
  compiler=(hipcc)
  compiler_name=hipcc
fi
# Kernels whose reductions run on wave shuffles (csrc/hip/block_reduce.h).
REDUCING=(hc_norm ple_gate)
# (v_readlane/v_readfirstlane are not among them: the compiler emits those for uniform values.)
CROSS_LANE='ds_swizzle|ds_bpermute|ds_permute|_dpp|v_permlane|row_shr|row_bcast|quad_perm'
cat >"$out/without_wavefront_macros.h" <<'EOF'
#include <hip/hip_runtime.h>
#undef __AMDGCN_WAVEFRONT_SIZE
#undef __AMDGCN_WAVEFRONT_SIZE__
EOF
status=0
arch_flags=()
for arch in "${archs[@]}"; do arch_flags+=(--offload-arch="$arch"); done
# The flags torch's ROCm build adds (no implicit half conversions/operators) keep us honest about
# 16-bit float handling going through our own helpers; -ffp-contract=off is setup.py's (no a·b+c
# contracted into an FMA).
flags=(-O3 -std=c++17 -Wall -Werror -ffp-contract=off -D__HIP_NO_HALF_OPERATORS__=1
  -D__HIP_NO_HALF_CONVERSIONS__=1 -I "$root/csrc")
# The kernels the builds compile: the `kernel` lines of csrc/kernel_sources.txt.
kernels="$(awk '$1 == "kernel" { print $2 }' "$root/csrc/kernel_sources.txt")"
[ -n "$kernels" ] || { echo "check-hip: no kernel in csrc/kernel_sources.txt"; exit 1; }
# check_kernel REL: every check of one kernel, its lines on stdout; fails if any check failed.
check_kernel() {
  local rel="$1" src name work asm note report count without arch status=0
  src="$root/csrc/$rel"
  name="$(basename "$src" .hip)"
  work="$out/$name"
  mkdir -p "$work"
  if "${compiler[@]}" "${arch_flags[@]}" "${flags[@]}" -c -fsyntax-only "$src" 2>"$work/log"; then
    echo "check-hip: ok   $compiler_name ${arch_flags[*]} -fsyntax-only $name.hip, wavefront macros present"
  else
    cat "$work/log"
    echo "check-hip: FAIL $compiler_name ${arch_flags[*]} -fsyntax-only $name.hip (wavefront macros present)"
    status=1
  fi
  # One compile for every arch: the host side is compiled once, not once per arch. --save-temps
  # keeps the AMD assembly, one file per arch.
  if ! (cd "$work" && "${compiler[@]}" "${arch_flags[@]}" "${flags[@]}" --save-temps \
      -include "$out/without_wavefront_macros.h" -c "$src" -o kernel.o 2>"$work/log"); then
    cat "$work/log"
    echo "check-hip: FAIL $compiler_name ${arch_flags[*]} $name.hip (wavefront macros removed)"
    return 1
  fi
  for arch in "${archs[@]}"; do
    # grep reads all of strings' output (no -q): an early exit would SIGPIPE strings, and
    # pipefail would then fail a large object at random.
    if ! strings "$work/kernel.o" | grep "amdgcn-amd-amdhsa--$arch" >/dev/null; then
      echo "check-hip: FAIL $name.hip has no $arch code object"; status=1; continue
    fi
    note=""
    asm="$(compgen -G "$work/*amdgcn-amd-amdhsa*$arch*.s" | sed -n 1p)"
    [ -n "$asm" ] || { echo "check-hip: FAIL no AMD assembly for $name.hip"; status=1; continue; }
    # What ROCm 7.2 compiles is the kernel report's AMD input (tools/kernel_report.py --amd-asm).
    if [ -n "${QWEN4EXP_HIP_ASM_DIR:-}" ]; then
      mkdir -p "$QWEN4EXP_HIP_ASM_DIR" && cp "$asm" "$QWEN4EXP_HIP_ASM_DIR/$name-$arch.s"
    fi
    if grep -E '__o(ckl|cml)_' "$asm" >/dev/null; then
      grep -oE '__o(ckl|cml)_[A-Za-z0-9_]+' "$asm" | sort -u | sed 's/^/   device-library call left: /'
      echo "check-hip: FAIL $name.hip for $arch calls the device libraries (not linked)"
      status=1
      continue
    fi
    if [[ " ${REDUCING[*]} " == *" $name "* ]]; then
      # Cross-lane instructions per kernel (a kernel's code runs from its label to .Lfunc_end).
      report="$(awk -v pattern="$CROSS_LANE" '
        /^_Z[^ :]*:/ { fn = substr($1, 1, length($1) - 1); count[fn] = 0; next }
        /^\.Lfunc_end/ { fn = "" }
        fn != "" && $0 ~ pattern { count[fn]++ }
        END { for (f in count) print count[f], f }' "$asm")"
      count="$(echo "$report" | grep -c . || true)"
      without="$(echo "$report" | awk '$1 == 0' | grep -c . || true)"
      if [ "$count" -eq 0 ] || [ "$without" -ne 0 ]; then
        echo "$report" | awk '$1 == 0 { print "   no cross-lane instruction:", $2 }'
        echo "check-hip: FAIL $name.hip for $arch: $without of $count kernels reduce without" \
          "cross-lane instructions"
        status=1
        continue
      fi
      note=" ($count kernels, each with cross-lane reductions)"
    fi
    echo "check-hip: ok   $compiler_name --offload-arch=$arch $name.hip, wavefront macros removed, no device-library calls$note"
  done
  return $status
}

# The kernels are compiled side by side, as many at once as there are CPUs (each compile is one
# process: run alone on a 2-core VM, gfx90a+gfx940 took 87 s one at a time, 41 s side by side;
# in .ci/run the venv and CMake jobs run beside this script and take the other core anyway).
# Each kernel's lines are printed whole, in kernel order, once all have finished. A job marks
# its kernel passed only after check_kernel returns 0: any failure (set -e ends the job at a
# nonzero return or an unexpected error) leaves no mark.
jobs_max="$(nproc 2>/dev/null || echo 2)"
running=0
for rel in $kernels; do
  name="$(basename "$rel" .hip)"
  ( check_kernel "$rel" >"$out/$name.report" 2>&1; touch "$out/$name.passed" ) &
  running=$((running + 1))
  if [ "$running" -ge "$jobs_max" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done
wait
for rel in $kernels; do
  name="$(basename "$rel" .hip)"
  cat "$out/$name.report"
  [ -f "$out/$name.passed" ] || status=1
done
exit $status
