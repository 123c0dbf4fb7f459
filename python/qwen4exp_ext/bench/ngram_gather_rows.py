"""``ngram_gather_rows`` cases: the fused op against the two ops it replaces, ``ngram_ids`` then
``gather_rows`` through an ids tensor (the ``two_ops`` baseline, what ``NGramEmbedding`` runs
without it: the fused op is worth keeping only where it wins this race).

The released hashing (N = 3, 16 heads, vocabulary and seeds of SPEC §1) into a bf16 table of d =
160 whose head sizes are scaled down so that it has QWEN4EXP_BENCH_GATHER_ROWS rows (the gather
bench's default: 4M on a CPU, 16M on a GPU) and every hashed id is one of its rows. Decode
batches are R = T requests of one token, prefill T = 8192 in R = 4 chunks with EOS tokens in
them; each call, whichever contender makes it, takes the next of several input batches, together
COLD_BYTES of rows, so that its rows are not still cached from an earlier call. The oracle is
reference.ngram_ids then reference.gather_rows; every contender must equal it exactly.

On a GPU with vLLM 0.33.0's source here, also what vLLM runs for these two steps (baseline
"vllm", for ``speedup_vs_vllm``): its Triton ``ple_ngram_ids`` into a preallocated ids buffer,
then its device table's lookup, ``F.embedding`` (``Qwen4ExpPLEDeviceEmbedding``, bf16); on a CPU
it is not timed (``registry.VLLM_CPU_NOTE``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen4exp_ext import layout, ops, reference
from qwen4exp_ext.bench.gather_rows import COLD_BYTES, HEAD_DIM, table_rows
from qwen4exp_ext.bench.ngram_ids import (
    EOS_TOKEN_ID,
    HEADS_PER_NGRAM,
    LAYER_INDEX,
    NGRAM_HEADS,
    NGRAM_SIZE,
    SEED,
    VOCAB_SIZE,
)
from qwen4exp_ext.bench.registry import Case, VllmKernels, vllm_kernels

INPUT_SEED = 0
DECODE_TOKENS = (1, 8, 64, 256)
PREFILL_TOKENS, PREFILL_REQUESTS = 8192, 4
PREFILL_EOS_RATE = 1 / 256
PAD_TO = 128


def cases(device: torch.device) -> list[Case]:
    rows = table_rows(device)
    heads = layout.head_vocab_layout(rows // NGRAM_HEADS - PAD_TO, NGRAM_HEADS, LAYER_INDEX, PAD_TO)
    gen = torch.Generator().manual_seed(INPUT_SEED)
    raw = torch.randint(
        0, 0x70, (heads.padded_rows, HEAD_DIM * 2), dtype=torch.uint8, generator=gen
    )
    table = raw.view(torch.bfloat16).to(device)
    del raw
    constants = [
        torch.tensor(layout.layer_multipliers(VOCAB_SIZE, NGRAM_SIZE, SEED, LAYER_INDEX)),
        torch.tensor(heads.sizes),
        torch.tensor(heads.offsets),
    ]
    constants = [t.to(device) for t in constants]
    head_divmod = ops.ngram_head_divmod(constants[1])
    vllm = vllm_kernels(device)
    shapes = [(f"decode_T{t}", t, t, 0.0) for t in DECODE_TOKENS]
    shapes.append(
        (
            f"prefill_T{PREFILL_TOKENS}_R{PREFILL_REQUESTS}",
            PREFILL_TOKENS,
            PREFILL_REQUESTS,
            PREFILL_EOS_RATE,
        )
    )
    return [
        _case(name, tokens, requests, eos_rate, table, constants, head_divmod, gen, vllm, device)
        for name, tokens, requests, eos_rate in shapes
    ]


def _case(
    name: str,
    tokens: int,
    requests: int,
    eos_rate: float,
    table: torch.Tensor,
    constants: list[torch.Tensor],
    head_divmod: torch.Tensor,
    gen: torch.Generator,
    vllm: VllmKernels,
    device: torch.device,
) -> Case:
    row_bytes = table.shape[1] * table.element_size()
    batches = max(2, -(-COLD_BYTES // (tokens * NGRAM_HEADS * row_bytes)))
    input_ids = torch.randint(0, VOCAB_SIZE, (batches, tokens), generator=gen, dtype=torch.int32)
    input_ids[torch.rand(batches, tokens, generator=gen) < eos_rate] = EOS_TOKEN_ID
    contexts = torch.randint(
        0, VOCAB_SIZE, (batches, requests, NGRAM_SIZE - 1), generator=gen, dtype=torch.int32
    )
    input_ids, contexts = input_ids.to(device), contexts.to(device)
    query_start_loc = torch.arange(0, tokens + 1, tokens // requests, dtype=torch.int32).to(device)
    width = NGRAM_HEADS * table.shape[1]
    out = {
        who: torch.empty(tokens, width, dtype=table.dtype, device=device)
        for who in ("ours", "two_ops", "oracle")
    }
    ids = torch.empty(tokens, NGRAM_HEADS, dtype=torch.int64, device=device)
    vllm_ids = torch.empty(tokens, NGRAM_HEADS, dtype=torch.int64, device=device)
    # One cursor for every contender, as in the gather's cases: each call hashes the next batch,
    # so no call finds its rows cached by the call before it (which would be another contender).
    cursor = [0]

    def batch() -> tuple:
        i = cursor[0]
        cursor[0] = (cursor[0] + 1) % batches
        return (input_ids[i], query_start_loc, contexts[i], *constants)

    # Looked up at call time (not bound here), so a test can substitute a broken kernel.
    def ours() -> torch.Tensor:
        return ops.ngram_gather_rows(
            *batch(),
            EOS_TOKEN_ID,
            HEADS_PER_NGRAM,
            table,
            head_divmod=head_divmod,
            output=out["ours"],
        )

    def two_ops() -> torch.Tensor:
        ops.ngram_ids(*batch(), EOS_TOKEN_ID, HEADS_PER_NGRAM, ids, head_divmod=head_divmod)
        return ops.gather_rows(table, ids, output=out["two_ops"])

    def oracle() -> torch.Tensor:
        row_ids = reference.ngram_ids(*batch(), EOS_TOKEN_ID, HEADS_PER_NGRAM)
        out["oracle"].copy_(reference.gather_rows(table, row_ids))
        return out["oracle"]

    baselines = {"two_ops": two_ops}
    vllm_hash = vllm.op("ple_ngram_ids")
    if vllm_hash is not None:

        def vllm_path() -> torch.Tensor:
            vllm_hash(*batch(), EOS_TOKEN_ID, HEADS_PER_NGRAM, output=vllm_ids)
            return F.embedding(vllm_ids, table).view(tokens, width)

        baselines["vllm"] = vllm_path

    def check() -> str | None:
        got = None
        contenders = [("ours", ours), *baselines.items(), ("the oracle", oracle)]
        for who, fn in contenders:
            cursor[0] = 0  # every contender on the first batch
            rows = fn()
            if got is None:
                got = rows.clone()
            elif not torch.equal(got, rows):
                return f"rows: ours differ from {who}'s"
        return None

    nbytes = (
        tokens * NGRAM_HEADS * row_bytes  # rows read
        + tokens * width * table.element_size()  # output written
        + input_ids[0].numel() * input_ids.element_size()
        + contexts[0].numel() * contexts.element_size()
    )
    return Case(
        op="ngram_gather_rows",
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=ours,
        oracle=oracle,
        baselines=baselines,
        params={"T": tokens, "R": requests, "table_rows": table.shape[0], "id_batches": batches},
        check=check,
        **vllm.case_fields("vllm" if vllm_hash is not None else None),
    )
