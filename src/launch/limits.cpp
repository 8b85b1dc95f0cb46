// What a job needs of this process, this user, its cgroup and the system, checked before anything
// starts: a job beyond them would fork for a long while, then fail on the first pipe or fork
// refused, and stop everything it started. And the open-files limit the launcher raises for itself.

#include "launch_internal.h"

#include <c10/util/Exception.h>

#include <dirent.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace paratrain {
namespace dist {
namespace launch_internal {
namespace {

// Descriptors this process holds now (/proc/self/fd, less the one that lists it).
int64_t open_descriptors() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) {
    return 3;
  }
  int64_t n = 0;
  while (const dirent* e = ::readdir(dir)) {
    n += e->d_name[0] != '.' ? 1 : 0;
  }
  ::closedir(dir);
  return n > 0 ? n - 1 : 0;
}

// The number in a file of one (a sysctl, a cgroup's pids.max); -1 when it is missing or holds
// something else ("max").
int64_t read_number(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word.size() > 18 ||
      word.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return std::stoll(word);
}

// Descriptors the launcher holds for a job of `nproc` workers: what is open now; the read ends of
// the two pipes of each worker it relays (and its log file with --log-dir; through mpirun, it
// relays mpirun alone); the signal pipe and /dev/null; the write ends of a starting worker's
// pipes; and room for what it opens while the job runs (/proc, the rendezvous' connections).
int64_t descriptors_needed(const LaunchOptions& o, int nproc) {
  const int64_t relayed = launch_internal::runs_on_mpi(o.backend()) ? 1 : nproc;
  return open_descriptors() + relayed * (o.log_dir().empty() ? 2 : 4) + 3 + 2 + 16;
}

// The hard limit: OpenFilesLimit raises the soft one up to it.
void check_open_files(const LaunchOptions& o, int nproc) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_max == RLIM_INFINITY) {
    return;
  }
  const int64_t need = descriptors_needed(o, nproc);
  const int64_t limit = static_cast<int64_t>(lim.rlim_max);
  TORCH_CHECK(need <= limit, "--nproc-per-node ", nproc, " needs about ", need,
              " open files in the launcher (2 per worker, 4 with --log-dir), but its limit is ",
              limit, " (ulimit -Hn): raise it (ulimit -n ", need,
              " as root, or nofile in /etc/security/limits.conf) or start fewer workers");
}

// Tasks on this system now (threads, which the process limits count): the total of
// /proc/loadavg's "running/total".
int64_t tasks_on_system() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen, tasks;
  if (!(in >> one >> five >> fifteen >> tasks) || tasks.find('/') == std::string::npos) {
    return 0;
  }
  return std::atoll(tasks.c_str() + tasks.find('/') + 1);
}

// This user's tasks now, threads included, as RLIMIT_NPROC counts them; a process's user read
// from the owner of /proc/PID (its effective user: the real one but for set-user-ID programs).
int64_t tasks_of_this_user() {
  const uid_t uid = ::getuid();
  int64_t n = 0;
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) {
    return 0;
  }
  while (const dirent* e = ::readdir(dir)) {
    const std::string proc = std::string("/proc/") + e->d_name;
    struct stat st {};
    if (e->d_name[0] < '1' || e->d_name[0] > '9' || ::stat(proc.c_str(), &st) != 0 ||
        st.st_uid != uid) {
      continue;
    }
    // Field 20 is num_threads; NAME (field 2) ends at the last ')'.
    std::ifstream in(proc + "/stat");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::istringstream fields(
        text.substr(text.rfind(')') == std::string::npos ? text.size() : text.rfind(')') + 1));
    std::string skipped;
    for (int field = 3; field < 20 && (fields >> skipped); ++field) {
    }
    int64_t threads = 0;
    n += ((fields >> threads) && threads > 0) ? threads : 1;
  }
  ::closedir(dir);
  return n;
}

// RLIMIT_NPROC binds neither root nor a process with CAP_SYS_ADMIN or CAP_SYS_RESOURCE (fork(2)).
bool bound_by_process_limit() {
  if (::getuid() == 0) {
    return false;
  }
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("CapEff:", 0) == 0) {
      const unsigned long long caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return (caps & ((1ULL << 21) | (1ULL << 24))) == 0;
    }
  }
  return true;
}

void check_user_processes(int nproc, int64_t more) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NPROC, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY ||
      !bound_by_process_limit()) {
    return;
  }
  const int64_t limit = static_cast<int64_t>(lim.rlim_cur);
  // This user's tasks are some of the system's: walking /proc for them only matters near it.
  if (tasks_on_system() + more <= limit) {
    return;
  }
  const int64_t mine = tasks_of_this_user();
  TORCH_CHECK(mine + more <= limit, "--nproc-per-node ", nproc, " needs ", more,
              " more processes, but this user may run ", limit, " (ulimit -u) and runs ", mine,
              " already, threads included: raise it (ulimit -u ", mine + more,
              ", or nproc in /etc/security/limits.conf) or start fewer workers");
}

// The least room under the pids controller from this process's cgroup up (v2, or v1's pids
// hierarchy), and the cgroup whose pids.max leaves it; room -1 when none sets one.
struct PidsRoom {
  int64_t room = -1;
  int64_t max = 0;
  std::string cgroup;
};

PidsRoom cgroup_pids_room() {
  PidsRoom out;
  std::ifstream in("/proc/self/cgroup");
  for (std::string line; std::getline(in, line);) {
    // "0::/PATH" (v2), "N:pids:/PATH" (v1, or "N:a,pids:/PATH" mounted with others)
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) {
      continue;
    }
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
    const std::string mount = controllers == ",," ? "/sys/fs/cgroup"
                              : controllers.find(",pids,") != std::string::npos
                                  ? "/sys/fs/cgroup/pids"
                                  : "";
    for (std::string path = line.substr(b + 1); !mount.empty();) {
      const int64_t max = read_number(mount + path + "/pids.max");
      const int64_t current = read_number(mount + path + "/pids.current");
      if (max >= 0 && current >= 0 && (out.room < 0 || max - current < out.room)) {
        out = PidsRoom{max - current, max, mount + path};
      }
      const size_t slash = path.rfind('/');
      if (path.size() <= 1 || slash == std::string::npos) {
        break;
      }
      path.resize(slash);
    }
  }
  return out;
}

void check_cgroup_processes(int nproc, int64_t more) {
  const PidsRoom r = cgroup_pids_room();
  TORCH_CHECK(r.room < 0 || more <= r.room, "--nproc-per-node ", nproc, " needs ", more,
              " more processes, but the cgroup ", r.cgroup, " has room for ", r.room, " (pids.max ",
              r.max,
              "): raise its pids.max (TasksMax= of a systemd unit, --pids-limit of a container) "
              "or start fewer workers");
}

void check_system_processes(int nproc, int64_t more) {
  const int64_t pid_max = read_number("/proc/sys/kernel/pid_max");
  const int64_t threads_max = read_number("/proc/sys/kernel/threads-max");
  int64_t limit = -1;
  for (int64_t v : {pid_max, threads_max}) {
    limit = v > 0 && (limit < 0 || v < limit) ? v : limit;
  }
  const int64_t tasks = tasks_on_system();
  TORCH_CHECK(limit < 0 || tasks + more <= limit, "--nproc-per-node ", nproc, " needs ", more,
              " more processes, but this system has room for ", limit, " (kernel.pid_max ", pid_max,
              ", kernel.threads-max ", threads_max, ") and runs ", tasks,
              " already: start fewer workers, or raise those limits (sysctl)");
}

}  // namespace

void check_limits(const LaunchOptions& o) {
  const int nproc = resolved_nproc(o);
  // Through mpirun: mpirun, and a shim and a worker per rank.
  const int64_t more = launch_internal::runs_on_mpi(o.backend()) ? 2 * int64_t{nproc} + 1 : nproc;
  check_open_files(o, nproc);
  check_user_processes(nproc, more);
  check_cgroup_processes(nproc, more);
  check_system_processes(nproc, more);
}

// Raising the soft limit up to the hard one is what a process that needs more descriptors is
// meant to do: the soft limit stays low (often 1024) for programs that use select(), which cannot
// watch a descriptor from 1024 on (systemd's advice; Go's runtime raises its own the same way).
// A user asking for many workers expects the launcher to hold their pipes, not to fail on the
// default soft limit, as the workers expect the limit they would have had: they get that one.
OpenFilesLimit::OpenFilesLimit(const LaunchOptions& o, int nproc) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= lim.rlim_max ||
      static_cast<rlim_t>(descriptors_needed(o, nproc)) <= lim.rlim_cur) {
    return;
  }
  const rlimit raised{lim.rlim_max, lim.rlim_max};
  if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) {
    before_ = static_cast<int64_t>(lim.rlim_cur);
  }
}

OpenFilesLimit::~OpenFilesLimit() {
  rlimit lim{};
  if (before_ >= 0 && ::getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    lim.rlim_cur = static_cast<rlim_t>(before_);
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
}

}  // namespace launch_internal
}  // namespace dist
}  // namespace paratrain
