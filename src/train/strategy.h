// Internal: how the Trainer trains across devices and processes. Each strategy (single, ddp, dp,
// pipeline, fsdp) is one TrainStrategy in a file of its own (strategy_<name>.cpp): it wraps the
// model, runs a batch's forward and backward, names the parameters the optimizer steps, clips,
// captures and restores its part of a checkpoint, gives the full weights, and checks the options
// that are its own. The Trainer keeps the loop, the evaluation and the metrics, and never asks
// which strategy it holds: a new strategy is one new file and one line in strategy.cpp's table.
//
// The split follows Lightning's Strategy (its training_step, backward, optimizer and checkpoint
// hooks): the loop is written once, a strategy only says how its steps differ.
#pragma once

#include "paratrain/amp/mixed_precision.h"
#include "paratrain/data/dataset.h"
#include "paratrain/data/loader.h"
#include "paratrain/io/checkpoint.h"
#include "paratrain/train/trainer.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace paratrain::train_internal {

class TrainStrategy {
 public:
  virtual ~TrainStrategy() = default;
  TrainStrategy(const TrainStrategy&) = delete;
  TrainStrategy& operator=(const TrainStrategy&) = delete;

  /// Where batches go (the first of `devices` for dp and pipeline).
  torch::Device device() const { return device_; }
  amp::MixedPrecision& mixed_precision() { return *mp_; }

  /// The optimizer over the parameters it steps: the model's (its O2 masters), or its shards.
  virtual std::unique_ptr<torch::optim::Optimizer> make_optimizer() const;
  /// Before an accumulation's first batch: the gradients forgotten (fsdp's offloaded ones too).
  virtual void zero_grad(torch::optim::Optimizer& optimizer) { optimizer.zero_grad(); }
  /// One batch forward and backward; its gradients are synchronized across the ranks only when
  /// `last` (the last batch of an accumulation). Returns the batch's mean loss, unscaled.
  virtual torch::Tensor forward_backward(const torch::Tensor& input,
                                         const torch::Tensor& target,
                                         bool last);
  /// The evaluation forward (under no_grad, in eval mode).
  virtual torch::Tensor forward(const torch::Tensor& input);
  /// The next validation batch; `last` is the previous one (fsdp keeps its ranks in step).
  virtual std::optional<data::Batch> next_val_batch(data::DataLoader& loader,
                                                    std::optional<data::Batch>& last);
  /// The global gradient norm (at its true scale), clipped to max_norm when max_norm > 0.
  virtual double clip_grad_norm_(double max_norm);
  /// The data-parallel rank and size, when they are not the process group's (a device mesh,
  /// whose tensor-parallel ranks take the same batches).
  virtual std::optional<std::pair<int, int>> data_rank() const { return std::nullopt; }
  /// After each optimizer step (ddp compares its replicas every check_replicas steps).
  virtual void after_step(int64_t global_step) { (void)global_step; }

  /// Into `state`: the model and the optimizer's state as this strategy saves them.
  virtual void capture(CheckpointState& state, torch::optim::Optimizer& optimizer);
  /// How a checkpoint's model differs from this one (name or shape), as a clause; "" if not.
  virtual std::string saved_model_difference(const CheckpointState& state) const;
  /// Loads the model and the optimizer's state of a checkpoint that passed the checks.
  virtual void restore(const CheckpointState& state,
                       const nlohmann::json& meta,
                       torch::optim::Optimizer& optimizer);
  /// The full weights (and buffers) under the model's names. Under fsdp a collective.
  virtual TensorMap weights();

  /// cross_entropy(output, target), over B * T tokens for a sequence model's [B, T, V].
  torch::Tensor loss_of(const torch::Tensor& output, const torch::Tensor& target) const;

 protected:
  /// Moves the model to `device` and prepares it for the opt level.
  TrainStrategy(const TrainerOptions& options,
                torch::nn::Sequential model,
                torch::Device device,
                amp::AmpOptions amp);
  /// The training forward (through the wrapper that synchronizes the gradients).
  virtual torch::Tensor train_forward(const torch::Tensor& input);
  /// The loss backward starts from: loss_of, or one over the vocabulary's parts (loss parallel).
  virtual torch::Tensor train_loss(const torch::Tensor& output, const torch::Tensor& target) const {
    return loss_of(output, target);
  }
  /// The optimizer's state saved in a checkpoint (the shared file or, sharded, the rank files);
  /// `zero`: this run shards it too, and takes only its part when the world is the same.
  TensorMap saved_optimizer_state(const CheckpointState& state, bool zero) const;
  int world() const;

  const TrainerOptions& options_;  // the Trainer's, which outlive the strategy
  torch::nn::Sequential model_;
  torch::Device device_;
  std::unique_ptr<amp::MixedPrecision> mp_;
};

/// What the Trainer knows of a strategy before building it: its name, whether it trains over a
/// process group, the options it owns, its own checks, and how to build it.
struct StrategyKind {
  Strategy strategy;
  const char* name;
  bool takes_process_group;
  /// The options only this strategy takes that `options` sets (they are refused with another).
  std::vector<std::string> (*options_set)(const TrainerOptions& options);
  const char* options_why;  // "works across DDP's ranks"
  /// Its own rules, as OptionError.
  void (*check)(const TrainerOptions& options);
  std::unique_ptr<TrainStrategy> (*make)(const TrainerOptions& options,
                                         torch::nn::Sequential model);
};

/// A sequence model's output [B, T, V] against targets [B, T]: B * T classifications (class
/// dimension last), where a classifier's class dimension is 1.
bool is_sequence(const torch::Tensor& output, const torch::Tensor& target);

/// A StrategyKind's make: builds strategy S.
template <typename S>
std::unique_ptr<TrainStrategy> make_strategy(const TrainerOptions& options,
                                             torch::nn::Sequential model) {
  return std::make_unique<S>(options, std::move(model));
}
/// A StrategyKind's options_set and check for a strategy with no options or rules of its own.
inline std::vector<std::string> no_own_options(const TrainerOptions&) {
  return {};
}
inline void no_own_checks(const TrainerOptions&) {}

/// Each in its own file.
StrategyKind single_strategy();
StrategyKind ddp_strategy();
StrategyKind fsdp_strategy();
StrategyKind data_parallel_strategy();
StrategyKind pipeline_strategy();

/// Every strategy, in the order the choices are listed.
const std::vector<StrategyKind>& strategy_kinds();
const StrategyKind& strategy_kind(Strategy strategy);
/// The chosen strategy's checks, then no option of another strategy set.
void check_strategy_options(const TrainerOptions& options);

/// offload.cpp: TrainerOptions::offload's rules (OptionError, field "offload"); the bytes each
/// rank writes to offload().dir(); the refusal of a directory without room for them (counting
/// the ranks on this host), before anything is built; and a rank's store (nullptr: none).
void check_offload_options(const TrainerOptions& options);
int64_t offload_bytes_per_rank(const TrainerOptions& options, const torch::nn::Sequential& model);
void check_offload_space(const TrainerOptions& options, const torch::nn::Sequential& model);
std::shared_ptr<optim::OffloadStore> make_offload_store(const TrainerOptions& options);

}  // namespace paratrain::train_internal
