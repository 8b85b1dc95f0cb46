#include "paratrain/parallel/fully_sharded_data_parallel.h"

#include "fsdp_internal.h"
#include "fsdp_saved.h"

#include "paratrain/util/allocator.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

namespace paratrain {

using fsdp_detail::UnitState;
using torch::Tensor;
using Impl = FullyShardedDataParallel::Impl;

int64_t fsdp_padded_size(int64_t numel, int world) {
  TORCH_CHECK(world >= 1, "fsdp_padded_size: world size ", world, " is below 1");
  return (numel + world - 1) / world * world;
}

namespace {

// Which children become units: the ones named, or every child with parameters but the first
// and the last (a language model's embedding and final norm, a classifier's stem and head).
std::vector<std::string> choose_units(const torch::nn::Sequential& module,
                                      const FsdpOptions& options) {
  if (!options.units().empty()) {
    return options.units();
  }
  std::vector<std::string> with_params;
  for (const auto& child : module->named_children()) {
    if (!child.value()->parameters().empty()) {
      with_params.push_back(child.key());
    }
  }
  if (with_params.size() <= 2) {
    return {};
  }
  return {with_params.begin() + 1, with_params.end() - 1};
}

// The unit's parameters, each variable once (a tensor registered twice within a unit is one
// parameter, under its first name), with their layout in the flat parameter.
void collect_params(UnitState& u,
                    const std::vector<std::pair<std::string, Tensor>>& named,
                    std::map<const void*, std::string>& owner) {
  std::set<const void*> seen;
  for (const auto& [name, p] : named) {
    const void* key = p.unsafeGetTensorImpl();
    auto other = owner.find(key);
    if (other != owner.end() && !seen.count(key)) {
      TORCH_CHECK(false, "FullyShardedDataParallel: parameter '", name, "' of unit '",
                  u.layout.name, "' is also '", other->second,
                  "' of another unit; a parameter shared by two units cannot be sharded: put "
                  "the modules that share it in one unit (or leave them to the root)");
    }
    if (!seen.insert(key).second) {
      continue;
    }
    owner[key] = name;
    TORCH_CHECK(p.requires_grad(), "FullyShardedDataParallel: parameter '", name,
                "' is frozen (requires_grad false); the optimizer steps every element of a flat "
                "shard, weight decay included, so FSDP takes trainable parameters only");
    if (!u.params.empty()) {
      TORCH_CHECK(p.scalar_type() == u.dtype && p.device() == u.params[0].device(),
                  "FullyShardedDataParallel: unit '", u.layout.name, "' mixes ",
                  u.params[0].scalar_type(), " on ", u.params[0].device(), " ('",
                  u.layout.params[0], "') and ", p.scalar_type(), " on ", p.device(), " ('", name,
                  "'); one flat parameter holds one dtype on one device");
    }
    u.dtype = p.scalar_type();
    u.layout.params.push_back(name);
    u.layout.shapes.push_back(p.sizes().vec());
    u.layout.offsets.push_back(u.layout.numel);
    u.layout.numel += p.numel();
    u.params.push_back(p);
  }
}

// Rank 0's weights, flat, cut into this rank's shard; the module's copies are dropped.
void shard_unit(UnitState& u,
                const dist::ProcessGroupPtr& group,
                const dist::ProcessGroupPtr& replicas,
                torch::ScalarType compute) {
  const int world = group->size();
  u.layout.padded = fsdp_padded_size(u.layout.numel, world);
  auto options = torch::TensorOptions().dtype(u.dtype).device(
      u.params.empty() ? torch::Device(torch::kCPU) : u.params[0].device());
  torch::NoGradGuard no_grad;
  Tensor flat = torch::zeros({u.layout.padded}, options);
  for (size_t i = 0; i < u.params.size(); ++i) {
    flat.narrow(0, u.layout.offsets[i], u.params[i].numel()).copy_(u.params[i].reshape({-1}));
  }
  if (world > 1 && u.layout.padded > 0) {
    group->broadcast(flat, 0)->wait();
  }
  if (replicas != nullptr && replicas->size() > 1 && u.layout.padded > 0) {
    replicas->broadcast(flat, 0)->wait();  // HSDP: every replica starts from one copy
  }
  const int64_t size = u.layout.padded / world;
  u.shard = flat.narrow(0, group->rank() * size, size).clone().requires_grad_(true);
  flat = Tensor();
  for (auto& p : u.params) {
    p.set_data(torch::empty({0}, options.dtype(compute)));  // as release() leaves them
  }
  u.full = torch::empty({u.layout.padded}, options.dtype(compute));
  u.full.storage().unsafeGetStorageImpl()->set_data_ptr_noswap(
      c10::DataPtr(nullptr, u.full.device()));
  u.full.storage().unsafeGetStorageImpl()->set_nbytes(0);
}

// Every unit's flat shard, in the dtypes the policy gives, each unit initialised first
// (param_init_fn) and offloaded after (its shard to the store) before the next is made. On the CPU,
// glibc maps the large blocks on their own while the model is copied into shards, and the unsharded
// weights freed meanwhile go back to the kernel instead of staying in a kept heap (allocator.h).
void shard_units(Impl& m) {
  const auto& mp = m.options.mixed_precision();
  const torch::ScalarType own = m.units[1].dtype;
  m.compute_dtype = mp.param_dtype().value_or(own);
  m.reduce_dtype = mp.reduce_dtype().value_or(m.compute_dtype);
  const bool on_cpu = m.units[1].params[0].device().is_cpu();
  if (on_cpu) {
    cpu::map_large_blocks();
  }
  for (auto& u : m.units) {
    if (m.options.param_init_fn()) {
      torch::NoGradGuard no_grad;
      for (size_t e : u.children) {
        m.options.param_init_fn()(*m.module->ptr(e));
      }
    }
    shard_unit(u, m.group, m.options.replicate_group(),
               u.params.empty() ? own : mp.param_dtype().value_or(u.dtype));
    m.offload_unit(u);
    if (on_cpu && m.options.param_init_fn()) {
      // The unit's weights were allocated with the model, before the large blocks were mapped on
      // their own: given back now, page by page, or every unit written would stay resident.
      cpu::release_free_memory();
    }
  }
  if (on_cpu) {
    cpu::release_free_memory();
  }
}

void broadcast_buffers(const torch::nn::Sequential& module, const dist::ProcessGroupPtr& group) {
  if (group->size() == 1) {
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& b : module->buffers()) {
    if (b.defined() && b.numel() > 0) {
      group->broadcast(b, 0)->wait();
    }
  }
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(torch::nn::Sequential module,
                                                   dist::ProcessGroupPtr group,
                                                   FsdpOptions options)
    : impl_(std::make_shared<Impl>()) {
  TORCH_CHECK(group != nullptr, "FullyShardedDataParallel: the process group is null");
  TORCH_CHECK(module, "FullyShardedDataParallel: the module is null");
  Impl& m = *impl_;
  static std::atomic<uint64_t> instances{0};
  m.id = instances++;
  m.self = impl_;
  m.module = module;
  m.group = std::move(group);
  m.options = options;
  const std::vector<std::string> chosen = choose_units(module, options);
  const auto children = module->named_children();
  TORCH_CHECK(!chosen.empty(), "FullyShardedDataParallel: the model has ", children.size(),
              " children and no unit to shard (units are children with parameters besides the "
              "first and the last, or those FsdpOptions::units names); for a model this small "
              "use DistributedDataParallel");
  std::map<std::string, size_t> position;
  for (size_t i = 0; i < children.size(); ++i) {
    position[children[i].key()] = i;
  }
  m.unit_of_entry.assign(children.size(), 0);
  std::set<std::string> seen;
  for (const auto& name : chosen) {
    TORCH_CHECK(position.count(name), "FullyShardedDataParallel: unit '", name,
                "' is not a child of the model; units are named as model->named_children() "
                "names them");
    TORCH_CHECK(seen.insert(name).second, "FullyShardedDataParallel: unit '", name,
                "' is listed twice");
    m.unit_of_entry[position[name]] = 1;
  }
  m.units.resize(1);
  m.units[0].layout.name = "";
  int next = 1;
  for (size_t i = 0; i < children.size(); ++i) {
    if (m.unit_of_entry[i] == 1) {
      m.unit_of_entry[i] = next++;
      UnitState u;
      u.layout.name = children[i].key();
      u.children = {i};
      m.units.push_back(std::move(u));
    } else {
      m.units[0].children.push_back(i);
    }
  }
  for (auto it = module->begin(); it != module->end(); ++it) {
    m.entries.push_back(*it);
  }
  std::map<const void*, std::string> owner;
  auto named_of = [&](const UnitState& u) {
    std::vector<std::pair<std::string, Tensor>> named;
    for (size_t e : u.children) {
      for (const auto& p : children[e].value()->named_parameters()) {
        named.emplace_back(children[e].key() + "." + p.key(), p.value());
      }
    }
    return named;
  };
  for (size_t k = 1; k < m.units.size(); ++k) {
    collect_params(m.units[k], named_of(m.units[k]), owner);
    TORCH_CHECK(!m.units[k].params.empty(), "FullyShardedDataParallel: unit '",
                m.units[k].layout.name,
                "' has no parameters; only children with parameters can be units");
  }
  collect_params(m.units[0], named_of(m.units[0]), owner);
  shard_units(m);
  broadcast_buffers(module, m.group);
  if (m.options.replicate_group() != nullptr) {
    broadcast_buffers(module, m.options.replicate_group());  // HSDP: one copy for every replica
  }
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  if (!impl_) {
    return;
  }
  // First the store's I/O, which may still use the units' buffers (it does not throw here).
  for (auto& u : impl_->units) {
    if (u.param_read.valid()) {
      u.param_read.wait();
    }
    if (u.grad_write.valid()) {
      u.grad_write.wait();
    }
    if (impl_->store() != nullptr) {
      impl_->store()->unbind(u.shard);
    }
  }
  try {
    for (auto& u : impl_->units) {
      if (u.reduce) {
        u.reduce->wait();
      }
      if (u.gather) {
        u.gather->wait();
      }
    }
  } catch (...) {
    // A broken group: the error was thrown where the collective was waited on.
  }
}

Tensor FullyShardedDataParallel::forward(const Tensor& input) {
  Impl& m = *impl_;
  const bool graph = torch::GradMode::is_enabled();
  if (m.backward_queued) {
    // The last backward threw before its end: its reductions are finished (their gradients
    // stay in the shards' .grad, as autograd leaves a failed backward's) and the rest reset; the
    // hooks are not called for a backward that failed.
    struct Restore {
      Impl& m;
      std::vector<std::function<void(const Tensor&)>> hooks;
      ~Restore() { m.grad_hooks = std::move(hooks); }
    } restore{m, std::move(m.grad_hooks)};
    m.grad_hooks.clear();
    for (auto& u : m.units) {
      m.finish_reduce(u);
    }
    m.backward_queued = false;
  }
  UnitState& root = m.units[0];
  m.use_gathered(root);
  m.prefetch(1);
  Tensor x = input;
  if (m.options.mixed_precision().param_dtype() && x.is_floating_point()) {
    x = x.to(m.compute_dtype);
  }
  try {
    for (size_t e = 0; e < m.entries.size(); ++e) {
      const int unit = m.unit_of_entry[e];
      x = unit == 0 ? m.entries[e].forward(x) : m.run_unit(unit, x, graph);
    }
  } catch (...) {
    m.release_all();  // the root too: a pending backward gathers it again (BackwardStart)
    throw;
  }
  if (const auto out = m.options.mixed_precision().output_dtype()) {
    x = x.to(*out);
  }
  if (graph && x.requires_grad()) {
    return m.mark_backward_start(x);
  }
  m.release(root);
  return x;
}

std::vector<Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<Tensor> out;
  for (const auto& u : impl_->units) {
    if (u.has_params()) {
      out.push_back(u.shard);
    }
  }
  return out;
}

void FullyShardedDataParallel::register_post_accumulate_grad_hook(
    std::function<void(const torch::Tensor&)> hook) {
  TORCH_CHECK(hook != nullptr,
              "FullyShardedDataParallel::register_post_accumulate_grad_hook: "
              "the hook is empty");
  impl_->grad_hooks.push_back(std::move(hook));
}

void FullyShardedDataParallel::set_requires_gradient_sync(bool sync) {
  impl_->sync = sync;
}

bool FullyShardedDataParallel::requires_gradient_sync() const {
  return impl_->sync;
}

double FullyShardedDataParallel::clip_grad_norm_(double max_norm) {
  return clip_grad_norm_(max_norm, TensorParallelLayout(), nullptr);
}

namespace {

// The squared norms of a unit's gradient shard: [of the parameters `layout` splits, of the
// others]. The shard covers [rank * size, (rank + 1) * size) of the flat parameter.
std::pair<double, double> shard_square_norms(const UnitState& u,
                                             const Tensor& grad,
                                             int rank,
                                             const TensorParallelLayout& layout) {
  const Tensor g = grad.to(torch::kDouble);
  if (layout.shards.empty()) {
    return {0.0, g.pow(2).sum().item<double>()};
  }
  const int64_t lo = rank * grad.numel(), hi = lo + grad.numel();
  double split = 0, whole = 0;
  for (size_t i = 0; i < u.layout.params.size(); ++i) {
    const int64_t begin = std::max(lo, u.layout.offsets[i]);
    const int64_t end =
        std::min(hi, u.layout.offsets[i] + c10::multiply_integers(u.layout.shapes[i]));
    if (begin >= end) {
      continue;
    }
    const double sq = g.narrow(0, begin - lo, end - begin).pow(2).sum().item<double>();
    (layout.shards.count(u.layout.params[i]) ? split : whole) += sq;
  }
  return {split, whole};
}

}  // namespace

double FullyShardedDataParallel::clip_grad_norm_(double max_norm,
                                                 const TensorParallelLayout& layout,
                                                 const dist::ProcessGroupPtr& tp) {
  TORCH_CHECK(layout.shards.empty() || (tp != nullptr && tp->size() == layout.degree),
              "FullyShardedDataParallel::clip_grad_norm_: a tensor-parallel layout of degree ",
              layout.degree, " needs its group of that size");
  for (const auto& [name, shard] : layout.shards) {
    bool found = false;
    for (const auto& u : impl_->units) {
      found = found || std::find(u.layout.params.begin(), u.layout.params.end(), name) !=
                           u.layout.params.end();
    }
    TORCH_CHECK(found, "FullyShardedDataParallel::clip_grad_norm_: the layout's ", name,
                " is no parameter of the model (parallelize the model FSDP wraps, by its names)");
  }
  torch::NoGradGuard no_grad;
  impl_->settle_offload();
  double split = 0, whole = 0;
  for (const auto& u : impl_->units) {
    const Tensor grad = u.grad_key.empty() ? u.shard.grad() : impl_->read_gradient(u);
    if (u.has_params() && grad.defined()) {
      const auto [a, b] = shard_square_norms(u, grad, rank(), layout);
      split += a;
      whole += b;
    }
  }
  const torch::Device device = impl_->units[1].shard.device();
  Tensor sums = torch::tensor({split, whole}, torch::kDouble).to(device);
  impl_->group->allreduce(sums, dist::ReduceOp::kSum)->wait();
  Tensor parts = sums.narrow(0, 0, 1).clone();  // the split parameters' parts, summed over tp
  if (tp != nullptr && tp->size() > 1) {
    tp->allreduce(parts, dist::ReduceOp::kSum)->wait();
  }
  const double norm = std::sqrt(parts.cpu().item<double>() + sums.cpu()[1].item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (max_norm > 0 && coef < 1) {
    for (auto& u : impl_->units) {
      if (!u.grad_key.empty()) {  // read again and written back: one unit in memory at a time
        Tensor grad = impl_->read_gradient(u);
        if (grad.defined()) {
          grad.mul_(coef);
          impl_->write_gradient(u, grad);
        }
      } else if (u.has_params() && u.shard.grad().defined()) {
        u.shard.mutable_grad().mul_(coef);
      }
    }
  }
  return norm;
}

std::vector<FullyShardedDataParallel::Unit> FullyShardedDataParallel::units() const {
  std::vector<Unit> out;
  for (const auto& u : impl_->units) {
    out.push_back(u.layout);
  }
  return out;
}

int FullyShardedDataParallel::world_size() const {
  return impl_->group->size();
}

int FullyShardedDataParallel::rank() const {
  return impl_->group->rank();
}

std::map<std::string, Tensor> FullyShardedDataParallel::full_state() {
  std::map<std::string, Tensor> out;
  torch::NoGradGuard no_grad;
  for (auto& u : impl_->units) {
    if (!u.has_params()) {
      continue;
    }
    Tensor flat = torch::empty({u.layout.padded}, u.shard.options().requires_grad(false));
    std::vector<Tensor> outputs = flat.chunk(impl_->group->size());
    impl_->group->allgather(outputs, impl_->read_shard(u))->wait();
    for (size_t i = 0; i < u.layout.params.size(); ++i) {
      const int64_t n = c10::multiply_integers(u.layout.shapes[i]);
      out[u.layout.params[i]] =
          flat.narrow(0, u.layout.offsets[i], n).view(u.layout.shapes[i]).clone();
    }
  }
  return out;
}

void FullyShardedDataParallel::load_full_state(const std::map<std::string, Tensor>& state) {
  torch::NoGradGuard no_grad;
  impl_->release_all();  // a gathered copy would keep the old weights
  const int world = impl_->group->size();
  for (auto& u : impl_->units) {
    if (!u.has_params()) {
      continue;
    }
    Tensor flat = torch::zeros({u.layout.padded}, u.shard.options().requires_grad(false));
    for (size_t i = 0; i < u.layout.params.size(); ++i) {
      const std::string& name = u.layout.params[i];
      auto it = state.find(name);
      TORCH_CHECK(it != state.end(), "FullyShardedDataParallel: the state has no '", name,
                  "'; it was saved from another model");
      TORCH_CHECK(it->second.sizes().vec() == u.layout.shapes[i], "FullyShardedDataParallel: '",
                  name, "' is ", it->second.sizes(), " in the state but ", u.layout.shapes[i],
                  " in the model; it was saved from a model of another shape");
      flat.narrow(0, u.layout.offsets[i], it->second.numel()).copy_(it->second.reshape({-1}));
    }
    const int64_t size = u.layout.padded / world;
    impl_->set_shard_values(u, flat.narrow(0, impl_->group->rank() * size, size));
  }
}

std::map<std::string, Tensor> FullyShardedDataParallel::sharded_state() const {
  std::map<std::string, Tensor> out;
  for (const auto& u : impl_->units) {
    if (u.has_params()) {
      out[fsdp_saved::unit_key(u.layout)] = impl_->read_shard(u);
    }
  }
  return out;
}

Tensor FullyShardedDataParallel::reshard(size_t unit, const std::vector<Tensor>& pieces) const {
  TORCH_CHECK(unit < impl_->units.size(), "FullyShardedDataParallel::reshard: unit ", unit, " of ",
              impl_->units.size());
  const UnitState& u = impl_->units[unit];
  const std::string name = fsdp_saved::unit_key(u.layout);
  TORCH_CHECK(!pieces.empty(), "FullyShardedDataParallel: no pieces of unit '", name, "'");
  Tensor flat = torch::cat(pieces).to(u.shard.device());
  TORCH_CHECK(flat.numel() >= u.layout.numel &&
                  flat.numel() == fsdp_padded_size(u.layout.numel, static_cast<int>(pieces.size())),
              "FullyShardedDataParallel: unit '", name, "' has ", flat.numel(), " elements in ",
              pieces.size(), " pieces, but ", u.layout.numel, " parameters padded to ",
              fsdp_padded_size(u.layout.numel, static_cast<int>(pieces.size())),
              " here; it was saved from a model of another shape");
  const int world = impl_->group->size();
  Tensor padded = torch::zeros({u.layout.padded}, flat.options());
  padded.narrow(0, 0, u.layout.numel).copy_(flat.narrow(0, 0, u.layout.numel));
  const int64_t size = u.layout.padded / world;
  return padded.narrow(0, impl_->group->rank() * size, size).clone();
}

void FullyShardedDataParallel::load_sharded_state(
    const std::vector<std::map<std::string, Tensor>>& shards) {
  torch::NoGradGuard no_grad;
  impl_->release_all();  // a gathered copy would keep the old weights
  for (size_t k = 0; k < impl_->units.size(); ++k) {
    UnitState& u = impl_->units[k];
    if (!u.has_params()) {
      continue;
    }
    const std::string name = fsdp_saved::unit_key(u.layout);
    std::vector<Tensor> pieces;
    for (const auto& rank_state : shards) {
      auto it = rank_state.find(name);
      TORCH_CHECK(it != rank_state.end(),
                  "FullyShardedDataParallel: the sharded state has no "
                  "unit '",
                  name, "'; it was saved from another model");
      pieces.push_back(it->second.reshape({-1}));
    }
    impl_->set_shard_values(u, reshard(k, pieces));
  }
}

void FullyShardedDataParallel::load_own_shards(const std::map<std::string, Tensor>& shards) {
  torch::NoGradGuard no_grad;
  impl_->release_all();  // a gathered copy would keep the old weights
  for (auto& u : impl_->units) {
    if (!u.has_params()) {
      continue;
    }
    const std::string name = fsdp_saved::unit_key(u.layout);
    auto it = shards.find(name);
    TORCH_CHECK(it != shards.end(), "FullyShardedDataParallel: the saved shards have no unit '",
                name, "'; they were saved from another model");
    TORCH_CHECK(it->second.numel() == u.shard.numel(), "FullyShardedDataParallel: unit '", name,
                "''s saved shard has ", it->second.numel(), " elements and this rank's ",
                u.shard.numel(), "; it was saved from a model of another shape or world size");
    impl_->set_shard_values(u, it->second.reshape({-1}));
  }
}

int64_t FullyShardedDataParallel::kept_bytes() const {
  return impl_->pool.kept_bytes();
}

torch::nn::Sequential& FullyShardedDataParallel::module() {
  return impl_->module;
}

const dist::ProcessGroupPtr& FullyShardedDataParallel::process_group() const {
  return impl_->group;
}

}  // namespace paratrain
