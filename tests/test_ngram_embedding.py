"""NGramEmbedding (SPEC.md §2-§4, seed 000): buffers, forward == reference ids + gather, and
load_weights / load_safetensors with every error the seed raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen4exp_ext import layout, reference
from qwen4exp_ext.layers import NGramEmbedding

CONFIG = SimpleNamespace(
    vocab_size=97,
    ngram_size=3,
    heads_per_ngram=2,
    ple_embed_dim=24,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=16,
    eos_token_id=5,
    seed=7,
    split_ngram_parts=7,
)
HEADS = layout.head_vocab_layout(50, 4, 1, 16)
ROWS = HEADS.padded_rows
HEAD_DIM = 6
SHARD_ROWS = -(-ROWS // 7)


def checkpoint(table: torch.Tensor, parts: int = 7) -> list[tuple[str, torch.Tensor]]:
    """The table as ``ngram_embedding.shard_<i>.weight`` pieces of ceil(rows/parts) rows."""
    size = -(-table.shape[0] // parts)
    return [
        (f"ngram_embedding.shard_{i}.weight", table[i * size : (i + 1) * size].clone())
        for i in range(parts)
    ]


def batch():
    input_ids = torch.tensor([9, 5, 3, 11, 40, 5, 96, 0, 1])
    qsl = torch.tensor([0, 4, 9], dtype=torch.int32)
    context = torch.tensor([[5, 5], [17, 23]])
    return input_ids, qsl, context


def expected(table, module, scale=None, out_dtype=None):
    ids = reference.ngram_ids(
        *batch(),
        module.layer_multipliers,
        module.ngram_heads_vocab_sizes,
        module.ngram_heads_offsets,
        CONFIG.eos_token_id,
        2,
    )
    return reference.gather_rows(table, ids, scale=scale, out_dtype=out_dtype)


def test_buffers_follow_spec_layout():
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu")
    assert m.layer_multipliers.tolist() == layout.layer_multipliers(97, 3, 7, 1)
    assert m.ngram_heads_vocab_sizes.tolist() == list(HEADS.sizes)
    assert m.ngram_heads_offsets.tolist() == list(HEADS.offsets)
    assert m.weight.shape == (ROWS, HEAD_DIM) and m.weight.dtype == torch.bfloat16
    assert {n for n, _ in m.named_buffers()} == {
        "layer_multipliers",
        "ngram_heads_vocab_sizes",
        "ngram_heads_offsets",
    }


@pytest.mark.parametrize("placement", ["cpu", "device"])
def test_load_weights_and_forward(placement):
    table = torch.randn(ROWS, HEAD_DIM).to(torch.bfloat16)
    m = NGramEmbedding(CONFIG, layer_index=1, placement=placement)
    weights = checkpoint(table) + [
        ("ngram_embedding.hashstats_counts", torch.zeros(3)),
        ("token_lookup", torch.zeros(4)),
        ("layer_multipliers", m.layer_multipliers.clone().to(torch.int32)),
        ("ngram_heads_offsets", m.ngram_heads_offsets.clone()),
        ("ngram_heads_vocab_sizes", m.ngram_heads_vocab_sizes.clone()),
    ]
    loaded = m.load_weights(iter(weights))
    assert loaded == {
        "ngram_embedding.weight",
        "layer_multipliers",
        "ngram_heads_offsets",
        "ngram_heads_vocab_sizes",
    }
    assert torch.equal(m.weight, table)
    got = m(*batch())
    assert got.shape == (9, 24)
    assert torch.equal(got, expected(table, m))


def test_buffers_are_copied_exactly_and_overwrite_computed_ones():
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu")
    shipped = torch.tensor([2**62 + 1, -(2**63), 2**63 - 1])  # not representable in float
    m.load_weights([("layer_multipliers", shipped)])
    assert m.layer_multipliers.tolist() == shipped.tolist()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str)
def test_fp8_table_with_scale(dtype):
    raw = torch.randint(0, 0x70, (ROWS, HEAD_DIM), dtype=torch.uint8)
    table = raw.view(dtype)
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=dtype)
    m.load_weights(checkpoint(table) + [("ngram_embedding.weight_scale", torch.tensor(0.0625))])
    got = m(*batch())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected(table, m, scale=torch.tensor([0.0625])))
    with pytest.raises(ValueError, match="an fp8 table loads fp8 rows"):
        m.load_weights(checkpoint(table.to(torch.bfloat16)))


@pytest.mark.parametrize(
    "weights,message",
    [
        (
            [("ngram_embedding.shard_7.weight", torch.zeros(SHARD_ROWS, HEAD_DIM))],
            "shard index 7 exceeds split_ngram_parts=7",
        ),
        (
            [("ngram_embedding.shard_0.weight", torch.zeros(SHARD_ROWS - 1, HEAD_DIM))],
            rf"Shape mismatch for PLE embedding shard 0 .*expected \({SHARD_ROWS}, 6\), got "
            rf"\({SHARD_ROWS - 1}, 6\)",
        ),
        (
            [("ngram_embedding.shard_6.weight", torch.zeros(SHARD_ROWS, HEAD_DIM))],
            rf"shard 6 .*expected \({ROWS - 6 * SHARD_ROWS}, 6\)",
        ),
        (
            [("ngram_embedding.shard_1.weight", torch.zeros(SHARD_ROWS, HEAD_DIM + 1))],
            "Shape mismatch for PLE embedding shard 1",
        ),
        (
            [("layer_multipliers", torch.zeros(4, dtype=torch.long))],
            r"Shape mismatch for layer_multipliers: expected \(3,\), got \(4,\)",
        ),
        ([("ngram_heads_offsets", torch.zeros(4))], "must be an integer tensor"),
        ([("ngram_embedding.weight_scale", torch.ones(1))], "not fp8"),
        ([("something.else", torch.zeros(1))], "unexpected checkpoint tensor 'something.else'"),
    ],
)
def test_load_errors(weights, message):
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        m.load_weights(weights)


def test_sharded_module_loads_only_its_rows():
    table = torch.randn(ROWS, HEAD_DIM)
    parts = []
    for rank in range(3):
        m = NGramEmbedding(
            CONFIG, layer_index=1, placement="cpu", dtype=torch.float32, shard=(rank, 3)
        )
        m.load_weights(checkpoint(table))
        assert torch.equal(m.weight, table[m.vocab_start : m.vocab_end])
        parts.append(m.lookup(m_ids(m), reduce=False))
    full = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    full.load_weights(checkpoint(table))
    assert torch.equal(parts[0] + parts[1] + parts[2], full.lookup(m_ids(full)))


def m_ids(m):
    return reference.ngram_ids(
        *batch(),
        m.layer_multipliers,
        m.ngram_heads_vocab_sizes,
        m.ngram_heads_offsets,
        CONFIG.eos_token_id,
        2,
    )


def test_load_safetensors_reads_owned_slices(tmp_path):
    from safetensors.torch import save_file

    table = torch.randn(ROWS, HEAD_DIM).to(torch.bfloat16)
    tensors = dict(checkpoint(table))
    tensors["ngram_embedding.hashstats_x"] = torch.zeros(2)
    first = {k: v for k, v in tensors.items() if k.endswith(("_0.weight", "_1.weight"))}
    rest = {k: v for k, v in tensors.items() if k not in first}
    save_file({f"model.ple.{k}": v for k, v in first.items()}, tmp_path / "a.safetensors")
    save_file({f"model.ple.{k}": v for k, v in rest.items()}, tmp_path / "b.safetensors")
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    for shard in (None, (1, 2)):
        m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", shard=shard)
        assert m.load_safetensors(files, prefix="model.ple.") == {"ngram_embedding.weight"}
        assert torch.equal(m.weight, table[m.vocab_start : m.vocab_end])


def test_pinned_placement_needs_a_gpu_build_or_device():
    if torch.cuda.is_available():
        pytest.skip("GPU present: covered by the GPU test run")
    with pytest.raises((RuntimeError, ValueError)):
        NGramEmbedding(CONFIG, layer_index=1, placement="pinned", device="cuda")


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="placement must be"):
        NGramEmbedding(CONFIG, placement="disk")
    with pytest.raises(ValueError, match="divisible by the number of n-gram heads"):
        NGramEmbedding(SimpleNamespace(**{**vars(CONFIG), "ple_embed_dim": 25}))
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        NGramEmbedding(CONFIG, placement="cpu", shard=(2, 2))
