#pragma once

// Pipeline (model) parallelism: a torch::nn::Sequential split into stages, micro-batches flowing
// through them under a GPipe or 1F1B schedule, in one process (a thread per stage and device) or
// over ranks (a stage per rank, send/recv through the process group), optionally combined with
// DDP over replicas of the pipeline (2-D parallelism).
//
//   auto model = paratrain::models::make("resnet50_cifar");
//   auto balance = paratrain::pipeline::balance_by_parameters(model, 2);
//   paratrain::pipeline::Pipeline pipe(model, balance, {cpu, cpu}, cross_entropy,
//       paratrain::pipeline::PipelineOptions().chunks(8).schedule(Schedule::k1F1B));
//   torch::optim::SGD opt(model->parameters(), ...);
//   opt.zero_grad();
//   auto loss = pipe.step(x, y);   // forward and backward of all 8 micro-batches
//   opt.step();
//
// Note [Pipeline schedules and gradients]
// step(input, target) cuts the batch into `chunks` micro-batches along dim 0 (sizes differ by at
// most one, as torch.tensor_split), runs the schedule's forwards and backwards on every stage, and
// leaves the gradients summed over micro-batches in each stage's parameters. The loss is computed
// on the last stage for each micro-batch and, with scale_loss (the default), weighted by the
// micro-batch's share of the batch: for a loss that averages over samples (cross-entropy's
// default), the gradients then equal those of one forward/backward of the unsplit model on the
// whole batch, and step() returns that batch's loss. Layers that mix samples see micro-batches:
// BatchNorm normalises each micro-batch with its own statistics and updates its running
// statistics once per micro-batch, in micro-batch order (as the unsplit model run on the
// micro-batches one after the other; GPipe's paper does the same).
//
// Schedules (`actions` gives each stage's list):
//   GPipe  every forward, then every backward: m micro-batches of activations alive per stage.
//   1F1B   stage s runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one
//          backward, then drains: at most p - s <= p micro-batches alive on stage s.
// The schedule is only the order of actions; a Transport carries activations forward and
// gradients backward, so the same code runs stages on threads (Pipeline) or ranks
// (DistributedPipeline).
//
// Recomputation (checkpoint): forwards keep only each stage's input and run without a graph; the
// backward reruns the stage's forward with a graph first (GPipe's re-materialisation). Layers
// that draw random numbers (Dropout) draw new ones on the rerun, and BatchNorm updates its running
// statistics again: use it with deterministic layers for exact gradients.

#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include "paratrain/comm/process_group.h"
#include "paratrain/parallel/distributed_data_parallel.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace pipeline {

// ---- splitting ------------------------------------------------------------------------------

/// The Sequential inside `module`, for APIs that need one; throws c10::Error saying what to do
/// when it is something else.
torch::nn::Sequential as_sequential(const std::shared_ptr<torch::nn::Module>& module);

/// Stages of `balance[i]` consecutive layers each. The stages share the model's layers (no copy;
/// optimizers built on the model's parameters see the stages' training) and keep their names
/// ("layer3.0.conv1.weight" stays). Throws c10::Error when a count is < 1 or the counts do not
/// sum to the number of layers.
std::vector<torch::nn::Sequential> split(const torch::nn::Sequential& model,
                                         const std::vector<int64_t>& balance);

/// The model with its nested Sequentials (ResNet's layer1..layer4) expanded into their children,
/// so stages can be cut between blocks: child "0" of "layer3" becomes "layer3_0" (libtorch
/// forbids dots in names). Shares the layers, as split does.
torch::nn::Sequential flatten(const torch::nn::Sequential& model);

/// Layer counts for `stages` stages that minimise the largest stage's parameter count.
std::vector<int64_t> balance_by_parameters(const torch::nn::Sequential& model, int64_t stages);

/// Layer counts that minimise the largest stage's forward + backward time, measured by running
/// `sample` (a micro-batch) through each layer `repeats` times on the caller's thread.
std::vector<int64_t> balance_by_time(const torch::nn::Sequential& model,
                                     int64_t stages,
                                     const torch::Tensor& sample,
                                     int repeats = 2);

/// The contiguous split of `costs` into `parts` non-empty runs with the smallest maximum sum.
std::vector<int64_t> partition(const std::vector<double>& costs, int64_t parts);

// ---- schedules ------------------------------------------------------------------------------

enum class Schedule { kGPipe, k1F1B };

/// "gpipe" or "1f1b" (case-insensitive); throws c10::Error for anything else.
Schedule parse_schedule(const std::string& name);
std::string to_string(Schedule schedule);

struct Action {
  enum class Kind { kForward, kBackward };
  Kind kind;
  int64_t micro_batch;
  bool operator==(const Action& o) const { return kind == o.kind && micro_batch == o.micro_batch; }
};

/// The ordered actions of `stage` (0-based) of `stages` for `chunks` micro-batches.
std::vector<Action> actions(Schedule schedule, int64_t stage, int64_t stages, int64_t chunks);

// ---- transports -----------------------------------------------------------------------------

/// Carries a stage's output activations to the next stage and input gradients to the previous
/// one. Both directions keep micro-batch order per pair of stages.
class Transport {
 public:
  virtual ~Transport() = default;
  /// `grad` false: activation of `micro_batch` from stage `from` to `from + 1`; true: gradient
  /// from `from` to `from - 1`. May return before the tensor is delivered; the tensor is kept.
  virtual void send(
      int64_t from, int64_t to, int64_t micro_batch, bool grad, const at::Tensor& tensor) = 0;
  /// Blocks until it arrives (or the transport's timeout: an error naming both stages and the
  /// micro-batch).
  virtual at::Tensor recv(int64_t from, int64_t to, int64_t micro_batch, bool grad) = 0;
  /// Waits for this side's sends to complete (end of a step).
  virtual void flush() {}
  /// Wakes every blocked recv with an error (another stage failed).
  virtual void abort(const std::string& /*why*/) {}
};

/// Between threads of one process: a mailbox per (stage, micro-batch, direction).
std::shared_ptr<Transport> make_thread_transport(std::chrono::milliseconds timeout);

/// Between ranks: stage i lives on rank stage_ranks[i] of `pg`. A message is a small header
/// (dtype and shape) then the data, both as point-to-point send/recv (tag 0 activations, tag 1
/// gradients); sends are asynchronous, which 1F1B needs (both neighbours may send at once).
/// Tensors travel through host memory when `pg` has a CPU engine (gloo, mpi, or a routed group
/// such as "cpu:gloo,cuda:nccl"), and through `device` on a group of nccl alone, which takes the
/// GPipe schedule only (an NCCL send may block until its receive is posted, and under 1F1B both
/// neighbours send first). Throws c10::Error for 1F1B or a CPU device on nccl alone.
std::shared_ptr<Transport> make_process_group_transport(dist::ProcessGroupPtr pg,
                                                        std::vector<int> stage_ranks,
                                                        torch::Device device = torch::kCPU,
                                                        Schedule schedule = Schedule::kGPipe);

// ---- training -------------------------------------------------------------------------------

using LossFn =
    std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

struct PipelineOptions {
  /// Micro-batches per step (1: plain model parallelism).
  TORCH_ARG(int64_t, chunks) = 1;
  /// GPipe (all forwards, then all backwards) or 1F1B (one forward, one backward).
  TORCH_ARG(Schedule, schedule) = Schedule::kGPipe;
  /// Recompute activations in backward (Note [Pipeline schedules and gradients]).
  TORCH_ARG(bool, checkpoint) = false;
  /// Weight each micro-batch's loss by its share of the batch (gradients of the batch's mean).
  TORCH_ARG(bool, scale_loss) = true;
  /// How long a stage waits for a neighbour's activation or gradient.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
};

/// What the last step did on one stage.
struct StageStats {
  /// Most micro-batches whose activations (or, with checkpoint, inputs) were held at once.
  int64_t max_live_micro_batches = 0;
  /// Time spent computing (forwards, backwards, loss), not waiting for neighbours.
  double busy_seconds = 0;
};

/// All stages in this process, stage i on devices[i] and its own thread.
class Pipeline {
 public:
  /// Throws c10::Error for a bad balance (see split), an empty device list, a device count that
  /// differs from the stage count, devices that do not exist, or chunks < 1.
  Pipeline(torch::nn::Sequential model,
           std::vector<int64_t> balance,
           std::vector<torch::Device> devices,
           LossFn loss,
           PipelineOptions options = {});
  ~Pipeline();

  /// Forward and backward of every micro-batch; returns the loss (see the Note) on the last
  /// stage's device. Throws c10::Error when chunks exceeds the batch, or naming the stage that
  /// failed (after every stage has stopped; gradients may then be partly accumulated: call
  /// zero_grad before the next step).
  torch::Tensor step(const torch::Tensor& input, const torch::Tensor& target);
  /// Micro-batched forward without gradients (evaluation); the output on the last stage's device.
  torch::Tensor forward(const torch::Tensor& input);

  const std::vector<torch::nn::Sequential>& stages() const;
  const std::vector<torch::Device>& devices() const;
  const PipelineOptions& options() const;
  /// Per stage, for the last step.
  std::vector<StageStats> last_stats() const;
  /// Wall time of the last step.
  double last_step_seconds() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// One stage per rank. Every rank of the pipeline constructs it with its own stage's module.
class DistributedPipeline {
 public:
  /// `stage_module` is stage `stage` of stage_ranks.size() stages; this rank must be
  /// stage_ranks[stage] of `pg`. With `data_parallel_group` (the ranks holding the same stage in
  /// other pipeline replicas), the stage is wrapped in DistributedDataParallel over that group:
  /// gradients are averaged over the replicas at the last backward of each step (the others run
  /// under no_sync), as torch.distributed.pipelining does with DDP.
  DistributedPipeline(torch::nn::Sequential stage_module,
                      int64_t stage,
                      dist::ProcessGroupPtr pg,
                      std::vector<int> stage_ranks,
                      torch::Device device,
                      LossFn loss,
                      PipelineOptions options = {},
                      dist::ProcessGroupPtr data_parallel_group = nullptr,
                      DDPOptions ddp_options = {});
  /// A stage sharded by FSDP over the ranks that hold it in the other pipeline replicas
  /// (mesh["dp_shard"]), as torch.distributed.pipelining runs a fully_shard-ed stage: every
  /// micro-batch's forward runs through `fsdp`, whose module is this stage, and its gradients stay
  /// unsharded (set_requires_gradient_sync(false)) until the step's last backward reduce-scatters
  /// their sum. A caller that turned the sync off itself (gradient accumulation over steps) keeps
  /// it off. `fsdp` must outlive the pipeline.
  DistributedPipeline(FullyShardedDataParallel& fsdp,
                      int64_t stage,
                      dist::ProcessGroupPtr pg,
                      std::vector<int> stage_ranks,
                      torch::Device device,
                      LossFn loss,
                      PipelineOptions options = {});
  ~DistributedPipeline();

  /// `input` is read on the first stage, `target` on the last (pass undefined tensors elsewhere).
  /// Returns the loss on the last stage, an undefined tensor on the others.
  torch::Tensor step(const torch::Tensor& input, const torch::Tensor& target);
  /// The same in `chunks` micro-batches instead of the options' (a last batch smaller than
  /// chunks); every stage must pass the same count.
  torch::Tensor step(const torch::Tensor& input, const torch::Tensor& target, int64_t chunks);
  /// Forward without gradients (evaluation) in `chunks` micro-batches, the same on every stage:
  /// `input` is read on the first stage; returns the output on the last, undefined elsewhere.
  torch::Tensor forward(const torch::Tensor& input, int64_t chunks = 1);

  bool is_first() const;
  bool is_last() const;
  const torch::nn::Sequential& module() const;
  StageStats last_stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace pipeline
}  // namespace paratrain
