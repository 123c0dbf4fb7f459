"""hc_up_gate_mix's bad-input cases (run by test_bad_inputs.py), with the generic kit of
tests/bad_inputs_support.py: the valid baseline, with out= and without, and one override per case
with the message it must give. No index data: DATA_ONLY is empty."""

from __future__ import annotations

import torch

from bad_inputs_support import F16, I32, meta, noncontig, p, put, sentinel, set_
from qwen4exp_ext import ops

T, HC, H, R = 3, 2, 8, 5


def baseline() -> dict:
    g = torch.Generator().manual_seed(2)
    return dict(
        lowrank=torch.randn(T, R, generator=g),
        w_up=torch.randn(HC * H, R, generator=g),
        xn=torch.randn(T, HC * H, generator=g),
        hc_count=HC,
        out=sentinel((T, H), torch.float32),
    )


def _call(a, kernels, **kw):
    kernels.hc_up_gate_mix(a.pop("lowrank"), a.pop("w_up"), a.pop("xn"), a.pop("hc_count"), **kw)


def run(a, kernels=ops):
    _call(a, kernels, out=a.pop("out"))


def run_functional(a, kernels=ops):
    a.pop("out")
    _call(a, kernels)


OPS = {
    "hc_up_gate_mix": (baseline, run, ("out",)),
    "hc_up_gate_mix_functional": (baseline, run_functional, ()),
}


def _no_rank(a):
    a.update(lowrank=a["lowrank"][:, :0], w_up=a["w_up"][:, :0])


_no_rank.arg = "lowrank"

_INPUTS = [
    ("lowrank-int", set_("lowrank", lambda t: t.to(I32)), "lowrank must be float32"),
    ("lowrank-3d", set_("lowrank", lambda t: t.unsqueeze(0)), "lowrank must be 2-D"),
    ("lowrank-noncontig", set_("lowrank", noncontig), "lowrank must have unit stride"),
    ("lowrank-rows", set_("lowrank", lambda t: t[:2]), "xn must have lowrank's"),
    ("lowrank-rank-0", _no_rank, "R must be in"),
    ("w_up-f16", set_("w_up", lambda t: t.to(F16)), "w_up must have lowrank's dtype"),
    ("w_up-transposed", set_("w_up", lambda t: t.t().contiguous().t()), "w_up must have unit"),
    ("w_up-rows", set_("w_up", lambda t: t[:-1]), r"w_up must be \[HC·H, R\]"),
    ("w_up-cols", set_("w_up", lambda t: t[:, :-1]), r"w_up must be \[HC·H, R\]"),
    ("xn-f16", set_("xn", lambda t: t.to(F16)), "xn must have lowrank's dtype"),
    ("xn-noncontig", set_("xn", noncontig), "xn must have unit stride"),
    ("xn-1d", set_("xn", lambda t: t[0]), "xn must be 2-D"),
    ("hc_count-0", put("hc_count", 0), "hc_count must be in"),
    ("hc_count-3", put("hc_count", 3), "multiple of hc_count"),
    ("hc_count-huge", put("hc_count", 2**40), "hc_count must be in"),
    ("meta-lowrank", set_("lowrank", meta), "lowrank"),
    ("meta-w_up", set_("w_up", meta), "w_up"),
    ("meta-xn", set_("xn", meta), "xn"),
]
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

CASES = [p("hc_up_gate_mix", i, o, m) for i, o, m in _INPUTS + _OUTPUTS] + [
    p("hc_up_gate_mix_functional", i, o, m) for i, o, m in _INPUTS
]
DATA_ONLY: set[str] = set()
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
