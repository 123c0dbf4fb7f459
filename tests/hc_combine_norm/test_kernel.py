"""hc_combine_norm's kernels (issue #50) on every backend this machine has (cpu, and the HIP kernel
on the SIMT emulator at wave 32 and 64): against the oracle in every dtype on strided and
contiguous rows, against vLLM's own Triton kernel on Triton's CPU interpreter (fp16: the share
of bit-equal elements and one unit in the last place; fp32: the stated tolerance,
qwen4exp_ext.testing), out=, empty batches and opcheck. The checks are
tests/hc_kernel_support.py's.
"""

from __future__ import annotations

import pytest
import torch

import hc_kernel_support as checks
import hc_support
from conftest import backends

OP = "hc_combine_norm"
BACKENDS = backends()


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", checks.DTYPES, ids=str)
@pytest.mark.parametrize("shape", checks.SHAPES, ids=str)
@pytest.mark.parametrize("strided", [True, False], ids=["strided", "contiguous"])
def test_matches_oracle(backend, dtype, shape, strided):
    checks.check_matches_oracle(backend, OP, dtype, shape, strided=strided)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(3, 40, 4), (2, 33, 3), (1, 520, 2)], ids=str)
def test_matches_vllm_triton_kernel(backend, dtype, shape):
    checks.check_matches_vllm(backend, OP, dtype, shape)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", checks.DTYPES, ids=str)
def test_out_writes_into_strided_views(backend, dtype):
    checks.check_out(backend, OP, dtype)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_empty_batch(backend):
    checks.check_empty(backend, OP)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_opcheck(backend):
    checks.check_opcheck(backend, OP)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize(
    "batch_kw",
    [
        dict(per_branch=False),  # one [H] weight shared by the streams
        dict(weight_dtype=torch.float32),  # fp32 weights of bf16 activations
        dict(per_branch=False, weight_dtype=torch.float32, strided=False),
    ],
    ids=str,
)
def test_norm_weight_layouts(backend, batch_kw):
    checks.check_matches_oracle(backend, OP, torch.bfloat16, (3, 40, 4), **batch_kw)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", checks.DTYPES, ids=str)
def test_without_injection_logits(backend, dtype):
    """injection_logits None (vLLM's NVIDIA module): the block output added as it is."""
    batch = hc_support.hc_batch(3, 33, 3, dtype, seed=9)
    batch.injection_logits = None
    got = checks.run(backend, OP, *hc_support.op_args(OP, batch))
    expected = hc_support.as_tuple(hc_support.oracle(OP, batch))
    for g, e in zip(got, expected, strict=True):
        checks.assert_within(g, e, checks.tolerance(OP, dtype), f"{backend} {OP} no logits")


@pytest.mark.parametrize("shape", [(3, 40, 4), (2, 1500, 2), (2, 2560, 4), (1, 4700, 2)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_cpu_sums_in_the_interpreters_order(shape, dtype):
    """Without logits (no exp) nothing but the order of the sum of squares could part the CPU
    kernel from vLLM's NVIDIA kernel on the interpreter: 512-wide tiles, each numpy's pairwise
    sum, then numpy's sum of the next_pow2(tiles) tile sums. Bit for bit, at widths of 1, 3-4, 5
    and 9-10 tiles (numpy sums fewer than 8 tile sums in a row, 8 to 128 in eight lanes)."""
    cpu = next(b for b in BACKENDS if b.name == "cpu")
    for name, measured in checks.vllm_parity(
        cpu, OP, dtype, shape, vendor="nvidia", no_logits=True
    ):
        assert measured.equal_share == 1.0, f"{name}: {measured}"


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("width", [40, 1500, 2560], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_xn_is_the_grouped_norm_of_h(backend, width, dtype):
    """SPEC §10's delayed combine: hc_combine_norm's h is hc_combine's, its xn
    grouped_gemma_rmsnorm(h)'s, bit for bit. The HIP kernels share one norm (every width); the CPU
    kernels follow the interpreter's two orders (512-wide tiles, next_pow2(H)), which agree at
    these widths (1, 3 and 5 tiles) but not at 4 or 9+ tiles, where vLLM's own kernels on the
    interpreter differ from each other too."""
    batch = hc_support.hc_batch(2, width, 4, dtype, seed=width)
    h, xn = checks.run(backend, OP, *hc_support.op_args(OP, batch))
    (combined,) = checks.run(backend, "hc_combine", *hc_support.op_args("hc_combine", batch))
    (normed,) = checks.run(
        backend, "grouped_gemma_rmsnorm", h, batch.norm_weight, batch.eps, batch.hc_count
    )
    checks.assert_exact(h, combined, "h against hc_combine", bitwise=True)
    checks.assert_exact(xn, normed, "xn against grouped_gemma_rmsnorm(h)", bitwise=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(2, 2560, 4), (2, 520, 2)], ids=str)
def test_results_do_not_depend_on_alignment(backend, dtype, shape):
    checks.check_alignment_independent(backend, OP, dtype, shape)
