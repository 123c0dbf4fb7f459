"""Every op, captured in a CUDA graph and replayed, equals the same op run eagerly.

vLLM captures its decode steps in CUDA graphs: a kernel whose launcher reads a tensor on the host
(a sync), allocates, or caches a pointer or a value at capture time fails the capture or replays
stale work. Each op's valid baseline from the bad-input tables is captured once; then its inputs
are rewritten in place (new values, ids pointing at other rows) and the graph is replayed, twice,
against eager calls on the same new values, outputs and in-out state (the conv's) compared bit
for bit. Runs where there is a GPU and a GPU build (tools/check-gpu.sh)."""

from __future__ import annotations

import pytest
import torch

from conftest import devices
from gather_rows import bad_inputs as gather_rows_cases
from ngram_gather_rows import bad_inputs as ngram_gather_rows_cases
from ngram_ids import bad_inputs as ngram_ids_cases
from ple_conv import bad_inputs as ple_conv_cases
from ple_gate import bad_inputs as ple_gate_cases
from qwen4exp_ext.testing import assert_exact

# Every op's valid baselines, from its folder's bad-input specs (tests/<op>/bad_inputs.py).
OPS = {
    **ngram_ids_cases.OPS,
    **ngram_gather_rows_cases.OPS,
    **gather_rows_cases.OPS,
    **ple_gate_cases.OPS,
    **ple_conv_cases.OPS,
}

pytestmark = pytest.mark.skipif("cuda" not in devices(), reason="needs a GPU and a GPU build")


def _on_cuda(args: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _rewrite_inputs(args: dict, written: tuple[str, ...], step: int) -> None:
    """New values, in place, for every input the op only reads: floats scaled, indices moved to
    other valid rows (ids and n-gram input tokens), so a replay that reused what it saw at capture
    would differ from the eager call."""
    for name, t in args.items():
        if not isinstance(t, torch.Tensor) or name in written:
            continue
        if t.dtype.is_floating_point:
            t.copy_((t.float() * (0.5 + step) + 0.25).to(t.dtype))
        elif name == "ids":
            t.copy_((t + 3 + step) % 10)  # the baselines' tables have 10 rows
        elif name == "input_ids":
            t.copy_((t * 7 + step) % 97)  # the n-gram baseline's vocabulary is 97


@pytest.mark.parametrize("op", sorted(OPS))
def test_cuda_graph_replay_equals_eager(op: str) -> None:
    make, run, written = OPS[op]
    eager, graphed = _on_cuda(make()), _on_cuda(make())
    # Warm-up on a side stream (first launches load modules, allocate workspaces), as
    # torch.cuda.graph asks; its own arguments, so `graphed` is untouched until the first replay.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(_on_cuda(make()))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(dict(graphed))
    for step in range(2):
        _rewrite_inputs(eager, written, step)
        _rewrite_inputs(graphed, written, step)
        run(dict(eager))
        graph.replay()
        torch.cuda.synchronize()
        for name in written:
            assert_exact(graphed[name], eager[name], f"{op} {name} (replay {step})", bitwise=True)
