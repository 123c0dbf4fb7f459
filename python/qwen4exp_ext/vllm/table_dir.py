"""vLLM's Qwen4Exp PLE tables from a directory of packed table files (issue #49, item 1).

With a table directory (``--additional-config '{"qwen4exp_table_dir": DIR}'``, else
``$QWEN4EXP_VLLM_TABLE_DIR``), every Qwen4Exp n-gram embedding vLLM builds, NVIDIA or AMD,
device or pinned, takes its table from ``DIR/ple<L>.q4xt`` (``qwen4exp-table pack-model``)
instead of allocating it and filling it from the checkpoint:

- **construction** (the n-gram embedding's ``__init__``): the table's allocation
  (``allocate_embedding_weight``, called by vLLM's embedding method with this rank's shard
  size) maps rows ``[org_vocab_start_index, + rows)`` of the file, this rank's vocabulary shard
  and nothing else, so one pack serves every TP/ETP/DP layout. The file is checked first against
  the layer's expected header (format, layer, width, rows, layout checksum): a missing, foreign,
  truncated or mismatched file raises :class:`~qwen4exp_ext.tables.file_format.TableFileError`
  naming it, and nothing is left mapped. Then the module's own hash buffers are checked against
  the file's layout checksum, and the fp8 / NVFP4 global scale is set from the file's header.
  NVFP4's ``weight`` and ``weight_scale`` are the two column ranges of the same mapped rows.
- **placement**: on the CPU the mapping *is* the table (read-only, ``MAP_SHARED``: the page
  cache's pages, shared by every process that maps the file). A device table on a GPU is copied
  from the mapping to the device (no zero fill, no checkpoint read). A pinned table on a GPU is
  the node's one copy (:func:`node_shared_table`, item 2's ``tables/shared.py``: the file on
  tmpfs mapped where it is, or staged into ``/dev/shm`` once per node under a lock), registered
  for the GPU's zero-copy lookup, and vLLM's ``weight`` is this rank's rows of that registered
  mapping. A table larger than the memory available falls back to a private mapping of the
  rank's own rows (vLLM has no CPU-staged lookup; a shard that does not fit either raises).
- **loading** (``load_weights``): the checkpoint's row shards (``ngram_embedding.shard_<i>.weight``,
  NVFP4's ``shard_<i>.weight_scale``, or an unsharded ``ngram_embedding.weight``) are dropped
  before vLLM's loader touches them. vLLM's safetensors iterator hands out tensors over a lazy
  mapping of the checkpoint file, so a shard dropped here is never read; and the model's
  ``is_unused_checkpoint_weight`` (vLLM's skip hook) says so of every row shard, so that vLLM's
  loader drops whole safetensors files that hold nothing else before opening them for reading.
  The rows are reported loaded (vLLM checks that every parameter was). The scales and hash
  buffers the checkpoint does hold are loaded, then compared with the file: a mismatch raises,
  naming the file.

Without a table directory nothing here runs: vLLM allocates and loads as before.

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .. import _switches
from ..tables.checkpoint import WEIGHT_NAME, shard_name
from ..tables.file_format import (
    NVFP4,
    TableFileError,
    TableFileHeader,
    expected_header,
    format_name,
    layout_checksum,
    table_path,
)
from ..tables.readers import map_row_range
from ..tables.shared import SHM_DIR, SharedTable, memory_available, open_shared_table

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "LayerTable",
    "configured_table_dir",
    "layer_table",
    "node_shared_table",
]

# vLLM's --additional-config key (VllmConfig.additional_config, a dict).
ADDITIONAL_CONFIG_KEY = "qwen4exp_table_dir"
# The attribute of a vLLM n-gram embedding (Qwen4ExpNGramEmbedding) served from a table file.
TABLE_ATTR = "_qwen4exp_table_file"
# What an NVFP4 table's row shards and the loader's names call the table's parameters.
_ROWS_LOADED = ("ngram_embedding.weight",)
_NVFP4_ROWS_LOADED = ("ngram_embedding.weight", "ngram_embedding.weight_scale")
_NVFP4_METHOD = "Qwen4ExpPLENvFp4EmbeddingMethod"
_PINNED_EMBEDDING = "Qwen4ExpPLEPinnedHostEmbedding"

logger = logging.getLogger("vllm.qwen4exp_ext")

# The layer table being built on this thread (set around a Qwen4ExpNGramEmbedding.__init__).
_building = threading.local()


def configured_table_dir(vllm_config: Any) -> Path | None:
    """The table directory of a vLLM model: ``additional_config["qwen4exp_table_dir"]`` where
    given (ValueError if it names no directory: it is this model's explicit setting), else
    ``$QWEN4EXP_VLLM_TABLE_DIR`` (unset or empty: None; a bad value: one warning and None, as for
    every variable of the plugin)."""
    additional = getattr(vllm_config, "additional_config", None)
    value = additional.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional, dict) else None
    if value is not None and value != "":
        if not isinstance(value, (str, os.PathLike)) or not os.path.isdir(value):
            raise ValueError(
                f"vLLM's additional_config {ADDITIONAL_CONFIG_KEY!r} must name an existing "
                f"directory of packed PLE table files (qwen4exp-table pack-model), got {value!r}"
            )
        return Path(value)
    return _switches.env_directory_or_warn(_switches.VLLM_TABLE_DIR_ENV, logger)


def _current_vllm_config() -> Any:
    return importlib.import_module("vllm.config").get_current_vllm_config()


class LayerTable:
    """One PLE layer's table file as one rank maps it: its header, this rank's rows
    (``rows``, uint8 [count, row_bytes] over the mapping, from global row ``start``) and the
    checkpoint names the loader skipped (``skipped``)."""

    def __init__(self, path: Path, config: Any, layer_index: int) -> None:
        self.path = path
        self.config = config
        self.layer_index = layer_index
        self.header: TableFileHeader | None = None
        self.rows: torch.Tensor | None = None
        self.start = 0
        self.count = 0
        self.copied = False  # a device table on a GPU: the rows were copied from the mapping
        self.device_view: torch.Tensor | None = None  # a pinned table's registration
        self.shared: SharedTable | None = None  # a pinned table's node copy (tables/shared.py)
        self.skipped: list[str] = []

    def __repr__(self) -> str:
        return f"LayerTable({str(self.path)!r}, rows [{self.start}, {self.start + self.count}))"

    # --- construction ---------------------------------------------------------------------------

    def allocate(self, layer: Any, num_embeddings: int, width: int, dtype: torch.dtype):
        """The tensor vLLM's ``allocate_embedding_weight(num_embeddings, width, dtype)`` asks
        for, over this rank's rows of the file (mapped on the first call; NVFP4's second call,
        its block scales, is a view of the same rows)."""
        nvfp4 = type(layer.quant_method).__name__ == _NVFP4_METHOD
        pinned = type(layer).__name__ == _PINNED_EMBEDDING
        if self.rows is None:
            fmt = NVFP4 if nvfp4 else format_name(dtype)
            expected = expected_header(self.config, self.layer_index, fmt)
            start = int(layer.shard_indices.org_vocab_start_index)
            self.start, self.count = start, num_embeddings
            if pinned and torch.cuda.is_available():  # the node's one registered copy
                self.shared = node_shared_table(self.path, expected, start, num_embeddings)
            if self.shared is not None:
                self.header = self.shared.header
                self._register_shared()
            else:
                self.header, self.rows = map_row_range(
                    self.path, expected, start, num_embeddings, private=pinned
                )
                if pinned:
                    self._register()
        header = self.header
        assert header is not None
        if nvfp4 and dtype == torch.float8_e4m3fn:
            view = header.block_scale_view(self.rows)
        else:
            view = header.value_view(self.rows)
        if tuple(view.shape) != (num_embeddings, width) or view.dtype != dtype:
            raise TableFileError(
                f"{self.path}: vLLM asks for a {num_embeddings} x {width} {dtype} table, the "
                f"file's rows give {tuple(view.shape)} {view.dtype}"
            )
        device = torch.get_default_device()
        if not pinned and device.type != "cpu":  # a device table: one copy, from the mapping
            self.copied = True
            return view.to(device)
        return view

    def _register_shared(self) -> None:
        """A pinned table's rows: this rank's slice of the node's shared mapping, registered
        once for the zero-copy lookup (``SharedTable.registered_rows``). vLLM takes the UVA view
        of ``weight`` in its ``__init__``, so the weight must be this CPU view of the registered
        mapping from the start (a later swap would leave vLLM's view on other memory)."""
        from ..tables import host_memory

        try:
            every_row = self.shared.registered_rows()
            self.rows = every_row[self.start : self.start + self.count]
            self.device_view = host_memory.device_view(self.rows)
        except Exception as error:
            self.rows = self.device_view = None
            self.shared.close()  # this rank's use of the node copy: the last one removes it
            self.shared = None
            raise TableFileError(
                f"{self.path}: cannot register the node's shared copy of the table "
                f"for the GPU's zero-copy lookup ({type(error).__name__}: {error})"
            ) from None

    def _register(self) -> None:
        """Registers the (private) mapping for the GPU's zero-copy lookup, as vLLM's pinned
        allocation is (its UVA view needs registered host memory)."""
        from ..tables import host_memory

        if not torch.cuda.is_available():
            return  # vLLM's pinned table itself refuses a machine without UVA
        try:
            self.device_view = host_memory.device_view(self.rows)
        except Exception as error:
            raise TableFileError(
                f"{self.path}: cannot register the mapped table rows for the GPU's zero-copy "
                f"lookup ({type(error).__name__}: {error})"
            ) from None

    def finish(self, module: Any) -> None:
        """After vLLM's n-gram embedding ``module`` was built: its hash buffers checked against
        the file, the global scale set from the file, and the table attached to ``module``."""
        if self.rows is None:
            raise TableFileError(
                f"{self.path}: vLLM's {type(module.ngram_embedding).__name__} allocates no table "
                "(vLLM's engram disk_offload reads the checkpoint itself), so a PLE table "
                f"directory ({ADDITIONAL_CONFIG_KEY}, {_switches.VLLM_TABLE_DIR_ENV}) cannot serve "
                "it: turn one of the two off"
            )
        self._check_layout(module)
        name = self._scale_name()
        if name is not None:
            with torch.no_grad():
                getattr(module.ngram_embedding, name).fill_(self.header.scale)
        if self.copied:  # the table is on the device: the mapping goes (header kept)
            self.rows = None
        setattr(module, TABLE_ATTR, self)

    def _scale_name(self) -> str | None:
        """The embedding's parameter that holds the file header's ``scale``."""
        fmt = self.header.format
        return "weight_scale_2" if fmt == NVFP4 else ("weight_scale" if "float8" in fmt else None)

    def _check_layout(self, module: Any) -> None:
        h = self.header
        checksum = layout_checksum(
            h.format,
            h.num_rows,
            h.head_dim,
            h.row_bytes,
            h.layer_index,
            module.layer_multipliers.tolist(),
            module.ngram_heads_vocab_sizes.tolist(),
            module.ngram_heads_offsets.tolist(),
        )
        if checksum != h.layout_checksum:
            raise TableFileError(
                f"{self.path}: the table file's layout checksum differs from the model's hash "
                "buffers (layer_multipliers, ngram_heads_vocab_sizes, ngram_heads_offsets): "
                "packed for another checkpoint or config"
            )

    # --- loading --------------------------------------------------------------------------------

    def is_row_shard(self, name: str) -> bool:
        """Whether the checkpoint name (relative to the n-gram embedding) holds table rows,
        which the file serves."""
        if name == WEIGHT_NAME:
            return True
        parsed = shard_name(name)
        if parsed is None:
            return False
        return parsed[1] == "weight" or (parsed[1] == "weight_scale" and self._nvfp4())

    def _nvfp4(self) -> bool:
        return self.header is not None and self.header.format == NVFP4

    def without_row_shards(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if self.is_row_shard(name):
                self.skipped.append(name)  # never touched: its bytes are not read
                continue
            yield name, tensor

    def loaded_names(self) -> set[str]:
        return set(_NVFP4_ROWS_LOADED if self._nvfp4() else _ROWS_LOADED)

    def check_loaded(self, module: Any) -> None:
        """After the checkpoint's load: its hash buffers and scale equal the file's."""
        self._check_layout(module)
        name = self._scale_name()
        if name is None:
            return
        value = getattr(module.ngram_embedding, name).detach().to("cpu", torch.float32)
        expected = torch.full_like(value, self.header.scale)
        if not torch.equal(value, expected):
            raise TableFileError(
                f"{self.path}: the checkpoint's {name} is {value.flatten().tolist()}, the table "
                f"file's scale is {self.header.scale}: the file was packed from another checkpoint"
            )


def node_shared_table(
    path: Path,
    expected: TableFileHeader,
    start: int,
    count: int,
    *,
    shm_dir: str | os.PathLike = SHM_DIR,
) -> SharedTable | None:
    """Where a pinned vLLM table on a GPU maps its rows from: the node's one copy of the whole
    file (:func:`~qwen4exp_ext.tables.shared.open_shared_table`: mapped where it is on tmpfs,
    staged into ``shm_dir`` once per node under a lock, or through the page cache), shared by
    every rank of the node, each registering it and taking its rows ``[start, start + count)``.

    Where ``shared.py`` decides the table is larger than the memory available
    (``"staged_lookup"``), None: vLLM's pinned embedding has no CPU-staged lookup (it reads its
    rows zero-copy, from registered host memory, and nothing else), so this rank falls back to
    a private mapping of its own rows (one copy per process, of its shard only), logged; a
    shard larger than the memory available raises, naming the file."""
    table = open_shared_table(path, expected, shm_dir=shm_dir)
    if isinstance(table, SharedTable):
        return table
    table.close()  # the "direct" FileTable of the CPU-staged lookups: not for vLLM
    shard_bytes = count * expected.row_bytes
    available = memory_available()
    if shard_bytes > available:
        raise TableFileError(
            f"{path}: the table file is larger than this node's memory available and this "
            f"rank's rows [{start}, {start + count}) ({shard_bytes} bytes) are larger than the "
            f"{available} bytes available too; vLLM's pinned PLE embedding reads registered host "
            "memory only (no CPU-staged lookup): use more ranks (a smaller shard each), more "
            "memory, or qwen4exp_ext's NGramEmbedding(placement='file', table_reader='direct')"
        )
    logger.warning(
        "qwen4exp_ext vLLM plugin: %s is larger than the memory available, so it is not "
        "shared; this rank maps and registers its own rows [%d, %d) (%d bytes, a private copy)",
        path,
        start,
        start + count,
        shard_bytes,
    )
    return None


def layer_table(module: Any) -> LayerTable | None:
    """The table file serving vLLM's n-gram embedding ``module``, or None."""
    return getattr(module, TABLE_ATTR, None)


# --- the shims ------------------------------------------------------------------------------------


def make_ngram_init(original: Callable[..., None]) -> Callable[..., None]:
    """``Qwen4ExpNGramEmbedding.__init__`` (NVIDIA and AMD): with a table directory, the layer's
    table comes from ``ple<L>.q4xt`` (L = ``ple_dense_layer_id``); without, vLLM's as before."""
    signature = inspect.signature(original)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        directory = configured_table_dir(_current_vllm_config())
        if directory is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        layer_index = int(bound.arguments["ple_dense_layer_id"])
        table = LayerTable(
            table_path(directory, layer_index), bound.arguments["config"], layer_index
        )
        outer = getattr(_building, "table", None)
        _building.table = table
        try:
            original(self, *args, **kwargs)
        finally:
            _building.table = outer
        table.finish(self)
        logger.info(
            "qwen4exp_ext vLLM plugin: PLE layer %d's table rows [%d, %d) are mapped from %s",
            layer_index,
            table.start,
            table.start + table.count,
            table.path,
        )

    return __init__


def allocate_from_file(
    embedding: Any, num_embeddings: int, embedding_dim: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """The table of a vLLM PLE embedding being built under a table directory (its rows of the
    file), or None where there is none (vLLM, or the plugin's pinned allocation, allocates)."""
    table = getattr(_building, "table", None)
    if table is None:
        return None
    return table.allocate(embedding, num_embeddings, embedding_dim, dtype)


def wrap_load_weights(original: Callable[..., set[str]]) -> Callable[..., set[str]]:
    """``Qwen4ExpNGramEmbedding.load_weights`` (NVIDIA and AMD): a layer served from a table file
    skips the checkpoint's row shards, reports its rows loaded, and checks the scales and hash
    buffers it loaded against the file."""

    def load_weights(self: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        table = layer_table(self)
        if table is None:
            return original(self, weights)
        loaded = set(original(self, table.without_row_shards(weights)))
        table.check_loaded(self)
        return loaded | table.loaded_names()

    return load_weights


def is_row_shard_of_file_table(model: Any, name: str) -> bool:
    """vLLM's skip hook (``is_unused_checkpoint_weight``) for a Qwen4Exp model: whether the
    checkpoint tensor ``name`` is a PLE table's rows that a table file serves. Every PLE layer of
    a model built with a table directory has its file (construction fails otherwise), so any
    row-shard name is unused once one layer is served from a file."""
    marker = ".ngram_embedding."
    cut = name.rfind(marker)
    if cut < 0:
        return False
    tables = _model_tables(model)
    if not tables:
        return False
    return tables[0].is_row_shard(name[cut + 1 :])


def _model_tables(model: Any) -> list[LayerTable]:
    cached = model.__dict__.get("_qwen4exp_tables")
    if cached is None:
        cached = [t for m in model.modules() if (t := layer_table(m)) is not None]
        model.__dict__["_qwen4exp_tables"] = cached
    return cached


def make_is_unused_checkpoint_weight(original: Callable[..., bool] | None) -> Callable[..., bool]:
    """``Qwen4ExpForCausalLM.is_unused_checkpoint_weight``: the PLE row shards a table file
    serves, and whatever vLLM's own rule (if any) says."""

    def is_unused_checkpoint_weight(self: Any, name: str) -> bool:
        if is_row_shard_of_file_table(self, name):
            return True
        return bool(original(self, name)) if original is not None else False

    return is_unused_checkpoint_weight
