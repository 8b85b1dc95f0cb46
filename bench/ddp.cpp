// paratrain bench ddp: DDP step time against the physical limit and against PyTorch's own DDP.
//
// For each workload (the mlp at batch 64 per rank, a CIFAR-style ResNet-18 at batch 16 per rank),
// 2 ranks with 1 thread each, run one after the other in one invocation:
//   paratrain       paratrain::DistributedDataParallel on each backend of --backend (default
//                   gloo, and mpi when built)
//   independent     two single-process trainers of the same model at the same time, no
//                   communication: the limit of data parallelism on this machine
//   pytorch-VERSION torch.nn.parallel.DistributedDataParallel of each anchor Python (anchors.h:
//                   Debian's 1.13.1 and PyPI's 2.15.0), via bench/ddp_pytorch.py, on each backend
//                   of --backend its torch.distributed has (gloo; mpi only in a PyTorch built
//                   with it)
// The headline compares the same backend on both sides; paratrain's fastest backend also gets a
// ratio to the fastest PyTorch on any backend, labelled as its best backend. The target: a step
// of paratrain at most 1.0x the fastest PyTorch's on the same backend.
// A step is zero_grad + forward + loss + backward + optimizer step on a fixed random batch; each
// process takes the median of its timed steps and a row reports the slowest process's median.
//
// Hidden communication: the time DDP still waits for bucket reductions when backward ends
// (exposed), against the time the same bucket allreduces take alone after training:
// hidden = 1 - exposed / alone.
//
// --trace FILE: the DDP run also writes a Chrome trace of its timed steps (forward, backward, the
// optimizer step, each bucket's allreduce from launch to wait, and DDP's exposed wait), and the
// report adds, from the trace, backward's time and the wait in it after its compute ended.

#include "anchors.h"
#include "args.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <tuple>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

// The trace of one paratrain run: FILE itself when it is the only one, else FILE with the
// workload and backend before its extension (trace.json -> trace.mlp.gloo.json); `tag` is
// "mlp.gloo", or the part of it that varies.
std::string trace_path(const std::string& file, const std::string& tag) {
  if (tag.empty()) {
    return file;
  }
  const size_t dot = file.rfind('.');
  const size_t slash = file.rfind('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) {
    return file + "." + tag;
  }
  return file.substr(0, dot) + "." + tag + file.substr(dot);
}

// From a merged trace: the median over ranks and steps of the backward span, and of DDP's
// exposed wait inside it (from the end of backward's compute until the last bucket's allreduce
// is done). A bucket's own span ends at its wait, so only the exposed wait tells what the
// network cost the step.
struct TracedBackward {
  double backward_seconds;
  double exposed_seconds;
};

TracedBackward backward_in_trace(const std::string& path) {
  std::ifstream in(path);
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::vector<double> backward, exposed;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("ph", "") != "X") {
      continue;
    }
    const double seconds = e.at("dur").get<double>() * 1e-6;
    const std::string name = e.at("name").get<std::string>();
    if (name == "backward") {
      backward.push_back(seconds);
    } else if (name == "allreduce wait (exposed)") {
      exposed.push_back(seconds);
    }
  }
  if (backward.empty() || exposed.size() != backward.size()) {
    throw std::runtime_error("the trace " + path + " has " + std::to_string(backward.size()) +
                             " backward spans and " + std::to_string(exposed.size()) +
                             " allreduce waits: expected one of each per step and rank");
  }
  return {median(backward), median(exposed)};
}

const BenchSpec& ddp_spec() {
  static const BenchSpec spec{
      "ddp",
      "DDP step time against independent trainers and PyTorch's DDP, on the same kernels.",
      {
          {"workloads", "LIST", "mlp, resnet18, ... (default mlp,resnet18)", "mlp"},
          {"backend", "LIST", "paratrain's backends: gloo, mpi (default both, mpi when built)"},
          {"steps", "N", "timed steps per workload", "1"},
          {"gradient-as-bucket-view", "", "DDP's gradient_as_bucket_view"},
          {"no-pytorch", "", "skip PyTorch's DDP rows"},
          {"python", "LIST", anchor_pythons_help("with torch for the PyTorch rows")},
          {"trace", "FILE",
           "also write a Chrome trace of paratrain's DDP steps and print how much of the "
           "allreduce time backward hides; with several workloads or backends, one file each "
           "(trace.json: trace.mlp.gloo.json, ...)"},
          {"mode", "M", kInternalOption},
          {"workload", "W", kInternalOption},
      },
      "print JSON",
      /*workers=*/true};
  return spec;
}

// Merges every rank's trace of the timed steps into `file` (rank 0 writes it).
void write_merged_trace(trace::Tracer& tracer,
                        const dist::ProcessGroupPtr& pg,
                        const std::string& file) {
  trace::set_current(nullptr);
  tracer.write(file + ".rank-" + std::to_string(pg->rank()));
  pg->barrier()->wait();
  if (pg->rank() == 0) {
    std::vector<std::string> parts;
    for (int r = 0; r < pg->size(); ++r) {
      parts.push_back(file + ".rank-" + std::to_string(r));
    }
    trace::merge(parts, file);
    for (const auto& part : parts) {
      std::remove(part.c_str());
    }
  }
}

// The timed steps of one process: each one's seconds, and DDP's exposed wait in each.
struct StepTimes {
  std::vector<double> seconds;
  std::vector<double> exposed;
};

StepTimes timed_steps(const Workload& w,
                      torch::nn::Sequential& model,
                      DistributedDataParallel* ddp,
                      const dist::ProcessGroupPtr& pg,
                      const std::string& trace_file) {
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  torch::Tensor x = torch::randn(w.shape);
  torch::Tensor y = torch::randint(0, 10, {w.batch});
  StepTimes out;
  std::unique_ptr<trace::Tracer> tracer;
  for (int step = 0; step < w.warmup + w.steps; ++step) {
    if (pg) {
      pg->barrier()->wait();
    }
    if (step == w.warmup && !trace_file.empty()) {  // the timed steps only
      tracer = std::make_unique<trace::Tracer>(pg->rank());
      trace::set_current(tracer.get());
    }
    auto t0 = Clock::now();
    opt.zero_grad();
    torch::Tensor loss;
    {
      trace::Span span("forward", "compute");
      auto logits = ddp ? ddp->forward(x) : model->forward(x);
      loss = torch::nn::functional::cross_entropy(logits, y);
    }
    {
      trace::Span span("backward", "compute");
      loss.backward();
    }
    {
      trace::Span span("optimizer step", "compute");
      opt.step();
    }
    const double seconds = seconds_since(t0);
    if (step >= w.warmup) {
      out.seconds.push_back(seconds);
      if (ddp) {
        out.exposed.push_back(ddp->last_exposed_comm_seconds());
      }
    }
  }
  if (tracer) {
    write_merged_trace(*tracer, pg, trace_file);
  }
  return out;
}

// DDP's bucket reductions with nothing else running: the median time of all of them, and how
// many buckets there are.
struct BucketComm {
  double seconds;
  size_t buckets;
};

BucketComm comm_alone(const torch::nn::Sequential& model,
                      const DistributedDataParallel& ddp,
                      const dist::ProcessGroupPtr& pg) {
  std::vector<double> alone;
  std::vector<at::Tensor> buckets;
  std::vector<torch::Tensor> trainable;  // the parameters DDP indexes: those needing a gradient
  for (const auto& p : model->parameters()) {
    if (p.requires_grad()) {
      trainable.push_back(p);
    }
  }
  for (const auto& b : ddp.bucket_assignment()) {
    int64_t n = 0;
    for (size_t i : b) {
      n += trainable[i].numel();
    }
    buckets.push_back(torch::ones({n}));
  }
  for (int rep = 0; rep < 5; ++rep) {
    pg->barrier()->wait();
    auto t0 = Clock::now();
    std::vector<dist::WorkPtr> works;
    for (auto& b : buckets) {
      works.push_back(pg->allreduce(b));
    }
    for (auto& work : works) {
      work->wait();
    }
    alone.push_back(seconds_since(t0));
  }
  return {median(alone), buckets.size()};
}

// One process of a measured system.
int run_ddp_worker(const Bench& bench) {
  torch::set_num_threads(1);
  const std::string mode = bench.get("mode");
  const Workload w = bench_workload(bench.get("workload"), bench);
  dist::ProcessGroupPtr pg;
  if (mode == "ddp") {
    pg = dist::init_process_group();
  }
  torch::manual_seed(0);
  auto model = models::make(w.model);
  std::unique_ptr<DistributedDataParallel> ddp;
  if (pg) {
    ddp = std::make_unique<DistributedDataParallel>(
        model, pg, DDPOptions().gradient_as_bucket_view(bench.has("gradient-as-bucket-view")));
  }
  const StepTimes steps = timed_steps(w, model, ddp.get(), pg, ddp ? bench.get("trace", "") : "");
  // Each process's median step, then the slowest process: the same statistic for every system
  // (the independent trainers cannot be timed step by step together).
  double step_seconds = median(steps.seconds);
  if (pg) {
    at::Tensor t = torch::tensor({step_seconds}, torch::kDouble);
    pg->allreduce(t, dist::ReduceOp::kMax)->wait();
    step_seconds = t.item<double>();
  }
  JsonRow row{{"workload", w.name},
              {"system", mode == "ddp" ? "paratrain" : "independent"},
              {"ranks", 2},
              {"step_seconds", step_seconds},
              {"steps", steps.seconds.size()}};
  if (ddp) {
    const BucketComm comm = comm_alone(model, *ddp, pg);
    const double exposed = median(steps.exposed);
    row["backend"] = pg->backend_name();
    row["comm_seconds"] = comm.seconds;
    row["exposed_comm_seconds"] = exposed;
    row["hidden_comm_fraction"] =
        comm.seconds > 0 ? std::clamp(1.0 - exposed / comm.seconds, 0.0, 1.0) : 1.0;
    row["buckets"] = comm.buckets;
  } else {
    const char* rank = std::getenv("RANK");
    row["process"] = rank ? std::atoi(rank) : 0;
  }
  if (!pg || pg->rank() == 0) {
    append_row(bench.get("out"), row);
  }
  return 0;
}

// --trace names a file this process can write: said now, not after the measurements.
void check_trace_file(const Bench& bench) {
  if (!bench.has("trace")) {
    return;
  }
  const std::filesystem::path path(bench.get("trace"));
  if (path.filename().empty()) {
    throw UsageError("--trace '" + bench.get("trace") + "' names no file: give e.g. trace.json");
  }
  const std::string dir = path.parent_path().string();
  if (::access(dir.empty() ? "." : dir.c_str(), W_OK) != 0) {
    throw UsageError("cannot write the --trace file " + bench.get("trace") + ": " +
                     std::strerror(errno));
  }
}

// Where the systems run and write their rows.
struct DdpJobs {
  std::vector<std::string> workloads;
  std::vector<std::string> backends;  // paratrain's, in order
  std::vector<AnchorPython> anchors;  // empty when the PyTorch rows are skipped
  std::string script;
  std::string out;
};

// The trace file of paratrain's run of workload `name` on `backend`, "" without --trace.
std::string ddp_trace(const Bench& bench,
                      const DdpJobs& jobs,
                      const std::string& name,
                      const std::string& backend) {
  if (!bench.has("trace")) {
    return "";
  }
  std::string tag = jobs.workloads.size() > 1 ? name : "";
  if (jobs.backends.size() > 1) {
    tag += (tag.empty() ? "" : ".") + backend;
  }
  return trace_path(bench.get("trace"), tag);
}

// Workload `name` on every system, one job after the other.
void measure_workload(const Bench& bench, const DdpJobs& jobs, const std::string& name) {
  const Workload w = bench_workload(name, bench);
  std::vector<std::string> extra{"--workload", name};
  for (const auto& word : bench.forwarded({"steps", "gradient-as-bucket-view"})) {
    extra.push_back(word);
  }
  for (const auto& backend : jobs.backends) {
    bench.progress("measuring " + name + ": paratrain DDP (" + backend + ")...");
    auto ddp_cmd = bench.worker_command(jobs.out, extra);
    ddp_cmd.insert(ddp_cmd.end(), {"--mode", "ddp"});
    const std::string trace = ddp_trace(bench, jobs, name, backend);
    if (!trace.empty()) {
      ddp_cmd.insert(ddp_cmd.end(), {"--trace", trace});
    }
    run_bench_job(ddp_cmd, 2, backend, jobs.out);
  }
  bench.progress("measuring " + name + ": two independent trainers...");
  auto single_cmd = bench.worker_command(jobs.out, extra);
  single_cmd.insert(single_cmd.end(), {"--mode", "single"});
  run_bench_job(single_cmd, 2, "", jobs.out);
  for (const auto& a : jobs.anchors) {
    for (const auto& backend : jobs.backends) {
      if (!a.has_backend(backend)) {
        continue;  // said once in run_ddp
      }
      bench.progress("measuring " + name + ": PyTorch " + a.torch + " DDP (" + backend + ")...");
      // gloo: the launcher's env:// contract; mpi: through mpirun, as paratrain's.
      run_bench_job({a.python, jobs.script, "--workload", name, "--batch", std::to_string(w.batch),
                     "--steps", std::to_string(w.steps), "--warmup", std::to_string(w.warmup),
                     "--backend", backend, "--system", a.label(), "--out", jobs.out},
                    2, backend == "mpi" ? "mpi" : "", jobs.out);
    }
  }
}

// The rows by (workload, system, backend): the independent trainers' is the slower of their two.
using DdpKey = std::tuple<std::string, std::string, std::string>;
using DdpRows = std::map<DdpKey, JsonRow>;

DdpRows collect_rows(const std::string& out, const std::vector<AnchorPython>& anchors) {
  DdpRows rows;
  for (JsonRow row : read_rows(out)) {
    for (const auto& a : anchors) {
      if (string_field(row, "system") == a.label()) {
        mark_anchor(row, a, a.torch);
        row["mpi_available"] = a.mpi;
      }
    }
    const DdpKey key{string_field(row, "workload"), string_field(row, "system"),
                     string_field(row, "backend")};
    if (!rows.count(key) ||
        number_field(row, "step_seconds") > number_field(rows[key], "step_seconds")) {
      rows[key] = row;
    }
  }
  std::remove(out.c_str());
  return rows;
}

// The fastest PyTorch row of `workload` on `backend` ("": on any backend); null when none.
const JsonRow* fastest_pytorch(const DdpRows& rows,
                               const std::string& workload,
                               const std::string& backend) {
  const JsonRow* best = nullptr;
  for (const auto& [key, row] : rows) {
    const bool anchor = is_anchor_system(std::get<1>(key));
    if (anchor && std::get<0>(key) == workload &&
        (backend.empty() || std::get<2>(key) == backend) &&
        (!best || number_field(row, "step_seconds") < number_field(*best, "step_seconds"))) {
      best = &row;
    }
  }
  return best;
}

// One paratrain row with its ratios: to the independent trainers; to each PyTorch on its backend
// and to the fastest of them (the headline, like with like); and on paratrain's fastest backend,
// to the fastest PyTorch on any backend.
void add_ratios(DdpRows& rows, JsonRow& row, double indep, bool best_backend) {
  const std::string workload = string_field(row, "workload"),
                    backend = string_field(row, "backend");
  const double ours = number_field(row, "step_seconds");
  row["ratio_to_independent"] = ours / indep;
  for (const auto& [key, other] : rows) {
    if (std::get<0>(key) == workload && std::get<2>(key) == backend &&
        is_anchor_system(std::get<1>(key))) {
      row["ratio_to_" + std::get<1>(key)] = ours / number_field(other, "step_seconds");
    }
  }
  if (const JsonRow* same = fastest_pytorch(rows, workload, backend)) {
    row["ratio_to_pytorch"] = ours / number_field(*same, "step_seconds");
    row["fastest_pytorch"] = string_field(*same, "system");
  }
  row["best_backend"] = best_backend;
  const JsonRow* any = fastest_pytorch(rows, workload, "");
  if (best_backend && any) {
    row["best_ratio_to_pytorch"] = ours / number_field(*any, "step_seconds");
    row["best_against"] = string_field(*any, "system") + " (" + string_field(*any, "backend") + ")";
  }
}

// What the report of one workload says beyond its rows: paratrain's rows with their ratios (and
// trace findings), one per backend, and the targets.
struct DdpSummary {
  std::string name;
  std::vector<JsonRow> ours;
  std::vector<Target> targets;
};

void add_trace(JsonRow& row, const std::string& traced) {
  const TracedBackward tb = backward_in_trace(traced);
  const double alone = number_field(row, "comm_seconds");
  row["trace"] = traced;
  row["trace_backward_seconds"] = tb.backward_seconds;
  row["trace_exposed_seconds"] = tb.exposed_seconds;
  row["trace_hidden_fraction"] =
      alone > 0 ? std::clamp(1.0 - tb.exposed_seconds / alone, 0.0, 1.0) : 1.0;
}

DdpSummary summarize(const Bench& bench,
                     const DdpJobs& jobs,
                     DdpRows& rows,
                     const std::string& name) {
  DdpSummary s;
  s.name = name;
  const double indep = number_field(rows[{name, "independent", ""}], "step_seconds");
  std::string best;
  for (const auto& b : jobs.backends) {
    if (best.empty() || number_field(rows[{name, "paratrain", b}], "step_seconds") <
                            number_field(rows[{name, "paratrain", best}], "step_seconds")) {
      best = b;
    }
  }
  for (const auto& b : jobs.backends) {
    JsonRow row = rows[{name, "paratrain", b}];
    add_ratios(rows, row, indep, b == best && jobs.backends.size() > 1);
    note_smoke_skip(bench, row);
    const std::string traced = ddp_trace(bench, jobs, name, b);
    if (!traced.empty()) {
      add_trace(row, traced);
    }
    if (row.contains("ratio_to_pytorch")) {
      s.targets.push_back({"ddp-step " + name + " " + b,
                           string_field(row, "fastest_pytorch") + " (" + b + ")",
                           {{"ratio", number_field(row, "ratio_to_pytorch"), 1.0, true}}});
    }
    s.ours.push_back(row);
  }
  return s;
}

void print_ddp_json(const Bench& bench, DdpRows& rows, const DdpSummary& s) {
  for (const auto& row : s.ours) {
    print_row(row);
  }
  for (const auto& [key, row] : rows) {
    if (std::get<0>(key) == s.name && std::get<1>(key) != "paratrain") {
      print_row(row);
    }
  }
  for (const auto& t : s.targets) {
    print_target(bench, t);
  }
}

// The paratrain row of one backend, as lines of the report.
void print_ours_text(const JsonRow& row) {
  const std::string backend = string_field(row, "backend");
  std::cout << std::fixed << std::setprecision(2);
  std::cout << "  paratrain / independent (" << backend
            << ") = " << number_field(row, "ratio_to_independent") << "x";
  for (const auto& [key, value] : row.items()) {
    if (key.rfind("ratio_to_pytorch-", 0) == 0) {
      std::cout << ", paratrain / PyTorch " << key.substr(17) << " (" << backend
                << ") = " << value.get<double>() << "x";
    }
  }
  if (row.value("best_backend", false) && row.contains("best_ratio_to_pytorch")) {
    std::cout << "\n  paratrain's best backend (" << backend << ") / fastest PyTorch ("
              << string_field(row, "best_against")
              << ") = " << number_field(row, "best_ratio_to_pytorch") << "x";
  }
  std::cout << "\n  communication hidden behind backward (" << backend
            << "): " << std::setprecision(0) << 100 * number_field(row, "hidden_comm_fraction")
            << "% (" << static_cast<int64_t>(number_field(row, "buckets"))
            << " buckets, allreduce alone " << std::setprecision(2)
            << 1e3 * number_field(row, "comm_seconds") << " ms, exposed "
            << 1e3 * number_field(row, "exposed_comm_seconds") << " ms)\n";
  if (row.contains("trace")) {
    std::cout << "  in the trace (" << string_field(row, "trace") << "): backward "
              << number_field(row, "trace_backward_seconds") * 1e3
              << " ms, of which waiting for allreduce after its compute "
              << number_field(row, "trace_exposed_seconds") * 1e3 << " ms: " << std::setprecision(0)
              << 100 * number_field(row, "trace_hidden_fraction")
              << "% of the allreduce time hidden (medians)\n";
  }
}

void print_ddp_text(const Bench& bench, DdpRows& rows, const DdpSummary& s) {
  std::cout << s.name << " (2 ranks x 1 thread):\n";
  auto line = [](const std::string& what, const JsonRow& row, const std::string& note) {
    std::cout << "  " << std::left << std::setw(30) << what << std::right << std::fixed
              << std::setprecision(1) << std::setw(8) << number_field(row, "step_seconds") * 1e3
              << " ms/step" << note << "\n";
  };
  for (const auto& row : s.ours) {
    line("paratrain DDP (" + string_field(row, "backend") + ")", row,
         row.value("best_backend", false) ? "  (paratrain's best backend)" : "");
  }
  line("independent x2", rows[{s.name, "independent", ""}], "");
  for (const auto& [key, row] : rows) {
    if (std::get<0>(key) == s.name && is_anchor_system(std::get<1>(key))) {
      line("PyTorch " + string_field(row, "anchor_version") + " DDP (" + std::get<2>(key) + ")",
           row, "");
    }
  }
  for (const auto& row : s.ours) {
    print_ours_text(row);
  }
  for (const auto& t : s.targets) {
    print_target(bench, t);
  }
}

// The anchors' backends: which of --backend each PyTorch lacks, said once.
void say_missing_backends(const Bench& bench, const DdpJobs& jobs) {
  for (const auto& a : jobs.anchors) {
    for (const auto& b : jobs.backends) {
      if (!a.has_backend(b)) {
        bench.info() << "PyTorch " << a.torch << " (" << a.python << ") has no " << b
                     << " backend (torch.distributed.is_" << b
                     << "_available() is False): paratrain's " << b << " rows have no PyTorch "
                     << "beside them" << std::endl;
      }
    }
  }
}

int run_ddp(const Bench& bench) {
  DdpJobs jobs;
  jobs.workloads = bench_workloads(bench);
  jobs.backends = cpu_backends(bench, "backend", {"gloo", "mpi"});
  jobs.anchors = anchor_pythons(bench);
  jobs.script = jobs.anchors.empty() ? "" : bench_script("ddp_pytorch.py");
  check_trace_file(bench);
  say_missing_backends(bench, jobs);
  jobs.out = results_file("ddp");
  for (const auto& name : jobs.workloads) {
    measure_workload(bench, jobs, name);
  }
  DdpRows rows = collect_rows(jobs.out, jobs.anchors);
  for (const auto& name : jobs.workloads) {
    const DdpSummary s = summarize(bench, jobs, rows, name);
    if (bench.json()) {
      print_ddp_json(bench, rows, s);
    } else {
      print_ddp_text(bench, rows, s);
    }
  }
  std::cout.flush();
  return 0;
}

}  // namespace

int run_bench_ddp(const std::vector<std::string>& argv) {
  return run_benchmark(ddp_spec(), argv, run_ddp, run_ddp_worker);
}

}  // namespace cli
}  // namespace paratrain
