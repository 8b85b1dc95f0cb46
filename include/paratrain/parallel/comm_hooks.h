#pragma once

// Communication hooks of DistributedDataParallel: how one bucket of gradients is reduced. The
// counterpart of torch.distributed.algorithms.ddp_comm_hooks.
//
// A hook receives the bucket as one flat tensor holding the local gradients and returns a Work
// whose completion leaves the bucket holding the gradients averaged over the group. It runs on
// the thread that runs backward, in the same bucket order on every rank, and must issue exactly
// one sequence of collectives per call, the same on every rank.

#include "paratrain/comm/process_group.h"

#include <functional>
#include <memory>
#include <string>

namespace paratrain {

class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual dist::WorkPtr run(dist::ProcessGroup& pg, at::Tensor& bucket) = 0;
  virtual std::string name() const = 0;
};

/// Divide by the world size, then allreduce (sum) in place, as PyTorch's allreduce_hook. DDP
/// without a hook averages in one pass less (it multiplies by 1 / world size while copying into
/// the bucket): the same values where the world size is a power of two, else up to the last bit.
class AllreduceHook : public CommHook {
 public:
  dist::WorkPtr run(dist::ProcessGroup& pg, at::Tensor& bucket) override;
  std::string name() const override { return "allreduce"; }
};

/// Halves the bytes on the wire: cast to `dtype` (fp16 or bf16), divide by the world size before
/// the sum (so fp16 does not overflow), allreduce, and cast back into the bucket.
class CompressionHook : public CommHook {
 public:
  explicit CompressionHook(at::ScalarType dtype);
  dist::WorkPtr run(dist::ProcessGroup& pg, at::Tensor& bucket) override;
  std::string name() const override;

 private:
  at::ScalarType dtype_;
};

std::shared_ptr<CommHook> fp16_compress_hook();
std::shared_ptr<CommHook> bf16_compress_hook();

/// A user hook from a function: fn(pg, bucket) -> Work, with the contract above.
class FunctionHook : public CommHook {
 public:
  using Fn = std::function<dist::WorkPtr(dist::ProcessGroup&, at::Tensor&)>;
  FunctionHook(std::string name, Fn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  dist::WorkPtr run(dist::ProcessGroup& pg, at::Tensor& bucket) override { return fn_(pg, bucket); }
  std::string name() const override { return name_; }

 private:
  std::string name_;
  Fn fn_;
};

}  // namespace paratrain
