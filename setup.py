"""Build of the qwen4exp_ext kernels.

One extension module, `qwen4exp_ext._kernels`, whose loading registers torch.ops.qwen4exp.*:
- the CPU kernels are always built;
- on a ROCm build of torch, the HIP kernels in csrc/hip/ are compiled by hipcc for
  PYTORCH_ROCM_ARCH (default gfx90a;gfx942;gfx950);
- on a CUDA build of torch with nvcc available, the same HIP sources are compiled by nvcc through
  csrc/common/platform.h, for TORCH_CUDA_ARCH_LIST (torch's default when unset).
QWEN4EXP_BUILD_TARGET=auto|cpu|cuda|rocm overrides the choice (auto is the default).
QWEN4EXP_BUILD_SIMT=1 also builds the SIMT emulator's modules, qwen4exp_ext._simt32 and _simt64:
the same HIP kernels and GPU host glue, compiled by the host C++ compiler against csrc/simt/ for
32- and 64-wide waves, run on CPU tensors (tests and debugging; default 0); =32 or =64 builds
that one only.

Install with `pip install --no-build-isolation .` (or `-e .`) so that the kernels build against
the torch already installed, not a fresh download.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
# The torch-facing layer: everything that includes torch, ATen, c10 or Python (the op library,
# the argument checks, the CPU ops, the GPU glue, the emulator's module). The rest of csrc/ is the
# torch-free kernel library of csrc/kernel_sources.txt (tools/check-torch-boundary.sh).
TORCH_CSRC = os.path.join(CSRC, "torch")
DEFAULT_ROCM_ARCHS = "gfx90a;gfx942;gfx950"
KNOWN_ROCM_ARCH_PREFIXES = ("gfx90", "gfx94", "gfx95", "gfx10", "gfx11", "gfx12")


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def choose_target(torch) -> str:
    """The build target: QWEN4EXP_BUILD_TARGET if set, else what the installed torch supports."""
    from torch.utils.cpp_extension import CUDA_HOME, ROCM_HOME

    requested = os.environ.get("QWEN4EXP_BUILD_TARGET", "auto").strip().lower()
    if requested not in ("auto", "cpu", "cuda", "rocm"):
        sys.exit(f"QWEN4EXP_BUILD_TARGET must be auto, cpu, cuda or rocm; got {requested!r}")
    if requested == "rocm" and torch.version.hip is None:
        sys.exit(
            "QWEN4EXP_BUILD_TARGET=rocm needs a ROCm build of torch (torch.version.hip is None)"
        )
    if requested == "cuda" and (torch.version.cuda is None or CUDA_HOME is None):
        sys.exit(
            "QWEN4EXP_BUILD_TARGET=cuda needs a CUDA build of torch and nvcc "
            f"(torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME})"
        )
    cuda_ok = CUDA_HOME is not None and os.path.exists(
        os.path.join(CUDA_HOME, "include", "cuda_runtime.h")
    )
    if requested == "cuda" and not cuda_ok:
        sys.exit(
            f"QWEN4EXP_BUILD_TARGET=cuda: no CUDA toolkit headers under CUDA_HOME={CUDA_HOME} "
            "(torch guesses it from the nvcc on PATH; a wrapper script there misleads it). "
            "Set CUDA_HOME to the toolkit root, e.g. /usr/local/cuda."
        )
    if requested != "auto":
        return requested
    if torch.version.hip is not None and ROCM_HOME is not None:
        return "rocm"
    if torch.version.cuda is not None and CUDA_HOME is not None:
        if cuda_ok:
            return "cuda"
        print(
            f"qwen4exp_ext: nvcc found but no toolkit headers under CUDA_HOME={CUDA_HOME}; "
            "building the CPU kernels only (set CUDA_HOME to build the GPU kernels)",
            flush=True,
        )
    return "cpu"


# The oldest torch and ROCm this project builds with (pyproject.toml says torch>=2.9 too, but
# `--no-build-isolation` skips that check). ROCm 6.0 is the first that supports MI300X (gfx942);
# every ROCm torch >= 2.9 is built on a newer one.
MIN_TORCH = (2, 9)
MIN_ROCM = (6, 0)
# The first ROCm release whose compiler targets each default arch, for the messages.
ROCM_FOR_ARCH = {"gfx90a": "4.5", "gfx942": "6.0", "gfx950": "7.0"}


def version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_versions(torch, target: str) -> None:
    if version_tuple(torch.__version__) < MIN_TORCH:
        sys.exit(
            f"qwen4exp_ext needs torch >= {'.'.join(map(str, MIN_TORCH))}; "
            f"this is torch {torch.__version__}"
        )
    if target == "rocm" and version_tuple(torch.version.hip) < MIN_ROCM:
        sys.exit(
            f"qwen4exp_ext needs ROCm >= {'.'.join(map(str, MIN_ROCM))}; "
            f"this torch is built for ROCm {torch.version.hip}"
        )


def hipcc_path() -> str:
    """The compiler torch's cpp_extension runs for .hip files: $ROCM_HOME/bin/hipcc."""
    from torch.utils.cpp_extension import ROCM_HOME

    return os.path.join(ROCM_HOME or "/opt/rocm", "bin", "hipcc")


def hipcc_rejects(hipcc: str, arch: str) -> str | None:
    """None if hipcc compiles for arch, else the compiler's complaint (one line). Preprocessing an
    empty file for the device only is enough: the driver checks the target first."""
    import subprocess

    cmd = [hipcc, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-nogpulib"]
    try:
        proc = subprocess.run(
            [*cmd, "-E", os.devnull, "-o", os.devnull], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not run {hipcc}: {exc}"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if "error" in ln]
    return (lines or [f"exit status {proc.returncode}"])[0].split(";")[0].strip()


def rocm_archs() -> list[str]:
    """PYTORCH_ROCM_ARCH (default DEFAULT_ROCM_ARCHS), checked against the compiler before anything
    is compiled: an arch the compiler does not know stops a build that asked for it, and is left
    out, with a warning, of the default list."""
    requested = os.environ.get("PYTORCH_ROCM_ARCH")
    archs = [a for a in (requested or DEFAULT_ROCM_ARCHS).replace(" ", ";").split(";") if a]
    unknown = [a for a in archs if not a.startswith(KNOWN_ROCM_ARCH_PREFIXES)]
    if unknown:
        sys.exit(f"PYTORCH_ROCM_ARCH has unknown AMD targets {unknown}; expected gfx9xx/gfx1xxx")
    hipcc = hipcc_path()
    rejected = {a: why for a in archs if (why := hipcc_rejects(hipcc, a)) is not None}
    if rejected:
        detail = "; ".join(
            f"{a} (needs ROCm >= {ROCM_FOR_ARCH[a.split(':')[0]]}): {why}"
            if a.split(":")[0] in ROCM_FOR_ARCH
            else f"{a}: {why}"
            for a, why in rejected.items()
        )
        kept = [a for a in archs if a not in rejected]
        if requested or not kept:
            sys.exit(
                f"qwen4exp_ext: the compiler {hipcc} cannot build for {sorted(rejected)} of "
                f"PYTORCH_ROCM_ARCH={';'.join(archs)}: {detail}. Set PYTORCH_ROCM_ARCH to the "
                "targets it supports, or point ROCM_HOME at a newer ROCm."
            )
        print(
            f"qwen4exp_ext: WARNING: the compiler {hipcc} cannot build for {sorted(rejected)} "
            f"(default PYTORCH_ROCM_ARCH={DEFAULT_ROCM_ARCHS}): {detail}. Building for "
            f"{';'.join(kept)} only; set PYTORCH_ROCM_ARCH to choose, or point ROCM_HOME at a "
            "newer ROCm.",
            flush=True,
        )
        archs = kept
    # torch's cpp_extension reads the same variable when it builds the hipcc flags.
    os.environ["PYTORCH_ROCM_ARCH"] = ";".join(archs)
    return archs


def cuda_archs() -> list[str]:
    from torch.utils import cpp_extension

    try:  # the flags torch will pass to nvcc (honours TORCH_CUDA_ARCH_LIST)
        flags = cpp_extension._get_cuda_arch_flags()
    except Exception as exc:  # noqa: BLE001 - report, do not hide, what torch rejected
        sys.exit(f"could not determine CUDA archs (TORCH_CUDA_ARCH_LIST?): {exc}")
    return sorted({f.split("code=")[-1] for f in flags if "code=" in f})


def kernel_sources(role: str) -> list[str]:
    """The paths of csrc/kernel_sources.txt with ``role`` ("kernel", "simt", "cpu" or
    "cpu_threads"): the list CMake reads too."""
    paths = []
    with open(os.path.join(CSRC, "kernel_sources.txt")) as listing:
        for line in listing:
            fields = line.split("#", 1)[0].split()
            if fields and fields[0] == role:
                paths.append(os.path.join(CSRC, fields[1]))
    return paths


def shims(sources: list[str], folder: str, suffix: str) -> list[str]:
    """One-line files that #include each source, so that a compiler chosen by file extension
    (nvcc for .cu, the C++ compiler for .cpp) builds the source as it is, and so that one source
    can go into two extensions with objects of their own. They live in build/ and carry no code.
    """
    shim_dir = os.path.join(ROOT, "build", folder)
    os.makedirs(shim_dir, exist_ok=True)
    made = []
    for src in sources:
        name = os.path.splitext(os.path.basename(src))[0]
        shim = os.path.join(shim_dir, f"{name}{suffix}")
        text = f'#include "{os.path.abspath(src)}"\n'
        if not os.path.exists(shim) or open(shim).read() != text:
            with open(shim, "w") as f:
                f.write(text)
        made.append(rel(shim))
    return made


SIMT_WAVE_SIZES = (32, 64)


# Every module links the shared libstdc++ (the one torch uses), named explicitly: a compiler set
# up to link it statically (a wrapper or specs with -static-libstdc++, as on one GPU image seen
# here) otherwise puts a second copy inside the module, whose streams then run on the process's
# locale data and crash formatting a number (every TORCH_CHECK message with an integer in it).
# Named before the driver's own -lstdc++, the shared library provides every symbol, so no member
# of a static archive is pulled in. tests/test_linking.py checks the result.
SHARED_LIBSTDCXX = ["-Wl,-Bdynamic", "-lstdc++"] if sys.platform.startswith("linux") else []


# hipify (torch's, run by cpp_extension.CUDAExtension on a ROCm torch) rewrites every source it
# is given, and every project header they include, into a copy `<name>_hip.<ext>` beside the
# original. In csrc/ those copies would break the next build (the listing check below), show in
# git status and reach check-hip.sh, kernel_report.py and CMake's header install. So a ROCm build
# hands torch a mirror of csrc/ under build/, and hipify writes its copies there.
HIPIFY_CSRC = os.path.join(ROOT, "build", "hipify", "csrc")


def _write_if_changed(path: str, data: bytes) -> None:
    """Writes only a changed file, so that ninja recompiles only what changed."""
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read() == data:
                return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def mirror_csrc() -> list[str]:
    """Copies csrc/ into HIPIFY_CSRC (changed files only) and returns the relative paths copied."""
    copied = []
    for dirpath, _, names in os.walk(CSRC):
        for name in names:
            src = os.path.join(dirpath, name)
            path = os.path.relpath(src, CSRC)
            with open(src, "rb") as f:
                _write_if_changed(os.path.join(HIPIFY_CSRC, path), f.read())
            copied.append(path)
    return copied


def in_mirror(path: str) -> str:
    return os.path.join(HIPIFY_CSRC, os.path.relpath(path, CSRC))


def prune_mirror(copied: list[str]) -> None:
    """Removes from the mirror whatever is neither a current copy of csrc/ nor an output of this
    build's hipify: the copies and hipified files of sources deleted or renamed since."""
    from torch.utils.hipify import hipify_python

    keep = {os.path.join(HIPIFY_CSRC, p) for p in copied}
    keep |= {
        os.path.abspath(result.hipified_path)
        for result in getattr(hipify_python, "HIPIFY_FINAL_RESULT", {}).values()
        if getattr(result, "hipified_path", None)
    }
    for dirpath, _, names in os.walk(HIPIFY_CSRC, topdown=False):
        for name in names:
            path = os.path.join(dirpath, name)
            if path not in keep:
                os.remove(path)
        if dirpath != HIPIFY_CSRC and not os.listdir(dirpath):
            os.rmdir(dirpath)


def hipify_leftovers() -> list[str]:
    """hipify's in-place copies (`<name>_hip.<ext>`) in csrc/ from a ROCm build by an older
    setup.py: beside their `<name>.<ext>`, or, outside csrc/torch/, copies of a file that now lives
    there (the torch layer's files sat in csrc/, csrc/gpu/ and csrc/simt/ before issue #42)."""
    torch_names = {name for _, _, names in os.walk(TORCH_CSRC) for name in names}
    leftovers = []
    for dirpath, _, names in os.walk(CSRC):
        in_torch = os.path.commonpath([dirpath, TORCH_CSRC]) == TORCH_CSRC
        for name in names:
            stem, ext = os.path.splitext(name)
            if not stem.endswith("_hip"):
                continue
            original = stem[: -len("_hip")] + ext
            moved = not in_torch and original in torch_names
            if moved or os.path.exists(os.path.join(dirpath, original)):
                leftovers.append(os.path.join(dirpath, name))
    return sorted(leftovers)


def build_simt() -> tuple[int, ...]:
    """The wave sizes to build the emulator for: QWEN4EXP_BUILD_SIMT=1 both, 32 or 64 that one
    (tools/check-sanitizers.sh builds 64 only, for CI's time), 0 (the default) none."""
    value = os.environ.get("QWEN4EXP_BUILD_SIMT", "0").strip()
    choices = {"0": (), "1": SIMT_WAVE_SIZES, **{str(w): (w,) for w in SIMT_WAVE_SIZES}}
    if value not in choices:
        sys.exit(f"QWEN4EXP_BUILD_SIMT must be 0, 1, 32 or 64; got {value!r}")
    return choices[value]


def simt_extensions(
    cpp_extension,
    waves: tuple[int, ...],
    hip_sources: list[str],
    opt: list[str],
    sanitize: list[str],
    link: list[str],
):
    """qwen4exp_ext._simt32 and _simt64: the HIP kernels, the SIMT runtime and the GPU host glue
    (csrc/torch/simt/glue.cpp), built by the host C++ compiler for one wave size each.

    -fvisibility=hidden keeps each module's helpers to itself: the kernels' shared helpers take
    their device branch here, and must never bind to the CPU kernels' host versions (or to the
    other wave size's) of the same inline functions. No a·b+c is contracted into an FMA, as on the
    GPUs (setup.py's device flags). `#pragma unroll` is the GPU compilers' and means nothing here.
    """
    simt_sources = [*kernel_sources("simt"), os.path.join(TORCH_CSRC, "simt", "glue.cpp")]
    extensions = []
    for wave in waves:
        flags = [
            *opt,
            *sanitize,
            "-fvisibility=hidden",
            "-ffp-contract=off",
            "-Wno-unknown-pragmas",
            f"-DQWEN4EXP_SIMT_WAVE_SIZE={wave}",
        ]
        extensions.append(
            cpp_extension.CppExtension(
                f"qwen4exp_ext._simt{wave}",
                shims(hip_sources + simt_sources, f"simt_shims/wave{wave}", ".cpp"),
                include_dirs=[CSRC],
                extra_compile_args={"cxx": flags},
                extra_link_args=[*link, *SHARED_LIBSTDCXX],
                py_limited_api=True,
            )
        )
    return extensions


def build_extension():
    import torch
    from torch.utils import cpp_extension

    target = choose_target(torch)
    check_versions(torch, target)
    cpu_sources = kernel_sources("cpu")
    hip_sources = kernel_sources("kernel")
    listed = set(hip_sources) | set(cpu_sources) | set(kernel_sources("cpu_threads"))
    found = glob.glob(os.path.join(CSRC, "hip", "*.hip")) + glob.glob(
        os.path.join(CSRC, "cpu", "*.cpp")
    )
    unlisted = set(found) - listed
    leftovers = hipify_leftovers()
    if leftovers:
        sys.exit(
            "csrc/ holds hipify's copies from a ROCm build by an older setup.py: "
            f"{list(map(rel, leftovers))}; delete them (`git clean -n csrc` lists them)"
        )
    if unlisted:
        sys.exit(f"csrc/kernel_sources.txt does not list {sorted(map(rel, unlisted))}")
    gpu_glue = sorted(glob.glob(os.path.join(TORCH_CSRC, "gpu", "*.cpp")))
    # bindings.cpp defines the ops; cpu_ops.cpp registers the CPU kernels under them and gives
    # them ATen's threads (the CMake library's are OpenMP's: csrc/cpu/threads_openmp.cpp).
    # fresh_output.cpp: the CPU ops' large fresh outputs (issue #51 item 3).
    torch_glue = [
        os.path.join(TORCH_CSRC, name)
        for name in ("bindings.cpp", "cpu_ops.cpp", "fresh_output.cpp")
    ]
    sources = [rel(s) for s in torch_glue + cpu_sources]

    debug = os.environ.get("QWEN4EXP_DEBUG", "0") == "1"
    # QWEN4EXP_SANITIZE=address,undefined (any -fsanitize= list) instruments the host C++ code
    # (the CPU kernels and the glue; not nvcc/hipcc device code). Every report is fatal
    # (-fno-sanitize-recover), and -O1 -g keeps the build quick and the reports' lines exact.
    # -fno-wrapv undoes the -fwrapv of Python's CFLAGS, which makes signed overflow defined and so
    # hides it from UBSan; nvcc and hipcc do not wrap, so the shared code must not overflow.
    # tools/check-sanitizers.sh builds and tests this way; it shows how to load the result.
    sanitize = os.environ.get("QWEN4EXP_SANITIZE", "").strip()
    sanitize_flags = [f"-fsanitize={sanitize}"] if sanitize else []
    if debug:
        opt = ["-O0", "-g"]
    elif sanitize:
        opt = ["-O1", "-g"]
    else:
        opt = ["-O3"]
    sanitize_cxx = []
    if sanitize:
        sanitize_cxx = [
            *sanitize_flags,
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
            "-fno-wrapv",
        ]
    # torch adds -DPy_LIMITED_API itself for py_limited_api=True extensions.
    cxx_flags = [*opt, "-fopenmp", *sanitize_cxx]
    simt = build_simt()
    info = {
        "target": target,
        "backends": ["cpu"],
        "torch": torch.__version__,
        "gpu_archs": [],
        "simt_wave_sizes": list(simt),
    }
    if sanitize:
        info["sanitize"] = sanitize

    if target == "cpu":
        extension_cls = cpp_extension.CppExtension
        extra = {"cxx": cxx_flags}
    else:
        extension_cls = cpp_extension.CUDAExtension
        if target == "rocm":
            info["gpu_archs"] = rocm_archs()
            info["backends"].append("rocm")
            info["hip"] = torch.version.hip
            sources += [rel(s) for s in hip_sources] + [rel(s) for s in gpu_glue]
            # No a·b+c contracted into an FMA: the GPU results then equal the CPU kernels' where
            # the tests claim bit parity (ple_conv; README "Floating point on the GPU").
            extra = {
                "cxx": cxx_flags + ["-D__HIP_PLATFORM_AMD__=1"],
                "nvcc": [*opt, "-ffp-contract=off"],
            }
        else:
            info["gpu_archs"] = cuda_archs()
            info["backends"].append("cuda")
            info["cuda"] = torch.version.cuda
            sources += shims(hip_sources, "nvcc_shims", ".cu") + [rel(s) for s in gpu_glue]
            extra = {
                "cxx": cxx_flags,
                "nvcc": [*opt, "--expt-relaxed-constexpr", "-lineinfo", "--fmad=false"],
            }
    info_json = json.dumps(info, sort_keys=True)
    define = f"-DQWEN4EXP_BUILD_INFO_JSON={json.dumps(info_json)}"
    extra["cxx"].append(define)
    print(f"qwen4exp_ext: building {info_json}", flush=True)
    include_dir = CSRC
    if target == "rocm":
        # torch hipifies the sources (and the headers they include) as it builds the extension:
        # in the mirror, never in csrc/ (HIPIFY_CSRC).
        copied = mirror_csrc()
        sources = [rel(in_mirror(os.path.join(ROOT, s))) for s in sources]
        include_dir = HIPIFY_CSRC
    ext = extension_cls(
        "qwen4exp_ext._kernels",
        sources,
        include_dirs=[include_dir],
        extra_compile_args=extra,
        extra_link_args=["-fopenmp", *sanitize_flags, *SHARED_LIBSTDCXX],
        py_limited_api=True,
    )
    if target == "rocm":
        prune_mirror(copied)
    extensions = [ext]
    if simt:
        extensions += simt_extensions(
            cpp_extension, simt, hip_sources, opt, sanitize_cxx, sanitize_flags
        )
    return extensions, cpp_extension.BuildExtension


def main() -> None:
    extensions, build_ext = build_extension()
    setup(
        ext_modules=extensions,
        cmdclass={"build_ext": build_ext},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )


if __name__ == "__main__":
    if shutil.which("ninja") is None:
        print("qwen4exp_ext: ninja not found; the build runs serially", flush=True)
    main()
