#pragma once

// Internal: moving a tensor to another device from a thread that reads it next.

#include <ATen/ATen.h>

namespace paratrain {
namespace detail {

/// `t` on `device`, asynchronously only where that is safe for the caller to read the result at
/// once. A copy to a CUDA device is ordered on that device's stream, so later kernels see it; but
/// `Tensor::to(cpu, non_blocking=true)` from a CUDA tensor returns pinned memory that the GPU is
/// still filling (PyTorch documents that the caller must synchronize first), and a CPU consumer
/// (a pipeline stage or a DataParallel replica on the CPU) has no stream to wait on. Copies to the
/// CPU are therefore blocking.
inline at::Tensor to_device(const at::Tensor& t, const c10::Device& device) {
  return t.to(device, /*non_blocking=*/!device.is_cpu());
}

/// `dst.copy_(src)` with the same rule.
inline void copy_to(at::Tensor& dst, const at::Tensor& src) {
  dst.copy_(src, /*non_blocking=*/!dst.device().is_cpu());
}

}  // namespace detail
}  // namespace paratrain
