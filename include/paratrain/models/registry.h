#pragma once

// Models by name, for `paratrain train --model` and the benchmarks. Every model is a
// torch::nn::Sequential with named children, so parameter names are stable ("linear0.weight").
//
//   linear  Flatten -> fc: Linear(784, 10)                       as PyTorch's DataParallel tutorial
//   mlp     Flatten -> linear0: Linear(784, 512) -> bn0 -> relu0 -> dropout0
//                   -> linear1: Linear(512, 256) -> bn1 -> relu1 -> dropout1
//                   -> linear2: Linear(256, 10)                 with_head's head, on 784 inputs
//   cnn     conv0(1->32, 3x3) -> bn0 -> relu -> pool -> conv1(32->64) -> bn1 -> relu -> pool
//           -> flatten -> fc0: Linear(3136, 128) -> relu -> dropout(0.25) -> fc1   for 1x28x28
//   resnet18, resnet34, resnet50, resnet101, resnet152
//           torchvision's ResNets (BasicBlock [2,2,2,2] / [3,4,6,3]; Bottleneck v1.5 [3,4,6,3],
//           [3,4,23,3], [3,8,36,3]) with the ImageNet stem (7x7 stride-2 conv, 3x3 max-pool):
//           children named as torchvision's (conv1, bn1, relu, maxpool, layer1..layer4 with
//           blocks "0", "1", ..., avgpool, fc; plus a parameterless "flatten"), so torchvision
//           weights map one to one; torchvision's initialisation
//   resnetNN_cifar  the same with a CIFAR stem (3x3 stride-1 conv, no max-pool) for 3x32x32;
//           examples/model_parallel_resnet50.cpp splits resnet50_cifar after layer2, as the
//           ModelParallelResNet50 of PyTorch's model-parallel tutorial splits ResNet-50
//   gpt2, gpt2-medium, gpt2-large, gpt2-xl
//           GPT-2 language models (models/gpt.h: gpt(gpt_options(name))), 124M to 1.5B
//           parameters, context 1024: int64 token ids [B, T] in, logits [B, T, 50257] out

#include <torch/nn/modules/container/sequential.h>

#include <string>
#include <vector>

namespace paratrain {
namespace models {

/// Builds model `name` for `num_classes` outputs; throws c10::Error listing the known names for an
/// unknown one. The GPT-2 presets ignore `num_classes`: their outputs are the vocabulary's 50257
/// logits. `paratrain train` offers the Fashion-MNIST models (linear, mlp).
torch::nn::Sequential make(const std::string& name, int64_t num_classes = 10);

std::vector<std::string> names();

enum class Stem { kImageNet, kCifar };

/// torchvision's ResNet of `depth` (18, 34, 50, 101 or 152); throws c10::Error for another depth.
torch::nn::Sequential resnet(int64_t depth,
                             int64_t num_classes = 1000,
                             Stem stem = Stem::kImageNet);

/// A custom classifier head: `backbone` (whose last child is its Linear "fc") with fc replaced
/// by Linear(in, 512) -> BatchNorm1d -> ReLU -> Dropout -> Linear(512, 256) -> BatchNorm1d ->
/// ReLU -> Dropout -> Linear(256, num_classes), named fc.0..fc.8. The backbone's layers are
/// shared, not copied. Throws c10::Error for num_classes < 1 or a backbone without a Linear fc.
torch::nn::Sequential with_head(const torch::nn::Sequential& backbone,
                                int64_t num_classes,
                                double dropout = 0.5);

/// Freezes every parameter outside "fc" (requires_grad false): fine-tuning the head only.
void freeze_backbone(const torch::nn::Sequential& model);

/// The input a model of the registry expects, as {channels, height, width}; for a GPT-2 preset,
/// {context}: the longest sequence of token ids it takes (1024).
std::vector<int64_t> input_shape(const std::string& name);

}  // namespace models
}  // namespace paratrain
