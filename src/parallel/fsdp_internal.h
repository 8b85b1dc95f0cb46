#pragma once

// FullyShardedDataParallel's state, shared by fully_sharded_data_parallel.cpp (construction,
// forward, state) and fsdp_units.cpp (gathering, freeing and reducing one unit, and the autograd
// functions that run units).

#include "paratrain/parallel/fully_sharded_data_parallel.h"

#include <torch/nn/modules/container/any.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace fsdp_detail {

// The unit-sized blocks FSDP needs again and again (gathered weights, flat gradients), kept for
// the next unit of the same size instead of going back to the allocator, as the CUDA caching
// allocator keeps them on a GPU. On the CPU each such block would otherwise be freed to the C
// library and allocated again a moment later: with glibc's defaults every block over its mmap
// threshold is mapped anew and its pages faulted in again, and with the heap kept
// (keep_freed_memory) smaller allocations split the freed blocks so that the next gather grows
// the heap. A block of a size not kept empties the pool first, so it holds only blocks of the
// sizes in use since then, and the end of each backward empties it: between steps (the
// optimizer's step, evaluation) FSDP keeps no block.
class BlockPool {
 public:
  /// A block of `nbytes` from `allocator`: a kept one of that size, or a new one.
  c10::DataPtr take(c10::Allocator* allocator, size_t nbytes);
  /// Keeps `block` (of `nbytes`) for a later take() of the same size and allocator.
  void give(c10::Allocator* allocator, size_t nbytes, c10::DataPtr block);
  /// A 1-D tensor of `numel` elements in a block of the pool (contents undefined).
  torch::Tensor empty(int64_t numel, const torch::TensorOptions& options);
  /// Gives back the block of `t`, a tensor empty() made, if `t` is the only tensor on its
  /// storage (nothing else still views the block); resets `t`.
  void recycle(torch::Tensor& t);
  /// Bytes of the blocks kept, not in use.
  int64_t kept_bytes() const;
  /// Frees the blocks kept.
  void clear() { kept_.clear(); }

 private:
  std::multimap<std::pair<c10::Allocator*, size_t>, c10::DataPtr> kept_;
};

// Where a unit's weights are, as FSDP2's sharded and unsharded states: only in the shard (`full`
// has no storage); being gathered into `full` (the all-gather is in flight, or done and not yet
// waited on); or unsharded, the module's parameters viewing `full`. Units without parameters stay
// sharded.
enum class UnitPhase { kSharded, kGathering, kUnsharded };

// One flat parameter and its shard. Units are numbered in the order they run; unit 0 is the
// root (possibly without parameters).
struct UnitState {
  FullyShardedDataParallel::Unit layout;
  std::vector<size_t> children;       // the Sequential's entries this unit covers
  std::vector<torch::Tensor> params;  // the module's own variables, pointed at `full` when gathered
  torch::ScalarType dtype = torch::kFloat;  // the parameters' (and the shard's)
  torch::Tensor shard;                      // [padded / world], a leaf the optimizer steps
  torch::Tensor full;  // [padded] in the compute dtype; its storage is freed between uses
  UnitPhase phase = UnitPhase::kSharded;
  dist::WorkPtr gather;
  torch::Tensor gather_input;  // the cast shard, alive while the gather runs
  dist::WorkPtr reduce;
  torch::Tensor reduce_input, reduce_output;
  torch::Tensor
      unsynced;  // fp32 [padded]: gradients summed under set_requires_gradient_sync(false)
  // Offload: the store's blocks of the shard and of its gradient ("" when in memory); a read of
  // the shard queued ahead of its all-gather, and the write of the gradient in flight, with the
  // buffers they use.
  std::string param_key, grad_key;
  std::shared_future<void> param_read, grad_write;
  torch::Tensor param_buffer, grad_buffer;
  bool has_params() const { return layout.padded > 0; }
};

}  // namespace fsdp_detail

struct FullyShardedDataParallel::Impl {
  torch::nn::Sequential module;
  std::vector<torch::nn::AnyModule> entries;  // module's children, in order
  std::vector<int> unit_of_entry;             // -1: the root's
  dist::ProcessGroupPtr group;
  FsdpOptions options;
  std::vector<fsdp_detail::UnitState> units;  // [0] is the root
  torch::ScalarType compute_dtype = torch::kFloat;
  torch::ScalarType reduce_dtype = torch::kFloat;
  bool sync = true;
  bool backward_queued = false;
  std::weak_ptr<Impl> self;  // what autograd nodes and the end-of-backward callback hold
  fsdp_detail::BlockPool pool;
  // Names this instance's blocks apart from another's in a shared store.
  uint64_t id = 0;
  // register_post_accumulate_grad_hook's, called with each shard as its gradient becomes final.
  std::vector<std::function<void(const torch::Tensor&)>> grad_hooks;

  // fsdp_units.cpp
  void issue_gather(fsdp_detail::UnitState& u);
  void use_gathered(fsdp_detail::UnitState& u);
  void release(fsdp_detail::UnitState& u);
  void release_all();
  void prefetch(int index);
  torch::Tensor run_entries(const fsdp_detail::UnitState& u, torch::Tensor x);
  void reduce_gradient(fsdp_detail::UnitState& u, std::vector<torch::Tensor> grads);
  void finish_reduce(fsdp_detail::UnitState& u);
  void queue_finalize();
  void finalize_backward();
  torch::Tensor run_unit(int index, const torch::Tensor& input, bool graph);
  torch::Tensor mark_backward_start(const torch::Tensor& output);

  // fsdp_offload.cpp
  optim::OffloadStore* store() const { return options.offload().store().get(); }
  void offload_unit(fsdp_detail::UnitState& u);
  void read_ahead(fsdp_detail::UnitState& u);
  torch::Tensor shard_values(fsdp_detail::UnitState& u);
  torch::Tensor read_shard(const fsdp_detail::UnitState& u) const;
  void set_shard_values(fsdp_detail::UnitState& u, const torch::Tensor& values);
  void add_offloaded_gradient(fsdp_detail::UnitState& u, const torch::Tensor& g);
  torch::Tensor read_gradient(const fsdp_detail::UnitState& u) const;
  void write_gradient(fsdp_detail::UnitState& u, const torch::Tensor& g);
  void settle_offload();
};

}  // namespace paratrain
