"""The on-disk PLE table file: one PLE layer's whole table ([R_pad, d]) served from disk.

Layout (all integers little-endian)::

    offset 0      MAGIC  b"Q4XPLETB"
    offset 8      u32    VERSION (1)
    offset 12     u32    n: bytes of the header JSON
    offset 16     32 B   sha256 of the header JSON (the header's own integrity check)
    offset 48     n B    the header JSON: canonical (sorted keys, no spaces, UTF-8) encoding of
                         TableFileHeader's fields
    48 + n ..     zero bytes up to HEADER_BYTES (4096)
    HEADER_BYTES  the rows: row i at data_offset + i * row_bytes, num_rows rows, nothing after

A row holds its storage bytes exactly as the checkpoint tensors hold them: d elements of the
format (fp32/bf16/fp16 bits, fp8 bytes), or for ``"nvfp4"`` the d/2 bytes of packed E2M1 codes
(element 2i in the low nibble) followed by the row's d/16 float8_e4m3fn block scales, so that one
read of a row gets both (SPEC §4). The fp8 per-tensor scale and the NVFP4 global scale are in
the header (``scale``). The data region starts 4096-aligned, so O_DIRECT reads of it are
aligned. ``layout_checksum`` binds the file to one layer's hash layout (multipliers, head sizes
and offsets, SPEC §2) and geometry: a table of another layer or config is refused by
:func:`check_header` even when its shape matches.

:func:`read_header` validates a file on its own (magic, version, checksum, field consistency,
size); :func:`check_header` against what a model expects (:func:`expected_header`). Packing
a checkpoint into a file and verifying it: :mod:`qwen4exp_ext.tables.pack` (``qwen4exp-table``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch

from qwen4exp_ext import layout
from qwen4exp_ext.reference import FP8_DTYPES, NVFP4_BLOCK

__all__ = [
    "FORMATS",
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "TableFileError",
    "TableFileNotFoundError",
    "TableFileHeader",
    "atomic_write",
    "check_header",
    "expected_header",
    "file_rows",
    "format_name",
    "hash_layout",
    "layout_checksum",
    "leftover_temporaries",
    "open_regular",
    "read_header",
    "read_header_at",
    "row_bytes_of",
    "table_dtype",
    "table_path",
    "write_header",
    "write_table_file",
]

MAGIC = b"Q4XPLETB"
VERSION = 1
HEADER_BYTES = 4096
FORMATS = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz", "nvfp4")
# The table format as vLLM's config field ``ple_embedding_dtype`` spells it.
NVFP4 = "nvfp4"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# What a table is stored as (NGramEmbedding's ``dtype``): a torch dtype, or NVFP4.
TableDtype = torch.dtype | Literal["nvfp4"]
FP8_FORMATS = tuple(str(dtype).removeprefix("torch.") for dtype in FP8_DTYPES)
# MAGIC, version, JSON length, sha256 of the JSON.
_PREFIX = struct.Struct("<8sII32s")
_JSON_MAX = HEADER_BYTES - _PREFIX.size
# The header is a flat object of scalars; JSON nested deeper than this is corruption. Checked
# before parsing: json.loads raises RecursionError only past the interpreter's recursion limit,
# which a host program (a test runner, a server) may have raised, so the outcome, and the
# message, would depend on who reads the file.
_JSON_MAX_DEPTH = 32
_FIELDS = (
    "format",
    "layer_index",
    "num_rows",
    "head_dim",
    "row_bytes",
    "data_offset",
    "scale",
    "layout_checksum",
)
# Every integer field and the file's size are int64 offsets for the readers (ops.read_file_rows).
_INT_LIMIT = 2**63
# A directory of table files (``qwen4exp-table pack-model``, vLLM's table directory) holds PLE
# layer L's table as this name.
TABLE_FILE_NAME = "ple{layer}.q4xt"


class TableFileError(ValueError):
    """A table file (or the checkpoint it is packed from) that cannot be used; the message
    names the file."""


class TableFileNotFoundError(TableFileError, FileNotFoundError):
    """The table file does not exist (a TableFileError and a FileNotFoundError)."""


@dataclass(frozen=True)
class TableFileHeader:
    """What a table file holds: one PLE layer's table, every row of it."""

    format: str  # one of FORMATS (a torch dtype's name, or "nvfp4")
    layer_index: int  # the dense PLE layer index L
    num_rows: int  # R_pad: all rows of the layer
    head_dim: int  # d: elements per row
    row_bytes: int  # d * itemsize; nvfp4: d/2 code bytes then d/16 block-scale bytes
    data_offset: int  # == HEADER_BYTES
    scale: float | None  # fp8: weight_scale; nvfp4: weight_scale_2; None for float tables
    layout_checksum: str  # layout_checksum(...)

    @property
    def file_bytes(self) -> int:
        """The file's exact size: the header region and every row."""
        return self.data_offset + self.num_rows * self.row_bytes

    @property
    def code_bytes(self) -> int:
        """Bytes of a row's values: d/2 for nvfp4 (its block scales follow), row_bytes
        otherwise."""
        return self.head_dim // 2 if self.format == NVFP4 else self.row_bytes

    @property
    def scale_bytes(self) -> int:
        """Bytes of a row's NVFP4 block scales (d/16), after its codes; 0 for other formats."""
        return self.row_bytes - self.code_bytes

    def torch_dtype(self) -> torch.dtype:
        """The storage dtype of the row values (uint8 for nvfp4's packed codes)."""
        return torch.uint8 if self.format == NVFP4 else getattr(torch, self.format)

    def value_view(self, raw: torch.Tensor) -> torch.Tensor:
        """The row values of rows in this layout (``raw``: uint8 [n, row_bytes], any device) as
        the gather reads them: [n, d] in the storage dtype, or the NVFP4 codes uint8 [n, d/2]."""
        return raw[:, : self.code_bytes].view(self.torch_dtype())

    def block_scale_view(self, raw: torch.Tensor) -> torch.Tensor | None:
        """The NVFP4 block scales of rows in this layout (float8_e4m3fn [n, d/16]); None for
        other formats."""
        if self.format != NVFP4:
            return None
        return raw[:, self.code_bytes : self.row_bytes].view(torch.float8_e4m3fn)

    def to_json(self) -> bytes:
        """The canonical header JSON (what write_header stores and checksums)."""
        return _canonical(dataclasses.asdict(self))


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def row_bytes_of(format: str, head_dim: int) -> int:
    """Bytes of one row of ``format`` with ``head_dim`` elements."""
    if format == NVFP4:
        return head_dim // 2 + head_dim // NVFP4_BLOCK
    return head_dim * getattr(torch, format).itemsize


def layout_checksum(
    format: str,
    num_rows: int,
    head_dim: int,
    row_bytes: int,
    layer_index: int,
    layer_multipliers: Sequence[int],
    head_sizes: Sequence[int],
    head_offsets: Sequence[int],
) -> str:
    """sha256 (hex) of the canonical JSON of the table's geometry and its layer's hash layout
    (exact Python ints)."""
    fields = {
        "format": str(format),
        "num_rows": int(num_rows),
        "head_dim": int(head_dim),
        "row_bytes": int(row_bytes),
        "layer_index": int(layer_index),
        "layer_multipliers": [int(x) for x in layer_multipliers],
        "head_sizes": [int(x) for x in head_sizes],
        "head_offsets": [int(x) for x in head_offsets],
    }
    return hashlib.sha256(_canonical(fields)).hexdigest()


def table_dtype(dtype: TableDtype | str) -> TableDtype:
    """The table storage ``dtype`` names: a torch dtype, ``"nvfp4"``, or a torch dtype's name."""
    if isinstance(dtype, str) and dtype != NVFP4:
        named = getattr(torch, dtype.removeprefix("torch."), None)
        dtype = named if isinstance(named, torch.dtype) else dtype
    if dtype != NVFP4 and dtype not in (*FLOAT_DTYPES, *FP8_DTYPES):
        raise ValueError(f"unsupported table dtype {dtype!r}")
    return dtype


def format_name(dtype: Any) -> str:
    """The FORMATS name of a table dtype as NGramEmbedding accepts it (a torch dtype, its name,
    or "nvfp4")."""
    dtype = table_dtype(dtype)
    return NVFP4 if dtype == NVFP4 else str(dtype).removeprefix("torch.")


def expected_header(config: Any, layer_index: int, dtype: Any) -> TableFileHeader:
    """The header of layer ``layer_index``'s table of ``dtype`` under a Qwen4Exp text config
    (the fields NGramEmbedding reads), with its layout computed as NGramEmbedding.__init__
    computes it; ``scale`` is None (a model does not know it before reading the file)."""
    fmt = format_name(dtype)
    layer_index = layout.check_layer_index(layer_index)
    head_dim = _head_dim(config)
    if fmt == NVFP4 and head_dim % NVFP4_BLOCK:
        raise ValueError(
            f"an NVFP4 table needs a head dim that is a multiple of {NVFP4_BLOCK}, got {head_dim}"
        )
    multipliers, sizes, offsets, num_rows = hash_layout(config, layer_index)
    row_bytes = row_bytes_of(fmt, head_dim)
    checksum = layout_checksum(
        fmt, num_rows, head_dim, row_bytes, layer_index, multipliers, sizes, offsets
    )
    return TableFileHeader(
        format=fmt,
        layer_index=layer_index,
        num_rows=num_rows,
        head_dim=head_dim,
        row_bytes=row_bytes,
        data_offset=HEADER_BYTES,
        scale=None,
        layout_checksum=checksum,
    )


def _ngram_heads(config: Any) -> int:
    ngram_size = int(config.ngram_size)
    heads_per_ngram = int(config.heads_per_ngram)
    if ngram_size < 2:
        raise ValueError(f"ngram_size must be >= 2, got {ngram_size}")
    if heads_per_ngram <= 0:
        raise ValueError(f"heads_per_ngram must be > 0, got {heads_per_ngram}")
    return (ngram_size - 1) * heads_per_ngram


def _head_dim(config: Any) -> int:
    heads = _ngram_heads(config)
    embed_dim = int(config.ple_embed_dim)
    if embed_dim % heads:
        raise ValueError(
            "ple_embed_dim must be divisible by the number of n-gram heads: "
            f"{embed_dim} % {heads} != 0"
        )
    return embed_dim // heads


def hash_layout(
    config: Any, layer_index: int
) -> tuple[list[int], tuple[int, ...], tuple[int, ...], int]:
    """(multipliers, head sizes, head offsets, R_pad) of PLE layer ``layer_index``, computed as
    NGramEmbedding.__init__ computes them (SPEC §2)."""
    multipliers = layout.layer_multipliers(
        int(config.vocab_size),
        int(config.ngram_size),
        int(getattr(config, "seed", 1234)),
        layout.check_layer_index(layer_index),
    )
    vocab = layout.head_vocab_layout(
        int(config.ngram_vocab_size_base),
        _ngram_heads(config),
        layout.check_layer_index(layer_index),
        int(config.make_ngram_vocab_size_divisible_by),
    )
    return multipliers, vocab.sizes, vocab.offsets, vocab.padded_rows


def encode_header(header: TableFileHeader) -> bytes:
    """The HEADER_BYTES bytes of the header region."""
    problem = _inconsistency(header)
    if problem:
        raise ValueError(f"inconsistent table file header: {problem}")
    text = header.to_json()
    if len(text) > _JSON_MAX:
        raise ValueError(f"table file header JSON is {len(text)} bytes, at most {_JSON_MAX}")
    prefix = _PREFIX.pack(MAGIC, VERSION, len(text), hashlib.sha256(text).digest())
    return (prefix + text).ljust(HEADER_BYTES, b"\0")


def write_header(fileobj: BinaryIO, header: TableFileHeader) -> None:
    """Writes the header region (HEADER_BYTES bytes) at the file object's position (the start
    of the file); the rows follow it."""
    fileobj.write(encode_header(header))


def _inconsistency(header: TableFileHeader) -> str | None:
    """What is wrong with a header's fields on their own, or None."""
    h = header
    if not isinstance(h.format, str) or h.format not in FORMATS:
        return f"unknown format {_short(h.format)} (known: {', '.join(FORMATS)})"
    ints = ("layer_index", "num_rows", "head_dim", "row_bytes", "data_offset")
    for name in ints:
        value = getattr(h, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _INT_LIMIT:
            return f"{name} must be a non-negative integer below 2**63, got {_short(value)}"
    if h.head_dim == 0:
        return "head_dim must be positive"
    if h.num_rows == 0:  # no layout has no rows, and an empty data region cannot be mapped
        return "num_rows must be positive"
    if h.format == NVFP4 and h.head_dim % NVFP4_BLOCK:
        return f"an nvfp4 head_dim must be a multiple of {NVFP4_BLOCK}, got {h.head_dim}"
    expected_row_bytes = row_bytes_of(h.format, h.head_dim)
    if h.row_bytes != expected_row_bytes:
        return (
            f"row_bytes {h.row_bytes} does not match format {h.format} with head_dim "
            f"{h.head_dim} ({expected_row_bytes} bytes)"
        )
    if h.data_offset != HEADER_BYTES:
        return f"data_offset {h.data_offset} is not {HEADER_BYTES}"
    quantized = h.format == NVFP4 or h.format in FP8_FORMATS
    if quantized:
        if isinstance(h.scale, bool) or not isinstance(h.scale, (int, float)):
            return f"a {h.format} table needs a float scale, got {_short(h.scale)}"
        if not (-_FLOAT_MAX <= h.scale <= _FLOAT_MAX):  # an int past float range, inf, nan
            return f"scale must be finite, got {_short(h.scale)}"
    elif h.scale is not None:
        return f"a {h.format} table has no scale, got {_short(h.scale)}"
    if h.file_bytes >= _INT_LIMIT:
        return f"{h.num_rows} rows of {h.row_bytes} bytes do not fit a file (2**63 bytes)"
    checksum = h.layout_checksum
    if not (isinstance(checksum, str) and len(checksum) == 64 and _is_hex(checksum)):
        return f"layout_checksum must be 64 lowercase hex digits, got {_short(checksum)}"
    return None


_FLOAT_MAX = 1.7976931348623157e308


def _json_depth(text: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON ``text`` (brackets inside strings
    are not counted)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # closing quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def _short(value: Any, limit: int = 60) -> str:
    """repr of a header value, cut to ``limit`` characters (a header can hold a 4000-digit
    number or a list nested a thousand deep)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def open_regular(path: str | os.PathLike, what: str = "the table file", noun: str = "") -> int:
    """A read-only descriptor of the regular file at ``path`` (``what`` it is, for messages).
    Anything else is refused before a byte is read: a FIFO would block the open or the read
    forever, a device (``/dev/zero``) never ends. The open itself is non-blocking (a FIFO
    without a writer opens at once), so that the check comes first."""
    noun = noun or what.removeprefix("the ")  # "no such <noun>"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TableFileNotFoundError(f"{path}: no such {noun}") from None
    except OSError as error:
        raise TableFileError(f"{path}: cannot open {what}: {error.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a file")
            raise TableFileError(f"{path}: {what} is {kind}, not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header(path: str | os.PathLike) -> TableFileHeader:
    """The header of the table file at ``path``, validated: magic, version, the header's
    checksum, its fields' consistency, and the file's size (exactly ``file_bytes``)."""
    fd = open_regular(path)
    try:
        return read_header_at(fd, path)
    finally:
        os.close(fd)


def read_header_at(fd: int, path: str | os.PathLike) -> TableFileHeader:
    """:func:`read_header` of the table file open as ``fd`` (not O_DIRECT; named ``path`` in
    errors). Readers read the header and the rows through one descriptor: a path replaced
    between two opens would give one file's header and another's rows."""
    try:
        region = os.pread(fd, HEADER_BYTES, 0)
        size = os.fstat(fd).st_size
    except OSError as error:
        raise TableFileError(f"{path}: cannot read the table file: {error.strerror}") from None
    if region[: len(MAGIC)] != MAGIC:
        raise TableFileError(f"{path}: not a qwen4exp table file (no {MAGIC!r} magic)")
    if len(region) < HEADER_BYTES:
        raise TableFileError(
            f"{path}: truncated table file: {size} bytes, shorter than its "
            f"{HEADER_BYTES}-byte header"
        )
    _, version, length, digest = _PREFIX.unpack_from(region)
    if version != VERSION:
        raise TableFileError(
            f"{path}: table file version {version}, this qwen4exp_ext reads version {VERSION}"
        )
    if length > _JSON_MAX:
        raise TableFileError(f"{path}: corrupted table file header (JSON length {length})")
    text = region[_PREFIX.size : _PREFIX.size + length]
    if hashlib.sha256(text).digest() != digest:
        raise TableFileError(f"{path}: corrupted table file header (checksum mismatch)")
    if any(region[_PREFIX.size + length :]):
        raise TableFileError(f"{path}: corrupted table file header (nonzero padding)")
    if _json_depth(text) > _JSON_MAX_DEPTH:
        raise TableFileError(f"{path}: corrupted table file header (too deeply nested)")
    try:
        fields = json.loads(text)
    except RecursionError:
        raise TableFileError(f"{path}: corrupted table file header (too deeply nested)") from None
    except ValueError as error:  # not UTF-8, not JSON, a number past int's digit limit
        raise TableFileError(f"{path}: corrupted table file header ({error})") from None
    if not isinstance(fields, dict) or sorted(fields) != sorted(_FIELDS):
        got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
        raise TableFileError(
            f"{path}: table file header has fields {_short(got, 200)}, expected {_FIELDS}"
        )
    header = TableFileHeader(**fields)
    problem = _inconsistency(header)
    if problem:
        raise TableFileError(f"{path}: inconsistent table file header: {problem}")
    if size != header.file_bytes:
        kind = "truncated" if size < header.file_bytes else "extended"
        raise TableFileError(
            f"{path}: {kind} table file: {size} bytes, but its header ({header.num_rows} rows of "
            f"{header.row_bytes} bytes after {header.data_offset}) needs {header.file_bytes}"
        )
    return header


def write_table_file(
    path: str | os.PathLike, header: TableFileHeader, rows: Iterable[torch.Tensor]
) -> None:
    """Writes the table file ``path``: ``header``, then ``rows`` (uint8 [n, row_bytes] chunks in
    row order, every row once), atomically (:func:`atomic_write`): it appears complete or not
    at all. The one writer of table files (``qwen4exp-table pack``,
    ``NGramEmbedding.save_table_file``)."""
    with atomic_write(path) as f:
        write_header(f, header)
        for chunk in rows:
            f.write(memoryview(chunk.contiguous().numpy()))
        if f.tell() != header.file_bytes:  # a check of the caller, not of the input
            raise TableFileError(f"{path}: wrote {f.tell()} bytes, expected {header.file_bytes}")


def file_rows(
    values: torch.Tensor, block_scales: torch.Tensor | None, chunk_rows: int
) -> Iterator[torch.Tensor]:
    """A table's rows as a table file holds them (uint8 [n, row_bytes], ``chunk_rows`` at a
    time, on the CPU): each row's values, then its NVFP4 ``block_scales`` if given."""
    for start in range(0, values.shape[0], chunk_rows):
        rows = values[start : start + chunk_rows].detach().cpu().contiguous().view(torch.uint8)
        if block_scales is not None:
            scales = block_scales[start : start + chunk_rows].detach().cpu().contiguous()
            rows = torch.cat((rows, scales.view(torch.uint8)), dim=1)
        yield rows


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A file object whose bytes replace ``path`` only when the block ends without an error:
    they go to a temporary file beside it (a random name created with O_EXCL, so nothing
    planted there is written through, and never ``*.safetensors``: a checkpoint scan of the
    directory must not pick it up), which is fsynced and renamed over ``path``, and the
    directory fsynced (the rename survives a crash). On any failure the temporary file is
    removed and ``path`` is left as it was."""
    path = Path(path)
    directory = path.parent
    temporary = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}{_TEMPORARY}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


_TEMPORARY = ".tmp"


def leftover_temporaries(path: str | os.PathLike) -> list[Path]:
    """The temporary files that :func:`atomic_write` of ``path`` left beside it in a process
    that is gone (killed while writing: its ``finally`` never ran). A temporary of a live
    process (another writer, this one) is not listed: removing it would fail that write."""
    path = Path(path)
    name = re.compile(rf"\.{re.escape(path.name)}\.([0-9]+)\.[0-9a-f]{{16}}{re.escape(_TEMPORARY)}")
    found = []
    with os.scandir(path.parent) as entries:
        for entry in entries:
            match = name.fullmatch(entry.name)
            if match and entry.is_file(follow_symlinks=False) and not _alive(int(match[1])):
                found.append(Path(entry.path))
    return sorted(found)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or a pid no process can have
        return False
    except PermissionError:  # another user's process
        return True
    return True


def table_path(directory: str | os.PathLike, layer_index: int) -> Path:
    """PLE layer ``layer_index``'s table file in a table directory (TABLE_FILE_NAME)."""
    layer_index = layout.check_layer_index(layer_index)
    return Path(directory) / TABLE_FILE_NAME.format(layer=layer_index)


def check_header(
    header: TableFileHeader, expected: TableFileHeader, path: str | os.PathLike
) -> None:
    """Raises TableFileError naming the first field in which the file's ``header`` differs from
    what the model ``expected`` (:func:`expected_header`): layer, format, head_dim, num_rows,
    then the layout checksum. The scale is not compared."""
    if header.layer_index != expected.layer_index:
        raise TableFileError(
            f"{path}: the table file is PLE layer {header.layer_index}'s, expected layer "
            f"{expected.layer_index}'s"
        )
    if header.format != expected.format:
        raise TableFileError(
            f"{path}: the table file's format (dtype) is {header.format}, expected "
            f"{expected.format}"
        )
    if header.head_dim != expected.head_dim:
        raise TableFileError(
            f"{path}: the table file's rows are {header.head_dim} wide (head_dim), expected "
            f"{expected.head_dim}"
        )
    if header.num_rows != expected.num_rows:
        raise TableFileError(
            f"{path}: the table file has {header.num_rows} rows, expected {expected.num_rows}"
        )
    if header.layout_checksum != expected.layout_checksum:
        raise TableFileError(
            f"{path}: the table file's layout checksum differs from the config's (another "
            "config's hash multipliers or head sizes)"
        )
