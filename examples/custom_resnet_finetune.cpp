// A torchvision ResNet fine-tuned on Fashion-MNIST from imported weights (written by PyTorch),
// its fc replaced by a custom classifier head (Linear-BatchNorm-ReLU-Dropout x2, then Linear to
// 10 classes), the backbone optionally frozen.
//
// Make the weights with Debian's python3-torch and python3-torchvision (nothing can be downloaded
// here, so they are torchvision's random initialisation; on a connected machine pass
// weights="IMAGENET1K_V1" to get the pretrained ones):
//
//   /usr/bin/python3 -c "import torch, torchvision; torch.save(
//       dict(torchvision.models.resnet50().state_dict()), 'resnet50.pt')"
//
// then
//
//   custom_resnet_finetune resnet50.pt [depth=50] [steps=100] [freeze=1]
//
// Fashion-MNIST's 1x28x28 images are resized to 32x32 and repeated over 3 channels.

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>

namespace pt = paratrain;

int main(int argc, char** argv) {
  paratrain::cpu::keep_freed_memory();  // reuse freed tensors' memory (docs/allocator.md)
  if (argc < 2) {
    std::cerr << "usage: custom_resnet_finetune WEIGHTS [depth=50] [steps=100] [freeze=1]"
              << std::endl;
    return 2;
  }
  const std::string weights = argv[1];
  const int64_t depth = argc > 2 ? std::atoll(argv[2]) : 50;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 100;
  const bool freeze = argc > 4 ? std::atoi(argv[4]) != 0 : true;
  try {
    // 1. torchvision's ResNet, ImageNet stem and 1000 classes, so the file loads as it is
    //    (strictly: a missing, unexpected or mis-shaped tensor is an error naming it).
    auto backbone = pt::models::resnet(depth, 1000);
    pt::load_module_state(*backbone, pt::load_weights(weights));
    // 2. The custom classifier head instead of fc; the backbone's layers are shared, not copied.
    auto model = pt::models::with_head(backbone, 10);
    if (freeze) {
      pt::models::freeze_backbone(model);  // only the head learns
    }
    std::vector<torch::Tensor> trainable;
    for (const auto& p : model->parameters()) {
      if (p.requires_grad()) {
        trainable.push_back(p);
      }
    }
    torch::optim::SGD optimizer(trainable, torch::optim::SGDOptions(0.01).momentum(0.9));

    pt::data::FashionMNIST train(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTrain);
    pt::data::FashionMNIST test(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTest);
    pt::data::DistributedSampler sampler(*train.size(), 1, 0);
    pt::data::TensorLoader loader(train.images(), train.targets(), sampler.indices(),
                                  pt::data::LoaderOptions(64).workers(1));
    model->train();
    double loss_sum = 0;
    int done = 0;
    for (; done < steps; ++done) {
      auto batch = loader.next();
      if (!batch) {
        break;
      }
      optimizer.zero_grad();
      auto x = pt::data::adapt_images(batch->data, 32, 3);
      auto loss = torch::nn::functional::cross_entropy(model->forward(x), batch->target);
      loss.backward();
      optimizer.step();
      loss_sum += loss.item<double>();
    }
    model->eval();
    torch::NoGradGuard no_grad;
    auto x = pt::data::adapt_images(test.images().slice(0, 0, 2000), 32, 3);
    auto accuracy = model->forward(x)
                        .argmax(1)
                        .eq(test.targets().slice(0, 0, 2000))
                        .to(torch::kDouble)
                        .mean()
                        .item<double>();
    std::cout << "resnet" << depth << " + custom head" << (freeze ? " (backbone frozen)" : "")
              << ": " << done << " steps, mean loss " << loss_sum / std::max(1, done)
              << ", test accuracy " << accuracy << std::endl;
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
