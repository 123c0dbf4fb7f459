"""What the vLLM plugin swaps: one row per vLLM function or method (:data:`SWAPS`); the
replacements live by op family in :mod:`.ple` (``ple_ngram_ids``, ``ple_gate``, ``ple_conv``),
:mod:`.lookup` (the table lookups of every format, the pinned table's allocation) and
:mod:`.amd` (vLLM's AMD code: its NVFP4 refusal and loader, the step-entry lookups),
:mod:`.hc` (the five hyper-connection ops of vLLM's AMD and NVIDIA modules: :data:`HC_SWAPS`),
:mod:`.disk_offload` (vLLM 0.34.0's ``disk_offload`` staging, read by ``read_file_rows``) and
:mod:`.disk_offload_step` (its steps started early, FP8/NVFP4 decoded on the host, and, with
:mod:`.amd`, on ROCm), over :mod:`.base` (what they share).

Every vLLM release the plugin supports (:data:`qwen4exp_ext.vllm.SUPPORTED_VLLM`) gets every row:
a row names its target and signature as in the oldest supported release, and where a later
release moved or changed them the row's ``changes`` say so, from that release on
(:func:`swaps_for` resolves the table for one release); nothing is repeated per release where
it is the same. A row that a later release added (a class the older ones lack) says from which
release it exists (``since``): :func:`swaps_for` leaves it out of older releases' tables, so
that they never look for it. Every replacement has its release's exact signature and calls
:mod:`qwen4exp_ext.ops`. Where
our build has no kernel for a tensor's device (a CPU-only build in a GPU process), it calls
vLLM's own function instead, so vLLM never breaks because of us.

Table formats: unquantized rows are copied bit for bit. FP8 and NVFP4 rows are dequantised in the
gather itself (vLLM: a byte copy, then an eager dequantisation, for FP8; its Triton lookup for
NVFP4), so they leave the lookup in the activation dtype, before the vocabulary (ETP)
reduction. For NVFP4 that is where vLLM dequantises too, with the same rounding as its GPU
kernel. For FP8 the values are vLLM's (``row.to(out) * scale.to(out)``) but the reduction then
sums activations instead of raw bytes: the bytes of a row owned by another rank are zeros either
way, so the sum is exact, except that a -0 row element comes out +0 (-0 + +0) when the ETP group
has more than one rank, and the all-reduce moves 2 (bf16) instead of 1 byte per element. The
AMD layer's refusal of NVFP4 tables is lifted (our kernels serve them on ROCm), and its loader
takes NVFP4 shards with vLLM's NVIDIA loader. Pinned host tables are allocated by
:func:`qwen4exp_ext.tables.host_memory.pinned_host_table`: exactly the table's bytes, where torch's
``pin_memory=True`` rounds each allocation up to a power of two.

This package imports neither vLLM nor anything that does: the plugin hands it vLLM's objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .. import SUPPORTED_VLLM, prefetch, table_dir
from .amd import (
    AMD_MODEL_STATE_MODULE,
    ENGRAM_CONFIG_MODULE,
    _lift_amd_nvfp4_refusal,
    _make_amd_load_weights,
    _make_amd_model_call,
    _make_amd_ngram_forward,
    _make_amd_ngram_init,
    _make_amd_nvfp4_check,
    _make_amd_pinned_lookup,
    _make_amd_prepare_inputs,
    _make_verify_model_config,
)
from .base import (
    AMD_LAYER_MODULE,
    AMD_MODEL_MODULE,
    CONSUMER_PREFIX,
    DEVICE_TYPES,
    DISK_OFFLOAD_EMBEDDING,
    EMBEDDING_MODULE,
    MARK,
    NVIDIA_EMBEDDING_MODULE,
    NVIDIA_MODEL_MODULE,
    PLE_OPS_MODULE,
    signature_text,
)
from .disk_offload import _make_stage_rows
from .disk_offload_step import _make_stage_checkpoint_rows, _make_staged_rows
from .hc import AMD_HC_MODULE, HC_OPS, NVIDIA_HC_MODULE
from .lookup import (
    _make_allocate_device,
    _make_allocate_pinned,
    _make_embedding,
    _make_fp8_dequantize,
    _make_lookup_dtype,
    _make_lookup_from_pinned,
    _make_nvfp4_embedding,
    _make_nvfp4_lookup_from_pinned,
)
from .ple import _make_ple_conv, _make_ple_gate, _make_ple_ngram_ids, head_divmod_for

__all__ = [
    "AMD_HC_MODULE",
    "AMD_LAYER_MODULE",
    "AMD_MODEL_MODULE",
    "CONSUMER_PREFIX",
    "DEVICE_TYPES",
    "EMBEDDING_MODULE",
    "HC_SWAPS",
    "MARK",
    "NVIDIA_EMBEDDING_MODULE",
    "NVIDIA_HC_MODULE",
    "PLE_OPS_MODULE",
    "SWAPS",
    "Change",
    "Swap",
    "head_divmod_for",
    "signature_text",
    "swaps_for",
]


# ---- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """What a vLLM release changed in a row, from that release on: the fields given replace the
    row's (``owner``, ``name``, ``signature``, ``make``, ``trigger``: see :class:`Swap`)."""

    owner: str | None = None
    name: str | None = None
    signature: str | None = None
    make: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    trigger: str | None = None


@dataclass(frozen=True)
class Swap:
    """One vLLM callable that runs our kernel after register().

    ``owner`` is a module (for a function) or ``module:Class`` (for a method); ``signature`` is
    the oldest supported vLLM's, as :func:`signature_text` writes it; ``needs`` is the
    :mod:`qwen4exp_ext.ops` function the replacement calls (the row is skipped while our build
    lacks it); ``torch_op`` names the ``torch.ops.vllm`` op that vLLM registered with this very
    function object, and ``torch_op_module`` the module that registers it.
    ``rebind_consumers`` (module owners) also replaces the copies other vLLM Qwen4Exp modules
    imported; ``applies`` says whether the row applies to this build at all; ``what`` names a
    row that is not a function; ``trigger`` is the vLLM module whose import applies the row
    (with the other rows of the same trigger: all of them or none). ``changes`` holds
    ``(release, Change)`` pairs: what that release of vLLM changed, kept by later ones.
    ``since`` is the first release that has the row's target at all (None: every supported
    release); older releases' tables leave the row out. ``adds``: a method vLLM's class lacks
    (vLLM's optional hooks), added by the plugin and removed on undo; should vLLM define it, the
    row wraps vLLM's like any other (``make`` takes None or vLLM's method).
    """

    owner: str
    name: str
    needs: str
    signature: str
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    torch_op: str | None = None
    torch_op_module: str | None = None
    rebind_consumers: bool = True
    applies: Callable[[], bool] | None = None
    what: str | None = None
    trigger: str = PLE_OPS_MODULE
    changes: tuple[tuple[str, Change], ...] = ()
    since: str | None = None
    adds: bool = False

    @property
    def label(self) -> str:
        if self.what is not None:
            return self.what
        cls = self.owner.partition(":")[2]
        return f"{cls}.{self.name}" if cls else self.name

    def for_release(self, release: str) -> Swap:
        """This row as vLLM ``release`` (one of SUPPORTED_VLLM) has it: every change of that
        release and the releases before it applied, oldest first."""
        order = _release_order(release)
        row = self
        for since, change in sorted(self.changes, key=lambda c: _release_order(c[0])):
            if _release_order(since) <= order:
                fields = {k: v for k, v in vars(change).items() if v is not None}
                row = replace(row, **fields)
        return replace(row, changes=())


def _release_order(release: str) -> int:
    try:
        return SUPPORTED_VLLM.index(release)
    except ValueError:
        raise ValueError(
            f"vLLM release {release!r} is not in the swap table's releases {SUPPORTED_VLLM}"
        ) from None


def swaps_for(release: str) -> tuple[Swap, ...]:
    """The rows of :data:`SWAPS` as vLLM ``release`` has them (ValueError for a release the
    table does not know); a row whose ``since`` is a later release is not among them."""
    order = _release_order(release)
    return tuple(
        swap.for_release(release)
        for swap in SWAPS
        if swap.since is None or _release_order(swap.since) <= order
    )


# The hyper-connection ops (shims/hc.py), two rows each, the same in 0.33.0 and 0.34.0 (which
# only widened the kernels' program ids to int64). AMD: the launcher ``_<op>`` that vLLM
# registered as ``torch.ops.vllm.qwen4_exp_<op>`` (its AMD GatedResidual calls the op; nothing
# imports the launcher). NVIDIA: the function ``<op>``, imported by its GatedResidual (rebound
# there). Each group waits for its own module, so an NVIDIA process never imports the AMD one.
HC_SWAPS: tuple[Swap, ...] = tuple(
    row
    for op, (signature, make) in HC_OPS.items()
    for row in (
        Swap(
            AMD_HC_MODULE,
            f"_{op}",
            op,
            signature,
            make,
            torch_op=f"qwen4_exp_{op}",
            torch_op_module=AMD_HC_MODULE,
            rebind_consumers=False,
            what=f"amd.ops.hc qwen4_exp_{op}",
            trigger=AMD_HC_MODULE,
        ),
        Swap(
            NVIDIA_HC_MODULE,
            op,
            op,
            signature,
            make,
            what=f"nvidia.ops.hc {op}",
            trigger=NVIDIA_HC_MODULE,
        ),
    )
)

SWAPS: tuple[Swap, ...] = (
    Swap(
        PLE_OPS_MODULE,
        "ple_ngram_ids",
        "ngram_ids",
        "(input_ids, query_start_loc, ngram_context, layer_multipliers, ngram_heads_vocab_sizes,"
        " ngram_heads_offsets, eos_token_id, heads_per_ngram, output=None)",
        _make_ple_ngram_ids,
    ),
    Swap(
        PLE_OPS_MODULE,
        "ple_gate",
        "ple_gate",
        "(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, eps)",
        _make_ple_gate,
        torch_op="qwen4_exp_ple_gate",
        torch_op_module=AMD_LAYER_MODULE,
    ),
    Swap(
        PLE_OPS_MODULE,
        "ple_conv",
        "ple_conv",
        "(inputs, residual, conv_state, conv_weights, state_indices, outer_residual, *, mode,"
        " dilation, query_start_loc=None, num_accepted_tokens=None, has_initial_states=None,"
        " spec_query_len=1, token_indices=None)",
        _make_ple_conv,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEEmbeddingMethod",
        "embedding",
        "gather_rows",
        "(self, layer, input_)",
        _make_embedding,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEEmbeddingMethod",
        "lookup_from_pinned",
        "gather_rows",
        "(self, layer, ids, output)",
        _make_lookup_from_pinned,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEEmbeddingMethod",
        "lookup_dtype",
        "gather_rows",
        "(self, layer)",
        _make_lookup_dtype,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEFp8EmbeddingMethod",
        "dequantize",
        "gather_rows",
        "(self, layer, embeddings, output_dtype)",
        _make_fp8_dequantize,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLENvFp4EmbeddingMethod",
        "embedding",
        "gather_rows",
        "(self, layer, input_)",
        _make_nvfp4_embedding,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLENvFp4EmbeddingMethod",
        "lookup_from_pinned",
        "gather_rows",
        "(self, layer, ids, output)",
        _make_nvfp4_lookup_from_pinned,
    ),
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEPinnedHostEmbedding",
        "allocate_embedding_weight",
        "gather_rows",
        "(self, num_embeddings, embedding_dim, dtype)",
        _make_allocate_pinned,
    ),
    # The device table: a table directory's file rows (table_dir.py), or on the CPU huge pages.
    Swap(
        f"{EMBEDDING_MODULE}:Qwen4ExpPLEDeviceEmbedding",
        "allocate_embedding_weight",
        "gather_rows",
        "(self, num_embeddings, embedding_dim, dtype)",
        _make_allocate_device,
    ),
    # A table directory (table_dir.py): vLLM's PLE tables from packed table files.
    Swap(
        f"{NVIDIA_EMBEDDING_MODULE}:Qwen4ExpNGramEmbedding",
        "__init__",
        "gather_rows",
        "(self, config, embedding_dim, ple_dense_layer_id, max_total_tokens, *,"
        " data_parallel_rank, prefix, quant_config=None, params_dtype=None,"
        " use_sequence_parallel=False)",
        table_dir.make_ngram_init,
        what="nvidia Qwen4ExpNGramEmbedding.__init__ (PLE table directory)",
        trigger=NVIDIA_EMBEDDING_MODULE,
    ),
    Swap(
        f"{NVIDIA_EMBEDDING_MODULE}:Qwen4ExpNGramEmbedding",
        "load_weights",
        "gather_rows",
        "(self, weights)",
        table_dir.wrap_load_weights,
        what="nvidia Qwen4ExpNGramEmbedding.load_weights (PLE table directory)",
        trigger=NVIDIA_EMBEDDING_MODULE,
    ),
    Swap(
        f"{NVIDIA_MODEL_MODULE}:Qwen4ExpForCausalLM",
        "is_unused_checkpoint_weight",
        "gather_rows",
        "(self, name)",
        table_dir.make_is_unused_checkpoint_weight,
        what="nvidia Qwen4ExpForCausalLM.is_unused_checkpoint_weight (PLE table directory)",
        trigger=NVIDIA_MODEL_MODULE,
        adds=True,
    ),
    Swap(
        f"{AMD_LAYER_MODULE}:Qwen4ExpNGramEmbedding",
        "__init__",
        "gather_rows",
        "(self, config, embedding_dim, ple_dense_layer_id, max_total_tokens, prefix, layer_name,"
        " *, data_parallel_rank=0, quant_config=None, params_dtype=None,"
        " use_sequence_parallel=False)",
        table_dir.make_ngram_init,
        what="amd Qwen4ExpNGramEmbedding.__init__ (PLE table directory)",
        trigger=AMD_LAYER_MODULE,
    ),
    Swap(
        f"{AMD_MODEL_MODULE}:Qwen4ExpForCausalLM",
        "is_unused_checkpoint_weight",
        "gather_rows",
        "(self, name)",
        table_dir.make_is_unused_checkpoint_weight,
        what="amd Qwen4ExpForCausalLM.is_unused_checkpoint_weight (PLE table directory)",
        trigger=AMD_MODEL_MODULE,
        adds=True,
    ),
    Swap(
        AMD_LAYER_MODULE,
        "Qwen4ExpPLENvFp4EmbeddingMethod",
        "gather_rows",
        "()",
        _make_amd_nvfp4_check,
        rebind_consumers=False,
        applies=_lift_amd_nvfp4_refusal,
        what="amd.ple_layer NVFP4 refusal",
        trigger=AMD_LAYER_MODULE,
    ),
    Swap(
        AMD_LAYER_MODULE,
        "qwen4_exp_amd_ple_ngram_embedding_pinned",
        "gather_rows",
        "(ngram_ids, output, layer_name)",
        _make_amd_pinned_lookup,
        torch_op="qwen4_exp_amd_ple_ngram_embedding_pinned",
        torch_op_module=AMD_LAYER_MODULE,
        rebind_consumers=False,
        applies=prefetch.enabled,
        trigger=AMD_LAYER_MODULE,
    ),
    Swap(
        f"{AMD_MODEL_MODULE}:Qwen4ExpModel",
        "__call__",
        "gather_rows",
        "(self, *args, **kwargs)",
        _make_amd_model_call,
        applies=prefetch.enabled,
        what="amd.model Qwen4ExpModel step-entry PLE lookups",
        trigger=AMD_MODEL_MODULE,
    ),
    Swap(
        f"{AMD_LAYER_MODULE}:Qwen4ExpNGramEmbedding",
        "load_weights",
        "gather_rows",
        "(self, weights)",
        _make_amd_load_weights,
        trigger=AMD_LAYER_MODULE,
    ),
    Swap(
        f"{NVIDIA_EMBEDDING_MODULE}:{DISK_OFFLOAD_EMBEDDING}",
        "stage_rows",
        "read_file_rows",
        "(self, num_tokens)",
        _make_stage_rows,
        trigger=NVIDIA_EMBEDDING_MODULE,
        since="0.34.0",
    ),
    # vLLM 0.34.0's disk_offload, a step at a time (disk_offload_step.py): started early, the
    # forward waiting for its own layer, FP8/NVFP4 decoded on the host where chosen.
    Swap(
        NVIDIA_EMBEDDING_MODULE,
        "stage_checkpoint_rows",
        "read_file_rows",
        "(modules, input_ids, query_start_loc, ngram_context)",
        _make_stage_checkpoint_rows,
        trigger=NVIDIA_EMBEDDING_MODULE,
        since="0.34.0",
    ),
    Swap(
        f"{NVIDIA_EMBEDDING_MODULE}:{DISK_OFFLOAD_EMBEDDING}",
        "staged_rows",
        "read_file_rows",
        "(self, num_tokens)",
        _make_staged_rows,
        trigger=NVIDIA_EMBEDDING_MODULE,
        since="0.34.0",
    ),
    # ... and on ROCm (amd.py): vLLM's refusal lifted where our path serves it, the AMD layer
    # building, loading (load_weights, above) and reading the disk-offloaded table, and the AMD
    # model state staging each step.
    Swap(
        f"{ENGRAM_CONFIG_MODULE}:EngramConfig",
        "verify_model_config",
        "read_file_rows",
        "(self, model_config)",
        _make_verify_model_config,
        trigger=ENGRAM_CONFIG_MODULE,
        since="0.34.0",
    ),
    Swap(
        f"{AMD_LAYER_MODULE}:Qwen4ExpNGramEmbedding",
        "__init__",
        "read_file_rows",
        "(self, config, embedding_dim, ple_dense_layer_id, max_total_tokens, prefix, layer_name,"
        " *, data_parallel_rank=0, quant_config=None, params_dtype=None,"
        " use_sequence_parallel=False)",
        _make_amd_ngram_init,
        what="amd.ple_layer Qwen4ExpNGramEmbedding.__init__ (disk_offload)",
        trigger=AMD_LAYER_MODULE,
        since="0.34.0",
    ),
    Swap(
        f"{AMD_LAYER_MODULE}:Qwen4ExpNGramEmbedding",
        "forward",
        "read_file_rows",
        "(self, input_ids, query_start_loc, ngram_context)",
        _make_amd_ngram_forward,
        what="amd.ple_layer Qwen4ExpNGramEmbedding.forward (disk_offload)",
        trigger=AMD_LAYER_MODULE,
        since="0.34.0",
    ),
    Swap(
        f"{AMD_MODEL_STATE_MODULE}:Qwen4ExpModelState",
        "prepare_inputs",
        "read_file_rows",
        "(self, input_batch, req_states)",
        _make_amd_prepare_inputs,
        what="amd.model_state Qwen4ExpModelState.prepare_inputs (disk_offload)",
        trigger=AMD_MODEL_STATE_MODULE,
        since="0.34.0",
    ),
    *HC_SWAPS,
)
