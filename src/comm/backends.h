#pragma once

// Internal: factories of the backends behind ProcessGroup. init.cpp picks one; nothing else
// needs to know which engines a build has.

#include "base/errors.h"
#include "paratrain/comm/process_group.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <string>
#include <vector>

namespace paratrain {
namespace dist {
namespace detail {

using paratrain::detail::error_message;

/// Makes a fresh client of the job's store, for a thread that must not share the main client's
/// socket (c10d's TCPStore serialises calls on one object, and a blocking get would stall it).
/// Empty for stores that cannot be reopened (file://, in-process).
using StoreClientFactory = std::function<c10::intrusive_ptr<c10d::Store>()>;

ProcessGroupPtr make_gloo_group(c10::intrusive_ptr<c10d::Store> store,
                                StoreClientFactory monitor_client,
                                int rank,
                                int size,
                                std::chrono::milliseconds timeout,
                                const std::string& hostname);

/// One engine of a routed group and the device type whose tensors it moves.
struct Route {
  c10::DeviceType device;
  ProcessGroupPtr group;
};

/// A group over several engines that picks one per call from the tensors' device
/// ("cpu:gloo,cuda:nccl"); `routes` lists the CPU's first. Every engine has the same rank and size.
ProcessGroupPtr make_routed_group(std::vector<Route> routes, const std::string& name);

#ifdef PARATRAIN_WITH_MPI
/// Uses MPI_COMM_WORLD (MPI is initialised on first use). Rank and size come from MPI.
ProcessGroupPtr make_mpi_group(std::chrono::milliseconds timeout);
#endif

#ifdef PARATRAIN_WITH_NCCL
/// `device_index` >= 0: the CUDA device this rank uses. It becomes the current device, and the
/// engine is bound to it at init where libtorch can (2.x), so NCCL need not guess it from the rank.
ProcessGroupPtr make_nccl_group(c10::intrusive_ptr<c10d::Store> store,
                                StoreClientFactory monitor_client,
                                int rank,
                                int size,
                                std::chrono::milliseconds timeout,
                                int device_index);
#endif

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
