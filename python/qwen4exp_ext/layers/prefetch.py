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

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .ngram_embedding import NGramEmbedding

__all__ = ["LookupPipeline", "PrefetchSlot", "default_max_blocks", "side_stream"]

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


def default_max_blocks(device: torch.device) -> int:
    """Half the SMs (NVIDIA) or CUs (AMD) of ``device``: the side stream's grid cap."""
    count = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, count // 2)


@dataclass
class PrefetchSlot:
    """One layer's prefetch buffers and where its lookup stands.

    ``state`` is ``"idle"`` (nothing started since the buffers were made), ``"started"`` (a
    lookup of ``num_tokens`` tokens is launched; its rows are not yet handed out) or
    ``"finalized"`` (handed out once; the next step must start again)."""

    ids: torch.Tensor  # [max_tokens, NH] int64
    rows: torch.Tensor  # [max_tokens, D_e] in the embedding's out_dtype
    event: torch.cuda.Event | None  # recorded on the side stream after the lookup (GPU only)
    state: str = "idle"
    num_tokens: int = 0
    # (data_ptr, numel) of the input_ids the lookup was started with, so a forward can tell
    # that a pending lookup is of its own tokens.
    source: tuple[int, int] = (0, 0)

    @property
    def max_tokens(self) -> int:
        return self.rows.shape[0]


def _embedding_of(module: Any) -> NGramEmbedding:
    from .ngram_embedding import NGramEmbedding

    if isinstance(module, NGramEmbedding):
        return module
    embedding = getattr(module, "ple_embedding", None)
    if isinstance(embedding, NGramEmbedding):
        return embedding
    raise TypeError(
        f"LookupPipeline takes NGramEmbedding or PLELayer modules, got {type(module).__name__}"
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
    who: str = "start_prefetch",
) -> None:
    """Launches the lookups of ``embeddings``, in that order (see the module docstring). Every
    argument is checked before the first launch: a batch larger than a layer's buffers, a layer
    without buffers or on another device raises and launches nothing, leaving every layer's
    previous result as it was."""
    input_ids = input_ids.reshape(-1)
    num_tokens = input_ids.numel()
    slots = [_slot_of(embedding, who) for embedding in embeddings]
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
    on_gpu = input_ids.device.type == "cuda"
    if on_gpu and stream is None:
        stream = side_stream(input_ids.device)
    if on_gpu and max_blocks is None:
        max_blocks = default_max_blocks(input_ids.device)
    source = (input_ids.data_ptr(), num_tokens)
    # A failed launch must not leave a layer looking started with the rows of another step.
    for slot in slots:
        slot.state = "idle"
    if not on_gpu:
        for embedding, slot in zip(embeddings, slots, strict=True):
            _launch_one(embedding, slot, input_ids, query_start_loc, ngram_context, 0)
            slot.num_tokens, slot.source, slot.state = num_tokens, source, "started"
        return
    current = torch.cuda.current_stream(input_ids.device)
    capturing = torch.cuda.is_current_stream_capturing()
    # The side stream starts after everything queued so far: the step's ids are written and the
    # previous step's reads of these buffers are done.
    stream.wait_stream(current)
    if not capturing:
        # The caching allocator must not hand the ids' memory to another tensor while the side
        # stream may still read it (graph memory is static: nothing to record in a capture).
        for tensor in (input_ids, query_start_loc, ngram_context):
            tensor.record_stream(stream)
    with torch.cuda.stream(stream):
        for embedding, slot in zip(embeddings, slots, strict=True):
            _launch_one(embedding, slot, input_ids, query_start_loc, ngram_context, max_blocks or 0)
            slot.event.record(stream)
            slot.num_tokens, slot.source, slot.state = num_tokens, source, "started"


def _launch_one(
    embedding: NGramEmbedding,
    slot: PrefetchSlot,
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    max_blocks: int,
) -> None:
    num_tokens = input_ids.numel()
    embedding._lookup_local(
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
    if slot.state == "finalized":
        raise RuntimeError(
            f"{who}: this lookup was already finalized; start_prefetch again for the next step"
        )
    if slot.event is not None:
        torch.cuda.current_stream(slot.rows.device).wait_event(slot.event)
    slot.state = "finalized"
    return embedding._reduced(slot.rows[: slot.num_tokens], reduce=True)


class LookupPipeline:
    """The step-level owner of several PLE layers' lookups (module docstring).

    ``modules`` are :class:`~.ple_layer.PLELayer` or :class:`~.ngram_embedding.NGramEmbedding`
    modules built with ``max_tokens``, in layer order. ``max_blocks`` caps each gather's grid
    on a GPU (default: :func:`default_max_blocks`); ``stream`` overrides the side stream.
    """

    def __init__(
        self,
        modules: Iterable[Any],
        *,
        max_blocks: int | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.modules = list(modules)
        self.embeddings = [_embedding_of(module) for module in self.modules]
        for embedding in self.embeddings:
            _slot_of(embedding, "LookupPipeline")
        if max_blocks is not None and max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self.stream = stream

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
            who="LookupPipeline.start_prefetch",
        )

    def finalize_prefetch(self, layer: int | Any) -> torch.Tensor:
        """Layer ``layer``'s rows (an index into ``modules``, or the module itself), as its
        embedding's ``forward`` returns them."""
        if isinstance(layer, int):
            embedding = self.embeddings[layer]
        else:
            embedding = _embedding_of(layer)
            if not any(embedding is e for e in self.embeddings):
                raise ValueError("finalize_prefetch: that layer is not part of this pipeline")
        return finalize(embedding, "LookupPipeline.finalize_prefetch")

    def join(self) -> None:
        """Makes the current stream wait for every started lookup (e.g. before a graph capture
        ends with layers that were not finalized). The rows stay pending."""
        for embedding in self.embeddings:
            slot = embedding.prefetch_slot
            if slot is not None and slot.state == "started" and slot.event is not None:
                torch.cuda.current_stream(slot.rows.device).wait_event(slot.event)
