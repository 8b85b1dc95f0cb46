#include "backend_routes.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace paratrain {
namespace dist {
namespace detail {

EngineTraits engine_traits(const std::string& engine) {
  if (engine == "gloo") {
    return {true, true, true};
  }
  if (engine == "mpi") {
    return {true, true, false};
  }
  if (engine == "nccl") {
    return {true, false, true};
  }
  return {};
}

std::vector<std::pair<c10::DeviceType, std::string>> parse_routes(const std::string& spec) {
  std::vector<std::pair<c10::DeviceType, std::string>> routes;
  std::stringstream in(spec);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto colon = item.find(':');
    TORCH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < item.size(), "backend '",
                spec, "': '", item, "' is not device:backend (write e.g. cpu:gloo,cuda:nccl)");
    const std::string device = item.substr(0, colon);
    const std::string engine = item.substr(colon + 1);
    TORCH_CHECK(device == "cpu" || device == "cuda", "backend '", spec, "': unknown device '",
                device, "': routes name cpu or cuda");
    TORCH_CHECK(engine == "gloo" || engine == "mpi" || engine == "nccl", "unknown backend '",
                engine, "' in '", spec, "': choose gloo, mpi or nccl for each device");
    const auto type = device == "cpu" ? c10::DeviceType::CPU : c10::DeviceType::CUDA;
    TORCH_CHECK(type != c10::DeviceType::CPU || engine_traits(engine).cpu_tensors, "backend '",
                spec, "': nccl moves CUDA tensors only; route cpu to gloo or mpi");
    TORCH_CHECK(type != c10::DeviceType::CUDA || engine_traits(engine).cuda_tensors, "backend '",
                spec,
                "': paratrain's mpi backend moves CPU tensors only; route cuda to nccl or gloo");
    for (const auto& r : routes) {
      TORCH_CHECK(r.first != type, "backend '", spec, "' names ", device, " twice");
    }
    routes.emplace_back(type, engine);
  }
  TORCH_CHECK(!routes.empty(), "backend '", spec, "' names no route");
  std::stable_sort(routes.begin(), routes.end(), [](const auto& a, const auto& b) {
    return a.first == c10::DeviceType::CPU && b.first != c10::DeviceType::CPU;
  });
  return routes;
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
