"""How the built modules link the C++ runtime.

Each module must load the shared libstdc++ that torch uses. A module with its own static copy
(a compiler that links -static-libstdc++, as on one GPU image seen here: setup.py's
SHARED_LIBSTDCXX) crashed formatting any integer into an error message: the first bad index with
debug checks on killed the process instead of raising. CI's compiler links the shared library
anyway; this test is for the machines whose compiler does not.
"""

from __future__ import annotations

import importlib
import struct
import sys

import pytest

import qwen4exp_ext
from qwen4exp_ext import simt

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="ELF shared objects: Linux"
)

PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_NEEDED, DT_STRTAB = 0, 1, 5


def needed_libraries(path: str) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF file: the libraries the dynamic
    linker loads for it, in order."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path}: not ELF64 LE"
    phoff, phentsize, phnum = (
        struct.unpack_from("<Q", data, 0x20)[0],
        *struct.unpack_from("<HH", data, 0x36),
    )
    loads, dynamic = [], None
    for i in range(phnum):
        kind, _, offset, vaddr, _, filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if kind == PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif kind == PT_DYNAMIC:
            dynamic = (offset, filesz)
    assert dynamic is not None, f"{path}: no dynamic section"

    def file_offset(address: int) -> int:
        for vaddr, offset, size in loads:
            if vaddr <= address < vaddr + size:
                return address - vaddr + offset
        raise AssertionError(f"{path}: address {address:#x} is in no loaded segment")

    entries = []
    for at in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, at)
        if tag == DT_NULL:
            break
        entries.append((tag, value))
    strtab = file_offset(next(value for tag, value in entries if tag == DT_STRTAB))
    names = []
    for tag, value in entries:
        if tag == DT_NEEDED:
            start = strtab + value
            names.append(data[start : data.index(b"\0", start)].decode())
    return names


def built_modules() -> list[str]:
    names = ["qwen4exp_ext._kernels"]
    names += [f"qwen4exp_ext._simt{wave}" for wave in simt.available()]
    return names


@pytest.mark.parametrize("name", built_modules())
def test_modules_load_the_shared_libstdcxx(name):
    assert qwen4exp_ext.build_info()  # the package (and its _kernels) imported
    path = importlib.import_module(name).__file__
    needed = needed_libraries(path)
    assert any(lib.startswith("libstdc++.so") for lib in needed), (
        f"{path} does not load the shared libstdc++ (it needs {needed}): the C++ runtime was "
        "linked into it statically, a second copy beside torch's (see setup.py SHARED_LIBSTDCXX)"
    )
