// paratrain bench: dispatches to the benchmark programs under bench/.

#include "args.h"
#include "commands.h"

#include <iostream>

namespace paratrain {
namespace cli {

int run_bench(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << help_text("paratrain bench <name> [options] [--json]", "benchmarks",
                           bench_commands(), false);
    return args.empty() ? 2 : 0;
  }
  return dispatch(bench_commands(), args[0], {args.begin() + 1, args.end()}, "benchmark");
}

}  // namespace cli
}  // namespace paratrain
