"""Bad checkpoints for NGramEmbedding.load_weights: mismatched shards raise an exception that
names what is wrong and leave the table bit-identical; a streamed load that fails late refuses to
run until reloaded; safetensors files have every header checked before any is read. (Each kernel
op's bad inputs are in its folder: tests/<op>/test_bad_inputs.py.)
"""

from __future__ import annotations

import pytest
import torch

from bad_inputs_support import EXC, META, sentinel
from ngram_support import CONFIG, HEAD_DIM, ROWS, SHARD_ROWS
from qwen4exp_ext.layers import NGramEmbedding
from qwen4exp_ext.testing import assert_untouched, snapshot

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
