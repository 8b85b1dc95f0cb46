// The model zoo: torchvision's ResNets (parameter counts, weights exported by Debian's
// python3-torchvision giving the same logits), the custom classifier head (with_head), and
// weight import errors.

#include "test_util.h"

#include "paratrain/io/safetensors.h"
#include "paratrain/io/torch_load.h"
#include "paratrain/models/registry.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

namespace paratrain {
namespace testing {
namespace {

int64_t count(const torch::nn::Sequential& m) {
  int64_t n = 0;
  for (const auto& p : m->parameters()) {
    n += p.numel();
  }
  return n;
}

TEST(Zoo, ResNetParameterCountsEqualTorchvision) {  // ctest: slow 3
  // sum(p.numel() for p in torchvision.models.resnetNN().parameters()), torchvision 0.14.
  const std::map<int64_t, int64_t> torchvision{
      {18, 11689512}, {34, 21797672}, {50, 25557032}, {101, 44549160}, {152, 60192808}};
  for (const auto& kv : torchvision) {
    EXPECT_EQ(count(models::resnet(kv.first)), kv.second) << "resnet" << kv.first;
    // The CIFAR stem swaps the 7x7 stem conv for a 3x3 one.
    EXPECT_EQ(count(models::make("resnet" + std::to_string(kv.first) + "_cifar", 1000)),
              kv.second - 64 * 3 * 49 + 64 * 3 * 9)
        << "resnet" << kv.first << "_cifar";
  }
  EXPECT_NE(error_of([] { models::resnet(20); }).find("no ResNet of depth 20"), std::string::npos);
}

void check_torchvision_logits(int depth) {
  if (!python_has("torchvision")) {
    GTEST_SKIP() << test_python() << " has no torchvision to write the reference weights";
  }
  SCOPED_TRACE("resnet" + std::to_string(depth));
  const std::string prefix = "/tmp/" + unique_token("tv-resnet" + std::to_string(depth));
  auto r = run_process(
      {test_python(), std::string(PARATRAIN_TEST_DATA_DIR) + "/make_torchvision_reference.py",
       std::to_string(depth), prefix},
      {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto model = models::make("resnet" + std::to_string(depth), 1000);
  load_module_state(*model, load_weights(prefix + "_state.pt"));  // strict
  model->eval();
  auto ref = load_torch_state_dict(prefix + "_ref.pt");
  torch::NoGradGuard no_grad;
  auto logits = model->forward(ref.at("input"));
  ASSERT_EQ(logits.sizes(), ref.at("logits").sizes());
  // Within 1e-5 of the largest logit. Two fp32 runs of the same weights differ by the order in
  // which their convolution kernels sum: PyTorch itself, oneDNN against ATen's own kernels
  // (torch.backends.mkldnn.enabled), differs by up to 3.8e-6 on resnet18 (largest logit 4.4) and
  // 1.2e-4 on resnet50 (largest logit 130), 0.9e-6 of the largest logit, in 1.13 and 2.6 alike,
  // with ONEDNN_MAX_CPU_ISA=AVX2 or not; fp64 lies 1e-4 from either on resnet50. A single tensor
  // left at its initial value moves the logits by 1.8e-4 of the largest (resnet50's least
  // influential, layer4.2.bn1.running_mean; 8e-3 on resnet18) or more.
  const double largest = ref.at("logits").abs().max().item<double>();
  EXPECT_LE((logits - ref.at("logits")).abs().max().item<double>(), 1e-5 * largest)
      << "largest logit " << largest;
  // model.state_dict() itself: libtorch 1.13 cannot unpickle its OrderedDict; a clear error.
  EXPECT_NE(error_of([&] {
              load_weights(prefix + "_ordered.pt");
            }).find("save a plain dict instead, torch.save(dict(model.state_dict()), path)"),
            std::string::npos);
  // Weights of another depth: the missing and mis-shaped tensors are named.
  auto other = models::make(depth == 18 ? "resnet34" : "resnet18", 1000);
  const std::string e =
      error_of([&] { load_module_state(*other, load_weights(prefix + "_state.pt")); });
  EXPECT_NE(e.find("weights do not match the model"), std::string::npos) << e;
  for (const char* suffix : {"_state.pt", "_ordered.pt", "_ref.pt"}) {
    std::remove((prefix + suffix).c_str());
  }
}

TEST(Zoo, TorchvisionWeightsGiveTheSameLogits) {
  check_torchvision_logits(18);
  check_torchvision_logits(50);
}

TEST(Zoo, CustomHeadAndFrozenBackbone) {
  auto backbone = models::make("resnet18_cifar", 1000);
  auto model = models::with_head(backbone, 10);
  auto names = model->named_parameters();
  EXPECT_EQ(names["fc.0.weight"].sizes(), (std::vector<int64_t>{512, 512}));
  EXPECT_EQ(names["fc.1.weight"].sizes(), (std::vector<int64_t>{512}));
  EXPECT_EQ(names["fc.4.weight"].sizes(), (std::vector<int64_t>{256, 512}));
  EXPECT_EQ(names["fc.8.weight"].sizes(), (std::vector<int64_t>{10, 256}));
  EXPECT_TRUE(names["layer4.1.conv2.weight"].is_same(
      backbone->named_parameters()["layer4.1.conv2.weight"]));
  models::freeze_backbone(model);
  for (const auto& p : model->named_parameters()) {
    EXPECT_EQ(p.value().requires_grad(), p.key().rfind("fc.", 0) == 0) << p.key();
  }
  model->train();
  auto out = model->forward(torch::randn({4, 3, 32, 32}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{4, 10}));
  out.sum().backward();
  EXPECT_FALSE(names["conv1.weight"].grad().defined());
  EXPECT_TRUE(names["fc.8.weight"].grad().defined());
  EXPECT_NE(error_of([&] {
              models::with_head(backbone, 0);
            }).find("a classifier head needs at least one class, got 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              models::with_head(models::make("cnn"), 10);
            }).find("the backbone's last layer must be its classifier 'fc'"),
            std::string::npos);
  EXPECT_EQ(models::input_shape("resnet50"), (std::vector<int64_t>{3, 224, 224}));
  EXPECT_EQ(models::input_shape("resnet18_cifar"), (std::vector<int64_t>{3, 32, 32}));
  EXPECT_EQ(models::input_shape("cnn"), (std::vector<int64_t>{1, 28, 28}));
}

TEST(Zoo, NotAWeightsFile) {
  const std::string path = "/tmp/" + unique_token("not-weights");
  { std::ofstream(path) << "PK\x03\x04 but not a zip"; }
  EXPECT_NE(error_of([&] { load_weights(path); }).find("cannot read " + path), std::string::npos);
  { std::ofstream(path) << "hello"; }
  EXPECT_NE(error_of([&] { load_weights(path); }).find("is not a valid safetensors file"),
            std::string::npos);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
