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
#include "commands.h"

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

// One process of a measured system.
int run_ddp_worker(const Args& args) {
  torch::set_num_threads(1);
  const std::string mode = args.get("mode");
  const Workload w = workload(args.get("workload"), args.get_int("steps", 0));
  const std::string out_path = args.get("out");
  dist::ProcessGroupPtr pg;
  if (mode == "ddp") {
    pg = dist::init_process_group();
  }
  torch::manual_seed(0);
  auto model = models::make(w.model);
  std::unique_ptr<DistributedDataParallel> ddp;
  if (pg) {
    ddp = std::make_unique<DistributedDataParallel>(
        model, pg, DDPOptions().gradient_as_bucket_view(args.has("gradient-as-bucket-view")));
  }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  torch::Tensor x = torch::randn(w.shape);
  torch::Tensor y = torch::randint(0, 10, {w.batch});
  std::vector<double> times;
  std::vector<double> exposed;
  const std::string trace_file = ddp ? args.get("trace", "") : "";
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
      auto out = ddp ? ddp->forward(x) : model->forward(x);
      loss = torch::nn::functional::cross_entropy(out, y);
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
      times.push_back(seconds);
      if (ddp) {
        exposed.push_back(ddp->last_exposed_comm_seconds());
      }
    }
  }
  if (tracer) {
    trace::set_current(nullptr);
    const std::string mine = trace_file + ".rank-" + std::to_string(pg->rank());
    tracer->write(mine);
    pg->barrier()->wait();
    if (pg->rank() == 0) {
      std::vector<std::string> parts;
      for (int r = 0; r < pg->size(); ++r) {
        parts.push_back(trace_file + ".rank-" + std::to_string(r));
      }
      trace::merge(parts, trace_file);
      for (const auto& part : parts) {
        std::remove(part.c_str());
      }
    }
  }
  // Each process's median step, then the slowest process: the same statistic for every system
  // (the independent trainers cannot be timed step by step together).
  double step_seconds = median(times);
  if (pg) {
    at::Tensor t = torch::tensor({step_seconds}, torch::kDouble);
    pg->allreduce(t, dist::ReduceOp::kMax)->wait();
    step_seconds = t.item<double>();
  }
  std::map<std::string, std::string> row{
      {"workload", quoted(w.name)},
      {"system", quoted(mode == "ddp" ? "paratrain" : "independent")},
      {"ranks", "2"},
      {"step_seconds", std::to_string(step_seconds)},
      {"steps", std::to_string(times.size())}};
  if (ddp) {
    // The same bucket reductions with nothing else running.
    std::vector<double> alone;
    std::vector<at::Tensor> buckets;
    std::vector<torch::Tensor> trainable;  // the parameters DDP indexes: those needing a gradient
    for (const auto& p : model->parameters()) {
      if (p.requires_grad()) {
        trainable.push_back(p);
      }
    }
    for (const auto& b : ddp->bucket_assignment()) {
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
    const double comm = median(alone);
    const double hidden = comm > 0 ? std::clamp(1.0 - median(exposed) / comm, 0.0, 1.0) : 1.0;
    row["backend"] = quoted(pg->backend_name());
    row["comm_seconds"] = std::to_string(comm);
    row["exposed_comm_seconds"] = std::to_string(median(exposed));
    row["hidden_comm_fraction"] = std::to_string(hidden);
    row["buckets"] = std::to_string(buckets.size());
  } else {
    const char* rank = std::getenv("RANK");
    row["process"] = rank ? rank : "0";
  }
  if (!pg || pg->rank() == 0) {
    std::ofstream out(out_path, std::ios::app);
    out << row_json(row) << std::endl;
  }
  return 0;
}

}  // namespace

int run_bench_ddp(const std::vector<std::string>& argv) {
  static const CommandSpec spec{
      "paratrain bench ddp",
      "DDP step time against independent trainers and PyTorch's DDP, on the same kernels.",
      {
          {"workloads", "LIST", "mlp, resnet18, ... (default mlp,resnet18)"},
          {"backend", "NAME", "mpi or gloo"},
          {"steps", "N", "timed steps per workload"},
          {"gradient-as-bucket-view", "", "DDP's gradient_as_bucket_view"},
          {"no-pytorch", "", "skip PyTorch's DDP row"},
          {"python", "P",
           "the Python with torch for the PyTorch row (default: python3 on PATH or "
           "/usr/bin/python3, whichever imports torch; or PARATRAIN_PYTHON)"},
          {"trace", "FILE",
           "also write a Chrome trace of paratrain's DDP steps and print how much of the "
           "allreduce time backward hides; with several workloads, one file each "
           "(trace.json: trace.mlp.json, trace.resnet18.json)"},
          {"json", "", "print JSON"},
          {"worker", "", ""},
          {"mode", "M", ""},
          {"workload", "W", ""},
          {"out", "FILE", ""},
      }};
  Args args(argv, spec);
  if (args.has("help")) {
    std::cout << args.help();
    return 0;
  }
  if (args.has("worker")) {
    return run_ddp_worker(args);
  }
  const std::vector<std::string> workloads = bench_workloads(args);
  const std::string backend = bench_backend(args);
  const bool json = args.has("json");
  const bool pytorch = !args.has("no-pytorch");
  const std::string python = pytorch ? torch_python(args.get("python", "")) : "";
  const std::string script = pytorch ? bench_script("ddp_pytorch.py") : "";
  if (args.has("trace")) {  // an unwritable place is said now, not after the measurements
    const std::filesystem::path path(args.get("trace"));
    if (path.filename().empty()) {
      throw UsageError("--trace '" + args.get("trace") + "' names no file: give e.g. trace.json");
    }
    const std::string dir = path.parent_path().string();
    if (::access(dir.empty() ? "." : dir.c_str(), W_OK) != 0) {
      throw UsageError("cannot write the --trace file " + args.get("trace") + ": " +
                       std::strerror(errno));
    }
  }
  const std::string out = results_file("ddp");

  auto run = [&](const std::vector<std::string>& command, const std::string& be) {
    run_bench_job(command, 2, be, out);
  };
  for (const auto& name : workloads) {
    const Workload w = workload(name, args.get_int("steps", 0));
    std::vector<std::string> base{self_path(),  "bench", "ddp",   "--worker",
                                  "--workload", name,    "--out", out};
    if (args.has("steps")) {
      base.insert(base.end(), {"--steps", args.get("steps")});
    }
    if (args.has("gradient-as-bucket-view")) {
      base.push_back("--gradient-as-bucket-view");
    }
    if (!json) {
      std::cerr << "measuring " << name << ": paratrain DDP (" << backend << ")..." << std::endl;
    }
    auto ddp_cmd = base;
    ddp_cmd.insert(ddp_cmd.end(), {"--mode", "ddp"});
    if (args.has("trace")) {
      ddp_cmd.insert(ddp_cmd.end(),
                     {"--trace", trace_path(args.get("trace"), name, workloads.size())});
    }
    run(ddp_cmd, backend);
    if (!json) {
      std::cerr << "measuring " << name << ": two independent trainers..." << std::endl;
    }
    auto single_cmd = base;
    single_cmd.insert(single_cmd.end(), {"--mode", "single"});
    run(single_cmd, "");
    if (pytorch) {
      if (!json) {
        std::cerr << "measuring " << name << ": PyTorch DDP (gloo)..." << std::endl;
      }
      run({python, script, "--workload", name, "--batch", std::to_string(w.batch), "--steps",
           std::to_string(w.steps), "--warmup", std::to_string(w.warmup), "--out", out},
          "");
    }
  }
  // Collect: one row per (workload, system); independent = the slower of its two processes.
  std::ifstream in(out);
  std::map<std::pair<std::string, std::string>, std::string> rows;
  std::map<std::pair<std::string, std::string>, double> step;
  for (std::string line; std::getline(in, line);) {
    auto key = std::make_pair(json_field(line, "workload"), json_field(line, "system"));
    double s = std::stod(json_field(line, "step_seconds"));
    if (!step.count(key) || s > step[key]) {
      step[key] = s;
      rows[key] = line;
    }
  }
  std::remove(out.c_str());
  for (const auto& name : workloads) {
    const double ours = step[{name, "paratrain"}];
    const double indep = step[{name, "independent"}];
    const bool have_pt = step.count({name, "pytorch"}) > 0;
    const double theirs = have_pt ? step[{name, "pytorch"}] : 0;
    const std::string& ddp_row = rows[{name, "paratrain"}];
    const std::string traced =
        args.has("trace") ? trace_path(args.get("trace"), name, workloads.size()) : "";
    const TracedBackward tb = traced.empty() ? TracedBackward{0, 0} : backward_in_trace(traced);
    const double alone = traced.empty() ? 0.0 : std::stod(json_field(ddp_row, "comm_seconds"));
    const double trace_hidden =
        alone > 0 ? std::clamp(1.0 - tb.exposed_seconds / alone, 0.0, 1.0) : 1.0;
    if (json) {
      for (const char* sys : {"paratrain", "independent", "pytorch"}) {
        auto key = std::make_pair(name, std::string(sys));
        if (!rows.count(key)) {
          continue;
        }
        JsonRow row = JsonRow::parse(rows[key]);
        if (std::string(sys) == "paratrain") {
          row["ratio_to_independent"] = ours / indep;
          if (have_pt) {
            row["ratio_to_pytorch"] = ours / theirs;
          }
          if (!traced.empty()) {
            row["trace"] = traced;
            row["trace_backward_seconds"] = tb.backward_seconds;
            row["trace_exposed_seconds"] = tb.exposed_seconds;
            row["trace_hidden_fraction"] = trace_hidden;
          }
        }
        std::cout << json_line(row) << "\n";
      }
      continue;
    }
    std::cout << std::fixed << std::setprecision(1) << name << " (2 ranks x 1 thread):\n"
              << "  paratrain DDP (" << json_field(ddp_row, "backend") << ")  " << ours * 1e3
              << " ms/step\n"
              << "  independent x2        " << indep * 1e3 << " ms/step\n";
    if (have_pt) {
      std::cout << "  PyTorch DDP (gloo)    " << theirs * 1e3 << " ms/step\n";
    }
    std::cout << std::setprecision(2) << "  paratrain / independent = " << ours / indep << "x";
    if (have_pt) {
      std::cout << ", paratrain / PyTorch = " << ours / theirs << "x";
    }
    std::cout << "\n  communication hidden behind backward: " << std::setprecision(0)
              << 100 * std::stod(json_field(ddp_row, "hidden_comm_fraction")) << "% ("
              << json_field(ddp_row, "buckets") << " buckets, allreduce alone "
              << std::setprecision(2) << 1e3 * std::stod(json_field(ddp_row, "comm_seconds"))
              << " ms, exposed " << 1e3 * std::stod(json_field(ddp_row, "exposed_comm_seconds"))
              << " ms)\n";
    if (!traced.empty()) {
      std::cout << std::setprecision(2) << "  in the trace (" << traced << "): backward "
                << tb.backward_seconds * 1e3 << " ms, of which waiting for allreduce after its "
                << "compute " << tb.exposed_seconds * 1e3 << " ms: " << std::setprecision(0)
                << 100 * trace_hidden << "% of the allreduce time hidden (medians)\n";
    }
  }
  std::cout.flush();
  return 0;
}

}  // namespace cli
}  // namespace paratrain
