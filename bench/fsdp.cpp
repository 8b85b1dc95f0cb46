// paratrain bench fsdp: memory and time per rank of DDP, ZeRO, FSDP and FSDP with activation
// checkpointing, training one GPT with Adam on 2 ranks (--nproc-per-node; one process and one
// thread each), on the CPU or, with --device cuda, each rank on its own GPU (--nproc-per-node 1 on
// one GPU).
//
// Beside them, the same training in PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2
// (fully_shard on each block, then the root; with torch.utils.checkpoint on each block for
// fsdp+ckpt) for each anchor Python (anchors.h: Debian's PyTorch 1.13.1, which has no fully_shard,
// and PyPI's 2.15.0), on the CPU over gloo (bench/fsdp_pytorch.py). Every row names its
// framework (paratrain, pytorch-VERSION); a system that an anchor cannot run has a row with the
// exact error. PyTorch's rows have no live-tensor peak, and their RSS holds the interpreter too.
//
// Rows: framework, system, params, ranks, peak_rss_bytes (per rank: the largest rank's getrusage
// peak), peak_tensor_bytes (per rank: the largest rank's peak of live tensor bytes on its main
// thread, CPU and GPU, without what the allocators keep of freed memory; see tensor_memory.h),
// rss_before_model_bytes (the largest rank's RSS before the model is built: the process and its
// libraries), step_seconds (median over the timed steps, the slowest rank's), loss (the last
// step's), first loss, and estimate_bytes (the training state per rank the system needs: see
// state_estimate).
//
// A system whose state alone would not fit --memory-per-rank is refused before it starts, with a
// row that says so (refused: the line) instead of a process the kernel kills. The default limit
// is the machine's memory shared by the ranks, as if each rank were a device of that size.
//
// The headline run, a byte-level GPT of 1.2 billion parameters that no rank could hold whole:
//   paratrain bench fsdp --model gpt --layers 24 --width 2048 --heads 16 --vocab 256
//       --context 64 --batch-size 1 --steps 9 --systems ddp,zero,fsdp

#include "anchors.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "harness.h"
#include "tensor_memory.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

const BenchSpec& fsdp_spec() {
  static const BenchSpec spec{
      "fsdp",
      "DDP, ZeRO, FSDP and FSDP with activation checkpointing on one GPT: memory and step time "
      "per rank.",
      {
          {"model", "NAME",
           "gpt2 (default), gpt2-medium, ..., or gpt with --layers/--width/--heads", "gpt"},
          {"layers", "N", "with --model gpt", "2"},
          {"width", "N", "with --model gpt", "32"},
          {"heads", "N", "with --model gpt", "2"},
          {"vocab", "N", "with --model gpt (default 50257)", "64"},
          {"context", "N", "tokens per sequence (default 128)", "16"},
          {"batch-size,batch", "N", "sequences per rank (default 2)", "2"},
          {"steps", "N", "timed steps after one warm-up step (default 5)", "1"},
          {"systems", "LIST", "of ddp, zero, fsdp, fsdp+ckpt (default all)"},
          {"memory-per-rank", "BYTES",
           "refuse a system whose state exceeds this (default: physical memory / ranks)"},
          {"backend", "NAME", "mpi or gloo (default gloo); nccl with --device cuda"},
          {"device", "NAME", "cpu (default) or cuda: rank r on its node's cuda:r"},
          {"nproc-per-node,ranks", "N", "ranks (default 2; 1 with --device cuda on one GPU)"},
          {"no-pytorch", "", "skip PyTorch's rows"},
          {"python", "LIST",
           anchor_pythons_help(
               "with torch for PyTorch's rows (DDP, ZeRO, FSDP2's fully_shard; CPU, gloo)")},
          {"system", "S", kInternalOption},
      },
      "print JSON rows",
      /*workers=*/true};
  return spec;
}

models::GptOptions gpt_shape(const Bench& bench) {
  const std::string name = bench.get("model", "gpt2");
  models::GptOptions o;
  if (name == "gpt") {
    require(bench.has("layers") || bench.smoke(), "--model gpt needs --layers, --width, --heads");
    o.layers(bench.get_int("layers", 12))
        .width(bench.get_int("width", 768))
        .heads(bench.get_int("heads", 12))
        .vocab(bench.get_int("vocab", 50257));
  } else {
    o = models::gpt_options(name);
  }
  return o.context(bench.get_int("context", 128));
}

// Bytes of training state per rank, fp32 with Adam (4 for a weight, 4 for its gradient, 8 for
// the moments): DDP holds it all plus its gradient buckets (4 more); ZeRO shards the moments;
// FSDP shards everything, gathers two blocks at a time, and keeps the root (the embeddings)
// gathered through the step, with its whole gradient at the end. Activations come on top.
int64_t state_estimate(
    const std::string& system, int64_t params, int64_t block, int64_t root, int ranks) {
  if (system == "ddp") {
    return params * 20;
  }
  if (system == "zero") {
    return params * 12 + params * 8 / ranks;
  }
  return params * 16 / ranks + block * 4 * 4 + root * 4 * 3;
}

struct Wrapped {
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::Optimizer> opt;
  torch::Tensor forward(const torch::Tensor& x) { return ddp ? ddp->forward(x) : fsdp->forward(x); }
};

Wrapped wrap(const std::string& system,
             torch::nn::Sequential model,
             const dist::ProcessGroupPtr& pg) {
  Wrapped w;
  auto adam = [](std::vector<torch::optim::OptimizerParamGroup> groups)
      -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(std::move(groups), torch::optim::AdamOptions(3e-4));
  };
  if (system == "ddp" || system == "zero") {
    w.ddp = std::make_unique<DistributedDataParallel>(model, pg);
    if (system == "zero") {
      w.opt = std::make_unique<ZeroRedundancyOptimizer>(model->parameters(), adam, pg);
    } else {
      w.opt = adam({torch::optim::OptimizerParamGroup(model->parameters())});
    }
    return w;
  }
  w.fsdp = std::make_unique<FullyShardedDataParallel>(
      model, pg,
      FsdpOptions()
          .units(models::gpt_block_names(model))
          .activation_checkpointing(system == "fsdp+ckpt"));
  w.opt = adam({torch::optim::OptimizerParamGroup(w.fsdp->parameters())});
  return w;
}

// This process's resident memory now, in bytes.
int64_t current_rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

int run_fsdp_worker(const Bench& bench) {
  torch::set_num_threads(1);
  const std::string system = bench.get("system");
  auto memory = std::make_shared<ReplicaMemory>(1);
  c10::DebugInfoGuard track(c10::DebugInfoKind::PROFILER_STATE, memory);
  auto pg = dist::init_process_group();
  const models::GptOptions shape = gpt_shape(bench);
  const int64_t params = models::gpt_parameter_count(shape);
  torch::manual_seed(0);
  const torch::Device device =
      bench.get("device", "cpu") == "cuda" ? dist::local_device() : torch::Device(torch::kCPU);
  const int64_t before = current_rss_bytes();
  auto model = models::gpt(shape);
  model->to(device);
  Wrapped w = wrap(system, model, pg);
  model = nullptr;
  const int batch = bench.get_int("batch-size", 2);
  const int steps = bench.get_int("steps", 5);
  torch::manual_seed(100 + pg->rank());
  torch::Tensor tokens = torch::randint(0, shape.vocab(), {batch, shape.context() + 1}).to(device);
  torch::Tensor x = tokens.narrow(1, 0, shape.context()), y = tokens.narrow(1, 1, shape.context());
  std::vector<double> times;
  double loss = 0, first = 0;
  for (int step = 0; step <= steps; ++step) {
    pg->barrier()->wait();
    auto t0 = Clock::now();
    w.opt->zero_grad();
    auto logits = w.forward(x);
    auto l = torch::nn::functional::cross_entropy(logits.flatten(0, 1), y.flatten());
    l.backward();
    w.opt->step();
    loss = l.item<double>();  // on a GPU, waits for the step
    first = step == 0 ? loss : first;
    if (step > 0) {
      times.push_back(seconds_since(t0));
    }
    bench.progress("  " + system + " step " + std::to_string(step) + ": loss " +
                   std::to_string(loss));
  }
  at::Tensor t =
      torch::tensor({median(times), static_cast<double>(peak_rss_bytes()),
                     static_cast<double>(memory->peaks()[0]), static_cast<double>(before)},
                    torch::kDouble)
          .to(device);  // where the group moves tensors (nccl: only CUDA ones)
  pg->allreduce(t, dist::ReduceOp::kMax)->wait();
  t = t.cpu();
  if (pg->rank() == 0) {
    append_row(bench.get("out"),
               {{"system", system},
                {"params", params},
                {"ranks", pg->size()},
                {"peak_rss_bytes", static_cast<int64_t>(t[1].item<double>())},
                {"peak_tensor_bytes", static_cast<int64_t>(t[2].item<double>())},
                {"rss_before_model_bytes", static_cast<int64_t>(t[3].item<double>())},
                {"step_seconds", t[0].item<double>()},
                {"first_loss", first},
                {"loss", loss},
                {"steps", steps}});
  }
  return 0;
}

std::string gib(double bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(2) << bytes / (1 << 30) << " GiB";
  return s.str();
}

// The row of a system refused up front, and the line that says why.
JsonRow refused_row(
    const std::string& system, int64_t params, int ranks, int64_t estimate, int64_t limit) {
  const std::string line = system + " needs at least " + gib(static_cast<double>(estimate)) +
                           " of training state per rank for " + std::to_string(params) +
                           " parameters (fp32 Adam), over the " + gib(static_cast<double>(limit)) +
                           " each rank may use; train this model with fsdp";
  return {{"system", system},
          {"params", params},
          {"ranks", ranks},
          {"estimate_bytes", estimate},
          {"refused", line}};
}

// The ratios of each measured row to its own framework's DDP row, and of paratrain's rows to
// each PyTorch's row of the same system.
void add_fsdp_ratios(std::vector<JsonRow>& rows) {
  auto find = [&](const std::string& framework, const std::string& system) -> const JsonRow* {
    for (const auto& row : rows) {
      if (string_field(row, "framework") == framework && string_field(row, "system") == system &&
          row.contains("step_seconds")) {
        return &row;
      }
    }
    return nullptr;
  };
  std::vector<JsonRow> out = rows;
  for (auto& row : out) {
    if (!row.contains("step_seconds")) {
      continue;
    }
    const std::string framework = string_field(row, "framework");
    row["rss_growth_bytes"] =
        number_field(row, "peak_rss_bytes") - number_field(row, "rss_before_model_bytes");
    if (const JsonRow* ddp = find(framework, "ddp")) {
      row["peak_rss_ratio_to_ddp"] =
          number_field(row, "peak_rss_bytes") / number_field(*ddp, "peak_rss_bytes");
      row["step_ratio_to_ddp"] =
          number_field(row, "step_seconds") / number_field(*ddp, "step_seconds");
    }
    if (framework != "paratrain") {
      continue;
    }
    for (const auto& other : rows) {
      const std::string theirs = string_field(other, "framework");
      if (theirs != "paratrain" && other.contains("step_seconds") &&
          string_field(other, "system") == string_field(row, "system")) {
        row["step_ratio_to_" + theirs] =
            number_field(row, "step_seconds") / number_field(other, "step_seconds");
        row["peak_rss_ratio_to_" + theirs] =
            number_field(row, "peak_rss_bytes") / number_field(other, "peak_rss_bytes");
        // What training added to each process, without what the interpreter and PyPI's CUDA
        // libraries hold before (about 0.7 GiB).
        row["rss_growth_ratio_to_" + theirs] =
            number_field(row, "rss_growth_bytes") /
            (number_field(other, "peak_rss_bytes") - number_field(other, "rss_before_model_bytes"));
      }
    }
  }
  rows = out;
}

// One measured row of the table ("of it new": the peak RSS less the RSS before the model).
void print_fsdp_line(const JsonRow& row) {
  std::cout << std::setw(15) << gib(number_field(row, "peak_rss_bytes")) << std::setw(12)
            << gib(number_field(row, "rss_growth_bytes")) << std::setw(14)
            << (row.contains("peak_tensor_bytes") ? gib(number_field(row, "peak_tensor_bytes"))
                                                  : "-")
            << std::fixed << std::setprecision(3) << std::setw(10)
            << number_field(row, "step_seconds");
  if (row.contains("peak_rss_ratio_to_ddp")) {
    std::cout << std::setprecision(2) << number_field(row, "peak_rss_ratio_to_ddp") << "x, "
              << number_field(row, "step_ratio_to_ddp") << "x           ";
  } else {
    std::cout << "-                      ";
  }
  std::cout << std::setprecision(3) << number_field(row, "first_loss") << " -> "
            << number_field(row, "loss") << "\n";
}

// Each row with its ratios (to its framework's DDP, and paratrain's to PyTorch's): JSON rows, or
// a table.
void print_fsdp_rows(const Bench& bench, std::vector<JsonRow> rows) {
  add_fsdp_ratios(rows);
  if (bench.json()) {
    for (const auto& row : rows) {
      print_row(row);
    }
    return;
  }
  std::cout << "framework       system      params       peak RSS/rank  of it new   tensors/rank  "
               "step (s)  vs ddp (memory, time)  loss\n";
  for (const auto& row : rows) {
    std::cout << std::left << std::setw(16) << string_field(row, "framework") << std::setw(12)
              << string_field(row, "system") << std::setw(13)
              << (row.contains("params")
                      ? std::to_string(static_cast<int64_t>(number_field(row, "params")))
                      : "-");
    if (row.contains("refused") || row.contains("error")) {
      std::cout << (row.contains("refused") ? "refused: " + string_field(row, "refused")
                                            : "failed: " + string_field(row, "error"))
                << "\n";
      continue;
    }
    print_fsdp_line(row);
  }
  std::cout.flush();
}

// What every framework runs: the model's sizes, the systems, and the memory each rank may use.
struct FsdpPlan {
  int64_t params = 0, block = 0, root = 0, limit = 0;
  int ranks = 0;
  std::vector<std::string> systems;
  std::vector<AnchorPython> anchors;  // PyTorch's side; empty when skipped
};

FsdpPlan fsdp_plan(const Bench& bench) {
  FsdpPlan p;
  const models::GptOptions shape = gpt_shape(bench);
  p.params = models::gpt_parameter_count(shape);
  p.block = 12 * shape.width() * shape.width() + 13 * shape.width();
  p.root = (shape.vocab() + shape.context() + 2) * shape.width();
  p.ranks = bench.get_int("nproc-per-node", 2);
  const std::string device = bench.get("device", "cpu");
  require(device == "cpu" || device == "cuda",
          "unknown --device '" + device + "': choose cpu or cuda");
  require(p.ranks >= 1, "--nproc-per-node must be at least 1");
  // On a GPU the limit is the device's, which the caching allocator enforces itself.
  p.limit = bench.has("memory-per-rank") ? bench.get_bytes("memory-per-rank", 0)
            : device == "cuda"           ? std::numeric_limits<int64_t>::max()
                                         : physical_memory() / p.ranks;
  p.systems = split_list(bench.get("systems", "ddp,zero,fsdp,fsdp+ckpt"));
  for (const auto& system : p.systems) {
    require(system == "ddp" || system == "zero" || system == "fsdp" || system == "fsdp+ckpt",
            "unknown system '" + system + "' in --systems: choose of ddp, zero, fsdp, fsdp+ckpt");
  }
  // PyTorch's side runs what its script runs: the CPU over gloo.
  if (device == "cpu" && bench.get("backend", "gloo") == "gloo") {
    p.anchors = anchor_pythons(bench);
  } else if (!bench.has("no-pytorch")) {
    std::cerr << "bench fsdp: PyTorch's rows are left out: they run on the CPU over gloo only"
              << std::endl;
  }
  return p;
}

// One system of one framework: its row, or the row that refuses it up front.
JsonRow measure_system(const Bench& bench,
                       const FsdpPlan& p,
                       const std::string& system,
                       const AnchorPython* anchor,
                       const std::string& out) {
  const std::string framework = anchor ? anchor->label() : "paratrain";
  const int64_t estimate = state_estimate(system, p.params, p.block, p.root, p.ranks);
  if (estimate > p.limit) {
    JsonRow row = refused_row(system, p.params, p.ranks, estimate, p.limit);
    row["framework"] = framework;
    std::cerr << "bench fsdp: " << framework << ": " << string_field(row, "refused") << std::endl;
    return row;
  }
  bench.progress("measuring " + framework + " " + system + " (" + std::to_string(p.params) +
                 " parameters)...");
  std::remove(out.c_str());
  if (anchor) {
    // The resolved shape, which the script cannot work out itself (the smoke values, presets).
    const models::GptOptions shape = gpt_shape(bench);
    std::vector<std::string> command{anchor->python, bench_script("fsdp_pytorch.py"),
                                     "--framework",  framework,
                                     "--out",        out,
                                     "--system",     system,
                                     "--model",      "gpt"};
    for (const auto& [flag, value] :
         std::vector<std::pair<std::string, int64_t>>{{"--layers", shape.layers()},
                                                      {"--width", shape.width()},
                                                      {"--heads", shape.heads()},
                                                      {"--vocab", shape.vocab()},
                                                      {"--context", shape.context()},
                                                      {"--batch", bench.get_int("batch-size", 2)},
                                                      {"--steps", bench.get_int("steps", 5)}}) {
      command.insert(command.end(), {flag, std::to_string(value)});
    }
    run_bench_job(command, p.ranks, "", out);
  } else {
    std::vector<std::string> extra{"--system", system};
    for (const auto& word : bench.forwarded({"model", "layers", "width", "heads", "vocab",
                                             "context", "batch-size", "steps", "device"})) {
      extra.push_back(word);
    }
    run_bench_job(bench.worker_command(out, extra), p.ranks, bench.get("backend", "gloo"), out);
  }
  JsonRow row = read_rows(out).at(0);
  row["framework"] = framework;
  row["estimate_bytes"] = estimate;
  if (anchor) {
    mark_anchor(row, *anchor, anchor->torch);
  } else {
    note_smoke_skip(bench, row);
  }
  return row;
}

int run_fsdp_bench(const Bench& bench) {
  const FsdpPlan p = fsdp_plan(bench);
  const std::string out = results_file("fsdp");
  std::vector<JsonRow> rows;
  for (const auto& system : p.systems) {
    rows.push_back(measure_system(bench, p, system, nullptr, out));
  }
  for (const auto& a : p.anchors) {
    for (const auto& system : p.systems) {
      rows.push_back(measure_system(bench, p, system, &a, out));
    }
  }
  std::remove(out.c_str());
  print_fsdp_rows(bench, rows);
  return 0;
}

}  // namespace

int run_bench_fsdp(const std::vector<std::string>& argv) {
  return run_benchmark(fsdp_spec(), argv, run_fsdp_bench, run_fsdp_worker);
}

}  // namespace cli
}  // namespace paratrain
