// The fused CPU optimizers (optim/fused.h): libtorch's Adam, AdamW and SGD within 1e-6 relative
// after 100 steps on a GPT, the same bits from every instruction set, state that moves between
// them and libtorch's, libtorch's step for what the pass does not take, and the half copies of
// master weights.

#include "optim/fused_kernels.h"

#include "paratrain/amp/mixed_precision.h"
#include "paratrain/io/checkpoint.h"
#include "paratrain/models/gpt.h"
#include "paratrain/optim/fused.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace paratrain {
namespace {

using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>, bool)>;

// The largest, over the parameters, of max|fused - libtorch| / max|libtorch|.
double max_relative_difference(const std::vector<torch::Tensor>& a,
                               const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = b[i].abs().max().item<double>();
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / std::max(scale, 1e-30));
  }
  return worst;
}

// 100 steps of a small GPT: libtorch's optimizer on the model, the fused one on a copy of its
// parameters that gets the same gradients each step (so that the comparison measures the
// updates, not how training amplifies a difference in the last bit).
double gpt_steps_difference(const MakeOptimizer& make, int steps = 100) {
  torch::manual_seed(0);
  auto model = models::gpt(models::GptOptions().layers(2).width(32).heads(4).vocab(61).context(16));
  std::vector<torch::Tensor> params = model->parameters();
  std::vector<torch::Tensor> copies;
  for (const auto& p : params) {
    copies.push_back(p.detach().clone().requires_grad_());
  }
  auto reference = make(params, false);
  auto fused = make(copies, true);
  for (int step = 0; step < steps; ++step) {
    const auto tokens = torch::randint(61, {4, 17});
    const auto logits = model->forward(tokens.slice(1, 0, 16));
    reference->zero_grad();
    torch::nn::functional::cross_entropy(logits.reshape({-1, 61}),
                                         tokens.slice(1, 1, 17).reshape(-1))
        .backward();
    for (size_t i = 0; i < params.size(); ++i) {
      copies[i].mutable_grad() = params[i].grad().clone();
    }
    reference->step();
    fused->step();
    EXPECT_TRUE(dynamic_cast<optim::FusedOptimizer&>(*fused).last_step_fused());
  }
  return max_relative_difference(copies, params);
}

template <typename Fused, typename Stock, typename Options>
MakeOptimizer maker(Options options) {
  return [options](std::vector<torch::Tensor> p,
                   bool fused) -> std::unique_ptr<torch::optim::Optimizer> {
    if (fused) {
      return std::make_unique<Fused>(std::move(p), options);
    }
    return std::make_unique<Stock>(std::move(p), options);
  };
}

TEST(FusedOptimizer, MatchesLibtorchAfter100StepsOnAGpt) {
  using torch::optim::AdamOptions;
  using torch::optim::AdamWOptions;
  using torch::optim::SGDOptions;
  const auto betas = std::make_tuple(0.9, 0.95);
  struct Case {
    const char* name;
    MakeOptimizer make;
  };
  const std::vector<Case> cases{
      {"adam", maker<optim::FusedAdam, torch::optim::Adam>(AdamOptions(1e-3))},
      {"adam, L2 0.01, betas (0.9, 0.95)", maker<optim::FusedAdam, torch::optim::Adam>(
                                               AdamOptions(3e-3).weight_decay(0.01).betas(betas))},
      {"adam, amsgrad",
       maker<optim::FusedAdam, torch::optim::Adam>(AdamOptions(1e-3).amsgrad(true))},
      {"adamw, 0.1", maker<optim::FusedAdamW, torch::optim::AdamW>(
                         AdamWOptions(1e-3).weight_decay(0.1).eps(1e-6))},
      {"sgd, momentum 0.9, L2 1e-4", maker<optim::FusedSGD, torch::optim::SGD>(
                                         SGDOptions(0.05).momentum(0.9).weight_decay(1e-4))},
      {"sgd, nesterov",
       maker<optim::FusedSGD, torch::optim::SGD>(SGDOptions(0.05).momentum(0.9).nesterov(true))},
      {"sgd, dampening 0.5",
       maker<optim::FusedSGD, torch::optim::SGD>(SGDOptions(0.05).momentum(0.8).dampening(0.5))},
      {"sgd, no momentum", maker<optim::FusedSGD, torch::optim::SGD>(SGDOptions(0.1))},
  };
  for (const auto& c : cases) {
    const double diff = gpt_steps_difference(c.make);
    EXPECT_LE(diff, 1e-6) << c.name;
    std::cout << "[ measured ] " << c.name << " (" << optim::fused_isa()
              << "): max relative difference after 100 steps " << diff << std::endl;
  }
}

// Every build computes the same operations in the same order: their bits agree, for the updated
// values and for the half copies, on lengths that leave tails of every size.
TEST(FusedOptimizer, EveryInstructionSetGivesTheSameBits) {
  std::vector<const optim::detail::Kernels*> builds;
  for (const char* isa : {"scalar", "avx2", "avx512"}) {
    try {
      builds.push_back(&optim::detail::kernels_for(isa));
    } catch (const c10::Error&) {
      std::cout << "[ skipped  ] " << isa << ": this CPU cannot run it" << std::endl;
    }
  }
  ASSERT_GE(builds.size(), 1u);
  torch::manual_seed(1);
  for (int64_t n : {1, 7, 8, 15, 16, 17, 33, 1000}) {
    const auto p0 = torch::randn({n}), g = torch::randn({n}) * 1e-2;
    const auto m0 = torch::randn({n}) * 1e-3, v0 = torch::rand({n}) * 1e-5;
    std::vector<std::vector<torch::Tensor>> outs;
    for (const auto* k : builds) {
      for (bool amsgrad : {false, true}) {
        auto p = p0.clone(), m = m0.clone(), v = v0.clone(), vmax = v0.clone() * 0.5;
        auto bf = torch::empty({n}, torch::kBFloat16), half = torch::empty({n}, torch::kHalf);
        optim::detail::AdamArgs a;
        a.param = p.data_ptr<float>();
        a.grad = g.data_ptr<float>();
        a.exp_avg = m.data_ptr<float>();
        a.exp_avg_sq = v.data_ptr<float>();
        a.max_exp_avg_sq = amsgrad ? vmax.data_ptr<float>() : nullptr;
        a.copy = static_cast<uint16_t*>((amsgrad ? half : bf).data_ptr());
        a.copy_kind = amsgrad ? optim::detail::CopyKind::kHalf : optim::detail::CopyKind::kBFloat16;
        a.beta1 = 0.9f, a.one_minus_beta1 = 0.1f, a.beta2 = 0.999f, a.one_minus_beta2 = 0.001f;
        a.bias_correction2_sqrt = 0.0447f, a.eps = 1e-8f, a.neg_step_size = -0.0105f;
        a.weight_decay = amsgrad ? 0.01f : 0.0f;
        k->adam(a, 0, n);
        optim::detail::SgdArgs s;
        auto q = p0.clone(), buf = m0.clone();
        s.param = q.data_ptr<float>();
        s.grad = g.data_ptr<float>();
        s.momentum_buffer = buf.data_ptr<float>();
        s.nesterov = amsgrad, s.momentum = 0.9f, s.one_minus_dampening = 0.75f;
        s.weight_decay = 1e-4f, s.neg_lr = -0.05f;
        k->sgd(s, 0, n);
        EXPECT_TRUE(
            torch::equal(amsgrad ? half : bf, p.to(amsgrad ? torch::kHalf : torch::kBFloat16)))
            << k->isa << " n " << n;
        outs.push_back({p, m, v, vmax, amsgrad ? half : bf, q, buf});
      }
    }
    for (size_t b = 2; b < outs.size(); ++b) {
      for (size_t t = 0; t < outs[b].size(); ++t) {
        EXPECT_TRUE(torch::equal(outs[b][t], outs[b % 2][t]))
            << builds[b / 2]->isa << " and " << builds[0]->isa << " differ in tensor " << t
            << " at length " << n;
      }
    }
  }
}

// The state objects are libtorch's: a fused optimizer's state loads into libtorch's and back,
// and both go on as one.
TEST(FusedOptimizer, StateMovesToLibtorchsOptimizerAndBack) {
  torch::manual_seed(2);
  auto w = torch::randn({37, 5}).requires_grad_();
  auto w2 = w.detach().clone().requires_grad_();
  optim::FusedAdamW fused({w}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (int i = 0; i < 3; ++i) {
    w.mutable_grad() = torch::randn({37, 5});
    fused.step();
  }
  torch::optim::AdamW stock({w2}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  {
    torch::NoGradGuard no_grad;
    w2.copy_(w);
  }
  load_optimizer_state(stock, optimizer_state(fused));
  optim::FusedAdamW again({w.detach().clone().requires_grad_()},
                          torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  load_optimizer_state(again, optimizer_state(stock));
  for (int i = 0; i < 3; ++i) {
    const auto g = torch::randn({37, 5});
    w.mutable_grad() = g.clone();
    w2.mutable_grad() = g.clone();
    fused.step();
    stock.step();
  }
  EXPECT_LE(max_relative_difference({w}, {w2}), 1e-6);
  const auto saved = optimizer_state(again);
  EXPECT_EQ(saved.at("0.0.step").item<int64_t>(), 3);  // the step count came through
}

// A parameter the pass does not take (a strided view) makes the step libtorch's, exactly.
TEST(FusedOptimizer, NonContiguousParametersTakeLibtorchsStep) {
  torch::manual_seed(3);
  auto base = torch::randn({6, 4});
  auto p = base.t().detach().requires_grad_();  // not contiguous
  auto q = p.detach().clone().requires_grad_();
  ASSERT_FALSE(p.is_contiguous());
  optim::FusedAdam fused({p}, torch::optim::AdamOptions(1e-2));
  torch::optim::Adam stock({q}, torch::optim::AdamOptions(1e-2));
  for (int i = 0; i < 4; ++i) {
    const auto g = torch::randn({4, 6});
    p.mutable_grad() = g.clone();
    q.mutable_grad() = g.clone();
    fused.step();
    stock.step();
  }
  EXPECT_FALSE(fused.last_step_fused());
  EXPECT_TRUE(torch::equal(p, q));
  // A parameter listed twice: libtorch steps it twice in turn, which the pass cannot do.
  auto r = torch::randn({5}).requires_grad_();
  auto s = r.detach().clone().requires_grad_();
  optim::FusedSGD twice({r, r}, torch::optim::SGDOptions(0.1));
  torch::optim::SGD stock_twice({s, s}, torch::optim::SGDOptions(0.1));
  r.mutable_grad() = torch::ones({5});
  s.mutable_grad() = torch::ones({5});
  twice.step();
  stock_twice.step();
  EXPECT_FALSE(twice.last_step_fused());
  EXPECT_TRUE(torch::equal(r, s));
}

// Master weights: each step writes the bf16 or fp16 model parameter in the same pass, rounded
// as Tensor::copy_ rounds; MixedPrecision at O2 asks for it.
TEST(FusedOptimizer, MasterWeightsWriteTheirHalfCopies) {
  torch::manual_seed(4);
  auto master = torch::randn({1001}).requires_grad_();
  auto bf = torch::zeros({1001}, torch::kBFloat16), half = torch::zeros({1001}, torch::kHalf);
  auto other = torch::randn({3}).requires_grad_();
  optim::FusedSGD sgd({master}, torch::optim::SGDOptions(0.1).momentum(0.9));
  sgd.write_copy(master, bf);
  EXPECT_TRUE(sgd.writes_copy(master));
  master.mutable_grad() = torch::randn({1001});
  const auto version = master._version();
  sgd.step();
  EXPECT_TRUE(torch::equal(bf, master.detach().to(torch::kBFloat16)));
  // Written in place as libtorch's in-place ops write: autograd sees the new version.
  EXPECT_GT(master._version(), version);
  optim::FusedAdam adam({master}, torch::optim::AdamOptions(1e-2));
  adam.write_copy(master, half);
  adam.step();
  EXPECT_TRUE(torch::equal(half, master.detach().to(torch::kHalf)));
  // What cannot be a copy, or a parameter this optimizer does not step, is refused.
  EXPECT_THROW(adam.write_copy(master, torch::zeros({1001})), c10::Error);
  EXPECT_THROW(adam.write_copy(master, torch::zeros({1000}, torch::kBFloat16)), c10::Error);
  EXPECT_THROW(adam.write_copy(other, torch::zeros({3}, torch::kBFloat16)), c10::Error);
}

// MixedPrecision at O2 with a fused optimizer trains as with libtorch's.
TEST(FusedOptimizer, MixedPrecisionO2WritesTheModelInThePass) {
  std::vector<std::vector<torch::Tensor>> finals;
  for (bool fused : {false, true}) {
    torch::manual_seed(5);
    torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                                torch::nn::Linear(32, 4));
    amp::MixedPrecision mp(model, torch::kCPU,
                           amp::AmpOptions().opt_level(amp::OptLevel::kO2).dtype(torch::kBFloat16));
    auto params = mp.optimizer_parameters();
    {
      // An optimizer over some of the masters: the others are MixedPrecision's to copy, as
      // with libtorch's optimizers (fine-tuning the head alone, say).
      std::vector<torch::Tensor> head(params.end() - 2, params.end());
      optim::FusedAdam partial(head, torch::optim::AdamOptions(1e-2));
      partial.zero_grad();
      model->forward(torch::randn({8, 16}).to(torch::kBFloat16))
          .to(torch::kFloat)
          .pow(2)
          .mean()
          .backward();
      EXPECT_NO_THROW(mp.step(partial));
      mp.sync_masters();
      torch::manual_seed(5);
    }
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (fused) {
      opt = std::make_unique<optim::FusedAdam>(params, torch::optim::AdamOptions(1e-2));
    } else {
      opt = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
    }
    for (int step = 0; step < 10; ++step) {
      const auto x = torch::randn({8, 16}).to(torch::kBFloat16);
      opt->zero_grad();
      model->forward(x).to(torch::kFloat).pow(2).mean().backward();
      ASSERT_TRUE(mp.step(*opt));
    }
    if (fused) {
      EXPECT_TRUE(dynamic_cast<optim::FusedAdam&>(*opt).last_step_fused());
      EXPECT_TRUE(dynamic_cast<optim::FusedAdam&>(*opt).writes_copy(mp.masters()[0]));
    }
    std::vector<torch::Tensor> out;
    for (const auto& p : model->parameters()) {
      out.push_back(p.detach().to(torch::kFloat));
    }
    finals.push_back(out);
  }
  EXPECT_LE(max_relative_difference(finals[1], finals[0]), 1e-2);  // bf16 rounding of 1e-7s
}

}  // namespace
}  // namespace paratrain
