#pragma once

// FullyShardedDataParallel: PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard) for libtorch.
// Where DDP keeps a whole copy of the weights, the gradients and the optimizer's state on every
// rank, FSDP keeps 1/world of each: the model's units (one per transformer block, plus the root,
// which holds every parameter outside the blocks) each own one flat parameter, padded to a
// multiple of the world size and sharded across the ranks. Only the shard lives between uses.
//
//   auto model = paratrain::models::gpt(paratrain::models::gpt_options("gpt2"));
//   paratrain::FullyShardedDataParallel fsdp(model, pg,
//       paratrain::FsdpOptions().units(paratrain::models::gpt_block_names(model)));
//   torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(3e-4));
//   auto logits = fsdp.forward(tokens);              // every rank its own batch
//   loss.backward();                                 // gradients reduce-scattered into shards
//   fsdp.clip_grad_norm_(1.0);                       // optional: the global norm
//   opt.step();
//
// How a step flows:
//  - forward: the root's flat parameter is all-gathered and the module's parameters become views
//    of it; each unit is all-gathered just before it runs (the next unit's all-gather already in
//    flight: prefetch) and freed after it (reshard_after_forward). libtorch modules have no
//    forward hooks, so a unit runs inside a custom autograd function that does this.
//  - backward: the function all-gathers the unit again (prefetching the unit before it), runs
//    the unit's backward, and reduce-scatters the unit's gradient (averaged over the ranks, as
//    DDP averages) into the shard's .grad; the root's gradient is reduce-scattered when the whole
//    backward ends.
//  - the optimizer steps on the shards (parameters()): any torch::optim optimizer, since they
//    update each element from its own gradient and state. The padding stays zero.
//
// With FsdpOptions::activation_checkpointing, a unit's forward keeps only its input, and its
// backward gathers the weights once for both the recompute and the backward.
//
// Mixed precision (FsdpMixedPrecision, as FSDP2's MixedPrecisionPolicy): the shards stay fp32
// (the master weights); the units compute with weights gathered in param_dtype (the shard is
// cast before the all-gather, which halves its traffic), take their inputs cast to it, and
// gradients are reduce-scattered in reduce_dtype, then added to the fp32 shards' .grad.
//
// Backends: every collective goes through paratrain's process group: gloo, mpi or nccl. NCCL and
// MPI (MPI_Reduce_scatter_block) have a reduce-scatter; c10d's Gloo has none, and paratrain's
// gloo group exchanges CPU tensors' pieces between every pair of ranks instead, with a
// reduce-scatter's volume (ProcessGroup::reduce_scatter).
//
// Memory: the gathered weights and the flat gradients are unit-sized blocks that FSDP keeps for
// the next unit instead of freeing them (as the CUDA caching allocator keeps them on a GPU). On
// the CPU the constructor also has glibc map blocks of 32 MiB and more on their own and gives the
// freed unsharded weights back to the kernel (cpu::map_large_blocks, cpu::release_free_memory):
// process-wide settings, see paratrain/util/allocator.h.
//
// Between steps the module's own parameters are empty tensors: read the weights through
// full_state() (a collective), not through the module.
//
// Offload (FsdpOptions::offload, as FSDP2's OffloadPolicy and DeepSpeed's offload_param and
// offload of gradients): each unit's shard, its gradient or both live in an OffloadStore (host
// memory or a file, paratrain/optim/offload.h) between uses. An offloaded shard has no storage
// of its own: a unit's all-gather reads it from the store (the next unit's read already queued),
// and the optimizer's step reads and writes it there. A unit's reduced gradient is added to its
// block in the store instead of the shard's .grad, which stays undefined. Give the optimizer the
// same store (paratrain::optim::FusedAdam or FusedAdamW, offload(store)): its step streams the
// moments, values and gradients through memory unit by unit, and uses the gradients up, as
// zero_grad would (discard_offloaded_gradients() drops them without a step). Training is bitwise
// the same as with everything in memory. CPU shards only.
//
// Threads: forward, backward and the state functions are collectives on the group; call them on
// every rank, in the same order, from one thread.

#include "paratrain/comm/process_group.h"
#include "paratrain/optim/offload.h"
#include "paratrain/parallel/tensor_parallel.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace paratrain {

/// FSDP2's MixedPrecisionPolicy.
struct FsdpMixedPrecision {
  /// The dtype units compute with (nullopt: the parameters' own).
  TORCH_ARG(std::optional<torch::ScalarType>, param_dtype) = std::nullopt;
  /// The dtype gradients are reduce-scattered in (nullopt: param_dtype's).
  TORCH_ARG(std::optional<torch::ScalarType>, reduce_dtype) = std::nullopt;
  /// The dtype forward() returns (nullopt: as the last layer computes it).
  TORCH_ARG(std::optional<torch::ScalarType>, output_dtype) = std::nullopt;
};

/// What of each unit lives in an OffloadStore between uses (FSDP2's OffloadPolicy). The
/// optimizer state is the optimizer's to offload (FusedAdam::offload with the same store).
struct FsdpOffloadPolicy {
  /// Where: host memory or a file (OffloadOptions::dir). nullptr: nothing is offloaded.
  TORCH_ARG(std::shared_ptr<optim::OffloadStore>, store) = nullptr;
  /// The shards' gradients, between backward and the optimizer's step.
  TORCH_ARG(bool, gradients) = false;
  /// The shards themselves (the fp32 weights the optimizer steps), between uses.
  TORCH_ARG(bool, params) = false;
};

struct FsdpOptions {
  /// The children of the Sequential that become units, by name; the other children's
  /// parameters form the root unit. Empty: every child with parameters except the first and the
  /// last (a language model's embedding and head, a classifier's stem and head stay in the root).
  TORCH_ARG(std::vector<std::string>, units) = {};
  /// Free a unit's gathered weights after its forward (gathered again for backward). false keeps
  /// them until backward, trading memory for an all-gather.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Issue the next unit's all-gather before the current unit computes.
  TORCH_ARG(bool, prefetch) = true;
  /// The dtypes parameters are gathered and gradients reduced in (FSDP2's MixedPrecisionPolicy).
  TORCH_ARG(FsdpMixedPrecision, mixed_precision) = {};
  /// Recompute each unit's activations in backward instead of keeping them (checkpoint()).
  TORCH_ARG(bool, activation_checkpointing) = false;
  /// HSDP (FSDP2 on a 2-D mesh): the group of the ranks that hold the same shards
  /// (mesh["dp_replicate"]), the constructor's group being the ranks that shard (mesh["dp_shard"]).
  /// The weights of its rank 0 are kept; each unit's gradient is reduce-scattered over the shard
  /// group, then all-reduced (averaged) over this one. nullptr: plain FSDP.
  TORCH_ARG(dist::ProcessGroupPtr, replicate_group) = nullptr;
  /// Shards and gradients kept in a store between uses (see above).
  TORCH_ARG(FsdpOffloadPolicy, offload) = {};
  /// Called with each child of each unit (the root's first, then the units in order) just before
  /// the unit is flattened and sharded, as FSDP's param_init_fn: with a model whose parameters
  /// are allocated but not yet written (models::GptOptions::defer_init, with
  /// models::gpt_init_weights), no rank ever holds more than one unit whole. The weights of rank
  /// 0 are still the ones kept. The root's children come first: a GPT's weights are gpt()'s when
  /// the root holds the embedding, ln_f and the head only (gpt_block_names' units).
  TORCH_ARG(std::function<void(torch::nn::Module&)>, param_init_fn) = nullptr;
};

class FullyShardedDataParallel {
 public:
  /// Shards `module`'s units over `group`'s ranks. Every rank must pass the same architecture;
  /// the weights of rank 0 are the ones kept (as DDP broadcasts them). Throws c10::Error with
  /// one line for a unit that is not a child, a unit with no parameters, a unit whose
  /// parameters have different dtypes, a parameter shared by two units (naming both), a model
  /// with no unit to shard, and a null group.
  FullyShardedDataParallel(torch::nn::Sequential module,
                           dist::ProcessGroupPtr group,
                           FsdpOptions options = {});
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// Runs the module on this rank's batch (a collective).
  torch::Tensor forward(const torch::Tensor& input);

  /// The shards, one flat tensor per unit (root first) in the parameters' dtype: what the
  /// optimizer steps.
  std::vector<torch::Tensor> parameters() const;

  /// Calls `hook` with each shard (parameters()) once its gradient for this backward is final:
  /// after its reduce-scatter in a backward that synchronizes, as PyTorch runs the
  /// post-accumulate-grad hooks of FSDP2's sharded parameters; on the thread that runs backward,
  /// the units in the order backward reaches them, the root last. With an offloaded optimizer,
  /// `opt.step_parameter(shard)` there streams each unit's state while backward goes on (the
  /// optimizer in backward); step() then finishes. A backward that fails has called the hooks of
  /// the units it finished before failing: after it, restore the last checkpoint.
  void register_post_accumulate_grad_hook(std::function<void(const torch::Tensor&)> hook);

  /// FSDP2's set_requires_gradient_sync: false makes backward add each unit's whole gradient to
  /// a local sum instead of reduce-scattering it (no_sync accumulation; it costs the unsharded
  /// gradients' memory); the next backward with true reduce-scatters the sum. The sum is not
  /// part of the optimizer's zero_grad(): end an accumulation with a synchronized backward.
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;

  /// Clips the gradients to a global L2 norm of max_norm (a collective: the shards' squared
  /// norms are summed over the ranks) and returns the norm before clipping, as
  /// torch.nn.utils.clip_grad_norm_. max_norm <= 0 only measures.
  double clip_grad_norm_(double max_norm);
  /// The same for a module whose parameters are themselves parts over a tensor-parallel group
  /// (parallelize_module's layout): the squared norms of the parameters the layout splits are
  /// summed over `tp` as well, the others counted once (they are equal on every tp rank).
  double clip_grad_norm_(double max_norm,
                         const TensorParallelLayout& layout,
                         const dist::ProcessGroupPtr& tp);
  [[deprecated("clip_grad_norm is now clip_grad_norm_, as PyTorch's FSDP names it")]] double
  clip_grad_norm(double max_norm) {
    return clip_grad_norm_(max_norm);
  }

  /// Each unit as it is sharded: the child names it covers ("" for the root's name), its
  /// parameters' names (as module->named_parameters() gives them), shapes and offsets in the
  /// flat parameter, the flat size and the padded size.
  struct Unit {
    std::string name;
    std::vector<std::string> params;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<int64_t> offsets;
    int64_t numel = 0;
    int64_t padded = 0;
  };
  std::vector<Unit> units() const;
  int world_size() const;
  int rank() const;

  /// The whole model's weights by parameter name, in the parameters' dtype (a collective: every
  /// rank gathers every unit, one at a time, and holds the whole model: mind the memory).
  std::map<std::string, torch::Tensor> full_state();
  /// Takes each parameter of a whole state (by name; from full_state(), a checkpoint or an
  /// unsharded model) into the shards: every rank keeps its slices. No communication. Throws
  /// c10::Error naming the first missing parameter or differing shape.
  void load_full_state(const std::map<std::string, torch::Tensor>& state);

  /// This rank's shards, one flat tensor per unit, by unit name ("root" for the root): what a
  /// sharded checkpoint saves. No communication.
  std::map<std::string, torch::Tensor> sharded_state() const;
  /// Shards saved by a world of shards.size() ranks (shards[r] is rank r's sharded_state(), any
  /// world size): each unit's flat parameter is put back together and this rank takes its slice
  /// for the current world. No communication. Throws c10::Error naming a missing unit or a flat
  /// size that differs (a checkpoint of another model or shape).
  void load_sharded_state(const std::vector<std::map<std::string, torch::Tensor>>& shards);
  /// This rank's own shards, saved by this rank in a job of the same world size (its
  /// sharded_state()): copied back bit for bit. Throws c10::Error naming a missing unit or a
  /// size that differs.
  void load_own_shards(const std::map<std::string, torch::Tensor>& shards);
  /// The same resharding for any tensors laid out as the shards (an optimizer's exp_avg):
  /// pieces[r] is rank r's piece of unit `unit`'s flat tensor; returns this rank's.
  torch::Tensor reshard(size_t unit, const std::vector<torch::Tensor>& pieces) const;

  /// With gradients offloaded: forgets the gradients in the store, as the optimizer's
  /// zero_grad() forgets those in memory (which it cannot reach there). No-op otherwise.
  void discard_offloaded_gradients();

  /// Bytes of gathered-weight and gradient blocks kept for the next unit, not in use now (what
  /// torch.cuda.memory_reserved counts beyond the allocated memory, for FSDP's own blocks):
  /// during a forward and backward; none once a backward has ended.
  int64_t kept_bytes() const;

  torch::nn::Sequential& module();
  const dist::ProcessGroupPtr& process_group() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;  // shared: autograd nodes hold it weakly
};

/// How `units` flatten and shard over `world` ranks, without a process group: the layout a
/// checkpoint made by that world has. Also used to reshard on another world size.
int64_t fsdp_padded_size(int64_t numel, int world);

}  // namespace paratrain
