#pragma once

// Internal: what a command or train trial runs: its argv (a train trial's flags, or the command
// with {name} replaced by the sampled values) and its environment (the sampled values, the
// PARATRAIN_TRIAL_* variables, OMP_NUM_THREADS, its GPUs), from the tuner's options and its
// config.

#include "trial_process.h"

#include "paratrain/tune/storage.h"
#include "paratrain/tune/tuner.h"

#include <string>
#include <vector>

namespace paratrain {
namespace tune {
namespace detail {

/// Trial `t` (its log at t.log_path, in its directory) run by `program` (the command's, resolved;
/// or the paratrain CLI for a train trial), on `cores` (-1: a slot not pinned) with `gpus`;
/// `gpus_visible`: whether to set its CUDA_VISIBLE_DEVICES (the machine has GPUs); `resume`:
/// whether it continues from its checkpoint.
ProcessSpec trial_process_spec(const TunerOptions& o,
                               const std::string& program,
                               const TrialRecord& t,
                               const std::vector<int>& cores,
                               const std::vector<int>& gpus,
                               bool gpus_visible,
                               bool resume);

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
