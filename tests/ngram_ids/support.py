"""What the ngram_ids tests share: the hash constants of a layer as tensors (Layout), model and
random layouts, random varlen batches, the oracle-vs-backend driver, the SPEC §3 toy layer."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from qwen4exp_ext import layout, reference


@dataclass
class Layout:
    """The hash constants of one layer, as the tensors the op takes."""

    multipliers: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor
    heads_per_ngram: int
    eos: int

    @property
    def context_len(self) -> int:
        return self.multipliers.numel() - 1

    def to(self, device: str) -> Layout:
        return Layout(
            self.multipliers.to(device),
            self.sizes.to(device),
            self.offsets.to(device),
            self.heads_per_ngram,
            self.eos,
        )

    def args(self):
        return self.multipliers, self.sizes, self.offsets, self.eos, self.heads_per_ngram


def model_layout(vocab, ngram_size, heads_per_ngram, base, seed, layer_index, eos) -> Layout:
    nh = (ngram_size - 1) * heads_per_ngram
    heads = layout.head_vocab_layout(base, nh, layer_index, 128)
    return Layout(
        torch.tensor(layout.layer_multipliers(vocab, ngram_size, seed, layer_index)),
        torch.tensor(heads.sizes),
        torch.tensor(heads.offsets),
        heads_per_ngram,
        eos,
    )


def random_layout(rng: random.Random, ngram_size: int, heads_per_ngram: int) -> Layout:
    """Arbitrary int64 constants: multipliers over the full signed range (checkpoints may ship
    any), sizes from 1 to 2^62, so wrap-around and negative mixes are exercised."""
    nh = (ngram_size - 1) * heads_per_ngram
    multipliers = [rng.randint(-(2**63), 2**63 - 1) for _ in range(ngram_size)]
    sizes = [rng.choice([1, 2, 3, 1009, 2**31 - 1, 2**32 + 15, 2**62]) for _ in range(nh)]
    sizes = [s if rng.random() < 0.5 else rng.randint(1, 2**40) for s in sizes]
    sizes = [min(s, 2**62 // nh) for s in sizes]  # the offsets' prefix sum must fit in int64
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += s
    return Layout(
        torch.tensor(multipliers),
        torch.tensor(sizes),
        torch.tensor(offsets),
        heads_per_ngram,
        rng.randint(0, 20),
    )


def random_batch(rng: random.Random, lay: Layout, id_dtype, vocab: int):
    """A varlen batch: R requests (0..6) of 0..40 tokens, sometimes with tail tokens past qsl[R]."""
    num_requests = rng.randint(0, 6)
    lengths = [rng.choice([0, 1, 1, 2, 3, rng.randint(0, 40)]) for _ in range(num_requests)]
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    tail = rng.choice([0, 0, 0, rng.randint(1, 3)])
    total = qsl[-1] + tail

    def token():  # small vocabularies repeat and hit EOS often; large ones reach the int range
        return lay.eos if rng.random() < 0.15 else rng.randint(0, vocab - 1)

    input_ids = torch.tensor([token() for _ in range(total)], dtype=id_dtype)
    context = torch.tensor(
        [[token() for _ in range(lay.context_len)] for _ in range(num_requests)], dtype=id_dtype
    ).reshape(num_requests, lay.context_len)
    return input_ids, torch.tensor(qsl, dtype=torch.int32), context


def run_both(backend, input_ids, qsl, context, lay: Layout, out_dtype=torch.int64):
    """(ours on `backend`, reference on CPU)."""
    device = backend.device
    expected = reference.ngram_ids(input_ids, qsl, context, *lay.args())
    dev_lay = lay.to(device)
    out = torch.full((input_ids.numel(), expected.shape[1]), -7, dtype=out_dtype, device=device)
    got = backend.ops.ngram_ids(
        input_ids.to(device), qsl.to(device), context.to(device), *dev_lay.args(), output=out
    )
    assert got.data_ptr() == out.data_ptr()
    return got.cpu(), expected


TOY = model_layout(
    vocab=128, ngram_size=3, heads_per_ngram=2, base=1000, seed=42, layer_index=0, eos=7
)
