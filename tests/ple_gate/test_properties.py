"""ple_gate's properties (SPEC §5, §9.1 and §9.8's fast-pass tolerance), each written once over
the oracle and every kernel backend (conftest.backends(oracle=True)): strided views and out=
views give the values of contiguous inputs (§5: row-major views, any row stride), d = 0 gives
g = 1/2 (§5: sign(0) = 0), the "fp32" pass within its tolerance of an fp64 evaluation and, in
bf16/fp16, never further from it than twice the "vllm" result (§9.8), and rows independent of
their batch (§9.1).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import backends
from qwen4exp_ext import reference
from qwen4exp_ext.testing import assert_exact, same_layout

from .support import DTYPES, EPS, assert_close, exact_gate, gate_inputs, make_inputs

BACKENDS = backends(oracle=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_mode_tolerance(backend, dtype):
    """SPEC §9.8: the fast single pass against fp64: within one ulp of the output dtype, and in
    bf16/fp16 at most 2x the error of vLLM's rounding. In fp32 both modes are plain fp32
    arithmetic; the kernels' fast one sums in 8 lanes instead of a pairwise tree and stays within
    2e-5 relative."""
    ops, device = backend.ops, backend.device
    key, value, hidden, weights = make_inputs(300, 640, 4, dtype, device=device, seed=3)
    exact = exact_gate(key.cpu(), value.cpu(), hidden.cpu(), [w.cpu() for w in weights])
    fast = ops.ple_gate(key, value, hidden, *weights, EPS, rounding="fp32")
    vllm = ops.ple_gate(key, value, hidden, *weights, EPS, rounding="vllm")
    for f, v, e in zip(fast, vllm, exact, strict=True):
        assert_close(f, e.to(dtype), dtype, "fp32")
        fast_err = (f.cpu().double() - e).abs().max().item()
        vllm_err = (v.cpu().double() - e).abs().max().item()
        if dtype != torch.float32:
            assert fast_err <= 2 * vllm_err


def strided_inputs(layout, dtype, device):
    """The two layouts: "hidden_slice", hidden a column slice of a wider buffer and fp32 weights
    (also with 16-bit activations), [23, 96·3]; "kv_split", hidden contiguous and weights in the
    activations' dtype, [5, 8·2]. In both, key and value are column slices of one [T, C+H]
    projection."""
    if layout == "hidden_slice":
        key, value, hidden, weights = make_inputs(
            23, 96, 3, dtype, device=device, hidden_strided=True, weight_dtype=torch.float32
        )
        assert not hidden.is_contiguous()
    else:
        key, value, hidden, weights = gate_inputs(5, 8, 2, dtype)
        key, value, hidden = (same_layout(t, device) for t in (key, value, hidden))
        weights = [w.to(device) for w in weights]
    assert not key.is_contiguous() and not value.is_contiguous()
    return key, value, hidden, weights


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["vllm", "fp32"])
@pytest.mark.parametrize("layout", ["hidden_slice", "kv_split"])
def test_strided_views_and_out(backend, dtype, rounding, layout):
    """SPEC §5 (row-major views, any row stride): strided key, value and hidden and out= views
    into wider buffers give the same values, bit for bit, as contiguous inputs, and nothing
    outside the views is touched; all within the tolerance of the reference."""
    ops, device = backend.ops, backend.device
    key, value, hidden, weights = strided_inputs(layout, dtype, device)
    tokens, channels = hidden.shape
    expected = ops.ple_gate(
        key.contiguous(), value.contiguous(), hidden.contiguous(), *weights, EPS, rounding=rounding
    )
    wide = torch.full((2, tokens, channels + 12), 7.0, dtype=dtype, device=device)
    out = (wide[0, :, 5 : channels + 5], wide[1, :, 1 : channels + 1])
    got = ops.ple_gate(key, value, hidden, *weights, EPS, rounding=rounding, out=out)
    assert got[0].data_ptr() == out[0].data_ptr()
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    assert torch.all(wide[0, :, :5] == 7) and torch.all(wide[0, :, channels + 5 :] == 7)
    assert torch.all(wide[1, :, :1] == 7) and torch.all(wide[1, :, channels + 1 :] == 7)
    ref = reference.ple_gate(
        key.cpu(), value.cpu(), hidden.cpu(), *(w.cpu() for w in weights), EPS, rounding=rounding
    )
    for g, e in zip(got, ref, strict=True):
        assert_close(g, e, dtype, rounding)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["vllm", "fp32"])
def test_zero_dot_gives_half(backend, dtype, rounding):
    """SPEC §5: hidden = 0 makes the normalised query 0, so d = 0, sign(0) = 0 and g = 1/2
    exactly: gated is value / 2 in every stream."""
    key, value, hidden, weights = gate_inputs(5, 8, 2, dtype)
    hidden = torch.zeros_like(hidden)
    device = backend.device
    args = [same_layout(t, device) for t in (key, value, hidden)]
    gated, _ = backend.ops.ple_gate(*args, *(w.to(device) for w in weights), EPS, rounding=rounding)
    assert_exact(gated.cpu(), (0.5 * value.float()).repeat(1, 2).to(dtype))


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@given(tokens=st.integers(1, 30), data=st.data(), rounding=st.sampled_from(["vllm", "fp32"]))
def test_property_rows_are_independent(backend, tokens, data, rounding):
    """§9.1 for the gate: a batch gives the same rows as any split of it (bit for bit)."""
    ops, device = backend.ops, backend.device
    key, value, hidden, weights = make_inputs(
        tokens, 64, 2, torch.bfloat16, device=device, seed=tokens
    )
    whole = ops.ple_gate(key, value, hidden, *weights, EPS, rounding=rounding)
    cut = data.draw(st.integers(0, tokens))
    parts = [
        ops.ple_gate(key[a:b], value[a:b], hidden[a:b], *weights, EPS, rounding=rounding)
        for a, b in ((0, cut), (cut, tokens))
    ]
    for i in range(2):
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])
