"""ngram_ids' bad-input cases (run by test_bad_inputs.py, on the CPU backends and, for DATA_ONLY,
with debug checks on the backends that read indices on the device; tests/ngram_gather_rows/
derives its own from them, and tests/test_cuda_graphs.py captures the baseline).

OPS: the valid baseline (output filled with a sentinel pattern), the runner that calls a backend's
`kernels` with it, the tensors it writes. CASES: each overrides one argument of the baseline, with
the error it must give. DATA_ONLY (DATA_CASES): bad values that only the index data shows.
"""

from __future__ import annotations

import torch

from bad_inputs_support import F32, I32, INT64_MAX, meta, noncontig, p, put, sentinel, set_
from ngram_support import HEADS
from qwen4exp_ext import layout, ops

NGRAM_HEADS = HEADS  # 4 heads = (N-1)=2 x heads_per_ngram=2


def ngram_baseline() -> dict:
    return dict(
        input_ids=torch.tensor([9, 5, 3, 11, 40, 5, 96, 0, 1]),
        query_start_loc=torch.tensor([0, 4, 9], dtype=torch.int32),
        ngram_context=torch.tensor([[5, 5], [17, 23]]),
        layer_multipliers=torch.tensor(layout.layer_multipliers(97, 3, 7, 1)),
        ngram_heads_vocab_sizes=torch.tensor(NGRAM_HEADS.sizes),
        ngram_heads_offsets=torch.tensor(NGRAM_HEADS.offsets),
        eos_token_id=5,
        heads_per_ngram=2,
        output=sentinel((9, 4), torch.int64),
    )


def head_divmod() -> torch.Tensor:
    """The baseline layout's fast-modulo constants (ngram_ids' head_divmod)."""
    return ops.ngram_head_divmod(torch.tensor(NGRAM_HEADS.sizes))


# Calls ngram_ids of `kernels` (qwen4exp_ext.ops, or a backend's ops) with the arguments.
def run_ngram(a, kernels=ops):
    kernels.ngram_ids(**a)
    return {"output": a["output"]}


OPS = {"ngram_ids": (ngram_baseline, run_ngram, ("output",))}

# The exceptions that the kernel tests' own error checks allowed (merged into these cases, each
# with the stricter of the two messages).
CLEAR = (RuntimeError, ValueError)

CASES = [
    p(
        "ngram_ids",
        "input_ids-float",
        set_("input_ids", lambda t: t.float()),
        "input_ids must be int32 or int64",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "qsl-float",
        set_("query_start_loc", lambda t: t.float()),
        "query_start_loc must be int32 or int64",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "qsl-2d",
        set_("query_start_loc", lambda t: t.view(1, 3)),
        "query_start_loc must be 1-D",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "context-float",
        set_("ngram_context", lambda t: t.double()),
        "ngram_context must be int32 or int64",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "context-1d",
        set_("ngram_context", lambda t: t.reshape(-1)),
        "ngram_context must be 2-D",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "context-rows",
        set_("ngram_context", lambda t: t[:1]),
        "ngram_context has 1 rows",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "multipliers-int32",
        set_("layer_multipliers", lambda t: t.to(I32)),
        "layer_multipliers must be int64",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "multipliers-len",
        set_("layer_multipliers", lambda t: t[:2]),
        "layer_multipliers must be int64",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "multipliers-noncontig",
        set_("layer_multipliers", noncontig),
        "layer_multipliers",
    ),
    p(
        "ngram_ids",
        "sizes-len",
        set_("ngram_heads_vocab_sizes", lambda t: t[:3]),
        "ngram_heads_vocab_sizes must be int64",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "sizes-zero",
        set_("ngram_heads_vocab_sizes", lambda t: t.clone().index_fill_(0, torch.tensor([2]), 0)),
        r"ngram_heads_vocab_sizes\[2\] must be positive",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "sizes-negative",
        set_("ngram_heads_vocab_sizes", lambda t: t.clone().index_fill_(0, torch.tensor([0]), -7)),
        "ngram_heads_vocab_sizes",
    ),
    p(
        "ngram_ids",
        "offsets-float",
        set_("ngram_heads_offsets", lambda t: t.float()),
        "ngram_heads_offsets must be int64",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "offsets-negative",
        set_("ngram_heads_offsets", lambda t: t - 10_000),
        r"ngram_heads_offsets\[0\] must be non-negative",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "heads_per_ngram-0",
        put("heads_per_ngram", 0),
        "heads_per_ngram must be >= 1",
        CLEAR,
    ),
    p("ngram_ids", "heads_per_ngram-negative", put("heads_per_ngram", -1), "heads_per_ngram"),
    p(
        "ngram_ids",
        "context-too-many-cols",
        put("ngram_context", lambda: torch.zeros(2, 8, dtype=torch.long)),
        "ngram_context",
    ),
    p(
        "ngram_ids",
        "context-no-cols",
        put("ngram_context", lambda: torch.zeros(2, 0, dtype=torch.long)),
        "ngram_context",
    ),
    p(
        "ngram_ids",
        "qsl-empty",
        put("query_start_loc", lambda: torch.zeros(0, dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ngram_ids",
        "offsets-overflow-int64",
        set_("ngram_heads_offsets", lambda t: t + (INT64_MAX - 100)),
        "ngram_heads_offsets",
    ),
    p(
        "ngram_ids",
        "output-int32-too-small",
        lambda a: a.update(
            output=sentinel((9, 4), I32), ngram_heads_offsets=a["ngram_heads_offsets"] + 2**31
        ),
        "int32 output cannot hold",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "qsl-start-1",
        put("query_start_loc", lambda: torch.tensor([1, 4, 9], dtype=I32)),
        r"query_start_loc\[0\] must be 0",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "qsl-decreasing",
        put("query_start_loc", lambda: torch.tensor([0, 6, 4], dtype=I32)),
        "query_start_loc must be non-decreasing",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "qsl-past-T",
        put("query_start_loc", lambda: torch.tensor([0, 4, 10], dtype=I32)),
        r"query_start_loc\[R\] = 10 is past the 9 tokens",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "output-shape",
        put("output", lambda: sentinel((9, 5), torch.int64)),
        r"output must be \[T, NH\]",
        CLEAR,
    ),
    p(
        "ngram_ids",
        "output-float",
        put("output", lambda: sentinel((9, 4), F32)),
        "output must be int64 or int32",
        CLEAR,
    ),
    p("ngram_ids", "meta-context", set_("ngram_context", meta), "ngram_context"),
    p("ngram_ids", "meta-multipliers", set_("layer_multipliers", meta), "layer_multipliers"),
    p("ngram_ids", "meta-qsl", set_("query_start_loc", meta), "query_start_loc"),
    # The one error check of the kernel tests that no case here had.
    p(
        "ngram_ids",
        "meta-output",
        set_("output", meta),
        "output is on meta but input_ids is on cpu",
        CLEAR,
    ),
    # head_divmod (ops.ngram_head_divmod of the sizes): checked like every argument, everywhere.
    p(
        "ngram_ids",
        "divmod-int32",
        put("head_divmod", lambda: head_divmod().to(I32)),
        r"head_divmod must be int64 \[NH, 4\] = \[4, 4\]",
    ),
    p(
        "ngram_ids",
        "divmod-3-words",
        put("head_divmod", lambda: head_divmod()[:, :3].contiguous()),
        r"head_divmod must be int64 \[NH, 4\]",
    ),
    p(
        "ngram_ids",
        "divmod-too-few-heads",
        put("head_divmod", lambda: head_divmod()[:3]),
        r"head_divmod must be int64 \[NH, 4\]",
    ),
    p(
        "ngram_ids",
        "divmod-1d",
        put("head_divmod", lambda: head_divmod().reshape(-1)),
        r"head_divmod must be int64 \[NH, 4\]",
    ),
    p(
        "ngram_ids",
        "divmod-noncontig",
        put("head_divmod", lambda: noncontig(head_divmod())),
        "head_divmod must be contiguous",
    ),
    p(
        "ngram_ids",
        "divmod-transposed",
        put("head_divmod", lambda: head_divmod().t().contiguous().t()),
        "head_divmod must be contiguous",
    ),
    p(
        "ngram_ids",
        "divmod-misaligned",
        put(
            "head_divmod",
            lambda: torch.cat([torch.zeros(1, dtype=torch.int64), head_divmod().reshape(-1)])[
                1:
            ].view(4, 4),
        ),
        "head_divmod must be 16-byte aligned",
    ),
    p(
        "ngram_ids",
        "meta-divmod",
        put("head_divmod", lambda: meta(head_divmod())),
        "head_divmod is on meta but input_ids is on cpu",
    ),
]

# Index values that only the data shows: errors on the CPU, which reads them for free; on the GPU
# (and the SIMT emulator) only with debug checks (test_bad_inputs.py).
DATA_ONLY = {
    "ngram_ids-output-int32-too-small",
    "ngram_ids-sizes-zero",
    "ngram_ids-sizes-negative",
    "ngram_ids-offsets-negative",
    "ngram_ids-offsets-overflow-int64",
    "ngram_ids-qsl-start-1",
    "ngram_ids-qsl-decreasing",
    "ngram_ids-qsl-past-T",
}
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
