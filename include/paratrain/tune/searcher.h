#pragma once

// Searchers propose the configs of a study's trials. All are seeded: the same seed, space and
// results give the same configs. Each sees the results as losses (lower is better; the tuner
// negates a metric with mode "max").
//
//   grid, random  Ray Tune's BasicVariantGenerator (the two names are one searcher): every
//           grid_search combination, num_samples times over, with the other parameters sampled
//           independently for each trial; the last grid parameter changes fastest. Without
//           grid_search it is random search over num_samples trials.
//   tpe     the Tree-structured Parzen Estimator with Optuna's TPESampler defaults
//           (n_startup_trials 10, n_ei_candidates 24, gamma(n) = min(ceil(0.1 n), 25), Optuna's
//           default weights, prior_weight 1, magic clip, univariate)
//   bohb    BOHB's model (Falkner et al. 2018) with HpBandSter's defaults (top_n_percent 15,
//           num_samples 64, random_fraction 1/3, bandwidth_factor 3, min_bandwidth 1e-3): a
//           good/bad KDE pair on the largest budget with enough results. The budgets are the
//           scheduler's rungs: asha's milestones (asynchronous: no trial waits at a rung) or
//           hyperband's (synchronous, as HpBandSter).

#include "paratrain/tune/space.h"

#include <torch/arg.h>

#include <memory>
#include <optional>

namespace paratrain {
namespace tune {

/// How a trial ended, as a searcher sees it.
enum class Outcome {
  kComplete,  ///< it ran to the end (or to max_t); `loss` is its final value
  kPruned,    ///< a scheduler stopped it early; `loss` is its last value
  kFailed,    ///< it crashed or never reported
};

class Searcher {
 public:
  virtual ~Searcher() = default;
  /// The config of trial `number` (0, 1, ...), or nullopt when the searcher has nothing more to
  /// propose (a grid that is done).
  virtual std::optional<Config> suggest(int64_t number) = 0;
  /// A result of trial `number` (whose config was `config`) at `budget` (its iteration).
  virtual void on_result(int64_t number, const Config& config, int64_t budget, double loss);
  /// Trial `number` reached a budget of the scheduler's (an ASHA or Hyperband rung, or max_t)
  /// with this loss. BOHB models these only, as HpBandSter records one result per job and budget.
  virtual void on_rung(int64_t number, const Config& config, int64_t budget, double loss);
  /// Trial `number` ended.
  virtual void on_complete(int64_t number, const Config& config, Outcome outcome, double loss);
};

struct SearcherOptions {
  /// "grid", "random", "tpe" or "bohb".
  TORCH_ARG(std::string, kind) = "random";
  /// The seed of the searcher's draws.
  TORCH_ARG(uint64_t, seed) = 0;
  /// grid: how many times the grid is repeated.
  TORCH_ARG(int64_t, num_samples) = 1;
  /// tpe: random trials before the model is used (Optuna's n_startup_trials).
  TORCH_ARG(int64_t, n_startup_trials) = 10;
  /// tpe: candidates drawn to pick the one with the best expected improvement (Optuna's).
  TORCH_ARG(int64_t, n_ei_candidates) = 24;
  /// bohb (HpBandSter's names).
  TORCH_ARG(double, top_n_percent) = 15;
  /// bohb: configurations drawn from the model to pick the best one.
  TORCH_ARG(int64_t, num_samples_kde) = 64;
  /// bohb: the fraction of configurations drawn at random.
  TORCH_ARG(double, random_fraction) = 1.0 / 3.0;
  /// bohb: widens the model's kernels when drawing.
  TORCH_ARG(double, bandwidth_factor) = 3;
  /// bohb: the smallest kernel bandwidth.
  TORCH_ARG(double, min_bandwidth) = 1e-3;
};

/// Throws c10::Error for an unknown kind, and for grid_search parameters with tpe or bohb (a
/// model-based searcher has no grid to walk).
std::unique_ptr<Searcher> make_searcher(const SearchSpace& space, const SearcherOptions& options);

}  // namespace tune
}  // namespace paratrain
