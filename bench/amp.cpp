// paratrain bench amp: step time and accuracy at each mixed-precision opt level, on this
// machine's CPU.
//
// Step time of a CIFAR-style ResNet-18 (32x32 inputs, batch 32 per rank) under DDP with 2 ranks
// x 1 thread, at opt levels O0 (fp32), O1 (autocast), O2 (bf16 model, fp32 BatchNorm and master
// weights) and O3 (pure bf16), with the ratios to O0. Then the accuracy side of the trade: the
// zoo's CNN trained on Fashion-MNIST with 2 DDP ranks for the same steps at O0 and O1, test
// accuracy on the 10,000 test images (--accuracy-steps, 0 to skip). A step is zero_grad +
// forward + loss + backward + step on a fixed random batch; a row reports the slowest rank's
// median.

#include "args.h"
#include "bench_util.h"
#include "commands.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

int run_amp_worker(const Args& args) {
  torch::set_num_threads(1);
  const std::string level_name = args.get("level");
  const amp::OptLevel level = amp::parse_opt_level(level_name);
  const at::ScalarType dtype = amp::parse_dtype(args.get("dtype", "bf16"));
  auto pg = dist::init_process_group();
  const bool accuracy = args.has("accuracy");
  torch::manual_seed(0);
  auto model = models::make(accuracy ? "cnn" : "resnet18_cifar");
  amp::MixedPrecision mp(model, torch::kCPU, amp::AmpOptions().opt_level(level).dtype(dtype));
  DistributedDataParallel ddp(model, pg);
  mp.sync_masters();
  torch::optim::SGD opt(mp.optimizer_parameters(),
                        torch::optim::SGDOptions(accuracy ? 0.05 : 0.01).momentum(0.9));
  auto train_step = [&](const torch::Tensor& x, const torch::Tensor& y) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      auto autocast = mp.autocast();
      loss = torch::nn::functional::cross_entropy(mp.cast_output(ddp.forward(mp.cast_input(x))), y);
    }
    mp.backward(loss);
    mp.step(opt);
  };
  std::map<std::string, std::string> row{{"level", quoted(level_name)},
                                         {"dtype", quoted(args.get("dtype", "bf16"))},
                                         {"ranks", std::to_string(pg->size())}};
  if (accuracy) {
    data::FashionMNIST train(data::kFashionMnistDir, data::FashionMNIST::Split::kTrain);
    data::FashionMNIST test(data::kFashionMnistDir, data::FashionMNIST::Split::kTest);
    data::DistributedSampler sampler(*train.size(), pg->size(), pg->rank());
    data::TensorLoader loader(train.images(), train.targets(), sampler.indices(),
                              data::LoaderOptions(64).workers(1));
    const int steps = args.get_int("steps", 400);
    model->train();
    for (int s = 0; s < steps; ++s) {
      auto batch = loader.next();
      if (!batch) {
        break;
      }
      train_step(batch->data, batch->target);
    }
    model->eval();
    torch::NoGradGuard no_grad;
    auto autocast = mp.autocast();
    auto out = mp.cast_output(model->forward(mp.cast_input(test.images())));
    const double acc = out.argmax(1).eq(test.targets()).to(torch::kDouble).mean().item<double>();
    row["workload"] = quoted("cnn_fashion_mnist");
    row["test_accuracy"] = std::to_string(acc);
    row["steps"] = std::to_string(steps);
  } else {
    const Workload w = workload("resnet18", args.get_int("steps", 0));
    std::vector<int64_t> shape{32, 3, 32, 32};
    torch::Tensor x = torch::randn(shape);
    torch::Tensor y = torch::randint(0, 10, {32});
    std::vector<double> times;
    for (int s = 0; s < w.warmup + w.steps; ++s) {
      pg->barrier()->wait();
      auto t0 = Clock::now();
      train_step(x, y);
      if (s >= w.warmup) {
        times.push_back(seconds_since(t0));
      }
    }
    at::Tensor t = torch::tensor({median(times)}, torch::kDouble);
    pg->allreduce(t, dist::ReduceOp::kMax)->wait();
    row["workload"] = quoted("resnet18");
    row["step_seconds"] = std::to_string(t.item<double>());
    row["steps"] = std::to_string(times.size());
  }
  if (pg->rank() == 0) {
    std::ofstream out(args.get("out"), std::ios::app);
    out << row_json(row) << std::endl;
  }
  return 0;
}

}  // namespace

int run_bench_amp(const std::vector<std::string>& argv) {
  static const CommandSpec spec{
      "paratrain bench amp",
      "DDP step time at opt levels O0-O3 (bf16), and accuracy O0 vs O1.",
      {
          {"levels", "LIST", "the opt levels (default O0,O1,O2,O3)"},
          {"steps", "N", "timed steps per level"},
          {"accuracy-steps", "N", "training steps of the accuracy comparison (0: skip)"},
          {"backend", "NAME", "mpi or gloo"},
          {"json", "", "print JSON"},
          {"worker", "", ""},
          {"accuracy", "", ""},
          {"level", "L", ""},
          {"dtype", "T", ""},
          {"out", "FILE", ""},
      }};
  Args args(argv, spec);
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  if (args.has("worker")) {
    return run_amp_worker(args);
  }
  std::vector<std::string> levels;
  {
    std::stringstream s(args.get("levels", "O0,O1,O2,O3"));
    for (std::string l; std::getline(s, l, ',');) {
      try {
        amp::parse_opt_level(l);
      } catch (const c10::Error& e) {
        throw UsageError(e.what_without_backtrace());
      }
      levels.push_back(l);
    }
  }
  if (levels.empty() || levels.front() != "O0") {
    throw UsageError("--levels must start with O0, the reference of the ratios");
  }
  const int accuracy_steps = args.get_int("accuracy-steps", 400);
  const std::string backend = bench_backend(args);
  const bool json = args.has("json");
  const std::string out = results_file("amp");
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> command{self_path(), "bench", "amp", "--worker", "--out", out};
    command.insert(command.end(), extra.begin(), extra.end());
    run_bench_job(command, 2, backend, out);
  };
  for (const auto& level : levels) {
    if (!json) {
      std::cerr << "measuring resnet18 at " << level << "..." << std::endl;
    }
    std::vector<std::string> extra{"--level", level};
    if (args.has("steps")) {
      extra.insert(extra.end(), {"--steps", args.get("steps")});
    }
    run(extra);
  }
  if (accuracy_steps > 0) {
    for (const char* level : {"O0", "O1"}) {
      if (!json) {
        std::cerr << "training the CNN on Fashion-MNIST at " << level << "..." << std::endl;
      }
      run({"--level", level, "--accuracy", "--steps", std::to_string(accuracy_steps)});
    }
  }
  std::ifstream in(out);
  std::vector<std::string> speed;
  std::map<std::string, double> accuracy;
  for (std::string line; std::getline(in, line);) {
    if (json_field(line, "workload") == "resnet18") {
      speed.push_back(line);
    } else {
      accuracy[json_field(line, "level")] = std::stod(json_field(line, "test_accuracy"));
    }
  }
  std::remove(out.c_str());
  const double o0 = std::stod(json_field(speed.front(), "step_seconds"));
  if (json) {
    for (auto line : speed) {
      const double s = std::stod(json_field(line, "step_seconds"));
      line.pop_back();
      line += ", \"speedup_vs_O0\": " + std::to_string(o0 / s);
      const std::string level = json_field(line, "level");
      if (accuracy.count(level)) {
        line += ", \"cnn_test_accuracy\": " + std::to_string(accuracy[level]);
      }
      std::cout << line << "}\n";
    }
    return 0;
  }
  std::cout << "resnet18 (CIFAR stem, batch 32 per rank), DDP 2 ranks x 1 thread (" << backend
            << "), bf16:\n"
            << "  level  ms/step  speedup vs O0\n";
  for (const auto& line : speed) {
    const double s = std::stod(json_field(line, "step_seconds"));
    std::cout << "  " << std::left << std::setw(5) << json_field(line, "level") << std::right
              << std::fixed << std::setprecision(1) << std::setw(9) << s * 1e3
              << std::setprecision(2) << std::setw(10) << o0 / s << "x\n";
  }
  if (accuracy.count("O0") && accuracy.count("O1")) {
    std::cout << std::setprecision(4) << "  CNN on Fashion-MNIST, " << accuracy_steps
              << " steps of 64 per rank: test accuracy O0 " << accuracy["O0"] << ", O1 "
              << accuracy["O1"] << " (difference " << std::setprecision(2)
              << 100 * (accuracy["O1"] - accuracy["O0"]) << " points)\n";
  }
  std::cout.flush();
  return 0;
}

}  // namespace cli
}  // namespace paratrain
