"""hc_silu's bad-input cases (run by test_bad_inputs.py), with the generic kit of
tests/bad_inputs_support.py. No index data: DATA_ONLY is empty."""

from __future__ import annotations

import torch

from bad_inputs_support import F16, I32, meta, noncontig, p, put, sentinel, set_
from qwen4exp_ext import ops

T, D = 3, 10


def baseline() -> dict:
    g = torch.Generator().manual_seed(3)
    return dict(x=torch.randn(T, D, generator=g), hc_count=4, out=sentinel((T, D), torch.float32))


def run(a, kernels=ops):
    kernels.hc_silu(a.pop("x"), a.pop("hc_count"), out=a.pop("out"))


def run_functional(a, kernels=ops):
    a.pop("out")
    kernels.hc_silu(a.pop("x"), a.pop("hc_count"))


OPS = {"hc_silu": (baseline, run, ("out",)), "hc_silu_functional": (baseline, run_functional, ())}

_INPUTS = [
    ("x-int", set_("x", lambda t: t.to(I32)), "x must be float32"),
    ("x-1d", set_("x", lambda t: t[0]), "x must be 2-D"),
    ("x-noncontig", set_("x", noncontig), "x must have unit stride"),
    ("hc_count-0", put("hc_count", 0), "hc_count must be in"),
    ("hc_count-negative", put("hc_count", -4), "hc_count must be in"),
    # (x alone on meta is a valid call: the fake's shapes, as torch.compile traces it.)
]
_OUTPUTS = [
    ("out-shape", put("out", lambda: sentinel((T, D - 1), torch.float32)), "out must be"),
    ("out-f16", put("out", lambda: sentinel((T, D), F16)), "out must have dtype"),
    ("out-noncontig", set_("out", noncontig), "out must have unit stride"),
    ("meta-out", set_("out", meta), "out"),
    ("meta-x", set_("x", meta), "out is on cpu but x is on meta"),
]

CASES = [p("hc_silu", i, o, m) for i, o, m in _INPUTS + _OUTPUTS] + [
    p("hc_silu_functional", i, o, m) for i, o, m in _INPUTS
]
DATA_ONLY: set[str] = set()
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
