#pragma once

// Shared by the benchmarks: medians, the workloads of the DDP benchmarks, results files, running
// a job of workers, and the Python of the PyTorch comparisons. The frame they run in (options,
// --smoke, workers' command lines, JSON rows) is bench/harness.h.

#include "args.h"
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"
#include "json_line.h"

#include "paratrain/comm/init.h"
#include "paratrain/launch/launch.h"

#include <sys/resource.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

/// Seconds since `start` on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// This process's peak resident memory so far, in bytes (getrusage; Linux counts KiB).
inline int64_t peak_rss_bytes() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

/// This machine's memory, in bytes.
inline int64_t physical_memory() {
  return static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
}

inline double median(std::vector<double> v) {
  if (v.empty()) {
    return 0;
  }
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The workloads of `bench ddp` and `bench strategies`: the model, its batch per rank (per
// replica for DataParallel), the input shape for that batch, warm-up and timed steps.
struct Workload {
  std::string name;
  std::string model;
  int batch;
  std::vector<int64_t> shape;
  int warmup;
  int steps;
};

inline Workload workload(const std::string& name, int steps_override) {
  if (name == "mlp") {
    return {"mlp", "mlp", 64, {64, 1, 28, 28}, 10, steps_override > 0 ? steps_override : 60};
  }
  if (name == "resnet18") {
    return {"resnet18", "resnet18_cifar",
            16,         {16, 3, 32, 32},
            2,          steps_override > 0 ? steps_override : 16};
  }
  if (name == "cnn") {  // the zoo's small CNN: activations of a few MiB (docs/allocator.md)
    return {"cnn", "cnn", 32, {32, 1, 28, 28}, 5, steps_override > 0 ? steps_override : 40};
  }
  throw UsageError("unknown workload '" + name + "': choose mlp, resnet18 or cnn");
}

/// Workload `name` as a benchmark's run takes it: --steps overrides the timed steps; under --smoke
/// a batch of 4 per rank or replica (BatchNorm trains on no fewer than 2) and one warm-up step,
/// so that a step costs little next to a process's start-up.
inline Workload bench_workload(const std::string& name, const Bench& bench) {
  Workload w = workload(name, bench.get_int("steps", 0));
  if (bench.smoke()) {
    w.batch = 4;
    w.shape[0] = 4;
    w.warmup = 1;
  }
  return w;
}

/// --workloads (default mlp,resnet18), each one checked.
inline std::vector<std::string> bench_workloads(const Bench& bench) {
  std::vector<std::string> out;
  for (const auto& w : split_list(bench.get("workloads", "mlp,resnet18"))) {
    workload(w, 0);  // throws UsageError for an unknown one
    out.push_back(w);
  }
  return out;
}

/// A fresh empty file for the rows of a benchmark's workers: /tmp/paratrain-bench-NAME-XXXXXX.
inline std::string results_file(const std::string& name) {
  std::string path = "/tmp/paratrain-bench-" + name + "-XXXXXX";
  std::vector<char> tmpl(path.begin(), path.end());
  tmpl.push_back('\0');
  int fd = ::mkstemp(tmpl.data());
  if (fd < 0) {
    throw std::runtime_error("cannot create a temporary file for the results");
  }
  ::close(fd);
  return tmpl.data();
}

/// The CPU backends that option `name` lists (comma-separated), else `defaults` less those this
/// build lacks. Each must be gloo or mpi, and built: a usage error names the option otherwise, and
/// says so when the build has none of the defaults.
inline std::vector<std::string> cpu_backends(const Bench& bench,
                                             const std::string& name,
                                             const std::vector<std::string>& defaults) {
  const std::vector<std::string> built = dist::available_backends();
  auto has = [&](const std::string& b) {
    return std::find(built.begin(), built.end(), b) != built.end();
  };
  std::vector<std::string> out;
  if (!bench.has(name)) {
    std::copy_if(defaults.begin(), defaults.end(), std::back_inserter(out), has);
    if (out.empty()) {
      std::string names;
      for (const auto& b : defaults) {
        names += (names.empty() ? "" : " or ") + b;
      }
      throw UsageError("this build has no " + names +
                       " backend, which this benchmark runs on by "
                       "default: name one it has with --" +
                       name + ", or build with " + names);
    }
    return out;
  }
  out = split_list(bench.get(name));
  if (out.empty()) {
    throw UsageError("--" + name + " is empty: name gloo or mpi");
  }
  for (const auto& b : out) {
    if ((b != "gloo" && b != "mpi") || !has(b)) {
      throw UsageError("--" + name + " '" + b + "': choose of gloo and mpi, those this build has");
    }
  }
  return out;
}

/// --backend, else mpi when this build has it (the fast path on CPU), else gloo.
inline std::string bench_backend(const Bench& bench) {
  auto backends = dist::available_backends();
  return bench.get("backend", std::find(backends.begin(), backends.end(), "mpi") != backends.end()
                                  ? "mpi"
                                  : "gloo");
}

/// Runs `command` as `nproc` processes of one intra-op thread each through the launcher (through
/// mpirun when `backend` is mpi; empty: no backend setting). On failure removes the results file
/// `out` and throws with the launcher's summary.
inline void run_bench_job(const std::vector<std::string>& command,
                          int nproc,
                          const std::string& backend,
                          const std::string& out) {
  dist::LaunchOptions o;
  o.nproc_per_node(nproc).standalone(true).command(command).env({{"OMP_NUM_THREADS", "1"}});
  if (!backend.empty()) {
    o.backend(backend).mpi_shim({paratrain_program(), "launch", "--from-mpirun"});
  }
  dist::LaunchResult r = dist::launch(o);
  if (r.exit_code != 0) {
    std::remove(out.c_str());
    throw std::runtime_error("a benchmark job failed: " + r.summary);
  }
}

/// The Python that runs the PyTorch comparisons: `flag` (--python) when given, else
/// PARATRAIN_PYTHON, else the first of `python3` on PATH and /usr/bin/python3 that imports torch.
/// Throws saying how to choose one when none does.
inline std::string torch_python(const std::string& flag) {
  if (!flag.empty()) {
    return flag;
  }
  const char* env = std::getenv("PARATRAIN_PYTHON");
  if (env != nullptr && env[0] != '\0') {
    return env;
  }
  for (const char* candidate : {"python3", "/usr/bin/python3"}) {
    const std::string probe = std::string("'") + candidate + "' -c 'import torch' >/dev/null 2>&1";
    if (std::system(probe.c_str()) == 0) {
      return candidate;
    }
  }
  throw std::runtime_error(
      "no Python with torch found (tried python3 on PATH and /usr/bin/python3): pass --python "
      "/path/to/python3 or set PARATRAIN_PYTHON, or skip PyTorch with --no-pytorch");
}

/// A PyTorch comparison script installed with the CLI: bin/../share/paratrain/NAME, in the build
/// tree as in an install.
inline std::string bench_script(const std::string& name) {
  const std::string path = beside_self("../share/paratrain/" + name);
  if (::access(path.c_str(), R_OK) != 0) {
    throw std::runtime_error("the PyTorch comparison script " + path +
                             " is missing: reinstall paratrain, or skip PyTorch with --no-pytorch");
  }
  return path;
}

/// The Python of a benchmark's PyTorch side (torch_python), or "" where it is skipped: with
/// --no-pytorch, and under --smoke unless --python names it (harness.h).
inline std::string comparison_python(const Bench& bench) {
  if (bench.has("no-pytorch") || (bench.smoke() && !bench.has("python"))) {
    return "";
  }
  return torch_python(bench.get("python", ""));
}

/// Marks `row` when --smoke skipped the comparison side, so that its missing rows and ratios read
/// as a choice, not as a failure. `field`: what was skipped ("pytorch", "optuna").
inline void note_smoke_skip(const Bench& bench, JsonRow& row, const char* field = "pytorch") {
  if (bench.smoke() && !bench.has("python") && !bench.has("no-pytorch")) {
    row[field] = kSkippedUnderSmoke;
  }
}

}  // namespace cli
}  // namespace paratrain
