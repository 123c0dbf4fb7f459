// The Python extension module of the SIMT emulator for one wave size (qwen4exp_ext._simt32 or
// _simt64; setup.py compiles this file once per wave size with QWEN4EXP_SIMT_WAVE_SIZE): the op
// library torch.ops.qwen4exp_simt<wave size> with the kernel ops' own schemas, implemented for
// CPU tensors by the GPU build's own host glue, which launches the HIP kernels on the emulator.
//
// The glue files are compiled here in one translation unit rather than one each: each includes
// torch, which is most of a file's compile time. They share no names (each keeps its helpers in
// an anonymous namespace under a distinct name).
#include <Python.h>

#include "../gpu/gather_rows_gpu.cpp"
#include "../gpu/hc_gpu.cpp"
#include "../gpu/ngram_gather_rows_gpu.cpp"
#include "../gpu/ngram_ids_gpu.cpp"
#include "../gpu/ple_conv_gpu.cpp"
#include "../gpu/ple_gate_gpu.cpp"
#include "../schemas.h"
#include "../switches.h"

#define QWEN4EXP_SIMT_LIBRARY_EXPANDED(library, m) TORCH_LIBRARY(library, m)
QWEN4EXP_SIMT_LIBRARY_EXPANDED(QWEN4EXP_GLUE_LIBRARY, m) {
  qwen4exp::define_kernel_ops(m);
  qwen4exp::switches::define_switch_ops(m);
  // The emulator's own: [launches, most blocks of one] since the last call (runtime.h's
  // take_launch_record; qwen4exp_ext.simt.take_launch_record).
  m.def("take_launch_record() -> int[]", [] {
    const qwen4exp::simt::LaunchRecord r = qwen4exp::simt::take_launch_record();
    return std::vector<int64_t>{static_cast<int64_t>(r.launches),
                                static_cast<int64_t>(r.most_blocks)};
  });
}

#define QWEN4EXP_SIMT_CAT(a, b) a##b
#define QWEN4EXP_SIMT_PYINIT(wave) QWEN4EXP_SIMT_CAT(PyInit__simt, wave)
#define QWEN4EXP_SIMT_MODULE_NAME(wave) "_simt" QWEN4EXP_SIMT_STRINGIZE(wave)
#define QWEN4EXP_SIMT_STRINGIZE(x) QWEN4EXP_SIMT_STRINGIZE2(x)
#define QWEN4EXP_SIMT_STRINGIZE2(x) #x

// Loading the module registers the ops; it exposes nothing itself (as csrc/torch/bindings.cpp).
PyMODINIT_FUNC QWEN4EXP_SIMT_PYINIT(QWEN4EXP_SIMT_WAVE_SIZE)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT,
                               QWEN4EXP_SIMT_MODULE_NAME(QWEN4EXP_SIMT_WAVE_SIZE), nullptr, -1,
                               nullptr};
  return PyModule_Create(&module);
}
