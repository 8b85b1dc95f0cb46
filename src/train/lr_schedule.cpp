#include "paratrain/train/lr_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace paratrain {

void check_lr_schedule(const LRScheduleOptions& o) {
  const std::string& k = o.kind();
  TORCH_CHECK(k == "constant" || k == "step" || k == "multistep" || k == "cosine",
              "unknown lr schedule '", k, "': choose constant, step, multistep or cosine");
  TORCH_CHECK(k != "step" || o.step_size() >= 1, "the step schedule needs step_size >= 1, got ",
              o.step_size());
  TORCH_CHECK(k != "cosine" || o.t_max() >= 1, "the cosine schedule needs t_max >= 1, got ",
              o.t_max());
  TORCH_CHECK(std::is_sorted(o.milestones().begin(), o.milestones().end()),
              "multistep milestones must be increasing, got ", o.milestones());
  TORCH_CHECK(o.warmup() >= 0, "warmup must be >= 0, got ", o.warmup());
  // LinearLR's own check.
  TORCH_CHECK(o.warmup() == 0 || (o.warmup_start_factor() > 0 && o.warmup_start_factor() <= 1),
              "warmup_start_factor must be in (0, 1], got ", o.warmup_start_factor());
}

namespace {

double main_lr(const LRScheduleOptions& o, double base, int64_t t) {
  if (o.kind() == "step") {
    return base * std::pow(o.gamma(), static_cast<double>(t / o.step_size()));
  }
  if (o.kind() == "multistep") {
    // bisect_right: a milestone m counts from step m on.
    const auto passed =
        std::upper_bound(o.milestones().begin(), o.milestones().end(), t) - o.milestones().begin();
    return base * std::pow(o.gamma(), static_cast<double>(passed));
  }
  if (o.kind() == "cosine") {
    const double pi = std::acos(-1.0);
    return o.eta_min() +
           (base - o.eta_min()) *
               (1 + std::cos(pi * static_cast<double>(t) / static_cast<double>(o.t_max()))) / 2;
  }
  return base;
}

}  // namespace

double lr_at(const LRScheduleOptions& o, double base, int64_t t) {
  if (t < o.warmup()) {
    const double s = o.warmup_start_factor();
    return base * (s + (1 - s) * static_cast<double>(t) / static_cast<double>(o.warmup()));
  }
  return main_lr(o, base, t - o.warmup());
}

LRSchedule::LRSchedule(torch::optim::Optimizer& optimizer, LRScheduleOptions options)
    : optimizer_(optimizer), options_(std::move(options)) {
  check_lr_schedule(options_);
  for (auto& group : optimizer_.param_groups()) {
    base_.push_back(group.options().get_lr());
  }
  apply();
}

void LRSchedule::step() {
  ++t_;
  apply();
}

void LRSchedule::set_steps(int64_t t) {
  TORCH_CHECK(t >= 0, "LRSchedule: steps must be >= 0, got ", t);
  t_ = t;
  apply();
}

double LRSchedule::lr() const {
  return optimizer_.param_groups().at(0).options().get_lr();
}

void LRSchedule::apply() {
  auto& groups = optimizer_.param_groups();
  for (size_t i = 0; i < groups.size() && i < base_.size(); ++i) {
    groups[i].options().set_lr(lr_at(options_, base_[i], t_));
  }
}

}  // namespace paratrain
