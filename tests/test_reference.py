"""The oracle itself: reference.py against docs/SPEC.md, its golden values, HF transformers 5.18 and
the properties of SPEC §9. CPU only; every case is seeded."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen4exp_ext import layout
from qwen4exp_ext import reference as ref
from qwen4exp_ext.testing import assert_exact

pytest.importorskip("transformers.models.qwen4_exp")
from transformers.models.qwen4_exp.modeling_qwen4_exp import (  # noqa: E402
    Qwen4ExpTextGatedResidual,
    Qwen4ExpTextNGramEmbedding,
    Qwen4ExpTextPLELayer,
)

from hf_support import EOS, tiny_config  # noqa: E402
from ple_conv.support import new_state  # noqa: E402

HYPOTHESIS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MASK64 = (1 << 64) - 1


# --------------------------------------------------------------------------------------------
# §3 ngram_ids
# --------------------------------------------------------------------------------------------
def layer_tensors(vocab: int, ngram_size: int, seed: int, layer: int, base: int, heads_per: int):
    mult = layout.layer_multipliers(vocab, ngram_size, seed, layer)
    sizes, offsets, _, _ = layout.head_vocab_layout(base, (ngram_size - 1) * heads_per, layer, 128)
    as_t = lambda v: torch.tensor(list(v), dtype=torch.int64)  # noqa: E731
    return as_t(mult), as_t(sizes), as_t(offsets)


def literal_ngram_ids(tokens, qsl, context, mult, sizes, offsets, eos, heads_per, n_ctx):
    """SPEC §3 read word by word: one token at a time, Python ints, explicit 2^64 wrap."""

    def wrap(v: int) -> int:
        v &= MASK64
        return v - (1 << 64) if v >= 1 << 63 else v

    num_reqs = len(qsl) - 1
    rows = []
    for t, token in enumerate(tokens):
        window = [token]
        if num_reqs <= 0:
            window += [eos] * n_ctx
        else:
            r = max([i for i in range(num_reqs) if qsl[i] <= t], default=0)
            p = t - qsl[r]
            crossed = False
            for s in range(1, n_ctx + 1):
                if p >= s:
                    cand = tokens[t - s]
                else:
                    col = n_ctx - s + p
                    cand = context[r][col] if col >= 0 else eos
                if crossed:
                    cand = eos
                crossed = crossed or cand == eos
                window.append(cand)
        row = []
        for h in range(len(sizes)):
            order = h // heads_per + 2
            mix = 0
            for k in range(order):
                mix ^= wrap(window[k] * mult[k])
            row.append(mix % sizes[h] + offsets[h])  # Python % with a positive divisor floors
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).reshape(len(tokens), len(sizes))


def test_ngram_ids_golden_toy_case():
    mult, sizes, offsets = layer_tensors(128, 3, 42, 0, 1000, 2)
    assert mult.tolist() == [62987067181621929, 46389143539761089, 16259569841195145]
    assert sizes.tolist() == [1009, 1013, 1019, 1021]
    assert offsets.tolist() == [0, 1009, 2022, 3041]
    expected = torch.tensor(
        [
            [431, 1474, 2482, 3896],
            [303, 1851, 2122, 3983],
            [799, 1184, 2346, 3957],
            [971, 1258, 2879, 3730],
        ]
    )
    for id_dtype in (torch.int32, torch.int64):
        ids = ref.ngram_ids(
            torch.tensor([9, 7, 3, 5], dtype=id_dtype),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([[7, 7]], dtype=id_dtype),
            mult,
            sizes,
            offsets,
            EOS,
            2,
        )
        assert ids.dtype == torch.int64
        assert_exact(ids, expected)
    out32 = torch.full((4, 4), -1, dtype=torch.int32)
    got = ref.ngram_ids(
        torch.tensor([9, 7, 3, 5]),
        torch.tensor([0, 4]),
        torch.tensor([[7, 7]]),
        mult,
        sizes,
        offsets,
        EOS,
        2,
        output=out32,
    )
    assert got is out32
    assert_exact(out32, expected.to(torch.int32))


@pytest.fixture(
    scope="module", params=[(3, 0), (3, 1), (4, 2), (2, 0)], ids=lambda p: f"N{p[0]}L{p[1]}"
)
def hf_ngram(request):
    """transformers' NGramEmbedding whose table row i holds i, so its output reads back the ids."""
    ngram_size, layer = request.param
    heads_per = 2
    heads = (ngram_size - 1) * heads_per
    cfg = tiny_config(ngram_size=ngram_size, ple_embed_dim=2 * heads)
    module = Qwen4ExpTextNGramEmbedding(cfg, 2 * heads, layer_idx=0, ple_layer_index=layer)
    with torch.no_grad():
        rows = module.ngram_embedding.weight.shape[0]
        module.ngram_embedding.weight.copy_(torch.arange(rows, dtype=torch.float32)[:, None])
    mult, sizes, offsets = layer_tensors(128, ngram_size, 42, layer, 1000, heads_per)
    assert_exact(module.layer_multipliers, mult)
    assert_exact(module.ngram_heads_vocab_sizes, sizes)
    assert_exact(module.ngram_heads_offsets, offsets)

    def hf_ids(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = module(batch, None)  # [B, S, NH·2]
        return out.unflatten(-1, (heads, 2))[..., 0].round().to(torch.int64)

    return dict(n_ctx=ngram_size - 1, heads_per=heads_per, tables=(mult, sizes, offsets), hf=hf_ids)


def varlen_chunks(seq: list[int], cuts: list[int], n_ctx: int):
    """Chunks of one sequence as the requests of one varlen step, each with its true context."""
    bounds = [0, *sorted(set(cuts)), len(seq)]
    qsl, context = [0], []
    for a, b in pairwise(bounds):
        qsl.append(qsl[-1] + b - a)
        before = [EOS] * n_ctx + seq[:a]
        context.append(before[len(before) - n_ctx :])
    return torch.tensor(qsl, dtype=torch.int32), torch.tensor(context)


def test_ngram_ids_match_transformers_whole_sequences(hf_ngram):
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 128, (4, 23), generator=gen)
    batch[batch % 9 == 0] = EOS  # several EOS per row, some adjacent, some at the start
    batch[1, 0] = EOS
    batch[2, -1] = EOS
    expected = hf_ngram["hf"](batch)
    n_ctx = hf_ngram["n_ctx"]
    qsl = torch.arange(0, batch.numel() + 1, batch.shape[1], dtype=torch.int32)
    context = torch.full((batch.shape[0], n_ctx), EOS)
    got = ref.ngram_ids(
        batch.reshape(-1), qsl, context, *hf_ngram["tables"], EOS, hf_ngram["heads_per"]
    )
    assert_exact(got.reshape(expected.shape), expected)


@HYPOTHESIS
@given(data=st.data())
def test_ngram_ids_chunks_with_context_match_transformers(hf_ngram, data):
    length = data.draw(st.integers(1, 30), label="length")
    seq = data.draw(
        st.lists(st.one_of(st.just(EOS), st.integers(0, 127)), min_size=length, max_size=length),
        label="seq",
    )
    cuts = data.draw(st.lists(st.integers(1, max(1, length - 1)), max_size=6), label="cuts")
    cuts = [c for c in cuts if 0 < c < length]
    qsl, context = varlen_chunks(seq, cuts, hf_ngram["n_ctx"])
    got = ref.ngram_ids(
        torch.tensor(seq), qsl, context, *hf_ngram["tables"], EOS, hf_ngram["heads_per"]
    )
    assert_exact(got, hf_ngram["hf"](torch.tensor([seq]))[0])


@HYPOTHESIS
@given(data=st.data())
def test_ngram_ids_match_literal_spec(data):
    """Wrap-around (tokens far outside the vocabulary, negative ones), negative mixes, empty
    requests, tokens past qsl[R], R = 0, int32 and int64 ids."""
    ngram_size = data.draw(st.integers(2, 4), label="N")
    heads_per = data.draw(st.integers(1, 3), label="K")
    n_ctx = ngram_size - 1
    mult, sizes, offsets = layer_tensors(
        128, ngram_size, 1234, data.draw(st.integers(0, 2)), 1000, heads_per
    )
    wide = data.draw(st.booleans(), label="int64 tokens")
    bound = 2**62 if wide else 2**31
    token = st.one_of(st.just(EOS), st.integers(0, 127), st.integers(-bound, bound - 1))
    tokens = data.draw(st.lists(token, max_size=24), label="tokens")
    lengths = data.draw(st.lists(st.integers(0, 6), max_size=5), label="request lengths")
    qsl = [min(data.draw(st.integers(0, 2), label="qsl[0]"), len(tokens))]
    for n in lengths:
        qsl.append(min(qsl[-1] + n, len(tokens)))  # tokens past qsl[R] belong to the last request
    context = data.draw(
        st.lists(
            st.lists(token, min_size=n_ctx, max_size=n_ctx),
            min_size=len(lengths),
            max_size=len(lengths),
        ),
        label="context",
    )
    dtype = torch.int64 if wide else torch.int32
    ctx_t = torch.tensor(context, dtype=dtype).reshape(len(lengths), n_ctx)
    got = ref.ngram_ids(
        torch.tensor(tokens, dtype=dtype),
        torch.tensor(qsl, dtype=torch.int32),
        ctx_t,
        mult,
        sizes,
        offsets,
        EOS,
        heads_per,
    )
    expected = literal_ngram_ids(
        tokens, qsl, context, mult.tolist(), sizes.tolist(), offsets.tolist(), EOS, heads_per, n_ctx
    )
    assert_exact(got, expected)
    lo, hi = offsets, offsets + sizes
    assert bool(((got >= lo) & (got < hi)).all())


@HYPOTHESIS
@given(data=st.data())
def test_ngram_ids_eos_barrier(data):
    """SPEC §9.2: tokens older than an EOS do not change the ids of any later token."""
    mult, sizes, offsets = layer_tensors(128, 4, 1234, 0, 1000, 2)
    seq = data.draw(st.lists(st.integers(0, 127), min_size=2, max_size=20), label="seq")
    eos_at = data.draw(st.integers(0, len(seq) - 1), label="eos position")
    seq[eos_at] = EOS
    other = [data.draw(st.integers(0, 2**40)) for _ in range(eos_at)] + seq[eos_at:]
    context_a = torch.tensor([data.draw(st.lists(st.integers(0, 127), min_size=3, max_size=3))])
    context_b = torch.tensor([[1, 2, 3]])
    qsl = torch.tensor([0, len(seq)])
    a = ref.ngram_ids(torch.tensor(seq), qsl, context_a, mult, sizes, offsets, EOS, 2)
    b = ref.ngram_ids(torch.tensor(other), qsl, context_b, mult, sizes, offsets, EOS, 2)
    assert_exact(a[eos_at + 1 :], b[eos_at + 1 :])


def test_ngram_ids_edge_cases():
    mult, sizes, offsets = layer_tensors(128, 3, 42, 0, 1000, 2)
    tokens = torch.tensor([9, 7, 3, 5])
    # R = 0: every earlier position reads EOS.
    none = ref.ngram_ids(
        tokens,
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, 2, dtype=torch.int64),
        mult,
        sizes,
        offsets,
        EOS,
        2,
    )
    fresh = ref.ngram_ids(
        tokens[:1], torch.tensor([0, 1]), torch.tensor([[EOS, EOS]]), mult, sizes, offsets, EOS, 2
    )
    assert_exact(none[0], fresh[0])
    # Padding tokens past qsl[R] continue the last request.
    padded = ref.ngram_ids(
        tokens,
        torch.tensor([0, 1, 2]),
        torch.tensor([[1, 2], [7, 7]]),
        mult,
        sizes,
        offsets,
        EOS,
        2,
    )
    whole = ref.ngram_ids(
        tokens[1:], torch.tensor([0, 3]), torch.tensor([[7, 7]]), mult, sizes, offsets, EOS, 2
    )
    assert_exact(padded[1:], whole)
    empty = ref.ngram_ids(
        tokens[:0], torch.tensor([0, 0]), torch.tensor([[7, 7]]), mult, sizes, offsets, EOS, 2
    )
    assert empty.shape == (0, 4)
    with pytest.raises(ValueError):
        ref.ngram_ids(
            tokens,
            torch.tensor([0, 4]),
            torch.tensor([[7, 7]]),
            mult,
            sizes,
            offsets,
            EOS,
            2,
            output=torch.empty(4, 3, dtype=torch.int64),
        )


# --------------------------------------------------------------------------------------------
# §4 gather_rows
# --------------------------------------------------------------------------------------------
TABLE_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
]


def literal_gather(table, ids, scale, start, end, out_dtype):
    """SPEC §4 one element at a time, in Python floats where the spec says float()."""
    rows, width = table.shape
    fp8 = table.dtype in ref.FP8_DTYPES
    scale_out = float(torch.tensor(float(scale)).to(out_dtype)) if fp8 else None
    out = torch.zeros(ids.shape[0], ids.shape[1] * width, dtype=out_dtype)
    for t in range(ids.shape[0]):
        for h in range(ids.shape[1]):
            i = int(ids[t, h])
            if not (start <= i < end and 0 <= i - start < rows):
                continue
            for c in range(width):
                v = float(table[i - start, c].float())
                out[t, h * width + c] = torch.tensor(v * scale_out if fp8 else v).to(out_dtype)
    return out


@pytest.mark.parametrize("table_dtype", TABLE_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=str)
def test_gather_rows_matches_literal_spec(table_dtype, out_dtype, id_dtype):
    gen = torch.Generator().manual_seed(3)
    rows, width = 37, 5
    table = (torch.randn(rows, width, generator=gen) * 30).to(table_dtype)
    fp8 = table_dtype in ref.FP8_DTYPES
    scale = torch.tensor(0.0123) if fp8 else None
    ids = torch.randint(-3, rows + 3, (11, 3), generator=gen, dtype=torch.int64)
    ids[0] = torch.tensor([0, rows - 1, rows])  # both ends and the first id past the table
    ids[1] = torch.tensor([-1, -(2**31), 2**31 - 1])
    ids = ids.to(id_dtype)
    got = ref.gather_rows(table, ids, scale=scale, out_dtype=out_dtype)
    resolved = out_dtype or (torch.bfloat16 if fp8 else table_dtype)
    assert got.dtype == resolved and got.shape == (11, 3 * width)
    assert_exact(got, literal_gather(table, ids, scale, 0, rows, resolved))


@pytest.mark.parametrize(
    "table_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str
)
def test_gather_rows_vocabulary_shards_sum_to_whole(table_dtype):
    gen = torch.Generator().manual_seed(4)
    rows, width = 50, 4
    table = torch.randn(rows, width, generator=gen).to(table_dtype)
    scale = torch.tensor(1.5) if table_dtype in ref.FP8_DTYPES else None
    ids = torch.randint(-2, rows + 2, (9, 4), generator=gen)
    whole = ref.gather_rows(table, ids, scale=scale)
    bounds = [0, 13, 13, 40, rows]  # includes an empty shard
    total = torch.zeros_like(whole)
    for start, end in pairwise(bounds):
        # each rank's table is padded past its range; padding rows must never be read
        local = torch.cat([table[start:end], torch.full((3, width), 99.0).to(table_dtype)])
        part = ref.gather_rows(local, ids, scale=scale, vocab_start=start, vocab_end=end)
        owned = ((ids >= start) & (ids < end)).repeat_interleave(width, dim=1)
        assert bool((part[~owned] == 0).all())
        total += part
    assert_exact(total, whole)


def test_gather_rows_errors():
    table = torch.zeros(4, 2).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        ref.gather_rows(table, torch.zeros(1, 1, dtype=torch.int64))  # fp8 without its scale
    with pytest.raises(ValueError):
        ref.gather_rows(
            torch.zeros(4, 2), torch.zeros(1, 1, dtype=torch.int64), vocab_start=0, vocab_end=5
        )
    with pytest.raises(ValueError):
        ref.gather_rows(torch.zeros(4, 2), torch.zeros(1, 1))  # float ids


# --------------------------------------------------------------------------------------------
# §5 ple_gate
# --------------------------------------------------------------------------------------------
def gate_inputs(tokens, width, streams, dtype, seed=5):
    gen = torch.Generator().manual_seed(seed)
    hc = width * streams
    kv = torch.randn(tokens, hc + width, generator=gen).to(dtype)
    key, value = kv.split([hc, width], dim=-1)  # strided views, as the kv projection gives them
    hidden = (torch.randn(tokens, hc, generator=gen) * 3).to(dtype)
    weights = [(torch.randn(hc, generator=gen) * 0.3).to(dtype) for _ in range(3)]
    return key, value, hidden, weights


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


def test_ple_gate_strided_views_and_zero_dot():
    key, value, hidden, weights = gate_inputs(5, 8, 2, torch.bfloat16)
    a = ref.ple_gate(key, value, hidden, *weights, 1e-6)
    b = ref.ple_gate(key.contiguous(), value.contiguous(), hidden, *weights, 1e-6)
    assert_exact(a[0], b[0])
    assert_exact(a[1], b[1])
    hidden = torch.zeros_like(hidden)  # normalised query 0 → d = 0, sign(0) = 0 → g = 1/2
    gated, _ = ref.ple_gate(key, value, hidden, *weights, 1e-6)
    assert_exact(gated, (0.5 * value.float()).repeat(1, 2).to(torch.bfloat16))


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
