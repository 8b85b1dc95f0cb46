// A one-layer classifier (Linear(784, 10) on flattened images), as PyTorch's DataParallel
// tutorial, wrapped in DataParallel and trained on Fashion-MNIST: one process, the batch scattered
// over every CUDA device, or over two CPU replicas (two threads) on a machine without GPUs.
//
//   dp_fashion_mnist [epochs] [steps_per_epoch]

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>

namespace pt = paratrain;

int main(int argc, char** argv) {
  paratrain::cpu::keep_freed_memory();  // reuse freed tensors' memory (docs/allocator.md)
  const int epochs = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t max_steps = argc > 2 ? static_cast<size_t>(std::atoll(argv[2])) : SIZE_MAX;
  const int64_t batch_size = 128;  // the whole batch: DataParallel splits it over the devices
  try {
    // 1. The devices: all GPUs, as nn.DataParallel's default, else two CPU replicas.
    std::vector<torch::Device> devices;
    for (size_t i = 0; i < static_cast<size_t>(torch::cuda::device_count()); ++i) {
      devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
    }
    if (devices.empty()) {
      devices = {torch::kCPU, torch::kCPU};
    }

    // 2. The model on the first device, wrapped once: replicas persist between steps.
    torch::manual_seed(0);
    auto net = pt::models::make("linear");
    net->to(devices[0]);
    pt::DataParallel model(net, devices);
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

    pt::data::FashionMNIST train(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTrain);
    pt::data::FashionMNIST test(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTest);
    // One process sees the whole dataset: a sampler of one replica is a plain shuffle.
    pt::data::DistributedSampler sampler(*train.size(), /*num_replicas=*/1, /*rank=*/0);

    for (int epoch = 0; epoch < epochs; ++epoch) {
      sampler.set_epoch(epoch);
      net->train();
      pt::data::TensorLoader loader(
          train.images(), train.targets(), sampler.indices(),
          pt::data::LoaderOptions(batch_size).workers(1).pin_memory(devices[0].is_cuda()));
      size_t steps = 0;
      double loss_sum = 0;
      while (steps < max_steps) {
        auto batch = loader.next();
        if (!batch) {
          break;
        }
        optimizer.zero_grad();
        // 3. Scatter, parallel forward on the replicas, gather on devices[0].
        auto output = model(batch->data.to(devices[0], /*non_blocking=*/true));
        auto loss = torch::nn::functional::cross_entropy(output, batch->target.to(devices[0]));
        loss.backward();  // each replica's gradients, summed into net's parameters
        optimizer.step();
        loss_sum += loss.item<double>();
        ++steps;
      }
      torch::NoGradGuard no_grad;
      net->eval();
      auto predicted = model(test.images().to(devices[0])).argmax(1);
      double accuracy =
          predicted.eq(test.targets().to(devices[0])).to(torch::kDouble).mean().item<double>();
      std::cout << "epoch " << epoch + 1 << ": " << devices.size() << " replicas, mean loss "
                << loss_sum / std::max<size_t>(1, steps) << ", test accuracy " << accuracy
                << std::endl;
    }
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
