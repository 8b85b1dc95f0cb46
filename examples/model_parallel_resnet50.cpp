// The ModelParallelResNet50 of PyTorch's model-parallel tutorial: ResNet-50 cut after layer2,
// conv1..layer2 on the first device and layer3..fc on the second; trained first as plain model
// parallelism (one batch at a time, each device idle while the other works), then pipelined with
// micro-batches (the tutorial's PipelineParallelResNet50). Random data, as in the tutorial.
//
//   model_parallel_resnet50 [steps] [batch] [chunks] [gpipe|1f1b]
//
// Devices: cuda:0 and cuda:1 when there are two GPUs, else two CPU stages on their own threads.

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <chrono>
#include <iostream>

namespace pt = paratrain;

int main(int argc, char** argv) {
  paratrain::cpu::keep_freed_memory();  // reuse freed tensors' memory (docs/allocator.md)
  const int steps = argc > 1 ? std::atoi(argv[1]) : 3;
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 64;
  const int64_t chunks = argc > 3 ? std::atoll(argv[3]) : 8;
  const std::string schedule = argc > 4 ? argv[4] : "gpipe";
  try {
    std::vector<torch::Device> devices{torch::kCPU, torch::kCPU};
    if (torch::cuda::device_count() >= 2) {
      devices = {torch::Device("cuda:0"), torch::Device("cuda:1")};
    }
    torch::manual_seed(0);
    // conv1, bn1, relu, layer1, layer2 | layer3, layer4, avgpool, flatten, fc
    auto model = pt::models::make("resnet50_cifar");
    const std::vector<int64_t> balance{5, 5};
    auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
      return torch::nn::functional::cross_entropy(out, y);
    };
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    auto x = torch::randn({batch, 3, 32, 32});
    auto y = torch::randint(0, 10, {batch});

    double plain_seconds = 0;
    for (int64_t m : {int64_t{1}, chunks}) {
      pt::pipeline::Pipeline pipe(model, balance, devices, loss_fn,
                                  pt::pipeline::PipelineOptions().chunks(m).schedule(
                                      pt::pipeline::parse_schedule(schedule)));
      double total = 0;
      double last_loss = 0;
      for (int s = 0; s < steps; ++s) {
        auto t0 = std::chrono::steady_clock::now();
        optimizer.zero_grad();
        last_loss = pipe.step(x, y).item<double>();  // forward + backward of every micro-batch
        optimizer.step();
        total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      const double per_step = total / steps;
      if (m == 1) {
        plain_seconds = per_step;
        std::cout << "model parallel (" << devices[0] << ", " << devices[1] << "): " << per_step
                  << " s/step, loss " << last_loss << std::endl;
      } else {
        std::cout << "pipelined, " << m << " chunks (" << schedule << "): " << per_step
                  << " s/step, loss " << last_loss << ", speedup " << plain_seconds / per_step
                  << "x" << std::endl;
      }
    }
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
