"""ple_gate's kernels (SPEC §5) on every backend this machine has: parity with vLLM 0.33.0's own
Triton kernel (run by Triton's CPU interpreter), the CPU kernel's summation order (bit for bit
with numpy), parity with the reference oracle on odd shapes and strided views in every dtype
(SPEC §9.8, also under hypothesis), more (token, stream)s than one GPU launch takes, NaNs, opcheck
and a torch.compile smoke test. The tolerances are in tests/ple_gate/support.py's docstring.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import backends
from qwen4exp_ext import ops, reference
from qwen4exp_ext.bench import vllm_triton
from qwen4exp_ext.testing import assert_within, same_layout, tolerance

from .support import DTYPES, EPS, assert_close, make_inputs

BACKENDS = backends()


# --- vLLM's own kernel ---------------------------------------------------------------------------

VLLM = vllm_triton.load()
needs_vllm = pytest.mark.skipif(
    VLLM is None, reason="vllm==0.33.0 (pip install --no-deps) and triton are needed"
)


def vllm_gate(key, value, hidden, weights):
    """vLLM's `_ple_gate_kernel` under the interpreter. Its `ple_gate` wrapper only admits
    bf16/fp16; the kernel itself is dtype-generic, so fp32 launches it directly (same grid)."""
    with vllm_triton.interpreter():
        if hidden.dtype != torch.float32:
            return VLLM.ple_gate(key, value, hidden, *weights, EPS)
        width = value.shape[1]
        streams = hidden.shape[1] // width
        gated, normed = torch.empty_like(hidden), torch.empty_like(hidden)
        VLLM._ple_gate_kernel[(hidden.shape[0], streams)](
            key,
            value,
            hidden,
            *weights,
            gated,
            normed,
            key.stride(0),
            value.stride(0),
            EPS,
            H=width,
            HC=streams,
            BLOCK_H=1 << (width - 1).bit_length(),
            num_warps=4,
            launch_pdl=False,
        )
        return gated, normed


# vLLM's results, by test case: the interpreter is slow, and every backend compares with them.
_VLLM_RESULTS: dict = {}


@needs_vllm
@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "tokens,width,streams", [(5, 100, 3), (3, 2624, 1), (4, 656, 4), (7, 3, 5), (2, 130, 2)]
)
def test_matches_vllm_triton_kernel(backend, dtype, tokens, width, streams):
    """The CPU kernel, which sums in vLLM's order: fp16 bit for bit, fp32 within 1e-6. The GPU
    kernels sum in a tree: within the "vllm" tolerance (qwen4exp_ext.testing.TOLERANCES)."""
    key, value, hidden, weights = make_inputs(tokens, width, streams, dtype, seed=tokens)
    case = (dtype, tokens, width, streams)
    if case not in _VLLM_RESULTS:
        _VLLM_RESULTS[case] = vllm_gate(key, value, hidden, weights)
    expected = _VLLM_RESULTS[case]
    device = backend.device
    got = backend.ops.ple_gate(
        *(same_layout(t, device) for t in (key, value, hidden, *weights)), EPS
    )
    for g, e, name in zip(got, expected, ("gated", "conv_input"), strict=True):
        if backend.name != "cpu":
            assert_close(g, e, dtype, "vllm", name, against="vllm")
        else:
            tol = tolerance("ple_gate", dtype, rounding="vllm", against="vllm_same_order")
            assert_within(g, e, tol, name)


def numpy_order_gate(key, value, hidden, weights, eps=EPS):
    """vLLM's `_ple_gate_kernel` operation by operation in numpy fp32, rounded to the storage
    dtype where it rounds, its sums numpy's own (pairwise) sums over the zero-padded power-of-two
    block: the order the CPU kernel documents. Independent of the interpreter, so it also pins
    bf16, where the interpreter's bf16 handling differs from vLLM's compiled kernel."""
    import numpy as np

    dtype = hidden.dtype
    tokens, channels = hidden.shape
    width = value.shape[1]
    streams = channels // width
    block = 1 << (width - 1).bit_length()
    f32 = np.float32

    def rnd(x):
        return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).float().numpy()

    def rows(x):  # [T, C] -> [T, M, block], zero-padded
        out = np.zeros((tokens, streams, block), f32)
        out[..., :width] = x.float().reshape(tokens, streams, width).numpy()
        return out

    def weight(w):
        out = np.zeros((streams, block), f32)
        out[:, :width] = f32(1.0) + w.float().reshape(streams, width).numpy()
        return out

    def inv_rms(x):  # 1/sqrt, as the kernel computes rsqrt
        return f32(1.0) / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) / f32(width) + f32(eps))

    k, q = rows(key), rows(hidden)
    k_n = rnd(k * inv_rms(k) * weight(weights[0]))
    q_n = rnd(q * inv_rms(q) * weight(weights[1]))
    dot = rnd(np.sum(rnd(k_n * q_n), axis=-1))
    d = rnd(dot / np.sqrt(f32(width)))
    magnitude = rnd(np.sqrt(np.maximum(np.abs(d), f32(1e-6))))
    a = np.sign(d) * magnitude
    g = rnd(f32(1.0) / (f32(1.0) + np.exp(-a.astype(np.float64)).astype(f32)))
    v = np.zeros((tokens, 1, block), f32)
    v[..., 0, :width] = value.float().numpy()
    gated = rnd(g[..., None] * v)
    normed = gated * inv_rms(gated) * weight(weights[2])

    def out(x):
        x = torch.from_numpy(np.ascontiguousarray(x[..., :width])).reshape(tokens, channels)
        return x.to(dtype)

    return out(gated), out(normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,width,streams",
    [(200, 100, 3), (3, 2624, 1), (100, 656, 4), (7, 3, 5), (300, 130, 2), (300, 120, 2)]
    + [(2, 2600, 2), (2, 16, 3), (3, 17, 1), (1, 8, 2), (2, 4, 1)],
)
def test_cpu_kernel_sums_in_numpy_order(dtype, tokens, width, streams):
    """The CPU kernel's "vllm" rounding, bit for bit with numpy_order_gate in every dtype: its
    blocked loops, which split 16-bit rows into even and odd elements, keep numpy's lane order,
    the tails included. fp16 is where a wrong order shows: fp32 sums of bf16-rounded terms are
    mostly exact, so in bf16 the order rarely changes a result."""
    key, value, hidden, weights = make_inputs(tokens, width, streams, dtype, seed=width)
    got = ops.ple_gate(key, value, hidden, *weights, EPS)
    expected = numpy_order_gate(key, value, hidden, weights)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


# --- the reference, odd shapes, strided views ---------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["vllm", "fp32"])
@pytest.mark.parametrize(
    "tokens,width,streams",
    [
        (0, 100, 1),
        (1, 100, 1),
        (37, 100, 1),
        (5000, 100, 1),
        (129, 2624, 1),
        (11, 656, 4),
        (3, 1, 4),
        (17, 4, 2),
        (9, 5, 3),
        # Rows longer than the GPU kernels hold in a block's registers (H > 4096 in bf16/fp16):
        # taken in tiles, whole 16-byte chunks and element by element.
        (2, 4104, 2),
        (3, 4099, 1),
    ],
)
def test_matches_reference(backend, dtype, rounding, tokens, width, streams):
    ops, device = backend.ops, backend.device
    key, value, hidden, weights = make_inputs(
        tokens, width, streams, dtype, device=device, seed=width + tokens
    )
    got = ops.ple_gate(key, value, hidden, *weights, EPS, rounding=rounding)
    expected = reference.ple_gate(
        key.cpu(), value.cpu(), hidden.cpu(), *(w.cpu() for w in weights), EPS, rounding=rounding
    )
    for g, e, name in zip(got, expected, ("gated", "conv_input"), strict=True):
        assert g.shape == e.shape and g.dtype == dtype and g.is_contiguous()
        assert_close(g, e, dtype, rounding, name)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("tokens,streams", [(2**23 + 3, 2), (1, 2**24 + 5)])
def test_more_token_streams_than_one_launch_takes(backend, tokens, streams):
    """H = 1: the GPU kernels take 2^24 (token, stream)s per launch (2^16 blocks of 256), so
    these calls take two, split by tokens or, within the one token, by streams. At H = 1 each
    (token, stream) is computed from its own inputs alone, so the reference runs on a sample of
    them: both ends, both sides of the split, and random ones (on all 2^24 it took most of the
    test's time)."""
    ops, device = backend.ops, backend.device
    key, value, hidden, weights = make_inputs(tokens, 1, streams, torch.bfloat16, device=device)
    got = ops.ple_gate(key, value, hidden, *weights, EPS)
    by_tokens = tokens > 1
    count, split = (tokens, 2**24 // streams) if by_tokens else (streams, 2**24)
    near = 4096
    sample = torch.cat(
        [
            torch.arange(0, near),
            torch.arange(split - near, min(split + near, count)),
            torch.arange(count - near, count),
            torch.randint(0, count, (4 * near,), generator=torch.Generator().manual_seed(0)),
        ]
    ).unique()
    key, value, hidden = key.cpu(), value.cpu(), hidden.cpu()
    weights = [w.cpu() for w in weights]
    if by_tokens:
        expected = reference.ple_gate(key[sample], value[sample], hidden[sample], *weights, EPS)
        got = [g.cpu()[sample] for g in got]
    else:
        expected = reference.ple_gate(
            key[:, sample], value, hidden[:, sample], *(w[sample] for w in weights), EPS
        )
        got = [g.cpu()[:, sample] for g in got]
    for g, e, name in zip(got, expected, ("gated", "conv_input"), strict=True):
        assert_close(g, e, torch.bfloat16, "vllm", name)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["vllm", "fp32"])
@pytest.mark.parametrize("where", ["key", "weight"])
def test_nans_spread_as_in_the_reference(backend, dtype, rounding, where):
    """A NaN in a key row makes its (token, stream) NaN; a NaN in an fp32 norm weight makes its
    stream NaN in every token. The weight's NaN is 0x7FFFFFFF, whose low half a bf16 rounding
    without its NaN select would carry into the sign (-0.0): the CPU kernel must see it and keep
    the select (simd::NaNs)."""
    ops, device = backend.ops, backend.device
    width, streams = 160, 3
    key, value, hidden, weights = make_inputs(
        5, width, streams, dtype, seed=11, weight_dtype=torch.float32
    )
    if where == "key":
        key[1, width + 5] = float("nan")
    else:
        weights[1][2 * width + 7] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    args = (key, value, hidden, *weights, EPS)
    got = ops.ple_gate(
        *(same_layout(a, device) if torch.is_tensor(a) else a for a in args), rounding=rounding
    )
    expected = reference.ple_gate(*args, rounding=rounding)
    for g, e, name in zip(got, expected, ("gated", "conv_input"), strict=True):
        nan = e.isnan()
        assert nan.any()
        assert torch.equal(g.cpu().isnan(), nan), name
        assert_close(g.cpu()[~nan], e[~nan], dtype, rounding, name)


# --- SPEC §9.8 under hypothesis -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@given(
    tokens=st.integers(0, 40),
    width=st.integers(1, 300),
    streams=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    rounding=st.sampled_from(["vllm", "fp32"]),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
)
def test_property_matches_reference(backend, tokens, width, streams, dtype, rounding, seed, scale):
    """§9.8: equal to the reference within the stated tolerance on any shape, strided views."""
    ops, device = backend.ops, backend.device
    key, value, hidden, weights = make_inputs(
        tokens,
        width,
        streams,
        dtype,
        device=device,
        seed=seed,
        scale=scale,
        hidden_strided=seed % 2 == 1,
    )
    got = ops.ple_gate(key, value, hidden, *weights, EPS, rounding=rounding)
    expected = reference.ple_gate(
        key.cpu(), value.cpu(), hidden.cpu(), *(w.cpu() for w in weights), EPS, rounding=rounding
    )
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e, dtype, rounding)


# --- opcheck, compile -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["vllm", "fp32"])
def test_opcheck(backend, dtype, rounding):
    device = backend.device
    key, value, hidden, weights = make_inputs(6, 40, 3, dtype, device=device)
    torch.library.opcheck(
        backend.library.ple_gate.default, (key, value, hidden, *weights, EPS, rounding)
    )
    gated, conv_input = torch.empty_like(hidden), torch.empty_like(hidden)
    torch.library.opcheck(
        backend.library.ple_gate_out.default,
        (key, value, hidden, *weights, EPS, rounding),
        {"gated": gated, "conv_input": conv_input},
    )


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_torch_compile_smoke(backend):
    ops, device = backend.ops, backend.device
    key, value, hidden, weights = make_inputs(9, 32, 2, torch.bfloat16, device=device)

    @torch.compile(fullgraph=True, dynamic=True)
    def gate(key, value, hidden):
        gated, conv_input = ops.ple_gate(key, value, hidden, *weights, EPS)
        return gated + conv_input

    eager_g, eager_c = ops.ple_gate(key, value, hidden, *weights, EPS)
    assert torch.equal(gate(key, value, hidden), eager_g + eager_c)
