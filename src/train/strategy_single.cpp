// --strategy single: one process, one device; what TrainStrategy does by default.

#include "strategy.h"

namespace paratrain::train_internal {

namespace {

class SingleStrategy : public TrainStrategy {
 public:
  SingleStrategy(const TrainerOptions& o, torch::nn::Sequential model)
      : TrainStrategy(o, std::move(model), o.device(), o.amp()) {}
};

}  // namespace

StrategyKind single_strategy() {
  return {
      Strategy::kSingle,
      "single",
      /*takes_process_group=*/false,
      [](const TrainerOptions&) { return std::vector<std::string>{}; },
      "",
      [](const TrainerOptions&) {},
      [](const TrainerOptions& o, torch::nn::Sequential model) -> std::unique_ptr<TrainStrategy> {
        return std::make_unique<SingleStrategy>(o, std::move(model));
      }};
}

}  // namespace paratrain::train_internal
