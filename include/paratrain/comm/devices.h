#pragma once

// Which device a rank computes on, and checks that a device exists, shared by init_process_group,
// DataParallel, the pipeline and the CLI.

#include <torch/types.h>

namespace paratrain {

/// Checks that `device` exists on this machine (CPU: index -1 or 0; CUDA: index below the device
/// count); throws c10::Error naming it otherwise.
void check_device_exists(const torch::Device& device);

namespace dist {

/// Throws c10::Error with one line saying what to do when `local_world_size` ranks on this node
/// would need more CUDA devices than are visible (`cuda_devices`): PyTorch gives each rank its own
/// GPU, and two ranks on one GPU fail inside NCCL ("Duplicate GPU detected").
void check_ranks_fit_gpus(int local_world_size, int cuda_devices);

/// cuda:LOCAL_RANK when CUDA is available (after CUDA_VISIBLE_DEVICES, so `launch --devices 0,1,3`
/// gives local rank 2 the physical GPU 3), else cpu. With more ranks on this node than visible
/// GPUs it throws (check_ranks_fit_gpus) rather than hand two ranks one GPU or a GPU that does not
/// exist.
torch::Device local_device();

}  // namespace dist
}  // namespace paratrain
