#pragma once

// Models by name, for `paratrain train --model` and the benchmarks. Every model is a
// torch::nn::Sequential with named children, so parameter names are stable ("linear0.weight").
//
//   linear  Flatten -> fc: Linear(784, 10)                       the notes' Net
//   mlp     Flatten -> linear0: Linear(784, 512) -> bn0 -> relu0 -> dropout0
//                   -> linear1: Linear(512, 256) -> bn1 -> relu1 -> dropout1
//                   -> linear2: Linear(256, 10)                 the notes' classifier head
//   cnn     conv0(1->32, 3x3) -> bn0 -> relu -> pool -> conv1(32->64) -> bn1 -> relu -> pool
//           -> flatten -> fc0: Linear(3136, 128) -> relu -> dropout(0.25) -> fc1   for 1x28x28
//   resnet18_cifar  ResNet-18 (BasicBlock [2, 2, 2, 2]) with a CIFAR stem (3x3 conv, stride 1, no
//                   max-pool) for 3x32x32 inputs; children named as torchvision's (conv1, bn1,
//                   layer1..layer4 with blocks "0", "1", fc), so weights map one to one
//   resnet50_cifar  ResNet-50 (Bottleneck [3, 4, 6, 3], torchvision v1.5) with the same stem and
//                   naming; the notes' ModelParallelResNet50 splits it after layer2

#include <torch/nn/modules/container/sequential.h>

#include <string>
#include <vector>

namespace paratrain {
namespace models {

/// Builds model `name` for `num_classes` outputs; throws c10::Error listing the known names for an
/// unknown one. `paratrain train` offers the Fashion-MNIST models (linear, mlp).
torch::nn::Sequential make(const std::string& name, int64_t num_classes = 10);

std::vector<std::string> names();

}  // namespace models
}  // namespace paratrain
