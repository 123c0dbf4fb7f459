"""``ngram_ids`` cases: the released model's first PLE layer over decode and prefill batches.

Decode batches are R = T requests of one token each, every request with its own random context;
prefill batches are long chunks with EOS tokens sprinkled in, so the document-boundary path runs.
T = 64 and T = 8192 as single prefill shapes are the sizes the acceptance criterion quotes.

Baseline ("transformers"): transformers 5.18's own hashing, ``Qwen4ExpTextNGramEmbedding.forward``
(modeling_qwen4_exp.py) of the released config, run as it is with its ``nn.Embedding`` swapped for
a module that hands the row ids back, so that only the hashing is timed. That forward has no
hash function of its own to call: the shifts, multiplies, XORs and remainders sit inline, and it
takes a padded [B, L] batch, not our flat varlen one. A user adapts as follows: the R requests of
a case have equal lengths, so the batch is [R, L]; each request's two context tokens (which
transformers would take from its cache, ``conv_states[2]``) are prepended to its chunk, with no
cache (the module then starts from EOS, which the prepended context follows), and the first
N-1 outputs of each row (those of the context tokens) are dropped. Its buffers (multipliers,
prime head sizes, offsets) are transformers' own, computed from the config, and the check
requires them, and its ids, to equal ours exactly. Decode R = 256 is then [256, 3]: the
baseline hashes three positions per token where ours hashes one (the context it needs anyway).

On a GPU with vLLM 0.33.0's source here, also vLLM's own Triton ``ple_ngram_ids`` (baseline
"vllm", into a preallocated output as its layer calls it; ``speedup_vs_vllm``), held to equal
ours exactly; on a CPU it is not timed (``registry.VLLM_CPU_NOTE``).

The oracle is ``reference.ngram_ids``; ours and the oracle write into preallocated outputs. Ours
gets the layer's modulo constants (``ops.ngram_head_divmod``), computed once per case as the
callers compute them once per layer.
"""

from __future__ import annotations

import torch

from qwen4exp_ext import layout, ops, reference
from qwen4exp_ext.bench.registry import Case, VllmKernels, vllm_kernels
from qwen4exp_ext.testing import exact_mismatch

# Released config, SPEC §1.
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
    hashing = _transformers_hashing(device)
    vllm = vllm_kernels(device)
    shapes = [(f"decode_T{t}", t, t, 0.0) for t in DECODE_TOKENS] + [
        (f"prefill_T{t}_R{r}", t, r, PREFILL_EOS_RATE) for t, r in PREFILL_SHAPES
    ]
    return [
        _case(name, tokens, requests, eos_rate, constants, hashing, vllm, device)
        for name, tokens, requests, eos_rate in shapes
    ]


class _RowIds(torch.nn.Module):
    """Stands in for the n-gram ``nn.Embedding``: returns the row ids it is asked to look up
    (``weight`` only tells the forward which device to send them to)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


def _transformers_hashing(device: torch.device) -> torch.nn.Module:
    """transformers' Qwen4ExpTextNGramEmbedding of the released layer 0, ids out."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    config = Qwen4ExpTextConfig(
        vocab_size=VOCAB_SIZE,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        ngram_vocab_size_base=NGRAM_VOCAB_SIZE_BASE,
        make_ngram_vocab_size_divisible_by=PAD_TO,
        seed=SEED,
        eos_token_id=EOS_TOKEN_ID,
    )
    # On the meta device the 320M-row embedding costs nothing; it is replaced below, and the
    # hashing buffers are rebuilt for real from the module's own recipe (and Python lists).
    with torch.device("meta"):
        module = Qwen4ExpTextNGramEmbedding(
            config, embedding_dim=NGRAM_HEADS, layer_idx=0, ple_layer_index=LAYER_INDEX
        )
    module.ngram_embedding = _RowIds(device)
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    module.layer_multipliers = hf._build_layer_multipliers(
        module.unigram_vocab_size, module.ngram_size, module.ple_layer_index, module.seed
    ).to(device)
    module.ngram_heads_vocab_sizes = torch.tensor(module.head_vocab_sizes, device=device)
    module.ngram_heads_offsets = torch.tensor(module.head_offsets, device=device)
    return module.eval()


def _case(
    name: str,
    tokens: int,
    requests: int,
    eos_rate: float,
    constants: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    hashing: torch.nn.Module,
    vllm: VllmKernels,
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
    out_vllm = torch.full((tokens, NGRAM_HEADS), -3, dtype=torch.int64, device=device)
    args = (*inputs, EOS_TOKEN_ID, HEADS_PER_NGRAM)
    # The layer's modulo constants, computed once as NGramEmbedding and the vLLM shim do.
    head_divmod = ops.ngram_head_divmod(inputs[4])
    # transformers' input: each request's context, then its chunk, one row per request.
    batch = torch.cat((ngram_context, input_ids.view(requests, -1)), dim=1).to(device)
    context_len = NGRAM_SIZE - 1

    # Looked up at call time (not bound here), so a test can substitute a broken kernel.
    def ours() -> torch.Tensor:
        return ops.ngram_ids(*args, output=out_ours, head_divmod=head_divmod)

    def oracle() -> torch.Tensor:
        return reference.ngram_ids(*args, output=out_ref)

    @torch.no_grad()
    def transformers() -> torch.Tensor:
        ids = hashing(batch, None)  # [R, N-1 + L, NH] flattened to [R, (N-1 + L)·NH]
        return ids.view(requests, -1, NGRAM_HEADS)[:, context_len:].reshape(tokens, NGRAM_HEADS)

    baselines = {"transformers": transformers}
    vllm_ids = vllm.op("ple_ngram_ids")
    if vllm_ids is not None:
        baselines["vllm"] = lambda: vllm_ids(*args, output=out_vllm)

    def check() -> str | None:
        theirs = (
            hashing.layer_multipliers,
            hashing.ngram_heads_vocab_sizes,
            hashing.ngram_heads_offsets,
        )
        names = ("multipliers", "head sizes", "offsets")
        for what, mine, hf in zip(names, inputs[3:], theirs, strict=True):
            if not torch.equal(mine, hf.to(mine)):
                return f"{what}: ours {mine.tolist()}, transformers {hf.tolist()}"
        got = ours().clone()
        problem = exact_mismatch(got, oracle(), "ids", against="the oracle")
        for who, fn in baselines.items():
            problem = problem or exact_mismatch(got, fn(), "ids", against=who)
        return problem

    nbytes = sum(t.numel() * t.element_size() for t in (*inputs, head_divmod, out_ours))
    eos_count = int((input_ids == EOS_TOKEN_ID).sum())
    return Case(
        op="ngram_ids",
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=ours,
        oracle=oracle,
        baselines=baselines,
        params={"T": tokens, "R": requests, "eos_tokens": eos_count},
        check=check,
        **vllm.case_fields("vllm" if vllm_ids is not None else None),
    )
