"""Reading the rows of a PLE table file (:mod:`qwen4exp_ext.tables.file_format`), never the whole
table.

Two readers, both kept because each wins somewhere (``qwen4exp-bench host_lookup`` measures
them side by side):

- ``"mmap"``: the file mapped read-only (``MAP_SHARED``, ``MADV_RANDOM``: a row read faults in
  its page, not a 128 KiB readahead window). The page cache keeps what fits in RAM, so a table
  that fits, or a hot subset of one that does not, is read at memory speed by the ordinary CPU
  gather kernel, decoding as it goes. A cold row is a page fault: one synchronous 4 KiB read
  per fault, as many in flight as the gather has threads.
- ``"direct"``: ``O_DIRECT`` reads (``ops.read_file_rows``): the rows of a batch sorted by
  offset, rows sharing a 4 KiB block read once, many reads in flight from I/O threads, into a
  scratch buffer that the CPU gather then decodes. Nothing goes through the page cache, so a
  table far larger than RAM neither evicts the rest of the host's memory nor pays the cache's
  copies; every read goes to the disk, warm or not.

A :class:`FileTable` owns its descriptor and mapping and releases both in :meth:`FileTable.close`
or when it is garbage-collected (tensors still viewing the mapping keep it mapped until they go).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
import warnings
import weakref
from pathlib import Path
from typing import Literal

import torch

from qwen4exp_ext import ops
from qwen4exp_ext._args import as_int
from qwen4exp_ext.tables.file_format import (
    TableFileError,
    TableFileHeader,
    check_header,
    open_regular,
    read_header_at,
)

__all__ = [
    "FileTable",
    "TableReader",
    "evict_range",
    "madvise_range",
    "map_row_range",
    "prefault_range",
]

TableReader = Literal["mmap", "direct"]
_libc = ctypes.CDLL(None, use_errno=True)
READERS = ("mmap", "direct")
# The most direct reads in flight (io_threads): each is a thread of ops.read_file_rows. The op's
# default, 32, already keeps a drive busy with random 4 KiB reads; a thousand threads is far past
# any gain (and 2**63 overflowed the op's int64 deep inside it, naming nothing).
MAX_IO_THREADS = 1024


class FileTable:
    """One open table file: its checked header and a reader of its rows.

    ``expected`` (from :func:`~qwen4exp_ext.tables.file_format.expected_header`) is compared with
    the file's header: a file of another layer, format, width or row count is refused, naming the
    file. ``io_threads`` is the direct reader's reads in flight (0: the op's default)."""

    def __init__(
        self,
        path: str | os.PathLike,
        expected: TableFileHeader | None = None,
        reader: TableReader = "mmap",
        io_threads: int = 0,
    ) -> None:
        if not isinstance(reader, str) or reader not in READERS:
            raise ValueError(f"table_reader must be one of {READERS}, got {reader!r}")
        try:
            self.path = str(Path(path))
        except TypeError:
            raise TypeError(
                f"table_path must be a path (str or os.PathLike), got {path!r}"
            ) from None
        self.reader = reader
        self.io_threads = _io_threads(io_threads)
        self._rows: torch.Tensor | None = None  # uint8 [num_rows, row_bytes] over the mapping
        # Reads in flight through the descriptor, and whether close() was called: close waits
        # for the reads to end, so that no read ever uses a descriptor number closed under it
        # (and perhaps reused by another open: rows of another file).
        self._in_flight = 0
        self._closing = False
        self._idle = threading.Condition(threading.Lock())
        # One descriptor for the header and the rows (a path replaced between two opens would
        # give one file's header and the other's rows). Direct: O_DIRECT set on it once the
        # header is read (a buffered read). mmap: the mapping's source, kept to check the
        # file's size before each lookup (check_readable).
        self._fd = open_regular(self.path)
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        try:
            self.header = header = read_header_at(self._fd, self.path)
            if expected is not None:
                check_header(header, expected, self.path)
            if reader == "direct":
                _set_direct(self._fd, self.path)
            else:
                self._rows = _map_rows(self._fd, self.path, header)
        except BaseException:
            self._finalizer()
            raise

    def _check_open(self) -> None:
        """Raises if the table was closed (called with ``_idle`` held)."""
        if self._closing:
            raise RuntimeError(f"{self.path}: the table file was closed")

    def _begin_read(self) -> None:
        """Counts a read that uses the descriptor, or raises if the table was closed."""
        with self._idle:
            self._check_open()
            self._in_flight += 1

    def _end_read(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    # --- the file's rows as tensors (mmap reader) -----------------------------------------------

    def check_readable(self) -> None:
        """Raises unless the table can be read: open, and (mmap) the file still its size. A
        mapped read past the end of a file truncated under the mapping would kill the process
        with SIGBUS, so each lookup checks first (one fstat). A truncation in the middle of a
        lookup, or a disk error under a mapping, cannot be caught this way: the direct reader
        reports both as errors."""
        with self._idle:  # close() waits for this lock: the descriptor stays this file's
            self._check_open()
            size = os.fstat(self._fd).st_size if self._rows is not None else None
        if size is not None and size != self.header.file_bytes:
            raise OSError(
                f"{self.path}: the table file is now {size} bytes, its header says "
                f"{self.header.file_bytes} (changed while mapped); not read"
            )

    @property
    def rows(self) -> torch.Tensor:
        """Every row of the file, uint8 [num_rows, row_bytes], over the mapping (mmap reader
        only). Read-only memory: never write to it."""
        self.check_readable()
        if self._rows is None:
            raise RuntimeError(f"{self.path}: a 'direct' table file is not mapped")
        return self._rows

    # --- direct reads ----------------------------------------------------------------------------

    def read_rows(
        self, ids: torch.Tensor, output: torch.Tensor, vocab_start: int, vocab_end: int
    ) -> None:
        """Raw rows of global ``ids`` into ``output`` (uint8 [ids.numel(), row_bytes]); ids
        outside [vocab_start, vocab_end) give zero rows. Raises naming the file on a read error
        or a short read; ``output`` is then partly written (callers read into scratch)."""
        if self.reader != "direct":
            raise RuntimeError(f"{self.path}: read_rows needs the 'direct' reader")
        self._begin_read()  # close() waits for this read: the descriptor stays this file's
        try:
            ops.read_file_rows(
                self._fd,
                ids,
                output,
                data_offset=self.header.data_offset,
                row_bytes=self.header.row_bytes,
                vocab_start=vocab_start,
                vocab_end=vocab_end,
                io_threads=self.io_threads,
                path=self.path,
            )
        finally:
            self._end_read()

    def prefault(self) -> None:
        """Maps every page of the file into this process now (mmap reader), reading what the
        page cache does not hold: for a table that fits in RAM, call it once at load so that no
        lookup pays a page fault (a first touch of a cached page is a minor fault, a few us on
        a VM: more than the row's read). Do not call it for a table larger than RAM."""
        self.check_readable()
        if self._rows is None:
            raise RuntimeError(f"{self.path}: prefault needs the 'mmap' reader")
        try:
            prefault_range(self._rows.data_ptr(), self._rows.numel())
        except OSError as error:
            raise OSError(error.errno, f"{self.path}: prefault: {error.strerror}") from None

    def drop_cached_pages(self) -> None:
        """Evicts the file's pages from the page cache and from this process's mapping (for
        cold-read measurements): the next reads go to the disk."""
        self.check_readable()
        if self._rows is not None:
            evict_range(self._rows.data_ptr(), self._rows.numel())
        self._begin_read()
        try:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            self._end_read()

    def close(self) -> None:
        """Closes the descriptor (direct) or drops this object's view of the mapping (the
        mapping goes when no tensor views it any more). Idempotent. Reads already in flight
        (other threads' read_rows) end first, on this file; later ones raise."""
        with self._idle:
            self._closing = True
            self._idle.wait_for(lambda: self._in_flight == 0)
            self._rows = None
            self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closing

    def __repr__(self) -> str:
        h = self.header
        return (
            f"FileTable({self.path!r}, {h.format}, rows={h.num_rows}, d={h.head_dim}, "
            f"reader={self.reader!r})"
        )


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


def prefault_range(address: int, nbytes: int) -> None:
    """Every page of [address, address + nbytes) (a file mapping) mapped and read in:
    ``MADV_POPULATE_READ``, or where the kernel lacks it, one byte read per page."""
    try:
        madvise_range(address, nbytes, MADV_POPULATE_READ)
    except OSError as error:
        # Only a kernel without MADV_POPULATE_READ (EINVAL) falls back to touching the pages.
        # EFAULT says a page cannot be read (past the end of a file truncated under the
        # mapping): touching it would kill the process with SIGBUS.
        if error.errno != errno.EINVAL:
            raise
        bytes((ctypes.c_char * nbytes).from_address(address)[:: mmap.PAGESIZE])


def evict_range(address: int, nbytes: int) -> None:
    """The pages of [address, address + nbytes) (a file mapping) out of this process's page
    tables (``MADV_DONTNEED``): the page cache may then drop them (``posix_fadvise``)."""
    madvise_range(address, nbytes, mmap.MADV_DONTNEED)


def _io_threads(value) -> int:
    """``io_threads`` checked: an int in [0, MAX_IO_THREADS] (the op takes an int64)."""
    count = as_int(value)
    if count is None or not 0 <= count <= MAX_IO_THREADS:
        raise ValueError(
            f"io_threads must be an integer in [0, {MAX_IO_THREADS}] (0: the default), "
            f"got {value!r}"
        )
    return count


def _set_direct(fd: int, path: str) -> None:
    """O_DIRECT on the open ``fd`` (the file system must support it)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as error:
        raise OSError(
            error.errno,
            f"{path}: cannot read the table file with O_DIRECT ('direct' reader): {error.strerror}",
        ) from None


def _map_rows(fd: int, path: str, header: TableFileHeader) -> torch.Tensor:
    """uint8 [num_rows, row_bytes] over a read-only shared mapping of the file's data region
    (Python's mmap holds its own duplicate of ``fd`` until the mapping goes; the tensor keeps
    the mapping alive)."""
    size = os.fstat(fd).st_size
    if size != header.file_bytes:  # changed since the header was read
        raise OSError(
            f"{path}: the table file is {size} bytes, its header says {header.file_bytes}"
        )
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    if hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_RANDOM)
    with warnings.catch_warnings():
        # The mapping is read-only; torch warns that its tensor is writable in principle. No
        # caller writes to it: it is never a parameter, and the module's loaders refuse rows.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(
            mapping,
            dtype=torch.uint8,
            offset=header.data_offset,
            count=header.num_rows * header.row_bytes,
        )
    return flat.view(header.num_rows, header.row_bytes)


def map_row_range(
    path: str | os.PathLike,
    expected: TableFileHeader | None,
    start: int,
    count: int,
    *,
    private: bool = False,
) -> tuple[TableFileHeader, torch.Tensor]:
    """(header, uint8 [count, row_bytes]) of rows [start, start + count) of the table file at
    ``path``, checked (:func:`read_header_at`, and against ``expected`` if given) and mapped on
    their own: a rank maps only its vocabulary shard's pages, not the whole file.

    The mapping is read-only and shared (``MAP_SHARED``: every process mapping the file shares
    its page-cache pages), or with ``private`` a private copy-on-write one that may be written
    (host registration of a mapping writes to it, see vllm/table_dir.py). The descriptor is
    closed before returning (Python's mmap holds its own duplicate while mapped); the tensor
    keeps the mapping alive, and unmaps it when the last view of it goes."""
    fd = open_regular(path)
    try:
        header = read_header_at(fd, path)
        if expected is not None:
            check_header(header, expected, path)
        if not (0 <= start and 0 < count and start + count <= header.num_rows):
            raise TableFileError(
                f"{path}: rows [{start}, {start + count}) are not in the table file's "
                f"{header.num_rows} rows"
            )
        first = header.data_offset + start * header.row_bytes
        nbytes = count * header.row_bytes
        aligned = first - first % mmap.ALLOCATIONGRANULARITY
        if private:
            mapping = mmap.mmap(
                fd, first + nbytes - aligned, offset=aligned, access=mmap.ACCESS_COPY
            )
        else:
            mapping = mmap.mmap(
                fd,
                first + nbytes - aligned,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ,
                offset=aligned,
            )
    finally:
        os.close(fd)
    if hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_RANDOM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memory: see _map_rows
        flat = torch.frombuffer(mapping, dtype=torch.uint8, offset=first - aligned, count=nbytes)
    return header, flat.view(count, header.row_bytes)


def madvise_range(address: int, nbytes: int, advice: int) -> None:
    """madvise over the pages of [address, address + nbytes) (the first page-aligned down)."""
    start = address & ~(mmap.PAGESIZE - 1)
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + nbytes - start), advice):
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise: {os.strerror(errno)}")
