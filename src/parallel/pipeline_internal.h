// Internal to the pipeline's files (not a public header): what partitioning
// (pipeline_partition.cpp), transports (pipeline_transport.cpp), one stage's work
// (pipeline_stage.cpp) and the runners (pipeline.cpp) share.
#pragma once

#include "paratrain/parallel/pipeline.h"

#include <torch/torch.h>

#include <chrono>
#include <map>
#include <optional>
#include <stdexcept>
#include <vector>

namespace paratrain {
namespace pipeline {

namespace nn = torch::nn;
using Clock = std::chrono::steady_clock;

namespace internal {

// Thrown in a stage woken because another stage failed: the other stage's error is the one to
// report.
struct StageAborted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace internal

// ---- one stage's work -----------------------------------------------------------------------

// Named, not anonymous: Pipeline::Impl and DistributedPipeline::Impl hold these, and a unity
// build would otherwise warn that they use types of internal linkage.
namespace stage_work {

// Runs one stage's actions over a transport; shared by Pipeline (one per thread) and
// DistributedPipeline (one per rank).
struct StageRunner {
  nn::Sequential module{nullptr};
  torch::Device device{torch::kCPU};
  int64_t index = 0;
  int64_t count = 1;
  LossFn loss;
  PipelineOptions options;
  DistributedDataParallel* ddp = nullptr;
  FullyShardedDataParallel* fsdp = nullptr;  // runs the module instead (a sharded stage)
  bool fsdp_sync = true;  // the sync the caller set, restored for the step's last backward
  Transport* transport = nullptr;

  // Per step.
  std::vector<at::Tensor> inputs;   // first stage: the micro-batches
  std::vector<at::Tensor> targets;  // last stage
  int64_t batch = 0;                // last stage: samples in the whole batch
  at::Tensor loss_sum;              // last stage
  std::vector<at::Tensor> outputs;  // last stage, forward-only runs
  StageStats stats;

  struct Saved {
    at::Tensor input;   // this stage's input leaf (its .grad goes to the previous stage)
    at::Tensor output;  // with its graph (not with checkpoint)
    at::Tensor loss;    // last stage
  };
  std::map<int64_t, Saved> saved;
  double waiting = 0;

  bool is_last() const { return index == count - 1; }

  // Drops what a failed step left (graphs of saved micro-batches hold memory).
  void clear() {
    saved.clear();
    inputs.clear();
    targets.clear();
    outputs.clear();
  }

  at::Tensor run_module(const at::Tensor& x);
  at::Tensor receive(int64_t from, int64_t mb, bool grad);
  at::Tensor compute_loss(const at::Tensor& out, int64_t mb);
  void forward(int64_t mb, bool training);
  void backward(int64_t mb,
                bool last_backward,
                std::optional<DistributedDataParallel::NoSyncGuard>& no_sync);
  void run(const std::vector<Action>& acts, bool training);
};

}  // namespace stage_work

}  // namespace pipeline
}  // namespace paratrain
