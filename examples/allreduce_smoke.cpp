// The smallest paratrain job: every rank joins, sums its rank + 1 over the group, and checks the
// answer. Run it with `paratrain launch --nproc-per-node 2 -- allreduce_smoke`, under mpirun, or
// alone (a world of one).

#include <paratrain/paratrain.h>

#include <torch/torch.h>

#include <iostream>

int main() {
  namespace dist = paratrain::dist;
  try {
    auto pg = dist::init_process_group();
    at::Tensor t = torch::full({4}, static_cast<float>(pg->rank() + 1));
    pg->allreduce(t)->wait();
    const float expected = pg->size() * (pg->size() + 1) / 2.0f;
    const bool ok = torch::allclose(t, torch::full({4}, expected));
    std::cout << "rank " << pg->rank() << " of " << pg->size() << " (" << pg->backend_name()
              << "): allreduce sum = " << t[0].item<float>() << ", expected " << expected
              << (ok ? " ok" : " WRONG") << std::endl;
    pg->barrier()->wait();
    return ok ? 0 : 1;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
