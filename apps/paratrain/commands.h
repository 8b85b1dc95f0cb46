#pragma once

// The subcommands of the paratrain CLI, one file each. Each takes the words after its name and
// returns the process exit code; errors are thrown (c10::Error, cli::UsageError) and reported by
// main().

#include <string>
#include <vector>

namespace paratrain {
namespace cli {

int run_info(const std::vector<std::string>& args);
int run_launch(const std::vector<std::string>& args);
int run_train(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args);
int run_bench_allreduce(const std::vector<std::string>& args);
int run_bench_ddp(const std::vector<std::string>& args);
int run_bench_strategies(const std::vector<std::string>& args);
int run_bench_pipeline(const std::vector<std::string>& args);
int run_bench_amp(const std::vector<std::string>& args);

/// Absolute path of this executable (to re-run it as a worker or an mpirun shim).
std::string self_path();

}  // namespace cli
}  // namespace paratrain
