#include "paratrain/dist/launch.h"

#include "backend_routes.h"
#include "rendezvous.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <set>
#include <sstream>
#include <thread>

extern char** environ;

namespace paratrain {
namespace dist {

std::vector<int> parse_device_list(const std::string& text) {
  TORCH_CHECK(!text.empty(), "--devices is empty: give GPU indices such as 0,1,3");
  std::vector<int> devices;
  std::set<int> seen;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    TORCH_CHECK(!item.empty() && item.find_first_not_of("0123456789") == std::string::npos &&
                    item.size() < 6,
                "--devices '", text, "': '", item,
                "' is not a GPU index; give non-negative integers such as 0,1,3");
    int d = std::stoi(item);
    TORCH_CHECK(seen.insert(d).second, "--devices '", text, "' lists GPU ", d,
                " twice; each device can serve one worker");
    devices.push_back(d);
  }
  TORCH_CHECK(text.back() != ',', "--devices '", text, "' ends with a comma");
  return devices;
}

std::vector<HostfileEntry> read_hostfile(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "cannot read --hostfile ", path, ": ", strerror(errno));
  std::vector<HostfileEntry> out;
  std::set<std::string> seen;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    HostfileEntry e;
    e.line = number;
    if (!(words >> e.host)) {
      continue;
    }
    std::string word;
    while (words >> word) {
      if (word.rfind("slots=", 0) == 0) {
        const std::string n = word.substr(6);
        TORCH_CHECK(!n.empty() && n.size() < 6 &&
                        n.find_first_not_of("0123456789") == std::string::npos && std::stoi(n) > 0,
                    "--hostfile ", path, " line ", number, ": '", word,
                    "' is not a slot count; write slots=N with N >= 1");
        e.slots = std::stoi(n);
      }
    }
    TORCH_CHECK(seen.insert(e.host).second, "--hostfile ", path, " line ", number, ": host '",
                e.host, "' is listed twice; give it one line with its slots");
    out.push_back(e);
  }
  TORCH_CHECK(!out.empty(), "--hostfile ", path, " lists no host");
  return out;
}

std::string format_device_list(const std::vector<int>& devices) {
  std::string list;
  for (int d : devices) {
    list += (list.empty() ? "" : ",") + std::to_string(d);
  }
  return list;
}

// An executable regular file (access(X_OK) alone also accepts directories).
static bool runnable(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

std::string find_program(const std::string& name) {
  if (name.empty()) {
    return "";
  }
  if (name.find('/') != std::string::npos) {
    return runnable(name) ? name : "";
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (runnable(candidate)) {
      return candidate;
    }
  }
  return "";
}

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "cannot open a socket to find a free port: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  TORCH_CHECK(ok, "cannot find a free port on 127.0.0.1: ", std::strerror(errno));
  return ntohs(addr.sin_port);
}

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
  int fd = -1;     // read end, -1 once closed
  int out_fd = 1;  // where lines go (1 or 2)
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
  std::string log_path;
  int log_fd = -1;  // O_CLOEXEC: later workers must not inherit the logs of earlier ones

  void emit(Stream& s, const std::string& line) {
    std::string text = prefix + line + "\n";
    write_all(s.out_fd, text);  // one write per line: lines from different workers never mix
    if (log_fd >= 0) {
      write_all(log_fd, line + "\n");
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

std::vector<std::string> build_environment(const std::map<std::string, std::string>& overrides) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) {
      env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
  }
  for (const auto& kv : overrides) {
    env[kv.first] = kv.second;
  }
  std::vector<std::string> out;
  for (const auto& kv : env) {
    out.push_back(kv.first + "=" + kv.second);
  }
  return out;
}

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (auto& s : v) {
    out.push_back(&s[0]);
  }
  out.push_back(nullptr);
  return out;
}

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

void validate(const LaunchOptions& o) {
  TORCH_CHECK(!o.command().empty(), o.name(),
              ": no program given; usage: paratrain launch [options] -- PROGRAM ARGS...");
  TORCH_CHECK(o.nproc_per_node() >= 0, "--nproc-per-node must be at least 1, got ",
              o.nproc_per_node());
  TORCH_CHECK(o.nnodes() >= 1, "--nnodes must be at least 1, got ", o.nnodes());
  const int min_nodes = o.min_nodes() > 0 ? o.min_nodes() : o.nnodes();
  TORCH_CHECK(min_nodes <= o.nnodes(), "--nnodes ", o.min_nodes(), ":", o.nnodes(),
              ": the minimum is larger than the maximum; write MIN:MAX with MIN <= MAX");
  TORCH_CHECK(min_nodes == o.nnodes() || !o.rdzv_endpoint().empty(), "--nnodes ", min_nodes, ":",
              o.nnodes(),
              " is elastic: it needs a dynamic rendezvous, --rdzv-endpoint host:port (and "
              "--rdzv-id)");
  TORCH_CHECK(o.node_rank() >= 0 && o.node_rank() < o.nnodes(), "--node-rank ", o.node_rank(),
              " is out of range for --nnodes ", o.nnodes(), ": it must be in [0, ", o.nnodes() - 1,
              "]");
  TORCH_CHECK(o.nnodes() == 1 || !o.master_addr().empty() || !o.rdzv_endpoint().empty(),
              "--nnodes ", o.nnodes(),
              " needs --master-addr: the address of node 0, which every node can reach");
  TORCH_CHECK(!(o.standalone() && o.nnodes() > 1), "--standalone is for one node; with --nnodes ",
              o.nnodes(), " give --master-addr and --master-port");
  TORCH_CHECK(o.rdzv_endpoint().empty() || !detail::runs_on_mpi(o.backend()),
              "--rdzv-endpoint with --backend mpi: mpirun places the ranks; use --hostfile");
  TORCH_CHECK(o.rdzv_endpoint().empty() || !o.standalone(),
              "--standalone is one node on loopback; it does not go with --rdzv-endpoint");
  TORCH_CHECK(
      o.hostfile().empty() || detail::runs_on_mpi(o.backend()),
      "--hostfile goes with --backend mpi: Open MPI starts the ranks on the hosts it lists");
  TORCH_CHECK(o.hostfile().empty() || o.nnodes() == 1, "--hostfile and --nnodes ", o.nnodes(),
              " both place ranks on nodes: give one of them");
  TORCH_CHECK(o.master_port() > 0 && o.master_port() < 65536, "--master-port ", o.master_port(),
              " is not a TCP port: it must be in [1, 65535]");
  // The names only: the program launched may be another one (a Python script) whose build has
  // engines this one lacks.
  if (!o.backend().empty() && o.backend() != "auto") {
    const std::string& b = o.backend();
    TORCH_CHECK(b.find(':') != std::string::npos || b == "gloo" || b == "mpi" || b == "nccl",
                "--backend: unknown backend '", b,
                "': choose gloo, mpi or nccl, or routes such as cpu:gloo,cuda:nccl");
    if (b.find(':') != std::string::npos) {
      try {
        detail::parse_routes(b);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "--backend: ", e.what_without_backtrace());
      }
    }
  }
  std::set<int> seen;
  for (int d : o.devices()) {
    TORCH_CHECK(d >= 0, "--devices: GPU index ", d, " is negative");
    TORCH_CHECK(seen.insert(d).second, "--devices lists GPU ", d, " twice");
  }
  TORCH_CHECK(!find_program(o.command()[0]).empty(), o.name(), ": program '", o.command()[0],
              "' not found: it is neither an executable file nor a command on PATH");
}

int resolved_nproc(const LaunchOptions& o) {
  if (o.nproc_per_node() > 0) {
    return o.nproc_per_node();
  }
  return o.devices().empty() ? 1 : static_cast<int>(o.devices().size());
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
// no descriptor open and no signal handler of ours installed.
struct JobGuard {
  std::vector<Worker> workers;
  struct sigaction old_int {};
  struct sigaction old_term {};
  struct sigaction old_chld {};
  bool handlers_installed = false;
  int dev_null = -1;

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
    for (auto& w : workers) {
      for (auto& s : w.streams) {
        if (s.fd >= 0) {
          ::close(s.fd);
          s.fd = -1;
        }
      }
      if (w.log_fd >= 0) {
        ::close(w.log_fd);
        w.log_fd = -1;
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

// Where this launcher's workers sit in the job. A plain launch computes it from the options; the
// mpirun shim (and launch_mpirun's outer launch of mpirun itself) is handed it.
struct Placement {
  bool from_mpirun = false;  // one worker, with the rank and size mpirun decided
  int first_rank = 0;
  int world_size = 1;
};

// The job-wide values every worker's environment shares.
struct JobPlan {
  int nproc = 1;
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;
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
    ::mkdir(o.log_dir().c_str(), 0755);
    struct stat st;
    TORCH_CHECK(::stat(o.log_dir().c_str(), &st) == 0 && S_ISDIR(st.st_mode), "--log-dir '",
                o.log_dir(), "' is not a directory and cannot be created");
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
  env["ROLE_RANK"] = env["RANK"];
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

// The child's side of fork: only async-signal-safe calls until exec.
[[noreturn]] void exec_worker(const std::string& program,
                              std::vector<char*>& argv,
                              std::vector<char*>& envp,
                              int dev_null,
                              int out_fd,
                              int err_fd,
                              pid_t launcher_pid) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher_pid) {
    ::_exit(127);
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGINT, &dfl, nullptr);
  ::sigaction(SIGTERM, &dfl, nullptr);
  ::sigaction(SIGCHLD, &dfl, nullptr);
  // A launcher inside a rank inherits the rank's ignored SIGPIPE (init_process_group); programs
  // get the default back, as Python's subprocess gives them.
  ::sigaction(SIGPIPE, &dfl, nullptr);
  // A caller that blocks SIGINT/SIGTERM (to sigwait for them) must not hand that mask to the
  // workers: they would ignore the launcher's SIGTERM until kill_grace ran out.
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  if (dev_null >= 0) {
    ::dup2(dev_null, 0);
  }
  ::dup2(out_fd, 1);
  ::dup2(err_fd, 2);
  ::execve(program.c_str(), argv.data(), envp.data());
  // write() only (async-signal-safe): the program, which the caller resolved before fork.
  const char msg[] = "paratrain: cannot execute ";
  ssize_t ignored = ::write(2, msg, sizeof(msg) - 1);
  ignored = ::write(2, program.c_str(), program.size());
  ignored = ::write(2, "\n", 1);
  (void)ignored;
  ::_exit(127);
}

// Forks and execs one worker with its output on two pipes the loop relays.
void start_worker(const LaunchOptions& o, const JobGuard& job, Worker& w, const Environment& env) {
  const std::string program = find_program(o.command()[0]);
  std::vector<std::string> env_strings = build_environment(env);
  std::vector<std::string> args = o.command();
  auto argv = c_strings(args);
  auto envp = c_strings(env_strings);
  int out_pipe[2];
  int err_pipe[2];
  TORCH_CHECK(::pipe2(out_pipe, O_CLOEXEC) == 0, "pipe: ", std::strerror(errno));
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    TORCH_CHECK(false, "pipe: ", std::strerror(errno));
  }
  const pid_t launcher_pid = ::getpid();
  // Signals stay blocked from fork until the child has reset the launcher's handlers: one
  // arriving in between would run on_signal in the child (a byte into the launcher's self-pipe,
  // the signal lost) instead of its default action. The child unblocks them in exec_worker.
  sigset_t all;
  sigset_t before;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &before);
  pid_t pid = ::fork();
  if (pid != 0) {
    ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  }
  if (pid < 0) {
    int err = errno;
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) {
      ::close(fd);
    }
    TORCH_CHECK(false, o.name(), ": cannot start worker ", w.rank,
                ": fork failed: ", std::strerror(err));
  }
  if (pid == 0) {
    exec_worker(program, argv, envp, job.dev_null, out_pipe[1], err_pipe[1], launcher_pid);
  }
  ::setpgid(pid, pid);  // also from the parent, so killpg works even before the child runs
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  w.pid = pid;
  w.running = true;
  w.streams[0].fd = out_pipe[0];
  w.streams[0].out_fd = 1;
  w.streams[1].fd = err_pipe[0];
  w.streams[1].out_fd = 2;
}

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
    if (!o.log_dir().empty()) {
      w.log_path = o.log_dir() + "/rank_" + std::to_string(w.rank) + ".log";
      w.log_fd = ::open(w.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      TORCH_CHECK(w.log_fd >= 0, o.name(), ": cannot write ", w.log_path, ": ",
                  std::strerror(errno));
    }
    start_worker(o, job, w, worker_environment(o, plan, where, w.rank, local));
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
             std::vector<Worker>& workers,
             std::function<bool(std::string*)> must_stop = nullptr)
      : o_(o),
        workers_(workers),
        running_(static_cast<int>(workers.size())),
        must_stop_(std::move(must_stop)) {}

  LaunchResult run() {
    for (;;) {
      reap();
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
        // Whatever the workers left behind goes now, and their pipes get a moment to drain.
        signal_groups(workers_, SIGKILL);
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

// Checks the options, then starts the workers (or mpirun) and supervises them.
LaunchResult run_job(const LaunchOptions& o,
                     const Placement& where,
                     std::function<bool(std::string*)> must_stop = nullptr);

// The paratrain CLI of this build: $PARATRAIN_CLI, else bin/paratrain beside the directory that
// holds this library (an install prefix's lib/ and bin/, or the build tree's libparatrain_launch
// and bin/). Not a search of PATH: another paratrain there may be another version, whose shim
// speaks another command line. "" when there is none.
std::string own_cli() {
  if (const char* cli = std::getenv("PARATRAIN_CLI"); cli != nullptr && cli[0] != '\0') {
    char* full = ::realpath(cli, nullptr);
    std::string out = full != nullptr ? full : "";
    std::free(full);
    TORCH_CHECK(!out.empty() && runnable(out), "PARATRAIN_CLI='", cli,
                "' is not an executable file; give the path of the paratrain CLI");
    return out;
  }
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&own_cli), &info) == 0 || info.dli_fname == nullptr) {
    return "";
  }
  // Linked statically, this code is in the program itself, which dladdr names by its argv[0].
  const std::string self = std::string(info.dli_fname).find(".so") == std::string::npos
                               ? "/proc/self/exe"
                               : info.dli_fname;
  char* lib = ::realpath(self.c_str(), nullptr);
  if (lib == nullptr) {
    return "";
  }
  std::string dir(lib);
  std::free(lib);
  // Beside it only, never further up (another tree there may hold another version): dir/bin
  // (the build tree), dir itself when it is a bin/ (linked statically), ../bin from prefix/lib or
  // lib64, ../../bin from Debian's prefix/lib/<triplet>.
  auto parent = [](const std::string& p) { return p.substr(0, p.rfind('/')); };
  auto name = [](const std::string& p) { return p.substr(p.rfind('/') + 1); };
  dir = parent(dir);
  std::vector<std::string> candidates{dir + "/bin/paratrain"};
  if (name(dir) == "bin") {
    candidates.push_back(dir + "/paratrain");
  } else if (name(dir) == "lib" || name(dir) == "lib64") {
    candidates.push_back(parent(dir) + "/bin/paratrain");
  } else if (name(parent(dir)) == "lib") {
    candidates.push_back(parent(parent(dir)) + "/bin/paratrain");
  }
  for (const std::string& candidate : candidates) {
    if (runnable(candidate)) {
      return candidate;
    }
  }
  return "";
}

// What mpirun starts on each rank: the paratrain CLI's `launch --from-mpirun`, which relays that
// rank's output and reports its failure.
std::vector<std::string> mpirun_shim(const LaunchOptions& o) {
  if (!o.mpi_shim().empty()) {
    return o.mpi_shim();
  }
  const std::string cli = own_cli();
  TORCH_CHECK(!cli.empty(), o.name(), ": --backend ", o.backend(),
              " starts each rank through the paratrain CLI (paratrain launch --from-mpirun), and "
              "none was found beside libparatrain_launch; set PARATRAIN_CLI to its path or "
              "LaunchOptions::mpi_shim");
  return {cli, "launch", "--from-mpirun"};
}

// Refuses a host that cannot be reached before mpirun tries (ssh to such a host can wait minutes):
// the name must resolve, and this host must have a route to it (the kernel picks a source
// address for a connected UDP socket, which sends nothing).
void check_reachable(const std::string& path, const HostfileEntry& e) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(e.host.c_str(), "9", &hints, &found);
  TORCH_CHECK(rc == 0, "--hostfile ", path, " line ", e.line, ": host '", e.host,
              "' does not resolve (", gai_strerror(rc), "); fix the name or its DNS entry");
  std::string why;
  bool routed = false;
  for (addrinfo* a = found; a != nullptr && !routed; a = a->ai_next) {
    int fd = socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = strerror(errno);
      continue;
    }
    routed = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    if (!routed) {
      why = strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  TORCH_CHECK(routed, "--hostfile ", path, " line ", e.line, ": host '", e.host,
              "' is unreachable from this host (", why,
              "); check its address and this host's routes");
}

// mpirun's placement: -np and, with a host file, where the ranks go.
std::vector<std::string> mpirun_placement(const LaunchOptions& o, int nproc) {
  if (o.hostfile().empty()) {
    return {"-np", std::to_string(nproc)};
  }
  const std::vector<HostfileEntry> hosts = read_hostfile(o.hostfile());
  for (const auto& e : hosts) {
    check_reachable(o.hostfile(), e);
  }
  if (o.nproc_per_node() > 0) {
    return {"-np",        std::to_string(o.nproc_per_node() * static_cast<int>(hosts.size())),
            "--hostfile", o.hostfile(),
            "--map-by",   "ppr:" + std::to_string(o.nproc_per_node()) + ":node"};
  }
  int slots = 0;
  for (const auto& e : hosts) {
    slots += e.slots;
  }
  return {"-np", std::to_string(slots), "--hostfile", o.hostfile()};
}

// mpirun's command line: one shim per rank, each running `command`.
std::vector<std::string> mpirun_command(const LaunchOptions& o, int nproc) {
  std::string mpirun = find_program("mpirun");
  TORCH_CHECK(!mpirun.empty(),
              "--backend mpi: mpirun not found on PATH; install Open MPI (openmpi-bin)");
  std::vector<std::string> cmd{mpirun};
  const std::vector<std::string> placement = mpirun_placement(o, nproc);
  cmd.insert(cmd.end(), placement.begin(), placement.end());
  if (!o.hostfile().empty()) {
    // Daemons that Open MPI starts on other hosts get only the variables named with -x.
    // OMP_NUM_THREADS only when the user chose it: otherwise each host's shim splits its own
    // cores between its own ranks.
    cmd.insert(cmd.end(), {"-x", "PARATRAIN_BACKEND"});
    for (const char* name : {"OMP_NUM_THREADS", "PARATRAIN_TIMEOUT"}) {
      if (std::getenv(name) != nullptr || o.env().count(name) > 0) {
        cmd.insert(cmd.end(), {"-x", name});
      }
    }
  }
  // Several ranks on a 2-core machine would otherwise be refused, and Open MPI's default
  // binding pins each rank to one core, starving libtorch's intra-op threads.
  cmd.insert(cmd.end(), {"--oversubscribe", "--bind-to", "none"});
  if (::geteuid() == 0) {
    cmd.push_back("--allow-run-as-root");
  }
  const std::vector<std::string> shim = mpirun_shim(o);
  cmd.insert(cmd.end(), shim.begin(), shim.end());
  if (!o.prefix_output() && std::find(shim.begin(), shim.end(), "--no-prefix") == shim.end()) {
    cmd.push_back("--no-prefix");
  }
  if (!o.log_dir().empty()) {
    cmd.insert(cmd.end(), {"--log-dir", o.log_dir()});
  }
  if (!o.devices().empty()) {
    cmd.insert(cmd.end(), {"--devices", format_device_list(o.devices())});
  }
  // Routes with mpi ("cpu:mpi,cuda:nccl") also meet over the store: --standalone's free port.
  const int port = o.standalone() ? pick_free_port() : o.master_port();
  // With a host file, rank 0 runs on its first host, which serves the store.
  std::string master = o.master_addr();
  if (master.empty()) {
    master = o.hostfile().empty() ? "127.0.0.1" : read_hostfile(o.hostfile()).front().host;
  }
  cmd.insert(cmd.end(), {"--master-addr", master, "--master-port", std::to_string(port)});
  for (const auto& kv : o.env()) {
    cmd.insert(cmd.end(), {"--env", kv.first + "=" + kv.second});
  }
  cmd.push_back("--");
  cmd.insert(cmd.end(), o.command().begin(), o.command().end());
  return cmd;
}

// mpirun's own environment: Open MPI settings measured or needed here (the user's win), and the
// job's backend for the shims.
Environment mpirun_environment(const LaunchOptions& o, int nproc) {
  Environment env{{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                  {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                  {"PARATRAIN_BACKEND", o.backend()}};
  // Measured here (paratrain bench allreduce, 2 ranks, 16 MiB): Open MPI's shared-memory transport
  // with its default single-copy mechanism (CMA, process_vm_readv) took 2.8-3.3 ms per allreduce,
  // with plain copy-in/copy-out through the shared segment 1.9-2.3 ms.
  if (std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism") == nullptr) {
    env["OMPI_MCA_btl_vader_single_copy_mechanism"] = "none";
  }
  // One node (without a host file): TCP between the ranks only over loopback. Open MPI 5
  // otherwise pairs every interface and prints "Unable to find reachable pairing between local
  // and remote interfaces" on hosts whose interfaces it cannot match (seen in Debian 13).
  if (o.hostfile().empty() && std::getenv("OMPI_MCA_btl_tcp_if_include") == nullptr &&
      std::getenv("OMPI_MCA_btl_tcp_if_exclude") == nullptr) {
    env["OMPI_MCA_btl_tcp_if_include"] = "lo";
  }
  // The outer launch starts a single process (mpirun), so it would give each rank all the cores;
  // split them between the ranks here instead, unless the user chose.
  if (o.hostfile().empty() && std::getenv("OMP_NUM_THREADS") == nullptr &&
      o.env().count("OMP_NUM_THREADS") == 0) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env["OMP_NUM_THREADS"] = std::to_string(std::max(1u, cores / static_cast<unsigned>(nproc)));
  }
  for (const auto& kv : o.env()) {
    env[kv.first] = kv.second;
  }
  return env;
}

// Runs a job through mpirun: mpirun starts the shim on each rank, the shim relays that rank's
// output and reports its failure; this process only watches mpirun.
LaunchResult launch_mpirun(const LaunchOptions& o, int nproc) {
  TORCH_CHECK(o.nnodes() == 1, "--backend mpi with --nnodes ", o.nnodes(),
              " is not supported: on several nodes run mpirun (or srun) with a host file yourself");
  LaunchOptions outer = o;
  outer.backend("")
      .hostfile("")       // mpirun's own
      .standalone(false)  // mpirun_command chose the ranks' port
      .command(mpirun_command(o, nproc))
      .nproc_per_node(1)
      .devices({})
      .log_dir("")
      .prefix_output(false)
      .env(mpirun_environment(o, nproc));
  // mpirun is one process that is rank 0 of 1 as far as this launcher is concerned.
  LaunchResult r = run_job(outer, Placement{true, 0, 1});
  if (r.interrupted_by != 0) {
    r.summary = o.name() + ": interrupted by " + strsignal(r.interrupted_by) +
                "; stopped mpirun and its " + std::to_string(nproc) + " ranks";
  } else if (r.first_failure) {
    r.summary = o.name() + ": mpirun " +
                (r.first_failure->signal
                     ? "was killed by signal " + std::to_string(r.first_failure->signal)
                     : "exited with code " + std::to_string(r.first_failure->exit_code)) +
                "; the failing rank's report is above";
  }
  return r;
}

LaunchResult run_job(const LaunchOptions& o,
                     const Placement& where,
                     std::function<bool(std::string*)> must_stop) {
  validate(o);
  const int nproc = resolved_nproc(o);
  TORCH_CHECK(o.devices().empty() || static_cast<int>(o.devices().size()) >= nproc,
              "--nproc-per-node ", nproc, " needs as many devices, but --devices lists only ",
              o.devices().size());
  if (detail::runs_on_mpi(o.backend()) && !where.from_mpirun) {
    return launch_mpirun(o, nproc);
  }
  TORCH_CHECK(!g_launch_active.exchange(true), o.name(),
              ": another launch is already running in this process");
  struct ActiveReset {
    ~ActiveReset() { g_launch_active = false; }
  } active_reset;
  const JobPlan plan = plan_job(o, nproc, where);
  JobGuard job;
  install_signal_handlers(job);
  start_workers(o, plan, where, job);
  return Supervisor(o, job.workers, std::move(must_stop)).run();
}

}  // namespace

namespace {

std::string describe_failure(const WorkerFailure& f) {
  return "rank " + std::to_string(f.rank) + " (pid " + std::to_string(f.pid) + ") " +
         (f.signal != 0 ? std::string("was killed by signal ") + std::to_string(f.signal) + " (" +
                              strsignal(f.signal) + ")"
                        : "exited with code " + std::to_string(f.exit_code)) +
         " at " + f.time;
}

}  // namespace

namespace {

std::pair<std::string, int> parse_endpoint(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  TORCH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < endpoint.size() &&
                  endpoint.find_first_not_of("0123456789", colon + 1) == std::string::npos &&
                  endpoint.size() - colon <= 6,
              "--rdzv-endpoint '", endpoint, "' is not host:port");
  const int port = std::stoi(endpoint.substr(colon + 1));
  TORCH_CHECK(port > 0 && port < 65536, "--rdzv-endpoint '", endpoint, "': port ", port,
              " is not a TCP port");
  return {endpoint.substr(0, colon), port};
}

// torchrun's elastic agent: rendezvous, run this node's workers, and form a new round when a
// worker fails (counted against max_restarts), when a node stops its heartbeat, or when nodes wait
// to join (neither counted). See rendezvous.h.
LaunchResult launch_elastic(const LaunchOptions& options) {
  validate(options);
  const auto [host, port] = parse_endpoint(options.rdzv_endpoint());
  detail::RendezvousOptions ro;
  ro.host = host;
  ro.port = port;
  ro.id = options.rdzv_id();
  ro.max_nodes = options.nnodes();
  ro.min_nodes = options.min_nodes() > 0 ? options.min_nodes() : options.nnodes();
  ro.join_timeout = options.rdzv_join_timeout();
  ro.last_call = options.rdzv_last_call();
  ro.keep_alive = options.rdzv_keep_alive();
  std::string command;
  for (const auto& a : options.command()) {
    command += (command.empty() ? "" : " ") + a;
  }
  ro.signature = "--nnodes " + std::to_string(ro.min_nodes) + ":" + std::to_string(ro.max_nodes) +
                 " --nproc-per-node " + std::to_string(resolved_nproc(options)) + " -- " + command;
  detail::Rendezvous rdzv(ro);
  std::cerr << options.name() << ": rendezvous '" << ro.id << "' at " << host << ":" << port
            << ": joining" << std::endl;
  std::vector<WorkerFailure> failures;
  int failures_used = 0;
  for (int attempt = 0;; ++attempt) {
    const detail::Assignment a = rdzv.next();
    const int nproc = resolved_nproc(options);
    std::cerr << options.name() << ": rendezvous " << ro.id << " round " << a.round << ": node "
              << a.node_rank << " of " << a.nnodes << ", world size " << a.nnodes * nproc
              << ", master " << a.master_addr << ":" << a.master_port << std::endl;
    LaunchOptions o = options;
    Environment env = o.env();
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options.max_restarts());
    env["TORCHELASTIC_RUN_ID"] = ro.id;
    if (ro.min_nodes < ro.max_nodes) {
      env["PARATRAIN_ELASTIC"] = "1";  // the world may change: programs resume across sizes
    }
    o.rdzv_endpoint("")
        .min_nodes(0)
        .nnodes(a.nnodes)
        .node_rank(a.node_rank)
        .master_addr(a.master_addr)
        .master_port(a.master_port)
        .env(env);
    LaunchResult r = run_job(o, Placement{},
                             [&rdzv, &a](std::string* why) { return rdzv.must_restart(a, why); });
    r.rounds = attempt + 1;
    if (!r.stopped_for.empty() && r.interrupted_by == 0 && r.signal_received == 0) {
      std::cerr << options.name() << ": " << r.stopped_for
                << "; stopped this node's workers to join the next round" << std::endl;
      continue;
    }
    if (r.exit_code == 0 && r.stopped_for.empty()) {
      rdzv.finish(a, std::chrono::seconds(30));
      return r;
    }
    std::string why;
    if (r.first_failure && r.interrupted_by == 0 && r.signal_received == 0 &&
        rdzv.membership_changed(a, ro.keep_alive + std::chrono::seconds(1), &why)) {
      std::cerr << options.name() << ": " << describe_failure(*r.first_failure) << ", as " << why
                << "; joining the next round (a change of membership, not a restart)" << std::endl;
      continue;
    }
    if (r.first_failure) {
      failures.push_back(*r.first_failure);
    }
    const bool retry = r.interrupted_by == 0 && r.signal_received == 0 && r.first_failure &&
                       failures_used < options.max_restarts();
    if (!retry) {
      // The other nodes stop now with this reason, instead of waiting for a round that cannot
      // form (or re-forming without a node that did not die).
      rdzv.shut_down(
          r.summary.empty() ? "node " + std::to_string(a.node_rank) + " stopped" : r.summary,
          a.nnodes - 1);
      r.failures = failures;
      r.restarts = failures_used;
      return r;
    }
    try {
      rdzv.open_next_round(a, "failure");  // the others stop at once
    } catch (const std::exception&) {
      // The store's node is gone: the others learn from their own failures.
    }
    ++failures_used;
    std::cerr << options.name() << ": " << describe_failure(*r.first_failure)
              << "; stopped this node's workers, joining the next round (restart " << failures_used
              << " of " << options.max_restarts() << ")" << std::endl;
  }
}

}  // namespace

LaunchResult launch(const LaunchOptions& options) {
  TORCH_CHECK(options.max_restarts() >= 0, "--max-restarts must be >= 0, got ",
              options.max_restarts());
  if (!options.rdzv_endpoint().empty()) {
    return launch_elastic(options);
  }

  std::vector<WorkerFailure> failures;
  for (int attempt = 0;; ++attempt) {
    LaunchOptions o = options;
    Environment env = o.env();
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options.max_restarts());
    o.env(env);
    LaunchResult r = run_job(o, Placement{});
    if (r.first_failure) {
      failures.push_back(*r.first_failure);
    }
    const bool retry = r.exit_code != 0 && r.interrupted_by == 0 && r.signal_received == 0 &&
                       r.first_failure && attempt < options.max_restarts();
    if (!retry) {
      r.restarts = attempt;
      r.failures = failures;
      if (options.max_restarts() > 0 && !failures.empty() && !r.summary.empty()) {
        r.summary += "\n" + options.name() + ": " + std::to_string(attempt) + " restart" +
                     (attempt == 1 ? "" : "s") + " of " + std::to_string(options.max_restarts()) +
                     " used; every failure:";
        for (size_t i = 0; i < failures.size(); ++i) {
          r.summary += "\n  attempt " + std::to_string(i) + ": " + describe_failure(failures[i]);
        }
      }
      return r;
    }
    std::cerr << options.name() << ": " << describe_failure(*r.first_failure)
              << "; stopped every worker, restarting all (restart " << attempt + 1 << " of "
              << options.max_restarts() << ")" << std::endl;
  }
}

namespace detail {

bool runs_on_mpi(const std::string& backend) {
  if (backend.find(':') == std::string::npos) {
    return backend == "mpi";
  }
  for (const auto& route : parse_routes(backend)) {
    if (route.second == "mpi") {
      return true;
    }
  }
  return false;
}

LaunchResult launch_mpirun_rank(const LaunchOptions& options, int rank, int world_size) {
  TORCH_CHECK(rank >= 0 && rank < world_size, options.name(), ": mpirun gave rank ", rank,
              " of a world of ", world_size);
  LaunchOptions one = options;
  one.nproc_per_node(1);
  return run_job(one, Placement{true, rank, world_size});
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
