"""Vocabulary sharding (SPEC §4): shard bounds, and two CPU processes (gloo) whose sharded
lookups, all-reduced or reduce-scattered, equal the unsharded lookup exactly."""

from __future__ import annotations

import itertools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ngram_support import CONFIG  # the toy n-gram config the layer tests share
from qwen4exp_ext import sharding

WORLD = 2


@pytest.mark.parametrize("rows,world", [(10, 3), (320, 2), (7, 7), (5, 8), (0, 2)])
def test_shard_bounds_partition_the_rows(rows, world):
    bounds = [sharding.shard_bounds(rows, r, world) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    for (_, end), (start, _) in itertools.pairwise(bounds):
        assert end == start
    assert all(0 <= s <= e for s, e in bounds)


def test_shard_bounds_errors():
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        sharding.shard_bounds(10, 2, 2)


def _inputs():
    gen = torch.Generator().manual_seed(11)
    input_ids = torch.randint(0, 97, (13,), generator=gen)
    input_ids[4] = 5
    qsl = torch.tensor([0, 6, 13], dtype=torch.int32)
    context = torch.randint(0, 97, (2, 2), generator=gen)
    return input_ids, qsl, context


def _table(rows: int, width: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)


def _worker(rank: int, init_file: str, result_dir: str) -> None:
    from qwen4exp_ext.layers import NGramEmbedding

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for reduce in ("all_reduce", "reduce_scatter"):
            m = NGramEmbedding(
                CONFIG, layer_index=1, placement="cpu", shard=(rank, WORLD), reduce=reduce
            )
            table = _table(m.num_rows, m.head_dim)
            size = -(-m.num_rows // 7)
            m.load_weights(
                (f"ngram_embedding.shard_{i}.weight", table[i * size : (i + 1) * size])
                for i in range(7)
            )
            results[reduce] = m(*_inputs())
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_the_unsharded_lookup():
    from qwen4exp_ext.layers import NGramEmbedding

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(init_file, tmp), nprocs=WORLD, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]

    full = NGramEmbedding(CONFIG, layer_index=1, placement="cpu")
    table = _table(full.num_rows, full.head_dim)
    with torch.no_grad():
        full.weight.copy_(table)
    expected = full(*_inputs())
    assert expected.abs().sum() > 0
    per_rank = -(-expected.shape[0] // WORLD)
    for rank, got in enumerate(results):
        assert torch.equal(got["all_reduce"], expected)
        assert torch.equal(got["reduce_scatter"], expected[rank * per_rank : (rank + 1) * per_rank])
