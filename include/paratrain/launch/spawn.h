#pragma once

// paratrain::spawn: the torch.multiprocessing.spawn counterpart for C++ programs that start their
// own workers.
//
//   int main(int argc, char** argv) {
//     paratrain::dist::spawn(4, [](int local_rank) {
//       auto pg = paratrain::dist::init_process_group();   // the contract is already set
//       ...
//     });
//     // only the parent gets here, after every worker exited 0
//   }
//
// A process cannot safely fork a copy of itself once libtorch has started its threads, so spawn
// re-executes the program (/proc/self/exe with the same arguments) nprocs times through the
// launcher, with torchrun's environment contract on a free loopback port. In each child the same
// spawn call finds PARATRAIN_SPAWN_WORKER set, runs fn(local_rank) and ends the process: with exit
// code 0 when fn returns, 1 (after printing the error) when it throws. Call spawn early in main,
// before work that the children should not repeat.

#include <torch/arg.h>

#include "paratrain/launch/launch.h"

#include <functional>

namespace paratrain {
namespace dist {

struct SpawnOptions {
  /// Relay the children's output with "[rank R]: " prefixes.
  TORCH_ARG(bool, prefix_output) = true;
  /// Backend hint for the children ("" lets init_process_group decide).
  TORCH_ARG(std::string, backend) = "";
  /// Per-rank log files, as `paratrain launch --log-dir`.
  TORCH_ARG(std::string, log_dir) = "";
};

/// Runs fn(0) .. fn(nprocs-1) in nprocs processes and waits for them. In the parent, returns when
/// all exited 0 and throws c10::Error with the launcher's failure summary otherwise. In a child,
/// never returns.
void spawn(int nprocs, const std::function<void(int)>& fn, const SpawnOptions& options = {});

/// True in a process started by spawn().
bool is_spawned_worker();

}  // namespace dist
}  // namespace paratrain
