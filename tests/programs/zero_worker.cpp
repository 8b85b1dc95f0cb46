// A ZeroRedundancyOptimizer test worker. Every rank trains two copies of one network under DDP
// on the same batches: one stepped by ZeroRedundancyOptimizer, one by the same optimizer
// unsharded. SGD with momentum and Adam update each parameter from its own gradient and state, so
// the copies must agree within 1e-6 after every step (they are in fact equal bit for bit).
//
// Also checked on every run:
//  - the ranks' optimizer-state bytes add up to the unsharded optimizer's, and no rank holds
//    more than its share plus the largest parameter's state;
//  - consolidate_state(0) on rank 0 equals optimizer_state() of the unsharded optimizer.
// --save FILE: rank 0 writes the model and the consolidated state (safetensors) at the end.
// --load FILE: both copies start from FILE (the model, and the state through load_state /
//   load_optimizer_state) before training, so a state saved by another world size is resumed.
// --optimizer sgd|adam  --steps N  --groups 1|2 (two groups: the last layer at a tenth of the lr)
// Prints "rank R: ok state_bytes=B unsharded=U" (exit 0) or "MISMATCH ..." / "error: ..." (exit 1).

#include "worker_options.h"

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>
#include <map>

// In the test programs' one binary (main.cpp): run() is this program's main.
namespace paratrain_test_programs {
namespace zero_worker {

namespace pt = paratrain;

namespace {

torch::nn::Sequential net() {
  return torch::nn::Sequential({{"fc0", torch::nn::Linear(20, 64)},
                                {"relu0", torch::nn::ReLU()},
                                {"fc1", torch::nn::Linear(64, 32)},
                                {"relu1", torch::nn::ReLU()},
                                {"fc2", torch::nn::Linear(32, 16)},
                                {"relu2", torch::nn::ReLU()},
                                {"fc3", torch::nn::Linear(16, 5)}});
}

std::vector<torch::optim::OptimizerParamGroup> groups_of(const torch::nn::Sequential& model,
                                                         int groups,
                                                         double lr) {
  if (groups == 1) {
    return {torch::optim::OptimizerParamGroup(model->parameters())};
  }
  std::vector<torch::Tensor> body, head;
  for (const auto& p : model->named_parameters()) {
    (p.key().rfind("fc3.", 0) == 0 ? head : body).push_back(p.value());
  }
  torch::optim::OptimizerParamGroup last(head);
  if (lr > 0) {
    last.set_options(std::make_unique<torch::optim::SGDOptions>(lr / 10));
  }
  return {torch::optim::OptimizerParamGroup(body), std::move(last)};
}

}  // namespace

int run(int argc, char** argv) {
  const Options opt = parse_options(argc, argv);
  int rank = -1;
  try {
    torch::set_num_threads(1);
    auto pg = pt::dist::init_process_group();
    rank = pg->rank();
    const int W = pg->size();
    const int steps = std::stoi(get(opt, "--steps", "6"));
    const int ngroups = std::stoi(get(opt, "--groups", "1"));
    const bool adam = get(opt, "--optimizer", "sgd") == "adam";
    const double lr = adam ? 1e-2 : 0.05;

    torch::manual_seed(11 + rank);  // DDP replaces these with rank 0's
    auto a = net();
    auto b = net();
    pt::DistributedDataParallel ddp_a(a, pg);
    pt::DistributedDataParallel ddp_b(b, pg);
    {
      torch::NoGradGuard g;
      auto src = a->parameters();
      auto dst = b->parameters();
      for (size_t i = 0; i < src.size(); ++i) {
        dst[i].copy_(src[i]);
      }
    }
    auto factory = [&](std::vector<torch::optim::OptimizerParamGroup> groups)
        -> std::unique_ptr<torch::optim::Optimizer> {
      if (adam) {
        return std::make_unique<torch::optim::Adam>(std::move(groups),
                                                    torch::optim::AdamOptions(lr));
      }
      return std::make_unique<torch::optim::SGD>(std::move(groups),
                                                 torch::optim::SGDOptions(lr).momentum(0.9));
    };
    // Two groups under Adam keep one lr (the group options above are SGD's).
    pt::ZeroRedundancyOptimizer zero(groups_of(a, ngroups, adam ? 0 : lr), factory, pg);
    auto plain = factory(groups_of(b, ngroups, adam ? 0 : lr));

    if (opt.count("--load")) {
      auto saved = pt::load_safetensors(get(opt, "--load", ""));
      pt::load_module_state(*a, pt::with_prefix(saved, "model.", true));
      pt::load_module_state(*b, pt::with_prefix(saved, "model.", true));
      zero.load_state(pt::with_prefix(saved, "optim.", true));
      pt::load_optimizer_state(*plain, pt::with_prefix(saved, "optim.", true));
    }

    for (int s = 0; s < steps; ++s) {
      torch::manual_seed(1000 + s * W + rank);
      torch::Tensor x = torch::randn({8, 20});
      torch::Tensor y = torch::randint(0, 5, {8});
      zero.zero_grad();
      plain->zero_grad();
      torch::nn::functional::cross_entropy(ddp_a.forward(x), y).backward();
      torch::nn::functional::cross_entropy(ddp_b.forward(x), y).backward();
      zero.step();
      plain->step();
      auto pb = b->named_parameters();
      for (const auto& p : a->named_parameters()) {
        double d = (p.value() - pb[p.key()]).abs().max().item<double>();
        if (!(d <= 1e-6)) {
          throw Mismatch(p.key() + " differs by " + std::to_string(d) + " after step " +
                         std::to_string(s));
        }
      }
    }

    const int64_t mine = zero.state_bytes();
    int64_t unsharded = 0, largest = 0;
    for (const auto& item : pt::optimizer_state(*plain)) {
      unsharded += static_cast<int64_t>(item.second.nbytes());
    }
    for (const auto& p : a->parameters()) {
      largest = std::max<int64_t>(largest, p.numel() * p.element_size() * (adam ? 2 : 1));
    }
    torch::Tensor total = torch::full({1}, mine, torch::kLong);
    pg->allreduce(total)->wait();
    if (total.item<int64_t>() != unsharded) {
      throw Mismatch("shards hold " + std::to_string(total.item<int64_t>()) +
                     " bytes in all, the unsharded optimizer " + std::to_string(unsharded));
    }
    if (mine > unsharded / W + largest + 64) {
      throw Mismatch("this rank holds " + std::to_string(mine) + " of " +
                     std::to_string(unsharded) + " bytes");
    }
    auto whole = zero.consolidate_state(0);
    if (rank == 0) {
      auto want = pt::optimizer_state(*plain);
      if (whole.size() != want.size()) {
        throw Mismatch("consolidated state has " + std::to_string(whole.size()) + " tensors, " +
                       "the unsharded optimizer " + std::to_string(want.size()));
      }
      for (const auto& [key, value] : want) {
        if (!whole.count(key) || !torch::equal(whole[key], value)) {
          throw Mismatch("consolidated state differs at " + key);
        }
      }
      if (opt.count("--save")) {
        auto out = pt::with_prefix(pt::module_state(*a), "model.");
        for (auto& [key, value] : pt::with_prefix(whole, "optim.")) {
          out[key] = value;
        }
        pt::save_safetensors(out, get(opt, "--save", ""));
      }
    } else if (!whole.empty()) {
      throw Mismatch("consolidate_state(0) returned a state on rank " + std::to_string(rank));
    }
    std::cout << "rank " << rank << ": ok state_bytes=" << mine << " unsharded=" << unsharded
              << std::endl;
    return 0;
  } catch (const Mismatch& e) {
    std::cout << "MISMATCH on rank " << rank << ": " << e.what() << std::endl;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
  }
  return 1;
}

}  // namespace zero_worker
}  // namespace paratrain_test_programs
