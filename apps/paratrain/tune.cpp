// paratrain tune: hyperparameter search over `paratrain train` jobs or any command that prints
// JSON metric lines (paratrain::tune, include/paratrain/tune/tuner.h).

#include "args.h"
#include "commands.h"

#ifdef PARATRAIN_WITH_TUNE
#include "paratrain/tune/dashboard.h"
#include "paratrain/tune/report.h"
#include "paratrain/tune/tuner.h"

#include <torch/cuda.h>
#include <nlohmann/json.hpp>
#endif

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <stdexcept>
#include <thread>

namespace paratrain {
namespace cli {

#ifndef PARATRAIN_WITH_TUNE
int run_tune(const std::vector<std::string>&) {
  std::cerr << "paratrain tune: this build has no SQLite (install libsqlite3-dev and rebuild)"
            << std::endl;
  return 1;
}
#else
namespace {

const CommandSpec& tune_spec() {
  static const CommandSpec spec{
      "paratrain tune",
      "Searches hyperparameters. Each trial is `paratrain train` with the sampled values as its\n"
      "flags (with `-- train ARGS` for the fixed ones), or COMMAND after --: it gets each value\n"
      "as an environment variable and wherever {name} appears in its arguments, and prints its\n"
      "metrics as JSON lines ({\"training_iteration\": 3, \"accuracy\": 0.86}). The study lives\n"
      "in --storage; a tuner started again on it continues (finished trials kept, running ones\n"
      "retried from their checkpoints). `paratrain tune report` writes a study's HTML report;\n"
      "`paratrain tune serve` shows the storage's studies live in a browser.",
      {
          {"storage", "URL",
           "sqlite:///FILE or a path (default sqlite:///paratrain-tune.db), or "
           "postgresql://USER@HOST/DB for tuners on several machines sharing the study"},
          {"study", "NAME", "the study's name (required)"},
          {"space", "NAME=DIST",
           "a parameter: uniform(a,b), quniform(a,b,q), loguniform(a,b), qloguniform(a,b,q), "
           "randint(a,b), choice(x,y,...) or grid_search(x,y,...); repeat for each",
           true},
          {"metric", "NAME", "the reported metric to optimize (required)"},
          {"mode", "min|max", "minimize or maximize the metric (required)"},
          {"scope", "last|best", "a trial's value: its last report (default) or its best"},
          {"searcher", "NAME", "grid, random (default), tpe or bohb"},
          {"scheduler", "NAME",
           "fifo (default; hyperband with bohb), asha, hyperband, median or pbt (bohb learns "
           "from asha's or hyperband's rungs)"},
          {"num-samples", "N", "trials (grid: passes over the grid; default 1)"},
          {"max-concurrent", "K", "at most K trials at once (default: as many as fit)"},
          {"seed", "S", "the searcher's seed (default 0)"},
          {"max-t", "T",
           "the most iterations a trial runs (asha 100, hyperband 81; a train trial's epochs)"},
          {"grace-period", "T", "asha, median: iterations before a trial can stop (default 1)"},
          {"reduction-factor", "F", "asha (default 4), hyperband (default 3)"},
          {"perturbation-interval", "T", "pbt: iterations between perturbations (required)"},
          {"mutation", "NAME=DIST",
           "pbt: a parameter explore perturbs, as 'lr=loguniform(1e-4, 1e-1)' or "
           "'batch-size=choice(32, 64)'; repeat for each",
           true},
          {"quantile-fraction", "Q",
           "pbt: the bottom and top fractions that exploit and are copied (default 0.25)"},
          {"resample-probability", "P",
           "pbt: the chance a mutation is resampled rather than perturbed (default 0.25)"},
          {"max-failures", "N", "times a failed trial is retried (default 3)"},
          {"nproc-per-node,nproc_per_node,ranks", "N",
           "processes per trial (default: train's --nproc-per-node, else 1; --ranks: the earlier "
           "spelling)"},
          {"threads", "T", "threads per rank, OMP_NUM_THREADS (default 1)"},
          {"gpus", "G", "GPUs per trial, as its own CUDA_VISIBLE_DEVICES (default 0)"},
          {"cpus", "N", "the cores to pack trials onto (default: those this process may use)"},
          {"trial-dir", "DIR", "trials' logs and checkpoints (default paratrain-tune/STUDY)"},
          {"kill-grace", "SECONDS", "SIGTERM, then SIGKILL this long after (default 5)"},
          {"heartbeat-timeout", "SECONDS",
           "retry a trial whose tuner sent no heartbeat this long (default 60)"},
          {"json", "", "print JSON rows instead of lines"},
          {"table", "", "a live status table (the default on a terminal)"},
      },
      "Example:\n"
      "  paratrain tune --study s --metric test_accuracy --mode max --searcher bohb \\\n"
      "    --space 'lr=loguniform(1e-3, 0.3)' --space 'batch-size=choice(32, 64, 128)' \\\n"
      "    --num-samples 20 --max-t 3 -- train --model mlp\n"
      "A config file (--config FILE.toml, or FILE.json) takes the same keys:\n"
      "  space = [\"lr=loguniform(1e-3, 0.3)\", \"batch-size=choice(32, 64, 128)\"]",
      true};
  return spec;
}

// A JSON config ({"study": "s", "space": {"lr": "loguniform(1e-3, 0.3)"}, ...}) as the command
// line words it stands for, put before the real ones so that those override it.
std::vector<std::string> json_config_words(const std::vector<std::string>& argv) {
  std::vector<std::string> out, rest;
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string path;
    if (argv[i] == "--") {
      rest.insert(rest.end(), argv.begin() + static_cast<long>(i), argv.end());
      break;
    }
    if (argv[i] == "--config" && i + 1 < argv.size()) {
      path = argv[i + 1];
    } else if (argv[i].rfind("--config=", 0) == 0) {
      path = argv[i].substr(9);
    }
    const bool json = path.size() > 5 && path.compare(path.size() - 5, 5, ".json") == 0;
    if (!json) {
      rest.push_back(argv[i]);
      continue;
    }
    i += argv[i] == "--config" ? 1 : 0;
    std::ifstream in(path);
    if (!in) {
      throw UsageError("--config " + path + " cannot be read");
    }
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      throw UsageError("--config " + path + " is not a JSON object");
    }
    for (const auto& [key, value] : j.items()) {
      auto word = [](const nlohmann::json& v) {
        return v.is_string() ? v.get<std::string>() : v.dump();
      };
      if (key == "space" && value.is_object()) {
        for (const auto& [name, dist] : value.items()) {
          out.insert(out.end(), {"--space", name + "=" + word(dist)});
        }
      } else if (value.is_array()) {
        for (const auto& v : value) {
          out.insert(out.end(), {"--" + key, word(v)});
        }
      } else if (value.is_boolean()) {
        if (value.get<bool>()) {
          out.push_back("--" + key);
        }
      } else {
        out.insert(out.end(), {"--" + key, word(value)});
      }
    }
  }
  out.insert(out.end(), rest.begin(), rest.end());
  return out;
}

// The value of `--name V` or `--name=V` among train's flags, for any of `names` (a flag's
// spellings): the last one given wins, as in train.
std::string flag_value(const std::vector<std::string>& words,
                       std::initializer_list<const char*> names) {
  std::string value;
  for (size_t i = 0; i < words.size(); ++i) {
    for (const std::string name : names) {
      if (words[i] == "--" + name && i + 1 < words.size()) {
        value = words[i + 1];
      } else if (words[i].rfind("--" + name + "=", 0) == 0) {
        value = words[i].substr(name.size() + 3);
      }
    }
  }
  return value;
}

std::string shell_word(const std::string& w) {
  if (!w.empty() && w.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789-_./=:,+") == std::string::npos) {
    return w;
  }
  std::string out = "'";
  for (char c : w) {
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  }
  return out + "'";
}

// The command that runs the best trial again on its own.
std::string reproduce(const tune::TunerOptions& o, const tune::TrialSummary& best) {
  std::string out;
  if (o.train()) {
    out = "paratrain train";
    for (const auto& w : o.train_args()) {
      out += " " + shell_word(w);
    }
    const int64_t max_t = tune::effective_max_t(o.scheduler());
    if (max_t > 0 && flag_value(o.train_args(), {"epochs"}).empty()) {
      out += " --epochs " + std::to_string(max_t);
    }
    for (const auto& [name, v] : best.config) {
      out += " --" + name + " " + shell_word(tune::to_string(v));
    }
    return out;
  }
  for (const auto& [name, v] : best.config) {
    out += name + "=" + shell_word(tune::to_string(v)) + " ";
  }
  for (std::string w : o.command()) {
    for (const auto& [name, v] : best.config) {
      const std::string key = "{" + name + "}";
      for (size_t at = w.find(key); at != std::string::npos; at = w.find(key, at + 1)) {
        w.replace(at, key.size(), tune::to_string(v));
      }
    }
    out += shell_word(w) + " ";
  }
  return out.substr(0, out.size() - 1);
}

// pbt's flags go with pbt, and its interval is in the trials' own iterations (Ray's default of 60
// is in seconds), so it is asked for rather than guessed.
void check_pbt_flags(const Args& args, const std::string& scheduler) {
  const bool pbt = scheduler == "pbt";
  for (const char* flag :
       {"perturbation-interval", "mutation", "quantile-fraction", "resample-probability"}) {
    if (args.has(flag) && !pbt) {
      throw UsageError(std::string("--") + flag + " is for --scheduler pbt (the scheduler is " +
                       scheduler + ")");
    }
  }
  if (pbt && !args.has("perturbation-interval")) {
    throw UsageError(
        "--scheduler pbt needs --perturbation-interval N: the iterations between perturbations");
  }
}

tune::TunerOptions options_from(const Args& args) {
  for (const char* required : {"study", "metric", "mode"}) {
    if (!args.has(required)) {
      throw UsageError(std::string("--") + required + " is required");
    }
  }
  tune::TunerOptions o;
  o.storage(args.get("storage", "sqlite:///paratrain-tune.db"))
      .study(args.get("study"))
      .metric(args.get("metric"))
      .mode(args.get("mode"))
      .scope(args.get("scope", "last"))
      .num_samples(args.get_int("num-samples", 1))
      .max_concurrent(args.get_int("max-concurrent", 0))
      .max_failures(args.get_int("max-failures", 3))
      .cpus(args.get_int("cpus", 0))
      .trial_dir(args.get("trial-dir", ""))
      .heartbeat_timeout(std::chrono::seconds(args.get_int("heartbeat-timeout", 60)))
      .kill_grace(std::chrono::milliseconds(
          static_cast<int64_t>(std::llround(args.get_double("kill-grace", 5) * 1000))));
  if (args.get_double("kill-grace", 5) <= 0 || args.get_int("heartbeat-timeout", 60) < 1 ||
      o.cpus() < 0) {
    throw UsageError("--kill-grace must be > 0, --heartbeat-timeout >= 1 and --cpus >= 0");
  }
  if (o.mode() != "min" && o.mode() != "max") {
    throw UsageError("--mode must be min or max, got '" + o.mode() + "'");
  }
  const std::string searcher = args.get("searcher", "random");
  const int seed = args.get_int("seed", 0);
  if (seed < 0) {
    throw UsageError("--seed must be >= 0, got " + std::to_string(seed));
  }
  o.searcher(tune::SearcherOptions().kind(searcher).seed(static_cast<uint64_t>(seed)));
  o.scheduler(tune::SchedulerOptions()
                  .kind(args.get("scheduler", searcher == "bohb" ? "hyperband" : "fifo"))
                  .max_t(args.get_int("max-t", 0))
                  .grace_period(args.get_int("grace-period", 1))
                  .reduction_factor(args.get_double("reduction-factor", 0))
                  .perturbation_interval(args.get_int("perturbation-interval", 60))
                  .quantile_fraction(args.get_double("quantile-fraction", 0.25))
                  .resample_probability(args.get_double("resample-probability", 0.25))
                  .mutations(args.get_all("mutation")));
  check_pbt_flags(args, o.scheduler().kind());
  const std::vector<std::string>& rest = args.rest();
  if (rest.empty() || rest[0] == "train") {
    o.train(true).paratrain_cli(self_path());
    if (!rest.empty()) {
      o.train_args(std::vector<std::string>(rest.begin() + 1, rest.end()));
    }
  } else {
    o.command(rest);
  }
  // train's own count, in any of its spellings.
  const std::string nproc =
      o.train() ? flag_value(o.train_args(), {"nproc", "nproc_per_node", "nproc-per-node"}) : "";
  const int ranks =
      args.get_int("nproc-per-node", nproc.empty() ? 1 : std::max(1, std::atoi(nproc.c_str())));
  int gpus = args.get_int("gpus", 0);
  o.resources(tune::Resources().ranks(ranks).threads(args.get_int("threads", 1)).gpus(gpus));
  o.gpus(static_cast<int>(torch::cuda::device_count()));
  o.output(args.has("json") ? "json" : args.has("table") || ::isatty(1) ? "table" : "plain");
  return o;
}

const CommandSpec& report_spec() {
  static const CommandSpec spec{
      "paratrain tune report",
      "Writes one self-contained HTML file (inline SVG, nothing fetched) about a stored study:\n"
      "the optimization history, each trial's intermediate values, each parameter against the\n"
      "metric, and the table of trials.",
      {
          {"storage", "URL", "the study's storage (default sqlite:///paratrain-tune.db)"},
          {"study", "NAME", "the study (required)"},
          {"out", "FILE", "the HTML file to write (required)"},
      }};
  return spec;
}

int run_report(const std::vector<std::string>& argv) {
  Args args(argv, report_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  for (const char* required : {"study", "out"}) {
    if (!args.has(required)) {
      throw UsageError(std::string("--") + required + " is required");
    }
  }
  tune::write_html_report(args.get("storage", "sqlite:///paratrain-tune.db"), args.get("study"),
                          args.get("out"));
  std::cout << "paratrain tune report: wrote " << args.get("out") << std::endl;
  return 0;
}

const CommandSpec& serve_spec() {
  static const CommandSpec spec{
      "paratrain tune serve",
      "A read-only web view of a study storage (every tuner writing to it): the studies, each\n"
      "study's history, intermediate values, population-based training lineage, parameters and\n"
      "trials, refreshed in place while trials run. Ctrl-C stops it.",
      {
          {"storage", "URL", "the storage (default sqlite:///paratrain-tune.db)"},
          {"bind", "ADDRESS",
           "the address to listen on (default 127.0.0.1; another makes the studies visible to "
           "the network, without authentication)"},
          {"port", "PORT", "the port (default 8080; 0: a free one)"},
          {"refresh", "SECONDS", "how often an open page refreshes (default 2)"},
      }};
  return spec;
}

// The write end of serve's stop pipe, for its signal handler (-1 when none is installed).
int g_serve_stop_fd = -1;

extern "C" void on_serve_stop_signal(int) {
  const int saved = errno;
  const char stop = 1;
  if (g_serve_stop_fd >= 0 && ::write(g_serve_stop_fd, &stop, 1) < 0) {
    // Nothing to do in a handler: the pipe holds a stop already.
  }
  errno = saved;
}

// While it lives, SIGINT and SIGTERM write a stop to a pipe that wait() reads. A handler, not a
// blocked mask and sigwait: the signal lands on whichever thread does not block it, and libraries
// (OpenBLAS) start threads of their own before main, blocking nothing.
class StopSignals {
 public:
  StopSignals() {
    if (::pipe2(pipe_, O_CLOEXEC) != 0) {
      throw std::runtime_error(std::string("tune serve: pipe: ") + std::strerror(errno));
    }
    g_serve_stop_fd = pipe_[1];
    struct sigaction on_stop {};
    on_stop.sa_handler = on_serve_stop_signal;
    on_stop.sa_flags = SA_RESTART;
    sigemptyset(&on_stop.sa_mask);
    sigaction(SIGINT, &on_stop, &old_int_);
    sigaction(SIGTERM, &on_stop, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    g_serve_stop_fd = -1;
    ::close(pipe_[0]);
    ::close(pipe_[1]);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  /// Until a signal (true) or wake() (false).
  bool wait() {
    char what = 0;
    while (::read(pipe_[0], &what, 1) < 0 && errno == EINTR) {
    }
    return what == 1;
  }
  void wake() {
    const char done = 0;
    if (::write(pipe_[1], &done, 1) < 0) {
      // A full pipe holds a stop already: wait() returns.
    }
  }

 private:
  int pipe_[2] = {-1, -1};
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

// Serves until SIGINT or SIGTERM (taken once the storage answered), which a thread of ours turns
// into the server's stop.
int run_serve(const std::vector<std::string>& argv) {
  Args args(argv, serve_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  const std::string bind = args.get("bind", "127.0.0.1");
  const tune::DashboardOptions o = tune::DashboardOptions()
                                       .storage(args.get("storage", "sqlite:///paratrain-tune.db"))
                                       .bind(bind)
                                       .port(args.get_int("port", 8080))
                                       .refresh_seconds(args.get_double("refresh", 2));
  tune::Dashboard dashboard(o);  // Ctrl-C still interrupts a slow storage here
  StopSignals signals;
  if (!tune::binds_loopback_only(bind)) {
    std::cerr << "paratrain tune serve: warning: listening on " << bind
              << ", not loopback: anyone who can reach this address reads the studies (there is "
                 "no authentication)"
              << std::endl;
  }
  std::cout << "paratrain tune serve: http://"
            << (bind.find(':') != std::string::npos ? "[" + bind + "]" : bind) << ":"
            << dashboard.port() << "/ (" << dashboard.storage_url() << ")" << std::endl;
  std::thread waiter([&] {
    if (signals.wait()) {
      dashboard.stop();
    }
  });
  struct Joined {  // also when run() throws
    StopSignals& signals;
    std::thread& waiter;
    ~Joined() {
      signals.wake();
      waiter.join();
    }
  } joined{signals, waiter};
  dashboard.run();
  return 0;
}

}  // namespace

int run_tune(const std::vector<std::string>& argv) {
  if (!argv.empty() && argv[0] == "report") {
    return run_report(std::vector<std::string>(argv.begin() + 1, argv.end()));
  }
  if (!argv.empty() && argv[0] == "serve") {
    return run_serve(std::vector<std::string>(argv.begin() + 1, argv.end()));
  }
  Args args(json_config_words(argv), tune_spec());
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  tune::SearchSpace space;
  for (const std::string& s : args.get_all("space")) {
    space.add(s);
  }
  if (space.empty()) {
    throw UsageError("no --space given; e.g. --space 'lr=loguniform(1e-3, 0.3)'");
  }
  const tune::TunerOptions o = options_from(args);
  const tune::TuneResult result = tune::tune(space, o);
  if (result.interrupted_by != 0) {
    std::cerr << "paratrain tune: interrupted by signal " << result.interrupted_by
              << "; running trials are retried when the study is started again" << std::endl;
    return 128 + result.interrupted_by;
  }
  int64_t failed = 0;
  for (const auto& t : result.trials) {
    failed += t.state == tune::TrialState::kFailed ? 1 : 0;
  }
  if (!result.best) {
    std::cerr << "paratrain tune: no trial reported " << o.metric() << " (" << failed
              << " failed; see their logs under "
              << (o.trial_dir().empty() ? "paratrain-tune/" + o.study() : o.trial_dir()) << ")"
              << std::endl;
    return 1;
  }
  const tune::TrialSummary& best = *result.best;
  if (o.output() == "json") {
    nlohmann::ordered_json row{{"event", "best"},
                               {"trial", best.number},
                               {o.metric(), best.value},
                               {"iterations", best.iterations}};
    nlohmann::ordered_json config = nlohmann::ordered_json::object();
    for (const auto& [name, v] : best.config) {
      std::visit([&, n = name](const auto& x) { config[n] = x; }, v);
    }
    row["config"] = config;
    row["trials"] = result.trials.size();
    row["failed"] = failed;
    row["command"] = reproduce(o, best);
    std::cout << row.dump() << std::endl;
  } else {
    std::cout << "Best trial " << best.number << ": " << o.metric() << " " << best.value << " ("
              << o.scope() << ", " << best.iterations << " iterations), config "
              << tune::to_string(best.config) << "\n"
              << result.trials.size() << " trials, " << failed << " failed\n"
              << "Reproduce it with:\n  " << reproduce(o, best) << std::endl;
  }
  return 0;
}
#endif

}  // namespace cli
}  // namespace paratrain
