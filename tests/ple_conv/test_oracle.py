"""The ple_conv oracle itself (SPEC §6): reference.ple_conv against torch.nn.functional's conv1d and
SiLU, vLLM's write-back of short and empty spec chunks, token maps with padding rows, and its
own errors. CPU only; every case is seeded. SPEC §9's properties of the op, which the oracle
holds as every kernel does, are in test_properties.py."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from qwen4exp_ext import reference as ref
from qwen4exp_ext.testing import assert_exact

from .support import new_state


def conv1d_oracle(history, weights, dilation, count):
    """F.conv1d over (state ++ chunk) [S+L, C] → SiLU outputs of the last `count` positions."""
    y = F.conv1d(
        history.T[None].float(),
        weights.float()[:, None, :],
        groups=weights.shape[0],
        dilation=dilation,
    )
    return F.silu(y[0].T[:count])


def test_ple_conv_prefill_matches_conv1d():
    gen = torch.Generator().manual_seed(7)
    channels, kernel, dilation = 6, 4, 3
    S = (kernel - 1) * dilation
    weights = torch.randn(channels, kernel, generator=gen)
    lengths = [5, 0, 12, 1]
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(int(qsl[-1]), channels, generator=gen)
    state = new_state(
        6, channels, S, torch.float32, fill=torch.randn(6, channels, S, generator=gen)
    )
    before = state.clone()
    slots = torch.tensor([2, 5, 1, 4])
    init = torch.tensor([True, True, False, True])
    out = torch.empty_like(x)
    ref.ple_conv(
        x,
        out,
        state,
        weights,
        slots,
        None,
        mode="prefill",
        dilation=dilation,
        query_start_loc=qsl,
        has_initial_states=init,
    )
    for r, (a, b) in enumerate(pairwise(qsl.tolist())):
        old = before[slots[r]].T if init[r] else torch.zeros(S, channels)
        history = torch.cat([old, x[a:b]])
        if b > a:
            torch.testing.assert_close(out[a:b], conv1d_oracle(history, weights, dilation, b - a))
            assert_exact(state[slots[r]], history[-S:].T)
        else:
            assert_exact(state[slots[r]], before[slots[r]])  # zero-length request keeps its state
    assert_exact(state[0], before[0])
    assert_exact(state[3], before[3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_ple_conv_rounds_the_sum_before_silu(dtype):
    """Low precision: equal to eager F.conv1d in the storage dtype followed by F.silu."""
    gen = torch.Generator().manual_seed(24)
    channels, kernel, dilation, T = 16, 4, 3, 40
    S = (kernel - 1) * dilation
    x = (torch.randn(T, channels, generator=gen) * 3).to(dtype)
    weights = torch.randn(channels, kernel, generator=gen).to(dtype)
    out = torch.empty_like(x)
    ref.ple_conv(
        x,
        out,
        torch.zeros(2, channels, S, dtype=dtype),
        weights,
        torch.tensor([1]),
        None,
        mode="prefill",
        dilation=dilation,
        query_start_loc=torch.tensor([0, T]),
        has_initial_states=torch.tensor([False]),
    )
    padded = F.pad(x.T[None], (S, 0))
    conv = F.conv1d(padded, weights[:, None, :], groups=channels, dilation=dilation)
    assert_exact(out, F.silu(conv)[0].T)


def test_ple_conv_spec_short_and_empty_chunks_keep_the_tail():
    """vLLM parity: a spec write-back covers S-1+qlen entries and keeps the rest; an empty spec
    chunk on a live slot still shifts the window (vLLM 0.33.0 `_ple_conv_writeback_kernel`)."""
    gen = torch.Generator().manual_seed(12)
    channels, kernel, dilation, q = 3, 3, 2, 4
    S = (kernel - 1) * dilation
    weights = torch.randn(channels, kernel, generator=gen)
    fill = torch.randn(3, channels, S + q - 1, generator=gen)
    x = torch.randn(2, channels, generator=gen)
    state = fill.clone()
    ref.ple_conv(
        x,
        torch.zeros_like(x),
        state,
        weights,
        torch.tensor([1, 2]),
        None,
        mode="spec",
        dilation=dilation,
        query_start_loc=torch.tensor([0, 2, 2]),
        num_accepted_tokens=torch.tensor([3, 2]),
        spec_query_len=q,
    )
    assert_exact(state[1, :, : S - 1], fill[1, :, 3 : 3 + S - 1])  # offset 2, shifted by one
    assert_exact(state[1, :, S - 1 : S + 1], x.T)
    assert_exact(state[1, :, S + 1 :], fill[1, :, S + 1 :])
    assert_exact(state[2, :, : S - 1], fill[2, :, 2 : 2 + S - 1])  # empty chunk: offset 1 + shift
    assert_exact(state[2, :, S - 1 :], fill[2, :, S - 1 :])


def test_ple_conv_token_indices_and_padding_rows():
    """A mixed batch addressed through token_indices equals the same requests run on their own
    gathered rows; rows outside every index and padding past qsl[R] get no conv output."""
    gen = torch.Generator().manual_seed(13)
    channels, kernel, dilation, q = 4, 3, 2, 2
    S = (kernel - 1) * dilation
    weights = torch.randn(channels, kernel, generator=gen)
    fill = torch.randn(6, channels, S + q - 1, generator=gen)
    x = torch.randn(10, channels, generator=gen)
    gated = torch.randn(10, channels, generator=gen)
    hidden = torch.randn(10, channels, generator=gen)
    decode_rows = torch.tensor([7, 0])
    prefill_rows = torch.tensor([2, 9, 4, 5, 1])  # last one is padding past qsl[R] = 4
    spec_rows = torch.tensor([8, 3])
    untouched = 6
    calls = [
        ("decode", decode_rows, dict(state_indices=torch.tensor([1, 2]))),
        (
            "prefill",
            prefill_rows,
            dict(
                state_indices=torch.tensor([3, 4]),
                query_start_loc=torch.tensor([0, 1, 4]),
                has_initial_states=torch.tensor([True, False]),
            ),
        ),
        (
            "spec",
            spec_rows,
            dict(
                state_indices=torch.tensor([5]),
                query_start_loc=torch.tensor([0, 2]),
                num_accepted_tokens=torch.tensor([2]),
                spec_query_len=q,
            ),
        ),
    ]
    mixed_state, mixed_res = fill.clone(), gated.clone()
    for mode, rows, kw in calls:
        kw = dict(kw)
        slots = kw.pop("state_indices")
        ref.ple_conv(
            x,
            mixed_res,
            mixed_state,
            weights,
            slots,
            hidden,
            mode=mode,
            dilation=dilation,
            token_indices=rows,
            **kw,
        )
    alone_state = fill.clone()
    for mode, rows, kw in calls:
        kw = dict(kw)
        slots = kw.pop("state_indices")
        res = gated[rows].clone()
        ref.ple_conv(
            x[rows],
            res,
            alone_state,
            weights,
            slots,
            hidden[rows],
            mode=mode,
            dilation=dilation,
            **kw,
        )
        assert_exact(mixed_res[rows], res)
    assert_exact(mixed_state, alone_state)
    assert_exact(mixed_res[untouched], gated[untouched])
    assert_exact(mixed_res[1], gated[1] + hidden[1])  # padding row: conv output 0


def test_ple_conv_errors():
    x = torch.zeros(2, 4)
    state = torch.zeros(2, 4, 4)
    w = torch.zeros(4, 3)
    with pytest.raises(ValueError):
        ref.ple_conv(
            x,
            x.clone(),
            state,
            w,
            torch.tensor([1]),
            None,
            mode="prefill",
            dilation=2,
            query_start_loc=torch.tensor([0, 2]),
        )
    with pytest.raises(ValueError):  # spec needs S + q - 1 = 5 entries
        ref.ple_conv(
            x,
            x.clone(),
            state,
            w,
            torch.tensor([1]),
            None,
            mode="spec",
            dilation=2,
            query_start_loc=torch.tensor([0, 2]),
            num_accepted_tokens=torch.tensor([1]),
            spec_query_len=2,
        )
    with pytest.raises(ValueError):
        ref.ple_conv(x, x.clone(), state, w, torch.tensor([1]), None, mode="chunked", dilation=2)
