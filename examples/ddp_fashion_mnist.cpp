// DDP training of the zoo's MLP (Linear-BN-ReLU-Dropout twice, then Linear) on Fashion-MNIST,
// written directly against the library: the C++ counterpart of main_worker, the per-process
// function of PyTorch's ImageNet DDP example. Run it under the launcher,
//
//   paratrain launch --nproc-per-node 2 -- ddp_fashion_mnist [epochs] [steps_per_epoch]
//
// or under mpirun, or alone (a world of one).

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>

namespace pt = paratrain;

int main(int argc, char** argv) {
  paratrain::cpu::keep_freed_memory();  // reuse freed tensors' memory (docs/allocator.md)
  const int epochs = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t max_steps = argc > 2 ? static_cast<size_t>(std::atoll(argv[2])) : SIZE_MAX;
  // Per rank: PyTorch's ImageNet example likewise divides the global batch by the GPUs.
  const int64_t batch_size = 64;
  try {
    // 1. Join the job: rank, world size and master come from the environment.
    auto pg = pt::dist::init_process_group();
    // 2. This rank's device: cuda:LOCAL_RANK on a GPU machine, else the CPU.
    const torch::Device device = pt::dist::local_device();

    // 3. The same initial weights everywhere (DDP also broadcasts rank 0's).
    torch::manual_seed(0);
    auto model = pt::models::make("mlp");
    model->to(device);
    pt::DistributedDataParallel ddp(model, pg);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

    // 4. Each rank reads its own shard, reshuffled every epoch.
    pt::data::FashionMNIST train(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTrain);
    pt::data::FashionMNIST test(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTest);
    pt::data::DistributedSampler sampler(*train.size(), pg->size(), pg->rank());

    for (int epoch = 0; epoch < epochs; ++epoch) {
      sampler.set_epoch(epoch);
      model->train();
      // 5. A loader with a worker thread and, for CUDA, pinned memory.
      pt::data::TensorLoader loader(
          train.images(), train.targets(), sampler.indices(),
          pt::data::LoaderOptions(batch_size).workers(1).pin_memory(device.is_cuda()));
      size_t step = 0;
      double loss_sum = 0;
      while (auto batch = loader.next()) {
        if (step++ >= max_steps) {
          break;
        }
        optimizer.zero_grad();
        auto output = ddp.forward(batch->data.to(device, /*non_blocking=*/true));
        auto loss = torch::nn::functional::cross_entropy(
            output, batch->target.to(device, /*non_blocking=*/true));
        loss.backward();  // gradients are averaged over the ranks here
        optimizer.step();
        loss_sum += loss.item<double>();
      }
      // 6. Rank 0 reports test accuracy (every rank holds the same weights).
      if (pg->rank() == 0) {
        torch::NoGradGuard no_grad;
        model->eval();
        auto predicted = model->forward(test.images().to(device)).argmax(1);
        double accuracy =
            predicted.eq(test.targets().to(device)).to(torch::kDouble).mean().item<double>();
        std::cout << "epoch " << epoch + 1 << ": mean loss " << loss_sum / std::max<size_t>(1, step)
                  << ", test accuracy " << accuracy << std::endl;
      }
      pg->barrier()->wait();
    }
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
