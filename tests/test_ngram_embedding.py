"""NGramEmbedding (SPEC §2-§4, vLLM's Qwen4ExpNGramEmbedding): buffers, forward == reference ids
+ gather, and load_weights / load_safetensors with every error vLLM's loader raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import devices
from ngram_support import CONFIG, HEAD_DIM, HEADS, ROWS, SHARD_ROWS, spy_on_ngram_ids
from qwen4exp_ext import layout, ops, reference
from qwen4exp_ext.layers import NGramEmbedding
from qwen4exp_ext.testing import assert_untouched, snapshot


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
        "ngram_heads_divmod",  # derived from the sizes: not in the state dict
    }
    assert "ngram_heads_divmod" not in m.state_dict()
    assert torch.equal(m.ngram_heads_divmod, ops.ngram_head_divmod(m.ngram_heads_vocab_sizes))


def other_sizes(m: NGramEmbedding) -> torch.Tensor:
    """Valid head sizes other than the layer's (each fits its rows: the next smaller size)."""
    return m.ngram_heads_vocab_sizes - 2


def test_forward_passes_the_layers_constants(monkeypatch):
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    seen = spy_on_ngram_ids(monkeypatch)
    m(*batch())
    assert len(seen) == 1 and seen[0] is m.ngram_heads_divmod


@pytest.mark.parametrize("fused", [True, False])
def test_forward_with_or_without_the_fused_op(monkeypatch, fused):
    """forward's two paths (ops.ngram_gather_rows where FUSED_LOOKUP_DEVICES has the table's
    device type, else ngram_ids then gather_rows) give the reference rows."""
    from qwen4exp_ext.layers import ngram_embedding

    devices_ = ("cpu",) if fused else ()
    monkeypatch.setattr(ngram_embedding, "FUSED_LOOKUP_DEVICES", devices_)
    table = torch.randn(ROWS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    m.load_weights(checkpoint(table))
    assert torch.equal(m(*batch()), expected(table, m, out_dtype=torch.float32))


def test_constants_follow_sizes_loaded_by_load_weights(monkeypatch):
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    address = m.ngram_heads_divmod.data_ptr()
    sizes = other_sizes(m)
    m.load_weights([("ngram_heads_vocab_sizes", sizes.to(torch.int32))])
    assert torch.equal(m.ngram_heads_vocab_sizes, sizes)
    assert torch.equal(m.ngram_heads_divmod, ops.ngram_head_divmod(sizes))
    assert m.ngram_heads_divmod.data_ptr() == address  # in place: a captured graph sees it
    seen = spy_on_ngram_ids(monkeypatch)
    got = m(*batch())
    assert seen[0] is m.ngram_heads_divmod
    assert torch.equal(got, expected(m.weight.detach(), m, out_dtype=torch.float32))


def test_constants_follow_sizes_loaded_by_load_state_dict():
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    state = m.state_dict()
    sizes = other_sizes(m)
    state["ngram_heads_vocab_sizes"] = sizes
    m.load_state_dict(state)
    assert torch.equal(m.ngram_heads_divmod, ops.ngram_head_divmod(sizes))
    # assign=True replaces the buffer tensors themselves
    state = {k: v.clone() for k, v in m.state_dict().items()}
    state["ngram_heads_vocab_sizes"] = torch.tensor(HEADS.sizes)
    m.load_state_dict(state, assign=True)
    assert torch.equal(m.ngram_heads_divmod, ops.ngram_head_divmod(torch.tensor(HEADS.sizes)))


def test_constants_keep_their_values_for_sizes_that_are_not_positive():
    """A derived buffer does not fail a load: such sizes are the kernels' to report."""
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.float32)
    before = m.ngram_heads_divmod.clone()
    m.load_weights([("ngram_heads_vocab_sizes", torch.tensor([5, 0, 7, 9]))])
    assert torch.equal(m.ngram_heads_divmod, before)
    with pytest.raises(RuntimeError, match=r"ngram_heads_vocab_sizes\[1\] must be positive"):
        m(*batch())


@pytest.mark.parametrize("target", ["meta", *(d for d in devices() if d != "cpu")])
def test_constants_move_with_the_module(target):
    m = NGramEmbedding(CONFIG, layer_index=1, placement="device", dtype=torch.float32)
    m.to(target)
    assert m.ngram_heads_divmod.device == m.ngram_heads_vocab_sizes.device
    assert m.ngram_heads_divmod.device.type == target
    if target != "meta":
        want = ops.ngram_head_divmod(torch.tensor(HEADS.sizes))
        assert torch.equal(m.ngram_heads_divmod.cpu(), want)


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


# --- NVFP4 tables (vLLM's layout: packed E2M1 codes, e4m3 block scales, one global scale) -----

NVFP4_CONFIG = SimpleNamespace(**{**vars(CONFIG), "ple_embed_dim": 128})  # head dim 32: 2 blocks
NVFP4_HEAD_DIM = 32
NVFP4_BLOCKS = NVFP4_HEAD_DIM // reference.NVFP4_BLOCK
GLOBAL_SCALE = 0.37
E4M3 = torch.float8_e4m3fn


def nvfp4_table(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed rows (every byte: every E2M1 code in both nibbles) and e4m3 block scales:
    positive normals and subnormals (bytes 0x01-0x5f, never NaN), some negative."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (ROWS, NVFP4_HEAD_DIM // 2), dtype=torch.uint8, generator=gen)
    bits = torch.randint(0x01, 0x60, (ROWS, NVFP4_BLOCKS), dtype=torch.uint8, generator=gen)
    negative = torch.rand(ROWS, NVFP4_BLOCKS, generator=gen) < 0.1
    bits = torch.where(negative, bits | 0x80, bits)
    return packed, bits.view(E4M3)


def nvfp4_checkpoint(
    packed: torch.Tensor, scales: torch.Tensor, global_scale=GLOBAL_SCALE, per_shard=False
) -> list[tuple[str, torch.Tensor]]:
    """vLLM's NVFP4 layout: rows and block scales in ``split_ngram_parts`` shards, the global
    scale once (or repeated per shard)."""
    weights = []
    for i in range(7):
        rows = slice(i * SHARD_ROWS, (i + 1) * SHARD_ROWS)
        weights.append((f"ngram_embedding.shard_{i}.weight", packed[rows].clone()))
        weights.append((f"ngram_embedding.shard_{i}.weight_scale", scales[rows].clone()))
        if per_shard:
            weights.append(
                (f"ngram_embedding.shard_{i}.weight_scale_2", torch.tensor(global_scale))
            )
    if not per_shard:
        weights.append(("ngram_embedding.weight_scale_2", torch.tensor([global_scale])))
    return weights


def every_row_ids() -> torch.Tensor:
    """Every row once, and ids outside the table (zero rows): [81, 4]."""
    return torch.cat([torch.arange(ROWS), torch.tensor([-1, ROWS, ROWS + 5, -7])]).reshape(-1, 4)


def nvfp4_expected(packed, scales, ids, out_dtype=None, global_scale=GLOBAL_SCALE):
    """The oracle on the whole table."""
    return reference.gather_rows(
        packed, ids, scale=torch.tensor([global_scale]), block_scales=scales, out_dtype=out_dtype
    )


def assert_same_state(before: dict, m: torch.nn.Module) -> None:
    """m's state has the names of the snapshot ``before``, each bit for bit as it was."""
    after = m.state_dict()
    assert after.keys() == before.keys()
    assert_untouched(before, after)


def placements():
    """(placement, device): CPU tables always; device and pinned GPU tables on a GPU build."""
    found = [("cpu", None), ("device", None)]
    if "cuda" in devices():
        found += [("device", "cuda"), ("pinned", "cuda")]
    return found


def save_nvfp4(tmp_path, weights, prefix="model.ple.") -> list:
    """The checkpoint in two files, shards 0-2 in the first (and the global scale in the
    second)."""
    from safetensors.torch import save_file

    first = {prefix + k: v for k, v in weights if k.startswith(SHARD_PREFIXES[:3])}
    rest = {prefix + k: v for k, v in weights if prefix + k not in first}
    save_file(first, tmp_path / "a.safetensors")
    save_file(rest, tmp_path / "b.safetensors")
    return [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]


SHARD_PREFIXES = tuple(f"ngram_embedding.shard_{i}." for i in range(7))


def load_nvfp4(m, weights, source: str, tmp_path) -> set[str]:
    if source == "dict":
        return m.load_weights(dict(weights))
    if source == "list":
        return m.load_weights(weights)
    if source == "iterator":
        return m.load_weights(iter(weights))
    assert source == "safetensors"
    return m.load_safetensors(save_nvfp4(tmp_path, weights), prefix="model.ple.")


@pytest.mark.parametrize("source", ["dict", "list", "iterator", "safetensors"])
@pytest.mark.parametrize("per_shard", [False, True], ids=["global", "per-shard-scale"])
@pytest.mark.parametrize("placement,device", placements(), ids=str)
def test_nvfp4_table_lookups_equal_the_reference(tmp_path, placement, device, source, per_shard):
    packed, scales = nvfp4_table()
    m = NGramEmbedding(
        NVFP4_CONFIG, layer_index=1, placement=placement, device=device, dtype="nvfp4"
    )
    assert m.weight.dtype == torch.uint8 and m.weight.shape == (ROWS, NVFP4_HEAD_DIM // 2)
    assert m.weight_scale.dtype == E4M3 and m.weight_scale.shape == (ROWS, NVFP4_BLOCKS)
    assert m.weight_scale.device == m.weight.device  # the block scales live with the table
    if placement == "pinned":  # the kernel reads both through their device views
        assert m.table.device.type == m.block_scales.device.type == "cuda"
    assert m.weight_scale_2.dtype == torch.float32 and m.weight_scale_2.shape == (1,)
    assert m.out_dtype == torch.bfloat16
    loaded = load_nvfp4(m, nvfp4_checkpoint(packed, scales, per_shard=per_shard), source, tmp_path)
    assert loaded == {
        "ngram_embedding.weight",
        "ngram_embedding.weight_scale",
        "ngram_embedding.weight_scale_2",
    }
    assert torch.equal(m.weight.cpu(), packed)
    assert torch.equal(m.weight_scale.cpu().view(torch.uint8), scales.view(torch.uint8))
    assert m.weight_scale_2.item() == torch.tensor(GLOBAL_SCALE).item()  # fp32(0.37)
    ids = every_row_ids()
    compute = m.layer_multipliers.device
    got = m.lookup(ids.to(compute))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.cpu(), nvfp4_expected(packed, scales, ids))
    forward = m(*(t.to(compute) for t in batch()))
    assert torch.equal(forward.cpu(), nvfp4_expected(packed, scales, m_ids(m).cpu()))


def test_nvfp4_out_dtype_and_dtype_spellings():
    packed, scales = nvfp4_table(1)
    m = NGramEmbedding(
        NVFP4_CONFIG, layer_index=1, placement="cpu", dtype="nvfp4", out_dtype=torch.float32
    )
    m.load_weights(nvfp4_checkpoint(packed, scales))
    ids = every_row_ids()
    assert torch.equal(m.lookup(ids), nvfp4_expected(packed, scales, ids, torch.float32))
    # vLLM's ple_embedding_dtype spells fp8 by name; torch dtypes keep working.
    assert NGramEmbedding(CONFIG, placement="cpu", dtype="float8_e4m3fn").table_dtype == E4M3
    with pytest.raises(ValueError, match="unsupported table dtype 'nvfp8'"):
        NGramEmbedding(CONFIG, placement="cpu", dtype="nvfp8")


def test_nvfp4_sharded_ranks_hold_their_rows_and_sum_to_the_whole(tmp_path):
    packed, scales = nvfp4_table(2)
    weights = nvfp4_checkpoint(packed, scales)
    ids = every_row_ids()
    for source in ("list", "safetensors"):
        parts = []
        for rank in range(3):
            m = NGramEmbedding(
                NVFP4_CONFIG, layer_index=1, placement="cpu", dtype="nvfp4", shard=(rank, 3)
            )
            load_nvfp4(m, weights, source, tmp_path)
            rows = slice(m.vocab_start, m.vocab_end)
            assert m.weight.shape[0] == m.vocab_end - m.vocab_start < ROWS
            assert torch.equal(m.weight, packed[rows])
            assert torch.equal(m.weight_scale.view(torch.uint8), scales[rows].view(torch.uint8))
            parts.append(m.lookup(ids, reduce=False))
        # Every row has one owner and the others give zeros: the sum is exact.
        assert torch.equal(parts[0] + parts[1] + parts[2], nvfp4_expected(packed, scales, ids))


def replace(weights, name, value):
    return [(n, value if n == name else t) for n, t in weights]


def _bad_nvfp4_checkpoints():
    """(checkpoint with one bad tensor, message): the bad tensor comes last or among good ones,
    so a list load that wrote anything before checking everything would be caught."""
    packed, scales = nvfp4_table(3)
    good = nvfp4_checkpoint(packed, scales)
    rows0 = packed[:SHARD_ROWS]
    scales0 = scales[:SHARD_ROWS]
    w0, s0 = "ngram_embedding.shard_0.weight", "ngram_embedding.shard_0.weight_scale"
    s6 = "ngram_embedding.shard_6.weight_scale"
    per_shard = nvfp4_checkpoint(packed, scales, per_shard=True)
    per_shard_differ = replace(
        per_shard, "ngram_embedding.shard_5.weight_scale_2", torch.tensor(0.5)
    )
    return [
        (replace(good, w0, rows0.view(torch.int8)), r"shard_0.weight must be torch.uint8.*int8"),
        (replace(good, w0, rows0.float()), r"shard_0.weight must be torch.uint8.*float32"),
        (replace(good, w0, rows0.view(E4M3)), "shard_0.weight must be torch.uint8"),
        (
            replace(good, s0, scales0.view(torch.uint8)),
            r"shard_0.weight_scale must be torch.float8_e4m3fn, got torch.uint8",
        ),
        (replace(good, s0, scales0.float()), "shard_0.weight_scale must be torch.float8_e4m3fn"),
        (
            replace(good, s0, scales0.view(torch.uint8).view(torch.float8_e4m3fnuz)),
            "shard_0.weight_scale must be torch.float8_e4m3fn",
        ),
        (
            replace(good, w0, torch.zeros(SHARD_ROWS, NVFP4_HEAD_DIM, dtype=torch.uint8)),
            rf"Shape mismatch for PLE embedding shard 0 .*expected \({SHARD_ROWS}, 16\)",
        ),
        (
            replace(good, w0, rows0[:-1].clone()),
            rf"shard 0 .*expected \({SHARD_ROWS}, 16\), got \({SHARD_ROWS - 1}, 16\)",
        ),
        (
            replace(good, s0, torch.zeros(SHARD_ROWS, NVFP4_BLOCKS + 1, dtype=E4M3)),
            rf"shard 0 \(ngram_embedding.shard_0.weight_scale\): expected \({SHARD_ROWS}, 2\)",
        ),
        (
            replace(good, s6, scales[6 * SHARD_ROWS :][:-1].clone()),
            rf"shard 6 .*weight_scale.*expected \({ROWS - 6 * SHARD_ROWS}, 2\)",
        ),
        (
            per_shard_differ,
            r"NVFP4 global scales differ: ngram_embedding.shard_0.weight_scale_2 = "
            r"0.37\d* but ngram_embedding.shard_5.weight_scale_2 = 0.5",
        ),
        (
            good + [("ngram_embedding.shard_4.weight_scale_2", torch.tensor(0.25))],
            r"ngram_embedding.weight_scale_2 = 0.37\d* but "
            r"ngram_embedding.shard_4.weight_scale_2 = 0.25",
        ),
        (
            replace(good, "ngram_embedding.weight_scale_2", torch.tensor([0.37, 0.37])),
            r"weight_scale_2 must be one float element, got torch.float32 \(2,\)",
        ),
        (
            replace(good, "ngram_embedding.weight_scale_2", torch.tensor([1])),
            "weight_scale_2 must be one float element, got torch.int64",
        ),
        (
            good + [("ngram_embedding.shard_9.weight_scale_2", torch.tensor(GLOBAL_SCALE))],
            "shard index 9 exceeds split_ngram_parts=7",
        ),
        (
            good + [("ngram_embedding.weight", packed)],
            r"NVFP4 PLE tables must be stored as ngram_embedding.shard_<i>.weight and "
            r"ngram_embedding.shard_<i>.weight_scale shards, got unsharded "
            r"ngram_embedding.weight$",
        ),
        (
            good + [("ngram_embedding.weight_scale", scales)],
            "must be stored as .* shards, got unsharded ngram_embedding.weight_scale$",
        ),
    ]


BAD_NVFP4 = _bad_nvfp4_checkpoints()


@pytest.mark.parametrize("as_dict", [False, True], ids=["list", "dict"])
@pytest.mark.parametrize("case", range(len(BAD_NVFP4)))
def test_nvfp4_bad_checkpoint_raises_and_leaves_the_module_untouched(case, as_dict):
    weights, message = BAD_NVFP4[case]
    packed, scales = nvfp4_table(4)
    m = NGramEmbedding(NVFP4_CONFIG, layer_index=1, placement="cpu", dtype="nvfp4")
    m.load_weights(nvfp4_checkpoint(packed, scales, global_scale=0.125))
    before = snapshot(m.state_dict())
    with pytest.raises(ValueError, match=message):
        m.load_weights(dict(weights) if as_dict else weights)
    assert_same_state(before, m)
    ids = every_row_ids()
    assert torch.equal(m.lookup(ids), nvfp4_expected(packed, scales, ids, global_scale=0.125))


def test_nvfp4_bad_safetensors_checkpoint_leaves_the_module_untouched(tmp_path):
    """Per-shard global scales in different files that differ: nothing is written."""
    packed, scales = nvfp4_table(5)
    weights = replace(
        nvfp4_checkpoint(packed, scales, per_shard=True),
        "ngram_embedding.shard_6.weight_scale_2",
        torch.tensor(0.5),
    )
    m = NGramEmbedding(NVFP4_CONFIG, layer_index=1, placement="cpu", dtype="nvfp4")
    before = snapshot(m.state_dict())
    with pytest.raises(ValueError, match="shard_0.weight_scale_2 = .* but .*shard_6"):
        m.load_safetensors(save_nvfp4(tmp_path, weights), prefix="model.ple.")
    assert_same_state(before, m)
    with pytest.raises(ValueError, match="must be torch.uint8"):
        bad = replace(
            weights, "ngram_embedding.shard_5.weight", packed[:SHARD_ROWS].view(torch.int8)
        )
        m.load_safetensors(save_nvfp4(tmp_path, bad), prefix="model.ple.")
    assert_same_state(before, m)


def test_nvfp4_streamed_load_failing_late_refuses_to_run_until_reloaded():
    packed, scales = nvfp4_table(6)
    good = nvfp4_checkpoint(packed, scales, per_shard=True)
    m = NGramEmbedding(NVFP4_CONFIG, layer_index=1, placement="cpu", dtype="nvfp4")
    differ = replace(good, "ngram_embedding.shard_3.weight_scale_2", torch.tensor(0.5))
    with pytest.raises(ValueError, match="global scales differ") as info:
        m.load_weights(iter(differ))
    assert "refuses to run" in "".join(getattr(info.value, "__notes__", []))
    assert m.weight_scale_2.item() == 1.0  # staged, never written
    with pytest.raises(RuntimeError, match="load the checkpoint again"):
        m.lookup(every_row_ids())
    m.load_weights(iter(good))
    assert torch.equal(m.lookup(every_row_ids()), nvfp4_expected(packed, scales, every_row_ids()))


def test_nvfp4_tensors_for_other_tables_and_bad_head_dim():
    m = NGramEmbedding(CONFIG, layer_index=1, placement="cpu", dtype=torch.bfloat16)
    before = snapshot(m.state_dict())
    scales = torch.zeros(SHARD_ROWS, 1, dtype=E4M3)
    with pytest.raises(ValueError, match="shard_0.weight_scale holds NVFP4 scales, but the table"):
        m.load_weights([("ngram_embedding.shard_0.weight_scale", scales)])
    with pytest.raises(ValueError, match="weight_scale_2 \\(an NVFP4 global scale\\) given"):
        m.load_weights([("ngram_embedding.weight_scale_2", torch.tensor(0.5))])
    assert_same_state(before, m)
    # CONFIG's head dim is 6; 24 is a multiple of 8 but not 16: both are refused.
    for embed_dim, head_dim in ((24, 6), (32, 8)):
        config = SimpleNamespace(**{**vars(CONFIG), "ple_embed_dim": embed_dim})
        with pytest.raises(ValueError, match=f"multiple of 16 .*got {head_dim}"):
            NGramEmbedding(config, layer_index=1, placement="cpu", dtype="nvfp4")
