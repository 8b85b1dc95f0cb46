#include "trial_process.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

extern char** environ;

namespace paratrain {
namespace tune {
namespace detail {

Process start_process(const ProcessSpec& spec) {
  // Everything the child needs is built before fork: after it, only async-signal-safe calls.
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq) {
      env[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
    }
  }
  for (const auto& [k, v] : spec.env) {
    env[k] = v;
  }
  std::vector<std::string> env_words;
  for (const auto& [k, v] : env) {
    env_words.push_back(k + "=" + v);
  }
  std::vector<char*> envp, argv;
  for (auto& w : env_words) {
    envp.push_back(w.data());
  }
  envp.push_back(nullptr);
  std::vector<std::string> args = spec.argv;
  for (auto& a : args) {
    argv.push_back(a.data());
  }
  argv.push_back(nullptr);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  for (int c : spec.cores) {
    CPU_SET(c, &cpus);
  }

  Process p;
  p.log_fd = ::open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  TORCH_CHECK(p.log_fd >= 0, "tune: cannot open trial log ", spec.log_path, ": ",
              std::strerror(errno));
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    const int err = errno;
    ::close(p.log_fd);
    TORCH_CHECK(false, "tune: pipe failed: ", std::strerror(err));
  }
  // Signals stay blocked until the child has dropped the tuner's handlers, so a SIGINT in
  // between cannot run the tuner's handler in the child.
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &block, &old);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::signal(SIGPIPE, SIG_DFL);  // a tuner inside a rank has it ignored (init_process_group)
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) {
      ::_exit(127);  // the tuner died before prctl: nobody would stop this trial
    }
    ::dup2(fds[1], 1);
    ::dup2(p.log_fd, 2);
    if (!spec.cores.empty()) {
      ::sched_setaffinity(0, sizeof(cpus), &cpus);  // best effort: a narrower cpuset still runs
    }
    ::execve(spec.program.c_str(), argv.data(), envp.data());
    const char msg[] = "tune: exec failed for the trial's program\n";
    ssize_t ignored = ::write(2, msg, sizeof(msg) - 1);
    (void)ignored;
    ::_exit(127);
  }
  const int err = errno;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    ::close(p.log_fd);
    TORCH_CHECK(false, "tune: fork failed: ", std::strerror(err));
  }
  ::setpgid(pid, pid);  // also here, so killpg works before the child runs
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  p.pid = pid;
  p.out_fd = fds[0];
  return p;
}

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
