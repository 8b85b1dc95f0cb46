// A Trainer in the spirit of Lightning's: it owns the strategy (one process, DDP, DataParallel or
// a pipeline, each with AMP O0-O3), the optimizer, the learning-rate schedule, the loop, the
// evaluation, checkpoints with exact resume, and metrics.
//
//   auto model = paratrain::models::make("resnet18", 10);
//   paratrain::Trainer trainer(model, train_set, val_set,
//       paratrain::TrainerOptions()
//           .strategy(paratrain::Strategy::kDDP).process_group(pg).device(torch::kCUDA)
//           .optimizer(paratrain::OptimizerOptions().kind("sgd").lr(0.1))
//           .lr_schedule(paratrain::LRScheduleOptions().kind("cosine").t_max(90))
//           .epochs(90).batch_size(256)
//           .checkpoint_dir("ckpt").checkpoint_every(1000).resume("auto"));
//   trainer.on_epoch_end([](const paratrain::EpochResult& r) { ... });
//   trainer.fit();
//
// A run killed at any step and resumed from its last checkpoint ends with the same weights, bit
// for bit, as a run that was never stopped: the checkpoint holds the weights, the optimizer's
// state, the schedule, the GradScaler, the O2 masters, every rank's RNG states, and where the
// sampler and loader were in the epoch.
//
// The loss is cross_entropy(output, target). A sequence model's output [B, T, V] against targets
// [B, T] (models::gpt on a data::TokenDataset) is B * T classifications, PyTorch's language-model
// loss cross_entropy(output.flatten(0, 1), target.flatten()); its accuracy is per token.
#pragma once

#include "paratrain/amp/mixed_precision.h"
#include "paratrain/base/option_error.h"  // what check_trainer_options throws
#include "paratrain/comm/process_group.h"
#include "paratrain/data/dataset.h"
#include "paratrain/io/checkpoint.h"
#include "paratrain/optim/offload.h"
#include "paratrain/parallel/fully_sharded_data_parallel.h"
#include "paratrain/parallel/pipeline.h"
#include "paratrain/train/lr_schedule.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace paratrain {

enum class Strategy { kSingle, kDDP, kDataParallel, kPipeline, kFSDP };
/// "single", "ddp", "dp", "pipeline", "fsdp"; OptionError (field "strategy") naming the choices
/// otherwise.
Strategy parse_strategy(const std::string& name);
std::string to_string(Strategy strategy);

struct OptimizerOptions {
  /// "sgd", "adam" or "adamw" (libtorch's).
  TORCH_ARG(std::string, kind) = "sgd";
  /// The learning rate.
  TORCH_ARG(double, lr) = 0.05;
  TORCH_ARG(double, momentum) = 0.9;  // sgd
  /// L2 penalty (sgd, adam) or decoupled weight decay (adamw).
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(double, beta1) = 0.9;  // adam, adamw
  /// adam, adamw: the second moment's decay.
  TORCH_ARG(double, beta2) = 0.999;
  /// adam, adamw: added to the denominator.
  TORCH_ARG(double, eps) = 1e-8;
  /// The step in one vectorized pass per CPU parameter (optim::FusedAdam, FusedAdamW, FusedSGD),
  /// as torch.optim.Adam(fused=True); libtorch's step for parameters the pass does not take.
  TORCH_ARG(bool, fused) = false;
  /// adam and adamw: the moments in this store (the fused step, optim::FusedAdam::offload);
  /// nullptr keeps them in memory.
  TORCH_ARG(std::shared_ptr<optim::OffloadStore>, offload) = nullptr;
};

/// What training keeps out of memory, and where (DeepSpeed's ZeRO-Offload and ZeRO-Infinity;
/// paratrain/optim/offload.h). Each rank has a store of its own.
struct TrainOffloadOptions {
  /// Adam's and AdamW's moments (fsdp, or ddp with zero): the fused step streams them.
  TORCH_ARG(bool, optimizer) = false;
  /// fsdp: the shards' gradients, between backward and the step.
  TORCH_ARG(bool, gradients) = false;
  /// fsdp: the shards themselves (the fp32 weights the optimizer steps), between uses.
  TORCH_ARG(bool, params) = false;
  /// A directory on a disk (the files tier); "" keeps them in host memory (for device training).
  TORCH_ARG(std::string, dir) = "";

 public:
  bool any() const { return optimizer_ || gradients_ || params_; }
};

/// libtorch's optimizer for the options (its fused subclass with `fused`); c10::Error for an
/// unknown kind or a bad value.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<torch::Tensor> parameters,
                                                        const OptimizerOptions& options);

/// The global L2 norm of the gradients of `parameters` (on any mix of devices), as
/// torch.nn.utils.clip_grad_norm_ computes it; with max_norm > 0 the gradients are scaled by
/// max_norm / (norm + 1e-6) when that is below 1. Under DDP the gradients are already averaged,
/// so every rank computes the same norm.
double clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm);
[[deprecated("clip_grad_norm is now clip_grad_norm_, as torch.nn.utils names it")]] inline double
clip_grad_norm(const std::vector<torch::Tensor>& parameters, double max_norm) {
  return clip_grad_norm_(parameters, max_norm);
}

/// What fit() throws for a non-finite loss, naming the step and the rank
/// (TrainerOptions::stop_on_non_finite).
struct NonFiniteLoss : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The fsdp strategy's device mesh, in torchtitan's parallel degrees (DeviceMesh, mesh_dims):
/// tensor parallelism over `tp` ranks (a gpt() model's plan, models/gpt_parallel.h), FSDP over
/// `dp_shard`, replicas of the shards over `dp_replicate` (HSDP). All 1 (dp_shard the world):
/// plain FSDP.
struct MeshOptions {
  /// Data-parallel replicas of the sharded model (HSDP's replicate dimension).
  TORCH_ARG(int, dp_replicate) = 1;
  /// Ranks each replica's shards are spread over; -1: what the other degrees leave of the world.
  TORCH_ARG(int, dp_shard) = -1;
  /// Tensor-parallel ranks (adjacent ranks: the innermost dimension).
  TORCH_ARG(int, tp) = 1;
  /// Pipeline stages, outermost (a gpt() model cut between its blocks, each stage sharded and
  /// split by the degrees above; TrainerOptions::chunks and pipeline_schedule apply).
  TORCH_ARG(int, pp) = 1;
  /// With tp > 1: the LayerNorms and the residual stream split along the sequence (torchtitan
  /// always does); the sequence length must be a multiple of tp.
  TORCH_ARG(bool, sequence_parallel) = true;
  /// With tp > 1: the loss computed on the vocabulary's parts (torchtitan's default).
  TORCH_ARG(bool, loss_parallel) = true;

 public:
  /// Whether this is more than plain FSDP (a degree other than dp_shard above 1).
  bool is_mesh() const { return dp_replicate_ > 1 || tp_ > 1 || pp_ > 1; }
};

struct TrainerOptions {
  /// single, ddp, dp (DataParallel), pipeline or fsdp.
  TORCH_ARG(Strategy, strategy) = Strategy::kSingle;
  /// single and ddp: where the model computes.
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  /// dp: the replicas' devices (the model lives on the first); pipeline: one per stage.
  TORCH_ARG(std::vector<torch::Device>, devices) = {};
  TORCH_ARG(int64_t, chunks) = 4;  // pipeline micro-batches
  /// pipeline: GPipe or 1F1B.
  TORCH_ARG(pipeline::Schedule, pipeline_schedule) = pipeline::Schedule::kGPipe;
  /// ddp and fsdp: the group (dist::init_process_group()).
  TORCH_ARG(dist::ProcessGroupPtr, process_group) = nullptr;
  /// fsdp: the units, prefetch, FSDP's mixed-precision policy, activation checkpointing. The
  /// fsdp strategy takes opt levels O0 and O1 (its shards are the fp32 master weights), clips
  /// by the global norm over every rank's shards, and saves sharded checkpoints: each rank
  /// writes its own shards and optimizer state, which resume on another number of ranks with
  /// `elastic` (resharded) and consolidate into one file (`paratrain checkpoint consolidate`).
  TORCH_ARG(FsdpOptions, fsdp) = {};
  /// fsdp: the device mesh (tensor parallel, HSDP); the default is 1-D FSDP over every rank.
  TORCH_ARG(MeshOptions, mesh) = {};
  /// fsdp (and ddp with zero, the optimizer only): state kept in host memory or files. Before
  /// anything is built each rank checks that the directory is a disk's with room for its part
  /// (counting the other ranks on its host), and refuses in one line otherwise. Checkpoints are
  /// the same with or without offload, and either resumes into the other.
  TORCH_ARG(TrainOffloadOptions, offload) = {};
  /// Mixed precision: the opt level, dtype and loss scaling.
  TORCH_ARG(amp::AmpOptions, amp) = {};
  /// The optimizer and its hyperparameters.
  TORCH_ARG(OptimizerOptions, optimizer) = {};
  /// The learning-rate schedule.
  TORCH_ARG(LRScheduleOptions, lr_schedule) = {};
  /// The schedule steps after every optimizer step instead of every epoch.
  TORCH_ARG(bool, schedule_per_step) = false;
  /// Passes over the training set.
  TORCH_ARG(int64_t, epochs) = 1;
  /// Caps the optimizer steps of each epoch (0: the whole epoch).
  TORCH_ARG(int64_t, steps_per_epoch) = 0;
  /// Per rank (ddp), or the whole batch (dp, pipeline).
  TORCH_ARG(int64_t, batch_size) = 64;
  TORCH_ARG(int64_t, eval_batch_size) = 0;  // 0: batch_size
  TORCH_ARG(int64_t, workers) = 1;          // DataLoader threads
  TORCH_ARG(uint64_t, seed) = 0;            // the sampler's and the transforms'
  /// Clip the global gradient norm to this (0: no clipping).
  TORCH_ARG(double, clip_grad_norm) = 0.0;
  /// Batches whose gradients add up before each optimizer step (ddp: no_sync but the last).
  TORCH_ARG(int64_t, accumulate) = 1;
  /// Applied to each batch's input on the device (e.g. data::adapt_images).
  TORCH_ARG(std::function<torch::Tensor(const torch::Tensor&)>, input_transform) = nullptr;
  /// Checkpoints: a directory, every N optimizer steps and/or at each epoch's end, the newest K
  /// kept. resume: "" (start fresh), "auto" (the newest one that verifies, if any), or a path.
  TORCH_ARG(std::string, checkpoint_dir) = "";
  /// Save every N optimizer steps (0: not by steps).
  TORCH_ARG(int64_t, checkpoint_every) = 0;
  /// Save at the end of every epoch.
  TORCH_ARG(bool, checkpoint_every_epoch) = false;
  /// How many checkpoints stay in checkpoint_dir; older ones are deleted.
  TORCH_ARG(int64_t, keep) = 3;
  /// "" (start fresh), "auto" (the newest checkpoint that verifies, if any) or a path.
  TORCH_ARG(std::string, resume) = "";
  /// With resume "auto": when every checkpoint in checkpoint_dir is damaged, start from step 0
  /// instead of failing. The damaged checkpoints stay on disk and rotation deletes none of them
  /// (a save at the same step replaces one). Without it that case fails naming the newest one's
  /// fault, and deletes nothing; a directory with no checkpoint at all starts from step 0 either
  /// way.
  TORCH_ARG(bool, start_fresh_if_damaged) = false;
  /// JSON object describing the run; a checkpoint whose config differs is refused on resume,
  /// naming the first difference.
  TORCH_ARG(std::string, config) = "{}";
  /// Keys of `config` that may differ from the checkpoint's on resume (lr, momentum, ...): a
  /// population-based training trial continues another trial's checkpoint with perturbed
  /// hyperparameters, which then apply from the resumed step on.
  TORCH_ARG(std::vector<std::string>, resume_may_change) = {};
  /// JSON lines: an epoch row per epoch, a step row every log_every optimizer steps (0: none).
  TORCH_ARG(std::string, metrics) = "";
  /// A step row in the metrics every N optimizer steps (0: none).
  TORCH_ARG(int64_t, log_every) = 0;
  /// The same rows as TensorBoard scalars (train/loss, train/lr, train/grad_norm,
  /// train/loss_scale, train/images_per_sec at each logged step; epoch/train_loss,
  /// epoch/val_accuracy, epoch/val_loss, ... per epoch), in event files under this directory
  /// (rank 0's).
  TORCH_ARG(std::string, tensorboard) = "";
  /// A non-finite loss stops the run (NonFiniteLoss naming step and rank); with dynamic loss
  /// scaling the GradScaler skips the step instead, as PyTorch does.
  TORCH_ARG(bool, stop_on_non_finite) = true;
  /// ddp: every N optimizer steps the ranks compare checksums of their parameters;
  /// a rank whose weights differ is named (ReplicaDivergence). 0: never.
  TORCH_ARG(int64_t, check_replicas) = 0;
  /// ddp: every BatchNorm becomes a SyncBatchNorm over the process group
  /// (convert_sync_batchnorm), so batches are normalized across the ranks.
  TORCH_ARG(bool, sync_batchnorm) = false;
  /// ddp: the optimizer's state is sharded over the ranks (ZeroRedundancyOptimizer).
  TORCH_ARG(bool, zero) = false;
  /// With zero, how checkpoints hold the optimizer's state: "consolidated" (rank 0 gathers it and
  /// saves it as the unsharded optimizer's) or "sharded" (each rank saves its own shard in its
  /// rank file: no gathering, no rank holding the whole state). Either resumes with or without
  /// zero, on any number of ranks with `elastic` (the shards are then read by every rank and
  /// each takes its part).
  TORCH_ARG(std::string, zero_checkpoint) = "consolidated";
  /// An elastic job (`paratrain launch --nnodes MIN:MAX`): resume may take a checkpoint made by
  /// another number of ranks. The rest of the interrupted epoch is then shared out over the new
  /// world (torchelastic's ElasticDistributedSampler start_index), so no sample of it is lost or
  /// trained twice; the learning rate stays the user's choice, as in PyTorch.
  TORCH_ARG(bool, elastic) = false;
  /// A Chrome trace (Perfetto, chrome://tracing) of fit(): forward, backward, optimizer steps,
  /// data waits, checkpoints, and under ddp each bucket's allreduce from launch to wait; every
  /// rank in one file. "": none.
  TORCH_ARG(std::string, trace) = "";
};

/// What fit() throws when --check-replicas finds ranks whose weights differ.
struct ReplicaDivergence : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct StepInfo {
  int64_t epoch = 0;        // 0-based
  int64_t batch = 0;        // batches of this epoch done
  int64_t global_step = 0;  // optimizer steps done
  double lr = 0;
  /// Measured only on log steps (log_every) or when clipping: NaN otherwise.
  double loss = std::numeric_limits<double>::quiet_NaN();
  double grad_norm = std::numeric_limits<double>::quiet_NaN();
  double loss_scale = 1.0;
  bool stepped = true;  // false when the GradScaler skipped the step
};

struct EpochResult {
  int64_t epoch = 0;  // 0-based
  /// False for an epoch this run trained no step of: one resumed from a checkpoint of its last
  /// step, whose training an earlier run did. Its train_loss and images_per_sec are then NaN (the
  /// evaluation, lr and seconds are this run's), and its metrics row says "resumed".
  bool trained = true;
  double train_loss = 0;
  /// Over the validation set (per token for sequence outputs), every rank's share counted under
  /// ddp; NaN without a validation set.
  double val_accuracy = 0;
  /// The mean cross entropy over the validation set (per token for sequence outputs), counted as
  /// val_accuracy is.
  double val_loss = 0;
  double images_per_sec = 0;
  double seconds = 0;
  double data_wait_seconds = 0;
  double lr = 0;
  int64_t global_step = 0;
};

/// Checks every option that does not need the process group, as the Trainer's constructor does:
/// throws OptionError naming the first bad field (checkpoint_every without checkpoint_dir, a
/// negative count, an option of another strategy), in these options' own terms.
void check_trainer_options(const TrainerOptions& options);

class Trainer {
 public:
  /// Builds the strategy and the optimizer. `val` may be null (no evaluation). Throws c10::Error
  /// with one line for bad options.
  Trainer(torch::nn::Sequential model,
          data::DatasetPtr train,
          data::DatasetPtr val,
          TrainerOptions options);
  ~Trainer();

  /// Resumes when options.resume says so, then trains the remaining epochs.
  std::vector<EpochResult> fit();
  /// Accuracy over the validation set (a collective under ddp); per token for sequence outputs.
  double evaluate();
  /// Saves a checkpoint now (options.checkpoint_dir must be set).
  void save_checkpoint();
  /// Blocks until the checkpoint being written in the background is on disk (none: returns).
  /// An epoch-end callback that tells others the epoch is done calls it first, so that whoever
  /// stops the job then can resume from that epoch.
  void wait_for_checkpoint();

  void on_step_end(std::function<void(const StepInfo&)> callback);
  void on_epoch_end(std::function<void(const EpochResult&)> callback);

  torch::nn::Sequential& model();
  torch::optim::Optimizer& optimizer();
  amp::MixedPrecision& mixed_precision();
  /// The weights (O2: the fp32 masters in the model's names; fsdp: gathered from every rank's
  /// shards, a collective to call on every rank).
  TensorMap weights() const;
  int64_t global_step() const;
  int64_t epoch() const;
  const TrainerOptions& options() const;
  /// The checkpoint resumed from ("" when none).
  std::string resumed_from() const;
  int64_t steps_per_epoch() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace paratrain
