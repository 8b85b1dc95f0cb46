// main_worker of PyTorch's ImageNet example on a folder of images: an ImageFolder (train/, val/),
// the DistributedSampler, a DataLoader with worker threads and pinned memory, batches copied to the
// GPU one ahead on a side stream, and DDP. The C++ counterpart of PyTorch's ImageNet example:
//
//   paratrain data make-imagefolder --from fashion-mnist --out /tmp/fm --size 64
//   paratrain launch --nproc-per-node 2 -- imagefolder_ddp /tmp/fm [epochs] [model] [image_size]
//
// model is one of the zoo's (default resnet18); image_size defaults to 64.

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>

namespace pt = paratrain;
namespace T = pt::data::transforms;

int main(int argc, char** argv) {
  paratrain::cpu::keep_freed_memory();  // reuse freed tensors' memory (docs/allocator.md)
  if (argc < 2) {
    std::cerr << "usage: imagefolder_ddp DIR [epochs] [model] [image_size]" << std::endl;
    return 2;
  }
  const std::string dir = argv[1];
  const int epochs = argc > 2 ? std::atoi(argv[2]) : 2;
  const std::string model_name = argc > 3 ? argv[3] : "resnet18";
  const int64_t size = argc > 4 ? std::atoll(argv[4]) : 64;
  const int64_t batch_size = 32;  // per rank
  try {
    auto pg = pt::dist::init_process_group();
    const torch::Device device = pt::dist::local_device();

    // torchvision's ImageNet recipe: random crops and flips to train, a center crop to validate.
    const T::Normalize normalize({0.485, 0.456, 0.406}, {0.229, 0.224, 0.225});
    auto train = std::make_shared<pt::data::ImageFolder>(
        dir + "/train", T::compose(T::RandomResizedCrop(size), T::RandomHorizontalFlip(),
                                   T::ToTensor(), normalize));
    auto val = std::make_shared<pt::data::ImageFolder>(
        dir + "/val",
        T::compose(T::Resize(size * 8 / 7), T::CenterCrop(size), T::ToTensor(), normalize));

    // The 1-channel models of the zoo (linear, mlp, cnn) see the images' mean over RGB.
    const int64_t channels = pt::models::input_shape(model_name)[0];
    auto fit = [&](const torch::Tensor& x) { return pt::data::adapt_images(x, size, channels); };
    torch::manual_seed(0);
    auto model = pt::models::make(model_name, static_cast<int64_t>(train->classes().size()));
    model->to(device);
    pt::DistributedDataParallel ddp(model, pg);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

    // DataLoader(train, sampler=DistributedSampler(train), num_workers=2, pin_memory=True).
    auto sampler =
        std::make_shared<pt::data::DistributedSampler>(train->size(), pg->size(), pg->rank());
    pt::data::DataLoader loader(
        train, pt::data::LoaderOptions(batch_size).workers(2).pin_memory(device.is_cuda()),
        sampler);
    pt::data::DataLoader val_loader(
        val, pt::data::LoaderOptions(100).workers(2).pin_memory(device.is_cuda()),
        std::make_shared<pt::data::DistributedSampler>(val->size(), pg->size(), pg->rank(),
                                                       /*shuffle=*/false));
    for (int epoch = 0; epoch < epochs; ++epoch) {
      loader.set_epoch(epoch);  // sampler.set_epoch(epoch)
      model->train();
      pt::data::DevicePrefetcher batches(loader, device, fit);  // non_blocking, one ahead
      double loss_sum = 0;
      int64_t steps = 0;
      while (auto batch = batches.next()) {
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(ddp.forward(batch->data), batch->target);
        loss.backward();
        optimizer.step();
        loss_sum += loss.item<double>();
        ++steps;
      }
      // Validation: each rank its share (DistributedSampler pads to equal shares), summed.
      torch::NoGradGuard no_grad;
      model->eval();
      val_loader.set_epoch(0);
      auto totals = torch::zeros({2}, torch::kDouble);
      pt::data::DevicePrefetcher vbatches(val_loader, device, fit);
      while (auto batch = vbatches.next()) {
        auto correct = model->forward(batch->data).argmax(1).eq(batch->target).sum();
        totals[0] += correct.cpu().item<double>();
        totals[1] += static_cast<double>(batch->target.size(0));
      }
      totals = totals.to(device);
      pg->allreduce(totals)->wait();
      totals = totals.cpu();
      if (pg->rank() == 0) {
        std::cout << "epoch " << epoch + 1 << ": mean loss "
                  << loss_sum / std::max<int64_t>(1, steps) << ", val accuracy "
                  << (totals[0] / totals[1]).item<double>() << ", waited "
                  << loader.stats().wait_seconds << " s for data" << std::endl;
      }
      loader.reset_stats();
    }
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
