#pragma once

// The launcher behind `paratrain launch` and paratrain::spawn: starts one worker process per
// local rank with torchrun's environment contract, relays their output line by line, and tears
// the whole job down when any worker fails.
//
// Concurrency contract: launch() runs on the calling thread and owns its children. It blocks until
// every worker has exited. SIGINT and SIGTERM received by the process during launch() are
// forwarded to every worker (then SIGKILL after kill_grace); the previous handlers are restored on
// return. Each worker runs in its own process group, so stopping a worker also stops the processes
// it started, and workers are killed if the launcher itself dies (PR_SET_PDEATHSIG). With
// adopt_orphans (`paratrain launch` sets it), what the workers leave behind in other process groups
// or sessions is stopped too, at the end of each attempt.

#include <torch/arg.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace paratrain {
namespace dist {

/// Environment variables, name -> value.
using Environment = std::map<std::string, std::string>;
/// Local rank -> which of its streams (1 stdout, 2 stderr, 3 both) reach the console.
using ConsoleStreams = std::map<int, int>;

struct LaunchOptions {
  /// Workers on this node; 0 means "one per --devices entry, else 1".
  TORCH_ARG(int, nproc_per_node) = 0;
  /// Nodes in the job (torchrun's --nnodes).
  TORCH_ARG(int, nnodes) = 1;
  /// This node's rank among them, 0 to nnodes - 1 (torchrun's --node-rank).
  TORCH_ARG(int, node_rank) = 0;
  /// Address of rank 0's node; required when nnodes > 1.
  TORCH_ARG(std::string, master_addr) = "";
  /// The port of the store on rank 0's node (torchrun's --master-port).
  TORCH_ARG(int, master_port) = 29500;
  /// Single node on loopback with a free port chosen by the launcher.
  TORCH_ARG(bool, standalone) = false;
  /// GPUs for this node's workers (CUDA_VISIBLE_DEVICES); local rank i uses cuda:i.
  TORCH_ARG(std::vector<int>, devices) = {};
  /// When set, also write each worker's stdout and stderr, as torchrun, to
  /// <log_dir>/<rdzv_id>_<random>/attempt_<k>/<local rank>/{stdout,stderr}.log: a new folder
  /// for each launch and each attempt, so nothing is written over.
  TORCH_ARG(std::string, log_dir) = "";
  /// "" (the worker decides), "gloo", "mpi" or "nccl". mpi runs the job through mpirun.
  TORCH_ARG(std::string, backend) = "";
  /// Program and arguments of each worker.
  TORCH_ARG(std::vector<std::string>, command) = {};
  /// torch.distributed.launch's way of telling a script its local rank: append
  /// "--local_rank=N" to each worker's arguments (LOCAL_RANK is set either way).
  TORCH_ARG(bool, pass_local_rank) = false;
  /// Extra environment for every worker (set after the contract; does not override it).
  TORCH_ARG(Environment, env) = {};
  /// Time between SIGTERM and SIGKILL when stopping workers.
  TORCH_ARG(std::chrono::milliseconds, kill_grace) = std::chrono::milliseconds(3000);
  /// Prefix each relayed line with "[rank R]: ".
  TORCH_ARG(bool, prefix_output) = true;
  /// Which of a worker's streams reach the console, by local rank: 1 stdout, 2 stderr, 3 both,
  /// 0 neither (torchrun's --redirects and --local-ranks-filter). Key -1 stands for every local
  /// rank not listed; without it, 3. The log files (log_dir) get both streams whatever this says.
  TORCH_ARG(ConsoleStreams, console_streams) = {};
  /// torchrun's --role: the workers' ROLE_NAME.
  TORCH_ARG(std::string, role) = "default";
  /// torchrun's --local-addr: the address this node gives the other nodes in a rendezvous (the
  /// job's master address when it is node 0); "" finds the one that routes to the endpoint.
  TORCH_ARG(std::string, local_addr) = "";
  /// Name used in the launcher's own messages.
  TORCH_ARG(std::string, name) = "paratrain launch";
  /// torchrun's --max-restarts: when a worker fails, every worker is stopped and all are started
  /// again, up to this many times, with TORCHELASTIC_RESTART_COUNT set to the attempt (0 first).
  /// With several nodes and a static rendezvous (node_rank, master_addr), the nodes agree on
  /// each restart: a failure on any node stops every node's workers, and all start the next
  /// attempt together with one TORCHELASTIC_RESTART_COUNT. Their launchers meet in a store that
  /// node 0's launcher serves at master_addr, port master_port + 1.
  TORCH_ARG(int, max_restarts) = 0;
  /// With backend "mpi" (or routes with mpi): the command mpirun starts on each rank in front of
  /// `command`, which relays that rank's output and reports its failure. Empty: `paratrain launch
  /// --from-mpirun` with the CLI of this build ($PARATRAIN_CLI, else bin/paratrain beside the
  /// installed library).
  TORCH_ARG(std::vector<std::string>, mpi_shim) = {};
  /// Dynamic rendezvous, torchrun's c10d kind: "host:port" where the launchers meet (the
  /// launcher on that host serves it). Node ranks are then given in the order nodes join, and
  /// node_rank and master_addr are not used. With min_nodes < nnodes the job is elastic (see
  /// launch()).
  TORCH_ARG(std::string, rdzv_endpoint) = "";
  /// Where the dynamic rendezvous lives: "c10d" (the launcher on the endpoint's host serves it)
  /// or "etcd" (an etcd server at the endpoint, torchrun's etcd backend: any node may die).
  TORCH_ARG(std::string, rdzv_backend) = "c10d";
  /// The job's name at the endpoint: nodes with other ids never mix.
  TORCH_ARG(std::string, rdzv_id) = "none";
  /// torchrun's --nnodes MIN:MAX; 0: nnodes (a fixed number of nodes).
  TORCH_ARG(int, min_nodes) = 0;
  /// How long the rendezvous waits for min_nodes (torchrun's join_timeout, 600 s).
  TORCH_ARG(std::chrono::milliseconds, rdzv_join_timeout) = std::chrono::milliseconds(600000);
  /// Once min_nodes have joined, how long it still waits for more, up to nnodes (torchrun's
  /// last_call_timeout, 30 s).
  TORCH_ARG(std::chrono::milliseconds, rdzv_last_call) = std::chrono::milliseconds(30000);
  /// A node whose heartbeat has not moved for this long is taken for dead, and the others form
  /// a new round without it.
  TORCH_ARG(std::chrono::milliseconds, rdzv_keep_alive) = std::chrono::milliseconds(10000);
  /// Makes this process the workers' descendants' child subreaper while the job runs
  /// (PR_SET_CHILD_SUBREAPER): a process a worker leaves behind when it exits (a daemon, a
  /// `setsid cmd &`, which its process group does not hold) is reparented here rather than to
  /// init, reaped when it exits, and stopped at the end of each attempt (SIGTERM, SIGKILL after
  /// kill_grace), with one line naming it. Every child of this process that the launch did not
  /// start and that was not there before it counts as such: so only for a process that starts no
  /// other children while the job runs, as `paratrain launch` (which sets it).
  TORCH_ARG(bool, adopt_orphans) = false;
  /// With backend "mpi" (or routes with mpi): an Open MPI host file ("host [slots=N]" per line).
  /// mpirun starts nproc_per_node ranks on each host listed (each host's slots when
  /// nproc_per_node is 0) through its own remote start (ssh, or OMPI_MCA_plm_rsh_agent), and
  /// the first host serves the store. Every host is checked first: one that does not resolve or
  /// has no route from here is refused, naming its line.
  TORCH_ARG(std::string, hostfile) = "";
};

/// One host of an Open MPI host file.
struct HostfileEntry {
  std::string host;
  int slots = 1;
  int line = 0;
};

/// Reads an Open MPI host file ("host [slots=N] ..." per line, # comments). Throws c10::Error
/// naming the file and line for an unreadable or empty file, a bad slot count or a repeated host.
std::vector<HostfileEntry> read_hostfile(const std::string& path);

struct WorkerFailure {
  int rank = -1;
  int local_rank = -1;
  int pid = -1;
  int exit_code = 0;  ///< when it exited
  int signal = 0;     ///< when a signal killed it
  std::string time;   ///< local time of the failure, ISO 8601
  std::string log_file;
};

struct LaunchResult {
  /// 0 when every worker exited 0; else the first failure's exit code (128 + signal when killed),
  /// or 128 + signal when the launcher itself was interrupted.
  int exit_code = 0;
  std::optional<WorkerFailure> first_failure;
  int interrupted_by = 0;  ///< signal that interrupted the launcher, 0 if none
  /// SIGINT or SIGTERM received at any time, also while stopping after a worker's failure: the
  /// launcher then does not restart (--max-restarts), as torchrun stops on a signal.
  int signal_received = 0;
  /// The summary printed on failure; empty on success.
  std::string summary;
  /// Restarts made (max_restarts), and the first failure of each attempt that failed.
  int restarts = 0;
  std::vector<WorkerFailure> failures;
  /// Elastic jobs: why the workers of the last attempt were stopped for a new rendezvous round
  /// ("" when they were not).
  std::string stopped_for;
  /// Elastic jobs: rendezvous rounds this node took part in.
  int rounds = 0;
};

/// Checks the options (throws c10::Error with one line for bad input: nproc_per_node < 1, a
/// missing or non-executable program, nnodes > 1 without master_addr, node_rank out of range,
/// duplicate or negative devices, more workers than this process's open files or this user's,
/// this cgroup's or this system's processes allow), then runs the job. When the workers need more
/// open files in this process than its soft limit, it is raised up to the hard limit for the job
/// (the workers keep the one from before).
LaunchResult launch(const LaunchOptions& options);

/// "0,1,3" or "cuda:0,cuda:1,cuda:3" -> {0, 1, 3}, physical GPU indices either way (they become
/// CUDA_VISIBLE_DEVICES); throws on non-numbers, negatives, duplicates and empty entries.
std::vector<int> parse_device_list(const std::string& text);

/// The paratrain CLI's `launch --from-mpirun`: mpirun started this process as rank `rank` of
/// `world_size`, and it runs that rank's one worker with torchrun's environment. Programs call
/// launch() instead: with backend "mpi" it starts mpirun and these shims itself.
LaunchResult launch_mpirun_rank(const LaunchOptions& options, int rank, int world_size);

/// {0, 1, 3} -> "0,1,3".
std::string format_device_list(const std::vector<int>& devices);

/// Resolves a program name like execvp would; "" when it cannot be run.
std::string find_program(const std::string& name);

/// A TCP port on 127.0.0.1 that was free a moment ago.
int pick_free_port();

}  // namespace dist
}  // namespace paratrain
