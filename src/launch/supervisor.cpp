// The local job: starts this node's workers with torchrun's environment, relays their output line
// by line, forwards SIGINT/SIGTERM to them (through a self-pipe), stops them all on the first
// failure, and reports how the job ended (run_job, see supervisor.h).

#include "supervisor.h"

#include "launch_internal.h"

#include "paratrain/base/child_process.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace paratrain {
namespace dist {
namespace launch_internal {
namespace {

using Clock = std::chrono::steady_clock;

// Self-pipe: signal handlers only write the signal number; the event loop does the work.
int g_signal_pipe[2] = {-1, -1};

void on_signal(int signo) {
  int saved = errno;
  unsigned char b = static_cast<unsigned char>(signo);
  ssize_t ignored = ::write(g_signal_pipe[1], &b, 1);
  (void)ignored;
  errno = saved;
}

void write_all(int fd, const std::string& text) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
}

std::string now_iso8601() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S%z", &tm);
  return buf;
}

// One relayed stream of one worker: bytes in, whole prefixed lines out.
struct Stream {
  int fd = -1;      // read end, -1 once closed
  int out_fd = 1;   // where lines go (1 or 2)
  int log_fd = -1;  // --log-dir's stdout.log or stderr.log; O_CLOEXEC: later workers must not
                    // inherit the logs of earlier ones
  bool to_console = true;
  std::string partial;
};

struct Worker {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  bool group_empty = false;  // its process group was seen empty: the pgid may be reused, skip it
  int status = 0;
  Stream streams[2];
  std::string prefix;
  std::string log_path;  // its stderr.log, which the failure summary names

  void emit(Stream& s, const std::string& line) {
    if (s.to_console) {
      // One write per line: lines from different workers never mix.
      write_all(s.out_fd, prefix + line + "\n");
    }
    if (s.log_fd >= 0) {
      write_all(s.log_fd, line + "\n");
    }
  }

  // Reads what is available; returns false at end of stream.
  bool pump(Stream& s) {
    char buf[65536];
    ssize_t n = ::read(s.fd, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
      return true;
    }
    if (n <= 0) {
      if (!s.partial.empty()) {
        emit(s, s.partial);
        s.partial.clear();
      }
      ::close(s.fd);
      s.fd = -1;
      return false;
    }
    s.partial.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
      emit(s, s.partial.substr(start, nl - start));
    }
    s.partial.erase(0, start);
    return true;
  }
};

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

bool failed(int status) {
  return WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
}

int exit_code_of(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

// Sends `sig` to every worker's process group (which also holds what the worker started), and to
// the groups of exited workers until they are seen empty: a group's id can be reused once empty.
void signal_groups(std::vector<Worker>& workers, int sig) {
  for (auto& w : workers) {
    if (w.pid <= 0 || w.group_empty) {
      continue;
    }
    if (!w.running && ::killpg(w.pid, 0) != 0 && errno == ESRCH) {
      w.group_empty = true;
      continue;
    }
    ::killpg(w.pid, sig);
  }
}

// Owns what launch() sets up, so that an exception (a failed fork, say) leaves no worker running,
// nothing they left behind (adopt_orphans), no descriptor open and no signal handler of ours
// installed.
struct JobGuard {
  std::vector<Worker> workers;
  struct sigaction old_int {};
  struct sigaction old_term {};
  struct sigaction old_chld {};
  bool handlers_installed = false;
  int dev_null = -1;
  // LaunchOptions::adopt_orphans: this process is the subreaper of the workers' descendants while
  // the job runs. `spared` holds the children it had before the job: other code's, never touched.
  bool adopting = false;
  bool was_subreaper = false;
  std::set<pid_t> spared;
  std::chrono::milliseconds grace{0};
  std::string name;

  // The children of this process that are not the job's leftovers: the workers not yet reaped
  // (the supervisor reaps them by their own pid; a reaped one's pid may come back as an orphan's)
  // and the spared.
  std::set<pid_t> keep() const {
    std::set<pid_t> out = spared;
    for (const auto& w : workers) {
      if (w.pid > 0 && w.running) {
        out.insert(w.pid);
      }
    }
    return out;
  }

  // Stops what the workers left running, and names in one line what their process groups did not
  // hold (a daemon, a `setsid cmd &`): the groups' members were sent SIGKILL with the groups, and
  // are only reaped here, as they die.
  void stop_leftovers() const {
    if (!adopting) {
      return;
    }
    std::set<pid_t> groups;
    for (const auto& w : workers) {
      groups.insert(w.pid);  // each worker leads its own group
    }
    std::vector<std::string> left;
    for (const ChildInfo& c : stop_children(keep(), grace)) {
      if (groups.count(c.group) == 0) {
        left.push_back(std::to_string(c.pid) + " (" + c.name + ")");
      }
    }
    if (left.empty()) {
      return;
    }
    std::string names;
    for (size_t i = 0; i < left.size() && i < 5; ++i) {
      names += (i == 0 ? "" : ", ") + left[i];
    }
    if (left.size() > 5) {
      names += " and " + std::to_string(left.size() - 5) + " more";
    }
    std::cerr << name << ": stopped " << left.size() << " process" << (left.size() == 1 ? "" : "es")
              << " that the workers left running: " << names << std::endl;
  }

  ~JobGuard() {
    bool any_running = false;
    for (auto& w : workers) {
      any_running = any_running || w.running;
    }
    if (any_running) {
      signal_groups(workers, SIGKILL);
      for (auto& w : workers) {
        if (w.running) {
          ::waitpid(w.pid, nullptr, 0);
          w.running = false;
        }
      }
    }
    stop_leftovers();  // none after a Supervisor's run, which stops them itself
    if (adopting) {
      set_child_subreaper(was_subreaper);
    }
    for (auto& w : workers) {
      for (auto& s : w.streams) {
        if (s.fd >= 0) {
          ::close(s.fd);
          s.fd = -1;
        }
        if (s.log_fd >= 0) {
          ::close(s.log_fd);
          s.log_fd = -1;
        }
      }
    }
    if (dev_null >= 0) {
      ::close(dev_null);
    }
    if (handlers_installed) {
      ::sigaction(SIGINT, &old_int, nullptr);
      ::sigaction(SIGTERM, &old_term, nullptr);
      ::sigaction(SIGCHLD, &old_chld, nullptr);
      ::close(g_signal_pipe[0]);
      ::close(g_signal_pipe[1]);
      g_signal_pipe[0] = g_signal_pipe[1] = -1;
    }
  }
};

// One launch at a time per process: the signal handlers and their pipe are process-wide.
std::atomic<bool> g_launch_active{false};

// The job-wide values every worker's environment shares.
struct JobPlan {
  int nproc = 1;
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;
  int64_t child_open_files = -1;  // ChildOptions::open_files_limit (OpenFilesLimit)
};

JobPlan plan_job(const LaunchOptions& o, int nproc, const Placement& where) {
  JobPlan plan;
  plan.nproc = nproc;
  plan.world_size = where.from_mpirun ? where.world_size : nproc * o.nnodes();
  plan.master_addr = o.master_addr().empty() ? "127.0.0.1" : o.master_addr();
  plan.master_port = o.master_port();
  if (o.standalone()) {
    plan.master_addr = "127.0.0.1";
    plan.master_port = pick_free_port();
  }
  if (!o.log_dir().empty()) {
    // Whole: an mpirun rank on another host gets the launch's folder, which may not exist there.
    std::error_code ec;
    std::filesystem::create_directories(o.log_dir(), ec);
    TORCH_CHECK(std::filesystem::is_directory(o.log_dir(), ec), "--log-dir '", o.log_dir(),
                "' is not a directory and cannot be created");
  }
  return plan;
}

// torchrun's environment contract for one worker, then the launcher's own settings.
Environment worker_environment(const LaunchOptions& o,
                               const JobPlan& plan,
                               const Placement& where,
                               int global_rank,
                               int local) {
  Environment env = o.env();
  const char* ompi_local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  const char* ompi_local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const bool shim = where.from_mpirun;
  const int local_rank = shim ? (ompi_local ? std::atoi(ompi_local) : 0) : local;
  const int local_world =
      shim ? (ompi_local_size ? std::atoi(ompi_local_size) : plan.world_size) : plan.nproc;
  env["RANK"] = std::to_string(global_rank);
  env["WORLD_SIZE"] = std::to_string(plan.world_size);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["LOCAL_WORLD_SIZE"] = std::to_string(local_world);
  env["GROUP_RANK"] = std::to_string(shim ? global_rank / std::max(1, local_world) : o.node_rank());
  // torchrun's roles: one role (--role, "default" unless given) of the whole job.
  env["ROLE_NAME"] = o.role();
  env["ROLE_RANK"] = env["RANK"];
  env["ROLE_WORLD_SIZE"] = env["WORLD_SIZE"];
  env["GROUP_WORLD_SIZE"] =
      std::to_string(shim ? std::max(1, plan.world_size / std::max(1, local_world)) : o.nnodes());
  env["TORCHELASTIC_RUN_ID"] = o.rdzv_id();
  // The workers meet in a store of their own, served by rank 0 at MASTER_ADDR:MASTER_PORT, not in
  // the launcher's: a PyTorch worker must serve it rather than look for the agent's.
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  env["MASTER_ADDR"] = plan.master_addr;
  env["MASTER_PORT"] = std::to_string(plan.master_port);
  if (!o.devices().empty()) {
    env["CUDA_VISIBLE_DEVICES"] = format_device_list(o.devices());
  }
  if (!o.backend().empty() && o.backend() != "auto") {
    env["PARATRAIN_BACKEND"] = o.backend();
  }
  // As torchrun: split the cores between local workers unless the user chose.
  if (std::getenv("OMP_NUM_THREADS") == nullptr && o.env().count("OMP_NUM_THREADS") == 0) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env["OMP_NUM_THREADS"] =
        std::to_string(std::max(1u, cores / static_cast<unsigned>(std::max(1, local_world))));
  }
  return env;
}

// Installs the handlers that forward SIGINT/SIGTERM and wake the loop on SIGCHLD; the JobGuard
// restores the previous ones.
void install_signal_handlers(JobGuard& job) {
  TORCH_CHECK(::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) == 0, "pipe: ", std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, &job.old_int);
  ::sigaction(SIGTERM, &sa, &job.old_term);
  ::sigaction(SIGCHLD, &sa, &job.old_chld);
  job.handlers_installed = true;
  // Workers run in their own process groups, i.e. in the background of a terminal: reading it
  // would stop them (SIGTTIN) for good. They read /dev/null instead, as under mpirun.
  job.dev_null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
}

// LaunchOptions::adopt_orphans: from here to the job's end, the processes the workers orphan are
// reparented to this one (PR_SET_CHILD_SUBREAPER) instead of to init, for the job to stop them.
void adopt_orphans(const LaunchOptions& o, JobGuard& job) {
  job.spared = current_children();
  job.was_subreaper = set_child_subreaper(true);
  job.adopting = true;
  job.grace = o.kill_grace();
  job.name = o.name();
}

// Starts one worker with its output on two pipes the loop relays.
void start_worker(const LaunchOptions& o,
                  const JobPlan& plan,
                  const JobGuard& job,
                  Worker& w,
                  const Environment& env) {
  // validate() found it; gone since, it must not fall back to a name relative to the directory.
  const std::string program = find_program(o.command()[0]);
  TORCH_CHECK(!program.empty(), "cannot start worker ", w.rank, ": ", o.command()[0],
              " is no longer an executable program");
  std::vector<std::string> argv = o.command();
  if (o.pass_local_rank()) {
    argv.push_back("--local_rank=" + env.at("LOCAL_RANK"));
  }
  ChildProcess child(ChildOptions(argv)
                         .program(program)
                         .environment(environment_with(env))
                         .inherit_environment(false)
                         .stdin_fd(job.dev_null)
                         .capture_stdout(true)
                         .capture_stderr(true)
                         .open_files_limit(plan.child_open_files));
  w.pid = child.pid();
  w.running = true;
  w.streams[0].fd = child.release_stdout();
  w.streams[0].out_fd = 1;
  w.streams[1].fd = child.release_stderr();
  w.streams[1].out_fd = 2;
}

// One folder per attempt and worker, as torchrun's: attempt_<k>/<local rank>/{stdout,stderr}.log.
// Never an existing file: each launch has a folder of its own (make_log_run_dir).
void open_logs(const std::string& run_dir, int attempt, int folder, Worker& w) {
  std::string dir = run_dir + "/attempt_" + std::to_string(attempt);
  for (const std::string& d : {dir, dir + "/" + std::to_string(folder)}) {
    TORCH_CHECK(::mkdir(d.c_str(), 0755) == 0 || errno == EEXIST, "cannot create ", d, ": ",
                std::strerror(errno));
  }
  dir += "/" + std::to_string(folder);
  const char* names[2] = {"/stdout.log", "/stderr.log"};
  for (int k = 0; k < 2; ++k) {
    const std::string path = dir + names[k];
    w.streams[k].log_fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    TORCH_CHECK(w.streams[k].log_fd >= 0, "cannot write ", path, ": ", std::strerror(errno));
  }
  w.log_path = dir + names[1];
}

}  // namespace

std::string make_log_run_dir(const LaunchOptions& o) {
  if (o.log_dir().empty()) {
    return "";
  }
  ::mkdir(o.log_dir().c_str(), 0755);
  struct stat st;
  TORCH_CHECK(::stat(o.log_dir().c_str(), &st) == 0 && S_ISDIR(st.st_mode), "--log-dir '",
              o.log_dir(), "' is not a directory and cannot be created");
  TORCH_CHECK(o.rdzv_id().find('/') == std::string::npos, "--rdzv-id '", o.rdzv_id(),
              "' names the log folder of the run: give one without '/'");
  std::string pattern = o.log_dir() + "/" + o.rdzv_id() + "_XXXXXX";
  TORCH_CHECK(::mkdtemp(&pattern[0]) != nullptr, "cannot create a folder in --log-dir '",
              o.log_dir(), "': ", std::strerror(errno));
  return pattern;
}

namespace {

void start_workers(const LaunchOptions& o,
                   const JobPlan& plan,
                   const Placement& where,
                   JobGuard& job) {
  job.workers.resize(static_cast<size_t>(plan.nproc));
  for (int local = 0; local < plan.nproc; ++local) {
    Worker& w = job.workers[static_cast<size_t>(local)];
    w.local_rank = where.from_mpirun ? -1 : local;
    w.rank = where.from_mpirun ? where.first_rank : o.node_rank() * plan.nproc + local;
    w.prefix = o.prefix_output() ? "[rank " + std::to_string(w.rank) + "]: " : "";
    const auto& console = o.console_streams();
    // A shim's one worker has the local rank mpirun gave it (worker_environment's LOCAL_RANK).
    const char* ompi_local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    auto shown = console.find(where.from_mpirun && ompi_local ? std::atoi(ompi_local) : local);
    if (shown == console.end()) {
      shown = console.find(-1);
    }
    const int streams = shown == console.end() ? 3 : shown->second;
    w.streams[0].to_console = (streams & 1) != 0;
    w.streams[1].to_console = (streams & 2) != 0;
    if (!o.log_dir().empty()) {
      open_logs(o.log_dir(), where.attempt, where.from_mpirun ? w.rank : local, w);
    }
    start_worker(o, plan, job, w, worker_environment(o, plan, where, w.rank, local));
  }
}

// Watches a started job: relays output, reaps workers, stops everyone on the first failure or on
// SIGINT/SIGTERM (SIGKILL after kill_grace), and drains the pipes at the end.
class Supervisor {
 public:
  /// `must_stop` (optional) is asked twice a second while the workers run; when it says so
  /// (with its reason), the workers are stopped as for a signal, and the result says why in
  /// stopped_for (the elastic launcher's new rendezvous round).
  Supervisor(const LaunchOptions& o,
             JobGuard& job,
             std::function<bool(std::string*)> must_stop = nullptr)
      : o_(o),
        job_(job),
        workers_(job.workers),
        running_(static_cast<int>(job.workers.size())),
        must_stop_(std::move(must_stop)) {}

  LaunchResult run() {
    for (;;) {
      reap();
      if (job_.adopting) {
        reap_exited_children(job_.keep());  // what the workers orphaned, as it ends
      }
      // Asked also while stopping: for the elastic launcher it is this node's heartbeat too.
      if (must_stop_ && running_ > 0 && Clock::now() >= next_stop_check_) {
        next_stop_check_ = Clock::now() + std::chrono::milliseconds(500);
        std::string why;
        if (must_stop_(&why) && !stopping_) {
          result_.stopped_for = why;
          begin_stop(SIGTERM);
        }
      }
      if (running_ == 0 && drain_deadline_ == Clock::time_point{}) {
        // Whatever the workers left behind goes now, in their process groups and (adopted) out of
        // them, which also closes the pipes it inherited; the pipes get a moment to drain.
        signal_groups(workers_, SIGKILL);
        job_.stop_leftovers();
        drain_deadline_ = Clock::now() + std::chrono::milliseconds(1000);
      }
      if (stopping_ && !killed_ && running_ > 0 && Clock::now() >= kill_deadline_) {
        signal_groups(workers_, SIGKILL);
        killed_ = true;
      }
      if (!relay()) {
        break;
      }
    }
    // A signal that came as the last worker ended was not read by relay(): it still counts
    // against a restart (it stops nothing now).
    unsigned char sig;
    while (::read(g_signal_pipe[0], &sig, 1) == 1) {
      if (sig == SIGINT || sig == SIGTERM) {
        result_.signal_received = sig;
      }
    }
    result_.summary = summary();
    return result_;
  }

 private:
  void begin_stop(int sig) {
    if (stopping_) {
      return;
    }
    stopping_ = true;
    kill_deadline_ = Clock::now() + o_.kill_grace();
    for (const auto& w : workers_) {
      stopped_running_ += w.running ? 1 : 0;
    }
    signal_groups(workers_, sig);
  }

  void reap() {
    for (size_t i = 0; i < workers_.size(); ++i) {
      Worker& w = workers_[i];
      int status = 0;
      if (!w.running || ::waitpid(w.pid, &status, WNOHANG) != w.pid) {
        continue;
      }
      w.running = false;
      w.status = status;
      --running_;
      if (failed(status) && !result_.first_failure && result_.interrupted_by == 0 && !stopping_) {
        WorkerFailure f;
        f.rank = w.rank;
        f.local_rank = w.local_rank;
        f.pid = w.pid;
        f.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
        f.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
        f.time = now_iso8601();
        f.log_file = w.log_path;
        result_.first_failure = f;
        result_.exit_code = exit_code_of(status);
        failed_index_ = i;
        begin_stop(SIGTERM);
      }
    }
  }

  // Polls the signal pipe and the workers' streams once (50 ms at most); false when the job is
  // over and its output relayed.
  bool relay() {
    std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
    std::vector<std::pair<Worker*, Stream*>> owners{{nullptr, nullptr}};
    for (auto& w : workers_) {
      for (auto& s : w.streams) {
        if (s.fd >= 0) {
          fds.push_back({s.fd, POLLIN, 0});
          owners.push_back({&w, &s});
        }
      }
    }
    if (running_ == 0 && (fds.size() == 1 || Clock::now() >= drain_deadline_)) {
      return false;
    }
    if (::poll(fds.data(), fds.size(), 50) <= 0) {
      return true;  // timeout, EINTR, or a transient error: the loop re-polls
    }
    if (fds[0].revents != 0) {
      on_signals();
    }
    for (size_t k = 1; k < fds.size(); ++k) {
      if (fds[k].revents != 0) {
        owners[k].first->pump(*owners[k].second);
      }
    }
    return true;
  }

  void on_signals() {
    unsigned char sig;
    while (::read(g_signal_pipe[0], &sig, 1) == 1) {
      if (sig == SIGINT || sig == SIGTERM) {
        result_.signal_received = sig;
      }
      if ((sig == SIGINT || sig == SIGTERM) && result_.interrupted_by == 0 &&
          !result_.first_failure) {
        result_.interrupted_by = sig;
        result_.exit_code = 128 + sig;
        begin_stop(sig);
      }
    }
  }

  std::string summary() const {
    if (result_.first_failure) {
      const WorkerFailure& f = *result_.first_failure;
      std::ostringstream s;
      s << o_.name() << ": job failed: rank " << f.rank;
      if (f.local_rank >= 0) {
        s << " (local rank " << f.local_rank << ", pid " << f.pid << ")";
      }
      s << " " << describe_exit(workers_[failed_index_].status) << " at " << f.time << "; log: "
        << (f.log_file.empty() ? "its lines above (use --log-dir for files)" : f.log_file);
      if (stopped_running_ > 0) {
        s << "; stopped the other " << stopped_running_ << " running worker"
          << (stopped_running_ == 1 ? "" : "s");
      }
      return s.str();
    }
    if (result_.interrupted_by != 0) {
      return o_.name() + ": interrupted by " + strsignal(result_.interrupted_by) + "; stopped " +
             std::to_string(stopped_running_) + " running worker" +
             (stopped_running_ == 1 ? "" : "s");
    }
    return "";
  }

  const LaunchOptions& o_;
  const JobGuard& job_;
  std::vector<Worker>& workers_;
  LaunchResult result_;
  int running_;
  bool stopping_ = false;
  bool killed_ = false;
  int stopped_running_ = 0;  // workers still running when the job was stopped
  size_t failed_index_ = 0;
  Clock::time_point kill_deadline_{};
  Clock::time_point drain_deadline_{};
  std::function<bool(std::string*)> must_stop_;
  Clock::time_point next_stop_check_{};
};

}  // namespace

LaunchResult run_job(const LaunchOptions& o,
                     const Placement& where,
                     std::function<bool(std::string*)> must_stop) {
  validate(o);
  const int nproc = resolved_nproc(o);
  TORCH_CHECK(o.devices().empty() || static_cast<int>(o.devices().size()) >= nproc,
              "--nproc-per-node ", nproc, " needs as many devices, but --devices lists only ",
              o.devices().size());
  if (launch_internal::runs_on_mpi(o.backend()) && !where.from_mpirun) {
    return launch_mpirun(o, nproc);
  }
  TORCH_CHECK(!g_launch_active.exchange(true), "another launch is already running in this process");
  struct ActiveReset {
    ~ActiveReset() { g_launch_active = false; }
  } active_reset;
  // Outlives the job's descriptors (JobGuard closes them).
  const OpenFilesLimit open_files(o, nproc);
  JobPlan plan = plan_job(o, nproc, where);
  plan.child_open_files = open_files.for_children();
  JobGuard job;
  install_signal_handlers(job);
  if (o.adopt_orphans()) {
    adopt_orphans(o, job);
  }
  start_workers(o, plan, where, job);
  return Supervisor(o, job, std::move(must_stop)).run();
}

}  // namespace launch_internal
}  // namespace dist
}  // namespace paratrain
