#pragma once

// paratrain::optim::FusedAdam, FusedAdamW and FusedSGD: libtorch's Adam, AdamW and SGD whose step
// updates each CPU parameter in one vectorized, threaded pass, as torch.optim.Adam(fused=True)
// (PyTorch 2.4 and later) and DeepSpeed's DeepSpeedCPUAdam do. libtorch's step makes about eight
// passes over memory per parameter (mul_, add_, addcmul_, sqrt, div, add_, addcdiv_); the fused
// one reads the parameter, its gradient and the moments once and writes them once.
//
//   paratrain::optim::FusedAdam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
//   loss.backward();
//   opt.step();
//
// They are torch::optim::Adam, AdamW and SGD, with the same options, parameter groups and state
// objects (AdamParamState, ...), so checkpoints, ZeroRedundancyOptimizer and FSDP take them as
// they take libtorch's, and state saved by either loads into the other.
// - The pass runs when every parameter with a gradient is a contiguous fp32 CPU tensor with a
//   contiguous fp32 gradient, as FSDP's flat shards are. Otherwise (a GPU parameter, a strided
//   view) the step is libtorch's, said once on stderr, and last_step_fused() says so; with the
//   state offloaded (below) such fp32 parameters are stepped from host copies instead.
// - The arithmetic is libtorch's, operation by operation, with the scalars (bias corrections,
//   step size) in double and rounded once; the pass fuses a + s * b into one rounding (fma)
//   where ATen's kernels compute it, so results stay within about 1e-7 relative of libtorch's
//   per step. The AVX512, AVX2 and scalar builds give the same bits; ATEN_CPU_CAPABILITY caps
//   which one runs, as it caps ATen's kernels.
// - Mixed precision: write_copy(master, model_param) makes each step also write the fp32 master
//   rounded to bf16 or fp16 into the model's parameter, in the same pass (MixedPrecision at O2
//   asks for it).
// - Offload (offload(store), ZeRO-Offload's CPU Adam): Adam's and AdamW's moments live in an
//   OffloadStore (host memory or a file, paratrain/optim/offload.h) instead of the state objects,
//   and each step streams them parameter by parameter: the next parameter's moments are read while
//   this one is stepped, and the last one's written behind. With FSDP each parameter is a unit's
//   flat shard, so memory holds two units' moments at a time. The arithmetic is the same pass's:
//   offloaded training is bitwise equal to training with the state in memory. The state objects
//   keep the step count and empty moments; optimizer_state() (paratrain/io/checkpoint.h) reads
//   the moments from the store, so checkpoints hold them as always, and state loaded into the
//   objects (a checkpoint made without offload) moves into the store at the next step.
//   Offloaded, the pass also takes fp32 parameters it cannot use in place: a GPU's (ZeRO-Offload:
//   the moments in host memory or a file, Adam on the CPU) or strided ones. Each is stepped from a
//   host copy of its values and gradient (pinned memory for a CUDA tensor) and its values copied
//   back, with the bits of the same step on a contiguous CPU copy.

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

namespace paratrain {
namespace optim {

class OffloadStore;
namespace detail {
struct InBackward;
}  // namespace detail

/// The build of the kernels this process runs: "avx512", "avx2" or "scalar".
std::string fused_isa();

/// What FusedAdam, FusedAdamW and FusedSGD share.
class FusedOptimizer {
 public:
  virtual ~FusedOptimizer() = default;
  /// From the next step on, each step also writes `param` rounded to `copy`'s dtype (bf16 or
  /// fp16, to nearest even, as Tensor::copy_ rounds) into `copy`: fp32 master weights for a
  /// low-precision model. `param`: one of this optimizer's contiguous fp32 CPU parameters;
  /// `copy`: a contiguous CPU tensor of its shape. c10::Error otherwise.
  void write_copy(const torch::Tensor& param, torch::Tensor copy);
  /// Whether write_copy(param, copy) would take them (without throwing).
  bool can_write_copy(const torch::Tensor& param, const torch::Tensor& copy) const;
  /// Whether write_copy was called for `param` (and its copy still fits it).
  bool writes_copy(const torch::Tensor& param) const;
  /// Whether `param` is one of this optimizer's parameters.
  bool steps(const torch::Tensor& param) const;
  /// Whether the last step ran the fused pass (false: libtorch's step, or no step yet).
  bool last_step_fused() const { return last_fused_; }

  /// From the next step on, keeps the moments of Adam and AdamW in `store` (see above); nullptr
  /// brings them back into memory. A step whose parameters the pass cannot take then throws
  /// (libtorch's step needs the moments in memory). The moments' space in the store is reserved
  /// now: a disk without room throws here, in one line. c10::Error for FusedSGD.
  void offload(std::shared_ptr<OffloadStore> store);
  const std::shared_ptr<OffloadStore>& offload_store() const { return store_; }
  /// Steps `param` alone, now, as PyTorch's optimizer in backward steps a parameter from its
  /// post-accumulate-grad hook: from FullyShardedDataParallel::register_post_accumulate_grad_hook,
  /// each unit's offloaded state streams while backward computes the units before it. Its blocks
  /// are read (already queued when the last step stepped another parameter just before this one),
  /// stepped, and written behind without waiting. The next step() steps the parameters not stepped
  /// since and waits for every write: the same bits as that step() over all of them. Takes Adam
  /// and AdamW with offloaded moments and the gradient in memory; c10::Error otherwise.
  virtual void step_parameter(const torch::Tensor& param);

  /// State tensor `name` ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") of `param` as it is now:
  /// `held` (the state object's) when it holds the values, else a copy read from the store.
  torch::Tensor state_tensor(const torch::Tensor& param,
                             const std::string& name,
                             const torch::Tensor& held);

 protected:
  /// The frame of every fused step: gradients off, the closure's loss, stale copies dropped;
  /// then `pass` when `unfit` (why some parameter does not suit the pass) returns "", else
  /// `fallback` (libtorch's step, said once) and the copies written after it.
  torch::Tensor run_step(const std::function<torch::Tensor()>& closure,
                         const std::function<std::string()>& unfit,
                         const std::function<void()>& fallback,
                         const std::function<void()>& pass);
  /// The copy to write with `param`, undefined when none.
  torch::Tensor copy_of(const torch::Tensor& param) const;
  /// The store's name of state tensor `name` of `param` ("optimizer2.0.3.exp_avg": this
  /// optimizer, group, index, name).
  std::string offload_key(const torch::Tensor& param, const std::string& name) const;
  /// Whether offload() takes this optimizer's state (Adam's and AdamW's moments).
  virtual bool offloadable() const { return true; }

  /// What every step_parameter does first: the store checked, stale copies dropped; the round.
  detail::InBackward& begin_step_parameter();
  /// Before a step: drops the copies that no longer fit their parameter (a model moved to another
  /// device or dtype since write_copy), saying so; their owner copies them itself again.
  void drop_stale_copies();

  std::shared_ptr<OffloadStore> store_;
  /// The parameters step_parameter stepped since the last step(), and their I/O in flight.
  std::shared_ptr<detail::InBackward> in_backward_;  // after store_: destroyed first

 private:
  static uint64_t next_id();
  /// After libtorch's step: every copy written from its parameter with Tensor::copy_.
  void copy_after_fallback();

  uint64_t id_ = next_id();  // names this optimizer's blocks apart from another's in one store
  bool last_fused_ = false;
  bool warned_ = false;
  std::unordered_map<const c10::TensorImpl*, std::pair<torch::Tensor, torch::Tensor>> copies_;
};

/// torch::optim::Adam with the fused step.
class FusedAdam : public torch::optim::Adam, public FusedOptimizer {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;
  void step_parameter(const torch::Tensor& param) override;
};

/// torch::optim::AdamW with the fused step (the decoupled decay in the same pass).
class FusedAdamW : public torch::optim::AdamW, public FusedOptimizer {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
  void step_parameter(const torch::Tensor& param) override;
};

/// torch::optim::SGD with the fused step (momentum, dampening, Nesterov and weight decay).
class FusedSGD : public torch::optim::SGD, public FusedOptimizer {
 public:
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override;

 protected:
  bool offloadable() const override { return false; }
};

}  // namespace optim
}  // namespace paratrain
