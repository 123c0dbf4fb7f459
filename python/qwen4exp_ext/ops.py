"""The only Python door to the compiled kernels (``torch.ops.qwen4exp.*``).

Each public function here has the signature users (and vLLM) call; each op also has a fake
implementation (:mod:`qwen4exp_ext._fakes`, registered as this module is imported), so the ops
trace under torch.compile and capture in CUDA graphs. The CPU kernels' tuning switches
(``set_cpu_gather_stream_bytes`` and the rest) live in :mod:`qwen4exp_ext.cpu_tuning` and are
re-exported here.

The doors are the methods of :class:`KernelOps`, bound here to the kernels' own library
``torch.ops.qwen4exp``; :func:`qwen4exp_ext.simt.ops` binds the same doors to the SIMT emulator's
libraries (the HIP kernels run on the CPU), so both take the same arguments and raise the same
errors.
"""

from __future__ import annotations

import math

import torch

from . import _fakes, _switches, cpu_tuning
from ._fakes import NVFP4_TABLE_DTYPE as _NVFP4_TABLE_DTYPE
from .cpu_tuning import (
    CPU_GATHER_PATHS,
    cpu_conv_silu_lookup,
    cpu_fresh_output_bytes,
    cpu_fresh_output_cache_bytes,
    cpu_fresh_output_mode,
    cpu_gather_calls,
    cpu_gather_fp8_lookup,
    cpu_gather_path,
    cpu_gather_stream_bytes,
    cpu_gather_timing,
    cpu_hc_dot,
    cpu_ngram_hash_isa,
    empty_fresh_output_cache,
    fresh_output_cache_held,
    set_cpu_conv_silu_lookup,
    set_cpu_fresh_output_bytes,
    set_cpu_fresh_output_cache_bytes,
    set_cpu_fresh_output_mode,
    set_cpu_gather_fp8_lookup,
    set_cpu_gather_path,
    set_cpu_gather_stream_bytes,
    set_cpu_hc_dot,
    set_cpu_ngram_hash_isa,
)
from .reference import FP8_DTYPES

__all__ = [
    "CPU_GATHER_PATHS",
    "KernelOps",
    "cpu_conv_silu_lookup",
    "cpu_fresh_output_bytes",
    "cpu_fresh_output_cache_bytes",
    "cpu_fresh_output_mode",
    "cpu_gather_calls",
    "cpu_gather_fp8_lookup",
    "cpu_gather_path",
    "cpu_gather_stream_bytes",
    "cpu_gather_timing",
    "cpu_hc_dot",
    "cpu_ngram_hash_isa",
    "empty_fresh_output_cache",
    "fresh_output_cache_held",
    "gather_rows",
    "grouped_gemma_rmsnorm",
    "hc_combine",
    "hc_combine_norm",
    "hc_down_silu_inject",
    "hc_gate_mix",
    "hc_silu",
    "hc_up_gate_mix",
    "ngram_head_divmod",
    "ngram_ids",
    "ple_conv",
    "ple_gate",
    "read_file_rows",
    "set_cpu_conv_silu_lookup",
    "set_cpu_fresh_output_bytes",
    "set_cpu_fresh_output_cache_bytes",
    "set_cpu_fresh_output_mode",
    "set_cpu_gather_fp8_lookup",
    "set_cpu_gather_path",
    "set_cpu_gather_stream_bytes",
    "set_cpu_hc_dot",
    "set_cpu_ngram_hash_isa",
]


# Dynamo knows this function (True while it traces); one global lookup, not three attribute reads.
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling


def _dispatcher_handle(op: torch._ops.OpOverload):
    """The callable that runs ``op`` through the C++ dispatcher, without ``OpOverload.__call__``
    (a Python frame that costs ~2.5 us of a cold decode step's ~13 us; the handle does the same
    dispatch: every dispatch key, mode and tensor subclass is honoured). Dynamo cannot trace it:
    compiled code must call the OpOverload itself."""
    # torch >= 2.13 keeps the C++ handle apart from ``_op``, which it may swap for its PyObject
    # dispatch (a shortcut to Python kernels that our C++ kernels do not have).
    return getattr(op, "_cpp_dispatch_handle", op._op)


# The hyper-connection ops (issue #50), each with its _out form.
_HC_OPS = (
    "hc_combine_norm",
    "hc_combine",
    "grouped_gemma_rmsnorm",
    "hc_gate_mix",
    "hc_silu",
    "hc_up_gate_mix",
    "hc_down_silu_inject",
)
_empty_cpu_output = torch.ops.qwen4exp.empty_cpu_output.default


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An op's output allocated by its door: on the CPU, from
    :func:`~qwen4exp_ext.cpu_tuning.cpu_fresh_output_bytes` bytes on, a freed output's mapping
    from the cache (:func:`~qwen4exp_ext.cpu_tuning.cpu_fresh_output_cache_bytes`), resident, or
    else a new one made resident cheaply before the kernel writes it (csrc/torch/fresh_output.h;
    no 4 KiB fault each page); uninitialised either way, as torch.empty: every caller's op writes
    all of it. torch.empty otherwise, and under Dynamo (which traces torch.empty, not our
    allocation)."""
    if (
        isinstance(dtype, torch.dtype)  # else torch.empty raises its own TypeError, as before
        and math.prod(shape) * dtype.itemsize >= cpu_tuning._fresh_output_bytes
        and device.type == "cpu"
        and not _is_dynamo_compiling()
    ):
        return _empty_cpu_output(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


class KernelOps:
    """The typed doors to one library of the kernel ops (the schemas of csrc/torch/schemas.h).

    ``KernelOps("qwen4exp")`` is this module's ``ngram_ids``, ``gather_rows``, ``ple_gate`` and
    ``ple_conv``; the SIMT emulator's libraries are ``qwen4exp_simt32`` and ``qwen4exp_simt64``.
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        library = getattr(torch.ops, namespace)
        # Resolved once: a torch.ops overload lookup per call is a visible share of a decode
        # step's hashing.
        self._ngram_ids_op = library.ngram_ids.default
        self._gather_rows_op = library.gather_rows.default
        self._gather_rows_handle = _dispatcher_handle(self._gather_rows_op)
        self._ngram_gather_rows_op = library.ngram_gather_rows.default
        self._ngram_gather_rows_handle = _dispatcher_handle(self._ngram_gather_rows_op)
        self._ple_gate_op = library.ple_gate.default
        self._ple_gate_out_op = library.ple_gate_out.default
        self._ple_conv_op = library.ple_conv.default
        self._hc = {
            name: (getattr(library, name).default, getattr(library, f"{name}_out").default)
            for name in _HC_OPS
        }
        _fakes.register_kernel_fakes(namespace)
        _switches.attach(namespace)

    def __repr__(self) -> str:
        return f"KernelOps({self.namespace!r})"

    def ngram_ids(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        layer_multipliers: torch.Tensor,
        ngram_heads_vocab_sizes: torch.Tensor,
        ngram_heads_offsets: torch.Tensor,
        eos_token_id: int,
        heads_per_ngram: int,
        output: torch.Tensor | None = None,
        *,
        head_divmod: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hashed n-gram row ids, SPEC §3 (vLLM's ``ple_ngram_ids``: same signature, result).

        input_ids [T] (int32/int64, any shape is flattened), query_start_loc [R+1], ngram_context
        [R, N-1] (the N-1 tokens before each request's chunk, oldest first), layer_multipliers [N],
        ngram_heads_vocab_sizes and ngram_heads_offsets [NH] int64 with NH = (N-1)·heads_per_ngram.
        Returns ``output`` ([T, NH], int64 unless an int32 ``output`` is passed).

        ``head_divmod``: the layer's :func:`ngram_head_divmod` of ``ngram_heads_vocab_sizes``,
        computed once per layer (int64 [NH, 4], contiguous, on input_ids' device). The ids are
        the same with or without it; the GPU kernel then copies the constants instead of
        building them in every block. A head whose stored divisor is not its size (constants of
        other sizes, or from before they were reloaded) is built as without them.
        """
        if input_ids.dim() != 1:
            input_ids = input_ids.reshape(-1)
        if output is None:
            output = _new_output(
                (input_ids.numel(), ngram_context.shape[-1] * heads_per_ngram),
                torch.int64,
                input_ids.device,
            )
        self._ngram_ids_op(
            input_ids,
            query_start_loc,
            ngram_context,
            layer_multipliers,
            ngram_heads_vocab_sizes,
            ngram_heads_offsets,
            int(eos_token_id),
            int(heads_per_ngram),
            output,
            head_divmod,
        )
        return output

    @staticmethod
    def ngram_head_divmod(head_sizes: torch.Tensor) -> torch.Tensor:
        """:func:`ngram_head_divmod` (host code, the same for every library's ``ngram_ids``)."""
        return ngram_head_divmod(head_sizes)

    def gather_rows(
        self,
        table: torch.Tensor,
        ids: torch.Tensor,
        *,
        scale: torch.Tensor | float | None = None,
        block_scales: torch.Tensor | None = None,
        vocab_start: int = 0,
        vocab_end: int | None = None,
        out_dtype: torch.dtype | None = None,
        output: torch.Tensor | None = None,
        max_blocks: int = 0,
    ) -> torch.Tensor:
        """Embedding rows of every head of every token, concatenated — SPEC §4.

        ``table`` [rows, d] in fp32/bf16/fp16/float8_e4m3fn/float8_e4m3fnuz (rows contiguous;
        fp8 needs the per-tensor fp32 ``scale``, best passed as a 1-element tensor on the table's
        device), ``ids`` [..., NH] int32/int64 → [..., NH·d] in ``out_dtype`` (default: the
        table's dtype, bf16 for fp8 and NVFP4; or ``output``'s dtype).

        NVFP4 (vLLM's layout): a ``uint8`` table [rows, d/2] (two E2M1 codes per byte, the even
        element in the low nibble) with ``block_scales`` (float8_e4m3fn [rows, d/16], rows
        contiguous) and the global fp32 ``scale``; element = fp32(e2m1 · block scale) · scale,
        rounded once in fp32, then to ``out_dtype``: vLLM 0.33.0's Triton lookup, bit for bit.

        This table owns global ids [vocab_start, vocab_end) (default vocab_start + rows) and
        reads table[id - vocab_start] for them; every other id gives a zero row, so no id value
        ever reads out of bounds. A CUDA/ROCm ``table`` may be the GPU view of pinned host memory
        (:func:`qwen4exp_ext.tables.host_memory.device_view`): read zero-copy over PCIe.

        On the CPU an output larger than the caches (a prefill) takes the path measured fastest
        on this machine (:func:`cpu_gather_path`): streaming stores that bypass the cache, which
        it would not fit in anyway, prefetched rows, or index_select's plain row copy. Same
        values on every path.

        ``max_blocks`` > 0 caps the grid of every GPU launch (and the SIMT emulator's) at that
        many blocks, so that a gather on a side stream takes a bounded share of the GPU from the
        compute running beside it; the kernels stride over their grid, so the output is the same
        bit for bit, only slower. 0 (the default) is no cap; a negative value is an error. On the
        CPU it is checked and has no effect: the CPU kernel's threads are torch's intra-op pool
        (:func:`torch.set_num_threads`).
        """
        # At decode this door costs as much as the op itself: each tensor attribute read is
        # ~0.1 us hot, a whole lookup of one token ~2 us hot. With an output and 2-D ids there is
        # nothing to build, so the fast path leaves every check to the op (csrc/
        # gather_rows_args.h, the same checks as below); only when the op rejects the arguments
        # does the checked path run, which names a problem of the door's as ValueError or
        # raises the op's own error again (the op checks before it writes anything).
        if (
            output is not None
            and out_dtype is None
            and ids.dim() == 2
            and (scale is None or isinstance(scale, torch.Tensor))
        ):
            # Dynamo traces the OpOverload; eager calls go straight to the C++ dispatcher.
            call = self._gather_rows_op if _is_dynamo_compiling() else self._gather_rows_handle
            try:
                call(
                    table,
                    ids,
                    scale,
                    block_scales,
                    vocab_start,
                    vocab_end,  # None: the op reads the table's rows itself
                    output,
                    max_blocks,
                )
                return output
            except (RuntimeError, IndexError, TypeError):
                pass
        # The checked path: it reads each tensor attribute once and builds the 2-D output shape
        # directly (slicing a shape costs ~0.4 us).
        table_shape = table.shape
        if len(table_shape) != 2:
            raise ValueError(
                f"gather_rows: table must be 2-D [rows, d], got shape {tuple(table_shape)}"
            )
        ids_shape = ids.shape
        ids_dim = len(ids_shape)
        if ids_dim == 0:
            raise ValueError("gather_rows: ids must be [..., NH], got a 0-d tensor")
        width = table_shape[1]
        table_dtype = table.dtype
        if table_dtype == _NVFP4_TABLE_DTYPE:
            width *= 2
        num_heads = ids_shape[-1]
        if ids_dim == 2:
            out_shape = (ids_shape[0], num_heads * width)
        else:
            out_shape = (*ids_shape[:-1], num_heads * width)
        if output is None:
            if out_dtype is None:
                quantized = table_dtype in FP8_DTYPES or table_dtype == _NVFP4_TABLE_DTYPE
                out_dtype = torch.bfloat16 if quantized else table_dtype
            output = _new_output(out_shape, out_dtype, table.device)
        else:
            if out_dtype is not None and output.dtype != out_dtype:
                raise ValueError(
                    f"gather_rows: output is {output.dtype} but out_dtype is {out_dtype}"
                )
            if output.shape != out_shape:
                raise ValueError(
                    f"gather_rows: output must be {list(out_shape)} = [..., NH·d], "
                    f"got {list(output.shape)}"
                )
        if scale is not None and not isinstance(scale, torch.Tensor):
            scale = torch.tensor([float(scale)], dtype=torch.float32, device=table.device)
        ids2, out2 = ids, output
        if ids_dim != 2:
            # Explicit token counts, not -1: with NH·d == 0 a -1 in a reshape/view is ambiguous.
            num_tokens = math.prod(ids_shape[:-1])
            ids2 = ids.reshape(num_tokens, num_heads)
            out2 = output.view(num_tokens, num_heads * width)
        self._gather_rows_op(
            table,
            ids2,
            scale,
            block_scales,
            int(vocab_start),
            None if vocab_end is None else int(vocab_end),
            out2,
            int(max_blocks),
        )
        return output

    def ngram_gather_rows(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        layer_multipliers: torch.Tensor,
        ngram_heads_vocab_sizes: torch.Tensor,
        ngram_heads_offsets: torch.Tensor,
        eos_token_id: int,
        heads_per_ngram: int,
        table: torch.Tensor,
        *,
        head_divmod: torch.Tensor | None = None,
        scale: torch.Tensor | float | None = None,
        block_scales: torch.Tensor | None = None,
        vocab_start: int = 0,
        vocab_end: int | None = None,
        out_dtype: torch.dtype | None = None,
        output: torch.Tensor | None = None,
        max_blocks: int = 0,
    ) -> torch.Tensor:
        """:meth:`ngram_ids` then :meth:`gather_rows` of its ids, in one op: the same [T, NH·d]
        rows, the ids never written to a tensor (the GPU kernel hashes each row's id in the block
        that gathers it; the CPU kernel keeps them in a per-thread buffer). The arguments are
        those of the two, less ngram_ids' output and gather_rows' ids; ``input_ids`` of any
        shape is flattened.

        ``max_blocks`` is :meth:`gather_rows`' grid cap, for every GPU launch of the op: the
        fused kernel, or where it does not apply the ids kernel and the gather both. Same
        output under any cap; 0 is no cap; no effect on the CPU (torch's intra-op threads)."""
        if input_ids.dim() != 1:
            input_ids = input_ids.reshape(-1)
        nvfp4 = table.dtype == _NVFP4_TABLE_DTYPE
        out_shape = (
            input_ids.shape[0],
            ngram_context.shape[-1] * heads_per_ngram * table.shape[-1] * (2 if nvfp4 else 1),
        )
        if output is None:
            if out_dtype is None:
                quantized = table.dtype in FP8_DTYPES or nvfp4
                out_dtype = torch.bfloat16 if quantized else table.dtype
            output = _new_output(out_shape, out_dtype, table.device)
        elif out_dtype is not None and output.dtype != out_dtype:
            raise ValueError(
                f"ngram_gather_rows: output is {output.dtype} but out_dtype is {out_dtype}"
            )
        if scale is not None and not isinstance(scale, torch.Tensor):
            scale = torch.tensor([float(scale)], dtype=torch.float32, device=table.device)
        # Dynamo traces the OpOverload; eager calls go straight to the C++ dispatcher.
        call = (
            self._ngram_gather_rows_op if _is_dynamo_compiling() else self._ngram_gather_rows_handle
        )
        call(
            input_ids,
            query_start_loc,
            ngram_context,
            layer_multipliers,
            ngram_heads_vocab_sizes,
            ngram_heads_offsets,
            int(eos_token_id),
            int(heads_per_ngram),
            head_divmod,
            table,
            scale,
            block_scales,
            int(vocab_start),
            None if vocab_end is None else int(vocab_end),
            output,
            int(max_blocks),
        )
        return output

    def ple_gate(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor,
        norm_key_w: torch.Tensor,
        norm_query_w: torch.Tensor,
        norm_conv_w: torch.Tensor,
        eps: float,
        *,
        rounding: str = "vllm",
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context-aware gate of every hyper-connection stream, SPEC §5 (vLLM's ``ple_gate``).

        key [T, C] and value [T, H] (row-major views, e.g. column slices of one [T, C+H]
        projection), hidden [T, C], norm weights [C] (fp32 or the activations' dtype), activations
        fp32/bf16/fp16. Returns (gated, conv_input), [T, C] contiguous in hidden's dtype.

        ``rounding="vllm"`` (default) rounds to the storage dtype where vLLM 0.33.0's kernel does
        (normed key and query, products, dot, d, |d|^½, g, gated): fp16 results equal vLLM's kernel
        bit for bit (as run by Triton's interpreter). ``rounding="fp32"`` is the fast single pass:
        fp32 intermediates, one fused weight (1+w_q)(1+w_k), one Σvalue² per token for all streams;
        its tolerance against the fp32 reference is stated and tested in tests/ple_gate/.

        ``out=(gated, conv_input)`` writes into preallocated [T, C] row-major views instead of new
        tensors (and returns them), as vLLM's callers reuse buffers.
        """
        if out is None:
            return self._ple_gate_op(
                key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, float(eps), rounding
            )
        gated, conv_input = out
        self._ple_gate_out_op(
            key,
            value,
            hidden,
            norm_key_w,
            norm_query_w,
            norm_conv_w,
            float(eps),
            rounding,
            gated=gated,
            conv_input=conv_input,
        )
        return gated, conv_input

    def ple_conv(
        self,
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
        """Dilated causal depthwise conv + SiLU with per-request state, SPEC §6 (vLLM's
        ``ple_conv``, same signature and results). Mutates ``residual`` and ``conv_state``.

        inputs/residual/outer_residual [T, C] (row-major views), conv_state [slots, C, W] with any
        strides (vLLM's window-first or dim-first storage), conv_weights [C, K] (fp32 or the
        inputs' dtype), K <= 8, dilation <= 8, mode "decode" | "prefill" | "spec". Slot 0 is the
        null slot (never read or written). With ``outer_residual``: residual <- round(round(residual
        + round(y)) + outer_residual); without: residual <- y. ``query_start_loc`` starts at 0 and
        never decreases. On CPU, out-of-range slots, token indices or query starts raise before
        anything is written; on a GPU (where the host cannot see the data) such rows are skipped:
        their state is left alone and nothing is read out of bounds (with
        :func:`qwen4exp_ext.debug_checks` the GPU raises the CPU's error instead). The CPU kernel
        keeps the last 64 contiguous weight tensors it transposed (by address; reused only while
        their bytes are unchanged), each at most 8·C·K bytes.
        """
        self._ple_conv_op(
            inputs,
            residual,
            conv_state,
            conv_weights,
            state_indices,
            outer_residual,
            conv_mode=mode,
            dilation=int(dilation),
            query_start_loc=query_start_loc,
            num_accepted_tokens=num_accepted_tokens,
            has_initial_states=has_initial_states,
            spec_query_len=int(spec_query_len),
            token_indices=token_indices,
        )

    # ---- hyper-connections (issue #50): vLLM 0.33.0's qwen4_exp_* ops, same arguments ----------
    # Precision as vLLM's Triton kernels (csrc/common/hc_norm.h, hc_mix.h): fp32 arithmetic in
    # vLLM's order, every output rounded to its dtype. Inputs are row-major views (unit stride
    # along the row, any row stride: the injection logits are usually a column slice of the
    # down-GEMM's output); fp32, bf16 or fp16, one dtype per call. ``out=`` writes into
    # preallocated row-major views of the result's shape and dtype (and returns them).

    def hc_combine_norm(
        self,
        residual: torch.Tensor,
        block_output: torch.Tensor,
        injection_logits: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        hc_count: int,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The combine and the next module's per-stream Gemma RMSNorm in one pass (vLLM's
        ``qwen4_exp_hc_combine_norm``): residual [T, HC·H], block_output [T, H], injection_logits
        [T, HC], norm_weight [H] (shared by the streams) or [HC·H] (fp32 or the activations'
        dtype, contiguous). Returns (h, xn), [T, HC·H]: h = round(residual + block · 2·sigmoid(
        logits / HC)) per stream, xn the Gemma RMSNorm of each H-wide stream of h (its squares
        summed after the rounding). ``injection_logits=None`` (vLLM's NVIDIA module) adds the
        block output to every stream as it is. ``out=(h, xn)``."""
        op, op_out = self._hc["hc_combine_norm"]
        args = (residual, block_output, injection_logits, norm_weight, float(eps), int(hc_count))
        if out is None:
            return op(*args)
        h, xn = out
        op_out(*args, h=h, xn=xn)
        return h, xn

    def hc_combine(
        self,
        residual: torch.Tensor,
        block_output: torch.Tensor,
        injection_logits: torch.Tensor | None,
        hc_count: int,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The combine alone (vLLM's ``qwen4_exp_hc_combine``): h of :meth:`hc_combine_norm`,
        [T, HC·H]."""
        return self._hc_call(
            "hc_combine", out, residual, block_output, injection_logits, int(hc_count)
        )

    def grouped_gemma_rmsnorm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        num_groups: int,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gemma RMSNorm of each of the num_groups equal parts of every row of x [N, D] (vLLM's
        ``qwen4_exp_grouped_gemma_rmsnorm``), weight [D / num_groups] (shared) or [D] (fp32 or
        x's dtype, contiguous): y = x·rrms; y += y·w. Returns [N, D]."""
        return self._hc_call("grouped_gemma_rmsnorm", out, x, weight, float(eps), int(num_groups))

    def hc_gate_mix(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        hc_count: int,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block input (vLLM's ``qwen4_exp_hc_gate_mix``): x and gate [T, HC·H] ->
        (Σ over the streams, in order, of sigmoid(gate)·x) / HC, [T, H]."""
        return self._hc_call("hc_gate_mix", out, x, gate, int(hc_count))

    def hc_silu(
        self, x: torch.Tensor, hc_count: int, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """silu(x / HC) of the low-rank projection (vLLM's ``qwen4_exp_hc_silu``), x [T, D]."""
        return self._hc_call("hc_silu", out, x, int(hc_count))

    # ---- the fused decode projections (issue #50 item 3, csrc/common/hc_fused.h) --------------
    # Each reads its weights once for all T tokens (decode: the weights are most of a module's
    # bytes) and never writes the GEMM outputs the element-wise ops would read back. Weights in
    # the activations' dtype, row-major views. Rounding as vLLM's unfused path: each dot in fp32,
    # rounded to the dtype, then the element-wise op's math; only the dots' summation order is
    # ours (qwen4exp_ext.testing states the tolerance against the unfused path).

    def hc_up_gate_mix(
        self,
        lowrank: torch.Tensor,
        w_up: torch.Tensor,
        xn: torch.Tensor,
        hc_count: int,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hc_gate_mix(xn, F.linear(lowrank, w_up), hc_count)`` without the gate tensor:
        lowrank [T, R], w_up [HC·H, R], xn [T, HC·H] -> block input [T, H]."""
        return self._hc_call("hc_up_gate_mix", out, lowrank, w_up, xn, int(hc_count))

    def hc_down_silu_inject(
        self,
        xn: torch.Tensor,
        w_down: torch.Tensor,
        w_inj: torch.Tensor | None,
        hc_count: int,
        *,
        out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hc_silu(F.linear(xn, w_down), hc_count), F.linear(xn, w_inj))`` in one pass over
        xn [T, HC·H]: w_down [R, HC·H], w_inj [HC, HC·H] or None (then the logits are None).
        ``out=(lowrank, logits)``, logits None exactly when w_inj is."""
        op, op_out = self._hc["hc_down_silu_inject"]
        args = (xn, w_down, w_inj, int(hc_count))
        if out is None:
            lowrank, logits = op(*args)
            return lowrank, (None if w_inj is None else logits)
        lowrank, logits = out
        op_out(*args, lowrank=lowrank, logits=logits)
        return lowrank, logits

    def _hc_call(self, name: str, out: torch.Tensor | None, *args) -> torch.Tensor:
        op, op_out = self._hc[name]
        if out is None:
            return op(*args)
        op_out(*args, out=out)
        return out


_kernels = KernelOps("qwen4exp")
ngram_ids = _kernels.ngram_ids
gather_rows = _kernels.gather_rows
ngram_gather_rows = _kernels.ngram_gather_rows
ple_gate = _kernels.ple_gate
ple_conv = _kernels.ple_conv
hc_combine_norm = _kernels.hc_combine_norm
hc_combine = _kernels.hc_combine
grouped_gemma_rmsnorm = _kernels.grouped_gemma_rmsnorm
hc_gate_mix = _kernels.hc_gate_mix
hc_silu = _kernels.hc_silu
hc_up_gate_mix = _kernels.hc_up_gate_mix
hc_down_silu_inject = _kernels.hc_down_silu_inject

# The largest int64: read_file_rows' vocab_end when the reader owns every id from vocab_start on.
_INT64_MAX = 2**63 - 1

_read_file_rows_op = torch.ops.qwen4exp.read_file_rows.default


def read_file_rows(
    fd: int,
    ids: torch.Tensor,
    output: torch.Tensor,
    *,
    data_offset: int,
    row_bytes: int,
    vocab_start: int = 0,
    vocab_end: int | None = None,
    io_threads: int = 0,
    path: str = "",
) -> torch.Tensor:
    """Table rows from a file (issue #39, the direct reader): ``output[k]`` = the ``row_bytes``
    bytes at ``data_offset + ids[k] * row_bytes`` of the file open as ``fd``, for every id in
    ``[vocab_start, vocab_end)`` (default: no upper bound); every other id (-1, another rank's)
    gives an all-zero row and no read. Returns ``output``.

    ``ids``: int32/int64 of any shape and strides, taken in row-major order (n = ids.numel()).
    ``output``: uint8 [n, row_bytes] on the CPU, rows contiguous (a row stride above row_bytes is
    fine). Ids are global: the file holds every row from row 0, and vocab_start/vocab_end only
    select the ones this reader reads.

    ``fd`` stays the caller's (never closed). Opened with ``O_DIRECT``, ``data_offset`` must be a
    multiple of 4096, and every read covers whole 4096-byte blocks through an aligned buffer;
    without it, reads go through the page cache. Rows are read in file order, each group of rows
    whose blocks share or touch in one pread of at most 128 KiB (a row wanted twice is read once),
    ``io_threads`` preads in flight at once (<= 0: 32; never more than there are reads; 1: on
    the calling thread); without O_DIRECT, the reads the page cache can serve are done first on
    the calling thread (``RWF_NOWAIT``), so cached rows start no thread, and the others are
    advised to the kernel's readahead (``POSIX_FADV_WILLNEED``) before the threads read them.
    ``path`` names the file in errors. The GIL is released while it reads (torch.ops calls
    release it).

    Raises RuntimeError, before reading anything, on a bad argument, a closed or write-only fd,
    or an owned id whose offset overflows int64; after reading, on a failed pread (its errno) or
    a file that ends before an owned row does (the output rows are then unspecified).
    """
    _read_file_rows_op(
        int(fd),
        ids,
        int(data_offset),
        int(row_bytes),
        int(vocab_start),
        _INT64_MAX if vocab_end is None else int(vocab_end),
        output,
        int(io_threads),
        str(path),
    )
    return output


def ngram_head_divmod(head_sizes: torch.Tensor) -> torch.Tensor:
    """The fast-modulo constants of a layer's head sizes, for :func:`ngram_ids`' ``head_divmod``:
    int64 [NH, 4] on ``head_sizes``' device (the bytes of csrc/common/fast_divmod.h's
    ``FastDivmodU64`` per head: divisor, multiplier, both shifts in one slot, 2^64 mod divisor).

    Computed on the host by the kernels' own ``make_fast_divmod``; from a GPU tensor that is a
    copy each way, so compute it once per layer (when the sizes are loaded), never per step and
    never during CUDA-graph capture. Raises unless ``head_sizes`` is int64 [NH] of positive sizes.
    """
    if head_sizes.device.type in ("cpu", "meta"):
        return torch.ops.qwen4exp.ngram_head_divmod(head_sizes)
    return torch.ops.qwen4exp.ngram_head_divmod(head_sizes.cpu()).to(head_sizes.device)
