"""Fuzzing of ngram_ids against the reference oracle (SPEC §9.8: bit-exact), with the
time-bounded kit of tests/fuzz_support.py (what is drawn, the budget, how to replay a failure):
layers of any int64 multipliers and head sizes up to 2^62, varlen batches (mixed, decode-like,
one long chunk, only empty requests, tokens past qsl[R]), int32/int64 ids, contexts and starts,
any memory layout of every tensor, and an output or none (int64, int32)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from fuzz_support import (
    BACKENDS,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    Recorder,
    assert_outside_untouched,
    assert_unchanged,
    draw_layout_1d,
    draw_layout_2d,
    draw_request_lengths,
    dtype_range,
    fuzz,
    generator,
    random_ints,
    sizes,
)
from ngram_support import cpu_ngram_hash, hash_cases
from qwen4exp_ext import reference
from qwen4exp_ext.testing import assert_exact


def ngram_body(backend, draw: Recorder) -> None:
    ops, device = backend.ops, backend.device
    ngram_size = draw(st.integers(2, 8), label="ngram_size")
    per = draw(sizes([1, 2, 8], 1, 5), label="heads_per_ngram")
    ctx_len, nh = ngram_size - 1, (ngram_size - 1) * per
    out_kind = draw(st.sampled_from(["none", "int64", "int32"]), label="output")
    cap = INT32_MAX // nh if out_kind == "int32" else 2**62 // nh  # offsets' prefix sums fit
    multipliers = draw(
        st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=ngram_size, max_size=ngram_size),
        label="multipliers",
    )
    head_sizes = draw(
        st.lists(
            sizes([1, 2, 3, 1009, 2**31 - 1, 2**32 + 15, 2**62], 1, 2**40),
            min_size=nh,
            max_size=nh,
        ),
        label="head sizes",
    )
    head_sizes = [min(s, cap) for s in head_sizes]
    offsets, total = [], 0
    for s in head_sizes:
        offsets.append(total)
        total += s
    eos = draw(sizes([0, 7, 248044, INT32_MAX], 0, 20), label="eos")
    id_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="input_ids dtype")
    ctx_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="context dtype")
    qsl_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="qsl dtype")
    lengths = draw_request_lengths(draw, longest=96, many=64)
    tail = draw(st.sampled_from([0, 0, 1, 3]), label="tokens past qsl[R]")
    vocab = draw(st.sampled_from([12, 1000, 248320, INT32_MAX, None]), label="vocab (None: any)")
    eos_rate = draw(st.sampled_from([0.0, 0.05, 0.2, 0.6]), label="eos rate")
    gen = generator(draw)

    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    num_tokens, num_reqs = qsl[-1] + tail, len(lengths)

    def tokens(shape, dtype):
        low, high = (0, vocab - 1) if vocab is not None else dtype_range(dtype)
        values = random_ints(gen, shape, low, high, torch.int64)
        values = torch.where(torch.rand(shape, generator=gen) < eos_rate, eos, values)
        return values.to(dtype)

    input_ids = tokens((num_tokens,), id_dtype)
    context = tokens((num_reqs, ctx_len), ctx_dtype)
    qsl_t = torch.tensor(qsl, dtype=qsl_dtype)
    consts = (
        torch.tensor(multipliers, dtype=torch.int64),
        torch.tensor(head_sizes, dtype=torch.int64),
        torch.tensor(offsets, dtype=torch.int64),
    )
    expected = reference.ngram_ids(input_ids, qsl_t, context, *consts, eos, per)

    ids_laid = draw_layout_1d(draw, input_ids, "input_ids")
    qsl_laid = draw_layout_1d(draw, qsl_t, "query_start_loc")
    ctx_laid = draw_layout_2d(draw, context, "ngram_context", any_strides=True)
    as_row = draw(st.booleans(), label="input_ids as [1, T]") and ids_laid.kind == "contiguous"
    ids_base, ids_dev = ids_laid.on(device)
    qsl_base, qsl_dev = qsl_laid.on(device)
    ctx_base, ctx_dev = ctx_laid.on(device)
    out_laid = out_base = out_dev = None
    if out_kind != "none":
        out_dtype = torch.int32 if out_kind == "int32" else torch.int64
        out_laid = draw_layout_2d(
            draw, torch.full((num_tokens, nh), -7, dtype=out_dtype), "output", any_strides=True
        )
        out_base, out_dev = out_laid.on(device)
    got = ops.ngram_ids(
        ids_dev.reshape(1, -1) if as_row else ids_dev,
        qsl_dev,
        ctx_dev,
        *(c.to(device) for c in consts),
        eos,
        per,
        output=out_dev,
    )
    if out_laid is None:
        assert got.dtype == torch.int64
        assert_exact(got, expected, "ngram_ids", bitwise=True)
    else:
        assert got.data_ptr() == out_dev.data_ptr()
        assert_exact(got, expected.to(out_dev.dtype), "ngram_ids", bitwise=True)
        assert_outside_untouched(out_laid, out_base, "ngram_ids output buffer")
    for laid, base, name in (
        (ids_laid, ids_base, "input_ids"),
        (qsl_laid, qsl_base, "query_start_loc"),
        (ctx_laid, ctx_base, "ngram_context"),
    ):
        assert_unchanged(laid, base, name)


@pytest.mark.parametrize(("backend", "isa"), hash_cases(BACKENDS))  # the CPU in every hash width
def test_fuzz_ngram_ids(backend, isa, record_property):
    with cpu_ngram_hash(isa):
        fuzz(f"ngram_ids on {backend}", lambda draw: ngram_body(backend, draw), record_property)
