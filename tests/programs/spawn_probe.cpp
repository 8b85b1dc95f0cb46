// A program that starts its own workers with paratrain::dist::spawn, as a C++ user would (spawn
// starts test_programs again, which runs spawn_probe once more: tests/programs/main.cpp).
//   spawn_probe N          N children allreduce their index + 1; the parent reports success
//   spawn_probe N fail     child 1 throws; the parent must report the failure

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>

namespace paratrain_test_programs {
namespace spawn_probe {

int run(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2;
  const bool fail = argc > 2 && std::string(argv[2]) == "fail";
  try {
    paratrain::dist::spawn(n, [&](int local_rank) {
      if (fail && local_rank == 1) {
        throw std::runtime_error("child 1 fails on purpose");
      }
      auto pg = paratrain::dist::init_process_group();
      at::Tensor t = torch::full({3}, static_cast<float>(local_rank + 1));
      pg->allreduce(t)->wait();
      std::cout << "child " << local_rank << " of " << pg->size() << " sum " << t[0].item<float>()
                << std::endl;
    });
  } catch (const c10::Error& e) {
    std::cout << "parent: spawn failed: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
  std::cout << "parent: all " << n << " children done" << std::endl;
  return 0;
}

}  // namespace spawn_probe
}  // namespace paratrain_test_programs
