#pragma once

// Internal: which modules are batch normalisation, in the two senses the library needs.

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>

#include <string>

namespace paratrain {
namespace detail {

/// libtorch's BatchNorm1d, BatchNorm2d or BatchNorm3d: the modules SyncBatchNorm replaces, as
/// torch.nn.SyncBatchNorm.convert_sync_batchnorm replaces torch.nn.modules.batchnorm._BatchNorm.
inline bool is_torch_batchnorm(const torch::nn::Module& m) {
  return m.as<torch::nn::BatchNorm1d>() || m.as<torch::nn::BatchNorm2d>() ||
         m.as<torch::nn::BatchNorm3d>();
}

/// Any batch normalisation, libtorch's or another whose type says so (SyncBatchNorm included):
/// the modules that opt level O2 keeps in fp32, as apex's O2 does (keep_batchnorm_fp32). By type
/// name, so that this layer needs no include of the modules above it.
inline bool is_any_batchnorm(const torch::nn::Module& m) {
  return is_torch_batchnorm(m) || m.name().find("BatchNorm") != std::string::npos;
}

}  // namespace detail
}  // namespace paratrain
