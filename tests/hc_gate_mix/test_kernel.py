"""hc_gate_mix's kernels (issue #50) on every backend this machine has (cpu, and the HIP kernel on
the SIMT emulator at wave 32 and 64): against the oracle in every dtype on strided and
contiguous rows, against vLLM's own Triton kernel on Triton's CPU interpreter (fp16: the share
of bit-equal elements and one unit in the last place; fp32: the stated tolerance,
qwen4exp_ext.testing), out=, empty batches and opcheck. The checks are
tests/hc_kernel_support.py's.
"""

from __future__ import annotations

import pytest
import torch

import hc_kernel_support as checks
from conftest import backends

OP = "hc_gate_mix"
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


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.name != "cpu"], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("width", [2560, 40, 33, 7], ids=str)
def test_16_bit_cpu_equals_the_gpu_kernel_bit_for_bit(backend, dtype, width):
    """In bf16 and fp16 the CPU kernel looks each gate's sigmoid up in a table of the GPU's own
    sigmoid_f32 (correctly rounded exp), in whole 16-column blocks and in a row's last columns:
    with the same fp32 operations in the same order, the CPU and the HIP kernel agree bit for
    bit, NaN and inf gates included."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(5, 4 * width, generator=gen).to(dtype)
    gate = (torch.randn(5, 4 * width, generator=gen) * 4).to(dtype)
    x[0, 3] = float("nan")
    gate[1, 5] = float("inf")
    gate[2, 6] = float("nan")
    gate[3, 1] = float("-inf")
    cpu = next(b for b in BACKENDS if b.name == "cpu")
    got = checks.run(cpu, OP, x, gate, 4)[0]
    expected = checks.run(backend, OP, x, gate, 4)[0]
    checks.assert_exact(got, expected, f"cpu against {backend}", bitwise=True)
