"""The oracle's own tests of gather_rows (SPEC §4): reference.gather_rows against SPEC's text
read element by element, and its errors. CPU only; every case is seeded."""

from __future__ import annotations

import pytest
import torch

from qwen4exp_ext import reference as ref
from qwen4exp_ext.testing import assert_exact

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
