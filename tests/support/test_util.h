#pragma once

// Helpers for tests that start real processes: run a command with extra environment and a
// deadline, capture its output, and look for processes left behind; and run_cli, which runs a
// paratrain command line in the test's own process.

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <functional>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace paratrain {
namespace testing {

/// The message (without backtrace) of the c10::Error that `f` throws; "" when it throws none.
std::string error_of(const std::function<void()>& f);

/// Expects `a` and `b` defined, of one shape, and within `tolerance` element-wise; `what` names
/// them in the failure.
void expect_close(const at::Tensor& a,
                  const at::Tensor& b,
                  const std::string& what,
                  double tolerance = 1e-5);

/// Starts `worker` (then `args`) on `ranks` ranks of `backend` through `paratrain launch` and
/// expects the job to succeed with every rank printing "rank R: ok" (the workers' contract).
void expect_every_rank_ok(const std::string& worker,
                          const std::string& backend,
                          int ranks,
                          const std::vector<std::string>& args);

struct ProcessResult {
  int exit_code = -1;  ///< -1 when killed by a signal
  int signal = 0;
  bool timed_out = false;
  std::string output;  ///< stdout and stderr, interleaved as written
};

/// Runs argv with `env` added to this process's environment; kills it (and its process group)
/// after `timeout_seconds`, which counts as a test failure in the callers.
ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env = {},
                          double timeout_seconds = 120);

/// Runs a paratrain command line in this process, as `paratrain` would (argv[0] is cli_path()):
/// the same dispatch and error reporting (cli::run_command_line), its stdout and stderr captured,
/// `env` set for its duration. For command lines that fail before starting anything, which would
/// otherwise each pay a process's libtorch start-up (0.8 CPU-seconds). Commands that run
/// themselves again as workers run cli_path() for it. No timeout: the test's own applies. What the
/// command set in libtorch stays set (the CUDA devices seen, seeds, oneDNN switched off), for the
/// cases that share the process after it (ctest runs a suite's cases in one process: tests/
/// CMakeLists.txt): so only for command lines refused before anything runs, or in cases that run
/// alone.
ProcessResult run_cli(const std::vector<std::string>& argv,
                      const std::map<std::string, std::string>& env = {});

/// A started process, for tests that signal it while it runs.
struct RunningProcess {
  int pid = -1;
  int output_fd = -1;
  std::string output;
  /// Reads what arrives within 50 ms; false at end of output.
  bool read_some();
  /// Reads output until `text` appears or the deadline passes; returns whether it appeared.
  bool wait_for_output(const std::string& text, double timeout_seconds);
  /// Waits for exit (reading output); kills after the deadline.
  ProcessResult finish(double timeout_seconds);
};
RunningProcess start_process(const std::vector<std::string>& argv,
                             const std::map<std::string, std::string>& env = {});

/// Extra environment for a process that must run as a world of one, outside any launcher: the
/// launcher and MPI variables of the test's own environment are removed.
std::map<std::string, std::string> world_of_one_env();

/// Environment entry that hides every GPU from a process: tests that run on the CPU whatever the
/// machine has (where a machine with one GPU would refuse 2 ranks of their own device).
inline const std::pair<const std::string, std::string> kCpuOnly{"CUDA_VISIBLE_DEVICES", ""};

/// PIDs of live processes whose command line contains `token`.
std::vector<int> processes_with(const std::string& token);

/// Deep copies of `tensors` (detached clones), to compare with later.
std::map<std::string, at::Tensor> clone_tensors(const std::map<std::string, at::Tensor>& tensors);

/// Expects `a` and `b` to hold the same names and bitwise-equal tensors (compared on the CPU).
void expect_bitwise(const std::map<std::string, at::Tensor>& a,
                    const std::map<std::string, at::Tensor>& b);

/// A new directory /tmp/NAME-PID-N (unique_token), for a test's files.
std::string make_temp_dir(const std::string& name);

/// Unique token for marking the processes of one test.
std::string unique_token(const std::string& prefix);

/// Paths of the built programs (from CMake).
std::string cli_path();
std::string worker_path();
std::string probe_path();
std::string spawn_probe_path();

/// The Python that writes reference files (CMake's PARATRAIN_TEST_PYTHON).
std::string test_python();
/// Whether test_python() has `module` installed (e.g. "torchvision"); checked once per module.
bool python_has(const std::string& module);

/// The Python with transformers for the Hugging Face tests (CMake's PARATRAIN_HF_PYTHON); "" when
/// none was configured.
std::string hf_python();
/// Why the Hugging Face tests cannot run here ("" when hf_python() imports transformers): their
/// GTEST_SKIP reason. Checked once.
std::string hf_python_missing();

/// Whether this machine has a CUDA device (tests that need one skip with this reason otherwise).
bool has_cuda();

/// What backend "auto" gives a job whose CPU engine is `cpu_engine` ("gloo", or "mpi" under
/// mpirun) on this machine: routes with nccl when there is a GPU and the build has NCCL.
std::string auto_backend(const std::string& cpu_engine);

/// A port nobody listens on right now.
int free_port();

/// Removes `path` and everything under it; no error when it is missing.
void remove_tree(const std::string& path);

/// The bytes of the file at `path` ("" when it cannot be read).
std::string file_bytes(const std::string& path);

/// Every file directly in `dir`, by name, with its bytes.
std::map<std::string, std::string> files_in(const std::string& dir);

/// Removes every file or directory whose path starts with `prefix` (e.g. "/tmp/run-" removes
/// /tmp/run-1 and /tmp/run-2.json): what `rm -rf PREFIX*` does.
void remove_with_prefix(const std::string& prefix);

}  // namespace testing
}  // namespace paratrain
