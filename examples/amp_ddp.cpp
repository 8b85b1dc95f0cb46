// Mixed precision with DDP at each of apex amp's opt levels: the zoo's CNN on
// Fashion-MNIST, bf16 on the CPU (fp16 on CUDA), under the launcher:
//
//   paratrain launch --nproc-per-node 2 -- amp_ddp O1 [steps]
//
// O0 fp32; O1 autocast; O2 a bf16 model with fp32 BatchNorm and fp32 master weights; O3 pure
// bf16. Loss scaling is on only for fp16 (bf16 has fp32's range).

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>

namespace pt = paratrain;

int main(int argc, char** argv) {
  paratrain::cpu::keep_freed_memory();  // reuse freed tensors' memory (docs/allocator.md)
  const std::string level = argc > 1 ? argv[1] : "O1";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 200;
  try {
    auto pg = pt::dist::init_process_group();
    const torch::Device device = pt::dist::local_device();
    torch::manual_seed(0);
    auto model = pt::models::make("cnn");
    model->to(device);
    // 1. Mixed precision first (it may cast the model), then DDP over the result.
    pt::amp::MixedPrecision amp(model, device,
                                pt::amp::AmpOptions().opt_level(pt::amp::parse_opt_level(level)));
    pt::DistributedDataParallel ddp(model, pg);
    amp.sync_masters();  // O2: the masters take the weights DDP broadcast from rank 0
    // 2. The optimizer owns what MixedPrecision says: fp32 masters at O2.
    torch::optim::SGD optimizer(amp.optimizer_parameters(),
                                torch::optim::SGDOptions(0.05).momentum(0.9));

    pt::data::FashionMNIST train(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTrain);
    pt::data::FashionMNIST test(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTest);
    pt::data::DistributedSampler sampler(*train.size(), pg->size(), pg->rank());
    pt::data::TensorLoader loader(train.images(), train.targets(), sampler.indices(),
                                  pt::data::LoaderOptions(64).workers(1));
    model->train();
    int done = 0;
    for (; done < steps; ++done) {
      auto batch = loader.next();
      if (!batch) {
        break;
      }
      optimizer.zero_grad();
      torch::Tensor loss;
      {
        auto autocast = amp.autocast();  // O1: ops in bf16 inside this scope
        auto out = ddp.forward(amp.cast_input(batch->data.to(device)));
        loss = torch::nn::functional::cross_entropy(amp.cast_output(out), batch->target.to(device));
      }
      amp.backward(loss);   // scaled for fp16
      amp.step(optimizer);  // O2: half gradients to fp32 masters, step, back to the model
    }
    if (pg->rank() == 0) {
      model->eval();
      torch::NoGradGuard no_grad;
      auto autocast = amp.autocast();
      auto out = amp.cast_output(model->forward(amp.cast_input(test.images().to(device))));
      auto accuracy =
          out.argmax(1).eq(test.targets().to(device)).to(torch::kDouble).mean().item<double>();
      std::cout << level << " (" << (amp.dtype() == torch::kBFloat16 ? "bf16" : "fp16")
                << "): " << done << " steps per rank, test accuracy " << accuracy << std::endl;
    }
    pg->barrier()->wait();
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
