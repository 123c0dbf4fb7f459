"""hc_combine_norm's and hc_combine's bad-input cases (run by test_bad_inputs.py here and in
tests/hc_combine/), with the generic kit of tests/bad_inputs_support.py.

OPS: per variant the valid baseline (outputs filled with a sentinel pattern), the runner (out=,
or the functional op) and the names of the tensors it writes. CASES: each overrides one argument
with the error message it must give. No index data: DATA_ONLY is empty.
"""

from __future__ import annotations

import torch

from bad_inputs_support import F16, I32, meta, noncontig, p, put, sentinel, set_
from qwen4exp_ext import ops

T, HC, H = 3, 2, 8


def baseline() -> dict:
    g = torch.Generator().manual_seed(1)
    down = torch.randn(T, HC + 3, generator=g)  # the logits: a column slice, as in vLLM
    return dict(
        residual=torch.randn(T, HC * H, generator=g),
        block_output=torch.randn(T, H, generator=g),
        injection_logits=down[:, 1 : 1 + HC],
        norm_weight=torch.randn(H, generator=g),
        eps=1e-6,
        hc_count=HC,
        h=sentinel((T, HC * H), torch.float32),
        xn=sentinel((T, HC * H), torch.float32) + 0.5,
    )


def _inputs(a):
    return a.pop("residual"), a.pop("block_output"), a.pop("injection_logits")


def run_norm(a, kernels=ops):
    out = (a.pop("h"), a.pop("xn"))
    kernels.hc_combine_norm(
        *_inputs(a), a.pop("norm_weight"), a.pop("eps"), a.pop("hc_count"), out=out
    )


def run_norm_functional(a, kernels=ops):
    a.pop("h"), a.pop("xn")
    kernels.hc_combine_norm(*_inputs(a), a.pop("norm_weight"), a.pop("eps"), a.pop("hc_count"))


def run_combine(a, kernels=ops):
    a.pop("xn"), a.pop("norm_weight"), a.pop("eps")
    kernels.hc_combine(*_inputs(a), a.pop("hc_count"), out=a.pop("h"))


def run_combine_functional(a, kernels=ops):
    a.pop("h"), a.pop("xn"), a.pop("norm_weight"), a.pop("eps")
    kernels.hc_combine(*_inputs(a), a.pop("hc_count"))


# The cases of the inputs every variant takes (the op's name filled in below).
_INPUT_CASES = [
    ("residual-int", set_("residual", lambda t: t.to(I32)), "residual must be float32"),
    ("residual-3d", set_("residual", lambda t: t.unsqueeze(0)), "residual must be 2-D"),
    ("residual-noncontig", set_("residual", noncontig), "residual must have unit stride"),
    ("residual-width", set_("residual", lambda t: t[:, :15]), "multiple of hc_count"),
    ("residual-width-0", set_("residual", lambda t: t[:, :0]), "positive multiple"),
    ("block-f16", set_("block_output", lambda t: t.to(F16)), "block_output must have residual's"),
    ("block-shape", set_("block_output", lambda t: t[:, :4]), r"block_output must be \[T, H\]"),
    ("block-rows", set_("block_output", lambda t: t[:2]), r"block_output must be \[T, H\]"),
    ("block-noncontig", set_("block_output", noncontig), "block_output must have unit stride"),
    ("block-1d", set_("block_output", lambda t: t[0]), "block_output must be 2-D"),
    ("logits-f16", set_("injection_logits", lambda t: t.to(F16)), "injection_logits must have"),
    ("logits-shape", set_("injection_logits", lambda t: t[:, :1]), "injection_logits must be"),
    ("logits-noncontig", set_("injection_logits", noncontig), "injection_logits must have unit"),
    ("hc_count-0", put("hc_count", 0), "hc_count must be in"),
    ("hc_count-negative", put("hc_count", -2), "hc_count must be in"),
    ("hc_count-huge", put("hc_count", 2**40), "hc_count must be in"),
    ("hc_count-3", put("hc_count", 3), "multiple of hc_count"),
    ("meta-residual", set_("residual", meta), "residual"),
    ("meta-block", set_("block_output", meta), "block_output"),
    ("meta-logits", set_("injection_logits", meta), "injection_logits"),
]
_OUTPUT_CASES = [
    ("h-shape", put("h", lambda: sentinel((T, HC * H - 1), torch.float32)), "must be"),
    ("h-f16", put("h", lambda: sentinel((T, HC * H), F16)), "must have dtype"),
    ("h-noncontig", set_("h", noncontig), "unit stride"),
    (
        "h-overlapping",
        put("h", lambda: sentinel((1, HC * H), torch.float32).expand(T, -1)),
        "must not overlap",
    ),
    ("meta-h", set_("h", meta), "h"),
]
_NORM_CASES = [
    ("weight-len", set_("norm_weight", lambda t: t[:7]), r"norm_weight must be \[8\]"),
    ("weight-f16", set_("norm_weight", lambda t: t.to(F16)), "norm_weight must be float32 or"),
    ("weight-2d", set_("norm_weight", lambda t: t.reshape(2, 4)), "norm_weight must be"),
    ("weight-noncontig", set_("norm_weight", noncontig), "norm_weight must be contiguous"),
    ("meta-weight", set_("norm_weight", meta), "norm_weight"),
    ("eps-negative", put("eps", -1e-6), "eps must be a positive finite number"),
    ("eps-nan", put("eps", float("nan")), "eps"),
    ("eps-zero", put("eps", 0.0), "eps"),
    ("eps-inf", put("eps", float("inf")), "eps"),
    ("eps-zero-in-fp32", put("eps", 1e-50), "eps"),  # the kernel's eps is fp32
]
_XN_CASES = [
    ("xn-shape", put("xn", lambda: sentinel((T + 1, HC * H), torch.float32)), "xn must be"),
    ("xn-is-h", lambda a: a.__setitem__("xn", a["h"]), "h and xn must be different"),
    ("meta-xn", set_("xn", meta), "xn"),
]
_XN_CASES[1][1].arg = "xn"

OPS = {
    "hc_combine_norm": (baseline, run_norm, ("h", "xn")),
    "hc_combine_norm_functional": (baseline, run_norm_functional, ()),
    "hc_combine": (baseline, run_combine, ("h",)),
    "hc_combine_functional": (baseline, run_combine_functional, ()),
}


def _cases(op, table):
    return [p(op, case_id, override, match) for case_id, override, match in table]


def cases_of(norm: bool) -> list:
    """The cases of hc_combine_norm (norm) or hc_combine, each with and without out=."""
    op = "hc_combine_norm" if norm else "hc_combine"
    inputs = _INPUT_CASES + (_NORM_CASES if norm else [])
    outputs = _OUTPUT_CASES + (_XN_CASES if norm else [])
    return _cases(op, inputs + outputs) + _cases(f"{op}_functional", inputs)


CASES = cases_of(norm=True)

# Index values that only the data shows: none.
DATA_ONLY: set[str] = set()
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
