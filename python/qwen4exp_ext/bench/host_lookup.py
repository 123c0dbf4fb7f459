"""``host_lookup`` cases: what reading the PLE tables from host memory costs a whole step, with
the lookups started at step entry (``layers.LookupPipeline``) and without (issue #38).

**The step proxy** (its stand-in decoder layers, PLE layers, batches and size presets) is
``bench/step_proxy.py``'s: a stack of 6 stand-in decoder layers with the FLOPs of the released
config's, the 2nd and the 6th opening with a real ``layers.PLELayer``; ``cpu``, ``released`` and
``quick`` sizes (``QWEN4EXP_BENCH_HOST_LOOKUP_SIZE``, ``QWEN4EXP_BENCH_HOST_LOOKUP_ROWS``).

**Paths**, each a whole step, timed side by side in one interleaved loop:

- ``device`` (the headline baseline, what the overhead is measured against): the tables in
  device memory, each PLE layer looking its rows up when it runs;
- ``pinned_sync`` (GPU): the tables pinned in host memory (``placement="pinned"``), each layer
  reading its rows over the link when it runs: what vLLM 0.33.0's AMD model does (``sync_lookup``);
- ``pinned_pipeline`` (GPU, ours there): the pinned tables, every PLE layer's lookup started at
  step entry (``LookupPipeline.start_prefetch``, on the side stream), each layer taking its rows;
- ``pinned_pipeline_dedupe`` (GPU): the same, each distinct row of a batch read from the host
  once (``LookupPipeline(dedupe=True)``); the bench's random tokens repeat few n-grams, so this
  is its cost where it saves nothing;
- ``pipeline`` (CPU, ours there): the CPU tables with the pipeline, whose lookups run when
  started (nothing to overlap them with on a CPU: the same work as ``device``);
- ``staged`` (CPU): the step's lookups submitted at step entry to a ``StagedLookupPipeline``
  (layers/staged.py), whose worker thread hashes and gathers while the stand-in layers run,
  each PLE layer taking its rows (``PLELayer.forward(embeddings=...)``). On a GPU the staged
  transport gets its own cases, ``staged_step_<shape>``: the tables in ordinary host memory,
  ``staged`` (ours there) beside ``device`` and ``pinned_pipeline`` (zero copy), timed by the
  wall clock between device syncs (``Case.host_waits``), since such a step waits on the host,
  which the event timing's queue lead would hide;
- ``vllm_triton`` (GPU, ``Case.vllm``: the row's ``speedup_vs_vllm`` is its step over ours;
  when vLLM 0.33.0's source is here: ``bench.vllm_triton``, installed or
  carried in ``$QWEN4EXP_VLLM_SOURCE``): ``pinned_sync`` with vLLM's own lookup in place of our
  gather, as its ``Qwen4ExpPLEPinnedHostEmbedding.sync_lookup`` runs it: the Triton UVA row copy
  ``_lookup_ple_embedding_from_pinned_kernel`` (bf16; fp8, then its eager ``.to(bf16) * scale``)
  or ``_lookup_nvfp4_ple_embedding_kernel`` (NVFP4); the hashing stays ours.

The oracle is ``device`` with each lookup done by the plain-PyTorch ``reference.ngram_ids`` and
``reference.gather_rows``. Timed beside them, racing no one (``Case.references``):
``no_lookup``, the ``device`` step with every PLE layer's lookup left out (its rows are those of
an earlier call), and on a GPU ``h2d_copy``, a non-blocking ``copy_`` of a pinned host buffer of
the step's lookup bytes to the device, and ``pinned_gather``, our gathers alone (both layers,
ids hashed beforehand) from the pinned tables. The check runs one step of every path and the
oracle from the same conv states and ids: all equal ``device`` bit for bit, output and states.

**Each row** adds (``derive``): ``paths``, per path its step quantiles, its exposed lookup time
(``exposed_lookup_us`` = its step's p50 minus the ``no_lookup`` step's p50, same loop: a
difference of medians, not an event measurement, so within noise of 0 when hidden, and noisy on
a shared CPU) and its overhead against ``device`` (``overhead_pct``, p50s);
``lookup_bytes``, what a step's lookups read from the tables (2 layers x T x 16 rows; bf16 320 B
a row, fp8 160, NVFP4 90 with its block scales); ``h2d_copy_gbps`` (those bytes over the
copy's p50), ``pinned_gather_gbps`` and ``pinned_gather_pct_of_h2d`` (GPU; null on a CPU, which
has no link, as ``notes`` says); ``notes``; and a printed ``summary``. ``bytes`` (the CLI's GB/s
and % copy columns) is ``lookup_bytes`` over the whole step's time: a step is mostly compute, so
those columns say little here.

**Ids.** Decode T = 1, 64, 256 (T requests of one token, each with history); prefill T = 8192
(4 fresh requests of 2048 tokens). Every call, whichever path makes it, takes the next of
several batches of random tokens, together COLD_BYTES of rows per cycle, so that no call finds
its rows cached by the one before; the requests' n-gram contexts are fixed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from qwen4exp_ext import ops, reference
from qwen4exp_ext.bench import staged_lookup, vllm_triton
from qwen4exp_ext.bench.gather_rows import HEAD_DIM, NUM_HEADS
from qwen4exp_ext.bench.ngram_ids import VOCAB_SIZE
from qwen4exp_ext.bench.registry import Case, vllm_kernels
from qwen4exp_ext.bench.step_proxy import (
    DECODER_LAYERS,
    FORMATS,
    INPUT_SEED,
    PLE_LAYERS,
    RELEASED_HIDDEN,
    Size,
    StepProxy,
    copy_module_weights,
    fill_table,
    fill_weights,
    ple_layers,
    row_bytes,
    seeded_generator,
    size_for,
    spec_gather_args,
)
from qwen4exp_ext.bench.timing import Quantiles
from qwen4exp_ext.layers import (
    LookupPipeline,
    PLEBatch,
    PLELayer,
    StagedLookupPipeline,
)
from qwen4exp_ext.layers.ngram_embedding import NGramEmbedding
from qwen4exp_ext.testing import exact_mismatch

EXPOSED_METHOD = (
    "p50 of the path's step minus p50 of the no_lookup step (the device step with every PLE "
    "layer's lookup left out), timed in the same interleaved loop; not measured with events"
)
VLLM_CPU_NOTE = (
    "not timed on a CPU: vLLM 0.33.0's pinned-table lookup (vllm_triton) is a Triton UVA kernel "
    "reading host memory from a GPU; a CPU has neither the kernel nor the link"
)
STAGED_STEP_NOTE = (
    "staged_step: the tables in ordinary host memory, each step's lookups submitted to a "
    "StagedLookupPipeline at step entry (a CPU thread hashes, gathers, stages; one copy per "
    "layer), beside pinned_pipeline (zero copy); timed by the wall clock between device syncs, "
    "since the step waits on the host: its exposed lookup is against this case's no_lookup"
)
CPU_NOTE = (
    "CPU: the tables are host memory gathered by the CPU, there is no host-to-device link, so "
    "h2d_copy_gbps, pinned_gather_gbps and pinned_gather_pct_of_h2d are null; the pipeline runs "
    "each lookup when it is started (the same work as device); staged runs them on a worker "
    "thread (StagedLookupPipeline), beside the stand-in layers"
)


# --- lookups put in place of ours (oracle, no_lookup, vllm_triton) ------------------------------

LookupFn = Callable[..., torch.Tensor]


@contextlib.contextmanager
def lookups_replaced(replacements: Sequence[tuple[NGramEmbedding, LookupFn]]) -> Iterator[None]:
    """Each embedding's ``_lookup_local`` (what its PLELayer calls to fill its rows, prefetched
    or not) is ``fn`` inside the block: an instance attribute over the method, removed after."""
    for embedding, fn in replacements:
        embedding._lookup_local = fn
    try:
        yield
    finally:
        for embedding, _ in replacements:
            del embedding._lookup_local


def reference_lookup(embedding: NGramEmbedding) -> LookupFn:
    """The lookup by the spec's plain-PyTorch statement (the oracle's)."""

    def lookup(input_ids, query_start_loc, ngram_context, *, output, **_: Any) -> torch.Tensor:
        ids = reference.ngram_ids(
            input_ids.reshape(-1), query_start_loc, ngram_context, *embedding._hashing()
        )
        gather = spec_gather_args(embedding)
        return output.copy_(reference.gather_rows(embedding.table, ids, **gather))

    return lookup


def no_lookup(embedding: NGramEmbedding) -> LookupFn:
    """No lookup: the rows left in the output buffer by an earlier call."""

    def lookup(input_ids, query_start_loc, ngram_context, *, output, **_: Any) -> torch.Tensor:
        return output

    return lookup


def vllm_rows(
    kernels: Any,
    embedding: NGramEmbedding,
    ids: torch.Tensor,
    output: torch.Tensor,
    staging: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows of ``ids`` [T, NH] into ``output`` [T, NH·d] as vLLM 0.33.0's
    ``Qwen4ExpPLEPinnedHostEmbedding`` looks them up (``_lookup`` then ``dequantize``):
    ``vllm_triton.lookup_rows`` on the layer's table (the pinned table's device view on a GPU),
    fp8 through ``staging`` [>= T·NH, d] uint8."""
    nvfp4 = embedding.nvfp4
    return vllm_triton.lookup_rows(
        kernels,
        embedding.table,
        ids,
        output,
        scale=embedding.weight_scale_2 if nvfp4 else embedding.weight_scale,
        block_scales=embedding.block_scales if nvfp4 else None,
        vocab_start=embedding.vocab_start,
        vocab_end=embedding.vocab_end,
        staging=staging,
    )


def vllm_lookup(kernels: Any, embedding: NGramEmbedding) -> LookupFn:
    """Our hashing, then vLLM's lookup (``vllm_rows``) into the layer's buffer."""
    slot = embedding.prefetch_slot
    staging = None
    if embedding.weight_scale is not None and not embedding.nvfp4:  # fp8: raw rows first
        rows = slot.max_tokens * embedding.ngram_heads
        staging = torch.empty(rows, embedding.head_dim, dtype=torch.uint8, device=slot.rows.device)

    def lookup(
        input_ids, query_start_loc, ngram_context, *, output, ids_output=None, **_: Any
    ) -> torch.Tensor:
        ids = ops.ngram_ids(
            input_ids.reshape(-1),
            query_start_loc,
            ngram_context,
            *embedding._hashing(),
            head_divmod=embedding.ngram_heads_divmod,
            output=ids_output,
        )
        return vllm_rows(kernels, embedding, ids, output, staging)

    return lookup


# --- cases ---------------------------------------------------------------------------------------


@dataclass
class _Tables:
    """One format's PLE layers: ``device`` (device memory, or the CPU tables on a CPU) and on a
    GPU ``pinned`` (the same layers, tables pinned in host memory)."""

    fmt: str
    device: list[PLELayer]
    pinned: list[PLELayer] | None
    # The layers whose tables the CPU reads (the device layers on a CPU; on a GPU a copy with
    # its tables in host memory), and the staged pipeline over them.
    host: list[PLELayer]
    staged: StagedLookupPipeline


def _tables(size: Size, fmt: str, device: torch.device, max_tokens: int) -> _Tables:
    on_gpu = device.type == "cuda"
    layers = ple_layers(size, fmt, "device" if on_gpu else "cpu", device, max_tokens)
    for index, layer in enumerate(layers):
        fill_table(layer.ple_embedding, fmt, seeded_generator(device, 1 + index))
        fill_weights(layer, seeded_generator(device, 101 + index))
    pinned = None
    host = layers
    if on_gpu:
        pinned = ple_layers(size, fmt, "pinned", device, max_tokens)
        host = ple_layers(size, fmt, "cpu", device, max_tokens)
        for source in layers:
            for target in (pinned[layers.index(source)], host[layers.index(source)]):
                copy_module_weights(source, target)
    staged = StagedLookupPipeline(host, max_tokens=max_tokens, device=device)
    return _Tables(fmt, layers, pinned, host, staged)


def cases(device: torch.device) -> list[Case]:
    size = size_for(device)
    proxy = StepProxy(size, device)
    # vLLM's pinned lookups run on a GPU only (this op has no pinned tables on a CPU).
    kernels = vllm_kernels(device).lookups if device.type == "cuda" else None
    out = []
    for fmt in FORMATS:
        tables = _tables(size, fmt, device, proxy.max_tokens)
        for tokens in (*size.decode_tokens, size.prefill_tokens):
            out.append(_case(proxy, tables, tokens, kernels))
            if device.type == "cuda":
                out.append(_case(proxy, tables, tokens, kernels, staged_step=True))
    return out + staged_lookup.cases(proxy)


def _id_batches(proxy: StepProxy, tokens: int, nbytes: int) -> torch.Tensor:
    """[S, T] random tokens: S batches whose lookups touch at least cold_bytes of rows."""
    count = max(2, -(-proxy.size.cold_bytes // nbytes))
    gen = torch.Generator().manual_seed(INPUT_SEED + tokens)
    return torch.randint(0, VOCAB_SIZE, (count, tokens), generator=gen).to(proxy.device)


def _hashed(embedding: NGramEmbedding, batch: PLEBatch, tokens: torch.Tensor) -> torch.Tensor:
    """[S, T, NH] ids of every batch of ``tokens`` [S, T] in ``batch``'s requests, in one call:
    S copies of the requests, back to back (no n-gram crosses a request)."""
    copies, count = tokens.shape
    qsl = batch.query_start_loc.to(torch.int64)
    starts = (qsl[:-1][None, :] + count * torch.arange(copies, device=qsl.device)[:, None]).reshape(
        -1
    )
    qsl_all = torch.cat((starts, qsl.new_tensor([copies * count]))).to(torch.int32)
    context = batch.ngram_context.repeat(copies, 1)
    ids = ops.ngram_ids(
        tokens.reshape(-1),
        qsl_all,
        context,
        *embedding._hashing(),
        head_divmod=embedding.ngram_heads_divmod,
    )
    return ids.reshape(copies, count, -1)


def _case(
    proxy: StepProxy, tables: _Tables, tokens: int, kernels: Any, staged_step: bool = False
) -> Case:
    """The step case of ``tokens``; with ``staged_step`` (a GPU) the staged transport's step
    beside the zero-copy one, by the wall clock (``STAGED_STEP_NOTE``)."""
    device, size, fmt = proxy.device, proxy.size, tables.fmt
    on_gpu = device.type == "cuda"
    batch = proxy.batches[tokens]
    phase = "prefill" if tokens == size.prefill_tokens else "decode"
    name = f"{'staged_step_' if staged_step else ''}{phase}_T{tokens}_{fmt}"
    lookup_bytes = len(PLE_LAYERS) * tokens * NUM_HEADS * row_bytes(fmt)
    id_batches = _id_batches(proxy, tokens, lookup_bytes)
    cursor = [0]

    def next_ids() -> int:
        """The next batch's tokens into the step's id buffer (every call, whoever makes it)."""
        i = cursor[0]
        cursor[0] = (i + 1) % id_batches.shape[0]
        batch.input_ids.copy_(id_batches[i])
        return i

    def step_of(
        layers: list[PLELayer],
        pipeline: LookupPipeline | None = None,
        replace: Callable[[NGramEmbedding], LookupFn] | None = None,
    ) -> Callable[[], torch.Tensor]:
        replacements = (
            []
            if replace is None
            else [(la.ple_embedding, replace(la.ple_embedding)) for la in layers]
        )

        def step() -> torch.Tensor:
            next_ids()
            with lookups_replaced(replacements):
                return proxy.step(layers, batch, pipeline)

        return step

    host_ids = id_batches.cpu()
    host_qsl, host_context = batch.query_start_loc.cpu(), batch.ngram_context.cpu()

    def staged_step_fn() -> torch.Tensor:
        i = next_ids()
        host_inputs = (host_ids[i], host_qsl, host_context)
        return proxy.step(tables.host, batch, staged=tables.staged, host_inputs=host_inputs)

    paths: dict[str, Callable[[], torch.Tensor]] = {"device": step_of(tables.device)}
    notes = []
    if staged_step:
        ours_name = "staged"
        paths["pinned_pipeline"] = step_of(tables.pinned, LookupPipeline(tables.pinned))
        paths[ours_name] = staged_step_fn
        notes.append(STAGED_STEP_NOTE)
    elif on_gpu:
        ours_name = "pinned_pipeline"
        paths["pinned_sync"] = step_of(tables.pinned)
        paths[ours_name] = step_of(tables.pinned, LookupPipeline(tables.pinned))
        paths["pinned_pipeline_dedupe"] = step_of(
            tables.pinned, LookupPipeline(tables.pinned, dedupe=True)
        )
        if kernels is not None:
            paths["vllm_triton"] = step_of(tables.pinned, replace=lambda e: vllm_lookup(kernels, e))
        else:
            notes.append(
                "vllm_triton not timed: no vLLM 0.33.0 source here (install vLLM, or carry "
                f"python -m qwen4exp_ext.bench.vllm_triton DIR and set ${vllm_triton.SOURCE_ENV})"
            )
    else:
        ours_name = "pipeline"
        paths[ours_name] = step_of(tables.device, LookupPipeline(tables.device))
        paths["staged"] = staged_step_fn
        notes.append(CPU_NOTE)
    if size.name != "released":
        notes.append(
            f"size {size.name!r}: H = {size.hidden} (released {RELEASED_HIDDEN}), F = "
            f"{size.ffn}, {tables.device[0].ple_embedding.num_rows:,} table rows: the compute "
            "around the lookups is scaled down (bench/host_lookup.py)"
        )
    oracle = step_of(tables.device, replace=reference_lookup)
    references: dict[str, Callable[[], object]] = {
        "no_lookup": step_of(tables.device, replace=no_lookup)
    }
    if on_gpu:
        references.update(_gpu_references(tables, batch, id_batches, lookup_bytes, next_ids))

    def check() -> str | None:
        return _check(proxy, {**paths, "oracle": oracle}, cursor)

    baselines = {who: fn for who, fn in paths.items() if who != ours_name}
    embedding = tables.device[0].ple_embedding
    params: dict[str, object] = {
        "T": tokens,
        "R": len(batch.request_ids),
        "format": fmt,
        "size": size.name,
        "ours": ours_name,
        "paths": list(paths),
        "decoder_layers": DECODER_LAYERS,
        "ple_layers": list(PLE_LAYERS),
        "H": size.hidden,
        "M": size.hc_count,
        "F": size.ffn,
        "stand_in_params": 2 * size.hidden * size.ffn,
        "rows": embedding.num_rows,
        "row_bytes": row_bytes(fmt),
        "NH": NUM_HEADS,
        "d": HEAD_DIM,
        "id_batches": id_batches.shape[0],
        "vllm_kernels": vllm_triton.source_origin() if "vllm_triton" in paths else None,
    }
    return Case(
        op="host_lookup",
        name=name,
        tokens=tokens,
        nbytes=lookup_bytes,
        ours=paths[ours_name],
        oracle=oracle,
        baselines=baselines,
        params=params,
        check=check,
        references=references,
        derive=_deriver(ours_name, list(paths), lookup_bytes, notes),
        vllm="vllm_triton" if "vllm_triton" in paths else None,
        vllm_note=None if "vllm_triton" in paths else (notes[0] if on_gpu else VLLM_CPU_NOTE),
        host_waits=staged_step,
    )


def _gpu_references(
    tables: _Tables,
    batch: PLEBatch,
    id_batches: torch.Tensor,
    lookup_bytes: int,
    next_ids: Callable[[], int],
) -> dict[str, Callable[[], object]]:
    """h2d_copy (a pinned buffer of the step's lookup bytes, copied non-blocking) and
    pinned_gather (our gathers alone, both layers, ids hashed beforehand, pinned tables)."""
    source = torch.zeros(lookup_bytes, dtype=torch.uint8).pin_memory()
    target = torch.zeros(lookup_bytes, dtype=torch.uint8, device=id_batches.device)
    embeddings = [layer.ple_embedding for layer in tables.pinned]
    hashed = [_hashed(e, batch, id_batches) for e in embeddings]
    tokens = id_batches.shape[1]

    def gather() -> torch.Tensor:
        i = next_ids()
        for embedding, ids in zip(embeddings, hashed, strict=True):
            out = ops.gather_rows(
                embedding.table,
                ids[i],
                **embedding._dequant(),
                vocab_start=embedding.vocab_start,
                vocab_end=embedding.vocab_end,
                out_dtype=embedding.out_dtype,
                output=embedding.prefetch_slot.rows[:tokens],
            )
        return out

    return {
        "h2d_copy": lambda: target.copy_(source, non_blocking=True),
        "pinned_gather": gather,
    }


def _check(
    proxy: StepProxy, steps: Mapping[str, Callable[[], torch.Tensor]], cursor: list[int]
) -> str | None:
    """One step of every path (and the oracle) from the same conv states and the first id
    batch: each must equal the device path's, output and conv states, bit for bit."""
    states = proxy.conv_states()
    saved = [s.clone() for s in states]
    got = {}
    try:
        for who, step in steps.items():
            for state, before in zip(states, saved, strict=True):
                state.copy_(before)
            cursor[0] = 0
            got[who] = (step().clone(), [s.clone() for s in states])
    finally:
        for state, before in zip(states, saved, strict=True):
            state.copy_(before)
    want_out, want_states = got["device"]
    for who, (out, after) in got.items():
        against = "the device path"
        problem = exact_mismatch(
            out, want_out, f"{who}'s step output", against=against, bitwise=True
        )
        for layer, (a, b) in enumerate(zip(after, want_states, strict=True)):
            what = f"{who}'s conv state of PLE layer {layer}"
            problem = problem or exact_mismatch(a, b, what, against=against, bitwise=True)
        if problem is not None:
            return problem
    return None


def _deriver(
    ours_name: str, path_names: list[str], lookup_bytes: int, notes: list[str]
) -> Callable[[Mapping[str, Quantiles]], dict[str, object]]:
    def derive(times: Mapping[str, Quantiles]) -> dict[str, object]:
        def timed(path: str) -> Quantiles:
            return times["ours" if path == ours_name else path]

        device = timed("device").p50_us
        base = times["no_lookup"].p50_us
        paths = {
            path: {
                "step": asdict(timed(path)),
                "exposed_lookup_us": timed(path).p50_us - base,
                "overhead_pct": 100.0 * (timed(path).p50_us - device) / device,
            }
            for path in path_names
        }

        def gbps(who: str) -> float | None:
            q = times.get(who)
            return None if q is None else lookup_bytes / (q.p50_us * 1e3)

        h2d, gather = gbps("h2d_copy"), gbps("pinned_gather")
        pct = None if h2d is None or gather is None else 100.0 * gather / h2d
        return {
            "ours_path": ours_name,
            "paths": paths,
            "exposed_lookup_method": EXPOSED_METHOD,
            "lookup_bytes": lookup_bytes,
            "h2d_copy_gbps": h2d,
            "pinned_gather_gbps": gather,
            "pinned_gather_pct_of_h2d": pct,
            "notes": list(notes),
            "summary": _summary(paths, base, h2d, gather, pct),
        }

    return derive


def _summary(
    paths: Mapping[str, Mapping[str, Any]],
    no_lookup_us: float,
    h2d: float | None,
    gather: float | None,
    pct: float | None,
) -> str:
    steps = ", ".join(
        f"{path} {p['step']['p50_us']:.1f} ({p['overhead_pct']:+.1f}%)" for path, p in paths.items()
    )
    exposed = ", ".join(f"{path} {p['exposed_lookup_us']:.1f}" for path, p in paths.items())
    text = f"step p50 µs: {steps}, no_lookup {no_lookup_us:.1f}\nexposed lookup µs: {exposed}"
    if h2d is None:
        return text + "\nh2d copy and pinned gather: - (no host-to-device link on a CPU)"
    return text + f"\nh2d copy {h2d:.1f} GB/s, pinned gather {gather:.1f} GB/s = {pct:.0f}% of it"
