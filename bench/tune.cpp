// paratrain bench tune: paratrain tune against Optuna on the same search, in the same run.
//
// The search: the mlp (the zoo's, with hidden units and dropout as parameters) on Fashion-MNIST,
// lr loguniform(1e-3, 0.3), batch choice(32, 64, 128, 256), hidden choice(128, 256, 512), dropout
// uniform(0, 0.5); at most 2 epochs a trial, test accuracy reported every quarter epoch (so
// max_t is 8), 20 trials, 1 thread per trial. paratrain runs its trials as C++ functions,
// --max-concurrent at once (default: one per core); Optuna (bench/tune_optuna.py, Debian's
// python3-optuna) runs them one after another with n_jobs=1, Optuna's default.
//
// Rows: system (paratrain-bohb (BOHB on synchronous Hyperband), paratrain-bohb-asha (BOHB's model
// fed by ASHA's rungs), paratrain-asha, paratrain-random, optuna-tpe-hyperband, optuna-random),
// seed, best_accuracy (the best trial that ran to max_t, at its last report, as
// Optuna's best_value), epochs_used, wall_seconds; then one mean row per system with its ratios
// to optuna-tpe-hyperband. Where no Python here imports torch and optuna, the Optuna systems are
// left out, said in one line; a build without SQLite has no tuner, and says so.

#include "args.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"
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

namespace {

const BenchSpec& tune_spec() {
  // --smoke: each system once, 2 trials of one epoch over the first 1024 training images (every
  // batch choice fits in them), scored on 256 test images.
  static const BenchSpec spec{
      "tune",
      "paratrain tune (BOHB on Hyperband or ASHA, ASHA, random) against Optuna (TPE with its "
      "Hyperband pruner, random)\n"
      "on the same search over the mlp on Fashion-MNIST, in one run.",
      {
          {"seeds", "N", "seeds 0..N-1 (default 3)", "1"},
          {"trials", "N", "trials per search (default 20)", "2"},
          {"epochs", "E", "epochs a trial runs at most (default 2)", "1"},
          {"max-concurrent", "K", "paratrain's concurrent trials (default: one per core)"},
          {"systems", "LIST", "a comma-separated subset of the six systems"},
          {"python", "PATH", "the Python with torch and optuna (default /usr/bin/python3)"},
          {"train-images", "N", "the training images trials draw from (default 60000: all)",
           "1024"},
          {"test-images", "N", "the test images trials are scored on (default 10000: all)", "256"},
      },
      "print JSON rows"};
  return spec;
}

}  // namespace

#ifndef PARATRAIN_WITH_TUNE
int run_bench_tune(const std::vector<std::string>& argv) {
  return run_benchmark(tune_spec(), argv, [](const Bench& bench) {
    return not_available(bench, "this build has no SQLite (install libsqlite3-dev)");
  });
}
#else
namespace {

namespace nn = torch::nn;

struct Data {
  torch::Tensor train_x, train_y, test_x, test_y;
};

// The first `train_images` training and `test_images` test images.
Data load_data(int64_t train_images, int64_t test_images) {
  // images() are already normalized as torchvision's Normalize((0.2860,), (0.3530,)) would
  auto flat = [](const data::FashionMNIST& d, int64_t n) {
    return d.images().reshape({-1, 784}).slice(0, 0, n);
  };
  data::FashionMNIST train(data::kFashionMnistDir, data::FashionMNIST::Split::kTrain);
  data::FashionMNIST test(data::kFashionMnistDir, data::FashionMNIST::Split::kTest);
  return {flat(train, train_images), train.targets().to(torch::kLong).slice(0, 0, train_images),
          flat(test, test_images), test.targets().to(torch::kLong).slice(0, 0, test_images)};
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
  const bool bohb = system.rfind("paratrain-bohb", 0) == 0;
  const std::string searcher = bohb ? "bohb" : "random";
  const std::string scheduler = system == "paratrain-bohb" ? "hyperband"
                                : system == "paratrain-asha" || system == "paratrain-bohb-asha"
                                    ? "asha"
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

// What every search runs: the search's size, and the data its trials see.
struct TunePlan {
  int seeds = 0, trials = 0, quarters = 0, concurrent = 0;
  int train_images = 0, test_images = 0;
  std::vector<std::string> systems;
  std::string python;  // of the Optuna systems; "" when they are left out
};

Outcome run_optuna(const std::string& system, uint64_t seed, const TunePlan& plan) {
  const bool tpe = system == "optuna-tpe-hyperband";
  const std::string cmd =
      "'" + plan.python + "' '" + bench_script("tune_optuna.py") + "' --seed " +
      std::to_string(seed) + " --sampler " + (tpe ? "tpe" : "random") + " --pruner " +
      (tpe ? "hyperband" : "none") + " --trials " + std::to_string(plan.trials) + " --quarters " +
      std::to_string(plan.quarters) + " --train-images " + std::to_string(plan.train_images) +
      " --test-images " + std::to_string(plan.test_images);
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
  const JsonRow row = parse_row(last);
  Outcome o;
  o.best_accuracy = number_field(row, "best_accuracy");
  o.epochs_used = number_field(row, "epochs_used");
  o.wall_seconds = number_field(row, "wall_seconds");
  return o;
}

// The Python of the Optuna systems, or "" where they are left out: under --smoke without
// --python (the rows say so), or where no Python here has torch and optuna (said in one line).
std::string optuna_python(const Bench& bench) {
  if (bench.smoke() && !bench.has("python")) {
    return "";
  }
  std::string python;
  try {
    python = torch_python(bench.get("python", ""));
  } catch (const std::exception& e) {
    std::cerr << "paratrain bench tune: the Optuna systems are left out: " << e.what() << std::endl;
    return "";
  }
  if (std::system(("'" + python + "' -c 'import optuna' >/dev/null 2>&1").c_str()) != 0) {
    std::cerr << "paratrain bench tune: the Optuna systems are left out: " << python
              << " cannot import optuna (install python3-optuna)" << std::endl;
    return "";
  }
  return python;
}

bool is_optuna(const std::string& system) {
  return system.rfind("optuna", 0) == 0;
}

// --systems (default all six).
std::vector<std::string> tune_systems(const Bench& bench) {
  const std::vector<std::string> all{"paratrain-bohb",   "paratrain-bohb-asha",  "paratrain-asha",
                                     "paratrain-random", "optuna-tpe-hyperband", "optuna-random"};
  if (!bench.has("systems")) {
    return all;
  }
  const std::vector<std::string> systems = split_list(bench.get("systems"));
  for (const auto& s : systems) {
    if (std::find(all.begin(), all.end(), s) == all.end()) {
      throw UsageError("unknown system '" + s + "' in --systems");
    }
  }
  return systems;
}

TunePlan tune_plan(const Bench& bench) {
  TunePlan p;
  p.seeds = bench.get_int("seeds", 3);
  p.trials = bench.get_int("trials", 20);
  p.quarters = 4 * bench.get_int("epochs", 2);
  p.concurrent = bench.get_int("max-concurrent",
                               static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  if (p.seeds < 1 || p.trials < 1 || p.quarters < 4 || p.concurrent < 1) {
    throw UsageError("--seeds, --trials, --epochs and --max-concurrent must be >= 1");
  }
  p.train_images = bench.get_int("train-images", 60000);
  p.test_images = bench.get_int("test-images", 10000);
  // Above the largest batch choice (256): a trial's batches are drawn from the first images.
  if (p.train_images < 512 || p.train_images > 60000 || p.test_images < 1 ||
      p.test_images > 10000) {
    throw UsageError("--train-images must be 512 to 60000 and --test-images 1 to 10000, got " +
                     std::to_string(p.train_images) + " and " + std::to_string(p.test_images));
  }
  p.systems = tune_systems(bench);
  if (std::any_of(p.systems.begin(), p.systems.end(), is_optuna)) {
    p.python = optuna_python(bench);
  }
  if (p.python.empty()) {
    p.systems.erase(std::remove_if(p.systems.begin(), p.systems.end(), is_optuna), p.systems.end());
  }
  return p;
}

// One row per system and seed, printed as each search ends; the outcomes by system.
std::map<std::string, std::vector<Outcome> > run_searches(const Bench& bench, const TunePlan& p) {
  torch::set_num_threads(1);
  // OpenBLAS keeps its own pool, which set_num_threads does not reach: two trials sharing its
  // spinning threads each ran at a fraction of their speed.
  set_blas_threads(1);
  const Data d = load_data(p.train_images, p.test_images);
  const std::string dir = results_file("tune");
  std::filesystem::remove(dir);
  std::filesystem::create_directories(dir);
  std::map<std::string, std::vector<Outcome> > all;
  for (int seed = 0; seed < p.seeds; ++seed) {
    for (const auto& system : p.systems) {
      const Outcome o = is_optuna(system) ? run_optuna(system, static_cast<uint64_t>(seed), p)
                                          : run_paratrain(system, static_cast<uint64_t>(seed), d,
                                                          p.trials, p.quarters, p.concurrent, dir);
      all[system].push_back(o);
      JsonRow row{{"system", system},
                  {"seed", seed},
                  {"best_accuracy", o.best_accuracy},
                  {"epochs_used", o.epochs_used},
                  {"wall_seconds", o.wall_seconds}};
      note_smoke_skip(bench, row, "optuna");
      std::cout << (bench.json() ? json_line(row) : row.dump()) << std::endl;
    }
  }
  detail::remove_tree(dir);
  return all;
}

double mean_of(const std::vector<Outcome>& v, double Outcome::*f) {
  double s = 0;
  for (const auto& o : v) {
    s += o.*f;
  }
  return s / static_cast<double>(v.size());
}

int run_tune_bench(const Bench& bench) {
  const TunePlan p = tune_plan(bench);
  if (p.systems.empty()) {
    return not_available(bench, "no system of --systems can run here");
  }
  std::map<std::string, std::vector<Outcome> > all = run_searches(bench, p);
  const auto ref = all.find("optuna-tpe-hyperband");
  for (const auto& system : p.systems) {
    const auto& v = all[system];
    JsonRow row{{"system", system},
                {"seeds", p.seeds},
                {"mean_best_accuracy", mean_of(v, &Outcome::best_accuracy)},
                {"mean_epochs_used", mean_of(v, &Outcome::epochs_used)},
                {"mean_wall_seconds", mean_of(v, &Outcome::wall_seconds)}};
    if (ref != all.end()) {
      row["accuracy_minus_optuna_tpe"] =
          mean_of(v, &Outcome::best_accuracy) - mean_of(ref->second, &Outcome::best_accuracy);
      row["wall_ratio_to_optuna_tpe"] =
          mean_of(v, &Outcome::wall_seconds) / mean_of(ref->second, &Outcome::wall_seconds);
    }
    std::cout << (bench.json() ? json_line(row) : row.dump()) << std::endl;
  }
  return 0;
}

}  // namespace

int run_bench_tune(const std::vector<std::string>& argv) {
  return run_benchmark(tune_spec(), argv, run_tune_bench);
}
#endif

}  // namespace cli
}  // namespace paratrain
