#pragma once

// SyncBatchNorm: torch.nn.SyncBatchNorm for libtorch. In training, the batch statistics are
// those of the whole batch across the ranks of a process group, so a model trained with DDP on
// small per-rank batches normalizes as if one process saw every rank's batch.
//
//   auto pg = paratrain::dist::init_process_group();
//   auto model = paratrain::models::make("resnet18_cifar", 10);
//   paratrain::convert_sync_batchnorm(model.ptr(), pg);   // every BatchNorm{1,2,3}d, in place
//   paratrain::DistributedDataParallel ddp(model, pg);
//
// Note [How SyncBatchNorm computes]
// Forward (training): each rank computes its count n_r, mean m_r and sum of squared deviations
// M2_r per channel; one allgather shares them; every rank combines them (Chan's parallel
// formula, in double) into the global mean and biased variance, normalizes its own rows, and
// updates the running statistics with the unbiased variance M2 / (N - 1), as BatchNorm on the
// whole batch would. Backward: each rank sums dy and dy * (x - mean) over its rows; one
// allreduce gives the global sums, from which the input gradient follows exactly as for one
// BatchNorm over all rows. The weight and bias gradients stay local, as PyTorch's: DDP averages
// them with the other gradients. Ranks may hold different batch sizes, also zero rows.
// Eval mode (with running statistics) needs no communication and is plain batch_norm. With no
// process group, or a group of one rank, the module computes exactly as BatchNorm (PyTorch's
// SyncBatchNorm falls back the same way when torch.distributed is not initialized).
//
// Threads: the collectives run on the thread that runs forward and backward. Every rank must
// run the same SyncBatchNorm layers in the same order (they are collectives).

#include "paratrain/comm/process_group.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace paratrain {

struct SyncBatchNormOptions {
  /* implicit */ SyncBatchNormOptions(int64_t num_features) : num_features_(num_features) {}
  /// Channels (C of an N, C, ... input).
  TORCH_ARG(int64_t, num_features);
  /// Added to the variance for stability.
  TORCH_ARG(double, eps) = 1e-5;
  /// nullopt: a cumulative moving average (PyTorch's momentum=None).
  TORCH_ARG(std::optional<double>, momentum) = 0.1;
  /// Learnable weight and bias.
  TORCH_ARG(bool, affine) = true;
  /// Keep running mean and variance for evaluation.
  TORCH_ARG(bool, track_running_stats) = true;
  /// The ranks whose batches are normalized together; nullptr: no synchronization.
  TORCH_ARG(dist::ProcessGroupPtr, process_group) = nullptr;
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(SyncBatchNormOptions options);
  /// A SyncBatchNorm over `group` holding the very parameter and buffer tensors of `batchnorm`
  /// (a BatchNorm1d, 2d or 3d; c10::Error otherwise), with its options.
  static std::shared_ptr<SyncBatchNormImpl> adopt(const torch::nn::Module& batchnorm,
                                                  dist::ProcessGroupPtr group);
  void reset() override;
  void reset_running_stats();
  void pretty_print(std::ostream& stream) const override;

  /// Input of shape [N, C, *] (at least 2-D). Throws c10::Error naming the shapes for a wrong
  /// channel count, and for a training batch of one value per channel over all ranks.
  torch::Tensor forward(const torch::Tensor& input);

  SyncBatchNormOptions options;
  torch::Tensor weight, bias;                                    // undefined without affine
  torch::Tensor running_mean, running_var, num_batches_tracked;  // undefined without tracking

 private:
  SyncBatchNormImpl(SyncBatchNormOptions options, std::vector<torch::Tensor> adopted);
  // reset() registers these instead of new tensors once, in adopt(); clone() makes new ones.
  std::vector<torch::Tensor> adopted_;
};
TORCH_MODULE(SyncBatchNorm);

/// libtorch modules call their children through C++ members, which a conversion cannot rebind.
/// A module other than a Sequential whose forward calls BatchNorm children takes part in
/// convert_sync_batchnorm by holding them as AnyModule slots and listing them here (the model
/// zoo's ResNet blocks do).
class NormSlots {
 public:
  virtual ~NormSlots() = default;
  /// (child name, the AnyModule the forward calls) for each normalization child.
  virtual std::vector<std::pair<std::string, torch::nn::AnyModule*>> norm_slots() = 0;
};

/// torch.nn.SyncBatchNorm.convert_sync_batchnorm, in place: every BatchNorm1d/2d/3d under
/// `module` (entries of Sequentials and NormSlots; not `module` itself, which has no parent)
/// becomes a SyncBatchNorm over `group` that shares its parameters and buffers, so optimizers
/// and checkpoints made before or after see the same tensors under the same names. Returns the
/// number of layers converted. Throws c10::Error naming the layer when a BatchNorm sits in a
/// module that cannot take the replacement (a plain C++ member of a custom module), before
/// converting anything. `group` may be nullptr or of one rank: the layers then compute as
/// BatchNorm.
int64_t convert_sync_batchnorm(const std::shared_ptr<torch::nn::Module>& module,
                               dist::ProcessGroupPtr group);

}  // namespace paratrain
