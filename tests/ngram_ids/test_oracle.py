"""reference.ngram_ids, the oracle itself (SPEC §3): against SPEC §3's text read word by word,
against transformers 5.18 (whole sequences, and chunks with their context), and its own errors.
CPU only; every case is seeded. Its golden rows, edge layouts and §9 properties, which every
kernel holds too, are test_properties.py's (over backends(oracle=True))."""

from __future__ import annotations

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
    Qwen4ExpTextNGramEmbedding,
)

from hf_support import EOS, tiny_config  # noqa: E402

HYPOTHESIS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MASK64 = (1 << 64) - 1


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


def test_ngram_ids_rejects_a_bad_output_shape():
    """The oracle's own error (from tests/test_reference.py's test_ngram_ids_edge_cases; its
    other checks are test_properties.py's test_edge_layouts, over every backend)."""
    mult, sizes, offsets = layer_tensors(128, 3, 42, 0, 1000, 2)
    tokens = torch.tensor([9, 7, 3, 5])
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
