// The tuner's state machine: one thread owns the study. It syncs with storage, starts trials
// while cores, GPUs and --max-concurrent allow, turns their metric rows into searcher and
// scheduler decisions (rungs, pruning, promotions, retries) and records each trial's state in
// storage. Running a trial (its process or thread, its output, stopping and reaping it) is in
// trial_runner.cpp, a process trial's command line in trial_command.cpp, the checked options and
// resources in tuner_setup.cpp, and what it prints (events, the live table) and the summary it
// returns in tuner_output.cpp.

#include "paratrain/tune/tuner.h"
#include "limits.h"

#include "pbt.h"
#include "util/files.h"

#include "trial_command.h"
#include "trial_runner.h"
#include "trial_value.h"
#include "tuner_output.h"
#include "tuner_setup.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <iostream>
#include <optional>
#include <random>
#include <set>

namespace paratrain {
namespace tune {
namespace {

using Clock = std::chrono::steady_clock;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A trial that is executing: a process or a function on its own thread (trial_runner.h), and
// what the state machine knows of it.
struct Running {
  int64_t number = 0;
  detail::TrialRun run;                // its process or thread: output, stopping, reaping
  int64_t rows = 0;                    // rows this run reported (numbers rows without an iteration)
  Decision why = Decision::kContinue;  // the scheduler's, once run.stopping()
  bool lost = false;                   // another tuner took it over: its end is not recorded here
  // What the scheduler decided while it was stopping for a pause (promoted: PENDING; dropped:
  // STOPPED), applied once it has paused.
  std::optional<TrialState> verdict;
  std::vector<int> cores, gpus;
};

class Tuner {
 public:
  Tuner(const SearchSpace& space, const TunerOptions& o, TrialFunction fn)
      : space_(space), o_(o), fn_(std::move(fn)), out_(o.output(), o.metric()) {}

  TuneResult run();

 private:
  void prepare();
  void main_loop();
  void sync(bool first);
  bool worker_dead(const TrialRecord& t, double now) const;
  void enqueue(int64_t number);
  bool others_active() const;
  Config suggest(int64_t number);
  void start_possible();
  int64_t slots() const;
  bool start(int64_t number, bool resume);
  void poll_once();
  void handle_row(Running& r, const std::string& line);
  // A metric row of a running trial: recorded, judged, acted on.
  void handle_result(Running& r, const nlohmann::json& row);
  Decision judge(const TrialRecord& t, int64_t iteration, double loss, bool observed = false);
  void stage_exploit(const TrialRecord& t);
  void drop_exploit(int64_t number);
  void restore_restart_floors();
  void apply(Running& r, Decision d);
  void reap();
  void on_exit(Running& r, int status, const std::string& error);
  std::string trial_path(int64_t number) const;
  void exploit(TrialRecord& t, const Exploit& e);
  bool transition(TrialRecord& t, TrialState to, TrialState from);
  void announce_end(const TrialRecord& t);
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
  detail::WakePipe wake_;  // ends poll() for function trials' reports and for signals
  bool detached_ = false;
  std::string host_, worker_id_;
  std::set<int64_t> notified_;  // trials whose end the searcher and scheduler were told
  // Trials that continue another trial's checkpoint (pbt): the iteration their next row follows.
  std::map<int64_t, int64_t> restarted_at_;
  // Exploits decided for stopping trials, their checkpoints copied already (stage_exploit).
  std::map<int64_t, Exploit> exploits_;
};

// Checks the options, opens the study (its searcher, scheduler and storage) and the trial
// directory, names this tuner, and takes in what storage already holds.
void Tuner::prepare() {
  detail::TunerResources given = detail::check_tuner_options(o_, fn_);
  free_cores_ = std::move(given.cores);
  free_gpus_ = std::move(given.gpus);
  program_ = std::move(given.program);
  SearcherOptions so = o_.searcher();
  so.num_samples(o_.num_samples());
  searcher_ = make_searcher(space_, so);
  total_ = space_.grid_size() * o_.num_samples();
  SchedulerOptions sched = o_.scheduler();
  sched.population(total_).seed(so.seed()).slots(slots());
  scheduler_ = make_scheduler(sched);
  if (sched.kind() == "pbt") {
    check_mutations(sched, space_);
  }
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
  if (sched.kind() == "pbt") {
    restore_restart_floors();
  }
}

TuneResult Tuner::run() {
  prepare();

  wake_.open();
  auto restore = [&] {
    wake_.close(detached_);  // a detached trial thread may still write to it: leave it open
  };
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
  result.interrupted_by = detail::WakePipe::signal();
  return result;
}

// Until the study is done (or a signal stops it): syncs with storage, beats, starts trials, polls
// their output, reaps them and acts on the scheduler's promotions.
void Tuner::main_loop() {
  auto last_sync = Clock::now(), last_beat = Clock::now();
  while (true) {
    if (detail::WakePipe::signal() != 0) {
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
    const bool fresh = it == trials_.end();
    if (fresh) {
      scheduler_->on_trial_add(n);
      it = trials_.emplace(n, TrialRecord{}).first;
      it->second.number = n;
    }
    TrialRecord& t = it->second;
    if (!s.config.empty() && t.config != s.config) {  // chosen, or perturbed (pbt), elsewhere
      t.config = s.config;
      scheduler_->on_config(n, t.config);
    }
    for (size_t i = t.results.size(); i < s.results.size(); ++i) {
      const auto [iteration, value] = s.results[i];
      t.results.push_back(s.results[i]);
      metric_seen_ = true;
      judge(t, iteration, loss_of(value), true);  // the tuner that runs it acts on it
    }
    if (s.state == TrialState::kPaused && (fresh || t.state != TrialState::kPaused)) {
      scheduler_->on_paused(n);  // paused by a tuner before this one
    }
    t.state = s.state;  // storage's view, whichever tuner moved it
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
      // release_trial moved it in storage, only while the dead tuner's last beat is the one
      // seen (a compare-and-set another transition cannot express): this is its mirror.
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
        transition(t, TrialState::kFailed, TrialState::kRunning);
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
    t.state = TrialState::kRunning;  // as reserve_trial stored it
    t.worker = worker_id_;
    trials_[n] = t;
    scheduler_->on_trial_add(n);
    trials_[n].config = suggest(n);
    start(n, false);
  }
}

// How many trials may run at once here: the cores (and GPUs) they take, and --max-concurrent.
int64_t Tuner::slots() const {
  const Resources& res = o_.resources();
  int64_t n = static_cast<int64_t>(free_cores_.size()) / (res.ranks() * res.threads());
  if (res.gpus() > 0) {
    n = std::min<int64_t>(n, static_cast<int64_t>(free_gpus_.size()) / res.gpus());
  }
  return o_.max_concurrent() > 0 ? std::min<int64_t>(n, o_.max_concurrent()) : n;
}

Config Tuner::suggest(int64_t number) {
  std::optional<Config> config = searcher_->suggest(number);
  TORCH_CHECK(config, "tune: the searcher has no config for trial ", number,
              " (a grid smaller than the study's trials)");
  storage_->set_config(number, *config);
  scheduler_->on_config(number, *config);
  return *config;
}

bool Tuner::start(int64_t number, bool resume) {
  TrialRecord& t = trials_.at(number);
  const std::string dir = trial_path(number);
  t.log_path = dir + "/trial.log";
  if (t.started == 0) {
    t.started = unix_now();
  }
  t.worker = worker_id_;
  if (!transition(t, TrialState::kRunning, TrialState::kRunning)) {
    return false;  // claimed or reserved by this tuner just now, and already taken over
  }
  // Only the tuner that holds the trial touches its directory.
  restore_aside(dir + "/checkpoints");  // a swap a killed tuner left half done (pbt)
  std::error_code ec;
  std::filesystem::create_directories(dir + "/checkpoints", ec);
  TORCH_CHECK(!ec, "tune: cannot create ", dir, ": ", ec.message());
  auto r = std::make_unique<Running>();
  r->number = number;
  const int need_cores = o_.resources().ranks() * o_.resources().threads();
  r->cores.assign(free_cores_.begin(), free_cores_.begin() + need_cores);
  free_cores_.erase(free_cores_.begin(), free_cores_.begin() + need_cores);
  r->gpus.assign(free_gpus_.begin(), free_gpus_.begin() + o_.resources().gpus());
  free_gpus_.erase(free_gpus_.begin(), free_gpus_.begin() + o_.resources().gpus());
  Running& ref = *r;
  running_[number] = std::move(r);
  ++started_;
  scheduler_->on_start(number);
  if (o_.train() || !o_.command().empty()) {
    const bool gpus_visible = !free_gpus_.empty() || !ref.gpus.empty();
    ref.run.start_process(
        detail::trial_process_spec(o_, program_, t, ref.cores, ref.gpus, gpus_visible, resume),
        t.number, t.attempts, resume);
  } else {
    ref.run.start_function(fn_, t.number, t.config, dir, resume);
  }
  out_.say("trial " + std::to_string(number) + (resume ? " resumed" : " started") + ": " +
               to_string(t.config),
           {{"event", resume ? "resumed" : "started"}, {"trial", number}});
  return true;
}

// Waits for the trials' output (or a wake-up) and hands their rows to handle_row; a function
// trial then gets its answer.
void Tuner::poll_once() {
  std::vector<Running*> trials;
  std::vector<detail::TrialRun*> runs;
  for (auto& [n, r] : running_) {
    trials.push_back(r.get());
    runs.push_back(&r->run);
  }
  for (size_t i : detail::wait_for_output(wake_, runs)) {
    Running& r = *trials[i];
    r.run.read(false, [&](const std::string& line) { handle_row(r, line); });
  }
  for (auto& [n, r] : running_) {
    Running& ref = *r;
    ref.run.take_reports([&](const std::string& row) { handle_row(ref, row); });
  }
}

void Tuner::handle_row(Running& r, const std::string& line) {
  const size_t first = line.find_first_not_of(" \t\r");
  if (first == std::string::npos || line[first] != '{') {
    return;  // not a metric row: only logged
  }
  const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
  // A train trial waits after each epoch's row until the decision on it is made: it goes on
  // when this returns (or throws), unless the decision stopped it.
  struct Answer {
    Running* r;
    ~Answer() {
      if (r != nullptr && !r->lost) {  // a lost trial is killed, not told to go on
        r->run.answer_epoch();
      }
    }
  } answer{row.is_discarded() || (row.is_object() && row.contains("epoch")) ? &r : nullptr};
  if (row.is_discarded() || !row.is_object() || r.run.stopping() || r.lost) {
    return;
  }
  handle_result(r, row);
}

void Tuner::handle_result(Running& r, const nlohmann::json& row) {
  const auto metric = row.find(o_.metric());
  const auto resumed = row.find("resumed");
  if (metric == row.end() && resumed != row.end() && resumed->is_boolean() &&
      resumed->get<bool>()) {
    // `paratrain train`'s row of an epoch trained before its resume, without the training values
    // (train_loss): the evaluation's metrics still count; others were reported when it trained.
    return;
  }
  TrialRecord& t = trials_.at(r.number);
  ++r.rows;
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
  // After an exploit the trial continues from its source's iteration (restarted_at_).
  const auto restart = restarted_at_.find(t.number);
  const int64_t floor = restart != restarted_at_.end() ? restart->second
                        : t.results.empty()            ? 0
                                                       : t.results.back().first;
  int64_t iteration = floor + 1;
  for (const char* key : {"training_iteration", "epoch"}) {
    const auto it = row.find(key);
    if (it != row.end() && it->is_number()) {
      iteration = it->get<int64_t>();
      break;
    }
  }
  if (iteration <= floor) {
    return;  // a resumed trial repeating what it reported before its checkpoint
  }
  metric_seen_ = true;
  // JSON has no NaN: a diverged trial's NaN reaches us as null (nlohmann, Python's json with
  // allow_nan=False). It is recorded, and ranks last.
  const double value = metric->is_null() ? std::nan("") : metric->get<double>();
  if (!storage_->add_result(t.number, iteration, value, row.dump(), worker_id_)) {
    r.lost = true;  // another tuner holds it now: its rows are that tuner's to write
    out_.say(
        "trial " + std::to_string(t.number) + " was taken over by another tuner; stopping it here",
        {{"event", "lost"}, {"trial", t.number}});
    r.run.signal_now(SIGKILL);  // as beat() does: two processes must not train one trial
    return;
  }
  t.results.emplace_back(iteration, value);
  if (restart != restarted_at_.end()) {
    restarted_at_.erase(restart);
  }
  const Decision d = judge(t, iteration, loss_of(value));
  if (d == Decision::kPause) {
    stage_exploit(t);  // while the source's checkpoint is the one its result came from
  }
  nlohmann::ordered_json j{
      {"event", "result"}, {"trial", t.number}, {"iteration", iteration}, {o_.metric(), value}};
  out_.say("trial " + std::to_string(t.number) + " iteration " + std::to_string(iteration) + ": " +
               o_.metric() + " " + detail::format_value(value),
           j);
  apply(r, d);
}

// One result for the searcher and the scheduler; a result the scheduler recorded at a rung (or
// at max_t) is also one of the searcher's budgets.
Decision Tuner::judge(const TrialRecord& t, int64_t iteration, double loss, bool observed) {
  if (!t.config.empty()) {
    searcher_->on_result(t.number, t.config, iteration, loss);
  }
  Decision d = Decision::kContinue;
  if (observed) {
    scheduler_->observe(t.number, iteration, loss);
  } else {
    d = scheduler_->on_result(t.number, iteration, loss);
  }
  const int64_t budget = scheduler_->last_rung();
  if (budget > 0 && !t.config.empty()) {
    searcher_->on_rung(t.number, t.config, budget, loss);
  }
  return d;
}

void Tuner::apply(Running& r, Decision d) {
  if (d == Decision::kContinue) {
    return;
  }
  r.why = d;
  // A trial at max_t usually ends by itself (a train trial runs max_t epochs): a second before
  // it is told to, so that its exit status stays its own.
  const auto term_delay =
      d == Decision::kComplete ? std::chrono::milliseconds(1000) : std::chrono::milliseconds(0);
  r.run.stop(term_delay, o_.kill_grace());
}

void Tuner::reap() {
  // Each ended trial leaves running_ as soon as its exit is recorded: should a later one throw,
  // stop_all must not record this one's end again.
  for (auto it = running_.begin(); it != running_.end();) {
    int status = 0;
    std::string error;
    Running& ref = *it->second;
    if (ref.run.reap([&](const std::string& line) { handle_row(ref, line); }, &status, &error)) {
      on_exit(ref, status, error);
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
}

void Tuner::on_exit(Running& r, int status, const std::string& error) {
  TrialRecord& t = trials_.at(r.number);
  free_cores_.insert(free_cores_.end(), r.cores.begin(), r.cores.end());
  std::sort(free_cores_.begin(), free_cores_.end());
  free_gpus_.insert(free_gpus_.end(), r.gpus.begin(), r.gpus.end());
  std::sort(free_gpus_.begin(), free_gpus_.end());
  if (r.lost) {
    drop_exploit(r.number);  // another tuner runs it now
    return;
  }
  t.exit_status = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
  const std::string id = "trial " + std::to_string(t.number);
  if (r.run.stopping()) {
    if (r.why == Decision::kPause) {
      const auto staged = exploits_.find(t.number);
      if (staged != exploits_.end()) {
        exploit(t, staged->second);
        exploits_.erase(staged);
      }
      if (!transition(t, TrialState::kPaused, TrialState::kRunning)) {
        return;
      }
      out_.say(id + " paused at iteration " + std::to_string(t.results.back().first),
               {{"event", "paused"}, {"trial", t.number}});
      if (r.verdict) {  // decided while it was stopping
        transition(t, *r.verdict, TrialState::kPaused);
      }
    } else {
      transition(t, r.why == Decision::kStop ? TrialState::kStopped : TrialState::kComplete,
                 TrialState::kRunning);
    }
    return;
  }
  if (t.exit_status == 0 && !t.results.empty()) {
    transition(t, TrialState::kComplete, TrialState::kRunning);  // it ended by itself
    return;
  }
  t.error = !error.empty()         ? error
            : t.exit_status == 0   ? "exited without reporting " + o_.metric()
            : t.exit_status == 127 ? "its program could not be executed (exit status 127)"
            : t.exit_status > 128  ? "killed by signal " + std::to_string(t.exit_status - 128)
                                   : "exit status " + std::to_string(t.exit_status);
  if (t.exit_status != 0 && t.attempts < o_.max_failures()) {
    ++t.attempts;
    if (!transition(t, TrialState::kPending, TrialState::kRunning)) {
      return;
    }
    out_.say(id + " failed (" + t.error + "; log " + t.log_path +
                 "); retrying from its checkpoint (" + std::to_string(t.attempts) + " of " +
                 std::to_string(o_.max_failures()) + ")",
             {{"event", "retry"}, {"trial", t.number}, {"error", t.error}, {"log", t.log_path}});
    return;
  }
  transition(t, TrialState::kFailed, TrialState::kRunning);
}

std::string Tuner::trial_path(int64_t number) const {
  char name[32];
  std::snprintf(name, sizeof(name), "trial_%04lld", static_cast<long long>(number));
  return o_.trial_dir() + "/" + name;
}

// pbt's exploit, decided as the trial pauses: the source's checkpoint directory is copied now,
// beside the trial's own (which its process may still be writing), while it holds the state the
// source's last result came from. A source without one ends the study: nothing could be copied.
void Tuner::stage_exploit(const TrialRecord& t) {
  auto e = scheduler_->take_exploit(t.number);
  if (!e) {
    return;
  }
  const std::string from = trial_path(e->source) + "/checkpoints";
  TORCH_CHECK(has_files(from), "tune: population-based training: trial ", t.number,
              " is to continue from trial ", e->source, "'s checkpoint, but ", from,
              " is empty; a trial must save its checkpoint in PARATRAIN_CHECKPOINT_DIR (and load "
              "it when PARATRAIN_TRIAL_RESUME is 1), or pbt has nothing to copy");
  stage_copy(from, trial_path(t.number) + "/checkpoints.exploit");
  exploits_[t.number] = std::move(*e);
}

void Tuner::drop_exploit(int64_t number) {
  if (exploits_.erase(number) > 0) {
    paratrain::detail::remove_tree(trial_path(number) + "/checkpoints.exploit");
  }
}

// The exploit takes effect once the trial's process is gone: the copy goes in place of its
// checkpoint directory, and the step and the new config are stored together.
void Tuner::exploit(TrialRecord& t, const Exploit& e) {
  const std::string dir = trial_path(t.number);
  swap_in(dir + "/checkpoints.exploit", dir + "/checkpoints");
  ExploitRecord rec;
  rec.trial = t.number;
  rec.source = e.source;
  rec.iteration = t.results.empty() ? 0 : t.results.back().first;
  rec.source_iteration = e.source_iteration;
  rec.old_config = t.config;
  rec.new_config = e.config;
  rec.time = unix_now();
  storage_->add_exploit(rec);
  t.config = e.config;
  restarted_at_[t.number] = e.source_iteration;
  out_.say("trial " + std::to_string(t.number) + " exploits trial " + std::to_string(e.source) +
               " (its checkpoint at iteration " + std::to_string(e.source_iteration) +
               "): " + to_string(rec.old_config) + " -> " + to_string(e.config),
           {{"event", "exploit"},
            {"trial", t.number},
            {"source", e.source},
            {"source_iteration", e.source_iteration},
            {"config", to_string(e.config)}});
}

// A continued study: a trial whose last exploit came after its last result resumes from the
// source's iteration.
void Tuner::restore_restart_floors() {
  for (const auto& e : storage_->load_exploits()) {
    const auto it = trials_.find(e.trial);
    const int64_t last =
        it == trials_.end() || it->second.results.empty() ? 0 : it->second.results.back().first;
    if (last == e.iteration) {
      restarted_at_[e.trial] = e.source_iteration;
    } else {
      restarted_at_.erase(e.trial);
    }
  }
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

// Every change of a trial's state goes through here. Storage first, and only if it still has the
// trial in state `from` (and, when RUNNING, held by this tuner); otherwise another tuner moved it
// first, and this one's view is dropped (sync() brings the truth). Then what the new state
// starts: PENDING is queued to run (again), an end is told to the searcher and the scheduler and
// announced. Returns whether the trial moved.
bool Tuner::transition(TrialRecord& t, TrialState to, TrialState from) {
  t.state = to;
  if (finished(to)) {
    t.ended = unix_now();
  }
  if (!storage_->update_trial(t, from, from == TrialState::kRunning ? worker_id_ : "")) {
    out_.say("trial " + std::to_string(t.number) + " was taken over by another tuner",
             {{"event", "lost"}, {"trial", t.number}});
    t.state = TrialState::kRunning;  // as far as this tuner knows
    t.worker = "?";
    return false;
  }
  if (to == TrialState::kPending) {
    enqueue(t.number);
  }
  if (finished(to)) {
    notify_end(t);
    announce_end(t);
  }
  return true;
}

void Tuner::announce_end(const TrialRecord& t) {
  const double v = scoped_value(t);
  std::string plain = "trial " + std::to_string(t.number) + " " + to_string(t.state);
  nlohmann::ordered_json j{{"event", "ended"}, {"trial", t.number}, {"state", to_string(t.state)}};
  if (!std::isnan(v)) {
    plain += ": " + o_.metric() + " " + detail::format_value(v) + " (" + o_.scope() + ")";
    j[o_.metric()] = v;
  }
  if (t.state == TrialState::kFailed) {
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
      transition(t, TrialState::kStopped, TrialState::kPaused);
    } else if (running_.count(n)) {
      running_.at(n)->verdict = TrialState::kStopped;
    }
  }
  for (int64_t n : scheduler_->take_promoted()) {
    TrialRecord& t = trials_.at(n);
    if (t.state == TrialState::kPaused) {
      transition(t, TrialState::kPending, TrialState::kPaused);
    } else if (running_.count(n)) {
      running_.at(n)->verdict = TrialState::kPending;
    }
  }
  if (no_more_ && running_.empty() && queue_.empty() && !others_active()) {
    for (auto& [n, t] : trials_) {  // nothing can promote them any more
      if (t.state == TrialState::kPaused) {
        transition(t, TrialState::kStopped, TrialState::kPaused);
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
      r->run.signal_now(SIGKILL);
    }
  }
}

void Tuner::stop_all() {
  for (auto& [n, r] : running_) {
    r->run.signal_now(SIGTERM);
  }
  const auto deadline = Clock::now() + o_.kill_grace();
  for (auto& [n, r] : running_) {
    if (r->run.end_by(deadline)) {
      detached_ = true;
    }
  }
  for (auto& [n, r] : running_) {
    drop_exploit(n);  // not applied: the trial resumes its own checkpoint
    if (r->lost) {
      continue;
    }
    // Interrupted, not failed: PENDING again without an attempt, for the next tuner to resume;
    // a trial the scheduler had already decided keeps that decision.
    TrialRecord& t = trials_.at(n);
    TrialState to = TrialState::kPending;
    if (r->run.stopping()) {
      to = r->why == Decision::kStop       ? TrialState::kStopped
           : r->why == Decision::kComplete ? TrialState::kComplete
                                           : r->verdict.value_or(TrialState::kPaused);
    }
    t.worker.clear();
    try {
      transition(t, to, TrialState::kRunning);
    } catch (const std::exception& e) {
      std::cerr << "tune: could not record trial " << n << " on the way out: " << e.what()
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
