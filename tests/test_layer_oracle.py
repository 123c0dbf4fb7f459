"""The layer-level oracle: reference.ple_layer (SPEC §7) and the hyper-connections (§8) against HF
transformers 5.18. CPU only; every case is seeded. (Each kernel op's oracle is tested in its
folder: tests/<op>/test_oracle.py, and its SPEC properties in tests/<op>/test_properties.py.)"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from qwen4exp_ext import reference as ref
from qwen4exp_ext.testing import assert_exact

pytest.importorskip("transformers.models.qwen4_exp")
from transformers.models.qwen4_exp.modeling_qwen4_exp import (  # noqa: E402
    Qwen4ExpTextGatedResidual,
    Qwen4ExpTextPLELayer,
)

from hf_support import EOS, tiny_config  # noqa: E402
from ple_conv.support import new_state  # noqa: E402


# --------------------------------------------------------------------------------------------
# §7 the layer against transformers
# --------------------------------------------------------------------------------------------
def hf_ple_layer(cfg, ple_layer_index, seed):
    torch.manual_seed(seed)
    layer = Qwen4ExpTextPLELayer(cfg, layer_idx=0, ple_layer_index=ple_layer_index)
    with torch.no_grad():
        for norm in (layer.norm_key, layer.norm_query, layer.norm_conv):
            norm.weight.normal_(0.0, 0.3)
        layer.conv1d.weight.normal_(0.0, 0.5)
    emb = layer.ple_embedding
    weights = dict(
        table=emb.ngram_embedding.weight.detach(),
        layer_multipliers=emb.layer_multipliers,
        head_sizes=emb.ngram_heads_vocab_sizes,
        head_offsets=emb.ngram_heads_offsets,
        eos_token_id=EOS,
        heads_per_ngram=cfg.heads_per_ngram,
        w_kv=torch.cat([layer.key_proj.weight, layer.value_proj.weight]).detach(),
        norm_key_w=layer.norm_key.weight.detach(),
        norm_query_w=layer.norm_query.weight.detach(),
        norm_conv_w=layer.norm_conv.weight.detach(),
        conv_weights=layer.conv1d.weight.detach().squeeze(1),
        eps=cfg.rms_norm_eps,
    )
    return layer, weights


LAYER_CASES = [
    dict(ple_layer_index=0, cfg={}),
    dict(
        ple_layer_index=1,
        cfg=dict(
            ngram_size=2, heads_per_ngram=3, ple_embed_dim=12, hc_count=2, ple_conv_kernel_size=3
        ),
    ),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=["L0-N3", "L1-N2"])
def test_ple_layer_matches_transformers_prefill(case):
    cfg = tiny_config(**case["cfg"])
    layer, weights = hf_ple_layer(cfg, case["ple_layer_index"], seed=14)
    gen = torch.Generator().manual_seed(15)
    B, S_len, C = 3, 17, cfg.hc_count * cfg.hidden_size
    ids = torch.randint(0, cfg.vocab_size, (B, S_len), generator=gen)
    ids[ids % 6 == 0] = EOS
    hidden = torch.randn(B, S_len, C, generator=gen) * 2
    with torch.no_grad():
        theirs = layer(hidden, ids, None)
    qsl = torch.arange(0, B * S_len + 1, S_len, dtype=torch.int32)
    context = torch.full((B, cfg.ngram_size - 1), EOS)
    ours = ref.ple_layer(hidden.reshape(-1, C), ids.reshape(-1), qsl, context, **weights)
    torch.testing.assert_close(ours.reshape(B, S_len, C), hidden + theirs, rtol=1e-5, atol=1e-5)


def test_ple_layer_chunked_with_state_matches_transformers():
    """Chunked prefill + decode through one persistent conv state and the right n-gram context
    gives transformers' whole-sequence output."""
    cfg = tiny_config()
    layer, weights = hf_ple_layer(cfg, 0, seed=16)
    gen = torch.Generator().manual_seed(17)
    S_len, C, n_ctx = 19, cfg.hc_count * cfg.hidden_size, cfg.ngram_size - 1
    ids = torch.randint(0, cfg.vocab_size, (S_len,), generator=gen)
    ids[[3, 4, 11]] = EOS
    hidden = torch.randn(S_len, C, generator=gen)
    with torch.no_grad():
        expected = hidden + layer(hidden[None], ids[None], None)[0]
    state_len = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
    state = new_state(3, C, state_len, torch.float32, "window_first")
    slot = torch.tensor([2])
    outs = []
    bounds = [0, 5, 6, 13, 17, 18, 19]  # prefill chunks, then single tokens through decode
    for a, b in pairwise(bounds):
        before = [EOS] * n_ctx + ids[:a].tolist()
        context = torch.tensor([before[len(before) - n_ctx :]])
        mode = "decode" if b - a == 1 and a > 13 else "prefill"
        outs.append(
            ref.ple_layer(
                hidden[a:b],
                ids[a:b],
                torch.tensor([0, b - a]),
                context,
                conv_state=state,
                state_indices=slot,
                mode=mode,
                has_initial_states=torch.tensor([a > 0]),
                **weights,
            )
        )
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)


def test_ple_layer_fp8_table_dequantises_like_vllm():
    cfg = tiny_config()
    _, weights = hf_ple_layer(cfg, 0, seed=18)
    scale = torch.tensor(0.02)
    fp8 = (weights["table"] / scale).to(torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(19)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=gen)
    hidden = torch.randn(9, cfg.hc_count * cfg.hidden_size, generator=gen).to(torch.bfloat16)
    args = (hidden, ids, torch.tensor([0, 9]), torch.full((1, 2), EOS))
    quant = dict(weights, table=fp8, table_scale=scale)
    dequant = dict(weights, table=fp8.to(torch.bfloat16) * scale.to(torch.bfloat16))
    assert_exact(ref.ple_layer(*args, **quant), ref.ple_layer(*args, **dequant))


# --------------------------------------------------------------------------------------------
# §8 hyper-connections
# --------------------------------------------------------------------------------------------
def test_hc_mix_and_combine():
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(2, 5, 3 * 4, generator=gen)
    block = torch.randn(2, 5, 4, generator=gen)
    torch.testing.assert_close(ref.hc_mix(x, 3), (x[..., :4] + x[..., 4:8] + x[..., 8:]) / 3)
    assert_exact(ref.hc_average_combine(block, x), x + block.repeat(1, 1, 3))
    # The name's meaning before SPEC §10's hc_combine, still given by its two-argument call.
    assert_exact(ref.hc_combine(block, x), x + block.repeat(1, 1, 3))


@pytest.mark.parametrize("hc_count,hidden_size,lowrank", [(2, 8, 3), (4, 6, 5)])
def test_gated_residual_matches_transformers(hc_count, hidden_size, lowrank):
    cfg = tiny_config(hc_count=hc_count, hidden_size=hidden_size, hc_lowrank=lowrank)
    torch.manual_seed(21)
    module = Qwen4ExpTextGatedResidual(cfg)
    with torch.no_grad():
        module.hc_norm.weight.normal_(0.0, 0.3)
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(3, 7, hc_count * hidden_size, generator=gen) * 2
    block = torch.randn(3, 7, hidden_size, generator=gen)
    with torch.no_grad():
        mixed_hf, hyper_hf, inj_hf = module(x)
        combined_hf = hyper_hf + (block.unsqueeze(-2) * inj_hf.unsqueeze(-1)).flatten(-2)
    w = {k: v.detach() for k, v in module.named_parameters()}
    mixed, normed = ref.gated_residual_mix(
        x,
        w["hc_norm.weight"],
        w["input_mix_weight_down.weight"],
        w["input_mix_weight_up.weight"],
        hc_count=hc_count,
        eps=cfg.rms_norm_eps,
    )
    torch.testing.assert_close(mixed, mixed_hf, rtol=1e-5, atol=1e-6)
    combined = ref.gated_residual_combine(block, x, normed, w["block_inject_weight.weight"])
    torch.testing.assert_close(combined, combined_hf, rtol=1e-5, atol=1e-6)


def test_gated_residual_shared_norm_weight():
    """vLLM's hc_per_branch_norm=False: one [H] weight shared by every stream."""
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(4, 3 * 8, generator=gen).to(torch.bfloat16)
    w = torch.randn(8, generator=gen).to(torch.bfloat16)
    assert_exact(ref.grouped_rms_norm(x, w, 8, 1e-6), ref.grouped_rms_norm(x, w.repeat(3), 8, 1e-6))


# --------------------------------------------------------------------------------------------
# our GatedResidual on the hyper-connection kernels (SPEC §10), mix / combine and the delayed
# combine_and_mix, against transformers' module and its decoder layer's combine
# --------------------------------------------------------------------------------------------
def _hf_chain(cfg, dtype, seed):
    """Three transformers GatedResidual modules (the last a final mixer, use_combine=False) in
    ``dtype``, their norm weights drawn around 0."""
    torch.manual_seed(seed)
    modules = [Qwen4ExpTextGatedResidual(cfg, use_combine=i < 2) for i in range(3)]
    for module in modules:
        with torch.no_grad():
            module.hc_norm.weight.normal_(0.0, 0.3)
        module.to(dtype)
    return modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hc_count,hidden_size,lowrank", [(4, 8, 5), (3, 24, 7)])
@pytest.mark.parametrize("batch", [(2, 7), (1, 3)], ids=["prefill", "decode"])
def test_gated_residual_on_the_kernels_matches_transformers(
    hc_count, hidden_size, lowrank, dtype, batch
):
    """Two blocks between three modules: transformers runs mix, the decoder's combine, mix,
    combine, final mix; ours the same with mix/combine, and again with vLLM's delayed chain
    (mix_delayed, combine_and_mix, combine_and_mix into the final mixer): equal within the
    module tolerance, and the two chains of ours equal to each other. A decode batch (T = 3)
    takes the fused down+inject projection (layers.hyper_connection.FUSED_DOWN_MAX_TOKENS)."""
    from qwen4exp_ext.layers import GatedResidual
    from qwen4exp_ext.testing import assert_within, tolerance

    cfg = tiny_config(hc_count=hc_count, hidden_size=hidden_size, hc_lowrank=lowrank)
    theirs = _hf_chain(cfg, dtype, seed=30)
    ours = []
    for module in theirs:
        mine = GatedResidual(cfg, dtype=dtype, use_combine=module.block_inject_weight is not None)
        mine.load_state_dict(module.state_dict())
        ours.append(mine)
    gen = torch.Generator().manual_seed(31)
    x = (torch.randn(*batch, hc_count * hidden_size, generator=gen) * 2).to(dtype)
    blocks = [torch.randn(*batch, hidden_size, generator=gen).to(dtype) for _ in range(2)]

    def block(i, mixed):  # a stand-in block whose output depends on its input
        return (blocks[i].float() + 0.5 * mixed.float()).to(dtype)

    with torch.no_grad():
        hf_x, hf_mixed = x, []
        for i in range(2):
            mixed, hyper, inj = theirs[i](hf_x)
            hf_mixed.append(mixed)
            hf_x = hyper + (block(i, mixed).unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)
        hf_mixed.append(theirs[2](hf_x))

        my_x, my_mixed = x, []
        for i in range(2):
            mixed, residuals = ours[i].mix(my_x)
            my_mixed.append(mixed)
            my_x = ours[i].combine(block(i, mixed), residuals)
        my_mixed.append(ours[2](my_x))

        hidden, mixed, logits = ours[0].mix_delayed(x)
        delayed = [mixed]
        for i in (1, 2):
            hidden, mixed, logits = ours[i].combine_and_mix(hidden, block(i - 1, mixed), logits)
            delayed.append(mixed)
        assert logits is None  # the final mixer has no injection

    tol = tolerance("hc_module", dtype, against="transformers")
    for i in range(3):
        assert_within(my_mixed[i], hf_mixed[i], tol, f"mix {i}")
        assert_within(delayed[i], my_mixed[i], tolerance("hc_combine_norm", dtype), f"delayed {i}")
    assert_within(my_x, hf_x, tol, "combined streams")
    assert_within(hidden, my_x, tolerance("hc_combine", dtype), "delayed combined streams")


@pytest.mark.parametrize("dot", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_residual_fuses_the_projections_at_decode(monkeypatch, dtype, dot):
    """On the CPU the module runs ops.hc_down_silu_inject up to the measured token limit
    (layers.hyper_connection: 16 for bf16 data with AVX512-BF16 dots, else 4; the logits with
    it where the module has W_inj) and ops.hc_up_gate_mix up to its own (4 with bf16 dots, else
    never), F.linear and the element-wise ops above them; the two paths agree within the fused
    ops' tolerance."""
    from hc_fused_support import cpu_hc_dot
    from qwen4exp_ext import ops
    from qwen4exp_ext.layers import GatedResidual, hyper_connection
    from qwen4exp_ext.testing import assert_within, tolerance

    cfg = tiny_config(hc_count=4, hidden_size=12, hc_lowrank=5)
    module = GatedResidual(cfg, dtype=dtype)
    gen = torch.Generator().manual_seed(33)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(17, 48, generator=gen).to(dtype)
    calls = {"hc_down_silu_inject": [], "hc_up_gate_mix": []}
    for name, found in calls.items():
        real = getattr(ops, name)

        def counted(*args, _real=real, _found=found, **kwargs):
            _found.append(args[0].shape[0])
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, counted)
    with cpu_hc_dot(dot), torch.no_grad():
        down, up = hyper_connection._fused_limits(x[:1])
        bf16_dots = dtype == torch.bfloat16 and dot == "bf16"
        assert (down, up) == ((16, 4) if bf16_dots else (4, 0))
        _, fused_mixed, fused_logits = module.mix_delayed(x[:down])
        _, mixed, logits = module.mix_delayed(x[: down + 1])
        module.mix(x[:1])
    assert calls["hc_down_silu_inject"] == [down, 1]
    assert calls["hc_up_gate_mix"] == ([1] if up else [])
    tol = tolerance("hc_module", dtype, against="reference")
    assert_within(fused_mixed, mixed[:down], tol, "block input")
    assert_within(fused_logits, logits[:down], tolerance("hc_down_silu_inject", dtype), "logits")


def test_combine_pending_without_injection_adds_the_block_to_every_stream():
    """vLLM's NVIDIA module passes no injection logits: unit weight per stream."""
    from qwen4exp_ext.layers import GatedResidual, HyperConnection

    cfg = tiny_config(hc_count=3, hidden_size=8, hc_lowrank=5)
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(5, 24, generator=gen).to(torch.bfloat16)
    block = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
    gated = GatedResidual(cfg, dtype=torch.bfloat16)
    average = HyperConnection(cfg, dtype=torch.bfloat16)
    assert_exact(gated.combine_pending(x, block, None), average.combine(block, x))
    with pytest.raises(ValueError, match="block output must have 8 features"):
        gated.combine_pending(x, block[:, :7], None)
    with pytest.raises(ValueError, match="hyper-connection features"):
        gated.combine_and_mix(x[:, :23], block, None)
