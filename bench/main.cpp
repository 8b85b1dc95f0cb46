// paratrain-bench: the benchmarks, a program of their own (`paratrain bench NAME` runs it too).
// Each benchmark lives in one file; this table gives the help and the dispatch.

#include "benchmarks.h"
#include "commands.h"

#include "paratrain/util/allocator.h"

#include <iostream>

namespace paratrain {
namespace cli {

namespace {

const std::vector<Command>& benchmarks() {
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
      {"fsdp", "", "DDP, ZeRO, FSDP and FSDP+checkpointing on a GPT: memory and time per rank",
       run_bench_fsdp},
      {"parallel", "",
       "a GPT on device meshes (tensor, sequence, fully sharded): bytes sent against Megatron's "
       "formula, activations, time",
       run_bench_parallel},
      {"optim", "",
       "one Adam step over CPU parameters: paratrain's fused Adam vs libtorch's, PyTorch's fused "
       "and foreach, DeepSpeedCPUAdam",
       run_bench_optim},
      {"offload", "",
       "FSDP with optimizer state, gradients and shards in files: memory, disk, step time, I/O "
       "wait, T*",
       run_bench_offload},
      {"data", "", "ImageFolder images/s: paratrain's loader vs PyTorch's DataLoader + PIL",
       run_bench_data},
  };
  return table;
}

}  // namespace

std::string paratrain_program() {
  return beside_self("paratrain");
}

}  // namespace cli
}  // namespace paratrain

int main(int argc, char** argv) {
  using namespace paratrain::cli;
  paratrain::cpu::keep_freed_memory();  // Note [Freed memory on the CPU]
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << help_text("paratrain bench <name> [options] [--json] [--smoke]", "benchmarks",
                           benchmarks());
    return args.empty() ? 2 : 0;
  }
  return run_guarded("bench", [&] {
    return dispatch(benchmarks(), args[0], {args.begin() + 1, args.end()}, "benchmark");
  });
}
