"""Bad inputs to every public op and to NGramEmbedding.load_weights: each one raises an exception
that names the offending argument and leaves every output and state tensor bit-identical
(outputs are filled with a sentinel pattern before the call). A few "data, never errors" cases
check inputs that must not raise; each op's own bad inputs are in its folder
(tests/<op>/test_bad_inputs.py).

Each case (the table is tests/bad_inputs_support.py) starts from one valid baseline per op and
overrides one argument. The op cases run on
every kernel backend with the CPU tensors of the table: the CPU kernels and the SIMT emulator's
HIP kernels, whose host glue is the GPU build's (tests/test_gpu_debug_checks.py moves them to a
GPU). There, the DATA_ONLY cases, bad index values that only the data shows, are not errors
without debug checks (the GPU kernels never read index data on the host), and that test file
covers them.
"""

from __future__ import annotations

import pytest
import torch

from bad_inputs_support import (
    CASES,
    DATA_CASES,
    EXC,
    META,
    OPS,
    sentinel,
)
from conftest import backends
from ngram_support import CONFIG, HEAD_DIM, ROWS, SHARD_ROWS
from qwen4exp_ext.layers import NGramEmbedding
from qwen4exp_ext.testing import assert_untouched, snapshot

_DATA_OVERRIDES = {case.values[1] for case in DATA_CASES}
CPU_BACKENDS = [b for b in backends() if b.device == "cpu"]


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=str)
@pytest.mark.parametrize("op,override,match,exc", CASES)
def test_bad_input_raises_and_writes_nothing(backend, op, override, match, exc):
    if backend.reads_indices_on_device and override in _DATA_OVERRIDES:
        pytest.skip("an index value, not an error without debug checks on this backend")
    baseline, run, mutable = OPS[op]
    args = baseline()
    override(args)
    outputs = {name: args[name] for name in mutable}
    before = snapshot(outputs)
    with pytest.raises(exc, match=match):
        run(dict(args), backend.ops)
    assert_untouched(before, outputs)


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=str)
@pytest.mark.parametrize("op", sorted(OPS))
def test_baselines_are_valid(backend, op):
    baseline, run, _ = OPS[op]
    run(baseline(), backend.ops)


# ---- NGramEmbedding.load_weights: mismatched checkpoint shards --------------------------------

LAST_ROWS = ROWS - 6 * SHARD_ROWS


def shard(i, rows, width=HEAD_DIM, dtype=torch.float32):
    return (f"ngram_embedding.shard_{i}.weight", torch.ones(rows, width, dtype=dtype))


LOAD_CASES = [
    pytest.param([shard(7, SHARD_ROWS)], "shard index 7", id="index-eq-parts"),
    pytest.param([shard(12, SHARD_ROWS)], "shard index 12", id="index-past-parts"),
    pytest.param([shard(0, SHARD_ROWS - 1)], "shard 0", id="rows-short"),
    pytest.param([shard(0, SHARD_ROWS + 1)], "shard 0", id="rows-long"),
    pytest.param([shard(1, SHARD_ROWS, HEAD_DIM + 1)], "shard 1", id="width-wide"),
    pytest.param([shard(2, SHARD_ROWS, HEAD_DIM - 1)], "shard 2", id="width-narrow"),
    pytest.param([shard(6, SHARD_ROWS)], "shard 6", id="last-shard-full-size"),
    pytest.param(
        [("ngram_embedding.shard_3.weight", torch.ones(SHARD_ROWS))], "shard 3", id="rank-1"
    ),
    pytest.param(
        [("layer_multipliers", torch.zeros(4, dtype=torch.long))],
        "layer_multipliers",
        id="multipliers-shape",
    ),
    pytest.param(
        [("ngram_heads_offsets", torch.zeros(4))], "ngram_heads_offsets", id="offsets-float"
    ),
    pytest.param(
        [("ngram_embedding.weight_scale", torch.ones(1))], "weight_scale", id="scale-non-fp8"
    ),
    pytest.param(
        [("ngram_embedding.shard_0.weight", torch.empty(SHARD_ROWS, HEAD_DIM, device=META))],
        "shard_0.weight.*meta",
        id="shard-meta",
    ),
    pytest.param(
        [shard(4, SHARD_ROWS, dtype=torch.int32)], "shard_4.weight.*floating", id="rows-int"
    ),
    # A bad tensor after good ones: a list is checked in full first, so nothing is written.
    pytest.param(
        [shard(0, SHARD_ROWS), shard(1, SHARD_ROWS), shard(2, SHARD_ROWS - 1)],
        "shard 2",
        id="good-shards-then-bad",
    ),
    pytest.param(
        [("layer_multipliers", torch.arange(3)), shard(5, SHARD_ROWS), ("bogus", torch.ones(1))],
        "bogus",
        id="good-buffer-then-unknown",
    ),
]


@pytest.mark.parametrize("weights,match", LOAD_CASES)
def test_load_weights_mismatch_raises_and_writes_nothing(weights, match):
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    with torch.no_grad():
        m.weight.copy_(sentinel(tuple(m.weight.shape), torch.float32))
    state = {"weight": m.weight.detach(), **dict(m.named_buffers())}
    before = snapshot(state)
    with pytest.raises(EXC, match=match):
        m.load_weights(weights)
    assert_untouched(before, state)


def test_streamed_load_failing_late_refuses_to_run_until_reloaded():
    """A lazy iterator cannot be checked ahead: rows of earlier shards are written, buffers are
    not, and the module raises on use (never silent half-loaded rows) until a load succeeds."""
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    multipliers = m.layer_multipliers.clone()
    good = [shard(i, SHARD_ROWS if i < 6 else LAST_ROWS) for i in range(7)]
    stream = iter([("layer_multipliers", torch.arange(3)), good[0], shard(1, SHARD_ROWS + 1)])
    with pytest.raises(ValueError, match="shard 1") as info:
        m.load_weights(stream)
    assert "refuses to run" in "".join(getattr(info.value, "__notes__", []))
    assert torch.equal(m.layer_multipliers, multipliers)  # staged buffers were not written
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="load the checkpoint again"):
        m.lookup(ids)
    m.load_weights(iter(good))
    assert m.lookup(ids).abs().sum() > 0


def test_safetensors_load_checks_every_header_first(tmp_path):
    from safetensors.torch import save_file

    save_file(dict([shard(0, SHARD_ROWS)]), tmp_path / "a.safetensors")
    save_file(dict([shard(1, SHARD_ROWS + 1)]), tmp_path / "b.safetensors")
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    with torch.no_grad():
        m.weight.copy_(sentinel(tuple(m.weight.shape), torch.float32))
    before = snapshot({"weight": m.weight.detach()})
    with pytest.raises(ValueError, match="shard 1"):
        m.load_safetensors([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert_untouched(before, {"weight": m.weight.detach()})


# ---- data, never errors ----------------------------------------------------------------------
