// One FSDP unit's life: gathered, run, freed, gathered again for backward, its gradient
// reduce-scattered into the shard. The two autograd functions that give libtorch modules the
// hooks FSDP needs live here too.

#include "fsdp_internal.h"

#include "recompute.h"

#include <ATen/core/ivalue.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <cstddef>

namespace paratrain {

using fsdp_detail::UnitPhase;
using fsdp_detail::UnitState;
using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// The gathered buffer's storage is emptied and refilled in place, the way PyTorch's FSDP resizes
// its unsharded flat parameter's storage to zero: tensors that autograd saved during forward
// (a weight's transposed view, say) alias this storage, and see the weights again once backward
// gathers them into it. No ATen call empties a storage while tensors view it, hence StorageImpl.
// The block goes back to the pool for the next unit.
void free_storage(const Tensor& t, fsdp_detail::BlockPool& pool) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = storage->nbytes();
  c10::DataPtr block = storage->set_data_ptr(c10::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
  if (block.get() != nullptr) {
    pool.give(storage->allocator(), nbytes, std::move(block));
  }
}

void allocate_storage(const Tensor& t, fsdp_detail::BlockPool& pool) {
  const c10::DeviceGuard guard(t.device());  // the CUDA allocator allocates on the current device
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (storage->nbytes() >= nbytes) {
    return;
  }
  storage->set_data_ptr_noswap(pool.take(storage->allocator(), nbytes));
  storage->set_nbytes(nbytes);
}

using Impl = FullyShardedDataParallel::Impl;

// An autograd node's hold on the FSDP object: weak, so a graph that outlives the object (a loss
// kept after the wrapper is gone) fails with a line instead of using freed memory.
struct ImplRef : torch::CustomClassHolder {
  explicit ImplRef(std::weak_ptr<Impl> i) : impl(std::move(i)) {}
  std::weak_ptr<Impl> impl;
};

c10::IValue hold(const std::weak_ptr<Impl>& impl) {
  return c10::IValue::make_capsule(c10::make_intrusive<ImplRef>(impl));
}

std::shared_ptr<Impl> held(const c10::IValue& v) {
  auto capsule = v.toCapsule();
  std::shared_ptr<Impl> impl = static_cast<ImplRef*>(capsule.get())->impl.lock();
  TORCH_CHECK(impl != nullptr,
              "FullyShardedDataParallel was destroyed before a backward through its forward; "
              "keep it alive until backward has run");
  return impl;
}

}  // namespace

namespace fsdp_detail {

c10::DataPtr BlockPool::take(c10::Allocator* allocator, size_t nbytes) {
  auto it = kept_.find({allocator, nbytes});
  if (it == kept_.end()) {
    // Units of another size are coming (a model whose units differ): what is kept is freed
    // first, so that the pool never holds more than the blocks in use since the last miss.
    kept_.clear();
    return allocator->allocate(nbytes);
  }
  c10::DataPtr block = std::move(it->second);
  kept_.erase(it);
  return block;
}

void BlockPool::give(c10::Allocator* allocator, size_t nbytes, c10::DataPtr block) {
  kept_.emplace(std::make_pair(allocator, nbytes), std::move(block));
}

Tensor BlockPool::empty(int64_t numel, const torch::TensorOptions& options) {
  const c10::DeviceGuard guard(options.device());
  // The allocator an empty tensor of these options gets (c10's table has no CUDA entry in
  // libtorch up to 2.7).
  c10::Allocator* allocator = torch::empty({0}, options).storage().allocator();
  const size_t nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, take(allocator, nbytes), allocator,
                       /*resizable=*/false);
  return torch::empty({0}, options).set_(storage, 0, {numel}, {1});
}

int64_t BlockPool::kept_bytes() const {
  int64_t total = 0;
  for (const auto& entry : kept_) {
    total += static_cast<int64_t>(entry.first.second);
  }
  return total;
}

void BlockPool::recycle(Tensor& t) {
  if (!t.defined()) {
    return;
  }
  const c10::Storage& storage = t.storage();
  const size_t nbytes = storage.nbytes();
  if (t.use_count() == 1 && storage.use_count() == 1 &&
      static_cast<size_t>(t.numel()) * t.element_size() == nbytes && t.storage_offset() == 0) {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    c10::DataPtr block = impl->set_data_ptr(c10::DataPtr(nullptr, t.device()));
    impl->set_nbytes(0);
    give(impl->allocator(), nbytes, std::move(block));
  }
  t = Tensor();
}

}  // namespace fsdp_detail

void FullyShardedDataParallel::Impl::issue_gather(UnitState& u) {
  if (u.phase != UnitPhase::kSharded || !u.has_params()) {
    return;
  }
  allocate_storage(u.full, pool);
  u.gather_input = shard_values(u).to(u.full.scalar_type()).contiguous();
  if (!u.param_key.empty()) {  // the read of the unit that runs next, behind this all-gather
    const auto next = (&u - units.data()) + (backward_queued ? -1 : 1);
    if (next >= 0 && next < static_cast<std::ptrdiff_t>(units.size())) {
      read_ahead(units[static_cast<size_t>(next)]);
    }
  }
  std::vector<Tensor> outputs = u.full.chunk(group->size());
  u.gather = group->allgather(outputs, u.gather_input);
  u.phase = UnitPhase::kGathering;
}

void FullyShardedDataParallel::Impl::use_gathered(UnitState& u) {
  issue_gather(u);
  if (u.phase != UnitPhase::kGathering) {
    return;  // unsharded already, or nothing to gather
  }
  if (u.gather) {  // not if an earlier call waited, then failed making the views
    u.gather->wait();
    u.gather.reset();
    u.gather_input = Tensor();
  }
  for (size_t i = 0; i < u.params.size(); ++i) {
    const int64_t n = c10::multiply_integers(u.layout.shapes[i]);
    u.params[i].set_data(u.full.narrow(0, u.layout.offsets[i], n).view(u.layout.shapes[i]));
  }
  u.phase = UnitPhase::kUnsharded;
}

// Between uses the module's parameters are empty tensors of the dtype they compute in: reading
// one then fails with a shape error instead of reading freed memory. Of that dtype, not the
// shard's: set_data with another dtype drops the parameter's gradient accumulator, and a graph
// recorded before (the unit's forward, under a mixed-precision policy) would then no longer reach
// the parameter in backward.
void FullyShardedDataParallel::Impl::release(UnitState& u) {
  if (u.gather) {
    u.gather->wait();  // the engine may still be writing into the storage
    u.gather.reset();
    u.gather_input = Tensor();
  }
  for (auto& p : u.params) {
    p.set_data(torch::empty({0}, u.full.options().requires_grad(false)));
  }
  if (u.phase != UnitPhase::kSharded) {
    free_storage(u.full, pool);
    u.phase = UnitPhase::kSharded;
  }
}

void FullyShardedDataParallel::Impl::release_all() {
  for (auto& u : units) {
    release(u);
  }
}

void FullyShardedDataParallel::Impl::prefetch(int index) {
  if (options.prefetch() && index > 0 && index < static_cast<int>(units.size())) {
    issue_gather(units[static_cast<size_t>(index)]);
  }
}

Tensor FullyShardedDataParallel::Impl::run_entries(const UnitState& u, Tensor x) {
  for (size_t e : u.children) {
    x = entries[e].forward(x);
  }
  return x;
}

// The unit's whole gradient, flat and padded, in the reduce dtype; reduce-scattered (averaged)
// into the shard, or added to the unsynced sum under set_requires_gradient_sync(false). One
// reduction is in flight at a time: the previous unit's, which overlapped this unit's backward,
// is finished before this unit's flat gradient is made, so that its block serves this one.
void FullyShardedDataParallel::Impl::reduce_gradient(UnitState& u, std::vector<Tensor> grads) {
  torch::NoGradGuard no_grad;
  if (sync) {
    for (auto& other : units) {
      finish_reduce(other);  // this unit's own too: a second backward through it before a step
    }
  }
  Tensor flat = pool.empty(u.layout.padded, u.shard.options());
  int64_t filled = 0;  // parameters are laid out in order: zero what no gradient covers
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t n = c10::multiply_integers(u.layout.shapes[i]);
    Tensor slot = flat.narrow(0, u.layout.offsets[i], n);
    if (grads[i].defined()) {
      slot.copy_(grads[i].reshape({-1}));
      grads[i] = Tensor();  // freed as it is copied: the whole gradient is held once
    } else {
      slot.zero_();
    }
    filled = u.layout.offsets[i] + n;
  }
  flat.narrow(0, filled, u.layout.padded - filled).zero_();
  if (u.unsynced.defined()) {
    flat.add_(u.unsynced);
    u.unsynced = Tensor();
  }
  if (!sync) {
    u.unsynced = std::move(flat);
    return;
  }
  if (flat.scalar_type() == reduce_dtype) {
    u.reduce_input = std::move(flat);
  } else {
    u.reduce_input = pool.empty(u.layout.padded, flat.options().dtype(reduce_dtype));
    u.reduce_input.copy_(flat);
    pool.recycle(flat);
  }
  u.reduce_output = torch::empty({u.shard.numel()}, u.reduce_input.options());
  std::vector<Tensor> inputs = u.reduce_input.chunk(group->size());
  u.reduce = group->reduce_scatter(u.reduce_output, inputs, dist::ReduceOp::kAvg);
}

void FullyShardedDataParallel::Impl::finish_reduce(UnitState& u) {
  if (!u.reduce) {
    return;
  }
  u.reduce->wait();
  u.reduce.reset();
  torch::NoGradGuard no_grad;
  const dist::ProcessGroupPtr& replicas = options.replicate_group();
  if (replicas != nullptr && replicas->size() > 1) {
    replicas->allreduce(u.reduce_output, dist::ReduceOp::kAvg)->wait();  // HSDP
  }
  Tensor g = u.reduce_output.to(u.shard.scalar_type());
  Tensor& grad = u.shard.mutable_grad();
  if (!u.grad_key.empty()) {
    add_offloaded_gradient(u, g);
  } else if (grad.defined()) {
    grad.add_(g);
  } else {
    grad = g;
  }
  pool.recycle(u.reduce_input);  // the sends are done: the block serves the next unit
  u.reduce_output = Tensor();
  for (const auto& hook : grad_hooks) {
    hook(u.shard);
  }
}

// Runs once when a backward through forward()'s output ends: the reductions still in flight
// finish, the root's gradient (accumulated by autograd into its parameters' .grad) is reduced,
// and every gathered buffer is freed.
void FullyShardedDataParallel::Impl::finalize_backward() {
  backward_queued = false;
  for (auto& u : units) {
    finish_reduce(u);
  }
  UnitState& root = units[0];
  std::vector<Tensor> grads;
  for (auto& p : root.params) {
    grads.push_back(std::move(p.mutable_grad()));
    p.mutable_grad() = Tensor();
  }
  release_all();  // before the root's flat gradient is made: its weights are no longer needed
  if (root.has_params()) {
    reduce_gradient(root, std::move(grads));
    finish_reduce(root);
  }
  pool.clear();  // the step's blocks go back to the allocator until the next forward
  settle_offload();
}

// Once per backward. The callback holds the object weakly: a backward that outlives it fails in
// held() first.
void FullyShardedDataParallel::Impl::queue_finalize() {
  if (!backward_queued) {
    backward_queued = true;
    torch::autograd::Engine::get_default_engine().queue_callback([weak = self] {
      if (auto impl = weak.lock()) {
        impl->finalize_backward();
      }
    });
  }
}

namespace {

// A unit's forward and backward. Forward gathers the unit, runs it with grad on a detached
// input (its own graph, kept in the context), and frees the weights; backward gathers them into
// the same storage, backpropagates through that graph with torch::autograd::grad (which hands
// back the parameters' gradients instead of accumulating them), and reduce-scatters them. With
// activation checkpointing forward keeps no graph, and backward rebuilds it first, replaying
// the RNG. `shard` is an input only so that the node is in the graph when `input` needs no
// gradient (a first unit fed with data); it receives its gradient through the reduction.
struct UnitFunction : public torch::autograd::Function<UnitFunction> {
  using Impl = FullyShardedDataParallel::Impl;

  static variable_list forward(
      AutogradContext* ctx, Tensor input, Tensor shard, Impl* impl, int64_t index) {
    (void)shard;
    UnitState& u = impl->units[static_cast<size_t>(index)];
    impl->use_gathered(u);
    impl->prefetch(static_cast<int>(index) + 1);
    ctx->saved_data["impl"] = hold(impl->self);
    ctx->saved_data["index"] = index;
    ctx->saved_data["input_requires_grad"] = input.requires_grad();
    Tensor x = input.detach();
    Tensor out;
    if (impl->options.activation_checkpointing()) {
      recompute::save(ctx);
      out = impl->run_entries(u, x);
      ctx->saved_data["input"] = x;
      impl->release(u);
      return {out};
    }
    x.requires_grad_(input.requires_grad());
    {
      torch::AutoGradMode enable(true);
      out = impl->run_entries(u, x);
    }
    ctx->saved_data["input"] = x;
    ctx->saved_data["output"] = out;
    if (impl->options.reshard_after_forward()) {
      impl->release(u);
    }
    return {out.detach()};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::shared_ptr<Impl> impl = held(ctx->saved_data["impl"]);
    const int index = static_cast<int>(ctx->saved_data["index"].toInt());
    TORCH_CHECK(ctx->saved_data.count("input"),
                "FullyShardedDataParallel: a backward ran a second time through one forward; "
                "backpropagate once per forward (retain_graph is not supported)");
    UnitState& u = impl->units[static_cast<size_t>(index)];
    impl->queue_finalize();
    impl->use_gathered(u);
    impl->prefetch(index - 1);
    Tensor x = ctx->saved_data["input"].toTensor();
    Tensor out;
    if (impl->options.activation_checkpointing()) {
      x = x.detach().requires_grad_(ctx->saved_data["input_requires_grad"].toBool());
      out = recompute::replay(ctx, [&] { return impl->run_entries(u, x); });
    } else {
      out = ctx->saved_data["output"].toTensor();
      ctx->saved_data.erase("output");
    }
    std::vector<Tensor> inputs, param_grads(u.params.size());
    std::vector<size_t> which;
    if (x.requires_grad()) {
      inputs.push_back(x);
    }
    for (size_t i = 0; i < u.params.size(); ++i) {
      if (u.params[i].requires_grad()) {
        inputs.push_back(u.params[i]);
        which.push_back(i);
      }
    }
    Tensor grad_input;
    if (out.requires_grad() && !inputs.empty()) {
      auto got = torch::autograd::grad({out}, inputs, {grads[0]}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
      size_t k = 0;
      if (x.requires_grad()) {
        grad_input = got[k++];
      }
      for (size_t i : which) {
        param_grads[i] = got[k++];
      }
    }
    ctx->saved_data.erase("input");
    // Gradients that reached the parameters' .grad instead (a checkpoint() inside the unit
    // backpropagates into .grad itself) belong to the unit's gradient too.
    for (size_t i = 0; i < u.params.size(); ++i) {
      if (u.params[i].grad().defined()) {
        param_grads[i] =
            param_grads[i].defined() ? param_grads[i] + u.params[i].grad() : u.params[i].grad();
        u.params[i].mutable_grad() = Tensor();
      }
    }
    out = Tensor();
    impl->release(u);  // before the flat gradient is made: the weights are no longer needed
    impl->reduce_gradient(u, std::move(param_grads));
    return {grad_input, Tensor(), Tensor(), Tensor()};
  }
};

// Identity on forward()'s output: its backward is the first node a backward through the output
// runs, which is where the end-of-backward work is queued. The root is gathered again here in case
// something released it since the forward (a forward without grad in between, another backward's
// end): the storage is refilled in place, so what this graph saved of the root's weights sees them
// again.
struct BackwardStart : public torch::autograd::Function<BackwardStart> {
  static variable_list forward(AutogradContext* ctx, Tensor output, Impl* impl) {
    ctx->saved_data["impl"] = hold(impl->self);
    return {output};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::shared_ptr<Impl> impl = held(ctx->saved_data["impl"]);
    impl->queue_finalize();
    impl->use_gathered(impl->units[0]);
    return {grads[0], Tensor()};
  }
};

}  // namespace

Tensor FullyShardedDataParallel::Impl::run_unit(int index, const Tensor& input, bool graph) {
  UnitState& u = units[static_cast<size_t>(index)];
  if (!graph) {
    use_gathered(u);
    prefetch(index + 1);
    Tensor out = run_entries(u, input);
    release(u);
    return out;
  }
  return UnitFunction::apply(input, u.shard, this, static_cast<int64_t>(index))[0];
}

Tensor FullyShardedDataParallel::Impl::mark_backward_start(const Tensor& output) {
  return BackwardStart::apply(output, this)[0];
}

}  // namespace paratrain
