// GradScaler against torch.cuda.amp.GradScaler's documented behaviour (PyTorch 1.13's, which
// cannot run on a CPU: it disables itself without CUDA), and the Autocast guard.

#include "test_util.h"

#include "paratrain/amp/autocast.h"
#include "paratrain/amp/grad_scaler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

namespace paratrain {
namespace amp {
namespace {

using paratrain::testing::error_of;

// One parameter w; the loss w * x gives w.grad = x * scale, so x = inf injects an overflow.
struct Toy {
  torch::Tensor w = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt{{w}, torch::optim::SGDOptions(0.1)};
};

TEST(GradScaler, DefaultsAreTorchs) {
  GradScaler s;
  EXPECT_EQ(s.get_scale(), 65536.0);
  EXPECT_EQ(s.options().growth_factor(), 2.0);
  EXPECT_EQ(s.options().backoff_factor(), 0.5);
  EXPECT_EQ(s.options().growth_interval(), 2000);
  EXPECT_TRUE(s.is_enabled());
}

// Scale sequence over steps with injected infs: backoff and a skipped step on every overflow,
// growth after growth_interval consecutive clean steps, the tracker reset by an overflow.
TEST(GradScaler, ScaleSequenceWithInjectedInfs) {
  Toy t;
  GradScaler s(GradScalerOptions().init_scale(8.0).growth_interval(3));
  const std::vector<bool> overflow{false, false, false, true,  false, false,
                                   true,  false, false, false, false};
  // Expected after each update: 3 clean -> 16; inf -> 8; 2 clean; inf -> 4 (tracker reset);
  // 3 clean -> 8; one more clean.
  const std::vector<double> want{8, 8, 16, 8, 8, 8, 4, 4, 4, 8, 8};
  const std::vector<int64_t> tracker{1, 2, 0, 0, 1, 2, 0, 1, 2, 0, 1};
  for (size_t i = 0; i < overflow.size(); ++i) {
    t.opt.zero_grad();
    const double x = overflow[i] ? std::numeric_limits<double>::infinity() : 1.0;
    auto before = t.w.detach().clone();
    s.scale((t.w * x).sum()).backward();
    const bool stepped = s.step(t.opt);
    s.update();
    EXPECT_EQ(stepped, !overflow[i]) << "step " << i;
    EXPECT_EQ(torch::equal(before, t.w.detach()), overflow[i]) << "step " << i;
    EXPECT_EQ(s.get_scale(), want[i]) << "step " << i;
    EXPECT_EQ(s.growth_tracker(), tracker[i]) << "step " << i;
  }
  // A clean step moved w by lr * x = 0.1 per element: the gradient was unscaled.
  t.opt.zero_grad();
  auto before = t.w.detach().clone();
  s.scale((t.w * 1.0).sum()).backward();
  s.step(t.opt);
  EXPECT_NEAR((before - t.w.detach()).max().item<double>(), 0.1, 1e-7);
}

TEST(GradScaler, UnscaleDividesAndFindsNaN) {
  Toy t;
  GradScaler s(GradScalerOptions().init_scale(4.0));
  s.scale((t.w * torch::tensor({1.0, 3.0})).sum()).backward();
  EXPECT_TRUE(torch::allclose(t.w.grad(), torch::tensor({4.0, 12.0})));
  s.unscale_(t.opt);
  EXPECT_TRUE(torch::allclose(t.w.grad(), torch::tensor({1.0, 3.0})));
  EXPECT_TRUE(s.step(t.opt));
  s.update();
  t.opt.zero_grad();
  s.scale((t.w * torch::tensor({1.0, std::nan("")})).sum()).backward();
  EXPECT_FALSE(s.step(t.opt));
  s.update();
  EXPECT_EQ(s.get_scale(), 2.0);
}

TEST(GradScaler, MisuseIsAnError) {
  Toy t;
  GradScaler s;
  EXPECT_NE(error_of([&] { s.unscale_(t.opt); }).find("before any scale()"), std::string::npos);
  s.scale((t.w * 1.0).sum()).backward();
  EXPECT_NE(error_of([&] { s.update(); }).find("no inf checks were recorded prior to update()"),
            std::string::npos);
  s.unscale_(t.opt);
  EXPECT_NE(error_of([&] { s.unscale_(t.opt); })
                .find("unscale_() has already been called on this optimizer since the last "
                      "update()"),
            std::string::npos);
  s.step(t.opt);
  EXPECT_NE(error_of([&] {
              s.step(t.opt);
            }).find("step() has already been called since the last update()"),
            std::string::npos);
  EXPECT_NE(error_of([&] { s.unscale_(t.opt); }).find("unscale_() is being called after step()"),
            std::string::npos);
  s.update();
  EXPECT_NO_THROW(s.unscale_(t.opt));  // a new iteration
  auto half = torch::ones({2}, torch::TensorOptions(torch::kHalf).requires_grad(true));
  torch::optim::SGD opt({half}, torch::optim::SGDOptions(0.1));
  half.mutable_grad() = torch::ones({2}, torch::kHalf);
  EXPECT_NE(error_of([&] { s.unscale_(opt); }).find("attempting to unscale fp16 gradients"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              GradScaler(GradScalerOptions().growth_factor(1.0));
            }).find("growth_factor must be > 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              GradScaler(GradScalerOptions().backoff_factor(1.5));
            }).find("backoff_factor must be in (0, 1)"),
            std::string::npos);
}

TEST(GradScaler, StateRoundTrip) {
  Toy t;
  GradScaler s(GradScalerOptions().init_scale(32.0).growth_interval(5));
  for (int i = 0; i < 3; ++i) {
    t.opt.zero_grad();
    s.scale((t.w * 1.0).sum()).backward();
    s.step(t.opt);
    s.update();
  }
  auto state = s.state_dict();
  EXPECT_EQ(state.at("scale"), 32.0);
  EXPECT_EQ(state.at("_growth_tracker"), 3.0);
  GradScaler r;
  r.load_state_dict(state);
  EXPECT_EQ(r.get_scale(), 32.0);
  EXPECT_EQ(r.growth_tracker(), 3);
  EXPECT_EQ(r.options().growth_interval(), 5);
  // Through a libtorch archive, as part of a checkpoint.
  torch::serialize::OutputArchive out;
  s.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  std::istringstream read(bytes.str());
  in.load_from(read);
  GradScaler a;
  a.load(in);
  EXPECT_EQ(a.get_scale(), 32.0);
  EXPECT_EQ(a.growth_tracker(), 3);
  // Two more clean steps reach the interval in both.
  for (GradScaler* g : {&s, &a}) {
    for (int i = 0; i < 2; ++i) {
      t.opt.zero_grad();
      g->scale((t.w * 1.0).sum()).backward();
      g->step(t.opt);
      g->update();
    }
    EXPECT_EQ(g->get_scale(), 64.0);
  }
  GradScaler off(GradScalerOptions().enabled(false));
  EXPECT_TRUE(off.state_dict().empty());
  EXPECT_NE(error_of([&] { r.load_state_dict(off.state_dict()); }).find("state is empty"),
            std::string::npos);
}

TEST(GradScaler, DisabledIsTransparent) {
  Toy t;
  GradScaler s(GradScalerOptions().enabled(false));
  auto loss = (t.w * 2.0).sum();
  EXPECT_TRUE(torch::equal(s.scale(loss), loss));
  loss.backward();
  EXPECT_TRUE(s.step(t.opt));
  s.update();
  EXPECT_EQ(s.get_scale(), 1.0);
  EXPECT_TRUE(torch::allclose(t.w.detach(), torch::full({2}, 0.8)));
}

TEST(Autocast, CpuBf16AndRestore) {
  auto a = torch::randn({4, 4});
  auto b = torch::randn({4, 4});
  {
    Autocast outer(torch::kCPU);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
    {
      Autocast off(torch::kCPU, c10::nullopt, /*enabled=*/false);
      EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
    }
    EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(torch::mm(a, b).scalar_type(), torch::kFloat);
  EXPECT_NE(error_of([] {
              Autocast bad(torch::kCPU, torch::kHalf);
            }).find("fp16 autocast is not available on the CPU"),
            std::string::npos);
  EXPECT_EQ(parse_dtype("BF16"), torch::kBFloat16);
  EXPECT_EQ(parse_dtype("fp16"), torch::kHalf);
  EXPECT_NE(error_of([] { parse_dtype("fp8"); }).find("unknown mixed-precision dtype 'fp8'"),
            std::string::npos);
}

}  // namespace
}  // namespace amp
}  // namespace paratrain
