"""PLELayer, PLEState, GatedResidual/HyperConnection and the checkpoint loaders against
transformers 5.18 (``Qwen4ExpTextPLELayer``, ``Qwen4ExpTextGatedResidual``) on the same weights.

The acceptance bound (fp32): max |ours − (hidden + theirs)| ≤ 1e-5 × max |theirs|, where theirs is
transformers' whole-sequence output, over full prefill, chunked prefill at random cut points,
token-by-token decode and speculative verify, for interleaved requests of different lengths with
EOS inside, slots reused after finished requests. Small shapes: the file runs in seconds on CPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import devices
from qwen4exp_ext import reference
from qwen4exp_ext.layers import (
    GatedResidual,
    HyperConnection,
    HyperConnectionConfig,
    PLELayer,
    PLEState,
    get_ple_mamba_state_dtype,
    get_ple_mamba_state_shape,
)
from qwen4exp_ext.testing import assert_untouched, snapshot

pytest.importorskip("transformers.models.qwen4_exp")
from transformers.models.qwen4_exp.modeling_qwen4_exp import (  # noqa: E402
    Qwen4ExpTextGatedResidual,
    Qwen4ExpTextPLELayer,
)

from hf_support import EOS, tiny_config  # noqa: E402

DEVICES = devices()
REL_TOL = 1e-5


CASES = {
    "L0-N3": dict(layer=0, cfg={}),
    "L1-N2": dict(
        layer=1,
        cfg=dict(
            ngram_size=2, heads_per_ngram=3, ple_embed_dim=12, hc_count=2, ple_conv_kernel_size=3
        ),
    ),
}


def hf_layer(cfg, layer: int, seed: int) -> Qwen4ExpTextPLELayer:
    """transformers' layer with non-zero norm and conv weights."""
    torch.manual_seed(seed)
    module = Qwen4ExpTextPLELayer(cfg, layer_idx=0, ple_layer_index=layer)
    with torch.no_grad():
        for norm in (module.norm_key, module.norm_query, module.norm_conv):
            norm.weight.normal_(0.0, 0.3)
        module.conv1d.weight.normal_(0.0, 0.5)
    return module.eval()


def our_layer(cfg, layer: int, hf: Qwen4ExpTextPLELayer, device: str = "cpu") -> PLELayer:
    ours = PLELayer.from_config(cfg, layer, state_index=0, dtype=torch.float32, device=device)
    loaded = ours.load_state_dict_transformers(hf.state_dict())
    assert loaded == set(ours.state_dict()), set(ours.state_dict()) ^ loaded
    return ours


def make_requests(cfg, lengths, gen):
    """(input_ids [L], hidden [L, C]) per request, EOS inside every sequence."""
    C = cfg.hc_count * cfg.hidden_size
    reqs = {}
    for i, length in enumerate(lengths):
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=gen)
        ids[torch.randint(1, length - 1, (2,), generator=gen)] = EOS
        reqs[f"req{i}"] = (ids, torch.randn(length, C, generator=gen))
    return reqs


def expected_outputs(hf, reqs):
    """transformers on each whole sequence (no cache): (hidden + theirs, theirs)."""
    out = {}
    with torch.no_grad():
        for rid, (ids, hidden) in reqs.items():
            theirs = hf(hidden[None], ids[None], None)[0]
            out[rid] = (hidden + theirs, theirs)
    return out


def assert_matches(ours: dict, expected: dict) -> None:
    for rid, (want, theirs) in expected.items():
        got = ours[rid].cpu()
        assert got.shape == want.shape, rid
        err = (got - want).abs().max().item()
        bound = REL_TOL * theirs.abs().max().item()
        assert err <= bound, f"{rid}: max |ours - theirs| = {err:.3g} > {bound:.3g}"


# --- §7 the layer, prefill ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_full_prefill_matches_transformers(case, device):
    cfg = tiny_config(**CASES[case]["cfg"])
    hf = hf_layer(cfg, CASES[case]["layer"], seed=1)
    ours = our_layer(cfg, CASES[case]["layer"], hf, device)
    reqs = make_requests(cfg, [13, 5, 21], torch.Generator().manual_seed(2))
    expected = expected_outputs(hf, reqs)

    # every request in one batch, through a cache
    cache = PLEState.from_config(cfg, max_requests=3, num_layers=1, device=device)
    for rid in reqs:
        cache.add_request(rid)
    batch = cache.prepare([(rid, ids) for rid, (ids, _) in reqs.items()])
    assert [g.mode for g in batch.groups] == ["prefill"]
    hidden = torch.cat([h for _, h in reqs.values()]).to(device)
    with torch.no_grad():
        out = ours(hidden, batch.input_ids, batch)
    cache.commit(batch)
    rows = batch.request_rows()
    assert_matches({rid: out[rows[rid]] for rid in reqs}, expected)

    # one sequence without any state
    with torch.no_grad():
        single = {rid: ours(h.to(device), ids.to(device)) for rid, (ids, h) in reqs.items()}
    assert_matches(single, expected)


# --- streaming: chunked prefill at random cuts, decode, slot reuse ----------------------------


def stream(layer, cache, reqs, rng: random.Random, *, spec_len: int = 0, device: str = "cpu"):
    """Simulates a scheduler over ``reqs``: admits requests while slots are free, runs every
    scheduled request's next chunk in one batch (random order, so decode/prefill/spec rows
    interleave), finishes requests at their end (their slot is reused). A request's first
    ``prompt`` tokens go in random chunks, the rest token by token — or, with ``spec_len``, as
    verify chunks of accepted tokens + rejected drafts. Returns outputs and the modes seen."""
    C = layer.hc_hidden_size
    waiting = list(reqs)
    prompt = {rid: rng.randint(1, len(reqs[rid][0]) - 2) for rid in reqs}
    pos = {rid: 0 for rid in reqs}
    outs: dict[str, list[torch.Tensor]] = {rid: [] for rid in reqs}
    live: list[str] = []
    seen: set[str] = set()
    slots_used: list[int] = []
    while waiting or live:
        while waiting and len(live) < cache.max_requests and (not live or rng.random() < 0.6):
            rid = waiting.pop(0)
            slots_used.append(cache.add_request(rid))
            live.append(rid)
        order = rng.sample(live, len(live))
        scheduled = [rid for rid in order if rng.random() < 0.8] or order[:1]
        chunks, hiddens, accepted, spec_ids = [], [], {}, []
        for rid in scheduled:
            ids, hidden = reqs[rid]
            p, length = pos[rid], len(ids)
            if p < prompt[rid]:
                n = rng.randint(1, prompt[rid] - p)
                chunks.append((rid, ids[p : p + n]))
                hiddens.append(hidden[p : p + n])
            elif spec_len and rng.random() < 0.7:
                a = rng.randint(1, min(spec_len + 1, length - p))
                drafts = rng.randint(0, spec_len + 1 - a)
                tok = torch.cat([ids[p : p + a], torch.randint(0, 128, (drafts,))])
                hid = torch.cat([hidden[p : p + a], torch.randn(drafts, C)])
                chunks.append((rid, tok))
                hiddens.append(hid)
                accepted[rid] = a
                spec_ids.append(rid)
            else:
                chunks.append((rid, ids[p : p + 1]))
                hiddens.append(hidden[p : p + 1])
        batch = cache.prepare(chunks, spec=spec_ids)
        seen |= {g.mode for g in batch.groups}
        if len(batch.groups) > 1:
            seen.add("mixed")
        with torch.no_grad():
            out = layer(torch.cat(hiddens).to(device), batch.input_ids, batch)
        cache.commit(batch, accepted)
        rows = batch.request_rows()
        for rid, tokens in chunks:
            keep = accepted.get(rid, len(tokens))
            outs[rid].append(out[rows[rid]][:keep])
            pos[rid] += keep
            if pos[rid] == len(reqs[rid][0]):
                cache.finish_request(rid)
                live.remove(rid)
    return {rid: torch.cat(o) for rid, o in outs.items()}, seen, slots_used


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case,layout,seed",
    [("L0-N3", "dim_first", 0), ("L0-N3", "window_first", 1), ("L1-N2", "dim_first", 2)],
)
def test_streaming_matches_transformers(case, layout, seed, device):
    """≥ 3 interleaved requests of different lengths with EOS inside; chunked prefill at random
    cut points, token-by-token decode, mixed batches, a finished request's slot reused."""
    cfg = tiny_config(**CASES[case]["cfg"])
    hf = hf_layer(cfg, CASES[case]["layer"], seed=10 + seed)
    ours = our_layer(cfg, CASES[case]["layer"], hf, device)
    reqs = make_requests(cfg, [19, 7, 26, 12, 9], torch.Generator().manual_seed(20 + seed))
    expected = expected_outputs(hf, reqs)
    cache = PLEState.from_config(cfg, 3, num_layers=1, device=device, layout=layout)
    got, seen, slots = stream(ours, cache, reqs, random.Random(seed), device=device)
    assert_matches(got, expected)
    assert {"decode", "prefill", "mixed"} <= seen
    assert len(set(slots)) < len(slots) and max(slots) <= 3  # slots were reused
    assert cache.request_ids == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_spec,seed", [(2, 0), (3, 1)])
def test_spec_verify_matches_transformers(num_spec, seed, device):
    """Verify steps with every accepted count: accepted tokens' outputs and every later step
    equal transformers on the accepted sequence (rejected drafts leave no trace), also across
    spec → decode/prefill and in batches mixed with non-spec requests."""
    cfg = tiny_config()
    hf = hf_layer(cfg, 0, seed=30 + seed)
    ours = our_layer(cfg, 0, hf, device)
    reqs = make_requests(cfg, [23, 15, 30, 11], torch.Generator().manual_seed(40 + seed))
    expected = expected_outputs(hf, reqs)
    cache = PLEState.from_config(cfg, 3, num_layers=1, num_spec=num_spec, device=device)
    assert cache.conv_state(0).shape[-1] == cache.state_len + num_spec
    got, seen, _ = stream(ours, cache, reqs, random.Random(seed), spec_len=num_spec, device=device)
    assert_matches(got, expected)
    assert {"spec", "decode", "prefill", "mixed"} <= seen


def test_multi_layer_state_and_context_helpers():
    """One cache serves several PLE layers (one conv state each, one shared n-gram context)."""
    cfg = tiny_config()
    hf0, hf1 = hf_layer(cfg, 0, seed=50), hf_layer(cfg, 1, seed=51)
    l0 = PLELayer.from_config(cfg, 0, dtype=torch.float32)
    l1 = PLELayer.from_config(cfg, 1, dtype=torch.float32)
    l0.load_state_dict_transformers(hf0.state_dict())
    l1.load_state_dict_transformers(hf1.state_dict())
    cache = PLEState.from_config(cfg, 2)
    assert cache.num_layers == 2
    gen = torch.Generator().manual_seed(52)
    ids = torch.tensor([3, EOS, 9, 11, 12, 5, 6])
    h0 = torch.randn(7, 24, generator=gen)
    h1 = torch.randn(7, 24, generator=gen)
    with torch.no_grad():
        want0 = h0 + hf0(h0[None], ids[None], None)[0]
        want1 = h1 + hf1(h1[None], ids[None], None)[0]
    cache.add_request("a", context=[1, 2, 3])
    assert cache.context("a") == [2, 3]
    cache.finish_request("a")
    cache.add_request("a")
    assert cache.context("a") == [EOS, EOS]
    outs0, outs1 = [], []
    for a, b in [(0, 4), (4, 5), (5, 7)]:
        batch = cache.prepare([("a", ids[a:b])])
        with torch.no_grad():
            outs0.append(l0(h0[a:b], batch.input_ids, batch))
            outs1.append(l1(h1[a:b], batch.input_ids, batch))
        cache.commit(batch)
    assert cache.num_computed_tokens("a") == 7 and cache.context("a") == [5, 6]
    torch.testing.assert_close(torch.cat(outs0), want0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(outs1), want1, rtol=1e-5, atol=1e-5)


def test_state_errors():
    cfg = tiny_config()
    cache = PLEState.from_config(cfg, 1)
    cache.add_request("a")
    with pytest.raises(ValueError, match="already live"):
        cache.add_request("a")
    with pytest.raises(RuntimeError, match="no free"):
        cache.add_request("b")
    with pytest.raises(KeyError):
        cache.finish_request("b")
    with pytest.raises(ValueError, match="num_spec"):
        cache.prepare([("a", [1, 2])], spec=True)
    with pytest.raises(ValueError, match="twice"):
        cache.prepare([("a", [1]), ("a", [2])])
    with pytest.raises(IndexError):
        cache.conv_state(5)
    spec_cache = PLEState.from_config(cfg, 1, num_spec=1)
    spec_cache.add_request("a")
    with pytest.raises(ValueError, match="1..2"):
        spec_cache.prepare([("a", [1, 2, 3])], spec=True)
    batch = spec_cache.prepare([("a", [1, 2])], spec=True)
    with pytest.raises(ValueError, match="accepted"):
        spec_cache.commit(batch)
    with pytest.raises(ValueError, match="accepted 3"):
        spec_cache.commit(batch, {"a": 3})
    layer = PLELayer.from_config(cfg, 0, state_index=2, dtype=torch.float32)
    with pytest.raises(IndexError):
        layer(torch.zeros(1, 24), torch.tensor([1]), cache.prepare([("a", [1])]))


# --- state shape/dtype helpers (vLLM's qwen4_exp) ----------------------------------------------


def test_state_shape_and_dtype_helpers():
    cfg = tiny_config()
    C, S = 24, 9
    assert get_ple_mamba_state_shape(cfg) == ((C, S),)
    assert get_ple_mamba_state_shape(cfg, num_spec=2) == ((C, S + 2),)
    assert get_ple_mamba_state_shape(cfg, 2, layout="window_first") == ((S + 2, C),)
    assert get_ple_mamba_state_dtype(torch.bfloat16) == (torch.bfloat16,)
    assert get_ple_mamba_state_dtype(torch.bfloat16, "float32") == (torch.float32,)
    assert get_ple_mamba_state_dtype("float16", "auto") == (torch.float16,)
    cache = PLEState.from_config(cfg, 4, num_spec=2, dtype=torch.bfloat16)
    assert tuple(cache.conv_state(1).shape[1:]) == get_ple_mamba_state_shape(cfg, 2)[0]
    assert cache.conv_state(1).dtype == torch.bfloat16


# --- checkpoint layouts ---------------------------------------------------------------------------


def vllm_layout(hf: Qwen4ExpTextPLELayer, parts: int) -> dict[str, torch.Tensor]:
    """The seed's checkpoint layout: the table split in ``parts`` row blocks, kv merged."""
    sd = hf.state_dict()
    table = sd.pop("ple_embedding.ngram_embedding.weight")
    shard = -(-table.shape[0] // parts)
    for i in range(parts):
        sd[f"ple_embedding.ngram_embedding.shard_{i}.weight"] = table[i * shard : (i + 1) * shard]
    sd["kv_proj.weight"] = torch.cat([sd.pop("key_proj.weight"), sd.pop("value_proj.weight")])
    sd["conv1d.weight"] = sd["conv1d.weight"].squeeze(1)
    sd["ple_embedding.hashstats_0"] = torch.zeros(3)
    return sd


def test_load_vllm_layout_and_safetensors(tmp_path):
    from safetensors.torch import save_file

    cfg = tiny_config(split_ngram_parts=5)
    hf = hf_layer(cfg, 0, seed=60)
    ref = our_layer(cfg, 0, hf)
    sd = vllm_layout(hf, 5)
    from_vllm = PLELayer.from_config(cfg, 0, dtype=torch.float32)
    assert from_vllm.load_weights(sd.items()) == set(from_vllm.state_dict())
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(from_vllm.state_dict()[name], value, rtol=0, atol=0)

    prefix = "model.language_model.layers.0.ple."
    save_file({prefix + k: v.contiguous() for k, v in sd.items()}, tmp_path / "a.safetensors")
    hf_sd = {prefix + k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file({"lm_head.weight": torch.zeros(2, 2), **hf_sd}, tmp_path / "b.safetensors")
    for files in ([tmp_path / "a.safetensors"], [tmp_path / "b.safetensors"]):
        layer = PLELayer.from_config(cfg, 0, dtype=torch.float32)
        assert layer.load_safetensors(files, prefix=prefix) == set(layer.state_dict())
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(layer.state_dict()[name], value, rtol=0, atol=0)

    with pytest.raises(ValueError, match="unexpected"):
        from_vllm.load_weights([("bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="Shape mismatch"):
        from_vllm.load_weights([("key_proj.weight", torch.zeros(3, 3))])

    # A list is checked in full first: good tensors before a bad one are not written either.
    before = {k: v.clone() for k, v in from_vllm.state_dict().items()}
    bad_lists = [
        [(k, torch.zeros_like(v)) for k, v in sd.items()] + [("bogus.weight", torch.zeros(1))],
        [
            ("kv_proj.weight", torch.zeros_like(sd["kv_proj.weight"])),
            ("conv1d.weight", sd["kv_proj.weight"]),
        ],
    ]
    for bad in bad_lists:
        with pytest.raises(ValueError):
            from_vllm.load_weights(bad)
        for name, value in before.items():
            assert torch.equal(from_vllm.state_dict()[name], value), name


@pytest.mark.parametrize("layout", ["vllm", "transformers"])
@pytest.mark.parametrize(
    "bad",
    [
        ("norm_key.weight", torch.zeros(3)),
        ("ple_embedding.ngram_embedding.shard_1.weight", torch.zeros(2, 2)),
        ("ple_embedding.ngram_embedding.weight", torch.zeros(2, 5)),
        ("ple_embedding.layer_multipliers", torch.zeros(3)),
        ("bogus.weight", torch.zeros(1)),
    ],
    ids=lambda bad: bad[0],
)
def test_load_safetensors_checks_every_file_first(tmp_path, layout, bad):
    """A bad tensor in the second file: nothing of the first file (table rows included) is
    written either."""
    from safetensors.torch import save_file

    cfg = tiny_config(split_ngram_parts=5)
    hf = hf_layer(cfg, 0, seed=61)
    good = vllm_layout(hf, 5) if layout == "vllm" else dict(hf.state_dict())
    save_file({k: v.contiguous() for k, v in good.items()}, tmp_path / "a.safetensors")
    save_file({bad[0]: bad[1]}, tmp_path / "b.safetensors")
    layer = PLELayer.from_config(cfg, 0, dtype=torch.float32)
    with torch.no_grad():
        for value in layer.state_dict().values():
            if value.is_floating_point():
                value.fill_(7.0)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError):
        layer.load_safetensors([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    for name, value in before.items():
        assert torch.equal(layer.state_dict()[name], value), name


# --- NVFP4 tables --------------------------------------------------------------------------------

NVFP4_PARTS = 5
NVFP4_GLOBAL_SCALE = 0.37


def nvfp4_cfg(**overrides):
    """4 n-gram heads of 32: two NVFP4 blocks a row."""
    return tiny_config(ple_embed_dim=128, split_ngram_parts=NVFP4_PARTS, **overrides)


def nvfp4_table(rows: int, head_dim: int, seed: int):
    """Random packed E2M1 rows and e4m3 block scales (positive, a few negative, never NaN)."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, head_dim // 2), dtype=torch.uint8, generator=gen)
    blocks = head_dim // reference.NVFP4_BLOCK
    bits = torch.randint(0x01, 0x60, (rows, blocks), dtype=torch.uint8, generator=gen)
    bits = torch.where(torch.rand(rows, blocks, generator=gen) < 0.1, bits | 0x80, bits)
    return packed, bits.view(torch.float8_e4m3fn)


def nvfp4_layout(hf, packed, scales, *, per_shard=False) -> dict[str, torch.Tensor]:
    """vLLM's layout with an NVFP4 table: the rows and block scales in shards, the global
    scale once (or repeated per shard)."""
    sd = {k: v for k, v in vllm_layout(hf, NVFP4_PARTS).items() if ".shard_" not in k}
    size = -(-packed.shape[0] // NVFP4_PARTS)
    prefix = "ple_embedding.ngram_embedding."
    for i in range(NVFP4_PARTS):
        rows = slice(i * size, (i + 1) * size)
        sd[f"{prefix}shard_{i}.weight"] = packed[rows].clone()
        sd[f"{prefix}shard_{i}.weight_scale"] = scales[rows].clone()
        if per_shard:
            sd[f"{prefix}shard_{i}.weight_scale_2"] = torch.tensor(NVFP4_GLOBAL_SCALE)
    if not per_shard:
        sd[prefix + "weight_scale_2"] = torch.tensor([NVFP4_GLOBAL_SCALE])
    return sd


def nvfp4_pair(dtype, seed, **layer_kwargs):
    """(an NVFP4 layer's checkpoint, the same layer with the dequantised ``dtype`` table,
    loaded): the dequantisation is exact, E = round_dtype(fp32(e2m1 · e4m3) · scale)."""
    cfg = nvfp4_cfg()
    hf = hf_layer(cfg, 0, seed=seed)
    dense = PLELayer.from_config(cfg, 0, dtype=dtype, **layer_kwargs)
    emb = dense.ple_embedding
    packed, scales = nvfp4_table(emb.num_rows, emb.head_dim, seed)
    decoded = reference.nvfp4_decode(packed, scales) * torch.tensor(NVFP4_GLOBAL_SCALE)
    sd = dict(hf.state_dict())
    sd["ple_embedding.ngram_embedding.weight"] = decoded.to(dtype)
    dense.load_weights(sd)
    return cfg, hf, packed, scales, dense


def run_layer(layer, cfg, dtype, seed):
    """One fresh sequence (no state) and a batch of three through a cache."""
    gen = torch.Generator().manual_seed(seed)
    reqs = make_requests(cfg, [13, 5, 21], gen)
    outs = []
    with torch.no_grad():
        for ids, hidden in reqs.values():
            outs.append(layer(hidden.to(dtype), ids))
        cache = PLEState.from_config(cfg, 3, num_layers=1, dtype=dtype)
        for rid in reqs:
            cache.add_request(rid)
        batch = cache.prepare([(rid, ids) for rid, (ids, _) in reqs.items()])
        hidden = torch.cat([h for _, h in reqs.values()]).to(dtype)
        outs.append(layer(hidden, batch.input_ids, batch))
    return outs


def load_nvfp4_layer(layer, sd, source, tmp_path) -> set[str]:
    prefix = "model.language_model.layers.0.ple."
    if source == "dict":
        return layer.load_weights(sd)
    if source == "list":
        return layer.load_weights(list(sd.items()))
    if source == "iterator":
        return layer.load_weights(iter(sd.items()))
    if source == "transformers-loader":
        return layer.load_state_dict_transformers(
            {prefix + k: v for k, v in sd.items()}, prefix=prefix
        )
    from safetensors.torch import save_file

    shards = {prefix + k: v.contiguous() for k, v in sd.items() if ".shard_" in k}
    rest = {prefix + k: v.contiguous() for k, v in sd.items() if ".shard_" not in k}
    save_file(shards, tmp_path / "a.safetensors")
    save_file(rest, tmp_path / "b.safetensors")
    return layer.load_safetensors(
        [tmp_path / "a.safetensors", tmp_path / "b.safetensors"], prefix=prefix
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "source", ["dict", "list", "iterator", "transformers-loader", "safetensors"]
)
@pytest.mark.parametrize("per_shard", [False, True], ids=["global", "per-shard-scale"])
def test_nvfp4_layer_equals_the_layer_with_the_dequantised_table(
    tmp_path, dtype, source, per_shard
):
    cfg, hf, packed, scales, dense = nvfp4_pair(dtype, seed=90)
    layer = PLELayer.from_config(cfg, 0, dtype=dtype, table_dtype="nvfp4")
    assert layer.ple_embedding.nvfp4 and layer.ple_embedding.out_dtype == dtype
    sd = nvfp4_layout(hf, packed, scales, per_shard=per_shard)
    assert load_nvfp4_layer(layer, sd, source, tmp_path) == set(layer.state_dict())
    assert torch.equal(layer.ple_embedding.weight, packed)
    for name in ("kv_proj.weight", "conv1d.weight", "norm_key.weight"):
        assert torch.equal(layer.state_dict()[name], dense.state_dict()[name]), name
    got, want = run_layer(layer, cfg, dtype, 91), run_layer(dense, cfg, dtype, 91)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
        assert g.abs().sum() > 0


def test_nvfp4_from_config_reads_ple_embedding_dtype():
    cfg = nvfp4_cfg()
    cfg.ple_embedding_dtype = "nvfp4"  # vLLM's config field of quantised checkpoints
    assert PLELayer.from_config(cfg, 0).ple_embedding.nvfp4
    # An explicit table_dtype wins; without the field the table is the layer's dtype.
    explicit = PLELayer.from_config(cfg, 0, table_dtype=torch.bfloat16)
    assert explicit.ple_embedding.table_dtype == torch.bfloat16
    assert PLELayer.from_config(nvfp4_cfg(), 0, dtype=torch.float16).ple_embedding.table_dtype == (
        torch.float16
    )
    cfg.ple_embedding_dtype = "float8_e4m3fn"
    fp8 = PLELayer.from_config(cfg, 0).ple_embedding
    assert fp8.table_dtype == torch.float8_e4m3fn and fp8.weight_scale.dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of 16 .*got 4"):
        PLELayer.from_config(tiny_config(), 0, table_dtype="nvfp4")


def _bad_nvfp4_layer_checkpoints():
    cfg = nvfp4_cfg()
    hf = hf_layer(cfg, 0, seed=92)
    rows = PLELayer.from_config(cfg, 0, table_dtype="nvfp4").ple_embedding.num_rows
    packed, scales = nvfp4_table(rows, 32, seed=92)
    good = nvfp4_layout(hf, packed, scales, per_shard=True)
    prefix = "ple_embedding.ngram_embedding."
    return [
        (
            {**good, prefix + "shard_3.weight_scale_2": torch.tensor(0.5)},
            rf"{prefix}shard_0.weight_scale_2 = 0.37\d* but {prefix}shard_3.weight_scale_2 = 0.5",
        ),
        (
            {**good, prefix + "shard_2.weight_scale": scales[:820].view(torch.uint8)},
            "shard_2.weight_scale must be torch.float8_e4m3fn, got torch.uint8",
        ),
        (
            {**good, prefix + "shard_1.weight": packed[:820].float()},
            "shard_1.weight must be torch.uint8",
        ),
        (
            {**good, prefix + "shard_1.weight": packed[:820, :8].clone()},
            r"Shape mismatch for PLE embedding shard 1 .*expected \(820, 16\)",
        ),
        (
            {**good, prefix + "weight": torch.zeros(rows, 32)},
            "must be stored as ngram_embedding.shard_<i>.weight and .* got unsharded "
            f"{prefix}weight$",
        ),
        (
            {**good, prefix + "weight_scale": scales},
            "got unsharded ngram_embedding.weight_scale",
        ),
    ]


BAD_NVFP4_LAYER = _bad_nvfp4_layer_checkpoints()


@pytest.mark.parametrize("source", ["dict", "list", "safetensors"])
@pytest.mark.parametrize("case", range(len(BAD_NVFP4_LAYER)))
def test_nvfp4_layer_bad_checkpoint_raises_and_leaves_it_untouched(tmp_path, case, source):
    bad, message = BAD_NVFP4_LAYER[case]
    cfg, hf, packed, scales, _ = nvfp4_pair(torch.bfloat16, seed=93)
    layer = PLELayer.from_config(cfg, 0, table_dtype="nvfp4")
    layer.load_weights(nvfp4_layout(hf, packed, scales))
    before = snapshot(layer.state_dict())
    with pytest.raises(ValueError, match=message):
        load_nvfp4_layer(layer, bad, source, tmp_path)
    assert_untouched(before, layer.state_dict())
    assert layer.ple_embedding._incomplete_load is None


def test_nvfp4_layer_stream_failing_after_rows_refuses_to_run():
    """A stream is loaded tensor by tensor: when a later tensor is bad, the rows already written
    must not be used silently."""
    cfg, hf, packed, scales, _ = nvfp4_pair(torch.bfloat16, seed=94)
    layer = PLELayer.from_config(cfg, 0, table_dtype="nvfp4")
    good = nvfp4_layout(hf, packed, scales, per_shard=True)
    bad = {**good, "ple_embedding.ngram_embedding.shard_4.weight_scale_2": torch.tensor(0.5)}
    with pytest.raises(ValueError, match="global scales differ"):
        layer.load_weights(iter(bad.items()))
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError, match="load the checkpoint again"):
        layer(torch.zeros(3, layer.hc_hidden_size, dtype=torch.bfloat16), ids)
    layer.load_weights(iter(good.items()))
    layer(torch.zeros(3, layer.hc_hidden_size, dtype=torch.bfloat16), ids)


def test_bf16_layer_runs_and_tracks_fp32():
    cfg = tiny_config()
    hf = hf_layer(cfg, 0, seed=70)
    ours = PLELayer.from_config(cfg, 0, dtype=torch.bfloat16)
    ours.load_state_dict_transformers(hf.state_dict())
    reqs = make_requests(cfg, [11, 6, 9], torch.Generator().manual_seed(71))
    expected = expected_outputs(hf, reqs)
    cache = PLEState.from_config(cfg, 3, num_layers=1, dtype=torch.bfloat16)
    reqs_bf16 = {rid: (ids, h.to(torch.bfloat16)) for rid, (ids, h) in reqs.items()}
    got, _, _ = stream(ours, cache, reqs_bf16, random.Random(3))
    for rid, (want, _) in expected.items():
        torch.testing.assert_close(got[rid].float(), want, rtol=3e-2, atol=6e-2)


# --- §8 hyper-connections ------------------------------------------------------------------------


@pytest.mark.parametrize("hc_count,hidden_size,lowrank", [(2, 8, 3), (4, 6, 5)])
def test_gated_residual_matches_transformers(hc_count, hidden_size, lowrank):
    cfg = tiny_config(hc_count=hc_count, hidden_size=hidden_size, hc_lowrank=lowrank)
    torch.manual_seed(80)
    theirs = Qwen4ExpTextGatedResidual(cfg)
    with torch.no_grad():
        theirs.hc_norm.weight.normal_(0.0, 0.3)
    ours = GatedResidual(cfg, dtype=torch.float32)
    ours.load_state_dict(theirs.state_dict())
    gen = torch.Generator().manual_seed(81)
    x = torch.randn(3, 7, hc_count * hidden_size, generator=gen) * 2
    block = torch.randn(3, 7, hidden_size, generator=gen)
    with torch.no_grad():
        mixed_hf, hyper_hf, inj_hf = theirs(x)
        combined_hf = hyper_hf + (block.unsqueeze(-2) * inj_hf.unsqueeze(-1)).flatten(-2)
        mixed, residuals = ours.mix(x)
        combined = ours.combine(block, residuals)
        fwd = ours(x)
    for got, want in ((mixed, mixed_hf), (combined, combined_hf), (fwd[2], inj_hf)):
        err = (got - want).abs().max().item()
        assert err <= REL_TOL * want.abs().max().item()
    assert fwd[1] is x


def test_gated_residual_shared_norm_and_disabled_parts():
    cfg = HyperConnectionConfig(
        hc_count=3,
        hidden_size=4,
        hc_lowrank=2,
        params_dtype=torch.float32,
        hc_per_branch_norm=False,
    )
    shared = GatedResidual(cfg)
    assert shared.hc_norm.weight.shape == (4,)
    per_branch = GatedResidual(
        HyperConnectionConfig(**{**cfg.__dict__, "hc_per_branch_norm": True})
    )
    with torch.no_grad():
        shared.hc_norm.weight.normal_()
        per_branch.load_state_dict(
            {**shared.state_dict(), "hc_norm.weight": shared.hc_norm.weight.repeat(3)}
        )
    x = torch.randn(5, 12)
    torch.testing.assert_close(shared.mix(x)[0], per_branch.mix(x)[0], rtol=0, atol=0)
    mix_only = GatedResidual(cfg, use_combine=False)
    assert mix_only.block_inject_weight is None and mix_only(x).shape == (5, 4)
    with pytest.raises(RuntimeError):
        GatedResidual(cfg, use_mix=False).mix(x)


def test_hyper_connection_average():
    hc = HyperConnection(HyperConnectionConfig(hc_count=3, hidden_size=4))
    x = torch.randn(2, 5, 12)
    block = torch.randn(2, 5, 4)
    mixed, residual = hc.mix(x)
    torch.testing.assert_close(mixed, (x[..., :4] + x[..., 4:8] + x[..., 8:]) / 3)
    torch.testing.assert_close(
        hc.combine(block, residual), x + block.repeat(1, 1, 3), rtol=0, atol=0
    )
    with pytest.raises(ValueError):
        hc.mix(torch.randn(2, 11))


# --- the example -------------------------------------------------------------------------------


def test_stream_requests_example(monkeypatch, capsys):
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "stream_requests.py"
    monkeypatch.setattr("sys.argv", [str(path)])
    runpy.run_path(str(path), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("request ") for line in lines) == 3
    assert float(lines[-1].rsplit(" ", 1)[-1]) <= REL_TOL
