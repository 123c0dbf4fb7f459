"""Issue #50 item 5: with the plugin, the installed vLLM's (0.33.0 or 0.34.0) own hyper-connection
modules run on our kernels, and equal the same modules on vLLM's kernels.

vLLM's AMD ``GatedResidual`` (its ops: ``torch.ops.vllm.qwen4_exp_*``) and its NVIDIA one (the
plain functions of ``nvidia/ops/hc.py``) are built on the CPU in a fresh interpreter with the
plugin loaded, given seeded weights (two modules with a per-branch norm and injection, a final
mixer with a shared norm and none), and run as vLLM's decoder does: ``mix``, the delayed
``combine_and_mix`` twice, and ``combine``; the NVIDIA module also without injection logits,
which only it takes. The profiler proves that each of our five ops ran; ``swapped()`` lists the
ten rows. The expected side is the same pipeline (tests/hc_support.py: ``vllm_mix``,
``vllm_combine_and_mix``, the same GEMMs) on vLLM's own Triton kernels under Triton's CPU
interpreter, in fp32 and fp16 (the interpreter mis-rounds bf16, triton#8322), within the
``hc_module`` tolerance against vLLM (testing.py). Measured on 0.33.0 and 0.34.0: in fp16 17 of
the 19 compared outputs bit for bit, in fp32 2 (exp and rsqrt differ in the last fp32 bits).

A call that our doors refuse (activations of mixed dtypes, a norm weight in a third dtype) runs
on vLLM's kernel: tested on the replacement itself with vLLM's launcher, under the interpreter,
as the original (vLLM on a CPU has Triton switched off, so the real process cannot run it).
"""

from __future__ import annotations

import pytest
import torch

from hc_support import HcWeights, hc_batch, need_vllm, run_vllm, vllm_combine_and_mix, vllm_mix
from qwen4exp_ext import ops
from qwen4exp_ext.bench import vllm_triton
from qwen4exp_ext.testing import close_mismatch, exact_mismatch, tolerance
from qwen4exp_ext.vllm import choice
from qwen4exp_ext.vllm.shims import HC_SWAPS, swaps_for
from qwen4exp_ext.vllm.shims.hc import HC_OPS
from vllm_support import (
    VLLM_VERSIONS,
    InterpretedHcKernels,
    recorded_ops,
    require_vllm,
    run_python,
    script_with_recorded_ops,
)

pytestmark = require_vllm()

HC, H, RANK, T, EPS = 4, 40, 7, 5, 1e-6
OUR_OPS = tuple(f"qwen4exp::{op}" for op in HC_OPS)

_VLLM_SCRIPT = r"""
import os

os.environ["VLLM_PLUGINS"] = "qwen4exp"
import vllm.plugins

vllm.plugins.load_general_plugins()  # as every vLLM process does: only our plugin

from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.models.qwen4_exp.amd.hyperconnection import GatedResidual as AmdGatedResidual
from vllm.models.qwen4_exp.common.hyperconnection import HyperConnectionConfig
from vllm.models.qwen4_exp.nvidia.hyperconnection import GatedResidual as NvidiaGatedResidual

import qwen4exp_ext.vllm as plugin

case = torch.load(os.environ["QWEN4EXP_CASE"], weights_only=False)
dtype = case["dtype"]
vc = VllmConfig(device_config=DeviceConfig("cpu"))
store = os.path.join(os.path.dirname(os.environ["QWEN4EXP_OUT"]), "dist_store")
with set_current_vllm_config(vc):  # vLLM's Linear layers read the TP group
    init_distributed_environment(1, 0, "file://" + store, 0, "gloo")
    initialize_model_parallel(1, 1)


def build(cls, w, use_combine, per_branch):
    cfg = HyperConnectionConfig(
        hc_count=case["hc"], hidden_size=case["h"], params_dtype=dtype,
        hc_lowrank=case["rank"], rms_norm_eps=case["eps"], hc_per_branch_norm=per_branch,
    )
    with set_current_vllm_config(vc):
        module = cls(cfg, use_combine=use_combine)
    with torch.no_grad():
        module.hc_norm.weight.copy_(w["norm"])
        if use_combine:
            down = module.input_mix_weight_down_block_inject.weight
            down.copy_(w["merged_down"])
        else:
            module.input_mix_weight_down.weight.copy_(w["down"])
        module.input_mix_weight_up.weight.copy_(w["up"])
    return module


out = {}
with recorded_ops() as names, torch.no_grad():
    for vendor, cls in (("amd", AmdGatedResidual), ("nvidia", NvidiaGatedResidual)):
        first, second, final = (
            build(cls, case["weights"][i], use_combine, per_branch)
            for i, use_combine, per_branch in ((0, True, True), (1, True, True), (2, False, False))
        )
        x, block, block2 = case["hidden"], case["block"], case["block2"]
        h0, mixed0, inj0 = first.mix(x)
        h1, mixed1, inj1 = second.combine_and_mix(h0, block, inj0)
        h2, mixed2, inj2 = final.combine_and_mix(h1, block2, inj1)
        got = {
            "mix": (mixed0, inj0), "combine_and_mix": (h1, mixed1, inj1),
            "final": (h2, mixed2, inj2), "combine": second.combine(h1, block2, inj1),
        }
        if vendor == "nvidia":  # a combine without injection: the NVIDIA module only
            got["final_no_injection"] = final.combine_and_mix(h1, block2, None)
            got["combine_no_injection"] = second.combine(h1, block2, None)
        out[vendor] = got
torch.save(
    {"out": out, "names": sorted(set(names)), "swapped": list(plugin.swapped())},
    os.environ["QWEN4EXP_OUT"],
)
print("ok")
"""


def _weights(seed: int, per_branch: bool, inject: bool, dtype: torch.dtype) -> HcWeights:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return HcWeights(
        norm=randn(HC * H if per_branch else H, scale=0.3),
        down=randn(RANK, HC * H, scale=0.1),
        up=randn(HC * H, RANK, scale=0.3),
        inject=randn(HC, HC * H, scale=0.1) if inject else None,
    )


def _case(dtype: torch.dtype) -> dict:
    weights = [
        _weights(1, True, True, dtype),
        _weights(2, True, True, dtype),
        _weights(3, False, False, dtype),
    ]
    batch = hc_batch(T, H, HC, dtype, seed=4, strided=False)
    block2 = hc_batch(T, H, HC, dtype, seed=5, strided=False).block_output
    return {
        "dtype": dtype,
        "hc": HC,
        "h": H,
        "rank": RANK,
        "eps": EPS,
        "hidden": batch.residual,
        "block": batch.block_output,
        "block2": block2,
        "hc_weights": weights,
        "weights": [
            {
                "norm": w.norm,
                "down": w.down,
                "up": w.up,
                "merged_down": w.merged_down(dtype) if w.inject is not None else None,
            }
            for w in weights
        ],
    }


def _expected(case: dict, vendor: str) -> dict:
    """The subprocess's pipeline on vLLM's own kernels under the interpreter."""
    kernels = InterpretedHcKernels(vendor)
    w0, w1, w2 = case["hc_weights"]
    x, block, block2 = case["hidden"], case["block"], case["block2"]
    mixed0, inj0 = vllm_mix(kernels, x, w0, HC, EPS)
    h1, mixed1, inj1 = vllm_combine_and_mix(kernels, x, block, inj0, w1, HC, EPS)
    want = {
        "mix": (mixed0, inj0),
        "combine_and_mix": (h1, mixed1, inj1),
        "final": vllm_combine_and_mix(kernels, h1, block2, inj1, w2, HC, EPS),
        "combine": kernels.hc_combine(h1, block2, inj1, HC),
    }
    if vendor == "nvidia":
        want["final_no_injection"] = vllm_combine_and_mix(kernels, h1, block2, None, w2, HC, EPS)
        want["combine_no_injection"] = kernels.hc_combine(h1, block2, None, HC)
    return want


def _flat(value) -> list:
    return list(value) if isinstance(value, tuple) else [value]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_vllm_gated_residual_runs_on_our_kernels_and_equals_vllms(tmp_path, dtype):
    need_vllm("amd"), need_vllm("nvidia")
    case = _case(dtype)
    case_path, out_path = tmp_path / "case.pt", tmp_path / "out.pt"
    torch.save({k: v for k, v in case.items() if k != "hc_weights"}, case_path)
    env = {"QWEN4EXP_CASE": str(case_path), "QWEN4EXP_OUT": str(out_path)}
    env["QWEN4EXP_VLLM_CHOICE_CACHE"] = "0"
    assert run_python(script_with_recorded_ops(_VLLM_SCRIPT), env=env).strip().endswith("ok")
    result = torch.load(out_path, weights_only=False)

    assert set(result["swapped"]) >= {s.label for s in HC_SWAPS}, result["swapped"]
    assert set(OUR_OPS) <= set(result["names"]), result["names"]
    tol = tolerance("hc_module", dtype, against="vllm")
    bit_equal, compared = 0, 0
    for vendor in ("amd", "nvidia"):
        want = _expected(case, vendor)
        assert set(result["out"][vendor]) == set(want)
        for step, expected in want.items():
            for i, (g, e) in enumerate(
                zip(_flat(result["out"][vendor][step]), _flat(expected), strict=True)
            ):
                what = f"{vendor} {step}[{i}]"
                if e is None:
                    assert g is None, what
                    continue
                problem = close_mismatch(g, e, tol, what, against="vLLM's kernels")
                assert problem is None, problem
                compared += 1
                bit_equal += exact_mismatch(g, e, bitwise=True) is None
    assert compared == 19  # the None injections of the final mixers are not tensors
    print(f"{dtype}: {bit_equal} of {compared} outputs bit-equal to vLLM's kernels")


# ---- a call our doors refuse runs on vLLM's kernel -------------------------------------------


def _refused_cases() -> list[tuple[str, tuple, str]]:
    """(op, arguments, the door's message): calls that vLLM's kernels take (they convert every
    load to fp32) and our doors refuse (SPEC §10: one activation dtype per call, a norm weight
    in fp32 or the activations' dtype)."""
    b = hc_batch(T, H, HC, torch.float32, seed=6)
    half = hc_batch(T, H, HC, torch.float16, seed=6)
    return [
        (
            "hc_combine",
            (b.residual, b.block_output.half(), b.injection_logits, HC),
            "block_output must have residual's",
        ),
        (
            "hc_combine_norm",
            (
                half.residual,
                half.block_output.float(),
                half.injection_logits,
                half.norm_weight,
                EPS,
                HC,
            ),
            "block_output must have residual's",
        ),
        (
            "grouped_gemma_rmsnorm",
            (b.residual, b.norm_weight.half(), EPS, HC),
            "weight must be float32 or",
        ),
        ("hc_gate_mix", (b.xn, b.gate.half(), HC), "gate must have"),
    ]


@pytest.mark.parametrize("vendor", ["amd", "nvidia"])
def test_a_call_our_doors_refuse_runs_vllms_kernel(vendor):
    kernels = need_vllm(vendor)
    for op, args, message in _refused_cases():
        launcher = getattr(kernels, f"_{op}" if vendor == "amd" else op)
        replacement = HC_OPS[op][1](launcher)
        with pytest.raises(RuntimeError, match=message):
            getattr(ops, op)(*args)  # the door refuses: else this test would prove nothing
        with vllm_triton.interpreter():
            got = replacement(*args)  # ours refuses (above): the result can only be vLLM's
        expected = run_vllm(op, *args, vendor=vendor)  # vLLM's kernel, called directly
        for g, e in zip(_flat(got), _flat(expected), strict=True):
            assert exact_mismatch(g, e, bitwise=True) is None, op


@pytest.mark.parametrize("vendor", ["amd", "nvidia"])
def test_a_call_our_doors_serve_runs_ours(vendor):
    kernels = need_vllm(vendor)
    b = hc_batch(T, H, HC, torch.float32, seed=7)
    calls = {
        "hc_combine_norm": (b.residual, b.block_output, b.injection_logits, b.norm_weight, EPS, HC),
        "grouped_gemma_rmsnorm": (b.residual, b.norm_weight, EPS, HC),
        "hc_silu": (b.lowrank, HC),
        "hc_gate_mix": (b.xn, b.gate, HC),
        "hc_combine": (b.residual, b.block_output, b.injection_logits, HC),
    }
    for op, args in calls.items():
        launcher = getattr(kernels, f"_{op}" if vendor == "amd" else op)
        with recorded_ops() as names:
            got = HC_OPS[op][1](launcher)(*args)
        assert f"qwen4exp::{op}" in names, op
        for g, e in zip(_flat(got), _flat(getattr(ops, op)(*args)), strict=True):
            assert exact_mismatch(g, e, bitwise=True) is None, op


def test_every_release_has_the_hc_rows():
    """Ten rows (five ops, AMD and NVIDIA) in every supported release's table, with the
    signatures of vLLM's functions as that release's source has them (the subprocess test checks
    the installed release through the plugin's own signature check)."""
    for release in VLLM_VERSIONS:
        rows = [s for s in swaps_for(release) if s in HC_SWAPS]
        assert len(rows) == 10, release


@pytest.fixture
def timed_cpu(monkeypatch):
    """A fresh process-wide chooser that times CPU kernels too (no cache file); the default one
    again after the test."""
    monkeypatch.delenv(choice.ENV, raising=False)

    def make(timer):
        return choice.reset(
            timer=timer, cache_path=None, timed_device_types=frozenset({"cpu", "cuda"})
        )

    yield make
    choice.reset()


@pytest.mark.parametrize("faster", [choice.OURS, choice.VLLM])
def test_each_op_runs_the_kernel_measured_faster(timed_cpu, faster):
    """The measured choice decides per class: with vLLM's kernels under the interpreter timed as
    faster, the replacement runs vLLM's (ours never runs); with the real timer (event_timer's
    wall clock on the CPU), ours wins against the interpreter and runs."""
    kernels = need_vllm("amd")
    timed: list[tuple[str, str]] = []

    def timer(op, label, which, setup, call):
        timed.append((op, which))
        if faster == choice.OURS:
            return choice.event_timer(op, label, which, setup, call, calls=2)
        return 1.0 if which == choice.VLLM else 2.0

    chooser = timed_cpu(timer)
    b = hc_batch(T, H, HC, torch.float32, seed=8)
    calls = {
        "hc_combine_norm": (b.residual, b.block_output, b.injection_logits, b.norm_weight, EPS, HC),
        "grouped_gemma_rmsnorm": (b.residual, b.norm_weight, EPS, HC),
        "hc_silu": (b.lowrank, HC),
        "hc_gate_mix": (b.xn, b.gate, HC),
        "hc_combine": (b.residual, b.block_output, b.injection_logits, HC),
    }
    for op, args in calls.items():
        replacement = HC_OPS[op][1](getattr(kernels, f"_{op}"))
        with vllm_triton.interpreter(), recorded_ops() as names:
            got = replacement(*args)
        assert [c.chosen for c in chooser.choices.values() if c.op == op] == [faster], op
        assert timed[-2:] == [(op, choice.OURS), (op, choice.VLLM)], timed
        if faster == choice.VLLM:
            assert f"qwen4exp::{op}" not in names, op
            expected = run_vllm(op, *args)
        else:
            expected = getattr(ops, op)(*args)
        for g, e in zip(_flat(got), _flat(expected), strict=True):
            assert exact_mismatch(g, e, bitwise=True) is None, op
        with vllm_triton.interpreter():
            replacement(*args)  # the class is known: no second timing
        assert len(timed) == 2 * len(chooser.choices), timed
