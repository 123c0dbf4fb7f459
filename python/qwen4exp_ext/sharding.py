"""Vocabulary sharding of the PLE table across ranks (SPEC §4).

Rank r of W owns the global rows [start_r, end_r) of the padded table (contiguous, equal blocks
of ceil(rows / W), the last one shorter) and gathers with ``vocab_start=start_r,
vocab_end=end_r``: its output holds the rows it owns and zeros elsewhere. Every element has
exactly one owner, so summing the W partial outputs — in any order, in any float dtype, fp8
bytes excepted — is exact and equals the unsharded lookup:

- :func:`all_reduce_embeddings`: every rank gets all T tokens (tensor parallelism);
- :func:`reduce_scatter_embeddings`: rank r gets its contiguous 1/W of the tokens (sequence
  parallelism), for half the traffic of an all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_embeddings", "reduce_scatter_embeddings", "shard_bounds"]


def shard_bounds(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the global rows rank ``rank`` of ``world_size`` owns."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if rows < 0:
        raise ValueError(f"rows must be non-negative, got {rows}")
    per_rank = -(-rows // world_size)
    start = min(rows, rank * per_rank)
    return start, min(rows, start + per_rank)


def all_reduce_embeddings(partial: torch.Tensor, group: dist.ProcessGroup | None = None):
    """Sums the ranks' partial lookups in place; returns ``partial`` (now the full lookup)."""
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    return partial


def reduce_scatter_embeddings(partial: torch.Tensor, group: dist.ProcessGroup | None = None):
    """Sums the ranks' partial lookups [T, D] and returns this rank's token shard: rows
    [r·ceil(T/W), (r+1)·ceil(T/W)) of the full lookup (the last shard is shorter, possibly
    empty), as ``sp_shard`` cuts a sequence."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    tokens = partial.shape[0]
    per_rank = -(-tokens // world)
    padded = partial
    if per_rank * world != tokens:
        padded = partial.new_zeros((per_rank * world, *partial.shape[1:]))
        padded[:tokens] = partial
    out = partial.new_empty((per_rank, *partial.shape[1:]))
    try:
        dist.reduce_scatter_tensor(out, padded.contiguous(), op=dist.ReduceOp.SUM, group=group)
    except (RuntimeError, NotImplementedError):
        # Backends without reduce_scatter (older gloo): same result from an all-reduce.
        full = padded.contiguous().clone()
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
        out.copy_(full[rank * per_rank : (rank + 1) * per_rank])
    start = min(tokens, rank * per_rank)
    return out[: min(tokens, start + per_rank) - start]
