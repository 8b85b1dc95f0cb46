#pragma once

// Trial schedulers: after each result they say whether a trial goes on, stops early or pauses.
// Time is the trial's training_iteration (its epoch for a paratrain train trial); results are
// losses (lower is better).
//
//   fifo       every trial runs to max_t (0: until it ends by itself)
//   asha       Ray Tune's AsyncHyperBandScheduler: rungs at grace_period * rf^k below max_t; a
//              trial reaching a rung stops if its result is worse than the rung's top 1/rf so far
//              (defaults grace_period 1, reduction_factor 4, max_t 100)
//   hyperband  synchronous Hyperband (Li et al. 2018) with HpBandSter's brackets: a bracket's
//              trials pause at each rung until the whole rung has reported, then the best
//              1/eta go on from their checkpoints and the others stop (defaults
//              reduction_factor 3, max_t 81)
//   median     Ray Tune's MedianStoppingRule: after grace_period, stop a trial whose best result
//              is worse than the median of the other trials' running means at the same time,
//              once min_samples_required trials got there

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace tune {

enum class Decision {
  kContinue,
  kStop,      ///< end it early (pruned)
  kPause,     ///< stop its process; it may be promoted later (resumed from its checkpoint)
  kComplete,  ///< it reached max_t: end it as complete
};

class Scheduler {
 public:
  virtual ~Scheduler() = default;
  virtual void on_trial_add(int64_t number);
  virtual Decision on_result(int64_t number, int64_t iteration, double loss) = 0;
  /// The trial ended (completed, stopped, failed or exited by itself) with this last loss.
  virtual void on_trial_end(int64_t number, double loss);
  /// No new trials will be added: brackets still filling close with the trials they have.
  virtual void on_no_more_trials();
  /// Paused trials to resume now.
  virtual std::vector<int64_t> take_promoted();
  /// Paused trials that will never resume: end them as stopped.
  virtual std::vector<int64_t> take_dropped();
};

struct SchedulerOptions {
  /// "fifo", "asha", "hyperband" or "median".
  TORCH_ARG(std::string, kind) = "fifo";
  /// The most iterations a trial runs; 0: asha 100, hyperband 81 (Ray Tune's), fifo and median
  /// unlimited.
  TORCH_ARG(int64_t, max_t) = 0;
  TORCH_ARG(int64_t, grace_period) = 1;
  /// 0: asha 4, hyperband 3.
  TORCH_ARG(double, reduction_factor) = 0;
  TORCH_ARG(int64_t, min_samples_required) = 3;
};

/// Throws c10::Error for an unknown kind or bad numbers (grace_period < 1, reduction_factor <= 1,
/// max_t < grace_period).
std::unique_ptr<Scheduler> make_scheduler(const SchedulerOptions& options);

/// The max_t a scheduler uses once its defaults are applied (0: none).
int64_t effective_max_t(const SchedulerOptions& options);

}  // namespace tune
}  // namespace paratrain
