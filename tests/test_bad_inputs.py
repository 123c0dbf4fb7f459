"""Bad inputs to every public op and to NGramEmbedding.load_weights: each one raises an exception
that names the offending argument and leaves every output and state tensor bit-identical
(outputs are filled with a sentinel pattern before the call). A few "data, never errors" cases
check inputs that must not raise (any int64 token id; gather ids outside the table or shard give
zero rows).

Each case starts from one valid baseline per op and overrides one argument. The op cases run on
every kernel backend with the CPU tensors of the table: the CPU kernels and the SIMT emulator's
HIP kernels, whose host glue is the GPU build's (tests/test_gpu_debug_checks.py moves them to a
GPU). There, the DATA_ONLY cases, bad index values that only the data shows, are not errors
without debug checks (the GPU kernels never read index data on the host), and that test file
covers them.
"""

from __future__ import annotations

import pytest
import torch

from conftest import backends
from qwen4exp_ext import layout, ops
from qwen4exp_ext.layers import NGramEmbedding
from test_ngram_embedding import CONFIG  # the toy n-gram config the layer tests share

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


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tensors.items() if v.device.type != "meta"}


def assert_untouched(before: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    for name, old in before.items():
        new = tensors[name]
        assert new.device.type != "meta"
        a = old.contiguous().view(torch.uint8)
        b = new.contiguous().view(torch.uint8)
        assert torch.equal(a, b), f"{name} was modified by a call that raised"


# ---- baselines -------------------------------------------------------------------------------

NGRAM_HEADS = layout.head_vocab_layout(50, 4, 1, 16)  # 4 heads = (N-1)=2 x heads_per_ngram=2


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


def conv_decode_baseline() -> dict:
    g = torch.Generator().manual_seed(2)
    return dict(
        inputs=torch.randn(2, 4, generator=g),
        residual=sentinel((2, 4), torch.float32),
        conv_state=sentinel((4, 4, 2), torch.float32) + 0.25,
        conv_weights=torch.randn(4, 3, generator=g),
        state_indices=torch.tensor([1, 2], dtype=torch.int32),
        outer_residual=None,
        mode="decode",
        dilation=1,
    )


def conv_prefill_baseline() -> dict:
    g = torch.Generator().manual_seed(3)
    return dict(
        inputs=torch.randn(5, 4, generator=g),
        residual=sentinel((5, 4), torch.float32),
        conv_state=sentinel((4, 4, 2), torch.float32) + 0.25,
        conv_weights=torch.randn(4, 3, generator=g),
        state_indices=torch.tensor([1, 2], dtype=torch.int32),
        outer_residual=None,
        mode="prefill",
        dilation=1,
        query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32),
        has_initial_states=torch.tensor([True, False]),
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
    "gather_rows": (gather_baseline, run_gather, ("output",)),
    "gather_rows_nvfp4": (gather_nvfp4_baseline, run_gather, ("output",)),
    "ple_gate": (gate_baseline, run_gate, ("gated", "conv_input")),
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
    """An override: args[name] = fn(args[name])."""

    def apply(a):
        a[name] = fn(a[name])

    return apply


def put(name, value):
    def apply(a):
        a[name] = value() if callable(value) else value

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
_DATA_OVERRIDES = {case.values[1] for case in DATA_CASES}
CPU_BACKENDS = [b for b in backends() if b.device == "cpu"]


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=str)
@pytest.mark.parametrize("op,override,match,exc", CASES)
def test_bad_input_raises_and_writes_nothing(backend, op, override, match, exc):
    if backend.reads_indices_on_device and override in _DATA_OVERRIDES:
        pytest.skip("an index value, not an error without debug checks on this backend")
    baseline, run, mutable = OPS[op]
    args = baseline()
    override(args)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with pytest.raises(exc, match=match):
        run(dict(args), backend.ops)
    assert_untouched(before, outputs)


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=str)
@pytest.mark.parametrize("op", sorted(OPS))
def test_baselines_are_valid(backend, op):
    baseline, run, _ = OPS[op]
    run(baseline(), backend.ops)


# ---- NGramEmbedding.load_weights: mismatched checkpoint shards --------------------------------

ROWS = NGRAM_HEADS.padded_rows
HEAD_DIM = 6
SHARD_ROWS = -(-ROWS // 7)
LAST_ROWS = ROWS - 6 * SHARD_ROWS


def shard(i, rows, width=HEAD_DIM, dtype=torch.float32):
    return (f"ngram_embedding.shard_{i}.weight", torch.ones(rows, width, dtype=dtype))


LOAD_CASES = [
    pytest.param([shard(7, SHARD_ROWS)], "shard index 7", id="index-eq-parts"),
    pytest.param([shard(12, SHARD_ROWS)], "shard index 12", id="index-past-parts"),
    pytest.param([shard(0, SHARD_ROWS - 1)], "shard 0", id="rows-short"),
    pytest.param([shard(0, SHARD_ROWS + 1)], "shard 0", id="rows-long"),
    pytest.param([shard(1, SHARD_ROWS, HEAD_DIM + 1)], "shard 1", id="width-wide"),
    pytest.param([shard(2, SHARD_ROWS, HEAD_DIM - 1)], "shard 2", id="width-narrow"),
    pytest.param([shard(6, SHARD_ROWS)], "shard 6", id="last-shard-full-size"),
    pytest.param(
        [("ngram_embedding.shard_3.weight", torch.ones(SHARD_ROWS))], "shard 3", id="rank-1"
    ),
    pytest.param(
        [("layer_multipliers", torch.zeros(4, dtype=torch.long))],
        "layer_multipliers",
        id="multipliers-shape",
    ),
    pytest.param(
        [("ngram_heads_offsets", torch.zeros(4))], "ngram_heads_offsets", id="offsets-float"
    ),
    pytest.param(
        [("ngram_embedding.weight_scale", torch.ones(1))], "weight_scale", id="scale-non-fp8"
    ),
    pytest.param(
        [("ngram_embedding.shard_0.weight", torch.empty(SHARD_ROWS, HEAD_DIM, device=META))],
        "shard_0.weight.*meta",
        id="shard-meta",
    ),
    pytest.param(
        [shard(4, SHARD_ROWS, dtype=torch.int32)], "shard_4.weight.*floating", id="rows-int"
    ),
    # A bad tensor after good ones: a list is checked in full first, so nothing is written.
    pytest.param(
        [shard(0, SHARD_ROWS), shard(1, SHARD_ROWS), shard(2, SHARD_ROWS - 1)],
        "shard 2",
        id="good-shards-then-bad",
    ),
    pytest.param(
        [("layer_multipliers", torch.arange(3)), shard(5, SHARD_ROWS), ("bogus", torch.ones(1))],
        "bogus",
        id="good-buffer-then-unknown",
    ),
]


@pytest.mark.parametrize("weights,match", LOAD_CASES)
def test_load_weights_mismatch_raises_and_writes_nothing(weights, match):
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    with torch.no_grad():
        m.weight.copy_(sentinel(tuple(m.weight.shape), torch.float32))
    state = {"weight": m.weight.detach(), **dict(m.named_buffers())}
    before = snapshot(state)
    with pytest.raises(EXC, match=match):
        m.load_weights(weights)
    assert_untouched(before, state)


def test_streamed_load_failing_late_refuses_to_run_until_reloaded():
    """A lazy iterator cannot be checked ahead: rows of earlier shards are written, buffers are
    not, and the module raises on use (never silent half-loaded rows) until a load succeeds."""
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    multipliers = m.layer_multipliers.clone()
    good = [shard(i, SHARD_ROWS if i < 6 else LAST_ROWS) for i in range(7)]
    stream = iter([("layer_multipliers", torch.arange(3)), good[0], shard(1, SHARD_ROWS + 1)])
    with pytest.raises(ValueError, match="shard 1") as info:
        m.load_weights(stream)
    assert "refuses to run" in "".join(getattr(info.value, "__notes__", []))
    assert torch.equal(m.layer_multipliers, multipliers)  # staged buffers were not written
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="load the checkpoint again"):
        m.lookup(ids)
    m.load_weights(iter(good))
    assert m.lookup(ids).abs().sum() > 0


def test_safetensors_load_checks_every_header_first(tmp_path):
    from safetensors.torch import save_file

    save_file(dict([shard(0, SHARD_ROWS)]), tmp_path / "a.safetensors")
    save_file(dict([shard(1, SHARD_ROWS + 1)]), tmp_path / "b.safetensors")
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    with torch.no_grad():
        m.weight.copy_(sentinel(tuple(m.weight.shape), torch.float32))
    before = snapshot({"weight": m.weight.detach()})
    with pytest.raises(ValueError, match="shard 1"):
        m.load_safetensors([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert_untouched(before, {"weight": m.weight.detach()})


# ---- data, never errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    [INT64_MIN, INT64_MIN + 1, -1, 0, 2**31, 2**32 + 5, INT64_MAX - 1, INT64_MAX],
    ids=str,
)
def test_any_int64_token_hashes(token):
    a = ngram_baseline()
    a["input_ids"] = a["input_ids"].clone()
    a["input_ids"][3] = token
    a["ngram_context"] = a["ngram_context"].clone()
    a["ngram_context"][1, 0] = token
    out = ops.ngram_ids(**a)
    sizes = a["ngram_heads_vocab_sizes"]
    offsets = a["ngram_heads_offsets"]
    assert ((out >= offsets) & (out < offsets + sizes)).all()


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
