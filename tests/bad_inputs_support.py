"""The bad-input case table of tests/test_bad_inputs.py, also run by tests/test_gpu_debug_checks.py.

OPS: one valid baseline per op (outputs filled with a sentinel pattern), the runner that calls it,
and the names of the tensors it writes. CASES: each overrides one argument of a baseline, with
the error it must raise. DATA_ONLY (DATA_CASES): the cases whose bad values only the index data
shows, errors on the CPU and, on the GPU and the SIMT emulator, only with debug checks.
"""

from __future__ import annotations

import pytest
import torch

from ngram_support import HASHING_ARGS, HEADS
from qwen4exp_ext import layout, ops

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
META = torch.device("meta")
EXC = (RuntimeError, ValueError, TypeError, IndexError)


def sentinel(shape, dtype) -> torch.Tensor:
    """A tensor with a distinctive bit pattern (no two neighbours equal)."""
    n = 1
    for s in shape:
        n *= s
    t = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype.is_floating_point:
        return (t * -1.375 - 7777.0).to(dtype)
    return (t * 7919 - 123456789).to(dtype)


# ---- baselines -------------------------------------------------------------------------------

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


def ngram_call(a: dict) -> dict[str, torch.Tensor]:
    return {"output": a["output"]}


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


# Each runner calls one op of `kernels` (qwen4exp_ext.ops, or a backend's ops) with the arguments.
def run_ngram(a, kernels=ops):
    kernels.ngram_ids(**a)
    return {"output": a["output"]}


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
    "ngram_ids": (ngram_baseline, run_ngram, ("output",)),
    "ple_conv": (conv_decode_baseline, run_conv, ("residual", "conv_state")),
    "ple_conv_prefill": (conv_prefill_baseline, run_conv, ("residual", "conv_state")),
}


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to(META)


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values and shape, stride(-1) == 2."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def set_(name, fn):
    """An override: args[name] = fn(args[name]); `arg` names the argument it changes."""

    def apply(a):
        a[name] = fn(a[name])

    apply.arg = name
    return apply


def put(name, value):
    def apply(a):
        a[name] = value() if callable(value) else value

    apply.arg = name
    return apply


def p(op, case_id, override, match, exc=EXC):
    return pytest.param(op, override, match, exc, id=f"{op}-{case_id}")


I32 = torch.int32
F16 = torch.float16
F32 = torch.float32
FP8 = torch.float8_e4m3fn

CASES = [
    # ---- ngram_ids ----
    p("ngram_ids", "input_ids-float", set_("input_ids", lambda t: t.float()), "input_ids"),
    p("ngram_ids", "qsl-float", set_("query_start_loc", lambda t: t.float()), "query_start_loc"),
    p("ngram_ids", "qsl-2d", set_("query_start_loc", lambda t: t.view(1, 3)), "query_start_loc"),
    p("ngram_ids", "context-float", set_("ngram_context", lambda t: t.double()), "ngram_context"),
    p("ngram_ids", "context-1d", set_("ngram_context", lambda t: t.reshape(-1)), "ngram_context"),
    p("ngram_ids", "context-rows", set_("ngram_context", lambda t: t[:1]), "ngram_context"),
    p(
        "ngram_ids",
        "multipliers-int32",
        set_("layer_multipliers", lambda t: t.to(I32)),
        "layer_multipliers",
    ),
    p(
        "ngram_ids",
        "multipliers-len",
        set_("layer_multipliers", lambda t: t[:2]),
        "layer_multipliers",
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
        "ngram_heads_vocab_sizes",
    ),
    p(
        "ngram_ids",
        "sizes-zero",
        set_("ngram_heads_vocab_sizes", lambda t: t.clone().index_fill_(0, torch.tensor([2]), 0)),
        "ngram_heads_vocab_sizes",
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
        "ngram_heads_offsets",
    ),
    p(
        "ngram_ids",
        "offsets-negative",
        set_("ngram_heads_offsets", lambda t: t - 10_000),
        "ngram_heads_offsets",
    ),
    p("ngram_ids", "heads_per_ngram-0", put("heads_per_ngram", 0), "heads_per_ngram"),
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
        "output",
    ),
    p(
        "ngram_ids",
        "qsl-start-1",
        put("query_start_loc", lambda: torch.tensor([1, 4, 9], dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ngram_ids",
        "qsl-decreasing",
        put("query_start_loc", lambda: torch.tensor([0, 6, 4], dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ngram_ids",
        "qsl-past-T",
        put("query_start_loc", lambda: torch.tensor([0, 4, 10], dtype=I32)),
        "query_start_loc",
    ),
    p("ngram_ids", "output-shape", put("output", lambda: sentinel((9, 5), torch.int64)), "output"),
    p("ngram_ids", "output-float", put("output", lambda: sentinel((9, 4), F32)), "output"),
    p("ngram_ids", "meta-context", set_("ngram_context", meta), "ngram_context"),
    p("ngram_ids", "meta-multipliers", set_("layer_multipliers", meta), "layer_multipliers"),
    p("ngram_ids", "meta-qsl", set_("query_start_loc", meta), "query_start_loc"),
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
    # ---- ple_conv (decode baseline) ----
    p("ple_conv", "inputs-int", set_("inputs", lambda t: t.to(I32)), "inputs"),
    p("ple_conv", "inputs-1d", set_("inputs", lambda t: t.reshape(-1)), "inputs"),
    p("ple_conv", "inputs-noncontig", set_("inputs", noncontig), "inputs"),
    p("ple_conv", "conv_weights-f64", set_("conv_weights", lambda t: t.double()), "conv_weights"),
    p("ple_conv", "conv_weights-channels", set_("conv_weights", lambda t: t[:3]), "conv_weights"),
    p("ple_conv", "kernel-size-0", put("conv_weights", lambda: torch.zeros(4, 0)), "conv_weights"),
    p("ple_conv", "kernel-size-9", put("conv_weights", lambda: torch.zeros(4, 9)), "conv_weights"),
    p("ple_conv", "dilation-0", put("dilation", 0), "dilation"),
    p("ple_conv", "dilation-9", put("dilation", 9), "dilation"),
    p("ple_conv", "dilation-negative", put("dilation", -1), "dilation"),
    p("ple_conv", "conv_state-2d", set_("conv_state", lambda t: t[:, :, 0]), "conv_state"),
    p("ple_conv", "conv_state-narrow", set_("conv_state", lambda t: t[:, :, :1]), "conv_state"),
    p("ple_conv", "conv_state-f16", set_("conv_state", lambda t: t.to(F16)), "conv_state"),
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
        "state_indices",
    ),
    p(
        "ple_conv",
        "state_indices-negative",
        put("state_indices", lambda: torch.tensor([1, -1], dtype=I32)),
        "state_indices",
    ),
    p(
        "ple_conv",
        "state_indices-eq-slots",
        put("state_indices", lambda: torch.tensor([4, 1], dtype=I32)),
        "state_indices",
    ),
    p(
        "ple_conv",
        "state_indices-duplicate",
        put("state_indices", lambda: torch.tensor([2, 2], dtype=I32)),
        "state_indices",
    ),
    p(
        "ple_conv",
        "token_indices-past",
        put("token_indices", lambda: torch.tensor([0, 2], dtype=I32)),
        "token_indices",
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
    p("ple_conv", "residual-shape", put("residual", lambda: sentinel((2, 5), F32)), "residual"),
    p("ple_conv", "residual-f16", put("residual", lambda: sentinel((2, 4), F16)), "residual"),
    p("ple_conv", "residual-noncontig", set_("residual", noncontig), "residual"),
    p(
        "ple_conv",
        "outer_residual-shape",
        put("outer_residual", lambda: torch.zeros(3, 4)),
        "outer_residual",
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
        "token_indices",
    ),
    p("ple_conv", "mode-bad", put("mode", "verify"), "mode"),
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
        "num_accepted_tokens",
    ),
    p("ple_conv", "meta-residual", set_("residual", meta), "residual"),
    p("ple_conv", "meta-conv_state", set_("conv_state", meta), "conv_state"),
    p(
        "ple_conv",
        "meta-outer_residual",
        put("outer_residual", lambda: torch.zeros(2, 4, device=META)),
        "outer_residual",
    ),
    p("ple_conv", "meta-conv_weights", set_("conv_weights", meta), "conv_weights"),
    p("ple_conv", "meta-state_indices", set_("state_indices", meta), "state_indices"),
    # ---- ple_conv (prefill baseline) ----
    p(
        "ple_conv_prefill",
        "qsl-decreasing",
        put("query_start_loc", lambda: torch.tensor([0, 3, 2], dtype=I32)),
        "query_start_loc",
    ),
    p(
        "ple_conv_prefill",
        "qsl-past-T",
        put("query_start_loc", lambda: torch.tensor([0, 2, 6], dtype=I32)),
        "query_start_loc",
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
        "query_start_loc",
    ),
    p("ple_conv_prefill", "qsl-missing", put("query_start_loc", None), "query_start_loc"),
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
        "has_initial_states",
    ),
    p("ple_conv_prefill", "meta-qsl", set_("query_start_loc", meta), "query_start_loc"),
]


def fused_baseline() -> dict:
    """ngram_gather_rows on the n-gram baseline, into a table that holds every id it hashes."""
    a = ngram_baseline()
    a.pop("output")
    a["table"] = torch.randn(NGRAM_HEADS.padded_rows, 6, generator=torch.Generator().manual_seed(5))
    a["output"] = sentinel((9, 4 * 6), torch.float32)
    return a


def run_fused(a, kernels=ops):
    hashing = [a.pop(k) for k in HASHING_ARGS]
    kernels.ngram_gather_rows(*hashing, a.pop("table"), **a)


OPS["ngram_gather_rows"] = (fused_baseline, run_fused, ("output",))
# ngram_gather_rows checks its n-gram arguments with ngram_ids' own checks: every ngram_ids case
# but those of ngram_ids' output (the one override without a named argument among them is one)
# applies to it as it is (its table and output checks are gather_rows', tested in
# tests/test_ngram_gather_rows.py).
CASES += [
    p("ngram_gather_rows", case.id.split("-", 1)[1], *case.values[1:])
    for case in list(CASES)
    if case.values[0] == "ngram_ids" and getattr(case.values[1], "arg", "output") != "output"
]
# Its own argument (gather_rows' grid cap, checked under the fused op's name).
CASES.append(
    p(
        "ngram_gather_rows",
        "max_blocks-negative",
        put("max_blocks", -1),
        r"ngram_gather_rows: max_blocks must be >= 0 \(0: no cap\), got -1",
    )
)


# Index values that only the data shows: errors on the CPU, which reads them for free; on the GPU
# (and the SIMT emulator) only with debug checks (tests/test_gpu_debug_checks.py).
DATA_ONLY = {
    "ngram_ids-output-int32-too-small",
    "ngram_ids-sizes-zero",
    "ngram_ids-sizes-negative",
    "ngram_ids-offsets-negative",
    "ngram_ids-offsets-overflow-int64",
    "ngram_ids-qsl-start-1",
    "ngram_ids-qsl-decreasing",
    "ngram_ids-qsl-past-T",
    "ple_conv-state_indices-negative",
    "ple_conv-state_indices-eq-slots",
    "ple_conv-state_indices-duplicate",
    "ple_conv-token_indices-past",
    "ple_conv-token_indices-negative",
    "ple_conv_prefill-qsl-decreasing",
    "ple_conv_prefill-qsl-past-T",
    "ple_conv_prefill-qsl-negative-start",
    "ple_conv_prefill-qsl-nonzero-start",
}
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]


# ---- the checks every op's bad-input tests run (tests/<op>/test_bad_inputs.py) ----------------
# An op's bad-input module (tests/<op>/bad_inputs.py) holds its specs: for each variant, one valid
# baseline (outputs filled with a sentinel pattern), the runner that calls the op of a backend's
# `kernels` with it, and the names of the tensors it writes: (baseline, run, mutable). Its cases
# override one argument of a baseline each, with the error message it must give.


# The backends that take the table's CPU tensors: the CPU kernels and the SIMT emulator's HIP
# kernels, whose host glue is the GPU build's.
def cpu_backends() -> list:
    from conftest import backends

    return [b for b in backends() if b.device == "cpu"]


# The backends whose kernels read index data on the device: the GPU and the SIMT emulator. Bad
# index values are defined there instead of errors, unless debug checks are on.
def device_index_backends() -> list:
    from conftest import backends

    return [b for b in backends() if b.reads_indices_on_device]


def on_device(args: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def synchronize(backend) -> None:
    if backend.device == "cuda":
        torch.cuda.synchronize()  # an out-of-bounds access would surface here


def check_raises_and_writes_nothing(spec, backend, override, match, exc) -> None:
    """The op raises `exc` with a message matching `match`, and every tensor it writes keeps its
    bytes."""
    from qwen4exp_ext.testing import assert_untouched, snapshot

    baseline, run, mutable = spec
    args = baseline()
    override(args)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with pytest.raises(exc, match=match):
        run(dict(args), backend.ops)
    assert_untouched(before, outputs)


def bad_args_on_device(spec, override, backend) -> dict:
    baseline, _, _ = spec
    args = baseline()
    override(args)
    return on_device(args, backend.device)


def check_debug_checks_raise_and_write_nothing(spec, backend, override, match) -> None:
    """With debug checks, a kernel that reads indices on the device raises the CPU's error and
    writes nothing."""
    import qwen4exp_ext
    from qwen4exp_ext.testing import assert_untouched, snapshot

    _, run, mutable = spec
    args = bad_args_on_device(spec, override, backend)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with qwen4exp_ext.debug_checks(), pytest.raises(EXC, match=match):
        run(dict(args), backend.ops)
    synchronize(backend)
    assert_untouched(before, outputs)


def run_without_debug_checks(spec, backend, override) -> dict:
    """Runs the op on the bad data with debug checks off; returns its arguments, as written."""
    import qwen4exp_ext

    _, run, _ = spec
    args = bad_args_on_device(spec, override, backend)
    with qwen4exp_ext.debug_checks(enabled=False):
        run(dict(args), backend.ops)
    synchronize(backend)
    return args


def check_debug_checks_pass_valid_inputs(spec, backend) -> None:
    import qwen4exp_ext

    baseline, run, _ = spec
    with qwen4exp_ext.debug_checks():
        run(on_device(baseline(), backend.device), backend.ops)
    synchronize(backend)
