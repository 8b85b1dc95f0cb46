#include "test_util.h"

#include "commands.h"  // apps/paratrain: run_cli
#include "paratrain/base/child_process.h"
#include "paratrain/util/allocator.h"
#include "util/files.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>

namespace paratrain {
namespace testing {

namespace {
using Clock = std::chrono::steady_clock;

// The suite's own process trains models in-process (MixedPrecision, Trainer, ...): it keeps freed
// memory as paratrain's programs and examples do (Note [Freed memory on the CPU]).
[[maybe_unused]] const bool kKeepsFreedMemory = cpu::keep_freed_memory();

void fill_result(int status, ProcessResult& r) {
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
}
}  // namespace

RunningProcess start_process(const std::vector<std::string>& argv,
                             const std::map<std::string, std::string>& env) {
  // tests/labels.cmake runs `unit` tests with PARATRAIN_TEST_UNIT=1: one that starts a process is
  // mislabelled (and would slow `scripts/test.sh --quick` down).
  if (const char* unit = std::getenv("PARATRAIN_TEST_UNIT"); unit && std::string(unit) == "1") {
    ADD_FAILURE() << "this test is labelled unit but starts " << (argv.empty() ? "" : argv[0])
                  << ": label it multiprocess in tests/labels.cmake";
  }
  // A value "<unset>" removes the variable (world_of_one_env).
  std::map<std::string, std::string> set;
  std::vector<std::string> unset;
  for (const auto& kv : env) {
    if (kv.second == "<unset>") {
      unset.push_back(kv.first);
    } else {
      set.insert(kv);
    }
  }
  // Not die_with_parent: a test may start a process from a thread that ends before it does.
  ChildProcess child(ChildOptions(argv)
                         .environment(environment_with(set, unset))
                         .inherit_environment(false)
                         .die_with_parent(false)
                         .capture_output(true));
  RunningProcess p;
  p.pid = child.pid();
  p.output_fd = child.release_stdout();
  return p;
}

bool RunningProcess::read_some() {
  pollfd pfd{output_fd, POLLIN, 0};
  if (::poll(&pfd, 1, 50) > 0) {
    char buf[4096];
    ssize_t n = ::read(output_fd, buf, sizeof(buf));
    if (n > 0) {
      output.append(buf, static_cast<size_t>(n));
    } else if (n == 0) {
      return false;
    }
  }
  return true;
}

bool RunningProcess::wait_for_output(const std::string& text, double timeout_seconds) {
  auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int>(timeout_seconds * 1000));
  while (output.find(text) == std::string::npos && Clock::now() < deadline && read_some()) {
  }
  return output.find(text) != std::string::npos;
}

ProcessResult RunningProcess::finish(double timeout_seconds) {
  ProcessResult r;
  auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int>(timeout_seconds * 1000));
  bool eof = false;
  int status = 0;
  bool exited = false;
  while (!(eof && exited)) {
    if (Clock::now() > deadline && !r.timed_out) {
      r.timed_out = true;
      ::kill(-pid, SIGKILL);
    }
    if (!eof) {
      eof = !read_some();
    }
    if (!exited && ::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      // Whatever still holds the pipe open past this point is a leftover: give it a moment.
      if (!eof) {
        deadline = std::min(deadline, Clock::now() + std::chrono::seconds(3));
      }
    }
    if (exited && Clock::now() > deadline) {
      break;
    }
  }
  ::close(output_fd);
  fill_result(status, r);
  r.output = output;
  return r;
}

ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env,
                          double timeout_seconds) {
  RunningProcess p = start_process(argv, env);
  return p.finish(timeout_seconds);
}

namespace {
// While alive: stdout and stderr (the descriptors, so C stdio and libtorch's warnings too) go to
// an unlinked temporary file, and `env` is set; the destructor puts both back.
class CapturedCommand {
 public:
  explicit CapturedCommand(const std::map<std::string, std::string>& env) {
    flush();
    // Close-on-exec: a process the command starts inherits its stdout and stderr (the file), not
    // these descriptors (the test's own output, which ctest waits on).
    char path[] = "/tmp/paratrain-run-cli.XXXXXX";
    file_ = ::mkostemp(path, O_CLOEXEC);
    TORCH_CHECK(file_ >= 0, "run_cli: mkostemp failed: ", std::strerror(errno));
    ::unlink(path);
    saved_out_ = ::fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
    saved_err_ = ::fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3);
    if (saved_out_ < 0 || saved_err_ < 0) {
      const int error = errno;
      for (int fd : {file_, saved_out_, saved_err_}) {
        if (fd >= 0) {
          ::close(fd);
        }
      }
      TORCH_CHECK(false, "run_cli: dup failed: ", std::strerror(error));
    }
    TORCH_CHECK(::dup2(file_, STDOUT_FILENO) >= 0 && ::dup2(file_, STDERR_FILENO) >= 0,
                "run_cli: dup2 failed: ", std::strerror(errno));
    for (const auto& [name, value] : env) {
      const char* old = std::getenv(name.c_str());
      saved_env_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      if (value == "<unset>") {  // as in start_process
        ::unsetenv(name.c_str());
      } else {
        ::setenv(name.c_str(), value.c_str(), 1);
      }
    }
  }
  CapturedCommand(const CapturedCommand&) = delete;
  CapturedCommand& operator=(const CapturedCommand&) = delete;
  ~CapturedCommand() {
    restore();
    ::close(file_);
  }
  // Restores stdout, stderr and the environment; returns what was written meanwhile.
  std::string finish() {
    restore();
    std::string out;
    ::lseek(file_, 0, SEEK_SET);
    char buffer[4096];
    ssize_t n;
    while ((n = ::read(file_, buffer, sizeof(buffer))) > 0) {
      out.append(buffer, static_cast<size_t>(n));
    }
    return out;
  }

 private:
  static void flush() {
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
  }
  void restore() {
    if (restored_) {
      return;
    }
    restored_ = true;
    flush();
    ::dup2(saved_out_, STDOUT_FILENO);
    ::dup2(saved_err_, STDERR_FILENO);
    ::close(saved_out_);
    ::close(saved_err_);
    for (const auto& [name, old] : saved_env_) {
      if (old) {
        ::setenv(name.c_str(), old->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }
  bool restored_ = false;
  int file_ = -1;
  int saved_out_ = -1;
  int saved_err_ = -1;
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_env_;
};
}  // namespace

ProcessResult run_cli(const std::vector<std::string>& argv,
                      const std::map<std::string, std::string>& env) {
  TORCH_CHECK(!argv.empty() && argv[0] == cli_path(), "run_cli: argv[0] must be cli_path(), got '",
              argv.empty() ? "" : argv[0], "'");
  cli::set_self_path(cli_path());
  ProcessResult r;
  CapturedCommand captured(env);
  r.exit_code = cli::run_command_line(std::vector<std::string>(argv.begin() + 1, argv.end()));
  r.output = captured.finish();
  return r;
}

std::vector<int> processes_with(const std::string& token) {
  std::vector<int> pids;
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) {
    return pids;
  }
  while (dirent* e = ::readdir(dir)) {
    int pid = std::atoi(e->d_name);
    if (pid <= 0 || pid == ::getpid()) {
      continue;
    }
    std::ifstream in(std::string("/proc/") + e->d_name + "/cmdline", std::ios::binary);
    std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ifstream st(std::string("/proc/") + e->d_name + "/stat");
    std::string stat((std::istreambuf_iterator<char>(st)), std::istreambuf_iterator<char>());
    auto close = stat.rfind(')');
    bool zombie = close != std::string::npos && stat.size() > close + 2 && stat[close + 2] == 'Z';
    if (!zombie && cmd.find(token) != std::string::npos) {
      pids.push_back(pid);
    }
  }
  ::closedir(dir);
  return pids;
}

std::map<std::string, at::Tensor> clone_tensors(const std::map<std::string, at::Tensor>& tensors) {
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : tensors) {
    out[kv.first] = kv.second.detach().clone();
  }
  return out;
}

void expect_bitwise(const std::map<std::string, at::Tensor>& a,
                    const std::map<std::string, at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& kv : a) {
    ASSERT_TRUE(b.count(kv.first)) << kv.first;
    EXPECT_TRUE(at::equal(kv.second.cpu(), b.at(kv.first).cpu())) << kv.first << " differs";
  }
}

std::string make_temp_dir(const std::string& name) {
  const std::string dir = "/tmp/" + unique_token(name);
  EXPECT_EQ(::mkdir(dir.c_str(), 0755), 0) << dir << ": " << std::strerror(errno);
  return dir;
}

std::string unique_token(const std::string& prefix) {
  static std::atomic<int> counter{0};
  return prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

std::map<std::string, std::string> world_of_one_env() {
  return {{"RANK", "<unset>"},
          {"WORLD_SIZE", "<unset>"},
          {"MASTER_ADDR", "<unset>"},
          {"OMPI_COMM_WORLD_SIZE", "<unset>"},
          {"PARATRAIN_BACKEND", "<unset>"}};
}

std::string test_python() {
  return PARATRAIN_TEST_PYTHON;
}

bool python_has(const std::string& module) {
  static std::mutex mutex;
  static std::map<std::string, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(module);
  if (it == known.end()) {
    // Whether the module is installed, found without importing it: importing torch or
    // torchvision costs 3 CPU-seconds, and the test that asked imports it next anyway (a broken
    // installation then fails that test rather than skipping it).
    auto r = run_process({test_python(), "-c",
                          "import importlib.util, sys; "
                          "sys.exit(importlib.util.find_spec(sys.argv[1]) is None)",
                          module},
                         {}, 120);
    it = known.emplace(module, r.exit_code == 0).first;
  }
  return it->second;
}

std::string hf_python() {
  return PARATRAIN_HF_PYTHON;
}

std::string hf_python_missing() {
  static const std::string reason = [] {
    const std::string remedy =
        "no Python with transformers: make it with scripts/venv.sh, or set "
        "-DPARATRAIN_HF_PYTHON";
    if (hf_python().empty()) {
      return remedy + " (PARATRAIN_HF_PYTHON is empty)";
    }
    if (!std::filesystem::exists(hf_python())) {
      return remedy + " (" + hf_python() + " does not exist)";
    }
    // scripts/venv.sh writes its stamp once every package is in: without it, the environment is
    // being made (CI makes it while the first leg's tests run) or its making was cut short.
    const std::filesystem::path venv =
        std::filesystem::path(hf_python()).parent_path().parent_path();
    if (std::filesystem::exists(venv / "pyvenv.cfg") &&
        !std::filesystem::exists(venv / ".paratrain-requirements")) {
      return remedy + " (" + venv.string() +
             " has no .paratrain-requirements: it is being made, or its making was cut short)";
    }
    auto r = run_process({hf_python(), "-c", "import transformers, safetensors"},
                         {{"HF_HUB_OFFLINE", "1"}, {"TRANSFORMERS_OFFLINE", "1"}}, 120);
    return r.exit_code == 0 ? std::string()
                            : remedy + " (" + hf_python() + " cannot import transformers)";
  }();
  return reason;
}

bool has_cuda() {
  return torch::cuda::is_available();
}

std::string auto_backend(const std::string& cpu_engine) {
#ifdef PARATRAIN_WITH_NCCL
  if (has_cuda()) {
    return "cpu:" + cpu_engine + ",cuda:nccl";
  }
#endif
  return cpu_engine;
}

std::string cli_path() {
  return PARATRAIN_TEST_CLI;
}
std::string worker_path() {
  return PARATRAIN_TEST_WORKER;
}
std::string probe_path() {
  return PARATRAIN_TEST_PROBE;
}
std::string spawn_probe_path() {
  return PARATRAIN_TEST_SPAWN_PROBE;
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

void expect_close(const at::Tensor& a,
                  const at::Tensor& b,
                  const std::string& what,
                  double tolerance) {
  ASSERT_TRUE(a.defined()) << what;
  ASSERT_TRUE(b.defined()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_LE((a - b).abs().max().item<double>(), tolerance) << what;
}

void expect_every_rank_ok(const std::string& worker,
                          const std::string& backend,
                          int ranks,
                          const std::vector<std::string>& args) {
  std::vector<std::string> argv{
      cli_path(), "launch", "--standalone", "--nproc-per-node", std::to_string(ranks), "--backend",
      backend,    "--",     worker};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = run_process(argv, {{"PARATRAIN_TIMEOUT", "60"}}, 240);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < ranks; ++rank) {
    std::string line = "[rank " + std::to_string(rank) + "]: rank " + std::to_string(rank) + ": ok";
    EXPECT_NE(r.output.find(line), std::string::npos) << "missing '" << line << "' in\n"
                                                      << r.output;
  }
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::map<std::string, std::string> files_in(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    out[entry.path().filename().string()] = file_bytes(entry.path().string());
  }
  return out;
}

void remove_tree(const std::string& path) {
  detail::remove_tree(path);  // best effort: a test's clean-up must not fail the test
}

void remove_with_prefix(const std::string& prefix) {
  const size_t slash = prefix.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : prefix.substr(0, slash);
  const std::string stem = slash == std::string::npos ? prefix : prefix.substr(slash + 1);
  if (stem.empty()) {
    return;  // every entry of the directory would match
  }
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return;
  }
  std::vector<std::string> doomed;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != ".." && name.rfind(stem, 0) == 0) {
      doomed.push_back(dir + "/" + name);
    }
  }
  ::closedir(d);
  for (const auto& path : doomed) {
    remove_tree(path);
  }
}

}  // namespace testing
}  // namespace paratrain
