#pragma once

// Internal: the tuner's start, before the study opens: its options checked (the messages name
// the CLI's flags), the machine's cores and GPUs that trials are given, and the program that a
// command or train trial runs.

#include "paratrain/tune/tuner.h"

#include <string>
#include <vector>

namespace paratrain {
namespace tune {
namespace detail {

/// What the tuner has to give its trials.
struct TunerResources {
  std::vector<int> cores;  ///< CPU slots (-1: a slot of --cpus the machine lacks; not pinned)
  std::vector<int> gpus;   ///< the tuner's GPU indices
  std::string program;     ///< a command or train trial's program, resolved; empty for functions
};

/// Checks `o` (and that there is a trial: a command, a train job or `fn`), throwing c10::Error
/// for the first problem; finds the machine's cores and GPUs and the trial's program. For
/// function trials, caps this process's intra-op and OpenBLAS threads at the trial's threads.
TunerResources check_tuner_options(const TunerOptions& o, const TrialFunction& fn);

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
