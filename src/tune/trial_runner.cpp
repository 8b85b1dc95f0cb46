// Running one trial for the tuner: starting its process or its function's thread, reading the
// lines it prints, handing a function's reports over, stopping it (SIGTERM, SIGKILL after the
// grace) and reaping it; and the wake-up pipe with the tuner's SIGINT and SIGTERM handlers.

#include "trial_runner.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <utility>

namespace paratrain {
namespace tune {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

// The wake-up pipe: signal handlers and function-trial threads write a byte to end poll().
std::atomic<int> g_wake_write{-1};
std::atomic<int> g_signal{0};

extern "C" void on_tuner_signal(int sig) {
  const int saved_errno = errno;  // the interrupted code may be about to read it
  g_signal.store(sig);
  const int fd = g_wake_write.load();
  if (fd >= 0) {
    const char c = 's';
    ssize_t ignored = ::write(fd, &c, 1);
    (void)ignored;
  }
  errno = saved_errno;
}

void wake() {
  const int fd = g_wake_write.load();
  if (fd >= 0) {
    const char c = 'w';
    ssize_t ignored = ::write(fd, &c, 1);
    (void)ignored;
  }
}

}  // namespace

void WakePipe::open() {
  TORCH_CHECK(::pipe2(fds_, O_CLOEXEC | O_NONBLOCK) == 0, "tune: pipe failed");
  g_wake_write = fds_[1];
  g_signal.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_tuner_signal;
  sigemptyset(&sa.sa_mask);
  // Restarted, so that a blocking write (the event lines into a full pipe) does not fail with
  // EINTR and lose the output; poll() is never restarted on Linux, and the wake byte ends it.
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, &old_int_);
  ::sigaction(SIGTERM, &sa, &old_term_);
}

void WakePipe::close(bool leave_open) {
  ::sigaction(SIGINT, &old_int_, nullptr);
  ::sigaction(SIGTERM, &old_term_, nullptr);
  g_wake_write = -1;
  if (!leave_open) {
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
}

int WakePipe::signal() {
  return g_signal.load();
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

void TrialRun::start_process(const ProcessSpec& spec, int64_t number, int attempts, bool resume) {
  {
    std::ofstream log(spec.log_path, std::ios::app);
    log << "== paratrain tune: trial " << number << (resume ? " resumed" : " started")
        << " (failures so far " << attempts << "):";
    for (const auto& w : spec.argv) {
      log << " " << w;
    }
    log << "\n";
  }
  proc_ = detail::start_process(spec);
}

void TrialRun::start_function(const TrialFunction& fn,
                              int64_t number,
                              const Config& config,
                              const std::string& dir,
                              bool resume) {
  fn_ = std::make_shared<FunctionContext>(number, config, dir, resume);
  auto ctx = fn_;
  thread_ = std::thread([ctx, fn] {
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

// Reads what the trial printed: one read while it runs (a trial that prints without pause must
// not keep the loop from its other duties), everything once it has exited.
void TrialRun::read(bool all, const LineHandler& on_line) {
  char buf[65536];
  for (bool more = true; more && proc_.out_fd >= 0; more = all) {
    const ssize_t got = ::read(proc_.out_fd, buf, sizeof(buf));
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got <= 0) {
      if (got == 0 || errno != EAGAIN) {
        ::close(proc_.out_fd);  // end of its output
        proc_.out_fd = -1;
      }
      break;
    }
    partial_.append(buf, static_cast<size_t>(got));
    for (size_t nl = partial_.find('\n'); nl != std::string::npos; nl = partial_.find('\n')) {
      const std::string line = partial_.substr(0, nl);
      partial_.erase(0, nl + 1);
      const std::string with_nl = line + "\n";
      ssize_t ignored = ::write(proc_.log_fd, with_nl.data(), with_nl.size());
      (void)ignored;
      on_line(line);
    }
  }
}

void TrialRun::take_reports(const LineHandler& on_line) {
  if (fn_) {
    for (const auto& row : fn_->take_rows()) {
      on_line(row);
    }
    fn_->answer(stopping_);
  }
}

void TrialRun::stop(std::chrono::milliseconds term_delay, std::chrono::milliseconds grace) {
  stopping_ = true;
  term_at_ = Clock::now() + term_delay;
  kill_at_ = term_at_ + grace;
  if (proc_.pid > 0 && term_delay.count() == 0) {
    ::kill(-proc_.pid, SIGTERM);  // its whole process group: a train trial's ranks too
    term_sent_ = true;
  }
  if (fn_) {
    fn_->answer(true);
  }
}

void TrialRun::signal_now(int sig) {
  if (proc_.pid > 0) {
    ::kill(-proc_.pid, sig);
  }
  if (fn_) {
    fn_->answer(true);
  }
}

bool TrialRun::reap(const LineHandler& on_line, int* status, std::string* error) {
  if (fn_) {
    if (!fn_->done(status, error)) {
      return false;
    }
    thread_.join();
    *status = *status == 0 ? 0 : 1 << 8;
    return true;
  }
  const pid_t got = ::waitpid(proc_.pid, status, WNOHANG);
  if (got < 0 && errno == ECHILD) {
    *status = 1 << 8;  // reaped elsewhere (SIGCHLD ignored by the program): ended, status lost
  }
  if (got == proc_.pid || (got < 0 && errno == ECHILD)) {
    ::kill(-proc_.pid, SIGKILL);  // anything it left behind in its group
    proc_.pid = -1;               // reaped: never signal its group again
    // Closed also when a line's handler throws (a row without the metric, a storage error).
    struct Closer {
      TrialRun* run;
      ~Closer() { run->close_fds(); }
    } closer{this};
    read(true, on_line);
    if (!partial_.empty()) {
      on_line(std::exchange(partial_, {}));
    }
    return true;
  }
  if (stopping_ && !term_sent_ && Clock::now() >= term_at_) {
    ::kill(-proc_.pid, SIGTERM);
    term_sent_ = true;
  } else if (stopping_ && !killed_ && Clock::now() >= kill_at_) {
    ::kill(-proc_.pid, SIGKILL);
    killed_ = true;
  }
  return false;
}

void TrialRun::close_fds() {
  close_process_fds(proc_);
}

void TrialRun::answer_epoch() {
  if (!stopping_) {
    answer_row(proc_);
  }
}

bool TrialRun::end_by(Clock::time_point deadline) {
  int status = 0;
  if (proc_.pid > 0) {
    while (::waitpid(proc_.pid, &status, WNOHANG) == 0) {
      if (Clock::now() >= deadline) {
        ::kill(-proc_.pid, SIGKILL);
        ::waitpid(proc_.pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::kill(-proc_.pid, SIGKILL);
    proc_.pid = -1;
  }
  close_fds();
  if (fn_) {
    std::string error;
    while (!fn_->done(&status, &error) && Clock::now() < deadline) {
      fn_->take_rows();
      fn_->answer(true);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!thread_.joinable()) {
      // reap() joined it already
    } else if (fn_->done(&status, &error)) {
      thread_.join();
    } else {
      thread_.detach();  // it never reports again; its context stays alive with it
      return true;
    }
  }
  return false;
}

std::vector<size_t> wait_for_output(const WakePipe& wake, const std::vector<TrialRun*>& runs) {
  std::vector<pollfd> fds{{wake.read_fd(), POLLIN, 0}};
  std::vector<size_t> owners{0};
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i]->out_fd() >= 0) {
      fds.push_back({runs[i]->out_fd(), POLLIN, 0});
      owners.push_back(i);
    }
  }
  ::poll(fds.data(), fds.size(), 200);  // 200 ms: also the pace of kill deadlines and reaping
  if (fds[0].revents) {
    char buf[256];
    while (::read(wake.read_fd(), buf, sizeof(buf)) > 0) {
    }
  }
  std::vector<size_t> ready;
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents) {
      ready.push_back(owners[i]);
    }
  }
  return ready;
}

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
