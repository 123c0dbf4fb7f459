"""The Qwen4Exp PLE layer as a plain nn.Module on our kernels (SPEC §7; vLLM's
``Qwen4ExpPLELayer``), with its own state handling (:class:`~.state.PLEState`) instead of vLLM's.

out = hidden + gated + SiLU(conv(conv_in)) where emb = gather(ngram_ids(...)),
kv = emb·W_kvᵀ (W_kv = [key_proj; value_proj]), gated, conv_in = ple_gate(key, value, hidden).
transformers' ``Qwen4ExpTextPLELayer`` returns the same thing without ``hidden``.

Checkpoints: :meth:`PLELayer.load_weights` takes tensor names relative to the layer in either
layout — transformers (``ple_embedding.ngram_embedding.weight`` whole, ``key_proj.weight``,
``value_proj.weight``, ``conv1d.weight`` [C, 1, K]) or vLLM/seed (``ple_embedding.ngram_embedding.
shard_<i>.weight`` split in ``split_ngram_parts`` blocks, a merged ``kv_proj.weight``). An NVFP4
table (``table_dtype="nvfp4"``) loads only in vLLM's split layout: ``shard_<i>.weight`` packed
codes, ``shard_<i>.weight_scale`` block scales and the global ``weight_scale_2`` (see
:meth:`NGramEmbedding.load_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qwen4exp_ext import ops
from qwen4exp_ext.reference import FP8_DTYPES
from qwen4exp_ext.tables.checkpoint import safetensors_dtype
from qwen4exp_ext.tables.file_format import TableDtype
from qwen4exp_ext.tables.readers import TableReader

from . import prefetch
from .ngram_embedding import NGramEmbedding, Placement
from .state import PLEBatch, _text_config, ple_conv_state_len

__all__ = ["PLELayer"]

EMBEDDING_PREFIX = "ple_embedding."
TABLE_NAME = "ngram_embedding.weight"


class _Weight(nn.Module):
    """A bare ``weight`` parameter, so state-dict names match transformers (``conv1d.weight``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class _GroupedNorm(nn.Module):
    """Holds one grouped Gemma RMSNorm weight [C] (the math runs inside ``ple_gate``)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(
            torch.zeros(size, dtype=dtype, device=device), requires_grad=False
        )


class PLELayer(nn.Module):
    """One PLE layer: n-gram embedding → merged kv projection → gate → dilated conv.

    ``forward(hidden [T, C], input_ids [T], batch)``: ``batch`` is a :class:`~.state.PLEBatch`
    from :meth:`PLEState.prepare` (varlen requests, conv state in the cache at ``state_index``);
    without it the T tokens are one fresh sequence and no state is kept. Returns [T, C] in
    hidden's dtype (= hidden + the transformers layer's output).

    ``table_dtype`` is the n-gram table's storage (default ``dtype``): a float or fp8 dtype, or
    ``"nvfp4"`` (see :class:`NGramEmbedding`); its lookups come out in ``dtype``.
    """

    def __init__(
        self,
        config: Any,
        layer_index: int = 0,
        *,
        state_index: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        table_dtype: TableDtype | str | None = None,
        placement: Placement = "device",
        device: torch.device | str | None = None,
        rounding: str = "vllm",
        shard: tuple[int, int] | None = None,
        process_group: Any = None,
        max_tokens: int | None = None,
        table_path: str | Path | None = None,
        table_reader: TableReader = "mmap",
        io_threads: int = 0,
    ) -> None:
        super().__init__()
        config = _text_config(config)
        self.layer_index = int(layer_index)
        self.state_index = self.layer_index if state_index is None else int(state_index)
        self.hidden_size = int(config.hidden_size)
        self.hc_count = int(config.hc_count)
        self.hc_hidden_size = self.hidden_size * self.hc_count
        self.embed_dim = int(config.ple_embed_dim)
        self.conv_kernel_size = int(config.ple_conv_kernel_size)
        self.dilation = int(config.ngram_size)
        self.state_len = ple_conv_state_len(config)
        self.eps = float(config.rms_norm_eps)
        self.dtype = dtype
        self.rounding = rounding
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.ple_embedding = NGramEmbedding(
            _EosConfig(config),
            self.layer_index,
            placement=placement,
            device=dev,
            dtype=table_dtype or dtype,
            out_dtype=dtype,
            shard=shard,
            process_group=process_group,
            max_tokens=max_tokens,
            table_path=table_path,
            table_reader=table_reader,
            io_threads=io_threads,
        )
        self.kv_proj = nn.Linear(
            self.embed_dim,
            self.hc_hidden_size + self.hidden_size,
            bias=False,
            dtype=dtype,
            device=dev,
        )
        self.kv_proj.weight.requires_grad_(False)
        self.norm_key = _GroupedNorm(self.hc_hidden_size, self.eps, dtype, dev)
        self.norm_query = _GroupedNorm(self.hc_hidden_size, self.eps, dtype, dev)
        self.norm_conv = _GroupedNorm(self.hc_hidden_size, self.eps, dtype, dev)
        # [C, 1, K] as transformers' depthwise nn.Conv1d stores it; zero at init (SPEC §7).
        self.conv1d = _Weight(
            torch.zeros(self.hc_hidden_size, 1, self.conv_kernel_size, dtype=dtype, device=dev)
        )
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self._workspace = self._allocate_workspace(dev)

    def _allocate_workspace(self, device: torch.device) -> dict[str, torch.Tensor] | None:
        """With ``max_tokens``: the buffers every large intermediate and the output are written
        into, made once (fixed addresses, as CUDA/HIP graphs need; and on a CPU a fresh [T, C]
        output faults in its pages on every call, which costs more than the gate itself at
        prefill)."""
        if self.max_tokens is None:
            return None
        rows, c = self.max_tokens, self.hc_hidden_size
        return {
            "kv": torch.empty(rows, c + self.hidden_size, dtype=self.dtype, device=device),
            "gated": torch.empty(rows, c, dtype=self.dtype, device=device),
            "conv_input": torch.empty(rows, c, dtype=self.dtype, device=device),
        }

    @classmethod
    def from_config(cls, config: Any, layer_index: int = 0, **kwargs: Any) -> PLELayer:
        """Builds from a ``Qwen4ExpTextConfig`` (or a composite config with a text config). The
        table's storage is ``table_dtype`` if given, else the config's ``ple_embedding_dtype``
        (vLLM's field: ``"nvfp4"`` or ``"float8_e4m3fn"``, set by quantised checkpoints), else
        ``dtype``."""
        if kwargs.get("table_dtype") is None:
            kwargs["table_dtype"] = getattr(_text_config(config), "ple_embedding_dtype", None)
        return cls(config, layer_index, **kwargs)

    @property
    def conv_weights(self) -> torch.Tensor:
        return self.conv1d.weight.squeeze(1)

    # --- forward -------------------------------------------------------------------------------

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        batch: PLEBatch | None = None,
        embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``embeddings``: the tokens' n-gram rows [T, D_e] when they were looked up elsewhere
        (a :class:`~.staged.StagedStep`'s ``rows``); otherwise looked up here."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hc_hidden_size:
            raise ValueError(
                f"hidden must be [T, {self.hc_hidden_size}], got {tuple(hidden.shape)}"
            )
        if input_ids is None:
            if batch is None:
                raise ValueError("input_ids or batch is required")
            input_ids = batch.input_ids
        input_ids = input_ids.reshape(-1)
        if input_ids.numel() != hidden.shape[0]:
            raise ValueError(
                f"input_ids has {input_ids.numel()} tokens but hidden has {hidden.shape[0]}"
            )
        hidden = hidden.contiguous()
        if batch is None:
            qsl, context = self._one_sequence(hidden.shape[0], hidden.device)
        else:
            qsl, context = batch.query_start_loc, batch.ngram_context

        num_tokens = hidden.shape[0]
        workspace = self._workspace
        if workspace is not None and num_tokens > self.max_tokens:
            raise ValueError(
                f"PLELayer: {num_tokens} tokens, but the layer was built for max_tokens = "
                f"{self.max_tokens}"
            )
        if embeddings is None:
            embeddings = self._embeddings(input_ids, qsl, context)
        elif tuple(embeddings.shape) != (num_tokens, self.embed_dim):
            raise ValueError(
                f"embeddings must be [{num_tokens}, {self.embed_dim}], got "
                f"{tuple(embeddings.shape)}"
            )
        if embeddings.dtype != hidden.dtype:
            embeddings = embeddings.to(hidden.dtype)
        kv_weight = self.kv_proj.weight.to(hidden.dtype)
        if workspace is not None and hidden.dtype == self.dtype:
            kv = torch.mm(embeddings, kv_weight.t(), out=workspace["kv"][:num_tokens])
            out = (workspace["gated"][:num_tokens], workspace["conv_input"][:num_tokens])
        else:
            kv = F.linear(embeddings, kv_weight)
            out = None
        key, value = kv.split([self.hc_hidden_size, self.hidden_size], dim=-1)
        gated, conv_input = ops.ple_gate(
            key,
            value,
            hidden,
            self.norm_key.weight,
            self.norm_query.weight,
            self.norm_conv.weight,
            self.eps,
            rounding=self.rounding,
            out=out,
        )
        if batch is None:
            self._conv_one_sequence(conv_input, gated, hidden, qsl)
        else:
            self._conv_batch(conv_input, gated, hidden, batch)
        return gated

    def _embeddings(
        self, input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
    ) -> torch.Tensor:
        """The n-gram rows of the tokens: those of a lookup started ahead for these very
        tokens (:meth:`start_prefetch`; :func:`~.prefetch.started_rows` tells), else looked up
        now (into the embedding's fixed buffers when the layer has them)."""
        emb = self.ple_embedding
        slot = emb.prefetch_slot
        if slot is None:
            return emb(input_ids, query_start_loc, ngram_context)
        rows = prefetch.started_rows(emb, input_ids)
        if rows is not None:
            return rows
        rows = prefetch.lookup_into_slot(emb, slot, input_ids, query_start_loc, ngram_context)
        return emb._reduced(rows, reduce=True)

    # --- lookups started ahead (layers/prefetch.py) ----------------------------------------------

    def start_prefetch(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
        ngram_context: torch.Tensor | None = None,
    ) -> None:
        """Starts this layer's n-gram lookup ahead of :meth:`forward` (needs ``max_tokens``):
        the next forward with the same ``input_ids`` tensor uses its rows. Without
        ``query_start_loc`` and ``ngram_context`` the tokens are one fresh sequence, as in a
        forward without a batch. Several layers start together through a
        :class:`~.prefetch.LookupPipeline`."""
        if query_start_loc is None or ngram_context is None:
            query_start_loc, ngram_context = self._one_sequence(input_ids.numel(), input_ids.device)
        self.ple_embedding.start_prefetch(input_ids, query_start_loc, ngram_context)

    def finalize_prefetch(self) -> torch.Tensor:
        """The n-gram embeddings [T, D_e] of the started lookup (what ``ple_embedding``'s
        forward returns), waiting only on this layer's lookup."""
        return self.ple_embedding.finalize_prefetch()

    def _one_sequence(
        self, num_tokens: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_start_loc, ngram_context) of the tokens as one fresh sequence: one request,
        an all-EOS context."""
        qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
        context = torch.full(
            (1, self.dilation - 1),
            self.ple_embedding.eos_token_id,
            dtype=torch.int64,
            device=device,
        )
        return qsl, context

    def _conv_one_sequence(
        self, conv_input: torch.Tensor, gated: torch.Tensor, hidden: torch.Tensor, qsl: torch.Tensor
    ) -> None:
        """The conv of one fresh sequence, over a scratch state that is discarded."""
        device = hidden.device
        scratch = torch.zeros(
            2, self.hc_hidden_size, self.state_len, dtype=hidden.dtype, device=device
        )
        ops.ple_conv(
            conv_input,
            gated,
            scratch,
            self.conv_weights.to(hidden.dtype),
            torch.ones(1, dtype=torch.int32, device=device),
            hidden,
            mode="prefill",
            dilation=self.dilation,
            query_start_loc=qsl,
            has_initial_states=torch.zeros(1, dtype=torch.bool, device=device),
        )

    def _conv_batch(
        self, conv_input: torch.Tensor, gated: torch.Tensor, hidden: torch.Tensor, batch: PLEBatch
    ) -> None:
        """The conv of a step's requests, one ple_conv call per mode, on this layer's state."""
        conv_weights = self.conv_weights.to(hidden.dtype)
        conv_state = batch.conv_state(self.state_index)
        if conv_state.dtype != hidden.dtype:
            raise ValueError(f"conv state is {conv_state.dtype} but hidden is {hidden.dtype}")
        for group in batch.groups:
            ops.ple_conv(
                conv_input,
                gated,
                conv_state,
                conv_weights,
                group.state_indices,
                hidden,
                mode=group.mode,
                dilation=self.dilation,
                query_start_loc=group.query_start_loc,
                num_accepted_tokens=group.num_accepted_tokens,
                has_initial_states=group.has_initial_states,
                spec_query_len=group.spec_query_len,
                token_indices=group.token_indices,
            )

    # --- checkpoint loading --------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads tensors named relative to the layer, transformers or vLLM/seed layout (module
        docstring). Returns the names of this module's state that were written; an unknown name
        is an error (``hashstats_*`` and ``token_lookup`` are skipped).

        A list, tuple or dict is checked in full (names, shapes, dtypes) before anything is
        written, so a bad tensor leaves the layer untouched; any other iterable is loaded one
        tensor at a time (see :meth:`NGramEmbedding.load_weights` for a stream that fails after
        writing table rows)."""
        if isinstance(weights, Mapping):
            weights = list(weights.items())
        global_scales: list[tuple[str, torch.Tensor]] = []
        steps = (self._plan_load(name, tensor, global_scales) for name, tensor in weights)
        if isinstance(weights, (list, tuple)):
            steps = list(steps)  # every tensor checked before the first write
        return self._apply(steps)

    def _apply(self, steps: Iterable[tuple[Callable[[], None], str | None]]) -> set[str]:
        """Runs checked (write it, state name or None) steps; returns the state names written.
        A stream that fails after table rows were written leaves the embedding refusing to run
        (as :meth:`NGramEmbedding.load_weights` does): each step is its own embedding load, so
        the embedding alone cannot tell that a later tensor failed."""
        loaded: set[str] = set()
        try:
            for apply, got in steps:
                apply()
                if got is not None:
                    loaded.add(got)
        except BaseException as error:
            emb = self.ple_embedding
            rows = {EMBEDDING_PREFIX + name for name in emb.row_parameters}
            if loaded & rows and emb._incomplete_load is None:
                emb._mark_incomplete(error)
            raise
        return loaded

    def _plan_load(
        self, name: str, tensor: torch.Tensor, global_scales: list[tuple[str, torch.Tensor]]
    ):
        """Checks one checkpoint tensor and returns (write it, the state name it loads or None)
        without writing anything. ``global_scales`` holds this load's first NVFP4 global scale:
        every later one must equal it."""
        emb = self.ple_embedding
        if tensor.device.type == "meta":
            raise ValueError(f"checkpoint tensor {name!r} has no data (it is on the meta device)")
        if name.startswith(EMBEDDING_PREFIX):
            sub = name[len(EMBEDDING_PREFIX) :]
            if sub == TABLE_NAME:
                self._check_table(tensor.shape, tensor.dtype)
                return (lambda: self._load_table_rows(0, tensor)), "ple_embedding.weight"
            plan = emb._plan(sub, tensor.shape, tensor.dtype, tensor.device)
            if plan[0] == "skip":
                return (lambda: None), None
            if plan[0] == "global_scale":
                emb._agree_global_scale(global_scales, name, tensor)
            state = EMBEDDING_PREFIX + emb._state_name(sub, plan)
            return (lambda: emb._run_load([(sub, plan, tensor)])), state
        if name == "kv_proj.weight":
            target = self.kv_proj.weight
        elif name == "key_proj.weight":
            target = self.kv_proj.weight[: self.hc_hidden_size]
        elif name == "value_proj.weight":
            target = self.kv_proj.weight[self.hc_hidden_size :]
        elif name in ("norm_key.weight", "norm_query.weight", "norm_conv.weight"):
            target = getattr(self, name.split(".")[0]).weight
        elif name == "conv1d.weight":
            target = self.conv1d.weight
            if tensor.dim() == 2:
                tensor = tensor.unsqueeze(1)
        else:
            leaf = name.rsplit(".", 1)[-1]
            if leaf.startswith("hashstats_") or leaf == "token_lookup":
                return (lambda: None), None
            raise ValueError(f"PLELayer.load_weights: unexpected checkpoint tensor {name!r}")
        self._check_copy(target, tensor, name)
        state = "kv_proj.weight" if name in ("key_proj.weight", "value_proj.weight") else name
        return (lambda: self._copy(target, tensor)), state

    def load_state_dict_transformers(
        self, state_dict: Mapping[str, torch.Tensor], prefix: str = ""
    ) -> set[str]:
        """Loads a transformers ``Qwen4ExpTextPLELayer`` state dict (or a model's, with
        ``prefix`` such as ``"model.language_model.layers.3.ple."``); other keys are ignored."""
        return self.load_weights(
            (key[len(prefix) :], value)
            for key, value in state_dict.items()
            if key.startswith(prefix)
        )

    def load_safetensors(self, files: Iterable[str | Path], prefix: str = "") -> set[str]:
        """Loads from safetensors files (transformers or vLLM layout) the tensors under ``prefix``;
        table rows (whole-table or checkpoint-split) are read as memory-mapped slices of this
        rank's rows. Every tensor of every file is checked (names, shapes, dtypes from the
        headers) before anything is written, so a bad file leaves the layer untouched."""
        from safetensors import safe_open

        emb = self.ple_embedding
        steps = []  # (write it, the state name it loads or None), all checked
        global_scales: list[tuple[str, torch.Tensor]] = []
        for path in [str(path) for path in files]:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if not key.startswith(prefix):
                        continue
                    name = key[len(prefix) :]
                    sub = (
                        name[len(EMBEDDING_PREFIX) :] if name.startswith(EMBEDDING_PREFIX) else None
                    )
                    piece = f.get_slice(key)
                    shape, dtype = piece.get_shape(), safetensors_dtype(piece.get_dtype(), key)
                    if sub == TABLE_NAME:
                        self._check_table(shape, dtype)
                        steps.append((self._table_reader(path, key), "ple_embedding.weight"))
                        continue
                    plan = emb._plan(sub, shape, dtype, torch.device("cpu")) if sub else None
                    if plan is not None and plan[0] == "skip":
                        continue
                    if plan is not None and plan[0] == "rows":
                        reader = emb._slice_reader(path, key, plan[2])
                        step = [(sub, plan, reader)]
                        state = EMBEDDING_PREFIX + emb._state_name(sub, plan)
                        steps.append(((lambda step=step: emb._run_load(step)), state))
                    else:  # small (norms, projections, conv, hash buffers, scales): read now
                        steps.append(self._plan_load(name, f.get_tensor(key), global_scales))
        return self._apply(steps)

    def _table_reader(self, path: str, key: str):
        """Copies this rank's rows of a whole-table checkpoint tensor, as a memory-mapped slice."""

        def read() -> None:
            from safetensors import safe_open

            with safe_open(path, framework="pt", device="cpu") as f:
                piece = f.get_slice(key)
                lo, hi = self.ple_embedding._owned_rows(0, piece.get_shape()[0])
                if lo < hi:
                    self._load_table_rows(lo, piece[lo:hi])

        return read

    def _check_table(self, shape, dtype: torch.dtype) -> None:
        emb = self.ple_embedding
        if emb.nvfp4:
            raise emb._unsharded_nvfp4(EMBEDDING_PREFIX + TABLE_NAME)
        if len(shape) != 2 or shape[1] != emb.head_dim or shape[0] > emb.num_rows:
            raise ValueError(
                f"ple_embedding.ngram_embedding.weight must be [<= {emb.num_rows}, "
                f"{emb.head_dim}], got {tuple(shape)}"
            )
        emb._check_rows(EMBEDDING_PREFIX + TABLE_NAME, dtype)

    def _load_table_rows(self, first_row: int, rows: torch.Tensor) -> None:
        """Writes table rows (of a whole-table tensor already checked by :meth:`_check_table`)
        from global row ``first_row`` on."""
        emb = self.ple_embedding
        if emb.table_dtype not in FP8_DTYPES:
            rows = rows.to(emb.table_dtype)
        emb._copy_rows(first_row, rows)

    @staticmethod
    def _check_copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"Shape mismatch for {name}: expected {tuple(param.shape)}, "
                f"got {tuple(tensor.shape)}"
            )
        if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex) and (
            param.dtype.is_floating_point
        ):
            raise ValueError(f"{name} must be floating point, got {tensor.dtype}")

    @staticmethod
    def _copy(param: torch.Tensor, tensor: torch.Tensor) -> None:
        """Writes a tensor already checked by :meth:`_check_copy`."""
        with torch.no_grad():
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))


class _EosConfig:
    """The config as NGramEmbedding reads it, with a list-valued ``eos_token_id`` reduced to
    its first entry (transformers configs may carry several)."""

    def __init__(self, config: Any) -> None:
        self._config = config
        eos = config.eos_token_id
        self.eos_token_id = int(eos[0] if isinstance(eos, (list, tuple)) else eos)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)
