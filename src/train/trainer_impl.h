// Internal: the Trainer's state, shared by its files: trainer.cpp (the loop, the evaluation, the
// metrics) and trainer_state.cpp (capture, restore and resume of the training state through
// checkpoints). How the model trains across devices and ranks is its TrainStrategy's (strategy.h).
#pragma once

#include "paratrain/train/trainer.h"

#include "strategy.h"

#include "paratrain/data/distributed_sampler.h"
#include "paratrain/data/loader.h"
#include "paratrain/io/tensorboard.h"
#include "paratrain/util/trace.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace paratrain {

using Json = nlohmann::json;

struct Trainer::Impl {
  TrainerOptions o;
  torch::nn::Sequential model;
  data::DatasetPtr train;
  data::DatasetPtr val;
  int rank = 0;
  int world = 1;
  int data_rank = 0;  // the sampler's: the data-parallel rank (a mesh's tp ranks share one)
  int data_world = 1;
  torch::Device device = torch::kCPU;  // where batches go
  std::unique_ptr<train_internal::TrainStrategy> strategy;
  amp::MixedPrecision* mp = nullptr;  // the strategy's
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<LRSchedule> schedule;
  std::shared_ptr<data::DistributedSampler> sampler;
  std::unique_ptr<data::DataLoader> loader;
  std::unique_ptr<data::DataLoader> val_loader;
  std::unique_ptr<Checkpoint> ckpt;
  std::ofstream metrics;
  std::unique_ptr<tensorboard::SummaryWriter> tb;
  std::chrono::steady_clock::time_point log_clock;  // since the last step row
  int64_t log_samples = 0;                          // this rank's samples since then
  std::vector<std::function<void(const StepInfo&)>> step_callbacks;
  std::vector<std::function<void(const EpochResult&)>> epoch_callbacks;
  int64_t epoch = 0;
  int64_t batch = 0;  // batches of `epoch` done
  // Samples of this epoch's order that an earlier world trained (elastic resume); 0 otherwise.
  int64_t epoch_start = 0;
  // Batches left in this epoch's steps_per_epoch budget after an elastic reshard; 0: no cap.
  int64_t epoch_cap = 0;
  void refresh_batches();
  int64_t global_step = 0;
  int64_t batches_per_epoch = 0;
  std::string resumed_from;

  void check_options() const;
  void build_strategy();
  void build_loaders();
  void train_epoch(double& loss_sum, int64_t& samples);
  void check_finite(const torch::Tensor& loss) const;
  void end_step(const torch::Tensor& loss);
  void write_step_row(const StepInfo& info);
  EpochResult run_epoch();
  void write_epoch_row(const EpochResult& r, bool trained);
  StepInfo optimizer_step(const torch::Tensor& loss, bool log);
  struct Evaluation {
    double accuracy;
    double loss;  // mean cross entropy
  };
  Evaluation evaluate();
  void resume();
  std::optional<CheckpointState> load_latest();
  void agree_on_load(const std::string& path, const std::exception_ptr& error);
  void check_saved_config(const CheckpointState& s, const Json& meta) const;
  void restore_progress(const CheckpointState& s, const Json& meta);
  void restore(const CheckpointState& s);
  CheckpointState capture();
  void write_metrics(const Json& row);
  void write_tensorboard(const Json& row);
  void write_trace(const trace::Tracer& tracer);
  bool is_log_step() const { return o.log_every() > 0 && (global_step + 1) % o.log_every() == 0; }
};

}  // namespace paratrain
