// paratrain: the command-line front end. Subcommands live one per file; this file only dispatches
// and turns exceptions into one line on stderr and an exit code (2 for a bad command line, 1 for
// everything else), the one place that decides how the process ends.

#include "args.h"
#include "commands.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <climits>
#include <iostream>

namespace paratrain {
namespace cli {

std::string self_path() {
  char exe[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  return n > 0 ? std::string(exe, static_cast<size_t>(n)) : "paratrain";
}

}  // namespace cli
}  // namespace paratrain

namespace {

const char* kUsage =
    "usage: paratrain <command> [options]\n"
    "\n"
    "commands:\n"
    "  info                    libtorch version, backends in this build, CPU threads, CUDA "
    "devices\n"
    "  launch [opts] -- PROG   start PROG once per rank with torchrun's environment (see\n"
    "                          `paratrain launch --help`)\n"
    "  train [opts]            train a model (linear, mlp) on Fashion-MNIST, alone or with DDP\n"
    "                          (see `paratrain train --help`)\n"
    "  bench allreduce         allreduce time and bus bandwidth per backend\n";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  try {
    if (command == "info") {
      return paratrain::cli::run_info(args);
    }
    if (command == "launch") {
      return paratrain::cli::run_launch(args);
    }
    if (command == "train") {
      return paratrain::cli::run_train(args);
    }
    if (command == "bench") {
      return paratrain::cli::run_bench(args);
    }
    std::cerr << "paratrain: unknown command '" << command
              << "'; run `paratrain --help` for the list" << std::endl;
    return 2;
  } catch (const paratrain::cli::UsageError& e) {
    std::cerr << "paratrain " << command << ": " << e.what() << " (see `paratrain " << command
              << " --help`)" << std::endl;
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "paratrain " << command << ": error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "paratrain " << command << ": error: " << e.what() << std::endl;
    return 1;
  }
}
