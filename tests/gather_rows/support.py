"""What the gather_rows tests share (test_kernel.py, test_properties.py, test_bad_inputs.py): ids
with out-of-range values and the CPU-path fixture. The helpers that tests/ngram_gather_rows/ and
the fuzzing share too (make_table, the CPU switches, the grid-cap sizes) are in
tests/gather_support.py."""

from __future__ import annotations

import pytest
import torch

from gather_support import CPU_PATHS, cpu_gather_path

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.fixture(params=CPU_PATHS)
def cpu_path(request):
    """The test once per CPU gather path (GPU cases once: the switch is CPU-only); a module runs
    all of its tests so with ``pytestmark = pytest.mark.usefixtures("cpu_path")``."""
    callspec = getattr(request.node, "callspec", None)
    backend = callspec.params.get("backend") if callspec else None
    if backend is not None and backend.name != "cpu" and request.param != "cached":
        pytest.skip("the CPU gather path applies to the CPU kernel only")
    with cpu_gather_path(request.param):
        yield request.param


def random_ids(num_tokens: int, num_heads: int, rows: int, dtype, gen=None) -> torch.Tensor:
    """Mostly valid rows, plus ids just outside and far outside the table (never errors)."""
    ids = torch.randint(0, max(rows, 1), (num_tokens, num_heads), generator=gen)
    specials = torch.tensor([-1, rows, rows + 1, -(2**31), 2**31 - 1, 0, max(rows - 1, 0)])
    if dtype == torch.int64:
        specials = torch.cat([specials, torch.tensor([INT64_MIN, INT64_MAX, 2**40])])
    mask = torch.rand(num_tokens, num_heads, generator=gen) < 0.1
    picks = specials[torch.randint(0, specials.numel(), (num_tokens, num_heads), generator=gen)]
    return torch.where(mask, picks, ids).to(dtype)
