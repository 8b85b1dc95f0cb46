#pragma once

// The benchmarks of paratrain-bench, one file each (bench/main.cpp lists them). Each takes the
// words after its name and returns the exit code; errors are thrown and reported by
// cli::run_guarded() as one line.

#include <string>
#include <vector>

namespace paratrain {
namespace cli {

int run_bench_data(const std::vector<std::string>& args);
int run_bench_allreduce(const std::vector<std::string>& args);
int run_bench_ddp(const std::vector<std::string>& args);
int run_bench_strategies(const std::vector<std::string>& args);
int run_bench_pipeline(const std::vector<std::string>& args);
int run_bench_amp(const std::vector<std::string>& args);
int run_bench_amp_accuracy(const std::vector<std::string>& args);
int run_bench_faults(const std::vector<std::string>& args);
int run_bench_tune(const std::vector<std::string>& args);
int run_bench_cluster(const std::vector<std::string>& args);
int run_bench_fsdp(const std::vector<std::string>& args);
int run_bench_parallel(const std::vector<std::string>& args);
int run_bench_optim(const std::vector<std::string>& args);
int run_bench_offload(const std::vector<std::string>& args);

/// The paratrain program beside this one (bin/paratrain), for the benchmarks that time its
/// commands (`launch`, `train`) or need its mpirun shim.
std::string paratrain_program();

}  // namespace cli
}  // namespace paratrain
