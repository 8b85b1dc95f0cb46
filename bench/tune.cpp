// paratrain bench tune: paratrain tune against Optuna and Ray Tune on the same search, in the
// same run.
//
// The search: the mlp (the zoo's, with hidden units and dropout as parameters) on Fashion-MNIST,
// lr loguniform(1e-3, 0.3), batch choice(32, 64, 128, 256), hidden choice(128, 256, 512), dropout
// uniform(0, 0.5); at most 2 epochs a trial, test accuracy reported every quarter epoch (so
// max_t is 8), 20 trials, 1 thread per trial. paratrain runs its trials as C++ functions,
// --max-concurrent at once (default: one per core); Ray Tune (bench/tune_ray.py) runs as many at
// once, one CPU each; Optuna (bench/tune_optuna.py) runs them one after another with n_jobs=1,
// Optuna's default. Every side trains a trial the same way (bench/tune_common.py).
//
// The PBT case: --pbt-population trials (default 4) drawn at random from the same space, each
// trained to --pbt-epochs (default 4), perturbed every half epoch (lr, batch and dropout
// mutate), by paratrain's pbt and Ray Tune's PopulationBasedTraining, at the same concurrency.
//
// Systems: paratrain-bohb (BOHB on synchronous Hyperband), paratrain-bohb-asha (BOHB's model fed
// by ASHA's rungs), paratrain-asha, paratrain-random, paratrain-pbt; optuna-VERSION-tpe-hyperband
// and optuna-VERSION-random for each Optuna of the anchor Pythons (anchors.h: Debian's 3.1, PyPI's
// current); ray-tune-asha (ASHA with random search), ray-tune-bohb (TuneBOHB with
// HyperBandForBOHB), ray-tune-pbt. Rows: system, seed, best_accuracy (the best trial that ran to
// max_t, at its last report, as Optuna's best_value), epochs_used (quarter epochs trained, over
// 4), wall_seconds; then one mean row per system, with its ratios to the newest Optuna's TPE;
// then the targets against Ray Tune: paratrain's accuracy at least Ray's (mean over the seeds,
// within 0.1 point) in at most 0.5x its wall time, for ASHA and for BOHB; PBT's best accuracy at
// least Ray's PBT's on the same epochs. A side whose Python is missing is left out, said in one
// line; a build without SQLite has no tuner, and says so.

#include "anchors.h"
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

#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace paratrain {
namespace cli {

namespace {

const BenchSpec& tune_spec() {
  // --smoke: each paratrain system once, 2 trials of one epoch over the first 1024 training
  // images (every batch choice fits in them), scored on 256 test images; PBT with 2 trials.
  static const BenchSpec spec{
      "tune",
      "paratrain tune (BOHB on Hyperband or ASHA, ASHA, random, PBT) against Optuna (TPE with its "
      "Hyperband pruner, random)\n"
      "and Ray Tune (ASHA, BOHB, PBT) on the same search over the mlp on Fashion-MNIST, in one "
      "run.",
      {
          {"seeds", "N", "seeds 0..N-1 (default 3)", "1"},
          {"trials", "N", "trials per search (default 20)", "2"},
          {"epochs", "E", "epochs a trial runs at most (default 2)", "1"},
          {"pbt-population", "N", "the PBT case's trials (default 4)", "2"},
          {"pbt-epochs", "E", "the PBT case's epochs a trial (default 4)", "1"},
          {"max-concurrent", "K",
           "paratrain's and Ray's concurrent trials (default: one per core)"},
          {"systems", "LIST",
           "a comma-separated subset of the systems (optuna-tpe-hyperband and optuna-random "
           "name each Optuna's)"},
          {"python", "LIST", anchor_pythons_help("of Optuna and Ray Tune")},
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

// One quarter epoch of SGD: batches drawn in order from a permutation seeded by the trial and the
// quarter, so that a resumed trial continues the same sequence (bench/tune_common.py does the
// same for Optuna and Ray Tune).
void train_quarter(nn::Sequential& model,
                   torch::optim::SGD& opt,
                   const Data& d,
                   int64_t batch,
                   uint64_t trial_seed,
                   int q) {
  const int64_t n = d.train_x.size(0);
  const int64_t per_quarter = (n + batch * 4 - 1) / (batch * 4);
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
}

// One trial: SGD (momentum 0.9) a quarter epoch at a time, test accuracy after each. It keeps
// a checkpoint after each report, so that a paused (Hyperband, PBT) trial continues where it was,
// and a PBT trial that exploits another continues from that one's. `trained` counts the quarters.
void run_trial(
    tune::TrialContext& t, const Data& d, int quarters, uint64_t seed, std::atomic<int>& trained) {
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
    for (auto& g : opt.param_groups()) {  // the checkpoint's lr is its source's: PBT changed ours
      g.options().set_lr(lr);
    }
  }
  for (int q = done + 1; q <= quarters; ++q) {
    train_quarter(model, opt, d, batch, trial_seed, q);
    model->eval();
    double acc = 0;
    {
      torch::NoGradGuard no_grad;
      acc =
          model->forward(d.test_x).argmax(1).eq(d.test_y).to(torch::kDouble).mean().item<double>();
    }
    // Each file written aside, then renamed: an exploiting trial copies this directory while this
    // one trains on, and must never read a half-written file (quarter is renamed last).
    torch::save(model, ck + "/model.pt.tmp");
    torch::save(opt, ck + "/opt.pt.tmp");
    std::filesystem::rename(ck + "/model.pt.tmp", ck + "/model.pt");
    std::filesystem::rename(ck + "/opt.pt.tmp", ck + "/opt.pt");
    std::ofstream(ck + "/quarter.tmp") << q;
    std::filesystem::rename(ck + "/quarter.tmp", ck + "/quarter");
    ++trained;
    t.report({{"training_iteration", q}, {"accuracy", acc}});
  }
}

struct Outcome {
  double best_accuracy = 0, epochs_used = 0, wall_seconds = 0;
};

// One search's size: the trials, the quarter epochs each runs at most, and how many at once.
struct SearchCase {
  int trials = 0, quarters = 0, concurrent = 0;
};

// The schedulers of paratrain's systems: PBT perturbs every half epoch (2 quarters), as Ray's in
// bench/tune_ray.py.
tune::SchedulerOptions paratrain_scheduler(const std::string& system, int quarters) {
  const std::string kind = system == "paratrain-bohb" ? "hyperband"
                           : system == "paratrain-asha" || system == "paratrain-bohb-asha" ? "asha"
                           : system == "paratrain-pbt"                                     ? "pbt"
                                                                                           : "fifo";
  tune::SchedulerOptions o = tune::SchedulerOptions().kind(kind).max_t(quarters);
  if (kind == "pbt") {
    o.perturbation_interval(2).mutations(
        {"lr=loguniform(1e-3, 0.3)", "batch=choice(32, 64, 128, 256)", "dropout=uniform(0, 0.5)"});
  }
  return o;
}

Outcome run_paratrain(const std::string& system,
                      uint64_t seed,
                      const Data& d,
                      const SearchCase& c,
                      const std::string& dir) {
  tune::SearchSpace space;
  space.add("lr=loguniform(1e-3, 0.3)");
  space.add("batch=choice(32, 64, 128, 256)");
  space.add("hidden=choice(128, 256, 512)");
  space.add("dropout=uniform(0, 0.5)");
  const bool bohb = system.rfind("paratrain-bohb", 0) == 0;
  const std::string study = system + "-" + std::to_string(seed);
  std::atomic<int> trained{0};
  const auto start = std::chrono::steady_clock::now();
  const tune::TuneResult r =
      tune::tune(space,
                 tune::TunerOptions()
                     .storage(dir + "/bench.db")
                     .study(study)
                     .metric("accuracy")
                     .mode("max")
                     .num_samples(c.trials)
                     .max_concurrent(c.concurrent)
                     .cpus(c.concurrent)
                     .trial_dir(dir + "/" + study)
                     .output("none")
                     .searcher(tune::SearcherOptions().kind(bohb ? "bohb" : "random").seed(seed))
                     .scheduler(paratrain_scheduler(system, c.quarters)),
                 [&](tune::TrialContext& t) { run_trial(t, d, c.quarters, seed, trained); });
  Outcome o;
  o.wall_seconds = seconds_since(start);
  o.epochs_used = trained.load() / 4.0;
  for (const auto& t : r.trials) {
    if (t.state == tune::TrialState::kComplete && t.iterations >= c.quarters) {
      o.best_accuracy = std::max(o.best_accuracy, t.value);
    }
  }
  return o;
}

// A system of the Python side: its row name, the Python that runs it, the script's arguments
// beyond the search's, and the version its rows carry.
struct PythonSystem {
  std::string name;  // optuna-5.0.0-tpe-hyperband, ray-tune-asha
  std::string kind;  // its name in --systems: optuna-tpe-hyperband, ray-tune-asha
  AnchorPython anchor;
  std::string script;
  std::vector<std::string> args;
  std::string version;  // "optuna 5.0.0, torch 2.15.0"
};

// What every search runs: the searches' sizes, the data their trials see, and the systems.
struct TunePlan {
  int seeds = 0;
  SearchCase search, pbt;
  int train_images = 0, test_images = 0;
  std::vector<std::string> systems;  // every row name, in order
  std::map<std::string, PythonSystem> python;
};

bool is_pbt(const std::string& system) {
  return system == "paratrain-pbt" || system == "ray-tune-pbt";
}

// Runs a Python system's search: its script prints one row last.
Outcome run_python(const PythonSystem& s, uint64_t seed, const TunePlan& plan) {
  const SearchCase& c = is_pbt(s.name) ? plan.pbt : plan.search;
  std::string cmd = "'" + s.anchor.python + "' '" + bench_script(s.script) + "' --seed " +
                    std::to_string(seed) + " --trials " + std::to_string(c.trials) +
                    " --quarters " + std::to_string(c.quarters) + " --train-images " +
                    std::to_string(plan.train_images) + " --test-images " +
                    std::to_string(plan.test_images);
  for (const auto& arg : s.args) {
    cmd += " " + arg;
  }
  FILE* p = ::popen(cmd.c_str(), "r");
  require(p != nullptr, "cannot run " + cmd);
  std::string last;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), p)) {
    last = buf;
  }
  require(::pclose(p) == 0 && !last.empty(), s.name + " failed: " + cmd);
  const JsonRow row = parse_row(last);
  Outcome o;
  o.best_accuracy = number_field(row, "best_accuracy");
  o.epochs_used = number_field(row, "epochs_used");
  o.wall_seconds = number_field(row, "wall_seconds");
  return o;
}

// The Optuna and Ray Tune systems of the anchors: Optuna's two for each Optuna version, Ray's
// three for the first Python with Ray, hpbandster and ConfigSpace. Left out under --smoke unless
// --python names the Pythons; Ray then also waits for --systems to name it (it starts slowly).
std::vector<PythonSystem> python_systems(const Bench& bench, const TunePlan& p) {
  std::vector<PythonSystem> out;
  std::vector<AnchorPython> anchors;
  try {
    anchors = anchor_pythons(bench);
  } catch (const std::exception& e) {
    std::cerr << "paratrain bench tune: the Optuna and Ray Tune systems are left out: " << e.what()
              << std::endl;
  }
  std::set<std::string> optunas;
  for (const auto& a : anchors_with(bench, anchors, "optuna")) {
    const std::string v = a.package("optuna");
    if (!optunas.insert(v).second) {
      continue;
    }
    const std::string version = "optuna " + v + ", torch " + a.torch;
    out.push_back({"optuna-" + v + "-tpe-hyperband",
                   "optuna-tpe-hyperband",
                   a,
                   "tune_optuna.py",
                   {"--sampler", "tpe", "--pruner", "hyperband"},
                   version});
    out.push_back({"optuna-" + v + "-random",
                   "optuna-random",
                   a,
                   "tune_optuna.py",
                   {"--sampler", "random", "--pruner", "none"},
                   version});
  }
  if (bench.smoke() && !bench.has("systems")) {
    return out;
  }
  for (const auto& a : anchors_with(bench, anchors, "ray")) {
    if (a.package("hpbandster").empty() || a.package("configspace").empty()) {
      std::cerr << "paratrain bench tune: leaving out Ray Tune of " << a.python
                << ": TuneBOHB needs hpbandster and ConfigSpace" << std::endl;
      continue;
    }
    const std::string version = "ray " + a.package("ray") + ", torch " + a.torch;
    for (const char* kind : {"asha", "bohb", "pbt"}) {
      const std::string concurrent =
          std::to_string(std::string(kind) == "pbt" ? p.pbt.concurrent : p.search.concurrent);
      out.push_back({std::string("ray-tune-") + kind,
                     std::string("ray-tune-") + kind,
                     a,
                     "tune_ray.py",
                     {"--system", kind, "--concurrent", concurrent},
                     version});
    }
    break;  // one Ray Tune
  }
  return out;
}

// --systems (default all): the row names to run. A name selects each version of it.
void choose_systems(const Bench& bench, TunePlan& p, const std::vector<PythonSystem>& python) {
  const std::vector<std::string> ours{"paratrain-bohb", "paratrain-bohb-asha", "paratrain-asha",
                                      "paratrain-random", "paratrain-pbt"};
  const std::set<std::string> known{ours.begin(), ours.end()};
  std::set<std::string> kinds{"optuna-tpe-hyperband", "optuna-random", "ray-tune-asha",
                              "ray-tune-bohb", "ray-tune-pbt"};
  const std::vector<std::string> asked = split_list(bench.get("systems", ""));
  for (const auto& s : asked) {
    if (!known.count(s) && !kinds.count(s)) {
      throw UsageError("unknown system '" + s + "' in --systems");
    }
  }
  auto wanted = [&](const std::string& kind) {
    return asked.empty() || std::find(asked.begin(), asked.end(), kind) != asked.end();
  };
  for (const auto& s : ours) {
    if (wanted(s)) {
      p.systems.push_back(s);
    }
  }
  for (const auto& s : python) {
    if (wanted(s.kind)) {
      p.systems.push_back(s.name);
      p.python[s.name] = s;
    }
  }
}

TunePlan tune_plan(const Bench& bench) {
  TunePlan p;
  p.seeds = bench.get_int("seeds", 3);
  const int concurrent = bench.get_int(
      "max-concurrent", static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  p.search = {bench.get_int("trials", 20), 4 * bench.get_int("epochs", 2), concurrent};
  p.pbt = {bench.get_int("pbt-population", 4), 4 * bench.get_int("pbt-epochs", 4), concurrent};
  if (p.seeds < 1 || p.search.trials < 1 || p.search.quarters < 4 || concurrent < 1 ||
      p.pbt.trials < 2 || p.pbt.quarters < 4) {
    throw UsageError(
        "--seeds, --trials, --epochs, --pbt-epochs and --max-concurrent must be >= 1, "
        "--pbt-population >= 2");
  }
  p.train_images = bench.get_int("train-images", 60000);
  p.test_images = bench.get_int("test-images", 10000);
  // Above the largest batch choice (256): a trial's batches are drawn from the first images.
  if (p.train_images < 512 || p.train_images > 60000 || p.test_images < 1 ||
      p.test_images > 10000) {
    throw UsageError("--train-images must be 512 to 60000 and --test-images 1 to 10000, got " +
                     std::to_string(p.train_images) + " and " + std::to_string(p.test_images));
  }
  choose_systems(bench, p, python_systems(bench, p));
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
      const auto python = p.python.find(system);
      const uint64_t s = static_cast<uint64_t>(seed);
      const Outcome o = python != p.python.end()
                            ? run_python(python->second, s, p)
                            : run_paratrain(system, s, d, is_pbt(system) ? p.pbt : p.search, dir);
      all[system].push_back(o);
      JsonRow row{{"system", system},
                  {"seed", seed},
                  {"best_accuracy", o.best_accuracy},
                  {"epochs_used", o.epochs_used},
                  {"wall_seconds", o.wall_seconds}};
      if (python != p.python.end()) {
        mark_anchor(row, python->second.anchor, python->second.version);
      }
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

// The targets against Ray Tune, each where both sides ran: paratrain's accuracy at least Ray's
// (the mean over the seeds, within 0.1 point) in at most 0.5x its wall time, for ASHA and BOHB
// (both of paratrain's BOHBs); PBT's best accuracy at least Ray's, with the ratio of the epochs
// each trained beside it (the same schedule; an exploit of a trial behind retrains quarters).
std::vector<Target> tune_targets(std::map<std::string, std::vector<Outcome> >& all) {
  std::vector<Target> out;
  const std::vector<std::array<std::string, 3> > pairs{
      {"tune-asha", "paratrain-asha", "ray-tune-asha"},
      {"tune-bohb", "paratrain-bohb", "ray-tune-bohb"},
      {"tune-bohb (BOHB on ASHA)", "paratrain-bohb-asha", "ray-tune-bohb"},
      {"tune-pbt", "paratrain-pbt", "ray-tune-pbt"}};
  for (const auto& [name, ours, theirs] : pairs) {
    if (!all.count(ours) || !all.count(theirs)) {
      continue;
    }
    const double accuracy =
        mean_of(all[ours], &Outcome::best_accuracy) - mean_of(all[theirs], &Outcome::best_accuracy);
    Target t{name, theirs, {}};
    if (name == "tune-pbt") {
      t.checks = {{"accuracy_difference", accuracy, 0.0, false}};
      t.notes = {{"epochs_ratio", mean_of(all[ours], &Outcome::epochs_used) /
                                      mean_of(all[theirs], &Outcome::epochs_used)}};
    } else {
      t.checks = {{"accuracy_difference", accuracy, -0.001, false},
                  {"wall_ratio",
                   mean_of(all[ours], &Outcome::wall_seconds) /
                       mean_of(all[theirs], &Outcome::wall_seconds),
                   0.5, true}};
    }
    out.push_back(t);
  }
  return out;
}

// Whether version a ("5.0.0") is newer than b ("3.1.0"), number by number.
bool newer_version(const std::string& a, const std::string& b) {
  std::istringstream x(a), y(b);
  for (std::string p, q;;) {
    const bool more_a = static_cast<bool>(std::getline(x, p, '.'));
    const bool more_b = static_cast<bool>(std::getline(y, q, '.'));
    if (!more_a || !more_b) {
      return more_a;
    }
    const long u = std::atol(p.c_str()), v = std::atol(q.c_str());
    if (u != v) {
      return u > v;
    }
  }
}

// The reference of the mean rows' ratios: the newest Optuna's TPE ("" when none ran).
std::string optuna_reference(const TunePlan& p) {
  std::string best;
  for (const auto& [name, s] : p.python) {
    if (s.kind == "optuna-tpe-hyperband" &&
        (best.empty() ||
         newer_version(s.anchor.package("optuna"), p.python.at(best).anchor.package("optuna")))) {
      best = name;
    }
  }
  return best;
}

int run_tune_bench(const Bench& bench) {
  const TunePlan p = tune_plan(bench);
  if (p.systems.empty()) {
    return not_available(bench, "no system of --systems can run here");
  }
  std::map<std::string, std::vector<Outcome> > all = run_searches(bench, p);
  const std::string ref = optuna_reference(p);
  for (const auto& system : p.systems) {
    const auto& v = all[system];
    JsonRow row{{"system", system},
                {"seeds", p.seeds},
                {"mean_best_accuracy", mean_of(v, &Outcome::best_accuracy)},
                {"mean_epochs_used", mean_of(v, &Outcome::epochs_used)},
                {"mean_wall_seconds", mean_of(v, &Outcome::wall_seconds)}};
    if (!ref.empty() && !is_pbt(system)) {
      row["optuna_reference"] = ref;
      row["accuracy_minus_optuna_tpe"] =
          mean_of(v, &Outcome::best_accuracy) - mean_of(all[ref], &Outcome::best_accuracy);
      row["wall_ratio_to_optuna_tpe"] =
          mean_of(v, &Outcome::wall_seconds) / mean_of(all[ref], &Outcome::wall_seconds);
    }
    std::cout << (bench.json() ? json_line(row) : row.dump()) << std::endl;
  }
  for (const auto& t : tune_targets(all)) {
    print_target(bench, t);
  }
  std::cout.flush();
  return 0;
}

}  // namespace

int run_bench_tune(const std::vector<std::string>& argv) {
  return run_benchmark(tune_spec(), argv, run_tune_bench);
}
#endif

}  // namespace cli
}  // namespace paratrain
