// Pipeline partitioning: checking a model is a Sequential, cutting it into stages by a balance,
// flattening nested Sequentials, and choosing a balance (by parameter count or by measured time)
// with the linear-partition dynamic programme.

#include "pipeline_internal.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>

namespace paratrain {
namespace pipeline {

nn::Sequential as_sequential(const std::shared_ptr<nn::Module>& module) {
  TORCH_CHECK(module != nullptr, "pipeline: the module is null");
  auto seq = std::dynamic_pointer_cast<nn::SequentialImpl>(module);
  TORCH_CHECK(seq != nullptr, "pipeline: a pipeline needs a torch::nn::Sequential, got ",
              module->name(),
              "; write the model as a Sequential of its layers (as the ModelParallelResNet50 of "
              "PyTorch's model-parallel tutorial is conv1..layer2 then layer3..fc), so it can be "
              "cut between layers");
  return nn::Sequential(seq);
}

std::vector<nn::Sequential> split(const nn::Sequential& model,
                                  const std::vector<int64_t>& balance) {
  const int64_t layers = static_cast<int64_t>(model->size());
  TORCH_CHECK(!balance.empty(), "pipeline: the balance is empty; give one layer count per stage");
  TORCH_CHECK(static_cast<int64_t>(balance.size()) <= layers, "pipeline: ", balance.size(),
              " stages but the model has only ", layers, " layers; use at most ", layers,
              " stages");
  int64_t sum = 0;
  for (size_t i = 0; i < balance.size(); ++i) {
    TORCH_CHECK(balance[i] >= 1, "pipeline: stage ", i, " of the balance has ", balance[i],
                " layers; every stage needs at least one");
    sum += balance[i];
  }
  TORCH_CHECK(sum == layers, "pipeline: the balance ", c10::IntArrayRef(balance), " sums to ", sum,
              " layers but the model has ", layers);
  auto names = model->named_children();
  std::vector<nn::Sequential> stages;
  int64_t next = 0;
  for (int64_t count : balance) {
    nn::Sequential stage;
    for (int64_t j = 0; j < count; ++j, ++next) {
      // AnyModule copies share the layer: the stage trains the model's own parameters.
      stage->push_back(names[static_cast<size_t>(next)].key(),
                       *(model->begin() + static_cast<std::ptrdiff_t>(next)));
    }
    stages.push_back(stage);
  }
  return stages;
}

nn::Sequential flatten(const nn::Sequential& model) {
  nn::Sequential flat;
  auto names = model->named_children();
  size_t i = 0;
  for (auto it = model->begin(); it != model->end(); ++it, ++i) {
    auto inner = std::dynamic_pointer_cast<nn::SequentialImpl>(it->ptr());
    if (inner == nullptr) {
      flat->push_back(names[i].key(), *it);
      continue;
    }
    auto inner_names = inner->named_children();
    size_t j = 0;
    for (auto jt = inner->begin(); jt != inner->end(); ++jt, ++j) {
      flat->push_back(names[i].key() + "_" + inner_names[j].key(), *jt);
    }
  }
  return flat;
}

std::vector<int64_t> partition(const std::vector<double>& costs, int64_t parts) {
  const int64_t n = static_cast<int64_t>(costs.size());
  TORCH_CHECK(parts >= 1, "pipeline: need at least one stage, got ", parts);
  TORCH_CHECK(parts <= n, "pipeline: ", parts, " stages but the model has only ", n,
              " layers; use at most ", n, " stages");
  std::vector<double> prefix(static_cast<size_t>(n + 1), 0);
  for (int64_t i = 0; i < n; ++i) {
    prefix[static_cast<size_t>(i + 1)] =
        prefix[static_cast<size_t>(i)] + costs[static_cast<size_t>(i)];
  }
  // best[k][i]: the smallest largest-part cost of the first i layers in k parts; the classic
  // linear-partition dynamic programme (n is a few dozen layers at most).
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<size_t>(parts + 1),
                                        std::vector<double>(static_cast<size_t>(n + 1), inf));
  std::vector<std::vector<int64_t>> cut(static_cast<size_t>(parts + 1),
                                        std::vector<int64_t>(static_cast<size_t>(n + 1), 0));
  best[0][0] = 0;
  for (int64_t k = 1; k <= parts; ++k) {
    for (int64_t i = k; i <= n; ++i) {
      for (int64_t j = k - 1; j < i; ++j) {
        const double cost =
            std::max(best[static_cast<size_t>(k - 1)][static_cast<size_t>(j)],
                     prefix[static_cast<size_t>(i)] - prefix[static_cast<size_t>(j)]);
        // Ties go to the later cut, which leaves the earlier stages no heavier.
        if (cost <= best[static_cast<size_t>(k)][static_cast<size_t>(i)]) {
          best[static_cast<size_t>(k)][static_cast<size_t>(i)] = cost;
          cut[static_cast<size_t>(k)][static_cast<size_t>(i)] = j;
        }
      }
    }
  }
  std::vector<int64_t> balance(static_cast<size_t>(parts));
  int64_t end = n;
  for (int64_t k = parts; k >= 1; --k) {
    const int64_t begin = cut[static_cast<size_t>(k)][static_cast<size_t>(end)];
    balance[static_cast<size_t>(k - 1)] = end - begin;
    end = begin;
  }
  return balance;
}

std::vector<int64_t> balance_by_parameters(const nn::Sequential& model, int64_t stages) {
  std::vector<double> costs;
  for (const auto& child : model->children()) {
    double n = 0;
    for (const auto& p : child->parameters()) {
      n += static_cast<double>(p.numel());
    }
    costs.push_back(n);
  }
  return partition(costs, stages);
}

std::vector<int64_t> balance_by_time(const nn::Sequential& model,
                                     int64_t stages,
                                     const torch::Tensor& sample,
                                     int repeats) {
  TORCH_CHECK(repeats >= 1, "pipeline: balance_by_time needs repeats >= 1, got ", repeats);
  // Timing runs real forwards and backwards: keep the model's gradients and buffers as they were.
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) {
    grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  }
  std::vector<at::Tensor> buffers;
  for (const auto& b : model->buffers()) {
    buffers.push_back(b.clone());
  }
  std::vector<double> costs;
  at::Tensor x = sample;
  nn::Sequential layers = model;  // non-const: AnyModule::forward is not const
  for (auto it = layers->begin(); it != layers->end(); ++it) {
    double fastest = std::numeric_limits<double>::infinity();
    at::Tensor y;
    for (int r = 0; r < repeats; ++r) {
      at::Tensor in = x.detach();
      if (in.is_floating_point()) {
        in.requires_grad_(true);
      }
      auto t0 = Clock::now();
      y = it->forward(in);
      if (y.requires_grad()) {
        y.backward(torch::ones_like(y));
      }
      fastest = std::min(fastest, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    costs.push_back(fastest);
    x = y.detach();
  }
  torch::NoGradGuard no_grad;
  auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = grads[i];
  }
  auto now = model->buffers();
  for (size_t i = 0; i < now.size(); ++i) {
    now[i].copy_(buffers[i]);
  }
  return partition(costs, stages);
}

}  // namespace pipeline
}  // namespace paratrain
