// The nccl backend: c10d's ProcessGroupNCCL, compiled only against a libtorch built with CUDA
// (CMake defines PARATRAIN_WITH_NCCL). Tensors must be on this rank's CUDA device.

#include "c10d_group.h"

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <type_traits>
#include <utility>

namespace paratrain {
namespace dist {
namespace detail {
namespace {

// What libtorch 2.x's ProcessGroupNCCL offers and 1.13's lacks, found by overload resolution so
// one source builds on both.
template <typename E, typename = void>
struct CanShutdown : std::false_type {};
template <typename E>
struct CanShutdown<E, decltype(void(std::declval<E&>().shutdown()))> : std::true_type {};

template <typename E, typename = void>
struct CanAbort : std::false_type {};
template <typename E>
struct CanAbort<E, decltype(void(std::declval<E&>().abort()))> : std::true_type {};

template <typename E, typename = void>
struct CanBindDevice : std::false_type {};
template <typename E>
struct CanBindDevice<E,
                     decltype(void(std::declval<E&>().setBoundDeviceId(
                         std::declval<at::Device>())))> : std::true_type {};

// Bound to its device, the engine no longer guesses it from the rank ("Guessing device ID based on
// global rank"). The communicator is still created at the first collective, as PyTorch does
// unless init_process_group is given device_id: connecting eagerly would leave every rank waiting
// on one whose initialisation failed.
template <typename E>
void bind_device(E& engine, const at::Device& device) {
  if constexpr (CanBindDevice<E>::value) {
    engine.setBoundDeviceId(device);
  } else {
    (void)engine;
    (void)device;
  }
}

}  // namespace

struct NcclTraits {
  using Engine = c10d::ProcessGroupNCCL;
  static constexpr const char* kName = "nccl";
  static constexpr bool kWidenBFloat16 = false;
  static constexpr bool kCudaOnly = true;
  static constexpr bool kNativeReduceScatter = true;
  static constexpr bool kExchangeAllgather = false;
  static constexpr bool kBitwiseOps = false;  // NCCL has no band, bor or bxor
  // libtorch 2.x warns at exit that "destroy_process_group() was not called" unless the engine
  // was shut down; 1.13 aborts its communicators in the destructor and has no shutdown().
  // A broken group is aborted instead: 2.6's graceful shutdown waits for kernels that a dead peer
  // never lets finish.
  static void shutdown(Engine& engine, bool broken) {
    if constexpr (CanAbort<Engine>::value) {
      if (broken) {
        engine.abort();
        return;
      }
    }
    if constexpr (CanShutdown<Engine>::value) {
      engine.shutdown();
    } else {
      (void)engine;
      (void)broken;
    }
  }
};

ProcessGroupPtr make_nccl_group(c10::intrusive_ptr<c10d::Store> store,
                                StoreClientFactory monitor_client,
                                int rank,
                                int size,
                                std::chrono::milliseconds timeout,
                                int device_index) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  const bool bind = device_index >= 0 && device_index < c10::cuda::device_count();
  if (bind) {
    // Programs that never pick a device then allocate on their own GPU, not all on cuda:0.
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index));
  }
  auto engine = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  if (bind) {
    bind_device(*engine, at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index)));
  }
  auto group = std::make_shared<C10dGroup<NcclTraits>>(
      std::move(engine), std::move(store), std::move(monitor_client), rank, size, timeout);
  group->set_maker([timeout, device_index](c10::intrusive_ptr<c10d::Store> s, StoreClientFactory c,
                                           int r, int n) {
    return make_nccl_group(std::move(s), std::move(c), r, n, timeout, device_index);
  });
  return group;
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain
