// The command tables of the paratrain CLI, and the help and dispatch made from them.

#include "commands.h"

#include "args.h"

#include <algorithm>
#include <iostream>
#include <sstream>

namespace paratrain {
namespace cli {

const std::vector<Command>& commands() {
  static const std::vector<Command> table{
      {"info", "", "libtorch version, backends in this build, CPU threads, CUDA devices", run_info},
      {"launch", "[opts] -- PROG", "start PROG once per rank with torchrun's environment",
       run_launch},
      {"train", "[opts]",
       "train a zoo model on Fashion-MNIST or an ImageFolder: alone, DDP, DataParallel or a "
       "pipeline",
       run_train},
      {"data", "make-imagefolder [opts]", "write Fashion-MNIST as an ImageFolder of JPEG/PNG/WebP",
       run_data},
      {"tune", "[opts] [-- COMMAND] | report [opts]",
       "hyperparameter search (grid, random, TPE, BOHB; ASHA, Hyperband, median) over train "
       "jobs or any command",
       run_tune},
      {"bench", "<name> [opts]", "the benchmarks below", run_bench},
  };
  return table;
}

const std::vector<Command>& bench_commands() {
  static const std::vector<Command> table{
      {"allreduce", "", "time per allreduce and bus bandwidth, per backend", run_bench_allreduce},
      {"ddp", "", "DDP step time vs independent trainers and PyTorch's DDP", run_bench_ddp},
      {"strategies", "", "single process vs DataParallel vs DDP: step time, peak memory",
       run_bench_strategies},
      {"pipeline", "", "GPipe/1F1B micro-batching vs plain model parallelism", run_bench_pipeline},
      {"amp", "", "DDP step time at opt levels O0-O3 (bf16), accuracy O0 vs O1", run_bench_amp},
      {"amp-accuracy", "", "accuracy at O0-O3 across seeds, paratrain and PyTorch",
       run_bench_amp_accuracy},
      {"faults", "", "random kills under --max-restarts: lost steps, overhead, exact resume",
       run_bench_faults},
      {"tune", "", "paratrain tune (BOHB, ASHA, random) vs Optuna (TPE+Hyperband, random)",
       run_bench_tune},
      {"cluster", "",
       "DDP on two (namespace) hosts vs one, SyncBatchNorm's overhead, ZeRO's state per rank",
       run_bench_cluster},
      {"data", "", "ImageFolder images/s: paratrain's loader vs PyTorch's DataLoader + PIL",
       run_bench_data},
  };
  return table;
}

const Command* find_command(const std::vector<Command>& table, const std::string& name) {
  for (const auto& c : table) {
    if (name == c.name) {
      return &c;
    }
  }
  return nullptr;
}

int dispatch(const std::vector<Command>& table,
             const std::string& name,
             const std::vector<std::string>& args,
             const char* what) {
  if (const Command* c = find_command(table, name)) {
    return c->run(args);
  }
  std::string names;
  for (const auto& c : table) {
    names += (names.empty() ? "" : ", ") + std::string(c.name);
  }
  throw UsageError("unknown " + std::string(what) + " '" + name + "'; available: " + names);
}

namespace {

// "  NAME SYNOPSIS   summary" with the summaries aligned at `column`.
void add_rows(std::ostringstream& out,
              const std::string& prefix,
              const std::vector<Command>& table,
              size_t column) {
  for (const auto& c : table) {
    std::string head = "  " + prefix + c.name;
    if (c.synopsis[0] != '\0') {
      head += std::string(" ") + c.synopsis;
    }
    out << head << std::string(column > head.size() ? column - head.size() : 1, ' ') << c.summary
        << '\n';
  }
}

size_t widest(const std::string& prefix, const std::vector<Command>& table) {
  size_t w = 0;
  for (const auto& c : table) {
    w = std::max(w, prefix.size() + std::char_traits<char>::length(c.name) +
                        std::char_traits<char>::length(c.synopsis) + 1);
  }
  return w;
}

}  // namespace

std::string help_text(const std::string& usage,
                      const std::string& heading,
                      const std::vector<Command>& table,
                      bool with_bench) {
  const size_t column =
      2 + std::max(widest("", table), with_bench ? widest("bench ", bench_commands()) : 0) + 2;
  std::ostringstream out;
  out << "usage: " << usage << "\n\n" << heading << ":\n";
  add_rows(out, "", table, column);
  if (with_bench) {
    add_rows(out, "bench ", bench_commands(), column);
  }
  // "paratrain <command> [options]" -> "run `paratrain <command> --help` for its options"
  out << "\nrun `" << usage.substr(0, usage.find(" [")) << " --help` for its options\n";
  return out.str();
}

int run_command_line(std::vector<std::string> args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << help_text("paratrain <command> [options]", "commands", commands(), true);
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  const Command* known = find_command(commands(), command);
  if (known == nullptr) {
    std::cerr << "paratrain: unknown command '" << command
              << "'; run `paratrain --help` for the list" << std::endl;
    return 2;
  }
  return run_guarded(command, [&] { return known->run(args); });
}

}  // namespace cli
}  // namespace paratrain
