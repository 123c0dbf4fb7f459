"""The oracle itself: reference.py against docs/SPEC.md, its golden values, HF transformers 5.18 and
the properties of SPEC §9. CPU only; every case is seeded."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen4exp_ext import reference as ref
from qwen4exp_ext.testing import assert_exact

pytest.importorskip("transformers.models.qwen4_exp")
from transformers.models.qwen4_exp.modeling_qwen4_exp import (  # noqa: E402
    Qwen4ExpTextGatedResidual,
    Qwen4ExpTextPLELayer,
)

from hf_support import EOS, tiny_config  # noqa: E402

HYPOTHESIS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# --------------------------------------------------------------------------------------------
# §6 ple_conv
# --------------------------------------------------------------------------------------------
def new_state(slots, channels, width, dtype, layout_="dim_first", fill=None):
    """[slots, C, W] pool; window-first storage is a transposed view (vLLM keeps both)."""
    if layout_ == "dim_first":
        state = torch.zeros(slots, channels, width, dtype=dtype)
    else:
        state = torch.zeros(slots, width, channels, dtype=dtype).transpose(1, 2)
    if fill is not None:
        state.copy_(fill)
    return state


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


def run_steps(steps, channels, weights, dilation, dtype, layout_, num_reqs):
    """Run a list of (mode, per-request chunks) steps on fresh slots 1..R; returns the outputs
    per request (concatenated over steps) and the final states."""
    S = (weights.shape[1] - 1) * dilation
    state = new_state(num_reqs + 2, channels, S, dtype, layout_)
    seen = [0] * num_reqs
    outputs = [[] for _ in range(num_reqs)]
    for mode, chunks in steps:
        active = [r for r in range(num_reqs) if mode == "prefill" or len(chunks[r])]
        x = (
            torch.cat([chunks[r] for r in active])
            if active
            else torch.zeros(0, channels, dtype=dtype)
        )
        out = torch.zeros_like(x)
        lens = [len(chunks[r]) for r in active]
        qsl = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()])
        init = torch.tensor([seen[r] > 0 for r in active])
        ref.ple_conv(
            x,
            out,
            state,
            weights,
            torch.tensor([r + 1 for r in active]),
            None,
            mode=mode,
            dilation=dilation,
            query_start_loc=qsl,
            has_initial_states=init,
        )
        for i, r in enumerate(active):
            outputs[r].append(out[int(qsl[i]) : int(qsl[i + 1])])
            seen[r] += lens[i]
    return [torch.cat(o) for o in outputs], state[1 : num_reqs + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout_", ["dim_first", "window_first"])
@HYPOTHESIS
@given(data=st.data())
def test_ple_conv_chunk_split_invariance(dtype, layout_, data):
    """SPEC §9.1: whole prefill == split prefill (empty chunks included) == token-by-token
    decode, for outputs and final states, bit for bit."""
    kernel = data.draw(st.integers(2, 4), label="K")
    dilation = data.draw(st.integers(1, 3), label="dilation")
    channels = 5
    lengths = data.draw(st.lists(st.integers(1, 14), min_size=1, max_size=3), label="lengths")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000), label="seed"))
    weights = torch.randn(channels, kernel, generator=gen).to(dtype)
    seqs = [torch.randn(n, channels, generator=gen).to(dtype) for n in lengths]
    R = len(seqs)
    whole, whole_state = run_steps(
        [("prefill", seqs)], channels, weights, dilation, dtype, layout_, R
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
    split, split_state = run_steps(split_steps, channels, weights, dilation, dtype, layout_, R)

    decode_steps = [("decode", [s[i : i + 1] for s in seqs]) for i in range(max(lengths))]
    decode, decode_state = run_decode(decode_steps, channels, weights, dilation, dtype, layout_, R)
    for r in range(R):
        assert_exact(split[r], whole[r])
        assert_exact(decode[r], whole[r])
    assert_exact(split_state, whole_state)
    assert_exact(decode_state, whole_state)


def run_decode(steps, channels, weights, dilation, dtype, layout_, num_reqs):
    """Token-by-token decode of every request; a request's first token has no initial state."""
    S = (weights.shape[1] - 1) * dilation
    state = new_state(num_reqs + 2, channels, S, dtype, layout_)
    seen = [0] * num_reqs
    outputs = [[] for _ in range(num_reqs)]
    for _, chunks in steps:
        active = [r for r in range(num_reqs) if len(chunks[r])]
        x = torch.cat([chunks[r] for r in active])
        out = torch.zeros_like(x)
        init = torch.tensor([seen[r] > 0 for r in active])
        ref.ple_conv(
            x,
            out,
            state,
            weights,
            torch.tensor([r + 1 for r in active]),
            None,
            mode="decode",
            dilation=dilation,
            has_initial_states=init,
        )
        for i, r in enumerate(active):
            outputs[r].append(out[i : i + 1])
            seen[r] += 1
    return [torch.cat(o) for o in outputs], state[1 : num_reqs + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_ple_conv_zero_weights_and_fused_residual(dtype):
    """SPEC §9.4 and the fused rounding: residual ← round(round(gated + round(y)) + hidden)."""
    gen = torch.Generator().manual_seed(8)
    T, channels = 9, 7
    x = torch.randn(T, channels, generator=gen).to(dtype)
    gated = torch.randn(T, channels, generator=gen).to(dtype)
    hidden = (torch.randn(T, channels, generator=gen) * 100).to(dtype)
    qsl = torch.tensor([0, 4, 9])
    kwargs = dict(
        mode="prefill",
        dilation=2,
        query_start_loc=qsl,
        has_initial_states=torch.tensor([False, True]),
    )
    state = new_state(3, channels, 4, dtype, fill=torch.randn(3, channels, 4, generator=gen))
    res = gated.clone()
    ref.ple_conv(
        x,
        res,
        state.clone(),
        torch.zeros(channels, 3, dtype=dtype),
        torch.tensor([1, 2]),
        hidden,
        **kwargs,
    )
    assert_exact(res, gated + hidden)  # torch's own low-precision add rounds once, like the spec
    weights = torch.randn(channels, 3, generator=gen).to(dtype)
    alone = torch.empty_like(x)
    ref.ple_conv(x, alone, state.clone(), weights, torch.tensor([1, 2]), None, **kwargs)
    fused = gated.clone()
    ref.ple_conv(x, fused, state.clone(), weights, torch.tensor([1, 2]), hidden, **kwargs)
    # vLLM eager: gated.add_(conv); gated.add_(hidden)
    assert_exact(fused, (gated + alone) + hidden)


@pytest.mark.parametrize("init", [True, False])
@pytest.mark.parametrize("layout_", ["dim_first", "window_first"])
def test_ple_conv_decode_equals_one_token_prefill(init, layout_):
    """SPEC §9.5, with the decode window read from the start of a wider (spec-sized) state."""
    gen = torch.Generator().manual_seed(9)
    channels, kernel, dilation, width = 6, 3, 3, 8
    weights = torch.randn(channels, kernel, generator=gen)
    fill = torch.randn(5, channels, width, generator=gen)
    x = torch.randn(3, channels, generator=gen)
    slots = torch.tensor([4, 1, 3])
    has_init = torch.tensor([init, True, init])
    s_dec = new_state(5, channels, width, torch.float32, layout_, fill)
    s_pre = new_state(5, channels, width, torch.float32, layout_, fill)
    o_dec, o_pre = torch.empty_like(x), torch.empty_like(x)
    ref.ple_conv(
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
    ref.ple_conv(
        x,
        o_pre,
        s_pre,
        weights,
        slots,
        None,
        mode="prefill",
        dilation=dilation,
        query_start_loc=torch.arange(4),
        has_initial_states=has_init,
    )
    assert_exact(o_dec, o_pre)
    assert_exact(s_dec, s_pre)
    assert_exact(s_dec[:, :, 6:], fill[:, :, 6:])  # entries past S are never touched outside spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout_", ["dim_first", "window_first"])
def test_ple_conv_spec_replays_accepted_tokens(dtype, layout_):
    """SPEC §9.6: after a spec step, the next step with num_accepted = a equals replaying the
    first a draft tokens with prefill and then running the next chunk."""
    gen = torch.Generator().manual_seed(10)
    channels, kernel, dilation, q = 5, 3, 2, 4
    S = (kernel - 1) * dilation
    weights = torch.randn(channels, kernel, generator=gen).to(dtype)
    prefix = [torch.randn(n, channels, generator=gen).to(dtype) for n in (6, 2)]
    d1 = [torch.randn(q, channels, generator=gen).to(dtype) for _ in range(2)]
    d2 = [torch.randn(q, channels, generator=gen).to(dtype) for _ in range(2)]
    slots = torch.tensor([3, 1])
    spec_qsl = torch.tensor([0, q, 2 * q])

    def prefill(state, chunks, init):
        x = torch.cat(chunks)
        qsl = torch.tensor([0, len(chunks[0]), len(x)])
        out = torch.zeros_like(x)
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
            has_initial_states=torch.tensor([init, init]),
        )
        return out

    def spec(state, chunks, accepted):
        x = torch.cat(chunks)
        out = torch.zeros_like(x)
        ref.ple_conv(
            x,
            out,
            state,
            weights,
            slots,
            None,
            mode="spec",
            dilation=dilation,
            query_start_loc=spec_qsl,
            num_accepted_tokens=torch.tensor(accepted),
            spec_query_len=q,
        )
        return out

    base = new_state(4, channels, S + q - 1, dtype, layout_)
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
            x = d1[r][:n]
            ref.ple_conv(
                x,
                torch.zeros_like(x),
                one,
                weights,
                slots[r : r + 1],
                None,
                mode="prefill",
                dilation=dilation,
                query_start_loc=torch.tensor([0, n]),
                has_initial_states=torch.tensor([True]),
            )
            replay[slots[r]] = one[slots[r]]
        assert_exact(out2, prefill(replay, d2, True))
        # State after step 2 holds S-1+q entries; its last S are the replayed window.
        for slot in slots.tolist():
            assert_exact(s2[slot, :, q - 1 : q - 1 + S], replay[slot, :, :S])


def test_ple_conv_null_slot_and_empty_requests_never_write():
    """SPEC §9.7 plus the null slot's outputs: 0 in decode/prefill, own-token history in spec."""
    gen = torch.Generator().manual_seed(11)
    channels, kernel, dilation, q = 4, 3, 2, 3
    S = (kernel - 1) * dilation
    weights = torch.randn(channels, kernel, generator=gen)
    fill = torch.randn(4, channels, S + q - 1, generator=gen)
    x = torch.randn(6, channels, generator=gen)
    hidden = torch.randn(6, channels, generator=gen)

    state = fill.clone()
    res = torch.ones(6, channels)
    ref.ple_conv(
        x,
        res,
        state,
        weights,
        torch.tensor([0, 2, 3]),
        hidden,
        mode="prefill",
        dilation=dilation,
        query_start_loc=torch.tensor([0, 3, 3, 6]),
        has_initial_states=torch.tensor([True, False, True]),
    )
    assert_exact(state[:3], fill[:3])  # null slot 0 and the empty request on slot 2 untouched
    assert_exact(res[:3], 1 + hidden[:3])  # null slot: conv output 0, residuals still added
    assert not torch.equal(state[3], fill[3])

    state = fill.clone()
    res = torch.ones(3, channels)
    ref.ple_conv(
        x[:3], res, state, weights, torch.tensor([1, 0, 2]), None, mode="decode", dilation=dilation
    )
    assert_exact(state[0], fill[0])
    assert_exact(res[1], torch.zeros(channels))

    state = fill.clone()
    res = torch.zeros(6, channels)
    ref.ple_conv(
        x,
        res,
        state,
        weights,
        torch.tensor([0, 2]),
        None,
        mode="spec",
        dilation=dilation,
        query_start_loc=torch.tensor([0, 3, 6]),
        num_accepted_tokens=torch.tensor([2, 2]),
        spec_query_len=q,
    )
    assert_exact(state[0], fill[0])
    scratch = torch.zeros(2, channels, S)
    from_zero = torch.zeros(3, channels)
    ref.ple_conv(
        x[:3],
        from_zero,
        scratch,
        weights,
        torch.tensor([1]),
        None,
        mode="prefill",
        dilation=dilation,
        query_start_loc=torch.tensor([0, 3]),
        has_initial_states=torch.tensor([False]),
    )
    assert_exact(res[:3], from_zero)


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


# --------------------------------------------------------------------------------------------
# §7 the layer against transformers
# --------------------------------------------------------------------------------------------
def hf_ple_layer(cfg, ple_layer_index, seed):
    torch.manual_seed(seed)
    layer = Qwen4ExpTextPLELayer(cfg, layer_idx=0, ple_layer_index=ple_layer_index)
    with torch.no_grad():
        for norm in (layer.norm_key, layer.norm_query, layer.norm_conv):
            norm.weight.normal_(0.0, 0.3)
        layer.conv1d.weight.normal_(0.0, 0.5)
    emb = layer.ple_embedding
    weights = dict(
        table=emb.ngram_embedding.weight.detach(),
        layer_multipliers=emb.layer_multipliers,
        head_sizes=emb.ngram_heads_vocab_sizes,
        head_offsets=emb.ngram_heads_offsets,
        eos_token_id=EOS,
        heads_per_ngram=cfg.heads_per_ngram,
        w_kv=torch.cat([layer.key_proj.weight, layer.value_proj.weight]).detach(),
        norm_key_w=layer.norm_key.weight.detach(),
        norm_query_w=layer.norm_query.weight.detach(),
        norm_conv_w=layer.norm_conv.weight.detach(),
        conv_weights=layer.conv1d.weight.detach().squeeze(1),
        eps=cfg.rms_norm_eps,
    )
    return layer, weights


LAYER_CASES = [
    dict(ple_layer_index=0, cfg={}),
    dict(
        ple_layer_index=1,
        cfg=dict(
            ngram_size=2, heads_per_ngram=3, ple_embed_dim=12, hc_count=2, ple_conv_kernel_size=3
        ),
    ),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=["L0-N3", "L1-N2"])
def test_ple_layer_matches_transformers_prefill(case):
    cfg = tiny_config(**case["cfg"])
    layer, weights = hf_ple_layer(cfg, case["ple_layer_index"], seed=14)
    gen = torch.Generator().manual_seed(15)
    B, S_len, C = 3, 17, cfg.hc_count * cfg.hidden_size
    ids = torch.randint(0, cfg.vocab_size, (B, S_len), generator=gen)
    ids[ids % 6 == 0] = EOS
    hidden = torch.randn(B, S_len, C, generator=gen) * 2
    with torch.no_grad():
        theirs = layer(hidden, ids, None)
    qsl = torch.arange(0, B * S_len + 1, S_len, dtype=torch.int32)
    context = torch.full((B, cfg.ngram_size - 1), EOS)
    ours = ref.ple_layer(hidden.reshape(-1, C), ids.reshape(-1), qsl, context, **weights)
    torch.testing.assert_close(ours.reshape(B, S_len, C), hidden + theirs, rtol=1e-5, atol=1e-5)


def test_ple_layer_chunked_with_state_matches_transformers():
    """Chunked prefill + decode through one persistent conv state and the right n-gram context
    gives transformers' whole-sequence output."""
    cfg = tiny_config()
    layer, weights = hf_ple_layer(cfg, 0, seed=16)
    gen = torch.Generator().manual_seed(17)
    S_len, C, n_ctx = 19, cfg.hc_count * cfg.hidden_size, cfg.ngram_size - 1
    ids = torch.randint(0, cfg.vocab_size, (S_len,), generator=gen)
    ids[[3, 4, 11]] = EOS
    hidden = torch.randn(S_len, C, generator=gen)
    with torch.no_grad():
        expected = hidden + layer(hidden[None], ids[None], None)[0]
    state_len = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
    state = new_state(3, C, state_len, torch.float32, "window_first")
    slot = torch.tensor([2])
    outs = []
    bounds = [0, 5, 6, 13, 17, 18, 19]  # prefill chunks, then single tokens through decode
    for a, b in pairwise(bounds):
        before = [EOS] * n_ctx + ids[:a].tolist()
        context = torch.tensor([before[len(before) - n_ctx :]])
        mode = "decode" if b - a == 1 and a > 13 else "prefill"
        outs.append(
            ref.ple_layer(
                hidden[a:b],
                ids[a:b],
                torch.tensor([0, b - a]),
                context,
                conv_state=state,
                state_indices=slot,
                mode=mode,
                has_initial_states=torch.tensor([a > 0]),
                **weights,
            )
        )
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)


def test_ple_layer_fp8_table_dequantises_like_vllm():
    cfg = tiny_config()
    _, weights = hf_ple_layer(cfg, 0, seed=18)
    scale = torch.tensor(0.02)
    fp8 = (weights["table"] / scale).to(torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(19)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=gen)
    hidden = torch.randn(9, cfg.hc_count * cfg.hidden_size, generator=gen).to(torch.bfloat16)
    args = (hidden, ids, torch.tensor([0, 9]), torch.full((1, 2), EOS))
    quant = dict(weights, table=fp8, table_scale=scale)
    dequant = dict(weights, table=fp8.to(torch.bfloat16) * scale.to(torch.bfloat16))
    assert_exact(ref.ple_layer(*args, **quant), ref.ple_layer(*args, **dequant))


# --------------------------------------------------------------------------------------------
# §8 hyper-connections
# --------------------------------------------------------------------------------------------
def test_hc_mix_and_combine():
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(2, 5, 3 * 4, generator=gen)
    block = torch.randn(2, 5, 4, generator=gen)
    torch.testing.assert_close(ref.hc_mix(x, 3), (x[..., :4] + x[..., 4:8] + x[..., 8:]) / 3)
    assert_exact(ref.hc_combine(block, x), x + block.repeat(1, 1, 3))


@pytest.mark.parametrize("hc_count,hidden_size,lowrank", [(2, 8, 3), (4, 6, 5)])
def test_gated_residual_matches_transformers(hc_count, hidden_size, lowrank):
    cfg = tiny_config(hc_count=hc_count, hidden_size=hidden_size, hc_lowrank=lowrank)
    torch.manual_seed(21)
    module = Qwen4ExpTextGatedResidual(cfg)
    with torch.no_grad():
        module.hc_norm.weight.normal_(0.0, 0.3)
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(3, 7, hc_count * hidden_size, generator=gen) * 2
    block = torch.randn(3, 7, hidden_size, generator=gen)
    with torch.no_grad():
        mixed_hf, hyper_hf, inj_hf = module(x)
        combined_hf = hyper_hf + (block.unsqueeze(-2) * inj_hf.unsqueeze(-1)).flatten(-2)
    w = {k: v.detach() for k, v in module.named_parameters()}
    mixed, normed = ref.gated_residual_mix(
        x,
        w["hc_norm.weight"],
        w["input_mix_weight_down.weight"],
        w["input_mix_weight_up.weight"],
        hc_count=hc_count,
        eps=cfg.rms_norm_eps,
    )
    torch.testing.assert_close(mixed, mixed_hf, rtol=1e-5, atol=1e-6)
    combined = ref.gated_residual_combine(block, x, normed, w["block_inject_weight.weight"])
    torch.testing.assert_close(combined, combined_hf, rtol=1e-5, atol=1e-6)


def test_gated_residual_shared_norm_weight():
    """vLLM's hc_per_branch_norm=False: one [H] weight shared by every stream."""
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(4, 3 * 8, generator=gen).to(torch.bfloat16)
    w = torch.randn(8, generator=gen).to(torch.bfloat16)
    assert_exact(ref.grouped_rms_norm(x, w, 8, 1e-6), ref.grouped_rms_norm(x, w.repeat(3), 8, 1e-6))
