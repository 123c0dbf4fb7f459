"""hc_silu's kernels (issue #50) on every backend this machine has (cpu, and the HIP kernel on the
SIMT emulator at wave 32 and 64): against the oracle in every dtype on strided and contiguous
rows, against vLLM's own Triton kernel on Triton's CPU interpreter (fp16: the share of bit-equal
elements and one unit in the last place; fp32: the stated tolerance, qwen4exp_ext.testing),
out=, empty batches and opcheck. The checks are tests/hc_kernel_support.py's.
"""

from __future__ import annotations

import pytest
import torch

import hc_kernel_support as checks
from conftest import backends
from qwen4exp_ext.testing import assert_exact

OP = "hc_silu"
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hc", [1, 3, 4, 64, 65])
def test_every_16_bit_input_as_the_gpu_kernels_compute_it(backend, dtype, hc):
    """Every bf16/fp16 bit pattern (inf and NaN included) as x, in rows with a row stride: z =
    x / HC in fp32, then z·(1/(1+exp(-z))) with a correctly rounded exp, rounded to the dtype,
    which is what the GPU kernels compute (float_types.h's sigmoid_f32). Bit for bit on every
    backend: the CPU looks it up for HC <= 64 and computes it with its vector exp past that
    (which measured exact on every input too: HC = 65, 100, 1000)."""
    ops, device = backend.ops, backend.device
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = torch.zeros(256, 300, dtype=dtype)[:, :256]  # rows of 256 with a row stride of 300
    x.copy_(bits.view(256, 256))
    z = x.float() / hc
    expected = (z * (1.0 / (1.0 + torch.exp(-z.double()).float()))).to(dtype)
    got = ops.hc_silu(x.to(device), hc).cpu()
    assert_exact(got, expected, f"hc_silu, HC = {hc}", equal_nan=True)
