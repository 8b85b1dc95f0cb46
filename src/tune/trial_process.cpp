#include "trial_process.h"

#include "paratrain/base/child_process.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <map>
#include <random>
#include <string>

namespace paratrain {
namespace tune {
namespace detail {

namespace {

// A fresh FIFO each start (its path is this start's alone): bytes written for an earlier process
// of the trial must not let this one run ahead. Made with a nonce added to the path when the
// name is taken (never replacing another tuner's). Where the trial directory takes no FIFO (some
// network and FUSE file systems), the trial runs without waiting, as before, said once.
bool make_sync_fifo(const std::string& base, Process& p) {
  std::string path = base;
  int err = 0;
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (::mkfifo(path.c_str(), 0600) == 0) {
      p.sync_fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
      if (p.sync_fd >= 0) {
        p.sync_path = path;
        return true;
      }
      err = errno;
      ::unlink(path.c_str());  // ours: just made
      break;
    }
    err = errno;
    if (err != EEXIST) {
      break;
    }
    path = base + "." + std::to_string(std::random_device{}());
  }
  static bool said = false;
  if (!said) {
    std::cerr << "paratrain tune: warning: cannot make the FIFO " << path << " ("
              << std::strerror(err)
              << "): train trials go on after each epoch without waiting for the scheduler's "
                 "decision, so a paused trial may resume past the epoch it reported"
              << std::endl;
    said = true;
  }
  return false;
}

// Removes the FIFO only while its path still names the one this process made.
void close_sync_fifo(Process& p) {
  if (p.sync_fd >= 0) {
    struct stat mine {
    }, named{};
    if (::fstat(p.sync_fd, &mine) == 0 && ::stat(p.sync_path.c_str(), &named) == 0 &&
        mine.st_dev == named.st_dev && mine.st_ino == named.st_ino) {
      ::unlink(p.sync_path.c_str());
    }
    ::close(p.sync_fd);
    p.sync_fd = -1;
  }
}

}  // namespace

void answer_row(const Process& p) {
  if (p.sync_fd >= 0) {
    const char go = '\n';
    ssize_t ignored = ::write(p.sync_fd, &go, 1);  // never full: the trial reads each byte
    (void)ignored;
  }
}

void close_process_fds(Process& p) {
  for (int* fd : {&p.out_fd, &p.log_fd}) {
    if (*fd >= 0) {
      ::close(*fd);
      *fd = -1;
    }
  }
  close_sync_fifo(p);
}

Process start_process(const ProcessSpec& spec) {
  Process p;
  // Not inherited from the tuner's own environment: only a trial with a FIFO waits.
  std::map<std::string, std::string> env = spec.env;
  if (!spec.sync_path.empty() && make_sync_fifo(spec.sync_path, p)) {
    env["PARATRAIN_TRIAL_SYNC"] = p.sync_path;  // with its nonce, when it got one
  }
  p.log_fd = ::open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (p.log_fd < 0) {
    const int err = errno;
    close_sync_fifo(p);
    TORCH_CHECK(false, "tune: cannot open trial log ", spec.log_path, ": ", std::strerror(err));
  }
  // In its own process group, a trial that read the terminal would stop for good (SIGTTIN): it
  // reads /dev/null, as the launcher's workers do.
  const int dev_null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  try {
    ChildProcess child(ChildOptions(spec.argv)
                           .program(spec.program)
                           .environment(environment_with(env, {"PARATRAIN_TRIAL_SYNC"}))
                           .inherit_environment(false)
                           .stdin_fd(dev_null)
                           .stderr_fd(p.log_fd)
                           .capture_stdout(true)
                           .cores(spec.cores));
    p.pid = child.pid();
    p.out_fd = child.release_stdout();
  } catch (...) {
    ::close(p.log_fd);
    close_sync_fifo(p);
    if (dev_null >= 0) {
      ::close(dev_null);
    }
    throw;
  }
  if (dev_null >= 0) {
    ::close(dev_null);
  }
  return p;
}

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
