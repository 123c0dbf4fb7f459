"""The vLLM shims' own logic, without vLLM: the ngram_ids constants that ``ple_ngram_ids``
caches per head-sizes tensor (vLLM passes the sizes on every call) and passes to our kernel, and
the swap table as each supported vLLM release has it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import pytest
import torch

from ngram_support import spy_on_ngram_ids
from qwen4exp_ext import layout, ops, reference
from qwen4exp_ext.vllm import SUPPORTED_VLLM, shims
from qwen4exp_ext.vllm.shims import ple as ple_shims


@pytest.fixture(autouse=True)
def _empty_cache(monkeypatch):
    monkeypatch.setattr(ple_shims, "_HEAD_DIVMODS", OrderedDict())
    monkeypatch.setattr(ple_shims, "_CAPTURED_DIVMODS", [])


def sizes_of_layer(layer: int) -> torch.Tensor:
    return torch.tensor(layout.head_vocab_layout(20_000, 16, layer, 128).sizes)


def test_constants_are_computed_once_per_tensor():
    sizes = sizes_of_layer(0)
    first = ple_shims.head_divmod_for(sizes)
    assert torch.equal(first, ops.ngram_head_divmod(sizes))
    assert ple_shims.head_divmod_for(sizes) is first
    other = sizes_of_layer(1)
    assert torch.equal(ple_shims.head_divmod_for(other), ops.ngram_head_divmod(other))
    assert ple_shims.head_divmod_for(sizes) is first  # each layer has its own


def test_a_tensor_written_in_place_misses():
    sizes = sizes_of_layer(0)
    first = ple_shims.head_divmod_for(sizes)
    sizes.copy_(sizes_of_layer(2))  # a reload into the same tensor: a new _version
    again = ple_shims.head_divmod_for(sizes)
    assert again is not first
    assert torch.equal(again, ops.ngram_head_divmod(sizes_of_layer(2)))


def test_the_cache_keeps_the_most_recently_used(monkeypatch):
    """Past _HEAD_DIVMODS_MAX tensors the least recently used entry goes; a hit counts as a use,
    and an evicted tensor is simply computed again."""
    monkeypatch.setattr(ple_shims, "_HEAD_DIVMODS_MAX", 3)
    layers = [sizes_of_layer(i) for i in range(5)]
    first = ple_shims.head_divmod_for(layers[0])
    for sizes in layers[1:3]:
        ple_shims.head_divmod_for(sizes)
    assert ple_shims.head_divmod_for(layers[0]) is first  # now the most recent
    ple_shims.head_divmod_for(layers[3])  # evicts layers[1]
    assert len(ple_shims._HEAD_DIVMODS) == 3
    assert ple_shims.head_divmod_for(layers[0]) is first
    ple_shims.head_divmod_for(layers[4])  # evicts layers[2]
    assert len(ple_shims._HEAD_DIVMODS) == 3
    again = ple_shims.head_divmod_for(layers[1])  # gone, so computed anew
    assert torch.equal(again, ops.ngram_head_divmod(layers[1]))
    assert len(ple_shims._HEAD_DIVMODS) == 3


def test_sizes_that_are_not_all_positive_give_none():
    assert ple_shims.head_divmod_for(torch.tensor([1009, 0, 1013])) is None


def test_capture_never_computes(monkeypatch):
    """During CUDA graph capture: constants already cached are passed (and kept alive for the
    graph even once replaced); new sizes get None, with no host copy."""
    cached = sizes_of_layer(0)
    constants = ple_shims.head_divmod_for(cached)
    monkeypatch.setattr(ple_shims, "_capturing", lambda device: True)

    def no_compute(_sizes):
        raise AssertionError("computed during capture")

    monkeypatch.setattr(ops, "ngram_head_divmod", no_compute)
    assert ple_shims.head_divmod_for(cached) is constants
    assert ple_shims._CAPTURED_DIVMODS == [constants]
    assert ple_shims.head_divmod_for(sizes_of_layer(1)) is None
    assert len(ple_shims._HEAD_DIVMODS) == 1  # the miss left nothing behind


def test_compiling_passes_none(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert ple_shims.head_divmod_for(sizes_of_layer(0)) is None
    assert not ple_shims._HEAD_DIVMODS


def test_ple_ngram_ids_passes_the_cached_constants(monkeypatch):
    def vllm_original(*args):
        raise AssertionError("vLLM's function ran on a device our build serves")

    ple_ngram_ids = ple_shims._make_ple_ngram_ids(vllm_original)
    seen = spy_on_ngram_ids(monkeypatch)
    heads = layout.head_vocab_layout(20_000, 4, 0, 128)
    args = (
        torch.tensor([9, 7, 3, 5, 11]),
        torch.tensor([0, 4, 5], dtype=torch.int32),
        torch.tensor([[7, 7], [1, 2]]),
        torch.tensor(layout.layer_multipliers(128, 3, 42, 0)),
        torch.tensor(heads.sizes),
        torch.tensor(heads.offsets),
        7,
        2,
    )
    for _ in range(2):
        assert torch.equal(ple_ngram_ids(*args), reference.ngram_ids(*args))
    assert seen[0] is not None and seen[1] is seen[0]
    assert torch.equal(seen[0], ops.ngram_head_divmod(args[4]))


# ---- the table's releases ------------------------------------------------------------------


def _row(**changes) -> shims.Swap:
    """A row of the table as the oldest release has it, with ``changes`` (release -> Change)."""
    base = next(row for row in shims.SWAPS if row.name == "ple_ngram_ids")
    return replace(base, changes=tuple(changes.items()))


def test_every_release_gets_every_row_that_exists_in_it():
    labels = [row.label for row in shims.SWAPS]
    assert len(set(labels)) == len(labels)
    for release in SUPPORTED_VLLM:
        rows = shims.swaps_for(release)
        order = SUPPORTED_VLLM.index(release)
        assert [row.label for row in rows] == [
            row.label
            for row in shims.SWAPS
            if row.since is None or SUPPORTED_VLLM.index(row.since) <= order
        ]
        assert all(row.changes == () for row in rows)


def test_a_row_since_a_release_is_left_out_of_older_releases(monkeypatch):
    """vLLM 0.34.0's disk_offload class does not exist in 0.33.0: 0.33.0's table has no row
    for it (so the plugin never looks for it there), 0.34.0's and later ones' do."""
    label = "Qwen4ExpPLEDiskOffloadEmbedding.stage_rows"
    (row,) = [row for row in shims.SWAPS if row.label == label]
    assert row.since == "0.34.0"
    assert label not in [r.label for r in shims.swaps_for("0.33.0")]
    for release in SUPPORTED_VLLM[SUPPORTED_VLLM.index("0.34.0") :]:
        assert label in [r.label for r in shims.swaps_for(release)]
    monkeypatch.setattr(shims, "SWAPS", (*shims.SWAPS, replace(row, since="9.9.9")))
    with pytest.raises(ValueError, match=r"'9\.9\.9' is not in the swap table's releases"):
        shims.swaps_for("0.34.0")


def test_a_change_holds_from_its_release_on():
    """A change made by the second release is that release's row (and a later one's); the
    oldest keeps the row as written. Fields the change leaves None stay the row's."""
    oldest, newer = SUPPORTED_VLLM[0], SUPPORTED_VLLM[1]

    def make(original):
        return original

    change = shims.Change(owner="vllm.elsewhere:Moved", signature="(input_ids, *, new_flag=False)")
    row = _row(**{newer: change}, **{oldest: shims.Change(make=make)})
    first, second = row.for_release(oldest), row.for_release(newer)
    assert (first.owner, first.signature, first.make) == (row.owner, row.signature, make)
    assert (second.owner, second.signature) == (change.owner, change.signature)
    assert second.make is make and second.name == row.name and second.needs == row.needs
    assert second.label == "Moved.ple_ngram_ids"


def test_an_unknown_release_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'0\.32\.0' is not in the swap table's releases"):
        shims.swaps_for("0.32.0")
    with pytest.raises(ValueError, match=r"'9\.9\.9'"):
        _row(**{"9.9.9": shims.Change(signature="()")}).for_release(SUPPORTED_VLLM[0])
