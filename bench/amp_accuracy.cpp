// paratrain bench amp-accuracy: how far each mixed-precision opt level's test accuracy lies from
// fp32's, against how far fp32 runs of different seeds lie from each other, for paratrain and for
// PyTorch on the same CPU.
//
// The zoo's CNN, trained in one process on the first steps x 64 Fashion-MNIST training images
// (SGD, lr 0.05, momentum 0.9; the batches in order, the same for every run), then scored on the
// first --test-images test images. Each (level, seed) is one run; the seed sets the initial
// weights and the Dropout masks. PyTorch's side is bench/amp_accuracy_pytorch.py, whose O1 is
// torch.autocast("cpu", dtype=torch.bfloat16) and whose CNN starts from the same weights for the
// same seed. The summary gives, per system and level, the accuracies' mean and spread and the
// paired difference to O0 of the same seed: the number the MixedPrecision test bounds.

#include "args.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace paratrain {
namespace cli {

namespace {

double train_and_score(amp::OptLevel level, int seed, int steps, int test_images) {
  static data::FashionMNIST train(data::kFashionMnistDir, data::FashionMNIST::Split::kTrain);
  static data::FashionMNIST test(data::kFashionMnistDir, data::FashionMNIST::Split::kTest);
  torch::manual_seed(seed);
  auto model = models::make("cnn");
  amp::MixedPrecision mp(model, torch::kCPU, amp::AmpOptions().opt_level(level));
  torch::optim::SGD opt(mp.optimizer_parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  model->train();
  for (int s = 0; s < steps; ++s) {
    auto x = train.images().slice(0, s * 64, (s + 1) * 64);
    auto y = train.targets().slice(0, s * 64, (s + 1) * 64);
    opt.zero_grad();
    torch::Tensor loss;
    {
      auto autocast = mp.autocast();
      loss =
          torch::nn::functional::cross_entropy(mp.cast_output(model->forward(mp.cast_input(x))), y);
    }
    mp.backward(loss);
    mp.step(opt);
  }
  model->eval();
  torch::NoGradGuard no_grad;
  auto autocast = mp.autocast();
  auto x = test.images().slice(0, 0, test_images);
  auto predicted = mp.cast_output(model->forward(mp.cast_input(x))).argmax(1);
  return predicted.eq(test.targets().slice(0, 0, test_images))
      .to(torch::kDouble)
      .mean()
      .item<double>();
}

struct Run {
  std::string system, level;
  int seed;
  double accuracy;
};

struct Spread {
  double mean = 0, sd = 0, min = 0, max = 0;
};

Spread spread_of(const std::vector<double>& v) {
  Spread s;
  if (v.empty()) {
    return s;
  }
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  for (double x : v) {
    s.mean += x / static_cast<double>(v.size());
  }
  for (double x : v) {
    s.sd += (x - s.mean) * (x - s.mean);
  }
  s.sd = v.size() > 1 ? std::sqrt(s.sd / static_cast<double>(v.size() - 1)) : 0.0;
  return s;
}

void print_summary(const std::vector<Run>& runs, bool json) {
  std::map<std::pair<std::string, int>, double> fp32;  // (system, seed) -> O0 accuracy
  for (const auto& r : runs) {
    if (r.level == "O0") {
      fp32[{r.system, r.seed}] = r.accuracy;
    }
  }
  std::map<std::pair<std::string, std::string>, std::vector<double>> acc, diff;
  for (const auto& r : runs) {
    acc[{r.system, r.level}].push_back(r.accuracy);
    auto it = fp32.find({r.system, r.seed});
    if (r.level != "O0" && it != fp32.end()) {
      diff[{r.system, r.level}].push_back(r.accuracy - it->second);
    }
  }
  if (!json) {
    std::cout << "\nsystem    level  runs  accuracy mean (sd) [min, max]    minus O0 of the same "
                 "seed: mean (sd) [min, max]\n";
  }
  for (const auto& kv : acc) {
    const Spread a = spread_of(kv.second);
    const Spread d = spread_of(diff[kv.first]);
    if (json) {
      std::cout << json_line({{"summary", kv.first.first},
                              {"level", kv.first.second},
                              {"runs", kv.second.size()},
                              {"mean", a.mean},
                              {"sd", a.sd},
                              {"diff_mean", d.mean},
                              {"diff_sd", d.sd},
                              {"diff_min", d.min},
                              {"diff_max", d.max}})
                << std::endl;
      continue;
    }
    std::cout << std::fixed << std::setprecision(4) << std::left << std::setw(10) << kv.first.first
              << std::setw(7) << kv.first.second << std::setw(6) << kv.second.size() << a.mean
              << " (" << a.sd << ") [" << a.min << ", " << a.max << "]";
    if (kv.first.second != "O0") {
      std::cout << "    " << std::showpos << d.mean << std::noshowpos << " (" << d.sd << ") ["
                << std::showpos << d.min << ", " << d.max << std::noshowpos << "]";
    }
    std::cout << "\n";
  }
}

const BenchSpec& amp_accuracy_spec() {
  static const BenchSpec spec{
      "amp-accuracy",
      "Test accuracy at opt levels O0-O3 (bf16) across seeds, paratrain and PyTorch side by side.",
      {
          {"levels", "LIST", "opt levels (default O0,O1,O2,O3)"},
          {"seeds", "LIST", "seeds (default 0,1,2,3)", "0"},
          {"steps", "N", "SGD steps of 64 images (default 900)", "2"},
          {"test-images", "N", "test images scored (default 10000)", "64"},
          {"no-pytorch", "", "skip PyTorch's runs"},
          {"python", "P", "the Python with torch (default as in bench ddp)"},
      },
      "print JSON"};
  return spec;
}

// Each level as to_string writes it ("o1" is O1), so that both systems and the summary's O0
// baseline name it alike; an unknown level is refused before the first run.
std::vector<std::string> accuracy_levels(const Bench& bench) {
  std::vector<std::string> levels;
  for (const auto& l : split_list(bench.get("levels", "O0,O1,O2,O3"))) {
    levels.push_back(amp::to_string(amp::parse_opt_level(l)));
  }
  if (levels.empty()) {
    throw UsageError("--levels names no opt level: give some of O0,O1,O2,O3");
  }
  return levels;
}

std::vector<int> accuracy_seeds(const Bench& bench) {
  std::vector<int> seeds;
  for (const auto& s : split_list(bench.get("seeds", "0,1,2,3"))) {
    size_t end = 0;
    int seed = -1;
    try {
      seed = std::stoi(s, &end);
    } catch (const std::exception&) {
    }
    if (seed < 0 || end != s.size()) {
      throw UsageError("--seeds takes non-negative integers, like 0,1,2,3; got '" + s + "'");
    }
    seeds.push_back(seed);
  }
  if (seeds.empty()) {
    throw UsageError("--seeds names no seed: give some, like 0,1,2,3");
  }
  return seeds;
}

// What every run trains and scores.
struct AccuracyPlan {
  std::vector<std::string> levels;
  std::vector<int> seeds;
  int steps = 0;
  int test_images = 0;
};

// paratrain's runs, each printed as a row when it ends.
void run_paratrain_side(const Bench& bench, const AccuracyPlan& plan, std::vector<Run>& runs) {
  for (int seed : plan.seeds) {
    for (const auto& level : plan.levels) {
      const auto start = std::chrono::steady_clock::now();
      const double acc =
          train_and_score(amp::parse_opt_level(level), seed, plan.steps, plan.test_images);
      runs.push_back({"paratrain", level, seed, acc});
      JsonRow row{{"system", "paratrain"}, {"level", level},  {"seed", seed},
                  {"steps", plan.steps},   {"accuracy", acc}, {"seconds", seconds_since(start)}};
      note_smoke_skip(bench, row);
      std::cout << json_line(row) << std::endl;
    }
  }
}

// PyTorch's runs (bench/amp_accuracy_pytorch.py), each row printed as it came.
void run_pytorch_side(const std::string& python, const AccuracyPlan& plan, std::vector<Run>& runs) {
  std::string seed_list;
  for (int s : plan.seeds) {
    seed_list += (seed_list.empty() ? "" : ",") + std::to_string(s);
  }
  std::string levels_list;
  for (const auto& l : plan.levels) {
    levels_list += (levels_list.empty() ? "" : ",") + l;
  }
  const std::string out = results_file("amp-accuracy");
  const std::string command = "'" + python + "' '" + bench_script("amp_accuracy_pytorch.py") +
                              "' --levels " + levels_list + " --seeds " + seed_list + " --steps " +
                              std::to_string(plan.steps) + " --test-images " +
                              std::to_string(plan.test_images) + " > '" + out + "'";
  if (std::system(command.c_str()) != 0) {
    std::remove(out.c_str());
    throw std::runtime_error("the PyTorch runs failed: " + command);
  }
  const std::vector<JsonRow> rows = read_rows(out);
  std::remove(out.c_str());
  for (const JsonRow& row : rows) {
    std::cout << json_line(row) << std::endl;
    runs.push_back({"pytorch", string_field(row, "level"),
                    static_cast<int>(number_field(row, "seed")), number_field(row, "accuracy")});
  }
}

int run_amp_accuracy(const Bench& bench) {
  AccuracyPlan plan;
  plan.levels = accuracy_levels(bench);
  plan.seeds = accuracy_seeds(bench);
  plan.steps = bench.get_int("steps", 900);
  plan.test_images = bench.get_int("test-images", 10000);
  if (plan.steps < 1 || plan.steps * 64 > 60000 || plan.test_images < 1 ||
      plan.test_images > 10000) {
    throw UsageError("--steps must be 1 to 937 (64 images each) and --test-images 1 to 10000");
  }
  std::vector<Run> runs;
  run_paratrain_side(bench, plan, runs);
  const std::string python = comparison_python(bench);
  if (!python.empty()) {
    run_pytorch_side(python, plan, runs);
  }
  print_summary(runs, bench.json());
  return 0;
}

}  // namespace

int run_bench_amp_accuracy(const std::vector<std::string>& argv) {
  return run_benchmark(amp_accuracy_spec(), argv, run_amp_accuracy);
}

}  // namespace cli
}  // namespace paratrain
