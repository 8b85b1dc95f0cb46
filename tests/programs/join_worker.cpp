// A Join test worker: uneven inputs. Rank r has --batches + r * --extra batches of --rows rows
// (rank 0 the fewest), trains under DDP (optionally with SyncBatchNorm and ZeroRedundancyOptimizer)
// inside a paratrain::Join, and joins when its data runs out. A reference in the same process
// replays every step on one replica: at step i the ranks that still have data are active, and the
// loss is the sum of their per-rank mean losses divided by the whole world size (joined ranks add
// zero gradients; DDP divides by the world size, as PyTorch's Join). With SyncBatchNorm the
// reference normalizes over the active ranks' rows together. After the last step every rank's
// parameters (and buffers) must equal the reference's within 1e-5.
// --model mlp|syncbn  --zero  --batches N --extra K --rows B
// Prints "rank R: ok shadows=S" (exit 0) or "MISMATCH ..." / "error: ..." (exit 1).

#include "worker_options.h"

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>
#include <map>

// In the test programs' one binary (main.cpp): run() is this program's main.
namespace paratrain_test_programs {
namespace join_worker {

namespace pt = paratrain;

namespace {

torch::nn::Sequential net(bool bn) {
  torch::nn::Sequential s;
  s->push_back("fc0", torch::nn::Linear(10, 16));
  if (bn) {
    s->push_back("bn0", torch::nn::BatchNorm1d(16));
  }
  s->push_back("relu0", torch::nn::ReLU());
  s->push_back("fc1", torch::nn::Linear(16, 3));
  return s;
}

}  // namespace

int run(int argc, char** argv) {
  const Options opt = parse_options(argc, argv);
  int rank = -1;
  try {
    torch::set_num_threads(1);
    auto pg = pt::dist::init_process_group();
    rank = pg->rank();
    const int W = pg->size();
    const bool syncbn = get(opt, "--model", "mlp") == "syncbn";
    const int rows = std::stoi(get(opt, "--rows", "4"));
    std::vector<int> batches;
    for (int r = 0; r < W; ++r) {
      batches.push_back(std::stoi(get(opt, "--batches", "2")) +
                        r * std::stoi(get(opt, "--extra", "2")));
    }
    const int steps = *std::max_element(batches.begin(), batches.end());

    torch::manual_seed(5);
    auto model = net(syncbn);
    auto reference = net(syncbn);
    {
      torch::NoGradGuard g;
      auto src = model->parameters();
      auto dst = reference->parameters();
      for (size_t i = 0; i < src.size(); ++i) {
        dst[i].copy_(src[i]);
      }
    }
    if (syncbn) {
      pt::convert_sync_batchnorm(model.ptr(), pg);
    }
    pt::DistributedDataParallel ddp(model, pg);
    auto sgd = [](std::vector<torch::optim::OptimizerParamGroup> groups) {
      return std::make_unique<torch::optim::SGD>(std::move(groups),
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
    };
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (opt.count("--zero")) {
      optimizer = std::make_unique<pt::ZeroRedundancyOptimizer>(model->parameters(), sgd, pg);
    } else {
      optimizer = sgd({torch::optim::OptimizerParamGroup(model->parameters())});
    }
    auto ref_opt = sgd({torch::optim::OptimizerParamGroup(reference->parameters())});

    auto data = [&](int step, int r) {
      torch::manual_seed(1000 + step * 10 + r);
      return std::make_pair(torch::randn({rows, 10}), torch::randint(0, 3, {rows}));
    };
    pt::Join join(pg, [&] {
      optimizer->zero_grad();
      auto out = ddp.forward(torch::zeros({0, 10}));
      (out.sum() * 0).backward();
      optimizer->step();
    });
    for (int s = 0; s < batches[static_cast<size_t>(rank)]; ++s) {
      join.notify();
      auto [x, y] = data(s, rank);
      optimizer->zero_grad();
      torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
      optimizer->step();
    }
    const int64_t shadows = join.join();

    for (int s = 0; s < steps; ++s) {
      std::vector<torch::Tensor> xs, ys;
      for (int r = 0; r < W; ++r) {
        if (s < batches[static_cast<size_t>(r)]) {
          auto [x, y] = data(s, r);
          xs.push_back(x);
          ys.push_back(y);
        }
      }
      ref_opt->zero_grad();
      torch::Tensor out = reference->forward(torch::cat(xs));
      torch::Tensor loss = torch::zeros({});
      for (size_t k = 0; k < xs.size(); ++k) {
        loss = loss + torch::nn::functional::cross_entropy(
                          out.narrow(0, static_cast<int64_t>(k) * rows, rows), ys[k]);
      }
      (loss / W).backward();
      ref_opt->step();
    }

    auto ref_state = pt::module_state(*reference);
    for (const auto& [key, value] : pt::module_state(*model)) {
      double d =
          (value.to(torch::kDouble) - ref_state[key].to(torch::kDouble)).abs().max().item<double>();
      if (!(d <= 1e-5)) {
        std::cout << "MISMATCH on rank " << rank << ": " << key << " differs by " << d << std::endl;
        return 1;
      }
    }
    if (shadows != steps - batches[static_cast<size_t>(rank)]) {
      std::cout << "MISMATCH on rank " << rank << ": " << shadows << " shadow steps, expected "
                << steps - batches[static_cast<size_t>(rank)] << std::endl;
      return 1;
    }
    std::cout << "rank " << rank << ": ok shadows=" << shadows << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cout << "error: " << e.what() << std::endl;
  }
  return 1;
}

}  // namespace join_worker
}  // namespace paratrain_test_programs
