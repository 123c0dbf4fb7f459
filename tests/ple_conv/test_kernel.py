"""ple_conv's kernels (SPEC §6): parity with vLLM 0.33.0's own Triton kernels (run by Triton's CPU
interpreter) in every mode, parity with the reference oracle on odd shapes, both state layouts,
token maps and every dtype, and on random batches (SPEC §9.8, hypothesis), opcheck and a
torch.compile smoke test — on every backend this machine has. SPEC §9's other properties of the
op, for the oracle and every kernel, are in test_properties.py; bad arguments in bad_inputs.py.

Tolerance (qwen4exp_ext.testing.TOLERANCES, with the reasons): bf16 and fp16 results equal vLLM's
kernel and the reference exactly; fp32 within 1e-6.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import backends
from qwen4exp_ext import ops, reference
from qwen4exp_ext.bench import vllm_triton
from qwen4exp_ext.testing import assert_exact, assert_within, same_layout, tolerance

from .support import DTYPES, MODES, Batch, assert_same, make_batch, random_lengths

BACKENDS = backends()


# --- vLLM's own kernels ---------------------------------------------------------------------------

VLLM = vllm_triton.load()
needs_vllm = pytest.mark.skipif(
    VLLM is None, reason="vllm==0.33.0 (pip install --no-deps) and triton are needed"
)


def vllm_conv(*args, **kwargs):
    with vllm_triton.interpreter():
        VLLM.ple_conv(*args, **kwargs)


# vLLM's results, by test case: the interpreter is slow, and every backend compares with them.
_VLLM_RESULTS: dict = {}


def vllm_result(case, batch: Batch):
    if case not in _VLLM_RESULTS:
        _VLLM_RESULTS[case] = batch.run(vllm_conv)
    return _VLLM_RESULTS[case]


@needs_vllm
@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "mode,lengths,query_len",
    [
        ("decode", None, 1),
        ("prefill", [3, 1, 0, 6, 2], 1),
        ("spec", [2, 3, 0, 1, 3], 3),
    ],
)
@pytest.mark.parametrize("window_first", [True, False])
@pytest.mark.parametrize("token_map,outer", [(False, True), (True, True), (True, False)])
def test_matches_vllm_triton_kernels(
    backend, dtype, mode, lengths, query_len, window_first, token_map, outer
):
    """fp16 bit for bit, fp32 within 1e-6, every mode, both layouts, token maps, null slots,
    has_initial_states, spec roll-back offsets, channels spanning two of vLLM's 512 blocks."""
    batch = make_batch(
        mode,
        dtype,
        lengths=lengths,
        tokens=5,
        channels=600 if outer else 40,
        query_len=query_len,
        window_first=window_first,
        token_map=token_map,
        outer=outer,
        extra_width=1,
        seed=len(lengths or []) + query_len,
    )
    case = (dtype, mode, query_len, window_first, token_map, outer)
    expected = vllm_result(case, batch)
    got = batch.run(backend.ops.ple_conv, backend.device)
    assert_same(got, expected, dtype, mode, against="vllm")


@needs_vllm
@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("kernel,dilation", [(1, 1), (2, 8), (8, 1), (5, 2)])
def test_matches_vllm_other_kernel_sizes(backend, kernel, dilation):
    for mode, lengths in (("decode", None), ("prefill", [4, 0, 9])):
        batch = make_batch(
            mode,
            torch.float16,
            lengths=lengths,
            tokens=3,
            kernel=kernel,
            dilation=dilation,
            seed=kernel * 10 + dilation,
        )
        expected = vllm_result((kernel, dilation, mode), batch)
        got = batch.run(backend.ops.ple_conv, backend.device)
        assert_same(got, expected, torch.float16, mode, against="vllm")


# --- the reference, odd shapes --------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "channels,lengths",
    [
        (100, []),
        (100, [0]),
        (100, [1]),
        (100, [5000]),
        (100, [1200, 0, 1300, 7]),
        (2624, [129, 3]),
        (2624, [1]),
    ],
)
def test_matches_reference(backend, dtype, mode, channels, lengths):
    ops, device = backend.ops, backend.device
    if mode == "spec":
        lengths = [min(n, 4) for n in lengths]
    batch = make_batch(
        mode,
        dtype,
        lengths=lengths,
        tokens=min(sum(lengths), 600),
        channels=channels,
        query_len=4,
        seed=channels + len(lengths),
    )
    assert_same(batch.run(ops.ple_conv, device), batch.run(reference.ple_conv), dtype, mode)


def _cpu_silu_lookups() -> list[str]:
    previous = ops.set_cpu_conv_silu_lookup("loop")
    try:
        ops.set_cpu_conv_silu_lookup("gather")
        return ["loop", "gather"]
    except ValueError:
        return ["loop"]
    finally:
        ops.set_cpu_conv_silu_lookup(previous)


@pytest.mark.parametrize("lookup", _cpu_silu_lookups())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_cpu_silu_lookups(lookup, dtype, mode):
    """Each SiLU lookup this CPU has (the loop; AVX-512 gathers), pinned: the CPU kernel times
    them and runs the faster, so without the pin only one would be tested on a given CPU. 2624
    channels are five whole 512-channel chunks and a 64-channel tail; tokens enough that the
    lookup sees most of the table."""
    previous = ops.set_cpu_conv_silu_lookup(lookup)
    try:
        assert ops.cpu_conv_silu_lookup() == lookup
        lengths = [4, 1] if mode == "spec" else [300, 1]
        batch = make_batch(mode, dtype, lengths=lengths, tokens=301, channels=2624, query_len=4)
        assert_same(batch.run(ops.ple_conv), batch.run(reference.ple_conv), dtype, mode)
    finally:
        ops.set_cpu_conv_silu_lookup(previous)


def test_cpu_silu_lookup_switch():
    """The timed default reports what it chose; a bad setting is a clear error."""
    previous = ops.set_cpu_conv_silu_lookup(None)
    try:
        assert ops.cpu_conv_silu_lookup() in _cpu_silu_lookups()
        assert ops.set_cpu_conv_silu_lookup("loop") is None
        assert ops.set_cpu_conv_silu_lookup(None) == "loop"
        for bad in ("scalar", 0, True):
            with pytest.raises(ValueError, match="lookup must be 'loop', 'gather' or None"):
                ops.set_cpu_conv_silu_lookup(bad)
        if "gather" not in _cpu_silu_lookups():
            with pytest.raises(ValueError, match="the gather lookup needs AVX-512"):
                ops.set_cpu_conv_silu_lookup("gather")
    finally:
        ops.set_cpu_conv_silu_lookup(previous)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_weights_rewritten_in_place_between_calls(backend, mode):
    """The CPU kernel keeps the weights it transposed for the next call with the same weights:
    weights rewritten in place (one element, then all) must give each call the results of its
    own weights, never those of the weights an earlier call saw at that address."""
    ops, device = backend.ops, backend.device
    batch = make_batch(
        mode, torch.bfloat16, lengths=[4, 3], tokens=4, channels=40, query_len=4, seed=5
    )
    for rewrite in (None, lambda w: w[7, 2].add_(1.0), lambda w: w.mul_(-2.0)):
        if rewrite is not None:
            rewrite(batch.conv_weights)
        expected = batch.run(reference.ple_conv)
        assert_same(batch.run(ops.ple_conv, device), expected, torch.bfloat16, mode)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_fp32_weights_and_strided_rows(backend, dtype, mode):
    """fp32 conv weights with 16-bit activations; inputs, residual and outer_residual as column
    slices of wider buffers; a dim-first state with room for more spec columns."""
    ops, device = backend.ops, backend.device
    batch = make_batch(
        mode,
        dtype,
        lengths=[3, 4, 1],
        tokens=4,
        channels=50,
        query_len=4,
        weight_dtype=torch.float32,
        window_first=False,
        extra_width=2,
        seed=5,
    )
    wide = [
        torch.randn(t.shape[0], 60).to(dtype)
        for t in (batch.inputs, batch.residual, batch.outer_residual)
    ]
    for w, t in zip(wide, (batch.inputs, batch.residual, batch.outer_residual), strict=True):
        w[:, 7:57] = t
    strided = Batch(
        wide[0][:, 7:57],
        wide[1][:, 7:57],
        batch.conv_state,
        batch.conv_weights,
        batch.state_indices,
        wide[2][:, 7:57],
        batch.kwargs,
    )
    assert not strided.inputs.is_contiguous()
    assert_same(strided.run(ops.ple_conv, device), batch.run(reference.ple_conv), dtype, mode)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window_first", [True, False], ids=["window_first", "dim_first"])
def test_nans_spread_as_in_the_reference(backend, dtype, mode, window_first):
    """NaNs in an input row and in two fp32 weights (channels in a whole block and in the tail)
    reach the same outputs as in the reference. The weights' NaNs are 0x7FFFFFFF and 0xFFFF8001,
    whose low halves a bf16 rounding without its NaN select would carry into the sign or the
    exponent: the CPU kernel must clear them first (ple_conv.cpp, kNaNs)."""
    ops, device = backend.ops, backend.device
    batch = make_batch(
        mode,
        dtype,
        lengths=[4, 3],
        tokens=5,
        channels=37,
        query_len=4,
        weight_dtype=torch.float32,
        window_first=window_first,
        seed=13,
    )
    payloads = torch.tensor([0x7FFFFFFF, 0xFFFF8001 - 2**32], dtype=torch.int32)
    batch.conv_weights[[5, 35], [3, 1]] = payloads.view(torch.float32)
    batch.inputs[2, 20] = float("nan")
    got, expected = batch.run(ops.ple_conv, device), batch.run(reference.ple_conv)
    tol = tolerance("ple_conv", dtype)
    for g, e, name in zip(got, expected, ("residual", "conv_state"), strict=True):
        nan = e.isnan()
        assert torch.equal(g.isnan(), nan), name
        assert_within(g[~nan], e[~nan], tol, name)
    assert expected[0].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,dilation", [(4, 3), (3, 5), (8, 8), (2, 1)])
@pytest.mark.parametrize("layout", ["window_first", "window_first_odd_stride", "dim_first"])
def test_decode_window_layouts_and_lengths(backend, dtype, kernel, dilation, layout):
    """Decode loads a token's whole window before it writes any of it: one access per entry where
    the state keeps a thread's channels contiguous and aligned (window-first), element by element
    otherwise (dim-first, or a window stride of an odd number of elements); the released K = 4,
    δ = 3 with the window in registers, other shapes a chunk of 8 entries at a time (S = 10 and
    56 take two and seven chunks). Null slots, no initial state, a token map and fp32 weights
    along the way."""
    ops, device = backend.ops, backend.device
    for seed, initial in ((1, None), (2, False)):
        batch = make_batch(
            "decode",
            dtype,
            tokens=7,
            channels=64,
            kernel=kernel,
            dilation=dilation,
            window_first=layout != "dim_first",
            token_map=seed == 2,
            initial=initial,
            weight_dtype=torch.float32 if seed == 2 else None,
            seed=seed,
        )
        if layout == "window_first_odd_stride":
            state = batch.conv_state  # [slots, C, W], a view of [slots, W, C] storage
            wide = torch.zeros(state.shape[0], state.shape[2], state.shape[1] + 1, dtype=dtype)
            wide[:, :, :-1] = state.transpose(1, 2)
            batch = replace(batch, conv_state=wide[:, :, :-1].transpose(1, 2))
            assert batch.conv_state.stride() == (wide.stride(0), 1, 65)
        got = batch.run(ops.ple_conv, device)
        assert_same(got, batch.run(reference.ple_conv), dtype, f"{layout}, seed {seed}")


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,dilation", [(4, 3), (3, 5), (8, 8), (2, 3)])
@pytest.mark.parametrize("channels", [31, 600])
def test_decode_dim_first_channel_tails(backend, dtype, kernel, dilation, channels):
    """Dim-first decode with contiguous windows (S = 9, 10, 56 and 3) copies each chunk's tap
    columns out of the windows and shifts them with one memmove per chunk: 31 channels (one
    16-element block, then a partial one) and 600 (a whole 512-channel chunk, then one of 88 that
    ends in a partial block)."""
    ops, device = backend.ops, backend.device
    batch = make_batch(
        "decode",
        dtype,
        tokens=5,
        channels=channels,
        kernel=kernel,
        dilation=dilation,
        window_first=False,
        seed=channels + kernel,
    )
    state = batch.conv_state
    assert state.stride()[1:] == (state.shape[2], 1)  # [slots, C, S]: contiguous windows
    got = batch.run(ops.ple_conv, device)
    assert_same(got, batch.run(reference.ple_conv), dtype, f"C = {channels}")


# --- SPEC §9.8: equal to the oracle on random batches --------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@given(
    mode=st.sampled_from(MODES),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    query_len=st.integers(1, 4),
    kernel=st.integers(1, 8),
    dilation=st.integers(1, 8),
    window_first=st.booleans(),
    token_map=st.booleans(),
    outer=st.booleans(),
    channels=st.sampled_from([1, 7, 33, 100]),
)
def test_property_matches_reference(
    backend,
    mode,
    dtype,
    seed,
    query_len,
    kernel,
    dilation,
    window_first,
    token_map,
    outer,
    channels,
):
    """§9.8: equal to the reference on random batches, any K <= 8 and dilation <= 8."""
    ops, device = backend.ops, backend.device
    rng = random.Random(seed)
    batch = make_batch(
        mode,
        dtype,
        lengths=random_lengths(rng, mode, query_len),
        tokens=rng.randint(0, 6),
        channels=channels,
        kernel=kernel,
        dilation=dilation,
        query_len=query_len,
        window_first=window_first,
        token_map=token_map,
        outer=outer,
        extra_width=rng.randint(0, 2),
        seed=seed,
    )
    assert_same(batch.run(ops.ple_conv, device), batch.run(reference.ple_conv), dtype, mode)


# --- opcheck, compile ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(backend, mode, dtype):
    device = backend.device
    batch = make_batch(
        mode, dtype, lengths=[2, 0, 3], tokens=3, query_len=3, token_map=True, seed=4
    )
    kwargs = {
        k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.kwargs.items()
    }
    kwargs["conv_mode"] = kwargs.pop("mode")  # the schema's name for vLLM's `mode`
    torch.library.opcheck(
        backend.library.ple_conv.default,
        (
            batch.inputs.to(device),
            batch.residual.to(device),
            batch.conv_state.to(device),
            batch.conv_weights.to(device),
            batch.state_indices.to(device),
            batch.outer_residual.to(device),
        ),
        kwargs,
    )


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_torch_compile_smoke(backend):
    ops, device = backend.ops, backend.device
    batch = make_batch("prefill", torch.bfloat16, lengths=[4, 3], seed=2)

    @torch.compile(fullgraph=True, dynamic=True)
    def layer_tail(inputs, residual, state, weights, slots, outer, qsl, init):
        ops.ple_conv(
            inputs,
            residual,
            state,
            weights,
            slots,
            outer,
            mode="prefill",
            dilation=3,
            query_start_loc=qsl,
            has_initial_states=init,
        )
        return residual * 2

    args = [
        batch.inputs,
        batch.residual.clone(),
        same_layout(batch.conv_state),
        batch.conv_weights,
        batch.state_indices,
        batch.outer_residual,
        batch.kwargs["query_start_loc"],
        batch.kwargs["has_initial_states"],
    ]
    args = [a.to(device) for a in args]
    compiled = layer_tail(*args)
    expected_residual, expected_state = batch.run(ops.ple_conv, device)
    assert torch.equal(compiled.cpu(), expected_residual * 2)
    assert torch.equal(args[1].cpu(), expected_residual)
    assert torch.equal(args[2].cpu(), expected_state)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_is_exact_for_every_16_bit_value(backend, dtype):
    """K = 1 with unit weights makes the conv sum each channel's input itself: one token over 65536
    channels runs SiLU on every bf16/fp16 bit pattern (inf and NaN included), against vLLM's fp32
    formula x·(1/(1+exp(-x))) with a correctly rounded exp."""
    ops, device = backend.ops, backend.device
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)[None, :]
    xf = x.float()
    expected = (xf * (1.0 / (1.0 + torch.exp(-xf.double()).float()))).to(dtype)
    residual = torch.zeros_like(x).to(device)
    ops.ple_conv(
        x.to(device),
        residual,
        torch.zeros(2, x.shape[1], 0, dtype=dtype, device=device),
        torch.ones(x.shape[1], 1, dtype=dtype, device=device),
        torch.tensor([1], dtype=torch.int32, device=device),
        None,
        mode="prefill",
        dilation=1,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        has_initial_states=torch.tensor([False], device=device),
    )
    # Exact on every backend: the GPU kernels compute exp in double, as the CPU kernel does
    # (float_types.h, sigmoid_f32), not with the device's expf.
    assert_exact(residual.cpu(), expected, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_zero_channels_do_nothing(backend, mode):
    """C = 0: nothing to compute or keep, on every backend (a GPU refuses the empty grid that
    the launcher used to ask for)."""
    ops, device = backend.ops, backend.device
    batch = make_batch(mode, torch.float32, lengths=[2, 1], tokens=3, channels=0, query_len=2)
    residual, state = batch.run(ops.ple_conv, device)
    assert residual.shape == (batch.inputs.shape[0], 0) and state.numel() == 0


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.name == "simt64"], ids=str)
def test_more_tokens_than_one_block_row_per_token(backend):
    """Past 65536 tokens the launcher launches again from the next token (a grid counts its
    threads in 32 bits on ROCm): decode and prefill of 65541 one-channel tokens, every token and
    state written."""
    ops = backend.ops
    for mode in ("decode", "prefill"):
        lengths = [65536 + 2, 3] if mode == "prefill" else None
        batch = make_batch(mode, torch.float32, lengths=lengths, tokens=65541, channels=1, seed=9)
        assert_same(batch.run(ops.ple_conv), batch.run(reference.ple_conv), torch.float32, mode)
