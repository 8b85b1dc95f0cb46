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
#include "commands.h"

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

}  // namespace

int run_bench_pipeline(const std::vector<std::string>& argv) {
  static const CommandSpec spec{"paratrain bench pipeline",
                                "GPipe and 1F1B micro-batching against plain model parallelism.",
                                {
                                    {"chunks", "LIST", "the micro-batch counts (default 2,4,8)"},
                                    {"steps", "N", "timed steps (default 3)"},
                                    {"batch", "B", "batch size (default 64)"},
                                    {"balance", "MODE", "time or layer2 (default time)"},
                                    {"model", "NAME", "the zoo model (default resnet50_cifar)"},
                                    {"json", "", "print JSON"},
                                }};
  Args args(argv, spec);
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  const int steps = args.get_int("steps", 3);
  const int64_t batch = args.get_int("batch", 64);
  const std::string balance_mode = args.get("balance", "time");
  const std::string model_name = args.get("model", "resnet50_cifar");
  const bool json = args.has("json");
  if (steps <= 0 || batch <= 0) {
    throw UsageError("--steps and --batch must be positive");
  }
  if (balance_mode != "time" && balance_mode != "layer2") {
    throw UsageError("unknown --balance '" + balance_mode + "': choose time or layer2");
  }
  std::vector<int64_t> chunk_counts;
  {
    std::stringstream s(args.get("chunks", "2,4,8"));
    for (std::string c; std::getline(s, c, ',');) {
      chunk_counts.push_back(std::stoll(c));
      if (chunk_counts.back() < 1 || chunk_counts.back() > batch) {
        throw UsageError("--chunks entries must be between 1 and the batch (" +
                         std::to_string(batch) + ")");
      }
    }
  }
  torch::set_num_threads(1);
  set_blas_threads(1);  // every row on one thread per stage, the unsplit one included
  torch::manual_seed(0);
  auto nested = models::make(model_name);
  auto model = pipeline::flatten(nested);
  const int64_t stages = 2;
  std::vector<int64_t> balance;
  if (balance_mode == "layer2") {
    int64_t upto = 0;  // children through layer2's last block
    auto names = model->named_children();
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i].key().rfind("layer2_", 0) == 0) {
        upto = static_cast<int64_t>(i) + 1;
      }
    }
    balance = {upto, static_cast<int64_t>(model->size()) - upto};
  } else {
    balance = pipeline::balance_by_time(model, stages, torch::randn({batch / 8, 3, 32, 32}));
  }
  auto loss = [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  torch::Tensor x = torch::randn({batch, 3, 32, 32});
  torch::Tensor y = torch::randint(0, 10, {batch});
  if (!json) {
    std::cerr << model_name << ", batch " << batch << ", " << model->size()
              << " layers after flattening, balance " << c10::IntArrayRef(balance) << " ("
              << balance_mode << "), " << steps << " timed steps after 1 warm-up" << std::endl;
  }

  std::vector<PipelineRow> rows;
  // The unsplit model on one thread: the whole batch, and the largest chunk count's micro-batches
  // one after the other (gradient accumulation). The second isolates what overlapping the stages
  // gains from what smaller tensors alone gain.
  const int64_t most = *std::max_element(chunk_counts.begin(), chunk_counts.end());
  for (int64_t m : {int64_t{1}, most}) {
    if (!json) {
      std::cerr << "measuring single " << m << "..." << std::endl;
    }
    auto xs = torch::tensor_split(x, m);
    auto ys = torch::tensor_split(y, m);
    std::vector<double> times;
    for (int s = 0; s <= steps; ++s) {
      auto t0 = Clock::now();
      opt.zero_grad();
      for (int64_t i = 0; i < m; ++i) {
        (loss(model->forward(xs[static_cast<size_t>(i)]), ys[static_cast<size_t>(i)]) *
         (static_cast<double>(xs[static_cast<size_t>(i)].size(0)) / static_cast<double>(batch)))
            .backward();
      }
      opt.step();
      if (s > 0) {
        times.push_back(seconds_since(t0));
      }
    }
    const double t = median(times);
    rows.push_back({"single", m, t, batch / t, 0, 0});
  }
  std::vector<std::pair<std::string, int64_t>> modes{{"model_parallel", 1}};
  for (const char* schedule : {"gpipe", "1f1b"}) {
    for (int64_t m : chunk_counts) {
      modes.emplace_back(schedule, m);
    }
  }
  for (const auto& mode : modes) {
    if (!json) {
      std::cerr << "measuring " << mode.first << " " << mode.second << "..." << std::endl;
    }
    pipeline::Pipeline pipe(
        model, balance, std::vector<torch::Device>(stages, torch::kCPU), loss,
        pipeline::PipelineOptions()
            .chunks(mode.second)
            .schedule(pipeline::parse_schedule(mode.first == "1f1b" ? "1f1b" : "gpipe")));
    std::vector<double> times;
    std::vector<double> bubbles;
    for (int s = 0; s <= steps; ++s) {
      auto t0 = Clock::now();
      opt.zero_grad();
      pipe.step(x, y);
      opt.step();
      const double t = seconds_since(t0);
      if (s > 0) {
        times.push_back(t);
        double busy = 0;
        for (const auto& st : pipe.last_stats()) {
          busy += st.busy_seconds;
        }
        bubbles.push_back(1.0 - busy / (static_cast<double>(stages) * pipe.last_step_seconds()));
      }
    }
    const double t = median(times);
    const double ideal =
        static_cast<double>(stages - 1) / static_cast<double>(mode.second + stages - 1);
    rows.push_back({mode.first, mode.second, t, batch / t, median(bubbles), ideal});
  }

  const double mp = rows[2].images_per_second;
  const double sequential_chunks = rows[1].images_per_second;
  double best8 = 0;
  for (const auto& r : rows) {
    if (r.chunks == 8 && r.mode != "model_parallel" && r.mode != "single") {
      best8 = std::max(best8, r.images_per_second);
    }
  }
  if (json) {
    for (const auto& r : rows) {
      std::cout << row_json(
                       {{"workload", quoted(model_name)},
                        {"mode", quoted(r.mode)},
                        {"stages", r.mode == "single" ? "1" : std::to_string(stages)},
                        {"chunks", std::to_string(r.chunks)},
                        {"batch", std::to_string(batch)},
                        {"step_seconds", std::to_string(r.step_seconds)},
                        {"images_per_second", std::to_string(r.images_per_second)},
                        {"bubble_fraction", std::to_string(r.bubble)},
                        {"ideal_bubble_fraction", std::to_string(r.ideal_bubble)},
                        {"speedup_vs_model_parallel", std::to_string(r.images_per_second / mp)},
                        {"speedup_vs_sequential_chunks",
                         std::to_string(r.images_per_second / sequential_chunks)}})
                << "\n";
    }
    return 0;
  }
  std::cout << model_name << ", batch " << batch << ", 2 stages x 1 thread, balance "
            << c10::IntArrayRef(balance) << ":\n"
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
    if (most == 8) {
      std::cout << "  8-chunk pipelining / the same 8 micro-batches on one thread = "
                << best8 / sequential_chunks << "x (the overlap alone; at most "
                << static_cast<double>(stages) * 8 / (8 + stages - 1) << "x)\n";
    }
  }
  std::cout.flush();
  return 0;
}

}  // namespace cli
}  // namespace paratrain
