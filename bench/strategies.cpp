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
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"
#include "tensor_memory.h"

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

const BenchSpec& strategies_spec() {
  static const BenchSpec spec{
      "strategies",
      "One process against DataParallel against DDP: step time and peak memory.",
      {
          {"workloads", "LIST", "mlp, resnet18, cnn (default mlp,resnet18)", "mlp"},
          {"steps", "N", "timed steps per workload", "1"},
          {"backend", "NAME", "mpi or gloo"},
          {"strategy", "S", kInternalOption},
          {"workload", "W", kInternalOption},
      },
      "print JSON",
      /*workers=*/true};
  return spec;
}

// DataParallel over {cpu, cpu}, each replica thread keeping its own memory account; the clone's
// parameters and buffers, allocated here, move to replica 1's (Note [Memory per replica]).
std::unique_ptr<DataParallel> make_data_parallel(torch::nn::Sequential& model,
                                                 ReplicaMemory& memory) {
  auto dp = std::make_unique<DataParallel>(
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
  memory.transfer(0, 1, clone_bytes);
  return dp;
}

// What one strategy measured: the median step (the slowest rank's for ddp), the largest replica's
// (or rank's) peak tensor memory, each replica's, and the peak resident memory.
struct StrategyNumbers {
  double step_seconds = 0;
  double peak = 0;
  double rss = 0;
  std::vector<int64_t> peaks;
  size_t steps = 0;
};

JsonRow strategy_row(const Workload& w, const std::string& strategy, const StrategyNumbers& n) {
  JsonRow row{{"workload", w.name},
              {"strategy", strategy},
              {"processes", strategy == "ddp" ? 2 : 1},
              {"replicas", strategy == "single" ? 1 : 2},
              {"global_batch", w.batch * 2},
              {"step_seconds", n.step_seconds},
              {"seconds_per_20_iterations", 20 * n.step_seconds},
              {"peak_memory_bytes", static_cast<int64_t>(n.peak)},
              {"peak_rss_bytes", static_cast<int64_t>(n.rss)},
              {"steps", n.steps}};
  if (n.peaks.size() > 1) {
    for (size_t i = 0; i < n.peaks.size(); ++i) {
      row["peak_memory_replica" + std::to_string(i) + "_bytes"] = n.peaks[i];
    }
  }
  return row;
}

int run_strategy_worker(const Bench& bench) {
  torch::set_num_threads(1);
  const std::string strategy = bench.get("strategy");
  auto memory = std::make_shared<ReplicaMemory>(strategy == "dp" ? 2 : 1);
  c10::DebugInfoGuard track(c10::DebugInfoKind::PROFILER_STATE, memory);
  const Workload w = bench_workload(bench.get("workload"), bench);
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
      dp = make_data_parallel(model, *memory);
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
  StrategyNumbers n{median(times), 0, static_cast<double>(peak_rss_bytes()), memory->peaks(),
                    times.size()};
  n.peak = static_cast<double>(*std::max_element(n.peaks.begin(), n.peaks.end()));
  if (pg) {
    at::Tensor t = torch::tensor({n.step_seconds, n.peak, n.rss}, torch::kDouble);
    pg->allreduce(t, dist::ReduceOp::kMax)->wait();
    n.step_seconds = t[0].item<double>();
    n.peak = t[1].item<double>();
    n.rss = t[2].item<double>();
  }
  if (!pg || pg->rank() == 0) {
    append_row(bench.get("out"), strategy_row(w, strategy, n));
  }
  return 0;
}

const std::vector<std::string> kStrategies{"single", "dp", "ddp"};

// Every (workload, strategy), one job after the other: the rows by (workload, strategy).
std::map<std::pair<std::string, std::string>, JsonRow> measure_strategies(
    const Bench& bench, const std::vector<std::string>& workloads) {
  const std::string backend = bench_backend(bench);
  const std::string out = results_file("strategies");
  for (const auto& name : workloads) {
    for (const auto& strategy : kStrategies) {
      bench.progress("measuring " + name + ": " + strategy + "...");
      std::vector<std::string> extra{"--workload", name, "--strategy", strategy};
      for (const auto& word : bench.forwarded({"steps"})) {
        extra.push_back(word);
      }
      run_bench_job(bench.worker_command(out, extra), strategy == "ddp" ? 2 : 1,
                    strategy == "ddp" ? backend : "", out);
    }
  }
  std::map<std::pair<std::string, std::string>, JsonRow> rows;
  for (const JsonRow& row : read_rows(out)) {
    rows[{string_field(row, "workload"), string_field(row, "strategy")}] = row;
  }
  std::remove(out.c_str());
  return rows;
}

// One strategy's line of the table: its step, speedups, and peak memory per replica or rank.
void print_strategy_line(const std::string& strategy,
                         const JsonRow& row,
                         double single,
                         double ddp) {
  const double s = number_field(row, "step_seconds");
  const double mib = 1 << 20;
  std::ostringstream mem;
  mem << std::fixed << std::setprecision(0);
  if (strategy == "dp") {
    mem << number_field(row, "peak_memory_replica0_bytes") / mib << " + "
        << number_field(row, "peak_memory_replica1_bytes") / mib << " MiB (replica 0 + 1)";
  } else {
    mem << number_field(row, "peak_memory_bytes") / mib << " MiB"
        << (strategy == "ddp" ? " per rank" : "");
  }
  mem << " (" << number_field(row, "peak_rss_bytes") / mib << " MiB)";
  std::cout << "  " << std::left << std::setw(8) << strategy << std::right << std::fixed
            << std::setprecision(1) << std::setw(9) << s * 1e3 << std::setprecision(2)
            << std::setw(11) << 20 * s << std::setw(8) << single / s << "x" << std::setw(7)
            << s / ddp << "x  " << mem.str() << "\n";
}

int run_strategies(const Bench& bench) {
  const std::vector<std::string> workloads = bench_workloads(bench);
  auto rows = measure_strategies(bench, workloads);
  for (const auto& name : workloads) {
    const double single = number_field(rows[{name, "single"}], "step_seconds");
    const double ddp = number_field(rows[{name, "ddp"}], "step_seconds");
    if (bench.json()) {
      for (const auto& strategy : kStrategies) {
        JsonRow row = rows[{name, strategy}];
        const double s = number_field(row, "step_seconds");
        row["speedup_vs_single"] = single / s;
        row["ratio_to_ddp"] = s / ddp;
        print_row(row);
      }
      continue;
    }
    const Workload w = bench_workload(name, bench);
    std::cout << name << " (global batch " << 2 * w.batch << ", 1 thread per replica/rank):\n"
              << "  strategy  ms/step  s/20 iter  speedup  vs ddp  peak tensor memory "
                 "(process RSS)\n";
    for (const auto& strategy : kStrategies) {
      print_strategy_line(strategy, rows[{name, strategy}], single, ddp);
    }
  }
  std::cout.flush();
  return 0;
}

}  // namespace

int run_bench_strategies(const std::vector<std::string>& argv) {
  return run_benchmark(strategies_spec(), argv, run_strategies, run_strategy_worker);
}

}  // namespace cli
}  // namespace paratrain
