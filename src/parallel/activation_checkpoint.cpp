#include "paratrain/parallel/activation_checkpoint.h"

#include "recompute.h"

#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <set>

namespace paratrain {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Fn = std::function<Tensor(const Tensor&)>;

struct FnHolder : torch::CustomClassHolder {
  explicit FnHolder(Fn f) : fn(std::move(f)) {}
  Fn fn;
};

// The reentrant form of torch.utils.checkpoint: forward runs without grad; backward reruns the
// function with grad from the saved input and RNG states, then backpropagates through that
// fresh graph, which accumulates the parameters' gradients where they belong. `anchor` is a
// tensor that requires grad, so the node is in the graph even when the input needs no gradient
// (a model's first layer); it gets no gradient.
struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, Tensor input, Tensor anchor, const Fn* fn) {
    (void)anchor;
    // fn points into checkpoint()'s caller, alive only during this call: the node keeps a copy
    // (AutogradContext holds IValues, so in a capsule).
    ctx->saved_data["function"] = c10::IValue::make_capsule(c10::make_intrusive<FnHolder>(*fn));
    ctx->saved_data["input_requires_grad"] = input.requires_grad();
    ctx->save_for_backward({input});  // version-checked: an in-place change is an error
    recompute::save(ctx);
    return {(*fn)(input)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Tensor input = ctx->get_saved_variables()[0].detach();
    input.requires_grad_(ctx->saved_data["input_requires_grad"].toBool());
    const Fn fn = function_of(ctx);
    ctx->saved_data.erase("function");
    Tensor output = recompute::replay(ctx, [&] { return fn(input); });
    if (output.requires_grad()) {
      torch::autograd::backward({output}, {grads[0]});
    }
    return {input.requires_grad() ? input.grad() : Tensor(), Tensor(), Tensor()};
  }

  static Fn function_of(AutogradContext* ctx) {
    TORCH_CHECK(ctx->saved_data.count("function"),
                "checkpoint: a backward ran a second time through one checkpointed call; "
                "backpropagate once per forward (retain_graph is not supported)");
    auto capsule = ctx->saved_data.at("function").toCapsule();
    return static_cast<FnHolder*>(capsule.get())->fn;
  }
};

// A child of apply_activation_checkpointing(): the wrapped module's children, parameters and
// buffers are registered here under their own names, so the wrapper adds no level to parameter
// names.
class CheckpointedImpl : public torch::nn::Module {
 public:
  explicit CheckpointedImpl(torch::nn::AnyModule wrapped) : wrapped_(std::move(wrapped)) {
    const std::shared_ptr<torch::nn::Module> inner = wrapped_.ptr();
    for (const auto& child : inner->named_children()) {
      register_module(child.key(), child.value());
    }
    for (const auto& p : inner->named_parameters(/*recurse=*/false)) {
      register_parameter(p.key(), p.value(), p.value().requires_grad());
    }
    for (const auto& b : inner->named_buffers(/*recurse=*/false)) {
      register_buffer(b.key(), b.value());
    }
  }

  Tensor forward(const Tensor& x) {
    return checkpoint([this](const Tensor& in) { return wrapped_.forward(in); }, x);
  }

  // The wrapped module is not registered (its children are, under its own names), so the
  // training flag that its own forward may read is passed on here.
  void train(bool on) override {
    torch::nn::Module::train(on);
    wrapped_.ptr()->train(on);
  }

 private:
  torch::nn::AnyModule wrapped_;
};
TORCH_MODULE(Checkpointed);

}  // namespace

Tensor checkpoint(const Fn& function, const Tensor& input) {
  TORCH_CHECK(function != nullptr, "checkpoint: the function is empty");
  if (!torch::GradMode::is_enabled()) {
    return function(input);
  }
  Tensor anchor = torch::empty({0}, input.options().dtype(torch::kFloat)).requires_grad_(true);
  return CheckpointFunction::apply(input, anchor, &function)[0];
}

torch::nn::Sequential apply_activation_checkpointing(const torch::nn::Sequential& model,
                                                     const std::vector<std::string>& names) {
  TORCH_CHECK(model, "apply_activation_checkpointing: the model is null");
  std::set<std::string> wanted(names.begin(), names.end());
  std::set<std::string> found;
  torch::nn::Sequential out;
  auto children = model->named_children();
  size_t i = 0;
  for (auto it = model->begin(); it != model->end(); ++it, ++i) {
    const std::string& name = children[i].key();
    if (wanted.count(name)) {
      out->push_back(name, torch::nn::AnyModule(Checkpointed(*it)));
      found.insert(name);
    } else {
      out->push_back(name, *it);
    }
  }
  for (const auto& name : names) {
    TORCH_CHECK(found.count(name), "apply_activation_checkpointing: the model has no child '", name,
                "'; its children are the names model->named_children() lists");
  }
  return out;
}

}  // namespace paratrain
