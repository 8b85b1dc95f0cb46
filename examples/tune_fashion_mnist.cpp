// PyTorch's "Hyperparameter tuning with Ray Tune" tutorial in C++, on Fashion-MNIST: the
// tutorial's CNN with l1 and l2 (powers of two), lr loguniform(1e-4, 1e-1) and the batch size
// sampled; ASHA (grace_period 1, reduction_factor 2) stops the weak trials early; 2 trials run
// at once with 1 thread each; each trial keeps a checkpoint per epoch (and continues from it
// when it is retried); the best trial is picked by its last validation loss.
//
//   tune_fashion_mnist [num_samples=8] [max_num_epochs=3] [train_images=20000]
//
// The study is kept in tune_fashion_mnist.db: run it again and it continues where it stopped.

#include <paratrain/paratrain.h>
#include <paratrain/tune/tuner.h>

#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <mutex>

namespace pt = paratrain;
namespace nn = torch::nn;

// The tutorial's Net, for 1x28x28 inputs.
nn::Sequential make_net(int64_t l1, int64_t l2) {
  return nn::Sequential(nn::Conv2d(1, 6, 5), nn::ReLU(), nn::MaxPool2d(2), nn::Conv2d(6, 16, 5),
                        nn::ReLU(), nn::MaxPool2d(2), nn::Flatten(), nn::Linear(16 * 4 * 4, l1),
                        nn::ReLU(), nn::Linear(l1, l2), nn::ReLU(), nn::Linear(l2, 10));
}

struct Data {
  torch::Tensor train_x, train_y, val_x, val_y;
};

std::mutex seed_mutex;  // torch::manual_seed is global: one trial builds its model at a time

// The tutorial's train_cifar: SGD (momentum 0.9), a checkpoint every epoch, and a report of the
// validation loss and accuracy.
void train_fashion_mnist(pt::tune::TrialContext& trial, const Data& d, int max_epochs) {
  const auto& config = trial.config();
  const int64_t batch = std::get<int64_t>(config.at("batch_size"));
  nn::Sequential net;
  {
    std::lock_guard<std::mutex> lock(seed_mutex);
    torch::manual_seed(trial.number());
    net = make_net(std::get<int64_t>(config.at("l1")), std::get<int64_t>(config.at("l2")));
  }
  torch::optim::SGD optimizer(
      net->parameters(), torch::optim::SGDOptions(std::get<double>(config.at("lr"))).momentum(0.9));
  const std::string ck = trial.checkpoint_dir();
  int start = 0;
  if (trial.resumed() && std::ifstream(ck + "/epoch") >> start) {
    torch::load(net, ck + "/net.pt");
    torch::load(optimizer, ck + "/optimizer.pt");
  }
  const int64_t n = d.train_x.size(0);
  for (int epoch = start; epoch < max_epochs; ++epoch) {
    net->train();
    const torch::Tensor perm = torch::randperm(n, torch::kLong);
    for (int64_t i = 0; i + batch <= n; i += batch) {
      const torch::Tensor idx = perm.slice(0, i, i + batch);
      optimizer.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(d.train_x.index_select(0, idx)),
                                           d.train_y.index_select(0, idx))
          .backward();
      optimizer.step();
    }
    net->eval();
    torch::NoGradGuard no_grad;
    const torch::Tensor logits = net->forward(d.val_x);
    const double loss = torch::nn::functional::cross_entropy(logits, d.val_y).item<double>();
    const double accuracy = logits.argmax(1).eq(d.val_y).to(torch::kDouble).mean().item<double>();
    torch::save(net, ck + "/net.pt");
    torch::save(optimizer, ck + "/optimizer.pt");
    std::ofstream(ck + "/epoch") << epoch + 1;
    trial.report({{"training_iteration", epoch + 1}, {"loss", loss}, {"accuracy", accuracy}});
  }
}

int main(int argc, char** argv) {
  paratrain::cpu::keep_freed_memory();  // reuse freed tensors' memory (docs/allocator.md)
  const int num_samples = argc > 1 ? std::atoi(argv[1]) : 8;
  const int max_epochs = argc > 2 ? std::atoi(argv[2]) : 3;
  const int64_t images = argc > 3 ? std::atoll(argv[3]) : 20000;
  try {
    torch::set_num_threads(1);  // 1 CPU per trial, as the tutorial's resources_per_trial
    pt::set_blas_threads(1);    // and OpenBLAS's own pool, which set_num_threads does not reach
    pt::data::FashionMNIST train(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTrain);
    pt::data::FashionMNIST test(pt::data::kFashionMnistDir, pt::data::FashionMNIST::Split::kTest);
    // images() are [N, 1, 28, 28] floats, normalized as the tutorial's transforms.Normalize
    auto images_of = [](const pt::data::FashionMNIST& ds, int64_t count) {
      return ds.images().slice(0, 0, count);
    };
    const Data d{images_of(train, images), train.targets().slice(0, 0, images).to(torch::kLong),
                 images_of(test, 5000), test.targets().slice(0, 0, 5000).to(torch::kLong)};

    pt::tune::SearchSpace space;  // the tutorial's config
    space.add("l1=choice(4, 8, 16, 32, 64, 128, 256)");
    space.add("l2=choice(4, 8, 16, 32, 64, 128, 256)");
    space.add("lr=loguniform(1e-4, 1e-1)");
    space.add("batch_size=choice(16, 32, 64)");
    const auto result =
        pt::tune::tune(space,
                       pt::tune::TunerOptions()
                           .storage("tune_fashion_mnist.db")
                           .study("fashion_mnist_cnn")
                           .metric("loss")
                           .mode("min")
                           .scope("last")
                           .num_samples(num_samples)
                           .max_concurrent(2)
                           .trial_dir("tune_fashion_mnist")
                           .scheduler(pt::tune::SchedulerOptions()
                                          .kind("asha")
                                          .max_t(max_epochs)
                                          .grace_period(1)
                                          .reduction_factor(2)),
                       [&](pt::tune::TrialContext& t) { train_fashion_mnist(t, d, max_epochs); });
    if (!result.best) {
      std::cerr << "no trial reported a loss" << std::endl;
      return 1;
    }
    std::cout << "Best trial config: " << pt::tune::to_string(result.best->config) << "\n"
              << "Best trial final validation loss: " << result.best->value << std::endl;
    return 0;
  } catch (const c10::Error& e) {
    std::cerr << "tune_fashion_mnist: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
}
