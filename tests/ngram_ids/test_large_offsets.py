"""ngram_ids past 2^31 (issue #48). It has no table, so "past 2^31" is two things here: ids past
2^31 and 2^32 rows (heads whose offsets put them there: exact in an int64 output; an int32 output
refuses them on the CPU and gets -1 for them on a GPU), and its tensors read and written past 2^31
and 2^32 elements of their storage (views into sparse files: tests/large_offsets_support.py) —
on the CPU kernel and the HIP kernel on the SIMT emulator, against the oracle on compact copies.
vLLM 0.34 fixed the same bug in its Triton kernels: program ids and offsets computed in int32."""

from __future__ import annotations

import pytest
import torch

from conftest import backends
from large_offsets_support import TOKEN_ROW_STRIDE, TOKEN_ROWS, run_leaving_nothing
from ngram_support import cpu_ngram_hash, hash_cases
from qwen4exp_ext import reference
from qwen4exp_ext.testing import assert_exact

INT32_MAX = 2**31 - 1
BACKENDS = [b for b in backends() if b.device == "cpu"]
EOS = 7
HEADS_PER_NGRAM = 2
# Head offsets (rows): below 2^31 with ids that reach across it, below 2^31 - size, across 2^32,
# far past it. Sizes are primes; the layout's heads are as many as (N-1)·K_h, cycling these.
OFFSETS = [2**31 - 500, 2**31 - 3000, 2**32 - 700, 2**33 + 5, 2**40 + 3, 2**31 - 10]
SIZES = [1009, 1013, 1019, 1021, 1031, 1033]
# ngram_context's rows: request 1's past 2^32 elements of its storage.
CONTEXT_ROW_STRIDE = 2**32 + 16


def layer(ngram_size: int):
    """(multipliers, sizes, offsets) of a layer of N = ngram_size whose ids lie around and past
    2^31 and 2^32."""
    heads = (ngram_size - 1) * HEADS_PER_NGRAM
    gen = torch.Generator().manual_seed(ngram_size)
    multipliers = torch.randint(-(2**62), 2**62, (ngram_size,), generator=gen)
    sizes = torch.tensor([SIZES[h % len(SIZES)] for h in range(heads)])
    offsets = torch.tensor([OFFSETS[h % len(OFFSETS)] for h in range(heads)])
    return multipliers, sizes, offsets


def batch():
    """(input_ids, query_start_loc, ngram_context of the largest N): two requests of two tokens,
    with token values past 2^31 too (int64), the second request's context cut by an EOS."""
    input_ids = torch.tensor([2**33 + 1, 12, EOS, 2**31 + 9])
    qsl = torch.tensor([0, 2, TOKEN_ROWS])
    context = torch.tensor(
        [[4, 2**35, 11, 2**31 - 1, 2**40 + 5, 3, 2**31], [5, 6, 9, 10, EOS, 2**32 + 1, 8]]
    )
    return input_ids, qsl, context


def check_ids(files, backend, ngram_size):
    for output_layout in ("tokens", "heads"):
        check_ids_layout(files, backend, ngram_size, output_layout)


def check_ids_layout(files, backend, ngram_size, output_layout):
    multipliers, sizes, offsets = layer(ngram_size)
    heads = sizes.numel()
    input_ids, qsl, context = batch()
    context = context[:, -(ngram_size - 1) :]
    expected = reference.ngram_ids(
        input_ids, qsl, context, multipliers, sizes, offsets, EOS, HEADS_PER_NGRAM
    )
    assert int(expected.max()) > 2**32 and int(expected.min()) < 2**31  # both sides of the marks
    # The inputs past 2^31 and 2^32 elements of theirs: token t of input_ids at
    # t·TOKEN_ROW_STRIDE, request r's context row at r·CONTEXT_ROW_STRIDE.
    ids_view = files.tensor(torch.int64, (TOKEN_ROWS,), (TOKEN_ROW_STRIDE,))
    ids_view.copy_(input_ids)
    context_view = files.tensor(torch.int64, tuple(context.shape), (CONTEXT_ROW_STRIDE, 1))
    context_view.copy_(context)
    for out_dtype in (torch.int64, torch.int32):
        # Token rows past the marks ("tokens"), or head columns past them ("heads").
        strides = (TOKEN_ROW_STRIDE, 1) if output_layout == "tokens" else (1, TOKEN_ROW_STRIDE)
        output = files.tensor(out_dtype, (TOKEN_ROWS, heads), strides)
        output.fill_(-5)  # an id not written shows
        args = (ids_view, qsl, context_view, multipliers, sizes, offsets, EOS, HEADS_PER_NGRAM)
        if out_dtype == torch.int64:
            got = backend.ops.ngram_ids(*args, output=output)
            assert got is output
            assert_exact(output.clone(), expected, f"{output_layout}: int64 ids")
        elif not backend.reads_indices_on_device:
            first = next(h for h in range(heads) if offsets[h] + sizes[h] - 1 > INT32_MAX)
            with pytest.raises(RuntimeError, match=f"an int32 output cannot hold head {first}'s"):
                backend.ops.ngram_ids(*args, output=output)
            assert bool((output == -5).all()), "a refused call wrote ids"
        else:
            # SPEC §3: on a GPU an id past the int32 output's maximum is -1.
            backend.ops.ngram_ids(*args, output=output)
            want = torch.where(expected > INT32_MAX, -1, expected).to(torch.int32)
            assert_exact(output.clone(), want, f"{output_layout}: int32 ids (-1 past 2^31 - 1)")


@pytest.mark.parametrize(("backend", "isa"), hash_cases(BACKENDS))  # the CPU in every hash width
@pytest.mark.parametrize("ngram_size", [3, 4, 6])
def test_ids_past_2_31_and_2_32(tmp_path, backend, isa, ngram_size):
    """Ids of heads whose rows lie around and past 2^31 and 2^32 (exact in int64; an int32 output
    refused on the CPU, -1 past 2^31 - 1 on the emulator), with input_ids and ngram_context read
    from past 2^31 and 2^32 elements of their storage and ids written there, by token rows or by
    head columns. N = 3 is the released order (the HIP kernel's own window); N = 4 and 6 take the
    others. Catches the id ``residue + offset`` narrowed to 32 bits, and ``t * output_row_stride``,
    ``h * output_col_stride``, the input's ``t * stride`` and the context's ``r * row_stride``
    computed in 32 bits."""
    with cpu_ngram_hash(isa):
        run_leaving_nothing(tmp_path, check_ids, backend, ngram_size)
