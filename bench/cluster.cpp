// paratrain bench cluster: what leaving one machine costs, and what SyncBatchNorm and ZeRO cost.
//
// In one invocation, side by side, each configuration `--repeats` times (rows carry the median):
//  - DDP step time of 2 ranks on one host against 2 ranks on two hosts (1 rank each), on gloo and
//    mpi, for the mlp (batch 64 per rank) and a CIFAR ResNet-18 (batch 16 per rank). The hosts
//    are network namespaces joined by a bridge (tests/support/fake_hosts.h; needs root), so "two
//    hosts" measures the cost of a network path (veth, bridge, TCP) instead of loopback or shared
//    memory on one machine; it cannot model a slower physical link.
//  - SyncBatchNorm's step time against plain BatchNorm (ResNet-18, 2 ranks, one host).
//  - ZeroRedundancyOptimizer against DDP's unsharded optimizer (ResNet-18, Adam, 2 ranks): the
//    optimizer-state bytes per rank (the largest rank's) and the step time.
// A step is zero_grad + forward + loss + backward + optimizer step on a fixed random batch; each
// process takes the median of its timed steps and a configuration reports the slowest process.
//
// --json: one object per row. Step-time rows: workload, backend, hosts, ranks, step_seconds (and
// sync_bn). Optimizer rows: system (ddp or zero), ranks, optimizer_state_bytes, step_seconds.
// Where hosts cannot be made (not root, no `ip netns`), it says so in one line and measures
// nothing (exit 0): the one-host rows alone would not answer what it asks.

#include "args.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "commands.h"
#include "fake_hosts.h"
#include "harness.h"

#include "paratrain/base/child_process.h"
#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <unistd.h>

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
// goes where ours goes. The child stays in our process group and outlives us if we die (no death
// signal), as when this was a plain fork and execve.
ChildProcess start_with_env(const std::vector<std::string>& argv,
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
  return ChildProcess(ChildOptions(argv)
                          .inherit_environment(false)
                          .environment(vars)
                          .own_process_group(false)
                          .die_with_parent(false));
}

int run_cluster_worker(const Bench& bench) {
  torch::set_num_threads(1);
  const Workload w = bench_workload(bench.get("workload"), bench);
  const std::string system = bench.get("system", "ddp");  // ddp, syncbn, zero
  auto pg = dist::init_process_group();
  torch::manual_seed(0);
  auto model = models::make(w.model);
  if (system == "syncbn") {
    convert_sync_batchnorm(model.ptr(), pg);
  }
  DistributedDataParallel ddp(model, pg);
  const bool adam = bench.has("adam");
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
    append_row(bench.get("out"),
               {{"workload", w.name},
                {"system", system},
                {"backend", bench.get("backend-name", pg->backend_name())},
                {"hosts", bench.get_int("hosts", 1)},
                {"ranks", pg->size()},
                {"step_seconds", stats[0].item<double>()},
                {"optimizer_state_bytes", static_cast<int64_t>(stats[1].item<double>())}});
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
  const std::string cli = paratrain_program();
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
    if (exit_code(start_with_env(argv, env).wait()) != 0) {
      throw std::runtime_error("a benchmark job across two hosts (mpi) failed");
    }
    return;
  }
  std::vector<ChildProcess> children;
  for (int k = 0; k < 2; ++k) {
    std::vector<std::string> host =
        fake.exec(k, {cli, "launch", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
                      std::to_string(k), "--master-addr", fake.address(0), "--master-port", "29500",
                      "--backend", backend, "--"});
    host.insert(host.end(), worker.begin(), worker.end());
    children.push_back(start_with_env(host, env));
  }
  int failed = 0;
  for (ChildProcess& child : children) {
    failed += exit_code(child.wait()) != 0;
  }
  if (failed) {
    throw std::runtime_error("a benchmark job across two hosts (" + backend + ") failed");
  }
}

const BenchSpec& cluster_spec() {
  static const BenchSpec spec{
      "cluster",
      "DDP across two (namespace) hosts against one host, SyncBatchNorm's overhead, and ZeRO's\n"
      "optimizer-state bytes per rank and step time against DDP. Needs root (network\n"
      "namespaces) for the two-host rows.",
      {
          {"workloads", "LIST", "mlp, resnet18 (default both)", "mlp"},
          {"backends", "LIST", "gloo, mpi (default both, mpi when built)"},
          {"repeats", "N", "runs of each configuration (default 3); rows hold the median", "1"},
          {"steps", "N", "timed steps per run", "1"},
          {"workload", "W", kInternalOption},
          {"system", "S", kInternalOption},
          {"hosts", "H", kInternalOption},
          {"backend-name", "B", kInternalOption},
          {"adam", "", kInternalOption},
      },
      "print JSON rows",
      /*workers=*/true};
  return spec;
}

// Every configuration's runs, by its key ("mlp gloo 2host"), in the order first measured.
struct Measured {
  std::vector<std::string> order;
  std::map<std::string, std::vector<double>> step;
  std::map<std::string, JsonRow> row;  // the last row of each configuration
  std::map<std::string, double> state;
};

// One run of configuration `key`: the worker (--workload, --system, ...) on 2 ranks of `backend`
// on `hosts` hosts.
void measure(const Bench& bench,
             const std::string& out,
             Measured& m,
             const std::string& key,
             std::vector<std::string> extra,
             const std::string& backend,
             int hosts) {
  extra.insert(extra.end(), {"--hosts", std::to_string(hosts), "--backend-name", backend});
  for (const auto& word : bench.forwarded({"steps"})) {
    extra.push_back(word);
  }
  bench.progress("measuring " + key + "...");
  std::remove(out.c_str());
  run_config(bench.worker_command(out, extra), backend, hosts, out);
  const std::vector<JsonRow> rows = read_rows(out);
  require(!rows.empty(), "bench cluster: the run of " + key + " wrote no row to " + out);
  m.step[key].push_back(number_field(rows.front(), "step_seconds"));
  m.state[key] = number_field(rows.front(), "optimizer_state_bytes");
  m.row[key] = rows.front();
  if (std::find(m.order.begin(), m.order.end(), key) == m.order.end()) {
    m.order.push_back(key);
  }
}

// One run of every configuration, interleaved, so that the machine's drift hits every
// configuration alike.
void measure_all_once(const Bench& bench,
                      const std::vector<std::string>& workloads,
                      const std::vector<std::string>& backends,
                      const std::string& out,
                      Measured& m) {
  for (const auto& w : workloads) {
    for (const auto& b : backends) {
      for (int hosts : {1, 2}) {
        measure(bench, out, m, w + " " + b + " " + std::to_string(hosts) + "host",
                {"--workload", w, "--system", "ddp"}, b, hosts);
      }
      if (b == "mpi") {
        // Open MPI pairs ranks on one host over shared memory and ranks on two hosts over TCP:
        // the same transport on one host tells the network path's cost from the transport's.
        ::setenv("OMPI_MCA_btl", "self,tcp", 1);
        measure(bench, out, m, w + " mpi 1host tcp", {"--workload", w, "--system", "ddp"}, b, 1);
        ::unsetenv("OMPI_MCA_btl");
      }
    }
  }
  for (const std::string system : {"ddp", "syncbn"}) {
    measure(bench, out, m, "resnet18 gloo 1host " + std::string(system == "ddp" ? "bn" : "syncbn"),
            {"--workload", "resnet18", "--system", system}, "gloo", 1);
  }
  for (const std::string system : {"ddp", "zero"}) {
    measure(bench, out, m, "resnet18 adam " + system,
            {"--workload", "resnet18", "--system", system, "--adam"}, "gloo", 1);
  }
}

void print_cluster_json(Measured& m) {
  for (const auto& k : m.order) {
    const JsonRow& row = m.row[k];
    const std::string system = string_field(row, "system");
    JsonRow o;
    if (k.find(" adam ") != std::string::npos) {
      o = {{"system", system},
           {"ranks", row.at("ranks")},
           {"optimizer_state_bytes", static_cast<int64_t>(m.state[k])},
           {"step_seconds", median(m.step[k])}};
    } else {
      o = {{"workload", string_field(row, "workload")},
           {"backend", string_field(row, "backend")},
           {"hosts", row.at("hosts")},
           {"ranks", row.at("ranks")},
           {"sync_bn", system == "syncbn"},
           {"step_seconds", median(m.step[k])}};
      if (string_field(row, "backend") == "mpi") {
        // Between the ranks: shared memory on one host unless told otherwise, TCP across hosts.
        const bool tcp = k.find(" tcp") != std::string::npos || number_field(row, "hosts") == 2;
        o["transport"] = tcp ? "tcp" : "shared memory";
      }
    }
    std::cout << json_line(o) << std::endl;
  }
}

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

void print_cluster_text(const std::vector<std::string>& workloads,
                        const std::vector<std::string>& backends,
                        Measured& m) {
  print_table(m.order, m);
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
}

int run_cluster(const Bench& bench) {
  const std::string why = FakeHosts::unavailable_reason();
  if (!why.empty()) {
    return not_available(bench, "it makes two hosts as network namespaces: " + why);
  }
  const std::vector<std::string> workloads = bench_workloads(bench);
  const std::vector<std::string> backends = cpu_backends(bench, "backends", {"gloo", "mpi"});
  const int repeats = bench.get_int("repeats", 3);
  if (repeats < 1) {
    throw UsageError("--repeats must be at least 1, got " + std::to_string(repeats));
  }
  const std::string out = results_file("cluster");
  Measured m;
  for (int rep = 0; rep < repeats; ++rep) {
    measure_all_once(bench, workloads, backends, out, m);
  }
  std::remove(out.c_str());
  if (bench.json()) {
    print_cluster_json(m);
  } else {
    print_cluster_text(workloads, backends, m);
  }
  return 0;
}

}  // namespace

int run_bench_cluster(const std::vector<std::string>& argv) {
  return run_benchmark(cluster_spec(), argv, run_cluster, run_cluster_worker);
}

}  // namespace cli
}  // namespace paratrain
