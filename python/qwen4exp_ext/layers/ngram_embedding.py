"""The hashed n-gram embedding of one PLE layer (SPEC §2-§4; vLLM's
``Qwen4ExpNGramEmbedding``), on our kernels: ``ngram_ids`` then ``gather_rows``, or both in one
(``ngram_gather_rows``) where that is measured faster (FUSED_LOOKUP_DEVICES).

The table ([R_pad, d], R_pad = 320,001,536 rows for the released layer) can be placed

- ``"device"``: in device memory (or CPU memory when ``device`` is the CPU);
- ``"pinned"``: in host memory of exactly its size, registered once and read by the GPU over
  PCIe (:func:`qwen4exp_ext.tables.host_memory.pinned_host_table`,
  :func:`~qwen4exp_ext.tables.host_memory.device_view`); ids and outputs live on the GPU;
- ``"cpu"``: in host memory on huge pages, gathered by the CPU kernel;
- ``"file"``: in a table file on disk (``table_path``, written by ``qwen4exp-table pack``;
  :mod:`qwen4exp_ext.tables.file_format`), never held whole in RAM, read by the CPU through a memory
  mapping or with ``O_DIRECT`` reads (``table_reader``; :mod:`qwen4exp_ext.tables.readers`).

A GPU reads a ``"pinned"`` table itself; the rows of a ``"cpu"`` or ``"file"`` table reach a
GPU through :class:`~qwen4exp_ext.layers.staged.StagedLookupPipeline` (CPU threads gather them
into pinned staging ahead of the layer, one copy per layer).

Its storage is fp32/bf16/fp16, fp8 (with a per-tensor scale) or NVFP4 in vLLM's layout: packed
E2M1 codes ``weight`` (uint8 [R, d/2]), e4m3 block scales ``weight_scale`` ([R, d/16], placed
like the table) and one fp32 global scale ``weight_scale_2``.

With ``shard=(rank, world_size)`` this rank holds only its block of rows
(:func:`qwen4exp_ext.sharding.shard_bounds`) and ``forward`` sums the ranks' partial lookups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from qwen4exp_ext import layout, ops, sharding
from qwen4exp_ext.reference import FP8_DTYPES, NVFP4_BLOCK
from qwen4exp_ext.tables.checkpoint import BUFFER_NAMES
from qwen4exp_ext.tables.file_format import (
    NVFP4,
    TableDtype,
    TableFileHeader,
    expected_header,
    file_rows,
    table_dtype,
    write_table_file,
)
from qwen4exp_ext.tables.host_memory import device_view, empty_host_table, pinned_host_table
from qwen4exp_ext.tables.readers import READERS, FileTable, TableReader

from . import prefetch
from .ngram_loading import CheckpointLoading

__all__ = ["NGramEmbedding"]

Placement = Literal["device", "pinned", "cpu", "file"]
PLACEMENTS = ("device", "pinned", "cpu", "file")
# Placements whose table the CPU reads (StagedLookupPipeline's tables).
HOST_PLACEMENTS = ("cpu", "file")
# Where forward hashes and gathers in one op (ops.ngram_gather_rows) rather than ngram_ids then
# gather_rows: the table's device types where the bench measured the fused op faster than the
# two (qwen4exp-bench ngram_gather_rows; results/bench.jsonl). On the CPU it was 1.85x at decode
# T = 1, 1.45x at T = 8 and never slower; no GPU has run the fused kernel yet.
FUSED_LOOKUP_DEVICES = ("cpu",)


class NGramEmbedding(CheckpointLoading, nn.Module):
    """Hashed n-gram rows of every token, concatenated over the NH heads: [T, D_e].

    ``config`` carries the Qwen4Exp text-config fields (``vocab_size``, ``ngram_size``,
    ``heads_per_ngram``, ``ple_embed_dim``, ``ngram_vocab_size_base``,
    ``make_ngram_vocab_size_divisible_by``, ``eos_token_id``, and optionally ``seed`` = 1234 and
    ``split_ngram_parts`` = 512). ``layer_index`` is the dense PLE layer index L. ``dtype`` is
    the table's storage: fp32/bf16/fp16/fp8 e4m3fn/e4m3fnuz (fp8 tables carry a per-tensor fp32
    ``weight_scale``), or ``"nvfp4"`` (``weight`` uint8 [rows, d/2], block scales
    ``weight_scale`` float8_e4m3fn [rows, d/16], global scale ``weight_scale_2`` fp32 [1]; the
    head dim d must be a multiple of 16). A dtype's name ("float8_e4m3fn", as vLLM's
    ``ple_embedding_dtype`` spells it) is accepted too. ``out_dtype`` is that of the embeddings
    (default: the table's, bf16 for fp8 and NVFP4).

    ``max_tokens`` (the most tokens of a step) gives the layer the fixed buffers of
    :meth:`start_prefetch` / :meth:`finalize_prefetch`, the lookup started ahead of the layer
    (:mod:`qwen4exp_ext.layers.prefetch`).

    ``placement="file"`` reads the table from ``table_path`` (the layer's table file; its header
    must match this layer, format, width and row count) with ``table_reader`` ``"mmap"`` (the
    page cache keeps what fits) or ``"direct"`` (``O_DIRECT`` reads, ``io_threads`` in flight;
    0: the default). Its rows and scales come from the file: ``load_weights`` refuses table
    rows. The file stays open until the module is garbage-collected or :meth:`close_table`.
    """

    def __init__(
        self,
        config: Any,
        layer_index: int = 0,
        *,
        placement: Placement = "device",
        device: torch.device | str | None = None,
        dtype: TableDtype | str = torch.bfloat16,
        out_dtype: torch.dtype | None = None,
        shard: tuple[int, int] | None = None,
        process_group: Any = None,
        reduce: Literal["all_reduce", "reduce_scatter"] = "all_reduce",
        max_tokens: int | None = None,
        table_path: str | Path | None = None,
        table_reader: TableReader = "mmap",
        io_threads: int = 0,
    ) -> None:
        super().__init__()
        self._read_geometry(config)
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if (placement == "file") != (table_path is not None):
            raise ValueError(
                "placement='file' needs table_path (the layer's table file), and table_path "
                f"is only for placement='file' (got placement={placement!r}, "
                f"table_path={table_path!r})"
            )
        if table_reader not in READERS:
            raise ValueError(f"table_reader must be one of {READERS}, got {table_reader!r}")
        dtype = table_dtype(dtype)
        self.nvfp4 = dtype == NVFP4
        if self.nvfp4 and self.head_dim % NVFP4_BLOCK:
            raise ValueError(
                f"an NVFP4 table needs a head dim (ple_embed_dim / n-gram heads) that is a "
                f"multiple of {NVFP4_BLOCK} (one e4m3 block scale per {NVFP4_BLOCK} elements), "
                f"got {self.head_dim}"
            )
        if reduce not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"reduce must be 'all_reduce' or 'reduce_scatter', got {reduce!r}")
        self.placement = placement
        self.table_dtype = dtype
        self.out_dtype = out_dtype or (torch.bfloat16 if self.quantized else dtype)
        self.process_group = process_group
        self.reduce = reduce

        multipliers = layout.layer_multipliers(
            int(config.vocab_size),
            self.ngram_size,
            int(getattr(config, "seed", 1234)),
            layer_index,
        )
        heads = layout.head_vocab_layout(
            int(config.ngram_vocab_size_base),
            self.ngram_heads,
            layer_index,
            int(config.make_ngram_vocab_size_divisible_by),
        )
        self.num_rows = heads.padded_rows  # R_pad: the checkpoint's row count
        if shard is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank, self.world_size = (int(x) for x in shard)
        self.vocab_start, self.vocab_end = sharding.shard_bounds(
            self.num_rows, self.rank, self.world_size
        )

        compute_device = _compute_device(placement, device)
        self._register_hash_buffers(multipliers, heads, compute_device)
        self.file_table: FileTable | None = None
        self._local_positions = torch.empty(0, dtype=torch.int64)  # _local_ids' arange, grown
        # What this layer's table file must say (tables/file_format.py): checked against a file
        # read, written by save_table_file.
        self.table_file_header = expected_header(config, layer_index, dtype)
        if placement == "file":
            self._open_table_file(
                FileTable(table_path, self.table_file_header, table_reader, io_threads)
            )
        else:
            self._allocate_table(compute_device)
        # Set when a streamed load failed after writing rows (see load_weights).
        self._incomplete_load: str | None = None
        # The fixed buffers of start_prefetch (none without max_tokens).
        self.prefetch_slot = prefetch.PrefetchSlot.allocate(self, max_tokens, compute_device)

    def _read_geometry(self, config: Any) -> None:
        """The n-gram heads, their width and the checkpoint split, from ``config``, checked."""
        self.ngram_size = int(config.ngram_size)
        self.heads_per_ngram = int(config.heads_per_ngram)
        if self.ngram_size < 2:
            raise ValueError(f"ngram_size must be >= 2, got {self.ngram_size}")
        if self.heads_per_ngram <= 0:
            raise ValueError(f"heads_per_ngram must be > 0, got {self.heads_per_ngram}")
        self.ngram_heads = (self.ngram_size - 1) * self.heads_per_ngram
        self.embedding_dim = int(config.ple_embed_dim)
        if self.embedding_dim % self.ngram_heads:
            raise ValueError(
                "ple_embed_dim must be divisible by the number of n-gram heads: "
                f"{self.embedding_dim} % {self.ngram_heads} != 0"
            )
        self.head_dim = self.embedding_dim // self.ngram_heads
        self.eos_token_id = int(config.eos_token_id)
        self.split_ngram_parts = int(getattr(config, "split_ngram_parts", 512))
        if self.split_ngram_parts <= 0:
            raise ValueError("split_ngram_parts must be positive")

    def _register_hash_buffers(
        self, multipliers: Sequence[int], heads: layout.HeadLayout, device: torch.device
    ) -> None:
        """The int64 hash constants of ngram_ids (BUFFER_NAMES), on ``device``."""
        self.register_buffer(
            "layer_multipliers", torch.tensor(multipliers, dtype=torch.int64, device=device)
        )
        self.register_buffer(
            "ngram_heads_vocab_sizes", torch.tensor(heads.sizes, dtype=torch.int64, device=device)
        )
        self.register_buffer(
            "ngram_heads_offsets", torch.tensor(heads.offsets, dtype=torch.int64, device=device)
        )
        # ngram_ids' fast-modulo constants of the head sizes, computed once here and again
        # whenever the sizes are loaded (load_weights, load_state_dict), never per forward. Not
        # persistent: derived from ngram_heads_vocab_sizes, they are no part of a checkpoint, and
        # as a buffer they follow .to() with it. Constants that do fall behind the sizes (an
        # in-place edit) still give the right ids: the kernel rebuilds every head whose stored
        # divisor is not its size.
        sizes = torch.tensor(heads.sizes, dtype=torch.int64)
        self.register_buffer(
            "ngram_heads_divmod", ops.ngram_head_divmod(sizes).to(device), persistent=False
        )
        self.register_load_state_dict_post_hook(_refresh_head_divmod_after_load)
        self.register_load_state_dict_pre_hook(_keep_file_values_on_load)

    def _refresh_head_divmod(self) -> None:
        """Recomputes ``ngram_heads_divmod`` from the sizes, in place when it can (a captured
        CUDA graph keeps reading the same memory). Sizes that are not all positive keep the old
        constants: the kernels handle such heads themselves (the CPU rejects them, the GPU gives
        id -1), and a load does not fail over a derived buffer."""
        sizes = self.ngram_heads_vocab_sizes
        if sizes.dim() != 1 or not bool((sizes > 0).all()):
            return
        fresh = ops.ngram_head_divmod(sizes)
        current = self.ngram_heads_divmod
        if current.shape == fresh.shape and current.device == fresh.device:
            with torch.no_grad():
                current.copy_(fresh)
        else:
            self.ngram_heads_divmod = fresh

    def _allocate_table(self, compute_device: torch.device) -> None:
        """The zeroed table of this rank's rows (NVFP4: codes and block scales) where
        ``placement`` puts it, its scales, and the device views of a pinned table."""
        local_rows = self.vocab_end - self.vocab_start

        def allocate(width: int, storage: torch.dtype) -> torch.Tensor:
            return _allocate_rows(self.placement, local_rows, width, storage, compute_device)

        self.weight_scale: torch.Tensor | None
        self.weight_scale_2: torch.Tensor | None
        block_scales = None
        if self.nvfp4:
            # Two E2M1 codes a byte. The block scales are an eighth of the table's bytes: too
            # large for the device memory that a pinned or CPU table is there to spare, so
            # they are placed like the table.
            table = allocate(self.head_dim // 2, torch.uint8)
            block_scales = allocate(self.head_dim // NVFP4_BLOCK, torch.float8_e4m3fn)
            self.register_buffer(
                "weight_scale_2", torch.ones(1, dtype=torch.float32, device=compute_device)
            )
        else:
            table = allocate(self.head_dim, self.table_dtype)
            if self.table_dtype in FP8_DTYPES:
                self.register_buffer(
                    "weight_scale", torch.ones(1, dtype=torch.float32, device=compute_device)
                )
            else:
                self.weight_scale = None
            self.weight_scale_2 = None
        self.weight = nn.Parameter(table, requires_grad=False)
        if block_scales is not None:
            self.weight_scale = nn.Parameter(block_scales, requires_grad=False)
        pinned = self.placement == "pinned"
        self._device_table = device_view(table) if pinned else None
        self._device_block_scales = (
            device_view(block_scales) if pinned and block_scales is not None else None
        )

    def _open_table_file(self, file_table: FileTable) -> None:
        """Reads a ``"file"`` table through ``file_table``: no table parameter (its rows are
        the file's), the scale from the file's header, and with the mmap reader the views of
        this rank's rows over the mapping that the kernels read."""
        self.file_table = file_table
        header = file_table.header
        self.weight = None
        scale = torch.tensor([1.0 if header.scale is None else header.scale], dtype=torch.float32)
        if self.nvfp4:
            self.weight_scale = None  # the block scales: in the file, beside each row's codes
            self.register_buffer("weight_scale_2", scale)
        elif self.table_dtype in FP8_DTYPES:
            self.register_buffer("weight_scale", scale)
            self.weight_scale_2 = None
        else:
            self.weight_scale = self.weight_scale_2 = None
        self._device_table = self._device_block_scales = None
        self._file_values = self._file_block_scales = None
        if file_table.reader == "mmap":
            rows = file_table.rows[self.vocab_start : self.vocab_end]
            self._file_values = header.value_view(rows)
            self._file_block_scales = header.block_scale_view(rows)

    def _check_file_values(self, staged: list[tuple[str, str, torch.Tensor]]) -> None:
        """A file table's scale is its header's, its hash buffers the layout its checksum was
        checked against: a checkpoint may repeat them, never change them."""
        for _, name, tensor in staged:
            current = getattr(self, name.removeprefix("ngram_embedding."))
            value = tensor.detach().reshape(current.shape).to("cpu", current.dtype)
            if not torch.equal(value, current.cpu()):
                path = self.file_table.path
                raise ValueError(
                    f"{name} {value.tolist()} differs from the table file's ({path}) "
                    f"{current.tolist()}: a file table's scale and hash layout are its file's"
                )

    def close_table(self) -> None:
        """Closes a ``"file"`` table (its descriptor; its mapping once no tensor views it): the
        module refuses to run afterwards. Nothing to do for other placements."""
        if self.file_table is not None:
            self._file_values = self._file_block_scales = None
            self.file_table.close()

    def save_table_file(self, path: str | Path, chunk_rows: int = 1 << 16) -> TableFileHeader:
        """Writes this layer's whole table (every row: an unsharded module) and its scale to a
        table file that ``placement="file"`` reads, ``chunk_rows`` rows at a time; the file
        appears complete or not at all (a temporary file renamed). Returns its header.
        ``qwen4exp-table pack`` writes the same file from a checkpoint."""
        if self.file_table is not None:
            raise ValueError("save_table_file: this table is already a file")
        if self.world_size != 1:
            raise ValueError(
                f"save_table_file: this module holds rows [{self.vocab_start}, {self.vocab_end})"
                f" of {self.num_rows} (a vocabulary shard); a table file holds every row"
            )
        self._check_complete()
        scale = self.weight_scale_2 if self.nvfp4 else self.weight_scale
        header = dataclasses.replace(
            self.table_file_header, scale=None if scale is None else float(scale.item())
        )
        block_scales = self.weight_scale if self.nvfp4 else None
        write_table_file(path, header, file_rows(self.weight, block_scales, chunk_rows))
        return header

    @property
    def quantized(self) -> bool:
        """Whether the table's rows need decoding (fp8, NVFP4)."""
        return self.nvfp4 or self.table_dtype in FP8_DTYPES

    @property
    def host_table(self) -> bool:
        """Whether the CPU reads this table (placement ``"cpu"`` or ``"file"``)."""
        return self.placement in HOST_PLACEMENTS

    # --- forward -------------------------------------------------------------------------------

    @property
    def table(self) -> torch.Tensor | None:
        """The table the kernel reads (the device view of a pinned table; the mapped rows of an
        mmap file table; None for a direct-read file table, which has no such tensor)."""
        if self.file_table is not None:
            self.file_table.check_readable()
            return self._file_values
        return self._device_table if self._device_table is not None else self.weight

    @property
    def row_parameters(self) -> tuple[str, ...]:
        """The parameters loaded row by row from checkpoint shards."""
        return ("weight", "weight_scale") if self.nvfp4 else ("weight",)

    @property
    def block_scales(self) -> torch.Tensor | None:
        """The NVFP4 block scales the kernel reads (the device view when pinned); None for
        other tables."""
        if self.file_table is not None:
            return self._file_block_scales
        if self._device_block_scales is not None:
            return self._device_block_scales
        return self.weight_scale if self.nvfp4 else None

    def _dequant(self) -> dict[str, Any]:
        """The gather's scale arguments for this table's format."""
        if self.nvfp4:
            return {"scale": self.weight_scale_2, "block_scales": self.block_scales}
        return {"scale": self.weight_scale}  # no block_scales argument: the door predates NVFP4

    def _reduced(self, out: torch.Tensor, reduce: bool) -> torch.Tensor:
        if not reduce or self.world_size == 1:
            return out
        if self.reduce == "reduce_scatter":
            return sharding.reduce_scatter_embeddings(out, self.process_group)
        return sharding.all_reduce_embeddings(out, self.process_group)

    def lookup(self, ngram_ids: torch.Tensor, *, reduce: bool = True) -> torch.Tensor:
        """Rows of precomputed ids [T, NH] → [T, D_e] (this rank's partial sum if not reduced)."""
        self._check_complete()
        return self._reduced(self._gather(ngram_ids), reduce)

    def forward(
        self, input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
    ) -> torch.Tensor:
        return self._reduced(self._lookup_local(input_ids, query_start_loc, ngram_context), True)

    def _lookup_local(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        *,
        output: torch.Tensor | None = None,
        ids_output: torch.Tensor | None = None,
        max_blocks: int = 0,
        batch_checked: bool = False,
    ) -> torch.Tensor:
        """This rank's rows [T, D_e] of the tokens, not yet reduced over vocabulary shards:
        into ``output`` (and the ids into ``ids_output``) when given; each gather on a GPU
        launches at most ``max_blocks`` blocks (0: no cap). ``batch_checked``: the caller has
        already checked this batch against this layer (``prefetch.check_batch``)."""
        self._check_complete()
        table = self.table
        if table is not None and table.device.type in FUSED_LOOKUP_DEVICES:
            # (the other path checks the batch in _ngram_ids)
            if not batch_checked:
                prefetch.check_batch(
                    self, input_ids, query_start_loc, ngram_context, "NGramEmbedding"
                )
            return ops.ngram_gather_rows(
                input_ids.reshape(-1),
                query_start_loc,
                ngram_context,
                *self._hashing(),
                table,
                head_divmod=self._buffers["ngram_heads_divmod"],
                **self._gather_args(output, max_blocks),
            )
        ids = self._ngram_ids(
            input_ids, query_start_loc, ngram_context, ids_output, batch_checked=batch_checked
        )
        return self._gather(ids, output, max_blocks)

    def _gather(
        self, ids: torch.Tensor, output: torch.Tensor | None = None, max_blocks: int = 0
    ) -> torch.Tensor:
        """This rank's rows of n-gram ids [..., NH] (into ``output`` when given)."""
        table = self.table
        if table is None:  # a direct-read file table
            return self._gather_direct(ids, output)
        return ops.gather_rows(table, ids, **self._gather_args(output, max_blocks))

    def _gather_direct(self, ids: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
        """Rows of a ``"direct"`` file table: the ids' raw rows read into scratch (each block
        once, many reads in flight), then decoded by the gather kernel from the scratch rows,
        in the ids' order: the same values, bit for bit, as a gather from the whole table.
        Ids this rank does not own, or a read error, never reach ``output`` as rows: the
        scratch is decoded only after every read succeeded."""
        flat = ids.reshape(-1)
        raw = torch.empty(flat.numel(), self.table_file_header.row_bytes, dtype=torch.uint8)
        self._raw_rows(flat, raw)
        return self._decode_raw(raw, self._local_ids(flat).view(ids.shape), output)

    # Raw rows: the lookup split in two, so that a CPU can read a host table's rows undecoded
    # and a GPU decode them after one copy (layers/staged.py). A raw row has the table file's
    # layout (table_file_header.row_bytes: the row's storage bytes; NVFP4: its codes, then its
    # block scales), whatever the placement.

    def _raw_rows(self, flat_ids: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """The raw rows of global ids ``flat_ids`` [n] into ``output`` (uint8 [n, row_bytes],
        on the CPU), zero for ids this rank does not own. Host tables only."""
        if self.file_table is not None and self.file_table.reader == "direct":
            self.file_table.read_rows(flat_ids, output, self.vocab_start, self.vocab_end)
            return output
        if not self.host_table:
            raise RuntimeError(f"raw rows are read from host tables, not a {self.placement} one")
        owned = self._owns(flat_ids)
        local = torch.where(owned, flat_ids - self.vocab_start, 0)
        if self.file_table is not None:  # mmap: the mapped rows are already in this layout
            self.file_table.check_readable()
            rows = self.file_table.rows[self.vocab_start : self.vocab_end]
            torch.index_select(rows, 0, local, out=output)
        else:
            code_bytes = self.table_file_header.code_bytes
            output[:, :code_bytes] = self.weight.view(torch.uint8).index_select(0, local)
            if self.nvfp4:
                scales = self.weight_scale.view(torch.uint8)
                output[:, code_bytes:] = scales.index_select(0, local)
        return output.masked_fill_(~owned[:, None], 0)

    def _owns(self, flat_ids: torch.Tensor) -> torch.Tensor:
        """Which of the global ids ``flat_ids`` are rows of this rank (bool [n])."""
        return (flat_ids >= self.vocab_start) & (flat_ids < self.vocab_end)

    def _local_ids(self, flat_ids: torch.Tensor, output: torch.Tensor | None = None):
        """Each id's position in its raw rows [n], or -1 where this rank owns no row: the ids
        that :meth:`_decode_raw` gathers with (a zero row, as the gather of a foreign id)."""
        n = flat_ids.numel()
        if self._local_positions.numel() < n:
            self._local_positions = torch.arange(max(n, 2 * self._local_positions.numel()))
        local = torch.empty(n, dtype=torch.int64) if output is None else output
        return local.copy_(self._local_positions[:n]).masked_fill_(~self._owns(flat_ids), -1)

    def _decode_raw(
        self, raw: torch.Tensor, local_ids: torch.Tensor, output: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The rows [..., NH·d] of raw rows ``raw`` (uint8 [n, row_bytes], on any device) at
        ``local_ids`` [..., NH] (positions in ``raw``, -1: a zero row), decoded by the gather
        kernel of ``raw``'s device: the values of a gather from the table, bit for bit. The
        scales go as Python floats (exact for fp32), so no tensor has to be on ``raw``'s
        device but the rows and ids."""
        header = self.table_file_header
        scale = self.weight_scale_2 if self.nvfp4 else self.weight_scale
        return ops.gather_rows(
            header.value_view(raw),
            local_ids,
            scale=None if scale is None else float(scale.item()),
            block_scales=header.block_scale_view(raw),
            out_dtype=self.out_dtype,
            output=output,
        )

    def _hashing(self) -> tuple:
        """ngram_ids' arguments after the batch: this layer's hash constants (the buffers read
        from ``_buffers`` itself: nn.Module's ``__getattr__`` is a Python call each, a visible
        share of a staged decode step's Python)."""
        buffers = self._buffers
        return (
            buffers["layer_multipliers"],
            buffers["ngram_heads_vocab_sizes"],
            buffers["ngram_heads_offsets"],
            self.eos_token_id,
            self.heads_per_ngram,
        )

    def _ngram_ids(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        output: torch.Tensor | None = None,
        *,
        batch_checked: bool = False,
    ) -> torch.Tensor:
        """The [T, NH] row ids of the tokens (into ``output`` when given; ``batch_checked`` as
        for :meth:`_lookup_local`)."""
        if not batch_checked:
            prefetch.check_batch(self, input_ids, query_start_loc, ngram_context, "NGramEmbedding")
        return ops.ngram_ids(
            input_ids.reshape(-1),
            query_start_loc,
            ngram_context,
            *self._hashing(),
            head_divmod=self._buffers["ngram_heads_divmod"],
            output=output,
        )

    def _gather_args(self, output: torch.Tensor | None, max_blocks: int = 0) -> dict[str, Any]:
        """gather_rows' keyword arguments for this table: its scales, this rank's rows, the
        output dtype (or ``output``) and the grid cap."""
        return {
            **self._dequant(),
            "vocab_start": self.vocab_start,
            "vocab_end": self.vocab_end,
            "out_dtype": self.out_dtype,
            "output": output,
            "max_blocks": max_blocks,
        }

    # --- lookups started ahead (layers/prefetch.py) ----------------------------------------------

    def start_prefetch(
        self, input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
    ) -> None:
        """Hashes the tokens and launches their lookup into this layer's fixed buffers (needs
        ``max_tokens``): on a GPU on the side stream (:mod:`.prefetch`), on a CPU right now.
        :meth:`finalize_prefetch` returns the rows. Several layers of one step start together
        through a :class:`~.prefetch.LookupPipeline`."""
        prefetch.start([self], input_ids, query_start_loc, ngram_context)

    def finalize_prefetch(self) -> torch.Tensor:
        """What :meth:`forward` would have returned for the tokens of the last
        :meth:`start_prefetch`, waiting only on this layer's lookup. A view of the fixed
        buffer: valid until this layer's next lookup starts."""
        return prefetch.finalize(self, "NGramEmbedding.finalize_prefetch")

    @property
    def prefetch_pending(self) -> bool:
        """Whether a started lookup's rows have not been handed out yet."""
        return self.prefetch_slot is not None and self.prefetch_slot.state == "started"

    # --- checkpoint loading (vLLM's ``Qwen4ExpNGramEmbedding.load_weights``) ---------------------


def _keep_file_values_on_load(module: NGramEmbedding, state_dict: dict, prefix: str, *_) -> None:
    """load_state_dict pre hook: as load_weights, a state dict may repeat a file table's scale
    and hash buffers, never change them (its rows were checked against them)."""
    if module.file_table is None:
        return
    names = (*BUFFER_NAMES, "weight_scale", "weight_scale_2")
    module._check_file_values(
        [
            (key, name, state_dict[key])
            for name in names
            if (key := prefix + name) in state_dict and getattr(module, name, None) is not None
        ]
    )


def _refresh_head_divmod_after_load(module: NGramEmbedding, incompatible_keys: Any) -> None:
    """load_state_dict post hook: the constants follow the sizes it loaded."""
    module._refresh_head_divmod()


def _compute_device(placement: Placement, device: torch.device | str | None) -> torch.device:
    """The device of the small metadata (hash buffers, scales): the ids', so the GPU for
    "device" on a GPU and for "pinned"."""
    if placement == "file" and device is not None and torch.device(device).type != "cpu":
        raise ValueError(
            f"placement='file' reads the table with the CPU, so the module lives on the CPU "
            f"(got device={device}); deliver its rows to a GPU with "
            "StagedLookupPipeline(..., device=...)"
        )
    if placement in HOST_PLACEMENTS:
        compute_device = torch.device("cpu")
    elif device is not None:
        compute_device = torch.device(device)
    elif placement == "pinned":
        compute_device = torch.device("cuda", torch.cuda.current_device())
    else:
        compute_device = torch.device("cpu")
    if placement == "pinned" and compute_device.type != "cuda":
        raise ValueError(f"placement='pinned' needs a CUDA/ROCm device, got {compute_device}")
    return compute_device


def _allocate_rows(
    placement: Placement, rows: int, width: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zeroed [rows, width] table of ``dtype`` where ``placement`` puts it."""
    if placement == "device" and device.type != "cpu":
        return torch.zeros(rows, width, dtype=dtype, device=device)
    if placement == "pinned":
        # Exactly the table's bytes, zeroed, NUMA-local to the GPU and registered once
        # (device_view reuses the registration).
        return pinned_host_table(rows, width, dtype, device=device)
    # Host tables on huge pages; zero-filled here (first touch), loaded later.
    host = empty_host_table(rows, width, dtype)
    host.view(torch.uint8).zero_()
    return host
