// paratrain bench: dispatches to the benchmark programs under bench/.

#include "args.h"
#include "commands.h"

#include <iostream>

namespace paratrain {
namespace cli {

int run_bench(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help") {
    std::cout << "usage: paratrain bench <name> [options] [--json]\n\n"
                 "  allreduce   time per allreduce and bus bandwidth, per backend\n"
                 "  ddp         DDP step time vs independent trainers and PyTorch's DDP\n"
                 "  strategies  single process vs DataParallel vs DDP: step time, peak memory\n"
                 "  pipeline    GPipe/1F1B micro-batching vs plain model parallelism\n"
                 "  amp         DDP step time at opt levels O0-O3 (bf16), accuracy O0 vs O1\n";
    return args.empty() ? 2 : 0;
  }
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (args[0] == "allreduce") {
    return run_bench_allreduce(rest);
  }
  if (args[0] == "ddp") {
    return run_bench_ddp(rest);
  }
  if (args[0] == "amp") {
    return run_bench_amp(rest);
  }
  if (args[0] == "pipeline") {
    return run_bench_pipeline(rest);
  }
  if (args[0] == "strategies") {
    return run_bench_strategies(rest);
  }
  throw UsageError("unknown benchmark '" + args[0] +
                   "'; available: allreduce, ddp, strategies, pipeline, amp");
}

}  // namespace cli
}  // namespace paratrain
