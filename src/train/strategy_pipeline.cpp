// --strategy pipeline: the model cut into stages, one per device, balanced by parameters; each
// batch runs as `chunks` micro-batches under the GPipe or 1F1B schedule (pipeline::Pipeline).

#include "strategy.h"

#include "paratrain/base/option_error.h"
#include "paratrain/parallel/pipeline.h"
#include "paratrain/util/trace.h"

namespace paratrain::train_internal {

namespace {

torch::Device first_stage(const TrainerOptions& o) {
  PARATRAIN_CHECK_OPTION(!o.devices().empty(), "devices",
                         "strategy pipeline needs devices, one per stage");
  return o.devices().front();
}

void check_pipeline_options(const TrainerOptions& o) {
  first_stage(o);
  PARATRAIN_CHECK_OPTION(o.chunks() <= o.batch_size(), "chunks", "chunks (", o.chunks(),
                         ") is larger than batch_size (", o.batch_size(),
                         "): a micro-batch needs a sample");
}

class PipelineStrategy : public TrainStrategy {
 public:
  PipelineStrategy(const TrainerOptions& o, torch::nn::Sequential model)
      : TrainStrategy(o, std::move(model), first_stage(o), o.amp()),
        pipe_(
            model_,
            pipeline::balance_by_parameters(model_, static_cast<int64_t>(o.devices().size())),
            o.devices(),
            // Each micro-batch's loss, scaled for the GradScaler and the accumulation.
            [this](const torch::Tensor& out, const torch::Tensor& target) {
              return mp_->scaler().scale(loss_of(out, target)) /
                     static_cast<double>(options_.accumulate());
            },
            pipeline::PipelineOptions().chunks(o.chunks()).schedule(o.pipeline_schedule())) {}

  // The pipeline runs the backward of each micro-batch itself.
  torch::Tensor forward_backward(const torch::Tensor& input,
                                 const torch::Tensor& target,
                                 bool last) override {
    (void)last;  // one process: nothing to synchronize
    trace::Span span("forward and backward (pipeline)", "compute");
    auto autocast = mp_->autocast();  // O1 only; the stages' threads inherit it
    const double accumulate = static_cast<double>(options_.accumulate());
    return pipe_.step(mp_->cast_input(input), target) * (accumulate / mp_->scaler().get_scale());
  }

  torch::Tensor forward(const torch::Tensor& input) override { return pipe_.forward(input); }

 private:
  pipeline::Pipeline pipe_;
};

}  // namespace

StrategyKind pipeline_strategy() {
  return {Strategy::kPipeline,
          "pipeline",
          /*takes_process_group=*/false,
          no_own_options,
          "",
          check_pipeline_options,
          make_strategy<PipelineStrategy>};
}

}  // namespace paratrain::train_internal
