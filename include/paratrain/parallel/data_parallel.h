#pragma once

// DataParallel: one process, several devices: the C++ counterpart of torch.nn.DataParallel.
//
//   auto model = paratrain::models::make("mlp");            // parameters on devices[0]
//   paratrain::DataParallel dp(model, {torch::kCPU, torch::kCPU});
//   torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
//   auto loss = torch::nn::functional::cross_entropy(dp(x), y);  // x: the whole batch
//   loss.backward();                                      // summed gradients in model
//   opt.step();
//
// Note [How DataParallel runs replicas]
// forward() splits the batch along `dim` into at most one chunk per device (Tensor::chunk, as
// PyTorch's scatter: a batch of 3 on 2 devices is 2 + 1, a batch of 1 uses one device), runs one
// replica per chunk on its own thread, and concatenates the outputs on output_device. Replica 0 is
// the module itself (PyTorch's replica on device_ids[0] shares the module's tensors too), so
// BatchNorm running statistics come from the first chunk, as in PyTorch. The other replicas are
// clones made once, at construction, and refreshed by copy at every forward (parameters and
// buffers; while an earlier forward's graph still waits for backward, only what changed).
// libtorch's own torch::nn::parallel::data_parallel clones the module on every call instead, which
// is why it is slower than one device (PyTorch issue #40581).
//
// Backward runs the replicas' backward passes in parallel too, one thread each: the gathered
// output's gradient function splits the incoming gradient, asks each replica's graph for its
// gradients (torch::autograd::grad on that thread) and returns their sum for each parameter of the
// module, and the chunk gradients for the input. The module's parameters therefore get the same
// gradients as from one pass over the whole batch (up to float summation order), their
// accumulators and hooks fire once, and on CPU the replicas' backward is parallel (the autograd
// engine alone would run it all on the caller's thread; on GPUs one reentrant grad() over all
// replicas lets the engine's per-device threads do the same). Double backward through
// DataParallel (create_graph) is not supported.
//
// Threads: each replica thread gets the caller's intra-op thread count divided by the number of
// CPU replicas (at least 1), unless threads_per_replica says otherwise. Dropout in replicas draws
// from the shared default generator, so masks depend on thread timing (as on GPUs, where each
// device has its own generator, masks differ from a single-device run anyway).

#include "paratrain/comm/devices.h"  // check_device_exists, declared here before

#include <c10/core/Device.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <vector>

namespace paratrain {

struct DataParallelOptions {
  /// Where forward gathers the outputs; devices[0] when unset (PyTorch's output_device default).
  TORCH_ARG(c10::optional<torch::Device>, output_device) = c10::nullopt;
  /// The batch dimension along which inputs are split and outputs gathered.
  TORCH_ARG(int64_t, dim) = 0;
  /// Intra-op threads of each replica thread; 0: the caller's count split over the CPU replicas.
  TORCH_ARG(int, threads_per_replica) = 0;
};

class DataParallel {
 public:
  /// How a replica is called: the module (the original or a clone of it) and its chunk.
  using ForwardFn = std::function<torch::Tensor(torch::nn::Module&, const torch::Tensor&)>;

  /// Wraps a module holder whose Impl has `Tensor forward(Tensor)` (Sequential included).
  template <typename ModuleType>
  DataParallel(torch::nn::ModuleHolder<ModuleType> module,
               std::vector<torch::Device> devices,
               DataParallelOptions options = {})
      : DataParallel(
            module.ptr(),
            [](torch::nn::Module& m, const torch::Tensor& x) -> torch::Tensor {
              return dynamic_cast<ModuleType&>(m).forward(x);  // Module is a virtual base
            },
            std::move(devices),
            options) {}

  /// The module must implement clone() (derive from torch::nn::Cloneable<Impl>) and have its
  /// parameters and buffers on devices[0]. Throws c10::Error for an empty device list, a device
  /// that does not exist, or a module that is elsewhere or cannot be cloned.
  DataParallel(std::shared_ptr<torch::nn::Module> module,
               ForwardFn forward,
               std::vector<torch::Device> devices,
               DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(DataParallel&&) noexcept;
  DataParallel& operator=(DataParallel&&) noexcept;

  /// Scatter, parallel forward, gather on output_device (see the Note). With one device the
  /// module runs alone on the caller's thread, as PyTorch's.
  torch::Tensor forward(const torch::Tensor& input);
  torch::Tensor operator()(const torch::Tensor& input) { return forward(input); }

  const std::shared_ptr<torch::nn::Module>& module() const;
  const std::vector<torch::Device>& devices() const;
  torch::Device output_device() const;
  /// Replicas the last forward used (fewer than devices() when the batch was smaller).
  size_t last_replicas_used() const;

  struct State;

 private:
  std::shared_ptr<State> state_;  // shared with the backward functions of outputs still alive
};

}  // namespace paratrain
