// paratrain bench allreduce: time per allreduce and bus bandwidth per backend.
//
// Bus bandwidth follows nccl-tests (doc/PERFORMANCE.md): busbw = bytes / time * 2(n-1)/n, the
// rate each link must sustain in a ring allreduce, so numbers are comparable across world sizes
// and with the memcpy line printed as the physical reference.
//
// The parent process starts one job per backend (gloo through the launcher, mpi through mpirun),
// each rank runs the same sizes, and rank 0 writes one JSON row per size to a file the parent then
// prints. Each size: warm-up, then timed iterations with every rank starting together; the time
// of one iteration is the slowest rank's, and the row reports the median over iterations.

#include "args.h"
#include "bench_util.h"
#include "benchmarks.h"
#include "commands.h"
#include "harness.h"

#include "paratrain/paratrain.h"

#include <torch/torch.h>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace paratrain {
namespace cli {

namespace {

using Clock = std::chrono::steady_clock;

std::string human_bytes(long long b) {
  std::ostringstream s;
  if (b >= (1LL << 20)) {
    s << (b >> 20) << " MiB";
  } else if (b >= (1LL << 10)) {
    s << (b >> 10) << " KiB";
  } else {
    s << b << " B";
  }
  return s.str();
}

// Iterations per size: many for small messages (latency-bound, noisy), few for large ones.
int iterations_for(long long bytes, int requested) {
  if (requested > 0) {
    return requested;
  }
  long long it = (256LL << 20) / std::max(1LL, bytes);
  return static_cast<int>(std::clamp<long long>(it, 20, 200));
}

struct AllreduceRow {
  std::string backend;
  int ranks = 0;
  long long bytes = 0;
  double seconds = 0;
  double busbw_gbps = 0;
  int iterations = 0;
};

JsonRow allreduce_json(const AllreduceRow& r) {
  return {{"benchmark", "allreduce"},  {"backend", r.backend}, {"ranks", r.ranks},
          {"bytes", r.bytes},          {"seconds", r.seconds}, {"busbw_gbps", r.busbw_gbps},
          {"iterations", r.iterations}};
}

AllreduceRow allreduce_row_of(const JsonRow& row) {
  AllreduceRow r;
  r.backend = string_field(row, "backend");
  r.ranks = static_cast<int>(number_field(row, "ranks"));
  r.bytes = static_cast<long long>(number_field(row, "bytes"));
  r.seconds = number_field(row, "seconds");
  r.busbw_gbps = number_field(row, "busbw_gbps");
  r.iterations = static_cast<int>(number_field(row, "iterations"));
  return r;
}

const BenchSpec& allreduce_spec() {
  static const BenchSpec spec{
      "allreduce",
      "Times allreduce per message size and backend, and prints the bus bandwidth.",
      {
          {"backends", "LIST", "the backends to compare (default: gloo and mpi where built)"},
          {"nproc-per-node,ranks", "N", "processes (default 2)"},
          {"min-bytes", "SIZE", "the smallest message (default 1K)", "1K"},
          {"max-bytes", "SIZE", "the largest message (default 64M)", "4K"},
          {"factor", "F", "the step between sizes (default 4)"},
          {"iters", "N", "allreduces per size (default: by size)", "2"},
      },
      "print JSON",
      /*workers=*/true};
  return spec;
}

// One rank of one backend's job.
int run_allreduce_worker(const Bench& bench) {
  auto pg = dist::init_process_group();
  const long long min_bytes = bench.get_bytes("min-bytes", 1 << 10);
  const long long max_bytes = bench.get_bytes("max-bytes", 64 << 20);
  const int factor = bench.get_int("factor", 4);
  const int requested = bench.get_int("iters", 0);
  for (long long bytes = min_bytes; bytes <= max_bytes; bytes *= factor) {
    at::Tensor t = torch::ones({std::max(1LL, bytes / 4)}, torch::kFloat);
    const int iters = iterations_for(bytes, requested);
    for (int i = 0; i < std::max(2, iters / 10); ++i) {
      pg->allreduce(t)->wait();
    }
    std::vector<double> times;
    at::Tensor slowest = torch::zeros({1}, torch::kDouble);
    for (int i = 0; i < iters; ++i) {
      pg->barrier()->wait();
      auto t0 = Clock::now();
      pg->allreduce(t)->wait();
      slowest.fill_(seconds_since(t0));
      pg->allreduce(slowest, dist::ReduceOp::kMax)->wait();
      times.push_back(slowest.item<double>());
    }
    if (pg->rank() == 0) {
      AllreduceRow r;
      r.backend = pg->backend_name();
      r.ranks = pg->size();
      r.bytes = t.nbytes();
      r.seconds = median(times);
      const double n = pg->size();
      r.busbw_gbps = r.bytes / r.seconds * 2.0 * (n - 1) / n / 1e9;
      r.iterations = iters;
      append_row(bench.get("out"), allreduce_json(r));
    }
  }
  return 0;
}

double memcpy_gbps(long long bytes) {
  std::vector<char> a(static_cast<size_t>(bytes), 1);
  std::vector<char> b(static_cast<size_t>(bytes), 0);
  std::vector<double> times;
  for (int i = 0; i < 10; ++i) {
    auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), a.size());
    times.push_back(seconds_since(t0));
  }
  return bytes / median(times) / 1e9;
}

// (mpi row, gloo row) for each size both backends measured.
std::vector<std::pair<AllreduceRow, AllreduceRow>> mpi_gloo_pairs(
    const std::vector<AllreduceRow>& rows) {
  std::vector<std::pair<AllreduceRow, AllreduceRow>> pairs;
  for (const auto& a : rows) {
    for (const auto& b : rows) {
      if (a.backend == "mpi" && b.backend == "gloo" && a.bytes == b.bytes && a.ranks == b.ranks) {
        pairs.emplace_back(a, b);
      }
    }
  }
  return pairs;
}

// --backends, else every CPU backend this build has.
std::vector<std::string> allreduce_backends(const Bench& bench) {
  const std::string list = bench.get("backends", "");
  if (!list.empty()) {
    std::vector<std::string> backends;
    std::stringstream s(list);
    for (std::string b; std::getline(s, b, ',');) {
      backends.push_back(b);
    }
    return backends;
  }
  std::vector<std::string> backends = dist::available_backends();
  backends.erase(std::remove(backends.begin(), backends.end(), "nccl"), backends.end());
  return backends;
}

// One job per backend, `ranks` processes each; their rows, in order.
std::vector<AllreduceRow> measure_backends(const Bench& bench,
                                           const std::vector<std::string>& backends,
                                           int ranks) {
  const std::string out_path = results_file("allreduce");
  const std::vector<std::string> worker_args = bench.worker_command(
      out_path, bench.forwarded({"min-bytes", "max-bytes", "factor", "iters"}));
  for (const auto& backend : backends) {
    dist::LaunchOptions o;
    o.nproc_per_node(ranks)
        .standalone(true)
        .backend(backend)
        .command(worker_args)
        .mpi_shim({paratrain_program(), "launch", "--from-mpirun"});
    bench.progress("running " + backend + " with " + std::to_string(ranks) + " ranks...");
    dist::LaunchResult r = dist::launch(o);
    if (r.exit_code != 0) {
      std::remove(out_path.c_str());
      throw std::runtime_error("the " + backend + " job failed: " + r.summary);
    }
  }
  std::vector<AllreduceRow> rows;
  for (const auto& row : read_rows(out_path)) {
    rows.push_back(allreduce_row_of(row));
  }
  std::remove(out_path.c_str());
  return rows;
}

void print_allreduce_json(const std::vector<AllreduceRow>& rows,
                          long long ref_bytes,
                          double memcpy_bw) {
  for (const auto& r : rows) {
    print_row(allreduce_json(r));
  }
  print_row({{"benchmark", "allreduce"},
             {"backend", "memcpy"},
             {"ranks", 1},
             {"bytes", ref_bytes},
             {"seconds", ref_bytes / memcpy_bw / 1e9},
             {"busbw_gbps", memcpy_bw}});
  for (const auto& [a, b] : mpi_gloo_pairs(rows)) {
    print_row({{"benchmark", "allreduce"},
               {"comparison", "mpi/gloo"},
               {"ranks", a.ranks},
               {"bytes", a.bytes},
               {"busbw_ratio", a.busbw_gbps / b.busbw_gbps}});
  }
  std::cout.flush();
}

void print_allreduce_table(const std::vector<AllreduceRow>& rows,
                           long long ref_bytes,
                           double memcpy_bw) {
  std::cout << std::left << std::setw(8) << "backend" << std::right << std::setw(7) << "ranks"
            << std::setw(11) << "size" << std::setw(14) << "time (ms)" << std::setw(15)
            << "busbw (GB/s)" << std::setw(8) << "iters"
            << "\n";
  for (const auto& r : rows) {
    std::cout << std::left << std::setw(8) << r.backend << std::right << std::setw(7) << r.ranks
              << std::setw(11) << human_bytes(r.bytes) << std::setw(14) << std::fixed
              << std::setprecision(3) << r.seconds * 1e3 << std::setw(15) << std::setprecision(2)
              << r.busbw_gbps << std::setw(8) << r.iterations << "\n";
  }
  std::cout << "memcpy " << human_bytes(ref_bytes) << ": " << std::fixed << std::setprecision(2)
            << memcpy_bw << " GB/s (physical reference)\n";
  // Side-by-side ratio per size when both CPU backends ran.
  for (const auto& [a, b] : mpi_gloo_pairs(rows)) {
    std::cout << "mpi/gloo busbw at " << human_bytes(a.bytes) << ": " << std::setprecision(2)
              << a.busbw_gbps / b.busbw_gbps << "x\n";
  }
}

int run_allreduce(const Bench& bench) {
  const int ranks = bench.get_int("nproc-per-node", 2);
  if (ranks < 2) {
    throw UsageError("--nproc-per-node must be at least 2 to measure communication, got " +
                     std::to_string(ranks));
  }
  if (bench.get_int("factor", 4) < 2) {
    throw UsageError("--factor must be at least 2");
  }
  const long long min_bytes = bench.get_bytes("min-bytes", 1 << 10);
  const long long max_bytes = bench.get_bytes("max-bytes", 64 << 20);
  if (min_bytes < 4 || max_bytes < min_bytes) {
    throw UsageError("need 4 <= --min-bytes <= --max-bytes");
  }
  const std::vector<AllreduceRow> rows = measure_backends(bench, allreduce_backends(bench), ranks);
  const long long ref_bytes = std::min<long long>(max_bytes, 16LL << 20);
  const double memcpy_bw = memcpy_gbps(ref_bytes);
  if (bench.json()) {
    print_allreduce_json(rows, ref_bytes, memcpy_bw);
  } else {
    print_allreduce_table(rows, ref_bytes, memcpy_bw);
  }
  return 0;
}

}  // namespace

int run_bench_allreduce(const std::vector<std::string>& argv) {
  return run_benchmark(allreduce_spec(), argv, run_allreduce, run_allreduce_worker);
}

}  // namespace cli
}  // namespace paratrain
