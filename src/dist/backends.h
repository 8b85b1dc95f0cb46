#pragma once

// Internal: factories of the backends behind ProcessGroup. init.cpp picks one; nothing else
// needs to know which engines a build has.

#include "paratrain/dist/process_group.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>

namespace paratrain {
namespace dist {
namespace detail {

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

#ifdef PARATRAIN_WITH_MPI
/// Uses MPI_COMM_WORLD (MPI is initialised on first use). Rank and size come from MPI.
ProcessGroupPtr make_mpi_group(std::chrono::milliseconds timeout);
#endif

#ifdef PARATRAIN_WITH_NCCL
ProcessGroupPtr make_nccl_group(c10::intrusive_ptr<c10d::Store> store,
                                StoreClientFactory monitor_client,
                                int rank,
                                int size,
                                std::chrono::milliseconds timeout);
#endif

/// Strips c10d's "[file.cc:123] " prefixes and backtraces: users get the engine's words only.
std::string engine_message(const std::exception& e);

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
