"""hc_combine's bad-input cases: tests/hc_combine_norm/bad_inputs.py's table, with the cases of
the combine's arguments only (no norm weight, eps or xn)."""

from __future__ import annotations

from hc_combine_norm.bad_inputs import OPS as _ALL_OPS
from hc_combine_norm.bad_inputs import cases_of

OPS = {
    name: spec
    for name, spec in _ALL_OPS.items()
    if name.startswith("hc_combine_functional") or name == "hc_combine"
}
CASES = cases_of(norm=False)
DATA_ONLY: set[str] = set()
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
