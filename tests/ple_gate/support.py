"""ple_gate's batch builders and comparison helpers, shared by the tests of tests/ple_gate/.

Tolerances, as data, with the reason for each: ``qwen4exp_ext.testing.TOLERANCES`` ("vllm"
rounding within two units in the last place of the reference, and bit for bit with vLLM's kernel
on the CPU in fp16; the fast "fp32" pass within one unit of the exact fp64 result, and in
bf16/fp16 never further from it than 2x the "vllm"-rounded result is).
"""

from __future__ import annotations

import math

import torch

from qwen4exp_ext.testing import assert_within, tolerance

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6


def make_inputs(
    tokens,
    width,
    streams,
    dtype,
    *,
    weight_dtype=None,
    seed=0,
    device="cpu",
    scale=3.0,
    hidden_strided=False,
):
    """key and value as column slices of one [T, C+H] projection (as the layer makes them),
    hidden [T, C] (or a column slice of a wider buffer), weights [C] near zero (Gemma's 1+w)."""
    g = torch.Generator().manual_seed(seed)
    channels = width * streams
    kv = torch.randn(tokens, channels + width, generator=g).to(dtype).to(device)
    hidden_full = (torch.randn(tokens, channels + 3, generator=g) * scale).to(dtype).to(device)
    # Sliced on the device: .to(device) of a column slice would be a contiguous copy.
    hidden = hidden_full[:, 3:] if hidden_strided else hidden_full[:, :channels].contiguous()
    wdt = weight_dtype or dtype
    weights = [(torch.randn(channels, generator=g) * 0.2).to(wdt) for _ in range(3)]
    weights = [w.to(device) for w in weights]
    return kv[:, :channels], kv[:, channels:], hidden, weights


def gate_inputs(tokens, width, streams, dtype, seed=5):
    """The oracle tests' inputs (CPU): key and value split from one [T, C+H] projection (strided
    views), hidden [T, C] contiguous, weights [C] in the activations' dtype."""
    gen = torch.Generator().manual_seed(seed)
    hc = width * streams
    kv = torch.randn(tokens, hc + width, generator=gen).to(dtype)
    key, value = kv.split([hc, width], dim=-1)  # strided views, as the kv projection gives them
    hidden = (torch.randn(tokens, hc, generator=gen) * 3).to(dtype)
    weights = [(torch.randn(hc, generator=gen) * 0.3).to(dtype) for _ in range(3)]
    return key, value, hidden, weights


def exact_gate(key, value, hidden, weights, eps=EPS):
    """SPEC §5 evaluated in fp64 (no rounding at all), outputs in fp64."""
    wk, wq, wc = (w.double() for w in weights)
    tokens, channels = hidden.shape
    width = value.shape[1]
    streams = channels // width

    def gn(x, w):
        x = x.double().reshape(tokens, streams, width)
        scale = torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
        return x * scale * (1 + w.reshape(streams, width))

    d = (gn(key, wk) * gn(hidden, wq)).sum(-1) / math.sqrt(width)
    g = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp(min=1e-6)))
    gated = (g[..., None] * value.double()[:, None, :]).reshape(tokens, channels)
    return gated, gn(gated, wc).reshape(tokens, channels)


def assert_close(got, expected, dtype, rounding, what="", against="reference"):
    """Within the stated tolerance of ple_gate in this rounding and dtype (compared in fp64)."""
    tol = tolerance("ple_gate", dtype, rounding=rounding, against=against)
    assert_within(got.cpu().double(), expected.cpu().double(), tol, what)
