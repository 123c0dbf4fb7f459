// Host glue for the hyper-connection HIP kernels (hc_norm.hip, hc_mix.hip): the entries of
// ../hc_entries.h with the GPU's device check, device guard, current stream, launch and launch
// check. Compiled by the host compiler against the CUDA runtime headers (and hipified with the rest
// of the extension on ROCm, where the dispatch key is still CUDA), and for the SIMT emulator
// (glue.h).
#include "glue.h"

#include "../../common/hc_fused.h"
#include "../../common/hc_mix.h"
#include "../../common/hc_norm.h"
#include "../hc_entries.h"

namespace qwen4exp {
namespace {

struct HcGpu {
  static void check_device(const char* op, const at::Tensor& t) {
    TORCH_CHECK(glue::on_kernel_device(t), op, ": GPU kernel called with ", t.device(), " tensors");
  }
  static at::Tensor empty(at::IntArrayRef sizes, const at::Tensor& like) {
    return at::empty(sizes, like.options());
  }

  template <typename P, typename Launch>
  static void launch(const char* op, const P& p, int64_t rows, int64_t width,
                     const at::Tensor& like, Launch launcher) {
    if (rows == 0 || width == 0) return;
    const glue::DeviceGuard device_guard(like.device());
    const hipError_t status = launcher(p, glue::current_stream());
    TORCH_CHECK(status == hipSuccess, op, ": kernel launch failed: ", hipGetErrorString(status));
  }

  static void run(const char* op, const HcCombineParams& p, const at::Tensor& like) {
    launch(op, p, p.num_tokens, p.width, like,
           p.xn != nullptr ? launch_hc_combine_norm : launch_hc_combine);
  }
  static void run(const char* op, const HcRmsNormParams& p, const at::Tensor& like) {
    launch(op, p, p.num_rows, p.width, like, launch_hc_rmsnorm);
  }
  static void run(const char* op, const HcGateMixParams& p, const at::Tensor& like) {
    launch(op, p, p.num_tokens, p.width, like, launch_hc_gate_mix);
  }
  static void run(const char* op, const HcSiluParams& p, const at::Tensor& like) {
    launch(op, p, p.num_tokens, p.width, like, launch_hc_silu);
  }
  static void run(const char* op, const HcUpGateMixParams& p, const at::Tensor& like) {
    launch(op, p, p.num_tokens, p.width, like, launch_hc_up_gate_mix);
  }
  // The split-K partial sums: a fresh fp32 buffer from the caching allocator, on the stream the
  // kernels run on (freed here, reused only by work queued after them).
  static void run(const char* op, const HcDownSiluInjectParams& p, const at::Tensor& like) {
    if (p.num_tokens == 0) return;
    const int32_t rows = p.rank + (p.w_inj != nullptr ? p.streams : 0);
    const at::Tensor workspace = at::empty({hc_down_workspace_floats(p.num_tokens, p.depth, rows)},
                                           like.options().dtype(at::kFloat));
    HcDownSiluInjectParams q = p;
    q.workspace = workspace.data_ptr<float>();
    launch(op, q, p.num_tokens, p.depth, like, launch_hc_down_silu_inject);
  }
};

}  // namespace
}  // namespace qwen4exp

QWEN4EXP_GLUE_IMPL(m) {
  qwen4exp::HcEntries<qwen4exp::HcGpu>::register_impls(m);
}
