"""hc_down_silu_inject's bad-input cases (run by test_bad_inputs.py), with the generic kit of
tests/bad_inputs_support.py: the valid baseline, with out= and without, with and without w_inj,
and one override per case with the message it must give. No index data: DATA_ONLY is empty."""

from __future__ import annotations

import torch

from bad_inputs_support import F16, I32, meta, noncontig, p, put, sentinel, set_
from qwen4exp_ext import ops

T, HC, H, R = 3, 2, 8, 5


def baseline() -> dict:
    g = torch.Generator().manual_seed(3)
    return dict(
        xn=torch.randn(T, HC * H, generator=g),
        w_down=torch.randn(R, HC * H, generator=g),
        w_inj=torch.randn(HC, HC * H, generator=g),
        hc_count=HC,
        lowrank=sentinel((T, R), torch.float32),
        logits=sentinel((T, HC), torch.float32),
    )


def _call(a, kernels, **kw):
    kernels.hc_down_silu_inject(
        a.pop("xn"), a.pop("w_down"), a.pop("w_inj"), a.pop("hc_count"), **kw
    )


def run(a, kernels=ops):
    _call(a, kernels, out=(a.pop("lowrank"), a.pop("logits")))


def run_functional(a, kernels=ops):
    a.pop("lowrank"), a.pop("logits")
    _call(a, kernels)


def baseline_no_inject() -> dict:
    a = baseline()
    a.update(w_inj=None, logits=None)
    return a


def run_no_inject(a, kernels=ops):
    a.pop("logits")
    _call(a, kernels, out=(a.pop("lowrank"), None))


OPS = {
    "hc_down_silu_inject": (baseline, run, ("lowrank", "logits")),
    "hc_down_silu_inject_functional": (baseline, run_functional, ()),
    # No w_inj (vLLM's NVIDIA module): out=(lowrank, None).
    "hc_down_silu_inject_no_inject": (baseline_no_inject, run_no_inject, ("lowrank",)),
}


def _no_depth(a):
    a.update(xn=a["xn"][:, :0], w_down=a["w_down"][:, :0], w_inj=a["w_inj"][:, :0])


_no_depth.arg = "xn"

_INPUTS = [
    ("xn-int", set_("xn", lambda t: t.to(I32)), "xn must be float32"),
    ("xn-3d", set_("xn", lambda t: t.unsqueeze(0)), "xn must be 2-D"),
    ("xn-noncontig", set_("xn", noncontig), "xn must have unit stride"),
    ("xn-depth-0", _no_depth, "positive multiple"),
    ("w_down-f16", set_("w_down", lambda t: t.to(F16)), "w_down must have xn's dtype"),
    ("w_down-transposed", set_("w_down", lambda t: t.t().contiguous().t()), "w_down must have"),
    ("w_down-cols", set_("w_down", lambda t: t[:, :-1]), r"w_down must be \[R, HC·H\]"),
    ("w_down-no-rows", set_("w_down", lambda t: t[:0]), r"w_down must be \[R, HC·H\]"),
    ("w_inj-f16", set_("w_inj", lambda t: t.to(F16)), "w_inj must have xn's dtype"),
    ("w_inj-rows", set_("w_inj", lambda t: t[:1]), r"w_inj must be \[hc_count, HC·H\]"),
    ("w_inj-cols", set_("w_inj", lambda t: t[:, :-2]), r"w_inj must be \[hc_count, HC·H\]"),
    ("w_inj-noncontig", set_("w_inj", noncontig), "w_inj must have unit stride"),
    ("hc_count-0", put("hc_count", 0), "hc_count must be in"),
    ("hc_count-3", put("hc_count", 3), "multiple of hc_count"),
    ("hc_count-huge", put("hc_count", 2**40), "hc_count must be in"),
    ("meta-xn", set_("xn", meta), "xn"),
    ("meta-w_down", set_("w_down", meta), "w_down"),
    ("meta-w_inj", set_("w_inj", meta), "w_inj"),
]
_OUTPUTS = [
    (
        "lowrank-shape",
        put("lowrank", lambda: sentinel((T, R + 1), torch.float32)),
        "lowrank must be",
    ),
    ("lowrank-f16", put("lowrank", lambda: sentinel((T, R), F16)), "lowrank must have dtype"),
    ("lowrank-noncontig", set_("lowrank", noncontig), "lowrank must have unit stride"),
    ("logits-shape", put("logits", lambda: sentinel((T, HC + 1), torch.float32)), "logits must be"),
    (
        "logits-overlapping",
        put("logits", lambda: sentinel((1, HC), torch.float32).expand(T, -1)),
        "must not overlap",
    ),
    ("meta-lowrank", set_("lowrank", meta), "lowrank"),
]


def _logits_without_inject(a):
    a["w_inj"] = None


_logits_without_inject.arg = "w_inj"

CASES = (
    [p("hc_down_silu_inject", i, o, m) for i, o, m in _INPUTS + _OUTPUTS]
    + [p("hc_down_silu_inject_functional", i, o, m) for i, o, m in _INPUTS]
    + [
        p(
            "hc_down_silu_inject",
            "logits-without-w_inj",
            _logits_without_inject,
            "logits must be given exactly when w_inj is",
        ),
        p(
            "hc_down_silu_inject_no_inject",
            "w_inj-without-logits",
            put("w_inj", lambda: torch.randn(HC, HC * H)),
            "logits must be given exactly when w_inj is",
        ),
    ]
)
DATA_ONLY: set[str] = set()
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
