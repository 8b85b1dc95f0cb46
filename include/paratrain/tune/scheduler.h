#pragma once

// Trial schedulers: after each result they say whether a trial goes on, stops early or pauses.
// Time is the trial's training_iteration (its epoch for a paratrain train trial); results are
// losses (lower is better).
//
//   fifo       every trial runs to max_t (0: until it ends by itself)
//   asha       Ray Tune's AsyncHyperBandScheduler: rungs at grace_period * rf^k below max_t; a
//              trial reaching a rung stops if its result is worse than the rung's top 1/rf so far
//              (defaults grace_period 1, reduction_factor 4, max_t 100); with the bohb
//              searcher, each rung's results are a budget of BOHB's model, and no trial waits
//   hyperband  synchronous Hyperband (Li et al. 2018) with HpBandSter's brackets: a bracket's
//              trials pause at each rung until the whole rung has reported, then the best
//              1/eta go on from their checkpoints and the others stop (defaults
//              reduction_factor 3, max_t 81)
//   median     Ray Tune's MedianStoppingRule: after grace_period, stop a trial whose best result
//              is worse than the median of the other trials' running means at the same time,
//              once min_samples_required trials got there
//   pbt        Ray Tune's PopulationBasedTraining (asynchronous): every perturbation_interval
//              iterations, a trial in the bottom quantile_fraction of the population (by last
//              result) pauses, takes the checkpoint and config of a trial of the top quantile
//              (exploit) and perturbs the config (explore): each mutation is resampled with
//              resample_probability, else multiplied by 1.2 or 0.8 (an integer is truncated), or
//              a choice moves to a neighbouring value. When the trials outnumber the slots, a
//              trial at a perturbation point also pauses while others wait for a slot (Ray's
//              time sharing): the one furthest behind resumes first.

#include "paratrain/tune/space.h"

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace paratrain {
namespace tune {

enum class Decision {
  kContinue,
  kStop,      ///< end it early (pruned)
  kPause,     ///< stop its process; it may be promoted later (resumed from its checkpoint, or from
              ///< another trial's: take_exploit)
  kComplete,  ///< it reached max_t: end it as complete
};

/// A trial's exploit step (pbt): continue from `source`'s checkpoint, made at its iteration
/// `source_iteration`, with `config` (the source's, perturbed).
struct Exploit {
  int64_t source = -1;
  int64_t source_iteration = 0;
  Config config;
};

class Scheduler {
 public:
  virtual ~Scheduler() = default;
  virtual void on_trial_add(int64_t number);
  virtual Decision on_result(int64_t number, int64_t iteration, double loss) = 0;
  /// A result of a trial another tuner runs, or one stored before this tuner started: its owner
  /// acted on it. The default judges it as on_result (rungs and brackets are rebuilt from
  /// these); pbt only records it.
  virtual void observe(int64_t number, int64_t iteration, double loss);
  /// A trial stored as PAUSED that this scheduler did not pause (a study continued).
  virtual void on_paused(int64_t number);
  /// The trial's process or thread started (or started again).
  virtual void on_start(int64_t number);
  /// The trial ended (completed, stopped, failed or exited by itself) with this last loss.
  virtual void on_trial_end(int64_t number, double loss);
  /// No new trials will be added: brackets still filling close with the trials they have.
  virtual void on_no_more_trials();
  /// Paused trials to resume now.
  virtual std::vector<int64_t> take_promoted();
  /// Paused trials that will never resume: end them as stopped.
  virtual std::vector<int64_t> take_dropped();
  /// The budget of the rung at which the last on_result recorded its trial (ASHA's milestone, a
  /// Hyperband rung), or 0 when it recorded none. BOHB's model learns from these results.
  virtual int64_t last_rung() const;
  /// The trial's config, when it is chosen or changed (pbt perturbs it).
  virtual void on_config(int64_t number, const Config& config);
  /// The exploit the scheduler chose when it paused trial `number` (once; nullopt for none).
  virtual std::optional<Exploit> take_exploit(int64_t number);
};

struct SchedulerOptions {
  /// "fifo", "asha", "hyperband", "median" or "pbt".
  TORCH_ARG(std::string, kind) = "fifo";
  /// The most iterations a trial runs; 0: asha 100, hyperband 81 (Ray Tune's), fifo and median
  /// unlimited.
  TORCH_ARG(int64_t, max_t) = 0;
  /// asha, hyperband, median: iterations a trial runs before it can be stopped.
  TORCH_ARG(int64_t, grace_period) = 1;
  /// 0: asha 4, hyperband 3.
  TORCH_ARG(double, reduction_factor) = 0;
  /// median: trials that must have reached an iteration before one is stopped there.
  TORCH_ARG(int64_t, min_samples_required) = 3;
  /// pbt (Ray's names and defaults; the interval is in iterations).
  TORCH_ARG(int64_t, perturbation_interval) = 60;
  /// pbt: the bottom and top fraction of trials that exploit and are copied (at most 0.5).
  TORCH_ARG(double, quantile_fraction) = 0.25;
  /// pbt: the chance that explore draws a mutation anew instead of perturbing it.
  TORCH_ARG(double, resample_probability) = 0.25;
  /// pbt: what explore changes, "lr=loguniform(1e-4, 1e-1)" or "batch-size=choice(32, 64)" (Ray's
  /// hyperparam_mutations); each name must be a parameter of the search space.
  TORCH_ARG(std::vector<std::string>, mutations) = {};
  /// pbt: the number of trials. Set by the tuner (its num_samples).
  TORCH_ARG(int64_t, population) = 0;
  /// pbt: how many trials run at once (0: all; trials share slots only when they outnumber them).
  /// Set by the tuner (what the resources allow).
  TORCH_ARG(int64_t, slots) = 0;
  /// pbt: the seed of its choices. Set by the tuner (the searcher's seed).
  TORCH_ARG(uint64_t, seed) = 0;
};

/// Throws c10::Error for an unknown kind or bad numbers (grace_period < 1, reduction_factor <= 1,
/// max_t < grace_period; pbt: perturbation_interval < 1, quantile_fraction outside [0, 0.5],
/// resample_probability outside [0, 1], no mutations or one that does not parse).
std::unique_ptr<Scheduler> make_scheduler(const SchedulerOptions& options);

/// The max_t a scheduler uses once its defaults are applied (0: none).
int64_t effective_max_t(const SchedulerOptions& options);

}  // namespace tune
}  // namespace paratrain
