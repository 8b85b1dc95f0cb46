// FSDP's offload policy (FsdpOffloadPolicy): shards and gradients in an OffloadStore between uses.

#include "fsdp_internal.h"
#include "fsdp_saved.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <string>

namespace paratrain {

using fsdp_detail::UnitState;
using torch::Tensor;

namespace {

// The shard keeps its shape (the optimizer's state and the checkpoints' layout follow it) and
// loses its memory: reading it without the store fails instead of reading stale values.
void drop_storage(const Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

}  // namespace

// Reserves the unit's blocks, moves its shard there when shards are offloaded, and binds them so
// that the optimizer's step finds them. Called as each unit is sharded: the shards never all sit
// in memory at once.
void FullyShardedDataParallel::Impl::offload_unit(UnitState& u) {
  const FsdpOffloadPolicy& policy = options.offload();
  if ((!policy.gradients() && !policy.params()) || !u.has_params()) {
    return;
  }
  TORCH_CHECK(store() != nullptr, "FullyShardedDataParallel: the offload policy moves ",
              policy.params() ? "the shards" : "the gradients",
              " but has no store; give it one (FsdpOffloadPolicy().store(...))");
  TORCH_CHECK(u.shard.device().is_cpu() && u.shard.scalar_type() == torch::kFloat,
              "FullyShardedDataParallel: offload takes fp32 CPU shards; unit '",
              fsdp_saved::unit_key(u.layout), "' is ", u.shard.scalar_type(), " on ",
              u.shard.device());
  const int64_t bytes = static_cast<int64_t>(u.shard.nbytes());
  const std::string base = "fsdp" + std::to_string(id) + "." + fsdp_saved::unit_key(u.layout);
  if (policy.gradients()) {
    u.grad_key = base + ".grad";
    store()->reserve(u.grad_key, bytes);
    store()->discard(u.grad_key);
    store()->bind(u.shard, "grad", u.grad_key);
  }
  if (policy.params()) {
    u.param_key = base + ".param";
    store()->reserve(u.param_key, bytes);
    Tensor values = optim::OffloadStore::buffer(u.shard.numel(), torch::kFloat);
    values.copy_(u.shard.detach());
    store()->wait(store()->write(u.param_key, values.data_ptr()));
    drop_storage(u.shard);
    store()->bind(u.shard, "param", u.param_key);
  }
}

// Queues the read of `u`'s shard, if it is offloaded and not queued yet.
void FullyShardedDataParallel::Impl::read_ahead(UnitState& u) {
  if (u.param_key.empty() || u.param_buffer.defined()) {
    return;
  }
  u.param_buffer = optim::OffloadStore::buffer(u.shard.numel(), torch::kFloat);
  u.param_read = store()->read(u.param_key, u.param_buffer.data_ptr());
}

// The shard's values: the shard, or its block read from the store (the read queued ahead, if
// any, is taken).
Tensor FullyShardedDataParallel::Impl::shard_values(UnitState& u) {
  if (u.param_key.empty()) {
    return u.shard.detach();
  }
  read_ahead(u);
  Tensor values = std::move(u.param_buffer);
  std::shared_future<void> read = std::move(u.param_read);
  u.param_buffer = Tensor();
  u.param_read = {};
  store()->wait(read);
  return values;
}

// The same without touching the reads queued ahead (a const caller: checkpoints).
Tensor FullyShardedDataParallel::Impl::read_shard(const UnitState& u) const {
  if (u.param_key.empty()) {
    return u.shard.detach();
  }
  Tensor values = optim::OffloadStore::buffer(u.shard.numel(), torch::kFloat);
  store()->wait(store()->read(u.param_key, values.data_ptr()));
  return values;
}

void FullyShardedDataParallel::Impl::set_shard_values(UnitState& u, const Tensor& values) {
  if (u.param_key.empty()) {
    u.shard.detach().copy_(values);
    return;
  }
  if (u.param_buffer.defined()) {  // a read ahead of the old values
    store()->wait(u.param_read);
    u.param_buffer = Tensor();
    u.param_read = {};
  }
  Tensor block = optim::OffloadStore::buffer(u.shard.numel(), torch::kFloat);
  block.copy_(values.reshape({-1}));
  store()->wait(store()->write(u.param_key, block.data_ptr()));
}

// What finish_reduce does with .grad (set, or add to what is there), in the store: the block is
// read back and added to when the last step has not used it up. Written behind.
void FullyShardedDataParallel::Impl::add_offloaded_gradient(UnitState& u, const Tensor& g) {
  // One gradient write in flight at a time: the others' buffers go back now, or every unit's
  // gradient would sit in memory until the end of backward.
  for (auto& other : units) {
    if (other.grad_buffer.defined()) {
      store()->wait(other.grad_write);
      other.grad_buffer = Tensor();
      other.grad_write = {};
    }
  }
  Tensor sum = optim::OffloadStore::buffer(u.shard.numel(), torch::kFloat);
  if (store()->written(u.grad_key)) {
    store()->wait(store()->read(u.grad_key, sum.data_ptr()));
    sum.add_(g);
  } else {
    sum.copy_(g);
  }
  u.grad_buffer = sum;
  u.grad_write = store()->write(u.grad_key, sum.data_ptr());
}

// The unit's offloaded gradient (undefined when none is waiting for a step).
Tensor FullyShardedDataParallel::Impl::read_gradient(const UnitState& u) const {
  if (u.grad_key.empty() || !store()->written(u.grad_key)) {
    return Tensor();
  }
  Tensor g = optim::OffloadStore::buffer(u.shard.numel(), torch::kFloat);
  store()->wait(store()->read(u.grad_key, g.data_ptr()));
  return g;
}

void FullyShardedDataParallel::Impl::write_gradient(UnitState& u, const Tensor& g) {
  store()->wait(store()->write(u.grad_key, g.data_ptr()));
}

// Waits for every gradient write and drops every read queued ahead: after a backward, the
// optimizer is about to change the blocks.
void FullyShardedDataParallel::Impl::settle_offload() {
  if (store() == nullptr) {
    return;
  }
  for (auto& u : units) {
    if (u.grad_buffer.defined()) {
      store()->wait(u.grad_write);  // the buffer stays alive until the write has taken it
      u.grad_buffer = Tensor();
      u.grad_write = {};
    }
    if (u.param_buffer.defined()) {
      u.param_read.wait();
      u.param_buffer = Tensor();
      u.param_read = {};
    }
  }
}

void FullyShardedDataParallel::discard_offloaded_gradients() {
  Impl& m = *impl_;
  m.settle_offload();
  for (auto& u : m.units) {
    if (!u.grad_key.empty()) {
      m.store()->discard(u.grad_key);
    }
  }
}

}  // namespace paratrain
