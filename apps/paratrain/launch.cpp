// paratrain launch: the torchrun counterpart.

#include "args.h"
#include "commands.h"

#include "paratrain/dist/launch.h"

#include <iostream>

namespace paratrain {
namespace cli {

namespace {

const CommandSpec& launch_spec() {
  static const CommandSpec spec{
      "paratrain launch",
      "Starts PROGRAM once per rank with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,\n"
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), prefixes each output line with\n"
      "[rank R]:, and stops every worker when one fails.",
      {
          {"nproc-per-node,nproc_per_node", "N",
           "workers on this node (default: number of --devices, else 1)"},
          {"nnodes", "M", "nodes in the job (default 1)"},
          {"node-rank,node_rank", "R", "this node's index (default 0)"},
          {"master-addr,master_addr", "A",
           "address of node 0 (required with --nnodes > 1; default 127.0.0.1)"},
          {"master-port,master_port", "P", "port of rank 0's store (default 29500)"},
          {"standalone", "", "one node, a free port picked for you"},
          {"devices", "0,1,3", "GPUs to use: sets CUDA_VISIBLE_DEVICES; local rank i uses cuda:i"},
          {"log-dir,log_dir", "D", "also write each rank's output to D/rank_R.log"},
          {"backend", "B",
           "gloo, mpi, nccl, or routes by tensor device such as cpu:gloo,cuda:nccl; mpi runs the "
           "job through mpirun"},
          {"hostfile", "FILE",
           "with --backend mpi: Open MPI's host file; mpirun starts --nproc-per-node ranks on "
           "each host (default: its slots) with its own remote start"},
          {"env", "NAME=VALUE", "set a variable in every worker (repeatable)", true},
          {"no-prefix", "", "relay output without the [rank R]: prefix"},
          {"max-restarts,max_restarts", "N",
           "when a worker fails, stop all and start them all again, up to N times (torchrun's; "
           "TORCHELASTIC_RESTART_COUNT tells the attempt)"},
          {"from-mpirun", "", ""},  // internal: what mpirun runs for --backend mpi
      },
      "The program and its arguments follow --: paratrain launch [options] -- PROGRAM [ARGS...]",
      true};
  return spec;
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
    int n = args.get_int("nproc-per-node", 0);
    if (n < 1) {
      throw UsageError("--nproc-per-node must be at least 1, got " + std::to_string(n));
    }
    o.nproc_per_node(n);
  }
  o.nnodes(args.get_int("nnodes", 1));
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
  {
    const int restarts = args.get_int("max-restarts", 0);
    if (restarts < 0) {
      throw UsageError("--max-restarts must be >= 0, got " + std::to_string(restarts));
    }
    o.max_restarts(restarts);
  }
  std::map<std::string, std::string> env;
  for (const auto& kv : args.get_all("env")) {
    auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw UsageError("--env '" + kv + "' must look like NAME=VALUE");
    }
    env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  o.env(env);
  o.mpi_shim({self_path(), "launch", "--from-mpirun"});

  int mpi_rank = -1;
  int mpi_size = -1;
  if (args.has("from-mpirun")) {
    // Started by mpirun on one rank: relay this rank's worker, with the rank mpirun gave it.
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
    // Each shim starts one worker; the device list stays whole (CUDA_VISIBLE_DEVICES) and the
    // worker picks cuda:LOCAL_RANK from it.
  }

  dist::LaunchResult result = args.has("from-mpirun")
                                  ? dist::detail::launch_mpirun_rank(o, mpi_rank, mpi_size)
                                  : dist::launch(o);
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
