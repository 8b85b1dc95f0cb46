#include "paratrain/parallel/sync_batchnorm.h"

#include "util/batchnorm.h"

#include <torch/autograd.h>
#include <torch/custom_class.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>

#include <c10/util/Exception.h>

#include <map>
#include <ostream>

namespace paratrain {
namespace {

// The process group travels to backward inside the autograd context, as a capsule (an IValue
// that holds any intrusive_ptr without registering a TorchScript class).
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(dist::ProcessGroupPtr g) : group(std::move(g)) {}
  dist::ProcessGroupPtr group;
};

// Dimensions reduced per channel: all but dimension 1.
std::vector<int64_t> reduce_dims(const torch::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) {
    dims.push_back(d);
  }
  return dims;
}

// [C] -> [1, C, 1, ...] to broadcast against x.
torch::Tensor per_channel(const torch::Tensor& v, const torch::Tensor& x) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = v.size(0);
  return v.view(shape);
}

c10::ScalarType accumulate_type(const torch::Tensor& x) {
  return x.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
}

struct GlobalStats {
  torch::Tensor mean;  // [C], double
  torch::Tensor m2;    // [C], double: sum of squared deviations over all rows
  double count = 0;    // rows per channel over all ranks
};

// Chan's parallel combination of every rank's (count, mean, M2), gathered in one allgather.
GlobalStats gather_stats(const torch::Tensor& x, dist::ProcessGroup& group) {
  const int64_t channels = x.size(1);
  const int64_t rows = channels == 0 ? 0 : x.numel() / channels;
  auto dopt = x.options().dtype(torch::kDouble);
  torch::Tensor mean = torch::zeros({channels}, dopt);
  torch::Tensor m2 = torch::zeros({channels}, dopt);
  if (rows > 0) {
    torch::Tensor local_mean = x.mean(reduce_dims(x));
    m2 = (x - per_channel(local_mean, x)).pow(2).sum(reduce_dims(x)).to(torch::kDouble);
    mean = local_mean.to(torch::kDouble);
  }
  torch::Tensor packed =
      torch::cat({torch::full({1}, static_cast<double>(rows), dopt), mean, m2}).contiguous();
  std::vector<torch::Tensor> all;
  for (int r = 0; r < group.size(); ++r) {
    all.push_back(torch::empty_like(packed));
  }
  group.allgather(all, packed)->wait();
  torch::Tensor stacked = torch::stack(all);  // [W, 2C + 1]
  torch::Tensor counts = stacked.select(1, 0).unsqueeze(1);
  torch::Tensor means = stacked.narrow(1, 1, channels);
  torch::Tensor m2s = stacked.narrow(1, 1 + channels, channels);
  GlobalStats out;
  out.count = counts.sum().item<double>();
  if (out.count > 0) {
    out.mean = (means * counts).sum(0) / out.count;
    out.m2 = m2s.sum(0) + (counts * (means - out.mean).pow(2)).sum(0);
  }
  return out;
}

struct SyncBatchNormFunction : torch::autograd::Function<SyncBatchNormFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               const torch::Tensor& input,
                               const torch::Tensor& weight,
                               const torch::Tensor& bias,
                               const torch::Tensor& running_mean,
                               const torch::Tensor& running_var,
                               double eps,
                               double momentum,
                               const c10::IValue& capsule) {
    auto group = c10::static_intrusive_pointer_cast<GroupCapsule>(capsule.toCapsule())->group;
    torch::Tensor x = input.to(accumulate_type(input));
    GlobalStats stats = gather_stats(x, *group);
    TORCH_CHECK(stats.count > 1,
                "SyncBatchNorm: expected more than 1 value per channel when training, got input of "
                "shape ",
                input.sizes(), " on rank ", group->rank(), " (", stats.count,
                " values per channel over all ", group->size(), " ranks)");
    torch::Tensor invstd = (stats.m2 / stats.count + eps).rsqrt();
    if (running_mean.defined()) {
      torch::NoGradGuard no_grad;
      running_mean.mul_(1 - momentum).add_(stats.mean.to(running_mean.scalar_type()), momentum);
      torch::Tensor unbiased = stats.m2 / (stats.count - 1);
      running_var.mul_(1 - momentum).add_(unbiased.to(running_var.scalar_type()), momentum);
    }
    torch::Tensor mean = stats.mean.to(x.scalar_type());
    invstd = invstd.to(x.scalar_type());
    torch::Tensor out = (x - per_channel(mean, x)) * per_channel(invstd, x);
    if (weight.defined()) {
      out = out * per_channel(weight.to(x.scalar_type()), x) +
            per_channel(bias.to(x.scalar_type()), x);
    }
    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["count"] = stats.count;
    ctx->saved_data["group"] = capsule;
    return out.to(input.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor& input = saved[0];
    const torch::Tensor& weight = saved[1];
    const torch::Tensor& mean = saved[2];
    const torch::Tensor& invstd = saved[3];
    const double count = ctx->saved_data["count"].toDouble();
    auto group =
        c10::static_intrusive_pointer_cast<GroupCapsule>(ctx->saved_data["group"].toCapsule())
            ->group;
    torch::Tensor x = input.to(accumulate_type(input));
    torch::Tensor dy = grads[0].to(x.scalar_type());
    torch::Tensor xmu = x - per_channel(mean, x);
    const int64_t channels = x.size(1);
    torch::Tensor sum_dy = torch::zeros({channels}, x.options());
    torch::Tensor sum_dy_xmu = torch::zeros({channels}, x.options());
    if (x.numel() > 0) {
      sum_dy = dy.sum(reduce_dims(x));
      sum_dy_xmu = (dy * xmu).sum(reduce_dims(x));
    }
    torch::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      // The global sums: the input gradient of one BatchNorm over every rank's rows.
      torch::Tensor sums = torch::cat({sum_dy, sum_dy_xmu}).to(torch::kDouble).contiguous();
      group->allreduce(sums, dist::ReduceOp::kSum)->wait();
      torch::Tensor mean_dy = (sums.narrow(0, 0, channels) / count).to(x.scalar_type());
      torch::Tensor mean_dy_xmu = (sums.narrow(0, channels, channels) / count).to(x.scalar_type());
      torch::Tensor scale = weight.defined() ? invstd * weight.to(x.scalar_type()) : invstd;
      grad_input =
          (dy - per_channel(mean_dy, x) - xmu * per_channel(invstd * invstd * mean_dy_xmu, x)) *
          per_channel(scale, x);
      grad_input = grad_input.to(input.scalar_type());
    }
    if (weight.defined() && ctx->needs_input_grad(1)) {
      grad_weight = (sum_dy_xmu * invstd).to(weight.scalar_type());
    }
    if (weight.defined() && ctx->needs_input_grad(2)) {
      grad_bias = sum_dy.to(weight.scalar_type());
    }
    return {grad_input,      grad_weight,     grad_bias,       torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// A BatchNorm{1,2,3}d's options and tensors, whichever dimension it has.
template <typename Impl>
bool read_batchnorm(const torch::nn::Module& module,
                    SyncBatchNormOptions* options,
                    std::vector<torch::Tensor>* tensors) {
  const auto* bn = module.as<Impl>();
  if (bn == nullptr) {
    return false;
  }
  const auto& o = bn->options;
  options->num_features(o.num_features())
      .eps(o.eps())
      .affine(o.affine())
      .track_running_stats(o.track_running_stats());
  options->momentum(o.momentum() ? std::optional<double>(*o.momentum()) : std::nullopt);
  *tensors = {bn->weight, bn->bias, bn->running_mean, bn->running_var, bn->num_batches_tracked};
  return true;
}

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_) : options(std::move(options_)) {
  reset();
}

std::shared_ptr<SyncBatchNormImpl> SyncBatchNormImpl::adopt(const torch::nn::Module& batchnorm,
                                                            dist::ProcessGroupPtr group) {
  SyncBatchNormOptions options(0);
  std::vector<torch::Tensor> tensors;
  TORCH_CHECK(read_batchnorm<torch::nn::BatchNorm1dImpl>(batchnorm, &options, &tensors) ||
                  read_batchnorm<torch::nn::BatchNorm2dImpl>(batchnorm, &options, &tensors) ||
                  read_batchnorm<torch::nn::BatchNorm3dImpl>(batchnorm, &options, &tensors),
              "SyncBatchNorm::adopt: expected a BatchNorm1d, BatchNorm2d or BatchNorm3d, got ",
              batchnorm.name());
  options.process_group(std::move(group));
  auto out = std::shared_ptr<SyncBatchNormImpl>(new SyncBatchNormImpl(options, tensors));
  return out;
}

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_,
                                     std::vector<torch::Tensor> adopted)
    : options(std::move(options_)), adopted_(std::move(adopted)) {
  reset();
}

void SyncBatchNormImpl::reset() {
  TORCH_CHECK(options.num_features() > 0, "SyncBatchNorm: num_features must be positive, got ",
              options.num_features());
  const int64_t c = options.num_features();
  // adopt(): the BatchNorm's own tensors, in the order read_batchnorm lists them.
  auto take = [&](size_t i, torch::Tensor fresh) {
    return adopted_.empty() ? std::move(fresh) : adopted_[i];
  };
  if (options.affine()) {
    // An adopted parameter keeps its requires_grad (a frozen BatchNorm stays frozen).
    torch::Tensor w = take(0, torch::ones({c}));
    torch::Tensor b = take(1, torch::zeros({c}));
    const bool w_grad = adopted_.empty() || w.requires_grad();
    const bool b_grad = adopted_.empty() || b.requires_grad();
    weight = register_parameter("weight", w, w_grad);
    bias = register_parameter("bias", b, b_grad);
  } else {
    weight = bias = torch::Tensor();
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", take(2, torch::zeros({c})));
    running_var = register_buffer("running_var", take(3, torch::ones({c})));
    num_batches_tracked =
        register_buffer("num_batches_tracked", take(4, torch::tensor(0, torch::kLong)));
  } else {
    running_mean = running_var = num_batches_tracked = torch::Tensor();
  }
  adopted_.clear();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "paratrain::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2,
              "SyncBatchNorm: expected at least 2-D input [N, C, ...], got shape ", input.sizes());
  TORCH_CHECK(input.size(1) == options.num_features(), "SyncBatchNorm: expected ",
              options.num_features(), " channels (dimension 1), got input of shape ",
              input.sizes());
  // PyTorch's _BatchNorm.forward: the average factor, and when batch statistics are used.
  double factor = 0.0;
  if (is_training() && options.track_running_stats()) {
    num_batches_tracked.add_(1);
    factor = options.momentum() ? *options.momentum()
                                : 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
  }
  const bool batch_stats = is_training() || !running_mean.defined();
  const auto& group = options.process_group();
  if (!(is_training() && batch_stats && group && group->size() > 1)) {
    return torch::batch_norm(input, weight, bias, running_mean, running_var, batch_stats, factor,
                             options.eps(), /*cudnn_enabled=*/true);
  }
  auto capsule = c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
  return SyncBatchNormFunction::apply(input, weight, bias, running_mean, running_var, options.eps(),
                                      factor, capsule);
}

namespace {

struct Replacement {
  std::string path;  // for messages
  torch::nn::Module* parent = nullptr;
  std::string name;
  torch::nn::AnyModule* slot = nullptr;  // the AnyModule the parent's forward calls
};

// Every BatchNorm under `module`, with where it is called from; throws for one that is a plain
// C++ member (nothing to rebind), before anything changed.
void find_batchnorms(torch::nn::Module& module,
                     const std::string& path,
                     std::vector<Replacement>* found) {
  std::map<std::string, torch::nn::AnyModule*> slots;
  if (auto* seq = module.as<torch::nn::Sequential>()) {
    auto names = module.named_children();
    size_t i = 0;
    for (auto it = seq->begin(); it != seq->end(); ++it, ++i) {
      slots[names[i].key()] = &*it;
    }
  } else if (auto* owner = dynamic_cast<NormSlots*>(&module)) {
    for (auto& [name, slot] : owner->norm_slots()) {
      slots[name] = slot;
    }
  }
  for (const auto& child : module.named_children()) {
    const std::string child_path = path.empty() ? child.key() : path + "." + child.key();
    if (paratrain::detail::is_torch_batchnorm(*child.value())) {
      auto slot = slots.find(child.key());
      TORCH_CHECK(slot != slots.end(), "convert_sync_batchnorm: cannot replace '", child_path,
                  "': its parent ", module.name(),
                  " calls it through a C++ member, which cannot be rebound; put it in a "
                  "Sequential, list it in the parent's paratrain::NormSlots, or build the model "
                  "with paratrain::SyncBatchNorm");
      found->push_back({child_path, &module, child.key(), slot->second});
    } else {
      find_batchnorms(*child.value(), child_path, found);
    }
  }
}

}  // namespace

int64_t convert_sync_batchnorm(const std::shared_ptr<torch::nn::Module>& module,
                               dist::ProcessGroupPtr group) {
  TORCH_CHECK(module != nullptr, "convert_sync_batchnorm: the module is null");
  TORCH_CHECK(!paratrain::detail::is_torch_batchnorm(*module),
              "convert_sync_batchnorm: the module is itself a BatchNorm, which cannot be "
              "replaced in place; pass the module that holds it, or build a "
              "paratrain::SyncBatchNorm");
  std::vector<Replacement> found;
  find_batchnorms(*module, "", &found);
  for (auto& r : found) {
    auto old = r.parent->named_children()[r.name];
    auto sync = SyncBatchNormImpl::adopt(*old, group);
    sync->train(old->is_training());
    r.parent->replace_module(r.name, SyncBatchNorm(sync));
    *r.slot = torch::nn::AnyModule(SyncBatchNorm(sync));
  }
  return static_cast<int64_t>(found.size());
}

}  // namespace paratrain
