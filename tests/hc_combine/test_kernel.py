"""hc_combine's kernels (issue #50) on every backend this machine has (cpu, and the HIP kernel on
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

OP = "hc_combine"
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
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_without_injection_logits_equals_vllm_nvidia(backend, dtype):
    """injection_logits None (vLLM's NVIDIA module): residual + block, one rounding: bit for bit
    on every backend."""
    for name, measured in checks.vllm_parity(
        backend, OP, dtype, (3, 33, 3), vendor="nvidia", no_logits=True
    ):
        assert measured.equal_share == 1.0, f"{name}: {measured}"
