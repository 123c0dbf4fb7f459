// The qwen4exp op library: the kernel ops (their schemas in csrc/torch/schemas.h) and the package's
// utilities. Backends register their kernels in their own files (TORCH_LIBRARY_IMPL in
// csrc/torch/cpu_ops.cpp and at the end of csrc/torch/gpu/*.cpp); the Python door is
// python/qwen4exp_ext/ops.py, the fake (meta) implementations python/qwen4exp_ext/_fakes.py.
//
// The namespace is `qwen4exp`, never `_C`: vLLM owns torch.ops._C in the same process.
#include <Python.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "../common/gather_rows.h"
#include "../common/hc_fused.h"
#include "../common/ngram_ids.h"
#include "../common/ple_conv.h"
#include "schemas.h"
#include "switches.h"

#ifndef QWEN4EXP_BUILD_INFO_JSON
#error "setup.py defines QWEN4EXP_BUILD_INFO_JSON (what this binary was built with)"
#endif

namespace {

// A CPU kernel's setter (it checks the value, returns the setting it replaces) as an op: its
// std::invalid_argument becomes Python's ValueError.
template <int64_t (*kSetter)(int64_t)>
int64_t checked_setting(int64_t value) {
  try {
    return kSetter(value);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace

TORCH_LIBRARY(qwen4exp, m) {
  qwen4exp::define_kernel_ops(m);
  qwen4exp::define_host_ops(m);
  qwen4exp::switches::define_switch_ops(m);
  // SPEC §3: the fast-modulo constants of a layer's head sizes (int64 [NH]) as ngram_ids'
  // head_divmod, int64 [NH, 4]; a CPU kernel (csrc/torch/cpu_ops.cpp), not emulated: host code.
  m.def("ngram_head_divmod(Tensor head_sizes) -> Tensor");
  // The output size (bytes) from which the CPU gather streams (sorted reads, non-temporal stores;
  // csrc/cpu/gather_rows_stream.cpp) by an explicit threshold, or by default times its paths; -1
  // where this CPU or build has no streaming path.
  m.def("cpu_gather_stream_bytes() -> int", &qwen4exp::cpu_gather_stream_bytes);
  // Sets that threshold (-1: none, the timed default) and returns the setting it replaces.
  m.def("set_cpu_gather_stream_bytes(int bytes) -> int",
        &checked_setting<qwen4exp::set_cpu_gather_stream_bytes>);
  // The CPU gather's path (csrc/common/gather_rows.h: 0 cached, 1 stream, 2 plain, 3 not timed
  // yet) for an output of out_bytes bytes (a conversion's, with `converts`), and the setter that
  // pins one (-1: none pinned), returning the setting it replaces.
  m.def("cpu_gather_path(int out_bytes, bool converts) -> int", &qwen4exp::cpu_gather_path);
  m.def("set_cpu_gather_path(int path) -> int", &checked_setting<qwen4exp::set_cpu_gather_path>);
  // The timing behind that path at this thread count: [path, output bytes, threads, best ns of
  // the cached, stream and plain paths (-1: not timed)].
  m.def("cpu_gather_timing(bool converts) -> int[]", [](bool converts) {
    std::vector<int64_t> out(qwen4exp::kGatherTimingFields);
    qwen4exp::cpu_gather_timing(converts, out.data());
    return out;
  });
  // Gathers run by path (cached, stream, plain) and fp8 ones by lookup (scalar, avx2, avx512)
  // since the last reset; `reset` starts the counts again.
  m.def("cpu_gather_calls(bool reset) -> int[]", [](bool reset) {
    std::vector<int64_t> out(qwen4exp::kGatherCallFields);
    qwen4exp::cpu_gather_calls(reset, out.data());
    return out;
  });
  // How the CPU gather converts fp8 rows (csrc/common/gather_rows.h): 0 scalar, 1 AVX2, 2
  // AVX-512; by default the widest this CPU has. The setter takes -1 (that default) or a lookup
  // and returns the setting it replaces.
  m.def("cpu_gather_fp8_lookup() -> int", &qwen4exp::cpu_gather_fp8_lookup);
  m.def("set_cpu_gather_fp8_lookup(int lookup) -> int",
        &checked_setting<qwen4exp::set_cpu_gather_fp8_lookup>);
  // How the CPU ngram_ids (and the fused ngram_gather_rows) reduces each head's mix
  // (csrc/common/ngram_ids.h): 0 scalar, 1 AVX2, 2 AVX-512; by default the widest this CPU has.
  // The setter takes -1 (that default) or a width and returns the setting it replaces.
  m.def("cpu_ngram_hash_isa() -> int", &qwen4exp::cpu_ngram_hash_isa);
  m.def("set_cpu_ngram_hash_isa(int isa) -> int",
        &checked_setting<qwen4exp::set_cpu_ngram_hash_isa>);
  // How the 16-bit CPU conv looks its SiLU up (csrc/cpu/ple_conv.cpp): 0 a loop, 1 AVX-512
  // gathers; by default timed on first use. The setter takes -1 (timed), 0 or 1 and returns the
  // setting it replaces.
  m.def("cpu_conv_silu_lookup() -> int", &qwen4exp::cpu_conv_silu_lookup);
  m.def("set_cpu_conv_silu_lookup(int lookup) -> int",
        &checked_setting<qwen4exp::set_cpu_conv_silu_lookup>);
  // How the fused HC projections' CPU kernels take bf16 dots (csrc/common/hc_fused.h): 0 fp32
  // FMAs, 1 AVX512-BF16; by default 1 where the CPU has it. The setter takes -1 (that default),
  // 0 or 1 and returns the setting it replaces.
  m.def("cpu_hc_dot() -> int", &qwen4exp::cpu_hc_dot);
  m.def("set_cpu_hc_dot(int dot) -> int", &checked_setting<qwen4exp::set_cpu_hc_dot>);
  // SPEC §4, pinned host tables: pins (or host-registers) a CPU tensor's memory once and returns
  // a view of it on `device` (hip/cudaHostGetDevicePointer) that kernels read over PCIe. GPU
  // builds only (csrc/torch/gpu/host_table.cpp).
  m.def("host_table_device_view(Tensor host_table, Device device) -> Tensor");
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
