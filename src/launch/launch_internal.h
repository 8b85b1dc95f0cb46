#pragma once

// Internal to launch/: what its files share besides the local job (supervisor.h). spawn.cpp, built
// into libparatrain, uses runs_on_mpi too (the symbol is visible across the two libraries).
// launch.cpp checks the options and picks the kind of job; hosts.cpp, mpirun.cpp and elastic.cpp
// hold the rest.

#include "paratrain/launch/launch.h"

#include <cstdint>
#include <string>

namespace paratrain {
namespace dist {
namespace launch_internal {

/// Whether a backend string starts its job through mpirun: "mpi", or routes with an mpi engine
/// ("cpu:mpi,cuda:nccl").
bool runs_on_mpi(const std::string& backend);

// hosts.cpp: an executable regular file.
bool runnable(const std::string& path);

// launch.cpp: the checks of launch()'s options (one line per mistake; check_limits last), the
// workers per node, and one worker's failure in a line.
void validate(const LaunchOptions& o);
int resolved_nproc(const LaunchOptions& o);
std::string describe_failure(const WorkerFailure& f);

// limits.cpp: the processes and descriptors a job of these options needs, against this process's
// open-files limit and the processes this user, this cgroup and the system may run; one line
// naming --nproc-per-node and the limit when one is too low.
void check_limits(const LaunchOptions& o);

// limits.cpp: while it lives, this process's soft limit of open files is raised to the hard one
// when a job of `nproc` workers needs more (validate refused a job beyond the hard one); the
// workers get the limit from before (for_children, -1 when it was not raised).
class OpenFilesLimit {
 public:
  OpenFilesLimit(const LaunchOptions& o, int nproc);
  ~OpenFilesLimit();
  OpenFilesLimit(const OpenFilesLimit&) = delete;
  OpenFilesLimit& operator=(const OpenFilesLimit&) = delete;
  int64_t for_children() const { return before_; }

 private:
  int64_t before_ = -1;
};

// mpirun.cpp: runs a job of `nproc` ranks through mpirun.
LaunchResult launch_mpirun(const LaunchOptions& o, int nproc);

// elastic.cpp: a job with --rdzv-endpoint (torchrun's elastic agent), or a static job of several
// nodes with --max-restarts, whose nodes agree on each restart.
LaunchResult launch_elastic(const LaunchOptions& options);
bool agrees_on_restarts(const LaunchOptions& options);

}  // namespace launch_internal
}  // namespace dist
}  // namespace paratrain
