// paratrain bench cluster: what leaving one machine costs, and what SyncBatchNorm and ZeRO cost.
//
// In one invocation, side by side, each configuration `--repeats` times (rows carry the median):
//  - DDP step time of 2 ranks on one host against 2 ranks on two hosts (1 rank each), on gloo and
//    mpi, for the mlp (batch 64 per rank) and a CIFAR ResNet-18 (batch 16 per rank). The hosts
//    are network namespaces joined by a bridge (bench/fake_hosts.h; needs root), so "two hosts"
//    measures the cost of a network path (veth, bridge, TCP) instead of loopback or shared memory
//    on one machine; it cannot model a slower physical link.
//  - SyncBatchNorm's step time against plain BatchNorm (ResNet-18, 2 ranks, one host).
//  - ZeroRedundancyOptimizer against DDP's unsharded optimizer (ResNet-18, Adam, 2 ranks): the
//    optimizer-state bytes per rank (the largest rank's) and the step time.
// A step is zero_grad + forward + loss + backward + optimizer step on a fixed random batch; each
// process takes the median of its timed steps and a configuration reports the slowest process.
//
// --json: one object per row. Step-time rows: workload, backend, hosts, ranks, step_seconds (and
// sync_bn). Optimizer rows: system (ddp or zero), ranks, optimizer_state_bytes, step_seconds.

#include "args.h"
#include "bench_util.h"
#include "commands.h"
#include "fake_hosts.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>

namespace paratrain {
namespace cli {
namespace {

using Clock = std::chrono::steady_clock;

// Starts argv (an absolute program) with `env` added to this process's environment; its output
// goes where ours goes.
pid_t start_with_env(const std::vector<std::string>& argv,
                     const std::map<std::string, std::string>& env) {
  std::vector<std::string> vars;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var = *e;
    if (!env.count(var.substr(0, var.find('=')))) {
      vars.push_back(var);
    }
  }
  for (const auto& kv : env) {
    vars.push_back(kv.first + "=" + kv.second);
  }
  std::vector<char*> args, envp;
  for (const auto& a : argv) {
    args.push_back(const_cast<char*>(a.c_str()));
  }
  args.push_back(nullptr);
  for (const auto& v : vars) {
    envp.push_back(const_cast<char*>(v.c_str()));
  }
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  if (pid < 0) {
    throw std::runtime_error("cannot start " + argv[0] + ": " + std::strerror(errno));
  }
  return pid;
}

int wait_for(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int run_cluster_worker(const Args& args) {
  torch::set_num_threads(1);
  const Workload w = workload(args.get("workload"), args.get_int("steps", 0));
  const std::string system = args.get("system", "ddp");  // ddp, syncbn, zero
  auto pg = dist::init_process_group();
  torch::manual_seed(0);
  auto model = models::make(w.model);
  if (system == "syncbn") {
    convert_sync_batchnorm(model.ptr(), pg);
  }
  DistributedDataParallel ddp(model, pg);
  const bool adam = args.has("adam");
  auto make = [adam](std::vector<torch::optim::OptimizerParamGroup> groups)
      -> std::unique_ptr<torch::optim::Optimizer> {
    if (adam) {
      return std::make_unique<torch::optim::Adam>(std::move(groups),
                                                  torch::optim::AdamOptions(1e-3));
    }
    return std::make_unique<torch::optim::SGD>(std::move(groups),
                                               torch::optim::SGDOptions(0.01).momentum(0.9));
  };
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (system == "zero") {
    opt = std::make_unique<ZeroRedundancyOptimizer>(model->parameters(), make, pg);
  } else {
    opt = make({torch::optim::OptimizerParamGroup(model->parameters())});
  }
  torch::Tensor x = torch::randn(w.shape);
  torch::Tensor y = torch::randint(0, 10, {w.batch});
  std::vector<double> times;
  for (int step = 0; step < w.warmup + w.steps; ++step) {
    pg->barrier()->wait();
    auto t0 = Clock::now();
    opt->zero_grad();
    torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
    opt->step();
    if (step >= w.warmup) {
      times.push_back(seconds_since(t0));
    }
  }
  int64_t state = 0;
  if (auto* zero = dynamic_cast<ZeroRedundancyOptimizer*>(opt.get())) {
    state = zero->state_bytes();
  } else {
    for (const auto& item : optimizer_state(*opt)) {
      state += static_cast<int64_t>(item.second.nbytes());
    }
  }
  at::Tensor stats = torch::tensor({median(times), static_cast<double>(state)}, torch::kDouble);
  pg->allreduce(stats, dist::ReduceOp::kMax)->wait();
  if (pg->rank() == 0) {
    std::map<std::string, std::string> row{
        {"workload", quoted(w.name)},
        {"system", quoted(system)},
        {"backend", quoted(args.get("backend-name", pg->backend_name()))},
        {"hosts", args.get("hosts", "1")},
        {"ranks", std::to_string(pg->size())},
        {"step_seconds", std::to_string(stats[0].item<double>())},
        {"optimizer_state_bytes", std::to_string(static_cast<int64_t>(stats[1].item<double>()))}};
    std::ofstream(args.get("out"), std::ios::app) << row_json(row) << std::endl;
  }
  return 0;
}

// Runs `worker` on 2 ranks: on one host, or 1 rank on each of two fake hosts.
void run_config(const std::vector<std::string>& worker,
                const std::string& backend,
                int hosts,
                const std::string& out) {
  if (hosts == 1) {
    run_bench_job(worker, 2, backend, out);
    return;
  }
  FakeHosts fake(2);
  const std::string cli = self_path();
  std::vector<std::string> argv;
  // A failed peer ends the other host's ranks at this timeout rather than the default 5 minutes.
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", "1"}, {"PARATRAIN_TIMEOUT", "120"}};
  if (backend == "mpi") {
    for (const auto& kv : fake.mpirun_env()) {
      env[kv.first] = kv.second;
    }
    argv = fake.exec(0, {cli, "launch", "--backend", "mpi", "--hostfile", fake.write_hostfile(1),
                         "--nproc-per-node", "1", "--"});
    argv.insert(argv.end(), worker.begin(), worker.end());
    if (wait_for(start_with_env(argv, env)) != 0) {
      throw std::runtime_error("a benchmark job across two hosts (mpi) failed");
    }
    return;
  }
  std::vector<pid_t> pids;
  for (int k = 0; k < 2; ++k) {
    std::vector<std::string> host =
        fake.exec(k, {cli, "launch", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
                      std::to_string(k), "--master-addr", fake.address(0), "--master-port", "29500",
                      "--backend", backend, "--"});
    host.insert(host.end(), worker.begin(), worker.end());
    pids.push_back(start_with_env(host, env));
  }
  int failed = 0;
  for (pid_t pid : pids) {
    failed += wait_for(pid) != 0;
  }
  if (failed) {
    throw std::runtime_error("a benchmark job across two hosts (" + backend + ") failed");
  }
}

struct Measured {
  std::map<std::string, std::vector<double>> step;
  std::map<std::string, std::string> row;  // the last row of each configuration
  std::map<std::string, double> state;
};

void print_table(const std::vector<std::string>& keys, Measured& m) {
  std::cout << std::left << std::setw(34) << "configuration" << std::right << std::setw(12)
            << "step (ms)" << std::setw(14) << "state/rank"
            << "\n";
  for (const auto& k : keys) {
    std::cout << std::left << std::setw(34) << k << std::right << std::setw(12) << std::fixed
              << std::setprecision(1) << 1000 * median(m.step[k]) << std::setw(14)
              << static_cast<int64_t>(m.state[k]) << "\n";
  }
}

}  // namespace

int run_bench_cluster(const std::vector<std::string>& argv) {
  static const CommandSpec spec{
      "paratrain bench cluster",
      "DDP across two (namespace) hosts against one host, SyncBatchNorm's overhead, and ZeRO's\n"
      "optimizer-state bytes per rank and step time against DDP. Needs root (network\n"
      "namespaces) for the two-host rows.",
      {
          {"workloads", "LIST", "mlp, resnet18 (default both)"},
          {"backends", "LIST", "gloo, mpi (default both, mpi when built)"},
          {"repeats", "N", "runs of each configuration (default 3); rows hold the median"},
          {"steps", "N", "timed steps per run"},
          {"json", "", "print JSON rows"},
          {"worker", "", ""},
          {"workload", "W", ""},
          {"system", "S", ""},
          {"hosts", "H", ""},
          {"backend-name", "B", ""},
          {"adam", "", ""},
          {"out", "FILE", ""},
      }};
  Args args(argv, spec);
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  if (args.has("worker")) {
    return run_cluster_worker(args);
  }
  const std::string why = FakeHosts::unavailable_reason();
  if (!why.empty()) {
    throw UsageError("bench cluster makes two hosts as network namespaces: " + why);
  }
  const std::vector<std::string> workloads = bench_workloads(args);
  std::vector<std::string> backends = split_list(args.get("backends", ""));
  if (backends.empty()) {
    backends = {"gloo"};
    for (const auto& b : dist::available_backends()) {
      if (b == "mpi") {
        backends.push_back("mpi");
      }
    }
  }
  for (const auto& b : backends) {
    if (b != "gloo" && b != "mpi") {
      throw UsageError("--backends: '" + b + "' is not gloo or mpi");
    }
  }
  const int repeats = args.get_int("repeats", 3);
  if (repeats < 1) {
    throw UsageError("--repeats must be at least 1, got " + std::to_string(repeats));
  }
  const bool json = args.has("json");
  const std::string out = results_file("cluster");
  Measured m;
  std::vector<std::string> order;
  auto measure = [&](const std::string& key, std::vector<std::string> worker,
                     const std::string& backend, int hosts) {
    worker.insert(worker.end(),
                  {"--out", out, "--hosts", std::to_string(hosts), "--backend-name", backend});
    if (args.has("steps")) {
      worker.insert(worker.end(), {"--steps", args.get("steps")});
    }
    if (!json) {
      std::cerr << "measuring " << key << "..." << std::endl;
    }
    std::remove(out.c_str());
    run_config(worker, backend, hosts, out);
    std::ifstream in(out);
    std::string line;
    std::getline(in, line);
    m.step[key].push_back(std::stod(json_field(line, "step_seconds")));
    m.state[key] = std::stod(json_field(line, "optimizer_state_bytes"));
    m.row[key] = line;
    if (std::find(order.begin(), order.end(), key) == order.end()) {
      order.push_back(key);
    }
  };
  const std::vector<std::string> self{self_path(), "bench", "cluster", "--worker"};
  for (int rep = 0; rep < repeats; ++rep) {
    // Interleaved, so that the machine's drift hits every configuration alike.
    for (const auto& w : workloads) {
      for (const auto& b : backends) {
        for (int hosts : {1, 2}) {
          auto worker = self;
          worker.insert(worker.end(), {"--workload", w, "--system", "ddp"});
          measure(w + " " + b + " " + std::to_string(hosts) + "host", worker, b, hosts);
        }
        if (b == "mpi") {
          // Open MPI pairs ranks on one host over shared memory and ranks on two hosts over TCP:
          // the same transport on one host tells the network path's cost from the transport's.
          ::setenv("OMPI_MCA_btl", "self,tcp", 1);
          auto worker = self;
          worker.insert(worker.end(), {"--workload", w, "--system", "ddp"});
          measure(w + " mpi 1host tcp", worker, b, 1);
          ::unsetenv("OMPI_MCA_btl");
        }
      }
    }
    for (const std::string system : {"ddp", "syncbn"}) {
      auto worker = self;
      worker.insert(worker.end(), {"--workload", "resnet18", "--system", system});
      measure("resnet18 gloo 1host " + std::string(system == "ddp" ? "bn" : "syncbn"), worker,
              "gloo", 1);
    }
    for (const std::string system : {"ddp", "zero"}) {
      auto worker = self;
      worker.insert(worker.end(), {"--workload", "resnet18", "--system", system, "--adam"});
      measure("resnet18 adam " + system, worker, "gloo", 1);
    }
  }
  std::remove(out.c_str());
  if (json) {
    for (const auto& k : order) {
      const std::string& row = m.row[k];
      const std::string system = json_field(row, "system");
      std::map<std::string, std::string> o;
      if (k.find(" adam ") != std::string::npos) {
        o = {{"system", quoted(system)},
             {"ranks", json_field(row, "ranks")},
             {"optimizer_state_bytes", std::to_string(static_cast<int64_t>(m.state[k]))},
             {"step_seconds", std::to_string(median(m.step[k]))}};
      } else {
        o = {{"workload", quoted(json_field(row, "workload"))},
             {"backend", quoted(json_field(row, "backend"))},
             {"hosts", json_field(row, "hosts")},
             {"ranks", json_field(row, "ranks")},
             {"sync_bn", system == "syncbn" ? "true" : "false"},
             {"step_seconds", std::to_string(median(m.step[k]))}};
        if (json_field(row, "backend") == "mpi") {
          // Between the ranks: shared memory on one host unless told otherwise, TCP across hosts.
          const bool tcp = k.find(" tcp") != std::string::npos || json_field(row, "hosts") == "2";
          o["transport"] = quoted(tcp ? "tcp" : "shared memory");
        }
      }
      std::cout << row_json(o) << std::endl;
    }
    return 0;
  }
  print_table(order, m);
  std::cout << "\n";
  for (const auto& w : workloads) {
    for (const auto& b : backends) {
      const std::string one = w + " " + b + " 1host", two = w + " " + b + " 2host";
      std::cout << w << " " << b << ": two hosts / one host = " << std::setprecision(2)
                << median(m.step[two]) / median(m.step[one]) << " (target <= 1.1)";
      if (b == "mpi") {
        std::cout << "; against one host over TCP as well = "
                  << median(m.step[two]) / median(m.step[w + " mpi 1host tcp"]);
      }
      std::cout << "\n";
    }
  }
  std::cout << "SyncBatchNorm / BatchNorm step time = "
            << median(m.step["resnet18 gloo 1host syncbn"]) /
                   median(m.step["resnet18 gloo 1host bn"])
            << "\nZeRO / DDP optimizer state per rank = "
            << m.state["resnet18 adam zero"] / m.state["resnet18 adam ddp"]
            << " (target <= 0.55); step time = "
            << median(m.step["resnet18 adam zero"]) / median(m.step["resnet18 adam ddp"]) << "\n";
  return 0;
}

}  // namespace cli
}  // namespace paratrain
