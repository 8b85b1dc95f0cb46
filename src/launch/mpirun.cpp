// Jobs with --backend mpi (or routes with mpi): the outer launch runs mpirun (one node, or the
// hosts of a --hostfile), which starts the paratrain CLI's `launch --from-mpirun` shim on each
// rank; the shim (launch_mpirun_rank) runs that rank's one worker.

#include "paratrain/launch/launch.h"

#include "backend_routes.h"
#include "launch_internal.h"
#include "supervisor.h"

#include <c10/util/Exception.h>

#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace paratrain {
namespace dist {
namespace launch_internal {
namespace {

// The paratrain CLI of this build: $PARATRAIN_CLI, else bin/paratrain beside the directory that
// holds this library (an install prefix's lib/ and bin/, or the build tree's libparatrain_launch
// and bin/). Not a search of PATH: another paratrain there may be another version, whose shim
// speaks another command line. "" when there is none.
std::string own_cli() {
  if (const char* cli = std::getenv("PARATRAIN_CLI"); cli != nullptr && cli[0] != '\0') {
    char* full = ::realpath(cli, nullptr);
    std::string out = full != nullptr ? full : "";
    std::free(full);
    TORCH_CHECK(!out.empty() && runnable(out), "PARATRAIN_CLI='", cli,
                "' is not an executable file; give the path of the paratrain CLI");
    return out;
  }
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&own_cli), &info) == 0 || info.dli_fname == nullptr) {
    return "";
  }
  // Linked statically, this code is in the program itself, which dladdr names by its argv[0].
  const std::string self = std::string(info.dli_fname).find(".so") == std::string::npos
                               ? "/proc/self/exe"
                               : info.dli_fname;
  char* lib = ::realpath(self.c_str(), nullptr);
  if (lib == nullptr) {
    return "";
  }
  std::string dir(lib);
  std::free(lib);
  // Beside it only, never further up (another tree there may hold another version): dir/bin
  // (the build tree), dir itself when it is a bin/ (linked statically), ../bin from prefix/lib or
  // lib64, ../../bin from Debian's prefix/lib/<triplet>.
  auto parent = [](const std::string& p) { return p.substr(0, p.rfind('/')); };
  auto name = [](const std::string& p) { return p.substr(p.rfind('/') + 1); };
  dir = parent(dir);
  std::vector<std::string> candidates{dir + "/bin/paratrain"};
  if (name(dir) == "bin") {
    candidates.push_back(dir + "/paratrain");
  } else if (name(dir) == "lib" || name(dir) == "lib64") {
    candidates.push_back(parent(dir) + "/bin/paratrain");
  } else if (name(parent(dir)) == "lib") {
    candidates.push_back(parent(parent(dir)) + "/bin/paratrain");
  }
  for (const std::string& candidate : candidates) {
    if (runnable(candidate)) {
      return candidate;
    }
  }
  return "";
}

// What mpirun starts on each rank: the paratrain CLI's `launch --from-mpirun`, which relays that
// rank's output and reports its failure.
std::vector<std::string> mpirun_shim(const LaunchOptions& o) {
  if (!o.mpi_shim().empty()) {
    return o.mpi_shim();
  }
  const std::string cli = own_cli();
  TORCH_CHECK(!cli.empty(), "--backend ", o.backend(),
              " starts each rank through the paratrain CLI (paratrain launch --from-mpirun), and "
              "none was found beside libparatrain_launch; set PARATRAIN_CLI to its path or "
              "LaunchOptions::mpi_shim");
  return {cli, "launch", "--from-mpirun"};
}

// Refuses a host that cannot be reached before mpirun tries (ssh to such a host can wait minutes):
// the name must resolve, and this host must have a route to it (the kernel picks a source
// address for a connected UDP socket, which sends nothing).
void check_reachable(const std::string& path, const HostfileEntry& e) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(e.host.c_str(), "9", &hints, &found);
  TORCH_CHECK(rc == 0, "--hostfile ", path, " line ", e.line, ": host '", e.host,
              "' does not resolve (", gai_strerror(rc), "); fix the name or its DNS entry");
  std::string why;
  bool routed = false;
  for (addrinfo* a = found; a != nullptr && !routed; a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = strerror(errno);
      continue;
    }
    routed = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    if (!routed) {
      why = strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  TORCH_CHECK(routed, "--hostfile ", path, " line ", e.line, ": host '", e.host,
              "' is unreachable from this host (", why,
              "); check its address and this host's routes");
}

// mpirun's placement: -np and, with a host file, where the ranks go.
std::vector<std::string> mpirun_placement(const LaunchOptions& o, int nproc) {
  if (o.hostfile().empty()) {
    return {"-np", std::to_string(nproc)};
  }
  const std::vector<HostfileEntry> hosts = read_hostfile(o.hostfile());
  for (const auto& e : hosts) {
    check_reachable(o.hostfile(), e);
  }
  if (o.nproc_per_node() > 0) {
    return {"-np",        std::to_string(o.nproc_per_node() * static_cast<int>(hosts.size())),
            "--hostfile", o.hostfile(),
            "--map-by",   "ppr:" + std::to_string(o.nproc_per_node()) + ":node"};
  }
  int slots = 0;
  for (const auto& e : hosts) {
    slots += e.slots;
  }
  return {"-np", std::to_string(slots), "--hostfile", o.hostfile()};
}

// mpirun's command line: one shim per rank, each running `command`.
std::vector<std::string> mpirun_command(const LaunchOptions& o, int nproc) {
  std::string mpirun = find_program("mpirun");
  TORCH_CHECK(!mpirun.empty(),
              "--backend mpi: mpirun not found on PATH; install Open MPI (openmpi-bin)");
  std::vector<std::string> cmd{mpirun};
  const std::vector<std::string> placement = mpirun_placement(o, nproc);
  cmd.insert(cmd.end(), placement.begin(), placement.end());
  if (!o.hostfile().empty()) {
    // Daemons that Open MPI starts on other hosts get only the variables named with -x.
    // OMP_NUM_THREADS only when the user chose it: otherwise each host's shim splits its own
    // cores between its own ranks.
    cmd.insert(cmd.end(), {"-x", "PARATRAIN_BACKEND"});
    for (const char* name : {"OMP_NUM_THREADS", "PARATRAIN_TIMEOUT"}) {
      if (std::getenv(name) != nullptr || o.env().count(name) > 0) {
        cmd.insert(cmd.end(), {"-x", name});
      }
    }
  }
  // Several ranks on a 2-core machine would otherwise be refused, and Open MPI's default
  // binding pins each rank to one core, starving libtorch's intra-op threads.
  cmd.insert(cmd.end(), {"--oversubscribe", "--bind-to", "none"});
  if (::geteuid() == 0) {
    cmd.push_back("--allow-run-as-root");
  }
  const std::vector<std::string> shim = mpirun_shim(o);
  cmd.insert(cmd.end(), shim.begin(), shim.end());
  if (!o.prefix_output() && std::find(shim.begin(), shim.end(), "--no-prefix") == shim.end()) {
    cmd.push_back("--no-prefix");
  }
  if (o.pass_local_rank()) {
    cmd.push_back("--pass-local-rank");
  }
  if (!o.log_dir().empty()) {
    cmd.insert(cmd.end(), {"--log-dir", o.log_dir()});
  }
  if (!o.console_streams().empty()) {
    // Each rank's shim applies the rule to its own worker (by its local rank), so that mpirun
    // relays only what reaches the console.
    std::string rule;
    for (const auto& kv : o.console_streams()) {
      rule +=
          (rule.empty() ? "" : ",") + std::to_string(kv.first) + ":" + std::to_string(kv.second);
    }
    cmd.insert(cmd.end(), {"--console-streams", rule});
  }
  if (!o.devices().empty()) {
    cmd.insert(cmd.end(), {"--devices", format_device_list(o.devices())});
  }
  // Routes with mpi ("cpu:mpi,cuda:nccl") also meet over the store: --standalone's free port.
  const int port = o.standalone() ? pick_free_port() : o.master_port();
  // With a host file, rank 0 runs on its first host, which serves the store.
  std::string master = o.master_addr();
  if (master.empty()) {
    master = o.hostfile().empty() ? "127.0.0.1" : read_hostfile(o.hostfile()).front().host;
  }
  cmd.insert(cmd.end(), {"--master-addr", master, "--master-port", std::to_string(port)});
  cmd.insert(cmd.end(), {"--role", o.role(), "--rdzv-id", o.rdzv_id()});
  for (const auto& kv : o.env()) {
    cmd.insert(cmd.end(), {"--env", kv.first + "=" + kv.second});
  }
  cmd.push_back("--");
  cmd.insert(cmd.end(), o.command().begin(), o.command().end());
  return cmd;
}

// mpirun's own environment: Open MPI settings measured or needed here (the user's win), and the
// job's backend for the shims.
Environment mpirun_environment(const LaunchOptions& o, int nproc) {
  Environment env{{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                  {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                  {"PARATRAIN_BACKEND", o.backend()}};
  // Measured here (paratrain bench allreduce, 2 ranks, 16 MiB): Open MPI's shared-memory transport
  // with its default single-copy mechanism (CMA, process_vm_readv) took 2.8-3.3 ms per allreduce,
  // with plain copy-in/copy-out through the shared segment 1.9-2.3 ms.
  if (std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism") == nullptr) {
    env["OMPI_MCA_btl_vader_single_copy_mechanism"] = "none";
  }
  // One node (without a host file): TCP between the ranks only over loopback. Open MPI 5
  // otherwise pairs every interface and prints "Unable to find reachable pairing between local
  // and remote interfaces" on hosts whose interfaces it cannot match (seen in Debian 13).
  if (o.hostfile().empty() && std::getenv("OMPI_MCA_btl_tcp_if_include") == nullptr &&
      std::getenv("OMPI_MCA_btl_tcp_if_exclude") == nullptr) {
    env["OMPI_MCA_btl_tcp_if_include"] = "lo";
  }
  // The outer launch starts a single process (mpirun), so it would give each rank all the cores;
  // split them between the ranks here instead, unless the user chose.
  if (o.hostfile().empty() && std::getenv("OMP_NUM_THREADS") == nullptr &&
      o.env().count("OMP_NUM_THREADS") == 0) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env["OMP_NUM_THREADS"] = std::to_string(std::max(1u, cores / static_cast<unsigned>(nproc)));
  }
  for (const auto& kv : o.env()) {
    env[kv.first] = kv.second;
  }
  return env;
}

}  // namespace

// Runs a job through mpirun: mpirun starts the shim on each rank, the shim relays that rank's
// output and reports its failure; this process only watches mpirun.
LaunchResult launch_mpirun(const LaunchOptions& o, int nproc) {
  TORCH_CHECK(o.nnodes() == 1, "--backend mpi with --nnodes ", o.nnodes(),
              " is not supported: on several nodes run mpirun (or srun) with a host file yourself");
  LaunchOptions outer = o;
  outer.backend("")
      .hostfile("")       // mpirun's own
      .standalone(false)  // mpirun_command chose the ranks' port
      .command(mpirun_command(o, nproc))
      .nproc_per_node(1)
      .devices({})
      .log_dir("")
      .console_streams({})  // the ranks' shims apply it; mpirun relays what they show
      .prefix_output(false)
      .env(mpirun_environment(o, nproc));
  // mpirun is one process that is rank 0 of 1 as far as this launcher is concerned.
  LaunchResult r = run_job(outer, Placement{true, 0, 1});
  if (r.interrupted_by != 0) {
    r.summary = o.name() + ": interrupted by " + strsignal(r.interrupted_by) +
                "; stopped mpirun and its " + std::to_string(nproc) + " ranks";
  } else if (r.first_failure) {
    r.summary = o.name() + ": mpirun " +
                (r.first_failure->signal
                     ? "was killed by signal " + std::to_string(r.first_failure->signal)
                     : "exited with code " + std::to_string(r.first_failure->exit_code)) +
                "; the failing rank's report is above";
  }
  return r;
}

bool runs_on_mpi(const std::string& backend) {
  if (backend.find(':') == std::string::npos) {
    return backend == "mpi";
  }
  for (const auto& route : detail::parse_routes(backend)) {
    if (route.second == "mpi") {
      return true;
    }
  }
  return false;
}

}  // namespace launch_internal

LaunchResult launch_mpirun_rank(const LaunchOptions& options, int rank, int world_size) {
  TORCH_CHECK(rank >= 0 && rank < world_size, "mpirun gave rank ", rank, " of a world of ",
              world_size);
  LaunchOptions one = options;
  one.nproc_per_node(1);
  launch_internal::Placement where{true, rank, world_size};
  // The attempt whose logs this rank writes: the outer launch's, which it passes on with --env
  // (Open MPI sends a remote host only the variables named with -x).
  const auto count = options.env().find("TORCHELASTIC_RESTART_COUNT");
  if (count != options.env().end()) {
    where.attempt = std::atoi(count->second.c_str());
  }
  return launch_internal::run_job(one, where);
}

}  // namespace dist
}  // namespace paratrain
