"""Packs a PLE layer's table from a safetensors checkpoint into a table file
(:mod:`qwen4exp_ext.tables.file_format`) and verifies a file against its checkpoint: the work of
the ``qwen4exp-table`` command (:mod:`qwen4exp_ext.tables.cli`).

The checkpoint: .safetensors files, or directories holding them. The checkpoint names are
NGramEmbedding's (SPEC §4 "Checkpoints"; :mod:`.checkpoint`), after ``prefix``:
``ngram_embedding.shard_<i>.weight`` shards (or an unsharded ``ngram_embedding.weight``), fp8's
``ngram_embedding.weight_scale``, NVFP4's ``shard_<i>.weight_scale`` block scales and
``weight_scale_2`` global scale. Both commands stream the table one checkpoint shard at a time, in
chunks of CHUNK_BYTES: a 95 GB table is never in memory.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from qwen4exp_ext.reference import NVFP4_BLOCK
from qwen4exp_ext.tables.checkpoint import (
    BUFFER_NAMES,
    GLOBAL_SCALE_NAME,
    SCALE_NAME,
    SHARD_PREFIX,
    WEIGHT_NAME,
    checkpoint_shard_rows,
    safetensors_dtype,
    shard_name,
)
from qwen4exp_ext.tables.file_format import (
    FP8_FORMATS,
    NVFP4,
    TableFileError,
    TableFileHeader,
    check_header,
    expected_header,
    format_name,
    hash_layout,
    open_regular,
    read_header_at,
    write_table_file,
)

__all__ = [
    "CHUNK_BYTES",
    "NoTableRowsError",
    "check_output",
    "load_config",
    "pack_table",
    "plan_table",
    "verify_table",
]

# Rows are read, written and compared this many bytes at a time (at least one row).
CHUNK_BYTES = 64 << 20
_PLE_TABLE_PREFIX = "ngram_embedding."
# The config fields a table's layout depends on (seed and split_ngram_parts have defaults).
CONFIG_FIELDS = (
    "vocab_size",
    "ngram_size",
    "heads_per_ngram",
    "ple_embed_dim",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
)
_INT64_MAX = 2**63 - 1
# Each integer field's range [lo, hi] (SPEC §1-§3; the rest: what an int64 kernel argument or
# the exact prime test, below 2^64, takes). seed and split_ngram_parts are optional.
_CONFIG_RANGES = {
    "vocab_size": (1, _INT64_MAX),
    "ngram_size": (2, 8),
    "heads_per_ngram": (1, 1024),
    "ple_embed_dim": (1, _INT64_MAX),
    "ngram_vocab_size_base": (2, 2**48),
    "make_ngram_vocab_size_divisible_by": (1, 2**32),
    "seed": (-(2**63), _INT64_MAX),
    "split_ngram_parts": (1, 2**32),
}
_MAX_HEADS = 1024  # NH = (N - 1) * heads_per_ngram (SPEC §3)
_CONFIG_MAX_BYTES = 64 << 20  # a config.json is a few KiB; anything far larger is not one
# The checkpoint files a directory given as a checkpoint holds.
CHECKPOINT_GLOB = "*.safetensors"


class NoTableRowsError(TableFileError):
    """The checkpoint holds no PLE table rows under the prefix (pack-model tries prefixes)."""


@dataclass(frozen=True)
class _Tensor:
    """A checkpoint tensor, by its header: file, key, shape, dtype."""

    path: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def where(self) -> str:
        return f"{self.path}: {self.key}"


@dataclass
class _Checkpoint:
    """The PLE table's tensors found in the checkpoint files (names after the prefix)."""

    files: list[str]
    prefix: str
    shards: dict[int, dict[str, _Tensor]] = field(default_factory=dict)
    named: dict[str, _Tensor] = field(default_factory=dict)  # unsharded names and buffers

    def where(self) -> str:
        """The checkpoint, for an error message."""
        first = self.files[0] if self.files else "<no files>"
        more = f" (+{len(self.files) - 1} more files)" if len(self.files) > 1 else ""
        return f"{first}{more}"


@dataclass(frozen=True)
class _Piece:
    """A run of table rows from one checkpoint tensor (and its NVFP4 block scales)."""

    start: int
    count: int
    rows: _Tensor
    block_scales: _Tensor | None
    label: str  # "shard 3" or the unsharded weight's name


@dataclass(frozen=True)
class _Plan:
    header: TableFileHeader  # with the checkpoint's scale
    pieces: list[_Piece]


# --- reading the checkpoint -------------------------------------------------------------------


def checkpoint_files(paths: Iterable[str | os.PathLike]) -> list[str]:
    """The .safetensors files of ``paths`` (files, or directories holding them, sorted)."""
    files: list[str] = []
    for path in paths:
        path = Path(path)
        if path.is_dir():
            found = sorted(str(p) for p in path.glob(CHECKPOINT_GLOB))
            if not found:
                raise TableFileError(f"{path}: no .safetensors files in the directory")
            files.extend(found)
        elif path.exists() or path.is_symlink():
            files.append(str(path))
        else:
            raise TableFileError(f"{path}: no such checkpoint file or directory")
    if not files:
        raise TableFileError("no checkpoint files given")
    for file in files:  # a FIFO would block safetensors' open forever, /dev/zero never end
        os.close(open_regular(file, "the checkpoint file"))
    return files


def _scan(paths: Iterable[str | os.PathLike], prefix: str) -> _Checkpoint:
    """The PLE table tensors of the checkpoint (their headers only), each found once."""
    from safetensors import safe_open

    found = _Checkpoint(checkpoint_files(paths), prefix)
    seen: dict[str, _Tensor] = {}
    for path in found.files:
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as error:  # safetensors raises its own error types
            raise TableFileError(f"{path}: not a readable safetensors file ({error})") from None
        with handle as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if not key.startswith(prefix):
                    continue
                name = key[len(prefix) :]
                if not (name.startswith(_PLE_TABLE_PREFIX) or name in BUFFER_NAMES):
                    continue  # another module's tensor
                leaf = name.rsplit(".", 1)[-1]
                if leaf.startswith("hashstats_") or leaf == "token_lookup":
                    continue
                piece = f.get_slice(key)
                tensor = _Tensor(
                    path, key, tuple(piece.get_shape()), safetensors_dtype(piece.get_dtype(), key)
                )
                if name in seen:
                    raise TableFileError(
                        f"{path}: {key} is in the checkpoint twice (also in {seen[name].path})"
                    )
                seen[name] = tensor
                shard = shard_name(name)
                if shard is not None:
                    found.shards.setdefault(shard[0], {})[shard[1]] = tensor
                elif name in (WEIGHT_NAME, SCALE_NAME, GLOBAL_SCALE_NAME, *BUFFER_NAMES):
                    found.named[name] = tensor
                else:
                    raise TableFileError(f"{path}: unexpected PLE table tensor {key!r}")
    return found


def _read_small(tensor: _Tensor) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(tensor.path, framework="pt", device="cpu") as f:
        return f.get_tensor(tensor.key)


def _one_float(tensor: _Tensor, what: str) -> float:
    """The value of a one-element float scale, as fp32 (what NGramEmbedding keeps)."""
    if math.prod(tensor.shape) != 1 or not tensor.dtype.is_floating_point:
        raise TableFileError(
            f"{tensor.where()}: {what} must be one float element, got {tensor.dtype} {tensor.shape}"
        )
    value = float(_read_small(tensor).reshape(1).to(torch.float32).item())
    if not math.isfinite(value):
        raise TableFileError(f"{tensor.where()}: {what} is {value}, not a finite scale")
    return value


def _plan(checkpoint: _Checkpoint, config: Any, layer_index: int, dtype: Any | None) -> _Plan:
    """Checks the checkpoint's table against the config (every row present once, shapes,
    dtypes, scales, hash buffers) and says where each run of rows comes from."""
    where = checkpoint.where()
    rows = [t.get("weight") for t in checkpoint.shards.values() if "weight" in t]
    whole = checkpoint.named.get(WEIGHT_NAME)
    if whole is not None:
        if checkpoint.shards:
            raise TableFileError(
                f"{whole.where()}: the checkpoint has both an unsharded {WEIGHT_NAME} and "
                f"{SHARD_PREFIX}<i> shards"
            )
        rows = [whole]
    if not rows:
        raise NoTableRowsError(
            f"{where}: no PLE table rows ({SHARD_PREFIX}<i>.weight or {WEIGHT_NAME}) under "
            f"prefix {checkpoint.prefix!r}"
        )
    first = rows[0]
    for tensor in rows[1:]:
        if tensor.dtype != first.dtype:
            raise TableFileError(
                f"{tensor.where()}: rows are {tensor.dtype} but {first.key} holds {first.dtype} "
                "(dtype mismatch: a table has one dtype)"
            )
    try:
        found = NVFP4 if first.dtype == torch.uint8 else format_name(first.dtype)
    except ValueError:
        raise TableFileError(
            f"{first.where()}: rows of {first.dtype} are no PLE table format"
        ) from None
    fmt = found if dtype is None else format_name(dtype)
    if fmt != found:
        raise TableFileError(
            f"{first.where()}: dtype mismatch: the table was asked for as {fmt} but the "
            f"checkpoint's rows are {first.dtype} ({found}); the file holds the checkpoint's "
            "bytes, unconverted"
        )
    header = expected_header(config, layer_index, fmt)
    _check_buffers(checkpoint, config, layer_index)
    if whole is not None:
        pieces = [_whole_piece(whole, header)]
    else:
        parts = int(getattr(config, "split_ngram_parts", 512))
        pieces = _shard_pieces(checkpoint, header, parts)
    return _Plan(replace(header, scale=_scale(checkpoint, header)), pieces)


def _check_buffers(checkpoint: _Checkpoint, config: Any, layer_index: int) -> None:
    """Hash buffers in the checkpoint must be the config's layout: the file's layout checksum
    states it."""
    multipliers, sizes, offsets, _ = hash_layout(config, layer_index)
    computed = dict(zip(BUFFER_NAMES, (multipliers, sizes, offsets), strict=True))
    for name in BUFFER_NAMES:
        tensor = checkpoint.named.get(name)
        if tensor is None:
            continue
        values = _read_small(tensor).reshape(-1).tolist()
        if values != list(computed[name]):
            raise TableFileError(
                f"{tensor.where()}: the checkpoint's {name} {values} is not the config's layout "
                f"of PLE layer {layer_index} {list(computed[name])}; wrong --layer or config?"
            )


def _expect(tensor: _Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    if tensor.shape != shape:
        raise TableFileError(
            f"{tensor.where()}: shape mismatch for {what}: expected {shape}, got {tensor.shape}"
        )
    if tensor.dtype != dtype:
        raise TableFileError(
            f"{tensor.where()}: dtype mismatch for {what}: expected {dtype}, got {tensor.dtype}"
        )


def _whole_piece(whole: _Tensor, header: TableFileHeader) -> _Piece:
    if header.format == NVFP4:
        raise TableFileError(
            f"{whole.where()}: NVFP4 PLE tables must be stored as {SHARD_PREFIX}<i>.weight and "
            f"{SHARD_PREFIX}<i>.weight_scale shards, got unsharded {WEIGHT_NAME}"
        )
    shape = (header.num_rows, header.head_dim)
    _expect(whole, shape, header.torch_dtype(), "the unsharded table")
    return _Piece(0, header.num_rows, whole, None, WEIGHT_NAME)


def _shard_pieces(checkpoint: _Checkpoint, header: TableFileHeader, parts: int) -> list[_Piece]:
    nvfp4 = header.format == NVFP4
    for index, leaves in sorted(checkpoint.shards.items()):
        if index >= parts:
            some = next(iter(leaves.values()))
            raise TableFileError(
                f"{some.where()}: PLE table shard index {index} exceeds split_ngram_parts={parts}"
            )
        if not nvfp4 and set(leaves) - {"weight"}:
            extra = next(t for leaf, t in leaves.items() if leaf != "weight")
            raise TableFileError(
                f"{extra.where()}: holds NVFP4 scales, but the table is {header.format}"
            )
    pieces = []
    for index in range(parts):
        start, count = checkpoint_shard_rows(header.num_rows, parts, index)
        leaves = checkpoint.shards.get(index, {})
        if count == 0 and not leaves:
            continue
        what = f"shard {index} (rows [{start}, {start + count}))"
        for leaf in ("weight", "weight_scale") if nvfp4 else ("weight",):
            if leaf not in leaves:
                raise TableFileError(
                    f"{checkpoint.where()}: missing rows: {SHARD_PREFIX}{index}.{leaf} of "
                    f"{what} is not in the checkpoint"
                )
        if nvfp4:
            _expect(leaves["weight"], (count, header.head_dim // 2), torch.uint8, what)
            scales = leaves["weight_scale"]
            shape = (count, header.head_dim // NVFP4_BLOCK)
            _expect(scales, shape, torch.float8_e4m3fn, f"the block scales of {what}")
        else:
            _expect(leaves["weight"], (count, header.head_dim), header.torch_dtype(), what)
            scales = None
        pieces.append(_Piece(start, count, leaves["weight"], scales, f"shard {index}"))
    return pieces


def _scale(checkpoint: _Checkpoint, header: TableFileHeader) -> float | None:
    """The fp8 per-tensor scale or the NVFP4 global scale (every copy equal); None for a float
    table, which must have neither."""
    top_scale = checkpoint.named.get(SCALE_NAME)
    top_global = checkpoint.named.get(GLOBAL_SCALE_NAME)
    if header.format == NVFP4:
        if top_scale is not None:
            raise TableFileError(
                f"{top_scale.where()}: NVFP4 block scales come in shards "
                f"({SHARD_PREFIX}<i>.weight_scale), not unsharded"
            )
        copies = [top_global] if top_global is not None else []
        copies += [
            leaves["weight_scale_2"]
            for _, leaves in sorted(checkpoint.shards.items())
            if "weight_scale_2" in leaves
        ]
        if not copies:
            raise TableFileError(
                f"{checkpoint.where()}: the NVFP4 global scale ({GLOBAL_SCALE_NAME}, or per shard"
                f" {SHARD_PREFIX}<i>.weight_scale_2) is not in the checkpoint"
            )
        value = _one_float(copies[0], "the NVFP4 global scale")
        for other in copies[1:]:
            if _one_float(other, "the NVFP4 global scale") != value:
                raise TableFileError(
                    f"{other.where()}: NVFP4 global scales differ: {copies[0].key} = {value!r} "
                    f"but {other.key} = {_one_float(other, 'it')!r}; a table has one"
                )
        return value
    if top_global is not None:
        raise TableFileError(
            f"{top_global.where()}: an NVFP4 global scale, but the table is {header.format}"
        )
    if header.format in FP8_FORMATS:
        if top_scale is None:
            raise TableFileError(
                f"{checkpoint.where()}: the fp8 table's scale {SCALE_NAME} is not in the checkpoint"
            )
        return _one_float(top_scale, SCALE_NAME)
    if top_scale is not None:
        raise TableFileError(
            f"{top_scale.where()}: {SCALE_NAME} given, but the table is {header.format}, not fp8"
        )
    return None


def _row_chunks(plan: _Plan) -> Iterator[tuple[_Piece, int, torch.Tensor]]:
    """(piece, first global row, the rows' file bytes [n, row_bytes] uint8) in row order,
    CHUNK_BYTES at a time."""
    from safetensors import safe_open

    chunk_rows = max(1, CHUNK_BYTES // plan.header.row_bytes)
    for piece in plan.pieces:
        with contextlib.ExitStack() as stack:
            rows = stack.enter_context(safe_open(piece.rows.path, "pt", device="cpu"))
            rows = rows.get_slice(piece.rows.key)
            scales = None
            if piece.block_scales is not None:
                scales = stack.enter_context(
                    safe_open(piece.block_scales.path, "pt", device="cpu")
                ).get_slice(piece.block_scales.key)
            for lo in range(0, piece.count, chunk_rows):
                hi = min(piece.count, lo + chunk_rows)
                data = rows[lo:hi].contiguous().view(torch.uint8)
                if scales is not None:
                    block = scales[lo:hi].contiguous().view(torch.uint8)
                    data = torch.cat([data, block], dim=1)
                yield piece, piece.start + lo, data


# --- pack and verify --------------------------------------------------------------------------


def load_config(path: str | os.PathLike) -> SimpleNamespace:
    """A Qwen4Exp text config from a HF config.json (its "text_config" when it has one), each
    field the table's layout depends on checked: a JSON integer in its range."""
    fd = open_regular(path, "the config", "config file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(_CONFIG_MAX_BYTES + 1)
    if len(data) > _CONFIG_MAX_BYTES:
        raise TableFileError(f"{path}: the config is over {_CONFIG_MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TableFileError(f"{path}: the config is not UTF-8 ({error})") from None
    try:
        fields = json.loads(text)
    except RecursionError:
        raise TableFileError(f"{path}: the config is not JSON (nested too deeply)") from None
    except ValueError as error:
        raise TableFileError(f"{path}: the config is not JSON ({error})") from None
    if not isinstance(fields, dict):
        raise TableFileError(f"{path}: the config is not a JSON object")
    if "text_config" in fields:
        fields = fields["text_config"]
        if not isinstance(fields, dict):
            raise TableFileError(
                f"{path}: text_config must be a JSON object, got {_json_value(fields)}"
            )
    missing = [name for name in CONFIG_FIELDS if name not in fields]
    if missing:
        raise TableFileError(f"{path}: the config has no {', '.join(missing)}")
    for name, (lo, hi) in _CONFIG_RANGES.items():
        if name not in fields:
            continue
        value = fields[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise TableFileError(f"{path}: {name} must be an integer, got {_json_value(value)}")
        if not lo <= value <= hi:
            raise TableFileError(f"{path}: {name} must be in [{lo}, {hi}], got {value}")
    heads = (fields["ngram_size"] - 1) * fields["heads_per_ngram"]
    if heads > _MAX_HEADS:
        raise TableFileError(
            f"{path}: (ngram_size - 1) * heads_per_ngram = {heads} n-gram heads, at most "
            f"{_MAX_HEADS}"
        )
    if fields["ple_embed_dim"] % heads:
        raise TableFileError(
            f"{path}: ple_embed_dim must be divisible by the number of n-gram heads: "
            f"{fields['ple_embed_dim']} % {heads} != 0"
        )
    return SimpleNamespace(**fields)


def _json_value(value: Any) -> str:
    """A config value as its JSON spells it (null, true, "3"), cut to 40 characters."""
    try:
        text = json.dumps(value)
    except (RecursionError, ValueError):  # nested as deep as the parser let it be
        return f"a JSON {type(value).__name__}"
    return text if len(text) <= 40 else f"{text[:40]}..."


def _config(config: Any) -> Any:
    return load_config(config) if isinstance(config, (str, os.PathLike)) else config


def plan_table(
    checkpoint_files: Iterable[str | os.PathLike],
    config: Any,
    layer_index: int,
    dtype: Any | None = None,
    prefix: str = "",
) -> TableFileHeader:
    """The header :func:`pack_table` would write, after every check it makes of the checkpoint
    (headers and the small tensors only: no row is read), nothing written: lets a caller that
    packs several layers refuse a bad one before the first file is written."""
    return _plan(_scan(checkpoint_files, prefix), _config(config), layer_index, dtype).header


def pack_table(
    checkpoint_files: Iterable[str | os.PathLike],
    out_path: str | os.PathLike,
    config: Any,
    layer_index: int,
    dtype: Any | None = None,
    prefix: str = "",
) -> TableFileHeader:
    """Writes PLE layer ``layer_index``'s table from the safetensors checkpoint to the table
    file ``out_path`` and returns its header. ``dtype`` (default: the checkpoint's rows', uint8
    meaning NVFP4) must be the checkpoint's. Everything is checked before the first row is
    written; the rows are streamed to a temporary file beside ``out_path`` that replaces it only
    when complete (no partial file is ever left)."""
    out_path = Path(out_path)
    inputs = [Path(p) for p in checkpoint_files]
    check_output(out_path, inputs)
    checkpoint = _scan(inputs, prefix)
    check_output(out_path, [Path(p) for p in checkpoint.files])  # also each file found
    plan = _plan(checkpoint, _config(config), layer_index, dtype)
    header = plan.header
    directory = out_path.parent
    free = shutil.disk_usage(directory).free
    if free < header.file_bytes:
        raise TableFileError(
            f"{out_path}: the table file needs {header.file_bytes} bytes, {free} are free"
        )
    write_table_file(out_path, header, (data for _, _, data in _row_chunks(plan)))
    return header


def check_output(out_path: Path, inputs: list[Path]) -> None:
    """Refuses an output that would destroy or join its own input, before anything is read or
    written: one of the checkpoint files (the same path, or the same file through a hard or
    symbolic link), or a name in a checkpoint directory that the directory's scan reads
    (CHECKPOINT_GLOB), and anything at the output that is not a regular file."""
    directory = out_path.parent
    if not directory.is_dir():
        raise TableFileError(f"{out_path}: the directory {directory} does not exist")
    try:
        target = os.stat(out_path)
    except FileNotFoundError:
        target = None
    if target is not None and not stat.S_ISREG(target.st_mode):
        kind = "a directory" if stat.S_ISDIR(target.st_mode) else "a FIFO"
        if not stat.S_ISDIR(target.st_mode) and not stat.S_ISFIFO(target.st_mode):
            kind = "a special file"
        raise TableFileError(f"{out_path}: the output is {kind}, not a regular file")
    for given in inputs:
        with contextlib.suppress(OSError):  # an input that is not there: the scan says so
            if given.is_dir():
                if fnmatch.fnmatchcase(out_path.name, CHECKPOINT_GLOB) and os.path.samefile(
                    given, directory
                ):
                    if target is not None:
                        raise TableFileError(
                            f"{out_path}: the output is the checkpoint file {out_path} (in the "
                            f"checkpoint directory {given}): packing would replace it"
                        )
                    raise TableFileError(
                        f"{out_path}: the output is inside the checkpoint directory {given} "
                        f"whose scan reads {CHECKPOINT_GLOB}: write the table elsewhere"
                    )
            elif target is not None and os.path.samestat(target, os.stat(given)):
                raise TableFileError(
                    f"{out_path}: the output is the checkpoint file {given} (the same file): "
                    "packing would replace it"
                )


def verify_table(
    path: str | os.PathLike,
    checkpoint_files: Iterable[str | os.PathLike],
    config: Any,
    layer_index: int,
    prefix: str = "",
) -> dict[str, int]:
    """Checks the table file ``path`` against the checkpoint it was packed from: its header
    (read_header, then check_header against expected_header of the checkpoint's format), its
    scale, and every row byte for byte. Raises TableFileError naming the first difference;
    returns {"rows", "pieces", "bytes"} compared."""
    # The header and the rows through one descriptor: the file checked is the file compared.
    with os.fdopen(open_regular(path), "rb") as f:
        header = read_header_at(f.fileno(), path)
        plan = _plan(_scan(checkpoint_files, prefix), _config(config), layer_index, None)
        check_header(header, plan.header, path)
        if header.scale != plan.header.scale:
            raise TableFileError(
                f"{path}: the table file's scale {header.scale!r} differs from the checkpoint's "
                f"{plan.header.scale!r}"
            )
        compared = 0
        f.seek(header.data_offset)
        for piece, first_row, want in _row_chunks(plan):
            got = f.read(want.numel())
            if got != want.numpy().tobytes():
                _raise_first_difference(path, header, piece, first_row, want, got)
            compared += len(got)
    return {"rows": header.num_rows, "pieces": len(plan.pieces), "bytes": compared}


def _raise_first_difference(
    path: Any, header: TableFileHeader, piece: _Piece, first_row: int, want, got: bytes
) -> None:
    if len(got) != want.numel():  # read_header checked the size: the file changed since
        raise TableFileError(f"{path}: the table file ended early, at row {first_row} or after")
    got_rows = torch.frombuffer(bytearray(got), dtype=torch.uint8).view(want.shape)
    differs = (got_rows != want).any(dim=1).nonzero()
    row = int(differs[0, 0])
    column = int((got_rows[row] != want[row]).nonzero()[0, 0])
    part = ""
    if header.format == NVFP4:
        part = " (block scales)" if column >= header.code_bytes else " (codes)"
    source = piece.block_scales if part == " (block scales)" else piece.rows
    raise TableFileError(
        f"{path}: row {first_row + row} differs from the checkpoint's (byte {column} of the "
        f"row{part}; {piece.label}, {source.where()} row {first_row + row - piece.start})"
    )
