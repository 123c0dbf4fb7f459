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


def gate_baseline() -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(
        key=torch.randn(3, 8, generator=g),
        value=torch.randn(3, 4, generator=g),
        hidden=torch.randn(3, 8, generator=g),
        norm_key_w=torch.randn(8, generator=g),
        norm_query_w=torch.randn(8, generator=g),
        norm_conv_w=torch.randn(8, generator=g),
        eps=1e-6,
        rounding="vllm",
        gated=sentinel((3, 8), torch.float32),
        conv_input=sentinel((3, 8), torch.float32) + 0.5,
    )


# Each runner calls one op of `kernels` (qwen4exp_ext.ops, or a backend's ops) with the arguments.
def run_ngram(a, kernels=ops):
    kernels.ngram_ids(**a)
    return {"output": a["output"]}


def run_gather(a, kernels=ops):
    kernels.gather_rows(a.pop("table"), a.pop("ids"), **a)


def run_gate(a, kernels=ops):
    gated, conv_input = a.pop("gated"), a.pop("conv_input")
    key, value, hidden = a.pop("key"), a.pop("value"), a.pop("hidden")
    wk, wq, wc = a.pop("norm_key_w"), a.pop("norm_query_w"), a.pop("norm_conv_w")
    kernels.ple_gate(key, value, hidden, wk, wq, wc, a.pop("eps"), out=(gated, conv_input), **a)


OPS = {
    "ngram_ids": (ngram_baseline, run_ngram, ("output",)),
    "gather_rows": (gather_baseline, run_gather, ("output",)),
    "gather_rows_nvfp4": (gather_nvfp4_baseline, run_gather, ("output",)),
    "ple_gate": (gate_baseline, run_gate, ("gated", "conv_input")),
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
    # ---- gather_rows ----
    p("gather_rows", "table-int", set_("table", lambda t: t.to(I32)), "table"),
    p("gather_rows", "table-1d", set_("table", lambda t: t.reshape(-1)), "table"),
    p("gather_rows", "table-noncontig", set_("table", noncontig), "table"),
    p("gather_rows", "ids-float", set_("ids", lambda t: t.float()), "ids"),
    p("gather_rows", "ids-0d", put("ids", lambda: torch.tensor(3)), "ids"),
    p("gather_rows", "output-shape", put("output", lambda: sentinel((3, 23), F32)), "output"),
    p("gather_rows", "output-int", put("output", lambda: sentinel((3, 24), I32)), "output"),
    p("gather_rows", "output-noncontig", set_("output", noncontig), "output"),
    p("gather_rows", "out_dtype-mismatch", put("out_dtype", F16), "out_dtype"),
    p("gather_rows", "fp8-table-no-scale", set_("table", lambda t: t.to(FP8)), "scale"),
    p(
        "gather_rows",
        "fp8-scale-f64",
        lambda a: a.update(table=a["table"].to(FP8), scale=torch.ones(1, dtype=torch.float64)),
        "scale",
    ),
    p(
        "gather_rows",
        "fp8-scale-2-elems",
        lambda a: a.update(table=a["table"].to(FP8), scale=torch.ones(2)),
        "scale",
    ),
    p(
        "gather_rows",
        "meta-scale",
        lambda a: a.update(table=a["table"].to(FP8), scale=torch.ones(1, device=META)),
        "scale",
    ),
    p("gather_rows", "meta-output", set_("output", meta), "output"),
    p("gather_rows", "meta-table", set_("table", meta), "table"),
    p("gather_rows", "scale-non-fp8", put("scale", 2.0), "scale"),
    p("gather_rows", "vocab_start-negative", put("vocab_start", -1), "vocab_start"),
    p("gather_rows", "vocab_end-too-far", put("vocab_end", 11), "vocab_end"),
    p("gather_rows", "vocab_end-before-start", put("vocab_end", -3), "vocab_end"),
    p("gather_rows", "meta-ids", set_("ids", meta), "ids"),
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
    # ---- ple_gate ----
    p("ple_gate", "hidden-int", set_("hidden", lambda t: t.to(I32)), "hidden"),
    p("ple_gate", "hidden-3d", set_("hidden", lambda t: t.unsqueeze(0)), "hidden"),
    p("ple_gate", "key-f16", set_("key", lambda t: t.to(F16)), "key"),
    p("ple_gate", "value-f16", set_("value", lambda t: t.to(F16)), "value"),
    p("ple_gate", "key-shape", set_("key", lambda t: t[:, :4]), "key"),
    p("ple_gate", "value-width-3", set_("value", lambda t: t[:, :3].contiguous()), "value|H"),
    p("ple_gate", "value-rows", set_("value", lambda t: t[:2]), "value"),
    p("ple_gate", "key-noncontig", set_("key", noncontig), "key"),
    p("ple_gate", "hidden-noncontig", set_("hidden", noncontig), "hidden"),
    p("ple_gate", "norm_key_w-f16", set_("norm_key_w", lambda t: t.to(F16)), "norm_key_w"),
    p("ple_gate", "norm_query_w-f64", set_("norm_query_w", lambda t: t.double()), "norm_query_w"),
    p("ple_gate", "norm_conv_w-len", set_("norm_conv_w", lambda t: t[:7]), "norm_conv_w"),
    p("ple_gate", "norm_conv_w-noncontig", set_("norm_conv_w", noncontig), "norm_conv_w"),
    p("ple_gate", "eps-negative", put("eps", -1e-6), "eps"),
    p("ple_gate", "eps-nan", put("eps", float("nan")), "eps"),
    p("ple_gate", "eps-zero", put("eps", 0.0), "eps"),
    p("ple_gate", "eps-negative-zero", put("eps", -0.0), "eps"),
    p("ple_gate", "eps-inf", put("eps", float("inf")), "eps"),
    p("ple_gate", "eps-zero-in-fp32", put("eps", 1e-50), "eps"),  # the kernel's eps is fp32
    p("ple_gate", "rounding-bad", put("rounding", "bf16"), "rounding"),
    p("ple_gate", "gated-shape", put("gated", lambda: sentinel((3, 7), torch.float32)), "gated"),
    p("ple_gate", "conv_input-f16", put("conv_input", lambda: sentinel((3, 8), F16)), "conv_input"),
    p("ple_gate", "value-width-0", set_("value", lambda t: t[:, :0]), "value"),
    p("ple_gate", "meta-value", set_("value", meta), "value"),
    p("ple_gate", "meta-gated", set_("gated", meta), "gated"),
    p("ple_gate", "meta-hidden", set_("hidden", meta), "hidden"),
    p("ple_gate", "meta-norm_query_w", set_("norm_query_w", meta), "norm_query_w"),
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
