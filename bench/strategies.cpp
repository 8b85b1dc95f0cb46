// paratrain bench strategies: DataParallel against DistributedDataParallel and a single process
// (time per 20 iterations, speedup, peak memory), on this machine's CPUs.
//
// For each workload of `bench ddp` (mlp, batch 64 per replica; CIFAR-style ResNet-18, batch 16
// per replica; or the zoo's CNN, batch 32 per replica, with --workloads cnn) the global batch is
// 2x that, trained three ways, one after the other:
//   single  one process, one thread, the whole batch
//   dp      one process, paratrain::DataParallel over {cpu, cpu}: two replica threads of one
//           intra-op thread each, the whole batch scattered
//   ddp     two processes of one thread (paratrain launch, mpi backend when built), half the
//           batch each, paratrain::DistributedDataParallel
// A step is zero_grad + forward + loss + backward + SGD step on a fixed random batch; a row
// gives the median step (the slowest rank's, for ddp) and the peak memory per replica or rank
// (Note [Memory per replica]), plus each process's peak resident memory (getrusage).
//
// Note [Memory per replica]
// On CPU the two DataParallel replicas share one address space, so memory is attributed by the
// thread that allocates: libtorch's CPU allocator reports every allocation and free to the
// MemoryReportingInfoBase in the thread's debug info while memory profiling is on (the hook its
// profiler uses), and paratrain's replica threads inherit the caller's debug info. Allocations of
// the caller's thread (the module's parameters and gradients, the gathered output, the loss, the
// optimizer) count for replica 0, which is where they live on GPUs too (devices[0]); each
// replica thread marks itself in the forward function. The clone's parameters and buffers are
// allocated by the caller when DataParallel is built and are moved to replica 1's account then.
// peak_memory_bytes is the largest replica's (or rank's) peak of live tensor bytes.

#include "args.h"
#include "bench_util.h"
#include "commands.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <unordered_map>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

int64_t peak_rss_bytes() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;  // Linux reports KiB
}

// Which replica the current thread works for (Note [Memory per replica]); 0 for the caller.
thread_local int t_replica = 0;

// reportMemoryUsage's two totals are int64_t in libtorch 1.13 and size_t in 2.x: take whatever
// type this libtorch declares.
template <typename Method>
struct TotalsOf;
template <typename C, typename R, typename P, typename B, typename T, typename D>
struct TotalsOf<R (C::*)(P, B, T, T, D)> {
  using type = T;
};
using Totals = TotalsOf<decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage)>::type;

class ReplicaMemory : public c10::MemoryReportingInfoBase {
 public:
  explicit ReplicaMemory(int replicas) : current_(replicas, 0), peak_(replicas, 0) {}

  void reportMemoryUsage(void* ptr, int64_t bytes, Totals, Totals, c10::Device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes > 0) {
      const size_t r = static_cast<size_t>(t_replica);
      live_[ptr] = {r, bytes};
      current_[r] += bytes;
      peak_[r] = std::max(peak_[r], current_[r]);
      return;
    }
    auto it = live_.find(ptr);
    if (it != live_.end()) {
      current_[it->second.first] -= it->second.second;
      live_.erase(it);
    }
  }
  bool memoryProfilingEnabled() const override { return true; }

  // Moves `bytes` still live from one replica's account to another's, and restarts the peaks.
  void transfer(size_t from, size_t to, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    current_[from] -= bytes;
    current_[to] += bytes;
    peak_ = current_;
  }
  std::vector<int64_t> peaks() {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, std::pair<size_t, int64_t>> live_;
  std::vector<int64_t> current_;
  std::vector<int64_t> peak_;
};

int run_strategy_worker(const Args& args) {
  torch::set_num_threads(1);
  const int replicas_here = args.get("strategy") == "dp" ? 2 : 1;
  auto memory = std::make_shared<ReplicaMemory>(replicas_here);
  c10::DebugInfoGuard track(c10::DebugInfoKind::PROFILER_STATE, memory);
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
      dp = std::make_unique<DataParallel>(
          model.ptr(),
          [&model](torch::nn::Module& m, const torch::Tensor& input) {
            t_replica = &m == model.ptr().get() ? 0 : 1;  // this thread's account
            return dynamic_cast<torch::nn::SequentialImpl&>(m).forward(input);
          },
          std::vector<torch::Device>{torch::kCPU, torch::kCPU},
          DataParallelOptions().threads_per_replica(1));
      int64_t clone_bytes = 0;
      for (const auto& t : model->parameters()) {
        clone_bytes += t.numel() * static_cast<int64_t>(t.element_size());
      }
      for (const auto& t : model->buffers()) {
        clone_bytes += t.numel() * static_cast<int64_t>(t.element_size());
      }
      memory->transfer(0, 1, clone_bytes);
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
      times.push_back(seconds_since(t0));
    }
  }
  double step_seconds = median(times);
  const std::vector<int64_t> peaks = memory->peaks();
  double rss = static_cast<double>(peak_rss_bytes());
  double peak = static_cast<double>(*std::max_element(peaks.begin(), peaks.end()));
  if (pg) {
    at::Tensor t = torch::tensor({step_seconds, peak, rss}, torch::kDouble);
    pg->allreduce(t, dist::ReduceOp::kMax)->wait();
    step_seconds = t[0].item<double>();
    peak = t[1].item<double>();
    rss = t[2].item<double>();
  }

  if (!pg || pg->rank() == 0) {
    std::ofstream out(args.get("out"), std::ios::app);
    std::map<std::string, std::string> row{
        {"workload", quoted(w.name)},
        {"strategy", quoted(strategy)},
        {"processes", strategy == "ddp" ? "2" : "1"},
        {"replicas", strategy == "single" ? "1" : "2"},
        {"global_batch", std::to_string(w.batch * 2)},
        {"step_seconds", std::to_string(step_seconds)},
        {"seconds_per_20_iterations", std::to_string(20 * step_seconds)},
        {"peak_memory_bytes", std::to_string(static_cast<int64_t>(peak))},
        {"peak_rss_bytes", std::to_string(static_cast<int64_t>(rss))},
        {"steps", std::to_string(times.size())}};
    if (peaks.size() > 1) {
      for (size_t i = 0; i < peaks.size(); ++i) {
        row["peak_memory_replica" + std::to_string(i) + "_bytes"] = std::to_string(peaks[i]);
      }
    }
    out << row_json(row) << std::endl;
  }
  return 0;
}

}  // namespace

int run_bench_strategies(const std::vector<std::string>& argv) {
  static const CommandSpec spec{
      "paratrain bench strategies",
      "One process against DataParallel against DDP: step time and peak memory.",
      {
          {"workloads", "LIST", "mlp, resnet18, cnn (default mlp,resnet18)"},
          {"steps", "N", "timed steps per workload"},
          {"backend", "NAME", "mpi or gloo"},
          {"json", "", "print JSON"},
          {"worker", "", ""},
          {"strategy", "S", ""},
          {"workload", "W", ""},
          {"out", "FILE", ""},
      }};
  Args args(argv, spec);
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  if (args.has("worker")) {
    return run_strategy_worker(args);
  }
  const std::vector<std::string> workloads = bench_workloads(args);
  const std::string backend = bench_backend(args);
  const bool json = args.has("json");
  const std::string out = results_file("strategies");
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
      run_bench_job(command, strategy == "ddp" ? 2 : 1, strategy == "ddp" ? backend : "", out);
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
              << "  strategy  ms/step  s/20 iter  speedup  vs ddp  peak tensor memory "
                 "(process RSS)\n";
    for (const auto& strategy : strategies) {
      const std::string& line = rows[{name, strategy}];
      const double s = std::stod(json_field(line, "step_seconds"));
      const double mib = 1 << 20;
      std::ostringstream mem;
      mem << std::fixed << std::setprecision(0);
      if (strategy == "dp") {
        mem << std::stod(json_field(line, "peak_memory_replica0_bytes")) / mib << " + "
            << std::stod(json_field(line, "peak_memory_replica1_bytes")) / mib
            << " MiB (replica 0 + 1)";
      } else {
        mem << std::stod(json_field(line, "peak_memory_bytes")) / mib << " MiB"
            << (strategy == "ddp" ? " per rank" : "");
      }
      mem << " (" << std::stod(json_field(line, "peak_rss_bytes")) / mib << " MiB)";
      std::cout << "  " << std::left << std::setw(8) << strategy << std::right << std::fixed
                << std::setprecision(1) << std::setw(9) << s * 1e3 << std::setprecision(2)
                << std::setw(11) << 20 * s << std::setw(8) << single / s << "x" << std::setw(7)
                << s / ddp << "x  " << mem.str() << "\n";
    }
  }
  std::cout.flush();
  return 0;
}

}  // namespace cli
}  // namespace paratrain
