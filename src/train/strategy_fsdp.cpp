// --strategy fsdp: each rank keeps a shard of every unit's parameters, gradients and optimizer
// state (FullyShardedDataParallel); its checkpoints are sharded (fsdp_checkpoint.h).

#include "strategy.h"

#include "paratrain/base/option_error.h"
#include "paratrain/parallel/fsdp_checkpoint.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"

namespace paratrain::train_internal {

namespace {

// Sharded gradients: every rank must agree to skip a step (PyTorch's ShardedGradScaler).
amp::AmpOptions sharded_scaler(const TrainerOptions& o) {
  amp::AmpOptions amp = o.amp();
  amp.scaler(amp::GradScalerOptions(amp.scaler()).process_group(o.process_group()));
  return amp;
}

class FsdpStrategy : public TrainStrategy {
 public:
  FsdpStrategy(const TrainerOptions& o, torch::nn::Sequential model)
      : TrainStrategy(o, std::move(model), o.device(), sharded_scaler(o)),
        fsdp_(model_, o.process_group(), o.fsdp()) {}

  std::unique_ptr<torch::optim::Optimizer> make_optimizer() const override {
    return paratrain::make_optimizer(fsdp_.parameters(), options_.optimizer());
  }

  torch::Tensor forward_backward(const torch::Tensor& input,
                                 const torch::Tensor& target,
                                 bool last) override {
    fsdp_.set_requires_gradient_sync(last);
    return TrainStrategy::forward_backward(input, target, last);
  }

  torch::Tensor forward(const torch::Tensor& input) override { return fsdp_.forward(input); }

  std::optional<data::Batch> next_val_batch(data::DataLoader& loader,
                                            std::optional<data::Batch>& last) override;

  double clip_grad_norm_(double max_norm) override { return fsdp_.clip_grad_norm_(max_norm); }

  void capture(CheckpointState& s, torch::optim::Optimizer& optimizer) override {
    capture_sharded_state(fsdp_, &optimizer, s);
  }

  // The layout's checks (units, names, shapes) come with the load (restore_sharded_state).
  std::string saved_model_difference(const CheckpointState&) const override { return ""; }

  void restore(const CheckpointState& s,
               const nlohmann::json& meta,
               torch::optim::Optimizer& optimizer) override {
    TORCH_CHECK(meta.contains("fsdp"), "checkpoint ", s.path,
                " was not saved by the fsdp strategy; resume it with the strategy that saved it (",
                meta.value("strategy", std::string("?")), ")");
    restore_sharded_state(s, fsdp_, &optimizer);
  }

  TensorMap weights() override {
    TensorMap state;
    for (auto& kv : fsdp_.full_state()) {
      state[kv.first] = kv.second;
    }
    for (const auto& b : model_->named_buffers()) {
      state[b.key()] = b.value();
    }
    return state;
  }

 protected:
  torch::Tensor train_forward(const torch::Tensor& input) override { return fsdp_.forward(input); }

 private:
  FullyShardedDataParallel fsdp_;
};

// A forward is a collective, and the ranks' shares of the validation set may differ by a batch:
// while any rank has a batch left, the ranks without one run their last batch again with an empty
// target (not counted).
std::optional<data::Batch> FsdpStrategy::next_val_batch(data::DataLoader& loader,
                                                        std::optional<data::Batch>& last) {
  std::optional<data::Batch> b = loader.next();
  // [any rank has a batch, any rank has had none at all]: every rank decides alike, so a rank
  // without data fails together with the others instead of leaving them in a collective.
  torch::Tensor flags =
      torch::tensor({b ? 1.0 : 0.0, b || last ? 0.0 : 1.0}, torch::kDouble).to(device_);
  options_.process_group()->allreduce(flags, dist::ReduceOp::kMax)->wait();
  flags = flags.cpu();
  if (flags[0].item<double>() == 0) {
    return std::nullopt;
  }
  TORCH_CHECK(flags[1].item<double>() == 0,
              "fsdp evaluation: a rank has no validation batch "
              "while others have one; use a validation set of at least one batch per rank");
  if (b) {
    last = b;
    return b;
  }
  return data::Batch{last->data, torch::empty({0}, last->target.options())};
}

void check_fsdp_options(const TrainerOptions& o) {
  PARATRAIN_CHECK_OPTION(
      o.amp().opt_level() == amp::OptLevel::kO0 || o.amp().opt_level() == amp::OptLevel::kO1, "amp",
      "strategy fsdp keeps fp32 shards as the master weights: use amp O0 or O1 "
      "(autocast), or bf16 shards through mixed_precision, not ",
      amp::to_string(o.amp().opt_level()));
  PARATRAIN_CHECK_OPTION(o.check_replicas() == 0, "check_replicas",
                         "check_replicas compares DDP's replicas; strategy fsdp keeps one shard "
                         "per rank, not replicas");
}

}  // namespace

StrategyKind fsdp_strategy() {
  return {Strategy::kFSDP,
          "fsdp",
          /*takes_process_group=*/true,
          no_own_options,
          "",
          check_fsdp_options,
          make_strategy<FsdpStrategy>};
}

}  // namespace paratrain::train_internal
