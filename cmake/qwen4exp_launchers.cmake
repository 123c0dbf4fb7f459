# qwen4exp::kernels: the launchers of the HIP kernels (csrc/kernel_sources.txt role "kernel"),
# built for QWEN4EXP_BACKEND = SIMT, CUDA or HIP. Included by CMakeLists.txt.
add_library(qwen4exp_kernels STATIC ${QWEN4EXP_KERNEL_SOURCES})
add_library(qwen4exp::kernels ALIAS qwen4exp_kernels)
set_target_properties(qwen4exp_kernels PROPERTIES EXPORT_NAME kernels POSITION_INDEPENDENT_CODE ON)
qwen4exp_public_interface(qwen4exp_kernels)

if(QWEN4EXP_BACKEND STREQUAL "SIMT")
  if(NOT QWEN4EXP_SIMT_WAVE_SIZE MATCHES "^(32|64)$")
    message(FATAL_ERROR "QWEN4EXP_SIMT_WAVE_SIZE must be 32 or 64, got ${QWEN4EXP_SIMT_WAVE_SIZE}")
  endif()
  # The kernel files are C++ here, compiled by the host compiler against csrc/simt/runtime.h.
  set_source_files_properties(${QWEN4EXP_KERNEL_SOURCES} PROPERTIES LANGUAGE CXX
                              COMPILE_OPTIONS "-xc++")
  target_sources(qwen4exp_kernels PRIVATE ${QWEN4EXP_SIMT_SOURCES})
  # Public: a consumer's includes of csrc/common must see the same emulated runtime.
  target_compile_definitions(qwen4exp_kernels PUBLIC
    QWEN4EXP_SIMT_WAVE_SIZE=${QWEN4EXP_SIMT_WAVE_SIZE})
  # No a·b+c contracted into an FMA, as on the GPUs; `#pragma unroll` means nothing here.
  target_compile_options(qwen4exp_kernels PRIVATE -ffp-contract=off -Wno-unknown-pragmas)
elseif(QWEN4EXP_BACKEND STREQUAL "CUDA")
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  set_source_files_properties(${QWEN4EXP_KERNEL_SOURCES} PROPERTIES LANGUAGE CUDA
                              COMPILE_OPTIONS "--x=cu")
  target_link_libraries(qwen4exp_kernels PUBLIC CUDA::cudart)
  # Consumers (host code) get the CUDA runtime and the launchers' declarations (platform.h).
  target_compile_definitions(qwen4exp_kernels PUBLIC QWEN4EXP_GPU_HOST_GLUE)
  # The device flags of setup.py: no FMA contraction (the GPU then equals the CPU kernels where
  # the tests claim bit parity).
  target_compile_options(qwen4exp_kernels PRIVATE --expt-relaxed-constexpr --fmad=false -lineinfo)
elseif(QWEN4EXP_BACKEND STREQUAL "HIP")
  enable_language(HIP)
  find_package(hip REQUIRED)
  set_source_files_properties(${QWEN4EXP_KERNEL_SOURCES} PROPERTIES LANGUAGE HIP)
  target_link_libraries(qwen4exp_kernels PUBLIC hip::host)
  target_compile_definitions(qwen4exp_kernels PUBLIC QWEN4EXP_GPU_HOST_GLUE)
  target_compile_options(qwen4exp_kernels PRIVATE $<$<COMPILE_LANGUAGE:HIP>:-ffp-contract=off>)
endif()
