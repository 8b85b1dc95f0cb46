#include "paratrain/parallel/threads.h"

#include <dlfcn.h>

namespace paratrain {

// Why it matters: Debian's libtorch runs GEMMs (e.g. 1x1 convolutions of small batches) on
// OpenBLAS, whose one pool per process spins while idle. Two replica or stage threads calling it
// at once each ran at half speed here, most of the time in the kernel (ResNet-50 micro-batches of
// 8: 2.2 s alone, 3.7 s each side by side; with the pool capped at 1, 2.2-2.3 s side by side).
void set_blas_threads(int threads) {
  // Looked up at run time: libtorch links the BLAS chosen by Debian's alternatives, and only
  // OpenBLAS has this entry point.
  using SetThreads = void (*)(int);
  static const auto set =
      reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set != nullptr && threads > 0) {
    set(threads);
  }
}

}  // namespace paratrain
