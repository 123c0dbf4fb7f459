// The schemas of the kernel ops, in one place: torch.ops.qwen4exp (csrc/torch/bindings.cpp) and
// each SIMT emulator library, torch.ops.qwen4exp_simt32/64 (csrc/torch/simt/glue.cpp), define them
// from here, so the emulated ops cannot differ from the real ones in signature. Backends register
// their kernels in their own files (TORCH_LIBRARY_IMPL in csrc/torch/cpu_ops.cpp and at the end of
// csrc/torch/gpu/*.cpp); the Python door is python/qwen4exp_ext/ops.py, the fake (meta)
// implementations python/qwen4exp_ext/_fakes.py.
#pragma once

#include <torch/library.h>

namespace qwen4exp {

inline void define_kernel_ops(torch::Library& m) {
  // SPEC §3. Writes [T, NH] row ids into `output` (int64, or int32 when every id fits).
  // head_divmod: the layer's fast-modulo constants, qwen4exp::ngram_head_divmod of the head sizes
  // (computed once per layer); the same ids with or without them, the GPU kernel just skips
  // building them in every block.
  m.def(
      "ngram_ids(Tensor input_ids, Tensor query_start_loc, Tensor ngram_context, "
      "Tensor layer_multipliers, Tensor ngram_heads_vocab_sizes, Tensor ngram_heads_offsets, "
      "int eos_token_id, int heads_per_ngram, Tensor(a!) output, Tensor? head_divmod=None) -> ()");
  // SPEC §4. Writes [T, NH·d] = the table rows of ids [T, NH] into `output` (fp32/bf16/fp16; an
  // fp8 table is dequantised with its per-tensor fp32 `scale`, an NVFP4 one — uint8 [rows, d/2] —
  // with its e4m3 `block_scales` [rows, d/16] and global fp32 `scale`). Ids outside
  // [vocab_start, vocab_end) give zero rows: ids are data, never errors, and never read out of
  // bounds. vocab_end None is vocab_start + rows: at decode, reading table.shape[0] in Python
  // costs a noticeable part of the call. max_blocks > 0 caps the grid of every GPU launch (a
  // gather on a side stream then takes a bounded share of the GPU; same output), 0 is no cap; the
  // CPU kernel ignores it. Last, with a default: positional callers of the older schema still fit.
  m.def(
      "gather_rows(Tensor table, Tensor ids, Tensor? scale, Tensor? block_scales, "
      "int vocab_start, int? vocab_end, Tensor(a!) output, int max_blocks=0) -> ()");
  // ngram_ids then gather_rows in one op, the ids never written to a tensor: the arguments of
  // both (ngram_ids' without its output, gather_rows' without its ids), the gather's output, and
  // gather_rows' max_blocks, which caps every launch of the op (the ids kernel's too, where the
  // fused kernel does not apply).
  m.def(
      "ngram_gather_rows(Tensor input_ids, Tensor query_start_loc, Tensor ngram_context, "
      "Tensor layer_multipliers, Tensor ngram_heads_vocab_sizes, Tensor ngram_heads_offsets, "
      "int eos_token_id, int heads_per_ngram, Tensor? head_divmod, Tensor table, Tensor? scale, "
      "Tensor? block_scales, int vocab_start, int? vocab_end, Tensor(a!) output, "
      "int max_blocks=0) -> ()");
  // SPEC §5. Returns (gated, conv_input), [T, C] in hidden's dtype. rounding "vllm" reproduces
  // vLLM 0.33.0's rounding points; "fp32" is the fast single pass (fp32 intermediates).
  m.def(
      "ple_gate(Tensor key, Tensor value, Tensor hidden, Tensor norm_key_w, Tensor norm_query_w, "
      "Tensor norm_conv_w, float eps, str rounding=\"vllm\") -> (Tensor, Tensor)");
  // The same into preallocated [T, C] outputs (row-major views), as vLLM's callers reuse buffers.
  m.def(
      "ple_gate_out(Tensor key, Tensor value, Tensor hidden, Tensor norm_key_w, "
      "Tensor norm_query_w, Tensor norm_conv_w, float eps, str rounding=\"vllm\", *, "
      "Tensor(a!) gated, Tensor(b!) conv_input) -> ()");
  // SPEC §6. Writes the activated conv (plus the fused residuals) into `residual` and advances
  // `conv_state`; conv_mode is "decode", "prefill" or "spec" (vLLM's `mode`: the schema cannot
  // name an argument `mode`, which torch's functionalization wrappers take for themselves).
  m.def(
      "ple_conv(Tensor inputs, Tensor(a!) residual, Tensor(b!) conv_state, Tensor conv_weights, "
      "Tensor state_indices, Tensor? outer_residual, *, str conv_mode, int dilation, "
      "Tensor? query_start_loc=None, Tensor? num_accepted_tokens=None, "
      "Tensor? has_initial_states=None, int spec_query_len=1, Tensor? token_indices=None) -> ()");
  // Issue #50, the hyper-connection ops, with vLLM 0.33.0's arguments (its qwen4_exp_* Triton
  // ops) and precision (csrc/common/hc_norm.h, hc_mix.h). Each has an _out form writing into
  // preallocated row-major views (the door's out=). hc_combine_norm returns (h, xn), [T, HC·H].
  // injection_logits None (vLLM's NVIDIA module) adds the block output to every stream as it is.
  m.def(
      "hc_combine_norm(Tensor residual, Tensor block_output, Tensor? injection_logits, "
      "Tensor norm_weight, float eps, int hc_count) -> (Tensor, Tensor)");
  m.def(
      "hc_combine_norm_out(Tensor residual, Tensor block_output, Tensor? injection_logits, "
      "Tensor norm_weight, float eps, int hc_count, *, Tensor(a!) h, Tensor(b!) xn) -> ()");
  m.def(
      "hc_combine(Tensor residual, Tensor block_output, Tensor? injection_logits, int hc_count) "
      "-> Tensor");
  m.def(
      "hc_combine_out(Tensor residual, Tensor block_output, Tensor? injection_logits, "
      "int hc_count, *, Tensor(a!) out) -> ()");
  m.def("grouped_gemma_rmsnorm(Tensor x, Tensor weight, float eps, int num_groups) -> Tensor");
  m.def(
      "grouped_gemma_rmsnorm_out(Tensor x, Tensor weight, float eps, int num_groups, *, "
      "Tensor(a!) out) -> ()");
  // Returns mean over the HC streams of sigmoid(gate)·x, [T, H].
  m.def("hc_gate_mix(Tensor x, Tensor gate, int hc_count) -> Tensor");
  m.def("hc_gate_mix_out(Tensor x, Tensor gate, int hc_count, *, Tensor(a!) out) -> ()");
  m.def("hc_silu(Tensor x, int hc_count) -> Tensor");
  m.def("hc_silu_out(Tensor x, int hc_count, *, Tensor(a!) out) -> ()");
  // Issue #50 item 3, the fused decode projections (csrc/common/hc_fused.h). hc_up_gate_mix:
  // hc_gate_mix(xn, lowrank @ w_up^T, hc_count), [T, H], the gate never written.
  // hc_down_silu_inject: (hc_silu(xn @ w_down^T, hc_count) [T, R], xn @ w_inj^T [T, HC]); without
  // w_inj the logits are [T, 0] (the _out form then takes none).
  m.def("hc_up_gate_mix(Tensor lowrank, Tensor w_up, Tensor xn, int hc_count) -> Tensor");
  m.def(
      "hc_up_gate_mix_out(Tensor lowrank, Tensor w_up, Tensor xn, int hc_count, *, "
      "Tensor(a!) out) -> ()");
  m.def(
      "hc_down_silu_inject(Tensor xn, Tensor w_down, Tensor? w_inj, int hc_count) "
      "-> (Tensor, Tensor)");
  m.def(
      "hc_down_silu_inject_out(Tensor xn, Tensor w_down, Tensor? w_inj, int hc_count, *, "
      "Tensor(a!) lowrank, Tensor(b!)? logits) -> ()");
}

// Host ops: torch.ops.qwen4exp only (csrc/torch/bindings.cpp), CPU only (csrc/torch/cpu_ops.cpp);
// the SIMT emulator's libraries have no GPU kernel of them to run.
inline void define_host_ops(torch::Library& m) {
  // Issue #39, tables in a file: the rows of `ids` (int32/int64, any shape, flattened row-major)
  // from the file open as `fd` (the caller's: never closed here; O_DIRECT or not) into `output`,
  // uint8 [ids.numel(), row_bytes] on the CPU. Row `id` is the row_bytes bytes at data_offset +
  // id·row_bytes (global ids: the file holds every row from 0); only ids in [vocab_start,
  // vocab_end) are read, every other id gives a zero row. io_threads preads in flight (<= 0: 32);
  // `path` names the file in errors. csrc/common/read_file_rows.h.
  m.def(
      "read_file_rows(int fd, Tensor ids, int data_offset, int row_bytes, int vocab_start, "
      "int vocab_end, Tensor(a!) output, int io_threads, str path) -> ()");
}

}  // namespace qwen4exp
