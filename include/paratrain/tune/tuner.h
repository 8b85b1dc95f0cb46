#pragma once

// paratrain::tune::tune: hyperparameter search, the counterpart of Ray Tune's Tuner.fit.
//
// A trial is one of
//   - a command that prints its metrics as JSON lines on stdout ({"training_iteration": 3,
//     "accuracy": 0.86}); it gets each sampled value as an environment variable of the same name
//     and wherever {name} appears in its arguments, and PARATRAIN_TRIAL_DIR,
//     PARATRAIN_CHECKPOINT_DIR and PARATRAIN_TRIAL_RESUME (1 when it should continue from its
//     checkpoint: a promoted, paused or retried trial);
//   - a `paratrain train` job (TunerOptions::train), the sampled values as its flags, checkpoints
//     every epoch and `--resume auto`, so a promoted trial continues where it paused; after each
//     epoch's row it waits for the scheduler's decision (on the FIFO in PARATRAIN_TRIAL_SYNC), as
//     Ray Tune's report() does, so a paused trial has not trained past the row it was judged on;
//   - a C++ function that calls TrialContext::report.
// The iteration of a row is its "training_iteration", else its "epoch", else the row's count.
//
//   SearchSpace space;
//   space.add("lr=loguniform(1e-4, 1e-1)");
//   auto result = tune(space, TunerOptions().storage("study.db").study("s").metric("loss"),
//                      [](TrialContext& t) {
//                        for (int it = 1; it <= 10; ++it) t.report({{"loss", ...}});
//                      });

#include "paratrain/tune/scheduler.h"
#include "paratrain/tune/searcher.h"
#include "paratrain/tune/space.h"
#include "paratrain/tune/storage.h"

#include <torch/arg.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace paratrain {
namespace tune {

/// What one trial takes; the tuner never runs more at once than the machine has.
struct Resources {
  /// Processes (a `paratrain train --nproc R` trial has R).
  TORCH_ARG(int, ranks) = 1;
  /// Threads per rank (OMP_NUM_THREADS); the trial takes ranks * threads cores. Function trials
  /// share the tuner's process: it sets at::set_num_threads and OpenBLAS's pool to this.
  TORCH_ARG(int, threads) = 1;
  /// GPUs, given to the trial as its own CUDA_VISIBLE_DEVICES.
  TORCH_ARG(int, gpus) = 0;
};

/// Thrown out of TrialContext::report when the scheduler stopped or paused the trial; a function
/// trial lets it pass (or returns).
struct TrialStopped : std::runtime_error {
  TrialStopped() : std::runtime_error("the scheduler stopped this trial") {}
};

class TrialContext {
 public:
  virtual ~TrialContext() = default;
  virtual int64_t number() const = 0;
  virtual const Config& config() const = 0;
  /// The trial's own directory (checkpoints go in checkpoint_dir()).
  virtual const std::string& dir() const = 0;
  virtual std::string checkpoint_dir() const = 0;
  /// Whether to continue from checkpoint_dir(): a promoted, paused or retried trial.
  virtual bool resumed() const = 0;
  /// One row of metrics (add "training_iteration" to number it yourself). Throws TrialStopped
  /// when the trial should end.
  virtual void report(const std::map<std::string, double>& metrics) = 0;
};

using TrialFunction = std::function<void(TrialContext&)>;

struct TunerOptions {
  /// sqlite:///FILE, a path, or postgresql://... (storage.h). Several tuners may share a study:
  /// each claims trials in transactions, and none runs twice.
  TORCH_ARG(std::string, storage) = "";
  /// The study's name in the storage.
  TORCH_ARG(std::string, study) = "";
  /// The reported metric the search optimizes.
  TORCH_ARG(std::string, metric) = "";
  /// "min" or "max".
  TORCH_ARG(std::string, mode) = "min";
  /// How a trial's metric is judged at the end: "last" (its last report) or "best" (its best).
  TORCH_ARG(std::string, scope) = "last";
  /// How configurations are chosen.
  TORCH_ARG(SearcherOptions, searcher) = {};
  /// When trials are stopped, paused or perturbed.
  TORCH_ARG(SchedulerOptions, scheduler) = {};
  /// Trials (grid: passes over the grid).
  TORCH_ARG(int64_t, num_samples) = 1;
  /// At most this many trials at once; 0: as many as the resources allow.
  TORCH_ARG(int, max_concurrent) = 0;
  /// Times a failed trial is started again (from its checkpoint) before it counts as failed.
  TORCH_ARG(int, max_failures) = 3;
  /// What each trial takes.
  TORCH_ARG(Resources, resources) = {};
  /// The machine: cores (0: those this process may run on) and GPUs (-1: torch's count).
  TORCH_ARG(int, cpus) = 0;
  /// The machine's GPUs; -1: torch's count.
  TORCH_ARG(int, gpus) = -1;
  /// Where trials keep their logs and checkpoints: <trial_dir>/trial_<number>/.
  TORCH_ARG(std::string, trial_dir) = "";
  /// A command trial: program and arguments.
  TORCH_ARG(std::vector<std::string>, command) = {};
  /// Each trial runs `paratrain train` (paratrain_cli) with train_args and the sampled values.
  TORCH_ARG(bool, train) = false;
  /// A `paratrain train` trial: its fixed flags.
  TORCH_ARG(std::vector<std::string>, train_args) = {};
  /// A `paratrain train` trial: the path of the paratrain program that runs it (required).
  TORCH_ARG(std::string, paratrain_cli) = "";
  /// A running trial whose tuner sent no heartbeat for this long (or, on the same host, whose
  /// tuner process is gone) is released and retried by another tuner on the study.
  TORCH_ARG(std::chrono::seconds, heartbeat_timeout) = std::chrono::seconds(60);
  /// SIGTERM, then SIGKILL after this long, for a trial that is stopped or paused.
  TORCH_ARG(std::chrono::milliseconds, kill_grace) = std::chrono::milliseconds(5000);
  /// Progress: "plain" lines, "json" rows, "table" (a live table), or "none".
  TORCH_ARG(std::string, output) = "plain";
};

struct TrialSummary {
  int64_t number = 0;
  TrialState state = TrialState::kPending;
  Config config;
  int64_t iterations = 0;  ///< the last reported iteration
  double value = 0;        ///< its metric by scope (NaN when it never reported)
  std::string log_path;
  int exit_status = 0;
  std::string error;
};

struct TuneResult {
  std::vector<TrialSummary> trials;
  /// The best trial that reported the metric, by mode and scope.
  std::optional<TrialSummary> best;
  /// Trials that ran in this call (not those a previous tuner finished).
  int64_t started = 0;
  /// The tuner was stopped by SIGINT or SIGTERM; its running trials went back to PENDING (no
  /// failure counted) for the next tuner on the same study to resume.
  int interrupted_by = 0;
};

/// Runs the study to the end (num_samples trials, or a grid's end), resuming what storage holds.
/// `fn` is the trial when no command and no train trial is set. Throws c10::Error for bad options
/// (a trial that needs more than the machine, a command not found, a study that exists with a
/// different space) and when a trial's first report lacks the metric.
TuneResult tune(const SearchSpace& space, const TunerOptions& options, TrialFunction fn = {});

}  // namespace tune
}  // namespace paratrain
