"""Shared test setup: fixed seeds, hypothesis profiles, the devices and kernel backends."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings

from qwen4exp_ext import reference
from qwen4exp_ext.bench import vllm_triton

# CI runs the same examples every time (derandomize); a developer can ask for a longer search with
# HYPOTHESIS_PROFILE=dev.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _import_triton_for_its_interpreter() -> None:
    """Triton decides once, when ``triton.language`` is imported, whether its standard library
    (``tl.zeros``, ``tl.sum``...) is made of interpreter functions: imported first by anything
    else (torch.compile does, when it probes for Triton), vLLM's kernels then fail under the CPU
    interpreter with "Cannot call @triton.jit'd outside of the scope of a kernel", so the
    outcome of tests/ple_conv/test_kernel.py depended on which test file ran first. On a machine
    with no GPU, nothing else can use Triton, so the session imports it under the interpreter
    before any test does. With a GPU, Triton stays as it is for torch.compile."""
    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    if importlib.util.find_spec("triton") is None or vllm_triton.ple_source_path() is None:
        return
    with vllm_triton.interpreter():
        import triton.language  # noqa: F401


_import_triton_for_its_interpreter()


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    torch.manual_seed(0)


def devices() -> list[str]:
    """CPU always; the GPU too when this machine has one and the extension was built for it."""
    import qwen4exp_ext

    found = ["cpu"]
    if torch.cuda.is_available() and len(qwen4exp_ext.build_info()["backends"]) > 1:
        found.append("cuda")
    return found


@dataclass(frozen=True)
class Backend:
    """Where a kernel test runs: ``ops`` (the kernel ops that csrc/torch/schemas.h defines,
    :mod:`qwen4exp_ext.ops` or a :class:`~qwen4exp_ext.ops.KernelOps`) on tensors on
    ``device``, registered in the torch op library ``library`` (for opcheck). "cpu" and "cuda"
    are torch.ops.qwen4exp's kernels; "simt32" and "simt64" are the HIP kernels on the SIMT
    emulator, on CPU tensors; "oracle" is reference.py behind the same doors (:class:`OracleOps`,
    no op library: ``library`` is None)."""

    name: str
    device: str
    ops: Any
    library: Any

    @property
    def reads_indices_on_device(self) -> bool:
        """The HIP kernels (GPU or emulator): bad index *values* are skipped, not rejected,
        unless debug checks are on (the CPU kernels and the oracle always reject them)."""
        return self.name not in ("cpu", "oracle")

    @property
    def is_oracle(self) -> bool:
        return self.name == "oracle"

    def __str__(self) -> str:
        return self.name


class OracleOps:
    """The oracle, ``qwen4exp_ext.reference`` (SPEC's executable form), behind the kernel ops'
    doors (:class:`qwen4exp_ext.ops.KernelOps`' calls), so that a property of an op is written
    once and holds for the oracle and for every kernel: the ops whose properties run on it
    (tests/<op>/test_properties.py). Their reference functions take the doors' arguments, but
    ple_gate's ``out=``, which is written here as the kernels write it."""

    namespace = None
    ngram_ids = staticmethod(reference.ngram_ids)
    gather_rows = staticmethod(reference.gather_rows)
    ple_conv = staticmethod(reference.ple_conv)

    def __repr__(self) -> str:
        return "OracleOps()"

    @staticmethod
    def ple_gate(*args, out=None, **kwargs):
        gated, conv_input = reference.ple_gate(*args, **kwargs)
        if out is None:
            return gated, conv_input
        out_gated, out_conv_input = out
        out_gated.copy_(gated)
        out_conv_input.copy_(conv_input)
        return out_gated, out_conv_input

    # The hyper-connection ops (SPEC §10): out= is one tensor, or (h, xn) for hc_combine_norm.
    @staticmethod
    def _into(result, out):
        if out is None:
            return result
        if isinstance(result, tuple):
            for target, value in zip(out, result, strict=True):
                target.copy_(value)
            return tuple(out)
        return out.copy_(result)

    @staticmethod
    def hc_combine_norm(*args, out=None):
        return OracleOps._into(reference.hc_combine_norm(*args), out)

    @staticmethod
    def grouped_gemma_rmsnorm(*args, out=None):
        return OracleOps._into(reference.grouped_gemma_rmsnorm(*args), out)

    @staticmethod
    def hc_silu(*args, out=None):
        return OracleOps._into(reference.hc_silu(*args), out)

    @staticmethod
    def hc_gate_mix(*args, out=None):
        return OracleOps._into(reference.hc_gate_mix(*args), out)

    @staticmethod
    def hc_combine(residual, block_output, injection_logits, hc_count, *, out=None):
        result = reference.hc_combine(residual, block_output, injection_logits, hc_count)
        return OracleOps._into(result, out)


ORACLE = Backend("oracle", "cpu", OracleOps(), None)


def backends(*, oracle: bool = False) -> list[Backend]:
    """Every backend of the kernel tests this build and machine have: cpu, cuda (with a GPU and a
    GPU build) and the SIMT emulator at both wave sizes (a build with QWEN4EXP_BUILD_SIMT=1, which
    tools/run-tests.sh always makes; QWEN4EXP_REQUIRE_SIMT=1 makes its absence an error).
    ``oracle=True`` puts the oracle (:class:`OracleOps`) first: for properties that SPEC states
    and that the oracle must hold as every kernel does."""
    from qwen4exp_ext import ops, simt

    found = [ORACLE] if oracle else []
    found += [Backend(d, d, ops, torch.ops.qwen4exp) for d in devices()]
    waves = simt.available()
    if os.environ.get("QWEN4EXP_REQUIRE_SIMT") == "1" and waves != simt.WAVE_SIZES:
        raise RuntimeError(
            f"QWEN4EXP_REQUIRE_SIMT=1 but this build has SIMT wave sizes {waves}; "
            "build with QWEN4EXP_BUILD_SIMT=1"
        )
    for wave in waves:
        kernel_ops = simt.ops(wave)
        found.append(
            Backend(f"simt{wave}", "cpu", kernel_ops, getattr(torch.ops, kernel_ops.namespace))
        )
    return found


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cpp_check(tmp_path, name: str, *flags: str, sources: tuple[str, ...] = ()) -> str:
    """Builds tests/cpp/<name>.cpp (with csrc/ on the include path and `sources`, relative to the
    repository) with the host compiler, warnings as errors, runs it and returns its output; the
    check passed when it exits 0 and its output starts with "ok "."""
    exe = tmp_path / name
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            *flags,
            "-I",
            os.path.join(ROOT, "csrc"),
            os.path.join(ROOT, "tests", "cpp", f"{name}.cpp"),
            *(os.path.join(ROOT, s) for s in sources),
            "-o",
            str(exe),
        ],
        check=True,
    )
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok "), result.stdout
    return result.stdout


@pytest.fixture
def one_process_group():
    """A gloo world of one process, for vocabulary-shard tests: a shard's reduce then sums one
    partial (itself)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method="file://" + os.path.join(tmp, "store"), rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()
