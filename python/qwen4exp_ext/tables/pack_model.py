"""Packs every dense PLE layer of a checkpoint directory into a table directory, and verifies
one: ``qwen4exp-table pack-model`` and ``verify-model`` (:mod:`qwen4exp_ext.tables.cli`).

The checkpoint directory is a HF model directory: its ``config.json`` (a Qwen4Exp config, or its
``text_config``) and its ``*.safetensors``. The PLE layers are the config's ``ple_layer_ids``
(one-indexed decoder layer ids, as transformers 5.18 and vLLM read them): dense PLE layer L is
the L-th of them in ascending order, and its table goes to ``ple<L>.q4xt``
(:func:`~qwen4exp_ext.tables.file_format.table_path`). Each layer is packed by
:func:`~qwen4exp_ext.tables.pack.pack_table` and checked by
:func:`~qwen4exp_ext.tables.pack.verify_table`: this module only walks the layers.

A layer's checkpoint names are found under a prefix template, ``{layer}`` standing for the
decoder layer's zero-based index as checkpoint names spell it: by default the first of
PREFIX_TEMPLATES under which the checkpoint holds the first PLE layer's table.

Packing resumes: a layer whose file is there and verifies is skipped; one that does not verify
is repacked (atomically: the old file stays until the new one is complete). Temporary files
that a killed run left are removed. Every layer is checked against the checkpoint (headers and
small tensors only) before the first file is written.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen4exp_ext import layout
from qwen4exp_ext.tables.file_format import (
    TableFileError,
    TableFileHeader,
    TableFileNotFoundError,
    leftover_temporaries,
    read_header,
    table_path,
)
from qwen4exp_ext.tables.pack import (
    CHECKPOINT_GLOB,
    NoTableRowsError,
    check_output,
    checkpoint_files,
    load_config,
    pack_table,
    plan_table,
    verify_table,
)

__all__ = [
    "CONFIG_NAME",
    "PREFIX_TEMPLATES",
    "LayerResult",
    "PLELayerId",
    "pack_model",
    "ple_layers",
    "verify_model",
]

CONFIG_NAME = "config.json"
# Where a PLE layer's embedding sits in a Qwen4Exp checkpoint: Qwen4ExpForConditionalGeneration's
# names, then Qwen4ExpForCausalLM's (transformers 5.18; vLLM maps the first onto the second).
PREFIX_TEMPLATES = (
    "model.language_model.layers.{layer}.ple.ple_embedding.",
    "model.layers.{layer}.ple.ple_embedding.",
)
_PLACEHOLDER = "{layer}"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PLELayerId:
    """A dense PLE layer: its index L (the table's layer) and its decoder layer (zero-based)."""

    index: int
    decoder_layer: int

    def __str__(self) -> str:
        return f"PLE layer {self.index} (decoder layer {self.decoder_layer})"


@dataclass(frozen=True)
class LayerResult:
    """What pack_model or verify_model did with one layer."""

    layer: PLELayerId
    path: Path
    action: str  # "packed", "repacked", "skipped" (pack_model) or "verified" (verify_model)
    header: TableFileHeader
    seconds: float
    reason: str = ""  # why a file was repacked

    def line(self) -> str:
        """The layer's progress line."""
        what = self.action
        if self.action == "skipped":
            what = "skipped (its file verifies)"
        elif self.action == "repacked":
            what = f"repacked (its file did not verify: {self.reason})"
        return (
            f"{self.layer}: {what}, {self.header.num_rows} rows, {self.header.file_bytes} "
            f"bytes, {self.seconds:.2f} s: {self.path}"
        )


def ple_layers(config: Any, where: str | os.PathLike = CONFIG_NAME) -> list[PLELayerId]:
    """The dense PLE layers of a Qwen4Exp text config, in order: ``ple_layer_ids`` deduplicated
    and sorted as transformers does, each a one-indexed decoder layer id (at most
    ``num_hidden_layers`` when the config says it). ``where`` names the config in errors."""
    ids = getattr(config, "ple_layer_ids", None)
    if ids is None or ids == []:
        raise TableFileError(f"{where}: the config has no PLE layers (ple_layer_ids is empty)")
    if not isinstance(ids, list):
        raise TableFileError(f"{where}: ple_layer_ids must be a list of integers, got {ids!r}")
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or i < 1]
    if bad:
        raise TableFileError(
            f"{where}: ple_layer_ids must hold one-indexed decoder layer ids (integers >= 1), "
            f"got {bad[0]!r}"
        )
    count = getattr(config, "num_hidden_layers", None)
    if isinstance(count, int) and not isinstance(count, bool):
        beyond = [i for i in ids if i > count]
        if beyond:
            raise TableFileError(
                f"{where}: ple_layer_ids {beyond[0]} is past num_hidden_layers = {count}"
            )
    ids = sorted(set(ids))
    if len(ids) > layout.MAX_LAYER_INDEX + 1:
        raise TableFileError(
            f"{where}: {len(ids)} PLE layers, at most {layout.MAX_LAYER_INDEX + 1} have tables"
        )
    return [PLELayerId(index, decoder - 1) for index, decoder in enumerate(ids)]


@dataclass(frozen=True)
class _Model:
    """A checked checkpoint directory: its config, files and layers, and each layer's prefix."""

    directory: Path
    config: Any
    files: list[str]
    layers: list[PLELayerId]
    template: str

    def prefix(self, layer: PLELayerId) -> str:
        return self.template.replace(_PLACEHOLDER, str(layer.decoder_layer))


def _directory(path: str | os.PathLike, what: str) -> Path:
    """``path`` if it is a directory (followed through links); raises naming ``what``."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise TableFileNotFoundError(f"{path}: no such {what}") from None
    except OSError as error:
        raise TableFileError(f"{path}: cannot read the {what}: {error.strerror}") from None
    if not stat.S_ISDIR(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a file"
        if not stat.S_ISREG(mode) and not stat.S_ISFIFO(mode):
            kind = "a special file"
        raise TableFileError(f"{path}: the {what} is {kind}, not a directory")
    return path


def _model(checkpoint_dir: str | os.PathLike, prefix: str | None) -> _Model:
    directory = _directory(checkpoint_dir, "checkpoint directory")
    config_path = directory / CONFIG_NAME
    config = load_config(config_path)
    layers = ple_layers(config, config_path)
    files = checkpoint_files([directory])
    if prefix is not None:
        if _PLACEHOLDER not in prefix:
            raise TableFileError(
                f"--prefix {prefix!r} has no {_PLACEHOLDER} (the decoder layer's index in the "
                "checkpoint names, e.g. model.layers.{layer}.ple.ple_embedding.)"
            )
        return _Model(directory, config, files, layers, prefix)
    first = layers[0]
    for template in PREFIX_TEMPLATES:
        probe = template.replace(_PLACEHOLDER, str(first.decoder_layer))
        try:
            plan_table(files, config, first.index, None, probe)
        except NoTableRowsError:
            continue  # any other error: the table is under this prefix, but wrong; say how
        return _Model(directory, config, files, layers, template)
    names = " or ".join(t.replace(_PLACEHOLDER, str(first.decoder_layer)) for t in PREFIX_TEMPLATES)
    raise TableFileError(
        f"{directory}: no table of {first} under {names}: give its names' prefix with --prefix "
        f"(with {_PLACEHOLDER} for the decoder layer)"
    )


def _check_table_dir(model: _Model, out_dir: Path) -> bool:
    """Refuses an output directory that is not one, or whose name the checkpoint directory's
    scan would read, and any layer's file that pack_table would refuse; True if it exists."""
    try:
        _directory(out_dir, "output directory")
    except TableFileNotFoundError:
        parent = out_dir.parent
        if not parent.is_dir():
            raise TableFileError(
                f"{out_dir}: the output directory's parent {parent} does not exist"
            ) from None
        exists = False
    else:
        exists = True
    parent = out_dir.parent
    with contextlib.suppress(OSError):
        if fnmatch.fnmatchcase(out_dir.name, CHECKPOINT_GLOB) and os.path.samefile(
            parent, model.directory
        ):
            raise TableFileError(
                f"{out_dir}: the output directory is inside the checkpoint directory "
                f"{model.directory}, named like its files ({CHECKPOINT_GLOB}): its scan would "
                "read it; write the tables elsewhere"
            )
    if exists:
        inputs = [model.directory, *(Path(f) for f in model.files)]
        for layer in model.layers:
            check_output(table_path(out_dir, layer.index), inputs)
    return exists


def pack_model(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: Any | None = None,
    prefix: str | None = None,
    progress: Progress | None = None,
) -> list[LayerResult]:
    """Packs every dense PLE layer of the checkpoint directory into ``out_dir/ple<L>.q4xt``
    (creating ``out_dir``, not its parents), skipping a layer whose file is there and verifies
    and repacking one that does not. Every layer is checked before the first file is written;
    ``progress`` gets one line per layer (and one per leftover temporary removed)."""
    model = _model(checkpoint_dir, prefix)
    out_dir = Path(out_dir)
    headers = [
        plan_table(model.files, model.config, layer.index, dtype, model.prefix(layer))
        for layer in model.layers
    ]
    if not _check_table_dir(model, out_dir):
        out_dir.mkdir()
    report = progress or (lambda line: None)
    results = []
    for layer, header in zip(model.layers, headers, strict=True):
        start = time.monotonic()
        path = table_path(out_dir, layer.index)
        for leftover in leftover_temporaries(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
                report(f"{layer}: removed {leftover}, left by a killed run")
        action, reason = "packed", ""
        if os.path.lexists(path):
            try:
                verify_table(path, model.files, model.config, layer.index, model.prefix(layer))
                action = "skipped"
            except TableFileError as error:
                action, reason = "repacked", " ".join(str(error).split())
        if action != "skipped":
            header = pack_table(
                model.files, path, model.config, layer.index, dtype, model.prefix(layer)
            )
        result = LayerResult(layer, path, action, header, time.monotonic() - start, reason)
        report(result.line())
        results.append(result)
    return results


def verify_model(
    checkpoint_dir: str | os.PathLike,
    table_dir: str | os.PathLike,
    prefix: str | None = None,
    progress: Progress | None = None,
) -> list[LayerResult]:
    """Verifies every dense PLE layer's file of ``table_dir`` against the checkpoint directory
    (:func:`~qwen4exp_ext.tables.pack.verify_table`), in layer order: raises TableFileError
    naming the first layer whose file is missing or differs."""
    model = _model(checkpoint_dir, prefix)
    table_dir = _directory(table_dir, "table directory")
    report = progress or (lambda line: None)
    results = []
    for layer in model.layers:
        start = time.monotonic()
        path = table_path(table_dir, layer.index)
        try:
            verify_table(path, model.files, model.config, layer.index, model.prefix(layer))
            header = read_header(path)
        except TableFileError as error:
            raise TableFileError(f"{layer}: {error}") from None
        result = LayerResult(layer, path, "verified", header, time.monotonic() - start)
        report(result.line())
        results.append(result)
    return results
