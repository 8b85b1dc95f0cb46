#pragma once

// Internal to libparatrain_launch: the local job (supervisor.cpp). run_job starts this node's
// workers (or, for --backend mpi, mpirun through launch_mpirun) and supervises them until every
// one has exited.

#include "paratrain/launch/launch.h"

#include <functional>
#include <string>

namespace paratrain {
namespace dist {
namespace launch_internal {

// Where this launcher's workers sit in the job. A plain launch computes it from the options; the
// mpirun shim (and launch_mpirun's outer launch of mpirun itself) is handed it.
struct Placement {
  bool from_mpirun = false;  // one worker, with the rank and size mpirun decided
  int first_rank = 0;
  int world_size = 1;
  int attempt = 0;  // TORCHELASTIC_RESTART_COUNT: the folder of this attempt's logs
};

// With --log-dir D: a folder of its own for this launch's logs, D/<rdzv_id>_<random>, as torchrun
// makes (so a second run never writes over the first's logs); each attempt writes into it
// attempt_<k>/<local rank>/{stdout,stderr}.log. "" without --log-dir.
std::string make_log_run_dir(const LaunchOptions& o);

// Checks the options, then starts the workers (or mpirun) and supervises them.
LaunchResult run_job(const LaunchOptions& o,
                     const Placement& where,
                     std::function<bool(std::string*)> must_stop = nullptr);

}  // namespace launch_internal
}  // namespace dist
}  // namespace paratrain
