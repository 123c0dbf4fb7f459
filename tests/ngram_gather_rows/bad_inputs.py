"""ngram_gather_rows' bad-input cases (run by test_bad_inputs.py on the CPU backends; its baseline
is captured by tests/test_cuda_graphs.py): OPS, its valid baseline (ngram_ids', into a table that
holds every id it hashes), its runner and the tensors it writes; CASES, derived from ngram_ids'
(tests/ngram_ids/bad_inputs.py) plus its own.
"""

from __future__ import annotations

import torch

from bad_inputs_support import p, put, sentinel
from ngram_ids import bad_inputs as ngram_ids_cases
from ngram_support import HASHING_ARGS
from qwen4exp_ext import ops


def fused_baseline() -> dict:
    """ngram_gather_rows on the n-gram baseline, into a table that holds every id it hashes."""
    a = ngram_ids_cases.ngram_baseline()
    a.pop("output")
    rows = ngram_ids_cases.NGRAM_HEADS.padded_rows
    a["table"] = torch.randn(rows, 6, generator=torch.Generator().manual_seed(5))
    a["output"] = sentinel((9, 4 * 6), torch.float32)
    return a


def run_fused(a, kernels=ops):
    hashing = [a.pop(k) for k in HASHING_ARGS]
    kernels.ngram_gather_rows(*hashing, a.pop("table"), **a)


OPS = {"ngram_gather_rows": (fused_baseline, run_fused, ("output",))}

# ngram_gather_rows checks its n-gram arguments with ngram_ids' own checks: every ngram_ids case
# but those of ngram_ids' output (the one override without a named argument among them is one)
# applies to it as it is (its table and output checks are gather_rows', tested in
# test_kernel.py).
CASES = [
    p("ngram_gather_rows", case.id.split("-", 1)[1], *case.values[1:])
    for case in ngram_ids_cases.CASES
    if getattr(case.values[1], "arg", "output") != "output"
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

# The cases derived from ngram_ids' DATA_ONLY ones: bad values that only the index data shows, not
# errors without debug checks on the backends that read indices on the device (skipped there, as
# ngram_ids' are; run there with and without debug checks by test_bad_inputs.py).
DATA_ONLY = {
    case.id
    for case in CASES
    if case.id.replace("ngram_gather_rows", "ngram_ids", 1) in ngram_ids_cases.DATA_ONLY
}
DATA_CASES = [case for case in CASES if case.id in DATA_ONLY]
