// The tuner's loop: one thread owns the study. It polls the trials' stdout pipes (and a wake-up
// pipe for function trials and signals), turns metric rows into scheduler decisions, and starts
// trials while cores, GPUs and --max-concurrent allow. What it prints (events, the live table) and
// the summary it returns are in tuner_output.cpp.

#include "paratrain/tune/tuner.h"
#include "limits.h"

#include "paratrain/launch/launch.h"
#include "paratrain/parallel/threads.h"
#include "trial_process.h"
#include "trial_value.h"
#include "tuner_output.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

namespace paratrain {
namespace tune {
namespace {

using Clock = std::chrono::steady_clock;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The wake-up pipe: signal handlers and function-trial threads write a byte to end poll().
std::atomic<int> g_wake_write{-1};
std::atomic<int> g_signal{0};

extern "C" void on_tuner_signal(int sig) {
  g_signal.store(sig);
  const int fd = g_wake_write.load();
  if (fd >= 0) {
    const char c = 's';
    ssize_t ignored = ::write(fd, &c, 1);
    (void)ignored;
  }
}

void wake() {
  const int fd = g_wake_write.load();
  if (fd >= 0) {
    const char c = 'w';
    ssize_t ignored = ::write(fd, &c, 1);
    (void)ignored;
  }
}

// A function trial's context: report() hands the row to the tuner's thread and waits for its
// decision, so the scheduler sees rows in order and can stop the trial at once.
class FunctionContext : public TrialContext {
 public:
  FunctionContext(int64_t number, Config config, std::string dir, bool resumed)
      : number_(number), config_(std::move(config)), dir_(std::move(dir)), resumed_(resumed) {}
  int64_t number() const override { return number_; }
  const Config& config() const override { return config_; }
  const std::string& dir() const override { return dir_; }
  std::string checkpoint_dir() const override { return dir_ + "/checkpoints"; }
  bool resumed() const override { return resumed_; }

  void report(const std::map<std::string, double>& metrics) override {
    nlohmann::json row = nlohmann::json::object();
    for (const auto& [k, v] : metrics) {
      row[k] = v;
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (stop_) {
      throw TrialStopped();
    }
    rows_.push_back(row.dump());
    answered_ = false;
    wake();
    cv_.wait(lock, [&] { return answered_ || stop_; });
    if (stop_) {
      throw TrialStopped();
    }
  }

  // The tuner's side.
  std::vector<std::string> take_rows() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(rows_, {});
  }
  void answer(bool stop) {
    std::lock_guard<std::mutex> lock(mu_);
    answered_ = answered_ || rows_.empty();  // a row that came after take_rows waits its turn
    stop_ = stop_ || stop;
    cv_.notify_all();
  }
  void finish(int status, std::string error) {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    status_ = status;
    error_ = std::move(error);
    wake();
  }
  bool done(int* status, std::string* error) {
    std::lock_guard<std::mutex> lock(mu_);
    *status = status_;
    *error = error_;
    return done_ && rows_.empty();
  }

 private:
  int64_t number_;
  Config config_;
  std::string dir_;
  bool resumed_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> rows_;
  bool answered_ = true, stop_ = false, done_ = false;
  int status_ = 0;
  std::string error_;
};

// A trial that is executing: a process or a function on its own thread.
struct Running {
  int64_t number = 0;
  detail::Process proc;
  std::string partial;  // stdout bytes after the last newline
  std::shared_ptr<FunctionContext> fn;
  std::thread thread;
  int64_t rows = 0;  // rows this run reported (numbers rows without an iteration)
  bool stopping = false;
  Decision why = Decision::kContinue;
  Clock::time_point term_at, kill_at;
  bool term_sent = false, killed = false;
  bool lost = false;  // another tuner took it over: its end is not recorded here
  std::vector<int> cores, gpus;
};

std::vector<int> machine_cores(int wanted) {
  std::vector<int> cores;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) {
        cores.push_back(c);
      }
    }
  }
  if (cores.empty()) {
    cores.push_back(0);
  }
  if (wanted > 0) {
    // A number given by the user: that many slots, pinned only when the machine has them.
    std::vector<int> out;
    for (int i = 0; i < wanted; ++i) {
      out.push_back(i < static_cast<int>(cores.size()) ? cores[i] : -1);
    }
    return out;
  }
  return cores;
}

class Tuner {
 public:
  Tuner(const SearchSpace& space, const TunerOptions& o, TrialFunction fn)
      : space_(space), o_(o), fn_(std::move(fn)), out_(o.output(), o.metric()) {}

  TuneResult run();

 private:
  void prepare();
  void check_options();
  void main_loop();
  void sync(bool first);
  bool worker_dead(const TrialRecord& t, double now) const;
  void enqueue(int64_t number);
  bool others_active() const;
  Config suggest(int64_t number);
  void start_possible();
  bool start(int64_t number, bool resume);
  void start_process(Running& r, TrialRecord& t, bool resume);
  void start_function(Running& r, TrialRecord& t, bool resume);
  void poll_once();
  void drain(Running& r, bool all);
  void handle_row(Running& r, const std::string& line);
  void apply(Running& r, Decision d);
  void reap();
  void on_exit(Running& r, int status, const std::string& error);
  void finish(TrialRecord& t, TrialState state, TrialState from);
  bool write(TrialRecord& t, TrialState from);
  void notify_end(const TrialRecord& t);
  void handle_promotions();
  double loss_of(double value) const { return detail::loss_of(value, o_.mode()); }
  double scoped_value(const TrialRecord& t) const {
    return detail::scoped_value(t, o_.scope(), o_.mode());
  }
  void print_table(bool force);
  void stop_all();
  void beat();
  std::chrono::milliseconds heartbeat_interval() const {
    // several beats per timeout, so that one late beat does not look like a death
    return std::min(
        std::chrono::milliseconds(2000),
        std::chrono::duration_cast<std::chrono::milliseconds>(o_.heartbeat_timeout()) / 3);
  }
  TuneResult summary() const { return detail::summarize(trials_, started_, o_.mode(), o_.scope()); }

  SearchSpace space_;
  TunerOptions o_;
  TrialFunction fn_;
  detail::TunerOutput out_;  // events, the live table
  std::unique_ptr<Storage> storage_;
  std::unique_ptr<Searcher> searcher_;
  std::unique_ptr<Scheduler> scheduler_;
  std::map<int64_t, TrialRecord> trials_;
  std::map<int64_t, std::unique_ptr<Running>> running_;
  std::deque<int64_t> queue_;  // trials to start again from their checkpoints
  std::vector<int> free_cores_;
  std::vector<int> free_gpus_;
  int64_t next_number_ = 0;
  int64_t total_ = 0;
  bool no_more_ = false;
  bool metric_seen_ = false;
  int64_t started_ = 0;
  std::string program_;
  int wake_read_ = -1;
  bool detached_ = false;
  std::string host_, worker_id_;
  std::set<int64_t> notified_;              // trials whose end the searcher and scheduler were told
  std::map<int64_t, TrialState> verdicts_;  // promotions (kPending) and drops of stopping trials
};

void Tuner::check_options() {
  TORCH_CHECK(!o_.study().empty(), "tune: --study is empty; name the study");
  TORCH_CHECK(!o_.metric().empty(), "tune: --metric is empty; name the metric to optimize");
  TORCH_CHECK(o_.mode() == "min" || o_.mode() == "max", "tune: --mode must be min or max, got '",
              o_.mode(), "'");
  TORCH_CHECK(o_.scope() == "last" || o_.scope() == "best",
              "tune: the scope must be last or best, got '", o_.scope(), "'");
  TORCH_CHECK(o_.num_samples() >= 1, "tune: --num-samples must be >= 1, got ", o_.num_samples());
  TORCH_CHECK(o_.max_concurrent() >= 0, "tune: --max-concurrent must be >= 0, got ",
              o_.max_concurrent());
  TORCH_CHECK(o_.max_failures() >= 0, "tune: max_failures must be >= 0, got ", o_.max_failures());
  const Resources& res = o_.resources();
  TORCH_CHECK(res.ranks() >= 1 && res.threads() >= 1 && res.gpus() >= 0,
              "tune: a trial's ranks and threads must be >= 1 and its GPUs >= 0; got ranks ",
              res.ranks(), ", threads ", res.threads(), ", gpus ", res.gpus());
  free_cores_ = machine_cores(o_.cpus());
  const int machine_gpus =
      o_.gpus() >= 0 ? o_.gpus() : static_cast<int>(torch::cuda::device_count());
  for (int g = 0; g < machine_gpus; ++g) {
    free_gpus_.push_back(g);
  }
  const int need = res.ranks() * res.threads();
  TORCH_CHECK(need <= static_cast<int>(free_cores_.size()), "tune: a trial needs ", need,
              " cores (", res.ranks(), " ranks x ", res.threads(),
              " threads) but this machine has ", free_cores_.size(),
              "; lower --ranks or --threads");
  TORCH_CHECK(res.gpus() <= machine_gpus, "tune: a trial needs ", res.gpus(),
              " GPUs but this machine has ", machine_gpus, "; lower --gpus");
  if (o_.train()) {
    TORCH_CHECK(!o_.paratrain_cli().empty(), "tune: a train trial needs the paratrain CLI's path");
    program_ = o_.paratrain_cli();
  } else if (!o_.command().empty()) {
    program_ = dist::find_program(o_.command()[0]);
    TORCH_CHECK(!program_.empty(), "tune: trial command '", o_.command()[0],
                "' not found (not a path, nor on PATH)");
  } else {
    TORCH_CHECK(static_cast<bool>(fn_), "tune: give a trial: a command, a train job or a function");
    // Function trials share this process: each computes on its own thread with `threads`
    // intra-op threads, and OpenBLAS's own pool (which set_num_threads does not reach) is capped
    // too, or concurrent trials contend for its spinning threads.
    at::set_num_threads(res.threads());
    set_blas_threads(res.threads());
  }
}

// Checks the options, opens the study (its searcher, scheduler and storage) and the trial
// directory, names this tuner, and takes in what storage already holds.
void Tuner::prepare() {
  check_options();
  SearcherOptions so = o_.searcher();
  so.num_samples(o_.num_samples());
  searcher_ = make_searcher(space_, so);
  scheduler_ = make_scheduler(o_.scheduler());
  total_ = space_.grid_size() * o_.num_samples();
  storage_ = open_storage(o_.storage());
  storage_->open_study({o_.study(), space_.canonical(), o_.metric(), o_.mode()});
  if (o_.trial_dir().empty()) {
    o_.trial_dir("paratrain-tune/" + o_.study());
  }
  std::error_code ec;
  std::filesystem::create_directories(o_.trial_dir(), ec);
  TORCH_CHECK(!ec, "tune: cannot create the trial directory ", o_.trial_dir(), ": ", ec.message());
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  host_ = host;
  // host:pid:nonce. The nonce tells apart tuners whose host names and PIDs coincide
  // (containers sharing a host name, each with its own PID namespace).
  worker_id_ = host_ + ":" + std::to_string(::getpid()) + ":" +
               std::to_string(std::random_device{}() & 0xffffff);
  sync(true);
}

TuneResult Tuner::run() {
  prepare();

  int wake_fds[2];
  TORCH_CHECK(::pipe2(wake_fds, O_CLOEXEC | O_NONBLOCK) == 0, "tune: pipe failed");
  g_wake_write = wake_fds[1];
  g_signal.store(0);
  struct sigaction sa {
  }, old_int{}, old_term{};
  sa.sa_handler = on_tuner_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  auto restore = [&] {
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    g_wake_write = -1;
    if (!detached_) {  // a detached trial thread may still write to it: leave it open
      ::close(wake_fds[0]);
      ::close(wake_fds[1]);
    }
  };
  wake_read_ = wake_fds[0];
  TuneResult result;
  try {
    main_loop();
  } catch (...) {
    try {
      stop_all();
    } catch (...) {  // the first error is the one to report; the handlers must go back
    }
    restore();
    throw;
  }
  restore();
  print_table(true);
  result = summary();
  result.interrupted_by = g_signal.load();
  return result;
}

// Until the study is done (or a signal stops it): syncs with storage, beats, starts trials, polls
// their output, reaps them and acts on the scheduler's promotions.
void Tuner::main_loop() {
  auto last_sync = Clock::now(), last_beat = Clock::now();
  while (true) {
    if (g_signal.load() != 0) {
      stop_all();
      break;
    }
    if (Clock::now() - last_sync >= std::chrono::seconds(1)) {
      sync(false);  // other tuners' trials and results
      last_sync = Clock::now();
    }
    if (!running_.empty() && Clock::now() - last_beat >= heartbeat_interval()) {
      beat();
      last_beat = Clock::now();
    }
    start_possible();
    if (running_.empty() && queue_.empty() && no_more_) {
      handle_promotions();
      if (running_.empty() && queue_.empty() && !others_active()) {
        break;
      }
    }
    poll_once();
    reap();
    handle_promotions();
    print_table(false);
  }
}

// Brings this tuner's view of the study up to date with storage: trials and results of other
// tuners (fed to the searcher and the scheduler), trials waiting to be run (retries,
// promotions), and trials whose tuner died (released and retried from their checkpoints).
void Tuner::sync(bool first) {
  const double now = unix_now();
  size_t seen = 0;
  for (auto& s : storage_->load_trials()) {
    ++seen;
    const int64_t n = s.number;
    if (running_.count(n)) {
      continue;  // this tuner runs it: its own copy is the current one
    }
    auto it = trials_.find(n);
    if (it == trials_.end()) {
      scheduler_->on_trial_add(n);
      TrialRecord fresh = s;
      fresh.results.clear();
      it = trials_.emplace(n, std::move(fresh)).first;
    }
    TrialRecord& t = it->second;
    if (t.config.empty()) {
      t.config = s.config;
    }
    for (size_t i = t.results.size(); i < s.results.size(); ++i) {
      const auto [iteration, value] = s.results[i];
      t.results.push_back(s.results[i]);
      metric_seen_ = true;
      if (!t.config.empty()) {
        searcher_->on_result(n, t.config, iteration, loss_of(value));
      }
      const Decision d = scheduler_->on_result(n, iteration, loss_of(value));
      if (!t.config.empty() && (d == Decision::kPause || d == Decision::kComplete)) {
        searcher_->on_rung(n, t.config, iteration, loss_of(value));  // its owner acts on d
      }
    }
    t.state = s.state;
    t.attempts = s.attempts;
    t.exit_status = s.exit_status;
    t.error = s.error;
    t.log_path = s.log_path;
    t.started = s.started;
    t.ended = s.ended;
    t.worker = s.worker;
    t.heartbeat = s.heartbeat;
    if (finished(t.state)) {
      notify_end(t);
    } else if (t.state == TrialState::kPending) {
      enqueue(n);
    } else if (t.state == TrialState::kRunning && worker_dead(t, now) &&
               storage_->release_trial(n, t.worker, t.heartbeat)) {
      out_.say("trial " + std::to_string(n) + ": its tuner " + t.worker +
                   " is gone; it is retried from its checkpoint",
               {{"event", "released"}, {"trial", n}, {"worker", t.worker}});
      t.state = TrialState::kPending;
      t.worker.clear();
      ++t.attempts;
      enqueue(n);
    }
  }
  if (first && seen > 0) {
    out_.say("tune: study " + o_.study() + " in " + storage_->url() + " has " +
                 std::to_string(seen) + " trials; continuing it (" + std::to_string(queue_.size()) +
                 " to run again)",
             {{"event", "resumed_study"}, {"trials", seen}, {"to_run_again", queue_.size()}});
  }
}

// Whether the tuner that holds a RUNNING trial is gone: a process of this host that no longer
// exists, or no heartbeat for heartbeat_timeout.
bool Tuner::worker_dead(const TrialRecord& t, double now) const {
  if (t.worker == worker_id_) {
    return true;  // this process runs no such trial (it is not in running_)
  }
  const size_t colon = t.worker.find(':');
  if (colon != std::string::npos && t.worker.substr(0, colon) == host_) {
    const pid_t pid = static_cast<pid_t>(std::atol(t.worker.c_str() + colon + 1));
    if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) {
      return true;
    }
  }
  return now - t.heartbeat > o_.heartbeat_timeout().count();
}

void Tuner::enqueue(int64_t number) {
  if (std::find(queue_.begin(), queue_.end(), number) == queue_.end()) {
    queue_.push_back(number);
  }
}

// Trials of other tuners that may still need this one: running (their tuner may die) or
// waiting to be claimed.
bool Tuner::others_active() const {
  for (const auto& [n, t] : trials_) {
    if (!running_.count(n) &&
        (t.state == TrialState::kRunning || t.state == TrialState::kPending)) {
      return true;
    }
  }
  return false;
}

void Tuner::start_possible() {
  const int need_cores = o_.resources().ranks() * o_.resources().threads();
  while (true) {
    if (o_.max_concurrent() > 0 && static_cast<int>(running_.size()) >= o_.max_concurrent()) {
      return;
    }
    if (static_cast<int>(free_cores_.size()) < need_cores ||
        static_cast<int>(free_gpus_.size()) < o_.resources().gpus()) {
      return;  // never oversubscribe: wait for a trial to end
    }
    if (!queue_.empty()) {
      const int64_t n = queue_.front();
      queue_.pop_front();
      if (!storage_->claim_trial(n, worker_id_)) {
        continue;  // another tuner took it
      }
      TrialRecord& t = trials_.at(n);
      t.worker = worker_id_;
      if (t.attempts > o_.max_failures()) {
        t.error = "its tuner died while running it " + std::to_string(t.attempts) +
                  " times (max_failures " + std::to_string(o_.max_failures()) + ")";
        finish(t, TrialState::kFailed, TrialState::kRunning);
        continue;
      }
      if (t.config.empty()) {  // reserved by a tuner that died before choosing its config
        t.config = suggest(n);
      }
      start(n, true);
      continue;
    }
    if (no_more_) {
      return;
    }
    const int64_t n = storage_->reserve_trial(total_, worker_id_);
    if (n < 0) {
      no_more_ = true;
      sync(false);  // every trial that will ever exist is in storage now
      scheduler_->on_no_more_trials();
      return;
    }
    TrialRecord t;
    t.number = n;
    t.state = TrialState::kRunning;
    t.worker = worker_id_;
    trials_[n] = t;
    scheduler_->on_trial_add(n);
    trials_[n].config = suggest(n);
    start(n, false);
  }
}

Config Tuner::suggest(int64_t number) {
  std::optional<Config> config = searcher_->suggest(number);
  TORCH_CHECK(config, "tune: the searcher has no config for trial ", number,
              " (a grid smaller than the study's trials)");
  storage_->set_config(number, *config);
  return *config;
}

bool Tuner::start(int64_t number, bool resume) {
  TrialRecord& t = trials_.at(number);
  auto r = std::make_unique<Running>();
  r->number = number;
  const int need_cores = o_.resources().ranks() * o_.resources().threads();
  r->cores.assign(free_cores_.begin(), free_cores_.begin() + need_cores);
  free_cores_.erase(free_cores_.begin(), free_cores_.begin() + need_cores);
  r->gpus.assign(free_gpus_.begin(), free_gpus_.begin() + o_.resources().gpus());
  free_gpus_.erase(free_gpus_.begin(), free_gpus_.begin() + o_.resources().gpus());
  char name[32];
  std::snprintf(name, sizeof(name), "trial_%04lld", static_cast<long long>(number));
  const std::string dir = o_.trial_dir() + "/" + name;
  std::error_code ec;
  std::filesystem::create_directories(dir + "/checkpoints", ec);
  TORCH_CHECK(!ec, "tune: cannot create ", dir, ": ", ec.message());
  t.log_path = dir + "/trial.log";
  if (t.started == 0) {
    t.started = unix_now();
  }
  t.state = TrialState::kRunning;
  t.worker = worker_id_;
  write(t, TrialState::kRunning);  // claimed or reserved by this tuner just now
  Running& ref = *r;
  running_[number] = std::move(r);
  ++started_;
  if (o_.train() || !o_.command().empty()) {
    start_process(ref, t, resume);
  } else {
    start_function(ref, t, resume);
  }
  out_.say("trial " + std::to_string(number) + (resume ? " resumed" : " started") + ": " +
               to_string(t.config),
           {{"event", resume ? "resumed" : "started"}, {"trial", number}});
  return true;
}

void Tuner::start_process(Running& r, TrialRecord& t, bool resume) {
  const std::string dir = t.log_path.substr(0, t.log_path.rfind('/'));
  detail::ProcessSpec spec;
  spec.program = program_;
  spec.log_path = t.log_path;
  for (int c : r.cores) {
    if (c >= 0) {
      spec.cores.push_back(c);
    }
  }
  if (o_.train()) {
    spec.argv = {program_, "train"};
    spec.argv.insert(spec.argv.end(), o_.train_args().begin(), o_.train_args().end());
    spec.argv.insert(spec.argv.end(), {"--json", "--checkpoint-dir", dir + "/checkpoints",
                                       "--checkpoint-every-epoch", "--resume", "auto"});
    const int64_t max_t = effective_max_t(o_.scheduler());
    const auto& ta = o_.train_args();
    const bool has_epochs = std::any_of(ta.begin(), ta.end(), [](const std::string& w) {
      return w == "--epochs" || w.rfind("--epochs=", 0) == 0;
    });
    if (max_t > 0 && !has_epochs) {
      spec.argv.insert(spec.argv.end(), {"--epochs", std::to_string(max_t)});
    }
    for (const auto& [name, v] : t.config) {
      spec.argv.push_back("--" + name);
      spec.argv.push_back(to_string(v));
    }
  } else {
    for (std::string word : o_.command()) {
      for (const auto& [name, v] : t.config) {
        const std::string key = "{" + name + "}";
        for (size_t at = word.find(key); at != std::string::npos;
             at = word.find(key, at + to_string(v).size())) {
          word.replace(at, key.size(), to_string(v));
        }
      }
      spec.argv.push_back(word);
    }
  }
  for (const auto& [name, v] : t.config) {
    spec.env[name] = to_string(v);
  }
  spec.env["PARATRAIN_TRIAL_NUMBER"] = std::to_string(t.number);
  spec.env["PARATRAIN_TRIAL_DIR"] = dir;
  spec.env["PARATRAIN_CHECKPOINT_DIR"] = dir + "/checkpoints";
  spec.env["PARATRAIN_TRIAL_RESUME"] = resume ? "1" : "0";
  spec.env["OMP_NUM_THREADS"] = std::to_string(o_.resources().threads());
  if (!free_gpus_.empty() || !r.gpus.empty()) {
    // The tuner's GPU i is the i-th of its own CUDA_VISIBLE_DEVICES, when it has one (Slurm).
    std::vector<std::string> visible;
    if (const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES")) {
      std::stringstream list(cvd);
      for (std::string g; std::getline(list, g, ',');) {
        visible.push_back(g);
      }
    }
    std::string value;
    for (int g : r.gpus) {
      value += (value.empty() ? "" : ",") +
               (g < static_cast<int>(visible.size()) ? visible[g] : std::to_string(g));
    }
    spec.env["CUDA_VISIBLE_DEVICES"] = value;
  }
  {
    std::ofstream log(t.log_path, std::ios::app);
    log << "== paratrain tune: trial " << t.number << (resume ? " resumed" : " started")
        << " (failures so far " << t.attempts << "):";
    for (const auto& w : spec.argv) {
      log << " " << w;
    }
    log << "\n";
  }
  r.proc = detail::start_process(spec);
}

void Tuner::start_function(Running& r, TrialRecord& t, bool resume) {
  const std::string dir = t.log_path.substr(0, t.log_path.rfind('/'));
  r.fn = std::make_shared<FunctionContext>(t.number, t.config, dir, resume);
  auto ctx = r.fn;
  auto fn = fn_;
  r.thread = std::thread([ctx, fn] {
    try {
      fn(*ctx);
      ctx->finish(0, "");
    } catch (const TrialStopped&) {
      ctx->finish(0, "");
    } catch (const c10::Error& e) {
      ctx->finish(1, e.what_without_backtrace());
    } catch (const std::exception& e) {
      ctx->finish(1, e.what());
    } catch (...) {
      ctx->finish(1, "an exception that is not a std::exception");
    }
  });
}

void Tuner::poll_once() {
  std::vector<pollfd> fds{{wake_read_, POLLIN, 0}};
  std::vector<Running*> owners{nullptr};
  for (auto& [n, r] : running_) {
    if (r->proc.out_fd >= 0) {
      fds.push_back({r->proc.out_fd, POLLIN, 0});
      owners.push_back(r.get());
    }
  }
  ::poll(fds.data(), fds.size(), 200);  // 200 ms: also the pace of kill deadlines and reaping
  if (fds[0].revents) {
    char buf[256];
    while (::read(wake_read_, buf, sizeof(buf)) > 0) {
    }
  }
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents) {
      drain(*owners[i], false);
    }
  }
  for (auto& [n, r] : running_) {
    if (r->fn) {
      for (const auto& row : r->fn->take_rows()) {
        handle_row(*r, row);
      }
      r->fn->answer(r->stopping);
    }
  }
}

// Reads what the trial printed: one read while it runs (a trial that prints without pause must
// not keep the loop from its other duties), everything once it has exited.
void Tuner::drain(Running& r, bool all) {
  char buf[65536];
  for (bool more = true; more && r.proc.out_fd >= 0; more = all) {
    const ssize_t got = ::read(r.proc.out_fd, buf, sizeof(buf));
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got <= 0) {
      if (got == 0 || errno != EAGAIN) {
        ::close(r.proc.out_fd);  // end of its output
        r.proc.out_fd = -1;
      }
      break;
    }
    r.partial.append(buf, static_cast<size_t>(got));
    for (size_t nl = r.partial.find('\n'); nl != std::string::npos; nl = r.partial.find('\n')) {
      const std::string line = r.partial.substr(0, nl);
      r.partial.erase(0, nl + 1);
      const std::string with_nl = line + "\n";
      ssize_t ignored = ::write(r.proc.log_fd, with_nl.data(), with_nl.size());
      (void)ignored;
      handle_row(r, line);
    }
  }
}

void Tuner::handle_row(Running& r, const std::string& line) {
  const size_t first = line.find_first_not_of(" \t\r");
  if (first == std::string::npos || line[first] != '{') {
    return;  // not a metric row: only logged
  }
  const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
  if (row.is_discarded() || !row.is_object() || r.stopping || r.lost) {
    return;
  }
  TrialRecord& t = trials_.at(r.number);
  ++r.rows;
  const auto metric = row.find(o_.metric());
  if (metric == row.end() || !(metric->is_number() || metric->is_null())) {
    if (!metric_seen_) {
      std::string keys;
      for (const auto& item : row.items()) {
        keys += (keys.empty() ? "" : ", ") + item.key();
      }
      TORCH_CHECK(false, "tune: trial ", r.number, " reported a row without the metric '",
                  o_.metric(), "' (its keys: ", keys, "); give --metric one of them");
    }
    return;  // other rows (a config line, say) once the metric is known
  }
  int64_t iteration = (t.results.empty() ? 0 : t.results.back().first) + 1;
  for (const char* key : {"training_iteration", "epoch"}) {
    const auto it = row.find(key);
    if (it != row.end() && it->is_number()) {
      iteration = it->get<int64_t>();
      break;
    }
  }
  if (!t.results.empty() && iteration <= t.results.back().first) {
    return;  // a resumed trial repeating what it reported before its checkpoint
  }
  metric_seen_ = true;
  // JSON has no NaN: a diverged trial's NaN reaches us as null (nlohmann, Python's json with
  // allow_nan=False). It is recorded, and ranks last.
  const double value = metric->is_null() ? std::nan("") : metric->get<double>();
  if (!storage_->add_result(t.number, iteration, value, row.dump(), worker_id_)) {
    r.lost = true;  // another tuner holds it now: its rows are that tuner's to write
    out_.say("trial " + std::to_string(t.number) + " was taken over by another tuner",
             {{"event", "lost"}, {"trial", t.number}});
    return;
  }
  t.results.emplace_back(iteration, value);
  const double loss = loss_of(value);
  searcher_->on_result(t.number, t.config, iteration, loss);
  const Decision d = scheduler_->on_result(t.number, iteration, loss);
  if (d == Decision::kPause || d == Decision::kComplete) {
    searcher_->on_rung(t.number, t.config, iteration, loss);
  }
  nlohmann::ordered_json j{
      {"event", "result"}, {"trial", t.number}, {"iteration", iteration}, {o_.metric(), value}};
  out_.say("trial " + std::to_string(t.number) + " iteration " + std::to_string(iteration) + ": " +
               o_.metric() + " " + detail::format_value(value),
           j);
  apply(r, d);
}

void Tuner::apply(Running& r, Decision d) {
  if (d == Decision::kContinue) {
    return;
  }
  r.stopping = true;
  r.why = d;
  // A trial at max_t usually ends by itself (a train trial runs max_t epochs): a second before
  // it is told to, so that its exit status stays its own.
  const auto term_delay =
      d == Decision::kComplete ? std::chrono::milliseconds(1000) : std::chrono::milliseconds(0);
  r.term_at = Clock::now() + term_delay;
  r.kill_at = r.term_at + o_.kill_grace();
  if (r.proc.pid > 0 && term_delay.count() == 0) {
    ::kill(-r.proc.pid, SIGTERM);  // its whole process group: a train trial's ranks too
    r.term_sent = true;
  }
  if (r.fn) {
    r.fn->answer(true);
  }
}

void Tuner::reap() {
  std::vector<int64_t> ended;
  for (auto& [n, r] : running_) {
    int status = 0;
    std::string error;
    if (r->fn) {
      if (!r->fn->done(&status, &error)) {
        continue;
      }
      r->thread.join();
      on_exit(*r, status == 0 ? 0 : 1 << 8, error);
      ended.push_back(n);
      continue;
    }
    const pid_t got = ::waitpid(r->proc.pid, &status, WNOHANG);
    if (got == r->proc.pid) {
      ::kill(-r->proc.pid, SIGKILL);  // anything it left behind in its group
      r->proc.pid = -1;               // reaped: never signal its group again
      drain(*r, true);
      if (!r->partial.empty()) {
        handle_row(*r, std::exchange(r->partial, {}));
      }
      if (r->proc.out_fd >= 0) {
        ::close(r->proc.out_fd);
        r->proc.out_fd = -1;
      }
      ::close(r->proc.log_fd);
      r->proc.log_fd = -1;
      r->proc.pid = -1;
      on_exit(*r, status, "");
      ended.push_back(n);
    } else if (r->stopping && !r->term_sent && Clock::now() >= r->term_at) {
      ::kill(-r->proc.pid, SIGTERM);
      r->term_sent = true;
    } else if (r->stopping && !r->killed && Clock::now() >= r->kill_at) {
      ::kill(-r->proc.pid, SIGKILL);
      r->killed = true;
    }
  }
  for (int64_t n : ended) {
    running_.erase(n);
  }
}

void Tuner::on_exit(Running& r, int status, const std::string& error) {
  TrialRecord& t = trials_.at(r.number);
  free_cores_.insert(free_cores_.end(), r.cores.begin(), r.cores.end());
  std::sort(free_cores_.begin(), free_cores_.end());
  free_gpus_.insert(free_gpus_.end(), r.gpus.begin(), r.gpus.end());
  std::sort(free_gpus_.begin(), free_gpus_.end());
  if (r.lost) {
    return;
  }
  t.exit_status = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
  const std::string id = "trial " + std::to_string(t.number);
  if (r.stopping) {
    if (r.why == Decision::kPause) {
      t.state = TrialState::kPaused;
      write(t, TrialState::kRunning);
      out_.say(id + " paused at iteration " + std::to_string(t.results.back().first),
               {{"event", "paused"}, {"trial", t.number}});
      const auto verdict = verdicts_.find(t.number);
      if (verdict != verdicts_.end()) {  // decided while it was stopping
        const TrialState next = verdict->second;
        verdicts_.erase(verdict);
        if (next == TrialState::kStopped) {
          finish(t, TrialState::kStopped, TrialState::kPaused);
        } else {
          t.state = TrialState::kPending;
          if (write(t, TrialState::kPaused)) {
            enqueue(t.number);
          }
        }
      }
    } else {
      finish(t, r.why == Decision::kStop ? TrialState::kStopped : TrialState::kComplete,
             TrialState::kRunning);
    }
    return;
  }
  if (t.exit_status == 0 && !t.results.empty()) {
    finish(t, TrialState::kComplete, TrialState::kRunning);  // it ended by itself
    return;
  }
  t.error = !error.empty()         ? error
            : t.exit_status == 0   ? "exited without reporting " + o_.metric()
            : t.exit_status == 127 ? "its program could not be executed (exit status 127)"
            : t.exit_status > 128  ? "killed by signal " + std::to_string(t.exit_status - 128)
                                   : "exit status " + std::to_string(t.exit_status);
  if (t.exit_status != 0 && t.attempts < o_.max_failures()) {
    ++t.attempts;
    t.state = TrialState::kPending;
    write(t, TrialState::kRunning);
    enqueue(t.number);
    out_.say(id + " failed (" + t.error + "; log " + t.log_path +
                 "); retrying from its checkpoint (" + std::to_string(t.attempts) + " of " +
                 std::to_string(o_.max_failures()) + ")",
             {{"event", "retry"}, {"trial", t.number}, {"error", t.error}, {"log", t.log_path}});
    return;
  }
  finish(t, TrialState::kFailed, TrialState::kRunning);
}

void Tuner::notify_end(const TrialRecord& t) {
  if (!notified_.insert(t.number).second) {
    return;
  }
  const Outcome outcome = t.state == TrialState::kComplete  ? Outcome::kComplete
                          : t.state == TrialState::kStopped ? Outcome::kPruned
                                                            : Outcome::kFailed;
  const double last = t.results.empty() ? kInf : loss_of(t.results.back().second);
  searcher_->on_complete(t.number, t.config, outcome, loss_of(scoped_value(t)));
  scheduler_->on_trial_end(t.number, last);
}

// Stores the trial if storage still has it in state `from` (and, when RUNNING, held by this
// tuner); otherwise another tuner moved it first, and this one's view is dropped.
bool Tuner::write(TrialRecord& t, TrialState from) {
  if (storage_->update_trial(t, from, from == TrialState::kRunning ? worker_id_ : "")) {
    return true;
  }
  out_.say("trial " + std::to_string(t.number) + " was taken over by another tuner",
           {{"event", "lost"}, {"trial", t.number}});
  t.state = TrialState::kRunning;  // as far as this tuner knows; sync() brings the truth
  t.worker = "?";
  return false;
}

void Tuner::finish(TrialRecord& t, TrialState state, TrialState from) {
  t.state = state;
  t.ended = unix_now();
  if (!write(t, from)) {
    return;
  }
  notify_end(t);
  const double v = scoped_value(t);
  std::string plain = "trial " + std::to_string(t.number) + " " + to_string(state);
  nlohmann::ordered_json j{{"event", "ended"}, {"trial", t.number}, {"state", to_string(state)}};
  if (!std::isnan(v)) {
    plain += ": " + o_.metric() + " " + detail::format_value(v) + " (" + o_.scope() + ")";
    j[o_.metric()] = v;
  }
  if (state == TrialState::kFailed) {
    plain += " (" + t.error + "; log " + t.log_path + ")";
    j["error"] = t.error;
    j["exit_status"] = t.exit_status;
    j["log"] = t.log_path;
  }
  out_.say(plain, j);
}

void Tuner::handle_promotions() {
  // A trial may be promoted or dropped while its process is still stopping for the pause: the
  // verdict then waits for its exit (on_exit).
  for (int64_t n : scheduler_->take_dropped()) {
    TrialRecord& t = trials_.at(n);
    if (t.state == TrialState::kPaused) {
      finish(t, TrialState::kStopped, TrialState::kPaused);
    } else if (running_.count(n)) {
      verdicts_[n] = TrialState::kStopped;
    }
  }
  for (int64_t n : scheduler_->take_promoted()) {
    TrialRecord& t = trials_.at(n);
    if (t.state == TrialState::kPaused) {
      t.state = TrialState::kPending;
      if (write(t, TrialState::kPaused)) {
        enqueue(n);
      }
    } else if (running_.count(n)) {
      verdicts_[n] = TrialState::kPending;
    }
  }
  if (no_more_ && running_.empty() && queue_.empty() && !others_active()) {
    for (auto& [n, t] : trials_) {  // nothing can promote them any more
      if (t.state == TrialState::kPaused) {
        finish(t, TrialState::kStopped, TrialState::kPaused);
      }
    }
  }
}

void Tuner::print_table(bool force) {
  if (out_.table_due(force)) {
    out_.print_table(summary(), space_);
  }
}

// Heartbeats for this tuner's trials; a trial storage no longer lists as this tuner's was
// released by another tuner (which thought this one dead): stop running it here.
void Tuner::beat() {
  const std::vector<int64_t> held = storage_->heartbeat(worker_id_);
  for (auto& [n, r] : running_) {
    if (std::find(held.begin(), held.end(), n) == held.end() && !r->lost) {
      r->lost = true;
      out_.say("trial " + std::to_string(n) + " was taken over by another tuner; stopping it here",
               {{"event", "lost"}, {"trial", n}});
      if (r->proc.pid > 0) {
        ::kill(-r->proc.pid, SIGKILL);
      }
      if (r->fn) {
        r->fn->answer(true);
      }
    }
  }
}

void Tuner::stop_all() {
  for (auto& [n, r] : running_) {
    if (r->proc.pid > 0) {
      ::kill(-r->proc.pid, SIGTERM);
    }
    if (r->fn) {
      r->fn->answer(true);
    }
  }
  const auto deadline = Clock::now() + o_.kill_grace();
  for (auto& [n, r] : running_) {
    int status = 0;
    if (r->proc.pid > 0) {
      while (::waitpid(r->proc.pid, &status, WNOHANG) == 0) {
        if (Clock::now() >= deadline) {
          ::kill(-r->proc.pid, SIGKILL);
          ::waitpid(r->proc.pid, &status, 0);
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      ::kill(-r->proc.pid, SIGKILL);
      if (r->proc.out_fd >= 0) {
        ::close(r->proc.out_fd);
      }
      if (r->proc.log_fd >= 0) {
        ::close(r->proc.log_fd);
      }
    }
    if (r->fn) {
      std::string error;
      while (!r->fn->done(&status, &error) && Clock::now() < deadline) {
        r->fn->take_rows();
        r->fn->answer(true);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (!r->thread.joinable()) {
        // reap() joined it already
      } else if (r->fn->done(&status, &error)) {
        r->thread.join();
      } else {
        r->thread.detach();  // it never reports again; its context stays alive with it
        detached_ = true;
      }
    }
  }
  for (auto& [n, r] : running_) {
    if (r->lost) {
      continue;
    }
    // Interrupted, not failed: PENDING again without an attempt, for the next tuner to resume;
    // a trial the scheduler had already decided keeps that decision.
    TrialRecord& t = trials_.at(n);
    t.state = TrialState::kPending;
    if (r->stopping) {
      const auto verdict = verdicts_.find(n);
      t.state = r->why == Decision::kStop       ? TrialState::kStopped
                : r->why == Decision::kComplete ? TrialState::kComplete
                : verdict != verdicts_.end()    ? verdict->second
                                                : TrialState::kPaused;
    }
    t.worker.clear();
    try {
      storage_->update_trial(t, TrialState::kRunning, worker_id_);
    } catch (const std::exception& e) {
      std::cerr << "tune: could not store trial " << n << " on the way out: " << e.what()
                << std::endl;
    }
  }
  running_.clear();
}

}  // namespace

TuneResult tune(const SearchSpace& space, const TunerOptions& options, TrialFunction fn) {
  Tuner tuner(space, options, std::move(fn));
  return tuner.run();
}

}  // namespace tune
}  // namespace paratrain
