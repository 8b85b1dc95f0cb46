// The gloo backend: c10d's ProcessGroupGloo, shipped in libtorch, behind paratrain's interface
// (see c10d_group.h for what paratrain adds on top).

#include "c10d_group.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>

namespace paratrain {
namespace dist {
namespace detail {

struct GlooTraits {
  using Engine = c10d::ProcessGroupGloo;
  static constexpr const char* kName = "gloo";
  // libtorch 1.13's Gloo has no bf16 arithmetic ("Invalid scalar type").
  static constexpr bool kWidenBFloat16 = true;
  static constexpr bool kCudaOnly = false;
  static constexpr bool kNativeReduceScatter = false;
  static constexpr bool kExchangeAllgather = true;
  static constexpr bool kBitwiseOps = true;
  static void shutdown(Engine&, bool) {}  // Gloo's pairs close when the engine is released
};

ProcessGroupPtr make_gloo_group(c10::intrusive_ptr<c10d::Store> store,
                                StoreClientFactory monitor_client,
                                int rank,
                                int size,
                                std::chrono::milliseconds timeout,
                                const std::string& hostname) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && ifname[0] != '\0') {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (!hostname.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  auto engine = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  auto group = std::make_shared<C10dGroup<GlooTraits>>(
      std::move(engine), std::move(store), std::move(monitor_client), rank, size, timeout);
  group->set_maker(
      [timeout, hostname](c10::intrusive_ptr<c10d::Store> s, StoreClientFactory c, int r, int n) {
        return make_gloo_group(std::move(s), std::move(c), r, n, timeout, hostname);
      });
  return group;
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
