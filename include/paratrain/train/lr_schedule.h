// Learning-rate schedules with PyTorch's semantics (torch.optim.lr_scheduler), which libtorch
// lacks except for StepLR:
//
//   auto options = paratrain::LRScheduleOptions().kind("cosine").t_max(90).warmup(5);
//   paratrain::LRSchedule schedule(optimizer, options);   // sets the lr of step 0
//   for (int epoch = 0; epoch < 95; ++epoch) {
//     train_one_epoch();
//     schedule.step();                                    // as scheduler.step()
//   }
//
// kind: "constant", "step" (StepLR: gamma every step_size), "multistep" (MultiStepLR: gamma at
// each milestone), "cosine" (CosineAnnealingLR down to eta_min over t_max). warmup > 0 puts
// LinearLR(start_factor, total_iters = warmup) before it, as SequentialLR([warm-up, main],
// milestones = [warmup]): the main schedule starts counting when the warm-up ends. The values are
// PyTorch's closed forms; tests/train/trainer_test.cpp (LRSchedule.*) checks them against
// python3-torch.
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace paratrain {

struct LRScheduleOptions {
  /// "constant", "step", "multistep" or "cosine" (StepLR, MultiStepLR, CosineAnnealingLR).
  TORCH_ARG(std::string, kind) = "constant";
  /// "step": the lr is multiplied by gamma every step_size scheduler steps.
  TORCH_ARG(int64_t, step_size) = 30;
  /// "step" and "multistep": the factor the lr is multiplied by.
  TORCH_ARG(double, gamma) = 0.1;
  /// "multistep": sorted scheduler steps at which the lr is multiplied by gamma.
  TORCH_ARG(std::vector<int64_t>, milestones) = {};
  /// "cosine": the half period, in scheduler steps (after the warm-up).
  TORCH_ARG(int64_t, t_max) = 1;
  /// "cosine": the lowest lr.
  TORCH_ARG(double, eta_min) = 0.0;
  /// Linear warm-up from start_factor * lr to lr over this many scheduler steps (0: none).
  TORCH_ARG(int64_t, warmup) = 0;
  TORCH_ARG(double, warmup_start_factor) = 1.0 / 3.0;  // LinearLR's default
};

/// Throws c10::Error with one line for an unknown kind or values PyTorch refuses.
void check_lr_schedule(const LRScheduleOptions& options);

/// The lr after `t` scheduler steps for a base lr.
double lr_at(const LRScheduleOptions& options, double base_lr, int64_t t);

class LRSchedule {
 public:
  /// Takes each param group's current lr as its base (PyTorch's initial_lr) and sets step 0's.
  LRSchedule(torch::optim::Optimizer& optimizer, LRScheduleOptions options);
  /// One scheduler step.
  void step();
  /// Jumps to `t` steps (a resumed run).
  void set_steps(int64_t t);
  int64_t steps() const { return t_; }
  /// The first param group's current lr.
  double lr() const;
  const LRScheduleOptions& options() const { return options_; }

 private:
  void apply();
  torch::optim::Optimizer& optimizer_;
  LRScheduleOptions options_;
  std::vector<double> base_;
  int64_t t_ = 0;
};

}  // namespace paratrain
