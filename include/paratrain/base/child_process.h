#pragma once

// Starting programs as child processes: the one place that forks and execs, for the launcher's
// workers, the tuner's trials, the benchmarks' jobs and the tests' processes.
//
//   paratrain::ChildProcess child(paratrain::ChildOptions({"/usr/bin/env"}).capture_output(true));
//   std::string text = child.read_all();  // stdout and stderr, until the child closes them
//   int code = paratrain::exit_code(child.wait());
//
// What every child gets, and why:
// - its own process group (own_process_group), so that signal() reaches whatever the program
//   starts in turn, and a terminal's Ctrl-C goes to the parent alone, which decides;
// - PR_SET_PDEATHSIG (die_with_parent): killed if the parent dies first, so no orphan keeps
//   running a job (or holding a port) that nobody watches. Linux sends it when the *thread* that
//   forked exits, so a caller that forks from a short-lived thread turns it off;
// - signals blocked in the parent from fork until the child has reset them: a SIGINT or SIGCHLD
//   in between would otherwise run the parent's handler in the child. The child starts with the
//   default action for SIGINT, SIGTERM, SIGCHLD and SIGPIPE (a rank ignores SIGPIPE) and an empty
//   signal mask, as Python's subprocess gives it.
//
// And for a launcher, what its children leave behind: a process that makes itself their child
// subreaper (set_child_subreaper) adopts the processes they orphan, a daemon or a `setsid cmd &`
// that would otherwise be reparented to init and outlive them, and can stop those with the job
// (stop_children) and reap them meanwhile (reap_exited_children).

#include <sys/types.h>

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace paratrain {

struct ChildOptions {
  /* implicit */ ChildOptions(std::vector<std::string> argv) : argv_(std::move(argv)) {}

  /// The program's arguments, argv[0] included.
  TORCH_ARG(std::vector<std::string>, argv);
  /// The file to execute: a path, run as given (no search of PATH; see dist::find_program).
  /// Empty: argv[0].
  TORCH_ARG(std::string, program);
  /// The child's whole environment ("NAME=VALUE"), used when inherit_environment is false.
  TORCH_ARG(std::vector<std::string>, environment);
  /// The child gets this process's environment; false: `environment` alone.
  TORCH_ARG(bool, inherit_environment) = true;
  /// Start the child in a process group of its own, so that a signal to it reaches its children.
  TORCH_ARG(bool, own_process_group) = true;
  /// The child gets SIGKILL when the thread that started it exits (PR_SET_PDEATHSIG).
  TORCH_ARG(bool, die_with_parent) = true;
  /// The child's stdin; -1 keeps the parent's.
  TORCH_ARG(int, stdin_fd) = -1;
  /// The child's stdout; -1 keeps the parent's.
  TORCH_ARG(int, stdout_fd) = -1;
  /// The child's stderr; -1 keeps the parent's.
  TORCH_ARG(int, stderr_fd) = -1;
  /// A pipe for stdout, read through ChildProcess::stdout_fd() (non-blocking, close-on-exec).
  TORCH_ARG(bool, capture_stdout) = false;
  /// A pipe for stderr, read through ChildProcess::stderr_fd().
  TORCH_ARG(bool, capture_stderr) = false;
  /// One pipe for stdout and stderr together, in the order written.
  TORCH_ARG(bool, capture_output) = false;
  /// CPU cores the child may run on (sched_setaffinity, best effort); empty: any.
  TORCH_ARG(std::vector<int>, cores);
  /// The child's soft limit of open files (RLIMIT_NOFILE, at most the hard limit); -1 keeps this
  /// process's. A launcher that raised its own to relay many workers gives them the limit from
  /// before: programs that use select() cannot watch a descriptor from 1024 on.
  TORCH_ARG(int64_t, open_files_limit) = -1;
};

/// A started child. Movable, not copyable. The destructor closes the pipes it still owns; it
/// neither signals nor reaps the child (wait() does), so a caller that must not leave one behind
/// calls signal() and wait().
class ChildProcess {
 public:
  /// Forks and execs; throws c10::Error naming the program when fork or a pipe fails. A program
  /// that cannot be executed exits with 127 after one line on its stderr.
  explicit ChildProcess(const ChildOptions& options);
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  /// Read ends of the captured streams (-1 when not captured). capture_output: stdout_fd().
  int stdout_fd() const { return stdout_fd_; }
  int stderr_fd() const { return stderr_fd_; }
  /// Hands a read end to the caller, who closes it; -1 when not captured.
  int release_stdout();
  int release_stderr();

  /// Sends `signal` to the child's process group (or to the child, without one). Nothing once
  /// the child was reaped (its pid may since be another process's).
  void signal(int signal) const;
  /// Waits for the child to exit (retrying on EINTR) and returns waitpid's status; again the
  /// same status once reaped. Throws c10::Error when waitpid fails (the child was reaped
  /// elsewhere).
  int wait();
  /// Reaps the child if it has exited: true and its status in `status` (may be null); false
  /// while it runs.
  bool try_wait(int* status);
  /// Reads the captured stdout until end of file (all writers closed) and returns it.
  std::string read_all();

 private:
  void close_pipes();

  pid_t pid_ = -1;
  bool own_group_ = true;
  bool reaped_ = false;
  int status_ = 0;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
};

/// This process's environment ("NAME=VALUE", sorted by name) without the variables named in
/// `unset`, and with `overrides` set.
std::vector<std::string> environment_with(const std::map<std::string, std::string>& overrides,
                                          const std::vector<std::string>& unset = {});

/// The exit code a shell reports for waitpid's `status`: the code, or 128 + the signal.
int exit_code(int status);

/// Makes this process a child subreaper (prctl PR_SET_CHILD_SUBREAPER), or stops it being one:
/// while it is one, a descendant whose parent exits is reparented to it instead of to init.
/// Returns whether it was one before, to put back.
bool set_child_subreaper(bool on);

/// This process's children now (from /proc/PID/stat), exited ones not yet reaped included.
std::set<pid_t> current_children();

/// Reaps the children that have exited, but none in `keep` (whose owners wait for them with
/// waitpid(pid)): what a subreaper adopted. Never blocks; one exited child in `keep` ends the
/// round, so call it again once its owner has reaped it.
void reap_exited_children(const std::set<pid_t>& keep);

/// A child of this process as /proc/PID/stat shows it: its process group and its name.
struct ChildInfo {
  pid_t pid = 0;
  pid_t group = 0;
  std::string name;
};

/// Stops every child of this process that is not in `keep`, with the process group of each that
/// leads one: SIGTERM, SIGKILL after `grace`, and the same for those their deaths hand to a
/// subreaper, until none runs (giving up 5 s after the SIGKILL); reaps them. Returns those that
/// were running. Every child not in `keep` counts: only for a process that knows all of its own
/// (a launcher).
std::vector<ChildInfo> stop_children(const std::set<pid_t>& keep, std::chrono::milliseconds grace);

}  // namespace paratrain
