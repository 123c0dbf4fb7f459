"""gather_rows' properties that SPEC §4 states, on the oracle and on every kernel backend
(backends(oracle=True)): ids out of the table or the shard give +0 rows and never an error, and
ranks owning consecutive vocabulary ranges sum exactly to the unsharded lookup."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import backends
from gather_support import make_table
from qwen4exp_ext import reference
from qwen4exp_ext.testing import assert_exact, bit_patterns

from .support import INT64_MAX, INT64_MIN, cpu_path, random_ids  # noqa: F401 - cpu_path: fixture

pytestmark = pytest.mark.usefixtures("cpu_path")  # every test once per CPU gather path

BACKENDS = backends(oracle=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
def test_out_of_range_ids_give_positive_zero_rows(backend):
    ops, device = backend.ops, backend.device
    table = make_table(50, 8, torch.bfloat16).to(device)
    ids = torch.tensor([[-1, 50, INT64_MIN, INT64_MAX, 49, 0]], device=device)
    got = ops.gather_rows(table, ids).cpu().view(6, 8)
    assert torch.all(bit_patterns(got[:4]) == 0)
    assert torch.equal(got[4:], table[[49, 0]].cpu())
    # The same ids against a shard that owns [10, 20): only 10..19 are read.
    shard = ops.gather_rows(
        table[:10], torch.tensor([[9, 10, 19, 20]], device=device), vocab_start=10, vocab_end=20
    )
    expected = torch.cat(
        [torch.zeros(8), table[0].cpu().float(), table[9].cpu().float(), torch.zeros(8)]
    ).to(torch.bfloat16)
    assert_exact(shard[0], expected, bitwise=True)


@pytest.mark.parametrize("backend", BACKENDS, ids=str)
@pytest.mark.parametrize(
    "table_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str
)
@given(
    shape=st.sampled_from([(97, 12, 11), (50, 4, 9)]),  # (rows, d, T), NH = 4
    cuts=st.lists(st.integers(0, 97), max_size=4),
    padding=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**16),
)
# Five ranks, one of them owning no id, each rank's table padded past its range.
@example(shape=(50, 4, 9), cuts=[13, 13, 40], padding=3, seed=4)
def test_shard_outputs_sum_to_the_whole(backend, table_dtype, shape, cuts, padding, seed):
    """SPEC §4: ranks owning consecutive vocabulary ranges, each gathering from its own slice,
    sum exactly to the unsharded lookup (every element has one owner; the rest add +0). Each
    rank's part is +0 wherever it does not own the id, and with ``padding`` its table has rows
    past its range (as a rank's padded shard does) that must never be read. A -0 element sums to
    +0 (SPEC's one exception), so the whole is compared with its -0 made +0."""
    ops, device = backend.ops, backend.device
    rows, width, tokens = shape
    gen = torch.Generator().manual_seed(seed)
    table = make_table(rows, width, table_dtype, gen=gen)
    scale = torch.tensor(1.5, device=device) if table_dtype in reference.FP8_DTYPES else None
    ids = random_ids(tokens, 4, rows, torch.int64, gen).to(device)
    bounds = [0, *sorted(min(cut, rows) for cut in cuts), rows]
    whole = ops.gather_rows(table.to(device), ids, scale=scale)
    total = torch.zeros(tokens, 4 * width, dtype=torch.float32, device=device)
    for start, end in itertools.pairwise(bounds):
        pad = torch.full((padding, width), 99.0).to(table_dtype)
        local = torch.cat([table[start:end], pad]).to(device)
        part = ops.gather_rows(local, ids, scale=scale, vocab_start=start, vocab_end=end)
        owned = ((ids >= start) & (ids < end)).repeat_interleave(width, dim=1)
        assert bool((part[~owned] == 0).all())
        total += part.float()
    assert_exact(total.to(whole.dtype), whole + 0.0, bitwise=True)
