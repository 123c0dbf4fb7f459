"""tables.host_memory: pinned_host_table, empty_host_table and footprint, checked against what the
kernel reports (/proc/self/maps, smaps, numa_maps). The registration is faked on a machine without a
GPU (a Python stand-in with the C++ op's ownership graph) and real where there is one."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import re
import weakref
from types import SimpleNamespace

import pytest
import torch

import qwen4exp_ext  # noqa: F401  (registers torch.ops.qwen4exp)
from qwen4exp_ext.tables import host_memory
from qwen4exp_ext.tables.host_memory import (
    device_view,
    empty_host_table,
    footprint,
    pinned_host_table,
)

PAGE = mmap.PAGESIZE
HUGE = 2 * 1024 * 1024

linux_only = pytest.mark.skipif(
    not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps"
)
pytestmark = linux_only


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            match = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def _vma_at(addr: int) -> tuple[int, int] | None:
    """The (start, end) of the kernel mapping holding ``addr``, read independently of
    host_memory.footprint."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
            if lo <= addr < hi:
                return lo, hi
    return None


def _page_round(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _gpu() -> bool:
    return torch.cuda.is_available() and host_memory._gpu_build()


# --- size, alignment, pages ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, width, dtype",
    [
        (3, 7, torch.bfloat16),  # 42 bytes: one page
        (1, 1, torch.uint8),
        (2561, 1024, torch.bfloat16),  # 5 MiB + 2 KiB: a power-of-two allocator takes 8 MiB
        (1000, 1000, torch.float8_e4m3fn),  # 10^6 bytes, not a page multiple
        (4096, 512, torch.float32),  # exactly 8 MiB
    ],
)
@pytest.mark.parametrize("huge_pages", [True, False])
def test_mapping_is_exactly_the_page_rounded_table(rows, width, dtype, huge_pages):
    table = pinned_host_table(rows, width, dtype, device="cpu", huge_pages=huge_pages)
    assert table.shape == (rows, width) and table.dtype == dtype and table.is_contiguous()
    expected = _page_round(table.nbytes)
    assert table.untyped_storage().nbytes() == expected
    assert table.data_ptr() == table.untyped_storage().data_ptr()
    assert _vma_at(table.data_ptr()) == (table.data_ptr(), table.data_ptr() + expected)
    fp = footprint(table)
    assert fp["storage_bytes"] == fp["mapping_bytes"] == expected
    assert fp["host_table"]


@pytest.mark.parametrize("huge_pages", [True, False])
def test_no_alignment_slack_left_mapped(huge_pages):
    # The 2 MiB over-mapped for alignment must be unmapped, not just left out of the table: the
    # advice splits the slack into mappings of its own, touching the table's, if it stays.
    for rows in (1, 3, 1025):
        table = pinned_host_table(rows, 4096, torch.uint8, device="cpu", huge_pages=huge_pages)
        start, end = table.data_ptr(), table.data_ptr() + table.untyped_storage().nbytes()
        below, above = _vma_at(start - 1), _vma_at(end)
        assert below is None or below[1] != start, (hex(start), below)
        assert above is None or above[0] != end, (hex(end), above)


@pytest.mark.parametrize("rows, width", [(0, 7), (7, 0), (0, 0)])
def test_empty_table_maps_nothing(rows, width):
    table = pinned_host_table(rows, width, torch.bfloat16)
    assert table.shape == (rows, width) and table.dtype == torch.bfloat16
    fp = footprint(table)
    assert fp["storage_bytes"] == fp["mapping_bytes"] == 0
    assert not fp["host_table"] and not fp["registered"]


@pytest.mark.parametrize("huge_pages", [True, False])
def test_aligned_to_huge_pages(huge_pages):
    for rows in (1, 3, 1025):
        table = pinned_host_table(rows, 4096, torch.uint8, device="cpu", huge_pages=huge_pages)
        assert table.data_ptr() % HUGE == 0


def test_huge_pages_back_the_table_only_when_asked():
    mode = _thp_mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode or 'unavailable'} on this kernel")
    huge = pinned_host_table(4, HUGE, torch.uint8, device="cpu")
    small = pinned_host_table(4, HUGE, torch.uint8, device="cpu", huge_pages=False)
    assert footprint(huge)["huge_page_bytes"] > 0, footprint(huge)
    assert footprint(small)["huge_page_bytes"] == 0, footprint(small)


def test_prefaulted_and_zeroed():
    table = pinned_host_table(2561, 1024, torch.bfloat16, device="cpu")
    fp = footprint(table)
    assert fp["resident_bytes"] == fp["mapping_bytes"] == _page_round(table.nbytes)
    assert table.count_nonzero() == 0
    table[7].fill_(3.5)
    assert table[7].eq(3.5).all() and table.count_nonzero() == 1024


def test_prefault_without_madv_populate_write(monkeypatch):
    # An advice the kernel does not know fails with EINVAL, as MADV_POPULATE_WRITE does before
    # Linux 5.14: the fallback writes one byte per page.
    monkeypatch.setattr(host_memory, "_MADV_POPULATE_WRITE", 0x7FFF)
    table = pinned_host_table(1000, 1000, torch.float8_e4m3fn, device="cpu")
    fp = footprint(table)
    assert fp["resident_bytes"] == fp["mapping_bytes"] == _page_round(table.nbytes)
    assert table.view(torch.uint8).count_nonzero() == 0


def test_footprint_measures_faults():
    # empty_host_table does not prefault: footprint must see the pages arrive when written.
    table = empty_host_table(1024, 4096, torch.uint8)
    fp = footprint(table)
    assert fp["mapping_bytes"] == table.nbytes and fp["host_table"]
    assert fp["resident_bytes"] == 0
    table[:512].fill_(1)
    assert footprint(table)["resident_bytes"] == table.nbytes // 2


def test_footprint_of_other_tensors():
    plain = torch.empty(10)
    fp = footprint(plain)
    assert fp["storage_bytes"] == 40 and fp["mapping_bytes"] >= 40
    assert not fp["host_table"] and not fp["registered"]
    with pytest.raises(ValueError, match="footprint: table must be a CPU tensor"):
        footprint([1, 2])


# --- lifetime -----------------------------------------------------------------------------------


def test_unmapped_when_the_last_view_dies():
    table = pinned_host_table(1027, 4096, torch.uint8, device="cpu")  # 4 MiB + 12 KiB
    addr, size = table.data_ptr(), table.untyped_storage().nbytes()
    rows = table[5:9]
    alias = torch.empty(0, dtype=torch.uint8).set_(table.untyped_storage())  # not a view
    del table
    gc.collect()
    assert _vma_at(addr) == (addr, addr + size)
    del rows
    gc.collect()
    assert _vma_at(addr) == (addr, addr + size)
    assert alias[addr % 7] == 0  # still readable
    del alias
    gc.collect()
    assert _vma_at(addr) != (addr, addr + size)


def test_empty_host_table_keeps_its_contract():
    small = empty_host_table(3, 7, torch.bfloat16)
    assert small.shape == (3, 7) and small.dtype == torch.bfloat16
    big = empty_host_table(2561, 1024, torch.bfloat16)
    assert big.shape == (2561, 1024) and big.dtype == torch.bfloat16
    assert big.data_ptr() % HUGE == 0
    assert footprint(big)["mapping_bytes"] == _page_round(big.nbytes)
    plain = empty_host_table(2561, 1024, torch.bfloat16, huge_pages=False)
    assert not footprint(plain)["host_table"]


# --- registration -------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU build with one device, whose host_table_device_view is a Python stand-in with the
    C++ op's ownership: the view's storage holds the host storage it was made from, and
    "unregisters" when the last view of it dies. Yields the register/unregister events; an
    unregister records whether the memory was still mapped then."""
    events: list[tuple] = []

    def fake_view(flat: torch.Tensor, device: torch.device) -> torch.Tensor:
        addr, nbytes = flat.data_ptr(), flat.untyped_storage().nbytes()
        holder = (ctypes.c_uint8 * nbytes).from_address(addr)
        holder.keep_alive = flat
        weakref.finalize(
            holder, lambda: events.append(("unregister", addr, _vma_at(addr) is not None))
        )
        events.append(("register", addr))
        return torch.frombuffer(holder, dtype=torch.uint8)

    monkeypatch.setattr(host_memory, "_gpu_build", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.ops.qwen4exp, "host_table_device_view", fake_view)
    return events


def test_registered_once_and_released_with_the_table(fake_gpu):
    table = pinned_host_table(1027, 4096, torch.uint8)
    addr, size = table.data_ptr(), table.untyped_storage().nbytes()
    assert fake_gpu == [("register", addr)]
    assert footprint(table)["registered"]
    view = device_view(table)
    rows = device_view(table[3:])
    assert len(fake_gpu) == 1  # device_view reuses the registration
    assert rows.data_ptr() == addr + 3 * 4096
    del table
    gc.collect()
    # The device views keep the registration and the mapping.
    assert len(fake_gpu) == 1 and _vma_at(addr) == (addr, addr + size)
    del view, rows
    gc.collect()
    # Unregistered while still mapped, then unmapped.
    assert fake_gpu == [("register", addr), ("unregister", addr, True)]
    assert _vma_at(addr) != (addr, addr + size)


def test_registration_lasts_as_long_as_any_cpu_view(fake_gpu):
    table = pinned_host_table(1027, 4096, torch.uint8)
    addr, size = table.data_ptr(), table.untyped_storage().nbytes()
    tail = table[1000:]
    del table
    gc.collect()
    assert footprint(tail)["registered"] and len(fake_gpu) == 1
    del tail
    gc.collect()
    # No reference cycle: with no device view left, both go.
    assert fake_gpu == [("register", addr), ("unregister", addr, True)]
    assert _vma_at(addr) != (addr, addr + size)


def test_cpu_device_is_never_registered(fake_gpu):
    table = pinned_host_table(3, 7, torch.bfloat16, device="cpu")
    assert fake_gpu == [] and not footprint(table)["registered"]


@pytest.mark.skipif(_gpu(), reason="checks the machine without a GPU")
def test_registration_skipped_without_a_gpu():
    table = pinned_host_table(2561, 1024, torch.bfloat16)
    assert not footprint(table)["registered"] and footprint(table)["host_table"]
    with pytest.raises(RuntimeError, match="pinned_host_table: "):
        pinned_host_table(3, 7, torch.bfloat16, device="cuda:0")


@pytest.mark.skipif(not _gpu(), reason="needs a CUDA/ROCm device and a GPU build")
def test_pinned_on_the_gpu():
    table = pinned_host_table(2561, 1024, torch.bfloat16)
    addr, size = table.data_ptr(), table.untyped_storage().nbytes()
    assert footprint(table)["registered"] and table.is_pinned()
    view = device_view(table)
    assert view.is_cuda
    view[11].fill_(2.0)
    torch.cuda.synchronize()
    assert table[11].eq(2.0).all()  # zero-copy: the GPU wrote the host table
    del table
    gc.collect()
    assert _vma_at(addr) == (addr, addr + size)
    del view
    gc.collect()
    assert _vma_at(addr) != (addr, addr + size)


# --- NUMA ---------------------------------------------------------------------------------------

needs_mbind = pytest.mark.skipif(
    host_memory._SYS_MBIND is None or not os.path.exists("/proc/self/numa_maps"),
    reason="needs mbind (x86_64/aarch64 Linux) and /proc/self/numa_maps",
)


@needs_mbind
def test_bound_to_the_requested_node():
    node = host_memory._memory_nodes()[0]
    table = pinned_host_table(2561, 1024, torch.bfloat16, device="cpu", numa_node=node)
    assert footprint(table)["numa_policy"] == f"bind:{node}"
    assert footprint(table)["resident_bytes"] == _page_round(table.nbytes)
    unbound = pinned_host_table(3, 7, torch.bfloat16, device="cpu", numa_node=-1)
    assert footprint(unbound)["numa_policy"] == "default"


@needs_mbind
def test_single_node_machine_is_not_bound(fake_gpu, monkeypatch):
    monkeypatch.setattr(host_memory, "_memory_nodes", lambda: [0])
    monkeypatch.setattr(host_memory, "_gpu_numa_node", lambda device: pytest.fail("asked"))
    table = pinned_host_table(3, 7, torch.bfloat16)
    assert footprint(table)["numa_policy"] == "default"


@needs_mbind
def test_bound_to_the_gpu_node_on_a_multi_node_machine(fake_gpu, monkeypatch):
    node = host_memory._memory_nodes()[0]
    monkeypatch.setattr(host_memory, "_memory_nodes", lambda: [node, node + 1])
    monkeypatch.setattr(host_memory, "_gpu_numa_node", lambda device: node)
    table = pinned_host_table(3, 7, torch.bfloat16)
    assert footprint(table)["numa_policy"] == f"bind:{node}"


@needs_mbind
def test_failed_binding(fake_gpu, monkeypatch):
    # The kernel refuses a node that does not exist, as a container may refuse any mbind.
    missing = max(host_memory._memory_nodes()) + 1
    monkeypatch.setattr(host_memory, "_memory_nodes", lambda: [0, missing])
    monkeypatch.setattr(host_memory, "_gpu_numa_node", lambda device: missing)
    with pytest.warns(UserWarning, match="could not bind the table to the GPU's NUMA node"):
        table = pinned_host_table(3, 7, torch.bfloat16)
    assert footprint(table)["numa_policy"] == "default"
    with pytest.raises(OSError, match=f"NUMA node {missing}"):
        pinned_host_table(3, 7, torch.bfloat16, device="cpu", numa_node=missing)


def test_gpu_numa_node_from_sysfs(monkeypatch):
    devices = "/sys/bus/pci/devices"
    slots = sorted(os.listdir(devices)) if os.path.isdir(devices) else []
    if not slots:
        pytest.skip("no PCI devices in sysfs")
    domain, bus, rest = slots[0].split(":")
    slot = SimpleNamespace(
        pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16), pci_device_id=int(rest[:2], 16)
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: slot)
    with open(f"{devices}/{slots[0]}/numa_node") as f:
        assert host_memory._gpu_numa_node(torch.device("cuda", 0)) == int(f.read())
    slot.pci_domain_id = 0xFFFF
    assert host_memory._gpu_numa_node(torch.device("cuda", 0)) == -1


# --- bad arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((-1, 7, torch.bfloat16), {}, "rows must be >= 0, got -1"),
        ((3, -7, torch.bfloat16), {}, "width must be >= 0, got -7"),
        ((2.5, 7, torch.bfloat16), {}, "rows must be an int, got 2.5"),
        ((True, 7, torch.bfloat16), {}, "rows must be an int, got True"),
        ((3, 7, "bfloat16"), {}, "dtype must be a torch.dtype, got 'bfloat16'"),
        ((3, 7, torch.bfloat16), {"numa_node": -2}, "numa_node must be None, -1 or a node"),
        ((3, 7, torch.bfloat16), {"numa_node": 4096}, "numa_node 4096 is not a NUMA node"),
        ((3, 7, torch.bfloat16), {"device": "warp-drive"}, "device 'warp-drive' is not a device"),
    ],
)
def test_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(f"pinned_host_table: {message}")):
        pinned_host_table(*args, **kwargs)


def test_too_large_to_map():
    with pytest.raises(MemoryError, match="cannot be mapped"):
        pinned_host_table(2**40, 2**30, torch.bfloat16, device="cpu")


def test_the_old_module_name_is_this_module():
    """README documented ``qwen4exp_ext.host_table`` before the tables moved to ``tables/``
    (#49 item 4): that import still works, and is tables.host_memory itself, not a copy (one
    registration cache, one set of mappings, one monkeypatch target)."""
    import qwen4exp_ext.host_table as by_path
    from qwen4exp_ext import host_table
    from qwen4exp_ext.host_table import pinned_host_table as old_allocator

    assert by_path is host_memory and host_table is host_memory
    assert old_allocator is pinned_host_table
