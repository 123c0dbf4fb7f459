"""PLE table lookups started ahead of the layers that read them (the lookup pipeline).

A released PLE table is 51-102 GB per layer, so it lives in host memory and the GPU reads its
rows over PCIe. The n-gram ids depend only on the step's tokens, so every PLE layer's lookup can
be launched when the step starts, before the first decoder layer runs, and overlap the compute
of the layers in front of it (the Engram paper, §6.4: -1.9% to -2.8% throughput for a
100B-parameter host table, against -100% of a synchronous read on every layer).

    pipeline = LookupPipeline([layer_a, layer_b])        # PLELayers or NGramEmbeddings
    pipeline.start_prefetch(input_ids, query_start_loc, ngram_context)   # at step entry
    ...
    out = layer_a(hidden, input_ids, batch)              # uses its prefetched rows
    rows = layer_b.finalize_prefetch()                   # or take them explicitly

How it runs:

- **Fixed buffers.** Each :class:`~.ngram_embedding.NGramEmbedding` built with ``max_tokens``
  owns a :class:`PrefetchSlot`: its ids [max_tokens, NH] and rows [max_tokens, D_e] at fixed
  addresses (as CUDA/HIP graphs need), and one event. A finalized result is a view of that
  buffer, valid until the layer's next lookup starts.
- **One side stream, in layer order.** On a GPU the lookups of a step run on one side stream
  (:func:`side_stream`, one per device), layer after layer, each followed by its own event;
  ``finalize_prefetch`` makes the current stream wait on that layer's event only, so the first
  PLE layer waits for its own rows, not for the deeper layers' (which one stream per layer, all
  reading the link at once, would delay). The side stream first waits for the current stream,
  so the lookups see the step's ids and never overwrite rows the previous step still reads.
- **A bounded share of the GPU.** Each gather launches at most ``max_blocks`` blocks (default:
  half the device's SMs/CUs, as vLLM's DeepSeek Engram lookup halves its grid): enough loads in
  flight to cover the PCIe round trip (bytes in flight = bandwidth x latency: about 63 GB/s x
  2 us = 126 KB, a few blocks' worth), while the rest of the GPU runs the model.
- **CUDA/HIP graphs: captured with the step.** Started while a graph is captured, the side
  stream joins the capture (it waits on the capturing stream), so the lookups become a parallel
  branch of the graph that every replay launches at its start, reading the step's ids from the
  graph's static input buffer into the fixed buffers; every PLE layer's finalize joins the
  branch back. vLLM instead keeps its prefetch out of the capture
  (``eager_break_during_capture``), which needs its breakable-graph mode and splits the graph at
  every PLE layer; a captured branch keeps one graph and the overlap, at the price that every
  started layer must be finalized (or :meth:`LookupPipeline.join` called) before the capture
  ends, which a step does anyway.
- **On a CPU** the same calls work: the lookups run when started (there is nothing to overlap
  with), so code written against this API runs everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qwen4exp_ext import ops
from qwen4exp_ext._args import as_int

if TYPE_CHECKING:
    from .ngram_embedding import NGramEmbedding

__all__ = [
    "LookupPipeline",
    "PrefetchSlot",
    "default_max_blocks",
    "launch_on_side_stream",
    "lookup_into_slot",
    "side_stream",
]

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_side_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device``'s lookups: one per device for the process, so that the
    lookups of every pipeline and layer on it run in the order they were started."""
    with _side_streams_lock:
        stream = _side_streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            _side_streams[device] = stream
        return stream


@functools.cache
def default_max_blocks(device: torch.device) -> int:
    """Half the SMs (NVIDIA) or CUs (AMD) of ``device``: the side stream's grid cap (asked of
    the driver once per device, not on every step)."""
    count = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, count // 2)


@contextlib.contextmanager
def launch_on_side_stream(
    device: torch.device, inputs: Sequence[torch.Tensor], stream: torch.cuda.Stream | None = None
):
    """Makes ``stream`` (default: :func:`side_stream` of ``device``) current, after everything
    queued so far on the current stream: the step's ids are written and the previous step's
    reads of the buffers the lookups write are done. Outside a graph capture, ``inputs`` are
    recorded on it, so the caching allocator does not hand their memory to another tensor while
    the side stream may still read it (graph memory is static: nothing to record in a capture).
    Yields the stream."""
    if stream is None:
        stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    if not torch.cuda.is_current_stream_capturing():
        for tensor in inputs:
            tensor.record_stream(stream)
    with torch.cuda.stream(stream):
        yield stream


@dataclass
class PrefetchSlot:
    """One layer's prefetch buffers and where its lookup stands.

    ``state`` is ``"idle"`` (nothing started since the buffers were made, or a stale lookup
    dropped), ``"started"`` (a lookup of ``num_tokens`` tokens is launched; its rows are not yet
    handed out), ``"failed"`` (its start raised ``error``) or ``"finalized"`` (handed out once;
    the next step must start again)."""

    ids: torch.Tensor  # [max_tokens, NH] int64
    rows: torch.Tensor  # [max_tokens, D_e] in the embedding's out_dtype
    event: torch.cuda.Event | None  # recorded on the side stream after the lookup (GPU only)
    state: str = "idle"
    num_tokens: int = 0
    # What identifies the batch the lookup was started for (BatchSource), so that a forward
    # takes a pending lookup only if it is of its own tokens.
    source: BatchSource | None = None
    error: str = ""  # why the start failed (state "failed")
    # The buffers of deduplicated lookups (_Dedupe), made by the first one (eagerly, before a
    # graph captures one).
    dedupe: _Dedupe | None = None

    @property
    def max_tokens(self) -> int:
        return self.rows.shape[0]

    @staticmethod
    def allocate(
        embedding: NGramEmbedding, max_tokens: Any, device: torch.device
    ) -> PrefetchSlot | None:
        """``embedding``'s buffers for ``max_tokens`` tokens on ``device`` (None: none)."""
        if max_tokens is None:
            return None
        max_tokens = positive_int(max_tokens, "max_tokens", "NGramEmbedding")
        return PrefetchSlot(
            ids=torch.zeros(max_tokens, embedding.ngram_heads, dtype=torch.int64, device=device),
            rows=torch.zeros(
                max_tokens, embedding.embedding_dim, dtype=embedding.out_dtype, device=device
            ),
            event=torch.cuda.Event() if device.type == "cuda" else None,
        )


@dataclass(frozen=True)
class BatchSource:
    """The input_ids a lookup was started from: the tensor (its memory and length) and what it
    held. A pointer alone does not tell steps apart: a static input buffer (CUDA graphs, vLLM's
    persistent buffers) is refilled in place for every step, so a lookup started for a step
    that failed before its forward would hand the next step's forward the old rows. What the
    buffer held is known by torch's version counter (bumped by every in-place write through
    torch) and, for host ids, by a copy of the values (compared exactly: that catches writes
    behind torch's back, such as through numpy, and costs no device sync). Device ids are
    compared by version only: comparing their values would make the host wait for the device
    on every layer, the stall the prefetch is there to avoid; a writer that bypasses torch on
    the device (a raw kernel into the buffer) must start the lookup again."""

    data_ptr: int
    numel: int
    version: int
    values: torch.Tensor | None  # a copy of host ids; None on a device

    @staticmethod
    def of(input_ids: torch.Tensor) -> BatchSource:
        flat = input_ids.reshape(-1)
        values = flat.clone() if flat.device.type == "cpu" else None
        return BatchSource(flat.data_ptr(), flat.numel(), flat._version, values)

    def same_tensor(self, input_ids: torch.Tensor) -> bool:
        return (self.data_ptr, self.numel) == (input_ids.data_ptr(), input_ids.numel())

    def same_ids(self, input_ids: torch.Tensor) -> bool:
        """Whether ``input_ids`` (the same tensor) still hold the ids the lookup read."""
        flat = input_ids.reshape(-1)
        if flat._version != self.version:
            return False
        return self.values is None or torch.equal(self.values, flat)


class _Dedupe:
    """Fixed buffers of a lookup that reads each distinct row once (:func:`_launch_deduplicated`)
    for up to ``n`` = max_tokens x NH ids of rows ``width`` wide."""

    def __init__(self, n: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        def ints() -> torch.Tensor:
            return torch.empty(n, dtype=torch.int64, device=device)

        self.sorted, self.order, self.host_ids, self.marker = ints(), ints(), ints(), ints()
        self.source, self.source_at, self.inverse, self.take = ints(), ints(), ints(), ints()
        self.positions = torch.arange(n, dtype=torch.int64, device=device)
        self.first = torch.empty(n, dtype=torch.bool, device=device)
        self.repeat = torch.empty(n, dtype=torch.bool, device=device)
        self.staging = torch.empty(n, width, dtype=dtype, device=device)


def _launch_deduplicated(
    embedding: NGramEmbedding,
    slot: PrefetchSlot,
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    max_blocks: int,
) -> None:
    """The lookup with every distinct row read once (from the host, for a pinned table): the ids
    sorted, the first of each run gathered into a staging buffer (the others ask for id -1, a
    zero row, for which the GPU kernel reads row 0: an L2 hit), then each output row copied
    from its run's first. No step syncs with the host, so it runs on a side stream and in a
    graph; every buffer is the slot's. The rows equal the direct gather's bit for bit: a row's
    bytes (or its dequantised values) do not depend on where its id sits."""
    num_tokens = input_ids.numel()
    ids = embedding._ngram_ids(input_ids, query_start_loc, ngram_context, slot.ids[:num_tokens])
    n = ids.numel()
    if n == 0:
        return
    width = embedding.head_dim
    if slot.dedupe is None:
        slot.dedupe = _Dedupe(slot.ids.numel(), width, slot.rows.dtype, slot.rows.device)
    d = slot.dedupe
    sorted_ids, order = d.sorted[:n], d.order[:n]
    torch.sort(ids.reshape(-1), out=(sorted_ids, order))
    first, repeat = d.first[:n], d.repeat[:n]
    first[:1].fill_(True)
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    torch.logical_not(first, out=repeat)
    host_ids = d.host_ids[:n]
    host_ids.copy_(sorted_ids).masked_fill_(repeat, -1)
    staging = d.staging[:n]
    gather = embedding._gather_args(staging, max_blocks)
    ops.gather_rows(embedding.table, host_ids.view(n, 1), **gather)
    # For every sorted position, the sorted position of its run's first id (a running maximum
    # of the firsts' positions); then, per id in the batch's order, its row's staging position.
    torch.mul(first, d.positions[:n], out=d.marker[:n])
    torch.cummax(d.marker[:n], 0, out=(d.source[:n], d.source_at[:n]))
    d.inverse[:n].index_copy_(0, order, d.positions[:n])
    torch.index_select(d.source[:n], 0, d.inverse[:n], out=d.take[:n])
    torch.index_select(staging, 0, d.take[:n], out=slot.rows[:num_tokens].view(n, width))


def _embedding_of(module: Any, who: str = "LookupPipeline") -> NGramEmbedding:
    from .ngram_embedding import NGramEmbedding

    if isinstance(module, NGramEmbedding):
        return module
    embedding = getattr(module, "ple_embedding", None)
    if isinstance(embedding, NGramEmbedding):
        return embedding
    raise TypeError(f"{who} takes NGramEmbedding or PLELayer modules, got {type(module).__name__}")


# --- argument checks shared by both pipelines (staged.py) and the layers' lookups --------------


def whole_number(value: Any, name: str, who: str) -> int:
    """``value`` as an int (any integer type; not a bool, a float or a string)."""
    number = as_int(value)
    if number is None:
        raise TypeError(f"{who}: {name} must be an integer, got {type(value).__name__} {value!r}")
    return number


def positive_int(value: Any, name: str, who: str) -> int:
    count = whole_number(value, name, who)
    if count <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return count


def check_timeout(timeout: Any, who: str) -> float | None:
    """A wait's ``timeout``: None (no limit) or a number of seconds >= 0; infinity is None."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"{who}: timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"{who}: timeout must be a number of seconds >= 0, got {timeout}")
    return None if math.isinf(timeout) else timeout


def modules_of(modules: Any, who: str) -> list:
    """The pipeline's modules as a list (an iterable of them, such as a list or an
    nn.ModuleList; not one module)."""
    if not isinstance(modules, Iterable):
        raise TypeError(
            f"{who}: modules must be an iterable of NGramEmbedding or PLELayer modules, got "
            f"{type(modules).__name__}"
        )
    return list(modules)


def layer_index(embeddings: Sequence[NGramEmbedding], layer: Any, who: str) -> int:
    """The position in ``embeddings`` of ``layer``: an index into the pipeline's modules
    (negative from the end), or one of its modules."""
    count = len(embeddings)
    if type(layer) is int and 0 <= layer < count:  # the common call: a plain index in range
        return layer
    if isinstance(layer, torch.nn.Module):
        embedding = _embedding_of(layer, who)
        for index, candidate in enumerate(embeddings):
            if candidate is embedding:
                return index
        raise ValueError(f"{who}: that layer is not part of this pipeline")
    index = as_int(layer)
    if index is None:
        raise TypeError(
            f"{who}: layer must be an index into the pipeline's modules or one of them, got "
            f"{type(layer).__name__} {layer!r}"
        )
    if not -count <= index < count:
        raise IndexError(f"{who}: layer {index} out of range ({count} layers)")
    return index % count


INDEX_DTYPES = (torch.int32, torch.int64)
MAX_GRID = 2**31 - 1  # the most blocks of a grid's x dimension (CUDA and HIP)


def check_batch(
    embedding: NGramEmbedding,
    input_ids: Any,
    query_start_loc: Any,
    ngram_context: Any,
    who: str,
) -> None:
    """The step's inputs as ``embedding``'s lookup takes them, checked by their metadata (no
    values, nothing synchronized): tensors of int32/int64 ids, and an ``ngram_context`` as wide
    as this layer's n-grams need (the op itself would blame the layer's ``layer_multipliers``
    for a context of the wrong width)."""
    for name, value in (
        ("input_ids", input_ids),
        ("query_start_loc", query_start_loc),
        ("ngram_context", ngram_context),
    ):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype not in INDEX_DTYPES:
            raise TypeError(f"{who}: {name} must be int32 or int64, got {value.dtype}")
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise ValueError(
            f"{who}: query_start_loc must be 1-D [R+1] (R >= 0 requests), got shape "
            f"{tuple(query_start_loc.shape)}"
        )
    width = embedding.ngram_size - 1
    requests = query_start_loc.numel() - 1
    if ngram_context.dim() != 2 or tuple(ngram_context.shape) != (requests, width):
        raise ValueError(
            f"{who}: ngram_context must be [R, N-1] = [{requests}, {width}] (the {width} tokens "
            f"before each of the {requests} requests: this layer's ngram_size is "
            f"{embedding.ngram_size}), got shape {tuple(ngram_context.shape)}"
        )


def _slot_of(embedding: NGramEmbedding, who: str) -> PrefetchSlot:
    slot = embedding.prefetch_slot
    if slot is None:
        raise RuntimeError(
            f"{who}: this NGramEmbedding has no prefetch buffers; build it (or its PLELayer) "
            "with max_tokens=<the most tokens of a step>"
        )
    return slot


def start(
    embeddings: Sequence[NGramEmbedding],
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    *,
    stream: torch.cuda.Stream | None = None,
    max_blocks: int | None = None,
    dedupe: bool = False,
    who: str = "start_prefetch",
) -> None:
    """Launches the lookups of ``embeddings``, in that order (see the module docstring); with
    ``dedupe`` each reads every distinct row of the batch once (:func:`_launch_deduplicated`). Every
    argument is checked before the first launch: a batch larger than a layer's buffers, a layer
    without buffers or on another device raises and launches nothing, leaving every layer's
    previous result as it was."""
    slots = [_slot_of(embedding, who) for embedding in embeddings]
    for embedding in embeddings:
        check_batch(embedding, input_ids, query_start_loc, ngram_context, who)
    input_ids = input_ids.reshape(-1)
    num_tokens = input_ids.numel()
    for embedding, slot in zip(embeddings, slots, strict=True):
        if num_tokens > slot.max_tokens:
            raise ValueError(
                f"{who}: the batch has {num_tokens} tokens but the prefetch buffers hold "
                f"{slot.max_tokens} (max_tokens); nothing was started"
            )
        if input_ids.device != slot.rows.device:
            raise ValueError(
                f"{who}: input_ids are on {input_ids.device} but the layer looks up on "
                f"{slot.rows.device}; nothing was started"
            )
        embedding._check_complete()
    source = BatchSource.of(input_ids)
    # A failed launch must not leave a layer looking started with the rows of another step.
    for slot in slots:
        slot.state, slot.source = "idle", None
    on_gpu = input_ids.device.type == "cuda"
    if on_gpu and max_blocks is None:
        max_blocks = default_max_blocks(input_ids.device)
    inputs = (input_ids, query_start_loc, ngram_context)
    side = (
        launch_on_side_stream(input_ids.device, inputs, stream)
        if on_gpu
        else contextlib.nullcontext()
    )
    launched = 0
    try:
        with side as stream:
            for embedding, slot in zip(embeddings, slots, strict=True):
                lookup_into_slot(
                    embedding, slot, *inputs, max_blocks=max_blocks or 0, dedupe=dedupe
                )
                if slot.event is not None:
                    slot.event.record(stream)
                slot.num_tokens, slot.source, slot.state = num_tokens, source, "started"
                launched += 1
    except BaseException as error:
        # The layers from the failed one on say why they have no rows (finalize raises it);
        # the ones launched before keep theirs. The next start starts them all afresh.
        for slot in slots[launched:]:
            slot.state, slot.error = "failed", f"{type(error).__name__}: {error}"
        raise


def lookup_into_slot(
    embedding: NGramEmbedding,
    slot: PrefetchSlot,
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    *,
    max_blocks: int = 0,
    dedupe: bool = False,
) -> torch.Tensor:
    """This rank's rows of the tokens, looked up on the current stream into ``slot``'s buffers
    (not reduced over vocabulary shards); its state is the caller's to set."""
    num_tokens = input_ids.numel()
    if dedupe:
        _launch_deduplicated(embedding, slot, input_ids, query_start_loc, ngram_context, max_blocks)
        return slot.rows[:num_tokens]
    return embedding._lookup_local(
        input_ids,
        query_start_loc,
        ngram_context,
        output=slot.rows[:num_tokens],
        ids_output=slot.ids[:num_tokens],
        max_blocks=max_blocks,
    )


def finalize(embedding: NGramEmbedding, who: str = "finalize_prefetch") -> torch.Tensor:
    """The rows of ``embedding``'s started lookup, as its ``forward`` returns them (reduced
    over vocabulary shards): the current stream waits on that layer's event only. Raises, and
    changes nothing, when no lookup was started or its rows were already handed out."""
    slot = _slot_of(embedding, who)
    if slot.state == "idle":
        raise RuntimeError(f"{who}: no lookup was started; call start_prefetch first")
    if slot.state == "failed":
        raise RuntimeError(
            f"{who}: the lookup started for this step failed ({slot.error}); start_prefetch again"
        )
    if slot.state == "finalized":
        raise RuntimeError(
            f"{who}: this lookup was already finalized; start_prefetch again for the next step"
        )
    if slot.event is not None:
        torch.cuda.current_stream(slot.rows.device).wait_event(slot.event)
    slot.state = "finalized"
    return embedding._reduced(slot.rows[: slot.num_tokens], reduce=True)


def started_rows(embedding: NGramEmbedding, input_ids: torch.Tensor) -> torch.Tensor | None:
    """For a forward of ``input_ids``: the rows of the lookup started for these very ids
    (finalized), or None when none is pending. A pending lookup started from this tensor while
    it held other ids (:class:`BatchSource`) is stale: it is dropped, never handed out. One
    started from another tensor is refused (the caller meant to start it for this forward)."""
    slot = embedding.prefetch_slot
    if slot is None or slot.state != "started":
        return None
    if not slot.source.same_tensor(input_ids):
        raise ValueError(
            "PLELayer: a lookup was started (start_prefetch) for other input_ids than "
            "this forward's; start it with the same input_ids tensor the layer gets"
        )
    if not slot.source.same_ids(input_ids):
        # The stale lookup may still be writing the slot's buffers on its side stream, and the
        # caller looks these ids up into the same buffers next, on the current stream.
        if slot.event is not None:
            torch.cuda.current_stream(slot.rows.device).wait_event(slot.event)
        slot.state, slot.source = "idle", None
        return None
    return finalize(embedding, "PLELayer.forward")


class LookupPipeline:
    """The step-level owner of several PLE layers' lookups (module docstring).

    ``modules`` are :class:`~.ple_layer.PLELayer` or :class:`~.ngram_embedding.NGramEmbedding`
    modules built with ``max_tokens``, in layer order. ``max_blocks`` caps each gather's grid
    on a GPU (default: :func:`default_max_blocks`); ``stream`` overrides the side stream.
    ``dedupe`` reads each distinct row of a batch once (repeated n-grams of real text): a sort
    and a few small kernels more per layer, which pay only where the link, not the launches,
    bounds the lookup (a prefill from a pinned table); off by default until a GPU has measured
    where it pays.
    """

    def __init__(
        self,
        modules: Iterable[Any],
        *,
        max_blocks: int | None = None,
        stream: torch.cuda.Stream | None = None,
        dedupe: bool = False,
    ) -> None:
        who = "LookupPipeline"
        self.modules = modules_of(modules, who)
        self.embeddings = [_embedding_of(module) for module in self.modules]
        for embedding in self.embeddings:
            _slot_of(embedding, who)
        if max_blocks is not None:
            max_blocks = positive_int(max_blocks, "max_blocks", who)
            if max_blocks > MAX_GRID:
                raise ValueError(
                    f"{who}: max_blocks must be at most {MAX_GRID} (a grid's x dimension), got "
                    f"{max_blocks}"
                )
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise TypeError(
                f"{who}: stream must be a torch.cuda.Stream or None, got {type(stream).__name__}"
            )
        if not isinstance(dedupe, bool):
            raise TypeError(f"{who}: dedupe must be True or False, got {dedupe!r}")
        self.max_blocks = max_blocks
        self.stream = stream
        self.dedupe = dedupe

    def __len__(self) -> int:
        return len(self.modules)

    def start_prefetch(
        self, input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
    ) -> None:
        """Hashes the step's ids and launches every layer's lookup, in layer order."""
        start(
            self.embeddings,
            input_ids,
            query_start_loc,
            ngram_context,
            stream=self.stream,
            max_blocks=self.max_blocks,
            dedupe=self.dedupe,
            who="LookupPipeline.start_prefetch",
        )

    def finalize_prefetch(self, layer: int | Any) -> torch.Tensor:
        """Layer ``layer``'s rows (an index into ``modules``, or the module itself), as its
        embedding's ``forward`` returns them."""
        who = "LookupPipeline.finalize_prefetch"
        return finalize(self.embeddings[layer_index(self.embeddings, layer, who)], who)

    def join(self) -> None:
        """Makes the current stream wait for every started lookup (e.g. before a graph capture
        ends with layers that were not finalized). The rows stay pending."""
        for embedding in self.embeddings:
            slot = embedding.prefetch_slot
            if slot is not None and slot.state == "started" and slot.event is not None:
                torch.cuda.current_stream(slot.rows.device).wait_event(slot.event)
