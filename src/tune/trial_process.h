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
};

struct Process {
  pid_t pid = -1;
  int out_fd = -1;  ///< the read end of its stdout (non-blocking)
  int log_fd = -1;  ///< its log, open for appending
};

/// Starts it; throws c10::Error when the log cannot be opened or fork fails.
Process start_process(const ProcessSpec& spec);

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
