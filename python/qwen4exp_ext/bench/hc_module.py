"""``hc_module`` cases: one whole hyper-connection module step, as vLLM runs it in every
decoder layer — the previous block's pending combine fused with this module's norm, then its mix
(two GEMMs included): ``GatedResidual.combine_and_mix(hidden, block_output, injection_logits)``
at the released shape (H = 2560, M = 4, r = 320, bf16), decode T = 1, 16, 64 and prefill
T = 8192.

Ours: our ``layers.GatedResidual.combine_and_mix`` (SPEC §10's kernels, torch's GEMMs: the down
and inject projections as two GEMMs, where vLLM merges them into one [336, C]). Baselines:
"transformers" (the headline): transformers 5.18's decoder-layer combine (``hyper_input +
(block ⊗ injection weights)``) and its ``Qwen4ExpTextGatedResidual`` forward, in bf16; on a GPU
with vLLM's source here, "vllm": vLLM's path — its Triton ``hc_combine_norm``, the merged down
GEMM, its ``hc_silu``, the up GEMM and its ``hc_gate_mix`` (the AMD module's ``combine_and_mix``
line for line). The oracle is that path on ``reference``'s ops.

Each returns the block input ([T, H], what the check compares first) and the combined streams.
The check holds ours to the oracle and to vLLM's path, and to transformers, within the module
tolerance (qwen4exp_ext.testing.TOLERANCES["hc_module", ...], with the reasons).

Bytes (compulsory): hidden, block output and injection logits read once, the combined streams,
the block input and the new injection logits written once, the three weights read once (the
normalised streams and the gates between the GEMMs are not counted: the fused kernels of the
issue's item 3 never write them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from qwen4exp_ext import reference
from qwen4exp_ext.bench import hc
from qwen4exp_ext.bench.registry import Case
from qwen4exp_ext.testing import close_mismatch, tolerance

DECODE_TOKENS = (1, 16, 64)
PREFILL_TOKENS = 8192
INPUT_SEED = 1
OP = "hc_module"


def cases(device: torch.device) -> list[Case]:
    shapes = [(f"decode_T{t}", t) for t in DECODE_TOKENS]
    shapes += [(f"prefill_T{PREFILL_TOKENS}", PREFILL_TOKENS)]
    launchers = {op: hc._vllm_launcher(op, device) for op in hc.HC_OPS}
    vllm_ops = {op: launcher for op, (launcher, _, _) in launchers.items()}
    _, note, interpreted = launchers["hc_combine_norm"]
    if any(launcher is None for launcher in vllm_ops.values()):
        vllm_ops = None
    return [_case(name, t, device, vllm_ops, note, interpreted) for name, t in shapes]


def _config():
    from qwen4exp_ext.layers import HyperConnectionConfig

    return HyperConnectionConfig(
        hc_count=hc.STREAMS,
        hidden_size=hc.WIDTH,
        params_dtype=hc.DTYPE,
        hc_lowrank=hc.LOWRANK,
        rms_norm_eps=hc.EPS,
        hc_per_branch_norm=True,
    )


def _vllm_path(ops: Any, weights: dict[str, torch.Tensor]) -> Callable[..., Any]:
    """vLLM's AMD ``GatedResidual.combine_and_mix`` on ``ops``' five ops (callables by name):
    (hidden, block_output, logits) -> (block_input, hidden, new logits)."""
    r, m = hc.LOWRANK, hc.STREAMS

    def run(hidden, block_output, logits):
        h, xn = ops["hc_combine_norm"](
            hidden, block_output, logits, weights["norm"], hc.EPS, hc.STREAMS
        )
        down = F.linear(xn, weights["merged_down"])
        lowrank, injection = down[:, :r], down[:, r : r + m]
        gate = F.linear(ops["hc_silu"](lowrank, m), weights["up"])
        return ops["hc_gate_mix"](xn, gate, m), h, injection

    return torch.no_grad()(run)


def _transformers_step(weights: dict[str, torch.Tensor], device: torch.device):
    """transformers' combine lines and its GatedResidual forward: (hidden, block_output,
    injection weights) -> (block_input, combined streams, its injection weights)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual

    cfg = _transformers_config()
    module = Qwen4ExpTextGatedResidual(cfg).to(device=device, dtype=hc.DTYPE)
    with torch.no_grad():
        module.hc_norm.weight.copy_(weights["norm"])
        module.input_mix_weight_down.weight.copy_(weights["down"])
        module.input_mix_weight_up.weight.copy_(weights["up"])
        module.block_inject_weight.weight.copy_(weights["inject"])

    @torch.no_grad()
    def step(hyper_input, block, injection_weights):
        injection = block.unsqueeze(-2) * injection_weights.unsqueeze(-1)
        hidden = hyper_input + injection.flatten(-2)
        mixed, hidden, new_weights = module(hidden)
        return mixed, hidden, new_weights

    return step


def _transformers_config():
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        hidden_size=hc.WIDTH,
        hc_count=hc.STREAMS,
        hc_lowrank=hc.LOWRANK,
        rms_norm_eps=hc.EPS,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )


def _case(
    name: str,
    tokens: int,
    device: torch.device,
    vllm_ops: dict[str, Callable] | None,
    vllm_note: str | None,
    interpreted: bool,
) -> Case:
    from qwen4exp_ext.layers import GatedResidual

    gen = torch.Generator().manual_seed(INPUT_SEED)
    channels = hc.STREAMS * hc.WIDTH

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(hc.DTYPE).to(device)

    weights = {
        "norm": randn(channels, scale=0.3),
        "down": randn(hc.LOWRANK, channels, scale=channels**-0.5),
        "inject": randn(hc.STREAMS, channels, scale=2 * channels**-0.5),
        "up": randn(channels, hc.LOWRANK, scale=2 * hc.LOWRANK**-0.5),
    }
    pad = hc._down_width() - hc.LOWRANK - hc.STREAMS
    pad_rows = torch.zeros(pad, channels, dtype=hc.DTYPE, device=device)
    weights["merged_down"] = torch.cat([weights["down"], weights["inject"], pad_rows])
    hidden = randn(tokens, channels, scale=2.0)
    block = randn(tokens, hc.WIDTH)
    logits = randn(tokens, hc._down_width(), scale=3.0)[:, hc.LOWRANK : hc.LOWRANK + hc.STREAMS]
    injection_weights = 2 * torch.sigmoid(logits.float() / hc.STREAMS).to(hc.DTYPE)

    layer = GatedResidual(_config(), dtype=hc.DTYPE, device=device)
    layer.load_state_dict(
        {
            "hc_norm.weight": weights["norm"],
            "input_mix_weight_down.weight": weights["down"],
            "input_mix_weight_up.weight": weights["up"],
            "block_inject_weight.weight": weights["inject"],
        }
    )
    oracle_path = _vllm_path({op: getattr(reference, op) for op in hc.HC_OPS}, weights)
    eager = _transformers_step(weights, device)

    @torch.no_grad()
    def run_ours():
        h, mixed, new_logits = layer.combine_and_mix(hidden, block, logits)
        return mixed, h, new_logits

    baselines = {"transformers": lambda: eager(hidden, block, injection_weights)[0]}
    vllm_path = None if vllm_ops is None else _vllm_path(vllm_ops, weights)
    if vllm_path is not None:
        baselines["vllm"] = lambda: vllm_path(hidden, block, logits)[0]

    def check() -> str | None:
        got = run_ours()
        others = [
            ("the oracle", "reference", oracle_path(hidden, block, logits)),
            ("transformers", "transformers", eager(hidden, block, injection_weights)),
        ]
        if vllm_path is not None and not interpreted:  # the interpreter mis-rounds bf16
            others.append(("vllm", "vllm", vllm_path(hidden, block, logits)))
        for who, against, expected in others:
            tol = tolerance(OP, hc.DTYPE, against=against)
            for what, g, e in zip(("block_input", "streams"), got[:2], expected[:2], strict=True):
                problem = close_mismatch(g, e, tol, what, against=who)
                if problem is not None:
                    return problem
        return None

    element = torch.tensor([], dtype=hc.DTYPE).element_size()
    per_token = 2 * (channels + hc.WIDTH + hc.STREAMS)
    weight_elements = (hc.LOWRANK + hc.STREAMS) * channels + channels * hc.LOWRANK + channels
    nbytes = element * (tokens * per_token + weight_elements)
    return Case(
        op=OP,
        name=name,
        tokens=tokens,
        nbytes=nbytes,
        ours=lambda: run_ours()[0],
        oracle=lambda: oracle_path(hidden, block, logits)[0],
        baselines=baselines,
        params={"T": tokens, "H": hc.WIDTH, "M": hc.STREAMS, "r": hc.LOWRANK},
        check=check,
        derive=lambda _times: {"bytes_per_token": nbytes / tokens},
        vllm="vllm" if vllm_path is not None else None,
        vllm_note=None if vllm_path is not None else vllm_note,
    )
