#include "paratrain/models/registry.h"

#include "paratrain/models/gpt.h"
#include "paratrain/parallel/sync_batchnorm.h"
#include "paratrain/util/cpu_kernels.h"

#include <torch/torch.h>

#include <algorithm>

namespace paratrain {
namespace models {

std::vector<std::string> names() {
  std::vector<std::string> out{"linear", "mlp", "cnn"};
  for (const char* depth : {"18", "34", "50", "101", "152"}) {
    out.push_back(std::string("resnet") + depth);
    out.push_back(std::string("resnet") + depth + "_cifar");
  }
  for (auto& preset : gpt_presets()) {
    out.push_back(std::move(preset));
  }
  return out;
}

namespace {

namespace nn = torch::nn;

nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return nn::Conv2d(
      nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}

// A block's normalization slot: BatchNorm2d, or, when the slot already holds a SyncBatchNorm
// (reset() inside clone() of a converted model), a SyncBatchNorm like it, so that clone() can copy
// the converted layers into their own kind.
nn::AnyModule norm2d(nn::Module& block,
                     const std::string& name,
                     const nn::AnyModule& current,
                     int64_t channels) {
  if (!current.is_empty()) {
    if (const auto* sync = current.ptr()->as<SyncBatchNorm>()) {
      SyncBatchNormOptions options = sync->options;
      options.num_features(channels);
      return nn::AnyModule(block.register_module(name, SyncBatchNorm(options)));
    }
  }
  return nn::AnyModule(block.register_module(name, nn::BatchNorm2d(channels)));
}

// torchvision's BasicBlock: conv-bn-relu-conv-bn, plus the input (downsampled when the shape
// changes), then relu. Cloneable, so DataParallel and pipelines can replicate it. The norms are
// AnyModule slots (NormSlots), so convert_sync_batchnorm can swap in SyncBatchNorm.
struct BasicBlockImpl : nn::Cloneable<BasicBlockImpl>, NormSlots {
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride) : in_(in), out_(out), stride_(stride) {
    reset();
  }
  void reset() override {
    conv1 = register_module("conv1", conv(in_, out_, 3, stride_));
    bn1 = norm2d(*this, "bn1", bn1, out_);
    conv2 = register_module("conv2", conv(out_, out_, 3, 1));
    bn2 = norm2d(*this, "bn2", bn2, out_);
    downsample = nullptr;
    if (stride_ != 1 || in_ != out_) {
      downsample = register_module(
          "downsample", nn::Sequential(conv(in_, out_, 1, stride_), nn::BatchNorm2d(out_)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor identity = downsample ? downsample->forward(x) : x;
    x = torch::relu(bn1.forward(conv1(x)));
    x = bn2.forward(conv2(x));
    return torch::relu(x + identity);
  }
  std::vector<std::pair<std::string, nn::AnyModule*>> norm_slots() override {
    return {{"bn1", &bn1}, {"bn2", &bn2}};
  }
  int64_t in_, out_, stride_;
  nn::Conv2d conv1{nullptr}, conv2{nullptr};
  nn::AnyModule bn1, bn2;
  nn::Sequential downsample{nullptr};
};
TORCH_MODULE(BasicBlock);

// torchvision's Bottleneck (v1.5: the stride on the 3x3 conv): 1x1 reduce, 3x3, 1x1 expand (4x),
// plus the input (downsampled when the shape changes), then relu.
struct BottleneckImpl : nn::Cloneable<BottleneckImpl>, NormSlots {
  static constexpr int64_t kExpansion = 4;
  BottleneckImpl(int64_t in, int64_t width, int64_t stride)
      : in_(in), width_(width), stride_(stride) {
    reset();
  }
  void reset() override {
    const int64_t out = width_ * kExpansion;
    conv1 = register_module("conv1", conv(in_, width_, 1, 1));
    bn1 = norm2d(*this, "bn1", bn1, width_);
    conv2 = register_module("conv2", conv(width_, width_, 3, stride_));
    bn2 = norm2d(*this, "bn2", bn2, width_);
    conv3 = register_module("conv3", conv(width_, out, 1, 1));
    bn3 = norm2d(*this, "bn3", bn3, out);
    downsample = nullptr;
    if (stride_ != 1 || in_ != out) {
      downsample = register_module(
          "downsample", nn::Sequential(conv(in_, out, 1, stride_), nn::BatchNorm2d(out)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor identity = downsample ? downsample->forward(x) : x;
    x = torch::relu(bn1.forward(conv1(x)));
    x = torch::relu(bn2.forward(conv2(x)));
    x = bn3.forward(conv3(x));
    return torch::relu(x + identity);
  }
  std::vector<std::pair<std::string, nn::AnyModule*>> norm_slots() override {
    return {{"bn1", &bn1}, {"bn2", &bn2}, {"bn3", &bn3}};
  }
  int64_t in_, width_, stride_;
  nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  nn::AnyModule bn1, bn2, bn3;
  nn::Sequential downsample{nullptr};
};
TORCH_MODULE(Bottleneck);

// A Sequential of blocks with a tensor-typed forward (Sequential's own is a template, which
// nested Sequentials cannot call through AnyModule).
struct StageImpl : nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(x); }
  // SequentialImpl's clone would make a plain Sequential, which a parent holding a Stage cannot
  // take back; clone the children into a Stage instead, under their names.
  std::shared_ptr<nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override {
    auto copy = std::make_shared<StageImpl>();
    auto children = named_children();
    size_t i = 0;
    for (auto it = begin(); it != end(); ++it, ++i) {
      copy->push_back(children[i].key(), it->clone(device));
    }
    return copy;
  }
};
TORCH_MODULE(Stage);

}  // namespace

torch::nn::Sequential resnet(int64_t depth, int64_t num_classes, Stem stem) {
  namespace nn = torch::nn;
  TORCH_CHECK(num_classes >= 1, "a model needs at least one class, got ", num_classes);
  std::vector<int> blocks;
  bool bottleneck = depth >= 50;
  switch (depth) {
    case 18:
      blocks = {2, 2, 2, 2};
      break;
    case 34:
    case 50:
      blocks = {3, 4, 6, 3};
      break;
    case 101:
      blocks = {3, 4, 23, 3};
      break;
    case 152:
      blocks = {3, 8, 36, 3};
      break;
    default:
      TORCH_CHECK(false, "no ResNet of depth ", depth, ": choose 18, 34, 50, 101 or 152");
  }
  nn::Sequential net;
  if (stem == Stem::kImageNet) {
    net->push_back("conv1",
                   nn::Conv2d(nn::Conv2dOptions(3, 64, 7).stride(2).padding(3).bias(false)));
  } else {
    net->push_back("conv1", conv(3, 64, 3, 1));
  }
  net->push_back("bn1", nn::BatchNorm2d(64));
  net->push_back("relu", nn::ReLU());
  if (stem == Stem::kImageNet) {
    net->push_back("maxpool", nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1)));
  }
  int64_t in = 64;
  const int64_t widths[] = {64, 128, 256, 512};
  for (int stage = 0; stage < 4; ++stage) {
    Stage layer;
    for (int b = 0; b < blocks[static_cast<size_t>(stage)]; ++b) {
      const int64_t stride = stage > 0 && b == 0 ? 2 : 1;
      if (bottleneck) {
        layer->push_back(std::to_string(b), Bottleneck(in, widths[stage], stride));
        in = widths[stage] * BottleneckImpl::kExpansion;
      } else {
        layer->push_back(std::to_string(b), BasicBlock(in, widths[stage], stride));
        in = widths[stage];
      }
    }
    net->push_back("layer" + std::to_string(stage + 1), layer);
  }
  net->push_back("avgpool", nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions({1, 1})));
  net->push_back("flatten", nn::Flatten());
  net->push_back("fc", nn::Linear(in, num_classes));
  // torchvision's initialisation: He-normal (fan_out) convolutions, BatchNorm at 1 and 0.
  torch::NoGradGuard no_grad;
  for (const auto& m : net->modules(/*include_self=*/false)) {
    if (auto* c = m->as<nn::Conv2d>()) {
      nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    } else if (auto* bn = m->as<nn::BatchNorm2d>()) {
      nn::init::ones_(bn->weight);
      nn::init::zeros_(bn->bias);
    }
  }
  return net;
}

torch::nn::Sequential with_head(const torch::nn::Sequential& backbone,
                                int64_t num_classes,
                                double dropout) {
  namespace nn = torch::nn;
  TORCH_CHECK(num_classes >= 1, "a classifier head needs at least one class, got ", num_classes);
  TORCH_CHECK(dropout >= 0 && dropout < 1, "dropout must be in [0, 1), got ", dropout);
  auto names = backbone->named_children();
  TORCH_CHECK(!names.is_empty() && names[names.size() - 1].key() == "fc",
              "with_head: the backbone's last layer must be its classifier 'fc' (as the zoo's "
              "ResNets), got '",
              names.is_empty() ? std::string("nothing") : names[names.size() - 1].key(), "'");
  auto* fc = names[names.size() - 1].value()->as<nn::Linear>();
  TORCH_CHECK(fc != nullptr, "with_head: the backbone's 'fc' is not a Linear layer");
  const int64_t features = fc->options.in_features();
  Stage head;  // a Sequential with a tensor forward, so a parent Sequential can hold it
  head->push_back("0", nn::Linear(features, 512));
  head->push_back("1", nn::BatchNorm1d(512));
  head->push_back("2", nn::ReLU());
  head->push_back("3", nn::Dropout(dropout));
  head->push_back("4", nn::Linear(512, 256));
  head->push_back("5", nn::BatchNorm1d(256));
  head->push_back("6", nn::ReLU());
  head->push_back("7", nn::Dropout(dropout));
  head->push_back("8", nn::Linear(256, num_classes));
  nn::Sequential out;
  size_t i = 0;
  for (auto it = backbone->begin(); it != backbone->end(); ++it, ++i) {
    if (i + 1 < names.size()) {
      out->push_back(names[i].key(), *it);  // shared: the backbone's own layers
    }
  }
  out->push_back("fc", head);
  return out;
}

void freeze_backbone(const torch::nn::Sequential& model) {
  for (auto& p : model->named_parameters()) {
    if (p.key().rfind("fc.", 0) != 0) {
      p.value().set_requires_grad(false);
    }
  }
}

std::vector<int64_t> input_shape(const std::string& name) {
  const auto presets = gpt_presets();
  if (std::find(presets.begin(), presets.end(), name) != presets.end()) {
    return {gpt_options(name).context()};
  }
  if (name == "linear" || name == "mlp" || name == "cnn") {
    return {1, 28, 28};
  }
  if (name.size() > 6 && name.compare(name.size() - 6, 6, "_cifar") == 0) {
    return {3, 32, 32};
  }
  return {3, 224, 224};
}

torch::nn::Sequential make(const std::string& name, int64_t num_classes) {
  namespace nn = torch::nn;
  cpu::ensure_usable_kernels();  // Note [CPU kernels that do not run]
  const auto presets = gpt_presets();
  if (std::find(presets.begin(), presets.end(), name) != presets.end()) {
    return gpt(gpt_options(name));  // a language model: its outputs are the vocabulary
  }
  TORCH_CHECK(num_classes >= 1, "a model needs at least one class, got ", num_classes);
  if (name == "linear") {
    nn::Sequential net;
    net->push_back("flatten", nn::Flatten());
    net->push_back("fc", nn::Linear(784, num_classes));
    return net;
  }
  if (name == "mlp") {
    nn::Sequential net;
    net->push_back("flatten", nn::Flatten());
    net->push_back("linear0", nn::Linear(784, 512));
    net->push_back("bn0", nn::BatchNorm1d(512));
    net->push_back("relu0", nn::ReLU());
    net->push_back("dropout0", nn::Dropout(0.5));  // p = 0.5, nn.Dropout()'s default
    net->push_back("linear1", nn::Linear(512, 256));
    net->push_back("bn1", nn::BatchNorm1d(256));
    net->push_back("relu1", nn::ReLU());
    net->push_back("dropout1", nn::Dropout(0.5));
    net->push_back("linear2", nn::Linear(256, num_classes));
    return net;
  }
  if (name == "cnn") {
    // A small CNN for 1x28x28 images: two conv-bn-relu-pool blocks, then a two-layer head.
    nn::Sequential net;
    net->push_back("conv0", nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1).bias(false)));
    net->push_back("bn0", nn::BatchNorm2d(32));
    net->push_back("relu0", nn::ReLU());
    net->push_back("pool0", nn::MaxPool2d(2));
    net->push_back("conv1", nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1).bias(false)));
    net->push_back("bn1", nn::BatchNorm2d(64));
    net->push_back("relu1", nn::ReLU());
    net->push_back("pool1", nn::MaxPool2d(2));
    net->push_back("flatten", nn::Flatten());
    net->push_back("fc0", nn::Linear(64 * 7 * 7, 128));
    net->push_back("relu2", nn::ReLU());
    net->push_back("dropout", nn::Dropout(0.25));
    net->push_back("fc1", nn::Linear(128, num_classes));
    return net;
  }
  for (const int64_t depth : {18, 34, 50, 101, 152}) {
    const std::string base = "resnet" + std::to_string(depth);
    if (name == base || name == base + "_cifar") {
      return resnet(depth, num_classes, name == base ? Stem::kImageNet : Stem::kCifar);
    }
  }
  std::string known;
  for (const auto& n : names()) {
    known += (known.empty() ? "" : ", ") + n;
  }
  TORCH_CHECK(false, "unknown model '", name, "': choose one of ", known);
}

}  // namespace models
}  // namespace paratrain
