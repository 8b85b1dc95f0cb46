// paratrain bench amp: step time and accuracy at each mixed-precision opt level, on this
// machine's CPU.
//
// Step time of a CIFAR-style ResNet-18 (32x32 inputs, batch 32 per rank) under DDP with 2 ranks
// x 1 thread, at opt levels O0 (fp32), O1 (autocast), O2 (bf16 model, fp32 BatchNorm and master
// weights) and O3 (pure bf16), with the ratios to O0. Then the accuracy side of the trade: the
// zoo's CNN trained on Fashion-MNIST with 2 DDP ranks for the same steps at O0 and O1, test
// accuracy on the 10,000 test images (--accuracy-steps, 0 to skip; --test-images). A step is
// zero_grad + forward + loss + backward + step on a fixed random batch; a row reports the slowest
// rank's median.
//
// Beside paratrain's O0 and O1, the same steps in PyTorch's own DDP, fp32 and under CPU autocast
// (torch.autocast("cpu", dtype=torch.bfloat16)), for each anchor Python (anchors.h: Debian's
// PyTorch 1.13.1, PyPI's 2.15.0; bench/ddp_pytorch.py --amp bf16), on the same backend (gloo
// unless --backend says otherwise, and PyTorch's only where its build has that backend).

#include "anchors.h"
#include "args.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

const BenchSpec& amp_spec() {
  // --smoke: O0 and O1 (the other levels take the same path through this file, each at the cost
  // of a job), a step at batch 4, and the accuracy side's 2 steps scored on 256 test images.
  static const BenchSpec spec{
      "amp",
      "DDP step time at opt levels O0-O3 (bf16), and accuracy O0 vs O1.",
      {
          {"levels", "LIST", "the opt levels (default O0,O1,O2,O3)", "O0,O1"},
          {"steps", "N", "timed steps per level", "1"},
          {"accuracy-steps", "N", "training steps of the accuracy comparison (0: skip)", "2"},
          {"test-images", "N", "test images the accuracy comparison scores (default 10000)", "256"},
          {"backend", "NAME", "gloo (default: PyTorch's backend too) or mpi"},
          {"no-pytorch", "", "skip PyTorch's rows"},
          {"python", "LIST", anchor_pythons_help("with torch for PyTorch's rows")},
          {"accuracy", "", kInternalOption},
          {"level", "L", kInternalOption},
          {"dtype", "T", kInternalOption},
      },
      "print JSON",
      /*workers=*/true};
  return spec;
}

using TrainStep = std::function<void(const torch::Tensor& x, const torch::Tensor& y)>;

// The accuracy side: the CNN trained on this rank's share of Fashion-MNIST, then scored on the
// first --test-images test images.
void measure_accuracy(const Bench& bench,
                      const TrainStep& train_step,
                      torch::nn::Sequential& model,
                      amp::MixedPrecision& mp,
                      const dist::ProcessGroupPtr& pg,
                      JsonRow& row) {
  data::FashionMNIST train(data::kFashionMnistDir, data::FashionMNIST::Split::kTrain);
  data::FashionMNIST test(data::kFashionMnistDir, data::FashionMNIST::Split::kTest);
  data::DistributedSampler sampler(*train.size(), pg->size(), pg->rank());
  data::TensorLoader loader(train.images(), train.targets(), sampler.indices(),
                            data::LoaderOptions(64).workers(1));
  const int steps = bench.get_int("steps", 400);
  const int64_t images = bench.get_int("test-images", 10000);
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
  auto out = mp.cast_output(model->forward(mp.cast_input(test.images().slice(0, 0, images))));
  const double acc =
      out.argmax(1).eq(test.targets().slice(0, 0, images)).to(torch::kDouble).mean().item<double>();
  row["workload"] = "cnn_fashion_mnist";
  row["test_accuracy"] = acc;
  row["steps"] = steps;
}

// The speed side: ResNet-18 steps on a fixed random batch of 32 (4 under --smoke); the slowest
// rank's median step.
void measure_speed(const Bench& bench,
                   const TrainStep& train_step,
                   const dist::ProcessGroupPtr& pg,
                   JsonRow& row) {
  const Workload w = bench_workload("resnet18", bench);
  const int64_t batch = bench.smoke() ? w.batch : 32;  // this benchmark's batch, not the workload's
  torch::Tensor x = torch::randn({batch, 3, 32, 32});
  torch::Tensor y = torch::randint(0, 10, {batch});
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
  row["workload"] = "resnet18";
  row["step_seconds"] = t.item<double>();
  row["steps"] = times.size();
}

int run_amp_worker(const Bench& bench) {
  torch::set_num_threads(1);
  const std::string level_name = bench.get("level");
  const amp::OptLevel level = amp::parse_opt_level(level_name);
  const at::ScalarType dtype = amp::parse_dtype(bench.get("dtype", "bf16"));
  auto pg = dist::init_process_group();
  const bool accuracy = bench.has("accuracy");
  torch::manual_seed(0);
  auto model = models::make(accuracy ? "cnn" : "resnet18_cifar");
  amp::MixedPrecision mp(model, torch::kCPU, amp::AmpOptions().opt_level(level).dtype(dtype));
  DistributedDataParallel ddp(model, pg);
  mp.sync_masters();
  torch::optim::SGD opt(mp.optimizer_parameters(),
                        torch::optim::SGDOptions(accuracy ? 0.05 : 0.01).momentum(0.9));
  const TrainStep train_step = [&](const torch::Tensor& x, const torch::Tensor& y) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      auto autocast = mp.autocast();
      loss = torch::nn::functional::cross_entropy(mp.cast_output(ddp.forward(mp.cast_input(x))), y);
    }
    mp.backward(loss);
    mp.step(opt);
  };
  JsonRow row{{"level", level_name}, {"dtype", bench.get("dtype", "bf16")}, {"ranks", pg->size()}};
  if (accuracy) {
    measure_accuracy(bench, train_step, model, mp, pg, row);
  } else {
    measure_speed(bench, train_step, pg, row);
  }
  if (pg->rank() == 0) {
    append_row(bench.get("out"), row);
  }
  return 0;
}

// --levels, each checked; O0 first, the reference of the ratios.
std::vector<std::string> amp_levels(const Bench& bench) {
  std::vector<std::string> levels;
  std::stringstream s(bench.get("levels", "O0,O1,O2,O3"));
  for (std::string l; std::getline(s, l, ',');) {
    try {
      amp::parse_opt_level(l);
    } catch (const c10::Error& e) {
      throw UsageError(e.what_without_backtrace());
    }
    levels.push_back(l);
  }
  if (levels.empty() || levels.front() != "O0") {
    throw UsageError("--levels must start with O0, the reference of the ratios");
  }
  return levels;
}

// The speed rows, one per level in order, PyTorch's rows (O0 and O1 of each anchor), and the
// CNN's test accuracy by level.
struct AmpResults {
  std::vector<JsonRow> speed;
  std::vector<JsonRow> pytorch;
  std::map<std::string, double> accuracy;
};

// What one measurement runs on: paratrain's backend and the anchors beside it.
struct AmpPlan {
  std::vector<std::string> levels;
  int accuracy_steps = 0;
  std::string backend;
  std::vector<AnchorPython> anchors;  // those with the backend; empty when skipped
};

// PyTorch's DDP on the speed side's ResNet-18 at O0 (fp32) and O1 (autocast), for each anchor.
void measure_pytorch_amp(const Bench& bench, const AmpPlan& plan, const std::string& out) {
  const Workload w = bench_workload("resnet18", bench);
  const int64_t batch = bench.smoke() ? w.batch : 32;
  for (const auto& a : plan.anchors) {
    for (const char* level : {"O0", "O1"}) {
      if (std::find(plan.levels.begin(), plan.levels.end(), level) == plan.levels.end()) {
        continue;
      }
      bench.progress("measuring resnet18 in PyTorch " + a.torch + " at " + level + "...");
      run_bench_job(
          {a.python, bench_script("ddp_pytorch.py"), "--workload", "resnet18", "--batch",
           std::to_string(batch), "--steps", std::to_string(w.steps), "--warmup",
           std::to_string(w.warmup), "--backend", plan.backend, "--amp",
           std::string(level) == "O1" ? "bf16" : "none", "--system", a.label(), "--out", out},
          2, plan.backend == "mpi" ? "mpi" : "", out);
    }
  }
}

AmpResults measure_amp(const Bench& bench, const AmpPlan& plan) {
  const std::string out = results_file("amp");
  auto run = [&](std::vector<std::string> extra) {
    for (const auto& word : bench.forwarded({"test-images"})) {
      extra.push_back(word);
    }
    run_bench_job(bench.worker_command(out, extra), 2, plan.backend, out);
  };
  for (const auto& level : plan.levels) {
    bench.progress("measuring resnet18 at " + level + "...");
    std::vector<std::string> extra{"--level", level};
    for (const auto& word : bench.forwarded({"steps"})) {
      extra.push_back(word);
    }
    run(extra);
  }
  measure_pytorch_amp(bench, plan, out);
  if (plan.accuracy_steps > 0) {
    for (const char* level : {"O0", "O1"}) {
      bench.progress(std::string("training the CNN on Fashion-MNIST at ") + level + "...");
      run({"--level", level, "--accuracy", "--steps", std::to_string(plan.accuracy_steps)});
    }
  }
  AmpResults r;
  for (JsonRow row : read_rows(out)) {
    if (is_anchor_system(string_field(row, "system"))) {
      row["level"] = string_field(row, "amp") == "bf16" ? "O1" : "O0";
      row["dtype"] = "bf16";
      r.pytorch.push_back(row);
    } else if (string_field(row, "workload") == "resnet18") {
      row["system"] = "paratrain";
      row["backend"] = plan.backend;
      r.speed.push_back(row);
    } else {
      r.accuracy[string_field(row, "level")] = number_field(row, "test_accuracy");
    }
  }
  std::remove(out.c_str());
  return r;
}

// The step seconds of `system` at `level` in `rows`; 0 when absent.
double step_of(const std::vector<JsonRow>& rows,
               const std::string& system,
               const std::string& level) {
  for (const auto& row : rows) {
    if (string_field(row, "system") == system && string_field(row, "level") == level) {
      return number_field(row, "step_seconds");
    }
  }
  return 0;
}

// The rows with their speedups over their own O0, and paratrain's ratios to each PyTorch at the
// same level.
std::vector<JsonRow> amp_rows(const Bench& bench, const AmpPlan& plan, const AmpResults& r) {
  std::vector<JsonRow> rows = r.speed;
  rows.insert(rows.end(), r.pytorch.begin(), r.pytorch.end());
  for (JsonRow& row : rows) {
    const std::string system = string_field(row, "system"), level = string_field(row, "level");
    const double o0 = step_of(rows, system, "O0"), s = number_field(row, "step_seconds");
    row["speedup_vs_O0"] = o0 / s;
    for (const auto& a : plan.anchors) {
      if (system == "paratrain" && step_of(rows, a.label(), level) > 0) {
        row["ratio_to_" + a.label()] = s / step_of(rows, a.label(), level);
      } else if (system == a.label()) {
        mark_anchor(row, a, a.torch);
      }
    }
    const auto acc = r.accuracy.find(level);
    if (system == "paratrain" && acc != r.accuracy.end()) {
      row["cnn_test_accuracy"] = acc->second;
    }
    if (system == "paratrain") {
      note_smoke_skip(bench, row);
    }
  }
  return rows;
}

void print_amp_text(const std::vector<JsonRow>& rows, const AmpPlan& plan, const AmpResults& r) {
  std::cout << "resnet18 (CIFAR stem, batch 32 per rank), DDP 2 ranks x 1 thread (" << plan.backend
            << "), bf16:\n"
            << "  system            level  ms/step  speedup vs O0  paratrain / this\n";
  for (const auto& row : rows) {
    const std::string system = string_field(row, "system"), level = string_field(row, "level");
    const double s = number_field(row, "step_seconds");
    std::cout << "  " << std::left << std::setw(18) << system << std::setw(5) << level << std::right
              << std::fixed << std::setprecision(1) << std::setw(9) << s * 1e3
              << std::setprecision(2) << std::setw(14) << number_field(row, "speedup_vs_O0") << "x";
    const double ours = step_of(rows, "paratrain", level);
    if (system != "paratrain" && ours > 0) {
      std::cout << std::setw(17) << ours / s << "x";
    }
    std::cout << "\n";
  }
  if (r.accuracy.count("O0") && r.accuracy.count("O1")) {
    const double a0 = r.accuracy.at("O0"), a1 = r.accuracy.at("O1");
    std::cout << std::setprecision(4) << "  CNN on Fashion-MNIST, " << plan.accuracy_steps
              << " steps of 64 per rank: test accuracy O0 " << a0 << ", O1 " << a1
              << " (difference " << std::setprecision(2) << 100 * (a1 - a0) << " points)\n";
  }
  std::cout.flush();
}

int run_amp(const Bench& bench) {
  AmpPlan plan;
  plan.levels = amp_levels(bench);
  plan.accuracy_steps = bench.get_int("accuracy-steps", 400);
  // gloo by default: PyTorch's DDP beside it has no other backend in most builds.
  const std::vector<std::string> backends = cpu_backends(bench, "backend", {"gloo"});
  if (backends.size() != 1) {
    throw UsageError("--backend '" + bench.get("backend") + "': name one backend, gloo or mpi");
  }
  plan.backend = backends.front();
  for (const auto& a : anchor_pythons(bench)) {
    if (a.has_backend(plan.backend)) {
      plan.anchors.push_back(a);
    } else {
      std::cerr << "paratrain bench amp: leaving out PyTorch " << a.torch << " (" << a.python
                << "): it has no " << plan.backend << " backend" << std::endl;
    }
  }
  const AmpResults r = measure_amp(bench, plan);
  const std::vector<JsonRow> rows = amp_rows(bench, plan, r);
  if (bench.json()) {
    for (const auto& row : rows) {
      print_row(row);
    }
    std::cout.flush();
  } else {
    print_amp_text(rows, plan, r);
  }
  return 0;
}

}  // namespace

int run_bench_amp(const std::vector<std::string>& argv) {
  return run_benchmark(amp_spec(), argv, run_amp, run_amp_worker);
}

}  // namespace cli
}  // namespace paratrain
