"""gather_rows' bad-input cases (run by test_bad_inputs.py, and by tests/test_cuda_graphs.py's
replays): OPS, one valid baseline per variant (outputs filled with a sentinel pattern), the runner
that calls the op of a backend's ``kernels`` and the names of the tensors it writes; CASES, each
overriding one argument of a baseline, with the error it must raise. gather_rows has no data-only
case: every id value is data (a zero row), never an error."""

from __future__ import annotations

import torch

from bad_inputs_support import F16, F32, FP8, I32, META, meta, noncontig, p, put, sentinel, set_
from qwen4exp_ext import ops


def gather_baseline() -> dict:
    return dict(
        table=torch.randn(10, 6, generator=torch.Generator().manual_seed(0)),
        ids=torch.tensor([[0, 3, 9, 1], [2, 2, 5, 7], [8, 4, 6, 0]]),
        output=sentinel((3, 24), torch.float32),
    )


def gather_nvfp4_baseline() -> dict:
    g = torch.Generator().manual_seed(4)
    return dict(
        table=torch.randint(0, 256, (10, 16), dtype=torch.uint8, generator=g),  # d = 32
        ids=torch.tensor([[0, 3, 9, 1], [2, 2, 5, 7], [8, 4, 6, 0]]),
        scale=torch.tensor([0.5]),
        block_scales=torch.rand(10, 2, generator=g).to(torch.float8_e4m3fn),
        output=sentinel((3, 4 * 32), torch.bfloat16),
    )


# Calls gather_rows of `kernels` (qwen4exp_ext.ops, or a backend's ops) with the arguments.
def run_gather(a, kernels=ops):
    kernels.gather_rows(a.pop("table"), a.pop("ids"), **a)


OPS = {
    "gather_rows": (gather_baseline, run_gather, ("output",)),
    "gather_rows_nvfp4": (gather_nvfp4_baseline, run_gather, ("output",)),
}

CASES = [
    # ---- gather_rows ----
    # The messages and exception types of the ops' argument errors that
    # test_bad_arguments_name_the_argument (torch.ops.qwen4exp.gather_rows itself) also checked
    # are given here in full: the door raises the op's own error.
    p(
        "gather_rows",
        "table-int",
        set_("table", lambda t: t.to(I32)),
        "table must be float32, bfloat16",
        RuntimeError,
    ),
    p("gather_rows", "table-1d", set_("table", lambda t: t.reshape(-1)), "table"),
    p(
        "gather_rows",
        "table-noncontig",
        set_("table", noncontig),
        "table rows must be contiguous",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "ids-float",
        set_("ids", lambda t: t.float()),
        "ids must be int32 or int64",
        RuntimeError,
    ),
    p("gather_rows", "ids-0d", put("ids", lambda: torch.tensor(3)), "ids"),
    p("gather_rows", "output-shape", put("output", lambda: sentinel((3, 23), F32)), "output"),
    p(
        "gather_rows",
        "output-int",
        put("output", lambda: sentinel((3, 24), I32)),
        "output must be float32, bfloat16 or float16",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "output-noncontig",
        set_("output", noncontig),
        "output rows must be contiguous",
        RuntimeError,
    ),
    p("gather_rows", "out_dtype-mismatch", put("out_dtype", F16), "out_dtype"),
    p(
        "gather_rows",
        "fp8-table-no-scale",
        set_("table", lambda t: t.to(FP8)),
        "an fp8 table needs its per-tensor scale",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "fp8-scale-f64",
        lambda a: a.update(table=a["table"].to(FP8), scale=torch.ones(1, dtype=torch.float64)),
        "scale must be one float32 element",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "fp8-scale-2-elems",
        lambda a: a.update(table=a["table"].to(FP8), scale=torch.ones(2)),
        "scale must be one float32 element",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "meta-scale",
        lambda a: a.update(table=a["table"].to(FP8), scale=torch.ones(1, device=META)),
        "scale",
    ),
    p(
        "gather_rows",
        "meta-output",
        set_("output", meta),
        "output is on meta but table is on cpu",
        RuntimeError,
    ),
    p("gather_rows", "meta-table", set_("table", meta), "table"),
    p(
        "gather_rows",
        "scale-non-fp8",
        put("scale", 2.0),
        "scale is only defined for fp8 and NVFP4 tables",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "vocab_start-negative",
        put("vocab_start", -1),
        r"shard \[vocab_start, vocab_end\) = \[-1, 9\)",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "vocab_end-too-far",
        put("vocab_end", 11),
        r"shard \[vocab_start, vocab_end\) = \[0, 11\)",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "vocab_end-before-start",
        put("vocab_end", -3),
        r"shard \[vocab_start, vocab_end\) = \[0, -3\)",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "meta-ids",
        set_("ids", meta),
        "ids is on meta but table is on cpu",
        RuntimeError,
    ),
    p(
        "gather_rows",
        "block_scales-non-nvfp4",
        put("block_scales", lambda: torch.ones(10, 1)),
        "block_scales",
    ),
    p(
        "gather_rows",
        "max_blocks-negative",
        put("max_blocks", -1),
        r"gather_rows: max_blocks must be >= 0 \(0: no cap\), got -1",
    ),
    # ---- gather_rows, NVFP4 tables ----
    p("gather_rows_nvfp4", "no-block_scales", put("block_scales", None), "block_scales"),
    p("gather_rows_nvfp4", "no-scale", put("scale", None), "scale"),
    p(
        "gather_rows_nvfp4",
        "block_scales-bf16",
        set_("block_scales", lambda t: t.to(torch.bfloat16)),
        "block_scales",
    ),
    p(
        "gather_rows_nvfp4",
        "block_scales-e4m3fnuz",
        set_("block_scales", lambda t: t.view(torch.float8_e4m3fnuz)),
        "block_scales",
    ),
    p(
        "gather_rows_nvfp4",
        "block_scales-width",
        put("block_scales", lambda: torch.ones(10, 3).to(torch.float8_e4m3fn)),
        "block_scales",
    ),
    p(
        "gather_rows_nvfp4",
        "block_scales-rows",
        put("block_scales", lambda: torch.ones(9, 2).to(torch.float8_e4m3fn)),
        "block_scales",
    ),
    p(
        "gather_rows_nvfp4",
        "block_scales-1d",
        set_("block_scales", lambda t: t.reshape(-1)),
        "block_scales",
    ),
    p(
        "gather_rows_nvfp4",
        "block_scales-noncontig",
        set_("block_scales", lambda t: noncontig(t.view(torch.uint8)).view(torch.float8_e4m3fn)),
        "block_scales",
    ),
    p("gather_rows_nvfp4", "meta-block_scales", set_("block_scales", meta), "block_scales"),
    p("gather_rows_nvfp4", "meta-scale", set_("scale", meta), "scale"),
    p("gather_rows_nvfp4", "scale-f16", set_("scale", lambda t: t.half()), "scale"),
    # d = 24: not a whole number of 16-element blocks (block_scales [10, 1] would fit d = 16)
    p(
        "gather_rows_nvfp4",
        "d-not-multiple-of-16",
        lambda a: a.update(
            table=a["table"][:, :12],
            block_scales=a["block_scales"][:, :1],
            output=sentinel((3, 4 * 24), torch.bfloat16),
        ),
        "packed width",
    ),
    # a packed width that is not d/2: the output is [T, NH·d] with d = 2 · packed width
    p(
        "gather_rows_nvfp4",
        "output-unpacked-width",
        put("output", lambda: sentinel((3, 4 * 16), torch.bfloat16)),
        "output",
    ),
]

# Index values that only the data shows (errors on the CPU, on the GPU only with debug checks):
# none for gather_rows.
DATA_ONLY: set[str] = set()
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
