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
  return {Strategy::kSingle,
          "single",
          /*takes_process_group=*/false,
          no_own_options,
          "",
          no_own_checks,
          make_strategy<SingleStrategy>};
}

}  // namespace paratrain::train_internal
