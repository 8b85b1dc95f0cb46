#pragma once

// Internal: moving a tensor to another device from a thread that reads it next.

#include <ATen/ATen.h>
#include <torch/version.h>

namespace paratrain {
namespace detail {

/// `t` on `device`, asynchronously only where that is safe for the caller to read the result at
/// once. A copy to a CUDA device is ordered on that device's stream, so later kernels see it; but
/// `Tensor::to(cpu, non_blocking=true)` from a CUDA tensor returns pinned memory that the GPU is
/// still filling (PyTorch documents that the caller must synchronize first), and a CPU consumer
/// (a pipeline stage or a DataParallel replica on the CPU) has no stream to wait on. Copies to the
/// CPU are therefore blocking.
inline at::Tensor to_device(const at::Tensor& t, const c10::Device& device) {
  bool async = !device.is_cpu();
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 1)
  // Conservative, unverified on a CUDA build of these versions: older pinned-memory caches found
  // the block to keep alive during an asynchronous copy by its base address, so a slice of a
  // pinned batch (a micro-batch, a replica's chunk) might be reused while the copy still read it.
  async = async && !(t.is_cpu() && t.storage_offset() != 0 && t.is_pinned());
#endif
  return t.to(device, /*non_blocking=*/async);
}

/// `dst.copy_(src)`, asynchronous only into a device other than the CPU.
inline void copy_to(at::Tensor& dst, const at::Tensor& src) {
  dst.copy_(src, /*non_blocking=*/!dst.device().is_cpu());
}

}  // namespace detail
}  // namespace paratrain
