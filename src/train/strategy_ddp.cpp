// --strategy ddp: one replica per process, gradients averaged by DistributedDataParallel; its own
// options are SyncBatchNorm, ZeRO (the optimizer's state sharded over the ranks) and the replica
// check.

#include "strategy.h"

#include "paratrain/base/option_error.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/parallel/distributed_data_parallel.h"
#include "paratrain/parallel/sync_batchnorm.h"
#include "paratrain/parallel/zero_redundancy_optimizer.h"

#include <algorithm>

namespace paratrain::train_internal {

namespace {

// SyncBatchNorm before MixedPrecision and DDP, which then see the converted modules.
torch::nn::Sequential with_sync_batchnorm(const TrainerOptions& o, torch::nn::Sequential model) {
  if (o.sync_batchnorm()) {
    model->to(o.device());
    convert_sync_batchnorm(model.ptr(), o.process_group());
  }
  return model;
}

class DdpStrategy : public TrainStrategy {
 public:
  DdpStrategy(const TrainerOptions& o, torch::nn::Sequential model)
      : TrainStrategy(o, with_sync_batchnorm(o, std::move(model)), o.device(), o.amp()),
        ddp_(model_, o.process_group()) {
    mp_->sync_masters();  // DDP broadcast rank 0's weights into the model
  }

  std::unique_ptr<torch::optim::Optimizer> make_optimizer() const override {
    if (!options_.zero()) {
      return TrainStrategy::make_optimizer();
    }
    // The local optimizer's moments in this rank's store (offload optimizer under zero).
    const OptimizerOptions options =
        OptimizerOptions(options_.optimizer()).offload(make_offload_store(options_));
    return std::make_unique<ZeroRedundancyOptimizer>(
        mp_->optimizer_parameters(),
        [options](std::vector<torch::optim::OptimizerParamGroup> groups) {
          return paratrain::make_optimizer(groups.at(0).params(), options);
        },
        options_.process_group());
  }

  torch::Tensor forward_backward(const torch::Tensor& input,
                                 const torch::Tensor& target,
                                 bool last) override {
    // Gradients add up locally until the accumulation's last batch, as DDP's no_sync().
    std::unique_ptr<DistributedDataParallel::NoSyncGuard> no_sync;
    if (!last) {
      no_sync = std::make_unique<DistributedDataParallel::NoSyncGuard>(ddp_);
    }
    return TrainStrategy::forward_backward(input, target, last);
  }

  void after_step(int64_t global_step) override {
    if (options_.check_replicas() > 0 && global_step % options_.check_replicas() == 0) {
      check_replicas(global_step);
    }
  }

  // ZeRO, consolidated: every rank sends its shard to rank 0, which saves the state as the
  // unsharded optimizer's. Sharded: each rank's shard goes to its own file, keyed the same way, so
  // the union of the rank files is that state. Either way any world size (or no ZeRO) resumes.
  void capture(CheckpointState& s, torch::optim::Optimizer& optimizer) override {
    auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(&optimizer);
    if (zero == nullptr) {
      TrainStrategy::capture(s, optimizer);
      return;
    }
    for (const auto& kv : with_prefix(module_state(*model_), "model.")) {
      s.shared[kv.first] = kv.second;
    }
    const bool sharded = options_.zero_checkpoint() == "sharded";
    TensorMap& home = sharded ? s.own : s.shared;
    s.own_read_by_all = sharded;
    for (const auto& kv :
         with_prefix(sharded ? zero->sharded_state() : zero->consolidate_state(0), "optim.")) {
      home[kv.first] = kv.second;
    }
  }

  void restore(const CheckpointState& s,
               const nlohmann::json& meta,
               torch::optim::Optimizer& optimizer) override {
    auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(&optimizer);
    if (zero == nullptr) {
      TrainStrategy::restore(s, meta, optimizer);
      return;
    }
    load_module_state(*model_, with_prefix(s.shared, "model.", true));
    zero->load_state(saved_optimizer_state(s, /*zero=*/true));
  }

 protected:
  torch::Tensor train_forward(const torch::Tensor& input) override { return ddp_.forward(input); }

 private:
  void check_replicas(int64_t global_step);

  DistributedDataParallel ddp_;
};

// The checksums of one rank's parameters: [tensors, 2] doubles.
torch::Tensor parameter_checksums(torch::nn::Sequential& model, std::vector<std::string>& names) {
  std::vector<torch::Tensor> sums;
  torch::NoGradGuard no_grad;
  // Parameters only: BatchNorm's running statistics are each rank's own until DDP broadcasts rank
  // 0's at the next forward.
  for (const auto& kv : model->named_parameters()) {
    names.push_back(kv.key());
    torch::Tensor t = kv.value().detach().to(torch::kDouble);
    // The sum and a position-weighted sum: a swap of two values changes the second.
    torch::Tensor w = torch::arange(t.numel(), t.options()).remainder(7).add_(1);
    sums.push_back(torch::stack({t.sum(), (t.reshape(-1) * w).sum()}));
  }
  return torch::stack(sums);
}

// DDP keeps every replica's parameters bitwise equal; a rank whose weights drifted (a bug, bad
// memory, a skipped step) is found by comparing per-tensor checksums of every rank.
void DdpStrategy::check_replicas(int64_t global_step) {
  std::vector<std::string> names;
  torch::Tensor mine = parameter_checksums(model_, names).to(device_);
  const int world = this->world();
  std::vector<torch::Tensor> all;
  for (int r = 0; r < world; ++r) {
    all.push_back(torch::empty_like(mine));
  }
  options_.process_group()->allgather(all, mine)->wait();
  // A rank differs when its checksums differ from those of most ranks (of rank 0 with two).
  std::vector<torch::Tensor> host;
  for (auto& t : all) {
    host.push_back(t.cpu().view(torch::kLong));  // bit for bit: equal NaNs do not diverge
  }
  std::vector<int> agree(host.size(), 0);
  for (size_t a = 0; a < host.size(); ++a) {
    for (size_t b = 0; b < host.size(); ++b) {
      agree[a] += torch::equal(host[a], host[b]);
    }
  }
  const size_t reference =
      static_cast<size_t>(std::max_element(agree.begin(), agree.end()) - agree.begin());
  std::string diverged;
  std::string tensor;
  for (size_t r = 0; r < host.size(); ++r) {
    if (torch::equal(host[r], host[reference])) {
      continue;
    }
    diverged += (diverged.empty() ? "" : ", ") + std::to_string(r);
    if (tensor.empty()) {
      const auto differs = host[r].ne(host[reference]).any(1).nonzero();
      tensor = names[static_cast<size_t>(differs[0].item<int64_t>())];
    }
  }
  if (!diverged.empty()) {
    throw ReplicaDivergence("the replicas diverged at step " + std::to_string(global_step) +
                            ": rank(s) " + diverged + " hold weights that differ from rank " +
                            std::to_string(reference) + "'s, first in '" + tensor +
                            "' (check_replicas)");
  }
}

}  // namespace

StrategyKind ddp_strategy() {
  return {Strategy::kDDP,
          "ddp",
          /*takes_process_group=*/true,
          [](const TrainerOptions& o) {
            std::vector<std::string> set;
            if (o.zero()) {
              set.push_back("zero");
            }
            if (o.sync_batchnorm()) {
              set.push_back("sync_batchnorm");
            }
            return set;
          },
          "works across DDP's ranks",
          no_own_checks,
          make_strategy<DdpStrategy>};
}

}  // namespace paratrain::train_internal
