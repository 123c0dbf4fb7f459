"""What the ngram_gather_rows tests share: a batch's n-gram arguments and the table rows its layout
spans, the oracle's composition (reference.ngram_ids, then reference.gather_rows) and the call of a
backend's op."""

from __future__ import annotations

import torch

from ngram_support import HASHING_ARGS
from qwen4exp_ext import layout, reference

VOCAB, EOS, SEED = 97, 5, 7


def make_batch(ngram_size: int, heads_per_ngram: int, lengths: list[int], gen, device):
    """The n-gram arguments of one batch: requests of `lengths` tokens (EOS inside), their
    contexts, the layer's constants; and the table rows the layout spans."""
    num_heads = (ngram_size - 1) * heads_per_ngram
    heads = layout.head_vocab_layout(60, num_heads, 1, 8)
    input_ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    input_ids[torch.rand(input_ids.shape, generator=gen) < 0.1] = EOS
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    context = torch.randint(0, VOCAB, (len(lengths), ngram_size - 1), generator=gen)
    args = dict(
        input_ids=input_ids,
        query_start_loc=starts,
        ngram_context=context,
        layer_multipliers=torch.tensor(layout.layer_multipliers(VOCAB, ngram_size, SEED, 1)),
        ngram_heads_vocab_sizes=torch.tensor(heads.sizes),
        ngram_heads_offsets=torch.tensor(heads.offsets),
        eos_token_id=EOS,
        heads_per_ngram=heads_per_ngram,
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}, (
        heads.padded_rows
    )


def expected(args: dict, table, **gather) -> torch.Tensor:
    """The oracle's composition, on the CPU."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    ids = reference.ngram_ids(**cpu)
    gather = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in gather.items()}
    return reference.gather_rows(table.cpu(), ids, **gather)


def call(backend, args: dict, table, **gather) -> torch.Tensor:
    a = dict(args)
    positional = [a.pop(k) for k in HASHING_ARGS]
    return backend.ops.ngram_gather_rows(*positional, table, **a, **gather)
