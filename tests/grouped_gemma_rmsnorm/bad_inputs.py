"""grouped_gemma_rmsnorm's bad-input cases (run by test_bad_inputs.py), with the generic kit of
tests/bad_inputs_support.py. No index data: DATA_ONLY is empty."""

from __future__ import annotations

import torch

from bad_inputs_support import F16, I32, meta, noncontig, p, put, sentinel, set_
from qwen4exp_ext import ops

N, GROUPS, G = 3, 2, 8


def baseline() -> dict:
    g = torch.Generator().manual_seed(4)
    return dict(
        x=torch.randn(N, GROUPS * G, generator=g),
        weight=torch.randn(G, generator=g),
        eps=1e-6,
        num_groups=GROUPS,
        out=sentinel((N, GROUPS * G), torch.float32),
    )


def _call(a, kernels, out):
    kernels.grouped_gemma_rmsnorm(
        a.pop("x"), a.pop("weight"), a.pop("eps"), a.pop("num_groups"), out=out
    )


def run(a, kernels=ops):
    _call(a, kernels, a.pop("out"))


def run_functional(a, kernels=ops):
    a.pop("out")
    _call(a, kernels, None)


OPS = {
    "grouped_gemma_rmsnorm": (baseline, run, ("out",)),
    "grouped_gemma_rmsnorm_functional": (baseline, run_functional, ()),
}

_INPUTS = [
    ("x-int", set_("x", lambda t: t.to(I32)), "x must be float32"),
    ("x-3d", set_("x", lambda t: t.unsqueeze(0)), "x must be 2-D"),
    ("x-noncontig", set_("x", noncontig), "x must have unit stride"),
    ("num_groups-0", put("num_groups", 0), "num_groups must be in"),
    ("num_groups-3", put("num_groups", 3), "multiple of num_groups"),
    ("weight-len", set_("weight", lambda t: t[:5]), r"weight must be \[8\]"),
    ("weight-f16", set_("weight", lambda t: t.to(F16)), "weight must be float32 or"),
    ("weight-noncontig", set_("weight", noncontig), "weight must be contiguous"),
    ("eps-negative", put("eps", -1e-6), "eps must be a positive finite number"),
    ("eps-nan", put("eps", float("nan")), "eps"),
    ("eps-zero-in-fp32", put("eps", 1e-50), "eps"),
    ("meta-x", set_("x", meta), "x"),
    ("meta-weight", set_("weight", meta), "weight"),
]
_OUTPUTS = [
    ("out-shape", put("out", lambda: sentinel((N, GROUPS * G + 1), torch.float32)), "out must be"),
    ("out-f16", put("out", lambda: sentinel((N, GROUPS * G), F16)), "out must have dtype"),
    ("out-noncontig", set_("out", noncontig), "out must have unit stride"),
    ("meta-out", set_("out", meta), "out"),
]

CASES = [p("grouped_gemma_rmsnorm", i, o, m) for i, o, m in _INPUTS + _OUTPUTS] + [
    p("grouped_gemma_rmsnorm_functional", i, o, m) for i, o, m in _INPUTS
]
DATA_ONLY: set[str] = set()
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
