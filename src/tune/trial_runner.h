#pragma once

// Internal: the machinery that runs one trial for the tuner's state machine (tuner.cpp): a
// process (its stdout read for metric lines) or a C++ function on its own thread; stopping it
// (SIGTERM, then SIGKILL after the grace) and reaping it. Also the wake-up pipe that ends the
// tuner's poll() for function trials' reports and for SIGINT and SIGTERM.

#include "trial_process.h"

#include "paratrain/tune/space.h"
#include "paratrain/tune/tuner.h"

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace tune {
namespace detail {

/// The tuner's wake-up pipe: poll() waits on it beside the trials' output; signal handlers and
/// function-trial threads write a byte to it to end poll(). One tuner at a time uses it.
class WakePipe {
 public:
  /// Opens it, clears the last signal and catches SIGINT and SIGTERM; throws when pipe() fails.
  void open();
  /// Puts the signal handlers back; the pipe is closed unless `leave_open` (a detached trial
  /// thread may still write to it).
  void close(bool leave_open);
  int read_fd() const { return fds_[0]; }
  /// The signal caught since open(); 0 when none.
  static int signal();

 private:
  int fds_[2] = {-1, -1};
  struct sigaction old_int_ = {};
  struct sigaction old_term_ = {};
};

class FunctionContext;

/// One trial while it executes: a process in its own group, or a function on its own thread.
class TrialRun {
 public:
  using LineHandler = std::function<void(const std::string&)>;

  /// Starts the process of `spec`, its log first given a header line for this start of trial
  /// `number` (`attempts`: its failures so far).
  void start_process(const ProcessSpec& spec, int64_t number, int attempts, bool resume);
  /// Starts `fn` on its own thread, with a context for trial `number` in `dir`.
  void start_function(const TrialFunction& fn,
                      int64_t number,
                      const Config& config,
                      const std::string& dir,
                      bool resume);

  /// Its stdout, for poll(); -1 when none (a function, or a process whose output ended).
  int out_fd() const { return proc_.out_fd; }
  /// Reads what the process printed (one read, or everything when `all`), logs each line and
  /// hands it to `on_line`.
  void read(bool all, const LineHandler& on_line);
  /// A function trial: hands its reported rows to `on_line`, then answers them (stop or go on).
  void take_reports(const LineHandler& on_line);

  /// Stops it after `term_delay`: SIGTERM to the process's group (now when the delay is 0), then
  /// SIGKILL after `grace` more; a function is told to stop at once.
  void stop(std::chrono::milliseconds term_delay, std::chrono::milliseconds grace);
  /// Whether stop() was called.
  bool stopping() const { return stopping_; }
  /// A `paratrain train` trial printed an epoch's row and waits: lets it go on, unless stop() was
  /// called (it is stopped where it stands, not an epoch later).
  void answer_epoch();
  /// Sends `sig` to the process's group at once; a function is told to stop.
  void signal_now(int sig);

  /// Whether it has ended (reaped: the process's last output handed to `on_line` and its pipes
  /// closed; a function's thread joined), with its wait status and, for a function, its error.
  /// While it runs, sends the SIGTERM and SIGKILL that stop() scheduled when they are due.
  bool reap(const LineHandler& on_line, int* status, std::string* error);
  /// The tuner is going: waits until `deadline` for it to end (SIGKILL then), closes its pipes.
  /// Returns true when it left a function's thread detached (it never reports again).
  bool end_by(std::chrono::steady_clock::time_point deadline);

 private:
  /// Closes the process's stdout, log and FIFO (each once), whatever happened to the process.
  void close_fds();

  Process proc_;
  std::string partial_;  // stdout bytes after the last newline
  std::shared_ptr<FunctionContext> fn_;
  std::thread thread_;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point term_at_, kill_at_;
  bool term_sent_ = false, killed_ = false;
};

/// Waits up to 200 ms for output from `runs` or a wake-up, and empties the wake-up pipe. Returns
/// the indices in `runs` of those that have output to read.
std::vector<size_t> wait_for_output(const WakePipe& wake, const std::vector<TrialRun*>& runs);

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
