// A user's DDP program, built against the installed paratrain: the umbrella header first, as a
// user would write it. Each rank trains a small model for a few steps on its own data; the
// parameters must end up equal on every rank (rank 0 prints them for the check).
#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>

int main() {
  try {
    auto pg = paratrain::dist::init_process_group(
        paratrain::dist::InitOptions().uses_cuda(false));  // CPU tensors on any machine
    torch::manual_seed(0);
    auto model =
        torch::nn::Sequential(torch::nn::Linear(8, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
    paratrain::DistributedDataParallel ddp(model, pg);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::manual_seed(100 + pg->rank());  // different data on every rank
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      auto x = torch::randn({16, 8});
      auto y = torch::randint(0, 2, {16});
      torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
      opt.step();
    }
    // Every rank's parameters equal rank 0's: gather the sums and compare.
    torch::Tensor sum = torch::zeros({1}, torch::kDouble);
    for (const auto& p : model->parameters()) {
      sum += p.detach().to(torch::kDouble).sum();
    }
    // One tensor per rank (a vector of n copies of one tensor would alias them all, and every
    // comparison below would compare a tensor with itself).
    std::vector<torch::Tensor> all;
    for (int r = 0; r < pg->size(); ++r) {
      all.push_back(torch::full_like(sum, -1.0));
    }
    pg->allgather(all, sum)->wait();
    for (const auto& t : all) {
      if (!t.equal(all[0])) {
        std::cerr << "consumer: ranks disagree after DDP steps" << std::endl;
        return 1;
      }
    }
    std::cout << "consumer rank " << pg->rank() << " of " << pg->size() << " ("
              << pg->backend_name() << "): parameters agree, checksum " << all[0].item<double>()
              << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "consumer: " << e.what() << std::endl;
    return 1;
  }
}
