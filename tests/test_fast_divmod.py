"""The GPU and CPU ngram_ids kernels reduce hashes with multiply-shift constants instead of a
64-bit division (csrc/common/fast_divmod.h). This proves the arithmetic exact against the hardware
division on edge and random operands, by compiling the torch-free header with the host compiler."""

from __future__ import annotations

import shutil

import pytest

from conftest import run_cpp_check


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_fast_divmod_matches_hardware_division(tmp_path):
    output = run_cpp_check(tmp_path, "fast_divmod_check")
    assert int(output.split()[1]) > 1_000_000
