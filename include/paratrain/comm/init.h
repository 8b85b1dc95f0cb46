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

#include "paratrain/comm/devices.h"  // local_device
#include "paratrain/comm/process_group.h"
#include "paratrain/launch/env.h"

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace paratrain {
namespace dist {

/// kDefaultTimeout, or PARATRAIN_TIMEOUT (seconds, may be fractional) when set: lets a launcher or
/// a test shorten every collective's timeout without touching the program.
std::chrono::milliseconds default_timeout();

struct InitOptions {
  /// "auto", "gloo", "mpi", "nccl", or routes by tensor device as in torch.distributed 2.x:
  /// "cpu:gloo,cuda:nccl" gives one group whose collectives on CPU tensors go over gloo and on
  /// CUDA tensors over nccl, chosen per call. "auto" reads PARATRAIN_BACKEND first (set by
  /// `paratrain launch --backend`); then, when the job uses CUDA devices and this build has NCCL,
  /// it is "cpu:gloo,cuda:nccl" ("cpu:mpi,cuda:nccl" under mpirun), else mpi under mpirun, else
  /// gloo.
  TORCH_ARG(std::string, backend) = "auto";
  /// "env://", "tcp://host:port" or "file:///path".
  TORCH_ARG(std::string, init_method) = "env://";
  /// -1: from the environment.
  TORCH_ARG(int, rank) = -1;
  /// -1: from the environment.
  TORCH_ARG(int, world_size) = -1;
  /// Deadline of the rendezvous and of every collective.
  TORCH_ARG(std::chrono::milliseconds, timeout) = default_timeout();
  /// Whether the job computes on CUDA devices (adds the nccl route to "auto").
  TORCH_ARG(bool, uses_cuda) = torch::cuda::is_available();
};

/// Joins the job and returns this rank's process group. Throws c10::Error with one clear line for
/// bad settings (unknown backend, rank out of range, missing MASTER_ADDR on several nodes, port in
/// use, master unreachable within the timeout).
ProcessGroupPtr init_process_group(const InitOptions& options = InitOptions());

/// The backend these options resolve to in this environment: "gloo", "mpi", "nccl" or routes
/// ("cpu:gloo,cuda:nccl"). Throws c10::Error with one line for an unknown backend or device, an
/// engine this build lacks, nccl routed CPU tensors, or a device named twice.
std::string resolve_backend(const InitOptions& options);

/// "cpu:gloo,cuda:nccl" as (device type, engine) pairs, CPU first; checked as resolve_backend
/// (with `check_built` false, engines missing from this build pass).
std::vector<std::pair<c10::DeviceType, std::string>> parse_backend_routes(const std::string& spec,
                                                                          bool check_built = true);

/// Backends compiled into this build, in preference order ("gloo", "mpi", "nccl").
std::vector<std::string> available_backends();

}  // namespace dist
}  // namespace paratrain
