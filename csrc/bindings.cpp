// Every schema of the qwen4exp op library, in one place. Backends register their kernels in their
// own files (TORCH_LIBRARY_IMPL at the end of csrc/cpu/*.cpp and csrc/gpu/*.cpp); the Python door
// with the fake (meta) implementations is python/qwen4exp_ext/ops.py.
//
// The namespace is `qwen4exp`, never `_C`: vLLM owns torch.ops._C in the same process.
#include <Python.h>
#include <torch/library.h>

#include <string>

namespace qwen4exp {
int64_t cpu_gather_stream_bytes();  // csrc/cpu/gather_rows.cpp
}  // namespace qwen4exp

#ifndef QWEN4EXP_BUILD_INFO_JSON
#error "setup.py defines QWEN4EXP_BUILD_INFO_JSON (what this binary was built with)"
#endif

TORCH_LIBRARY(qwen4exp, m) {
  // SPEC §3. Writes [T, NH] row ids into `output` (int64, or int32 when every id fits).
  m.def(
      "ngram_ids(Tensor input_ids, Tensor query_start_loc, Tensor ngram_context, "
      "Tensor layer_multipliers, Tensor ngram_heads_vocab_sizes, Tensor ngram_heads_offsets, "
      "int eos_token_id, int heads_per_ngram, Tensor(a!) output) -> ()");
  // SPEC §4. Writes [T, NH·d] = the table rows of ids [T, NH] into `output` (fp32/bf16/fp16; an
  // fp8 table is dequantised with its per-tensor fp32 `scale`). Ids outside [vocab_start,
  // vocab_end) give zero rows: ids are data, never errors, and never read out of bounds.
  m.def(
      "gather_rows(Tensor table, Tensor ids, Tensor? scale, int vocab_start, int vocab_end, "
      "Tensor(a!) output) -> ()");
  // SPEC §4, pinned host tables: pins (or host-registers) a CPU tensor's memory once and returns
  // a view of it on `device` (hip/cudaHostGetDevicePointer) that kernels read over PCIe. GPU
  // builds only (csrc/gpu/host_table.cpp).
  // The output size (bytes) from which the CPU gather takes its streaming path (sorted reads,
  // non-temporal stores; csrc/cpu/gather_rows.cpp), -1 where this CPU or build has none.
  m.def("cpu_gather_stream_bytes() -> int", &qwen4exp::cpu_gather_stream_bytes);
  m.def("host_table_device_view(Tensor host_table, Device device) -> Tensor");
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
  // What was compiled into this binary (backends, GPU archs, torch version), as JSON. Baked in at
  // build time so it cannot disagree with the binary that is loaded.
  m.def("build_info() -> str", []() -> std::string { return QWEN4EXP_BUILD_INFO_JSON; });
}

// The ops register when the library loads; the Python module itself exposes nothing
// (pytorch/extension-cpp style), which keeps it within the stable ABI (abi3 wheel).
extern "C" PyObject* PyInit__kernels(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
