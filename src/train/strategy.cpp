// What every strategy does alike (a model replicated whole on each rank), the table of strategies,
// and the option rules that span them.

#include "strategy.h"

#include "paratrain/base/option_error.h"
#include "paratrain/io/safetensors.h"
#include "paratrain/util/trace.h"

#include <torch/nn/functional/loss.h>

#include <sstream>
#include <utility>

namespace paratrain::train_internal {

TrainStrategy::TrainStrategy(const TrainerOptions& options,
                             torch::nn::Sequential model,
                             torch::Device device,
                             amp::AmpOptions amp)
    : options_(options), model_(std::move(model)), device_(device) {
  model_->to(device_);
  mp_ = std::make_unique<amp::MixedPrecision>(model_, device_, std::move(amp));
}

int TrainStrategy::world() const {
  return options_.process_group() ? options_.process_group()->size() : 1;
}

std::unique_ptr<torch::optim::Optimizer> TrainStrategy::make_optimizer() const {
  return paratrain::make_optimizer(mp_->optimizer_parameters(), options_.optimizer());
}

bool is_sequence(const torch::Tensor& out, const torch::Tensor& target) {
  return out.dim() == 3 && target.dim() == 2;
}

// PyTorch's language-model loss for sequences: cross_entropy(out.flatten(0, 1), target.flatten()).
torch::Tensor TrainStrategy::loss_of(const torch::Tensor& out, const torch::Tensor& target) const {
  if (is_sequence(out, target)) {
    return torch::nn::functional::cross_entropy(mp_->cast_output(out).flatten(0, 1),
                                                target.flatten());
  }
  return torch::nn::functional::cross_entropy(mp_->cast_output(out), target);
}

torch::Tensor TrainStrategy::train_forward(const torch::Tensor& input) {
  return model_->forward(input);
}

torch::Tensor TrainStrategy::forward_backward(const torch::Tensor& input,
                                              const torch::Tensor& target,
                                              bool last) {
  (void)last;  // nothing to synchronize here
  torch::Tensor loss;
  {
    trace::Span span("forward", "compute");
    auto autocast = mp_->autocast();  // O1 only; its threads (dp) inherit it
    loss = train_loss(train_forward(mp_->cast_input(input)), target);
  }
  trace::Span span("backward", "compute");
  const double accumulate = static_cast<double>(options_.accumulate());
  mp_->backward(accumulate > 1 ? loss / accumulate : loss);
  return loss;
}

torch::Tensor TrainStrategy::forward(const torch::Tensor& input) {
  return model_->forward(input);
}

std::optional<data::Batch> TrainStrategy::next_val_batch(data::DataLoader& loader,
                                                         std::optional<data::Batch>& last) {
  (void)last;
  return loader.next();
}

double TrainStrategy::clip_grad_norm_(double max_norm) {
  return paratrain::clip_grad_norm_(mp_->optimizer_parameters(), max_norm);
}

void TrainStrategy::capture(CheckpointState& s, torch::optim::Optimizer& optimizer) {
  for (const auto& kv : with_prefix(module_state(*model_), "model.")) {
    s.shared[kv.first] = kv.second;
  }
  for (const auto& kv : with_prefix(optimizer_state(optimizer), "optim.")) {
    s.shared[kv.first] = kv.second;
  }
}

// The first parameter or buffer whose name or shape differs; empty when the same.
std::string TrainStrategy::saved_model_difference(const CheckpointState& state) const {
  const TensorMap saved = with_prefix(state.shared, "model.", true);
  const TensorMap now = module_state(*model_);
  for (const auto& kv : now) {
    auto it = saved.find(kv.first);
    if (it == saved.end()) {
      return "it has no '" + kv.first + "'";
    }
    if (it->second.sizes() != kv.second.sizes()) {
      std::ostringstream line;
      line << "'" << kv.first << "' has shape " << it->second.sizes() << " there and "
           << kv.second.sizes() << " in this model";
      return line.str();
    }
  }
  for (const auto& kv : saved) {
    if (!now.count(kv.first)) {
      return "it has '" + kv.first + "', which this model lacks";
    }
  }
  return "";
}

// The optimizer's state in a checkpoint: in the shared file, or (ZeRO's sharded checkpoints) in
// the rank files. Under ZeRO with as many ranks as saved it, this rank's own shard is its part
// (ZeRO splits the parameters the same way again). Otherwise its part need not be any one saving
// rank's, so it reads them all (verified by load_latest) and ZeroRedundancyOptimizer::load_state,
// or the unsharded optimizer, takes what it needs.
TensorMap TrainStrategy::saved_optimizer_state(const CheckpointState& s, bool zero) const {
  TensorMap optim = with_prefix(s.shared, "optim.", true);
  if (!s.own_read_by_all) {  // what ddp's capture sets for sharded ZeRO state
    return optim;
  }
  if (zero && s.world_size == world()) {
    return with_prefix(s.own, "optim.", true);
  }
  for (int r = 0; r < s.world_size; ++r) {
    for (auto& kv :
         with_prefix(Checkpoint::load_own(s.path, r, s.step, s.world_size), "optim.", true)) {
      optim[kv.first] = std::move(kv.second);
    }
  }
  return optim;
}

void TrainStrategy::restore(const CheckpointState& s,
                            const nlohmann::json& meta,
                            torch::optim::Optimizer& optimizer) {
  (void)meta;
  load_module_state(*model_, with_prefix(s.shared, "model.", true));
  load_optimizer_state(optimizer, saved_optimizer_state(s, /*zero=*/false));
}

TensorMap TrainStrategy::weights() {
  TensorMap state = module_state(*model_);
  if (mp_->opt_level() != amp::OptLevel::kO2) {
    return state;
  }
  // The fp32 masters under the model's names: masters() follows parameters(), tied weights once.
  std::vector<torch::Tensor> unique;
  for (const auto& p : model_->named_parameters()) {
    size_t i = 0;
    while (i < unique.size() && !unique[i].is_same(p.value())) {
      ++i;
    }
    if (i == unique.size()) {
      unique.push_back(p.value());
    }
    state[p.key()] = mp_->masters()[i].detach();
  }
  return state;
}

const std::vector<StrategyKind>& strategy_kinds() {
  static const std::vector<StrategyKind> kinds = {single_strategy(), ddp_strategy(),
                                                  fsdp_strategy(), data_parallel_strategy(),
                                                  pipeline_strategy()};
  return kinds;
}

const StrategyKind& strategy_kind(Strategy strategy) {
  for (const auto& kind : strategy_kinds()) {
    if (kind.strategy == strategy) {
      return kind;
    }
  }
  TORCH_CHECK(false, "unknown strategy ", static_cast<int>(strategy));
  return strategy_kinds().front();  // not reached
}

// The chosen strategy's rules first, then no option of another strategy set.
void check_strategy_options(const TrainerOptions& o) {
  const StrategyKind& chosen = strategy_kind(o.strategy());
  chosen.check(o);
  for (const auto& kind : strategy_kinds()) {
    if (kind.strategy == chosen.strategy) {
      continue;
    }
    for (const std::string& field : kind.options_set(o)) {
      PARATRAIN_CHECK_OPTION(false, field, field, " ", kind.options_why, ": add strategy ",
                             kind.name, " (got strategy ", chosen.name, ")");
    }
  }
}

}  // namespace paratrain::train_internal

namespace paratrain {

Strategy parse_strategy(const std::string& name) {
  std::string choices;
  const auto& kinds = train_internal::strategy_kinds();
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (name == kinds[i].name) {
      return kinds[i].strategy;
    }
    choices += (i == 0 ? "" : i + 1 == kinds.size() ? " or " : ", ") + std::string(kinds[i].name);
  }
  PARATRAIN_CHECK_OPTION(false, "strategy", "unknown strategy '", name, "': choose ", choices);
  return Strategy::kSingle;  // not reached
}

std::string to_string(Strategy s) {
  for (const auto& kind : train_internal::strategy_kinds()) {
    if (kind.strategy == s) {
      return kind.name;
    }
  }
  return "?";
}

}  // namespace paratrain
