"""One copy of a PLE table per node: a packed table file (:mod:`.file_format`) mapped shared by
every process that serves it (issue #49 item 2).

:func:`open_shared_table` decides first, before anything is mapped or copied
(:func:`plan_shared_table`), then does one of:

- ``"tmpfs"``: the file is on tmpfs (``/dev/shm``, a RAM disk): its pages are already the one
  copy in RAM, so it is mapped ``MAP_SHARED`` read-only where it is;
- ``"stage"``: the file is on a disk: the first process *stages* it, copies it into
  ``/dev/shm`` (``shm_dir``), and every process maps that copy. The copy is made under a lock
  (``flock`` on ``<copy>.lock``: the others wait, up to ``timeout`` seconds, then map it), into a
  temporary name renamed over the copy's name when complete (:func:`~.file_format.atomic_write`),
  so a copy cut short (the stager killed) is never mapped: the next process finds no complete
  copy, removes the dead stager's temporary and stages again. Beside the copy, ``<copy>.json``
  records the source it was made from (path, device, inode, size, mtime) and the copy's own
  inode and size; a copy whose record no longer matches its source, or whose header differs from
  the source's, is stale and staged again;
- ``"page_cache"`` (``stage=False``, or ``shm_dir`` is not a tmpfs or has no room for the
  table, logged): the disk file is mapped where it is; processes share the kernel's page cache,
  which may evict it (reads then go to the disk again);
- ``"staged_lookup"``: the table is larger than the memory available (``MemAvailable``, plus a
  staged copy of it already in RAM): nothing is mapped or copied, a log line says why, and the
  table is returned as a :class:`~.readers.FileTable` with the ``"direct"`` reader, for the
  CPU-staged lookups (``layers/staged.py``: ``NGramEmbedding(placement="file",
  table_reader="direct")`` and ``StagedLookupPipeline``).

Who removes the copy: every process that maps it holds a shared ``flock`` on ``<copy>.users``
while its :class:`SharedTable` is open; :meth:`SharedTable.close` (or garbage collection) drops
it, and the process that then finds no other user removes the copy, its record and both lock
files, unless it was opened with ``keep=True`` (then the copy stays for the next start, which
reuses it if it is still fresh). Memory already mapped stays valid until unmapped. A process
killed while it was the last user leaves the copy: the next open reuses or re-stages it, and
:func:`remove_staged_copy` removes it.

On a CPU, the mapping is the table: :attr:`SharedTable.rows` is a uint8 tensor over it. On a GPU,
:meth:`SharedTable.device_rows` host-registers the mapping once for the zero-copy lookup (see
``docs/design/shared-tables.md``): read-only registration (``cudaHostRegisterReadOnly`` on the
read-only mapping) where the CUDA driver reports ``cudaDevAttrHostRegisterReadOnlySupported``;
elsewhere (ROCm, older CUDA drivers) a read-write shared mapping of the tmpfs file is registered,
as vLLM's DeepSeek-V4.1 ``DPSharedEngramStorage`` registers its ``/dev/shm`` file.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch

from qwen4exp_ext.tables.file_format import (
    HEADER_BYTES,
    TableFileError,
    TableFileHeader,
    atomic_write,
    check_header,
    leftover_temporaries,
    open_regular,
    read_header_at,
)
from qwen4exp_ext.tables.readers import FileTable

__all__ = [
    "DEFAULT_TIMEOUT",
    "SHM_DIR",
    "SharePlan",
    "SharedTable",
    "memory_available",
    "on_tmpfs",
    "open_shared_table",
    "plan_shared_table",
    "read_only_registration",
    "remove_staged_copy",
    "staged_copy_path",
]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# How long a process waits for another's staging (a 100 GB copy from a slow disk takes minutes).
DEFAULT_TIMEOUT = 1800.0
_POLL_SECONDS = 0.02
_COPY_CHUNK = 64 << 20
_TMPFS_MAGIC = 0x01021994  # statfs f_type of tmpfs (and of /dev/shm)

ShareHow = Literal["tmpfs", "stage", "page_cache", "staged_lookup"]
Progress = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True)
class SharePlan:
    """What :func:`open_shared_table` will do with a table file, decided before anything is
    mapped or copied."""

    how: ShareHow
    source: Path  # the table file asked for
    path: Path  # the file that will be mapped: the source, or its copy in shm_dir
    header: TableFileHeader
    reason: str  # why, in words (logged)


def on_tmpfs(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on tmpfs (statfs's f_type), where a file's pages are RAM already."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first field
    if _libc().statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"statfs: {os.strerror(err)}", str(path))
    return ctypes.c_long.from_buffer(buf).value == _TMPFS_MAGIC


def memory_available() -> int:
    """``MemAvailable`` of /proc/meminfo, in bytes: what can be allocated without swapping."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def staged_copy_path(source: str | os.PathLike, shm_dir: str | os.PathLike = SHM_DIR) -> Path:
    """Where the table file ``source`` is staged in ``shm_dir``: one name per source path (its
    resolved path's hash, then its name), shared by every process of the node."""
    resolved = os.path.realpath(source)
    key = hashlib.sha256(os.fsencode(resolved)).hexdigest()[:16]
    return Path(shm_dir) / f"qwen4exp-{key}-{Path(resolved).name}"


def plan_shared_table(
    path: str | os.PathLike,
    expected: TableFileHeader | None = None,
    *,
    shm_dir: str | os.PathLike = SHM_DIR,
    stage: bool = True,
) -> SharePlan:
    """Reads and checks the file's header (against ``expected`` if given) and decides how it
    is shared (:class:`SharePlan`); maps, copies and locks nothing. A missing file or one that
    is not a table raises :class:`~.file_format.TableFileError` naming it.

    In order: on tmpfs, ``"tmpfs"`` (its pages are in RAM already); larger than the memory
    available (``MemAvailable``, plus a staged copy of it already there), ``"staged_lookup"``;
    ``stage`` and ``shm_dir`` a tmpfs with room for it, ``"stage"``; else ``"page_cache"``
    (``stage=False``, or no room: a container's ``/dev/shm`` is often 64 MiB)."""
    source = Path(path)
    fd = open_regular(source)
    try:
        header = read_header_at(fd, source)
    finally:
        os.close(fd)
    if expected is not None:
        check_header(header, expected, source)
    size = header.file_bytes
    if on_tmpfs(source):
        return SharePlan("tmpfs", source, source, header, "the table file is on tmpfs: mapped")
    copy = staged_copy_path(source, shm_dir)
    # A copy already there (fresh or stale) is memory that staging reuses or replaces.
    already = _size_or_zero(copy) if stage else 0
    available = memory_available() + already
    if size > available:
        return SharePlan(
            "staged_lookup",
            source,
            source,
            header,
            f"the table file is {_gib(size)}, more than the {_gib(available)} of memory "
            "available (MemAvailable, and a staged copy of it): its rows are read by the "
            "CPU-staged lookups",
        )
    if not stage:
        return SharePlan("page_cache", source, source, header, "mapped through the page cache")
    if not os.path.isdir(shm_dir) or not on_tmpfs(shm_dir):
        why = f"{shm_dir} is not a tmpfs directory"
    else:
        free = shutil.disk_usage(shm_dir).free + already
        if size <= free:
            return SharePlan("stage", source, copy, header, f"staged in {shm_dir} and mapped")
        why = f"{shm_dir} has {_gib(free)} free, the table file is {_gib(size)}"
    return SharePlan(
        "page_cache", source, source, header, f"not staged ({why}): mapped through the page cache"
    )


def open_shared_table(
    path: str | os.PathLike,
    expected: TableFileHeader | None = None,
    *,
    shm_dir: str | os.PathLike = SHM_DIR,
    stage: bool = True,
    keep: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    progress: Progress | None = None,
) -> SharedTable | FileTable:
    """The table file ``path`` as one mapped copy per node (:class:`SharedTable`), or, for a
    table that does not fit in memory, a ``"direct"`` :class:`~.readers.FileTable` for the
    CPU-staged lookups (logged with the reason). See the module's docstring for what happens
    when; ``progress(copied, total)`` is called as a staging copy goes (bytes)."""
    timeout = _check_timeout(timeout)
    plan = plan_shared_table(path, expected, shm_dir=shm_dir, stage=stage)
    if plan.how == "staged_lookup":
        log.warning("%s: not mapped whole: %s", plan.source, plan.reason)
        return FileTable(plan.source, expected, reader="direct")
    level = logging.WARNING if plan.reason.startswith("not staged") else logging.INFO
    log.log(level, "%s: %s (%s)", plan.source, plan.reason, plan.path)
    return SharedTable(plan, expected, keep=keep, timeout=timeout, progress=progress)


class SharedTable:
    """One table file mapped ``MAP_SHARED`` (:func:`open_shared_table`): its pages are the
    node's one copy. ``rows`` is the table (uint8 [num_rows, row_bytes] over the mapping);
    ``path`` the file mapped (the source or its staged copy), ``file_table`` its mmap
    :class:`~.readers.FileTable` (what ``NGramEmbedding(placement="file")`` reads)."""

    def __init__(
        self,
        plan: SharePlan,
        expected: TableFileHeader | None = None,
        *,
        keep: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        progress: Progress | None = None,
    ) -> None:
        if plan.how not in ("tmpfs", "stage", "page_cache"):
            raise ValueError(f"SharedTable: plan.how must map the file, got {plan.how!r}")
        self.plan = plan
        self.source, self.path, self.how = plan.source, plan.path, plan.how
        self.keep = bool(keep)
        self._registration: torch.Tensor | None = None
        self._users = _Users(plan.path if plan.how == "stage" else None, self.keep)
        self._closer = weakref.finalize(self, self._users.release)
        try:
            if plan.how == "stage":
                deadline = time.monotonic() + timeout
                self._users.enter(deadline)
                with _staging_lock(plan.path, deadline):
                    self.staged = _stage_if_stale(plan, progress)
                    self.file_table = FileTable(plan.path, expected, reader="mmap")
            else:
                self.staged = False
                self.file_table = FileTable(plan.path, expected, reader="mmap")
        except BaseException:
            self._closer()
            raise
        self.header = self.file_table.header

    @property
    def rows(self) -> torch.Tensor:
        """Every row of the table, uint8 [num_rows, row_bytes], over the shared mapping (CPU;
        read-only memory)."""
        return self.file_table.rows

    def device_rows(self, device: torch.device | str | int | None = None) -> torch.Tensor:
        """The rows as a tensor on ``device`` (default: the current CUDA/ROCm device) that
        reads the shared mapping zero-copy: the mapping is host-registered on the first call
        (read-only where the driver supports it; see the module's docstring)."""
        from qwen4exp_ext.tables import host_memory

        host_memory._check_gpu("SharedTable.device_rows")
        device = host_memory._cuda_device("SharedTable.device_rows", device)
        return host_memory.device_view(self.registered_rows(device), device)

    def registered_rows(self, device: torch.device | str | int | None = None) -> torch.Tensor:
        """The rows, uint8 [num_rows, row_bytes], as a CPU tensor over the mapping registered
        for ``device``'s zero-copy lookup (registered on the first call, as
        :meth:`device_rows`): for a caller that takes its own device view of a slice of it
        (vLLM's pinned embedding takes the UVA view of its ``weight``, a rank's rows)."""
        from qwen4exp_ext.tables import host_memory

        host_memory._check_gpu("SharedTable.registered_rows")
        device = host_memory._cuda_device("SharedTable.registered_rows", device)
        if self._registration is None:
            self._registration = _registered_mapping(self.path, self.header, device)
        h = self.header
        return self._registration[h.data_offset : h.file_bytes].view(h.num_rows, h.row_bytes)

    def close(self) -> None:
        """Drops this process's use of the table: closes the file (its mapping goes when no
        tensor views it), and removes the staged copy if no other process uses it (unless
        ``keep``). Idempotent."""
        self.file_table.close()
        self._registration = None
        self._closer()

    def __enter__(self) -> SharedTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SharedTable({str(self.source)!r}, how={self.how!r}, path={str(self.path)!r})"


def remove_staged_copy(
    source: str | os.PathLike,
    shm_dir: str | os.PathLike = SHM_DIR,
    timeout: float = DEFAULT_TIMEOUT,
) -> bool:
    """Removes the staged copy of ``source`` (and its record and lock files) if no process
    uses it; True if it removed one. For a copy kept (``keep=True``) or left by a crash."""
    users = _Users(staged_copy_path(source, shm_dir), keep=False)
    return users.remove_if_unused(time.monotonic() + _check_timeout(timeout))


# --- locks --------------------------------------------------------------------------------------


def _lock(path: Path, kind: int, deadline: float | None, what: str) -> int | None:
    """A descriptor of ``path`` (created if missing) holding ``flock`` ``kind``; waits until
    ``deadline`` (then TimeoutError naming the file), or with None does not wait and returns
    None if the lock is held. A lock file that its last user removed (and another process may
    have re-created) while this waited is opened again: a lock on an unlinked file locks
    nothing."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            while True:
                try:
                    fcntl.flock(fd, kind | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is None:
                        os.close(fd)
                        return None
                    if time.monotonic() >= deadline:
                        holder = _holder(fd)
                        raise TimeoutError(
                            f"{path}: waited past the timeout for {what}"
                            f"{f' (held by pid {holder})' if holder else ''}"
                        ) from None
                    time.sleep(_POLL_SECONDS)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            mine = os.fstat(fd)
            if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return fd
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        os.close(fd)


def _holder(fd: int) -> str:
    """The pid a staging lock's holder wrote into it ('' if none)."""
    with contextlib.suppress(OSError, ValueError):
        return str(int(os.pread(fd, 32, 0).decode().strip()))
    return ""


@contextlib.contextmanager
def _staging_lock(copy: Path, deadline: float):
    """The exclusive staging lock of ``copy`` (``<copy>.lock``), with this pid written in it
    for a waiter's timeout message."""
    fd = _lock(_sibling(copy, ".lock"), fcntl.LOCK_EX, deadline, "another process's staging")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


class _Users:
    """This process's use of a staged copy: a shared ``flock`` on ``<copy>.users`` while the
    table is open. Holds no reference to the table (it is the table's finalizer)."""

    def __init__(self, copy: Path | None, keep: bool) -> None:
        self.copy, self.keep, self.fd = copy, keep, None

    def enter(self, deadline: float) -> None:
        self.fd = _lock(_sibling(self.copy, ".users"), fcntl.LOCK_SH, deadline, "a cleanup")

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        os.close(fd)
        if not self.keep:
            try:
                self.remove_if_unused(time.monotonic() + DEFAULT_TIMEOUT)
            except (OSError, TimeoutError) as error:  # from a finalizer: say it, never raise
                log.warning("%s: the staged copy was not removed: %s", self.copy, error)

    def remove_if_unused(self, deadline: float) -> bool:
        """Removes the copy, its record and lock files if no process holds ``.users``."""
        users = _sibling(self.copy, ".users")
        if not users.exists() and not self.copy.exists():
            return False
        fd = _lock(users, fcntl.LOCK_EX, None, "")
        if fd is None:
            return False  # another process uses the copy: the last one removes it
        try:
            with _staging_lock(self.copy, deadline):
                existed = self.copy.exists()
                for path in (self.copy, _sibling(self.copy, ".json"), users):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                for leftover in leftover_temporaries(self.copy):
                    leftover.unlink(missing_ok=True)
                # Unlinked while held: a waiter finds the name gone and opens a new one.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_sibling(self.copy, ".lock"))
            return existed
        finally:
            os.close(fd)


# --- staging ------------------------------------------------------------------------------------


def _stage_if_stale(plan: SharePlan, progress: Progress | None) -> bool:
    """Under the staging lock: copies the source to ``plan.path`` unless a fresh copy is
    there. True if it copied."""
    copy = plan.path
    for leftover in leftover_temporaries(copy):  # a stager killed mid-copy
        log.warning("%s: removing a partial copy left by a killed stager", leftover)
        leftover.unlink(missing_ok=True)
    src_fd = open_regular(plan.source)
    try:
        header = read_header_at(src_fd, plan.source)  # the source now, not when planned
        if header != plan.header:
            raise TableFileError(f"{plan.source}: the table file changed while it was opened")
        source = _identity(src_fd)
        if _fresh(copy, source, os.pread(src_fd, HEADER_BYTES, 0)):
            return False
        log.info("%s: staging %s into %s", plan.source, _gib(header.file_bytes), copy)
        with atomic_write(copy) as out:
            _copy(src_fd, out.fileno(), header.file_bytes, plan.source, progress)
        record = dict(source, copy_ino=os.stat(copy).st_ino, copy_size=header.file_bytes)
        with atomic_write(_sibling(copy, ".json")) as out:
            out.write(json.dumps(record, sort_keys=True).encode())
        return True
    finally:
        os.close(src_fd)


def _identity(fd: int) -> dict:
    st = os.fstat(fd)
    link = os.readlink(f"/proc/self/fd/{fd}")
    return {
        "source": link,
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


def _fresh(copy: Path, source: dict, source_header: bytes) -> bool:
    """Whether ``copy`` is a complete copy of the source as it is now: its record names this
    source (same inode, size and mtime), the copy is the file the record was written for (its
    inode and size), and its header is the source's."""
    try:
        record = json.loads(_sibling(copy, ".json").read_bytes())
        st = os.stat(copy)
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in source.items()):
        return False
    if (record.get("copy_ino"), record.get("copy_size")) != (st.st_ino, st.st_size):
        return False
    with open(copy, "rb") as f:
        return f.read(HEADER_BYTES) == source_header


def _copy(src: int, dst: int, nbytes: int, source: Path, progress: Progress | None) -> None:
    done = 0
    while done < nbytes:
        try:
            sent = os.copy_file_range(src, dst, min(_COPY_CHUNK, nbytes - done), done, done)
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(error.errno, f"{source}: staging copy: {error.strerror}") from None
            sent = os.pwrite(dst, os.pread(src, min(_COPY_CHUNK, nbytes - done), done), done)
        if sent == 0:
            raise TableFileError(f"{source}: the table file ended at {done} of {nbytes} bytes")
        done += sent
        if progress is not None:
            progress(done, nbytes)


# --- registration -------------------------------------------------------------------------------

_CUDA_READ_ONLY_ATTRIBUTE = 113  # cudaDevAttrHostRegisterReadOnlySupported
_REGISTER_PORTABLE, _REGISTER_MAPPED, _REGISTER_READ_ONLY = 1, 2, 8


def read_only_registration(device: torch.device) -> bool:
    """Whether ``device``'s driver registers read-only host memory: CUDA's
    ``cudaDevAttrHostRegisterReadOnlySupported``. ROCm: False (HIP's flag 0x8 is
    ``hipExtHostRegisterCoarseGrained``, and HIP has no read-only registration)."""
    if torch.version.hip is not None:
        return False
    try:
        lib = _loaded_library("libcudart.so")
    except OSError as error:
        log.warning("read-only host registration not asked for: %s", error)
        return False
    value = ctypes.c_int(0)
    if lib.cudaDeviceGetAttribute(ctypes.byref(value), _CUDA_READ_ONLY_ATTRIBUTE, device.index):
        return False
    return bool(value.value)


def _registered_mapping(path: Path, header: TableFileHeader, device: torch.device):
    """The whole file mapped ``MAP_SHARED`` and host-registered (mapped, portable), as a uint8
    CPU tensor; unregistered once no tensor views it. Read-only mapping and registration where
    the driver supports it; else a read-write mapping (the file must be writable: a staged
    copy is), as the registration of a read-only mapping would fail."""
    read_only = read_only_registration(device)
    flags = _REGISTER_MAPPED | _REGISTER_PORTABLE | (_REGISTER_READ_ONLY if read_only else 0)
    try:
        fd = os.open(path, (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC)
    except OSError as error:
        raise TableFileError(
            f"{path}: cannot open the table file {'read-only' if read_only else 'read-write'} "
            f"to register it for the GPU ({error.strerror}); without read-only registration "
            "(ROCm, older CUDA drivers) the mapped file must be writable: stage it"
        ) from None
    try:
        if os.fstat(fd).st_size != header.file_bytes:
            raise TableFileError(f"{path}: the table file changed size under the mapping")
        prot = mmap.PROT_READ | (0 if read_only else mmap.PROT_WRITE)
        mapping = mmap.mmap(fd, header.file_bytes, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)
    # The storage holds ``owner``, whose finalizer unregisters the memory and only then lets
    # the mapping go (its argument): unregistering after the unmap would leave the driver
    # with pages nobody maps. vLLM's DPSharedEngramStorage holds its mapping the same way.
    owner = memoryview(mapping)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer; never written
        flat = torch.frombuffer(owner, dtype=torch.uint8)
    pointer = flat.data_ptr()
    result = torch.cuda.cudart().cudaHostRegister(pointer, header.file_bytes, flags)
    if int(getattr(result, "value", result)) != 0:
        raise RuntimeError(
            f"{path}: registering the shared mapping ({header.file_bytes} bytes, flags {flags}) "
            f"for the GPU failed: {result} (locked-memory limit?)"
        )
    weakref.finalize(owner, _unregister, pointer, mapping)
    return flat


def _unregister(pointer: int, mapping: mmap.mmap) -> None:
    result = torch.cuda.cudart().cudaHostUnregister(pointer)
    if int(getattr(result, "value", result)) != 0:
        log.warning("unregistering a shared table mapping failed: %s", result)


def _loaded_library(prefix: str) -> ctypes.CDLL:
    """The shared library whose file name starts with ``prefix`` that torch has loaded
    (the CUDA runtime torch runs on, not another one on the path)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.rsplit(maxsplit=1)[-1]
            if os.path.basename(name).startswith(prefix):
                return ctypes.CDLL(name)
    raise OSError(f"no {prefix}* is loaded in this process (a CUDA torch loads it)")


# --- helpers ------------------------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _sibling(copy: Path, suffix: str) -> Path:
    return copy.with_name(copy.name + suffix)


def _size_or_zero(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB ({nbytes} bytes)"


def _check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    return float(timeout)
