#pragma once

// ZeroRedundancyOptimizer: torch.distributed.optim.ZeroRedundancyOptimizer for libtorch. Each rank
// keeps the optimizer state (SGD's momentum, Adam's moments) of only its share of the
// parameters, steps only those, and then broadcasts them to the other ranks. Optimizer-state
// memory per rank drops to about 1/world; the result equals the unsharded optimizer, because
// these optimizers update each parameter from its own gradient and state alone.
//
//   paratrain::DistributedDataParallel ddp(model, pg);     // gradients averaged over the ranks
//   paratrain::ZeroRedundancyOptimizer opt(model->parameters(),
//       [](std::vector<torch::optim::OptimizerParamGroup> groups) {
//         return std::make_unique<torch::optim::Adam>(std::move(groups),
//                                                     torch::optim::AdamOptions(1e-3));
//       }, pg);
//   ... loss.backward(); opt.step();                        // every rank, same parameters after
//
// Note [How parameters are assigned to ranks]
// As PyTorch's _partition_parameters: group by group, each group's parameters sorted by size
// (largest first, ties in their order) go one by one to the rank with the fewest elements so far
// (the lowest such rank). Every rank computes the same plan. The local optimizer gets, for each
// group, the group's options and the parameters this rank owns, in that order (a group may be
// empty on some rank).
//
// It is a torch::optim::Optimizer: param_groups() hold every parameter with the options that
// schedules change (step() hands them to the local optimizer), zero_grad() clears every
// gradient, and GradScaler and LRSchedule work unchanged. Groups added after construction are
// not sharded (add_param_group is not supported).
//
// Threads: step() and the state functions are collectives on the group; call them on every rank,
// in the same order, from one thread.

#include "paratrain/comm/process_group.h"

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace paratrain {

class ZeroRedundancyOptimizer : public torch::optim::Optimizer {
 public:
  /// Makes the local optimizer from the groups this rank owns (same order and options as given).
  /// Any libtorch optimizer steps; the state functions (sharded_state, consolidate_state,
  /// load_state, state_bytes) know SGD, Adam and AdamW, as optimizer_state() does.
  using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
      std::vector<torch::optim::OptimizerParamGroup>)>;

  /// Shards `groups` over `group`'s ranks. Throws c10::Error with one line for a parameter set
  /// that cannot be sharded: no parameters, an undefined or sparse parameter, parameters of
  /// different dtypes or devices (one flat broadcast per rank carries them), or a parameter
  /// listed twice; and for a null process group or factory.
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                          const OptimizerFactory& make_local,
                          dist::ProcessGroupPtr group);
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                          const OptimizerFactory& make_local,
                          dist::ProcessGroupPtr group);

  /// Steps this rank's parameters with the current group options, then broadcasts every
  /// parameter from its owner (a collective).
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// The rank that owns parameter `index` of group `group_index`.
  int owner(size_t group_index, size_t index) const;
  /// Per group, the indices (into param_groups()[g].params()) this rank owns, in local order.
  const std::vector<std::vector<size_t>>& owned() const { return owned_; }
  torch::optim::Optimizer& local_optimizer() { return *local_; }
  const dist::ProcessGroupPtr& process_group() const { return group_; }

  /// This rank's optimizer state, keyed as optimizer_state() keys the unsharded optimizer's
  /// ("<group>.<index>.<field>", with indices into param_groups()): the sharded checkpoint.
  std::map<std::string, torch::Tensor> sharded_state();
  /// PyTorch's consolidate_state_dict: every rank sends its shard to rank `to` (a collective),
  /// which returns the whole state, exactly what optimizer_state() gives for an unsharded
  /// optimizer over the same parameters; the other ranks return an empty map.
  std::map<std::string, torch::Tensor> consolidate_state(int to = 0);
  /// Takes this rank's part of a state keyed as above: a consolidated state (from any world
  /// size, or from an unsharded optimizer) or the union of shards. Keys of other ranks'
  /// parameters are ignored. Throws c10::Error as load_optimizer_state does.
  void load_state(const std::map<std::string, torch::Tensor>& state);
  /// Bytes of optimizer state this rank holds (after the first step).
  int64_t state_bytes();

 private:
  struct Plan;
  static std::shared_ptr<Plan> make_plan(std::vector<torch::optim::OptimizerParamGroup> groups,
                                         const OptimizerFactory& make_local,
                                         const dist::ProcessGroupPtr& group);
  explicit ZeroRedundancyOptimizer(const std::shared_ptr<Plan>& plan);
  void broadcast_parameters();

  dist::ProcessGroupPtr group_;
  std::unique_ptr<torch::optim::Optimizer> local_;
  std::vector<std::vector<int>> owner_;              // [group][index] -> rank
  std::vector<std::vector<size_t>> owned_;           // [group] -> indices owned here, local order
  std::vector<std::vector<torch::Tensor>> by_rank_;  // [rank] -> its parameters, broadcast order
};

}  // namespace paratrain
