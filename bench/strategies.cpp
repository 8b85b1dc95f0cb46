// paratrain bench strategies: the notes' comparison of DataParallel and DistributedDataParallel
// (time per 20 iterations), on this machine's CPUs.
//
// For each workload of `bench ddp` (mlp, batch 64 per replica; CIFAR-style ResNet-18, batch 16
// per replica) the global batch is 2x that, trained three ways, one after the other:
//   single  one process, one thread, the whole batch
//   dp      one process, paratrain::DataParallel over {cpu, cpu}: two replica threads of one
//           intra-op thread each, the whole batch scattered
//   ddp     two processes of one thread (paratrain launch, mpi backend when built), half the
//           batch each, paratrain::DistributedDataParallel
// A step is zero_grad + forward + loss + backward + SGD step on a fixed random batch; a row
// gives the median step (the slowest rank's, for ddp) and the process's peak resident memory
// (getrusage). On CPU a DataParallel process holds both replicas in one address space, so its
// row is the memory of both; a ddp row is the larger of the two ranks'.

#include "args.h"
#include "bench_util.h"
#include "commands.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

int64_t peak_rss_bytes() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;  // Linux reports KiB
}

int run_strategy_worker(const Args& args) {
  torch::set_num_threads(1);
  const std::string strategy = args.get("strategy");
  const Workload w = workload(args.get("workload"), args.get_int("steps", 0));
  dist::ProcessGroupPtr pg;
  if (strategy == "ddp") {
    pg = dist::init_process_group();
  }
  torch::manual_seed(0);
  auto model = models::make(w.model);
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<DataParallel> dp;
  std::vector<int64_t> shape = w.shape;  // per replica
  if (strategy == "ddp") {
    ddp = std::make_unique<DistributedDataParallel>(model, pg);
  } else {
    shape[0] *= 2;  // single and dp take the global batch
    if (strategy == "dp") {
      dp = std::make_unique<DataParallel>(model,
                                          std::vector<torch::Device>{torch::kCPU, torch::kCPU},
                                          DataParallelOptions().threads_per_replica(1));
    }
  }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  torch::Tensor x = torch::randn(shape);
  torch::Tensor y = torch::randint(0, 10, {shape[0]});
  std::vector<double> times;
  for (int step = 0; step < w.warmup + w.steps; ++step) {
    if (pg) {
      pg->barrier()->wait();
    }
    auto t0 = Clock::now();
    opt.zero_grad();
    auto out = ddp ? ddp->forward(x) : dp ? dp->forward(x) : model->forward(x);
    torch::nn::functional::cross_entropy(out, y).backward();
    opt.step();
    if (step >= w.warmup) {
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  double step_seconds = median(times);
  double peak = static_cast<double>(peak_rss_bytes());
  if (pg) {
    at::Tensor t = torch::tensor({step_seconds, peak}, torch::kDouble);
    pg->allreduce(t, dist::ReduceOp::kMax)->wait();
    step_seconds = t[0].item<double>();
    peak = t[1].item<double>();
  }
  if (!pg || pg->rank() == 0) {
    std::ofstream out(args.get("out"), std::ios::app);
    out << row_json({{"workload", quoted(w.name)},
                     {"strategy", quoted(strategy)},
                     {"processes", strategy == "ddp" ? "2" : "1"},
                     {"replicas", strategy == "single" ? "1" : "2"},
                     {"global_batch", std::to_string(w.batch * 2)},
                     {"step_seconds", std::to_string(step_seconds)},
                     {"seconds_per_20_iterations", std::to_string(20 * step_seconds)},
                     {"peak_memory_bytes", std::to_string(static_cast<int64_t>(peak))},
                     {"steps", std::to_string(times.size())}})
        << std::endl;
  }
  return 0;
}

}  // namespace

int run_bench_strategies(const std::vector<std::string>& argv) {
  Args args(argv, {"workloads", "steps", "strategy", "workload", "out", "backend"},
            {"json", "help", "worker"});
  if (args.has("help")) {
    std::cout << "usage: paratrain bench strategies [--workloads mlp,resnet18] [--steps N]\n"
                 "         [--backend mpi|gloo] [--json]\n";
    return 0;
  }
  if (args.has("worker")) {
    return run_strategy_worker(args);
  }
  std::vector<std::string> workloads;
  {
    std::stringstream s(args.get("workloads", "mlp,resnet18"));
    for (std::string w; std::getline(s, w, ',');) {
      workload(w, 0);  // validates
      workloads.push_back(w);
    }
  }
  auto backends = dist::available_backends();
  const std::string backend = args.get(
      "backend",
      std::find(backends.begin(), backends.end(), "mpi") != backends.end() ? "mpi" : "gloo");
  const bool json = args.has("json");
  char tmpl[] = "/tmp/paratrain-bench-strategies-XXXXXX";
  int fd = ::mkstemp(tmpl);
  if (fd < 0) {
    throw std::runtime_error("cannot create a temporary file for the results");
  }
  ::close(fd);
  const std::string out = tmpl;
  const std::vector<std::string> strategies{"single", "dp", "ddp"};
  for (const auto& name : workloads) {
    for (const auto& strategy : strategies) {
      if (!json) {
        std::cerr << "measuring " << name << ": " << strategy << "..." << std::endl;
      }
      std::vector<std::string> command{self_path(),  "bench", "strategies", "--worker",
                                       "--workload", name,    "--strategy", strategy,
                                       "--out",      out};
      if (args.has("steps")) {
        command.insert(command.end(), {"--steps", args.get("steps")});
      }
      dist::LaunchOptions o;
      o.nproc_per_node(strategy == "ddp" ? 2 : 1)
          .standalone(true)
          .command(command)
          .env({{"OMP_NUM_THREADS", "1"}});
      if (strategy == "ddp") {
        o.backend(backend).mpi_shim({self_path(), "launch", "--from-mpirun"});
      }
      dist::LaunchResult r = dist::launch(o);
      if (r.exit_code != 0) {
        std::remove(out.c_str());
        throw std::runtime_error("a benchmark job failed: " + r.summary);
      }
    }
  }
  std::ifstream in(out);
  std::map<std::pair<std::string, std::string>, std::string> rows;
  for (std::string line; std::getline(in, line);) {
    rows[{json_field(line, "workload"), json_field(line, "strategy")}] = line;
  }
  std::remove(out.c_str());
  for (const auto& name : workloads) {
    const double single = std::stod(json_field(rows[{name, "single"}], "step_seconds"));
    const double ddp = std::stod(json_field(rows[{name, "ddp"}], "step_seconds"));
    if (json) {
      for (const auto& strategy : strategies) {
        std::string line = rows[{name, strategy}];
        const double s = std::stod(json_field(line, "step_seconds"));
        line.pop_back();
        line += ", \"speedup_vs_single\": " + std::to_string(single / s) +
                ", \"ratio_to_ddp\": " + std::to_string(s / ddp) + "}";
        std::cout << line << "\n";
      }
      continue;
    }
    const Workload w = workload(name, 0);
    std::cout << name << " (global batch " << 2 * w.batch << ", 1 thread per replica/rank):\n"
              << "  strategy  ms/step  s/20 iter  speedup  vs ddp  peak memory\n";
    for (const auto& strategy : strategies) {
      const std::string& line = rows[{name, strategy}];
      const double s = std::stod(json_field(line, "step_seconds"));
      const double mem = std::stod(json_field(line, "peak_memory_bytes"));
      std::cout << "  " << std::left << std::setw(8) << strategy << std::right << std::fixed
                << std::setprecision(1) << std::setw(9) << s * 1e3 << std::setprecision(2)
                << std::setw(11) << 20 * s << std::setw(8) << single / s << "x" << std::setw(7)
                << s / ddp << "x" << std::setprecision(0) << std::setw(9) << mem / (1 << 20)
                << " MiB" << (strategy == "ddp" ? " per rank" : "") << "\n";
    }
  }
  std::cout.flush();
  return 0;
}

}  // namespace cli
}  // namespace paratrain
