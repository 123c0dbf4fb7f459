"""ple_gate (SPEC §5): parity with vLLM 0.33.0's own Triton kernel (run by Triton's CPU
interpreter), parity with the reference oracle on odd shapes and strided views in every dtype,
the stated tolerance of the fast ("fp32") mode against an fp64 evaluation, SPEC §9 properties 1
(row independence, the gate's chunk-split invariance) and 8 (hypothesis), opcheck, errors and a
torch.compile smoke test — on every backend this machine has.

Tolerances, as data, with the reason for each: ``qwen4exp_ext.testing.TOLERANCES`` ("vllm"
rounding within two units in the last place of the reference, and bit for bit with vLLM's kernel
on the CPU in fp16; the fast "fp32" pass within one unit of the exact fp64 result, and in
bf16/fp16 never further from it than 2x the "vllm"-rounded result is).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qwen4exp_ext
from conftest import backends
from qwen4exp_ext import ops, reference
from qwen4exp_ext.bench import vllm_triton
from qwen4exp_ext.testing import assert_within, same_layout, tolerance

BACKENDS = backends()
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
    if backend.name == "simt32" and "sanitize" in qwen4exp_ext.build_info():
        # Under the sanitizers (tools/check-sanitizers.sh), where its two cases took an eighth of
        # the pass, simt64 runs it alone: the split and every global address are the same at
        # either wave size (256-thread blocks, one (token, stream) per thread at H = 1); what the
        # wave size changes, the block's scratch and the reductions' lanes, every other gate test
        # covers at both.
        pytest.skip("sanitizer build: simt64 makes the same global accesses")
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


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_mode_tolerance(backend, dtype):
    """The fast single pass against fp64: within one ulp of the output dtype, and in bf16/fp16
    at most 2x the error of vLLM's rounding. In fp32 both modes are plain fp32 arithmetic; the
    fast one sums in 8 lanes instead of a pairwise tree and stays within 2e-5 relative."""
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


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["vllm", "fp32"])
def test_strided_views_and_out(backend, dtype, rounding):
    """hidden as a column slice, fp32 weights with 16-bit activations, and out= views into wider
    buffers: the same values as contiguous inputs, and nothing outside the views is touched."""
    ops, device = backend.ops, backend.device
    key, value, hidden, weights = make_inputs(
        23, 96, 3, dtype, device=device, hidden_strided=True, weight_dtype=torch.float32
    )
    assert not hidden.is_contiguous() and not key.is_contiguous()
    expected = ops.ple_gate(
        key.contiguous(), value.contiguous(), hidden.contiguous(), *weights, EPS, rounding=rounding
    )
    wide = torch.full((2, 23, 300), 7.0, dtype=dtype, device=device)
    out = (wide[0, :, 5:293], wide[1, :, 1:289])
    got = ops.ple_gate(key, value, hidden, *weights, EPS, rounding=rounding, out=out)
    assert got[0].data_ptr() == out[0].data_ptr()
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    assert torch.all(wide[0, :, :5] == 7) and torch.all(wide[0, :, 293:] == 7)
    assert torch.all(wide[1, :, :1] == 7) and torch.all(wide[1, :, 289:] == 7)
    ref = reference.ple_gate(
        key.cpu(), value.cpu(), hidden.cpu(), *(w.cpu() for w in weights), EPS, rounding=rounding
    )
    for g, e in zip(got, ref, strict=True):
        assert_close(g, e, dtype, rounding)


# --- SPEC §9 properties ---------------------------------------------------------------------------


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


# --- opcheck, compile, errors ---------------------------------------------------------------------


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


def gate_call(**overrides):
    key, value, hidden, weights = make_inputs(4, 8, 2, torch.bfloat16)
    args = dict(
        key=key,
        value=value,
        hidden=hidden,
        norm_key_w=weights[0],
        norm_query_w=weights[1],
        norm_conv_w=weights[2],
        eps=EPS,
    )
    args.update(overrides)
    return ops.ple_gate(**args)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(hidden=torch.zeros(4, 16, 1, dtype=torch.bfloat16)), "hidden must be 2-D"),
        (dict(hidden=torch.zeros(4, 16, dtype=torch.float64)), "hidden must be float32"),
        (dict(key=torch.zeros(4, 16)), "key must have hidden's dtype"),
        (dict(value=torch.zeros(4, 8)), "value must have hidden's dtype"),
        (dict(value=torch.zeros(3, 8, dtype=torch.bfloat16)), r"value must be \[T, H\]"),
        (dict(value=torch.zeros(4, 5, dtype=torch.bfloat16)), "multiple of value's H"),
        (dict(key=torch.zeros(4, 12, dtype=torch.bfloat16)), r"key must be \[T, C\]"),
        (dict(key=torch.zeros(16, 4, dtype=torch.bfloat16).t()), "key must have unit stride"),
        (dict(norm_key_w=torch.zeros(16, dtype=torch.float16)), "norm_key_w must be float32 or"),
        (dict(norm_query_w=torch.zeros(16)), "norm_query_w must have norm_key_w's dtype"),
        (dict(norm_conv_w=torch.zeros(15, dtype=torch.bfloat16)), r"norm_conv_w must be \[C\]"),
        (dict(norm_conv_w=torch.zeros(32, dtype=torch.bfloat16)[::2]), "must be contiguous"),
        (dict(eps=-1.0), "eps must be a positive finite number"),
        (
            dict(norm_conv_w=torch.zeros(16, dtype=torch.bfloat16, device="meta")),
            "norm_conv_w is on meta but hidden is on cpu",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(overrides, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        gate_call(**overrides)


def test_bad_rounding_and_out_raise():
    key, value, hidden, weights = make_inputs(4, 8, 2, torch.bfloat16)
    with pytest.raises(RuntimeError, match="rounding must be 'vllm' or 'fp32'"):
        ops.ple_gate(key, value, hidden, *weights, EPS, rounding="fast")
    with pytest.raises(RuntimeError, match=r"gated must be \[T, C\]"):
        ops.ple_gate(
            key,
            value,
            hidden,
            *weights,
            EPS,
            out=(torch.empty(4, 15, dtype=torch.bfloat16), torch.empty_like(hidden)),
        )
    with pytest.raises(RuntimeError, match="conv_input must have hidden's dtype"):
        ops.ple_gate(
            key, value, hidden, *weights, EPS, out=(torch.empty_like(hidden), torch.empty(4, 16))
        )
