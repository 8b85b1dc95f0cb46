#include "paratrain/comm/devices.h"

#include "paratrain/launch/env.h"

#include <c10/util/Exception.h>
#include <torch/cuda.h>

namespace paratrain {

void check_device_exists(const torch::Device& device) {
  if (device.is_cpu()) {
    TORCH_CHECK(!device.has_index() || device.index() == 0, "device ", device,
                " does not exist: the CPU is cpu (or cpu:0)");
    return;
  }
  if (device.is_cuda()) {
    const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
    TORCH_CHECK(count > 0, "device ", device,
                " does not exist: this machine (or this libtorch build) has no CUDA device");
    TORCH_CHECK(!device.has_index() || device.index() < count, "device ", device,
                " does not exist: there are ", count, " CUDA devices (cuda:0..cuda:", count - 1,
                ")");
    return;
  }
  TORCH_CHECK(false, "device ", device, " is not supported: use cpu or cuda:N");
}

namespace dist {

void check_ranks_fit_gpus(int local_world_size, int cuda_devices) {
  TORCH_CHECK(local_world_size <= cuda_devices, local_world_size,
              " ranks run on this node but it has ", cuda_devices, " visible CUDA device",
              cuda_devices == 1 ? "" : "s",
              ", and each rank needs a GPU of its own: start at most ", cuda_devices,
              " per node (--nproc-per-node ", cuda_devices,
              "), pick GPUs with --devices, or compute on the CPU with the gloo backend "
              "(paratrain train --device cpu)");
}

torch::Device local_device() {
  if (!torch::cuda::is_available()) {
    return torch::Device(torch::kCPU);
  }
  const RankInfo info = discover_rank_info();
  check_ranks_fit_gpus(info.local_world_size, static_cast<int>(torch::cuda::device_count()));
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(info.local_rank));
}

}  // namespace dist
}  // namespace paratrain
