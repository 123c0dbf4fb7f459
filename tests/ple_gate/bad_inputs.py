"""ple_gate's bad-input cases (run by tests/ple_gate/test_bad_inputs.py), with the generic kit of
tests/bad_inputs_support.py.

OPS: the valid baseline (outputs filled with a sentinel pattern), the runner that calls it with
out= (and the functional op's, without), and the names of the tensors it writes. CASES: each
overrides one argument of the baseline, with the error message it must give. ple_gate takes no
index data: DATA_ONLY is empty.
"""

from __future__ import annotations

import torch

from bad_inputs_support import F16, I32, meta, noncontig, p, put, sentinel, set_
from qwen4exp_ext import ops


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


# Calls ple_gate of `kernels` (qwen4exp_ext.ops, or a backend's ops) with the arguments.
def run_gate(a, kernels=ops):
    _call_gate(a, kernels, out=(a.pop("gated"), a.pop("conv_input")))


def _call_gate(a, kernels, out):
    key, value, hidden = a.pop("key"), a.pop("value"), a.pop("hidden")
    wk, wq, wc = a.pop("norm_key_w"), a.pop("norm_query_w"), a.pop("norm_conv_w")
    kernels.ple_gate(key, value, hidden, wk, wq, wc, a.pop("eps"), out=out, **a)


OPS = {"ple_gate": (gate_baseline, run_gate, ("gated", "conv_input"))}

CASES = [
    p("ple_gate", "hidden-int", set_("hidden", lambda t: t.to(I32)), "hidden must be float32"),
    p("ple_gate", "hidden-3d", set_("hidden", lambda t: t.unsqueeze(0)), "hidden must be 2-D"),
    p("ple_gate", "key-f16", set_("key", lambda t: t.to(F16)), "key must have hidden's dtype"),
    p(
        "ple_gate",
        "value-f16",
        set_("value", lambda t: t.to(F16)),
        "value must have hidden's dtype",
    ),
    p("ple_gate", "key-shape", set_("key", lambda t: t[:, :4]), r"key must be \[T, C\]"),
    p(
        "ple_gate",
        "value-width-3",
        set_("value", lambda t: t[:, :3].contiguous()),
        "multiple of value's H",
    ),
    p("ple_gate", "value-rows", set_("value", lambda t: t[:2]), r"value must be \[T, H\]"),
    p("ple_gate", "key-noncontig", set_("key", noncontig), "key must have unit stride"),
    p("ple_gate", "hidden-noncontig", set_("hidden", noncontig), "hidden"),
    p(
        "ple_gate",
        "norm_key_w-f16",
        set_("norm_key_w", lambda t: t.to(F16)),
        "norm_key_w must be float32 or",
    ),
    p(
        "ple_gate",
        "norm_query_w-f64",
        set_("norm_query_w", lambda t: t.double()),
        "norm_query_w must have norm_key_w's dtype",
    ),
    p(
        "ple_gate",
        "norm_conv_w-len",
        set_("norm_conv_w", lambda t: t[:7]),
        r"norm_conv_w must be \[C\]",
    ),
    p(
        "ple_gate",
        "norm_conv_w-noncontig",
        set_("norm_conv_w", noncontig),
        "norm_conv_w must be contiguous",
    ),
    p("ple_gate", "eps-negative", put("eps", -1e-6), "eps must be a positive finite number"),
    p("ple_gate", "eps-nan", put("eps", float("nan")), "eps"),
    p("ple_gate", "eps-zero", put("eps", 0.0), "eps"),
    p("ple_gate", "eps-negative-zero", put("eps", -0.0), "eps"),
    p("ple_gate", "eps-inf", put("eps", float("inf")), "eps"),
    p("ple_gate", "eps-zero-in-fp32", put("eps", 1e-50), "eps"),  # the kernel's eps is fp32
    p("ple_gate", "rounding-bad", put("rounding", "bf16"), "rounding must be 'vllm' or 'fp32'"),
    p(
        "ple_gate",
        "gated-shape",
        put("gated", lambda: sentinel((3, 7), torch.float32)),
        r"gated must be \[T, C\]",
    ),
    p(
        "ple_gate",
        "conv_input-f16",
        put("conv_input", lambda: sentinel((3, 8), F16)),
        "conv_input must have hidden's dtype",
    ),
    p("ple_gate", "value-width-0", set_("value", lambda t: t[:, :0]), "value"),
    p("ple_gate", "meta-value", set_("value", meta), "value"),
    p("ple_gate", "meta-gated", set_("gated", meta), "gated"),
    p("ple_gate", "meta-hidden", set_("hidden", meta), "hidden"),
    p("ple_gate", "meta-norm_query_w", set_("norm_query_w", meta), "norm_query_w"),
]


# The functional op (no out=: ple_gate allocates its outputs) checks its arguments on its own
# entry: every case but those of the outputs applies to it as it is.
def run_gate_functional(a, kernels=ops):
    a.pop("gated"), a.pop("conv_input")
    _call_gate(a, kernels, out=None)


OPS["ple_gate_functional"] = (gate_baseline, run_gate_functional, ())
CASES += [
    p("ple_gate_functional", case.id.split("-", 1)[1], *case.values[1:])
    for case in list(CASES)
    if case.values[0] == "ple_gate" and case.values[1].arg not in ("gated", "conv_input")
]

# Index values that only the data shows: ple_gate has none.
DATA_ONLY: set[str] = set()
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
