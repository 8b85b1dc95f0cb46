#pragma once

// DistributedDataParallel for libtorch modules: the C++ counterpart of
// torch.nn.parallel.DistributedDataParallel.
//
//   auto pg = paratrain::dist::init_process_group();
//   auto model = torch::nn::Sequential(...);
//   paratrain::DistributedDataParallel ddp(model, pg, paratrain::DDPOptions().bucket_cap_mb(25));
//   torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
//   for (...) {
//     opt.zero_grad();
//     auto loss = torch::nn::functional::cross_entropy(ddp.forward(x), y);
//     loss.backward();   // gradients are averaged over the ranks when backward returns
//     opt.step();
//   }
//
// Note [How DDP reduces gradients]
// At construction every rank checks that all ranks hold the same parameters (names, dtypes,
// shapes), takes rank 0's parameters and buffers, and assigns the parameters to buckets in
// reverse registration order (roughly the order backward produces their gradients): the first
// bucket holds up to first_bucket_mb, the others up to bucket_cap_mb. A post-hook on each
// parameter's gradient accumulator copies its gradient into the bucket's flat buffer when
// backward has accumulated it (without a communication hook, divided by the world size on the
// way, as PyTorch's reducer); when a bucket is complete, and every bucket before it has been
// launched, its allreduce (or its communication hook) starts asynchronously, so the allreduce of
// the last layers overlaps the backward of the first. An end-of-backward callback waits for
// every bucket and writes the averaged gradients back (unless they already are views of the
// buckets). As in PyTorch, a backward that fails part way leaves the gradients it had copied or
// divided as they were then: zero them before training on.
//
// Threads: hooks and the callback run on the thread(s) the autograd engine uses for the
// parameters' device (the caller's thread on CPU); state is guarded by one mutex. forward() and
// backward() must not run concurrently on one DDP object.

#include <torch/arg.h>
#include <torch/nn/module.h>

#include "paratrain/comm/process_group.h"
#include "paratrain/parallel/comm_hooks.h"
#include "paratrain/util/autograd_node.h"

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace paratrain {

constexpr double kDefaultBucketCapMb = 25.0;
constexpr double kDefaultFirstBucketMb = 1.0;

struct DDPOptions {
  /// Bucket size cap, MiB (PyTorch's default 25).
  TORCH_ARG(double, bucket_cap_mb) = kDefaultBucketCapMb;
  /// Cap of the first bucket (the last layers' gradients), MiB: small, so that communication
  /// starts early in backward (PyTorch's default 1).
  TORCH_ARG(double, first_bucket_mb) = kDefaultFirstBucketMb;
  /// Broadcast buffers (BatchNorm running statistics) from rank 0 at each forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Parameters that may get no gradient in an iteration: found from the autograd graph at each
  /// forward and marked ready, at the cost of a graph walk and one small allreduce per iteration.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// Make each parameter's .grad a view into its bucket: saves a copy in and out and the memory
  /// of one set of gradients.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Accepted for PyTorch compatibility: the graph is treated as possibly dynamic every iteration
  /// (the bucket order is already fixed and every hook is already registered once).
  TORCH_ARG(bool, static_graph) = false;
};

class DistributedDataParallel {
 public:
  /// Wraps `module`: any libtorch module holder whose forward takes and returns a tensor
  /// (torch::nn::Sequential, torch::nn::Linear, a TORCH_MODULE of your own).
  template <typename ModuleHolder>
  DistributedDataParallel(ModuleHolder module,
                          dist::ProcessGroupPtr pg,
                          DDPOptions options = DDPOptions())
      : DistributedDataParallel(
            module.ptr(),
            [m = module.ptr()](const torch::Tensor& x) -> torch::Tensor { return m->forward(x); },
            std::move(pg),
            std::move(options)) {}
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Runs the module's forward (after broadcasting buffers, and checking that the previous
  /// iteration's reduction finished).
  torch::Tensor forward(const torch::Tensor& input) {
    return forward_with([&] { return forward_(input); });
  }
  torch::Tensor operator()(const torch::Tensor& input) { return forward(input); }
  /// The same around any call producing the output, for modules whose forward takes other
  /// arguments: ddp.forward_with([&] { return model->forward(a, b); }).
  template <typename F>
  torch::Tensor forward_with(F&& f) {
    pre_forward();
    torch::Tensor out = f();
    post_forward(out);
    return out;
  }

  /// RAII: while alive, backward accumulates gradients locally without communication; the first
  /// backward after it ends reduces the accumulated gradients (PyTorch's no_sync()).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp), previous_(ddp.require_sync_) {
      ddp_.require_sync_ = false;
    }
    ~NoSyncGuard() { ddp_.require_sync_ = previous_; }

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// For schedules that run several forwards before the backward that should reduce (pipelines;
  /// PyTorch's reducer.prepare_for_backward): run the forwards and the other backwards under
  /// no_sync(), then, outside it, call this with the tensor whose backward comes next. That
  /// backward reduces every gradient accumulated since the last reduction.
  void prepare_for_backward(const torch::Tensor& output) { post_forward(output); }

  /// Replaces the communication hook. Without one, each gradient is multiplied by 1 / world size
  /// as it is copied into its bucket, and the bucket is summed: one pass less than AllreduceHook,
  /// as PyTorch's DDP without a hook (the same result where the world size is a power of two,
  /// else up to the last bit). Not during a backward.
  void register_comm_hook(std::shared_ptr<CommHook> hook);

  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  const dist::ProcessGroupPtr& process_group() const { return pg_; }
  const DDPOptions& options() const { return options_; }
  /// Parameter indices of each bucket, in launch order; indices count the module's parameters
  /// that require a gradient, in module()->parameters() order.
  std::vector<std::vector<size_t>> bucket_assignment() const;

  /// Seconds spent in wait() for bucket reductions at the end of the last backward: the part of
  /// communication not hidden behind backward.
  double last_exposed_comm_seconds() const { return last_exposed_comm_seconds_; }

 private:
  struct Bucket {
    at::Tensor flat;               // the bucket's gradients, contiguous
    std::vector<size_t> params;    // indices into params_
    std::vector<int64_t> offsets;  // element offset of each parameter in flat
    size_t pending = 0;            // parameters not yet ready this iteration
    bool launched = false;
    dist::WorkPtr work;
    std::chrono::steady_clock::time_point launched_at;  // for trace::current()
  };

  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                          std::function<torch::Tensor(const torch::Tensor&)> forward,
                          dist::ProcessGroupPtr pg,
                          DDPOptions options);

  void verify_same_parameters();
  void broadcast_state(bool parameters, bool buffers);
  void build_buckets();
  void register_hooks();
  void pre_forward();
  void post_forward(const torch::Tensor& output);
  void on_gradient_ready(size_t index);  // hook of parameter `index`
  void mark_ready_locked(size_t index);
  void launch_ready_buckets_locked();
  void finalize_backward();
  at::Tensor slot(size_t index);
  at::Tensor grad_alias(size_t index);

  std::shared_ptr<torch::nn::Module> module_;
  std::function<torch::Tensor(const torch::Tensor&)> forward_;
  dist::ProcessGroupPtr pg_;
  DDPOptions options_;
  std::shared_ptr<CommHook> hook_;  // null: the built-in average (see register_comm_hook)
  at::Tensor inverse_world_size_;   // 1 / world size as a wrapped scalar: the built-in average

  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<autograd_graph::NodePtr> accumulators_;  // kept alive for the hooks
  std::vector<uintptr_t> hook_keys_;  // to remove the hooks when this object goes away
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> location_;  // parameter -> (bucket, position)

  std::mutex mutex_;  // guards everything below during backward
  bool require_sync_ = true;
  bool backward_started_ = false;
  bool expecting_backward_ =
      false;  // a synced forward ran; cleared by the end-of-backward callback
  size_t next_bucket_ = 0;
  std::vector<bool> ready_;     // parameter marked ready this iteration
  std::vector<bool> used_;      // reached by some forward since the last reduction (no_sync too)
  std::vector<bool> in_graph_;  // reached by the synced forwards this backward covers
  std::string unfinished_;      // names of parameters that got no gradient, when not finished
  double last_exposed_comm_seconds_ = 0;
};

}  // namespace paratrain
