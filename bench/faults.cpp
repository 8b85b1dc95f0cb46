// paratrain bench faults: what failures cost a long job, and what checkpoints cost.
//
// Part 1 (--strategy fsdp: the same job under FSDP, with sharded checkpoints; lost_steps has one
// entry per restart that got as far as resuming; a kill during an attempt's start-up loses no
// steps, only the start-up time, and is counted apart): a 2-rank DDP job of the mlp on
// Fashion-MNIST (`paratrain train --nproc-per-node 2
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
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"
#include "util/files.h"

#include "paratrain/base/child_process.h"
#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

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

// Starts argv with stdout and stderr into `log`, as posix_spawn started it before: in this
// process's group, so that a Ctrl-C stops the job with the benchmark, and without a death signal.
ChildProcess start(const std::vector<std::string>& argv, const std::string& log) {
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw std::runtime_error("bench faults: cannot write the log " + log + ": " +
                             std::strerror(errno));
  }
  try {
    ChildProcess child(
        ChildOptions(argv).stdout_fd(fd).stderr_fd(fd).own_process_group(false).die_with_parent(
            false));
    ::close(fd);
    return child;
  } catch (...) {
    ::close(fd);
    throw;
  }
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
  ChildProcess launcher = start(argv, log);
  std::mt19937_64 rng(seed);
  JobResult r;
  std::set<int> killed;
  for (int k = 0; k < kills; ++k) {
    // Wait for a full set of workers none of which was killed (the next attempt's).
    std::vector<int> workers;
    while (true) {
      int status = 0;
      if (launcher.try_wait(&status)) {
        r.exit_code = exit_code(status);
        r.seconds = seconds_since(t0);
        r.log = read_text(log);
        return r;  // the job ended before every kill was made
      }
      workers = children_of(launcher.pid());
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
  r.exit_code = exit_code(launcher.wait());
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

// Blocks of 100 steps, each starting with a checkpoint written in the background. The
// checkpoint's cost is the extra time of the block's first 10 steps (the copy to host memory on
// this thread, then the writer competing for the cores) over the median step of the same block
// after them; comparing within a block keeps the machine's drift out of it.
void background_cost(Checkpoint& bg,
                     int steps,
                     const std::function<CheckpointState(int64_t)>& capture,
                     const std::function<void()>& step,
                     ResnetNumbers& n) {
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
}

ResnetNumbers resnet_checkpoint(const std::string& model_name,
                                const std::string& dir,
                                int repeats,
                                int steps,
                                int image,
                                int batch) {
  ResnetNumbers n;
  torch::manual_seed(0);
  auto model = models::make(model_name, 1000);
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
  Checkpoint bg(CheckpointOptions(dir + "/bg").keep(1));
  background_cost(bg, steps, capture, step, n);
  return n;
}

const BenchSpec& faults_spec() {
  // --smoke: one kill, soon after the workers start (so usually in their start-up: a restart
  // that loses no step), of a job of 4 steps checkpointed every 2; the checkpoint's numbers once,
  // of ResNet-18 (the same path as ResNet-50's with a quarter of the bytes), over the 20 steps that
  // one checkpoint's block of steps needs, at batch 2 (1x1 maps in its last stage: BatchNorm needs
  // 2 values).
  static const BenchSpec spec{
      "faults",
      "Kills a random rank of a 2-rank DDP run at random times under --max-restarts and\n"
      "--resume auto: restarts, lost steps, overhead, and whether the weights stay bitwise equal;\n"
      "then a ResNet-50 checkpoint's save time and step overhead.",
      {
          {"strategy", "NAME", "ddp (default) or fsdp: the killed job's strategy"},
          {"kills", "N", "kills (default 20)", "1"},
          {"max-restarts", "N", "the run's --max-restarts (default: --kills)"},
          {"epochs", "E", "epochs of the mlp run (default 3)", "1"},
          {"steps", "S", "cap on the steps per epoch (default 0: all)", "4"},
          {"checkpoint-every", "N", "steps between checkpoints (default 20)", "2"},
          {"min-gap", "SECONDS", "the shortest time between kills (default 2.0)", "0"},
          {"max-gap", "SECONDS", "the longest time between kills (default 6.0)", "0.5"},
          {"seed", "S", "the seed of the kill times"},
          {"repeats", "N", "repeats of the ResNet-50 timings (default 3)", "1"},
          {"resnet-steps", "N", "steps of the step-overhead run (default 300)", "20"},
          {"resnet-image", "N", "its image side (default 32)"},
          {"resnet-batch", "B", "its batch (default 16)", "2"},
          // The checkpoint's model: ResNet-50, whose numbers the rows name; the smoke run takes the
          // same path with ResNet-18's quarter of the bytes.
          {"resnet-model", "NAME", kInternalOption, "resnet18"},
          {"dir", "DIR", "where the runs write (default /tmp)"},
      },
      "print one JSON object"};
  return spec;
}

// The kill schedule of the job with kills.
struct KillPlan {
  int kills = 0;
  double min_gap = 0, max_gap = 0;
  uint64_t seed = 0;
};

// `paratrain train` of the mlp on 2 ranks, resuming from its checkpoints, writing its checkpoints,
// metrics and final weights under `dir` as NAME-ckpt, NAME.jsonl and NAME.safetensors.
std::vector<std::string> train_job(const Bench& bench,
                                   int restarts,
                                   const std::string& dir,
                                   const std::string& name) {
  require(bench.get("strategy", "ddp") == "ddp" || bench.get("strategy", "ddp") == "fsdp",
          "unknown --strategy '" + bench.get("strategy") + "': choose ddp or fsdp");
  std::vector<std::string> job{paratrain_program(),
                               "train",
                               "--model",
                               "mlp",
                               "--strategy",
                               bench.get("strategy", "ddp"),
                               "--nproc-per-node",
                               "2",
                               "--backend",
                               "gloo",
                               "--device",
                               "cpu",
                               "--epochs",
                               bench.get("epochs", "3"),
                               "--steps",
                               bench.get("steps", "0"),
                               "--batch-size",
                               "64",
                               "--log-every",
                               "1",
                               "--checkpoint-every",
                               std::to_string(bench.get_int("checkpoint-every", 20)),
                               "--resume",
                               "auto",
                               "--max-restarts",
                               std::to_string(restarts)};
  job.insert(job.end(),
             {"--checkpoint-dir", dir + "/" + name + "-ckpt", "--metrics",
              dir + "/" + name + ".jsonl", "--save-weights", dir + "/" + name + ".safetensors"});
  return job;
}

// The mlp job run whole, then with kills, and what the kills cost.
struct FaultNumbers {
  JobResult clean, faulty;
  int restarts_made = 0;
  std::vector<int64_t> lost;
  int64_t lost_total = 0;
  bool equal = false;
  double overhead = 0;
};

FaultNumbers measure_faults(const Bench& bench,
                            const KillPlan& plan,
                            int restarts,
                            const std::string& dir) {
  FaultNumbers n;
  bench.info() << "bench faults: the uninterrupted job ..." << std::endl;
  n.clean =
      run_job(train_job(bench, restarts, dir, "clean"), dir + "/clean.log", 0, 0, 0, plan.seed);
  if (n.clean.exit_code != 0) {
    throw std::runtime_error("bench faults: the uninterrupted job failed:\n" + n.clean.log);
  }
  bench.info() << "bench faults: the job with " << plan.kills << " kills ..." << std::endl;
  n.faulty = run_job(train_job(bench, restarts, dir, "faulty"), dir + "/faulty.log", plan.kills,
                     plan.min_gap, plan.max_gap, plan.seed);
  if (n.faulty.exit_code != 0) {
    throw std::runtime_error("bench faults: the job with kills failed:\n" + n.faulty.log);
  }
  for (size_t p = n.faulty.log.find("restarting all"); p != std::string::npos;
       p = n.faulty.log.find("restarting all", p + 1)) {
    ++n.restarts_made;
  }
  n.lost = lost_steps(dir + "/faulty.jsonl");
  for (int64_t l : n.lost) {
    n.lost_total += l;
  }
  n.equal = read_text(dir + "/clean.safetensors") == read_text(dir + "/faulty.safetensors");
  n.overhead = (n.faulty.seconds - n.clean.seconds) / n.clean.seconds;
  return n;
}

void print_faults_json(const FaultNumbers& f, const ResnetNumbers& rn) {
  const double save_ratio = rn.fsync_seconds > 0 ? rn.save_seconds / rn.fsync_seconds : 0;
  // A checkpoint every 100 steps: its cost spread over 100 steps.
  const double step_overhead = rn.step_plain > 0 ? rn.checkpoint_cost / (100 * rn.step_plain) : 0;
  std::cout << json_line(
                   {{"kills", f.faulty.kills},
                    {"restarts", f.restarts_made},
                    {"lost_steps", f.lost},
                    {"lost_steps_total", f.lost_total},
                    {"restarts_killed_in_startup",
                     std::max<int64_t>(0, f.restarts_made - static_cast<int64_t>(f.lost.size()))},
                    {"clean_seconds", f.clean.seconds},
                    {"faulty_seconds", f.faulty.seconds},
                    {"overhead_fraction", f.overhead},
                    {"bitwise_equal", f.equal},
                    {"resnet50_checkpoint_bytes", rn.bytes},
                    {"resnet50_save_seconds", rn.save_seconds},
                    {"resnet50_fsync_seconds", rn.fsync_seconds},
                    {"resnet50_save_vs_fsync", save_ratio},
                    {"resnet50_step_seconds", rn.step_plain},
                    {"resnet50_checkpoint_cost_seconds", rn.checkpoint_cost},
                    {"resnet50_checkpoint_step_overhead", step_overhead}})
            << std::endl;
}

void print_faults_text(const FaultNumbers& f, const ResnetNumbers& rn) {
  const double save_ratio = rn.fsync_seconds > 0 ? rn.save_seconds / rn.fsync_seconds : 0;
  const double step_overhead = rn.step_plain > 0 ? rn.checkpoint_cost / (100 * rn.step_plain) : 0;
  std::cout << std::fixed << std::setprecision(2) << "kills " << f.faulty.kills << ", restarts "
            << f.restarts_made << ", steps lost " << f.lost_total << " (";
  for (size_t i = 0; i < f.lost.size(); ++i) {
    std::cout << (i ? " " : "") << f.lost[i];
  }
  std::cout << "), wall " << f.clean.seconds << " s uninterrupted vs " << f.faulty.seconds
            << " s with kills (overhead " << 100 * f.overhead << "%), final weights "
            << (f.equal ? "bitwise equal" : "DIFFERENT") << "\n";
  if (rn.bytes > 0) {
    std::cout << std::setprecision(3) << "ResNet-50 checkpoint " << rn.bytes / 1e6 << " MB: save "
              << rn.save_seconds << " s vs write+fsync " << rn.fsync_seconds << " s (" << save_ratio
              << "x); step " << rn.step_plain << " s, checkpoint every 100 steps adds "
              << 100 * step_overhead << "%\n";
  }
}

int run_faults(const Bench& bench) {
  KillPlan plan;
  plan.kills = bench.get_int("kills", 20);
  const int restarts = bench.get_int("max-restarts", plan.kills);
  const int every = bench.get_int("checkpoint-every", 20);
  plan.min_gap = bench.get_double("min-gap", 2.0);
  plan.max_gap = bench.get_double("max-gap", 6.0);
  if (plan.kills < 0 || restarts < plan.kills || every < 1 || plan.min_gap < 0 ||
      plan.max_gap < plan.min_gap) {
    throw UsageError(
        "need --kills >= 0, --max-restarts >= --kills, --checkpoint-every >= 1 and "
        "0 <= --min-gap <= --max-gap");
  }
  plan.seed = static_cast<uint64_t>(bench.get_int("seed", static_cast<int>(::getpid())));
  const std::string dir =
      bench.get("dir", "/tmp") + "/paratrain-bench-faults-" + std::to_string(::getpid());
  // No TORCH_CHECK in the CLI: its __FILE__ would put a source path in the installed binary.
  if (::mkdir(dir.c_str(), 0755) != 0) {
    throw std::runtime_error("bench faults: cannot create " + dir);
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() { detail::remove_tree(dir); }  // best effort, on the way out
  } cleanup{dir};
  const FaultNumbers f = measure_faults(bench, plan, restarts, dir);
  ResnetNumbers rn;
  const int resnet_steps = bench.get_int("resnet-steps", 300);
  const int repeats = bench.get_int("repeats", 3);
  if (resnet_steps >= 0 && repeats > 0) {
    bench.info() << "bench faults: ResNet-50 checkpoints ..." << std::endl;
    rn = resnet_checkpoint(bench.get("resnet-model", "resnet50"), dir, repeats, resnet_steps,
                           bench.get_int("resnet-image", 32), bench.get_int("resnet-batch", 16));
  }
  if (bench.json()) {
    print_faults_json(f, rn);
  } else {
    print_faults_text(f, rn);
  }
  return f.equal ? 0 : 1;
}

}  // namespace

int run_bench_faults(const std::vector<std::string>& argv) {
  return run_benchmark(faults_spec(), argv, run_faults);
}

}  // namespace cli
}  // namespace paratrain
