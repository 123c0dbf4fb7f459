"""Step-entry lookups of the pinned PLE tables for vLLM's AMD Qwen4Exp model (0.33.0, 0.34.0).

vLLM's NVIDIA model starts each PLE layer's lookup of a pinned host table one layer ahead, on a
side stream; its AMD model looks the table up inside the layer (``sync_lookup``, through the
op ``torch.ops.vllm.qwen4_exp_amd_ple_ngram_embedding_pinned``), so on ROCm the PCIe read of
every PLE layer sits on the critical path. The plugin gives the AMD model the overlap without
changing vLLM, with two swaps (rows of :data:`~qwen4exp_ext.vllm.shims.SWAPS`):

- ``Qwen4ExpModel.__call__`` (the compiled model's entry, run eagerly every step, whichever of
  vLLM's Qwen4Exp classes calls the model): on an eager step it hashes the step's n-gram ids of
  every PLE layer of this pipeline stage and launches their lookups, in layer order, on one side
  stream (:func:`qwen4exp_ext.layers.prefetch.side_stream`) into fixed buffers, one event per
  layer, each gather on a capped grid (:func:`~qwen4exp_ext.layers.prefetch.default_max_blocks`).
  The rows are read by vLLM's own ``lookup_from_pinned`` (our kernel, through the plugin), so
  they are exactly ``sync_lookup``'s;
- the pinned-lookup op: when the layer's lookup was started for this very step (the same
  forward context, the same token count), it waits on that layer's event only, reduces over the
  vocabulary (ETP) ranks with vLLM's own ``_reduce_etp_embeddings`` and writes the op's output;
  otherwise it runs vLLM's ``sync_lookup`` as before.

What stays vLLM's: steps replayed from a CUDA/HIP graph (the lookup is captured inside vLLM's
graph pieces, which run no Python), and layers whose ETP group spans data-parallel ranks (their
ids are all-gathered across ranks first). Device tables are untouched. ``QWEN4EXP_VLLM_PREFETCH=0``
turns the step-entry lookups off; vLLM's log says which is in force.

This module imports neither vLLM nor anything that does: the swaps hand it vLLM's objects.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _switches, ops
from ..layers import prefetch as pipeline

ENV = "QWEN4EXP_VLLM_PREFETCH"
logger = logging.getLogger("vllm.qwen4exp_ext")  # vLLM's log, as the plugin's other lines

__all__ = ["ENV", "enabled", "status_line"]


def enabled() -> bool:
    """Whether the plugin starts the AMD model's pinned-table lookups at step entry (default:
    on; ``QWEN4EXP_VLLM_PREFETCH=0`` turns it off; any word of the package's on/off variables,
    a bad one is one warning in vLLM's log and the default)."""
    return _switches.env_flag_or_warn(ENV, True, logger)


def status_line() -> str:
    """The line vLLM's log gets when the AMD model's code is swapped."""
    if enabled():
        return (
            "qwen4exp_ext vLLM plugin: AMD Qwen4Exp pinned PLE tables are looked up at step "
            f"entry, every PLE layer on one side stream (eager steps; {ENV}=0 turns it off)"
        )
    return (
        f"qwen4exp_ext vLLM plugin: {ENV}=0: AMD Qwen4Exp pinned PLE tables are looked up "
        "inside each layer (vLLM's sync_lookup, on qwen4exp_ext's gather)"
    )


@dataclass
class _Slot:
    """One PLE layer's fixed buffers and the step its lookup was started for."""

    ids: torch.Tensor  # [rows, NH] int64
    rows: torch.Tensor  # [rows, NH, d] in the embedding method's lookup dtype
    event: torch.cuda.Event
    step: Any = None  # the ForwardContext of the started lookup; None once taken
    num_tokens: int = 0


class StepLookups:
    """The step-entry lookups of the process's pinned PLE layers (:data:`STEP_LOOKUPS`)."""

    def __init__(self) -> None:
        # vLLM's pinned embedding module -> its slot (gone with the module).
        self._slots: weakref.WeakKeyDictionary[Any, _Slot] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @staticmethod
    def eligible(ple_layer: Any) -> bool:
        """A PLE layer whose lookup can start at step entry: a pinned table (vLLM's
        ``supports_prefetch``) whose ETP group holds no other data-parallel rank."""
        embedding = getattr(getattr(ple_layer, "ple_embedding", None), "ngram_embedding", None)
        return (
            embedding is not None
            and getattr(embedding, "supports_prefetch", False)
            and getattr(embedding, "etp_data_parallel_size", 1) == 1
            and hasattr(embedding, "_uva_weight")
        )

    def _slot(self, ple_layer: Any) -> _Slot:
        embedding = ple_layer.ple_embedding.ngram_embedding
        slot = self._slots.get(embedding)
        if slot is None:
            with self._lock:
                slot = self._slots.get(embedding)
                if slot is None:
                    device = embedding._uva_weight.device
                    rows = max(1, int(embedding._prefetch_rows))
                    heads = int(ple_layer.ple_embedding.ngram_heads)
                    slot = _Slot(
                        ids=torch.empty(rows, heads, dtype=torch.int64, device=device),
                        rows=torch.empty(
                            rows,
                            heads,
                            embedding.embedding_dim,
                            dtype=embedding.embedding_method.lookup_dtype(embedding),
                            device=device,
                        ),
                        event=torch.cuda.Event(),
                    )
                    self._slots[embedding] = slot
        return slot

    def start(
        self,
        ple_layers: Sequence[Any],
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        step: Any,
        lookup_rows: Callable[[Any, torch.Tensor, torch.Tensor, int], None],
        head_divmod: Callable[[torch.Tensor], torch.Tensor | None],
    ) -> int:
        """Launches the lookups of ``ple_layers`` (eligible, in layer order) for ``step``;
        returns how many were started (none when the batch exceeds a layer's buffers)."""
        input_ids = input_ids.reshape(-1)
        num_tokens = input_ids.numel()
        slots = [self._slot(layer) for layer in ple_layers]
        if any(num_tokens > slot.rows.shape[0] for slot in slots):
            return 0
        # Constants computed now, on this stream (a first call copies sizes to the host).
        divmods = [head_divmod(layer.ple_embedding.ngram_heads_vocab_sizes) for layer in ple_layers]
        device = input_ids.device
        max_blocks = pipeline.default_max_blocks(device)
        # Imported here: the shims package imports this module (a module-level import would be
        # circular). vLLM may hand over more context rows than the step has requests.
        from .shims.ple import step_context

        ngram_context = step_context(query_start_loc, ngram_context)
        inputs = (input_ids, query_start_loc, ngram_context)
        with pipeline.launch_on_side_stream(device, inputs) as stream:
            for layer, slot, divmod in zip(ple_layers, slots, divmods, strict=True):
                embedding = layer.ple_embedding
                ids = slot.ids[:num_tokens]
                ops.ngram_ids(
                    input_ids,
                    query_start_loc,
                    ngram_context,
                    embedding.layer_multipliers,
                    embedding.ngram_heads_vocab_sizes,
                    embedding.ngram_heads_offsets,
                    embedding.eos_token_id,
                    embedding.heads_per_ngram,
                    output=ids,
                    head_divmod=divmod,
                )
                if num_tokens:
                    lookup_rows(
                        embedding.ngram_embedding,
                        ids.reshape(-1),
                        slot.rows[:num_tokens],
                        max_blocks,
                    )
                slot.event.record(stream)
                slot.step, slot.num_tokens = step, num_tokens
        return len(slots)

    def take(self, embedding: Any, num_tokens: int, step: Any) -> torch.Tensor | None:
        """The started rows [T, NH, d] of ``embedding`` for ``step`` (the current stream now
        waits on that layer's event), or None when none were started for it."""
        slot = self._slots.get(embedding)
        if slot is None or slot.step is None or slot.step is not step:
            return None
        if slot.num_tokens != num_tokens:
            slot.step = None
            return None
        slot.step = None
        torch.cuda.current_stream(slot.rows.device).wait_event(slot.event)
        return slot.rows[:num_tokens]


STEP_LOOKUPS = StepLookups()
