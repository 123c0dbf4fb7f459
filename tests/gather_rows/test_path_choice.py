"""The CPU gather's choice of path (csrc/cpu/gather_rows.cpp, ops.cpu_gather_path): large
outputs take the path timed fastest on this machine, timed once per kind and thread count on
the first large gathers and kept; small ones the cached path; an explicit setting
(set_cpu_gather_path, set_cpu_gather_stream_bytes, QWEN4EXP_CPU_GATHER_STREAM_BYTES) wins over
the timing. The timing lives for the whole process, so the tests that watch it being made run in
a fresh one. That each path gives the reference's rows is test_kernel.py's (its ``cpu_path``
fixture pins each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gather_support import CPU_PATHS, cpu_gather_path
from qwen4exp_ext import ops

# Run in a fresh process: large bf16 gathers (the output just past the size from which the
# paths are timed), each checked against index_select, with the figures printed as JSON.
_TIMING_SCRIPT = """
import json, sys
import torch
from qwen4exp_ext import ops

torch.set_num_threads(int(sys.argv[1]))
rows, heads, width = 100_000, 16, 160
gen = torch.Generator().manual_seed(0)
table = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
large = ops.cpu_gather_stream_bytes()
if large < 0:  # no streaming path: past what a thread keeps in cache (L2 + 4 MiB of L3)
    large = torch.get_num_threads() * (8 << 20)
tokens = -(-large // (heads * width * 2)) + 1
report = {"large": large, "before": ops.cpu_gather_path(), "small": ops.cpu_gather_path(1024)}

def gather(tokens):
    ids = torch.randint(-5, rows + 5, (tokens, heads), generator=gen)
    got = ops.gather_rows(table, ids)
    expected = torch.index_select(table, 0, ids.clamp(0, rows - 1).flatten()).view(tokens, -1)
    expected[((ids < 0) | (ids >= rows)).repeat_interleave(width, dim=1)] = 0
    assert torch.equal(got, expected), "wrong rows"

for _ in range(20):  # small gathers never time
    gather(8)
report["after_small"] = ops.cpu_gather_timing()
report["paths"] = []
ops.cpu_gather_calls(reset=True)
for _ in range(int(sys.argv[2])):
    gather(tokens)
    report["paths"].append(ops.cpu_gather_path())
report["calls"] = ops.cpu_gather_calls(reset=True)["path"]
report["timing"] = ops.cpu_gather_timing()
report["converting"] = ops.cpu_gather_timing(converting=True)
for _ in range(4):
    gather(tokens)
report["calls_after"] = ops.cpu_gather_calls()["path"]
report["timing_after"] = ops.cpu_gather_timing()
torch.set_num_threads(3 - torch.get_num_threads())  # the other of 1 and 2: not timed yet
report["other_threads"] = ops.cpu_gather_path()
print(json.dumps(report))
"""


def _run(threads: int, large_calls: int, **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _TIMING_SCRIPT, str(threads), str(large_calls)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("threads", [1, 2])
def test_the_timed_choice_is_made_once_and_kept(threads):
    """The first 2·(paths) large gathers run each path in turn, twice (each giving the right
    rows; a path far slower than the fastest is not run again); then the fastest is chosen,
    reported with its figures, and every later large gather takes it without timing again.
    Small gathers never time; other kinds and thread counts time on their own."""
    paths = len(CPU_PATHS)
    report = _run(threads, 2 * paths)
    assert report["before"] == "untimed"
    assert report["small"] == "cached"
    assert report["after_small"] is None
    # Each path ran at least once while timing, the first (cached) twice; a path far slower than
    # the fastest gave its second call to the fastest so far. The choice came with the last one.
    calls = report["calls"]
    assert sum(calls.values()) == 2 * paths
    assert all(calls[p] >= 1 for p in CPU_PATHS) and calls[CPU_PATHS[0]] >= 2
    assert report["paths"][:-1] == ["untimed"] * (2 * paths - 1)
    timing = report["timing"]
    assert timing is not None and report["paths"][-1] == timing["path"]
    assert timing["threads"] == threads
    assert timing["output_bytes"] >= report["large"]
    seconds = timing["seconds"]
    assert sorted(seconds) == sorted(CPU_PATHS) and all(s > 0 for s in seconds.values())
    assert timing["path"] == min(seconds, key=seconds.get)  # never a slower path
    # Kept: later large gathers take the chosen path, and nothing is timed again.
    assert report["calls_after"] == {p: 4 * (p == timing["path"]) for p in ops.CPU_GATHER_PATHS}
    assert report["timing_after"] == timing
    assert report["converting"] is None
    assert report["other_threads"] == "untimed"


def test_an_explicit_threshold_wins_over_the_timing():
    """With QWEN4EXP_CPU_GATHER_STREAM_BYTES set, large gathers take the threshold's path from
    the first call on and are never timed."""
    report = _run(1, 8, QWEN4EXP_CPU_GATHER_STREAM_BYTES="0")
    expected = "stream" if "stream" in CPU_PATHS else "cached"
    assert report["before"] == report["small"] == expected
    assert report["calls"][expected] == 8 and sum(report["calls"].values()) == 8
    assert report["timing"] is None and report["timing_after"] is None


def test_the_settings_win_over_the_timing_in_process():
    """set_cpu_gather_path pins a path for every size, over a threshold too; a threshold picks
    by size; None gives the next one back. The gathers' counts follow the path they took."""
    import torch

    table = torch.randn(1000, 32).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (64, 4))
    previous_path = ops.set_cpu_gather_path(None)
    previous_bytes = ops.set_cpu_gather_stream_bytes(2**62)
    try:
        assert ops.cpu_gather_path(2**61) == "cached"  # the threshold, not the timing
        for path in CPU_PATHS:
            with cpu_gather_path(path):
                assert ops.cpu_gather_path() == ops.cpu_gather_path(0) == path
                assert ops.cpu_gather_path(converting=True) == path
                ops.cpu_gather_calls(reset=True)
                ops.gather_rows(table, ids)
                counts = ops.cpu_gather_calls()["path"]
                assert counts == {p: int(p == path) for p in ops.CPU_GATHER_PATHS}
        if "stream" in CPU_PATHS:
            ops.set_cpu_gather_stream_bytes(100)
            assert ops.cpu_gather_path(99) == "cached" and ops.cpu_gather_path(100) == "stream"
    finally:
        ops.set_cpu_gather_path(previous_path)
        ops.set_cpu_gather_stream_bytes(previous_bytes)


def test_the_fp8_lookup_of_each_gather_is_counted():
    """An fp8 gather counts the lookup that converted it; a bf16 one none."""
    import torch

    table = torch.randint(0, 0x70, (500, 64), dtype=torch.uint8).view(torch.float8_e4m3fn)
    ids = torch.randint(0, 500, (16, 4))
    ops.cpu_gather_calls(reset=True)
    ops.gather_rows(table.view(torch.uint8).to(torch.bfloat16), ids)
    assert sum(ops.cpu_gather_calls()["fp8_lookup"].values()) == 0
    ops.gather_rows(table, ids, scale=torch.tensor([0.5]), out_dtype=torch.bfloat16)
    lookups = ops.cpu_gather_calls(reset=True)["fp8_lookup"]
    assert lookups == {k: int(k == ops.cpu_gather_fp8_lookup()) for k in lookups}
    assert sum(ops.cpu_gather_calls()["fp8_lookup"].values()) == 0  # reset


def test_bad_settings_are_clear_errors():
    previous = ops.set_cpu_gather_path(None)
    try:
        for bad in ("streaming", "", 1, True):
            with pytest.raises(
                ValueError, match="path must be 'cached', 'stream', 'plain' or None"
            ):
                ops.set_cpu_gather_path(bad)
        if "stream" not in CPU_PATHS:
            with pytest.raises(ValueError, match="stream path needs x86-64 with AVX"):
                ops.set_cpu_gather_path("stream")
        for bad in (-1, 1.5, "1 MB", True):
            with pytest.raises(ValueError, match="output_bytes must be an int >= 0 or None"):
                ops.cpu_gather_path(bad)
        assert ops.set_cpu_gather_path(None) is None  # nothing was pinned by the bad calls
    finally:
        ops.set_cpu_gather_path(previous)
