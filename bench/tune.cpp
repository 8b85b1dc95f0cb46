// paratrain bench tune: paratrain tune against Optuna on the same search, in the same run.
//
// The search: the mlp (the zoo's, with hidden units and dropout as parameters) on Fashion-MNIST,
// lr loguniform(1e-3, 0.3), batch choice(32, 64, 128, 256), hidden choice(128, 256, 512), dropout
// uniform(0, 0.5); at most 2 epochs a trial, test accuracy reported every quarter epoch (so
// max_t is 8), 20 trials, 1 thread per trial. paratrain runs its trials as C++ functions,
// --max-concurrent at once (default: one per core); Optuna (bench/tune_optuna.py, Debian's
// python3-optuna) runs them one after another with n_jobs=1, Optuna's default.
//
// Rows: system (paratrain-bohb, paratrain-asha, paratrain-random, optuna-tpe-hyperband,
// optuna-random), seed, best_accuracy (the best trial that ran to max_t, at its last report, as
// Optuna's best_value), epochs_used, wall_seconds; then one mean row per system with its ratios
// to optuna-tpe-hyperband.

#include "args.h"
#include "bench_util.h"
#include "commands.h"
#include "json_line.h"
#include "util/files.h"

#include "paratrain/data/fashion_mnist.h"
#include "paratrain/parallel/threads.h"
#ifdef PARATRAIN_WITH_TUNE
#include "paratrain/tune/tuner.h"
#endif

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

namespace paratrain {
namespace cli {

#ifndef PARATRAIN_WITH_TUNE
int run_bench_tune(const std::vector<std::string>&) {
  std::cerr << "paratrain bench tune: this build has no SQLite (install libsqlite3-dev)"
            << std::endl;
  return 1;
}
#else
namespace {

namespace nn = torch::nn;

struct Data {
  torch::Tensor train_x, train_y, test_x, test_y;
};

Data load_data() {
  // images() are already normalized as torchvision's Normalize((0.2860,), (0.3530,)) would
  auto flat = [](const data::FashionMNIST& d) { return d.images().reshape({-1, 784}); };
  data::FashionMNIST train(data::kFashionMnistDir, data::FashionMNIST::Split::kTrain);
  data::FashionMNIST test(data::kFashionMnistDir, data::FashionMNIST::Split::kTest);
  return {flat(train), train.targets().to(torch::kLong), flat(test),
          test.targets().to(torch::kLong)};
}

nn::Sequential mlp(int64_t hidden, double dropout) {
  return nn::Sequential(nn::Linear(784, hidden), nn::BatchNorm1d(hidden), nn::ReLU(),
                        nn::Dropout(dropout), nn::Linear(hidden, hidden / 2),
                        nn::BatchNorm1d(hidden / 2), nn::ReLU(), nn::Dropout(dropout),
                        nn::Linear(hidden / 2, 10));
}

std::mutex g_seed_mutex;  // torch::manual_seed is global: one trial builds its model at a time

// One trial: SGD (momentum 0.9) a quarter epoch at a time, test accuracy after each. It keeps
// a checkpoint after each report, so that a paused (Hyperband) trial continues where it was.
void run_trial(tune::TrialContext& t, const Data& d, int quarters, uint64_t seed) {
  const auto& c = t.config();
  const double lr = tune::to_double(c.at("lr"));
  const int64_t batch = std::get<int64_t>(c.at("batch"));
  const int64_t hidden = std::get<int64_t>(c.at("hidden"));
  const double dropout = tune::to_double(c.at("dropout"));
  const uint64_t trial_seed = seed * 1000 + static_cast<uint64_t>(t.number());
  nn::Sequential model;
  {
    std::lock_guard<std::mutex> lock(g_seed_mutex);
    torch::manual_seed(trial_seed);
    model = mlp(hidden, dropout);
  }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
  const std::string ck = t.checkpoint_dir();
  int done = 0;
  if (t.resumed() && std::ifstream(ck + "/quarter") >> done) {
    torch::load(model, ck + "/model.pt");
    torch::load(opt, ck + "/opt.pt");
  }
  const int64_t n = d.train_x.size(0);
  const int64_t per_quarter = (n + batch * 4 - 1) / (batch * 4);
  for (int q = done + 1; q <= quarters; ++q) {
    auto gen = at::detail::createCPUGenerator(trial_seed * 100 + static_cast<uint64_t>(q));
    const torch::Tensor perm = torch::randperm(n, gen, torch::kLong);
    model->train();
    for (int64_t s = 0; s < per_quarter; ++s) {
      const torch::Tensor idx =
          perm.slice(0, (s * batch) % (n - batch), (s * batch) % (n - batch) + batch);
      opt.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(d.train_x.index_select(0, idx)),
                                           d.train_y.index_select(0, idx))
          .backward();
      opt.step();
    }
    model->eval();
    double acc = 0;
    {
      torch::NoGradGuard no_grad;
      acc =
          model->forward(d.test_x).argmax(1).eq(d.test_y).to(torch::kDouble).mean().item<double>();
    }
    torch::save(model, ck + "/model.pt");
    torch::save(opt, ck + "/opt.pt");
    std::ofstream(ck + "/quarter.tmp") << q;
    std::filesystem::rename(ck + "/quarter.tmp", ck + "/quarter");
    t.report({{"training_iteration", q}, {"accuracy", acc}});
  }
}

struct Outcome {
  double best_accuracy = 0, epochs_used = 0, wall_seconds = 0;
};

Outcome run_paratrain(const std::string& system,
                      uint64_t seed,
                      const Data& d,
                      int trials,
                      int quarters,
                      int concurrent,
                      const std::string& dir) {
  tune::SearchSpace space;
  space.add("lr=loguniform(1e-3, 0.3)");
  space.add("batch=choice(32, 64, 128, 256)");
  space.add("hidden=choice(128, 256, 512)");
  space.add("dropout=uniform(0, 0.5)");
  const std::string searcher = system == "paratrain-bohb" ? "bohb" : "random";
  const std::string scheduler = system == "paratrain-bohb"   ? "hyperband"
                                : system == "paratrain-asha" ? "asha"
                                                             : "fifo";
  const std::string study = system + "-" + std::to_string(seed);
  const auto start = std::chrono::steady_clock::now();
  const tune::TuneResult r =
      tune::tune(space,
                 tune::TunerOptions()
                     .storage(dir + "/bench.db")
                     .study(study)
                     .metric("accuracy")
                     .mode("max")
                     .num_samples(trials)
                     .max_concurrent(concurrent)
                     .cpus(concurrent)
                     .trial_dir(dir + "/" + study)
                     .output("none")
                     .searcher(tune::SearcherOptions().kind(searcher).seed(seed))
                     .scheduler(tune::SchedulerOptions().kind(scheduler).max_t(quarters)),
                 [&](tune::TrialContext& t) { run_trial(t, d, quarters, seed); });
  Outcome o;
  o.wall_seconds = seconds_since(start);
  for (const auto& t : r.trials) {
    o.epochs_used += static_cast<double>(t.iterations) / 4;
    if (t.state == tune::TrialState::kComplete && t.iterations >= quarters) {
      o.best_accuracy = std::max(o.best_accuracy, t.value);
    }
  }
  return o;
}

Outcome run_optuna(
    const std::string& system, uint64_t seed, int trials, int quarters, const std::string& python) {
  const bool tpe = system == "optuna-tpe-hyperband";
  const std::string cmd = "'" + python + "' '" + bench_script("tune_optuna.py") + "' --seed " +
                          std::to_string(seed) + " --sampler " + (tpe ? "tpe" : "random") +
                          " --pruner " + (tpe ? "hyperband" : "none") + " --trials " +
                          std::to_string(trials) + " --quarters " + std::to_string(quarters);
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    throw std::runtime_error("cannot run " + cmd);
  }
  std::string last;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), p)) {
    last = buf;
  }
  if (::pclose(p) != 0 || last.empty()) {
    throw std::runtime_error("the Optuna side failed (is python3-optuna installed?): " + cmd);
  }
  Outcome o;
  o.best_accuracy = std::stod(json_field(last, "best_accuracy"));
  o.epochs_used = std::stod(json_field(last, "epochs_used"));
  o.wall_seconds = std::stod(json_field(last, "wall_seconds"));
  return o;
}

const CommandSpec& tune_bench_spec() {
  static const CommandSpec spec{
      "paratrain bench tune",
      "paratrain tune (BOHB, ASHA, random) against Optuna (TPE with its Hyperband pruner, random)\n"
      "on the same search over the mlp on Fashion-MNIST, in one run.",
      {
          {"seeds", "N", "seeds 0..N-1 (default 3)"},
          {"trials", "N", "trials per search (default 20)"},
          {"epochs", "E", "epochs a trial runs at most (default 2)"},
          {"max-concurrent", "K", "paratrain's concurrent trials (default: one per core)"},
          {"systems", "LIST", "a comma-separated subset of the five systems"},
          {"python", "PATH", "the Python with torch and optuna (default /usr/bin/python3)"},
          {"json", "", "print JSON rows"},
      }};
  return spec;
}

}  // namespace

int run_bench_tune(const std::vector<std::string>& argv) {
  Args args(argv, tune_bench_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  const int seeds = args.get_int("seeds", 3), trials = args.get_int("trials", 20);
  const int quarters = 4 * args.get_int("epochs", 2);
  const int concurrent = args.get_int(
      "max-concurrent", static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  if (seeds < 1 || trials < 1 || quarters < 4 || concurrent < 1) {
    throw UsageError("--seeds, --trials, --epochs and --max-concurrent must be >= 1");
  }
  std::vector<std::string> systems{"paratrain-bohb", "paratrain-asha", "paratrain-random",
                                   "optuna-tpe-hyperband", "optuna-random"};
  if (args.has("systems")) {
    std::vector<std::string> picked;
    std::stringstream list(args.get("systems"));
    for (std::string s; std::getline(list, s, ',');) {
      if (std::find(systems.begin(), systems.end(), s) == systems.end()) {
        throw UsageError("unknown system '" + s + "' in --systems");
      }
      picked.push_back(s);
    }
    systems = picked;
  }
  const bool json = args.has("json");
  const std::string python = torch_python(args.get("python", ""));
  torch::set_num_threads(1);
  // OpenBLAS keeps its own pool, which set_num_threads does not reach: two trials sharing its
  // spinning threads each ran at a fraction of their speed.
  set_blas_threads(1);
  const Data d = load_data();
  const std::string dir = results_file("tune");
  std::filesystem::remove(dir);
  std::filesystem::create_directories(dir);
  std::map<std::string, std::vector<Outcome> > all;
  for (int seed = 0; seed < seeds; ++seed) {
    for (const auto& system : systems) {
      const Outcome o =
          system.rfind("optuna", 0) == 0
              ? run_optuna(system, static_cast<uint64_t>(seed), trials, quarters, python)
              : run_paratrain(system, static_cast<uint64_t>(seed), d, trials, quarters, concurrent,
                              dir);
      all[system].push_back(o);
      JsonRow row{{"system", system},
                  {"seed", seed},
                  {"best_accuracy", o.best_accuracy},
                  {"epochs_used", o.epochs_used},
                  {"wall_seconds", o.wall_seconds}};
      std::cout << (json ? json_line(row) : row.dump()) << std::endl;
    }
  }
  auto mean = [](const std::vector<Outcome>& v, double Outcome::*f) {
    double s = 0;
    for (const auto& o : v) {
      s += o.*f;
    }
    return s / static_cast<double>(v.size());
  };
  const auto ref = all.find("optuna-tpe-hyperband");
  for (const auto& system : systems) {
    const auto& v = all[system];
    JsonRow row{{"system", system},
                {"seeds", seeds},
                {"mean_best_accuracy", mean(v, &Outcome::best_accuracy)},
                {"mean_epochs_used", mean(v, &Outcome::epochs_used)},
                {"mean_wall_seconds", mean(v, &Outcome::wall_seconds)}};
    if (ref != all.end()) {
      row["accuracy_minus_optuna_tpe"] =
          mean(v, &Outcome::best_accuracy) - mean(ref->second, &Outcome::best_accuracy);
      row["wall_ratio_to_optuna_tpe"] =
          mean(v, &Outcome::wall_seconds) / mean(ref->second, &Outcome::wall_seconds);
    }
    std::cout << (json ? json_line(row) : row.dump()) << std::endl;
  }
  detail::remove_tree(dir);
  return 0;
}
#endif

}  // namespace cli
}  // namespace paratrain
