"""The shims of vLLM's PLE ops (``ple_ngram_ids``, ``ple_gate``, ``ple_conv``), each running our
kernel or vLLM's, whichever :mod:`..choice` picked for the shape class; and the ngram_ids
constants cached per head-sizes tensor.

This module imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ... import ops
from .. import choice
from ..choice import OURS, copy_for_timing, token_bucket
from .base import DEVICE_TYPES


@dataclass
class _HeadDivmod:
    """ngram_ids' constants of one head-sizes tensor: those of the tensor's ``version`` (None
    where its sizes are not all positive), and whether a CUDA graph captured them."""

    version: int
    divmod: torch.Tensor | None
    captured: bool = False


# vLLM hands ple_ngram_ids a layer's head sizes on every call; their constants are computed once
# per tensor, keyed by (device, address, length): a tensor written in place (a new _version) or
# a new one at another address misses and is recomputed. A new tensor that reuses a freed
# address with the same version hits constants that may be another layer's: the kernel rebuilds
# every head whose stored divisor is not its size, so that costs time, never wrong ids. The
# least recently used entry goes past _HEAD_DIVMODS_MAX (a process that keeps making new size
# tensors would otherwise grow the cache without end); that covers a head-sizes tensor per layer
# of any released model several times over.
_HEAD_DIVMODS_MAX = 512
_HEAD_DIVMODS: OrderedDict[tuple[torch.device, int, int], _HeadDivmod] = OrderedDict()
# Constants a captured CUDA graph reads: kept alive even once their entry is replaced.
_CAPTURED_DIVMODS: list[torch.Tensor] = []


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def head_divmod_for(sizes: torch.Tensor) -> torch.Tensor | None:
    """The :func:`~qwen4exp_ext.ops.ngram_head_divmod` constants of ``sizes``, from the cache, or
    computed and cached (a host round trip for a GPU tensor). None where they cannot be had
    without work that must not happen here: under torch.compile tracing, and during CUDA graph
    capture for sizes not seen before (a copy to the host is impossible then); also for sizes
    that are not all positive (the kernel treats those heads itself)."""
    if torch.compiler.is_compiling():
        return None
    key = (sizes.device, sizes.data_ptr(), sizes.numel())
    version = sizes._version
    entry = _HEAD_DIVMODS.get(key)
    capturing = _capturing(sizes.device)
    if entry is not None and entry.version == version:
        _HEAD_DIVMODS.move_to_end(key)
        if capturing and entry.divmod is not None and not entry.captured:
            entry.captured = True
            _CAPTURED_DIVMODS.append(entry.divmod)
        return entry.divmod
    if capturing:
        return None
    host = sizes.detach().cpu()
    divmod = None
    if host.dtype == torch.int64 and host.dim() == 1 and bool((host > 0).all()):
        divmod = ops.ngram_head_divmod(host).to(sizes.device)
    _HEAD_DIVMODS[key] = _HeadDivmod(version, divmod)
    _HEAD_DIVMODS.move_to_end(key)
    if len(_HEAD_DIVMODS) > _HEAD_DIVMODS_MAX:
        _HEAD_DIVMODS.popitem(last=False)
    return divmod


def step_context(query_start_loc: torch.Tensor, ngram_context: torch.Tensor) -> torch.Tensor:
    """The rows of ``ngram_context`` that this step's requests own: its first
    ``len(query_start_loc) - 1`` rows (a view, no copy: safe under CUDA graph capture).

    vLLM's model states may hand over more rows than the step has requests (0.34.0's AMD model
    state passes its whole buffer, a row per possible request, with the query_start_loc of the
    padded request count); vLLM's own ``ple_ngram_ids`` kernel reads only the rows of the
    requests it finds in query_start_loc, so the rows past them are simply not the step's. Our
    ``ngram_ids`` keeps its contract (exactly one row per request, SPEC §3): every caller hands
    it this slice. Fewer rows than requests, or a malformed argument, are passed on unchanged for
    the op to reject with its message."""
    requests = query_start_loc.numel() - 1
    if ngram_context.dim() == 2 and 0 <= requests < ngram_context.shape[0]:
        return ngram_context[:requests]
    return ngram_context


def _make_ple_ngram_ids(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def ple_ngram_ids(
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        layer_multipliers: torch.Tensor,
        ngram_heads_vocab_sizes: torch.Tensor,
        ngram_heads_offsets: torch.Tensor,
        eos_token_id: int,
        heads_per_ngram: int,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ngram_context = step_context(query_start_loc, ngram_context)
        args = (
            input_ids,
            query_start_loc,
            ngram_context,
            layer_multipliers,
            ngram_heads_vocab_sizes,
            ngram_heads_offsets,
            eos_token_id,
            heads_per_ngram,
            output,
        )
        device = input_ids.device
        if device.type not in DEVICE_TYPES:
            return original(*args)
        cls = (
            input_ids.dtype,
            ngram_context.shape[1] * heads_per_ngram,
            token_bucket(input_ids.numel()),
        )
        which = choice.choose("ple_ngram_ids", cls, device)
        if which is None:
            divmod = head_divmod_for(ngram_heads_vocab_sizes)

            def setup() -> tuple:
                out = None if output is None else torch.empty_like(output)
                return (*args[:-1], out)

            which = choice.decide(
                "ple_ngram_ids",
                cls,
                device,
                setup,
                lambda a: ops.ngram_ids(*a, head_divmod=divmod),
                lambda a: original(*a),
            )
        if which != OURS:
            return original(*args)
        return ops.ngram_ids(*args, head_divmod=head_divmod_for(ngram_heads_vocab_sizes))

    return ple_ngram_ids


def _make_ple_gate(
    original: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    # The parameter names are vLLM's: torch.ops.vllm.qwen4_exp_ple_gate's schema was inferred
    # from them, and this function becomes that op's kernel.
    def ple_gate(
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor,
        norm_key_w: torch.Tensor,
        norm_query_w: torch.Tensor,
        norm_conv_w: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        args = (key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, eps)
        device = hidden.device
        if device.type not in DEVICE_TYPES:
            return original(*args)
        cls = (hidden.dtype, value.shape[-1], hidden.shape[-1], token_bucket(hidden.shape[0]))
        which = choice.choose("ple_gate", cls, device)
        if which is None:  # nothing written in place: the live arguments serve the timing
            which = choice.decide(
                "ple_gate",
                cls,
                device,
                lambda: args,
                lambda a: ops.ple_gate(*a),
                lambda a: original(*a),
            )
        return (ops.ple_gate if which == OURS else original)(*args)

    return ple_gate


def _make_ple_conv(original: Callable[..., None]) -> Callable[..., None]:
    def ple_conv(
        inputs: torch.Tensor,
        residual: torch.Tensor,
        conv_state: torch.Tensor,
        conv_weights: torch.Tensor,
        state_indices: torch.Tensor,
        outer_residual: torch.Tensor | None,
        *,
        mode: str,
        dilation: int,
        query_start_loc: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
        has_initial_states: torch.Tensor | None = None,
        spec_query_len: int = 1,
        token_indices: torch.Tensor | None = None,
    ) -> None:
        kwargs = dict(
            mode=mode,
            dilation=dilation,
            query_start_loc=query_start_loc,
            num_accepted_tokens=num_accepted_tokens,
            has_initial_states=has_initial_states,
            spec_query_len=spec_query_len,
            token_indices=token_indices,
        )
        device = inputs.device
        if device.type not in DEVICE_TYPES:
            return original(
                inputs, residual, conv_state, conv_weights, state_indices, outer_residual, **kwargs
            )
        tokens = inputs.shape[0] if token_indices is None else token_indices.numel()
        cls = (
            mode,
            "SD" if conv_state.stride(1) == 1 else "DS",  # channel stride 1: window-first
            inputs.dtype,
            inputs.shape[1],
            conv_weights.shape[1],
            dilation,
            "fused" if outer_residual is not None else "-",
            "map" if token_indices is not None else "-",
            token_bucket(tokens),
        )
        which = choice.choose("ple_conv", cls, device)
        if which is None:
            # residual and conv_state are written in place: every timed call gets copies.
            def setup() -> tuple:
                return (
                    inputs,
                    copy_for_timing(residual),
                    copy_for_timing(conv_state),
                    conv_weights,
                    state_indices,
                    outer_residual,
                )

            which = choice.decide(
                "ple_conv",
                cls,
                device,
                setup,
                lambda a: ops.ple_conv(*a, **kwargs),
                lambda a: original(*a, **kwargs),
            )
        fn = ops.ple_conv if which == OURS else original
        return fn(
            inputs, residual, conv_state, conv_weights, state_indices, outer_residual, **kwargs
        )

    return ple_conv
