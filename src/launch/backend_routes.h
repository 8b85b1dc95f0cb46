#pragma once

// Internal: the syntax of a routed backend ("cpu:gloo,cuda:nccl"), which the launcher checks
// before it starts anything and init_process_group reads, without libtorch (c10 only).

#include <c10/core/DeviceType.h>

#include <string>
#include <utility>
#include <vector>

namespace paratrain {
namespace dist {
namespace detail {

/// What an engine moves where the tensors are: gloo CPU and CUDA tensors, paratrain's mpi backend
/// CPU tensors, nccl CUDA tensors; an unknown engine (or "", no engine) neither. The one place
/// that knows, for the routes below, the pipeline's wire and Join's counter.
struct EngineTraits {
  bool known = false;
  bool cpu_tensors = false;
  bool cuda_tensors = false;
  bool moves(c10::DeviceType type) const {
    return type == c10::DeviceType::CPU ? cpu_tensors
                                        : type == c10::DeviceType::CUDA && cuda_tensors;
  }
};
EngineTraits engine_traits(const std::string& engine);

/// "cpu:gloo,cuda:nccl" as (device type, engine) pairs, CPU first. Throws c10::Error with one
/// line for a route that is not device:engine, an unknown device or engine, nccl for CPU
/// tensors, mpi for CUDA tensors, or a device named twice. Whether this build has the engines
/// is not checked here (init_process_group does).
std::vector<std::pair<c10::DeviceType, std::string>> parse_routes(const std::string& spec);

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
