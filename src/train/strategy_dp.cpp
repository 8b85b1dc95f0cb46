// --strategy dp: one process scatters each batch over `devices` (DataParallel, as
// torch.nn.DataParallel), the model living on the first.

#include "strategy.h"

#include "paratrain/base/option_error.h"
#include "paratrain/parallel/data_parallel.h"

namespace paratrain::train_internal {

namespace {

torch::Device first_device(const TrainerOptions& o) {
  PARATRAIN_CHECK_OPTION(!o.devices().empty(), "devices",
                         "strategy dp needs devices (e.g. devices cpu,cpu)");
  return o.devices().front();
}

class DataParallelStrategy : public TrainStrategy {
 public:
  DataParallelStrategy(const TrainerOptions& o, torch::nn::Sequential model)
      : TrainStrategy(o, std::move(model), first_device(o), o.amp()), dp_(model_, o.devices()) {}

 protected:
  torch::Tensor train_forward(const torch::Tensor& input) override { return dp_.forward(input); }

 private:
  DataParallel dp_;
};

}  // namespace

StrategyKind data_parallel_strategy() {
  return {Strategy::kDataParallel,
          "dp",
          /*takes_process_group=*/false,
          no_own_options,
          "",
          [](const TrainerOptions& o) { first_device(o); },
          make_strategy<DataParallelStrategy>};
}

}  // namespace paratrain::train_internal
