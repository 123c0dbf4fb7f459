"""``host_lookup``'s lookup-level cases (issue #39): tables the GPU cannot read itself, looked
up by CPU threads (``layers.StagedLookupPipeline``) from RAM and from a table file, against what
a user would write.

**One call** looks up one step's rows of both PLE layers of the step proxy (``step_proxy``:
the same batches, hashing and released row shape, 16 heads x 160 per token), delivered where
the model runs: on a CPU the rows in host buffers, on a GPU in device memory. Every path hashes
the step's ids with our ``ngram_ids`` (or the fused CPU lookup); what differs is how the rows
are read. Calls are timed by the wall clock (``Case.host_waits``: on a GPU between device
syncs), since the host's waiting is the cost.

**Sources** (case names ``staged_<phase>_T<T>_<format>_<source>``):

- ``ram``: the tables in host memory (``placement="cpu"``, 2 MiB pages). Ours ``staged``:
  ``StagedLookupPipeline.submit`` then every layer's ``rows`` (the worker thread hashes and
  gathers with our CPU kernels, decoding fp8 and NVFP4 to bf16 as it goes), then ``release``.
  Baseline ``torch_gather`` (headline): the rows by the plain-PyTorch statement of the spec
  (``reference.gather_rows``: ``index_select``, then the decode in eager torch), into a host
  buffer (pinned on a GPU) and one copy per layer. Where to decode (fp8, NVFP4):
  ``decode_rows`` is the worker's lookup run on the calling thread (hash, gather decoding to
  bf16), and ``raw_rows`` the CPU's share of the other way, copying the rows raw for a GPU
  kernel to decode: the same gather kernel moving the same row bytes undecoded (the table
  viewed as fp16), so the two differ only by the decode and the bytes written. On a GPU also
  ``zero_copy``: the same rows read by the GPU from pinned tables (``LookupPipeline``,
  ``placement="pinned"``), the transport that needs no CPU.
- ``warm``: bf16 tables in table files whose every page is in the page cache and mapped
  (``FileTable.prefault``, and the same for the memmaps: a server that has run a while; a
  freshly mapped page costs a minor fault on its first touch, a few us on a VM). Ours
  ``staged_mmap`` (``table_reader="mmap"``), also ``staged_direct`` (``"direct"``:
  ``O_DIRECT``, which never uses the cache); baselines ``memmap_fancy`` (headline:
  ``np.memmap`` of the file, fancy indexing ``mm[ids]`` copied into a host buffer, pinned on a
  GPU, then ``copy_(non_blocking=True)``) and ``memmap_take`` (``np.take(mm, ids,
  out=buffer)``: numpy's fastest form of the same).
- ``cold``: the same files with every page dropped before each call, untimed
  (``Case.before_call``: ``madvise(DONTNEED)`` on every mapping of them here, then
  ``posix_fadvise(DONTNEED)``). Ours ``staged_direct``, also ``staged_mmap``; the same
  baselines (``np.memmap`` keeps the kernel's default readahead: each fault reads a window
  around the row). Decode shapes only: a cold prefill reads 2 x 131,072 random rows (~1 GB of
  4 KiB blocks) from the disk, seconds a call. Not on a GPU: a cold call is the disk's time
  (up to a second a call for the baselines), which a CPU run measures as well, and a lent GPU's
  minutes are better spent on the copies and the steps.

References timed beside the file cases: ``sequential_read``, SEQUENTIAL_BYTES of the first file
read with ``O_DIRECT`` in 1 MiB reads (the disk's streaming bandwidth, the physical limit for
bytes; a lookup reads 4 KiB blocks at random, so it is bounded by the disk's random reads
instead, which ``rows_per_s`` shows).

The check runs every path once and compares both layers' rows with the oracle (the spec's
gather from the RAM table), bit for bit.

The files are written to a fresh directory in $QWEN4EXP_BENCH_TABLE_DIR (default /var/tmp,
which unlike /tmp is never tmpfs, where ``O_DIRECT`` fails) and unlinked as soon as every reader
holds them open: they go with the process, however it ends.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from qwen4exp_ext import _switches, reference
from qwen4exp_ext.bench.gather_rows import HEAD_DIM, NUM_HEADS
from qwen4exp_ext.bench.registry import Case
from qwen4exp_ext.bench.timing import Quantiles
from qwen4exp_ext.layers import LookupPipeline, StagedLookupPipeline
from qwen4exp_ext.layers.ngram_embedding import NGramEmbedding
from qwen4exp_ext.tables.readers import evict_range, prefault_range
from qwen4exp_ext.testing import exact_mismatch

from . import step_proxy as sp

RAM_FORMATS = ("bf16", "fp8", "nvfp4")
FILE_FORMATS = ("bf16",)
TABLE_DIR_ENV = "QWEN4EXP_BENCH_TABLE_DIR"
SEQUENTIAL_BYTES = 64 << 20
SEQUENTIAL_CHUNK = 1 << 20
VLLM_NOTE = (
    "vLLM 0.33.0 has no CPU-staged or file-table PLE lookup: its host tables are pinned and "
    "read by the GPU (zero_copy here)"
)
DECODE_CHOICE = (
    "rows decoded by the CPU gather (staged), not copied raw for a GPU kernel to decode: "
    "raw_rows is the CPU side of the latter"
)


def cases(proxy: sp.StepProxy) -> list[Case]:
    """Every lookup-level case of ``proxy``'s device and size (module docstring)."""
    size = proxy.size
    tokens_all = (*size.decode_tokens, size.prefill_tokens)
    directory = _table_dir()
    out: list[Case] = []
    for fmt in RAM_FORMATS:
        tables = _Tables(proxy, fmt, directory if fmt in FILE_FORMATS else None)
        for tokens in tokens_all:
            out.append(_case(proxy, tables, tokens, "ram"))
        if tables.files:
            for tokens in tokens_all:
                out.append(_case(proxy, tables, tokens, "warm"))
            if proxy.device.type != "cuda":  # the disk, not the GPU: measured on a CPU run
                for tokens in size.decode_tokens:
                    out.append(_case(proxy, tables, tokens, "cold"))
    return out


# --- the tables, their files and their pipelines ----------------------------------------------


def _table_dir() -> str:
    """A fresh directory for the bench's table files (emptied and removed as soon as they are
    open: _Tables)."""
    parent = _switches.env_directory(TABLE_DIR_ENV) or "/var/tmp"
    return tempfile.mkdtemp(prefix="qwen4exp-bench-tables-", dir=parent)


def _embeddings(
    proxy: sp.StepProxy, fmt: str, paths: Sequence[str] | None = None, **kwargs: Any
) -> list[NGramEmbedding]:
    """The proxy's PLE layers' embeddings (dense indices 0 and 1), reading ``paths`` (one
    table file each) when given."""
    config = sp.ple_config(proxy.size)
    return [
        NGramEmbedding(
            config,
            index,
            dtype=sp.TABLE_DTYPES[fmt],
            out_dtype=sp.DTYPE,
            max_tokens=proxy.max_tokens,
            **({} if paths is None else {"table_path": paths[index]}),
            **kwargs,
        )
        for index in range(len(sp.PLE_LAYERS))
    ]


class _Tables:
    """One format's tables: in RAM (filled as host_lookup fills its tables), in files (bf16),
    as pinned copies on a GPU, and the pipelines that read them (shared by every T)."""

    def __init__(self, proxy: sp.StepProxy, fmt: str, directory: str | None) -> None:
        self.fmt = fmt
        self.device = proxy.device
        self.ram = _embeddings(proxy, fmt, placement="cpu")
        for index, embedding in enumerate(self.ram):
            sp.fill_table(embedding, fmt, sp.seeded_generator(torch.device("cpu"), 1 + index))
        pipeline = StagedLookupPipeline  # every pipeline delivers to the proxy's device
        self.staged = {
            "staged": pipeline(self.ram, max_tokens=proxy.max_tokens, device=proxy.device)
        }
        if proxy.device.type == "cuda" and fmt != "bf16":  # the decode choice, on a GPU
            self.staged["staged_device_decode"] = pipeline(
                self.ram, max_tokens=proxy.max_tokens, device=proxy.device, decode="device"
            )
        self.files: list[str] = []
        self.memmaps: list[np.memmap] = []
        self.mapped: list[NGramEmbedding] = []
        self.fds: list[int] = []
        self.file_bytes = 0
        if directory is not None:
            for index, embedding in enumerate(self.ram):
                path = os.path.join(directory, f"layer{index}_{fmt}.table")
                embedding.save_table_file(path)
                self.files.append(path)
            readers = {}
            for reader in ("mmap", "direct"):
                readers[reader] = _embeddings(
                    proxy, fmt, self.files, placement="file", table_reader=reader
                )
                self.staged[f"staged_{reader}"] = pipeline(
                    readers[reader], max_tokens=proxy.max_tokens, device=proxy.device
                )
            self.mapped = readers["mmap"]
            # Descriptors of the files for the drops and the sequential read (O_DIRECT).
            self.fds = [
                os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC) for path in self.files
            ]
            for path, embedding in zip(self.files, self.ram, strict=True):
                header = embedding.table_file_header
                self.memmaps.append(
                    np.memmap(
                        path,
                        dtype=np.uint8,
                        mode="r",
                        offset=header.data_offset,
                        shape=(header.num_rows, header.row_bytes),
                    )
                )
            self.file_bytes = os.path.getsize(self.files[0])
            # Everything that reads the files holds them open now: unlinked, they go when this
            # process does, however it ends (a bench cut short leaves no GBs in /var/tmp).
            for path in self.files:
                os.unlink(path)
            os.rmdir(directory)
        self.state = "cached"  # "warm" (populated), "cold" (dropped)
        self.pinned = None
        if proxy.device.type == "cuda":
            self.pinned = _embeddings(proxy, fmt, placement="pinned", device=proxy.device)
            for source, target in zip(self.ram, self.pinned, strict=True):
                sp.copy_module_weights(source, target)

    def drop_pages(self) -> None:
        """Every page of the files out of this process's mappings (ours and the memmaps'), then
        out of the page cache, which keeps a page while anything maps it."""
        for rows in [e.file_table.rows for e in self.mapped]:
            evict_range(rows.data_ptr(), rows.numel())
        for memmap in self.memmaps:
            evict_range(memmap.ctypes.data, memmap.nbytes)
        for fd in self.fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.state = "cold"

    def warm(self) -> None:
        """Every page of the files cached and mapped, ours and the memmaps' (once after a drop)."""
        if self.state == "warm":
            return
        for embedding in self.mapped:
            embedding.file_table.prefault()
        for memmap in self.memmaps:
            prefault_range(memmap.ctypes.data, memmap.nbytes)
        self.state = "warm"


# --- one case ------------------------------------------------------------------------------------


def _host_batch(proxy: sp.StepProxy, tokens: int):
    batch = proxy.batches[tokens]
    return batch, batch.query_start_loc.cpu(), batch.ngram_context.cpu()


def _case(proxy: sp.StepProxy, tables: _Tables, tokens: int, source: str) -> Case:
    size, device, fmt = proxy.size, proxy.device, tables.fmt
    on_gpu = device.type == "cuda"
    phase = "prefill" if tokens == size.prefill_tokens else "decode"
    name = f"staged_{phase}_T{tokens}_{fmt}_{source}"
    rows_read = len(sp.PLE_LAYERS) * tokens * NUM_HEADS
    read_bytes = rows_read * sp.row_bytes(fmt)
    out_bytes = rows_read * HEAD_DIM * 2  # bf16 out
    batch, qsl, context = _host_batch(proxy, tokens)
    count = max(2, -(-size.cold_bytes // max(read_bytes, 1)))
    gen = torch.Generator().manual_seed(sp.INPUT_SEED + tokens)
    id_batches = torch.randint(0, sp.VOCAB_SIZE, (count, tokens), generator=gen)
    device_ids = id_batches.to(device)
    cursor = [0]

    def next_ids() -> torch.Tensor:
        i = cursor[0]
        cursor[0] = (i + 1) % count
        return id_batches[i]

    # Host buffers of the baselines (pinned on a GPU) and their device rows.
    def host_rows(width: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.empty(tokens, width, dtype=dtype, pin_memory=on_gpu) for _ in sp.PLE_LAYERS]

    device_rows = [
        torch.empty(tokens, NUM_HEADS * HEAD_DIM, dtype=sp.DTYPE, device=device)
        for _ in sp.PLE_LAYERS
    ]
    ids_buffers = [torch.empty(tokens, NUM_HEADS, dtype=torch.int64) for _ in sp.PLE_LAYERS]

    def hashed(embedding: NGramEmbedding, ids: torch.Tensor, k: int) -> torch.Tensor:
        return embedding._ngram_ids(ids, qsl, context, ids_buffers[k])

    def deliver(rows: list[torch.Tensor]) -> list[torch.Tensor]:
        if not on_gpu:
            return rows
        for host, target in zip(rows, device_rows, strict=True):
            target.copy_(host, non_blocking=True)
        return device_rows

    paths: dict[str, Callable[[], list[torch.Tensor]]] = {}
    for path, pipeline in tables.staged.items():
        if (path in ("staged", "staged_device_decode")) == (source == "ram"):
            paths[path] = _staged_call(pipeline, next_ids, qsl, context)

    if source == "ram":
        oracle_out = host_rows(NUM_HEADS * HEAD_DIM, sp.DTYPE)

        def torch_gather() -> list[torch.Tensor]:
            ids = next_ids()
            for k, embedding in enumerate(tables.ram):
                gathered = reference.gather_rows(
                    embedding.table, hashed(embedding, ids, k), **sp.spec_gather_args(embedding)
                )
                oracle_out[k].copy_(gathered)
            return deliver(oracle_out)

        paths["torch_gather"] = torch_gather
        if fmt != "bf16":
            decoded = host_rows(NUM_HEADS * HEAD_DIM, sp.DTYPE)

            def decode_rows() -> list[torch.Tensor]:
                ids = next_ids()
                for k, embedding in enumerate(tables.ram):
                    embedding._lookup_local(ids, qsl, context, output=decoded[k])
                return deliver(decoded)

            paths["decode_rows"] = decode_rows
            paths["raw_rows"] = _raw_rows_call(tables.ram, tokens, hashed, next_ids, on_gpu)
        if tables.pinned is not None:
            paths["zero_copy"] = _zero_copy_call(tables.pinned, batch, device_ids, cursor)
    else:
        pinned = host_rows(NUM_HEADS * tables.memmaps[0].shape[1], torch.uint8)

        def memmap_path(take: bool) -> Callable[[], list[torch.Tensor]]:
            def run() -> list[torch.Tensor]:
                ids = next_ids()
                for k, (embedding, memmap) in enumerate(
                    zip(tables.ram, tables.memmaps, strict=True)
                ):
                    flat = hashed(embedding, ids, k).numpy().reshape(-1)
                    out = pinned[k].view(-1, memmap.shape[1])
                    if take:
                        np.take(memmap, flat, axis=0, out=out.numpy())
                    else:
                        out.copy_(torch.from_numpy(memmap[flat]))
                return deliver([p.view(sp.DTYPE).view(tokens, -1) for p in pinned])

            return run

        paths["memmap_fancy"] = memmap_path(take=False)
        paths["memmap_take"] = memmap_path(take=True)
    ours_name = {"ram": "staged", "warm": "staged_mmap", "cold": "staged_direct"}[source]
    references: dict[str, Callable[[], object]] = {}
    before_call = tables.drop_pages if source == "cold" else None
    if source == "warm":
        paths = {who: _warm_first(tables, fn) for who, fn in paths.items()}
    if source != "ram":
        references["sequential_read"] = _sequential_reader(tables.fds[0], tables.file_bytes)

    oracle_rows = host_rows(NUM_HEADS * HEAD_DIM, sp.DTYPE)

    def oracle() -> list[torch.Tensor]:
        ids = next_ids()
        for k, embedding in enumerate(tables.ram):
            oracle_rows[k].copy_(
                reference.gather_rows(
                    embedding.table, hashed(embedding, ids, k), **sp.spec_gather_args(embedding)
                )
            )
        return oracle_rows

    def check() -> str | None:
        cursor[0] = 0
        want = [r.clone() for r in oracle()]
        for who, fn in paths.items():
            if who == "raw_rows":  # raw bytes, not rows: nothing to compare
                continue
            cursor[0] = 0
            got = [r.to("cpu", copy=True) for r in fn()]
            for k, (a, b) in enumerate(zip(got, want, strict=True)):
                problem = exact_mismatch(
                    a, b, f"{who}'s rows of PLE layer {k}", against="the oracle", bitwise=True
                )
                if problem is not None:
                    return problem
        return None

    def last(fn: Callable[[], list[torch.Tensor]]) -> Callable[[], torch.Tensor]:
        return lambda: fn()[-1]

    baselines = {who: last(fn) for who, fn in paths.items() if who != ours_name}
    headline = {"ram": "torch_gather"}.get(source, "memmap_fancy")
    baselines = {headline: baselines.pop(headline), **baselines}
    params: dict[str, object] = {
        "T": tokens,
        "format": fmt,
        "source": source,
        "size": size.name,
        "ours": ours_name,
        "paths": list(paths),
        "ple_layers": len(sp.PLE_LAYERS),
        "rows": tables.ram[0].num_rows,
        "row_bytes": sp.row_bytes(fmt),
        "NH": NUM_HEADS,
        "d": HEAD_DIM,
        "id_batches": count,
        "decode": DECODE_CHOICE,
        "table_dir": os.path.dirname(tables.files[0]) if tables.files else None,
    }
    return Case(
        op="host_lookup",
        name=name,
        tokens=tokens,
        nbytes=read_bytes + out_bytes,
        ours=last(paths[ours_name]),
        oracle=last(oracle),
        baselines=baselines,
        params=params,
        check=check,
        references=references,
        derive=_deriver(ours_name, list(paths), rows_read, read_bytes, source),
        vllm_note=VLLM_NOTE,
        host_waits=True,
        before_call=before_call,
    )


def _staged_call(
    pipeline: StagedLookupPipeline,
    next_ids: Callable[[], torch.Tensor],
    qsl: torch.Tensor,
    context: torch.Tensor,
) -> Callable[[], list[torch.Tensor]]:
    def run() -> list[torch.Tensor]:
        step = pipeline.submit(next_ids(), qsl, context)
        rows = [step.rows(k) for k in range(len(pipeline))]
        # Released at once: the harness reads nothing after the call (the check copies first,
        # and the next submit goes to the other slot).
        step.release()
        return rows

    return run


def _raw_rows_call(
    embeddings: Sequence[NGramEmbedding],
    tokens: int,
    hashed: Callable[[NGramEmbedding, torch.Tensor, int], torch.Tensor],
    next_ids: Callable[[], torch.Tensor],
    on_gpu: bool,
) -> Callable[[], list[torch.Tensor]]:
    """The CPU's share of decoding on the device (``StagedLookupPipeline(decode="device")``):
    hash, read the raw rows and their local ids into host buffers (pinned on a GPU), and on a
    GPU copy them over; nothing decoded."""
    buffers = []
    for embedding in embeddings:
        rows = tokens * embedding.ngram_heads
        width = embedding.table_file_header.row_bytes
        buffers.append(
            (
                torch.empty(rows, width, dtype=torch.uint8, pin_memory=on_gpu),
                torch.empty(rows, dtype=torch.int64, pin_memory=on_gpu),
            )
        )
    targets = [(r.to("cuda"), x.to("cuda")) for r, x in buffers] if on_gpu else None

    def run() -> list[torch.Tensor]:
        ids = next_ids()
        out = []
        for k, embedding in enumerate(embeddings):
            flat = hashed(embedding, ids, k).reshape(-1)
            raw, local = buffers[k]
            embedding._raw_rows(flat, raw)
            embedding._local_ids(flat, local)
            if targets is not None:
                targets[k][0].copy_(raw, non_blocking=True)
                targets[k][1].copy_(local, non_blocking=True)
            out.append(raw)
        return out

    return run


def _zero_copy_call(
    pinned: list[NGramEmbedding], batch: Any, device_ids: torch.Tensor, cursor: list[int]
) -> Callable[[], list[torch.Tensor]]:
    """The GPU reading pinned tables itself (LookupPipeline), from the step's ids on the
    device."""
    pipeline = LookupPipeline(pinned)
    ids = batch.input_ids

    def run() -> list[torch.Tensor]:
        i = (cursor[0] - 1) % device_ids.shape[0]  # the batch next_ids just handed out
        ids.copy_(device_ids[i])
        pipeline.start_prefetch(ids, batch.query_start_loc, batch.ngram_context)
        return [pipeline.finalize_prefetch(k) for k in range(len(pinned))]

    def advance_then_run() -> list[torch.Tensor]:
        cursor[0] = (cursor[0] + 1) % device_ids.shape[0]
        return run()

    return advance_then_run


def _warm_first(
    tables: _Tables, fn: Callable[[], list[torch.Tensor]]
) -> Callable[[], list[torch.Tensor]]:
    """``fn`` on warm files: the first call after a drop (a warm-up call) maps them again."""

    def run() -> list[torch.Tensor]:
        tables.warm()
        return fn()

    return run


def _sequential_reader(fd: int, size: int) -> Callable[[], int]:
    """Reads SEQUENTIAL_BYTES of the file open as ``fd`` (O_DIRECT; ``size`` bytes; from the
    data region on, wrapping) in SEQUENTIAL_CHUNK reads, a different stretch each call."""
    span = max(SEQUENTIAL_CHUNK, (size - 4096) // SEQUENTIAL_CHUNK * SEQUENTIAL_CHUNK)
    buffer = mmap.mmap(-1, SEQUENTIAL_CHUNK)  # page-aligned, as O_DIRECT needs
    where = [0]

    def run() -> int:
        total = 0
        while total < SEQUENTIAL_BYTES:
            offset = 4096 + where[0] % span
            got = os.preadv(fd, [buffer], offset)
            if got <= 0:
                where[0] = 0
                continue
            total += got
            where[0] += got
        return total

    return run


def _deriver(
    ours_name: str, path_names: list[str], rows_read: int, read_bytes: int, source: str
) -> Callable[[Mapping[str, Quantiles]], dict[str, object]]:
    def derive(times: Mapping[str, Quantiles]) -> dict[str, object]:
        def timed(path: str) -> Quantiles:
            return times["ours" if path == ours_name else path]

        paths = {}
        for path in path_names:
            q = timed(path)
            paths[path] = {
                "call": asdict(q),
                "rows_per_s": rows_read / (q.p50_us * 1e-6),
                "read_gbps": read_bytes / (q.p50_us * 1e3),
            }
        seq = times.get("sequential_read")
        seq_gbps = None if seq is None else SEQUENTIAL_BYTES / (seq.p50_us * 1e3)
        ours = paths[ours_name]["call"]["p50_us"]
        ratios = {
            path: p["call"]["p50_us"] / ours for path, p in paths.items() if path != ours_name
        }
        text = ", ".join(f"{path} {p['call']['p50_us']:.1f}" for path, p in paths.items())
        summary = f"{source}: p50 µs a call: {text}"
        summary += "\n" + ", ".join(
            f"{ours_name} is {r:.2f}x faster than {p}" for p, r in ratios.items()
        )
        if seq_gbps is not None:
            summary += f"\nsequential O_DIRECT read of the file: {seq_gbps:.2f} GB/s"
        return {
            "ours_path": ours_name,
            "paths": paths,
            "speedups_of_ours": ratios,
            "sequential_read_gbps": seq_gbps,
            "lookup_bytes": read_bytes,
            "summary": summary,
        }

    return derive
