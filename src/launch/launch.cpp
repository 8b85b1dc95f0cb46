// The public entry of the launcher: checks the options (validate), then runs the job, locally
// with torchrun's --max-restarts (supervisor.cpp), through mpirun (mpirun.cpp), or with a dynamic
// rendezvous (elastic.cpp).

#include "paratrain/launch/launch.h"

#include "backend_routes.h"
#include "launch_internal.h"
#include "supervisor.h"

#include <c10/util/Exception.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>

namespace paratrain {
namespace dist {
namespace launch_internal {
namespace {

// ---- Why a program cannot be run -------------------------------------------------------------

// What to run a file without its execute bit through: the interpreter its "#!" line names
// ("/usr/bin/env python3"), else a guess from its name; "" for a compiled program.
std::string interpreter_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char head[256] = {};
  in.read(head, sizeof(head) - 1);
  const std::string first(head, static_cast<size_t>(in.gcount()));
  if (first.rfind("\177ELF", 0) == 0) {  // an executable's magic number, 0x7f "ELF"
    return "";
  }
  if (first.rfind("#!", 0) == 0) {
    const std::string line = first.substr(2, first.find('\n') - 2);
    const size_t start = line.find_first_not_of(" \t");
    const size_t end = line.find_last_not_of(" \t\r");
    if (start != std::string::npos) {
      return line.substr(start, end - start + 1);
    }
  }
  const bool python = path.size() > 3 && path.compare(path.size() - 3, 3, ".py") == 0;
  return python ? "python3" : "sh";
}

std::string not_executable(const std::string& path) {
  const std::string interpreter = interpreter_of(path);
  return "exists but is not executable: make it so (chmod +x " + path + ")" +
         (interpreter.empty()
              ? std::string()
              : " or run it through its interpreter (-- " + interpreter + " " + path + ")");
}

// The rest of "program 'NAME' ..." when find_program found nothing: a file without its execute
// bit, a directory, a script in this directory named without ./, or nothing at all.
std::string why_not_runnable(const std::string& name) {
  struct stat st {};
  if (name.find('/') != std::string::npos) {
    if (::stat(name.c_str(), &st) != 0) {
      return errno == ENOENT ? "not found: no such file"
                             : "cannot be run: " + std::string(std::strerror(errno));
    }
    return S_ISDIR(st.st_mode)    ? "is a directory, not a program"
           : !S_ISREG(st.st_mode) ? "is not a regular file"
                                  : not_executable(name);
  }
  // A bare name is looked up on PATH alone, as execvp does.
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      return "is on PATH as " + candidate + ", which " + not_executable(candidate);
    }
  }
  if (::stat(name.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    return "is not a command on PATH; for the file in this directory write ./" + name;
  }
  return "not found: it is neither an executable file nor a command on PATH";
}

}  // namespace

void validate(const LaunchOptions& o) {
  TORCH_CHECK(!o.command().empty(),
              "no program given; usage: paratrain launch [options] -- PROGRAM ARGS...");
  TORCH_CHECK(o.nproc_per_node() >= 0, "--nproc-per-node must be at least 1, got ",
              o.nproc_per_node());
  TORCH_CHECK(o.nnodes() >= 1, "--nnodes must be at least 1, got ", o.nnodes());
  const int min_nodes = o.min_nodes() > 0 ? o.min_nodes() : o.nnodes();
  TORCH_CHECK(min_nodes <= o.nnodes(), "--nnodes ", o.min_nodes(), ":", o.nnodes(),
              ": the minimum is larger than the maximum; write MIN:MAX with MIN <= MAX");
  TORCH_CHECK(min_nodes == o.nnodes() || !o.rdzv_endpoint().empty(), "--nnodes ", min_nodes, ":",
              o.nnodes(),
              " is elastic: it needs a dynamic rendezvous, --rdzv-endpoint host:port (and "
              "--rdzv-id)");
  TORCH_CHECK(o.node_rank() >= 0 && o.node_rank() < o.nnodes(), "--node-rank ", o.node_rank(),
              " is out of range for --nnodes ", o.nnodes(), ": it must be in [0, ", o.nnodes() - 1,
              "]");
  TORCH_CHECK(o.nnodes() == 1 || !o.master_addr().empty() || !o.rdzv_endpoint().empty(),
              "--nnodes ", o.nnodes(),
              " needs --master-addr: the address of node 0, which every node can reach");
  TORCH_CHECK(!(o.standalone() && o.nnodes() > 1), "--standalone is for one node; with --nnodes ",
              o.nnodes(), " give --master-addr and --master-port");
  TORCH_CHECK(o.rdzv_endpoint().empty() || !launch_internal::runs_on_mpi(o.backend()),
              "--rdzv-endpoint with --backend mpi: mpirun places the ranks; use --hostfile");
  TORCH_CHECK(o.rdzv_backend() == "c10d" || o.rdzv_backend() == "etcd", "--rdzv-backend '",
              o.rdzv_backend(), "': choose c10d, etcd or static");
  TORCH_CHECK(o.rdzv_endpoint().empty() || !o.standalone(),
              "--standalone is one node on loopback; it does not go with --rdzv-endpoint");
  TORCH_CHECK(
      o.hostfile().empty() || launch_internal::runs_on_mpi(o.backend()),
      "--hostfile goes with --backend mpi: Open MPI starts the ranks on the hosts it lists");
  TORCH_CHECK(o.hostfile().empty() || o.nnodes() == 1, "--hostfile and --nnodes ", o.nnodes(),
              " both place ranks on nodes: give one of them");
  TORCH_CHECK(o.master_port() > 0 && o.master_port() < 65536, "--master-port ", o.master_port(),
              " is not a TCP port: it must be in [1, 65535]");
  for (const auto& [local_rank, streams] : o.console_streams()) {
    TORCH_CHECK(local_rank >= -1 && streams >= 0 && streams <= 3, "console_streams: local rank ",
                local_rank, " -> ", streams,
                " is not a rule; give local ranks >= 0 (or -1 for the rest) and streams 0-3 (1 "
                "stdout, 2 stderr, 3 both)");
  }
  // The names only: the program launched may be another one (a Python script) whose build has
  // engines this one lacks.
  if (!o.backend().empty() && o.backend() != "auto") {
    const std::string& b = o.backend();
    TORCH_CHECK(b.find(':') != std::string::npos || b == "gloo" || b == "mpi" || b == "nccl",
                "--backend: unknown backend '", b,
                "': choose gloo, mpi or nccl, or routes such as cpu:gloo,cuda:nccl");
    if (b.find(':') != std::string::npos) {
      try {
        detail::parse_routes(b);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "--backend: ", e.what_without_backtrace());
      }
    }
  }
  std::set<int> seen;
  for (int d : o.devices()) {
    TORCH_CHECK(d >= 0, "--devices: GPU index ", d, " is negative");
    TORCH_CHECK(seen.insert(d).second, "--devices lists GPU ", d, " twice");
  }
  TORCH_CHECK(!find_program(o.command()[0]).empty(), "program '", o.command()[0], "' ",
              why_not_runnable(o.command()[0]));
  check_limits(o);
}

int resolved_nproc(const LaunchOptions& o) {
  if (o.nproc_per_node() > 0) {
    return o.nproc_per_node();
  }
  return o.devices().empty() ? 1 : static_cast<int>(o.devices().size());
}

std::string describe_failure(const WorkerFailure& f) {
  return "rank " + std::to_string(f.rank) + " (pid " + std::to_string(f.pid) + ") " +
         (f.signal != 0 ? std::string("was killed by signal ") + std::to_string(f.signal) + " (" +
                              strsignal(f.signal) + ")"
                        : "exited with code " + std::to_string(f.exit_code)) +
         " at " + f.time;
}

}  // namespace launch_internal

LaunchResult launch(const LaunchOptions& options) {
  TORCH_CHECK(options.max_restarts() >= 0, "--max-restarts must be >= 0, got ",
              options.max_restarts());
  if (!options.rdzv_endpoint().empty() || launch_internal::agrees_on_restarts(options)) {
    return launch_internal::launch_elastic(options);
  }

  std::vector<WorkerFailure> failures;
  const std::string log_run_dir = launch_internal::make_log_run_dir(options);
  for (int attempt = 0;; ++attempt) {
    LaunchOptions o = options;
    Environment env = o.env();
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options.max_restarts());
    o.env(env).log_dir(log_run_dir);
    launch_internal::Placement where;
    where.attempt = attempt;
    LaunchResult r = launch_internal::run_job(o, where);
    if (r.first_failure) {
      failures.push_back(*r.first_failure);
    }
    const bool retry = r.exit_code != 0 && r.interrupted_by == 0 && r.signal_received == 0 &&
                       r.first_failure && attempt < options.max_restarts();
    if (!retry) {
      r.restarts = attempt;
      r.failures = failures;
      if (options.max_restarts() > 0 && !failures.empty() && !r.summary.empty()) {
        r.summary += "\n" + options.name() + ": " + std::to_string(attempt) + " restart" +
                     (attempt == 1 ? "" : "s") + " of " + std::to_string(options.max_restarts()) +
                     " used; every failure:";
        for (size_t i = 0; i < failures.size(); ++i) {
          r.summary += "\n  attempt " + std::to_string(i) + ": " +
                       launch_internal::describe_failure(failures[i]);
        }
      }
      return r;
    }
    std::cerr << options.name() << ": " << launch_internal::describe_failure(*r.first_failure)
              << "; stopped every worker, restarting all (restart " << attempt + 1 << " of "
              << options.max_restarts() << ")" << std::endl;
  }
}

}  // namespace dist
}  // namespace paratrain
