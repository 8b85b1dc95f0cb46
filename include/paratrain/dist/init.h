#pragma once

// init_process_group: rendezvous and backend choice, the C++ twin of
// torch.distributed.init_process_group.
//
//   auto pg = paratrain::dist::init_process_group();                  // env://, backend auto
//   auto pg = paratrain::dist::init_process_group(
//       paratrain::dist::InitOptions().backend("gloo").init_method("tcp://10.0.0.1:29500")
//           .rank(r).world_size(n).timeout(std::chrono::seconds(30)));
//
// Init methods, as in PyTorch:
//   env://             MASTER_ADDR / MASTER_PORT (and rank, world size) from the environment
//   tcp://host:port    rank 0 serves the store on host:port
//   file:///some/path  a file on a filesystem every rank sees
// Rank and world size come from the options when set (>= 0), else from rank discovery (env.h).

#include <torch/arg.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include "paratrain/dist/env.h"
#include "paratrain/dist/process_group.h"

#include <chrono>
#include <string>

namespace paratrain {
namespace dist {

/// kDefaultTimeout, or PARATRAIN_TIMEOUT (seconds, may be fractional) when set: lets a launcher or
/// a test shorten every collective's timeout without touching the program.
std::chrono::milliseconds default_timeout();

struct InitOptions {
  /// "auto", "gloo", "mpi" or "nccl". "auto" reads PARATRAIN_BACKEND first (set by
  /// `paratrain launch --backend`), then picks nccl when the job uses CUDA devices and this build
  /// has NCCL, mpi when started by mpirun and this build has MPI, else gloo.
  TORCH_ARG(std::string, backend) = "auto";
  /// "env://", "tcp://host:port" or "file:///path".
  TORCH_ARG(std::string, init_method) = "env://";
  /// -1: from the environment.
  TORCH_ARG(int, rank) = -1;
  /// -1: from the environment.
  TORCH_ARG(int, world_size) = -1;
  /// Deadline of the rendezvous and of every collective.
  TORCH_ARG(std::chrono::milliseconds, timeout) = default_timeout();
  /// Whether the job computes on CUDA devices (steers "auto" to nccl).
  TORCH_ARG(bool, uses_cuda) = torch::cuda::is_available();
};

/// Joins the job and returns this rank's process group. Throws c10::Error with one clear line for
/// bad settings (unknown backend, rank out of range, missing MASTER_ADDR on several nodes, port in
/// use, master unreachable within the timeout).
ProcessGroupPtr init_process_group(const InitOptions& options = InitOptions());

/// The backend "auto" resolves to for these options and this environment.
std::string resolve_backend(const InitOptions& options);

/// Backends compiled into this build, in preference order ("gloo", "mpi", "nccl").
std::vector<std::string> available_backends();

/// cuda:LOCAL_RANK when CUDA is available (after CUDA_VISIBLE_DEVICES, so `launch --devices 0,1,3`
/// gives local rank 2 the physical GPU 3), else cpu.
torch::Device local_device();

}  // namespace dist
}  // namespace paratrain
