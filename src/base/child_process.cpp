#include "paratrain/base/child_process.h"

#include <c10/util/Exception.h>

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace paratrain {

namespace {

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (auto& s : strings) {
    out.push_back(&s[0]);
  }
  out.push_back(nullptr);
  return out;
}

// Everything the child needs, prepared before fork: after it, only async-signal-safe calls.
struct ExecPlan {
  std::string program;
  std::vector<std::string> argv_strings;
  std::vector<std::string> env_strings;
  std::vector<char*> argv;
  std::vector<char*> envp;  // empty: inherit
  cpu_set_t cores;
  bool pin = false;
  bool limit_open_files = false;
  rlimit open_files{};
  pid_t parent = 0;
  int in = -1, out = -1, err = -1;
};

void close_all(std::initializer_list<int> fds) {
  for (int fd : fds) {
    if (fd >= 0) {
      ::close(fd);
    }
  }
}

void write_error(const char* text) {
  const ssize_t ignored = ::write(2, text, std::strlen(text));
  (void)ignored;
}

// errno as digits, by hand: strerror may take a lock or allocate (gettext), which a forked child
// of a threaded parent must not.
void write_errno(int error) {
  char digits[16];
  int n = 0;
  do {
    digits[n++] = static_cast<char>('0' + error % 10);
    error /= 10;
  } while (error > 0 && n < 15);
  char text[24] = "errno ";
  int at = 6;
  while (n > 0) {
    text[at++] = digits[--n];
  }
  text[at] = '\0';
  write_error(text);
}

// Ends the child with one line when a redirection failed: running with the parent's streams
// instead would send its output where nobody reads it.
[[noreturn]] void redirect_failed() {
  const int error = errno;
  write_error("paratrain: cannot redirect the child's standard streams (");
  write_errno(error);
  write_error(")\n");
  ::_exit(127);
}

// Makes `from` the child's descriptor `to`. A source that already is `to` only loses
// close-on-exec (dup2 onto itself would keep it).
void redirect(int from, int to) {
  if (from == to) {
    if (::fcntl(to, F_SETFD, 0) != 0) {
      redirect_failed();
    }
  } else if (from >= 0 && ::dup2(from, to) != to) {
    redirect_failed();
  }
}

// The child's side of fork.
[[noreturn]] void exec_child(const ChildOptions& o, ExecPlan& plan) {
  if (o.own_process_group()) {
    ::setpgid(0, 0);
  }
  if (o.die_with_parent()) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != plan.parent) {
      ::_exit(127);  // the parent died before prctl: nobody would stop this child
    }
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int s : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE}) {
    ::sigaction(s, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  // A source among 0-2 that is not its own target moves above 2 first, so that no dup2 below
  // overwrites another's source (a parent started with a standard descriptor closed).
  int* sources[3] = {&plan.in, &plan.out, &plan.err};
  for (int target = 0; target < 3; ++target) {
    int& from = *sources[target];
    if (from >= 0 && from <= 2 && from != target) {
      from = ::fcntl(from, F_DUPFD_CLOEXEC, 3);
      if (from < 0) {
        redirect_failed();
      }
    }
  }
  redirect(plan.in, 0);
  redirect(plan.out, 1);
  redirect(plan.err, 2);
  if (plan.pin) {
    ::sched_setaffinity(0, sizeof(plan.cores), &plan.cores);  // best effort
  }
  // After the redirections: a lower limit must not refuse their descriptors.
  if (plan.limit_open_files) {
    ::setrlimit(RLIMIT_NOFILE, &plan.open_files);  // best effort
  }
  char** envp = plan.envp.empty() ? environ : plan.envp.data();
  ::execve(plan.program.c_str(), plan.argv.data(), envp);
  const int error = errno;
  write_error("paratrain: cannot execute ");
  write_error(plan.program.c_str());
  write_error(" (");
  write_errno(error);
  write_error(")\n");
  ::_exit(127);
}

ExecPlan make_plan(const ChildOptions& o) {
  TORCH_CHECK(!o.argv().empty(), "ChildProcess: no program to run (argv is empty)");
  ExecPlan plan;
  plan.program = o.program().empty() ? o.argv()[0] : o.program();
  TORCH_CHECK(!plan.program.empty(), "ChildProcess: the program to run is empty");
  plan.argv_strings = o.argv();
  plan.argv = c_strings(plan.argv_strings);
  if (!o.inherit_environment()) {
    plan.env_strings = o.environment();
    plan.envp = c_strings(plan.env_strings);
  }
  CPU_ZERO(&plan.cores);
  for (int c : o.cores()) {
    CPU_SET(c, &plan.cores);
    plan.pin = true;
  }
  if (o.open_files_limit() >= 0 && ::getrlimit(RLIMIT_NOFILE, &plan.open_files) == 0) {
    plan.open_files.rlim_cur =
        std::min(static_cast<rlim_t>(o.open_files_limit()), plan.open_files.rlim_max);
    plan.limit_open_files = true;
  }
  plan.parent = ::getpid();
  plan.in = o.stdin_fd();
  plan.out = o.stdout_fd();
  plan.err = o.stderr_fd();
  return plan;
}

// A close-on-exec pipe whose read end does not block; throws naming the program.
void make_pipe(int fds[2], const std::string& program) {
  TORCH_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "cannot start ", program,
              ": pipe failed: ", std::strerror(errno));
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
}

}  // namespace

ChildProcess::ChildProcess(const ChildOptions& o) : own_group_(o.own_process_group()) {
  ExecPlan plan = make_plan(o);
  const std::string program = o.program().empty() ? o.argv()[0] : o.program();
  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  if (o.capture_stdout() || o.capture_output()) {
    make_pipe(out_pipe, program);
    plan.out = out_pipe[1];
    if (o.capture_output()) {
      plan.err = out_pipe[1];
    }
  }
  if (o.capture_stderr() && !o.capture_output()) {
    try {
      make_pipe(err_pipe, program);
    } catch (...) {
      close_all({out_pipe[0], out_pipe[1]});
      throw;
    }
    plan.err = err_pipe[1];
  }
  // Blocked from fork until the child has reset the handlers (see the header).
  sigset_t all, before;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &before);
  const pid_t pid = ::fork();
  if (pid == 0) {
    exec_child(o, plan);
  }
  const int fork_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  close_all({out_pipe[1], err_pipe[1]});
  if (pid < 0) {
    close_all({out_pipe[0], err_pipe[0]});
    TORCH_CHECK(false, "cannot start ", program, ": fork failed: ", std::strerror(fork_errno));
  }
  if (own_group_) {
    ::setpgid(pid, pid);  // also from here, so signal() reaches the group before the child runs
  }
  pid_ = pid;
  stdout_fd_ = out_pipe[0];
  stderr_fd_ = err_pipe[0];
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(other.pid_),
      own_group_(other.own_group_),
      reaped_(other.reaped_),
      status_(other.status_),
      stdout_fd_(other.stdout_fd_),
      stderr_fd_(other.stderr_fd_) {
  other.pid_ = -1;
  other.stdout_fd_ = other.stderr_fd_ = -1;
}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    close_pipes();
    pid_ = other.pid_;
    own_group_ = other.own_group_;
    reaped_ = other.reaped_;
    status_ = other.status_;
    stdout_fd_ = other.stdout_fd_;
    stderr_fd_ = other.stderr_fd_;
    other.pid_ = -1;
    other.stdout_fd_ = other.stderr_fd_ = -1;
  }
  return *this;
}

ChildProcess::~ChildProcess() {
  close_pipes();
}

void ChildProcess::close_pipes() {
  close_all({stdout_fd_, stderr_fd_});
  stdout_fd_ = stderr_fd_ = -1;
}

int ChildProcess::release_stdout() {
  const int fd = stdout_fd_;
  stdout_fd_ = -1;
  return fd;
}

int ChildProcess::release_stderr() {
  const int fd = stderr_fd_;
  stderr_fd_ = -1;
  return fd;
}

void ChildProcess::signal(int signal) const {
  if (pid_ > 0 && !reaped_) {  // once reaped, the pid may be another process's
    ::kill(own_group_ ? -pid_ : pid_, signal);
  }
}

int ChildProcess::wait() {
  TORCH_CHECK(pid_ > 0, "ChildProcess::wait: no child (moved from)");
  if (!reaped_) {
    int status = 0;
    pid_t r;
    while ((r = ::waitpid(pid_, &status, 0)) < 0 && errno == EINTR) {
    }
    TORCH_CHECK(r == pid_, "waitpid of ", pid_, " failed: ", std::strerror(errno));
    status_ = status;
    reaped_ = true;
  }
  return status_;
}

bool ChildProcess::try_wait(int* status) {
  TORCH_CHECK(pid_ > 0, "ChildProcess::try_wait: no child (moved from)");
  if (!reaped_) {
    const pid_t r = ::waitpid(pid_, &status_, WNOHANG);
    TORCH_CHECK(r >= 0 || errno == EINTR, "waitpid of ", pid_, " failed: ", std::strerror(errno));
    reaped_ = r == pid_;
  }
  if (reaped_ && status != nullptr) {
    *status = status_;
  }
  return reaped_;
}

std::string ChildProcess::read_all() {
  std::string text;
  char buf[4096];
  while (stdout_fd_ >= 0) {
    const ssize_t n = ::read(stdout_fd_, buf, sizeof(buf));
    if (n > 0) {
      text.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      break;
    } else if (errno == EAGAIN) {
      pollfd pfd{stdout_fd_, POLLIN, 0};
      ::poll(&pfd, 1, -1);
    }
  }
  return text;
}

std::vector<std::string> environment_with(const std::map<std::string, std::string>& overrides,
                                          const std::vector<std::string>& unset) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq != nullptr) {
      env[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
    }
  }
  for (const auto& name : unset) {
    env.erase(name);
  }
  for (const auto& kv : overrides) {
    env[kv.first] = kv.second;
  }
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& kv : env) {
    out.push_back(kv.first + "=" + kv.second);
  }
  return out;
}

int exit_code(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

namespace {

// What /proc/PID/stat says of a process: "PID (NAME) STATE PPID PGRP ...".
struct ProcessStat {
  pid_t pid = 0;
  char state = 0;  // 'Z': exited, not yet reaped
  pid_t parent = 0;
  pid_t group = 0;
  std::string name;
};

bool read_process_stat(pid_t pid, ProcessStat* st) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return false;
  }
  char text[512];  // the fields read here come first, and NAME has at most 15 characters
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) {
    return false;
  }
  text[n] = '\0';
  // NAME may hold spaces and parentheses: it ends at the last ')'.
  const char* name_start = std::strchr(text, '(');
  const char* name_end = std::strrchr(text, ')');
  int parent = 0;
  int group = 0;
  if (name_start == nullptr || name_end == nullptr || name_end < name_start ||
      std::sscanf(name_end + 1, " %c %d %d", &st->state, &parent, &group) != 3) {
    return false;
  }
  st->pid = pid;
  st->parent = parent;
  st->group = group;
  st->name.assign(name_start + 1, name_end);
  return true;
}

// This process's children, from a walk of /proc (Linux keeps no list of them elsewhere that
// every kernel shows: /proc/PID/task/TID/children needs CONFIG_PROC_CHILDREN).
std::vector<ProcessStat> children_of_this_process() {
  std::vector<ProcessStat> out;
  const pid_t self = ::getpid();
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) {
    return out;
  }
  while (const dirent* e = ::readdir(dir)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    ProcessStat st;
    if (pid > 0 && *end == '\0' && read_process_stat(static_cast<pid_t>(pid), &st) &&
        st.parent == self) {
      out.push_back(st);
    }
  }
  ::closedir(dir);
  return out;
}

}  // namespace

bool set_child_subreaper(bool on) {
  int was = 0;
  ::prctl(PR_GET_CHILD_SUBREAPER, &was);
  ::prctl(PR_SET_CHILD_SUBREAPER, on ? 1UL : 0UL);
  return was != 0;
}

std::set<pid_t> current_children() {
  std::set<pid_t> out;
  for (const ProcessStat& c : children_of_this_process()) {
    out.insert(c.pid);
  }
  return out;
}

void reap_exited_children(const std::set<pid_t>& keep) {
  for (;;) {
    // WNOWAIT: look first, so that a child in `keep` stays waitable for its owner's waitpid.
    siginfo_t info{};
    if (::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0 ||
        keep.count(info.si_pid) != 0) {
      return;
    }
    ::waitpid(info.si_pid, nullptr, WNOHANG);
  }
}

std::vector<ChildInfo> stop_children(const std::set<pid_t>& keep, std::chrono::milliseconds grace) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point kill_at = Clock::now() + grace;
  const Clock::time_point give_up = kill_at + std::chrono::seconds(5);
  std::map<pid_t, int> sent;  // the last signal each child got
  std::vector<ChildInfo> stopped;
  for (;;) {
    const int sig = Clock::now() < kill_at ? SIGTERM : SIGKILL;
    bool running = false;
    // A child cannot be another process until it is reaped, here: its pid (and its group's id,
    // while it leads the group) is safe to signal.
    for (const ProcessStat& c : children_of_this_process()) {
      if (keep.count(c.pid) != 0) {
        continue;
      }
      if (c.state == 'Z') {
        ::waitpid(c.pid, nullptr, WNOHANG);
        continue;
      }
      running = true;
      auto it = sent.find(c.pid);
      if (it == sent.end()) {
        stopped.push_back(ChildInfo{c.pid, c.group, c.name});
      }
      if (it == sent.end() || it->second != sig) {
        ::kill(c.pid, sig);
        if (c.group == c.pid) {
          ::killpg(c.pid, sig);
        }
        sent[c.pid] = sig;
      }
    }
    if (!running || Clock::now() >= give_up) {
      return stopped;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace paratrain
