// paratrain bench ddp: DDP step time against the physical limit and against PyTorch's own DDP.
//
// For each workload (the mlp at batch 64 per rank, a CIFAR-style ResNet-18 at batch 16 per rank),
// 2 ranks with 1 thread each, run one after the other in one invocation:
//   paratrain    paratrain::DistributedDataParallel (mpi backend when built, else gloo)
//   independent  two single-process trainers of the same model at the same time, no
//                communication: the limit of data parallelism on this machine
//   pytorch      torch.nn.parallel.DistributedDataParallel from Debian's python3-torch (the same
//                libtorch build), gloo, via bench/ddp_pytorch.py
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

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

// The trace of workload `name`: FILE itself for one workload, else FILE with the name before
// its extension (trace.json -> trace.mlp.json).
std::string trace_path(const std::string& file, const std::string& name, size_t workloads) {
  if (workloads == 1) {
    return file;
  }
  const size_t dot = file.rfind('.');
  const size_t slash = file.rfind('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) {
    return file + "." + name;
  }
  return file.substr(0, dot) + "." + name + file.substr(dot);
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
          {"backend", "NAME", "mpi or gloo"},
          {"steps", "N", "timed steps per workload", "1"},
          {"gradient-as-bucket-view", "", "DDP's gradient_as_bucket_view"},
          {"no-pytorch", "", "skip PyTorch's DDP row"},
          {"python", "P",
           "the Python with torch for the PyTorch row (default: python3 on PATH or "
           "/usr/bin/python3, whichever imports torch; or PARATRAIN_PYTHON)"},
          {"trace", "FILE",
           "also write a Chrome trace of paratrain's DDP steps and print how much of the "
           "allreduce time backward hides; with several workloads, one file each "
           "(trace.json: trace.mlp.json, trace.resnet18.json)"},
          {"mode", "M", ""},
          {"workload", "W", ""},
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
  std::string backend;
  std::string python;  // "" when the PyTorch row is skipped
  std::string script;
  std::string out;
};

// Workload `name` on the three systems, one job after the other.
void measure_workload(const Bench& bench, const DdpJobs& jobs, const std::string& name) {
  const Workload w = bench_workload(name, bench);
  std::vector<std::string> extra{"--workload", name};
  for (const auto& word : bench.forwarded({"steps", "gradient-as-bucket-view"})) {
    extra.push_back(word);
  }
  bench.progress("measuring " + name + ": paratrain DDP (" + jobs.backend + ")...");
  auto ddp_cmd = bench.worker_command(jobs.out, extra);
  ddp_cmd.insert(ddp_cmd.end(), {"--mode", "ddp"});
  if (bench.has("trace")) {
    ddp_cmd.insert(ddp_cmd.end(),
                   {"--trace", trace_path(bench.get("trace"), name, jobs.workloads.size())});
  }
  run_bench_job(ddp_cmd, 2, jobs.backend, jobs.out);
  bench.progress("measuring " + name + ": two independent trainers...");
  auto single_cmd = bench.worker_command(jobs.out, extra);
  single_cmd.insert(single_cmd.end(), {"--mode", "single"});
  run_bench_job(single_cmd, 2, "", jobs.out);
  if (!jobs.python.empty()) {
    bench.progress("measuring " + name + ": PyTorch DDP (gloo)...");
    run_bench_job({jobs.python, jobs.script, "--workload", name, "--batch", std::to_string(w.batch),
                   "--steps", std::to_string(w.steps), "--warmup", std::to_string(w.warmup),
                   "--out", jobs.out},
                  2, "", jobs.out);
  }
}

// One row per (workload, system): the independent trainers' is the slower of their two.
using DdpRows = std::map<std::pair<std::string, std::string>, JsonRow>;

DdpRows collect_rows(const std::string& out) {
  DdpRows rows;
  for (const JsonRow& row : read_rows(out)) {
    const auto key = std::make_pair(string_field(row, "workload"), string_field(row, "system"));
    if (!rows.count(key) ||
        number_field(row, "step_seconds") > number_field(rows[key], "step_seconds")) {
      rows[key] = row;
    }
  }
  std::remove(out.c_str());
  return rows;
}

// What the report of one workload says beyond its rows.
struct DdpSummary {
  std::string name;
  double ours = 0, indep = 0, theirs = 0;  // step seconds: paratrain, independent, PyTorch
  bool have_pt = false;
  std::string traced;  // the trace file, "" without --trace
  TracedBackward tb{0, 0};
  double trace_hidden = 1;
};

DdpSummary summarize(const Bench& bench, DdpRows& rows, const std::string& name, size_t workloads) {
  DdpSummary s;
  s.name = name;
  auto step = [&](const char* system) {
    return number_field(rows[{name, system}], "step_seconds");
  };
  s.ours = step("paratrain");
  s.indep = step("independent");
  s.have_pt = rows.count({name, "pytorch"}) > 0;
  s.theirs = s.have_pt ? step("pytorch") : 0;
  s.traced = bench.has("trace") ? trace_path(bench.get("trace"), name, workloads) : "";
  if (!s.traced.empty()) {
    s.tb = backward_in_trace(s.traced);
    const double alone = number_field(rows[{name, "paratrain"}], "comm_seconds");
    s.trace_hidden = alone > 0 ? std::clamp(1.0 - s.tb.exposed_seconds / alone, 0.0, 1.0) : 1.0;
  }
  return s;
}

void print_ddp_json(const Bench& bench, DdpRows& rows, const DdpSummary& s) {
  for (const char* sys : {"paratrain", "independent", "pytorch"}) {
    auto key = std::make_pair(s.name, std::string(sys));
    if (!rows.count(key)) {
      continue;
    }
    JsonRow row = rows[key];
    if (std::string(sys) == "paratrain") {
      row["ratio_to_independent"] = s.ours / s.indep;
      if (s.have_pt) {
        row["ratio_to_pytorch"] = s.ours / s.theirs;
      }
      note_smoke_skip(bench, row);
      if (!s.traced.empty()) {
        row["trace"] = s.traced;
        row["trace_backward_seconds"] = s.tb.backward_seconds;
        row["trace_exposed_seconds"] = s.tb.exposed_seconds;
        row["trace_hidden_fraction"] = s.trace_hidden;
      }
    }
    print_row(row);
  }
}

void print_ddp_text(DdpRows& rows, const DdpSummary& s) {
  const JsonRow& ddp_row = rows[{s.name, "paratrain"}];
  std::cout << std::fixed << std::setprecision(1) << s.name << " (2 ranks x 1 thread):\n"
            << "  paratrain DDP (" << string_field(ddp_row, "backend") << ")  " << s.ours * 1e3
            << " ms/step\n"
            << "  independent x2        " << s.indep * 1e3 << " ms/step\n";
  if (s.have_pt) {
    std::cout << "  PyTorch DDP (gloo)    " << s.theirs * 1e3 << " ms/step\n";
  }
  std::cout << std::setprecision(2) << "  paratrain / independent = " << s.ours / s.indep << "x";
  if (s.have_pt) {
    std::cout << ", paratrain / PyTorch = " << s.ours / s.theirs << "x";
  }
  std::cout << "\n  communication hidden behind backward: " << std::setprecision(0)
            << 100 * number_field(ddp_row, "hidden_comm_fraction") << "% ("
            << static_cast<int64_t>(number_field(ddp_row, "buckets"))
            << " buckets, allreduce alone " << std::setprecision(2)
            << 1e3 * number_field(ddp_row, "comm_seconds") << " ms, exposed "
            << 1e3 * number_field(ddp_row, "exposed_comm_seconds") << " ms)\n";
  if (!s.traced.empty()) {
    std::cout << std::setprecision(2) << "  in the trace (" << s.traced << "): backward "
              << s.tb.backward_seconds * 1e3 << " ms, of which waiting for allreduce after its "
              << "compute " << s.tb.exposed_seconds * 1e3 << " ms: " << std::setprecision(0)
              << 100 * s.trace_hidden << "% of the allreduce time hidden (medians)\n";
  }
}

int run_ddp(const Bench& bench) {
  DdpJobs jobs;
  jobs.workloads = bench_workloads(bench);
  jobs.backend = bench_backend(bench);
  jobs.python = comparison_python(bench);
  jobs.script = jobs.python.empty() ? "" : bench_script("ddp_pytorch.py");
  check_trace_file(bench);
  jobs.out = results_file("ddp");
  for (const auto& name : jobs.workloads) {
    measure_workload(bench, jobs, name);
  }
  DdpRows rows = collect_rows(jobs.out);
  for (const auto& name : jobs.workloads) {
    const DdpSummary s = summarize(bench, rows, name, jobs.workloads.size());
    if (bench.json()) {
      print_ddp_json(bench, rows, s);
    } else {
      print_ddp_text(rows, s);
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
