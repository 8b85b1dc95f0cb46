#include "paratrain/parallel/distributed_data_parallel.h"

#include "paratrain/util/trace.h"

#include <ATen/ScalarOps.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <chrono>
#include <map>
#include <sstream>
#include <unordered_set>

namespace paratrain {

namespace {

// Post-hook on a gradient accumulator: runs once backward has accumulated the parameter's
// gradient (see Note [How DDP reduces gradients]).
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

std::string describe_param(const std::string& name, const at::Tensor& p) {
  std::ostringstream s;
  s << "'" << name << "' " << p.scalar_type() << " " << p.sizes();
  return s.str();
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(
    std::shared_ptr<torch::nn::Module> module,
    std::function<torch::Tensor(const torch::Tensor&)> forward,
    dist::ProcessGroupPtr pg,
    DDPOptions options)
    : module_(std::move(module)),
      forward_(std::move(forward)),
      pg_(std::move(pg)),
      options_(std::move(options)) {
  TORCH_CHECK(pg_ != nullptr, "DistributedDataParallel needs a process group");
  TORCH_CHECK(options_.bucket_cap_mb() > 0 && options_.first_bucket_mb() > 0,
              "DistributedDataParallel: bucket_cap_mb and first_bucket_mb must be positive, got ",
              options_.bucket_cap_mb(), " and ", options_.first_bucket_mb());
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (item.value().requires_grad()) {
      names_.push_back(item.key());
      params_.push_back(item.value());
    }
  }
  TORCH_CHECK(!params_.empty(),
              "DistributedDataParallel: the module has no parameter that "
              "requires a gradient; there is nothing to synchronise");
  if (pg_->size() > 1) {
    verify_same_parameters();
    broadcast_state(/*parameters=*/true, /*buffers=*/true);
  }
  inverse_world_size_ = at::native::wrapped_scalar_tensor(1.0 / static_cast<double>(pg_->size()));
  build_buckets();
  ready_.assign(params_.size(), false);
  used_.assign(params_.size(), !options_.find_unused_parameters());
  in_graph_.assign(params_.size(), true);
  register_hooks();
}

DistributedDataParallel::~DistributedDataParallel() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

void DistributedDataParallel::register_comm_hook(std::shared_ptr<CommHook> hook) {
  TORCH_CHECK(hook != nullptr, "register_comm_hook: the hook is null");
  // A backward's buckets must all be averaged one way (copied divided, or divided by the hook).
  // try_lock: a hook that registered another from inside run() holds the lock on this thread.
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  TORCH_CHECK(lock.owns_lock() && !backward_started_,
              "register_comm_hook: a backward is running (or the last one failed: run a forward "
              "first); register the hook between steps");
  hook_ = std::move(hook);
}

std::vector<std::vector<size_t>> DistributedDataParallel::bucket_assignment() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) {
    out.push_back(b.params);
  }
  return out;
}

// Every rank publishes "name dtype shape" of each parameter; all ranks compare against rank 0 and
// fail together (none is left waiting in a later collective) naming the first difference.
void DistributedDataParallel::verify_same_parameters() {
  std::ostringstream sig;
  for (size_t i = 0; i < params_.size(); ++i) {
    sig << describe_param(names_[i], params_[i]) << "\n";
  }
  const std::string mine = sig.str();
  // On the parameters' device: nccl moves only CUDA tensors.
  const auto on = torch::TensorOptions().device(params_[0].device());
  at::Tensor length =
      torch::tensor({static_cast<int64_t>(mine.size())}, torch::kLong).to(params_[0].device());
  std::vector<at::Tensor> lengths;
  for (int r = 0; r < pg_->size(); ++r) {
    lengths.push_back(torch::zeros({1}, on.dtype(torch::kLong)));
  }
  pg_->allgather(lengths, length)->wait();
  for (auto& l : lengths) {
    l = l.cpu();
  }
  int64_t longest = 0;
  for (const auto& l : lengths) {
    longest = std::max(longest, l.item<int64_t>());
  }
  at::Tensor bytes = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  bytes = bytes.to(params_[0].device());
  std::vector<at::Tensor> all;
  for (int r = 0; r < pg_->size(); ++r) {
    all.push_back(torch::zeros({longest}, on.dtype(torch::kUInt8)));
  }
  pg_->allgather(all, bytes)->wait();
  for (auto& a : all) {
    a = a.cpu();
  }
  auto text_of = [&](int r) {
    return std::string(static_cast<const char*>(all[r].data_ptr()),
                       static_cast<size_t>(lengths[r].item<int64_t>()));
  };
  const std::string reference = text_of(0);
  for (int r = 1; r < pg_->size(); ++r) {
    const std::string other = text_of(r);
    if (other == reference) {
      continue;
    }
    std::istringstream a(reference);
    std::istringstream b(other);
    std::string la, lb;
    int index = 0;
    while (true) {
      bool ha = static_cast<bool>(std::getline(a, la));
      bool hb = static_cast<bool>(std::getline(b, lb));
      if (!ha || !hb || la != lb) {
        TORCH_CHECK(false, "DistributedDataParallel: rank ", r,
                    "'s parameters differ from rank 0's at parameter #", index, ": rank 0 has ",
                    ha ? la : "no more parameters", ", rank ", r, " has ",
                    hb ? lb : "no more parameters", "; every rank must build the same model");
      }
      ++index;
    }
  }
}

// Rank 0's values to everyone, one flat broadcast per dtype and device.
void DistributedDataParallel::broadcast_state(bool parameters, bool buffers) {
  std::vector<at::Tensor> tensors;
  if (parameters) {
    for (const auto& p : module_->parameters()) {
      tensors.push_back(p);
    }
  }
  if (buffers) {
    for (const auto& b : module_->buffers()) {
      tensors.push_back(b);
    }
  }
  std::map<std::pair<int, std::string>, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      groups[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t);
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& group : groups) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : group.second) {
      flat_parts.push_back(t.detach().reshape({-1}));
    }
    at::Tensor flat = torch::cat(flat_parts);
    pg_->broadcast(flat, 0)->wait();
    int64_t offset = 0;
    for (auto& t : group.second) {
      t.detach().copy_(flat.slice(0, offset, offset + t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

void DistributedDataParallel::build_buckets() {
  const double first_cap = options_.first_bucket_mb() * 1024 * 1024;
  const double cap = options_.bucket_cap_mb() * 1024 * 1024;
  location_.assign(params_.size(), {0, 0});
  // As PyTorch's compute_bucket_assignment_by_size: fill a bucket until it reaches its cap
  // (first_cap for the first one), then start the next; a change of dtype or device also starts
  // a new one, since a bucket is one flat tensor.
  std::vector<std::vector<size_t>> groups;
  double bytes = 0;
  bool closed = true;
  for (size_t k = params_.size(); k-- > 0;) {
    const at::Tensor& p = params_[k];
    if (!closed) {
      const at::Tensor& last = params_[groups.back().back()];
      closed = last.scalar_type() != p.scalar_type() || last.device() != p.device();
    }
    if (closed) {
      groups.emplace_back();
      bytes = 0;
      closed = false;
    }
    groups.back().push_back(k);
    bytes += static_cast<double>(p.nbytes());
    closed = bytes >= (groups.size() == 1 ? first_cap : cap);
  }
  for (const auto& g : groups) {
    Bucket b;
    b.params = g;
    int64_t numel = 0;
    for (size_t k : g) {
      b.offsets.push_back(numel);
      numel += params_[k].numel();
    }
    b.flat = torch::zeros({numel}, params_[g.front()].options().requires_grad(false));
    for (size_t pos = 0; pos < g.size(); ++pos) {
      location_[g[pos]] = {buckets_.size(), pos};
    }
    buckets_.push_back(std::move(b));
  }
  if (options_.gradient_as_bucket_view()) {
    torch::NoGradGuard no_grad;
    // Only gradients that exist become aliases now; the others when first computed, so that a
    // parameter that never gets a gradient keeps none (and the optimizer leaves it alone).
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].grad().defined()) {
        at::Tensor alias = grad_alias(i);
        alias.copy_(params_[i].grad());
        params_[i].mutable_grad() = alias;
      }
    }
  }
}

// The parameter's gradient as an alias of its bucket slot: the same memory, but not an autograd
// view, so that libtorch's Optimizer::zero_grad() (which calls detach_() on every gradient) works
// on it.
at::Tensor DistributedDataParallel::grad_alias(size_t index) {
  at::Tensor s = slot(index);
  at::Tensor alias = at::empty({0}, s.options());
  alias.set_(s.storage(), s.storage_offset(), params_[index].sizes(),
             params_[index].contiguous().strides());
  return alias;
}

at::Tensor DistributedDataParallel::slot(size_t index) {
  const auto& loc = location_[index];
  Bucket& b = buckets_[loc.first];
  const int64_t offset = b.offsets[loc.second];
  return b.flat.slice(0, offset, offset + params_[index].numel());
}

void DistributedDataParallel::register_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_INTERNAL_ASSERT(accumulator != nullptr, "no gradient accumulator for ", names_[i]);
    hook_keys_.push_back(accumulator->add_post_hook(
        std::make_unique<ReadyHook>([this, i] { on_gradient_ready(i); })));
    accumulators_.push_back(std::move(accumulator));
  }
}

void DistributedDataParallel::pre_forward() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!unfinished_.empty()) {
      std::string names = unfinished_;
      unfinished_.clear();
      TORCH_CHECK(false,
                  "DistributedDataParallel: expected to have finished reduction in the prior "
                  "iteration before starting a new one: parameters that received no gradient: ",
                  names,
                  ". Your module has parameters that were not used in producing the loss; "
                  "enable unused parameter detection with "
                  "DDPOptions().find_unused_parameters(true)");
    }
  }
  if (options_.broadcast_buffers() && pg_->size() > 1 && !module_->buffers().empty()) {
    broadcast_state(/*parameters=*/false, /*buffers=*/true);
  }
}

void DistributedDataParallel::post_forward(const torch::Tensor& output) {
  if (pg_->size() == 1) {
    return;
  }
  std::unordered_set<torch::autograd::Node*> seen;
  if (options_.find_unused_parameters()) {
    // Walk the autograd graph from the output: accumulators not reached belong to parameters that
    // will get no gradient from this forward's backward.
    std::vector<torch::autograd::Node*> stack;
    if (output.grad_fn()) {
      stack.push_back(output.grad_fn().get());
    }
    while (!stack.empty()) {
      torch::autograd::Node* node = stack.back();
      stack.pop_back();
      if (!seen.insert(node).second) {
        continue;
      }
      for (const auto& edge : node->next_edges()) {
        if (edge.function) {
          stack.push_back(edge.function.get());
        }
      }
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  // As PyTorch, the decision to reduce is taken at forward: a backward of a forward run under
  // no_sync() (or of no forward through this object at all) communicates nothing.
  if (backward_started_) {
    // The previous backward never reached its end-of-backward callback (it threw): start over.
    backward_started_ = false;
    expecting_backward_ = false;
  }
  if (require_sync_ && !expecting_backward_) {
    expecting_backward_ = true;
    std::fill(in_graph_.begin(), in_graph_.end(), false);
  }
  if (options_.find_unused_parameters()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const bool reached = seen.count(accumulators_[i].get()) > 0;
      used_[i] = used_[i] || reached;  // since the last reduction, no_sync forwards included
      if (require_sync_) {
        in_graph_[i] = in_graph_[i] || reached;  // forwards this reduction's backward will cover
      }
    }
  }
}

void DistributedDataParallel::on_gradient_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!expecting_backward_) {
    return;  // no_sync(), a world of one, or a backward not started through forward()
  }
  if (!backward_started_) {
    backward_started_ = true;
    next_bucket_ = 0;
    std::fill(ready_.begin(), ready_.end(), false);
    for (auto& b : buckets_) {
      b.pending = b.params.size();
      b.launched = false;
      b.work.reset();
    }
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
    if (options_.find_unused_parameters()) {
      // Parameters outside this backward's graph are ready now, with whatever gradient they
      // accumulated under no_sync() (or none).
      for (size_t i = 0; i < params_.size(); ++i) {
        if (!in_graph_[i]) {
          mark_ready_locked(i);
        }
      }
    }
  }
  TORCH_CHECK(!ready_[index], "DistributedDataParallel: parameter ", names_[index],
              " received a gradient after it was already reduced in this backward; run one "
              "backward per forward (or wrap the extra forwards in no_sync())");
  mark_ready_locked(index);
  launch_ready_buckets_locked();
}

void DistributedDataParallel::mark_ready_locked(size_t index) {
  if (ready_[index]) {
    return;
  }
  ready_[index] = true;
  torch::NoGradGuard no_grad;
  at::Tensor s = slot(index);
  at::Tensor grad = params_[index].grad();
  if (!grad.defined()) {
    s.zero_();  // an unused parameter contributes nothing
  } else if (!(options_.gradient_as_bucket_view() && grad.data_ptr() == s.data_ptr())) {
    if (hook_ == nullptr) {
      // The built-in reduction averages while copying into the bucket, as PyTorch's reducer
      // (one pass over the gradients less than a copy and a division): times the reciprocal of
      // the world size, as a wrapped scalar, so that the result is PyTorch's to the bit.
      at::mul_out(s, grad.reshape({-1}), inverse_world_size_);
    } else {
      s.copy_(grad.reshape({-1}));
    }
    if (options_.gradient_as_bucket_view()) {
      // The optimizer (or zero_grad(set_to_none)) replaced the view: point .grad at it again.
      params_[index].mutable_grad() = grad_alias(index);
    }
  } else if (hook_ == nullptr) {
    s.div_(pg_->size());  // the gradient is the bucket's memory already: as PyTorch, divide it
  }
  buckets_[location_[index].first].pending -= 1;
}

void DistributedDataParallel::launch_ready_buckets_locked() {
  // Buckets start in index order on every rank, whatever order their gradients arrived in, so
  // that all ranks issue the same collectives in the same order.
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& b = buckets_[next_bucket_];
    b.launched_at = std::chrono::steady_clock::now();
    // Without a hook, the bucket holds the gradients averaged already (mark_ready_locked).
    b.work =
        hook_ != nullptr ? hook_->run(*pg_, b.flat) : pg_->allreduce(b.flat, dist::ReduceOp::kSum);
    b.launched = true;
    ++next_bucket_;
  }
}

void DistributedDataParallel::finalize_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  backward_started_ = false;
  expecting_backward_ = false;
  if (next_bucket_ < buckets_.size()) {
    // Some parameters got no gradient: their buckets never started. Finish what did start (the
    // same on every rank), and report at the next forward, as PyTorch does.
    std::string names;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!ready_[i]) {
        names += (names.empty() ? "" : ", ") + names_[i];
      }
    }
    unfinished_ = names;
    for (auto& b : buckets_) {
      if (b.launched) {
        b.work->wait();
      }
    }
    return;
  }
  auto start = std::chrono::steady_clock::now();
  trace::Tracer* tracer = trace::current();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    buckets_[i].work->wait();
    if (tracer != nullptr) {  // each bucket's allreduce from launch to the end of its wait
      tracer->complete("allreduce bucket " + std::to_string(i), "comm", buckets_[i].launched_at,
                       std::chrono::steady_clock::now());
    }
  }
  if (tracer != nullptr) {  // the end of backward's compute: what follows waits for the network
    tracer->complete("allreduce wait (exposed)", "comm", start, std::chrono::steady_clock::now());
  }
  last_exposed_comm_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::vector<bool> globally_used(params_.size(), true);
  if (options_.find_unused_parameters()) {
    // Which parameters some rank used: those get the averaged gradient even where unused locally;
    // the others keep no gradient, as in single-process training.
    std::vector<int> flags(used_.begin(), used_.end());
    at::Tensor used = torch::tensor(flags, torch::kInt).to(params_[0].device());
    pg_->allreduce(used, dist::ReduceOp::kMax)->wait();
    used = used.cpu();
    const int* flag = used.data_ptr<int>();  // one read, not an item() per parameter
    for (size_t i = 0; i < params_.size(); ++i) {
      globally_used[i] = flag[i] != 0;
    }
    std::fill(used_.begin(), used_.end(), false);
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!globally_used[i]) {
      continue;
    }
    at::Tensor s = slot(i).view(params_[i].sizes());
    at::Tensor& grad = params_[i].mutable_grad();
    if (options_.gradient_as_bucket_view()) {
      if (!grad.defined() || grad.data_ptr() != s.data_ptr()) {
        grad = grad_alias(i);
      }
    } else if (!grad.defined()) {
      grad = s.clone();
    } else {
      grad.copy_(s);
    }
  }
}

}  // namespace paratrain
