"""ngram_ids' properties, for the oracle (reference.ngram_ids) and every kernel backend alike:
SPEC §3's golden rows and its edge layouts (T = 0, R = 0, tokens past qsl[R]), and SPEC §9.1
(chunk-split invariance), §9.2 (EOS barrier), §9.3 (ids in range) with §9.8 (equal to the
oracle)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import backends
from qwen4exp_ext.testing import assert_exact

from .support import TOY, Layout, model_layout, random_batch, random_layout, run_both

BACKENDS = backends(oracle=True)

# SPEC §3's golden rows: layer 0 of a 128-token vocabulary, N = 3, two heads per order, head
# vocabulary base 1000, seed 42, EOS 7 (TOY); tokens [9, 7, 3, 5] of one request, context [7, 7].
GOLDEN = [
    [431, 1474, 2482, 3896],
    [303, 1851, 2122, 3983],
    [799, 1184, 2346, 3957],
    [971, 1258, 2879, 3730],
]


def hashed(backend, tokens, qsl, context, lay: Layout = TOY) -> torch.Tensor:
    """backend.ops.ngram_ids of CPU tensors, on the backend's device, back on the CPU."""
    device = backend.device
    return backend.ops.ngram_ids(
        tokens.to(device), qsl.to(device), context.to(device), *lay.to(device).args()
    ).cpu()


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("out_dtype", [torch.int64, torch.int32])
def test_golden_toy_case(backend, id_dtype, out_dtype):
    """SPEC §3's golden rows, checked against transformers 5.18 by the spec's authors: the layer's
    constants, then the ids into a new int64 tensor and into an `out_dtype` output (the tensor
    returned), with query_start_loc int32 and int64."""
    assert TOY.multipliers.tolist() == [62987067181621929, 46389143539761089, 16259569841195145]
    assert TOY.sizes.tolist() == [1009, 1013, 1019, 1021]
    assert TOY.offsets.tolist() == [0, 1009, 2022, 3041]
    device = backend.device
    lay = TOY.to(device)
    tokens = torch.tensor([9, 7, 3, 5], dtype=id_dtype, device=device)
    context = torch.tensor([[7, 7]], dtype=id_dtype, device=device)
    golden = torch.tensor(GOLDEN)
    for qsl_dtype in (torch.int32, torch.int64):
        qsl = torch.tensor([0, 4], dtype=qsl_dtype, device=device)
        ids = backend.ops.ngram_ids(tokens, qsl, context, *lay.args())
        assert ids.dtype == torch.int64
        assert_exact(ids.cpu(), golden)
        out = torch.full((4, 4), -7, dtype=out_dtype, device=device)
        got = backend.ops.ngram_ids(tokens, qsl, context, *lay.args(), output=out)
        assert got is out
        assert got.cpu().tolist() == GOLDEN
        assert_exact(out.cpu(), golden.to(out_dtype))


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_edge_layouts(backend):
    """T = 0 (R = 0 and R = 1), R = 0 (every predecessor reads EOS), tokens past qsl[R], empty
    requests."""
    ops, device = backend.ops, backend.device
    lay = TOY.to(device)
    empty = ops.ngram_ids(
        torch.empty(0, dtype=torch.long, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.empty(0, 2, dtype=torch.long, device=device),
        *lay.args(),
    )
    assert empty.shape == (0, 4)
    tokens = torch.tensor([9, 7, 3, 5])
    empty_request = hashed(backend, tokens[:0], torch.tensor([0, 0]), torch.tensor([[7, 7]]))
    assert empty_request.shape == (0, 4)

    no_requests, _ = run_both(
        backend,
        torch.tensor([9, 3]),
        torch.tensor([0], dtype=torch.int32),
        torch.empty(0, 2, dtype=torch.long),
        TOY,
    )
    as_if_doc_start, _ = run_both(
        backend,
        torch.tensor([9, 3]),
        torch.tensor([0, 0, 0], dtype=torch.int32),
        torch.tensor([[1, 2], [7, 7]]),
        TOY,
    )
    # R = 0: both tokens are hashed with an all-EOS history, like each opening a document.
    assert torch.equal(no_requests[0], as_if_doc_start[0])
    single, _ = run_both(
        backend,
        torch.tensor([3]),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([[7, 7]]),
        TOY,
    )
    assert torch.equal(no_requests[1], single[0])
    # The same with the first of four tokens, against a one-token request of all-EOS context.
    none = hashed(backend, tokens, torch.zeros(1, dtype=torch.int32), torch.zeros(0, 2).long())
    fresh = hashed(backend, tokens[:1], torch.tensor([0, 1]), torch.tensor([[7, 7]]))
    assert_exact(none[0], fresh[0])

    # Tokens past qsl[R] continue the last request (as in vLLM): same ids as a longer chunk.
    tail, _ = run_both(
        backend,
        torch.tensor([4, 5, 6, 8]),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([[1, 2], [3, 4]]),
        TOY,
    )
    longer, _ = run_both(
        backend,
        torch.tensor([4, 5, 6, 8]),
        torch.tensor([0, 1, 4], dtype=torch.int32),
        torch.tensor([[1, 2], [3, 4]]),
        TOY,
    )
    assert torch.equal(tail, longer)
    # Padding tokens past qsl[R] after a one-token request: the rest as one request of three.
    padded = hashed(backend, tokens, torch.tensor([0, 1, 2]), torch.tensor([[1, 2], [7, 7]]))
    whole = hashed(backend, tokens[1:], torch.tensor([0, 3]), torch.tensor([[7, 7]]))
    assert_exact(padded[1:], whole)


def ids_for_chunks(backend, sequence, cuts, lay: Layout):
    """Ids of `sequence` fed as consecutive chunks of one request (ending at `cuts`), each with
    the N-1 tokens before it as context — the way a server streams a prompt."""
    device = backend.device
    ctx_len = lay.context_len
    history = [lay.eos] * ctx_len + list(sequence)
    pieces, start = [], 0
    dev_lay = lay.to(device)
    for stop in [*cuts, len(sequence)]:
        chunk = sequence[start:stop]
        context = history[start : start + ctx_len]
        pieces.append(
            backend.ops.ngram_ids(
                torch.tensor(chunk, dtype=torch.long, device=device),
                torch.tensor([0, len(chunk)], dtype=torch.int32, device=device),
                torch.tensor([context], dtype=torch.long, device=device),
                *dev_lay.args(),
            ).cpu()
        )
        start = stop
    return torch.cat(pieces)


tokens = st.lists(st.integers(0, 12), min_size=1, max_size=30)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@given(sequence=tokens, data=st.data())
def test_chunk_split_invariance(backend, sequence, data):
    """SPEC §9.1: whole prefill == any split into chunks (empty ones included) == one by one."""
    whole = ids_for_chunks(backend, sequence, [], TOY)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(sequence)), max_size=4)))
    assert torch.equal(ids_for_chunks(backend, sequence, cuts, TOY), whole)
    one_by_one = list(range(1, len(sequence)))
    assert torch.equal(ids_for_chunks(backend, sequence, one_by_one, TOY), whole)


# N = 4, heads_per_ngram 2, seed 1234: the oracle's EOS-barrier layer, next to the toy N = 3 one.
N4 = model_layout(128, 4, 2, 1000, 1234, 0, eos=TOY.eos)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@given(data=st.data())
def test_eos_barrier(backend, data):
    """SPEC §9.2: whatever precedes an EOS (earlier tokens, of any number and value up to 2^40,
    and the request's context) cannot change the ids of the tokens after it (the EOS token itself
    still sees its own history: being EOS does not cut it). N = 3 and N = 4."""
    lay = data.draw(st.sampled_from([TOY, N4]), label="layout (N = 3, N = 4)")
    eos, ctx_len = lay.eos, lay.context_len
    token = st.one_of(st.integers(0, 12), st.integers(0, 127))  # small vocabularies hit EOS
    before = data.draw(st.lists(token, max_size=30), label="before")
    after = data.draw(st.lists(token, max_size=30), label="after")
    other = data.draw(st.lists(st.one_of(token, st.integers(0, 2**40)), max_size=30), label="other")
    all_eos = [eos] * ctx_len
    context_a = data.draw(
        st.one_of(st.just(all_eos), st.lists(token, min_size=ctx_len, max_size=ctx_len)),
        label="context before",
    )
    context_b = data.draw(st.sampled_from([all_eos, [1, 2, 3][:ctx_len]]), label="context other")
    qsl_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="qsl dtype")

    def after_eos(earlier, context):
        sequence = earlier + [eos] + after
        qsl = torch.tensor([0, len(sequence)], dtype=qsl_dtype)
        ids = hashed(backend, torch.tensor(sequence), qsl, torch.tensor([context]), lay)
        return ids[len(earlier) + 1 :]

    assert_exact(after_eos(before, context_a), after_eos(other, context_b))


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@given(seed=st.integers(0, 2**32 - 1), ngram_size=st.integers(2, 8), per=st.integers(1, 4))
def test_ids_in_head_range_and_equal_reference(backend, seed, ngram_size, per):
    """SPEC §9.3 and §9.8, on random layouts and batches."""
    rng = random.Random(seed)
    lay = random_layout(rng, ngram_size, per)
    input_ids, qsl, context = random_batch(rng, lay, torch.int64, 2**40)
    got, expected = run_both(backend, input_ids, qsl, context, lay)
    assert torch.equal(got, expected)
    low = lay.offsets.unsqueeze(0)
    assert torch.all(got >= low) and torch.all(got < low + lay.sizes.unsqueeze(0))
