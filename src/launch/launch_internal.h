#pragma once

// Internal to libparatrain_launch: what its files share besides the local job (supervisor.h).
// launch.cpp checks the options and picks the kind of job; hosts.cpp, mpirun.cpp and elastic.cpp
// hold the rest.

#include "paratrain/launch/launch.h"

#include <string>

namespace paratrain {
namespace dist {
namespace launch_internal {

// hosts.cpp: an executable regular file.
bool runnable(const std::string& path);

// launch.cpp: the checks of launch()'s options (one line per mistake), the workers per node, and
// one worker's failure in a line.
void validate(const LaunchOptions& o);
int resolved_nproc(const LaunchOptions& o);
std::string describe_failure(const WorkerFailure& f);

// mpirun.cpp: runs a job of `nproc` ranks through mpirun.
LaunchResult launch_mpirun(const LaunchOptions& o, int nproc);

// elastic.cpp: a job with --rdzv-endpoint (torchrun's elastic agent), or a static job of several
// nodes with --max-restarts, whose nodes agree on each restart.
LaunchResult launch_elastic(const LaunchOptions& options);
bool agrees_on_restarts(const LaunchOptions& options);

}  // namespace launch_internal
}  // namespace dist
}  // namespace paratrain
