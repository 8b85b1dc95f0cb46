// paratrain's fused Adam against PyTorch's own fused CPU Adam (torch.optim.Adam(fused=True),
// PyTorch 2.4 and later): the same parameters, the same 100 gradients, the parameters after.
// Run by the Python of the Hugging Face tests (PyPI's PyTorch, scripts/venv.sh).

#include "test_util.h"

#include "paratrain/io/safetensors.h"
#include "paratrain/optim/fused.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace paratrain {
namespace testing {
namespace {

double max_relative_difference(const std::vector<torch::Tensor>& a,
                               const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(b[i].abs().max().item<double>(), 1e-30);
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

TEST(FusedOptimizerPyTorch, AdamMatchesPyTorchsFusedAdam) {
  const std::string missing = hf_python_missing();
  if (!missing.empty()) {
    GTEST_SKIP() << missing;
  }
  if (run_process({hf_python(), "-c",
                   "import torch, sys; sys.exit(0 if hasattr(torch, '_fused_adam_') and "
                   "tuple(map(int, torch.__version__.split('.')[:2])) >= (2, 4) else 1)"},
                  {}, 120)
          .exit_code != 0) {
    GTEST_SKIP() << hf_python() << "'s PyTorch has no fused CPU Adam (2.4 and later have it)";
  }
  const std::string dir = make_temp_dir("fused-pytorch");
  const int steps = 100;
  torch::manual_seed(7);
  std::map<std::string, torch::Tensor> inputs;
  std::vector<torch::Tensor> initial;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{61, 32}, {32}, {96, 32}, {1001}}) {
    initial.push_back(torch::randn(shape) * 0.05);
    inputs["p." + std::to_string(initial.size() - 1)] = initial.back();
  }
  for (int s = 0; s < steps; ++s) {
    for (size_t i = 0; i < initial.size(); ++i) {
      inputs["g." + std::to_string(s) + "." + std::to_string(i)] =
          torch::randn(initial[i].sizes()) * (1e-2 / (1 + s));
    }
  }
  save_safetensors(inputs, dir + "/inputs.safetensors");
  struct Case {
    const char* name;
    std::vector<std::string> flags;
  };
  for (const Case& c : std::vector<Case>{{"adam", {}},
                                         {"adam, L2 0.01", {"--weight-decay", "0.01"}},
                                         {"adamw 0.1", {"--weight-decay", "0.1", "--decoupled"}},
                                         {"adam, amsgrad", {"--amsgrad"}}}) {
    std::vector<std::string> argv{
        hf_python(), std::string(PARATRAIN_TEST_DATA_DIR) + "/../optim/fused_adam_reference.py",
        "--inputs",  dir + "/inputs.safetensors",
        "--out",     dir + "/out.safetensors",
        "--steps",   std::to_string(steps),
        "--lr",      "1e-3"};
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    const auto r = run_process(argv, {}, 120);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto theirs_map = load_safetensors(dir + "/out.safetensors");
    const bool decoupled =
        std::find(c.flags.begin(), c.flags.end(), "--decoupled") != c.flags.end();
    const double wd =
        c.flags.size() >= 2 && c.flags[0] == "--weight-decay" ? std::stod(c.flags[1]) : 0.0;
    const bool amsgrad = std::find(c.flags.begin(), c.flags.end(), "--amsgrad") != c.flags.end();
    std::vector<torch::Tensor> ours, stock, theirs;
    for (size_t i = 0; i < initial.size(); ++i) {
      ours.push_back(initial[i].clone().requires_grad_());
      stock.push_back(initial[i].clone().requires_grad_());
      theirs.push_back(theirs_map.at("p." + std::to_string(i)));
    }
    std::unique_ptr<torch::optim::Optimizer> fused, reference;
    if (decoupled) {
      const auto o = torch::optim::AdamWOptions(1e-3).weight_decay(wd).amsgrad(amsgrad);
      fused = std::make_unique<optim::FusedAdamW>(ours, o);
      reference = std::make_unique<torch::optim::AdamW>(stock, o);
    } else {
      const auto o = torch::optim::AdamOptions(1e-3).weight_decay(wd).amsgrad(amsgrad);
      fused = std::make_unique<optim::FusedAdam>(ours, o);
      reference = std::make_unique<torch::optim::Adam>(stock, o);
    }
    for (int s = 0; s < steps; ++s) {
      for (size_t i = 0; i < initial.size(); ++i) {
        const auto& g = inputs.at("g." + std::to_string(s) + "." + std::to_string(i));
        ours[i].mutable_grad() = g.clone();
        stock[i].mutable_grad() = g.clone();
      }
      fused->step();
      reference->step();
    }
    const double vs_fused = max_relative_difference(ours, theirs);
    const double libtorch_vs_fused = max_relative_difference(stock, theirs);
    std::cout << "[ measured ] " << c.name << ": paratrain's fused Adam vs PyTorch's fused "
              << vs_fused << "; libtorch's Adam vs PyTorch's fused " << libtorch_vs_fused
              << std::endl;
    EXPECT_LE(vs_fused, 1e-6) << c.name;
  }
  remove_tree(dir);
}

}  // namespace
}  // namespace testing
}  // namespace paratrain
