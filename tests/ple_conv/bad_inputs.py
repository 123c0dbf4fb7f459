"""ple_conv's bad-input cases (SPEC §6, §9.10), run by test_bad_inputs.py with the checks of
tests/bad_inputs_support.py: OPS (one valid baseline per variant, outputs filled with a sentinel
pattern; the runner; the tensors it writes), CASES (each overrides one argument of a baseline,
with the error message it must give), DATA_ONLY (the cases whose bad values only the index data
shows: errors on the CPU and, on the GPU and the SIMT emulator, only with debug checks).

The cases that the kernel tests' own error table also had (merged here) carry its stricter
message and exception types (RAISES)."""

from __future__ import annotations

import torch

from bad_inputs_support import F16, F32, I32, META, meta, noncontig, p, put, sentinel, set_
from qwen4exp_ext import ops

# What ple_conv's argument checks raise (the generic table's EXC also allows TypeError and
# IndexError).
RAISES = (RuntimeError, ValueError)


def _conv_baseline(tokens: int, seed: int, mode: str, **extra) -> dict:
    """ple_conv of `tokens` rows of 4 channels, K = 3, on slots 1 and 2 of 4 (width 2)."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        inputs=torch.randn(tokens, 4, generator=g),
        residual=sentinel((tokens, 4), torch.float32),
        conv_state=sentinel((4, 4, 2), torch.float32) + 0.25,
        conv_weights=torch.randn(4, 3, generator=g),
        state_indices=torch.tensor([1, 2], dtype=torch.int32),
        outer_residual=None,
        mode=mode,
        dilation=1,
        **extra,
    )


def conv_decode_baseline() -> dict:
    return _conv_baseline(tokens=2, seed=2, mode="decode")


def conv_prefill_baseline() -> dict:
    return _conv_baseline(
        tokens=5,
        seed=3,
        mode="prefill",
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        has_initial_states=torch.tensor([True, False]),
    )


def run_conv(a, kernels=ops):
    pos = [
        a.pop(k)
        for k in (
            "inputs",
            "residual",
            "conv_state",
            "conv_weights",
            "state_indices",
            "outer_residual",
        )
    ]
    kernels.ple_conv(*pos, **a)


OPS = {
    "ple_conv": (conv_decode_baseline, run_conv, ("residual", "conv_state")),
    "ple_conv_prefill": (conv_prefill_baseline, run_conv, ("residual", "conv_state")),
}

CASES = [
    # ---- ple_conv (decode baseline) ----
    p(
        "ple_conv",
        "inputs-int",
        set_("inputs", lambda t: t.to(I32)),
        "inputs must be float32",
        RAISES,
    ),
    p(
        "ple_conv",
        "inputs-1d",
        set_("inputs", lambda t: t.reshape(-1)),
        "inputs must be 2-D",
        RAISES,
    ),
    p(
        "ple_conv",
        "inputs-noncontig",
        set_("inputs", noncontig),
        "inputs must have unit stride",
        RAISES,
    ),
    p(
        "ple_conv",
        "conv_weights-f64",
        set_("conv_weights", lambda t: t.double()),
        "conv_weights must be float32 or inputs' dtype",
        RAISES,
    ),
    p(
        "ple_conv",
        "conv_weights-channels",
        set_("conv_weights", lambda t: t[:3]),
        r"conv_weights must be \[C, K\]",
        RAISES,
    ),
    p("ple_conv", "kernel-size-0", put("conv_weights", lambda: torch.zeros(4, 0)), "conv_weights"),
    p(
        "ple_conv",
        "kernel-size-9",
        put("conv_weights", lambda: torch.zeros(4, 9)),
        "kernel size K must be in",
        RAISES,
    ),
    p("ple_conv", "dilation-0", put("dilation", 0), "dilation must be in", RAISES),
    p("ple_conv", "dilation-9", put("dilation", 9), "dilation must be in", RAISES),
    p("ple_conv", "dilation-negative", put("dilation", -1), "dilation"),
    p("ple_conv", "conv_state-2d", set_("conv_state", lambda t: t[:, :, 0]), "conv_state"),
    p(
        "ple_conv",
        "conv_state-narrow",
        set_("conv_state", lambda t: t[:, :, :1]),
        "conv_state must have shape",
        RAISES,
    ),
    p(
        "ple_conv",
        "conv_state-f16",
        set_("conv_state", lambda t: t.to(F16)),
        "conv_state must have inputs' dtype",
        RAISES,
    ),
    p(
        "ple_conv",
        "state_indices-float",
        set_("state_indices", torch.Tensor.float),
        "state_indices",
    ),
    p(
        "ple_conv",
        "state_indices-short",
        set_("state_indices", lambda t: t[:1]),
        "state_indices needs at least 2 entries",
        RAISES,
    ),
    p(
        "ple_conv",
        "state_indices-negative",
        put("state_indices", lambda: torch.tensor([1, -1], dtype=I32)),
        r"state_indices\[1\] = -1 is outside",
        RAISES,
    ),
    p(
        "ple_conv",
        "state_indices-eq-slots",
        put("state_indices", lambda: torch.tensor([4, 1], dtype=I32)),
        r"state_indices\[0\] = 4 is outside conv_state's 4 slots",
        RAISES,
    ),
    p(
        "ple_conv",
        "state_indices-duplicate",
        put("state_indices", lambda: torch.tensor([2, 2], dtype=I32)),
        "state_indices holds slot 2 twice",
        RAISES,
    ),
    p(
        "ple_conv",
        "token_indices-past",
        put("token_indices", lambda: torch.tensor([0, 2], dtype=I32)),
        r"token_indices\[1\] = 2 is outside the 2 rows",
        RAISES,
    ),
    p(
        "ple_conv",
        "token_indices-negative",
        put("token_indices", lambda: torch.tensor([-1, 0])),
        "token_indices",
    ),
    p(
        "ple_conv",
        "token_indices-float",
        put("token_indices", lambda: torch.tensor([0.0, 1.0])),
        "token_indices",
    ),
    p(
        "ple_conv",
        "residual-shape",
        put("residual", lambda: sentinel((2, 5), F32)),
        "residual must have inputs' shape",
        RAISES,
    ),
    p(
        "ple_conv",
        "residual-f16",
        put("residual", lambda: sentinel((2, 4), F16)),
        "residual must have inputs' dtype",
        RAISES,
    ),
    p("ple_conv", "residual-noncontig", set_("residual", noncontig), "residual"),
    p(
        "ple_conv",
        "outer_residual-shape",
        put("outer_residual", lambda: torch.zeros(3, 4)),
        "outer_residual must have inputs' shape",
        RAISES,
    ),
    p(
        "ple_conv",
        "outer_residual-f16",
        put("outer_residual", lambda: torch.zeros(2, 4, dtype=F16)),
        "outer_residual",
    ),
    p(
        "ple_conv",
        "token_indices-2d",
        put("token_indices", lambda: torch.tensor([[0, 1]])),
        "token_indices must be 1-D",
        RAISES,
    ),
    p(
        "ple_conv",
        "mode-bad",
        put("mode", "verify"),
        "mode must be 'decode', 'prefill' or 'spec'",
        RAISES,
    ),
    p(
        "ple_conv",
        "spec_query_len-0",
        lambda a: a.update(
            mode="spec",
            spec_query_len=0,
            query_start_loc=torch.tensor([0, 1, 2], dtype=I32),
            num_accepted_tokens=torch.tensor([1, 1], dtype=I32),
        ),
        "spec_query_len",
    ),
    p(
        "ple_conv",
        "spec-num_accepted_tokens-missing",
        lambda a: a.update(mode="spec", query_start_loc=torch.tensor([0, 1, 2], dtype=I32)),
        "num_accepted_tokens are required for spec decode",
        RAISES,
    ),
    p(  # spec reads S-1+q entries: S = 2, q = 2 need a window of 3
        "ple_conv",
        "spec-conv_state-narrow",
        lambda a: a.update(
            mode="spec",
            spec_query_len=2,
            query_start_loc=torch.tensor([0, 1, 2], dtype=I32),
            num_accepted_tokens=torch.tensor([1, 1], dtype=I32),
        ),
        "window >= 3",
        RAISES,
    ),
    p(
        "ple_conv",
        "spec-request-longer-than-q",
        lambda a: a.update(
            mode="spec",
            spec_query_len=1,
            query_start_loc=torch.tensor([0, 2, 2], dtype=I32),
            num_accepted_tokens=torch.tensor([1, 1], dtype=I32),
        ),
        "spec request 0 has 2 tokens, more than spec_query_len = 1",
        RAISES,
    ),
    p("ple_conv", "meta-residual", set_("residual", meta), "residual"),
    p("ple_conv", "meta-conv_state", set_("conv_state", meta), "conv_state"),
    p(
        "ple_conv",
        "meta-outer_residual",
        put("outer_residual", lambda: torch.zeros(2, 4, device=META)),
        "outer_residual",
    ),
    p(
        "ple_conv",
        "meta-conv_weights",
        set_("conv_weights", meta),
        "conv_weights is on meta but inputs is on cpu",
        RAISES,
    ),
    p("ple_conv", "meta-state_indices", set_("state_indices", meta), "state_indices"),
    # ---- ple_conv (prefill baseline) ----
    p(
        "ple_conv_prefill",
        "qsl-decreasing",
        put("query_start_loc", lambda: torch.tensor([0, 3, 2], dtype=I32)),
        "query_start_loc must be non-decreasing",
        RAISES,
    ),
    p(
        "ple_conv_prefill",
        "qsl-past-T",
        put("query_start_loc", lambda: torch.tensor([0, 2, 6], dtype=I32)),
        r"query_start_loc\[R\] = 6 is past the 5 tokens",
        RAISES,
    ),
    p(
        "ple_conv_prefill",
        "qsl-negative-start",
        put("query_start_loc", lambda: torch.tensor([-1, 2, 5], dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ple_conv_prefill",
        "qsl-nonzero-start",
        put("query_start_loc", lambda: torch.tensor([1, 2, 5], dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ple_conv_prefill",
        "qsl-short",
        set_("query_start_loc", lambda t: t[:2]),
        "query_start_loc needs at least 3 entries",
        RAISES,
    ),
    p(
        "ple_conv_prefill",
        "qsl-missing",
        put("query_start_loc", None),
        "query_start_loc and has_initial_states are required for prefill",
        RAISES,
    ),
    p(
        "ple_conv_prefill",
        "qsl-float",
        set_("query_start_loc", lambda t: t.float()),
        "query_start_loc must be int32 or int64",
        RAISES,
    ),
    p(
        "ple_conv_prefill",
        "has_initial_states-missing",
        put("has_initial_states", None),
        "has_initial_states",
    ),
    p(
        "ple_conv_prefill",
        "has_initial_states-float",
        set_("has_initial_states", lambda t: t.float()),
        "has_initial_states",
    ),
    p(
        "ple_conv_prefill",
        "has_initial_states-short",
        set_("has_initial_states", lambda t: t[:1]),
        "has_initial_states needs at least 2 entries",
        RAISES,
    ),
    p("ple_conv_prefill", "meta-qsl", set_("query_start_loc", meta), "query_start_loc"),
    p(
        "ple_conv_prefill",
        "state_indices-2d",
        put("state_indices", lambda: torch.tensor([[1, 2]], dtype=I32)),
        "state_indices must be 1-D",
        RAISES,
    ),
]

DATA_ONLY = {
    "ple_conv-state_indices-negative",
    "ple_conv-state_indices-eq-slots",
    "ple_conv-state_indices-duplicate",
    "ple_conv-token_indices-past",
    "ple_conv-token_indices-negative",
    "ple_conv-spec-request-longer-than-q",
    "ple_conv_prefill-qsl-decreasing",
    "ple_conv_prefill-qsl-past-T",
    "ple_conv_prefill-qsl-negative-start",
    "ple_conv_prefill-qsl-nonzero-start",
}
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
