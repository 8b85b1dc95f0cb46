// The tuner end to end: function trials, command trials (real processes), paratrain train
// trials, crashes, a SIGKILLed tuner resumed on the same SQLite study, and bad input through
// the CLI.

#include "paratrain/tune/tuner.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>

namespace paratrain {
namespace tune {
namespace {

using testing::error_of;
using testing::run_cli;
using testing::run_process;

struct TempDir {
  std::string path;
  explicit TempDir(const std::string& name)
      : path(::testing::TempDir() + testing::unique_token(name)) {
    std::filesystem::create_directories(path);
  }
  ~TempDir() { paratrain::testing::remove_tree(path); }
};

void write_script(const std::string& path, const std::string& text) {
  std::ofstream(path) << "#!/bin/sh\n" << text;
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
}

TunerOptions function_options(const TempDir& dir, const std::string& scheduler) {
  return TunerOptions()
      .storage(dir.path + "/study.db")
      .study("f")
      .metric("loss")
      .mode("min")
      .num_samples(16)
      .max_concurrent(2)
      .cpus(2)
      .trial_dir(dir.path + "/trials")
      .output("none")
      .searcher(SearcherOptions().kind("random").seed(3))
      .scheduler(SchedulerOptions().kind(scheduler).max_t(8).reduction_factor(2));
}

// loss(lr, t) = (log10 lr + 2)^2 + 1/t: trials differ by lr and improve with iterations.
void quadratic(TrialContext& t) {
  const double lr = to_double(t.config().at("lr"));
  for (int it = 1; it <= 8; ++it) {
    t.report({{"training_iteration", it}, {"loss", std::pow(std::log10(lr) + 2, 2) + 1.0 / it}});
  }
}

SearchSpace lr_space() {
  SearchSpace s;
  s.add("lr=loguniform(1e-4, 1)");
  return s;
}

TEST(Tuner, AshaOnFunctionTrialsStopsTheWorstAndKeepsTheBest) {
  TempDir dir("tune-asha");
  const TuneResult asha = tune(lr_space(), function_options(dir, "asha"), quadratic);
  ASSERT_EQ(asha.trials.size(), 16u);
  int stopped = 0, complete = 0;
  double best_possible = 1e9;
  int64_t iterations = 0;
  for (const auto& t : asha.trials) {
    stopped += t.state == TrialState::kStopped;
    complete += t.state == TrialState::kComplete;
    iterations += t.iterations;
    if (t.state == TrialState::kComplete) {
      EXPECT_EQ(t.iterations, 8);
    }
    best_possible =
        std::min(best_possible, std::pow(std::log10(to_double(t.config.at("lr"))) + 2, 2));
  }
  EXPECT_EQ(stopped + complete, 16);
  EXPECT_GE(stopped, 6) << "ASHA with rf 2 stops about half at each rung";
  EXPECT_LT(iterations, 16 * 8 * 3 / 4);
  ASSERT_TRUE(asha.best);
  EXPECT_EQ(asha.best->state, TrialState::kComplete);
  // The best complete trial is within the best lr's reach: ASHA never stops the leader.
  EXPECT_NEAR(asha.best->value, best_possible + 1.0 / 8, 0.5);

  // The same study again: everything is finished, nothing runs, the result is the same.
  const TuneResult again = tune(lr_space(), function_options(dir, "asha"), quadratic);
  EXPECT_EQ(again.started, 0);
  ASSERT_TRUE(again.best);
  EXPECT_EQ(again.best->number, asha.best->number);
}

// BOHB over ASHA: the model learns from every rung's results, so its later proposals close in on
// the best lr where random search's do not; no trial ever waits at a rung (none is resumed).
// Before rung results reached the model, only the few trials that ran to max_t did, too few for
// a model over two parameters (6 results on one budget) in 32 trials: BOHB then proposed as
// random search does. `x` does not change the loss.
double later_distance(const std::string& searcher, uint64_t seed, int* resumed) {
  TempDir dir("tune-bohb-asha");
  std::atomic<int> resumes{0};
  auto fn = [&](TrialContext& t) {
    resumes += t.resumed();
    const double lr = to_double(t.config().at("lr"));
    for (int it = 1; it <= 16; ++it) {
      t.report({{"training_iteration", it}, {"loss", std::pow(std::log10(lr) + 2, 2) + 1.0 / it}});
    }
  };
  auto o = function_options(dir, "asha")
               .num_samples(32)
               .max_concurrent(1)  // one at a time: the same results in the same order anywhere
               .searcher(SearcherOptions().kind(searcher).seed(seed))
               .scheduler(SchedulerOptions().kind("asha").max_t(16).reduction_factor(4));
  SearchSpace space = lr_space();
  space.add("x=uniform(0, 1)");
  const TuneResult r = tune(space, o, fn);
  *resumed += resumes;
  double later = 0;
  for (const auto& t : r.trials) {
    later += t.number >= 16 ? std::abs(std::log10(to_double(t.config.at("lr"))) + 2) / 16 : 0;
  }
  return later;
}

TEST(Tuner, BohbLearnsFromAshaRungsWithoutWaiting) {
  double bohb = 0, random = 0;
  int resumed = 0;
  for (uint64_t seed = 0; seed < 3; ++seed) {
    bohb += later_distance("bohb", seed, &resumed) / 3;
    random += later_distance("random", seed, &resumed) / 3;
  }
  EXPECT_EQ(resumed, 0) << "ASHA pauses no trial";
  std::cout << "later mean |log10 lr + 2|: bohb " << bohb << ", random " << random << std::endl;
  // lr loguniform(1e-4, 1): random search's mean distance from log10 lr = -2 is about 1.
  // Measured: bohb 0.48, random 1.16; with only max_t results reaching the model, bohb 0.77.
  EXPECT_LT(bohb, 0.55 * random) << "bohb " << bohb << " random " << random;
}

TEST(Tuner, HyperbandPausesAndResumesFunctionTrials) {
  TempDir dir("tune-hb");
  std::mutex mu;
  std::map<int64_t, int> starts, resumed;
  auto fn = [&](TrialContext& t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      starts[t.number()]++;
      resumed[t.number()] += t.resumed();
    }
    // A checkpoint: the last iteration done, in the trial's checkpoint directory.
    const std::string ck = t.checkpoint_dir() + "/it";
    int it = 0;
    std::ifstream(ck) >> it;
    const double lr = to_double(t.config().at("lr"));
    while (++it <= 8) {
      std::ofstream(ck) << it;
      t.report({{"training_iteration", it}, {"loss", std::pow(std::log10(lr) + 2, 2) + 1.0 / it}});
    }
  };
  auto o = function_options(dir, "hyperband")
               .num_samples(8)
               .scheduler(SchedulerOptions().kind("hyperband").max_t(8).reduction_factor(2));
  const TuneResult r = tune(lr_space(), o, fn);
  int complete = 0, total_resumes = 0;
  for (const auto& t : r.trials) {
    complete += t.state == TrialState::kComplete;
    EXPECT_TRUE(t.state == TrialState::kComplete || t.state == TrialState::kStopped)
        << to_string(t.state);
    total_resumes += resumed[t.number];
    EXPECT_EQ(starts[t.number], 1 + resumed[t.number]);
  }
  // max_t 8, eta 2: the first bracket takes all 8 trials at 1 iteration, 4 go on to 2, 2 to 4,
  // 1 to 8: 4 + 2 + 1 resumes, one trial complete.
  EXPECT_EQ(total_resumes, 7);
  EXPECT_EQ(complete, 1);
  ASSERT_TRUE(r.best);
  EXPECT_EQ(r.best->iterations, 8);
}

TEST(Tuner, CommandTrialsGetTheirValuesAndCrashesAreRecorded) {
  TempDir dir("tune-cmd");
  const std::string script = dir.path + "/trial.sh";
  // Trial 2 crashes on every attempt; the others echo their values back as metrics.
  write_script(script,
               "echo \"not json\"\n"
               "if [ \"$PARATRAIN_TRIAL_NUMBER\" = 2 ]; then echo boom >&2; exit 3; fi\n"
               "echo \"{\\\"training_iteration\\\": 1, \\\"w\\\": $width, \\\"arg\\\": $1, "
               "\\\"resume\\\": $PARATRAIN_TRIAL_RESUME}\"\n");
  SearchSpace s;
  s.add("width=grid_search(10, 20, 30, 40)");
  const TuneResult r = tune(s, TunerOptions()
                                   .storage("sqlite:///" + dir.path + "/s.db")
                                   .study("c")
                                   .metric("w")
                                   .mode("max")
                                   .searcher(SearcherOptions().kind("grid"))
                                   .max_failures(1)
                                   .cpus(2)
                                   .trial_dir(dir.path + "/trials")
                                   .output("none")
                                   .command({script, "{width}"}));
  ASSERT_EQ(r.trials.size(), 4u);
  for (const auto& t : r.trials) {
    if (t.number == 2) {
      EXPECT_EQ(t.state, TrialState::kFailed);
      EXPECT_EQ(t.exit_status, 3);
      EXPECT_EQ(t.error, "exit status 3");
      std::ifstream log(t.log_path);
      const std::string text((std::istreambuf_iterator<char>(log)), {});
      EXPECT_NE(text.find("boom"), std::string::npos) << text;
      EXPECT_NE(text.find("failures so far 1"), std::string::npos) << "retried once: " << text;
    } else {
      EXPECT_EQ(t.state, TrialState::kComplete);
      EXPECT_EQ(t.value, to_double(t.config.at("width")));
    }
  }
  ASSERT_TRUE(r.best);
  EXPECT_EQ(r.best->value, 40);
  // The {width} argument and the environment agree: the logged rows say so.
  std::ifstream log(r.best->log_path);
  const std::string rows((std::istreambuf_iterator<char>(log)), {});
  EXPECT_NE(rows.find("\"w\": 40, \"arg\": 40, \"resume\": 0"), std::string::npos) << rows;
}

TEST(Tuner, BadInputIsRefusedBeforeAnythingRuns) {
  TempDir dir("tune-bad");
  auto o = TunerOptions()
               .storage(dir.path + "/s.db")
               .study("b")
               .metric("loss")
               .cpus(2)
               .trial_dir(dir.path + "/t")
               .output("none");
  EXPECT_NE(error_of([&] {
              tune(lr_space(), TunerOptions(o).command({"no-such-program-x"}));
            }).find("trial command 'no-such-program-x' not found"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              tune(lr_space(), TunerOptions(o).resources(Resources().ranks(2).threads(2)),
                   quadratic);
            }).find("needs 4 cores (2 ranks x 2 threads) but this machine has 2"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              tune(lr_space(), TunerOptions(o).gpus(0).resources(Resources().gpus(1)), quadratic);
            }).find("needs 1 GPUs but this machine has 0"),
            std::string::npos);
  // A metric the trials never report: named after the first report.
  const std::string e =
      error_of([&] { tune(lr_space(), TunerOptions(o).metric("acc").num_samples(3), quadratic); });
  EXPECT_NE(e.find("reported a row without the metric 'acc' (its keys: loss, training_iteration)"),
            std::string::npos)
      << e;
  // The study exists with metric acc now; another space is refused and the trials are kept.
  SearchSpace other;
  other.add("lr=uniform(0, 1)");
  EXPECT_NE(error_of([&] {
              tune(other, TunerOptions(o).metric("acc"), quadratic);
            }).find("exists with a different search space"),
            std::string::npos);
  auto st = open_storage(dir.path + "/s.db");
  st->open_study({"b", lr_space().canonical(), "acc", "min"});
  EXPECT_GE(st->load_trials().size(), 1u);
}

// A slow command trial, SIGKILLed tuner, second tuner on the same study: finished trials kept,
// interrupted ones retried with PARATRAIN_TRIAL_RESUME=1 from their checkpoints, none twice.
TEST(Tuner, SigkilledTunerResumesTheStudy) {
  TempDir dir("tune-kill");
  const std::string script = dir.path + "/trial.sh";
  write_script(script,
               "ck=$PARATRAIN_CHECKPOINT_DIR/it; it=0\n"
               "[ -f $ck ] && it=$(cat $ck)\n"
               "echo \"$PARATRAIN_TRIAL_NUMBER $PARATRAIN_TRIAL_RESUME $it\" >> " +
                   dir.path +
                   "/starts\n"
                   "while [ $it -lt 6 ]; do it=$((it+1)); sleep 0.1; echo $it > $ck\n"
                   "  echo \"{\\\"training_iteration\\\": $it, \\\"loss\\\": $x}\"; done\n");
  const std::vector<std::string> argv{testing::cli_path(),
                                      "tune",
                                      "--storage",
                                      dir.path + "/s.db",
                                      "--study",
                                      "k",
                                      "--metric",
                                      "loss",
                                      "--mode",
                                      "min",
                                      "--space",
                                      "x=uniform(0, 1)",
                                      "--num-samples",
                                      "6",
                                      "--max-concurrent",
                                      "2",
                                      "--cpus",
                                      "2",
                                      "--trial-dir",
                                      dir.path + "/trials",
                                      "--",
                                      script};
  auto first = testing::start_process(argv);
  ASSERT_TRUE(first.wait_for_output("trial 2 iteration 2:", 60)) << first.output;
  ::kill(first.pid, SIGKILL);
  first.finish(30);
  // PR_SET_PDEATHSIG took the trials down with the tuner.
  for (int i = 0; i < 50 && !testing::processes_with(script).empty(); ++i) {
    ::usleep(100000);
  }
  EXPECT_TRUE(testing::processes_with(script).empty());
  const auto second = run_process(argv, {}, 120);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("trials; continuing it ("), std::string::npos) << second.output;
  auto st = open_storage(dir.path + "/s.db");
  st->open_study({"k",
                  [] {
                    SearchSpace s;
                    s.add("x=uniform(0, 1)");
                    return s.canonical();
                  }(),
                  "loss", "min"});
  const auto trials = st->load_trials();
  ASSERT_EQ(trials.size(), 6u);
  std::set<int64_t> resumed_from_checkpoint;
  std::ifstream starts(dir.path + "/starts");
  int64_t number = 0;
  int resume = 0, it = 0;
  while (starts >> number >> resume >> it) {
    if (resume == 1 && it > 0) {
      resumed_from_checkpoint.insert(number);
    }
  }
  for (const auto& t : trials) {
    EXPECT_EQ(t.state, TrialState::kComplete) << t.number;
    // Each iteration at most once, in order, up to the last. A row can be lost (not repeated):
    // the trial saved its checkpoint, then died with the tuner before printing the row.
    ASSERT_GE(t.results.size(), 5u) << t.number;
    EXPECT_EQ(t.results.back().first, 6) << t.number;
    for (size_t i = 1; i < t.results.size(); ++i) {
      EXPECT_LT(t.results[i - 1].first, t.results[i].first) << t.number;
    }
  }
  EXPECT_FALSE(resumed_from_checkpoint.empty()) << "no trial continued from its checkpoint";
}

TEST(Tuner, CliBadInputGetsOneLine) {
  TempDir dir("tune-cli");
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv{testing::cli_path(),
                                  "tune",
                                  "--storage",
                                  dir.path + "/s.db",
                                  "--study",
                                  "x",
                                  "--metric",
                                  "m",
                                  "--mode",
                                  "min",
                                  "--trial-dir",
                                  dir.path + "/t"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return run_cli(argv);
  };
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases{
      {{"--space", "lr=gauss(0, 1)", "--", "true"}, "unknown distribution 'gauss'"},
      {{"--space", "lr=uniform(1, 0)", "--", "true"}, "needs low < high"},
      {{"--space", "lr=loguniform(0, 1)", "--", "true"}, "needs low > 0"},
      {{"--space", "c=choice()", "--", "true"}, "at least one value"},
      {{"--space", "lr=uniform(0, 1)", "--storage", "mysql://h/x", "--", "true"},
       "unknown storage scheme"},
      {{"--space", "lr=uniform(0, 1)", "--", "no-such-program-y"}, "not found"},
      {{"--space", "lr=uniform(0, 1)", "--nproc-per-node", "64", "--", "true"}, "needs 64 cores"},
      {{"--space", "lr=uniform(0, 1)", "--ranks", "64", "--", "true"}, "needs 64 cores"},  // alias
      // train's own count, in any spelling, the last one winning
      {{"--space", "lr=uniform(0, 1)", "--", "train", "--nproc", "8", "--nproc_per_node", "64"},
       "needs 64 cores"},
      {{"--space", "lr=uniform(0, 1)", "--", "train", "--nproc-per-node=64"}, "needs 64 cores"},
      {{"--", "true"}, "no --space given"},
      {{"--space", "lr=uniform(0, 1)", "--mode", "up", "--", "true"}, "--mode must be min or max"},
      {{"--space", "lr=uniform(0, 1)", "--searcher", "cma", "--", "true"}, "unknown searcher"},
  };
  for (const auto& c : cases) {
    const auto r = run(c.args);
    EXPECT_NE(r.exit_code, 0) << c.expected;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
}

// paratrain train trials under Hyperband: a promoted trial continues from its epoch checkpoint,
// and the end names the command that reproduces the best trial.
TEST(Tuner, TrainTrialsResumeFromTheirCheckpoints) {
  TempDir dir("tune-train");
  const auto r = run_process({testing::cli_path(),
                              "tune",
                              "--storage",
                              dir.path + "/s.db",
                              "--study",
                              "t",
                              "--metric",
                              "test_accuracy",
                              "--mode",
                              "max",
                              "--scheduler",
                              "hyperband",
                              "--max-t",
                              "3",
                              "--num-samples",
                              "3",
                              "--space",
                              "lr=loguniform(1e-3, 0.3)",
                              "--trial-dir",
                              dir.path + "/t",
                              "--json",
                              "--",
                              "train",
                              "--model",
                              "linear",
                              "--steps",
                              "5",
                              "--batch-size",
                              "32"},
                             testing::world_of_one_env(), 240);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\"event\":\"resumed\""), std::string::npos) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("\"command\":\"([^\"]*)\""))) << r.output;
  EXPECT_NE(m[1].str().find("paratrain train --model linear --steps 5 --batch-size 32 --epochs 3 "
                            "--lr "),
            std::string::npos)
      << m[1];
  bool resumed = false;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path + "/t")) {
    std::ifstream log(entry.path().string() + "/trial.log");
    const std::string text((std::istreambuf_iterator<char>(log)), {});
    resumed = resumed || text.find("paratrain: resumed from") != std::string::npos;
  }
  EXPECT_TRUE(resumed) << "no promoted trial continued from its checkpoint";
}

// A study from a config file, TOML (a list of spaces) or JSON (an object of spaces); the command
// line overrides it.
TEST(Tuner, ConfigFilesGiveTheStudy) {
  TempDir dir("tune-config");
  std::ofstream(dir.path + "/s.toml")
      << "storage = \"" << dir.path << "/s.db\"\nstudy = \"toml\"\nmetric = \"m\"\n"
      << "mode = \"max\"\nsearcher = \"grid\"\n"
      << "space = [\"x=grid_search(1, 2, 3)\", \"y=uniform(0, 1)\"]\n";
  std::ofstream(dir.path + "/s.json")
      << "{\"storage\": \"" << dir.path << "/s.db\", \"study\": \"json\", \"metric\": \"m\", "
      << "\"mode\": \"min\", \"space\": {\"x\": \"grid_search(4, 5)\"}}";
  const std::vector<std::string> trial{"--trial-dir", dir.path + "/t",      "--", "/bin/sh",
                                       "-c",          "echo '{\"m\": {x}}'"};
  auto run = [&](std::vector<std::string> argv) {
    argv.insert(argv.begin(), {testing::cli_path(), "tune"});
    argv.insert(argv.end(), trial.begin(), trial.end());
    return run_process(argv, {}, 60);
  };
  const auto toml = run({"--config", dir.path + "/s.toml", "--json"});
  ASSERT_EQ(toml.exit_code, 0) << toml.output;
  EXPECT_NE(toml.output.find("\"event\":\"best\",\"trial\":2,\"m\":3.0"), std::string::npos)
      << toml.output;
  const auto json = run({"--config", dir.path + "/s.json", "--mode", "max", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.output;
  EXPECT_NE(json.output.find("\"trials\":2"), std::string::npos) << json.output;
  EXPECT_NE(json.output.find("\"command\":\"x=5 /bin/sh -c "), std::string::npos) << json.output;
}

// Trials are packed onto the cores and GPUs without oversubscribing: on 2 cores, trials of 2
// threads run one at a time; trials of 1 GPU on a 2-GPU machine get one each, as their own
// CUDA_VISIBLE_DEVICES, mapped through the tuner's own list.
TEST(Tuner, PacksTrialsOntoCoresAndGpus) {
  TempDir dir("tune-pack");
  std::mutex mu;
  int now = 0, peak = 0;
  auto fn = [&](TrialContext& t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      peak = std::max(peak, ++now);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    {
      std::lock_guard<std::mutex> lock(mu);
      --now;
    }
    t.report({{"loss", 1.0}});
  };
  auto o = TunerOptions()
               .storage(dir.path + "/s.db")
               .metric("loss")
               .num_samples(4)
               .cpus(2)
               .gpus(0)
               .trial_dir(dir.path + "/t")
               .output("none");
  tune(lr_space(), TunerOptions(o).study("two-threads").resources(Resources().threads(2)), fn);
  EXPECT_EQ(peak, 1);
  peak = 0;
  tune(lr_space(), TunerOptions(o).study("one-thread").resources(Resources().threads(1)), fn);
  EXPECT_EQ(peak, 2);

  const std::string script = dir.path + "/gpu.sh";
  write_script(script,
               "sleep 0.3; echo \"{\\\"loss\\\": 1, \\\"gpu\\\": $CUDA_VISIBLE_DEVICES}\"\n");
  // The suite's later cases share this process (tests/CMakeLists.txt): the variable is restored,
  // thrown or not.
  struct RestoreEnv {
    std::optional<std::string> old;
    ~RestoreEnv() {
      if (old) {
        ::setenv("CUDA_VISIBLE_DEVICES", old->c_str(), 1);
      } else {
        ::unsetenv("CUDA_VISIBLE_DEVICES");
      }
    }
  } restore{std::getenv("CUDA_VISIBLE_DEVICES") != nullptr
                ? std::optional<std::string>(std::getenv("CUDA_VISIBLE_DEVICES"))
                : std::nullopt};
  ::setenv("CUDA_VISIBLE_DEVICES", "5,7", 1);
  const TuneResult r =
      tune(lr_space(),
           TunerOptions(o).study("gpus").gpus(2).resources(Resources().gpus(1)).command({script}));
  std::set<std::string> seen;
  for (const auto& t : r.trials) {
    std::ifstream log(t.log_path);
    const std::string text((std::istreambuf_iterator<char>(log)), {});
    std::smatch m;
    ASSERT_TRUE(std::regex_search(text, m, std::regex("\"gpu\": (\\d+)"))) << text;
    seen.insert(m[1]);
  }
  EXPECT_EQ(seen, (std::set<std::string>{"5", "7"}));
}

// examples/tune_fashion_mnist.cpp, small: 4 trials of the tutorial's CNN, 2 epochs on 2,000
// images, ASHA; it names the best config, and the study in its directory is complete.
TEST(Tuner, TheTutorialExampleFindsABestTrial) {
  TempDir dir("tune-example");
  const auto r = run_process(
      {"/bin/sh", "-c", "cd '" + dir.path + "' && exec '" PARATRAIN_TEST_TUNE_EXAMPLE "' 4 2 2000"},
      testing::world_of_one_env(), 240);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      r.output, m,
      std::regex("Best trial config: batch_size=\\d+ l1=\\d+ l2=\\d+ lr=[0-9.e-]+\\n"
                 "Best trial final validation loss: ([0-9.]+)")))
      << r.output;
  EXPECT_LT(std::stod(m[1]), 2.3) << "better than chance (ln 10)";
  auto st = open_storage(dir.path + "/tune_fashion_mnist.db");
  st->load_study("fashion_mnist_cnn");
  const auto trials = st->load_trials();
  ASSERT_EQ(trials.size(), 4u);
  for (const auto& t : trials) {
    EXPECT_TRUE(t.state == TrialState::kComplete || t.state == TrialState::kStopped)
        << to_string(t.state);
  }
}

}  // namespace
}  // namespace tune
}  // namespace paratrain
