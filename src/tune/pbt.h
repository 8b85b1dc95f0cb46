#pragma once

// The pbt scheduler (scheduler.h), made by make_scheduler.

#include "paratrain/tune/scheduler.h"

#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace tune {

/// Throws c10::Error for bad pbt options (make_scheduler's list).
std::unique_ptr<Scheduler> make_pbt(const SchedulerOptions& options);

/// Throws c10::Error naming a mutation whose parameter is not in the space.
void check_mutations(const SchedulerOptions& options, const SearchSpace& space);

/// Whether the directory holds a file (at any depth).
bool has_files(const std::string& dir);

/// Copies the directory `from` to `staged`, replacing what `staged` held. Throws c10::Error
/// naming what failed.
void stage_copy(const std::string& from, const std::string& staged);

/// Puts back `to` when an interrupted swap_in left it aside.
void restore_aside(const std::string& to);

/// Puts the directory `staged` in the place of `to` by renames, so that a reader finds the old
/// directory or the new one (a `to` that an interrupted swap left aside is put back first).
void swap_in(const std::string& staged, const std::string& to);

/// The parameter names of options.mutations(), in their order.
std::vector<std::string> mutation_names(const SchedulerOptions& options);

}  // namespace tune
}  // namespace paratrain
