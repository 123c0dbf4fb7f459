// The run-time switch of an op library: the GPU glue's debug checks
// (csrc/torch/gpu/debug_checks.h). The others (the CPU kernels' settings: the gather's streaming
// threshold, its fp8 lookup, ...) belong to the torch-free kernels they steer;
// csrc/torch/bindings.cpp makes each an op, and is where they are listed.
//
// Python owns them (python/qwen4exp_ext/_switches.py): it reads their environment variables
// once, at import, and sets every loaded library (torch.ops.qwen4exp and the SIMT emulator's)
// through ops. Kernels and glue read them with one relaxed atomic load: no getenv per call, and
// no os.environ writes that would race with a getenv on another thread.
#pragma once

#include <torch/library.h>

#include <atomic>
#include <cstdint>

namespace qwen4exp::switches {

// The process-wide debug-check setting (qwen4exp_ext.set_debug_checks).
inline std::atomic<bool> debug_checks_process{false};
// This thread's `with qwen4exp_ext.debug_checks(enabled)`: 1 on, 0 off, -1 none (the process
// setting applies). Thread-local like torch.no_grad, so one thread's block cannot end another's.
inline thread_local int8_t debug_checks_thread = -1;

inline bool debug_checks() {
  const int8_t here = debug_checks_thread;
  return here >= 0 ? here == 1 : debug_checks_process.load(std::memory_order_relaxed);
}

inline void define_switch_ops(torch::Library& m) {
  m.def("set_debug_checks(bool enabled) -> ()",
        [](bool enabled) { debug_checks_process.store(enabled, std::memory_order_relaxed); });
  // Sets this thread's setting: 1, 0, or -1 for none (Python keeps what it replaces).
  m.def("set_thread_debug_checks(int setting) -> ()", [](int64_t setting) {
    TORCH_CHECK_VALUE(setting >= -1 && setting <= 1,
                      "set_thread_debug_checks: setting must be -1, 0 or 1, got ", setting);
    debug_checks_thread = static_cast<int8_t>(setting);
  });
}

}  // namespace qwen4exp::switches
