"""gather_rows' bad inputs: each case of bad_inputs.py raises the error that names the offending
argument and leaves the output bit-identical (on the CPU kernel and the SIMT emulator's HIP
kernels, with the CPU tensors of the table); the op's own argument checks called directly
(torch.ops.qwen4exp.gather_rows) and the Python door's; and data that is never an error: ids
outside the table or the shard give zero rows."""

from __future__ import annotations

import pytest
import torch

from bad_inputs_support import (
    INT64_MAX,
    INT64_MIN,
    table_tests,
)
from qwen4exp_ext import ops

from . import bad_inputs
from .support import cpu_path  # noqa: F401 - the fixture

# The tests every op's table gets (tests/bad_inputs_support.py).
(
    test_bad_input_raises_and_writes_nothing,
    test_baselines_are_valid,
    test_debug_checks_pass_valid_inputs,
) = table_tests(bad_inputs)


# ---- the op's own checks, called directly, and the Python door's ------------------------------
# Each error of torch.ops.qwen4exp.gather_rows that a case of bad_inputs.py also reaches through
# the door (same argument, same mistake, the op's own error raised again) is checked there, with
# this message in full; what is left here the door checks itself first, or no case covers.


def op(table, ids, scale, start, end, output):
    torch.ops.qwen4exp.gather_rows.default(table, ids, scale, None, start, end, output)


TABLE = torch.zeros(10, 4, dtype=torch.bfloat16)
IDS = torch.zeros(3, 2, dtype=torch.long)
OUT = torch.zeros(3, 8, dtype=torch.bfloat16)
SCALE = torch.tensor([1.0])
TABLE8 = torch.zeros(10, 4, dtype=torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.usefixtures("cpu_path")
@pytest.mark.parametrize(
    "args,message",
    [
        ((TABLE[0], IDS, None, 0, 10, OUT), "table must be 2-D"),
        ((TABLE, IDS[0], None, 0, 10, OUT), "ids must be 2-D"),
        ((TABLE, IDS, None, 0, 10, OUT[:, :4]), r"output must be \[T, NH·d\] = \[3, 8\]"),
        (
            (TABLE, IDS, None, 0, 10, OUT.view(torch.float8_e4m3fn)[:, :8]),
            "output must be float32, bfloat16 or float16",
        ),
        ((TABLE, IDS, None, -1, 5, OUT), r"shard \[vocab_start, vocab_end\)"),
        ((TABLE, IDS, None, 2**63 - 5, None, OUT), r"the default vocab_end\) must fit in int64"),
    ],
)
def test_bad_arguments_name_the_argument(args, message):
    with pytest.raises(RuntimeError, match=message):
        op(*args)


@pytest.mark.usefixtures("cpu_path")
def test_python_door_errors():
    with pytest.raises(ValueError, match="table must be 2-D"):
        ops.gather_rows(TABLE[0], IDS)
    with pytest.raises(ValueError, match="output is torch.bfloat16 but out_dtype is"):
        ops.gather_rows(TABLE, IDS, out_dtype=torch.float32, output=OUT)
    with pytest.raises(ValueError, match=r"output must be \[3, 8\]"):
        ops.gather_rows(TABLE, IDS, output=OUT[:2])
    with pytest.raises(ValueError, match="table must be 2-D"):
        ops.gather_rows(TABLE[0, 0], IDS, output=OUT)
    # What the door does not check itself is the op's error, raised as it is.
    with pytest.raises(RuntimeError, match="an fp8 table needs its per-tensor scale"):
        ops.gather_rows(TABLE8, IDS, output=OUT)
    with pytest.raises(RuntimeError, match="ids must be int32 or int64"):
        ops.gather_rows(TABLE, IDS.float(), output=OUT)


# ---- data, never errors ----------------------------------------------------------------------


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
def test_gather_ids_outside_table_give_zero_rows(ids_dtype):
    table = torch.randn(10, 6, generator=torch.Generator().manual_seed(4))
    lo, hi = (-(2**31), 2**31 - 1) if ids_dtype == torch.int32 else (INT64_MIN, INT64_MAX)
    ids = torch.tensor([[lo, 10, 3], [-1, hi, 11]], dtype=ids_dtype)
    out = ops.gather_rows(table, ids)
    rows = out.view(2, 3, 6)
    assert torch.equal(rows[0, 2], table[3])
    zero = torch.zeros(6)
    for t, h in [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]:
        assert torch.equal(rows[t, h], zero)


def test_gather_ids_outside_shard_give_zero_rows():
    table = torch.randn(10, 6, generator=torch.Generator().manual_seed(5))
    # This shard owns global ids [100, 108): table rows 0..7; rows 8, 9 are never read.
    ids = torch.tensor([[99, 100, 107, 108], [0, 9, 105, INT64_MAX]])
    out = ops.gather_rows(table, ids, vocab_start=100, vocab_end=108).view(2, 4, 6)
    assert torch.equal(out[0, 1], table[0])
    assert torch.equal(out[0, 2], table[7])
    assert torch.equal(out[1, 2], table[5])
    zero = torch.zeros(6)
    for t, h in [(0, 0), (0, 3), (1, 0), (1, 1), (1, 3)]:
        assert torch.equal(out[t, h], zero)
