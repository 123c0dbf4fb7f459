"""SPEC §9's properties of ple_conv, each written once and held by the oracle as by every kernel
(``backends(oracle=True)``): §9.1 chunk-split invariance, §9.4 zero conv weights (and the fused
residual's rounding), §9.5 decode = one-token prefill, §9.6 spec replay, §9.7 the null slot and
empty requests. §9.8 (equal to the oracle) is test_kernel.py's, §9.10 (bad index values)
test_bad_inputs.py's.

Each test runs two drivers on the backend: several requests with fixed (seeded) inputs in both
state layouts, and random batches drawn by hypothesis (null slots, token maps, any q).
"""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import backends
from qwen4exp_ext.testing import assert_exact, same_layout

from .support import (
    DTYPES,
    MODES,
    Batch,
    assert_same,
    fresh_state,
    make_batch,
    new_state,
    random_lengths,
    single_request_step,
)

BACKENDS = backends(oracle=True)
LAYOUTS = ["dim_first", "window_first"]


def on(backend, *tensors: torch.Tensor):
    """The tensors on the backend's device (layouts kept)."""
    moved = tuple(same_layout(t, backend.device) for t in tensors)
    return moved if len(moved) > 1 else moved[0]


# --- §9.1 chunk-split invariance ------------------------------------------------------------------


def run_steps(backend, steps, channels, weights, dilation, dtype, layout_, num_reqs):
    """Run a list of (mode, per-request chunks) steps on fresh slots 1..R; returns the outputs
    per request (concatenated over steps) and the final states."""
    S = (weights.shape[1] - 1) * dilation
    state = on(backend, new_state(num_reqs + 2, channels, S, dtype, layout_))
    seen = [0] * num_reqs
    outputs = [[] for _ in range(num_reqs)]
    for mode, chunks in steps:
        active = [r for r in range(num_reqs) if mode == "prefill" or len(chunks[r])]
        x = (
            torch.cat([chunks[r] for r in active])
            if active
            else torch.zeros(0, channels, dtype=dtype)
        )
        out = on(backend, torch.zeros_like(x))
        lens = [len(chunks[r]) for r in active]
        qsl = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()])
        init = torch.tensor([seen[r] > 0 for r in active])
        backend.ops.ple_conv(
            on(backend, x),
            out,
            state,
            on(backend, weights),
            on(backend, torch.tensor([r + 1 for r in active])),
            None,
            mode=mode,
            dilation=dilation,
            query_start_loc=on(backend, qsl),
            has_initial_states=on(backend, init),
        )
        out = out.cpu()
        for i, r in enumerate(active):
            outputs[r].append(out[int(qsl[i]) : int(qsl[i + 1])])
            seen[r] += lens[i]
    return [torch.cat(o) for o in outputs], state[1 : num_reqs + 1].cpu()


def run_decode(backend, steps, channels, weights, dilation, dtype, layout_, num_reqs):
    """Token-by-token decode of every request; a request's first token has no initial state."""
    S = (weights.shape[1] - 1) * dilation
    state = on(backend, new_state(num_reqs + 2, channels, S, dtype, layout_))
    seen = [0] * num_reqs
    outputs = [[] for _ in range(num_reqs)]
    for _, chunks in steps:
        active = [r for r in range(num_reqs) if len(chunks[r])]
        x = torch.cat([chunks[r] for r in active])
        out = on(backend, torch.zeros_like(x))
        init = torch.tensor([seen[r] > 0 for r in active])
        backend.ops.ple_conv(
            on(backend, x),
            out,
            state,
            on(backend, weights),
            on(backend, torch.tensor([r + 1 for r in active])),
            None,
            mode="decode",
            dilation=dilation,
            has_initial_states=on(backend, init),
        )
        out = out.cpu()
        for i, r in enumerate(active):
            outputs[r].append(out[i : i + 1])
            seen[r] += 1
    return [torch.cat(o) for o in outputs], state[1 : num_reqs + 1].cpu()


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout_", LAYOUTS)
@given(data=st.data())
def test_chunk_split_invariance(backend, dtype, layout_, data):
    """SPEC §9.1: whole prefill == split prefill (empty chunks included) == token-by-token
    decode, for outputs and final states, bit for bit."""
    # Up to three requests at once, K 2..4, dilation 1..3, cuts anywhere (empty chunks too).
    kernel = data.draw(st.integers(2, 4), label="K")
    dilation = data.draw(st.integers(1, 3), label="dilation")
    channels = 5
    lengths = data.draw(st.lists(st.integers(1, 14), min_size=1, max_size=3), label="lengths")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000), label="seed"))
    weights = torch.randn(channels, kernel, generator=gen).to(dtype)
    seqs = [torch.randn(n, channels, generator=gen).to(dtype) for n in lengths]
    R = len(seqs)
    whole, whole_state = run_steps(
        backend, [("prefill", seqs)], channels, weights, dilation, dtype, layout_, R
    )

    cuts = [sorted(set(data.draw(st.lists(st.integers(0, n), max_size=4)))) for n in lengths]
    pieces = [
        [s[a:b] for a, b in pairwise([0, *c, len(s)])] for s, c in zip(seqs, cuts, strict=True)
    ]
    num_steps = max(len(p) for p in pieces)
    split_steps = [
        ("prefill", [p[i] if i < len(p) else s[:0] for p, s in zip(pieces, seqs, strict=True)])
        for i in range(num_steps)
    ]
    split, split_state = run_steps(
        backend, split_steps, channels, weights, dilation, dtype, layout_, R
    )

    decode_steps = [("decode", [s[i : i + 1] for s in seqs]) for i in range(max(lengths))]
    decode, decode_state = run_decode(
        backend, decode_steps, channels, weights, dilation, dtype, layout_, R
    )
    for r in range(R):
        assert_exact(split[r], whole[r])
        assert_exact(decode[r], whole[r])
    assert_exact(split_state, whole_state)
    assert_exact(decode_state, whole_state)

    # One request (K = 4, dilation 3, 24 channels) from a random state, with or without it.
    device = backend.device
    length = data.draw(st.integers(1, 14), label="length")
    init = data.draw(st.booleans(), label="init")
    gen = torch.Generator().manual_seed(length)
    channels, state_len = 24, 9
    x = torch.randn(length, channels, generator=gen).to(dtype).to(device)
    weights = (torch.randn(channels, 4, generator=gen) * 0.5).to(dtype).to(device)
    start = fresh_state(channels, state_len, dtype, device, gen, layout_ == "window_first")

    def run(cuts, mode):
        state = same_layout(start)
        outs, a = [], 0
        for i, b in enumerate([*cuts, length]):
            if b > a:
                outs.append(
                    single_request_step(
                        backend, mode, x[a:b], state, weights, init=init or i > 0 and a > 0
                    )
                )
            a = b
        return torch.cat(outs), state[1]

    whole_y, whole_state = run([], "prefill")
    cuts = sorted(data.draw(st.lists(st.integers(1, length), max_size=4), label="cuts"))
    split_y, split_state = run(cuts, "prefill")
    tok_y, tok_state = run(list(range(1, length)), "decode")
    for y, s in ((split_y, split_state), (tok_y, tok_state)):
        assert torch.equal(y, whole_y)
        assert torch.equal(s, whole_state)


# --- §9.4 zero conv weights -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_weights_and_fused_residual(backend, mode, dtype):
    """SPEC §9.4: with zero conv weights the layer output is hidden + gated (one rounding), in
    every mode; and the fused rounding: residual ← round(round(gated + round(y)) + hidden)."""
    ops, device = backend.ops, backend.device
    batch = make_batch(mode, dtype, lengths=[3, 0, 5, 2], tokens=5, query_len=5, seed=9)
    batch.conv_weights.zero_()
    residual, _ = batch.run(ops.ple_conv, device)
    rows = batch.kwargs.get("token_indices", torch.arange(residual.shape[0]))
    rows = rows[: (batch.state_indices.numel() if mode == "decode" else sum([3, 0, 5, 2]))]
    expected = (batch.residual[rows].float() + batch.outer_residual[rows].float()).to(dtype)
    assert torch.equal(residual[rows], expected)
    if mode != "prefill":
        return

    # Two prefill requests (one from zeros), with and without the fused residual.
    gen = torch.Generator().manual_seed(8)
    T, channels = 9, 7
    x = torch.randn(T, channels, generator=gen).to(dtype)
    gated = torch.randn(T, channels, generator=gen).to(dtype)
    hidden = (torch.randn(T, channels, generator=gen) * 100).to(dtype)
    qsl = torch.tensor([0, 4, 9])
    kwargs = dict(
        mode="prefill",
        dilation=2,
        query_start_loc=on(backend, qsl),
        has_initial_states=on(backend, torch.tensor([False, True])),
    )
    state = new_state(3, channels, 4, dtype, fill=torch.randn(3, channels, 4, generator=gen))
    slots = on(backend, torch.tensor([1, 2]))
    res = on(backend, gated)
    ops.ple_conv(
        on(backend, x),
        res,
        on(backend, state),
        on(backend, torch.zeros(channels, 3, dtype=dtype)),
        slots,
        on(backend, hidden),
        **kwargs,
    )
    # torch's own low-precision add rounds once, like the spec
    assert_exact(res.cpu(), gated + hidden)
    weights = torch.randn(channels, 3, generator=gen).to(dtype)
    alone = on(backend, torch.empty_like(x))
    ops.ple_conv(
        on(backend, x), alone, on(backend, state), on(backend, weights), slots, None, **kwargs
    )
    fused = on(backend, gated)
    ops.ple_conv(
        on(backend, x),
        fused,
        on(backend, state),
        on(backend, weights),
        slots,
        on(backend, hidden),
        **kwargs,
    )
    # vLLM eager: gated.add_(conv); gated.add_(hidden)
    assert_exact(fused.cpu(), (gated + alone.cpu()) + hidden)


# --- §9.5 decode = one-token prefill --------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("init", [True, False])
@pytest.mark.parametrize("layout_", LAYOUTS)
def test_decode_equals_one_token_prefill(backend, init, layout_):
    """SPEC §9.5: a decode step equals a prefill of one token per request from the same state,
    with the decode window read from the start of a wider (spec-sized) state."""
    device = backend.device
    gen = torch.Generator().manual_seed(9)
    channels, kernel, dilation, width = 6, 3, 3, 8
    weights = on(backend, torch.randn(channels, kernel, generator=gen))
    fill = torch.randn(5, channels, width, generator=gen)
    x = on(backend, torch.randn(3, channels, generator=gen))
    slots = on(backend, torch.tensor([4, 1, 3]))
    has_init = on(backend, torch.tensor([init, True, init]))
    s_dec = on(backend, new_state(5, channels, width, torch.float32, layout_, fill))
    s_pre = on(backend, new_state(5, channels, width, torch.float32, layout_, fill))
    o_dec, o_pre = torch.empty_like(x), torch.empty_like(x)
    backend.ops.ple_conv(
        x,
        o_dec,
        s_dec,
        weights,
        slots,
        None,
        mode="decode",
        dilation=dilation,
        has_initial_states=has_init,
    )
    backend.ops.ple_conv(
        x,
        o_pre,
        s_pre,
        weights,
        slots,
        None,
        mode="prefill",
        dilation=dilation,
        query_start_loc=on(backend, torch.arange(4)),
        has_initial_states=has_init,
    )
    assert_exact(o_dec.cpu(), o_pre.cpu())
    assert_exact(s_dec.cpu(), s_pre.cpu())
    # entries past S are never touched outside spec
    assert_exact(s_dec.cpu()[:, :, 6:], fill[:, :, 6:])

    # Random decode batches: null slots, token maps; the initial state as the test's `init`.
    @given(seed=st.integers(0, 2**16), tokens=st.integers(0, 6), token_map=st.booleans())
    def random_batches(seed, tokens, token_map):
        batch = make_batch(
            "decode",
            torch.float16,
            tokens=tokens,
            window_first=layout_ == "window_first",
            token_map=token_map,
            seed=seed,
            initial=init,
        )
        prefill = Batch(
            batch.inputs,
            batch.residual,
            batch.conv_state,
            batch.conv_weights,
            batch.state_indices,
            batch.outer_residual,
            dict(batch.kwargs),
        )
        prefill.kwargs["mode"] = "prefill"
        prefill.kwargs["query_start_loc"] = torch.arange(tokens + 1, dtype=torch.int32)
        assert_same(
            batch.run(backend.ops.ple_conv, device),
            prefill.run(backend.ops.ple_conv, device),
            torch.float16,
        )

    random_batches()


# --- §9.6 spec replay -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout_", LAYOUTS)
def test_spec_replays_accepted_tokens(backend, dtype, layout_):
    """SPEC §9.6: after a spec step of q drafts, the next step with num_accepted = a equals
    replaying the first a draft tokens with prefill (no copy of rejected drafts) and then
    running the next chunk."""
    ops, device = backend.ops, backend.device
    gen = torch.Generator().manual_seed(10)
    channels, kernel, dilation, q = 5, 3, 2, 4
    S = (kernel - 1) * dilation
    weights = on(backend, torch.randn(channels, kernel, generator=gen).to(dtype))
    prefix = [torch.randn(n, channels, generator=gen).to(dtype) for n in (6, 2)]
    d1 = [torch.randn(q, channels, generator=gen).to(dtype) for _ in range(2)]
    d2 = [torch.randn(q, channels, generator=gen).to(dtype) for _ in range(2)]
    slots = torch.tensor([3, 1])
    spec_qsl = on(backend, torch.tensor([0, q, 2 * q]))

    def prefill(state, chunks, init):
        x = on(backend, torch.cat(chunks))
        qsl = torch.tensor([0, len(chunks[0]), len(x)])
        out = torch.zeros_like(x)
        ops.ple_conv(
            x,
            out,
            state,
            weights,
            on(backend, slots),
            None,
            mode="prefill",
            dilation=dilation,
            query_start_loc=on(backend, qsl),
            has_initial_states=on(backend, torch.tensor([init, init])),
        )
        return out.cpu()

    def spec(state, chunks, accepted):
        x = on(backend, torch.cat(chunks))
        out = torch.zeros_like(x)
        ops.ple_conv(
            x,
            out,
            state,
            weights,
            on(backend, slots),
            None,
            mode="spec",
            dilation=dilation,
            query_start_loc=spec_qsl,
            num_accepted_tokens=on(backend, torch.tensor(accepted)),
            spec_query_len=q,
        )
        return out.cpu()

    base = on(backend, new_state(4, channels, S + q - 1, dtype, layout_))
    prefill(base, prefix, False)
    s1 = base.clone()
    out1 = spec(s1, d1, [1, 1])
    check = base.clone()
    assert_exact(out1, prefill(check, d1, True))  # a spec step reads like a prefill of its drafts

    for a in range(1, q + 1):
        accepted = [a, q + 1 - a]
        s2 = s1.clone()
        out2 = spec(s2, d2, accepted)
        replay = base.clone()
        for r, n in enumerate(accepted):  # replay each request's accepted drafts on its own
            one = replay.clone()
            x = on(backend, d1[r][:n])
            ops.ple_conv(
                x,
                torch.zeros_like(x),
                one,
                weights,
                on(backend, slots[r : r + 1]),
                None,
                mode="prefill",
                dilation=dilation,
                query_start_loc=on(backend, torch.tensor([0, n])),
                has_initial_states=on(backend, torch.tensor([True])),
            )
            replay[int(slots[r])] = one[int(slots[r])]
        assert_exact(out2, prefill(replay, d2, True))
        # State after step 2 holds S-1+q entries; its last S are the replayed window.
        for slot in slots.tolist():
            assert_exact(s2[slot, :, q - 1 : q - 1 + S].cpu(), replay[slot, :, :S].cpu())

    # One request on slot 1 (K = 4, dilation 3), any q <= 4, any accepted count and next chunk.
    @given(query_len=st.integers(1, 4), data=st.data(), seed=st.integers(0, 2**16))
    def random_steps(query_len, data, seed):
        gen = torch.Generator().manual_seed(seed)
        channels = 16
        state_len = 9
        width = state_len + query_len - 1
        weights = (torch.randn(channels, 4, generator=gen) * 0.5).to(dtype).to(device)
        drafts = torch.randn(query_len, channels, generator=gen).to(dtype).to(device)
        following = torch.randn(query_len, channels, generator=gen).to(dtype).to(device)
        start = fresh_state(channels, width, dtype, device, gen, layout_ == "window_first")
        accepted = data.draw(st.integers(1, query_len))
        next_len = data.draw(st.integers(0, query_len))

        spec_state = same_layout(start)
        single_request_step(
            backend, "spec", drafts, spec_state, weights, accepted=1, query_len=query_len
        )
        spec_y = single_request_step(
            backend,
            "spec",
            following[:next_len],
            spec_state,
            weights,
            accepted=accepted,
            query_len=query_len,
        )

        replay_state = same_layout(start)
        single_request_step(backend, "prefill", drafts[:accepted], replay_state, weights)
        replay_y = single_request_step(
            backend,
            "spec",
            following[:next_len],
            replay_state,
            weights,
            accepted=1,
            query_len=query_len,
        )
        assert torch.equal(spec_y, replay_y)
        kept = state_len - 1 + next_len
        assert torch.equal(spec_state[1, :, :kept], replay_state[1, :, :kept])

    random_steps()


# --- §9.7 the null slot and empty requests --------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_null_slot_and_empty_requests_never_write(backend):
    """SPEC §9.7: the null slot and unreferenced slots are never written; an empty prefill
    request keeps its state; null-slot rows output 0 in decode/prefill (residual = outer +
    residual) and are computed from their own tokens in spec."""
    ops, device = backend.ops, backend.device
    gen = torch.Generator().manual_seed(11)
    channels, kernel, dilation, q = 4, 3, 2, 3
    S = (kernel - 1) * dilation
    weights = on(backend, torch.randn(channels, kernel, generator=gen))
    fill = torch.randn(4, channels, S + q - 1, generator=gen)
    x = torch.randn(6, channels, generator=gen)
    hidden = torch.randn(6, channels, generator=gen)

    state = on(backend, fill)
    res = on(backend, torch.ones(6, channels))
    ops.ple_conv(
        on(backend, x),
        res,
        state,
        weights,
        on(backend, torch.tensor([0, 2, 3])),
        on(backend, hidden),
        mode="prefill",
        dilation=dilation,
        query_start_loc=on(backend, torch.tensor([0, 3, 3, 6])),
        has_initial_states=on(backend, torch.tensor([True, False, True])),
    )
    state, res = state.cpu(), res.cpu()
    assert_exact(state[:3], fill[:3])  # null slot 0 and the empty request on slot 2 untouched
    assert_exact(res[:3], 1 + hidden[:3])  # null slot: conv output 0, residuals still added
    assert not torch.equal(state[3], fill[3])

    state = on(backend, fill)
    res = on(backend, torch.ones(3, channels))
    ops.ple_conv(
        on(backend, x[:3]),
        res,
        state,
        weights,
        on(backend, torch.tensor([1, 0, 2])),
        None,
        mode="decode",
        dilation=dilation,
    )
    assert_exact(state.cpu()[0], fill[0])
    assert_exact(res.cpu()[1], torch.zeros(channels))

    state = on(backend, fill)
    res = on(backend, torch.zeros(6, channels))
    ops.ple_conv(
        on(backend, x),
        res,
        state,
        weights,
        on(backend, torch.tensor([0, 2])),
        None,
        mode="spec",
        dilation=dilation,
        query_start_loc=on(backend, torch.tensor([0, 3, 6])),
        num_accepted_tokens=on(backend, torch.tensor([2, 2])),
        spec_query_len=q,
    )
    assert_exact(state.cpu()[0], fill[0])
    scratch = on(backend, torch.zeros(2, channels, S))
    from_zero = on(backend, torch.zeros(3, channels))
    ops.ple_conv(
        on(backend, x[:3]),
        from_zero,
        scratch,
        weights,
        on(backend, torch.tensor([1])),
        None,
        mode="prefill",
        dilation=dilation,
        query_start_loc=on(backend, torch.tensor([0, 3])),
        has_initial_states=on(backend, torch.tensor([False])),
    )
    assert_exact(res.cpu()[:3], from_zero.cpu())

    # Random batches in every mode, every other request on the null slot, an empty one last.
    @given(mode=st.sampled_from(MODES), seed=st.integers(0, 2**16), query_len=st.integers(1, 3))
    def random_batches(mode, seed, query_len):
        rng = random.Random(seed)
        lengths = random_lengths(rng, mode, query_len) + [0]
        batch = make_batch(
            mode,
            torch.bfloat16,
            lengths=lengths,
            tokens=rng.randint(0, 6),
            query_len=query_len,
            null_every=2,
            seed=seed,
        )
        residual, state = batch.run(ops.ple_conv, device)
        slots = batch.state_indices.tolist()
        assert torch.equal(state[0], batch.conv_state[0])
        for slot in range(1, state.shape[0]):
            if slot not in slots:
                assert torch.equal(state[slot], batch.conv_state[slot])
        if mode == "prefill":
            qsl = batch.kwargs["query_start_loc"].tolist()
            for r, slot in enumerate(slots):
                if qsl[r + 1] == qsl[r]:
                    assert torch.equal(state[slot], batch.conv_state[slot])
        if mode != "spec":
            starts = (
                list(range(len(slots) + 1))
                if mode == "decode"
                else batch.kwargs["query_start_loc"].tolist()
            )
            rows = batch.kwargs.get("token_indices", torch.arange(residual.shape[0]))
            for r, slot in enumerate(slots):
                if slot == 0:
                    for t in rows[starts[r] : starts[r + 1]].tolist():
                        expected = batch.residual[t].float() + batch.outer_residual[t].float()
                        assert torch.equal(residual[t], expected.to(torch.bfloat16))

    random_batches()
