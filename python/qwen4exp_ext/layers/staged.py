"""PLE lookups staged by CPU threads: for tables the GPU cannot read itself.

A table in ordinary host memory or in a file (``placement="cpu"`` or ``"file"``) cannot be read
zero-copy by the GPU: its rows have to be gathered by the CPU into pinned staging buffers and
copied to the device. The token ids of a step are on the host when the step is prepared, so the
whole lookup (hash, gather, copy) can run on a CPU thread ahead of the model, as ROCm's ATOM does
for DeepSeek's Engram rows and SGLang for rows streamed from NVMe:

    pipeline = StagedLookupPipeline([layer_a, layer_b], max_tokens=8192, device="cuda")
    step = pipeline.submit(input_ids, query_start_loc, ngram_context)   # host tensors
    ...                                          # the worker hashes and gathers meanwhile
    rows_a = step.rows(0)                        # waits for layer a's rows only
    ...
    step.release()                               # its buffers may be refilled
    pipeline.close()                             # joins the worker (also: ``with pipeline:``)

How it runs:

- **One worker thread, layers in order.** ``submit`` copies the step's inputs into the step's
  slot and returns; the worker hashes each layer's ids (``ngram_ids``, or the fused CPU lookup)
  and gathers its rows into that layer's staging buffer with the CPU kernels (torch's intra-op
  threads); on a GPU it then queues the layer's asynchronous host-to-device copy on a copy
  stream (with ``decode="device"``, and the decode) and records an event.
  ``rows(l)`` waits for layer l only: the first PLE layer does not wait for the deeper ones.
- **Double-buffered.** Steps alternate between two slots (buffers of every layer), so step n+1
  is prepared while step n's rows are read. A slot is refilled only after the step that used it
  was released (``release`` or leaving ``with step:``): ``submit`` waits for that (and raises
  ``TimeoutError`` after ``timeout`` seconds, when given). On a GPU the copy stream also waits on
  the event that ``release`` records on the consumer's stream before overwriting the device
  rows, and the worker waits for a staging buffer's previous copy to finish before refilling it.
- **Where fp8 and NVFP4 rows are decoded** (``decode``): by the CPU gather, into the staging
  (``"auto"``, the default), as measured. The alternative (``"device"``) stages each layer's raw
  rows (the table file's row layout: values, then NVFP4 block scales) and their local ids, copies
  both, and lets the device's gather decode them (``NGramEmbedding._raw_rows``, ``_local_ids``,
  ``_decode_raw``: bit for bit the gather from the table); it moves 2x (fp8) to 3.6x (NVFP4)
  fewer bytes over the link, but reading rows raw costs the worker more than decoding them
  (``qwen4exp-bench host_lookup``, 2-core Zen 4, same run: ``raw_rows`` 668 us against
  ``decode_rows`` 233 us for fp8 at T = 64, 603 against 382 for NVFP4; torch's ``index_select``
  moving bytes is slower than our gather decoding them), while at T = 64 the bytes saved are
  ~160 KB a layer, a few us of PCIe. ``"device"`` stays for a GPU run to compare
  (``staged_device_decode`` in the bench) and for a faster raw read later.
- **Errors** (a short read of a file table, a table freed under the pipeline, anything the
  worker raises for a step, torch refusing its thread count included) are raised by ``rows`` of
  the failed layer and of every later layer of that step, never as partial rows; the other
  slot's rows, a previous step's, are untouched, and the worker goes on with the next step.
- **Small steps inline** (``inline``): handing a step to the worker and its rows back costs
  thread wake-ups and GIL hand-offs, which on a 2-core Xeon cost more than a decode step's
  lookup (issue #51: T = 64 from a warm table file, 0.90x the ``np.memmap`` baseline at 1
  thread). How much depends on the machine (on the 2-core AMD EPYC VM of this change, a whole
  step of submit, rows and release took about the same on the worker as inline, ~285 us, the
  lookups themselves ~200 us of it; since inline steps no longer wake the idle worker, the
  pipeline's own share of an inline step of two small layers fell from 159-294 us to 67 us),
  so the choice is measured, not set. With
  ``inline="auto"`` (the default) the pipeline measures what each way costs the consumer, per
  step size (tokens, to a power of two): on the worker the time spent in ``submit`` plus the
  time ``rows`` blocked; inline the time spent in ``submit``, which then runs the lookups. A
  step goes the way whose last five steps of its size had the lower median cost (the first
  three steps of a size on the worker, the next three inline; every 32nd step the other way, to
  measure it again), and inline only while the worker is idle and the
  submitter's thread count is the step's. So a step the consumer overlaps with work keeps its
  worker (its rows come at no wait), and one whose rows are waited for at once runs where that
  costs no hand-off. ``"always"``/``"never"`` pin the choice (tests, measurements). An inline
  step's rows and errors are the worker's: ``rows`` returns or raises the same. An inline step
  reads the caller's tensors where they are (a worker's step copies them into its slot, as the
  caller may reuse them once ``submit`` returns), and no layer checks the batch again after
  ``submit`` did: the Python of an inline step of two layers, its lookups left out, is ~28 us
  (53 us before both). That Python costs 3-10x as much after other work has evicted the
  caches and TLBs (the decode step of a server: the model's weights stream between two
  lookups), so each call, check and tensor view left out of a step counts several times.
- **Vocabulary shards**: the first ``rows(l)`` of a step reduces layer l's rows across the ranks
  (a collective: every rank calls it, in the same layer order); later calls return the same
  rows, and ``wait`` runs no collective.

On a CPU-only machine the rows are delivered in the staging buffers themselves (``device`` =
CPU): the same calls, with the overlap of the worker thread.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .prefetch import (
    _embedding_of,
    check_batch,
    check_timeout,
    layer_index,
    modules_of,
    positive_int,
)

__all__ = ["StagedLookupPipeline", "StagedStep"]

SLOTS = 2  # double buffering: one step read, the next prepared
DECODES = ("auto", "host", "device")
INLINE = ("auto", "always", "never")
EXPLORE_EVERY = 32  # with inline="auto", every 32nd step of a size goes the other way
SAMPLES = 3  # costs measured of each way before choosing; a way's cost: the median of the last 5


@dataclass
class _Slot:
    """One step's buffers for every layer, and where that step stands."""

    input_ids: torch.Tensor  # [max_tokens] int64, host
    query_start_loc: torch.Tensor  # [max_tokens + 1] int32 (the batch's dtype), host
    ngram_context: torch.Tensor | None
    staging: list[torch.Tensor]  # per layer [max_tokens, D_e], host (pinned on a GPU)
    ids: list[torch.Tensor]  # per layer [max_tokens, NH] int64, host
    device_rows: list[torch.Tensor] | None  # per layer [max_tokens, D_e] on the GPU
    # Layers decoded by the device (raw rows staged): per layer the raw rows [max_tokens·NH,
    # row_bytes] and their local ids [max_tokens·NH] on the host (pinned on a GPU), and their
    # copies on the GPU (the host ones on a CPU); None for layers decoded on the host.
    raw: list[torch.Tensor | None]
    local: list[torch.Tensor | None]
    device_raw: list[torch.Tensor | None]
    device_local: list[torch.Tensor | None]
    copied: list[torch.cuda.Event] | None  # per layer: its host-to-device copy is done
    released: torch.cuda.Event | None  # recorded on the consumer's stream by release()
    step: StagedStep | None = None  # the step using the slot, until released


class StagedStep:
    """One submitted step: its rows per layer, as the worker finishes them."""

    def __init__(
        self, pipeline: StagedLookupPipeline, slot: _Slot, number: int, tokens: int, threads: int
    ):
        self._pipeline = pipeline
        self._slot = slot
        self.number = number
        self.num_tokens = tokens
        self._ready = 0  # layers whose rows are complete (and queued to the GPU)
        self._error: BaseException | None = None
        self._released = False
        self.threads = threads  # the worker's intra-op threads for this step's lookups
        # Per layer, the rows handed out, reduced over vocabulary shards: the reduction is a
        # collective (in place for an all-reduce), so it runs once per layer and step, however
        # often rows() is called.
        self._rows: dict[int, torch.Tensor] = {}
        self._inline = False  # run on the submitting thread (StagedLookupPipeline's inline)
        self._cost = 0.0  # seconds the consumer spent in submit and blocked in rows

    def rows(self, layer: int | Any, timeout: float | None = None) -> torch.Tensor:
        """Layer ``layer``'s rows [T, D_e] (an index into the pipeline's modules, or the
        module), as its embedding's ``forward`` returns them, on the pipeline's device. Waits
        for that layer only (on a GPU: the current stream waits on its copy's event). Valid
        until :meth:`release`. Raises the worker's error if this layer's lookup failed. With
        vocabulary shards the first call of a layer all-reduces its rows (every rank must call
        it, in the same layer order; on a GPU, on the current stream of that call); later calls
        return the same rows."""
        index = self._pipeline._index(layer, "StagedStep.rows")
        rows = self._rows.get(index)
        if rows is None:
            self._wait_for(index, timeout)
            rows = self._rows[index] = self._pipeline.embeddings[index]._reduced(
                self._local_rows(index), reduce=True
            )
        return rows

    def _wait_for(self, index: int, timeout: float | None) -> None:
        """Waits until layer ``index``'s rows are complete; raises the worker's error (for this
        layer and every later one) or TimeoutError."""
        timeout = check_timeout(timeout, "StagedStep.rows")
        if self._released:
            raise RuntimeError(f"StagedStep {self.number} was released; its rows are gone")
        if self._ready > index:  # done (an int read under the GIL): no lock, no wait
            return
        start = time.perf_counter()
        try:
            self._wait_locked(index, timeout)
        finally:
            self._cost += time.perf_counter() - start

    def _wait_locked(self, index: int, timeout: float | None) -> None:
        with self._pipeline._cond:
            done = self._pipeline._cond.wait_for(
                lambda: self._ready > index or self._error is not None, timeout
            )
            if not done:
                raise TimeoutError(
                    f"StagedStep {self.number}: layer {index}'s rows not ready after {timeout} s"
                )
            if self._ready <= index:
                error = self._error
                raise RuntimeError(
                    f"StagedStep {self.number}: no rows for layer {index}: the lookup of layer "
                    f"{self._ready} failed ({type(error).__name__}: {error})"
                ) from error

    def _local_rows(self, index: int) -> torch.Tensor:
        """This rank's rows of layer ``index`` (complete), not yet reduced."""
        slot, tokens = self._slot, self.num_tokens
        if slot.device_rows is None:
            return slot.staging[index][:tokens]
        device = slot.device_rows[index].device
        torch.cuda.current_stream(device).wait_event(slot.copied[index])
        return slot.device_rows[index][:tokens]

    def wait(self, timeout: float | None = None) -> None:
        """Waits until every layer's rows are ready (or raises the worker's error). Reduces
        nothing: the reductions over vocabulary shards run in :meth:`rows`, in the caller's
        layer order."""
        self._wait_for(len(self._pipeline.embeddings) - 1, timeout)

    def release(self) -> None:
        """Hands the step's buffers back for a later step (idempotent). On a GPU, work queued so
        far on the current stream (the reads of these rows) finishes before they are refilled."""
        if self._released:
            return
        self._released = True
        self._pipeline._release(self)  # measures the step first: which rows were read
        self._rows.clear()

    def __enter__(self) -> StagedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class _Job:
    step: StagedStep
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] = field(repr=False)


class StagedLookupPipeline:
    """The CPU-staged lookups of PLE layers with host or file tables (module docstring).

    ``modules``: :class:`~.ple_layer.PLELayer` or :class:`~.ngram_embedding.NGramEmbedding`
    modules whose tables the CPU reads (placement ``"cpu"`` or ``"file"``), in layer order.
    ``max_tokens``: the most tokens of a step. ``device``: where the rows are delivered (default
    the CPU; a CUDA/ROCm device: pinned staging and one copy per layer). ``decode``: where fp8
    and NVFP4 rows are decoded: ``"host"`` (the CPU gather decodes them into the staging),
    ``"device"`` (their raw rows are staged and copied, and the device's gather decodes them),
    or ``"auto"`` (the default: ``"host"``, as measured; see the module docstring).
    Other tables' rows are their values: always staged as they are. ``threads``: the worker's
    intra-op threads for the CPU kernels (default: each step uses the count of the thread that
    submitted it, ``torch.get_num_threads()``; a thread's count is its own in torch, so without
    this the worker would keep the count of its first lookup); 1 to ``os.cpu_count()``.
    ``inline``: ``"auto"`` (default: each step where it costs the consumer less, as measured),
    ``"always"`` (every step that can, on the submitting thread) or ``"never"`` (every step on
    the worker); see the module docstring. Every argument is checked before the worker
    starts."""

    def __init__(
        self,
        modules: Iterable[Any],
        *,
        max_tokens: int,
        device: torch.device | str | None = None,
        decode: str = "auto",
        threads: int | None = None,
        inline: str = "auto",
    ) -> None:
        # Every argument is checked before anything is allocated or the worker is started: a
        # refused pipeline leaves no thread behind.
        who = "StagedLookupPipeline"
        self.modules = modules_of(modules, who)
        self.embeddings = [_embedding_of(module, who) for module in self.modules]
        if not self.embeddings:
            raise ValueError("StagedLookupPipeline needs at least one layer")
        for embedding in self.embeddings:
            if not embedding.host_table:
                raise ValueError(
                    "StagedLookupPipeline reads host tables (placement 'cpu' or 'file'); a "
                    f"{embedding.placement!r} table is read by its device: use LookupPipeline"
                )
        # A batch is checked once per n-gram size (the only part of a layer check_batch reads),
        # not once per layer: the layers' lookups then skip it.
        checks: dict[int, Any] = {}
        for embedding in self.embeddings:
            checks.setdefault(embedding.ngram_size, embedding)
        self._batch_checks = list(checks.values())
        self.max_tokens = positive_int(max_tokens, "max_tokens", who)
        self.threads = None if threads is None else _check_threads(threads)
        self.device = _check_device(device)
        on_gpu = self.device.type == "cuda"
        if not isinstance(decode, str) or decode not in DECODES:
            raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
        if not isinstance(inline, str) or inline not in INLINE:
            raise ValueError(f"inline must be one of {INLINE}, got {inline!r}")
        self.inline = inline
        # Per step size (tokens.bit_length()): [the worker's costs, inline's costs (the last
        # five of each, in seconds), steps of that size so far]. Medians: a step preempted by
        # another process, or the first one on a thread, says little of the next.
        self._costs: dict[int, list] = {}
        self._last: StagedStep | None = None  # the step submitted last
        self._check_memory()
        on_device = decode == "device"  # "auto": the host, as measured (module docstring)
        self.decode_on_device = [on_device and e.quantized for e in self.embeddings]
        self._copy_stream = torch.cuda.Stream(device=self.device) if on_gpu else None
        self._slots = [self._make_slot(on_gpu) for _ in range(SLOTS)]
        # Two conditions on one lock: the worker waits on _work (a job queued, or the stop) and
        # nothing else; consumers wait on _cond (a layer's rows ready, a slot released, an
        # error). Notifying the worker of every layer and release it has no use for woke it
        # for nothing: with inline steps ~10 us of futex wake and GIL hand-off each, twice a
        # layer.
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._work = threading.Condition(lock)
        self._jobs: list[_Job] = []
        self._submitted = 0
        self._closed = False
        self._worker = threading.Thread(
            target=_work,
            args=(weakref.ref(self), self._cond, self._work, self._jobs),
            daemon=True,
            name="qwen4exp-staged-lookups",
        )
        self._worker.start()
        # The worker holds no reference to the pipeline between jobs: when the pipeline is
        # dropped without close(), this stops and joins it.
        self._finalizer = weakref.finalize(
            self, _stop, self._cond, self._work, self._jobs, self._worker
        )

    def _check_memory(self) -> None:
        """Refuses a ``max_tokens`` whose buffers (two slots of every layer's staging and ids)
        would not fit in this machine's memory, before allocating any."""
        per_token = sum(
            e.embedding_dim * e.out_dtype.itemsize + e.ngram_heads * 8 for e in self.embeddings
        )
        need = SLOTS * self.max_tokens * (per_token + 12)  # + input_ids, query_start_loc
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > have:
            raise ValueError(
                f"StagedLookupPipeline: max_tokens={self.max_tokens} needs {need} bytes of "
                f"staging buffers, more than this machine's memory ({have} bytes)"
            )

    def _make_slot(self, on_gpu: bool) -> _Slot:
        n = self.max_tokens
        pin = on_gpu

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        def raw_buffers(on_host: bool) -> tuple[list, list]:
            raws, locals_ = [], []
            for embedding, on_device in zip(self.embeddings, self.decode_on_device, strict=True):
                if not on_device:
                    raws.append(None)
                    locals_.append(None)
                    continue
                rows = n * embedding.ngram_heads
                width = embedding.table_file_header.row_bytes
                if on_host:
                    raws.append(host(rows, width, dtype=torch.uint8))
                    locals_.append(host(rows, dtype=torch.int64))
                else:
                    raws.append(torch.zeros(rows, width, dtype=torch.uint8, device=self.device))
                    locals_.append(torch.zeros(rows, dtype=torch.int64, device=self.device))
            return raws, locals_

        raw, local = raw_buffers(on_host=True)
        device_raw, device_local = raw_buffers(on_host=False) if on_gpu else (raw, local)
        return _Slot(
            input_ids=host(n, dtype=torch.int64),
            query_start_loc=host(n + 1, dtype=torch.int32),
            ngram_context=None,
            staging=[host(n, e.embedding_dim, dtype=e.out_dtype) for e in self.embeddings],
            ids=[torch.zeros(n, e.ngram_heads, dtype=torch.int64) for e in self.embeddings],
            device_rows=(
                [
                    torch.zeros(n, e.embedding_dim, dtype=e.out_dtype, device=self.device)
                    for e in self.embeddings
                ]
                if on_gpu
                else None
            ),
            copied=[torch.cuda.Event() for _ in self.embeddings] if on_gpu else None,
            released=torch.cuda.Event() if on_gpu else None,
            raw=raw,
            local=local,
            device_raw=device_raw,
            device_local=device_local,
        )

    def __len__(self) -> int:
        return len(self.modules)

    def _index(self, layer: int | Any, who: str) -> int:
        return layer_index(self.embeddings, layer, who)

    def submit(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        *,
        timeout: float | None = None,
    ) -> StagedStep:
        """Starts the lookups of one step (host tensors, as ``NGramEmbedding.forward`` takes
        them; copied here, so the caller may reuse them at once) and returns its handle. Waits
        while the slot it needs is still held by the step two before (``release``)."""
        who = "StagedLookupPipeline.submit"
        start = time.perf_counter()
        if self._closed:
            raise RuntimeError(f"{who}: the pipeline is closed")
        timeout = check_timeout(timeout, who)
        for embedding in self._batch_checks:
            check_batch(embedding, input_ids, query_start_loc, ngram_context, who)
        inputs = (input_ids.reshape(-1), query_start_loc, ngram_context)
        for name, tensor in zip(
            ("input_ids", "query_start_loc", "ngram_context"), inputs, strict=True
        ):
            if not tensor.is_cpu:
                raise ValueError(
                    f"StagedLookupPipeline.submit: {name} must be on the host (the step's ids "
                    f"are there when it is prepared), got {tensor.device}"
                )
        if not self._worker.is_alive():
            raise RuntimeError(f"{who}: the pipeline's worker thread has stopped")
        tokens = inputs[0].numel()
        if tokens > self.max_tokens:
            raise ValueError(
                f"StagedLookupPipeline.submit: the batch has {tokens} tokens but the buffers "
                f"hold {self.max_tokens} (max_tokens); nothing was started"
            )
        slot = self._slots[self._submitted % SLOTS]
        with self._cond:
            if not self._cond.wait_for(lambda: slot.step is None or self._closed, timeout):
                raise TimeoutError(
                    f"StagedLookupPipeline.submit: step {slot.step.number}'s buffers are still "
                    f"held after {timeout} s; release() each step when its rows are read"
                )
            if self._closed:
                raise RuntimeError("StagedLookupPipeline.submit: the pipeline is closed")
            threads = self.threads or torch.get_num_threads()
            step = StagedStep(self, slot, self._submitted, tokens, threads)
            slot.step = step
            self._submitted += 1
            last, self._last = self._last, step
            step._inline = self._runs_inline(tokens, threads, last)
            if step._inline:
                # Run before submit returns: the caller's tensors are read as they are, not
                # copied (three copies and their views: ~10 us of an inline step's Python).
                job = _Job(step, inputs)
            else:
                job = _Job(step, self._copy_inputs(slot, inputs))
                self._jobs.append(job)
                self._work.notify()
        if step._inline:
            try:
                self._run(job)
            except BaseException as error:  # noqa: BLE001 - handed to rows(), as the worker's
                _fail(self._cond, step, error)
                if not isinstance(error, Exception):
                    raise  # KeyboardInterrupt, SystemExit: the caller's
        step._cost = time.perf_counter() - start
        return step

    def _copy_inputs(self, slot: _Slot, inputs: tuple) -> tuple:
        """The step's inputs copied into ``slot`` (with the lock held), for the worker: the
        caller may reuse its tensors as soon as submit returns."""
        input_ids, query_start_loc, ngram_context = inputs
        tokens = input_ids.numel()
        slot.input_ids[:tokens].copy_(input_ids)
        qsl = slot.query_start_loc
        if qsl.dtype != query_start_loc.dtype or qsl.numel() < query_start_loc.numel():
            qsl = slot.query_start_loc = torch.zeros(
                max(self.max_tokens + 1, query_start_loc.numel()),
                dtype=query_start_loc.dtype,
                pin_memory=slot.device_rows is not None,
            )
        qsl[: query_start_loc.numel()].copy_(query_start_loc)
        slot.ngram_context = ngram_context.clone()
        return (slot.input_ids[:tokens], qsl[: query_start_loc.numel()], slot.ngram_context)

    def _runs_inline(self, tokens: int, threads: int, last: StagedStep | None) -> bool:
        """Whether a step of ``tokens`` runs on the submitting thread (with the lock held): only
        while the worker is idle (no step queued, the last one done) and with the submitter's
        own thread count; then as ``inline`` says (module docstring)."""
        if self.inline == "never" or self._jobs or threads != torch.get_num_threads():
            return False
        if last is not None and last._ready < len(self.embeddings) and last._error is None:
            return False
        if self.inline == "always":
            return True
        costs = self._costs.get(tokens.bit_length())
        if costs is None:
            costs = self._costs[tokens.bit_length()] = [deque(maxlen=5), deque(maxlen=5), 0]
        worker, inline, steps = costs
        costs[2] = steps + 1
        if len(worker) < SAMPLES:
            return False
        if len(inline) < SAMPLES:
            return True
        faster = statistics.median(inline) < statistics.median(worker)
        if steps % EXPLORE_EVERY == 0:  # the other way, measured again
            return not faster
        return faster

    def _measured(self, step: StagedStep) -> None:
        """Adds a released step's cost to the last costs of its way and size; a failed step, or
        one whose rows were not all read, says nothing of either."""
        if step._error is not None or len(step._rows) < len(self.embeddings):
            return
        costs = self._costs.get(step.num_tokens.bit_length())
        if costs is None:
            return
        costs[1 if step._inline else 0].append(step._cost)

    def _release(self, step: StagedStep) -> None:
        if self.inline == "auto":
            self._measured(step)
        slot = step._slot
        if slot.released is not None:
            slot.released.record(torch.cuda.current_stream(self.device))
        with self._cond:
            if slot.step is step:
                slot.step = None
            self._cond.notify_all()

    def _run(self, job: _Job) -> None:
        """The worker's part of one step: every layer in order (see the module docstring)."""
        step = job.step
        slot = step._slot
        tokens = step.num_tokens
        if torch.get_num_threads() != step.threads:  # this thread's count (module docstring)
            torch.set_num_threads(step.threads)
        for index in range(len(self.embeddings)):
            if slot.copied is not None:
                slot.copied[index].synchronize()  # the last copy out of this staging is done
            if self.decode_on_device[index]:
                self._stage_raw(slot, index, tokens, job.inputs)
            else:
                self._stage_rows(slot, index, tokens, job.inputs)
            if step._inline:  # nobody waits: submit has not handed the step out yet
                step._ready = index + 1
            else:
                with self._cond:
                    step._ready = index + 1
                    self._cond.notify_all()

    def _stage_rows(self, slot: _Slot, index: int, tokens: int, inputs: tuple) -> None:
        """Layer ``index``'s rows decoded by the CPU gather into its staging (one copy to the
        GPU after)."""
        embedding = self.embeddings[index]
        staging = slot.staging[index][:tokens]
        embedding._lookup_local(
            *inputs, output=staging, ids_output=slot.ids[index][:tokens], batch_checked=True
        )
        if slot.device_rows is not None:
            stream = self._copy_stream
            stream.wait_event(slot.released)  # the last reads of the device rows
            with torch.cuda.stream(stream):
                slot.device_rows[index][:tokens].copy_(staging, non_blocking=True)
            slot.copied[index].record(stream)

    def _stage_raw(self, slot: _Slot, index: int, tokens: int, inputs: tuple) -> None:
        """Layer ``index``'s raw rows and local ids staged by the CPU (two copies to the GPU),
        then decoded by the device's gather into its rows (on a CPU: into the staging)."""
        embedding = self.embeddings[index]
        ids = embedding._ngram_ids(*inputs, slot.ids[index][:tokens], batch_checked=True)
        flat = ids.reshape(-1)
        n = flat.numel()
        embedding._raw_rows(flat, slot.raw[index][:n])
        embedding._local_ids(flat, slot.local[index][:n])
        raw, local = slot.device_raw[index][:n], slot.device_local[index][:n]
        if slot.device_rows is None:
            embedding._decode_raw(raw, local.view(ids.shape), slot.staging[index][:tokens])
            return
        stream = self._copy_stream
        stream.wait_event(slot.released)  # the last reads of the device buffers
        with torch.cuda.stream(stream):
            raw.copy_(slot.raw[index][:n], non_blocking=True)
            local.copy_(slot.local[index][:n], non_blocking=True)
            rows = slot.device_rows[index][:tokens]
            embedding._decode_raw(raw, local.view(ids.shape), rows)
        slot.copied[index].record(stream)

    def close(self, timeout: float | None = None) -> None:
        """Stops the worker after the steps already submitted and joins it (idempotent); raises
        TimeoutError when it is still running after ``timeout`` seconds (then a later close
        joins it again)."""
        timeout = check_timeout(timeout, "StagedLookupPipeline.close")
        self._closed = True
        _stop(self._cond, self._work, self._jobs, self._worker, timeout)
        if self._worker.is_alive():
            raise TimeoutError(
                f"StagedLookupPipeline.close: the worker is still running after {timeout} s"
            )
        self._finalizer.detach()

    def __enter__(self) -> StagedLookupPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _work(
    pipeline_ref: weakref.ref, cond: threading.Condition, work: threading.Condition, jobs: list
) -> None:
    """The worker thread: runs submitted jobs in order (waiting on ``work``; ``cond``, on the
    same lock, tells consumers of each step's progress); stops on ``None`` (from :func:`_stop`).
    Whatever a job raises, wherever (torch.set_num_threads, a layer's lookup, a copy), is handed
    to that step's ``rows`` and the worker goes on with the next job: a step never waits on a
    worker that is gone."""
    while True:
        with work:
            work.wait_for(lambda: bool(jobs))
            job = jobs.pop(0)
        if job is None:
            return
        pipeline = pipeline_ref()
        if pipeline is None:
            _fail(cond, job.step, RuntimeError("the StagedLookupPipeline was garbage-collected"))
            return
        try:
            pipeline._run(job)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            _fail(cond, job.step, error)
        del pipeline, job  # hold no reference to the pipeline while waiting


def _fail(cond: threading.Condition, step: StagedStep, error: BaseException) -> None:
    with cond:
        step._error = error
        cond.notify_all()


def _stop(
    cond: threading.Condition,
    work: threading.Condition,
    jobs: list,
    worker: threading.Thread,
    timeout: float | None = None,
) -> None:
    with cond:
        if None not in jobs:
            jobs.append(None)
        work.notify_all()
        cond.notify_all()
    if worker is not threading.current_thread():
        worker.join(timeout)


def _check_threads(threads: Any) -> int:
    """``threads`` as an int in [1, the machine's CPUs]: torch takes any count up to 2**31 - 1
    but more intra-op threads than CPUs only oversubscribe them, and a count torch refuses would
    surface only in the worker."""
    count = positive_int(threads, "threads", "StagedLookupPipeline")
    cpus = os.cpu_count() or 1
    if count > cpus:
        raise ValueError(
            f"StagedLookupPipeline: threads must be at most {cpus} (this machine's CPUs; more "
            f"intra-op threads than CPUs only oversubscribe them), got {threads}"
        )
    return count


def _check_device(device: Any) -> torch.device:
    """``device`` (None: the CPU) as a torch.device, the CPU or an existing CUDA/ROCm device."""
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"StagedLookupPipeline: device must be a torch.device, a string or None, got "
            f"{type(device).__name__}"
        )
    try:
        device = torch.device("cpu" if device is None else device)
    except RuntimeError as error:
        raise ValueError(f"StagedLookupPipeline: device {device!r} is not a device") from error
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be the CPU or a CUDA/ROCm device, got {device}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is None and count:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index is None or device.index >= count:
            raise ValueError(
                f"StagedLookupPipeline: device {device} does not exist here ({count} CUDA/ROCm "
                "devices)"
            )
    return device
