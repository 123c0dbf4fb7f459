"""Embedding tables that live in host memory (SPEC.md §4).

Two uses:

- **Pinned host tables for the GPU.** :func:`device_view` page-locks (host-registers) a CPU tensor
  in place, once, and returns a CUDA/ROCm tensor aliasing it (the address from
  hip/cudaHostGetDevicePointer). ``ops.gather_rows`` reads such a view zero-copy over PCIe: the
  Engram paper measures < 3% end-to-end cost for a 100B-parameter table kept this way. Unlike
  ``Tensor.pin_memory()``, nothing is copied, so a 51-102 GB table is never held twice.
- **CPU tables.** :func:`empty_host_table` allocates a table on 2 MiB transparent huge pages where
  the kernel allows it: a random row of a many-GB table is otherwise a TLB miss as well as a cache
  miss, and the page walk is a large share of the CPU gather's time.

ROCm caveats (see also csrc/gpu/host_table.cpp and README.md):

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
import mmap
import weakref

import torch

__all__ = ["device_view", "empty_host_table"]

_HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14
# (storage address, storage bytes, device) -> the registered full-storage uint8 view.
_registered: weakref.WeakValueDictionary[tuple[int, int, torch.device], torch.Tensor] = (
    weakref.WeakValueDictionary()
)


def _gpu_build() -> bool:
    from qwen4exp_ext import build_info

    return any(b in ("cuda", "rocm") for b in build_info()["backends"])


def device_view(host_table: torch.Tensor, device: torch.device | str | int | None = None):
    """A tensor on ``device`` (default: the current CUDA/ROCm device) that aliases the CPU tensor
    ``host_table`` through pinned, mapped host memory. Same shape, strides and dtype.

    The host memory is registered once per storage and device; later calls (any slice of the
    same storage) reuse that registration. Keep the returned view for as long as kernels read it.
    """
    if not isinstance(host_table, torch.Tensor) or host_table.device.type != "cpu":
        where = host_table.device if isinstance(host_table, torch.Tensor) else type(host_table)
        raise ValueError(f"device_view: host_table must be a CPU tensor, got {where}")
    if not _gpu_build():
        raise RuntimeError(
            "device_view: this qwen4exp_ext was built without GPU kernels (CPU only); pinned host "
            "tables need a CUDA or ROCm build"
        )
    if not torch.cuda.is_available():
        raise RuntimeError("device_view: no CUDA/ROCm device is available")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device_view: device must be a CUDA/ROCm device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    storage = host_table.untyped_storage()
    if storage.nbytes() == 0:
        raise ValueError("device_view: host_table has no storage to register")
    key = (storage.data_ptr(), storage.nbytes(), device)
    base = _registered.get(key)
    if base is None:
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        base = torch.ops.qwen4exp.host_table_device_view(flat, device)
        _registered[key] = base
    return base.view(host_table.dtype).as_strided(
        host_table.shape, host_table.stride(), host_table.storage_offset()
    )


def empty_host_table(rows: int, width: int, dtype: torch.dtype, *, huge_pages: bool = True):
    """An uninitialised [rows, width] CPU table, on transparent huge pages when ``huge_pages`` and
    the OS allows it (Linux, THP in "madvise" or "always" mode; silently ordinary pages
    elsewhere). The advice must come before the pages are first touched, hence this allocator:
    fill the result afterwards (``copy_``, ``load_weights``)."""
    nbytes = rows * width * torch.empty(0, dtype=dtype).element_size()
    if not huge_pages or nbytes < _HUGE_PAGE:
        return torch.empty(rows, width, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % _HUGE_PAGE
    aligned = raw[start : start + nbytes]
    advise_bytes = nbytes - nbytes % mmap.PAGESIZE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(
            ctypes.c_void_p(aligned.data_ptr()),
            ctypes.c_size_t(advise_bytes),
            ctypes.c_int(_MADV_HUGEPAGE),
        )
    except (OSError, AttributeError):  # not Linux: ordinary pages
        pass
    return aligned.view(dtype).view(rows, width)
