"""Embedding tables that live in host memory (SPEC §4).

Three uses:

- **Pinned host tables for the GPU.** :func:`device_view` page-locks (host-registers) a CPU tensor
  in place, once, and returns a CUDA/ROCm tensor aliasing it (the address from
  hip/cudaHostGetDevicePointer). ``ops.gather_rows`` reads such a view zero-copy over PCIe: the
  Engram paper measures < 3% end-to-end cost for a 100B-parameter table kept this way. Unlike
  ``Tensor.pin_memory()``, nothing is copied, so a 51-102 GB table is never held twice.
- **Exact-size pinned tables.** :func:`pinned_host_table` allocates such a table itself: an
  anonymous mapping of exactly the table's size (page-rounded), on 2 MiB huge pages, prefaulted,
  on the GPU's NUMA node, and registered once. ``torch.empty(pin_memory=True)`` goes through
  torch's caching host allocator, which rounds every block up to a power of two: 47.7 GiB of fp8
  PLE table pins 64 GiB.
- **CPU tables.** :func:`empty_host_table` allocates a table on 2 MiB transparent huge pages where
  the kernel allows it: a random row of a many-GB table is otherwise a TLB miss as well as a cache
  miss, and the page walk is a large share of the CPU gather's time.

:func:`footprint` says what the kernel actually holds for a table (mapping size, resident and
huge-page bytes, NUMA policy) and whether this module registered it: for tests and benchmarks.

ROCm caveats (see also csrc/torch/gpu/host_table.cpp and README.md):

- the device pointer of registered host memory can differ from the host pointer on ROCm: always
  use the returned view, never ``torch.from_blob``-style tricks with the host address;
- register once: this module caches one registration per storage and device, and every view of
  that storage is carved out of it; memory that is already pinned (``pin_memory()``) is used
  as is;
- registering pins every page: for a 51-102 GB table it takes seconds to tens of seconds and
  needs that much lockable memory (``ulimit -l``, container limits). Do it once at load time;
- the views must outlive every kernel that reads them; the registration is released when the
  last view of the storage is garbage-collected, with no stream ordering.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import platform
import re
import sys
import warnings
import weakref
from typing import TypedDict

import torch

__all__ = ["Footprint", "device_view", "empty_host_table", "footprint", "pinned_host_table"]

_HUGE_PAGE = 2 * 1024 * 1024
_PAGE = mmap.PAGESIZE
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_MPOL_BIND = 2
# mbind is not in glibc (it is libnuma's), so it is called as a raw syscall.
_SYS_MBIND = {"x86_64": 237, "amd64": 237, "aarch64": 235, "arm64": 235}.get(
    platform.machine().lower()
)
_NODE_SYSFS = "/sys/devices/system/node"

# (storage address, storage bytes, device) -> the registered full-storage uint8 view.
_registered: weakref.WeakValueDictionary[tuple[int, int, torch.device], torch.Tensor] = (
    weakref.WeakValueDictionary()
)
# address -> bytes of every mapping made here that is still mapped.
_mappings: dict[int, int] = {}


def _gpu_build() -> bool:
    from qwen4exp_ext import build_info

    return any(b in ("cuda", "rocm") for b in build_info()["backends"])


def _register(host_table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The cached registration of ``host_table``'s whole storage on ``device``: a uint8 CUDA
    tensor over all of it. Registers it on the first call."""
    storage = host_table.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes(), device)
    base = _registered.get(key)
    if base is None:
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        base = torch.ops.qwen4exp.host_table_device_view(flat, device)
        _registered[key] = base
    return base


def _check_gpu(fn: str) -> None:
    if not _gpu_build():
        raise RuntimeError(
            f"{fn}: this qwen4exp_ext was built without GPU kernels (CPU only); pinned host "
            "tables need a CUDA or ROCm build"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(f"{fn}: no CUDA/ROCm device is available")


def _cuda_device(fn: str, device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{fn}: device must be a CUDA/ROCm device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_view(host_table: torch.Tensor, device: torch.device | str | int | None = None):
    """A tensor on ``device`` (default: the current CUDA/ROCm device) that aliases the CPU tensor
    ``host_table`` through pinned, mapped host memory. Same shape, strides and dtype.

    The host memory is registered once per storage and device; later calls (any slice of the
    same storage) reuse that registration. Keep the returned view for as long as kernels read it.
    """
    if not isinstance(host_table, torch.Tensor) or host_table.device.type != "cpu":
        where = host_table.device if isinstance(host_table, torch.Tensor) else type(host_table)
        raise ValueError(f"device_view: host_table must be a CPU tensor, got {where}")
    _check_gpu("device_view")
    device = _cuda_device("device_view", device)
    if host_table.untyped_storage().nbytes() == 0:
        raise ValueError("device_view: host_table has no storage to register")
    base = _register(host_table, device)
    return base.view(host_table.dtype).as_strided(
        host_table.shape, host_table.stride(), host_table.storage_offset()
    )


# --- anonymous mappings -------------------------------------------------------------------------


@functools.cache
def _c() -> ctypes.CDLL:
    """libc, with the prototypes of what is called here (size_t and pointers must not be
    truncated to int)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.syscall.restype = ctypes.c_long
    return libc


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _munmap(addr: int, nbytes: int) -> None:
    if _c().munmap(addr, nbytes) != 0:
        raise _os_error(f"munmap of {nbytes} bytes at {addr:#x}")


class _Mapping:
    """Owns one anonymous mapping; unmaps it when the last reference goes. Referenced by the
    buffer object behind every storage over the mapping, never by a storage itself."""

    def __init__(self, addr: int, nbytes: int):
        self.addr = addr
        self.nbytes = nbytes
        _mappings[addr] = nbytes

    def __del__(self):
        _mappings.pop(self.addr, None)
        _munmap(self.addr, self.nbytes)


def _map(nbytes: int, *, huge_pages: bool) -> _Mapping:
    """An anonymous private mapping of ``nbytes`` (a multiple of the page size), at a 2 MiB
    boundary. Over-maps by 2 MiB and unmaps the unaligned head and tail, so what is left is
    exactly ``nbytes``: both the alignment (a huge page needs a 2 MiB-aligned range) and the
    exact size (a registration pins the whole storage) matter. The tail, never empty, is left as
    a hole after the table, so a table made after it cannot end right against it, and the kernel
    does not merge two tables into one mapping."""
    if not sys.platform.startswith("linux"):
        raise OSError("host tables made of anonymous mappings need Linux")
    if nbytes >= 2**62:
        raise MemoryError(f"a host table of {nbytes} bytes cannot be mapped")
    c = _c()
    over = nbytes + _HUGE_PAGE
    raw = c.mmap(
        None, over, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )
    if raw is None or raw == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise MemoryError(f"mmap of {over} bytes for a host table failed: {os.strerror(err)}")
    addr = raw + (-raw) % _HUGE_PAGE
    head, tail = addr - raw, raw + over - (addr + nbytes)
    if head:
        _munmap(raw, head)
    if tail:
        _munmap(addr + nbytes, tail)
    mapping = _Mapping(addr, nbytes)
    # Advice before the first touch: it decides which pages the faults allocate. EINVAL means a
    # kernel without THP: ordinary pages, nothing to do.
    c.madvise(addr, nbytes, _MADV_HUGEPAGE if huge_pages else _MADV_NOHUGEPAGE)
    return mapping


def _table(
    mapping: _Mapping, rows: int, width: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ctypes.Array]:
    """A [rows, width] tensor whose storage is exactly ``mapping``, and the buffer object that
    storage holds (which holds the mapping)."""
    buf = (ctypes.c_uint8 * mapping.nbytes).from_address(mapping.addr)
    buf.mapping = mapping
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    nbytes = rows * width * _element_size(dtype)
    return flat[:nbytes].view(dtype).view(rows, width), buf


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _mbind(addr: int, nbytes: int, node: int) -> None:
    if _SYS_MBIND is None:
        raise OSError(f"mbind: no syscall number for {platform.machine()} (x86_64, aarch64 only)")
    bits = (node // 64 + 1) * 64
    mask = (ctypes.c_ulong * (bits // 64))()
    mask[node // 64] = 1 << (node % 64)
    # The kernel reads maxnode - 1 bits (libnuma passes its mask size + 1 too).
    rc = _c().syscall(
        ctypes.c_long(_SYS_MBIND),
        ctypes.c_void_p(addr),
        ctypes.c_ulong(nbytes),
        ctypes.c_long(_MPOL_BIND),
        mask,
        ctypes.c_ulong(bits + 1),
        ctypes.c_uint(0),
    )
    if rc != 0:
        raise _os_error(f"mbind of {nbytes} bytes to NUMA node {node}")


def _prefault(mapping: _Mapping) -> None:
    """Fault every page in now (zero pages), so that neither registration nor the first lookups
    pay for it, and huge pages are taken while the advice and binding apply."""
    if _c().madvise(mapping.addr, mapping.nbytes, _MADV_POPULATE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err != errno.EINVAL:  # EINVAL: a kernel before 5.14; anything else is real
        raise MemoryError(
            f"prefaulting {mapping.nbytes} bytes of host table failed: {os.strerror(err)}"
        )
    pages = (ctypes.c_uint8 * mapping.nbytes).from_address(mapping.addr)
    torch.frombuffer(pages, dtype=torch.uint8)[::_PAGE].zero_()


def _memory_nodes() -> list[int]:
    """The NUMA nodes that have memory; [] where sysfs does not say."""
    try:
        with open(os.path.join(_NODE_SYSFS, "has_memory")) as f:
            text = f.read().strip()
    except OSError:
        return []
    nodes: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes


def _gpu_numa_node(device: torch.device) -> int:
    """The NUMA node of ``device``'s PCI slot, -1 where sysfs does not know it."""
    props = torch.cuda.get_device_properties(device)
    pci = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        with open(f"/sys/bus/pci/devices/{pci}/numa_node") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def _check_shape(fn: str, rows: object, width: object, dtype: object) -> int:
    for name, value in (("rows", rows), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{fn}: {name} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{fn}: {name} must be >= 0, got {value}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{fn}: dtype must be a torch.dtype, got {dtype!r}")
    return rows * width * _element_size(dtype)  # type: ignore[operator]


def _check_numa_node(numa_node: object) -> None:
    """pinned_host_table's ``numa_node``: None, -1, or a node that has memory here."""
    if numa_node is not None and (
        isinstance(numa_node, bool) or not isinstance(numa_node, int) or numa_node < -1
    ):
        raise ValueError(
            f"pinned_host_table: numa_node must be None, -1 or a node, got {numa_node}"
        )
    if numa_node is not None and numa_node >= 0 and numa_node not in _memory_nodes():
        raise ValueError(
            f"pinned_host_table: numa_node {numa_node} is not a NUMA node with memory here "
            f"(nodes: {_memory_nodes()})"
        )


def _bind_pinned(mapping: _Mapping, numa_node: int | None, gpu: torch.device | None) -> None:
    """Binds a pinned table's pages to ``numa_node``, or with None to the node of ``gpu`` (the
    GPU it is registered for, None if none) where there are several: a failure to bind the
    node asked for raises, one to bind the GPU's only warns."""
    node, required = numa_node, numa_node is not None
    if node is None:
        node = _gpu_numa_node(gpu) if gpu is not None and len(_memory_nodes()) > 1 else -1
    if node >= 0:
        try:
            _mbind(mapping.addr, mapping.nbytes, node)
        except OSError as e:
            if required:
                raise
            warnings.warn(
                f"pinned_host_table: could not bind the table to the GPU's NUMA node ({e}); "
                "its pages go wherever the kernel puts them",
                stacklevel=3,  # pinned_host_table's caller
            )


def pinned_host_table(
    rows: int,
    width: int,
    dtype: torch.dtype,
    *,
    device: torch.device | str | int | None = None,
    huge_pages: bool = True,
    numa_node: int | None = None,
) -> torch.Tensor:
    """A zeroed [rows, width] CPU table in memory of exactly its size, pinned for ``device``.

    The storage is one anonymous mapping of ``rows * width * itemsize`` bytes rounded up to the
    page size, never more (``torch.empty(pin_memory=True)`` rounds up to a power of two). It is:

    - 2 MiB-aligned and advised ``MADV_HUGEPAGE`` when ``huge_pages`` (huge pages where THP is
      "madvise" or "always"); ``huge_pages=False`` advises ``MADV_NOHUGEPAGE``: 4 KiB pages;
    - bound (mbind, ``MPOL_BIND``) to ``numa_node``. ``None``: the GPU's node, only on a machine
      with several NUMA nodes, and a failed binding (a container without the permission) is a
      warning; an int binds to that node on any machine, and failing is an error; -1: no binding;
    - prefaulted (``MADV_POPULATE_WRITE``, or one write per page on kernels before 5.14), hence
      resident and zeroed;
    - registered (hip/cudaHostRegister, mapped and portable) through :func:`device_view`'s cache
      when this is a GPU build and a GPU is available: ``device_view(table)`` then costs nothing.
      ``device=None`` is the current GPU, or no registration where there is none; ``"cpu"``: no
      registration (a CPU table on huge pages).

    The registration lasts as long as the table's storage (any CPU view of it) or any device view;
    the mapping is unmapped when the last of them dies. Zero rows or width: an ordinary empty
    tensor, nothing mapped or registered. Raises ValueError for bad arguments and MemoryError when
    the memory cannot be mapped or faulted in (mind ``MPOL_BIND``: only that node's memory counts).
    """
    nbytes = _check_shape("pinned_host_table", rows, width, dtype)
    _check_numa_node(numa_node)
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"pinned_host_table: device {device!r} is not a device ({e})") from e
    register = device is None and _gpu_build() and torch.cuda.is_available()
    if device is not None and device.type != "cpu":
        _check_gpu("pinned_host_table")
        device = _cuda_device("pinned_host_table", device)
        register = True
    if nbytes == 0:
        return torch.empty(rows, width, dtype=dtype)
    if register and device is None:
        device = _cuda_device("pinned_host_table", None)

    mapping = _map(-(-nbytes // _PAGE) * _PAGE, huge_pages=huge_pages)
    _bind_pinned(mapping, numa_node, device if register else None)
    _prefault(mapping)
    table, buf = _table(mapping, rows, width, dtype)
    if register:
        # Registered through a second storage over the same mapping: the registration holds a
        # reference to the storage it was made from, and the table's storage holds the
        # registration (so it lasts as long as the table), so the two must differ or neither is
        # ever freed. Both hold the mapping, so device views keep it mapped.
        alias = (ctypes.c_uint8 * mapping.nbytes).from_address(mapping.addr)
        alias.mapping = mapping
        buf.registration = _register(torch.frombuffer(alias, dtype=torch.uint8), device)
    return table


def empty_host_table(rows: int, width: int, dtype: torch.dtype, *, huge_pages: bool = True):
    """An uninitialised [rows, width] CPU table, on transparent huge pages when ``huge_pages`` and
    the OS allows it (Linux, THP in "madvise" or "always" mode; silently ordinary pages
    elsewhere). The advice must come before the pages are first touched, hence this allocator:
    fill the result afterwards (``copy_``, ``load_weights``). A table of 2 MiB or more is its own
    mapping of exactly its size (page-rounded), 2 MiB-aligned, so that :func:`device_view`
    registers no more than the table; nothing is faulted in until it is written."""
    nbytes = rows * width * _element_size(dtype)
    if not huge_pages or nbytes < _HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.empty(rows, width, dtype=dtype)
    return _table(_map(-(-nbytes // _PAGE) * _PAGE, huge_pages=True), rows, width, dtype)[0]


# --- introspection ------------------------------------------------------------------------------


class Footprint(TypedDict):
    """What :func:`footprint` reports about a CPU tensor's storage."""

    storage_bytes: int
    """Bytes of the tensor's storage (what a registration pins)."""
    mapping_bytes: int
    """Bytes of the kernel mappings (/proc/self/smaps VMAs) that hold the storage. For a
    :func:`pinned_host_table` this equals ``storage_bytes``; for ordinary allocations the mapping
    may hold other memory too."""
    resident_bytes: int
    """Resident bytes (Rss) of those mappings."""
    huge_page_bytes: int
    """Bytes of those mappings backed by transparent huge pages (AnonHugePages)."""
    numa_policy: str | None
    """Their NUMA policy as /proc/self/numa_maps writes it ("default", "bind:0", ...); None where
    the kernel has no numa_maps or nothing is mapped."""
    host_table: bool
    """The storage is a mapping made by this module (pinned_host_table, empty_host_table)."""
    registered: bool
    """This module has registered (pinned) the storage for some GPU."""


_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def footprint(table: torch.Tensor) -> Footprint:
    """The memory behind the CPU tensor ``table``'s storage, as the kernel sees it now (read from
    /proc/self/smaps and numa_maps, Linux only): for tests and benchmarks, not the serving path
    (it reads every mapping of the process)."""
    if not isinstance(table, torch.Tensor) or table.device.type != "cpu":
        where = table.device if isinstance(table, torch.Tensor) else type(table)
        raise ValueError(f"footprint: table must be a CPU tensor, got {where}")
    storage = table.untyped_storage()
    start, nbytes = storage.data_ptr(), storage.nbytes()
    result = Footprint(
        storage_bytes=nbytes,
        mapping_bytes=0,
        resident_bytes=0,
        huge_page_bytes=0,
        numa_policy=None,
        host_table=_mappings.get(start) == nbytes and nbytes > 0,
        registered=any(k[0] == start and k[1] == nbytes for k in list(_registered.keys())),
    )
    if nbytes == 0:
        return result
    vmas: list[int] = []
    inside = False
    fields = {"Size": "mapping_bytes", "Rss": "resident_bytes", "AnonHugePages": "huge_page_bytes"}
    with open("/proc/self/smaps") as f:
        for line in f:
            vma = _VMA.match(line)
            if vma:
                lo, hi = int(vma.group(1), 16), int(vma.group(2), 16)
                inside = lo < start + nbytes and hi > start
                if inside:
                    vmas.append(lo)
                continue
            if inside:
                key, _, value = line.partition(":")
                if key in fields:
                    result[fields[key]] += int(value.split()[0]) * 1024  # type: ignore[literal-required]
    policies = []
    try:
        with open("/proc/self/numa_maps") as f:
            for line in f:
                addr, _, rest = line.partition(" ")
                if int(addr, 16) in vmas:
                    policies.append(rest.split(" ", 1)[0].strip())
    except OSError:
        pass
    if policies:
        result["numa_policy"] = ",".join(dict.fromkeys(policies))
    return result
