#include "paratrain/parallel/join.h"

#include "paratrain/comm/devices.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

namespace paratrain {

Join::Join(dist::ProcessGroupPtr group, std::function<void()> shadow_step)
    : group_(std::move(group)), shadow_step_(std::move(shadow_step)) {
  TORCH_CHECK(group_ != nullptr, "Join: the process group is null");
  TORCH_CHECK(shadow_step_ != nullptr, "Join: no shadow step was given");
}

int64_t Join::count(int64_t mine) {
  // A CPU tensor, unless the group has no CPU engine (nccl alone): then the rank's GPU.
  const bool on_cpu = group_->moves(c10::DeviceType::CPU);
  auto options = torch::TensorOptions(torch::kLong)
                     .device(on_cpu ? torch::Device(torch::kCPU) : dist::local_device());
  torch::Tensor n = torch::full({1}, mine, options);
  group_->allreduce(n, dist::ReduceOp::kSum)->wait();
  return n.item<int64_t>();
}

int64_t Join::notify() {
  TORCH_CHECK(!joined_, "Join::notify: this rank has already joined");
  return count(1);
}

int64_t Join::join() {
  TORCH_CHECK(!joined_, "Join::join: this rank has already joined");
  joined_ = true;
  int64_t shadows = 0;
  while (count(0) > 0) {
    shadow_step_();
    ++shadows;
  }
  return shadows;
}

}  // namespace paratrain
