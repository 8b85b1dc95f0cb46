// The tuner's start: its options checked, the cores and GPUs trials are given, and the program a
// command or train trial runs.

#include "tuner_setup.h"

#include "paratrain/launch/launch.h"
#include "paratrain/parallel/threads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <sched.h>

namespace paratrain {
namespace tune {
namespace detail {
namespace {

std::vector<int> machine_cores(int wanted) {
  std::vector<int> cores;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) {
        cores.push_back(c);
      }
    }
  }
  if (cores.empty()) {
    cores.push_back(0);
  }
  if (wanted > 0) {
    // A number given by the user: that many slots, pinned only when the machine has them.
    std::vector<int> out;
    for (int i = 0; i < wanted; ++i) {
      out.push_back(i < static_cast<int>(cores.size()) ? cores[i] : -1);
    }
    return out;
  }
  return cores;
}

}  // namespace

TunerResources check_tuner_options(const TunerOptions& o, const TrialFunction& fn) {
  TunerResources out;
  TORCH_CHECK(!o.study().empty(), "tune: --study is empty; name the study");
  TORCH_CHECK(!o.metric().empty(), "tune: --metric is empty; name the metric to optimize");
  TORCH_CHECK(o.mode() == "min" || o.mode() == "max", "tune: --mode must be min or max, got '",
              o.mode(), "'");
  TORCH_CHECK(o.scope() == "last" || o.scope() == "best",
              "tune: the scope must be last or best, got '", o.scope(), "'");
  TORCH_CHECK(o.num_samples() >= 1, "tune: --num-samples must be >= 1, got ", o.num_samples());
  TORCH_CHECK(o.max_concurrent() >= 0, "tune: --max-concurrent must be >= 0, got ",
              o.max_concurrent());
  TORCH_CHECK(o.max_failures() >= 0, "tune: max_failures must be >= 0, got ", o.max_failures());
  const Resources& res = o.resources();
  TORCH_CHECK(res.ranks() >= 1 && res.threads() >= 1 && res.gpus() >= 0,
              "tune: a trial's ranks and threads must be >= 1 and its GPUs >= 0; got ranks ",
              res.ranks(), ", threads ", res.threads(), ", gpus ", res.gpus());
  out.cores = machine_cores(o.cpus());
  const int machine_gpus = o.gpus() >= 0 ? o.gpus() : static_cast<int>(torch::cuda::device_count());
  for (int g = 0; g < machine_gpus; ++g) {
    out.gpus.push_back(g);
  }
  const int need = res.ranks() * res.threads();
  TORCH_CHECK(need <= static_cast<int>(out.cores.size()), "tune: a trial needs ", need, " cores (",
              res.ranks(), " ranks x ", res.threads(), " threads) but this machine has ",
              out.cores.size(), "; lower --nproc-per-node or --threads");
  TORCH_CHECK(res.gpus() <= machine_gpus, "tune: a trial needs ", res.gpus(),
              " GPUs but this machine has ", machine_gpus, "; lower --gpus");
  if (o.train()) {
    TORCH_CHECK(!o.paratrain_cli().empty(), "tune: a train trial needs the paratrain CLI's path");
    out.program = o.paratrain_cli();
  } else if (!o.command().empty()) {
    out.program = dist::find_program(o.command()[0]);
    TORCH_CHECK(!out.program.empty(), "tune: trial command '", o.command()[0],
                "' not found (not a path, nor on PATH)");
  } else {
    TORCH_CHECK(static_cast<bool>(fn), "tune: give a trial: a command, a train job or a function");
    // Function trials share this process: each computes on its own thread with `threads`
    // intra-op threads, and OpenBLAS's own pool (which set_num_threads does not reach) is capped
    // too, or concurrent trials contend for its spinning threads.
    at::set_num_threads(res.threads());
    set_blas_threads(res.threads());
  }
  return out;
}

}  // namespace detail
}  // namespace tune
}  // namespace paratrain
