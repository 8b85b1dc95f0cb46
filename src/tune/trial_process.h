#pragma once

// One trial's process: started in its own process group with its stdout on a pipe (the tuner
// reads the metric lines) and its stderr in the trial's log, killed with the tuner
// (PR_SET_PDEATHSIG), pinned to the cores the tuner gave it.

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

namespace paratrain {
namespace tune {
namespace detail {

struct ProcessSpec {
  std::string program;  ///< resolved path
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;  ///< set on top of the tuner's environment
  std::string log_path;
  std::vector<int> cores;  ///< CPU affinity; empty: inherit
  /// Where to make the FIFO a `paratrain train` trial waits on after each epoch's row;
  /// start_process names it in the trial's PARATRAIN_TRIAL_SYNC. Empty: none.
  std::string sync_path;
};

struct Process {
  pid_t pid = -1;
  int out_fd = -1;  ///< the read end of its stdout (non-blocking)
  int log_fd = -1;  ///< its log, open for appending
  /// The FIFO of ProcessSpec::sync_path, open for reading and writing (so that neither open nor
  /// write ever blocks or raises SIGPIPE); -1 when none.
  int sync_fd = -1;
  std::string sync_path;
};

/// Starts it; throws c10::Error when the log or the FIFO cannot be made or fork fails.
Process start_process(const ProcessSpec& spec);

/// Tells a trial waiting on its FIFO to go on; nothing when it has none.
void answer_row(const Process& p);

/// Closes its stdout, its log and its FIFO (removed), each once.
void close_process_fds(Process& p);

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
