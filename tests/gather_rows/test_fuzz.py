"""gather_rows' fuzzing against the oracle (SPEC §9.8), bit-exact as test_kernel.py, with the
time-bounded kit of tests/fuzz_support.py (what is drawn, the budget, how to replay a failure).

Findings: reference.gather_rows failed on an empty table and ops.gather_rows on ids that are not
2-D when NH·d == 0 (both fixed; their regression tests are below).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from fuzz_support import (
    BACKENDS,
    FLOATS,
    FP8,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    Recorder,
    assert_outside_untouched,
    assert_unchanged,
    draw_layout_2d,
    dtype_range,
    fuzz,
    generator,
    sizes,
)

# make_table: every finite fp8 byte, wide-range other values; CPU_PATHS: cached and streaming.
from gather_support import CPU_PATHS, cpu_gather_path, make_table
from qwen4exp_ext import ops, reference
from qwen4exp_ext.testing import assert_exact


def gather_body(backend, draw: Recorder) -> None:
    ops, device = backend.ops, backend.device
    table_dtype = draw(st.sampled_from([*FLOATS, *FP8]), label="table dtype")
    rows = draw(sizes([0, 1, 2, 3, 5, 7, 31, 97], 0, 300), label="rows")
    width = draw(sizes([0, 1, 2, 3, 7, 16, 24, 31, 160, 700], 1, 48), label="d")
    num_tokens = draw(sizes([0, 1, 2, 3, 5, 13], 0, 40), label="T")
    num_heads = draw(sizes([0, 1, 2, 3, 16], 1, 12), label="NH")
    id_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="ids dtype")
    lead = draw(st.sampled_from(["[T, NH]", "[NH]", "[a, T, NH]"]), label="ids shape")
    shard = draw(st.sampled_from(["none", "start", "range", "empty"]), label="shard")
    start = 0
    if shard != "none":
        start = draw(sizes([0, 1, rows, 2**31 - 5, 2**40], 0, 500), label="vocab_start")
    end = None
    if shard == "range":
        end = start + draw(st.integers(0, rows), label="shard rows")
    elif shard == "empty":
        end = start
    out_dtype = draw(st.sampled_from([None, *FLOATS]), label="out_dtype")
    special_rate = draw(st.sampled_from([0.0, 0.1, 0.5]), label="out-of-range id rate")
    gen = generator(draw)

    table = make_table(rows, width, table_dtype, gen=gen)
    scale = scale_arg = None
    if table_dtype in FP8:
        value = draw(
            st.one_of(
                st.sampled_from([1.0, -0.5, 3.0e-5, 700.0, 1.0e30, 0.0, -0.0, 2.0**-24, 6.0e-8]),
                st.floats(-1.0e4, 1.0e4, allow_nan=False, width=32),
            ),
            label="scale",
        )
        scale_kind = draw(st.sampled_from(["[1]", "[]", "float"]), label="scale as")
        scale = torch.tensor([value], dtype=torch.float32)
        scale_arg = {"[1]": scale, "[]": scale.reshape(()), "float": value}[scale_kind]

    # Ids around this shard's range, plus values just outside it and far away.
    span = (end if end is not None else start + rows) - start
    low, high = dtype_range(id_dtype)
    ids = start + torch.randint(-2, span + 3, (num_tokens, num_heads), generator=gen)
    specials = [-1, start - 1, start, start + span - 1, start + span, start + span + 1]
    specials += [INT32_MIN, INT32_MAX, 0, rows, 2**40, INT64_MIN, INT64_MAX]
    picks = torch.tensor(specials)[
        torch.randint(0, len(specials), (num_tokens, num_heads), generator=gen)
    ]
    ids = torch.where(torch.rand(num_tokens, num_heads, generator=gen) < special_rate, picks, ids)
    ids = ids.clamp(low, high).to(id_dtype)
    expected = reference.gather_rows(
        table, ids, scale=scale, vocab_start=start, vocab_end=end, out_dtype=out_dtype
    )

    table_laid = draw_layout_2d(draw, table, "table", any_strides=False)
    ids_laid = draw_layout_2d(draw, ids, "ids", any_strides=True)
    table_base, table_dev = table_laid.on(device)
    ids_base, ids_dev = ids_laid.on(device)
    call_ids = ids_dev
    if lead == "[NH]" and num_tokens == 1:
        call_ids = ids_dev[0]
    elif lead == "[a, T, NH]" and num_tokens % 2 == 0:
        call_ids = ids_dev.reshape(2, num_tokens // 2, num_heads)
    resolved = out_dtype or (torch.bfloat16 if table_dtype in FP8 else table_dtype)
    out_laid = out_base = out_dev = None
    if call_ids.dim() == 2 and draw(st.booleans(), label="output= given"):
        out_laid = draw_layout_2d(
            draw,
            torch.zeros(num_tokens, num_heads * width, dtype=resolved),
            "output",
            any_strides=False,
        )
        out_base, out_dev = out_laid.on(device)
    cpu_path = draw(st.sampled_from(CPU_PATHS), label="CPU gather path")
    # The HIP kernels' grid cap (none on the CPU): every cap gives the same output.
    max_blocks = draw(st.sampled_from([0, 0, 1, 2, 3]), label="max_blocks")
    with cpu_gather_path(cpu_path):
        got = ops.gather_rows(
            table_dev,
            call_ids,
            scale=scale_arg.to(device) if isinstance(scale_arg, torch.Tensor) else scale_arg,
            vocab_start=start,
            vocab_end=end,
            out_dtype=out_dtype,
            output=out_dev,
            max_blocks=max_blocks,
        )
    assert got.shape == (*call_ids.shape[:-1], num_heads * width)
    assert_exact(got.reshape(expected.shape), expected, "gather_rows", bitwise=True)
    if out_laid is not None:
        assert got.data_ptr() == out_dev.data_ptr()
        assert_outside_untouched(out_laid, out_base, "gather_rows output buffer")
    assert_unchanged(table_laid, table_base, "table")
    assert_unchanged(ids_laid, ids_base, "ids")


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_fuzz_gather_rows(backend, record_property):
    fuzz(f"gather_rows on {backend}", lambda draw: gather_body(backend, draw), record_property)


@pytest.mark.parametrize("ids_shape,width", [((2, 3, 0), 4), ((0,), 4), ((3,), 0), ((2, 3, 1), 0)])
def test_gather_rows_door_empty_rows(ids_shape, width):
    table = torch.zeros(5, width)
    ids = torch.zeros(ids_shape, dtype=torch.int64)
    expected = reference.gather_rows(table, ids)
    assert_exact(ops.gather_rows(table, ids), expected, "gather_rows", bitwise=True)


def test_reference_gather_rows_empty_table():
    expected = torch.zeros(1, 4)
    assert_exact(
        ops.gather_rows(torch.empty(0, 4), torch.tensor([[2]])), expected, "ops", bitwise=True
    )
    assert_exact(
        reference.gather_rows(torch.empty(0, 4), torch.tensor([[2]])),
        expected,
        "reference",
        bitwise=True,
    )
