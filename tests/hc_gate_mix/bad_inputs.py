"""hc_gate_mix's bad-input cases (run by test_bad_inputs.py), with the generic kit of
tests/bad_inputs_support.py: the valid baseline, with out= and without, and one override per case
with the message it must give. No index data: DATA_ONLY is empty."""

from __future__ import annotations

import torch

from bad_inputs_support import F16, I32, meta, noncontig, p, put, sentinel, set_
from qwen4exp_ext import ops

T, HC, H = 3, 2, 8


def baseline() -> dict:
    g = torch.Generator().manual_seed(2)
    return dict(
        x=torch.randn(T, HC * H, generator=g),
        gate=torch.randn(T, HC * H, generator=g),
        hc_count=HC,
        out=sentinel((T, H), torch.float32),
    )


def run(a, kernels=ops):
    kernels.hc_gate_mix(a.pop("x"), a.pop("gate"), a.pop("hc_count"), out=a.pop("out"))


def run_functional(a, kernels=ops):
    a.pop("out")
    kernels.hc_gate_mix(a.pop("x"), a.pop("gate"), a.pop("hc_count"))


OPS = {
    "hc_gate_mix": (baseline, run, ("out",)),
    "hc_gate_mix_functional": (baseline, run_functional, ()),
}

_INPUTS = [
    ("x-int", set_("x", lambda t: t.to(I32)), "x must be float32"),
    ("x-3d", set_("x", lambda t: t.unsqueeze(0)), "x must be 2-D"),
    ("x-noncontig", set_("x", noncontig), "x must have unit stride"),
    ("gate-f16", set_("gate", lambda t: t.to(F16)), "gate must have x's dtype"),
    ("gate-shape", set_("gate", lambda t: t[:, :8]), "gate must have x's shape"),
    ("gate-rows", set_("gate", lambda t: t[:2]), "gate must have x's shape"),
    ("gate-noncontig", set_("gate", noncontig), "gate must have unit stride"),
    ("hc_count-0", put("hc_count", 0), "hc_count must be in"),
    ("hc_count-3", put("hc_count", 3), "multiple of hc_count"),
    ("hc_count-huge", put("hc_count", 2**40), "hc_count must be in"),
    ("x-width-0", lambda a: a.update(x=a["x"][:, :0], gate=a["gate"][:, :0]), "positive multiple"),
    ("meta-x", set_("x", meta), "x"),
    ("meta-gate", set_("gate", meta), "gate"),
]
_INPUTS[10][1].arg = "x"
_OUTPUTS = [
    ("out-shape", put("out", lambda: sentinel((T, H + 1), torch.float32)), r"out must be"),
    ("out-f16", put("out", lambda: sentinel((T, H), F16)), "out must have dtype"),
    ("out-noncontig", set_("out", noncontig), "out must have unit stride"),
    (
        "out-overlapping",
        put("out", lambda: sentinel((1, H), torch.float32).expand(T, -1)),
        "must not overlap",
    ),
    ("meta-out", set_("out", meta), "out"),
]

CASES = [p("hc_gate_mix", i, o, m) for i, o, m in _INPUTS + _OUTPUTS] + [
    p("hc_gate_mix_functional", i, o, m) for i, o, m in _INPUTS
]
DATA_ONLY: set[str] = set()
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
