"""Hyper-connections of Qwen4Exp (SPEC §8; vLLM qwen4_exp's ``HyperConnectionBase`` and
``GatedResidual``): the gated module's element-wise steps on the hyper-connection kernels
(SPEC §10), its projections on torch's GEMM; the average one in plain PyTorch.

A decoder block reads one [.., H] input mixed from the M residual streams ([.., M·H], stream m in
columns m·H .. m·H+H-1) and writes its output back into every stream:

    mixed, residuals = hc.mix(x)
    x = hc.combine(block(mixed), residuals)

State-dict names match transformers' ``Qwen4ExpTextGatedResidual`` (``hc_norm.weight``,
``input_mix_weight_down.weight``, ``input_mix_weight_up.weight``, ``block_inject_weight.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qwen4exp_ext import ops

from .state import _text_config

# The fused decode projections (ops.hc_down_silu_inject: xn read once for the down and inject
# GEMMs, SiLU as the epilogue; ops.hc_up_gate_mix: the up GEMM with hc_gate_mix as the epilogue,
# the gate never written) run where they were measured faster than F.linear + the element-wise
# op: on the CPU, up to these many tokens. Measured with bench/hc_fused.py's shapes (H = 2560,
# M = 4, r = 320, bf16) on a 2-core AMD EPYC Zen 4 VM (AVX512-BF16), 1 thread, 10th percentile of
# 100 calls (another worker shared the VM), fused against unfused, us:
#                        T = 1         T = 4         T = 16
#   down, bf16 dots      97 / 314      159 / 358     633 / 774    (3.2x, 2.3x, 1.2x)
#   down, fp32 dots     173 / 380      311 / 419    1252 / 783    (2.2x, 1.35x, 0.63x)
#   up,   bf16 dots     129 / 268      284 / 330    1386 / 719    (2.1x, 1.16x, 0.52x)
#   up,   fp32 dots     255 / 264      437 / 427    2183 / 758    (1.0x, 1.0x, 0.35x)
# ("bf16 dots": bf16 data where cpu_tuning.cpu_hc_dot() is "bf16", AVX512-BF16's vdpbf16ps;
# "fp32 dots": fp32 FMAs, every other CPU and dtype.) So: the down projection fused up to T = 16
# with bf16 dots, up to 4 without; the up projection fused up to 4 with bf16 dots only. Above
# that the dots, not the weights' bytes, bound the step, and oneDNN's GEMM takes them faster.
# Not on a GPU, where the HIP kernels are not measured yet.
FUSED_DOWN_MAX_TOKENS = 4
FUSED_DOWN_MAX_TOKENS_BF16_DOT = 16
FUSED_UP_MAX_TOKENS_BF16_DOT = 4


def _fused_limits(rows: torch.Tensor) -> tuple[int, int]:
    """(the most tokens for the fused down, for the fused up) of these activations: 0 where the
    fused op is not used."""
    if rows.device.type != "cpu" or rows.shape[0] > FUSED_DOWN_MAX_TOKENS_BF16_DOT:
        return 0, 0
    if rows.dtype == torch.bfloat16 and ops.cpu_hc_dot() == "bf16":
        return FUSED_DOWN_MAX_TOKENS_BF16_DOT, FUSED_UP_MAX_TOKENS_BF16_DOT
    return FUSED_DOWN_MAX_TOKENS, 0


__all__ = ["GatedResidual", "HyperConnection", "HyperConnectionConfig"]


@dataclass
class HyperConnectionConfig:
    """Seed 004's ``HyperConnectionConfig``."""

    hc_count: int = 4
    hidden_size: int = 64
    params_dtype: torch.dtype = torch.bfloat16
    mtp_hc: bool = False
    hc_lowrank: int = 16
    rms_norm_eps: float = 1e-6
    hc_per_branch_norm: bool = True

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype = torch.bfloat16, **overrides: Any):
        """From a ``Qwen4ExpTextConfig``. transformers keeps one norm weight per element of the
        M·H layout (``hc_per_branch_norm=True``); vLLM may share one [H] weight (False)."""
        text = _text_config(config)
        fields = dict(
            hc_count=int(text.hc_count),
            hidden_size=int(text.hidden_size),
            params_dtype=dtype,
            hc_lowrank=int(getattr(text, "hc_lowrank", 16)),
            rms_norm_eps=float(text.rms_norm_eps),
            hc_per_branch_norm=bool(getattr(text, "hc_per_branch_norm", True)),
        )
        fields.update(overrides)
        return cls(**fields)


def _as_hc_config(config: Any, dtype: torch.dtype | None) -> HyperConnectionConfig:
    if isinstance(config, HyperConnectionConfig):
        return config
    return HyperConnectionConfig.from_config(config, dtype or torch.bfloat16)


class HyperConnection(nn.Module):
    """Average pooling (``HyperConnectionBase``): mix = mean of the M streams; combine =
    residual + block output broadcast to every stream. No weights."""

    def __init__(self, config: Any, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = _as_hc_config(config, dtype)
        self.hc_count = self.config.hc_count
        self.hidden_size = self.config.hidden_size

    @property
    def hyper_hidden_size(self) -> int:
        return self.hc_count * self.hidden_size

    def _check(self, hyper_input: torch.Tensor) -> None:
        if hyper_input.shape[-1] != self.hyper_hidden_size:
            raise ValueError(
                f"expected {self.hyper_hidden_size} hyper-connection features, "
                f"got {hyper_input.shape[-1]}"
            )

    def mix(self, hyper_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(hyper_input)
        return hyper_input.unflatten(-1, (self.hc_count, self.hidden_size)).mean(
            dim=-2
        ), hyper_input

    def combine(self, block_output: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        self._check(residual)
        streams = residual.unflatten(-1, (self.hc_count, self.hidden_size))
        return (streams + block_output.unsqueeze(-2)).flatten(-2)


class GatedResidual(HyperConnection):
    """Gated hyper-connection: n = grouped Gemma RMSNorm(x); mix = mean_m(sigmoid(W_up·SiLU(
    W_down·n / M))_m ⊙ n_m); combine = x_m + block_out · 2·sigmoid(W_inj·n / M)_m, reusing the
    mix's n. ``forward(x)`` returns what transformers' module returns: (mixed, x, injection
    weights [.., M]) — or just mixed when built with ``use_combine=False``.

    The element-wise steps run on the hyper-connection kernels (SPEC §10: ``ops.
    grouped_gemma_rmsnorm``, ``hc_silu``, ``hc_gate_mix``, ``hc_combine``, ``hc_combine_norm``)
    with vLLM's rounding points, the two projections on torch's GEMM. Besides ``mix`` and
    ``combine``, vLLM's delayed combine:

        hidden, block_in, logits = hc.mix_delayed(x)
        hidden, block_in, logits = next_hc.combine_and_mix(hidden, block(block_in), logits)
        ...
        x = last_hc.combine_pending(hidden, block(block_in), logits)

    where each combine is fused with the next module's norm (one pass over the residual)."""

    def __init__(
        self,
        config: Any,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        use_mix: bool = True,
        use_combine: bool = True,
    ) -> None:
        super().__init__(config, dtype=dtype)
        cfg = self.config
        dtype = dtype or cfg.params_dtype
        self.eps = float(cfg.rms_norm_eps)
        self.per_branch_norm = bool(cfg.hc_per_branch_norm)
        norm_size = self.hyper_hidden_size if self.per_branch_norm else self.hidden_size
        self.hc_norm = _NormWeight(norm_size, dtype, device)
        factory = dict(bias=False, dtype=dtype, device=device)
        self.input_mix_weight_down = (
            nn.Linear(self.hyper_hidden_size, cfg.hc_lowrank, **factory) if use_mix else None
        )
        self.input_mix_weight_up = (
            nn.Linear(cfg.hc_lowrank, self.hyper_hidden_size, **factory) if use_mix else None
        )
        self.block_inject_weight = (
            nn.Linear(self.hyper_hidden_size, self.hc_count, **factory) if use_combine else None
        )

    # The kernels take [T, width] rows: leading dims are flattened here and restored after.
    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])

    def normalize(self, hyper_input: torch.Tensor) -> torch.Tensor:
        """Grouped Gemma RMSNorm of each H-wide stream (fp32 inside, y = x·rrms; y += y·w),
        in the input dtype."""
        rows = ops.grouped_gemma_rmsnorm(
            self._rows(hyper_input), self.hc_norm.weight, self.eps, self.hc_count
        )
        return rows.reshape(hyper_input.shape)

    def _down(
        self, rows: torch.Tensor, with_logits: bool, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(SiLU(W_down·n / M) [T, r], W_inj·n [T, M] if ``with_logits`` and there is W_inj)."""
        w_down = self.input_mix_weight_down.weight
        inject = self.block_inject_weight if with_logits else None
        w_inj = None if inject is None else inject.weight
        if fused and w_down.dtype == rows.dtype and (w_inj is None or w_inj.dtype == rows.dtype):
            return ops.hc_down_silu_inject(rows, w_down, w_inj, self.hc_count)
        lowrank = ops.hc_silu(F.linear(rows, w_down), self.hc_count)
        return lowrank, None if w_inj is None else F.linear(rows, w_inj)

    def _mix_normed(
        self, normed: torch.Tensor, with_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mix from n on: SiLU(W_down·n / M), its up projection's gates, the gated mean;
        and W_inj·n ([.., M]) where ``with_logits`` and the module has W_inj, else None."""
        if self.input_mix_weight_down is None or self.input_mix_weight_up is None:
            raise RuntimeError("mix was disabled for this hyper-connection")
        rows = self._rows(normed)
        down_limit, up_limit = _fused_limits(rows)
        tokens = rows.shape[0]
        lowrank, logits = self._down(rows, with_logits, tokens <= down_limit)
        w_up = self.input_mix_weight_up.weight
        if tokens <= up_limit and w_up.dtype == rows.dtype:
            mixed = ops.hc_up_gate_mix(lowrank, w_up, rows, self.hc_count)
        else:
            mixed = ops.hc_gate_mix(rows, F.linear(lowrank, w_up), self.hc_count)
        mixed = mixed.reshape(*normed.shape[:-1], self.hidden_size)
        if logits is not None:
            logits = logits.reshape(*normed.shape[:-1], self.hc_count)
        return mixed, logits

    def mix(
        self, hyper_input: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        self._check(hyper_input)
        if self.input_mix_weight_down is None or self.input_mix_weight_up is None:
            raise RuntimeError("mix was disabled for this hyper-connection")
        normed = self.normalize(hyper_input)
        return self._mix_normed(normed)[0], (hyper_input, normed)

    def injection_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """W_inj·n: [.., M] (the combine's injection weights are 2·sigmoid(logits / M))."""
        if self.block_inject_weight is None:
            raise RuntimeError("combine was disabled for this hyper-connection")
        return F.linear(normed, self.block_inject_weight.weight)

    def injection_weights(self, normed: torch.Tensor) -> torch.Tensor:
        """2·sigmoid(W_inj·n / M): [.., M]."""
        return 2.0 * torch.sigmoid(self.injection_logits(normed) / self.hc_count)

    def combine(
        self, block_output: torch.Tensor, residuals: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        hyper_input, normed = residuals
        self._check(hyper_input)
        return self.combine_pending(hyper_input, block_output, self.injection_logits(normed))

    def combine_pending(
        self,
        hyper_input: torch.Tensor,
        block_output: torch.Tensor,
        injection_logits: torch.Tensor | None,
    ) -> torch.Tensor:
        """vLLM's ``combine(hidden, block_output, injection)``: x_m + block_out ·
        2·sigmoid(logits_m / M) (unit weights where ``injection_logits`` is None), for a combine
        that no next module takes over (the last, or before a PLE layer)."""
        self._check(hyper_input)
        if block_output.shape[-1] != self.hidden_size:
            raise ValueError(f"block output must have {self.hidden_size} features")
        logits = None if injection_logits is None else self._rows(injection_logits)
        out = ops.hc_combine(
            self._rows(hyper_input), self._rows(block_output), logits, self.hc_count
        )
        return out.reshape(hyper_input.shape)

    def mix_delayed(
        self, hyper_input: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """vLLM's ``mix``: (hyper_input, block input, injection logits [.., M] or None without
        W_inj), the combine left pending for the next module's :meth:`combine_and_mix` or
        :meth:`combine_pending`."""
        self._check(hyper_input)
        mixed, logits = self._mix_normed(self.normalize(hyper_input), with_logits=True)
        return hyper_input, mixed, logits

    def combine_and_mix(
        self,
        hyper_input: torch.Tensor,
        prev_block_output: torch.Tensor,
        prev_injection_logits: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """vLLM's ``combine_and_mix``: the previous module's pending combine of
        ``prev_block_output`` into ``hyper_input`` (its injection logits, None for unit
        weights), fused with this module's norm (``ops.hc_combine_norm``), then this module's
        mix. Returns (the combined streams, block input, this module's injection logits)."""
        self._check(hyper_input)
        if prev_block_output.shape[-1] != self.hidden_size:
            raise ValueError(f"block output must have {self.hidden_size} features")
        logits = None if prev_injection_logits is None else self._rows(prev_injection_logits)
        hidden, normed = ops.hc_combine_norm(
            self._rows(hyper_input),
            self._rows(prev_block_output),
            logits,
            self.hc_norm.weight,
            self.eps,
            self.hc_count,
        )
        hidden, normed = hidden.reshape(hyper_input.shape), normed.reshape(hyper_input.shape)
        mixed, logits = self._mix_normed(normed, with_logits=True)
        return hidden, mixed, logits

    def forward(
        self, hyper_input: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mixed, (_, normed) = self.mix(hyper_input)
        if self.block_inject_weight is None:
            return mixed
        return mixed, hyper_input, self.injection_weights(normed)


class _NormWeight(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
