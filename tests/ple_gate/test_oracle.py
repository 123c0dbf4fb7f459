"""The oracle reference.ple_gate itself (SPEC §5): its "vllm" rounding against vLLM's eager op
sequence in torch, and its two rounding modes against its own fp32 evaluation. CPU only; every
case is seeded."""

from __future__ import annotations

import math

import pytest
import torch

from qwen4exp_ext import reference as ref
from qwen4exp_ext.testing import assert_exact

from .support import gate_inputs


def eager_vllm_gate(key, value, hidden, w_k, w_q, w_c, eps):
    """vLLM's eager op sequence in the storage dtype (what its Triton kernel reproduces)."""
    width = value.shape[-1]
    streams = hidden.shape[-1] // width

    def norm(x, w):
        g = x.float().unflatten(-1, (streams, width))
        g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)
        return (g.flatten(-2) * (1.0 + w.float())).to(x.dtype)

    k = norm(key, w_k).unflatten(-1, (streams, width))
    q = norm(hidden, w_q).unflatten(-1, (streams, width))
    gate = (k * q).sum(dim=-1, keepdim=True) / math.sqrt(width)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
    return gated, norm(gated, w_c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 8, 2), (13, 24, 3), (7, 160, 4)], ids=str)
def test_ple_gate_vllm_rounding_matches_eager(dtype, shape):
    key, value, hidden, weights = gate_inputs(*shape, dtype)
    gated, conv_in = ref.ple_gate(key, value, hidden, *weights, 1e-6, rounding="vllm")
    e_gated, e_conv = eager_vllm_gate(key, value, hidden, *weights, 1e-6)
    assert gated.dtype == dtype and conv_in.dtype == dtype
    # fp32 differs only by the reduction order of mean vs sum/H
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(gated, e_gated, **tol)
    torch.testing.assert_close(conv_in, e_conv, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_ple_gate_rounding_modes_against_fp32(dtype):
    """The two low-precision modes each stay within a few output ulps of the fp32 gate."""
    key, value, hidden, weights = gate_inputs(64, 32, 4, dtype, seed=6)
    as32 = lambda xs: [x.float() for x in xs]  # noqa: E731
    g32, c32 = ref.ple_gate(*as32([key, value, hidden]), *as32(weights), 1e-6)
    eps = torch.finfo(dtype).eps
    for mode, ulps in (("fp32", 1), ("vllm", 8)):
        gated, conv_in = ref.ple_gate(key, value, hidden, *weights, 1e-6, rounding=mode)
        torch.testing.assert_close(gated.float(), g32, rtol=ulps * eps, atol=ulps * eps)
        torch.testing.assert_close(conv_in.float(), c32, rtol=ulps * eps, atol=ulps * eps)
    same = ref.ple_gate(key, value, hidden, *weights, 1e-6, rounding="fp32")
    assert_exact(same[0], g32.to(dtype))  # fp32 mode == the fp32 computation rounded once
