// paratrain bench optim: one Adam step over a model's worth of fp32 CPU parameters, paratrain's
// fused optimizer against libtorch's and the anchors', side by side.
//
// Each optimizer runs in a process of its own (a 1B-parameter model's parameters, gradients and
// two moments take 16 GB), on --threads intra-op threads, over --params elements cut into
// tensors of at most --tensor-elements (64M: a GPT's largest matrices are a few tens of
// millions). A step is optimizer.step() alone, with the gradients set once; a row holds the
// median of --steps timed steps after --warmup. The optimizers, by their row names:
//   paratrain-fused-adam  optim::FusedAdam (one vectorized pass, optim/fused.h)
//   torch::optim::Adam    libtorch's Adam, this build's libtorch
//   pytorch-fused         torch.optim.Adam(fused=True), PyTorch 2.4 or later (PyPI's venv)
//   pytorch-foreach       torch.optim.Adam(foreach=True), the same Python
//   DeepSpeedCPUAdam      DeepSpeed's CPU Adam (adamw_mode=False), whose op DeepSpeed compiles
//                         on first use for this CPU (its "simd" field says which arithmetic)
// Then the targets: at each size the fused step takes at most 1/3 of libtorch's, and no more
// than DeepSpeedCPUAdam's.

#include "anchors.h"
#include "args.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"

#include "paratrain/base/child_process.h"
#include "paratrain/optim/fused.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

const char* const kFused = "paratrain-fused-adam";
const char* const kLibtorch = "torch::optim::Adam";
const char* const kPytorchFused = "pytorch-fused";
const char* const kPytorchForeach = "pytorch-foreach";
const char* const kDeepSpeed = "DeepSpeedCPUAdam";

const BenchSpec& optim_spec() {
  static const BenchSpec spec{
      "optim",
      "One Adam step over fp32 CPU parameters: paratrain's fused Adam, libtorch's, PyTorch's "
      "fused and foreach, DeepSpeedCPUAdam.",
      {
          {"params", "LIST",
           "parameter counts, comma-separated, with a K, M or B suffix (default: 100 million and 1 "
           "billion)",
           "1M"},
          {"optimizers", "LIST",
           "of paratrain-fused-adam, torch::optim::Adam, pytorch-fused, pytorch-foreach, "
           "DeepSpeedCPUAdam (default: all)"},
          {"steps", "N", "timed steps in each optimizer's process (default 5)", "2"},
          {"repeat", "N",
           "processes of each optimizer, taking turns; a row holds their medians' median "
           "(default 3)",
           "1"},
          {"warmup", "N", "untimed steps first (default 1)", "1"},
          {"threads", "N", "intra-op threads of every optimizer (default: this machine's cores)"},
          {"tensor-elements", "N", "elements of the largest tensor (default 64M)"},
          {"timeout", "SECONDS", "how long one optimizer's process may run (default 1800)"},
          {"huge-pages", "on|off",
           "every optimizer's process takes its large blocks in transparent huge pages "
           "(GLIBC_TUNABLES=glibc.malloc.hugetlb=1), or the machine's default (default on)"},
          {"no-pytorch", "", "skip PyTorch's and DeepSpeed's rows"},
          {"python", "LIST", anchor_pythons_help("with torch 2.4 or later (and deepspeed)")},
          {"optimizer", "NAME", kInternalOption},
          {"count", "N", kInternalOption},
      },
      "print JSON",
      /*workers=*/true};
  return spec;
}

int64_t parse_count(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string suffix = text.substr(used);
  const double scale = suffix.empty()  ? 1
                       : suffix == "K" ? 1e3
                       : suffix == "M" ? 1e6
                       : suffix == "B" ? 1e9
                                       : 0;
  if (used == 0 || scale == 0 || value <= 0) {
    throw UsageError("--params '" + text + "': give counts like 100M or 1B");
  }
  return static_cast<int64_t>(value * scale);
}

int threads_of(const Bench& bench) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = bench.get_int("threads", cores);
  require(threads >= 1, "--threads must be at least 1");
  return threads;
}

int64_t tensor_elements(const Bench& bench) {
  const int64_t n =
      bench.has("tensor-elements") ? parse_count(bench.get("tensor-elements")) : int64_t{64} << 20;
  return n;
}

// The bytes of this process's memory in transparent huge pages (/proc/self/smaps_rollup's
// AnonHugePages): whether the kernel granted them changes a memory-bound step by up to 1.6x, so
// each row says how much it had.
int64_t huge_page_bytes() {
  std::ifstream in("/proc/self/smaps_rollup");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("AnonHugePages:", 0) == 0) {
      return std::atoll(line.c_str() + 14) * 1024;
    }
  }
  return -1;
}

// The worker: the parameters and their gradients, the optimizer, the timed steps; one row.
int run_optim_worker(const Bench& bench) {
  const std::string name = bench.get("optimizer");
  const int64_t count = parse_count(bench.get("count"));
  const int threads = threads_of(bench);
  at::set_num_threads(threads);
  std::vector<torch::Tensor> params;
  for (int64_t left = count; left > 0;) {
    const int64_t size = std::min(left, tensor_elements(bench));
    auto p = torch::empty({size}).uniform_(-0.05, 0.05).requires_grad_();
    p.mutable_grad() = torch::empty({size}).normal_(0, 1e-3);
    params.push_back(p);
    left -= size;
  }
  const auto options = torch::optim::AdamOptions(1e-3);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (name == kFused) {
    opt = std::make_unique<optim::FusedAdam>(params, options);
  } else {
    opt = std::make_unique<torch::optim::Adam>(params, options);
  }
  const int warmup = bench.get_int("warmup", 1), steps = bench.get_int("steps", 5);
  require(steps >= 1 && warmup >= 0, "--steps must be at least 1 and --warmup at least 0");
  std::vector<double> times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = Clock::now();
    opt->step();
    if (s >= warmup) {
      times.push_back(seconds_since(t0));
    }
  }
  JsonRow row{{"optimizer", name},
              {"params", count},
              {"threads", threads},
              {"step_seconds", median(times)},
              {"step_seconds_min", *std::min_element(times.begin(), times.end())},
              {"step_seconds_max", *std::max_element(times.begin(), times.end())},
              {"steps", steps},
              {"peak_rss_bytes", peak_rss_bytes()},
              {"huge_page_bytes", huge_page_bytes()},
              {"anchor_version", name == kFused ? std::string("paratrain-") + optim::fused_isa()
                                                : std::string("libtorch-") + TORCH_VERSION}};
  append_row(bench.get("out"), row);
  return 0;
}

// Roughly what an optimizer holds at its peak: parameters, gradients and two moments, plus the
// full-size temporaries of libtorch's per-tensor step and of the foreach lists.
int64_t estimate_bytes(const std::string& name, int64_t count, int64_t per_tensor) {
  const int64_t base = 16 * count;
  if (name == kLibtorch) {
    return base + 3 * 4 * std::min(count, per_tensor);
  }
  return name == kPytorchForeach ? base + 4 * count : base;
}

// Whether the optimizers' processes take huge pages (--huge-pages): where the machine leaves them
// to the program (transparent_hugepage "madvise"), a memory-bound step varied 1.7x between
// processes in 4 KiB pages, with whatever pages the host backed each with, and not in 2 MiB ones.
bool huge_pages(const Bench& bench) {
  const std::string v = bench.get("huge-pages", "on");
  if (v != "on" && v != "off") {
    throw UsageError("--huge-pages '" + v + "': give on or off");
  }
  return v == "on";
}

// Runs `argv` with the optimizer's threads; its row, or a row saying why there is none.
JsonRow run_one(const Bench& bench,
                const std::vector<std::string>& argv,
                const std::string& name,
                int64_t count,
                const std::string& out) {
  const int64_t need = estimate_bytes(name, count, tensor_elements(bench));
  const int64_t have = physical_memory() * 9 / 10;
  if (need > have) {
    JsonRow row{{"optimizer", name}, {"params", count}, {"step_seconds", nullptr}};
    row["refused"] = "needs about " + std::to_string(need >> 30) + " GiB, over 90% of this " +
                     "machine's " + std::to_string(physical_memory() >> 30) + " GiB";
    std::cerr << "bench optim: " << name << " at " << count << ": " << string_field(row, "refused")
              << std::endl;
    return row;
  }
  bench.progress("measuring " + name + " on " + std::to_string(count) + " parameters...");
  std::remove(out.c_str());
  const std::string threads = std::to_string(threads_of(bench));
  std::map<std::string, std::string> env{{"OMP_NUM_THREADS", threads},
                                         {"MKL_NUM_THREADS", threads}};
  if (huge_pages(bench)) {
    // The same page policy for every system: all of them take their arrays from glibc's malloc.
    const char* given = std::getenv("GLIBC_TUNABLES");  // added to, not replaced
    env["GLIBC_TUNABLES"] = (given != nullptr && *given != '\0' ? std::string(given) + ":" : "") +
                            "glibc.malloc.hugetlb=1";
  }
  ChildProcess child(ChildOptions(argv)
                         .environment(environment_with(env))
                         .inherit_environment(false)
                         .stdout_fd(2));  // the rows go to `out`; what it says, to stderr
  // A hung child (DeepSpeed waits on its build's lock) is one failed row, not a hung benchmark.
  const auto deadline = Clock::now() + std::chrono::seconds(bench.get_int("timeout", 1800));
  int status = 0;
  bool timed_out = false;
  while (!child.try_wait(&status)) {
    if (Clock::now() > deadline) {
      child.signal(SIGKILL);
      status = child.wait();
      timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const int code = exit_code(status);
  const std::vector<JsonRow> rows = code == 0 ? read_rows(out) : std::vector<JsonRow>{};
  if (rows.empty()) {
    JsonRow row{{"optimizer", name}, {"params", count}, {"step_seconds", nullptr}};
    row["error"] = timed_out   ? "timed out (--timeout)"
                   : code == 0 ? std::string("it wrote no row")
                               : "exit status " + std::to_string(code);
    std::cerr << "bench optim: " << name << " at " << count << " parameters failed ("
              << string_field(row, "error") << "); the other rows go on" << std::endl;
    return row;
  }
  return rows.at(0);
}

// "2.15.0" as {2, 15, 0}.
std::vector<int> version_numbers(const std::string& version) {
  std::vector<int> out;
  std::stringstream parts(version);
  for (std::string part; std::getline(parts, part, '.');) {
    out.push_back(std::atoi(part.c_str()));
  }
  return out;
}

bool version_at_least(const std::string& version, const std::vector<int>& least) {
  return version_numbers(version) >= least;  // lexicographic, number by number
}

// The optimizers to run, checked; the anchor Python that runs PyTorch's and DeepSpeed's rows (the
// newest torch among the anchors), or none.
struct OptimPlan {
  std::vector<int64_t> counts;
  std::vector<std::string> optimizers;
  const AnchorPython* anchor = nullptr;
  bool deepspeed = false;
  std::vector<AnchorPython> anchors;
};

OptimPlan optim_plan(const Bench& bench) {
  OptimPlan p;
  for (const auto& word : split_list(bench.get("params", "100M,1B"))) {
    p.counts.push_back(parse_count(word));
  }
  const std::vector<std::string> all{kFused, kLibtorch, kPytorchFused, kPytorchForeach, kDeepSpeed};
  p.optimizers = bench.has("optimizers") ? split_list(bench.get("optimizers")) : all;
  for (const auto& name : p.optimizers) {
    if (std::find(all.begin(), all.end(), name) == all.end()) {
      throw UsageError("unknown optimizer '" + name +
                       "' in --optimizers: choose of paratrain-fused-adam, torch::optim::Adam, "
                       "pytorch-fused, pytorch-foreach, DeepSpeedCPUAdam");
    }
  }
  p.anchors = anchor_pythons(bench);
  for (const auto& a : p.anchors) {  // the newest: fused CPU Adam came with PyTorch 2.4
    if (version_at_least(a.torch, {2, 4}) &&
        (p.anchor == nullptr || version_at_least(a.torch, version_numbers(p.anchor->torch)))) {
      p.anchor = &a;
    }
  }
  if (p.anchor == nullptr && !p.anchors.empty()) {
    std::cerr
        << "bench optim: no anchor Python has PyTorch 2.4 or later (CPU Adam(fused=True)): no "
           "PyTorch rows (bash scripts/venv.sh --bench makes one)"
        << std::endl;
  }
  p.deepspeed = p.anchor != nullptr && !p.anchor->package("deepspeed").empty();
  if (p.anchor != nullptr && !p.deepspeed) {
    std::cerr << "bench optim: " << p.anchor->python
              << " has no deepspeed: no DeepSpeedCPUAdam rows (bash scripts/venv.sh --bench "
                 "installs it)"
              << std::endl;
  }
  return p;
}

// The row of one optimizer at one size (nothing when its side is skipped).
std::vector<JsonRow> measure(const Bench& bench,
                             const OptimPlan& p,
                             const std::string& name,
                             int64_t count,
                             const std::string& out) {
  const bool cpp = name == kFused || name == kLibtorch;
  if (!cpp && (p.anchor == nullptr || (name == kDeepSpeed && !p.deepspeed))) {
    return {};
  }
  std::vector<std::string> argv;
  if (cpp) {
    argv = bench.worker_command(out, {"--optimizer", name, "--count", std::to_string(count),
                                      "--threads", std::to_string(threads_of(bench)), "--steps",
                                      std::to_string(bench.get_int("steps", 5)), "--warmup",
                                      std::to_string(bench.get_int("warmup", 1)),
                                      "--tensor-elements", std::to_string(tensor_elements(bench))});
  } else {
    argv = {p.anchor->python,
            bench_script("optim_pytorch.py"),
            "--optimizer",
            name,
            "--params",
            std::to_string(count),
            "--tensor-elements",
            std::to_string(tensor_elements(bench)),
            "--threads",
            std::to_string(threads_of(bench)),
            "--steps",
            std::to_string(bench.get_int("steps", 5)),
            "--warmup",
            std::to_string(bench.get_int("warmup", 1)),
            "--out",
            out};
  }
  JsonRow row = run_one(bench, argv, name, count, out);
  if (!cpp) {
    row["anchor_python"] = p.anchor->python;
  }
  return {row};
}

// The fused step's time against another's at each size: at most `bound` of it.
void print_targets(const Bench& bench, const std::vector<JsonRow>& rows) {
  auto seconds = [&](const std::string& name, int64_t count) {
    for (const auto& r : rows) {
      if (string_field(r, "optimizer") == name && number_field(r, "params") == count &&
          r.contains("step_seconds") && r["step_seconds"].is_number()) {
        return r["step_seconds"].get<double>();
      }
    }
    return -1.0;
  };
  std::vector<int64_t> counts;
  for (const auto& r : rows) {
    const auto c = static_cast<int64_t>(number_field(r, "params"));
    if (std::find(counts.begin(), counts.end(), c) == counts.end()) {
      counts.push_back(c);
    }
  }
  for (int64_t c : counts) {
    const double fused = seconds(kFused, c);
    for (const auto& [against, bound] :
         std::vector<std::pair<std::string, double>>{{kLibtorch, 1.0 / 3}, {kDeepSpeed, 1.0}}) {
      const double other = seconds(against, c);
      if (fused > 0 && other > 0) {
        print_target(bench, Target{"optim-step " + std::to_string(c),
                                   against,
                                   {{"ratio", fused / other, bound, true}}});
      }
    }
  }
}

void print_optim_rows(const Bench& bench, const std::vector<JsonRow>& rows) {
  for (const auto& row : rows) {
    if (bench.json()) {
      print_row(row);
      continue;
    }
    std::cout << std::left << std::setw(22) << string_field(row, "optimizer") << std::right
              << std::setw(12) << static_cast<int64_t>(number_field(row, "params")) << " params  ";
    if (row.contains("refused") || row.contains("error")) {
      std::cout << (row.contains("refused") ? "refused: " + string_field(row, "refused")
                                            : "failed: " + string_field(row, "error"))
                << "\n";
      continue;
    }
    std::cout << std::fixed << std::setprecision(4) << number_field(row, "step_seconds")
              << " s per step  " << std::setprecision(2)
              << number_field(row, "peak_rss_bytes") / double(1 << 30) << " GiB peak, "
              << number_field(row, "huge_page_bytes") / double(1 << 30) << " in huge pages  "
              << string_field(row, "anchor_version") << "\n";
  }
  print_targets(bench, rows);
  std::cout.flush();
}

// One row per optimizer and size from its --repeat processes: the median of their medians, and
// each process's median in `step_seconds_runs`. The processes of the optimizers take turns, so
// that what changes over minutes on a shared machine (the memory the host backs a process with)
// falls on all of them alike.
std::vector<JsonRow> combine_repeats(const std::vector<std::vector<JsonRow>>& runs) {
  std::vector<JsonRow> out;
  for (size_t i = 0; !runs.empty() && i < runs[0].size(); ++i) {
    // The fields of the first process that measured (a failed one wrote none of its own).
    JsonRow row = runs[0][i];
    std::vector<double> seconds;
    int failed = 0;
    for (const auto& run : runs) {
      const JsonRow& r = run.at(i);
      if (r.contains("step_seconds") && r["step_seconds"].is_number()) {
        if (seconds.empty()) {
          row = r;
        }
        seconds.push_back(r["step_seconds"].get<double>());
      } else if (r.contains("error")) {
        ++failed;
      }
    }
    if (!seconds.empty()) {
      row.erase("error");
      if (failed > 0) {
        row["failed_runs"] = failed;
      }
    }
    row["step_seconds_runs"] = seconds;
    row["step_seconds"] = seconds.empty() ? JsonRow(nullptr) : JsonRow(median(seconds));
    if (!seconds.empty()) {
      row["step_seconds_min"] = *std::min_element(seconds.begin(), seconds.end());
      row["step_seconds_max"] = *std::max_element(seconds.begin(), seconds.end());
    }
    out.push_back(row);
  }
  return out;
}

int run_optim_bench(const Bench& bench) {
  const OptimPlan p = optim_plan(bench);
  const int repeat = bench.get_int("repeat", 3);
  require(repeat >= 1, "--repeat must be at least 1");
  const std::string out = results_file("optim");
  std::vector<std::vector<JsonRow>> runs(static_cast<size_t>(repeat));
  for (int64_t count : p.counts) {
    for (auto& run : runs) {
      for (const auto& name : p.optimizers) {
        for (auto& row : measure(bench, p, name, count, out)) {
          run.push_back(std::move(row));
        }
      }
    }
  }
  std::remove(out.c_str());
  print_optim_rows(bench, combine_repeats(runs));
  return 0;
}

}  // namespace

int run_bench_optim(const std::vector<std::string>& argv) {
  return run_benchmark(optim_spec(), argv, run_optim_bench, run_optim_worker);
}

}  // namespace cli
}  // namespace paratrain
