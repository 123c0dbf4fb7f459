// A GPU-visible view of a host (CPU) tensor, for tables too large for device memory: the GPU
// reads the pinned host pages directly over PCIe (zero-copy, unified virtual addressing), and
// gather_rows treats the view like any device tensor. SPEC §4.
//
// ROCm caveats (also in README.md):
// - The device address of host memory comes from hip/cudaHostGetDevicePointer. On CUDA with UVA
//   it equals the host address; on ROCm, for memory registered with hipHostRegister, it can
//   differ, so the view is always built from the returned device pointer, never the host one.
// - Register once. Registering pages that are already registered fails
//   (hipErrorHostMemoryAlreadyRegistered), and unregistering while another view still uses the
//   pages breaks that view. So: memory pinned by someone else (torch's pin_memory()) is used as
//   it is and never unregistered here; memory that we register is counted once per storage, with
//   a reference per view on any device, and unregistered when the last view dies. Keep the view
//   (not a fresh one per call) for the lifetime of the model:
//   python/qwen4exp_ext/tables/host_memory.py caches it.
// - Registration pins every page of the allocation, page by page: for a 51 GB (fp8) or 102 GB
//   (bf16) table that takes seconds to tens of seconds and locks that much RAM (mind ulimit -l
//   and the container's memory limit). Do it once at load time, never in the serving loop.
// - The view must outlive every kernel that reads it: unregistering frees the mapping at once,
//   with no stream ordering.
#define QWEN4EXP_GPU_HOST_GLUE 1

#include <c10/cuda/CUDAGuard.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

#include "../../common/platform.h"

namespace qwen4exp {
namespace {

// Host memory that this process registered, by base address, with the number of live views of it
// on any device. Registration is Portable (every device sees it), so the memory is unregistered
// only when the last view, on whichever device, dies: counting per device would unregister it
// under device 1 when device 0's views are gone.
struct Registration {
  size_t bytes;
  int64_t views;
};
std::mutex registry_mutex;
// Never destroyed: views may still die during static destruction at exit.
std::unordered_map<void*, Registration>& registry() {
  static auto* registrations = new std::unordered_map<void*, Registration>();
  return *registrations;
}

void release_view(void* host_base) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(host_base);
  if (it == registry().end() || --it->second.views > 0) return;
  (void)hipHostUnregister(host_base);
  registry().erase(it);
}

at::Tensor host_table_device_view(const at::Tensor& host, c10::Device device) {
  TORCH_CHECK(host.device().is_cpu(),
              "host_table_device_view: host_table must be a CPU tensor, "
              "got one on ",
              host.device());
  TORCH_CHECK(device.is_cuda(), "host_table_device_view: device must be a CUDA/ROCm device, got ",
              device);
  TORCH_CHECK(host.storage().nbytes() > 0, "host_table_device_view: host_table is empty");
  const c10::cuda::CUDAGuard device_guard(device);
  void* host_base = host.storage().mutable_data();
  const size_t bytes = host.storage().nbytes();

  void* device_base = nullptr;
  bool ours = false;  // whether this view holds a reference to our registration
  {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(host_base);
    if (it != registry().end()) {
      TORCH_CHECK(it->second.bytes == bytes, "host_table_device_view: ", it->second.bytes,
                  " bytes at this address are registered, but the storage has ", bytes);
      ++it->second.views;
      ours = true;
    } else if (hipHostGetDevicePointer(&device_base, host_base, 0) != hipSuccess) {
      (void)hipGetLastError();  // not pinned yet: clear the error and register
      const hipError_t status =
          hipHostRegister(host_base, bytes, hipHostRegisterMapped | hipHostRegisterPortable);
      TORCH_CHECK(status == hipSuccess, "host_table_device_view: registering ", bytes,
                  " bytes of host memory failed: ", hipGetErrorString(status),
                  " (locked-memory limit? already registered by someone else?)");
      registry().emplace(host_base, Registration{bytes, 1});
      ours = true;
    }
    // else: pinned by someone else (pin_memory()): used as it is, never unregistered here.
  }
  if (ours) {
    const hipError_t mapped = hipHostGetDevicePointer(&device_base, host_base, 0);
    if (mapped != hipSuccess) {
      release_view(host_base);
      TORCH_CHECK(false, "host_table_device_view: no device address for registered host memory: ",
                  hipGetErrorString(mapped));
    }
  }

  // The view keeps the host storage alive, and drops its reference to the registration.
  c10::Storage keep_alive = host.storage();
  auto release = [keep_alive, host_base, ours](void*) {
    if (ours) release_view(host_base);
  };
  char* data = static_cast<char*>(device_base) + host.storage_offset() * host.element_size();
  return at::from_blob(data, host.sizes(), host.strides(), release, host.options().device(device),
                       device);
}

}  // namespace
}  // namespace qwen4exp

// The input is a CPU tensor, so the op dispatches on CPU; this kernel exists only in GPU builds
// (python/qwen4exp_ext/tables/host_memory.py says so clearly on a CPU-only build).
TORCH_LIBRARY_IMPL(qwen4exp, CPU, m) {
  m.impl("host_table_device_view", &qwen4exp::host_table_device_view);
}
