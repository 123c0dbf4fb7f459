"""``ngram_ids`` cases: the released model's first PLE layer over decode and prefill batches.

Decode batches are R = T requests of one token each, every request with its own random context;
prefill batches are long chunks with EOS tokens sprinkled in, so the document-boundary path runs.
T = 64 and T = 8192 as single prefill shapes are the sizes the acceptance criterion quotes.
"""

from __future__ import annotations

import torch

from qwen4exp_ext import layout, ops, reference
from qwen4exp_ext.bench.registry import Case

# Released config, SPEC.md §1.
VOCAB_SIZE = 248_320
NGRAM_SIZE = 3
HEADS_PER_NGRAM = 8
NGRAM_HEADS = (NGRAM_SIZE - 1) * HEADS_PER_NGRAM
SEED = 1234
NGRAM_VOCAB_SIZE_BASE = 20_000_000
PAD_TO = 128
LAYER_INDEX = 0
# Any in-vocabulary id serves: the hash costs the same whichever id marks a boundary.
EOS_TOKEN_ID = 248_044

INPUT_SEED = 0
DECODE_TOKENS = (1, 8, 64, 256)
PREFILL_SHAPES = ((64, 1), (8192, 4))  # (T, R), equal-length chunks
# About one document boundary per 256 tokens, so a 2048-token chunk crosses several.
PREFILL_EOS_RATE = 1 / 256


def cases(device: torch.device) -> list[Case]:
    """Decode T ∈ {1, 8, 64, 256} (R = T), then prefill T = 64 (R = 1) and T = 8192 (R = 4)."""
    head_layout = layout.head_vocab_layout(NGRAM_VOCAB_SIZE_BASE, NGRAM_HEADS, LAYER_INDEX, PAD_TO)
    constants = (
        torch.tensor(
            layout.layer_multipliers(VOCAB_SIZE, NGRAM_SIZE, SEED, LAYER_INDEX), dtype=torch.int64
        ),
        torch.tensor(head_layout.sizes, dtype=torch.int64),
        torch.tensor(head_layout.offsets, dtype=torch.int64),
    )
    shapes = [(f"decode_T{t}", t, t, 0.0) for t in DECODE_TOKENS] + [
        (f"prefill_T{t}_R{r}", t, r, PREFILL_EOS_RATE) for t, r in PREFILL_SHAPES
    ]
    return [
        _case(name, tokens, requests, eos_rate, constants, device)
        for name, tokens, requests, eos_rate in shapes
    ]


def _case(
    name: str,
    tokens: int,
    requests: int,
    eos_rate: float,
    constants: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    device: torch.device,
) -> Case:
    # Inputs are drawn on the CPU from a fixed seed, so every device hashes the same batch.
    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, VOCAB_SIZE, (tokens,), generator=gen, dtype=torch.int32)
    input_ids[torch.rand(tokens, generator=gen) < eos_rate] = EOS_TOKEN_ID
    ngram_context = torch.randint(
        0, VOCAB_SIZE, (requests, NGRAM_SIZE - 1), generator=gen, dtype=torch.int32
    )
    query_start_loc = torch.arange(0, tokens + 1, tokens // requests, dtype=torch.int32)
    # int32 ids, context and qsl are what vLLM's model runner hands the op.
    inputs = [t.to(device) for t in (input_ids, query_start_loc, ngram_context, *constants)]
    # Distinct sentinels: a kernel that writes nothing cannot match the reference by accident.
    out_ours = torch.full((tokens, NGRAM_HEADS), -1, dtype=torch.int64, device=device)
    out_ref = torch.full((tokens, NGRAM_HEADS), -2, dtype=torch.int64, device=device)
    args = (*inputs, EOS_TOKEN_ID, HEADS_PER_NGRAM)

    # Looked up at call time (not bound here), so a test can substitute a broken kernel.
    def ours() -> torch.Tensor:
        return ops.ngram_ids(*args, output=out_ours)

    def ref() -> torch.Tensor:
        return reference.ngram_ids(*args, output=out_ref)

    nbytes = sum(t.numel() * t.element_size() for t in (*inputs, out_ours))
    eos_count = int((input_ids == EOS_TOKEN_ID).sum())
    return Case(
        op="ngram_ids",
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=ours,
        ref=ref,
        params={"T": tokens, "R": requests, "eos_tokens": eos_count},
    )
