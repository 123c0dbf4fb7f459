"""The hyper-connection oracle (SPEC §10): against vLLM's Triton kernels on Triton's CPU
interpreter (fp16: bit-equal share and largest difference; fp32: the stated tolerance), its own
rounding points (the delayed combine, fp64 evaluations), seed 004's module math and
transformers 5.18's Qwen4ExpTextGatedResidual. CPU only; every case is seeded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hc_support import (
    HcWeights,
    as_tuple,
    hc_batch,
    need_vllm,
    op_args,
    oracle,
    parity,
    run_vllm,
    vllm_combine_and_mix,
    vllm_mix,
)
from qwen4exp_ext import reference as ref
from qwen4exp_ext.testing import (
    HC_MIN_EQUAL_SHARE,
    HC_OPS,
    assert_exact,
    assert_within,
    tolerance,
)

# (T, H, M): odd T and H, H above and below the kernels' 512-wide tiles, M = 4 (the model) and
# the other counts vLLM's kernels take.
SHAPES = [(13, 72, 4), (1, 600, 4), (7, 100, 3), (5, 40, 1), (3, 24, 8), (2, 2560, 4)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# --------------------------------------------------------------------------------------------
# against vLLM's kernels (the interpreter): fp16 and fp32
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_branch", [True, False], ids=["per_branch", "shared_w"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("op", HC_OPS)
def test_oracle_matches_vllm_kernels(op, dtype, shape, per_branch):
    need_vllm()
    batch = hc_batch(*shape, dtype, seed=sum(shape), per_branch=per_branch, lowrank=9)
    ours = as_tuple(oracle(op, batch))
    theirs = as_tuple(run_vllm(op, *op_args(op, batch)))
    tol = tolerance(op, dtype, against="vllm")
    for index, (got, expected) in enumerate(zip(ours, theirs, strict=True)):
        what = f"{op}[{index}] {dtype} {shape}"
        assert_within(got, expected, tol, what)
        if dtype == torch.float16:
            measured = parity(got, expected)
            assert measured.equal_share >= HC_MIN_EQUAL_SHARE, f"{what}: {measured}"


def test_oracle_matches_vllm_nvidia_without_injection():
    """vLLM's NVIDIA module passes no injection logits to a combine: unit weight per stream."""
    need_vllm("nvidia")
    batch = hc_batch(7, 100, 4, torch.float16, seed=3)
    got = ref.hc_combine(batch.residual, batch.block_output, None, 4)
    expected = run_vllm("hc_combine", batch.residual, batch.block_output, None, 4, vendor="nvidia")
    assert_exact(got, expected)
    h, xn = ref.hc_combine_norm(
        batch.residual, batch.block_output, None, batch.norm_weight, 1e-6, 4
    )
    eh, exn = run_vllm(
        "hc_combine_norm",
        batch.residual,
        batch.block_output,
        None,
        batch.norm_weight,
        1e-6,
        4,
        vendor="nvidia",
    )
    assert_exact(h, eh)
    assert_within(xn, exn, tolerance("hc_combine_norm", torch.float16, against="vllm"))


def test_run_vllm_refuses_bf16():
    need_vllm()
    batch = hc_batch(3, 24, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="triton#8322"):
        run_vllm("hc_silu", batch.lowrank, 4)


# --------------------------------------------------------------------------------------------
# the rounding points, in every dtype
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_branch", [True, False], ids=["per_branch", "shared_w"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_combine_norm_is_the_rounded_combine_then_the_norm(dtype, per_branch):
    """The delayed combine: h is hc_combine's result, and xn normalises h *as stored* (rounded
    before its sum of squares), bit for bit."""
    b = hc_batch(11, 72, 4, dtype, seed=1, per_branch=per_branch)
    h, xn = ref.hc_combine_norm(
        b.residual, b.block_output, b.injection_logits, b.norm_weight, b.eps, 4
    )
    combined = ref.hc_combine(b.residual, b.block_output, b.injection_logits, 4)
    assert_exact(h, combined, bitwise=True)
    assert_exact(xn, ref.grouped_gemma_rmsnorm(combined, b.norm_weight, b.eps, 4), bitwise=True)
    assert h.is_contiguous() and xn.is_contiguous()


def _round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_op_is_one_rounding_of_an_fp64_evaluation(dtype):
    """Every output is the fp64 value of SPEC §10's formula (inputs as stored, the combine
    rounded where it is materialised), rounded once: within one unit of the output dtype (fp32
    intermediates), and in fp16/bf16 mostly equal to it."""
    b = hc_batch(9, 100, 4, dtype, seed=2, lowrank=9)
    d = {name: getattr(b, name).double() for name in ("residual", "block_output", "xn", "gate")}
    inj = 2 / (1 + torch.exp(-b.injection_logits.double() / 4))
    combine = d["residual"].unflatten(1, (4, 100)) + d["block_output"][:, None] * inj[..., None]
    streams = combine.to(dtype).double()  # h, as stored

    def norm(v):
        w = b.norm_weight.double().reshape(-1, 100)
        return v / torch.sqrt(v.square().mean(-1, keepdim=True) + b.eps) * (1 + w)

    silu_in = b.lowrank.double() / 4
    gates = torch.sigmoid(d["gate"].unflatten(1, (4, 100)))
    expected = {
        "hc_combine": combine.flatten(1),
        "hc_combine_norm": norm(streams).flatten(1),
        "grouped_gemma_rmsnorm": norm(d["residual"].unflatten(1, (4, 100))).flatten(1),
        "hc_silu": silu_in * torch.sigmoid(silu_in),
        "hc_gate_mix": (gates * d["xn"].unflatten(1, (4, 100))).mean(1),
    }
    for op, exact in expected.items():
        got = as_tuple(oracle(op, b))[-1]
        assert_within(got, exact.to(dtype), tolerance(op, dtype), f"{op} {dtype}")
        if dtype != torch.float32:
            share = parity(got, exact.to(dtype)).equal_share
            assert share >= HC_MIN_EQUAL_SHARE, f"{op} {dtype}: {share:.4%} correctly rounded"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_batch(dtype):
    b = hc_batch(0, 24, 4, dtype)
    for op in HC_OPS:
        for got in as_tuple(oracle(op, b)):
            assert got.shape[0] == 0 and got.dtype == dtype


def test_fp32_norm_weight_with_16_bit_activations():
    """vLLM keeps the norm weight in the params dtype; an fp32 weight is also accepted and read
    as it is (no rounding to the activations' dtype)."""
    b = hc_batch(5, 40, 4, torch.bfloat16, weight_dtype=torch.float32)
    exact_w = ref.grouped_gemma_rmsnorm(b.residual, b.norm_weight, b.eps, 4)
    rounded_w = ref.grouped_gemma_rmsnorm(b.residual, b.norm_weight.bfloat16(), b.eps, 4)
    assert not torch.equal(exact_w, rounded_w)


# --------------------------------------------------------------------------------------------
# bad arguments: an error naming the argument
# --------------------------------------------------------------------------------------------
def _bad_calls():
    b = hc_batch(4, 24, 4, torch.float16)
    r, blk, inj, w = b.residual, b.block_output, b.injection_logits, b.norm_weight
    yield "residual", lambda: ref.hc_combine(r[:, :95], blk, inj, 4)
    yield "block_output", lambda: ref.hc_combine(r, blk[:, :23], inj, 4)
    yield "block_output", lambda: ref.hc_combine(r, blk.float(), inj, 4)
    yield "injection_logits", lambda: ref.hc_combine(r, blk, inj[:, :3], 4)
    yield "injection_logits", lambda: ref.hc_combine(r, blk, b.down[:, ::2][:, :4], 4)
    yield "hc_count", lambda: ref.hc_combine(r, blk, inj, 5)
    yield "hc_count", lambda: ref.hc_combine(r, blk, inj, 0)
    yield "norm weight", lambda: ref.hc_combine_norm(r, blk, inj, w[:50], 1e-6, 4)
    yield "eps", lambda: ref.hc_combine_norm(r, blk, inj, w, 0.0, 4)
    yield "eps", lambda: ref.hc_combine_norm(r, blk, inj, w, 1e-50, 4)
    yield "x", lambda: ref.grouped_gemma_rmsnorm(r.to(torch.int32), w, 1e-6, 4)
    yield "num_groups", lambda: ref.grouped_gemma_rmsnorm(r, w, 1e-6, 7)
    yield "x", lambda: ref.hc_silu(b.lowrank[None], 4)
    yield "hc_count", lambda: ref.hc_silu(b.lowrank, True)
    yield "gate", lambda: ref.hc_gate_mix(b.xn, b.gate[:, :48], 4)
    yield "gate", lambda: ref.hc_gate_mix(b.xn, b.gate.float(), 4)


@pytest.mark.parametrize(
    "name,call", list(_bad_calls()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_bad_arguments_are_named(name, call):
    with pytest.raises((ValueError, TypeError), match=name):
        call()


# --------------------------------------------------------------------------------------------
# a whole module: seed 004's math and transformers' GatedResidual
# --------------------------------------------------------------------------------------------
def seed_mix(x, w: HcWeights, hc_count, eps, per_branch):
    """Seed 004's ``GatedResidual.mix`` (vLLM's pure-PyTorch module): (mixed, (x, normed))."""
    width = x.shape[-1] // hc_count
    hidden = x.float()
    if not per_branch:
        hidden = hidden.unflatten(-1, (hc_count, width))  # _normalize's unflatten
    grouped = hidden.unflatten(-1, (-1, width)) if per_branch else hidden
    variance = grouped.square().mean(dim=-1, keepdim=True)
    normalized = (grouped * torch.rsqrt(variance + eps)).flatten(-2)
    if not per_branch:
        normalized = normalized.unflatten(-1, (hc_count, width)) * (1.0 + w.norm.float())
        normed = normalized.to(x.dtype).flatten(-2)
    else:
        normed = (normalized * (1.0 + w.norm.float())).to(x.dtype)
    gate = F.silu(F.linear(normed, w.down) / hc_count)
    gate = torch.sigmoid(F.linear(gate, w.up)).unflatten(-1, (hc_count, width))
    mixed = (gate * normed.unflatten(-1, (hc_count, width))).mean(dim=-2)
    return mixed.to(x.dtype), (x, normed)


def seed_combine(block_output, residuals, w: HcWeights, hc_count):
    """Seed 004's ``GatedResidual.combine``."""
    hyper_input, normed = residuals
    residual = hyper_input.unflatten(-1, (hc_count, block_output.shape[-1]))
    injection = 2.0 * torch.sigmoid(F.linear(normed, w.inject) / hc_count)
    out = residual + block_output.unsqueeze(-2) * injection.unsqueeze(-1)
    return out.flatten(-2).to(hyper_input.dtype)


def module_weights(hidden, hc_count, lowrank, dtype, per_branch, seed):
    gen = torch.Generator().manual_seed(seed)
    width = hc_count * hidden

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return HcWeights(
        norm=rand(width if per_branch else hidden, scale=0.3),
        down=rand(lowrank, width, scale=width**-0.5),
        up=rand(width, lowrank, scale=2 * lowrank**-0.5),
        inject=rand(hc_count, width, scale=2 * width**-0.5),
    )


@pytest.mark.parametrize("per_branch", [True, False], ids=["per_branch", "shared_w"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hc_count,hidden", [(4, 72), (3, 40)])
def test_ops_pipeline_matches_seed_module(hc_count, hidden, dtype, per_branch):
    """vLLM's AMD module on the five oracle ops (mix, then the delayed combine fused into the next
    module's norm) against seed 004's module math (mix, combine, mix)."""
    eps = 1e-6
    first = module_weights(hidden, hc_count, 11, dtype, per_branch, seed=4)
    second = module_weights(hidden, hc_count, 11, dtype, per_branch, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(9, hc_count * hidden, generator=gen) * 2).to(dtype)
    block = torch.randn(9, hidden, generator=gen).to(dtype)

    mixed_seed, residuals = seed_mix(x, first, hc_count, eps, per_branch)
    h_seed = seed_combine(block, residuals, first, hc_count)
    mixed2_seed, _ = seed_mix(h_seed, second, hc_count, eps, per_branch)

    mixed, injection = vllm_mix(ref, x, first, hc_count, eps)
    h, mixed2, _ = vllm_combine_and_mix(ref, x, block, injection, second, hc_count, eps)

    tol = tolerance("hc_module", dtype, against="seed")
    assert_within(mixed, mixed_seed, tol, "mix")
    assert_within(h, h_seed, tol, "combine")
    assert_within(mixed2, mixed2_seed, tol, "combine_and_mix")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hc_count,hidden,lowrank", [(4, 8, 5), (3, 24, 7)])
def test_ops_pipeline_matches_transformers(hc_count, hidden, lowrank, dtype):
    """transformers' Qwen4ExpTextGatedResidual and its decoder layer's combine
    (``hyper_input + block ⊗ injection``), followed by the next module, against the ops."""
    pytest.importorskip("transformers.models.qwen4_exp")
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual

    from hf_support import tiny_config

    cfg = tiny_config(hc_count=hc_count, hidden_size=hidden, hc_lowrank=lowrank)
    torch.manual_seed(21)
    modules = [Qwen4ExpTextGatedResidual(cfg) for _ in range(2)]
    for module in modules:
        with torch.no_grad():
            module.hc_norm.weight.normal_(0.0, 0.3)
        module.to(dtype)
    gen = torch.Generator().manual_seed(22)
    x = (torch.randn(13, hc_count * hidden, generator=gen) * 2).to(dtype)
    block = torch.randn(13, hidden, generator=gen).to(dtype)
    with torch.no_grad():
        mixed_hf, hyper_hf, inj_hf = modules[0](x)
        h_hf = hyper_hf + (block.unsqueeze(-2) * inj_hf.unsqueeze(-1)).flatten(-2)
        mixed2_hf, _, _ = modules[1](h_hf)

    weights = [HcWeights.of(m) for m in modules]
    eps = cfg.rms_norm_eps
    mixed, injection = vllm_mix(ref, x, weights[0], hc_count, eps)
    h, mixed2, _ = vllm_combine_and_mix(ref, x, block, injection, weights[1], hc_count, eps)

    tol = tolerance("hc_module", dtype, against="transformers")
    assert_within(mixed, mixed_hf, tol, "mix")
    assert_within(h, h_hf, tol, "combine")
    assert_within(mixed2, mixed2_hf, tol, "combine_and_mix")
