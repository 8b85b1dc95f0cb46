// paratrain bench pipeline: pipelining against plain model parallelism, in one process with two
// CPU stages of one thread each (standing in for two GPUs).
//
// Workload: ResNet-50 with a CIFAR stem (32x32 inputs, 10 classes), batch 64, SGD. The model is
// flattened to its blocks and cut in two where the measured forward + backward time balances
// (pipeline::balance_by_time on a micro-batch of 8); --balance layer2 cuts after layer2 as the
// ModelParallelResNet50 of PyTorch's model-parallel tutorial does. Rows, one after the other on
// the same model:
//   single          the unsplit model on one thread (no parallelism): the whole batch (chunks
//                   1), and the largest chunk count's micro-batches in sequence (gradient
//                   accumulation), which separates the gain of overlapping stages from the gain
//                   of smaller tensors (on this machine a batch of 64 runs slower per image
//                   than micro-batches of 8: its 64 MiB activations go through mmap each time)
//   model_parallel  the two stages, one micro-batch (chunks 1): each stage idles while the other
//                   works
//   gpipe / 1f1b    2, 4 and 8 micro-batches
// For each: images/s from the median step, and the bubble fraction: the share of stage time
// spent idle, measured as 1 - sum(stage busy time) / (stages x step time), next to the ideal
// (p - 1) / (m + p - 1) of a perfectly balanced pipeline with free communication.

#include "args.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <chrono>
#include <iomanip>
#include <iostream>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

struct PipelineRow {
  std::string mode;
  int64_t chunks;
  double step_seconds;
  double images_per_second;
  double bubble;
  double ideal_bubble;
};

const BenchSpec& pipeline_spec() {
  // --smoke: ResNet-18's ImageNet stem at 32x32 leaves 1x1 maps in layer4, so its steps cost
  // little; the smallest batch whose time-balancing micro-batch (batch / 8) still trains its
  // BatchNorm there is 16.
  static const BenchSpec spec{
      "pipeline",
      "GPipe and 1F1B micro-batching against plain model parallelism.",
      {
          {"chunks", "LIST", "the micro-batch counts (default 2,4,8)", "2"},
          {"steps", "N", "timed steps (default 3)", "1"},
          {"batch-size,batch", "B", "batch size (default 64)", "16"},
          {"balance", "MODE", "time or layer2 (default time)"},
          {"model", "NAME", "the zoo model (default resnet50_cifar)", "resnet18"},
      },
      "print JSON"};
  return spec;
}

// The model, cut in two stages, and what every row trains it on.
struct PipelineSetup {
  std::string model_name;
  torch::nn::Sequential model;  // flattened to its blocks
  std::vector<int64_t> balance;
  int64_t batch = 0;
  int steps = 0;
  std::vector<int64_t> chunk_counts;
  torch::Tensor x, y;
};

const int64_t kStages = 2;

torch::Tensor pipeline_loss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

std::vector<int64_t> chunk_counts(const Bench& bench, int64_t batch) {
  std::vector<int64_t> counts;
  std::stringstream s(bench.get("chunks", "2,4,8"));
  for (std::string c; std::getline(s, c, ',');) {
    counts.push_back(std::stoll(c));
    if (counts.back() < 1 || counts.back() > batch) {
      throw UsageError("--chunks entries must be between 1 and the batch (" +
                       std::to_string(batch) + ")");
    }
  }
  return counts;
}

// The stages' sizes: cut after layer2 (PyTorch's model-parallel tutorial), or where the measured
// forward + backward time balances.
std::vector<int64_t> stage_balance(const PipelineSetup& p, const std::string& mode) {
  if (mode == "layer2") {
    int64_t upto = 0;  // children through layer2's last block
    auto names = p.model->named_children();
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i].key().rfind("layer2_", 0) == 0) {
        upto = static_cast<int64_t>(i) + 1;
      }
    }
    return {upto, static_cast<int64_t>(p.model->size()) - upto};
  }
  return pipeline::balance_by_time(p.model, kStages, torch::randn({p.batch / 8, 3, 32, 32}));
}

PipelineSetup pipeline_setup(const Bench& bench) {
  PipelineSetup p;
  p.steps = bench.get_int("steps", 3);
  p.batch = bench.get_int("batch-size", 64);
  const std::string balance_mode = bench.get("balance", "time");
  p.model_name = bench.get("model", "resnet50_cifar");
  if (p.steps <= 0 || p.batch <= 0) {
    throw UsageError("--steps and --batch-size must be positive");
  }
  if (balance_mode != "time" && balance_mode != "layer2") {
    throw UsageError("unknown --balance '" + balance_mode + "': choose time or layer2");
  }
  p.chunk_counts = chunk_counts(bench, p.batch);
  torch::set_num_threads(1);
  set_blas_threads(1);  // every row on one thread per stage, the unsplit one included
  torch::manual_seed(0);
  p.model = pipeline::flatten(models::make(p.model_name));
  p.balance = stage_balance(p, balance_mode);
  p.x = torch::randn({p.batch, 3, 32, 32});
  p.y = torch::randint(0, 10, {p.batch});
  if (!bench.json()) {
    std::cerr << p.model_name << ", batch " << p.batch << ", " << p.model->size()
              << " layers after flattening, balance " << c10::IntArrayRef(p.balance) << " ("
              << balance_mode << "), " << p.steps << " timed steps after 1 warm-up" << std::endl;
  }
  return p;
}

// The unsplit model on one thread, `m` micro-batches one after the other (gradient accumulation).
PipelineRow measure_single(PipelineSetup& p, torch::optim::SGD& opt, int64_t m) {
  auto xs = torch::tensor_split(p.x, m);
  auto ys = torch::tensor_split(p.y, m);
  std::vector<double> times;
  for (int s = 0; s <= p.steps; ++s) {
    auto t0 = Clock::now();
    opt.zero_grad();
    for (size_t i = 0; i < static_cast<size_t>(m); ++i) {
      (pipeline_loss(p.model->forward(xs[i]), ys[i]) *
       (static_cast<double>(xs[i].size(0)) / static_cast<double>(p.batch)))
          .backward();
    }
    opt.step();
    if (s > 0) {
      times.push_back(seconds_since(t0));
    }
  }
  const double t = median(times);
  return {"single", m, t, p.batch / t, 0, 0};
}

// The two stages under `schedule` with `chunks` micro-batches.
PipelineRow measure_pipeline(PipelineSetup& p,
                             torch::optim::SGD& opt,
                             const std::string& schedule,
                             int64_t chunks) {
  pipeline::Pipeline pipe(p.model, p.balance, std::vector<torch::Device>(kStages, torch::kCPU),
                          pipeline_loss,
                          pipeline::PipelineOptions().chunks(chunks).schedule(
                              pipeline::parse_schedule(schedule == "1f1b" ? "1f1b" : "gpipe")));
  std::vector<double> times;
  std::vector<double> bubbles;
  for (int s = 0; s <= p.steps; ++s) {
    auto t0 = Clock::now();
    opt.zero_grad();
    pipe.step(p.x, p.y);
    opt.step();
    const double t = seconds_since(t0);
    if (s > 0) {
      times.push_back(t);
      double busy = 0;
      for (const auto& st : pipe.last_stats()) {
        busy += st.busy_seconds;
      }
      bubbles.push_back(1.0 - busy / (static_cast<double>(kStages) * pipe.last_step_seconds()));
    }
  }
  const double t = median(times);
  const double ideal = static_cast<double>(kStages - 1) / static_cast<double>(chunks + kStages - 1);
  return {schedule, chunks, t, p.batch / t, median(bubbles), ideal};
}

// Every row, one after the other on the same model: the unsplit model on the whole batch and on
// the largest chunk count's micro-batches in sequence (which isolates what overlapping the stages
// gains from what smaller tensors alone gain), then model_parallel, gpipe and 1f1b.
std::vector<PipelineRow> measure_rows(const Bench& bench, PipelineSetup& p) {
  torch::optim::SGD opt(p.model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  std::vector<PipelineRow> rows;
  const int64_t most = *std::max_element(p.chunk_counts.begin(), p.chunk_counts.end());
  for (int64_t m : {int64_t{1}, most}) {
    bench.progress("measuring single " + std::to_string(m) + "...");
    rows.push_back(measure_single(p, opt, m));
  }
  std::vector<std::pair<std::string, int64_t>> modes{{"model_parallel", 1}};
  for (const char* schedule : {"gpipe", "1f1b"}) {
    for (int64_t m : p.chunk_counts) {
      modes.emplace_back(schedule, m);
    }
  }
  for (const auto& mode : modes) {
    bench.progress("measuring " + mode.first + " " + std::to_string(mode.second) + "...");
    rows.push_back(measure_pipeline(p, opt, mode.first, mode.second));
  }
  return rows;
}

void print_pipeline_json(const PipelineSetup& p, const std::vector<PipelineRow>& rows) {
  const double mp = rows[2].images_per_second;
  const double sequential_chunks = rows[1].images_per_second;
  for (const auto& r : rows) {
    print_row({{"workload", p.model_name},
               {"mode", r.mode},
               {"stages", r.mode == "single" ? 1 : kStages},
               {"chunks", r.chunks},
               {"batch", p.batch},
               {"step_seconds", r.step_seconds},
               {"images_per_second", r.images_per_second},
               {"bubble_fraction", r.bubble},
               {"ideal_bubble_fraction", r.ideal_bubble},
               {"speedup_vs_model_parallel", r.images_per_second / mp},
               {"speedup_vs_sequential_chunks", r.images_per_second / sequential_chunks}});
  }
}

void print_pipeline_table(const PipelineSetup& p, const std::vector<PipelineRow>& rows) {
  const double mp = rows[2].images_per_second;
  const double sequential_chunks = rows[1].images_per_second;
  double best8 = 0;
  for (const auto& r : rows) {
    if (r.chunks == 8 && r.mode != "model_parallel" && r.mode != "single") {
      best8 = std::max(best8, r.images_per_second);
    }
  }
  std::cout << p.model_name << ", batch " << p.batch << ", 2 stages x 1 thread, balance "
            << c10::IntArrayRef(p.balance) << ":\n"
            << "  mode            chunks  s/step  images/s  vs model-parallel  bubble (ideal)\n";
  for (const auto& r : rows) {
    std::cout << "  " << std::left << std::setw(15) << r.mode << std::right << std::setw(7)
              << r.chunks << std::fixed << std::setprecision(2) << std::setw(8) << r.step_seconds
              << std::setprecision(1) << std::setw(10) << r.images_per_second
              << std::setprecision(2) << std::setw(18) << r.images_per_second / mp << "x";
    if (r.mode != "single") {
      std::cout << std::setprecision(2) << std::setw(9) << r.bubble << " (" << r.ideal_bubble
                << ")";
    }
    std::cout << "\n";
  }
  if (best8 > 0) {
    std::cout << std::setprecision(2)
              << "  8-chunk pipelining / plain model parallelism = " << best8 / mp
              << "x (target >= 1.5x)\n";
    if (rows[1].chunks == 8) {
      std::cout << "  8-chunk pipelining / the same 8 micro-batches on one thread = "
                << best8 / sequential_chunks << "x (the overlap alone; at most "
                << static_cast<double>(kStages) * 8 / (8 + kStages - 1) << "x)\n";
    }
  }
}

int run_pipeline(const Bench& bench) {
  PipelineSetup p = pipeline_setup(bench);
  const std::vector<PipelineRow> rows = measure_rows(bench, p);
  if (bench.json()) {
    print_pipeline_json(p, rows);
    return 0;
  }
  print_pipeline_table(p, rows);
  std::cout.flush();
  return 0;
}

}  // namespace

int run_bench_pipeline(const std::vector<std::string>& argv) {
  return run_benchmark(pipeline_spec(), argv, run_pipeline);
}

}  // namespace cli
}  // namespace paratrain
