"""Standalone streaming state for PLE layers (SPEC §6-§7), for users who do not run vLLM.

:class:`PLEState` owns what vLLM's Mamba cache and input batch own for the PLE layers: one
conv-state slot per live request (slot 0 is the null slot, as in vLLM) for every PLE layer, and
each request's n-gram context (the N-1 tokens before its next chunk). A step goes

    batch = state.prepare([(request_id, tokens), ...])      # metadata for every PLE layer
    out = layer(hidden, batch.input_ids, batch)             # once per PLE layer
    state.commit(batch)                                     # contexts move on

``prepare`` keeps the rows in the caller's order: each request gets the right ``ple_conv`` mode
(decode for one token with history, prefill otherwise, spec when asked) and the modes run as
separate calls over ``token_indices``, so no reordering is needed. ``commit(batch,
num_accepted={request_id: a})`` closes a speculative verify step: only the first ``a`` tokens of
the chunk enter the context, and the next step reads the conv window at offset ``a - 1`` (no state
copy, as vLLM). ``finish_request`` frees the slot for the next ``add_request``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from qwen4exp_ext.reference import CONV_MODES, NULL_SLOT, ConvMode

__all__ = [
    "ConvGroup",
    "PLEBatch",
    "PLEState",
    "get_ple_mamba_state_dtype",
    "get_ple_mamba_state_shape",
]

StateLayout = Literal["dim_first", "window_first"]


# --- vLLM qwen4_exp's Mamba state shape/dtype helpers -----------------------------------------


def _text_config(config: Any) -> Any:
    """The text config of a (possibly multimodal) config."""
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else getattr(config, "text_config", config)


def ple_conv_state_len(config: Any) -> int:
    """S = (Kc - 1)·δ with δ = ngram_size."""
    config = _text_config(config)
    return (int(config.ple_conv_kernel_size) - 1) * int(config.ngram_size)


def get_ple_mamba_state_shape(
    config: Any, num_spec: int = 0, *, layout: StateLayout = "dim_first"
) -> tuple[tuple[int, int]]:
    """Per-request PLE conv state shape, vLLM qwen4_exp's ``get_ple_mamba_state_shape_from_config``:
    ((C, S + num_spec),) dim-first (vLLM's ``is_conv_state_dim_first``), else ((S + num_spec, C),).
    The PLE state is replicated over tensor-parallel ranks (``tp_world_size=1``)."""
    text = _text_config(config)
    channels = int(text.hidden_size) * int(text.hc_count)
    width = ple_conv_state_len(text) + int(num_spec)
    if layout == "dim_first":
        return ((channels, width),)
    if layout == "window_first":
        return ((width, channels),)
    raise ValueError(f"layout must be 'dim_first' or 'window_first', got {layout!r}")


_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def get_ple_mamba_state_dtype(
    model_dtype: torch.dtype | str, mamba_cache_dtype: torch.dtype | str = "auto"
) -> tuple[torch.dtype]:
    """Seed 004's ``get_ple_mamba_state_dtype_from_config`` (vLLM's ``short_conv_state_dtype``):
    the model dtype, unless ``mamba_cache_dtype`` names another one."""

    def resolve(value: torch.dtype | str) -> torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        name = value.removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {value!r}")
        return _DTYPE_NAMES[name]

    if mamba_cache_dtype == "auto":
        return (resolve(model_dtype),)
    return (resolve(mamba_cache_dtype),)


# --- one step's metadata -----------------------------------------------------------------------


@dataclass
class ConvGroup:
    """One ``ple_conv`` call of a step: the requests of one mode, as logical rows."""

    mode: ConvMode
    state_indices: torch.Tensor
    query_start_loc: torch.Tensor | None = None
    has_initial_states: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None
    spec_query_len: int = 1
    token_indices: torch.Tensor | None = None


@dataclass
class PLEBatch:
    """A step's metadata, built by :meth:`PLEState.prepare` and read by every PLE layer."""

    input_ids: torch.Tensor  # [T] int64, the chunks concatenated in the caller's order
    query_start_loc: torch.Tensor  # [R+1] int32
    ngram_context: torch.Tensor  # [R, N-1] int64
    groups: list[ConvGroup]
    request_ids: list[Hashable]
    tokens: list[list[int]]
    slots: list[int]
    spec: list[bool]
    state: PLEState | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def conv_state(self, layer: int) -> torch.Tensor:
        """The [slots, C, W] conv state of PLE layer ``layer`` (a view of the cache's storage)."""
        if self.state is None:
            raise ValueError("this batch has no state attached")
        return self.state.conv_state(layer)

    def request_rows(self) -> dict[Hashable, slice]:
        """Rows of each request's chunk in the step's tokens."""
        qsl = self.query_start_loc.tolist()
        return {rid: slice(qsl[i], qsl[i + 1]) for i, rid in enumerate(self.request_ids)}


@dataclass
class _Request:
    slot: int
    context: list[int]  # the N-1 tokens before the next chunk, oldest first
    has_state: bool = False
    window_offset: int = 0  # where the conv window starts (a spec step leaves a - 1)
    num_computed: int = 0


# --- the cache ---------------------------------------------------------------------------------


class PLEState:
    """Conv-state slots and n-gram contexts of the live requests, for ``num_layers`` PLE layers.

    ``conv_state(layer)`` is [max_requests + 1, C, S + num_spec] (slot 0 is the null slot),
    stored dim-first or window-first (``layout``) in ``dtype`` on ``device`` (CPU or GPU).
    """

    def __init__(
        self,
        *,
        max_requests: int,
        hc_hidden_size: int,
        state_len: int,
        ngram_size: int,
        eos_token_id: int,
        num_layers: int = 1,
        num_spec: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layout: StateLayout = "dim_first",
    ) -> None:
        if max_requests <= 0 or num_layers <= 0:
            raise ValueError("max_requests and num_layers must be positive")
        if ngram_size < 2:
            raise ValueError(f"ngram_size must be >= 2, got {ngram_size}")
        if layout not in ("dim_first", "window_first"):
            raise ValueError(f"layout must be 'dim_first' or 'window_first', got {layout!r}")
        self.max_requests = int(max_requests)
        self.hc_hidden_size = int(hc_hidden_size)
        self.state_len = int(state_len)
        self.ngram_size = int(ngram_size)
        self.eos_token_id = int(eos_token_id)
        self.num_spec = int(num_spec)
        self.device = torch.device(device)
        self.dtype = dtype
        self.layout = layout
        width = self.state_len + self.num_spec
        slots = self.max_requests + 1
        if layout == "dim_first":
            self._storage = [
                torch.zeros(slots, hc_hidden_size, width, dtype=dtype, device=self.device)
                for _ in range(num_layers)
            ]
            self._views = list(self._storage)
        else:
            self._storage = [
                torch.zeros(slots, width, hc_hidden_size, dtype=dtype, device=self.device)
                for _ in range(num_layers)
            ]
            self._views = [s.transpose(1, 2) for s in self._storage]
        self._free = list(range(self.max_requests, NULL_SLOT, -1))  # pop() gives slot 1 first
        self._requests: dict[Hashable, _Request] = {}

    @classmethod
    def from_config(
        cls,
        config: Any,
        max_requests: int,
        *,
        num_layers: int | None = None,
        num_spec: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layout: StateLayout = "dim_first",
    ) -> PLEState:
        """A cache for a ``Qwen4ExpTextConfig`` (one state per entry of ``ple_layer_ids`` unless
        ``num_layers`` says otherwise)."""
        text = _text_config(config)
        if num_layers is None:
            num_layers = max(1, len(getattr(text, "ple_layer_ids", None) or [0]))
        eos = text.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0]
        return cls(
            max_requests=max_requests,
            hc_hidden_size=int(text.hidden_size) * int(text.hc_count),
            state_len=ple_conv_state_len(text),
            ngram_size=int(text.ngram_size),
            eos_token_id=int(eos),
            num_layers=num_layers,
            num_spec=num_spec,
            dtype=dtype,
            device=device,
            layout=layout,
        )

    # --- requests ------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._views)

    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._requests)

    def conv_state(self, layer: int) -> torch.Tensor:
        if not 0 <= layer < len(self._views):
            raise IndexError(f"PLE state has {len(self._views)} layers, asked for layer {layer}")
        return self._views[layer]

    def slot(self, request_id: Hashable) -> int:
        return self._request(request_id).slot

    def context(self, request_id: Hashable) -> list[int]:
        return list(self._request(request_id).context)

    def num_computed_tokens(self, request_id: Hashable) -> int:
        return self._request(request_id).num_computed

    def add_request(self, request_id: Hashable, context: Sequence[int] | None = None) -> int:
        """Takes a free slot (zeroed) for a new request and returns it. ``context`` optionally
        gives tokens that precede the first chunk (only their last N-1 count)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already live")
        if not self._free:
            raise RuntimeError(f"no free PLE state slot (max_requests={self.max_requests})")
        slot = self._free.pop()
        for storage in self._storage:
            storage[slot].zero_()
        ctx = [self.eos_token_id] * (self.ngram_size - 1) + [int(t) for t in (context or [])]
        self._requests[request_id] = _Request(slot, ctx[len(ctx) - (self.ngram_size - 1) :])
        return slot

    def finish_request(self, request_id: Hashable) -> None:
        """Frees the request's slot; the next ``add_request`` may reuse it."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        self._free.append(req.slot)

    def _request(self, request_id: Hashable) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    # --- steps ---------------------------------------------------------------------------------

    def prepare(
        self,
        batch: Iterable[tuple[Hashable, Sequence[int] | torch.Tensor]],
        *,
        spec: bool | Iterable[Hashable] = False,
    ) -> PLEBatch:
        """The metadata of one step over ``(request_id, tokens)`` chunks, rows in the given order.

        ``spec`` (True, or the ids of the requests that verify drafts) marks speculative chunks of
        at most num_spec + 1 tokens; the others run as decode (one token, with history) or
        prefill. Nothing changes until :meth:`commit`.
        """
        entries = [(rid, _as_tokens(tokens)) for rid, tokens in batch]
        ids = [rid for rid, _ in entries]
        if len(set(ids)) != len(ids):
            raise ValueError("a request appears twice in one step")
        spec_ids = set(ids) if spec is True else set(spec or ())
        if spec_ids - set(ids):
            raise ValueError(f"spec requests not in the batch: {spec_ids - set(ids)}")
        if spec_ids and self.num_spec <= 0:
            raise ValueError("speculative steps need a PLEState built with num_spec > 0")

        qsl = [0]
        for _, tokens in entries:
            qsl.append(qsl[-1] + len(tokens))
        modes = self._conv_modes(entries, spec_ids)
        self._rewind_windows(ids, modes)

        dev = self.device
        slots = [self._requests[rid].slot for rid in ids]
        groups: list[ConvGroup] = []
        for mode in CONV_MODES:
            members = [i for i, m in enumerate(modes) if m == mode]
            if members:
                groups.append(self._conv_group(mode, members, ids, qsl, slots))
        flat = [t for _, tokens in entries for t in tokens]
        return PLEBatch(
            input_ids=torch.tensor(flat, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            ngram_context=torch.tensor(
                [self._requests[rid].context for rid in ids], dtype=torch.int64, device=dev
            ).reshape(len(ids), self.ngram_size - 1),
            groups=groups,
            request_ids=ids,
            tokens=[tokens for _, tokens in entries],
            slots=slots,
            spec=[m == "spec" for m in modes],
            state=self,
        )

    def _conv_modes(
        self, entries: list[tuple[Hashable, list[int]]], spec_ids: set[Hashable]
    ) -> list[ConvMode]:
        """The ple_conv mode of each chunk: spec when asked (1..num_spec + 1 tokens), decode for
        one token with history, prefill otherwise."""
        query_len = self.num_spec + 1
        modes: list[ConvMode] = []
        for rid, tokens in entries:
            req = self._request(rid)
            if rid in spec_ids:
                if not 0 < len(tokens) <= query_len:
                    raise ValueError(
                        f"spec request {rid!r} has {len(tokens)} tokens; 1..{query_len} allowed"
                    )
                modes.append("spec")
            elif len(tokens) == 1 and req.has_state:
                modes.append("decode")
            else:
                modes.append("prefill")
        return modes

    def _rewind_windows(self, ids: list[Hashable], modes: list[ConvMode]) -> None:
        """A request leaving a verify step with a > 1 accepted tokens has its window at offset
        a - 1; decode and prefill read offset 0, so move it there once."""
        for rid, mode in zip(ids, modes, strict=True):
            req = self._requests[rid]
            if mode != "spec" and req.window_offset:
                off, slot = req.window_offset, req.slot
                for view in self._views:
                    view[slot, :, : self.state_len] = view[
                        slot, :, off : off + self.state_len
                    ].clone()
                req.window_offset = 0

    def _conv_group(
        self,
        mode: ConvMode,
        members: list[int],
        ids: list[Hashable],
        qsl: list[int],
        slots: list[int],
    ) -> ConvGroup:
        """The ple_conv call of one mode over the chunks ``members`` (indices into the step's
        ``ids``): their rows of the step as token_indices (None when they are the whole step)
        and their metadata."""
        dev = self.device
        rows: list[int] = []
        local_qsl = [0]
        for i in members:
            rows.extend(range(qsl[i], qsl[i + 1]))
            local_qsl.append(len(rows))
        whole = len(members) == len(ids)
        group = ConvGroup(
            mode=mode,
            state_indices=torch.tensor([slots[i] for i in members], dtype=torch.int32, device=dev),
            token_indices=None if whole else torch.tensor(rows, dtype=torch.int64, device=dev),
        )
        if mode != "decode":
            group.query_start_loc = torch.tensor(local_qsl, dtype=torch.int32, device=dev)
        if mode == "prefill":
            group.has_initial_states = torch.tensor(
                [self._requests[ids[i]].has_state for i in members],
                dtype=torch.bool,
                device=dev,
            )
        if mode == "spec":
            group.num_accepted_tokens = torch.tensor(
                [self._requests[ids[i]].window_offset + 1 for i in members],
                dtype=torch.int32,
                device=dev,
            )
            group.spec_query_len = self.num_spec + 1
        return group

    def commit(self, batch: PLEBatch, num_accepted: Mapping[Hashable, int] | None = None) -> None:
        """Moves every request of ``batch`` past its chunk. A speculative request needs its
        accepted count a (1..len(chunk)): only its first a tokens become history."""
        num_accepted = dict(num_accepted or {})
        for rid, tokens, is_spec in zip(batch.request_ids, batch.tokens, batch.spec, strict=True):
            req = self._request(rid)
            if is_spec:
                if rid not in num_accepted:
                    raise ValueError(f"spec request {rid!r} needs its accepted token count")
                accepted = int(num_accepted.pop(rid))
                if not 1 <= accepted <= len(tokens):
                    raise ValueError(
                        f"request {rid!r}: accepted {accepted} of {len(tokens)} tokens"
                    )
                tokens = tokens[:accepted]
                req.window_offset = accepted - 1
            if tokens:
                req.has_state = True
            req.num_computed += len(tokens)
            ctx = req.context + list(tokens)
            req.context = ctx[len(ctx) - (self.ngram_size - 1) :]
        if num_accepted:
            raise ValueError(
                f"accepted counts for requests that did not verify: {list(num_accepted)}"
            )


def _as_tokens(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    return [int(t) for t in tokens]
