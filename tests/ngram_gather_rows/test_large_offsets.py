"""ngram_gather_rows past 2^31 and 2^32 elements (issue #48): heads whose hashed rows lie around
and past those marks of a table in a sparse file (tests/large_offsets_support.py), every table
format, written into an output whose token rows straddle and pass them, on the CPU kernel (both
gather paths) and the HIP kernels on the SIMT emulator (the fused kernel, and the ids kernel then
the gather where it does not apply), against the oracle's composition on a small copy of the rows
read. vLLM 0.34 fixed the same bug in its Triton kernels: program ids and offsets in int32."""

from __future__ import annotations

import pytest
import torch

from large_offsets_support import (
    FORMATS,
    MARKS,
    TOKEN_ROW_STRIDE,
    TOKEN_ROWS,
    WIDTHS,
    gather_cases,
    gather_oracle,
    gather_path,
    large_table,
    run_leaving_nothing,
    seed,
    token_rows,
)
from ngram_support import CPU_HASH_ISAS, cpu_ngram_hash
from qwen4exp_ext import reference
from qwen4exp_ext.testing import assert_exact

EOS = 7
HEADS_PER_NGRAM = 2
VOCAB_START = 3
# The n-gram order per HIP gather kernel: the released N = 3 takes the fused kernel (rows in
# 16-byte pieces, not NVFP4); N = 4 takes the ids kernel, then the gather, through an ids buffer.
NGRAM_SIZE = {"vector": 3, "scalar": 4}


def head_windows(rows: int, row_stride: int, heads: int) -> tuple[list[int], list[int]]:
    """(local offsets, sizes) of ``heads`` heads whose rows straddle the row of each mark and
    end at the table's last row, cycling."""
    at = [mark // row_stride for mark in MARKS]
    windows = [(at[0] - 6, 13), (at[1] - 5, 11), (rows - 13, 13), (at[0] - 2, 7), (at[1], 9)]
    picked = [windows[h % len(windows)] for h in range(heads)]
    return [w[0] for w in picked], [w[1] for w in picked]


def check_ngram_gather(files, backend, table_format):
    for kind in WIDTHS:
        check_ngram_gather_kind(files, backend, table_format, kind)


def check_ngram_gather_kind(files, backend, table_format, kind):
    gen = torch.Generator().manual_seed(seed(table_format, kind))
    ngram_size = NGRAM_SIZE[kind]
    large = large_table(files, table_format, kind)
    heads = (ngram_size - 1) * HEADS_PER_NGRAM
    local, sizes = head_windows(large.rows, large.row_stride, heads)
    large.fill(sorted({r for o, s in zip(local, sizes, strict=True) for r in range(o, o + s)}), gen)
    multipliers = torch.randint(-(2**62), 2**62, (ngram_size,), generator=gen)
    sizes = torch.tensor(sizes)
    offsets = torch.tensor(local) + VOCAB_START
    # A shard that stops 4 rows short of the table: the last head's window is partly another's.
    vocab_end = VOCAB_START + large.rows - 4
    input_ids = torch.tensor([2**33 + 1, 12, EOS, 2**31 + 9])
    qsl = torch.tensor([0, 2, TOKEN_ROWS])
    context = torch.tensor([[2**40 + 5, 3, 2**31], [EOS, 2**32 + 1, 8]])[:, 1 - ngram_size :]
    hashing = (qsl, context, multipliers, sizes, offsets, EOS, HEADS_PER_NGRAM)
    ids = reference.ngram_ids(input_ids, *hashing)
    starts = [(i - VOCAB_START) * large.row_stride for i in ids.flatten().tolist()]
    assert all(any(mark <= x < mark + 2**31 for x in starts) for mark in MARKS), "rows past both"
    # input_ids too past 2^31 elements of its storage.
    ids_view = files.tensor(torch.int64, (TOKEN_ROWS,), (TOKEN_ROW_STRIDE,))
    ids_view.copy_(input_ids)
    for out_dtype in large.out_dtypes:
        expected = gather_oracle(large, ids, VOCAB_START, vocab_end, out_dtype)
        output = token_rows(files, out_dtype, heads * large.width)
        output.fill_(float("nan"))  # a row not written shows
        got = backend.ops.ngram_gather_rows(
            ids_view,
            *hashing,
            large.table,
            scale=large.scale,
            block_scales=large.block_scales,
            vocab_start=VOCAB_START,
            vocab_end=vocab_end,
            output=output,
        )
        assert got is output
        assert_exact(output.clone(), expected, f"{kind} N={ngram_size} {out_dtype}", bitwise=True)


def hash_gather_cases() -> list:
    """gather_cases(), the CPU kernel's in every hash width this CPU has too."""
    found = []
    for case in gather_cases():
        backend, path = case.values
        for isa in CPU_HASH_ISAS if backend.name == "cpu" else [None]:
            name = case.id if isa is None else f"{case.id}-{isa}"
            found.append(pytest.param(backend, path, isa, id=name))
    return found


@pytest.mark.parametrize(("backend", "path", "isa"), hash_gather_cases())
@pytest.mark.parametrize("table_format", FORMATS)
def test_hashed_rows_and_outputs_past_2_31_and_2_32_elements(
    tmp_path, backend, path, isa, table_format
):
    """Each head's rows straddle the row that holds element 2^31 or 2^32 of a table of more than
    2^32 elements, or end at its last row (every format; NVFP4's block scales interleaved as in a
    table file), read from a vocabulary shard and written into an ``output=`` whose token rows
    straddle 2^31 and 2^32 elements and lie past them, input_ids read from past them. Catches
    ``row * table_row_stride`` and ``t * output_row_stride`` computed in 32 bits in the fused
    kernel, the ids kernel plus gather, and the CPU kernel."""
    with gather_path(path), cpu_ngram_hash(isa):
        run_leaving_nothing(tmp_path, check_ngram_gather, backend, table_format)
