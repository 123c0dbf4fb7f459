// The CPU kernels as torch ops (TORCH_LIBRARY_IMPL CPU): each entry checks its tensors
// (csrc/torch/args/<op>_args.h), including the index values the CPU can read for free, builds the
// params struct and runs the torch-free kernel of csrc/cpu/<op>.cpp. Also the threads those kernels
// run on in this extension: ATen's, so that torch.set_num_threads applies to them
// (csrc/cpu/threads.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>

#include "../common/gather_rows.h"
#include "../common/ngram_gather_rows.h"
#include "../common/ngram_ids.h"
#include "../common/ple_conv.h"
#include "../common/ple_gate.h"
#include "../common/read_file_rows.h"
#include "../cpu/threads.h"
#include "args/gather_rows_args.h"
#include "args/ngram_gather_rows_args.h"
#include "args/ngram_ids_args.h"
#include "args/ple_conv_args.h"
#include "args/ple_gate_args.h"
#include "args/read_file_rows_args.h"
#include "fresh_output.h"
#include "hc_entries.h"

namespace qwen4exp {

namespace cpu {

int64_t num_threads() { return std::max<int64_t>(1, at::get_num_threads()); }

void parallel_for_range(int64_t begin, int64_t end, int64_t grain, RangeFn fn) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(b, e); });
}

}  // namespace cpu

namespace {

void check_on_cpu(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), op, ": CPU kernel called with ", t.device(), " tensors");
}

void ngram_ids_cpu(const at::Tensor& input_ids, const at::Tensor& query_start_loc,
                   const at::Tensor& ngram_context, const at::Tensor& layer_multipliers,
                   const at::Tensor& ngram_heads_vocab_sizes, const at::Tensor& ngram_heads_offsets,
                   int64_t eos_token_id, int64_t heads_per_ngram, const at::Tensor& output,
                   const std::optional<at::Tensor>& head_divmod) {
  // head_divmod's metadata is checked like the GPU's; the CPU kernel builds its own constants.
  const NgramIdsParams p = check_ngram_ids_args(
      input_ids, query_start_loc, ngram_context, layer_multipliers, ngram_heads_vocab_sizes,
      ngram_heads_offsets, eos_token_id, heads_per_ngram, output, head_divmod);
  check_on_cpu("ngram_ids", input_ids);
  const bool output_int64 = output.scalar_type() == at::kLong;
  check_ngram_ids_values(p, !output_int64);
  run_ngram_ids_cpu(p, output_int64);
}

// The fast-modulo constants of a layer's head sizes, [NH, 4] int64 (the bytes of
// FastDivmodU64[NH]), for ngram_ids' head_divmod: computed once per layer, on the host, by the
// one definition the kernels use (make_fast_divmod).
at::Tensor ngram_head_divmod_cpu(const at::Tensor& head_sizes) {
  TORCH_CHECK(head_sizes.scalar_type() == at::kLong && head_sizes.dim() == 1,
              "ngram_head_divmod: head_sizes must be int64 [NH], got ", head_sizes.scalar_type(),
              " ", head_sizes.sizes());
  check_on_cpu("ngram_head_divmod", head_sizes);
  const at::Tensor sizes = head_sizes.contiguous();
  const int64_t* size = sizes.data_ptr<int64_t>();
  const int64_t num_heads = sizes.numel();
  at::Tensor out = at::empty({num_heads, kFastDivmodWords}, sizes.options());
  auto* constants = reinterpret_cast<FastDivmodU64*>(out.data_ptr<int64_t>());
  for (int64_t h = 0; h < num_heads; ++h) {
    TORCH_CHECK(size[h] > 0, "ngram_head_divmod: head_sizes[", h, "] must be positive, got ",
                size[h]);
    constants[h] = make_fast_divmod(static_cast<uint64_t>(size[h]));
  }
  return out;
}

void gather_rows_cpu(const at::Tensor& table, const at::Tensor& ids,
                     const std::optional<at::Tensor>& scale,
                     const std::optional<at::Tensor>& block_scales, int64_t vocab_start,
                     std::optional<int64_t> vocab_end, const at::Tensor& output,
                     int64_t max_blocks) {
  // max_blocks caps the GPU launchers' grids: checked here as everywhere, and without effect (the
  // CPU kernel runs on the intra-op threads of ATen, torch.set_num_threads).
  const GatherRowsParams p = check_gather_rows_args(table, ids, scale, block_scales, vocab_start,
                                                    vocab_end, output, max_blocks);
  check_on_cpu("gather_rows", table);
  run_gather_rows_cpu(p);
}

void ngram_gather_rows_cpu(const at::Tensor& input_ids, const at::Tensor& query_start_loc,
                           const at::Tensor& ngram_context, const at::Tensor& layer_multipliers,
                           const at::Tensor& ngram_heads_vocab_sizes,
                           const at::Tensor& ngram_heads_offsets, int64_t eos_token_id,
                           int64_t heads_per_ngram, const std::optional<at::Tensor>& head_divmod,
                           const at::Tensor& table, const std::optional<at::Tensor>& scale,
                           const std::optional<at::Tensor>& block_scales, int64_t vocab_start,
                           std::optional<int64_t> vocab_end, const at::Tensor& output,
                           int64_t max_blocks) {
  // max_blocks: checked, without effect on the CPU (as gather_rows_cpu's).
  const NgramGatherRowsParams p = check_ngram_gather_rows_args(
      input_ids, query_start_loc, ngram_context, layer_multipliers, ngram_heads_vocab_sizes,
      ngram_heads_offsets, eos_token_id, heads_per_ngram, head_divmod, table, scale, block_scales,
      vocab_start, vocab_end, output, max_blocks);
  check_on_cpu(kNgramGatherRows, table);
  check_ngram_ids_values(p.ngram, /*output_int32=*/false, kNgramGatherRows);
  run_ngram_gather_rows_cpu(p);
}

std::tuple<at::Tensor, at::Tensor> ple_gate_cpu(const at::Tensor& key, const at::Tensor& value,
                                                const at::Tensor& hidden,
                                                const at::Tensor& norm_key_w,
                                                const at::Tensor& norm_query_w,
                                                const at::Tensor& norm_conv_w, double eps,
                                                c10::string_view rounding) {
  PleGateParams p = check_ple_gate_args(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w,
                                        eps, std::string(rounding));
  check_on_cpu("ple_gate", hidden);
  // Fresh outputs made resident cheaply (fresh_output.h): at prefill, faulting two 168 MB
  // outputs in 4 KiB at a time cost as much as the gate itself.
  at::Tensor gated = empty_cpu_output(hidden.sizes(), hidden.scalar_type());
  at::Tensor conv_input = empty_cpu_output(hidden.sizes(), hidden.scalar_type());
  check_ple_gate_outputs(hidden, gated, conv_input, p);
  run_ple_gate_cpu(p);
  return {gated, conv_input};
}

void ple_gate_out_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& hidden,
                      const at::Tensor& norm_key_w, const at::Tensor& norm_query_w,
                      const at::Tensor& norm_conv_w, double eps, c10::string_view rounding,
                      const at::Tensor& gated, const at::Tensor& conv_input) {
  PleGateParams p = check_ple_gate_args(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w,
                                        eps, std::string(rounding));
  check_on_cpu("ple_gate", hidden);
  check_ple_gate_outputs(hidden, gated, conv_input, p);
  run_ple_gate_cpu(p);
}

void ple_conv_cpu(const at::Tensor& inputs, const at::Tensor& residual,
                  const at::Tensor& conv_state, const at::Tensor& conv_weights,
                  const at::Tensor& state_indices, const std::optional<at::Tensor>& outer_residual,
                  c10::string_view mode, int64_t dilation,
                  const std::optional<at::Tensor>& query_start_loc,
                  const std::optional<at::Tensor>& num_accepted_tokens,
                  const std::optional<at::Tensor>& has_initial_states, int64_t spec_query_len,
                  const std::optional<at::Tensor>& token_indices) {
  const PleConvParams p = check_ple_conv_args(inputs, residual, conv_state, conv_weights,
                                              state_indices, outer_residual, std::string(mode),
                                              dilation, query_start_loc, num_accepted_tokens,
                                              has_initial_states, spec_query_len, token_indices);
  check_on_cpu("ple_conv", inputs);
  check_ple_conv_values(p);
  run_ple_conv_cpu(p);
}

// Host code, not a kernel: the rows of ids (any shape, flattened in row-major order) from the
// file behind fd into output [ids.numel(), row_bytes] (csrc/common/read_file_rows.h). Its own
// threads (io_threads preads in flight), not ATen's: they wait on the device, not on a core.
void read_file_rows_cpu(int64_t fd, const at::Tensor& ids, int64_t data_offset, int64_t row_bytes,
                        int64_t vocab_start, int64_t vocab_end, const at::Tensor& output,
                        int64_t io_threads, c10::string_view path) {
  const std::string name(path);
  // A flat view of the ids where one exists (any strides), a copy where none does.
  const at::Tensor flat = ids.reshape({-1});
  const ReadFileRowsParams p = check_read_file_rows_args(
      fd, flat, data_offset, row_bytes, vocab_start, vocab_end, output, io_threads, name);
  const ReadFileRowsStatus status = run_read_file_rows_cpu(p);
  TORCH_CHECK(status.ok(), status.error);
}

// The hyper-connection ops' entries (hc_entries.h) on the CPU kernels.
struct HcCpu {
  static void check_device(const char* op, const at::Tensor& t) { check_on_cpu(op, t); }
  // Made resident cheaply when large (fresh_output.h): at prefill, h and xn are 168 MB each.
  static at::Tensor empty(at::IntArrayRef sizes, const at::Tensor& like) {
    return empty_cpu_output(sizes, like.scalar_type());
  }
  static void run(const char*, const HcCombineParams& p, const at::Tensor&) {
    run_hc_combine_cpu(p);
  }
  static void run(const char*, const HcRmsNormParams& p, const at::Tensor&) {
    run_hc_rmsnorm_cpu(p);
  }
  static void run(const char*, const HcGateMixParams& p, const at::Tensor&) {
    run_hc_gate_mix_cpu(p);
  }
  static void run(const char*, const HcSiluParams& p, const at::Tensor&) { run_hc_silu_cpu(p); }
  static void run(const char*, const HcUpGateMixParams& p, const at::Tensor&) {
    run_hc_up_gate_mix_cpu(p);
  }
  static void run(const char*, const HcDownSiluInjectParams& p, const at::Tensor&) {
    run_hc_down_silu_inject_cpu(p);
  }
};

}  // namespace
}  // namespace qwen4exp

TORCH_LIBRARY_IMPL(qwen4exp, CPU, m) {
  qwen4exp::HcEntries<qwen4exp::HcCpu>::register_impls(m);
  m.impl("ngram_ids", &qwen4exp::ngram_ids_cpu);
  m.impl("ngram_head_divmod", &qwen4exp::ngram_head_divmod_cpu);
  m.impl("gather_rows", &qwen4exp::gather_rows_cpu);
  m.impl("ngram_gather_rows", &qwen4exp::ngram_gather_rows_cpu);
  m.impl("ple_gate", &qwen4exp::ple_gate_cpu);
  m.impl("ple_gate_out", &qwen4exp::ple_gate_out_cpu);
  m.impl("ple_conv", &qwen4exp::ple_conv_cpu);
  m.impl("read_file_rows", &qwen4exp::read_file_rows_cpu);
}
