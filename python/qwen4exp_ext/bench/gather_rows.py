"""``gather_rows`` cases: ``gather_rows`` at the released row shape (NH = 16 heads of d = 160)
over decode (T = 1..256) and prefill (T = 8192) batches, bf16, fp8 and NVFP4 tables.

Baselines, what vLLM runs without our kernel: "index_select" (the headline),
``torch.index_select(table, 0, ids.flatten(), out=preallocated)``, and "embedding",
``F.embedding(ids, table)``; each followed by vLLM's eager dequantisation for fp8
(``row.to(out) * scale.to(out)``, indexing the table's byte view) and NVFP4 (below). The oracle
is ``reference.gather_rows``. The check requires ours to equal every baseline and the oracle.

The released table has 320M rows (102 GB in bf16): far more than a CI host has, so the table
here has QWEN4EXP_BENCH_GATHER_ROWS rows (default 4M on CPU = 1.28 GB bf16; 16M = 5.1 GB on a
GPU, ~85x an H200's 60 MB L2, so every row is still a miss, with a quarter of the bytes to build
and pin that 64M rows took of a lent GPU's minutes), the same number of rows in every format (so
the NVFP4 table, d/2 packed bytes and d/16 block scales a row, is ~9/32 of the bf16 table's
bytes).
Every row of a table that size is a cache (and TLB) miss, like the released one: the timing is
the same latency-bound regime. The ids (params "ids") are:

- fresh (every case; no suffix): each case cycles through enough different id batches to touch
  COLD_BYTES of rows per cycle (far above any last-level cache), so no timed call finds its rows
  still cached by an earlier one — a real decode step reads rows the last step did not. One
  cursor serves every contender: each timed call, whoever makes it, reads the next batch.
- repeated (``*_repeated``: bf16, decode T = 64 and prefill): the same batch every call, so
  after the first call its rows are hot in the cache.
- dup1024 (``*_dup1024``: bf16 prefill): every id drawn from the same DUPLICATE_ROWS random
  rows (two batches cycling), so each row is looked up ~128 times a batch, from cache.
- sorted (``*_sorted``: bf16 prefill): fresh batches, each sorted ascending (all T·NH ids).

On the CPU the ``hugepages`` case reads a copy of the bf16 table on transparent huge pages, the
way ``NGramEmbedding(placement="cpu")`` allocates it (``host_memory.empty_host_table``), fresh
ids, against ``index_select`` only.

NVFP4 (vLLM's layout, see ``reference.gather_rows``): a uint8 table [rows, d/2] of E2M1 codes,
float8_e4m3fn block scales [rows, d/16] and a global fp32 scale. Its baselines look up the
packed rows and the block scales, then dequantise in eager torch,
``(e2m1 · block scale · scale).to(out)``; they are written here, so the check holds them, and
ours, to ``reference.gather_rows`` too.

Bytes (the GB/s and "% copy" columns) count the traffic of the lookups: the ids read, each
looked-up row read (NVFP4: d/2 packed bytes + d/16 scale bytes), the output written. For the
repeated and dup1024 ids the rows come from cache, so their GB/s is lookup bandwidth, not DRAM
traffic.

vLLM 0.33.0's own lookup of each case (``Case.vllm``, for ``speedup_vs_vllm``): of a device
table, ``Qwen4ExpPLEDeviceEmbedding`` runs ``F.embedding`` (bf16; fp8 then its eager
``dequantize``), which is the "embedding" baseline, on a CPU too; NVFP4 its Triton
``_lookup_nvfp4_ple_embedding_kernel`` (baseline "vllm", GPU); of a pinned table,
``Qwen4ExpPLEPinnedHostEmbedding`` its Triton UVA kernels on the table's device view (baseline
"vllm": ``_lookup_ple_embedding_from_pinned_kernel``, a raw-byte row copy, for bf16 and fp8, then
fp8's eager dequantize; the NVFP4 kernel for NVFP4), as ``vllm_triton.lookup_rows`` runs them.
The check holds them to equal ours exactly. The huge-page case times index_select only.

The CLI's "% copy" column is the share of a same-run copy of the same bytes (CPU: memcpy; GPU:
device-to-device copy, ~HBM peak). On a GPU the ``pinned_*`` cases read a table in pinned host
memory (bf16, fp8; NVFP4 rows and block scales, all through ``host_memory.device_view``), as do ours
and vLLM's lookup, the other baselines and the oracle the same table resident on the device; compare
them with ``h2d_copy`` (params: the measured host-to-device bandwidth of a pinned copy of the same
bytes, GB/s).

Untimed sections (``sections``):

- ``pinned_bytes``: host memory pinned per layer of the released PLE table (R_pad = 320,001,536
  rows of d = 160), for bf16, fp8 and NVFP4 (rows + block scales), computed, not allocated:
  the table's bytes (per allocation: NVFP4 has two, rows and block scales); what
  ``torch.empty(..., pin_memory=True)`` pins: torch's CachingHostAllocator rounds every request
  up to the next power of two (``c10::llvm::PowerOf2Ceil`` in ATen/core/CachingHostAllocator.h,
  torch 2.14; unless ``pinned_max_round_threshold_mb`` / ``pinned_max_cached_size_mb`` is set in
  PYTORCH_ALLOC_CONF) — 47.7 GiB of fp8 pins 64 GiB; and what ``host_memory.pinned_host_table``
  pins: each allocation rounded up to a 4 KiB page (on a 64 KiB-page kernel, 64 KiB: < 64 KiB
  more per allocation).
- ``pinned_bytes_measured`` (GPU only): the same comparison for a small table of
  MEASURED_ROWS rows, allocated both ways and measured with ``host_memory.footprint``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from qwen4exp_ext import _switches, ops, reference
from qwen4exp_ext.bench import vllm_triton
from qwen4exp_ext.bench.registry import Case, Section, VllmKernels, vllm_kernels
from qwen4exp_ext.testing import exact_mismatch

NUM_HEADS = 16
HEAD_DIM = 160
DECODE_TOKENS = (1, 8, 64, 256)
PREFILL_TOKENS = 8192
FP8_SCALE = 0.0123
NVFP4_SCALE = 0.0123
NVFP4_BLOCK = reference.NVFP4_BLOCK
INPUT_SEED = 0
COLD_BYTES = 256 << 20  # rows touched per cycle of id batches: several times any LLC
DUPLICATE_ROWS = 1024
# The id patterns beyond "fresh", for the bf16 table: decode at this T, and the prefill.
REPEATED_DECODE_TOKENS = 64
PREFILL_ID_PATTERNS = ("repeated", "dup1024", "sorted")

# R_pad of one released PLE layer: layout.head_vocab_layout(20_000_000, 16, 0, 128).padded_rows
# (checked in tests/test_layout.py); layout.py has the construction, not the released config.
RELEASED_ROWS = 320_001_536
PAGE_BYTES = 4096
MEASURED_ROWS = 1_000_003  # small table of pinned_bytes_measured: ~0.3 GB in bf16


class _Table(NamedTuple):
    """One table in one format, with what ``gather_rows`` needs to read it."""

    kind: str
    rows: torch.Tensor  # bf16/fp8 [rows, d]; NVFP4 uint8 [rows, d/2]
    scale: torch.Tensor | None = None  # fp8, NVFP4: the global fp32 scale, [1]
    block_scales: torch.Tensor | None = None  # NVFP4: float8_e4m3fn [rows, d/16]

    @property
    def row_bytes(self) -> int:
        """Bytes read per looked-up row."""
        n = self.rows.shape[1] * self.rows.element_size()
        if self.block_scales is not None:
            n += self.block_scales.shape[1] * self.block_scales.element_size()
        return n

    def to(self, device: torch.device) -> _Table:
        return _Table(*(t if not isinstance(t, torch.Tensor) else t.to(device) for t in self))


GATHER_ROWS_ENV = "QWEN4EXP_BENCH_GATHER_ROWS"


def table_rows(device: torch.device) -> int:
    default = 16_000_000 if device.type == "cuda" else 4_000_000
    rows = _switches.env_count(GATHER_ROWS_ENV, what="a row count", minimum=1)
    return default if rows is None else rows


def cases(device: torch.device) -> list[Case]:
    rows = table_rows(device)
    gen = torch.Generator().manual_seed(INPUT_SEED)
    # Random bytes below 0x70 are finite in both fp8 formats and in bf16 (no NaN checks fail).
    raw = torch.randint(0, 0x70, (rows, HEAD_DIM * 2), dtype=torch.uint8, generator=gen)
    scale = torch.tensor([FP8_SCALE], device=device)
    tables = {
        "bf16": _Table("bf16", raw.view(torch.bfloat16).to(device)),
        "fp8": _Table(
            "fp8", raw[:, :HEAD_DIM].contiguous().view(torch.float8_e4m3fn).to(device), scale
        ),
        # Every byte is two valid E2M1 codes; block scales from the finite fp8 bytes above.
        "nvfp4": _Table(
            "nvfp4",
            torch.randint(0, 256, (rows, HEAD_DIM // 2), dtype=torch.uint8, generator=gen).to(
                device
            ),
            torch.tensor([NVFP4_SCALE], device=device),
            raw[:, HEAD_DIM : HEAD_DIM + HEAD_DIM // NVFP4_BLOCK]
            .contiguous()
            .view(torch.float8_e4m3fn)
            .to(device),
        ),
    }
    del raw
    vllm = vllm_kernels(device)
    more_ids = {REPEATED_DECODE_TOKENS: ("repeated",), PREFILL_TOKENS: PREFILL_ID_PATTERNS}
    out: list[Case] = []
    for kind, table in tables.items():
        for tokens in (*DECODE_TOKENS, PREFILL_TOKENS):
            phase = "decode" if tokens in DECODE_TOKENS else "prefill"
            name = f"{phase}_T{tokens}_{kind}"
            ids = _id_batches(rows, tokens, table.row_bytes, gen, device)
            out.append(_case(name, table, ids, "fresh", vllm))
            for pattern in more_ids.get(tokens, ()) if kind == "bf16" else ():
                patterned = _patterned_ids(pattern, ids, rows, gen)
                out.append(_case(f"{name}_{pattern}", table, patterned, pattern, vllm))
    if device.type == "cpu":
        from qwen4exp_ext.tables.host_memory import empty_host_table

        bf16 = tables["bf16"].rows
        huge = empty_host_table(rows, HEAD_DIM, torch.bfloat16)
        huge.copy_(bf16)
        ids = _id_batches(rows, PREFILL_TOKENS, HEAD_DIM * 2, gen, device)
        name = f"prefill_T{PREFILL_TOKENS}_bf16_hugepages"
        out.append(_case(name, _Table("bf16", huge), ids, "fresh", vllm, embedding=False))
    if device.type == "cuda":
        out += _pinned_cases(list(tables.values()), gen, device, vllm)
    return out


def _id_batches(rows: int, tokens: int, row_bytes: int, gen, device) -> torch.Tensor:
    """[S, T, NH] random ids: S batches that together touch at least COLD_BYTES of rows."""
    batches = max(2, -(-COLD_BYTES // (tokens * NUM_HEADS * row_bytes)))
    return torch.randint(0, rows, (batches, tokens, NUM_HEADS), generator=gen).to(device)


def _patterned_ids(pattern: str, fresh: torch.Tensor, rows: int, gen) -> torch.Tensor:
    """The [S, T, NH] id batches of ``pattern`` (module docstring), from the fresh ones."""
    if pattern == "repeated":
        return fresh[:1].clone()
    if pattern == "sorted":
        return fresh.reshape(fresh.shape[0], -1).sort(dim=1).values.reshape(fresh.shape)
    if pattern == "dup1024":
        distinct = torch.randint(0, rows, (DUPLICATE_ROWS,), generator=gen)
        picks = torch.randint(0, DUPLICATE_ROWS, (2, *fresh.shape[1:]), generator=gen)
        return distinct[picks].to(fresh.device)
    raise ValueError(f"unknown id pattern {pattern!r}")


def _e2m1_values(device: torch.device) -> torch.Tensor:
    """fp32 [16]: the value of each E2M1 code (bit 3 the sign: -0.0 for code 8), made once per
    case so that the timed baseline does no host-to-device copy of it."""
    magnitudes = torch.tensor(reference.E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat((magnitudes, -magnitudes))


def _case(
    name: str,
    table: _Table,
    batches: torch.Tensor,
    pattern: str,
    vllm: VllmKernels,
    table_for_ref: _Table | None = None,
    embedding: bool = True,
) -> Case:
    tokens = batches.shape[1]
    device = batches.device
    out_dtype = torch.bfloat16
    ours_out = torch.full((tokens, NUM_HEADS * HEAD_DIM), -1.0, dtype=out_dtype, device=device)
    ref_table = table if table_for_ref is None else table_for_ref

    def run_ours(i: int) -> torch.Tensor:
        return ops.gather_rows(
            table.rows,
            batches[i],
            scale=table.scale,
            block_scales=table.block_scales,
            output=ours_out,
        )

    def run_oracle(i: int) -> torch.Tensor:
        return reference.gather_rows(
            ref_table.rows,
            batches[i],
            scale=ref_table.scale,
            block_scales=ref_table.block_scales,
            out_dtype=out_dtype,
        )

    runs = _eager_lookups(ref_table, batches, out_dtype, embedding)
    # vLLM's own lookup: of a device bf16/fp8 table, F.embedding (+ dequantize), timed already;
    # else its Triton kernels, on the table ours reads (the pinned one's device view).
    pinned = table_for_ref is not None
    if not pinned and table.block_scales is None:
        vllm_fields = {"vllm": "embedding" if embedding else None, "vllm_note": None}
        if not embedding:
            vllm_fields["vllm_note"] = (
                "not timed: this case times index_select only (vLLM's F.embedding lookup of "
                "the same rows is timed in the case without the suffix)"
            )
    else:
        vllm_run = _vllm_lookup(vllm, table, batches, out_dtype)
        if vllm_run is not None:
            runs["vllm"] = vllm_run
        vllm_fields = vllm.case_fields("vllm" if vllm_run is not None else None)

    # One cursor for every contender: each timed call, ours or another's, reads the next batch,
    # so none finds rows another has just pulled into the cache (with fresh ids).
    cursor = [0]

    def next_batch() -> int:
        cursor[0] = (cursor[0] + 1) % batches.shape[0]
        return cursor[0]

    def check() -> str | None:
        ours = run_ours(0).clone()
        for who, run in runs.items():
            problem = exact_mismatch(ours, run(0), "rows", against=who, equal_nan=True)
            if problem is not None:
                return problem
        # The baselines are written here: hold them (and ours) to the spec's reference too.
        oracle = run_oracle(0)
        return exact_mismatch(ours, oracle, "rows", against="reference.gather_rows", equal_nan=True)

    def bind(run: Callable[[int], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: run(next_batch())

    ids_numel = tokens * NUM_HEADS
    nbytes = (
        ids_numel * batches.element_size()
        + ids_numel * table.row_bytes
        + ours_out.numel() * ours_out.element_size()
    )
    params: dict[str, object] = {
        "T": tokens,
        "NH": NUM_HEADS,
        "d": HEAD_DIM,
        "rows": table.rows.shape[0],
        "row_bytes": table.row_bytes,
        "ids": pattern,
        "id_batches": batches.shape[0],
    }
    if pattern == "dup1024":
        params["distinct_rows"] = int(batches.unique().numel())
    return Case(
        op="gather_rows",
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=bind(run_ours),
        oracle=bind(run_oracle),
        baselines={who: bind(run) for who, run in runs.items()},
        check=check,
        params=params,
        **vllm_fields,
    )


def _vllm_lookup(
    vllm: VllmKernels, table: _Table, batches: torch.Tensor, out_dtype: torch.dtype
) -> Callable[[int], torch.Tensor] | None:
    """vLLM 0.33.0's Triton lookup of id batch i from ``table`` (``vllm_triton.lookup_rows``)
    into a preallocated output, or None where its kernels are not here."""
    if vllm.lookups is None:
        return None
    tokens = batches.shape[1]
    device = batches.device
    out = torch.full((tokens, NUM_HEADS * HEAD_DIM), -1.0, dtype=out_dtype, device=device)
    fp8 = table.scale is not None and table.block_scales is None
    staging = (
        torch.empty(tokens * NUM_HEADS, HEAD_DIM, dtype=torch.uint8, device=device) if fp8 else None
    )

    def run(i: int) -> torch.Tensor:
        return vllm_triton.lookup_rows(
            vllm.lookups,
            table.rows,
            batches[i],
            out,
            scale=table.scale,
            block_scales=table.block_scales,
            staging=staging,
        )

    return vllm.wrap(run)


def _eager_lookups(
    ref_table: _Table, batches: torch.Tensor, out_dtype: torch.dtype, embedding: bool
) -> dict[str, Callable[[int], torch.Tensor]]:
    """The baselines, vLLM's eager path, by name: the rows of id batch i by index_select into a
    preallocated output (and by F.embedding when ``embedding``), then dequantised."""
    tokens = batches.shape[1]
    device = batches.device
    flat_batches = batches.reshape(batches.shape[0], -1)
    fp8 = ref_table.rows.dtype == torch.float8_e4m3fn
    nvfp4 = ref_table.block_scales is not None
    # vLLM's eager path: index the (byte view of the) table, then row.to(out) * scale.to(out)
    # (fp8), or decode the packed codes times their block scale times the global scale (NVFP4).
    lookup_table = ref_table.rows.view(torch.uint8) if fp8 else ref_table.rows
    lookup_scales = ref_table.block_scales.view(torch.uint8) if nvfp4 else None
    select_out = torch.empty(
        tokens * NUM_HEADS, lookup_table.shape[1], dtype=lookup_table.dtype, device=device
    )
    if nvfp4:
        scales_out = torch.empty(
            tokens * NUM_HEADS, lookup_scales.shape[1], dtype=torch.uint8, device=device
        )
    scale_out = ref_table.scale.to(out_dtype) if fp8 else None
    e2m1 = _e2m1_values(device) if nvfp4 else None

    def finish(rows_: torch.Tensor, scales_: torch.Tensor | None) -> torch.Tensor:
        if fp8:
            rows_ = rows_.view(torch.float8_e4m3fn).to(out_dtype) * scale_out
        elif nvfp4:
            n = rows_.numel() // rows_.shape[-1]
            packed = rows_.reshape(n, -1)
            codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, HEAD_DIM)
            blocks = scales_.reshape(n, -1).view(torch.float8_e4m3fn).to(torch.float32)
            values = e2m1[codes.long()] * blocks.repeat_interleave(NVFP4_BLOCK, dim=1)
            rows_ = (values * ref_table.scale).to(out_dtype)
        return rows_.reshape(tokens, NUM_HEADS * HEAD_DIM)

    def run_index_select(i: int) -> torch.Tensor:
        ids = flat_batches[i]
        scales_ = None
        if nvfp4:
            scales_ = torch.index_select(lookup_scales, 0, ids, out=scales_out)
        return finish(torch.index_select(lookup_table, 0, ids, out=select_out), scales_)

    def run_embedding(i: int) -> torch.Tensor:
        scales_ = F.embedding(batches[i], lookup_scales) if nvfp4 else None
        return finish(F.embedding(batches[i], lookup_table), scales_)

    runs: dict[str, Callable[[int], torch.Tensor]] = {"index_select": run_index_select}
    if embedding:
        runs["embedding"] = run_embedding
    return runs


def _pinned_cases(device_tables: list[_Table], gen, device, vllm: VllmKernels) -> list[Case]:
    """Tables in pinned host memory, read zero-copy by the GPU (NVFP4: rows and block scales)."""
    from qwen4exp_ext.tables.host_memory import device_view

    h2d = _h2d_gbps(device)
    cases_: list[Case] = []
    for device_table in device_tables:
        host = device_table.to(torch.device("cpu"))
        view = _Table(
            host.kind,
            device_view(host.rows, device),
            device_table.scale,
            None if host.block_scales is None else device_view(host.block_scales, device),
        )
        for tokens in (*DECODE_TOKENS, PREFILL_TOKENS):
            phase = "decode" if tokens in DECODE_TOKENS else "prefill"
            ids = _id_batches(host.rows.shape[0], tokens, host.row_bytes, gen, device)
            case = _case(
                f"pinned_{phase}_T{tokens}_{host.kind}",
                view,
                ids,
                "fresh",
                vllm,
                table_for_ref=device_table,
            )
            params = {**case.params, "h2d_copy_gbps": round(h2d, 2)}
            cases_.append(Case(**{**case.__dict__, "params": params}))
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


# --- pinned bytes per layer ---------------------------------------------------------------------


def _allocations(rows: int, d: int) -> dict[str, list[tuple[str, int]]]:
    """Each format's host allocations for a [rows, d] table: (name, bytes)."""
    return {
        "bf16": [("rows", rows * d * 2)],
        "fp8": [("rows", rows * d)],
        "nvfp4": [("rows", rows * d // 2), ("block_scales", rows * (d // NVFP4_BLOCK))],
    }


def _torch_pinned(nbytes: int) -> int:
    """What torch's CachingHostAllocator pins for one request: the next power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


def _page_rounded(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def pinned_bytes(rows: int = RELEASED_ROWS, d: int = HEAD_DIM) -> list[dict[str, object]]:
    """Per format: the bytes of one [rows, d] table and what each way of pinning it pins."""
    out: list[dict[str, object]] = []
    for kind, allocs in _allocations(rows, d).items():
        table = sum(n for _, n in allocs)
        torch_pinned = sum(_torch_pinned(n) for _, n in allocs)
        ours = sum(_page_rounded(n) for _, n in allocs)
        out.append(
            {
                "format": kind,
                "rows": rows,
                "d": d,
                "allocations": {name: n for name, n in allocs},
                "table_bytes": table,
                "torch_pin_memory_bytes": torch_pinned,
                "pinned_host_table_bytes": ours,
                "torch_over_table": torch_pinned / table,
            }
        )
    return out


def _measured_pinned_bytes(device: torch.device, rows: int = MEASURED_ROWS) -> list[dict]:
    """pinned_bytes for a small table, allocated both ways and measured with footprint."""
    from qwen4exp_ext.tables.host_memory import footprint, pinned_host_table

    widths = {
        "rows": (HEAD_DIM, None),
        "block_scales": (HEAD_DIM // NVFP4_BLOCK, torch.float8_e4m3fn),
    }
    dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}
    out = []
    for kind, allocs in _allocations(rows, HEAD_DIM).items():
        table = torch_mapped = ours_mapped = 0
        for name, nbytes in allocs:
            width, dtype = widths[name]
            dtype = dtype or dtypes[kind]
            if kind == "nvfp4" and name == "rows":
                width //= 2
            theirs = torch.empty(rows, width, dtype=dtype, pin_memory=True)
            ours = pinned_host_table(rows, width, dtype, device=device)
            # The tensors hold the table's bytes; their storages may hold more (ours: the page).
            assert theirs.nbytes == nbytes == ours.nbytes, (theirs.nbytes, nbytes, ours.nbytes)
            table += nbytes
            torch_mapped += footprint(theirs)["mapping_bytes"]
            ours_mapped += footprint(ours)["mapping_bytes"]
            del theirs, ours
        out.append(
            {
                "format": kind,
                "rows": rows,
                "d": HEAD_DIM,
                "table_bytes": table,
                "torch_pin_memory_bytes": torch_mapped,
                "pinned_host_table_bytes": ours_mapped,
                "torch_over_table": torch_mapped / table,
            }
        )
    return out


_PINNED_COLUMNS = (
    ("format", "format"),
    ("table_bytes", "table"),
    ("torch_pin_memory_bytes", "torch pin_memory"),
    ("pinned_host_table_bytes", "pinned_host_table"),
    ("torch_over_table", "torch/table"),
)


def sections(device: torch.device) -> list[Section]:
    out = [
        Section(
            op="gather_rows",
            name="pinned_bytes",
            note=f"host bytes pinned per layer of the released table ({RELEASED_ROWS:,} rows "
            f"x d={HEAD_DIM}; NVFP4 = rows + block scales), computed: torch rounds each "
            f"allocation up to a power of two, pinned_host_table to a {PAGE_BYTES // 1024} KiB "
            "page",
            columns=_PINNED_COLUMNS,
            rows=pinned_bytes(),
        )
    ]
    if device.type == "cuda":
        out.append(
            Section(
                op="gather_rows",
                name="pinned_bytes_measured",
                note=f"the same for a {MEASURED_ROWS:,}-row table, allocated both ways: "
                "mapping bytes from host_memory.footprint",
                columns=_PINNED_COLUMNS,
                rows=_measured_pinned_bytes(device),
            )
        )
    return out
