#include "paratrain/parallel/zero_redundancy_optimizer.h"

#include "paratrain/io/checkpoint.h"   // optimizer_state, load_optimizer_state
#include "paratrain/io/safetensors.h"  // encode_safetensors, load_safetensors_bytes

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <set>

namespace paratrain {

struct ZeroRedundancyOptimizer::Plan {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::unique_ptr<torch::optim::Optimizer> local;
  std::vector<std::vector<int>> owner;
  std::vector<std::vector<size_t>> owned;
};

namespace {

void check_shardable(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::set<const void*> seen;
  const torch::Tensor* first = nullptr;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      const torch::Tensor& p = groups[g].params()[i];
      const std::string where = "parameter " + std::to_string(i) + " of group " + std::to_string(g);
      TORCH_CHECK(p.defined(), "ZeroRedundancyOptimizer: ", where, " is undefined");
      TORCH_CHECK(!p.is_sparse(), "ZeroRedundancyOptimizer: ", where,
                  " is sparse; only dense parameters can be sharded");
      TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "ZeroRedundancyOptimizer: ", where,
                  " is listed twice");
      if (first == nullptr) {
        first = &p;
      }
      TORCH_CHECK(p.scalar_type() == first->scalar_type() && p.device() == first->device(),
                  "ZeroRedundancyOptimizer: every parameter must have one dtype and device (as "
                  "PyTorch's), but ",
                  where, " is ", p.scalar_type(), " on ", p.device(), " and the first is ",
                  first->scalar_type(), " on ", first->device(),
                  "; shard each kind with its own ZeroRedundancyOptimizer");
    }
  }
  TORCH_CHECK(first != nullptr, "ZeroRedundancyOptimizer: there are no parameters to shard");
}

}  // namespace

std::shared_ptr<ZeroRedundancyOptimizer::Plan> ZeroRedundancyOptimizer::make_plan(
    std::vector<torch::optim::OptimizerParamGroup> groups,
    const OptimizerFactory& make_local,
    const dist::ProcessGroupPtr& group) {
  TORCH_CHECK(group != nullptr, "ZeroRedundancyOptimizer: the process group is null");
  TORCH_CHECK(make_local != nullptr, "ZeroRedundancyOptimizer: no optimizer factory was given");
  check_shardable(groups);
  auto plan = std::make_shared<Plan>();
  const int world = group->size();
  std::vector<int64_t> sizes(static_cast<size_t>(world), 0);  // elements per rank, all groups
  std::vector<torch::optim::OptimizerParamGroup> local_groups;
  plan->owned.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    std::vector<size_t> order(params.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return params[a].numel() > params[b].numel(); });
    plan->owner.emplace_back(params.size(), 0);
    std::vector<torch::Tensor> mine;
    for (size_t i : order) {
      const int rank =
          static_cast<int>(std::min_element(sizes.begin(), sizes.end()) - sizes.begin());
      plan->owner[g][i] = rank;
      sizes[static_cast<size_t>(rank)] += params[i].numel();
      if (rank == group->rank()) {
        plan->owned[g].push_back(i);
        mine.push_back(params[i]);
      }
    }
    local_groups.emplace_back(std::move(mine));
    if (groups[g].has_options()) {
      local_groups.back().set_options(groups[g].options().clone());
    }
  }
  plan->local = make_local(std::move(local_groups));
  TORCH_CHECK(plan->local != nullptr, "ZeroRedundancyOptimizer: the factory returned no optimizer");
  TORCH_CHECK(plan->local->param_groups().size() == groups.size(),
              "ZeroRedundancyOptimizer: the factory's optimizer has ",
              plan->local->param_groups().size(), " parameter groups, expected ", groups.size(),
              " (build it from the groups it is given)");
  plan->groups = std::move(groups);
  return plan;
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(const std::shared_ptr<Plan>& plan)
    : torch::optim::Optimizer(plan->groups, plan->local->defaults().clone()),
      local_(std::move(plan->local)),
      owner_(std::move(plan->owner)),
      owned_(std::move(plan->owned)) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(
    std::vector<torch::optim::OptimizerParamGroup> groups,
    const OptimizerFactory& make_local,
    dist::ProcessGroupPtr group)
    : ZeroRedundancyOptimizer(make_plan(std::move(groups), make_local, group)) {
  group_ = std::move(group);
  by_rank_.resize(static_cast<size_t>(group_->size()));
  for (size_t g = 0; g < owner_.size(); ++g) {
    // Broadcast order: each owner's parameters in its local optimizer's order.
    std::vector<size_t> order(owner_[g].size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return param_groups()[g].params()[a].numel() > param_groups()[g].params()[b].numel();
    });
    for (size_t i : order) {
      by_rank_[static_cast<size_t>(owner_[g][i])].push_back(param_groups()[g].params()[i]);
    }
  }
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::Tensor> params,
                                                 const OptimizerFactory& make_local,
                                                 dist::ProcessGroupPtr group)
    : ZeroRedundancyOptimizer(
          std::vector<torch::optim::OptimizerParamGroup>{
              torch::optim::OptimizerParamGroup(std::move(params))},
          make_local,
          std::move(group)) {}

int ZeroRedundancyOptimizer::owner(size_t group_index, size_t index) const {
  TORCH_CHECK(group_index < owner_.size() && index < owner_[group_index].size(),
              "ZeroRedundancyOptimizer::owner: no parameter ", index, " in group ", group_index);
  return owner_[group_index][index];
}

torch::Tensor ZeroRedundancyOptimizer::step(LossClosure closure) {
  TORCH_CHECK(param_groups().size() == owner_.size(),
              "ZeroRedundancyOptimizer: ", param_groups().size() - owner_.size(),
              " parameter group(s) were added after construction (add_param_group), which are not "
              "sharded; pass every group to the constructor");
  for (size_t g = 0; g < owner_.size(); ++g) {
    TORCH_CHECK(param_groups()[g].params().size() == owner_[g].size(),
                "ZeroRedundancyOptimizer: group ", g, " has ", param_groups()[g].params().size(),
                " parameters but ", owner_[g].size(),
                " were sharded at construction; parameters added later are not optimized");
  }
  // Schedules and scalers change the options of param_groups(); the local optimizer steps with
  // them.
  for (size_t g = 0; g < param_groups().size(); ++g) {
    local_->param_groups()[g].set_options(param_groups()[g].options().clone());
  }
  torch::Tensor loss = local_->step(std::move(closure));
  broadcast_parameters();
  return loss;
}

void ZeroRedundancyOptimizer::broadcast_parameters() {
  torch::NoGradGuard no_grad;
  // One flat broadcast per owning rank: fewer, larger messages than one per parameter.
  std::vector<torch::Tensor> flats(by_rank_.size());
  std::vector<dist::WorkPtr> works;
  for (size_t r = 0; r < by_rank_.size(); ++r) {
    const auto& params = by_rank_[r];
    if (params.empty()) {
      continue;
    }
    if (static_cast<int>(r) == group_->rank()) {
      std::vector<torch::Tensor> pieces;
      for (const auto& p : params) {
        pieces.push_back(p.detach().reshape({-1}));
      }
      flats[r] = torch::cat(pieces);
    } else {
      int64_t n = 0;
      for (const auto& p : params) {
        n += p.numel();
      }
      flats[r] = torch::empty({n}, params[0].options().requires_grad(false));
    }
    works.push_back(group_->broadcast(flats[r], static_cast<int>(r)));
  }
  for (auto& w : works) {
    w->wait();
  }
  for (size_t r = 0; r < by_rank_.size(); ++r) {
    if (static_cast<int>(r) == group_->rank() || by_rank_[r].empty()) {
      continue;
    }
    int64_t offset = 0;
    for (auto& p : by_rank_[r]) {
      p.detach().copy_(flats[r].narrow(0, offset, p.numel()).view_as(p));
      offset += p.numel();
    }
  }
}

std::map<std::string, torch::Tensor> ZeroRedundancyOptimizer::sharded_state() {
  std::map<std::string, torch::Tensor> out;
  for (auto& [key, value] : optimizer_state(*local_)) {
    // "<group>.<local index>.<field>" -> "<group>.<index in param_groups()>.<field>"
    const size_t dot1 = key.find('.');
    const size_t dot2 = key.find('.', dot1 + 1);
    const size_t g = std::stoul(key.substr(0, dot1));
    const size_t local = std::stoul(key.substr(dot1 + 1, dot2 - dot1 - 1));
    out[std::to_string(g) + "." + std::to_string(owned_[g][local]) + key.substr(dot2)] = value;
  }
  return out;
}

namespace {

torch::Tensor to_bytes(const std::map<std::string, torch::Tensor>& tensors) {
  SafetensorsParts parts = encode_safetensors(tensors);
  int64_t size = static_cast<int64_t>(parts.header.size());
  for (const auto& t : parts.tensors) {
    size += static_cast<int64_t>(t.nbytes());
  }
  torch::Tensor out = torch::empty({size}, torch::kByte);
  auto* dst = static_cast<char*>(out.data_ptr());
  std::memcpy(dst, parts.header.data(), parts.header.size());
  dst += parts.header.size();
  for (const auto& t : parts.tensors) {
    std::memcpy(dst, t.data_ptr(), t.nbytes());
    dst += t.nbytes();
  }
  return out;
}

}  // namespace

std::map<std::string, torch::Tensor> ZeroRedundancyOptimizer::consolidate_state(int to) {
  TORCH_CHECK(to >= 0 && to < group_->size(), "consolidate_state: rank ", to,
              " is outside the group of ", group_->size());
  std::map<std::string, torch::Tensor> mine = sharded_state();
  // Byte messages on the parameters' device, so a CUDA-only (nccl) group can carry them.
  const torch::Device device = param_groups()[0].params()[0].device();
  if (group_->rank() != to) {
    torch::Tensor bytes = to_bytes(mine).to(device);
    torch::Tensor size =
        torch::full({1}, bytes.numel(), torch::TensorOptions(torch::kLong).device(device));
    group_->send(size, to, /*tag=*/0)->wait();
    group_->send(bytes, to, /*tag=*/1)->wait();
    return {};
  }
  for (int r = 0; r < group_->size(); ++r) {
    if (r == to) {
      continue;
    }
    torch::Tensor size = torch::empty({1}, torch::TensorOptions(torch::kLong).device(device));
    group_->recv(size, r, /*tag=*/0)->wait();
    torch::Tensor bytes =
        torch::empty({size.item<int64_t>()}, torch::TensorOptions(torch::kByte).device(device));
    group_->recv(bytes, r, /*tag=*/1)->wait();
    bytes = bytes.cpu();
    auto theirs = load_safetensors_bytes(bytes.data_ptr(), static_cast<size_t>(bytes.numel()),
                                         "rank " + std::to_string(r) + "'s optimizer shard");
    for (auto& [key, value] : theirs) {
      mine[key] = value.to(device);
    }
  }
  return mine;
}

void ZeroRedundancyOptimizer::load_state(const std::map<std::string, torch::Tensor>& state) {
  std::map<std::string, torch::Tensor> local;
  for (const auto& [key, value] : state) {
    const size_t dot1 = key.find('.');
    const size_t dot2 = dot1 == std::string::npos ? dot1 : key.find('.', dot1 + 1);
    TORCH_CHECK(dot2 != std::string::npos, "ZeroRedundancyOptimizer::load_state: key '", key,
                "' is not <group>.<index>.<field>");
    const size_t g = std::stoul(key.substr(0, dot1));
    const size_t i = std::stoul(key.substr(dot1 + 1, dot2 - dot1 - 1));
    TORCH_CHECK(g < owner_.size() && i < owner_[g].size(),
                "ZeroRedundancyOptimizer::load_state: key '", key,
                "' names no parameter of this optimizer (another model?)");
    if (owner_[g][i] != group_->rank()) {
      continue;
    }
    const size_t local_index =
        static_cast<size_t>(std::find(owned_[g].begin(), owned_[g].end(), i) - owned_[g].begin());
    local[std::to_string(g) + "." + std::to_string(local_index) + key.substr(dot2)] = value;
  }
  load_optimizer_state(*local_, local);
}

int64_t ZeroRedundancyOptimizer::state_bytes() {
  int64_t bytes = 0;
  for (const auto& item : optimizer_state(*local_)) {
    bytes += static_cast<int64_t>(item.second.nbytes());
  }
  return bytes;
}

}  // namespace paratrain
