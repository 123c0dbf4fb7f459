"""The SIMT emulator itself (csrc/simt): its C++ self-test, which runs right kernels and kernels
with the bugs it exists to catch (a missing __syncthreads, a reduction written for 32 lanes run
at 64, barriers and shuffles in divergent code, launches a GPU refuses), built for both wave sizes
and both fiber switches; and its Python entry, qwen4exp_ext.simt."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import backends, run_cpp_check
from qwen4exp_ext import ops, simt

SIMT_BACKENDS = [b for b in backends() if b.name.startswith("simt")]
needs_simt = pytest.mark.skipif(not SIMT_BACKENDS, reason="built without QWEN4EXP_BUILD_SIMT=1")


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
@pytest.mark.parametrize("wave_size", simt.WAVE_SIZES)
@pytest.mark.parametrize("switch", ["assembly", "ucontext"])
def test_self_test_catches_the_bugs_it_exists_for(tmp_path, wave_size, switch):
    output = run_cpp_check(
        tmp_path,
        "simt_selftest",
        "-Wno-unknown-pragmas",
        f"-DQWEN4EXP_SIMT_WAVE_SIZE={wave_size}",
        *(["-DQWEN4EXP_SIMT_UCONTEXT"] if switch == "ucontext" else []),
        sources=("csrc/simt/runtime.cpp",),
    )
    assert f"(wave size {wave_size})" in output


def test_wave_sizes_are_checked():
    with pytest.raises(ValueError, match="wave_size must be one of"):
        simt.ops(48)


@needs_simt
@pytest.mark.parametrize("backend", SIMT_BACKENDS, ids=str)
def test_ops_live_in_their_own_library(backend):
    """Each wave size registers its own op library, with the kernel ops' schemas, and leaves
    torch.ops.qwen4exp (the CPU kernels here) alone."""
    library = backend.ops.namespace
    assert library == f"qwen4exp_simt{backend.name[4:]}"
    hc_ops = ("hc_combine_norm", "hc_combine", "grouped_gemma_rmsnorm", "hc_gate_mix", "hc_silu")
    for name in (
        ("ngram_ids", "gather_rows", "ple_gate", "ple_gate_out", "ple_conv")
        + hc_ops
        + tuple(f"{op}_out" for op in hc_ops)
    ):
        ours = getattr(torch.ops.qwen4exp, name).default._schema
        emulated = getattr(getattr(torch.ops, library), name).default._schema
        assert str(emulated).split("::", 1)[1] == str(ours).split("::", 1)[1]
    assert simt.ops(int(backend.name[4:])) is backend.ops


@needs_simt
@pytest.mark.parametrize("backend", SIMT_BACKENDS, ids=str)
def test_emulated_ops_run_the_gpu_kernels(backend):
    """The emulated op is the GPU path, not the CPU kernel again: a query_start_loc that the CPU
    rejects is data to the GPU kernel (its tokens read EOS)."""
    lay = dict(
        layer_multipliers=torch.tensor([3, 5, 7]),
        ngram_heads_vocab_sizes=torch.tensor([11, 13]),
        ngram_heads_offsets=torch.tensor([0, 11]),
        eos_token_id=0,
        heads_per_ngram=1,
    )
    args = (
        torch.tensor([4, 5, 6]),
        torch.tensor([1, 3], dtype=torch.int32),
        torch.ones(1, 2, dtype=torch.long),
    )
    with pytest.raises(RuntimeError, match=r"query_start_loc\[0\] must be 0"):
        ops.ngram_ids(*args, **lay)
    ids = backend.ops.ngram_ids(*args, **lay)
    assert ids.shape == (3, 2) and bool(((ids >= 0) & (ids < 24)).all())


@needs_simt
def test_the_most_heads_fit_a_blocks_shared_memory():
    """ngram_ids' dynamic shared memory holds a 32-byte divisor per head: the argument checks
    allowed 4096 heads (128 KiB), more than any GPU block has, where the CPU worked. Now the most
    heads allowed must launch (the emulator refuses what a GPU would)..."""
    kernels = simt.ops(64)
    heads = 1024
    sizes = torch.full((heads,), 7, dtype=torch.long)
    out = kernels.ngram_ids(
        torch.tensor([1, 2, 3]),
        torch.tensor([0, 3], dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.long),
        torch.tensor([3, 5]),
        sizes,
        torch.arange(heads) * 7,
        0,
        heads,
    )
    assert bool(((out >= torch.arange(heads) * 7) & (out < torch.arange(heads) * 7 + 7)).all())
    # ...and one more is an argument error on every backend, before anything launches.
    for kernel_ops in (ops, kernels):
        with pytest.raises(RuntimeError, match="more than the supported 1024"):
            kernel_ops.ngram_ids(
                torch.tensor([1]),
                torch.tensor([0, 1], dtype=torch.int32),
                torch.zeros(1, 1, dtype=torch.long),
                torch.tensor([3, 5]),
                torch.full((heads + 1,), 7, dtype=torch.long),
                torch.arange(heads + 1) * 7,
                0,
                heads + 1,
            )
