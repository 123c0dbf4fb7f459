"""gather_rows past 2^31 and 2^32 elements (issue #48): tables, ids and outputs whose elements lie
across and past those marks of their storage, in sparse files (tests/large_offsets_support.py),
on the CPU kernel (both paths) and the HIP kernels on the SIMT emulator (the vector and the
scalar kernel), against the oracle on a small copy of the rows read. vLLM 0.34 fixed the same
bug in its Triton kernels: program ids and offsets computed in int32."""

from __future__ import annotations

import pytest
import torch

from large_offsets_support import (
    FORMATS,
    TOKEN_ROW_STRIDE,
    TOKEN_ROWS,
    WIDTHS,
    gather_cases,
    gather_oracle,
    gather_path,
    large_table,
    rows_at_marks,
    run_leaving_nothing,
    seed,
    token_rows,
)
from qwen4exp_ext.testing import assert_exact

NUM_HEADS = 4


def check_gather(files, backend, table_format):
    for kind in WIDTHS:
        check_gather_kind(files, backend, table_format, kind)


def check_gather_kind(files, backend, table_format, kind):
    gen = torch.Generator().manual_seed(seed(table_format, kind))
    large = large_table(files, table_format, kind)
    written = rows_at_marks(large.row_stride, large.rows)
    large.fill(written, gen)
    for id_dtype, vocab_start in ((torch.int32, 1000), (torch.int64, 2**33 + 7)):
        vocab_end = vocab_start + large.rows
        # Every row written (global ids), then ids this shard does not own, to T·NH.
        wanted = [vocab_start + r for r in written]
        flat = ((wanted + [-1, vocab_start - 1, vocab_end]) * 4)[: TOKEN_ROWS * NUM_HEADS]
        assert set(wanted) <= set(flat)
        ids_small = torch.tensor(flat)[torch.randperm(len(flat), generator=gen)]
        ids_small = ids_small.reshape(TOKEN_ROWS, NUM_HEADS)
        # The ids too past 2^31 elements of their storage.
        ids = files.tensor(id_dtype, (TOKEN_ROWS, NUM_HEADS), (TOKEN_ROW_STRIDE, 1))
        ids.copy_(ids_small)
        kwargs = {
            "scale": large.scale,
            "block_scales": large.block_scales,
            "vocab_start": vocab_start,
            "vocab_end": vocab_end,
        }
        for out_dtype in large.out_dtypes:
            expected = gather_oracle(large, ids_small, vocab_start, vocab_end, out_dtype)
            output = token_rows(files, out_dtype, NUM_HEADS * large.width)
            output.fill_(float("nan"))  # a row not written shows
            got = backend.ops.gather_rows(large.table, ids, output=output, **kwargs)
            assert got is output
            assert_exact(output.clone(), expected, f"{kind} output= {out_dtype}", bitwise=True)
            fresh = backend.ops.gather_rows(
                large.table, ids_small.to(id_dtype), out_dtype=out_dtype, **kwargs
            )
            assert_exact(fresh, expected, f"{kind} new {out_dtype} output", bitwise=True)


@pytest.mark.parametrize(("backend", "path"), gather_cases())
@pytest.mark.parametrize("table_format", FORMATS)
def test_rows_and_outputs_past_2_31_and_2_32_elements(tmp_path, backend, path, table_format):
    """Rows of a table of more than 2^32 elements around and past 2^31 and 2^32 (every format,
    NVFP4's block scales interleaved as in a table file, so that they are past the marks too;
    rows that take the HIP vector kernel and rows that take its scalar one), read for ids of both
    dtypes that lie past 2^31 elements of theirs, from a vocabulary shard (global ids past 2^33
    with int64 ids), written into an ``output=`` whose token rows straddle 2^31 and 2^32 elements
    and lie past them, and into a new output. Catches ``row * table_row_stride`` (and the block
    scales' ``row * block_scales_row_stride``), ``t * output_row_stride`` or
    ``t * ids_row_stride`` computed in 32 bits, in the HIP vector and scalar kernels and in both
    CPU paths."""
    with gather_path(path):
        run_leaving_nothing(tmp_path, check_gather, backend, table_format)
