"""The GPU and CPU ngram_ids kernels reduce hashes with multiply-shift constants instead of a
64-bit division (csrc/hip/fast_divmod.h). This proves the arithmetic exact against the hardware
division on edge and random operands, by compiling the torch-free header with the host compiler."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_fast_divmod_matches_hardware_division(tmp_path):
    exe = tmp_path / "fast_divmod_check"
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-I",
            os.path.join(ROOT, "csrc"),
            os.path.join(ROOT, "tests", "cpp", "fast_divmod_check.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
    )
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok "), result.stdout
    assert int(result.stdout.split()[1]) > 1_000_000
