#include "paratrain/launch/spawn.h"

#include "launch_internal.h"

#include "paratrain/launch/env.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>

namespace paratrain {
namespace dist {

namespace {
constexpr const char* kWorkerVariable = "PARATRAIN_SPAWN_WORKER";

std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  std::string current;
  for (char c : all) {
    if (c == '\0') {
      args.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  char exe[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  TORCH_CHECK(n > 0 && !args.empty(), "spawn: cannot find this program's path and arguments");
  args[0] = std::string(exe, static_cast<size_t>(n));
  return args;
}
}  // namespace

bool is_spawned_worker() {
  const char* v = std::getenv(kWorkerVariable);
  return v != nullptr && std::string(v) == "1";
}

void spawn(int nprocs, const std::function<void(int)>& fn, const SpawnOptions& options) {
  TORCH_CHECK(nprocs >= 1, "spawn: nprocs must be at least 1, got ", nprocs);
  if (is_spawned_worker()) {
    int code = 0;
    try {
      RankInfo info = discover_rank_info();
      fn(info.local_rank);
    } catch (const c10::Error& e) {
      std::cerr << "error: " << e.what_without_backtrace() << std::endl;
      code = 1;
    } catch (const std::exception& e) {
      std::cerr << "error: " << e.what() << std::endl;
      code = 1;
    }
    std::cout.flush();
    // The one place library code ends the process: a spawned child must not go on running the
    // parent's main() after fn (torch.multiprocessing.spawn's children end the same way).
    std::exit(code);
  }
  TORCH_CHECK(!launch_internal::runs_on_mpi(options.backend()),
              "spawn cannot start an MPI job: run the program under mpirun or `paratrain launch "
              "--backend mpi` instead");
  LaunchOptions launch_options;
  launch_options.nproc_per_node(nprocs)
      .standalone(true)
      .command(own_command_line())
      .env({{kWorkerVariable, "1"}})
      .prefix_output(options.prefix_output())
      .backend(options.backend())
      .log_dir(options.log_dir())
      .name("paratrain spawn");
  LaunchResult result = launch(launch_options);
  TORCH_CHECK(result.exit_code == 0, result.summary);
}

}  // namespace dist
}  // namespace paratrain
