// The nccl backend: c10d's ProcessGroupNCCL, compiled only against a libtorch built with CUDA
// (CMake defines PARATRAIN_WITH_NCCL). Tensors must be on this rank's CUDA device.

#include "c10d_group.h"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace paratrain {
namespace dist {
namespace detail {

ProcessGroupPtr make_nccl_group(c10::intrusive_ptr<c10d::Store> store,
                                StoreClientFactory monitor_client,
                                int rank,
                                int size,
                                std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto engine = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  return std::make_shared<C10dGroup<c10d::ProcessGroupNCCL>>(
      "nccl", std::move(engine), std::move(store), std::move(monitor_client), rank, size, timeout);
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
