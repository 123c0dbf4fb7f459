"""``gather`` cases: ``gather_rows`` at the released row shape (NH = 16 heads of d = 160) over
decode (T = 1..256) and prefill (T = 8192) batches, bf16 and fp8 tables, against
``torch.nn.functional.embedding`` (+ vLLM's eager dequant for fp8) and, for the acceptance
shape, against ``torch.index_select(..., out=)``.

The released table has 320M rows (102 GB in bf16): far more than a CI host has, so the table
here has QWEN4EXP_BENCH_GATHER_ROWS rows (default 4M on CPU = 1.28 GB bf16, 64M on a GPU).
Every row of a table that size is a cache (and TLB) miss, like the released one: the timing is
the same latency-bound regime. Each case cycles through enough different id batches to touch
COLD_BYTES of rows per cycle (far above any last-level cache), so no timed call finds its rows
still cached by an earlier one — a real decode step reads rows the last step did not. On the
CPU the ``hugepages`` case reads a copy of the bf16 table on transparent huge pages, the way
``NGramEmbedding(placement="cpu")`` allocates it (``host_table.empty_host_table``).

The CLI's "% copy" column is the share of a same-run copy of the same bytes (CPU: memcpy; GPU:
device-to-device copy, ~HBM peak). On a GPU the ``pinned_*`` cases read a table in pinned host
memory; compare them with ``h2d_copy`` (params: the measured host-to-device bandwidth of a
pinned copy of the same bytes, GB/s).
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from qwen4exp_ext import ops
from qwen4exp_ext.bench.registry import Case

NUM_HEADS = 16
HEAD_DIM = 160
DECODE_TOKENS = (1, 8, 64, 256)
PREFILL_TOKENS = 8192
FP8_SCALE = 0.0123
INPUT_SEED = 0
COLD_BYTES = 256 << 20  # rows touched per cycle of id batches: several times any LLC


def _rows(device: torch.device) -> int:
    default = 64_000_000 if device.type == "cuda" else 4_000_000
    return int(os.environ.get("QWEN4EXP_BENCH_GATHER_ROWS", default))


def cases(device: torch.device) -> list[Case]:
    rows = _rows(device)
    gen = torch.Generator().manual_seed(INPUT_SEED)
    # Random bytes below 0x70 are finite in both fp8 formats and in bf16 (no NaN checks fail).
    raw = torch.randint(0, 0x70, (rows, HEAD_DIM * 2), dtype=torch.uint8, generator=gen)
    tables = {
        "bf16": (raw.view(torch.bfloat16).to(device), None),
        "fp8": (
            raw[:, :HEAD_DIM].contiguous().view(torch.float8_e4m3fn).to(device),
            torch.tensor([FP8_SCALE], device=device),
        ),
    }
    del raw
    out: list[Case] = []
    for kind, (table, scale) in tables.items():
        for tokens in (*DECODE_TOKENS, PREFILL_TOKENS):
            phase = "decode" if tokens in DECODE_TOKENS else "prefill"
            ids = _id_batches(rows, tokens, HEAD_DIM * table.element_size(), gen, device)
            out.append(_case(f"{phase}_T{tokens}_{kind}", table, scale, ids, "embedding"))
            if tokens == PREFILL_TOKENS:
                out.append(
                    _case(
                        f"{phase}_T{tokens}_{kind}_vs_index_select",
                        table,
                        scale,
                        ids,
                        "index_select",
                    )
                )
    if device.type == "cpu":
        from qwen4exp_ext.host_table import empty_host_table

        bf16 = tables["bf16"][0]
        huge = empty_host_table(rows, HEAD_DIM, torch.bfloat16)
        huge.copy_(bf16)
        ids = _id_batches(rows, PREFILL_TOKENS, HEAD_DIM * 2, gen, device)
        name = f"prefill_T{PREFILL_TOKENS}_bf16_hugepages_vs_index_select"
        out.append(_case(name, huge, None, ids, "index_select"))
    if device.type == "cuda":
        out += _pinned_cases(tables["bf16"][0], gen, device)
    return out


def _id_batches(rows: int, tokens: int, row_bytes: int, gen, device) -> torch.Tensor:
    """[S, T, NH] random ids: S batches that together touch at least COLD_BYTES of rows."""
    batches = max(2, -(-COLD_BYTES // (tokens * NUM_HEADS * row_bytes)))
    return torch.randint(0, rows, (batches, tokens, NUM_HEADS), generator=gen).to(device)


def _case(name, table, scale, batches, baseline: str, table_for_ref=None) -> Case:
    tokens = batches.shape[1]
    device = batches.device
    out_dtype = torch.bfloat16
    ours_out = torch.full((tokens, NUM_HEADS * HEAD_DIM), -1.0, dtype=out_dtype, device=device)
    flat_batches = batches.reshape(batches.shape[0], -1)
    ref_table = table if table_for_ref is None else table_for_ref
    fp8 = ref_table.dtype == torch.float8_e4m3fn
    # vLLM's eager path: index the (byte view of the) table, then row.to(out) * scale.to(out).
    lookup_table = ref_table.view(torch.uint8) if fp8 else ref_table
    select_out = torch.empty(tokens * NUM_HEADS, HEAD_DIM, dtype=lookup_table.dtype, device=device)
    scale_out = scale.to(out_dtype) if scale is not None else None

    def run_ours(i: int) -> torch.Tensor:
        return ops.gather_rows(table, batches[i], scale=scale, output=ours_out)

    def finish(rows_: torch.Tensor) -> torch.Tensor:
        if fp8:
            rows_ = rows_.view(torch.float8_e4m3fn).to(out_dtype) * scale_out
        return rows_.reshape(tokens, NUM_HEADS * HEAD_DIM)

    if baseline == "embedding":

        def run_ref(i: int) -> torch.Tensor:
            return finish(F.embedding(batches[i], lookup_table))
    else:

        def run_ref(i: int) -> torch.Tensor:
            return finish(torch.index_select(lookup_table, 0, flat_batches[i], out=select_out))

    # One cursor for both contenders: every timed call, ours or the reference's, reads the next
    # batch, so neither finds rows the other has just pulled into the cache.
    cursor = [0]

    def next_batch() -> int:
        cursor[0] = (cursor[0] + 1) % batches.shape[0]
        return cursor[0]

    def check() -> str | None:
        ours, ref = run_ours(0), run_ref(0)
        if torch.equal(ours, ref):
            return None
        return f"{int((ours != ref).sum())} of {ref.numel()} elements differ"

    row_bytes = HEAD_DIM * table.element_size()
    ids_numel = tokens * NUM_HEADS
    nbytes = (
        ids_numel * batches.element_size()
        + ids_numel * row_bytes
        + ours_out.numel() * ours_out.element_size()
    )
    return Case(
        op="gather",
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=lambda: run_ours(next_batch()),
        ref=lambda: run_ref(next_batch()),
        check=check,
        params={
            "T": tokens,
            "NH": NUM_HEADS,
            "d": HEAD_DIM,
            "rows": table.shape[0],
            "id_batches": batches.shape[0],
        },
    )


def _pinned_cases(device_table: torch.Tensor, gen, device) -> list[Case]:
    """The bf16 table in pinned host memory, read zero-copy by the GPU."""
    from qwen4exp_ext.host_table import device_view

    host = device_table.cpu()
    view = device_view(host, device)
    h2d = _h2d_gbps(device)
    cases_: list[Case] = []
    for tokens in (*DECODE_TOKENS, PREFILL_TOKENS):
        phase = "decode" if tokens in DECODE_TOKENS else "prefill"
        ids = _id_batches(host.shape[0], tokens, HEAD_DIM * host.element_size(), gen, device)
        case = _case(
            f"pinned_{phase}_T{tokens}_bf16",
            view,
            None,
            ids,
            "embedding",
            table_for_ref=device_table,
        )
        cases_.append(
            Case(**{**case.__dict__, "params": {**case.params, "h2d_copy_gbps": round(h2d, 2)}})
        )
    return cases_


def _h2d_gbps(device, nbytes: int = 256 << 20) -> float:
    """Measured pinned host-to-device copy bandwidth (the ceiling of a pinned-table gather)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 5 * nbytes / (time.perf_counter() - start) / 1e9
