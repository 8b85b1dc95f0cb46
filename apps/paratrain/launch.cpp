// paratrain launch: the torchrun counterpart.

#include "args.h"
#include "commands.h"

#include "paratrain/launch/launch.h"
#include "paratrain/launch/slurm.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace cli {

namespace {

const CommandSpec& launch_spec() {
  static const CommandSpec spec{
      "paratrain launch",
      "Starts PROGRAM once per rank with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,\n"
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), prefixes each output line with\n"
      "[rank R]:, and stops every worker when one fails. Inside a Slurm allocation (srun\n"
      "--ntasks-per-node 1 paratrain launch ...), --nnodes, --node-rank and --master-addr come\n"
      "from SLURM_JOB_NODELIST, SLURM_NNODES and SLURM_NODEID unless given.",
      {
          {"nproc-per-node,nproc_per_node", "N|auto|cpu|gpu",
           "workers on this node: N; gpu, one per visible GPU; cpu, one per CPU; auto, gpu where "
           "there are GPUs, else cpu (torchrun's; default: number of --devices, else 1)"},
          {"nnodes", "M|MIN:MAX",
           "nodes in the job (default 1, or the Slurm allocation's); MIN:MAX is elastic, with "
           "--rdzv-endpoint (torchrun's)"},
          {"node-rank,node_rank", "R", "this node's index (default 0)"},
          {"master-addr,master_addr", "A",
           "address of node 0 (required with --nnodes > 1; default 127.0.0.1)"},
          {"master-port,master_port", "P", "port of rank 0's store (default 29500)"},
          {"standalone", "", "one node, a free port picked for you"},
          {"devices", "0,1,3",
           "GPUs to use, by physical index (cuda:N means N too): sets CUDA_VISIBLE_DEVICES; "
           "local rank i uses cuda:i"},
          {"log-dir,log_dir", "D",
           "also write each worker's stdout and stderr under D, a folder per run, attempt and "
           "local rank (as torchrun)"},
          {"backend", "B",
           "gloo, mpi, nccl, or routes by tensor device such as cpu:gloo,cuda:nccl; mpi runs the "
           "job through mpirun"},
          {"hostfile", "FILE",
           "with --backend mpi: Open MPI's host file; mpirun starts --nproc-per-node ranks on "
           "each host (default: its slots) with its own remote start"},
          {"rdzv-endpoint,rdzv_endpoint", "HOST:PORT",
           "dynamic rendezvous (torchrun's c10d): the launchers meet there, served by the one on "
           "HOST; node ranks follow the order nodes join"},
          {"rdzv-id,rdzv_id", "JOB", "the job's name at the endpoint (default none)"},
          {"rdzv-backend,rdzv_backend", "c10d",
           "c10d (the dynamic rendezvous, served by the launcher on the endpoint's host), etcd "
           "(the same rounds kept in an etcd server at the endpoint) or static (--node-rank and "
           "--master-addr)"},
          {"rdzv-conf,rdzv_conf", "K=V,...",
           "join_timeout (s, default 600), last_call_timeout (s, default 30), "
           "keep_alive_interval (s, default 5) and keep_alive_max_attempt (default 3)"},
          {"env", "NAME=VALUE", "set a variable in every worker (repeatable)", true},
          {"pass-local-rank,pass_local_rank", "",
           "append --local_rank=N to each worker's arguments, as torch.distributed.launch did "
           "(for scripts that read args.local_rank)"},
          {"no-prefix", "", "relay output without the [rank R]: prefix"},
          {"redirects", "N|R:N,...",
           "with --log-dir, send these streams of every local rank (N), or of local rank R "
           "(R:N), to the log files only: 1 stdout, 2 stderr, 3 both, 0 neither (torchrun's)"},
          {"tee", "N|R:N,...",
           "with --log-dir, write these streams to the log files and the console, as every stream "
           "is by default (torchrun's)"},
          {"local-ranks-filter,local_ranks_filter", "0,2",
           "show only these local ranks' output on the console (the log files keep every rank's)"},
          {"role", "NAME", "the workers' ROLE_NAME (default default, as torchrun's)"},
          {"local-addr,local_addr", "A",
           "this node's address in a rendezvous, given to the other nodes (default: the one "
           "that routes to the endpoint)"},
          {"monitor-interval,monitor_interval", "S",
           "accepted for torchrun's command lines; the launcher learns of a worker's end at once "
           "(SIGCHLD), so there is nothing to poll"},
          {"no-python,no_python", "",
           "accepted for torchrun's command lines: PROGRAM runs as given unless -m or --run-path "
           "says it is Python"},
          {"module,m", "", "PROGRAM is a Python module: run python3 -u -m PROGRAM (torchrun's -m)"},
          {"run-path,run_path", "",
           "PROGRAM is a Python script: run python3 -u PROGRAM (torchrun's --run-path)"},
          {"max-restarts,max_restarts", "N",
           "when a worker fails, stop all and start them all again, up to N times (torchrun's; "
           "TORCHELASTIC_RESTART_COUNT tells the attempt); with several static nodes, every "
           "node restarts together (their launchers meet at --master-port + 1)"},
          {"from-mpirun", "", kInternalOption},         // what mpirun runs for --backend mpi
          {"console-streams", "MAP", kInternalOption},  // the console rule, to a shim
      },
      "The program and its arguments follow --: paratrain launch [options] -- PROGRAM [ARGS...]",
      true};
  return spec;
}

}  // namespace

namespace {

// The GPUs a worker would see: CUDA_VISIBLE_DEVICES's entries when set, else the NVIDIA driver's
// (/proc/driver/nvidia/gpus); the launcher loads no CUDA runtime to ask.
int visible_gpus() {
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    int n = 0;
    std::stringstream list(visible);
    for (std::string item; std::getline(list, item, ',');) {
      if (item.empty() || item[0] == '-') {
        break;  // CUDA stops at the first invalid entry
      }
      ++n;
    }
    return n;
  }
  std::error_code ec;
  int n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// --nproc-per-node N, auto, cpu or gpu, as torchrun's.
int parse_nproc(const Args& args) {
  const std::string text = args.get("nproc-per-node");
  if (text == "cpu" || (text == "auto" && visible_gpus() == 0)) {
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  if (text == "gpu" || text == "auto") {
    const int gpus = visible_gpus();
    if (gpus == 0) {
      throw UsageError(
          "--nproc-per-node gpu: this node has no GPU visible (CUDA_VISIBLE_DEVICES, "
          "/proc/driver/nvidia/gpus); give a number or cpu");
    }
    return gpus;
  }
  const bool digits = !text.empty() && text.size() <= 6 &&
                      text.find_first_not_of("0123456789") == std::string::npos;
  const int n = digits ? std::stoi(text) : 0;
  if (n < 1) {
    throw UsageError("--nproc-per-node must be at least 1, or auto, cpu or gpu; got " + text);
  }
  return n;
}

// -m and --run-path: a Python module or script, run by python3 as torchrun runs them by its own
// interpreter; otherwise the program as given (torchrun's --no-python).
std::vector<std::string> python_command(const Args& args) {
  const bool module = args.has("module");
  const bool script = args.has("run-path");
  if ((module || script) && args.has("no-python")) {
    throw UsageError(std::string(module ? "-m" : "--run-path") +
                     " runs PROGRAM with Python, and --no-python says not to: give one of them");
  }
  if (module && script) {
    throw UsageError("-m and --run-path both say how Python runs PROGRAM: give one of them");
  }
  std::vector<std::string> command = args.rest();
  if (module || script) {
    std::vector<std::string> python{"python3", "-u"};
    if (module) {
      python.push_back("-m");
    }
    command.insert(command.begin(), python.begin(), python.end());
  }
  return command;
}

// torchrun's --redirects and --tee values: "N" for every local rank, or "R:N,R:N,...".
std::map<int, int> parse_streams(const std::string& flag, const std::string& text) {
  auto bad = [&] {
    return UsageError("--" + flag + " '" + text +
                      "' is not N or LOCAL_RANK:N,... with N 0 (none), 1 (stdout), 2 (stderr) "
                      "or 3 (both)");
  };
  auto number = [&](const std::string& s, int most) {
    if (s.empty() || s.size() > 6 || s.find_first_not_of("0123456789") != std::string::npos ||
        std::stoi(s) > most) {
      throw bad();
    }
    return std::stoi(s);
  };
  std::map<int, int> out;
  if (text.find(':') == std::string::npos) {
    out[-1] = number(text, 3);
    return out;
  }
  std::stringstream items(text);
  for (std::string item; std::getline(items, item, ',');) {
    const size_t colon = item.find(':');
    if (colon == std::string::npos) {
      throw bad();
    }
    out[number(item.substr(0, colon), 999999)] = number(item.substr(colon + 1), 3);
  }
  return out;
}

// Which streams of which local ranks reach the console: --local-ranks-filter picks the ranks,
// --redirects takes streams away (to the log files only), --tee keeps them.
void parse_console(const Args& args, dist::LaunchOptions& o) {
  for (const char* flag : {"redirects", "tee"}) {
    if (args.has(flag) && !args.has("log-dir")) {
      throw UsageError(std::string("--") + flag +
                       " says which streams go to the log files: give --log-dir too");
    }
  }
  if (!args.has("redirects") && !args.has("tee") && !args.has("local-ranks-filter")) {
    return;  // every stream of every rank
  }
  // As torchrun's: a stream given to --tee reaches the console even where --redirects names it.
  const auto redirected = parse_streams("redirects", args.get("redirects", "0"));
  const auto teed = parse_streams("tee", args.get("tee", "0"));
  std::set<int> shown;
  if (args.has("local-ranks-filter")) {
    std::stringstream list(args.get("local-ranks-filter"));
    for (std::string item; std::getline(list, item, ',');) {
      if (item.empty() || item.size() > 6 ||
          item.find_first_not_of("0123456789") != std::string::npos) {
        throw UsageError("--local-ranks-filter '" + args.get("local-ranks-filter") +
                         "' is not a list of local ranks (e.g. 0,2)");
      }
      shown.insert(std::stoi(item));
    }
  }
  auto streams_of = [&](int rank) {
    int s = shown.empty() || (rank >= 0 && shown.count(rank) != 0) ? 3 : 0;
    auto mask = [rank](const std::map<int, int>& m) {
      auto it = m.find(rank);
      it = it == m.end() ? m.find(-1) : it;
      return it == m.end() ? 0 : it->second;
    };
    return s & ~(mask(redirected) & ~mask(teed));
  };
  std::map<int, int> console{{-1, streams_of(-1)}};
  for (const auto* m : {&redirected, &teed}) {
    for (const auto& kv : *m) {
      console[kv.first] = streams_of(kv.first);
    }
  }
  for (int rank : shown) {
    console[rank] = streams_of(rank);
  }
  o.console_streams(console);
}

// --console-streams, the rule the launcher that started mpirun made of the console flags
// ("-1:3,1:1": local rank, then streams), which this rank's shim applies to its worker.
dist::ConsoleStreams parse_console_streams(const std::string& text) {
  const std::regex item_form("(-1|[0-9]{1,6}):([0-3])");
  dist::ConsoleStreams out;
  for (const std::string& item : split_list(text)) {
    std::smatch m;
    if (!std::regex_match(item, m, item_form)) {
      throw UsageError("--console-streams is internal: it is what --backend mpi gives its ranks");
    }
    out[std::stoi(m[1].str())] = std::stoi(m[2].str());
  }
  return out;
}

}  // namespace

// --nnodes N or MIN:MAX.
void parse_nnodes(const std::string& text, dist::LaunchOptions& o) {
  auto number = [&](const std::string& part) {
    if (part.empty() || part.size() > 6 ||
        part.find_first_not_of("0123456789") != std::string::npos) {
      throw UsageError("--nnodes '" + text + "' is not N or MIN:MAX (e.g. 2, or 1:3)");
    }
    return std::stoi(part);
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    o.nnodes(number(text));
    return;
  }
  const int lo = number(text.substr(0, colon));
  const int hi = number(text.substr(colon + 1));
  if (lo < 1 || lo > hi) {
    throw UsageError("--nnodes " + text + ": MIN must be at least 1 and at most MAX");
  }
  o.min_nodes(lo).nnodes(hi);
}

// --rdzv-endpoint, --rdzv-id, --rdzv-backend and --rdzv-conf, with torchrun's names and defaults.
void parse_rendezvous(const Args& args, dist::LaunchOptions& o) {
  std::string backend = args.get("rdzv-backend", args.has("rdzv-endpoint") ? "c10d" : "static");
  if (backend == "etcd-v2") {
    backend = "etcd";  // torchrun's other name for it
  }
  if (backend != "c10d" && backend != "etcd" && backend != "static") {
    throw UsageError("--rdzv-backend '" + backend + "': choose c10d, etcd or static");
  }
  if (backend != "static" && !args.has("rdzv-endpoint")) {
    throw UsageError("--rdzv-backend " + backend + " needs --rdzv-endpoint HOST:PORT" +
                     (backend == "etcd" ? " (etcd's client address, port 2379 by default)" : ""));
  }
  if (backend == "static" && args.has("rdzv-endpoint")) {
    throw UsageError("--rdzv-endpoint goes with --rdzv-backend c10d or etcd, not static");
  }
  o.rdzv_endpoint(args.get("rdzv-endpoint", "")).rdzv_id(args.get("rdzv-id", "none"));
  if (backend != "static") {
    o.rdzv_backend(backend);
  }
  double interval = 5, attempts = 3;
  std::stringstream conf(args.get("rdzv-conf", ""));
  for (std::string item; std::getline(conf, item, ',');) {
    const size_t eq = item.find('=');
    const std::string k = item.substr(0, eq);
    double v = -1;
    try {
      v = eq == std::string::npos ? -1 : std::stod(item.substr(eq + 1));
    } catch (const std::exception&) {
    }
    if (v <= 0) {
      throw UsageError("--rdzv-conf '" + item + "' is not KEY=POSITIVE_NUMBER");
    }
    const auto ms = std::chrono::milliseconds(static_cast<int64_t>(v * 1000));
    if (k == "join_timeout") {
      o.rdzv_join_timeout(ms);
    } else if (k == "last_call_timeout") {
      o.rdzv_last_call(ms);
    } else if (k == "keep_alive_interval") {
      interval = v;
    } else if (k == "keep_alive_max_attempt") {
      attempts = v;
    } else {
      throw UsageError("--rdzv-conf: unknown key '" + k +
                       "'; known: join_timeout, last_call_timeout, keep_alive_interval, "
                       "keep_alive_max_attempt");
    }
  }
  o.rdzv_keep_alive(std::chrono::milliseconds(static_cast<int64_t>(interval * attempts * 1000)));
}

// --env NAME=VALUE, repeated.
std::map<std::string, std::string> parse_env(const Args& args) {
  std::map<std::string, std::string> env;
  for (const auto& kv : args.get_all("env")) {
    auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw UsageError("--env '" + kv + "' must look like NAME=VALUE");
    }
    env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

// Inside a Slurm allocation, the node's place when the command line gives none: the allocation's
// node count, SLURM_NODEID, and the first host of SLURM_JOB_NODELIST as node 0.
void apply_slurm(const Args& args, dist::LaunchOptions& o) {
  for (const char* placed : {"nnodes", "node-rank", "master-addr", "standalone", "rdzv-endpoint",
                             "hostfile", "from-mpirun"}) {
    if (args.has(placed)) {
      return;
    }
  }
  const auto slurm = dist::slurm_placement(dist::current_environment());
  if (!slurm) {
    return;
  }
  o.nnodes(slurm->nnodes).node_rank(slurm->node_rank);
  // One node keeps the workers' store on loopback, as without Slurm.
  if (slurm->nnodes > 1) {
    o.master_addr(slurm->master_addr);
  }
  std::cerr << o.name() << ": Slurm job " << slurm->job_id << ": node " << slurm->node_rank
            << " of " << slurm->nnodes << " ("
            << slurm->hosts[static_cast<size_t>(slurm->node_rank)] << "), node 0 "
            << slurm->master_addr << std::endl;
}

namespace {

// Started by mpirun on one rank (--from-mpirun): this rank's worker, with the rank mpirun gave
// it, the job's backend and the console rule of the launcher that started mpirun.
void take_mpirun_rank(const Args& args, dist::LaunchOptions& o, int& mpi_rank, int& mpi_size) {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (rank == nullptr || size == nullptr) {
    throw UsageError("--from-mpirun is internal: it is what mpirun runs for --backend mpi");
  }
  // The launcher that started mpirun put the job's backend ("mpi", or routes with mpi) here.
  const char* backend = std::getenv("PARATRAIN_BACKEND");
  o.backend(backend != nullptr && backend[0] != '\0' ? backend : "mpi");
  mpi_rank = std::atoi(rank);
  mpi_size = std::atoi(size);
  if (args.has("console-streams")) {
    o.console_streams(parse_console_streams(args.get("console-streams")));
  }
  // Each shim starts one worker; the device list stays whole (CUDA_VISIBLE_DEVICES) and the
  // worker picks cuda:LOCAL_RANK from it.
}

}  // namespace

int run_launch(const std::vector<std::string>& argv) {
  Args args(argv, launch_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  dist::LaunchOptions o;
  o.command(args.rest());
  if (args.rest().empty()) {
    throw UsageError("no program given: paratrain launch [options] -- PROGRAM ARGS...");
  }
  if (args.has("nproc-per-node")) {
    o.nproc_per_node(parse_nproc(args));
  }
  o.command(python_command(args));
  parse_console(args, o);
  o.role(args.get("role", "default")).local_addr(args.get("local-addr", ""));
  if (args.has("monitor-interval") && !(args.get_double("monitor-interval", 0) > 0)) {
    throw UsageError("--monitor-interval must be a positive number of seconds, got '" +
                     args.get("monitor-interval") + "'");
  }
  parse_nnodes(args.get("nnodes", "1"), o);
  parse_rendezvous(args, o);
  o.node_rank(args.get_int("node-rank", 0));
  o.master_addr(args.get("master-addr", ""));
  o.master_port(args.get_int("master-port", 29500));
  o.standalone(args.has("standalone"));
  if (args.has("devices")) {
    o.devices(dist::parse_device_list(args.get("devices")));
  }
  o.log_dir(args.get("log-dir", ""));
  o.backend(args.get("backend", ""));
  o.hostfile(args.get("hostfile", ""));
  o.prefix_output(!args.has("no-prefix"));
  o.pass_local_rank(args.has("pass-local-rank"));
  apply_slurm(args, o);
  {
    const int restarts = args.get_int("max-restarts", 0);
    if (restarts < 0) {
      throw UsageError("--max-restarts must be >= 0, got " + std::to_string(restarts));
    }
    o.max_restarts(restarts);
  }
  o.env(parse_env(args));
  o.mpi_shim({self_path(), "launch", "--from-mpirun"});
  // This process only runs the job, so every child it has is the job's: what a worker leaves
  // running out of its process group (a daemon, `setsid cmd &`) is adopted and ends with the job
  // instead of outliving it.
  o.adopt_orphans(true);

  int mpi_rank = -1;
  int mpi_size = -1;
  if (args.has("from-mpirun")) {
    take_mpirun_rank(args, o, mpi_rank, mpi_size);
  } else if (args.has("console-streams")) {
    throw UsageError("--console-streams is internal: it is what --backend mpi gives its ranks");
  }

  dist::LaunchResult result =
      args.has("from-mpirun") ? dist::launch_mpirun_rank(o, mpi_rank, mpi_size) : dist::launch(o);
  // Under mpirun, a shim is stopped by mpirun when another rank failed: that rank's shim already
  // reported the failure, and mpirun reports the job's end.
  if (args.has("from-mpirun") && result.interrupted_by != 0) {
    return result.exit_code;
  }
  if (!result.summary.empty()) {
    std::cerr << result.summary << std::endl;
  }
  return result.exit_code;
}

}  // namespace cli
}  // namespace paratrain
