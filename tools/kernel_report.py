#!/usr/bin/env python3
"""What each GPU kernel costs the hardware, from its machine code, and the gates CI holds it to.

For every kernel of csrc/kernel_sources.txt (its csrc/hip/*.hip lines), on AMD gfx90a and gfx940
(Debian's hipcc, ROCm 5.2), gfx942 (MI300X, Debian's clang-19 with the ROCm device libraries linked:
a current LLVM for the real target; ROCm 5.2 has no gfx942), all from check-hip.sh's --save-temps
assembly, and NVIDIA sm_90 (nvcc -Xptxas -v, and the PTX): registers, static LDS / shared memory,
scratch (private segment; NVIDIA stack frame) and spills, occupancy (AMD: waves per SIMD, as the
compiler computes it for the kernel's launch bounds and LDS; NVIDIA: resident warps per SM, from
registers, shared memory and the block size), the widths of its global loads and stores (bits: count
of instructions in the kernel's code), and on AMD the most global loads a thread has in flight
(issued and not yet waited for by an s_waitcnt vmcnt, counted in program order): where that is 1 or
2, a thread waits for each load before it issues the next, and only the other waves hide the memory
latency.

Gates (``--check``): no scratch and no spill anywhere, no call left in an AMD kernel (the device
libraries' functions are linked in and inlined), and every kernel at or above the occupancy floor
stated for its op in FLOORS, on every arch. Torch-free: it needs hipcc, clang-19 and nvcc only.

    tools/kernel_report.py [--amd-asm DIR] [--text PATH] [--json PATH] [--check]

``--amd-asm DIR`` reads the AMD assembly that ``QWEN4EXP_HIP_ASM_DIR=DIR tools/check-hip.sh``
kept (``<kernel>-<arch>.s``, for every arch of AMD_ARCHS), as CI does; without it, the report
runs check-hip.sh itself (with QWEN4EXP_HIP_CLANG for clang-19's archs), so that the AMD code it
reads is always compiled as check-hip.sh compiles it (one set of flags).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each AMD arch and the compiler check-hip.sh builds it with: hipcc, or the clang it is given as
# QWEN4EXP_HIP_CLANG (ROCm 5.2's hipcc has no gfx942).
AMD_ARCHS = ("gfx90a", "gfx940", "gfx942")
AMD_COMPILER = {"gfx90a": "hipcc", "gfx940": "hipcc", "gfx942": "clang++-19"}
AMD_COMPILER_LABEL = {
    "hipcc": "Debian's hipcc, ROCm 5.2",
    "clang++-19": "Debian's clang-19, ROCm device libraries linked",
}
NVIDIA_ARCH = "sm_90"

# The occupancy each op's kernels must keep, per vendor: AMD in waves per SIMD (of 8 on
# gfx90a/gfx940/gfx942 with 512 VGPRs; the ple_gate and ple_conv kernels ask the AMD compilers
# for their floor: QWEN4EXP_AMD_MIN_WAVES, csrc/common/platform.h), NVIDIA in resident warps per
# SM (of 64 on sm_90). These are the levels the kernels reach today, held as a floor so that no
# change lowers them unseen; the roofline restructuring of issue #13 raised them, together with
# these numbers (the conv's per-mode kernels went from 3 to 4, 24 to 32; with one row per block
# and its own decode kernel, from 4 to 7 on AMD: 8 but for the bf16 decode of K = 4, dilation = 3
# on gfx940; the gather's vector kernel, with its loads issued without branches between them,
# from 4-5 to 8: 6 for NVFP4 tables into fp16 and bf16). gfx942 (clang-19) holds the same floors.
FLOORS = {
    "amd": {
        "gather_rows": 6,
        "hc_fused": 4,  # csrc/hip/hc_fused.hip's kAmdMinWaves says why
        "hc_mix": 8,
        "hc_norm": 8,
        "ngram_ids": 8,
        "ple_conv": 7,
        "ple_gate": 4,
    },
    "nvidia": {
        "gather_rows": 32,
        "hc_fused": 32,
        "hc_mix": 32,
        "hc_norm": 32,
        "ngram_ids": 32,
        "ple_conv": 32,
        "ple_gate": 32,
    },
}

# sm_90 (H100/H200): 64K 32-bit registers, 64 warps, 32 blocks and 228 KiB of shared memory per
# SM; registers are allocated per warp in units of 256, and each block reserves 1 KiB of shared
# memory for the system.
SM90 = dict(regs=65536, warps=64, blocks=32, smem=233472, reg_unit=256, block_smem_reserve=1024)


@dataclass
class Kernel:
    vendor: str
    arch: str
    op: str
    name: str  # demangled, namespace-free
    registers: int  # AMD: VGPRs (+ AGPRs); NVIDIA: registers per thread
    scalar_registers: int  # AMD SGPRs; 0 on NVIDIA
    shared_bytes: int  # static LDS / shared memory
    scratch_bytes: int  # AMD private segment; NVIDIA stack frame
    spills: int  # AMD VGPRs spilled (to scratch); NVIDIA spill stores + loads (bytes)
    scalar_spills: int  # AMD SGPRs spilled (into VGPR lanes, no memory traffic); 0 on NVIDIA
    occupancy: int  # AMD waves per SIMD; NVIDIA warps per SM
    block_threads: int
    loads: dict[int, int] = field(default_factory=dict)  # bits -> count
    stores: dict[int, int] = field(default_factory=dict)
    loads_in_flight: int = 0  # AMD: see the module docstring; 0 on NVIDIA (PTX has no waits)
    calls: int = 0  # AMD: calls left in the kernel's code (s_swappc); 0 on NVIDIA
    compiler: str = ""
    problems: list[str] = field(default_factory=list)


def run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.exit(f"kernel-report: {' '.join(cmd[:3])}... failed:\n{output[-4000:]}")
    return output


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled → readable, without the qwen4exp and anonymous namespaces."""
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    readable = proc.stdout.splitlines() if proc.returncode == 0 else names
    strip = re.compile(r"qwen4exp::|\(anonymous namespace\)::|_GLOBAL__N_[0-9a-f_]*::")
    return {m: strip.sub("", r) for m, r in zip(names, readable, strict=True)}


def kernel_sources() -> list[Path]:
    """The HIP kernels the builds compile: the `kernel` lines of csrc/kernel_sources.txt."""
    found = []
    for line in (ROOT / "csrc" / "kernel_sources.txt").read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) == 2 and fields[0] == "kernel":
            found.append(ROOT / "csrc" / fields[1])
    return sorted(found)


# ---- AMD ---------------------------------------------------------------------------------------

AMD_WIDTH = {"dwordx4": 128, "dwordx3": 96, "dwordx2": 64, "dword": 32}
AMD_ACCESS = re.compile(r"^\s+(?:global|buffer|flat)_(load|store)_(\w+)")
AMD_VMCNT = re.compile(r"^\s+s_waitcnt\b.*\bvmcnt\((\d+)\)")
AMD_CALL = re.compile(r"^\s+s_swappc_b64\b")


def amd_width(suffix: str) -> int:
    for key, bits in AMD_WIDTH.items():
        if suffix.startswith(key):
            return bits
    if "short" in suffix or "d16" in suffix:
        return 16
    if "byte" in suffix:
        return 8
    return 0  # atomics and others: not a plain access width


def compile_amd(asm_dir: Path) -> None:
    """Every kernel's AMD assembly into asm_dir, by check-hip.sh (its flags, macros removed), one
    run per compiler."""
    for compiler in dict.fromkeys(AMD_COMPILER.values()):
        archs = [arch for arch in AMD_ARCHS if AMD_COMPILER[arch] == compiler]
        env = {**os.environ, "QWEN4EXP_HIP_ASM_DIR": str(asm_dir)}
        env.pop("QWEN4EXP_HIP_CLANG", None)
        if compiler != "hipcc":
            env["QWEN4EXP_HIP_CLANG"] = compiler
        run(["bash", str(ROOT / "tools" / "check-hip.sh"), *archs], env=env)


def parse_amd(asm: Path, op: str, arch: str) -> list[Kernel]:
    text = asm.read_text()
    # Per-function code: label to .Lfunc_end; the compiler's occupancy comment follows each.
    code: dict[str, list[str]] = {}
    occupancy: dict[str, int] = {}
    current = last = None
    for line in text.splitlines():
        label = re.match(r"^(_Z\S+):\s*(;.*)?$", line)
        if label:
            current = last = label.group(1)
            code[current] = []
            continue
        if line.startswith(".Lfunc_end"):
            current = None
            continue
        if current is not None:
            code[current].append(line)
        occ = re.match(r"^; Occupancy: (\d+)", line)
        if occ and last is not None:
            occupancy[last] = int(occ.group(1))
    kernels = []
    for block in re.split(r"\n  - ", text.split("amdhsa.kernels:", 1)[1])[1:]:
        fields = dict(re.findall(r"^\s*\.([a-z_]+):\s+(\S+)", "  " + block, re.M))
        name = fields.get("name")
        if name is None or name not in code:
            continue
        loads: dict[int, int] = {}
        stores: dict[int, int] = {}
        pending = in_flight = 0  # loads issued and not yet waited for, and the most of them
        calls = 0
        for line in code[name]:
            calls += bool(AMD_CALL.match(line))
            m = AMD_ACCESS.match(line)
            if m and amd_width(m.group(2)):
                table = loads if m.group(1) == "load" else stores
                bits = amd_width(m.group(2))
                table[bits] = table.get(bits, 0) + 1
                if m.group(1) == "load":
                    pending += 1
                    in_flight = max(in_flight, pending)
            wait = AMD_VMCNT.match(line)
            if wait:
                pending = min(pending, int(wait.group(1)))
        kernels.append(
            Kernel(
                vendor="amd",
                arch=arch,
                op=op,
                name=name,
                registers=int(fields.get("vgpr_count", 0)) + int(fields.get("agpr_count", 0)),
                scalar_registers=int(fields.get("sgpr_count", 0)),
                shared_bytes=int(fields.get("group_segment_fixed_size", 0)),
                scratch_bytes=int(fields.get("private_segment_fixed_size", 0)),
                spills=int(fields.get("vgpr_spill_count", 0)),
                scalar_spills=int(fields.get("sgpr_spill_count", 0)),
                occupancy=occupancy.get(name, 0),
                block_threads=int(fields.get("max_flat_workgroup_size", 0)),
                loads=dict(sorted(loads.items())),
                stores=dict(sorted(stores.items())),
                loads_in_flight=in_flight,
                calls=calls,
                compiler=AMD_COMPILER[arch],
            )
        )
    return kernels


# ---- NVIDIA ------------------------------------------------------------------------------------

PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
PTXAS_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")
PTX_ACCESS = re.compile(r"^\s+(ld|st)\.global(?:\.\w+)*?(?:\.v(\d))?\.[bsuf](\d+)\s")


def compile_nvidia(src: Path, work: Path) -> tuple[str, str]:
    out = work / f"{src.stem}-{NVIDIA_ARCH}"
    out.mkdir(parents=True, exist_ok=True)
    shim = out / f"{src.stem}.cu"
    shim.write_text(f'#include "{src}"\n')
    nvcc = os.environ.get("NVCC") or next(
        (
            str(p)
            for p in (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc",)
            if p.is_file()
        ),
        "nvcc",  # a wrapper on PATH may hide the toolkit: CUDA_HOME or NVCC say where it is
    )
    log = run(
        [
            nvcc,
            f"-arch={NVIDIA_ARCH}",
            "-O3",
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "--fmad=false",  # setup.py's device flags
            "-D__CUDA_NO_HALF_OPERATORS__",
            "-D__CUDA_NO_HALF_CONVERSIONS__",
            "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-I",
            str(ROOT / "csrc"),
            "-Xptxas",
            "-v",
            "--keep",
            "--keep-dir",
            str(out),
            "-c",
            str(shim),
            "-o",
            str(out / "kernel.o"),
        ]
    )
    ptx = sorted(out.glob("*.ptx"))
    return log, ptx[0].read_text() if ptx else ""


def sm90_warps(registers: int, shared: int, threads: int) -> int:
    warps_per_block = max(1, -(-threads // 32))
    per_warp = -(-registers * 32 // SM90["reg_unit"]) * SM90["reg_unit"]
    by_regs = SM90["regs"] // max(per_warp, 1) // warps_per_block
    by_smem = SM90["smem"] // (shared + SM90["block_smem_reserve"])
    blocks = min(by_regs, by_smem, SM90["blocks"], SM90["warps"] // warps_per_block)
    return blocks * warps_per_block


def parse_nvidia(log: str, ptx: str, op: str) -> list[Kernel]:
    # PTX: each entry's launch bound and global access widths.
    entries: dict[str, tuple[int, dict[int, int], dict[int, int]]] = {}
    for chunk in re.split(r"\n\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+", ptx)[1:]:
        name = re.match(r"(\S+?)\(", chunk).group(1)
        body = chunk.split("\n}\n", 1)[0]
        maxntid = re.search(r"\.maxntid\s+(\d+)", body)
        loads: dict[int, int] = {}
        stores: dict[int, int] = {}
        for line in body.splitlines():
            m = PTX_ACCESS.match(line)
            if m:
                bits = int(m.group(3)) * int(m.group(2) or 1)
                table = loads if m.group(1) == "ld" else stores
                table[bits] = table.get(bits, 0) + 1
        entries[name] = (int(maxntid.group(1)) if maxntid else 1024, loads, stores)
    kernels = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = PTXAS_ENTRY.search(line)
        if not m:
            continue
        name = m.group(1)
        frame = used = None
        for follow in lines[i + 1 : i + 6]:
            frame = frame or PTXAS_FRAME.search(follow)
            used = used or PTXAS_USED.search(follow)
        registers = int(used.group(1)) if used else 0
        shared = int(used.group(2) or 0) if used else 0
        threads, loads, stores = entries.get(name, (1024, {}, {}))
        kernels.append(
            Kernel(
                vendor="nvidia",
                arch=NVIDIA_ARCH,
                op=op,
                name=name,
                registers=registers,
                scalar_registers=0,
                shared_bytes=shared,
                scratch_bytes=int(frame.group(1)) if frame else 0,
                spills=int(frame.group(2)) + int(frame.group(3)) if frame else 0,
                scalar_spills=0,
                occupancy=sm90_warps(registers, shared, threads),
                block_threads=threads,
                loads=dict(sorted(loads.items())),
                stores=dict(sorted(stores.items())),
                compiler="nvcc",
            )
        )
    return kernels


# ---- report ------------------------------------------------------------------------------------


def check(kernels: list[Kernel]) -> int:
    failed = 0
    for k in kernels:
        if k.scratch_bytes:
            k.problems.append(f"{k.scratch_bytes} B scratch")
        if k.spills:
            k.problems.append(f"{k.spills} spills")
        if k.scalar_spills:
            k.problems.append(f"{k.scalar_spills} SGPR spills")
        if k.calls:
            k.problems.append(f"{k.calls} calls")
        floor = FLOORS[k.vendor][k.op]
        if k.occupancy < floor:
            unit = "waves/SIMD" if k.vendor == "amd" else "warps/SM"
            k.problems.append(f"occupancy {k.occupancy} < floor {floor} {unit}")
        failed += bool(k.problems)
    return failed


def widths(table: dict[int, int]) -> str:
    return " ".join(f"{bits}:{count}" for bits, count in table.items()) or "-"


def render(kernels: list[Kernel]) -> str:
    names = demangle([k.name for k in kernels])
    out = []
    for arch in dict.fromkeys(k.arch for k in kernels):
        rows = [k for k in kernels if k.arch == arch]
        amd = rows[0].vendor == "amd"
        occ = "waves/SIMD" if amd else "warps/SM"
        how = (
            f"{AMD_COMPILER_LABEL[rows[0].compiler]}: {rows[0].compiler} --save-temps"
            if amd
            else "nvcc -Xptxas -v, PTX"
        )
        out.append(f"== {arch} ({how})")
        out.append(
            f"{'op':<12} {'regs':>4} {'sgpr':>4} {'shared':>6} {'scratch':>7} {'spill':>5} "
            f"{'sspill':>6} {occ:>10} {'inflight':>8}  {'loads (bits:n)':<26} "
            f"{'stores (bits:n)':<14} kernel"
        )
        for k in sorted(rows, key=lambda k: (k.op, names[k.name])):
            flag = "  <-- " + "; ".join(k.problems) if k.problems else ""
            out.append(
                f"{k.op:<12} {k.registers:>4} {k.scalar_registers or '-':>4} "
                f"{k.shared_bytes:>6} {k.scratch_bytes:>7} {k.spills:>5} {k.scalar_spills:>6} "
                f"{k.occupancy:>10} {k.loads_in_flight or '-':>8}  {widths(k.loads):<26} "
                f"{widths(k.stores):<14} "
                f"{names[k.name]}{flag}"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--amd-asm", type=Path, help="AMD assembly kept by check-hip.sh")
    parser.add_argument("--text", type=Path, help="also write the report here")
    parser.add_argument("--json", type=Path, help="write every kernel's figures as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when a gate fails")
    args = parser.parse_args(argv)

    kernels: list[Kernel] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        asm_dir = args.amd_asm
        if asm_dir is None:
            asm_dir = work / "hip-asm"
            compile_amd(asm_dir)
        for arch in AMD_ARCHS:
            for src in kernel_sources():
                asm = asm_dir / f"{src.stem}-{arch}.s"
                if not asm.is_file():
                    sys.exit(f"kernel-report: no AMD assembly {asm} (from tools/check-hip.sh)")
                kernels += parse_amd(asm, src.stem, arch)
        # nvcc compiles one file on one core: the four side by side.
        sources = kernel_sources()
        with ThreadPoolExecutor(max_workers=len(sources)) as pool:
            compiled = list(pool.map(lambda src: compile_nvidia(src, work), sources))
        for src, (log, ptx) in zip(sources, compiled, strict=True):
            kernels += parse_nvidia(log, ptx, src.stem)

    failed = check(kernels)
    report = render(kernels)
    summary = (
        f"kernel-report: {len(kernels)} kernels, {failed} failing a gate (no scratch, no spill, "
        "no AMD call, occupancy floors of tools/kernel_report.py FLOORS)"
    )
    print(report + summary)
    if args.text:
        args.text.write_text(report + summary + "\n")
    if args.json:
        args.json.write_text(json.dumps([asdict(k) for k in kernels], indent=1) + "\n")
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
