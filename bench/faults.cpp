// paratrain bench faults: what failures cost a long job, and what checkpoints cost.
//
// Part 1 (lost_steps has one entry per restart that got as far as resuming; a kill during an
// attempt's start-up loses no steps, only the start-up time, and is counted apart): a 2-rank DDP
// job of the mlp on Fashion-MNIST (`paratrain train --nproc 2
// --max-restarts K --resume auto`, checkpoints every --checkpoint-every steps). While it runs, a
// random worker is SIGKILLed at a random time (uniform in [--min-gap, --max-gap] seconds after
// the previous restart's workers appeared), --kills times. Reported: the restarts, the steps
// each one lost (from the metrics file: the last step logged before the kill minus the step
// resumed from), the wall-time overhead against the same job run without kills, and whether the
// final weights are bitwise equal (they must be).
//
// Part 2 (--repeats 0 skips it): a ResNet-50 checkpoint (weights and SGD momentum, ~200 MB)
// saved synchronously against writing the same number of bytes with write + fsync, medians of
// --repeats; and the step-time overhead of checkpointing every 100 steps (background writes)
// on --resnet-steps steps (0 skips) of ResNet-50 at --resnet-image px, batch --resnet-batch: the
// extra time of the 10 steps after each checkpoint over the median step, spread over 100 steps.

#include "args.h"
#include "bench_util.h"
#include "commands.h"
#include "util/files.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

extern char** environ;

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

// The live children of `parent` (the launcher's workers), from /proc.
std::vector<int> children_of(int parent) {
  std::vector<int> out;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) {
    return out;
  }
  while (dirent* e = ::readdir(d)) {
    const int pid = std::atoi(e->d_name);
    if (pid <= 0) {
      continue;
    }
    std::ifstream stat("/proc/" + std::string(e->d_name) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) {
      continue;
    }
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    int ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent && state != 'Z') {
      out.push_back(pid);
    }
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// Starts argv with stdout and stderr into `log`; returns the pid.
int start(const std::vector<std::string>& argv, const std::string& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<char*> args;
  for (const auto& a : argv) {
    args.push_back(const_cast<char*>(a.c_str()));
  }
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    throw std::runtime_error("bench faults: cannot start " + argv[0] + ": " + std::strerror(rc));
  }
  return pid;
}

int wait_exit(int pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Steps lost to each restart, from the metrics file: each attempt writes a "resumed_from" row
// with the step it starts from; the steps logged before it beyond that step were lost.
std::vector<int64_t> lost_steps(const std::string& metrics) {
  std::vector<int64_t> lost;
  std::istringstream in(read_text(metrics));
  std::string line;
  int64_t last = -1;  // the last step logged
  while (std::getline(in, line)) {
    const nlohmann::json row = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!row.is_object() || !row.contains("step")) {
      continue;  // a line cut by a kill
    }
    const int64_t step = row.at("step").get<int64_t>();
    if (row.contains("resumed_from")) {
      if (last >= 0) {
        lost.push_back(std::max<int64_t>(0, last - step));
      }
      last = step;
    } else if (row.contains("loss")) {
      last = step;
    }
  }
  return lost;
}

struct JobResult {
  double seconds = 0;
  int exit_code = 0;
  int kills = 0;
  std::string log;
};

JobResult run_job(const std::vector<std::string>& argv,
                  const std::string& log,
                  int kills,
                  double min_gap,
                  double max_gap,
                  uint64_t seed) {
  const auto t0 = Clock::now();
  const int launcher = start(argv, log);
  std::mt19937_64 rng(seed);
  JobResult r;
  std::set<int> killed;
  for (int k = 0; k < kills; ++k) {
    // Wait for a full set of workers none of which was killed (the next attempt's).
    std::vector<int> workers;
    while (true) {
      int status = 0;
      if (::waitpid(launcher, &status, WNOHANG) == launcher) {
        r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        r.seconds = seconds_since(t0);
        r.log = read_text(log);
        return r;  // the job ended before every kill was made
      }
      workers = children_of(launcher);
      bool fresh = workers.size() == 2;
      for (int w : workers) {
        fresh = fresh && killed.count(w) == 0;
      }
      if (fresh) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const double gap = std::uniform_real_distribution<double>(min_gap, max_gap)(rng);
    std::this_thread::sleep_for(std::chrono::duration<double>(gap));
    const int victim = workers[std::uniform_int_distribution<size_t>(0, 1)(rng)];
    if (::kill(victim, SIGKILL) == 0) {
      killed.insert(workers.begin(), workers.end());
      ++r.kills;
    }
  }
  r.exit_code = wait_exit(launcher);
  r.seconds = seconds_since(t0);
  r.log = read_text(log);
  return r;
}

struct ResnetNumbers {
  double bytes = 0;
  double save_seconds = 0;     // median, Checkpoint::save without the background thread
  double fsync_seconds = 0;    // median, the same bytes with write + fsync
  double step_plain = 0;       // median step seconds
  double checkpoint_cost = 0;  // median extra seconds a background checkpoint adds
};

double write_fsync(const std::string& path, const std::vector<char>& bytes) {
  const auto t = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    throw std::runtime_error("bench faults: cannot write " + path);
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      ::close(fd);
      throw std::runtime_error("bench faults: writing " + path + " failed");
    }
    done += static_cast<size_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
  return seconds_since(t);
}

ResnetNumbers resnet_checkpoint(
    const std::string& dir, int repeats, int steps, int image, int batch) {
  ResnetNumbers n;
  torch::manual_seed(0);
  auto model = models::make("resnet50", 1000);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto x = torch::randn({batch, 3, image, image});
  auto y = torch::randint(0, 1000, {batch});
  auto step = [&] {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    opt.step();
  };
  step();  // momentum buffers exist from here on
  auto capture = [&](int64_t s) {
    CheckpointState st;
    st.step = s;
    st.shared = with_prefix(module_state(*model), "model.");
    for (const auto& kv : with_prefix(optimizer_state(opt), "optim.")) {
      st.shared[kv.first] = kv.second;
    }
    st.own = rng_state();
    return st;
  };
  {
    Checkpoint sync(CheckpointOptions(dir + "/sync").keep(1).background(false));
    std::vector<double> save, plain;
    for (int r = 0; r < repeats; ++r) {
      const auto t = Clock::now();
      sync.save(capture(r + 1));
      save.push_back(seconds_since(t));
    }
    for (const auto& kv : capture(0).shared) {
      n.bytes += static_cast<double>(kv.second.nbytes());
    }
    std::vector<char> bytes(static_cast<size_t>(n.bytes), 1);
    for (int r = 0; r < repeats; ++r) {
      plain.push_back(write_fsync(dir + "/plain.bin", bytes));
    }
    n.save_seconds = median(save);
    n.fsync_seconds = median(plain);
  }
  if (steps <= 0) {
    return n;
  }
  // Blocks of 100 steps, each starting with a checkpoint written in the background. The
  // checkpoint's cost is the extra time of the block's first 10 steps (the copy to host memory on
  // this thread, then the writer competing for the cores) over the median step of the same block
  // after them; comparing within a block keeps the machine's drift out of it.
  Checkpoint bg(CheckpointOptions(dir + "/bg").keep(1));
  std::vector<double> costs, medians;
  for (int block = 0; block * 100 < steps; ++block) {
    std::vector<double> times;
    for (int i = 0; i < 100 && block * 100 + i < steps; ++i) {
      const auto t = Clock::now();
      if (i == 0) {
        bg.save(capture(block));
      }
      step();
      times.push_back(seconds_since(t));
    }
    if (times.size() < 20) {
      continue;
    }
    const double m = median(std::vector<double>(times.begin() + 10, times.end()));
    double cost = 0;
    for (size_t i = 0; i < 10; ++i) {
      cost += times[i] - m;
    }
    costs.push_back(cost);
    medians.push_back(m);
  }
  bg.wait();
  n.step_plain = median(medians);
  n.checkpoint_cost = median(costs);
  return n;
}

}  // namespace
int run_bench_faults(const std::vector<std::string>& argv) {
  static const CommandSpec spec{
      "paratrain bench faults",
      "Kills a random rank of a 2-rank DDP run at random times under --max-restarts and\n"
      "--resume auto: restarts, lost steps, overhead, and whether the weights stay bitwise equal;\n"
      "then a ResNet-50 checkpoint's save time and step overhead.",
      {
          {"kills", "N", "kills (default 20)"},
          {"max-restarts", "N", "the run's --max-restarts (default: --kills)"},
          {"epochs", "E", "epochs of the mlp run (default 5)"},
          {"steps", "S", "cap on the steps per epoch (default 0: all)"},
          {"checkpoint-every", "N", "steps between checkpoints (default 20)"},
          {"min-gap", "SECONDS", "the shortest time between kills (default 2.0)"},
          {"max-gap", "SECONDS", "the longest time between kills (default 6.0)"},
          {"seed", "S", "the seed of the kill times"},
          {"repeats", "N", "repeats of the ResNet-50 timings (default 3)"},
          {"resnet-steps", "N", "steps of the step-overhead run (default 300)"},
          {"resnet-image", "N", "its image side (default 32)"},
          {"resnet-batch", "B", "its batch (default 16)"},
          {"dir", "DIR", "where the runs write (default /tmp)"},
          {"json", "", "print one JSON object"},
      }};
  Args args(argv, spec);
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  const int kills = args.get_int("kills", 20);
  const int restarts = args.get_int("max-restarts", kills);
  const int every = args.get_int("checkpoint-every", 20);
  const double min_gap = args.get_double("min-gap", 2.0);
  const double max_gap = args.get_double("max-gap", 6.0);
  if (kills < 0 || restarts < kills || every < 1 || min_gap < 0 || max_gap < min_gap) {
    throw UsageError(
        "need --kills >= 0, --max-restarts >= --kills, --checkpoint-every >= 1 and "
        "0 <= --min-gap <= --max-gap");
  }
  const uint64_t seed = static_cast<uint64_t>(args.get_int("seed", static_cast<int>(::getpid())));
  const std::string dir =
      args.get("dir", "/tmp") + "/paratrain-bench-faults-" + std::to_string(::getpid());
  // No TORCH_CHECK in the CLI: its __FILE__ would put a source path in the installed binary.
  if (::mkdir(dir.c_str(), 0755) != 0) {
    throw std::runtime_error("bench faults: cannot create " + dir);
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() { detail::remove_tree(dir); }  // best effort, on the way out
  } cleanup{dir};
  std::ostream& info = args.has("json") ? std::cerr : std::cout;

  const std::vector<std::string> job{self_path(),
                                     "train",
                                     "--model",
                                     "mlp",
                                     "--strategy",
                                     "ddp",
                                     "--nproc",
                                     "2",
                                     "--backend",
                                     "gloo",
                                     "--device",
                                     "cpu",
                                     "--epochs",
                                     args.get("epochs", "3"),
                                     "--steps",
                                     args.get("steps", "0"),
                                     "--batch-size",
                                     "64",
                                     "--log-every",
                                     "1",
                                     "--checkpoint-every",
                                     std::to_string(every),
                                     "--resume",
                                     "auto",
                                     "--max-restarts",
                                     std::to_string(restarts)};
  auto with = [&](const std::string& name) {
    std::vector<std::string> a = job;
    for (const std::string flag : {"--checkpoint-dir", "--metrics", "--save-weights"}) {
      a.push_back(flag);
      a.push_back(dir + "/" + name +
                  (flag == std::string("--checkpoint-dir") ? "-ckpt"
                   : flag == std::string("--metrics")      ? ".jsonl"
                                                           : ".safetensors"));
    }
    return a;
  };
  info << "bench faults: the uninterrupted job ..." << std::endl;
  const JobResult clean = run_job(with("clean"), dir + "/clean.log", 0, 0, 0, seed);
  if (clean.exit_code != 0) {
    throw std::runtime_error("bench faults: the uninterrupted job failed:\n" + clean.log);
  }
  info << "bench faults: the job with " << kills << " kills ..." << std::endl;
  const JobResult faulty =
      run_job(with("faulty"), dir + "/faulty.log", kills, min_gap, max_gap, seed);
  if (faulty.exit_code != 0) {
    throw std::runtime_error("bench faults: the job with kills failed:\n" + faulty.log);
  }
  int restarts_made = 0;
  for (size_t p = faulty.log.find("restarting all"); p != std::string::npos;
       p = faulty.log.find("restarting all", p + 1)) {
    ++restarts_made;
  }
  const std::vector<int64_t> lost = lost_steps(dir + "/faulty.jsonl");
  int64_t lost_total = 0;
  for (int64_t l : lost) {
    lost_total += l;
  }
  const bool equal =
      read_text(dir + "/clean.safetensors") == read_text(dir + "/faulty.safetensors");
  const double overhead = (faulty.seconds - clean.seconds) / clean.seconds;

  ResnetNumbers rn;
  const int resnet_steps = args.get_int("resnet-steps", 300);
  if (resnet_steps >= 0 && args.get_int("repeats", 3) > 0) {
    info << "bench faults: ResNet-50 checkpoints ..." << std::endl;
    rn = resnet_checkpoint(dir, args.get_int("repeats", 3), resnet_steps,
                           args.get_int("resnet-image", 32), args.get_int("resnet-batch", 16));
  }
  const double save_ratio = rn.fsync_seconds > 0 ? rn.save_seconds / rn.fsync_seconds : 0;
  // A checkpoint every 100 steps: its cost spread over 100 steps.
  const double step_overhead = rn.step_plain > 0 ? rn.checkpoint_cost / (100 * rn.step_plain) : 0;
  if (args.has("json")) {
    std::cout << json_line(
                     {{"kills", faulty.kills},
                      {"restarts", restarts_made},
                      {"lost_steps", lost},
                      {"lost_steps_total", lost_total},
                      {"restarts_killed_in_startup",
                       std::max<int64_t>(0, restarts_made - static_cast<int64_t>(lost.size()))},
                      {"clean_seconds", clean.seconds},
                      {"faulty_seconds", faulty.seconds},
                      {"overhead_fraction", overhead},
                      {"bitwise_equal", equal},
                      {"resnet50_checkpoint_bytes", rn.bytes},
                      {"resnet50_save_seconds", rn.save_seconds},
                      {"resnet50_fsync_seconds", rn.fsync_seconds},
                      {"resnet50_save_vs_fsync", save_ratio},
                      {"resnet50_step_seconds", rn.step_plain},
                      {"resnet50_checkpoint_cost_seconds", rn.checkpoint_cost},
                      {"resnet50_checkpoint_step_overhead", step_overhead}})
              << std::endl;
  } else {
    std::cout << std::fixed << std::setprecision(2) << "kills " << faulty.kills << ", restarts "
              << restarts_made << ", steps lost " << lost_total << " (";
    for (size_t i = 0; i < lost.size(); ++i) {
      std::cout << (i ? " " : "") << lost[i];
    }
    std::cout << "), wall " << clean.seconds << " s uninterrupted vs " << faulty.seconds
              << " s with kills (overhead " << 100 * overhead << "%), final weights "
              << (equal ? "bitwise equal" : "DIFFERENT") << "\n";
    if (rn.bytes > 0) {
      std::cout << std::setprecision(3) << "ResNet-50 checkpoint " << rn.bytes / 1e6 << " MB: save "
                << rn.save_seconds << " s vs write+fsync " << rn.fsync_seconds << " s ("
                << save_ratio << "x); step " << rn.step_plain
                << " s, checkpoint every 100 steps adds " << 100 * step_overhead << "%\n";
    }
  }
  return equal ? 0 : 1;
}

}  // namespace cli
}  // namespace paratrain
